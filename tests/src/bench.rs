//! Benchmarks run by `stoke-gpu bench`. Every figure is printed beside the same run's ceiling
//! (device-to-device copy bandwidth) and, where there is one, the plain burn-cuda peer.
//! Kernel times come from CUDA events on Stoke's stream; times that include host work (API
//! calls, crossings) are wall-clock around a full synchronization.

use crate::{PlainCuda, StokeCuda, gpu};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Instant;
use stoke_cuda::kernels::rms_norm::{ElemType, RmsNormParams, entry_point, launch};
use stoke_cuda::{DeviceBuffer, DevicePtr, DevicePtrMut, Kernel, LaunchShape, Runtime};

/// An RMSNorm entry point loaded for its element type (chosen at run time).
pub(crate) enum RmsKernel {
    F32(Kernel<RmsNormParams<f32>>),
    Bf16(Kernel<RmsNormParams<half::bf16>>),
}

/// The device buffers of one RMSNorm launch (`residual` / `sum_out`: the residual op's).
pub(crate) struct RmsArgs<'a> {
    pub x: &'a DeviceBuffer,
    pub residual: Option<&'a DeviceBuffer>,
    pub gamma: &'a DeviceBuffer,
    pub out: &'a DeviceBuffer,
    pub sum_out: Option<&'a DeviceBuffer>,
}

impl RmsKernel {
    pub(crate) fn new(
        rt: &Runtime,
        elem: ElemType,
        entry: &'static str,
    ) -> stoke_cuda::Result<Self> {
        Ok(match elem {
            ElemType::F32 => Self::F32(rt.kernel(entry_point::<f32>(entry))?),
            ElemType::Bf16 => Self::Bf16(rt.kernel(entry_point::<half::bf16>(entry))?),
        })
    }

    /// # Safety
    /// The buffers hold `rows x hidden` elements (gamma `hidden`) of the kernel's type and
    /// outlive the kernel.
    pub(crate) unsafe fn launch(
        &self,
        rt: &Runtime,
        shape: LaunchShape,
        a: &RmsArgs<'_>,
        rows: u32,
        hidden: u32,
    ) -> stoke_cuda::Result<()> {
        fn params<T>(a: &RmsArgs<'_>, rows: u32, hidden: u32) -> RmsNormParams<T> {
            RmsNormParams {
                x: a.x.as_ptr(),
                residual: a.residual.map_or(DevicePtr::NULL, |b| b.as_ptr()),
                gamma: a.gamma.as_ptr(),
                out: a.out.as_mut_ptr(),
                sum_out: a.sum_out.map_or(DevicePtrMut::NULL, |b| b.as_mut_ptr()),
                rows,
                hidden,
                eps: 1e-5,
            }
        }
        // SAFETY: the caller's guarantees.
        unsafe {
            match self {
                Self::F32(k) => rt.launch(k, shape, &params(a, rows, hidden)),
                Self::Bf16(k) => rt.launch(k, shape, &params(a, rows, hidden)),
            }
        }
    }
}

/// Bytes of working set beyond which repeated inputs no longer fit the 60 MB L2.
const L2_ESCAPE_BYTES: usize = 256 << 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// A buffer of `bytes` bytes filled with 0x3c: random-looking, finite bit patterns (never time
/// zeros), about 0.0115 as bf16 and f32; the timed kernels' work does not depend on the values.
fn filled(rt: &Arc<Runtime>, bytes: usize) -> DeviceBuffer {
    let b = rt.alloc(bytes).unwrap();
    // SAFETY: `b` holds `bytes` bytes.
    unsafe { rt.fill_bytes(b.ptr(), 0x3c, bytes).unwrap() };
    b
}

/// ptxas resources of the loaded entry points of kernel file `file` (as compiled now).
pub(crate) fn kernel_reports(rt: &Runtime, file: &str) -> Vec<Value> {
    rt.loaded_reports()
        .into_iter()
        .filter(|(f, _)| f == file)
        .map(|(_, r)| json!({"entry": r.entry, "registers": r.registers, "shared_bytes": r.shared_bytes, "spills": r.spill_store_bytes}))
        .collect()
}

/// Median over `reps` of the mean µs per iteration of `body`, timed with events on Stoke's stream.
pub(crate) fn time_events(
    rt: &Runtime,
    reps: usize,
    iters: usize,
    mut body: impl FnMut(usize),
) -> f64 {
    let (start, stop) = (rt.timing_event().unwrap(), rt.timing_event().unwrap());
    for i in 0..iters.min(8) {
        body(i); // warm-up: module load, allocator pools
    }
    let mut samples = Vec::new();
    for _ in 0..reps {
        rt.record(&start).unwrap();
        for i in 0..iters {
            body(i);
        }
        rt.record(&stop).unwrap();
        stop.synchronize().unwrap();
        samples.push(start.elapsed_ms(&stop).unwrap() as f64 * 1e3 / iters as f64);
    }
    median(samples)
}

/// A benchmark call's times: `us`, GPU µs per call with the calls replayed from one CUDA graph
/// (as in a graphed decode step, and as the PyTorch peers are timed); `stream_us`, the same
/// calls launched back to back from the host; `host_us`, the host's µs to queue one call (when
/// it is near the kernel time, stream launches wait on the host).
pub(crate) struct CallTiming {
    pub us: f64,
    pub stream_us: f64,
    pub host_us: f64,
}

/// Times `iters` calls of `body` (see [`CallTiming`]): back to back on the stream, then captured
/// once into a CUDA graph and replayed `reps` times (median). Where the capture fails, `us` is
/// the stream time (and the reason is printed).
pub(crate) fn time_calls(
    rt: &Runtime,
    reps: usize,
    iters: usize,
    mut body: impl FnMut(usize),
) -> CallTiming {
    let stream_us = time_events(rt, reps, iters, &mut body);
    let t0 = Instant::now();
    for i in 0..iters {
        body(i);
    }
    let host_us = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
    rt.synchronize().unwrap();
    let mut panicked = None;
    let graph = rt.capture(|| {
        let calls = std::panic::AssertUnwindSafe(|| (0..iters).for_each(&mut body));
        if let Err(p) = std::panic::catch_unwind(calls) {
            panicked = Some(p);
        }
        Ok(())
    });
    if let Some(p) = panicked {
        std::panic::resume_unwind(p);
    }
    let us = match graph.and_then(|g| {
        g.upload().map_err(|e| stoke_cuda::Error::Driver {
            call: "cuGraphUpload",
            source: e,
        })?;
        Ok(g)
    }) {
        Ok(g) => time_events(rt, reps, 1, |_| g.launch().unwrap()) / iters as f64,
        Err(e) => {
            println!("graph capture failed ({e}); stream time only");
            stream_us
        }
    };
    CallTiming {
        us,
        stream_us,
        host_us,
    }
}

/// Median over `reps` of wall-clock µs per iteration, `sync` called before and after.
fn time_wall(
    reps: usize,
    iters: usize,
    mut sync: impl FnMut(),
    mut body: impl FnMut(usize),
) -> f64 {
    for i in 0..iters.min(8) {
        body(i);
    }
    sync();
    let mut samples = Vec::new();
    for _ in 0..reps {
        sync();
        let t0 = Instant::now();
        for i in 0..iters {
            body(i);
        }
        sync();
        samples.push(t0.elapsed().as_secs_f64() * 1e6 / iters as f64);
    }
    median(samples)
}

/// Device-to-device copy of 1 GiB, bytes read + written per second.
pub fn copy_bandwidth(rt: &Arc<Runtime>) -> f64 {
    let bytes = 1usize << 30;
    let (a, b) = (filled(rt, bytes), rt.alloc(bytes).unwrap());
    // SAFETY: copies within two live buffers of `bytes` bytes.
    let us = time_events(rt, 5, 10, |_| unsafe {
        rt.copy_dtod(b.ptr(), a.ptr(), bytes).unwrap()
    });
    2.0 * bytes as f64 / (us * 1e-6) / 1e9
}

/// The tensor cores' rate for mma.sync.m16n8k16 (bf16 in, f32 accumulation), the W4A16
/// kernels' instruction, timed like the kernels (`time_calls`): TFLOP/s with 8 independent
/// accumulators per warp and 4 CTAs of 4 warps per SM (`c8`), and the ns per mma of one
/// dependent chain with one warp per SM sub-partition (`c1`, the instruction's latency).
pub fn mma_rate(rt: &Arc<Runtime>) -> Value {
    use stoke_cuda::kernels::mma_rate::{
        CHAINS, ENTRY_POINTS, MMA_MACS, MmaRateParams, entry_point,
    };
    let iters = 4096u32;
    let out = rt.alloc(rt.sm_count as usize * 4 * 128 * 4).unwrap();
    let mut v = json!({ "iters": iters });
    for (entry, chains) in ENTRY_POINTS.iter().zip(CHAINS) {
        let kernel = rt.kernel(entry_point(entry)).unwrap();
        let ctas_per_sm = if chains == 1 { 1 } else { 4 };
        let shape = LaunchShape {
            grid: (rt.sm_count * ctas_per_sm, 1, 1),
            block: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let params = MmaRateParams {
            out: out.as_mut_ptr(),
            iters,
            never: f32::NAN,
        };
        // SAFETY: the params mirror the kernel's struct (layout test); `out` holds one f32 per
        // launched thread and outlives the synchronizing timer.
        let t = time_calls(rt, 5, 10, |_| unsafe {
            rt.launch(&kernel, shape, &params).unwrap()
        });
        let warps = u64::from(shape.grid.0) * 4;
        let macs = warps * u64::from(iters) * u64::from(chains) * MMA_MACS;
        let tflops = 2.0 * macs as f64 / (t.us * 1e6);
        let ns_per_round = t.us * 1e3 / f64::from(iters);
        println!(
            "mma.sync m16n8k16 bf16: {entry}: {:.1} us, {tflops:.1} TFLOP/s, {ns_per_round:.2} ns per round per warp",
            t.us
        );
        v[*entry] = json!({ "us": t.us, "ctas_per_sm": ctas_per_sm, "tflops": tflops,
            "ns_per_round": ns_per_round });
    }
    v
}

/// The fastest one launch reads `bytes` once, from buffers rotated through >= 256 MB, timed like
/// the kernels ([`time_calls`]): the memory side of their roofline where they read and write
/// almost nothing. Every configuration of `kernels/read_rate.cu` is timed: the kernels' load (no
/// L1 allocation, L2 evict-first; a chunk per CTA or per warp, 4 or 8 loads in flight per thread,
/// 128 or 256 threads, 1-8 CTAs per SM) and the copy engine into a ring of shared-memory stages
/// ([`BULK_SHAPES`]).
pub(crate) fn same_size_read(rt: &Arc<Runtime>, bytes: usize) -> ReadCeiling {
    use stoke_cuda::kernels::read_rate;
    use stoke_cuda::kernels::read_rate::{
        BULK_ENTRY, BULK_THREADS, LOAD_ENTRIES, MAX_THREADS, ReadRateParams, bulk_smem,
    };
    let bytes = bytes.next_multiple_of(16);
    let sets = (L2_ESCAPE_BYTES / bytes).clamp(1, 64);
    let bufs: Vec<_> = (0..sets).map(|_| filled(rt, bytes)).collect();
    // One u32 per thread of the largest launch below (8 CTAs per SM of MAX_THREADS).
    let out = rt
        .alloc(rt.sm_count as usize * 8 * MAX_THREADS as usize * 4)
        .unwrap();
    let iters = (200_000_000 / bytes).clamp(10, 2000);
    let mut configs = Vec::new();
    let mut time = |entry: &'static str, threads: u32, ctas_per_sm: u32, stage: (u32, u32)| {
        let kernel = rt.kernel(read_rate::entry_point(entry)).unwrap();
        let bulk = entry == BULK_ENTRY;
        let shape = LaunchShape {
            grid: (rt.sm_count * ctas_per_sm, 1, 1),
            block: (threads, 1, 1),
            shared_mem_bytes: if bulk { bulk_smem(stage.0, stage.1) } else { 0 },
        };
        // SAFETY: the params mirror the kernel's struct (layout test); each buffer holds
        // `bytes` bytes, `out` one u32 per launched thread, both outlive the timer; the bulk
        // launch brings its stages' shared memory.
        let t = time_calls(rt, 5, iters, |i| unsafe {
            let params = ReadRateParams {
                src: bufs[i % sets].as_ptr(),
                words: (bytes / 16) as u64,
                out: out.as_mut_ptr(),
                never: 0x9e37_79b9,
                stage_bytes: stage.0,
                stages: stage.1,
                pad: 0,
            };
            rt.launch(&kernel, shape, &params).unwrap()
        });
        let mut c =
            json!({ "entry": entry, "threads": threads, "ctas_per_sm": ctas_per_sm, "us": t.us });
        if bulk {
            c["stage_bytes"] = json!(stage.0);
            c["stages"] = json!(stage.1);
        }
        configs.push(c);
        t.us
    };
    let mut load_us = f64::INFINITY;
    for entry in LOAD_ENTRIES {
        for threads in [MAX_THREADS / 2, MAX_THREADS] {
            for ctas_per_sm in [1u32, 2, 4, 8] {
                load_us = load_us.min(time(entry, threads, ctas_per_sm, (0, 0)));
            }
        }
    }
    let mut bulk_us = f64::INFINITY;
    for &(stage_bytes, stages, ctas_per_sm) in BULK_SHAPES {
        let smem = ctas_per_sm * bulk_smem(stage_bytes, stages);
        if smem <= rt.shared_optin.min(BULK_SMEM_PER_SM) {
            let us = time(BULK_ENTRY, BULK_THREADS, ctas_per_sm, (stage_bytes, stages));
            bulk_us = bulk_us.min(us);
        }
    }
    ReadCeiling {
        us: load_us.min(bulk_us),
        load_us,
        bulk_us,
        configs: json!(configs),
    }
}

/// The copy-engine read probe's shapes: (bytes per stage, stages, CTAs per SM), from 16 KB to
/// 192 KB in flight per SM; those over [`BULK_SMEM_PER_SM`] (or the device's per-CTA limit) are
/// skipped.
const BULK_SHAPES: &[(u32, u32, u32)] = &[
    (4096, 8, 1),
    (4096, 8, 2),
    (4096, 8, 4),
    (8192, 8, 2),
    (16384, 4, 1),
    (16384, 4, 2),
    (16384, 6, 2),
    (16384, 12, 1),
    (32768, 4, 1),
    (32768, 3, 2),
    (32768, 6, 1),
    (65536, 3, 1),
];

/// Shared memory per SM the bulk shapes may take (the H200's 228 KB less the CTAs' reserve).
const BULK_SMEM_PER_SM: u32 = 220 * 1024;

/// [`same_size_read`]'s answer: the best µs of either form, each form's best, every
/// configuration's time.
pub(crate) struct ReadCeiling {
    pub us: f64,
    pub load_us: f64,
    pub bulk_us: f64,
    pub configs: Value,
}

impl ReadCeiling {
    /// The bests as JSON fields: `us`, `load_us`, `bulk_us`.
    pub fn summary(&self) -> Value {
        json!({ "us": self.us, "load_us": self.load_us, "bulk_us": self.bulk_us })
    }
}

/// µs per device-to-device copy moving `traffic` bytes (half read, half written), from buffers
/// rotated through >= 256 MB (no copy starts in L2), timed like the kernels ([`time_calls`]):
/// what one launch moving that many bytes reaches (transfers of tens of MB stay well below the
/// 1 GiB copy rate).
pub(crate) fn same_size_copy_us(rt: &Arc<Runtime>, traffic: usize) -> f64 {
    let half = (traffic / 2).max(256);
    let sets = (L2_ESCAPE_BYTES / (2 * half)).clamp(2, 64);
    let bufs: Vec<_> = (0..sets)
        .map(|_| (filled(rt, half), rt.alloc(half).unwrap()))
        .collect();
    let iters = (200_000_000 / (2 * half)).clamp(20, 2000);
    time_calls(rt, 5, iters, |i| {
        let (a, b) = &bufs[i % sets];
        // SAFETY: both buffers hold `half` bytes.
        unsafe { rt.copy_dtod(b.ptr(), a.ptr(), half).unwrap() }
    })
    .us
}

struct RmsBuffers {
    x: Vec<DeviceBuffer>,
    out: Vec<DeviceBuffer>,
    gamma: DeviceBuffer,
}

fn rms_buffers(rt: &Arc<Runtime>, rows: usize, hidden: usize, elem: usize) -> RmsBuffers {
    let bytes = rows * hidden * elem;
    let sets = (L2_ESCAPE_BYTES / (2 * bytes)).clamp(1, 64);
    let alloc = |n: usize| filled(rt, n);
    RmsBuffers {
        x: (0..sets).map(|_| alloc(bytes)).collect(),
        out: (0..sets).map(|_| alloc(bytes)).collect(),
        gamma: alloc(hidden * elem),
    }
}

/// RMSNorm kernel time (events, inputs rotated so they come from HBM) and effective bandwidth,
/// and the plain burn-cuda composition of the same op (wall-clock).
pub fn rms_norm(rt: &Arc<Runtime>, copy_gbps: f64) -> Vec<Value> {
    let device = Default::default();
    let mut rows_out = Vec::new();
    for (dtype, elem_type, elem) in [
        (DType::BF16, ElemType::Bf16, 2usize),
        (DType::F32, ElemType::F32, 4),
    ] {
        for &hidden in &[576usize, 4096, 8192] {
            for &rows in &[1usize, 32, 2048, 16384] {
                let bufs = rms_buffers(rt, rows, hidden, elem);
                let l = launch(
                    elem_type,
                    false,
                    rows as u32,
                    hidden as u32,
                    true,
                    rt.sm_count,
                );
                let kernel = RmsKernel::new(rt, elem_type, l.entry).unwrap();
                let shape = LaunchShape::from(l);
                let sets = bufs.x.len();
                let iters = if rows >= 2048 { 50 } else { 200 };
                let launch_one = |i: usize| {
                    let a = RmsArgs {
                        x: &bufs.x[i % sets],
                        residual: None,
                        gamma: &bufs.gamma,
                        out: &bufs.out[i % sets],
                        sum_out: None,
                    };
                    // SAFETY: the buffers hold elements of `elem_type` and outlive the timing.
                    unsafe { kernel.launch(rt, shape, &a, rows as u32, hidden as u32) }
                };
                // Back-to-back launches on the stream: small shapes are bound by the host's
                // launch rate here.
                let stream_us = time_events(rt, 7, iters, |i| launch_one(i).unwrap());
                // The same launches replayed from a CUDA graph: GPU time per kernel, as in a
                // graphed decode step.
                let graph = rt.capture(|| (0..iters).try_for_each(launch_one)).unwrap();
                graph.upload().unwrap();
                let kernel_us = time_events(rt, 7, 1, |_| graph.launch().unwrap()) / iters as f64;
                let bytes = (2 * rows * hidden + hidden) * elem;
                let gbps = bytes as f64 / (kernel_us * 1e-6) / 1e9;
                // The floor for this many bytes: copying x to out (same bytes read and written,
                // same rotation), replayed from a graph the same way.
                let copy_graph = rt
                    .capture(|| {
                        (0..iters).try_for_each(|i| unsafe {
                            // SAFETY: both buffers hold rows * hidden * elem bytes.
                            rt.copy_dtod(
                                bufs.out[i % sets].ptr(),
                                bufs.x[i % sets].ptr(),
                                rows * hidden * elem,
                            )
                        })
                    })
                    .unwrap();
                copy_graph.upload().unwrap();
                let same_size_copy_us =
                    time_events(rt, 7, 1, |_| copy_graph.launch().unwrap()) / iters as f64;

                // The same op as burn-cuda runs it: the reference composition.
                let x = Tensor::<PlainCuda, 2>::from_data(
                    TensorData::new(vec![0.5f32; rows * hidden], [rows, hidden]),
                    &device,
                )
                .cast(dtype);
                let g = Tensor::<PlainCuda, 1>::ones([hidden], &device).cast(dtype);
                let burn_us = time_wall(
                    5,
                    20,
                    || PlainCuda::sync(&device).unwrap(),
                    |_| {
                        let _ = stoke::rms_norm(x.clone(), g.clone(), 1e-5);
                    },
                );
                println!(
                    "rms_norm {dtype:?} rows {rows:5} hidden {hidden:5}: {kernel_us:8.2} us {gbps:7.0} GB/s ({:5.1}% of copy), same-size copy {same_size_copy_us:7.2} us, stream {stream_us:7.2} us | burn-cuda composition {burn_us:8.2} us ({} entry {})",
                    100.0 * gbps / copy_gbps,
                    if burn_us > kernel_us {
                        format!("{:.1}x", burn_us / kernel_us)
                    } else {
                        "slower".into()
                    },
                    l.entry
                );
                rows_out.push(json!({
                    "dtype": format!("{dtype:?}"), "rows": rows, "hidden": hidden, "entry": l.entry,
                    "kernel_us": kernel_us, "stream_us": stream_us, "same_size_copy_us": same_size_copy_us, "effective_gbps": gbps, "fraction_of_copy": gbps / copy_gbps,
                    "burn_cuda_composition_us": burn_us, "input_sets": sets,
                }));
            }
        }
    }
    rows_out
}

fn pinned(t: Tensor<StokeCuda, 2>) -> Tensor<StokeCuda, 2> {
    stoke::cuda::pin(t)
}

/// Host cost of Stoke launches and of crossings between burn-cuda and Stoke.
pub fn host_and_crossing(rt: &Arc<Runtime>) -> Value {
    let device = Default::default();
    let (rows, hidden) = (1, 4096);
    let x = pinned(
        Tensor::<StokeCuda, 2>::random(
            [rows, hidden],
            burn::tensor::Distribution::Default,
            &device,
        )
        .cast(DType::BF16),
    );
    let g = stoke::cuda::pin(Tensor::<StokeCuda, 1>::ones([hidden], &device).cast(DType::BF16));
    let stoke_sync = || rt.synchronize().unwrap();

    // Host time to enqueue one Stoke op through the Burn API (no synchronization inside).
    let n = 2000;
    let _ = stoke::rms_norm(x.clone(), g.clone(), 1e-5);
    stoke_sync();
    let t0 = Instant::now();
    for _ in 0..n {
        let _ = stoke::rms_norm(x.clone(), g.clone(), 1e-5);
    }
    let host_launch_us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
    stoke_sync();

    // Building blocks measured alone: a pooled buffer allocation + release, a raw launch.
    let alloc_release_us = time_wall(5, 2000, || {}, |_| drop(rt.alloc(8192).unwrap()));
    let tiny = rms_buffers(rt, 1, hidden, 2);
    let l = launch(ElemType::Bf16, false, 1, hidden as u32, true, rt.sm_count);
    let kernel = rt.kernel(entry_point::<half::bf16>(l.entry)).unwrap();
    let shape = LaunchShape::from(l);
    let p = RmsNormParams::<half::bf16> {
        x: tiny.x[0].as_ptr(),
        residual: DevicePtr::NULL,
        gamma: tiny.gamma.as_ptr(),
        out: tiny.out[0].as_mut_ptr(),
        sum_out: DevicePtrMut::NULL,
        rows: 1,
        hidden: hidden as u32,
        eps: 1e-5,
    };
    let t0 = Instant::now();
    for _ in 0..n {
        // SAFETY: the buffers hold bf16 rows and outlive the synchronize below.
        unsafe { rt.launch(&kernel, shape, &p).unwrap() };
    }
    let raw_launch_us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
    stoke_sync();
    // Building blocks of a crossing.
    let plain = Tensor::<PlainCuda, 2>::ones([rows, hidden], &device);
    let prim = plain.clone().into_primitive().tensor();
    let get_resource_us = time_wall(
        5,
        200,
        || {},
        |_| {
            let _ = prim.client.get_resource(prim.handle.clone()).unwrap();
        },
    );
    let burn_sync_us = time_wall(5, 200, || {}, |_| PlainCuda::sync(&device).unwrap());
    let stoke_sync_us = time_wall(5, 200, || {}, |_| rt.synchronize().unwrap());

    // Crossing in: a Stoke op on a burn-cuda tensor (pin + one burn sync + launch).
    let unpinned = Tensor::<StokeCuda, 2>::ones([rows, hidden], &device).cast(DType::BF16);
    let cross_in_us = time_wall(5, 200, stoke_sync, |_| {
        let _ = stoke::rms_norm(unpinned.clone(), g.clone(), 1e-5);
    });
    // Crossing out: a burn-cuda op on a Stoke output (sync, copy, sync), then the op itself.
    let outs: Vec<_> = (0..1200)
        .map(|_| stoke::rms_norm(x.clone(), g.clone(), 1e-5))
        .collect();
    stoke_sync();
    let mut it = outs.into_iter();
    let cross_out_us = time_wall(5, 200, stoke_sync, |_| {
        let y = it.next().unwrap();
        let _ = y.add_scalar(1.0);
    });
    // One round trip as the alternation test does it: Stoke op, then burn op on its output.
    let mut cur = Tensor::<StokeCuda, 2>::ones([rows, hidden], &device).cast(DType::BF16);
    let round_trip_us = time_wall(
        5,
        200,
        || {
            rt.synchronize().unwrap();
            StokeCuda::sync(&device).unwrap()
        },
        |_| {
            let n = stoke::rms_norm(cur.clone(), g.clone(), 1e-5);
            cur = n.add_scalar(0.01);
        },
    );
    let v = json!({
        "shape": [rows, hidden], "dtype": "BF16",
        "host_us_per_stoke_launch": host_launch_us,
        "host_us_per_raw_launch": raw_launch_us,
        "host_us_per_pooled_alloc_release": alloc_release_us,
        "get_resource_us": get_resource_us,
        "burn_cuda_sync_idle_us": burn_sync_us,
        "stoke_sync_idle_us": stoke_sync_us,
        "cross_in_us": cross_in_us,
        "cross_out_us": cross_out_us,
        "round_trip_us": round_trip_us,
    });
    println!("host and crossings: {v}");
    v
}

/// A chain of 100 RMSNorms, `x <- rms_norm(x)`: Stoke keeps every intermediate on its stream
/// (one crossing in, none inside); plain burn-cuda runs the composition. Wall-clock from the
/// first call to the final synchronization.
pub fn chain100() -> Vec<Value> {
    let device = Default::default();
    let mut out = Vec::new();
    for &(rows, hidden) in &[(1usize, 4096usize), (32, 4096), (2048, 4096), (16384, 576)] {
        let xs = Tensor::<StokeCuda, 2>::random(
            [rows, hidden],
            burn::tensor::Distribution::Default,
            &device,
        )
        .cast(DType::BF16);
        let gs =
            stoke::cuda::pin(Tensor::<StokeCuda, 1>::ones([hidden], &device).cast(DType::BF16));
        let xp = Tensor::<PlainCuda, 2>::from_data(xs.to_data(), &device);
        let gp = Tensor::<PlainCuda, 1>::ones([hidden], &device).cast(DType::BF16);
        let stoke_us = time_wall(
            7,
            1,
            || StokeCuda::sync(&device).unwrap(),
            |_| {
                let mut x = xs.clone();
                for _ in 0..100 {
                    x = stoke::rms_norm(x, gs.clone(), 1e-5);
                }
                StokeCuda::sync(&device).unwrap();
            },
        );
        let burn_us = time_wall(
            7,
            1,
            || PlainCuda::sync(&device).unwrap(),
            |_| {
                let mut x = xp.clone();
                for _ in 0..100 {
                    x = stoke::rms_norm(x, gp.clone(), 1e-5);
                }
                PlainCuda::sync(&device).unwrap();
            },
        );
        println!(
            "chain of 100 rms_norm [{rows}, {hidden}] bf16: stoke {stoke_us:9.1} us, burn-cuda {burn_us:9.1} us ({:.1}x)",
            burn_us / stoke_us
        );
        out.push(json!({ "rows": rows, "hidden": hidden, "dtype": "BF16", "stoke_us": stoke_us, "burn_cuda_us": burn_us, "speedup": burn_us / stoke_us }));
    }
    out
}

/// Everything, as one JSON document.
pub fn all() -> Result<Value, String> {
    let rt = gpu()?;
    let copy_gbps = copy_bandwidth(&rt);
    println!("device-to-device copy: {copy_gbps:.0} GB/s (read + write)");
    let rms = rms_norm(&rt, copy_gbps);
    let host = host_and_crossing(&rt);
    let chain = chain100();
    Ok(json!({
        "gpu": rt.name, "sm_count": rt.sm_count, "arch": rt.arch,
        "copy_gbps": copy_gbps,
        "rms_norm": rms,
        "host_and_crossing": host,
        "chain100": chain,
        "kernels": rt.loaded_reports().into_iter().map(|(f, r)| json!({
            "file": f, "entry": r.entry, "registers": r.registers, "shared_bytes": r.shared_bytes,
            "stack_bytes": r.stack_bytes, "spill_store_bytes": r.spill_store_bytes, "spill_load_bytes": r.spill_load_bytes,
        })).collect::<Vec<_>>(),
    }))
}
