//! Packed INT4 weights on the GPU and the W4A16 GEMM call (`kernels/int4_gemm_*.cu`).

use crate::kernels::int4_gemm::{
    Entry, Epilogue, Int4GemmParams, Int4WgParams, Launch, MAX_ROWS, QkvRopeParams, WARPS,
    WG_ROWS_DEFAULT, WordOrder, counters_len, launch_bound_ctas, launch_bound_slots, plan,
    source_of, wg_clustered, wg_rows_of,
};
use crate::{
    DeviceBuffer, DevicePtr, DevicePtrMut, DriverContext, Error, KernelInfo, LaunchShape, Result,
    Runtime, ShapeError,
};
use half::bf16;
use std::sync::Arc;

/// A packed INT4 weight `[k, n]` (docs/INT4_FORMAT.md) in device memory.
#[derive(Debug)]
pub struct DeviceInt4 {
    pub k: u32,
    pub n: u32,
    pub group: u32,
    /// Scales and offsets are f16 (else bf16).
    pub f16_scales: bool,
    /// Order of the 512-byte word blocks in `words`.
    pub order: WordOrder,
    words: DeviceBuffer,
    scales: DeviceBuffer,
    offsets: Option<DeviceBuffer>,
}

fn bytes_of<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain integers (u16/u32) have no padding; the length covers the same memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

impl DeviceInt4 {
    /// Uploads a packed weight: `words` in fragment order (`k * n / 8`), `scales` and
    /// `offsets` (`None`: symmetric) as `[k / group, n]` 16-bit patterns, in the default
    /// device word order.
    pub fn upload(
        rt: &Arc<Runtime>,
        shape: (usize, usize, usize),
        f16_scales: bool,
        words: &[u32],
        scales: &[u16],
        offsets: Option<&[u16]>,
    ) -> Result<Self> {
        Self::upload_ordered(
            rt,
            shape,
            f16_scales,
            words,
            scales,
            offsets,
            WordOrder::default(),
        )
    }

    /// Uploads the packer's weight `p` (`stoke_formats::int4::PackedInt4`) with its word
    /// blocks in `order`.
    pub fn upload_packed(
        rt: &Arc<Runtime>,
        p: &stoke_formats::int4::PackedInt4,
        order: WordOrder,
    ) -> Result<Self> {
        Self::upload_ordered(
            rt,
            (p.k, p.n, p.group),
            p.scale_type == stoke_formats::int4::ScaleType::F16,
            &p.words,
            &p.scales,
            p.offsets.as_deref(),
            order,
        )
    }

    /// [`DeviceInt4::upload`] with the word blocks rearranged into `order` on the way (the
    /// packer's `words` are [`WordOrder::KtMajor`]).
    pub fn upload_ordered(
        rt: &Arc<Runtime>,
        (k, n, group): (usize, usize, usize),
        f16_scales: bool,
        words: &[u32],
        scales: &[u16],
        offsets: Option<&[u16]>,
        order: WordOrder,
    ) -> Result<Self> {
        let shape_err = |what: &str, want: usize, got: usize| {
            Error::Shape(ShapeError::new(
                format!("INT4 weight [{k}, {n}] group {group}: {what}"),
                format!("{want} values"),
                format!("{got} values"),
            ))
        };
        plan(
            1,
            k as u32,
            n as u32,
            group as u32,
            f16_scales,
            Epilogue::Plain,
            &launch_bound_slots(rt.sm_count),
            0,
            0,
        )
        .map_err(Error::Shape)?;
        if words.len() != k * n / 8 {
            return Err(shape_err("words", k * n / 8, words.len()));
        }
        let reordered;
        let words = match order {
            WordOrder::KtMajor => words,
            WordOrder::SlabMajor => {
                // 128 words (512 bytes) per block.
                let mut v = vec![0u32; words.len()];
                for kt in 0..k / 16 {
                    for slab in 0..n / 64 {
                        let from = WordOrder::KtMajor.block(kt, slab, k, n) * 128;
                        let to = order.block(kt, slab, k, n) * 128;
                        v[to..to + 128].copy_from_slice(&words[from..from + 128]);
                    }
                }
                reordered = v;
                &reordered[..]
            }
        };
        let groups = k / group * n;
        if scales.len() != groups {
            return Err(shape_err("scales", groups, scales.len()));
        }
        if let Some(o) = offsets
            && o.len() != groups
        {
            return Err(shape_err("offsets", groups, o.len()));
        }
        let put = |data: &[u8]| -> Result<DeviceBuffer> {
            let buf = rt.alloc(data.len())?;
            // SAFETY: the buffer holds data.len() bytes.
            unsafe { rt.copy_htod(buf.ptr(), data) }?;
            Ok(buf)
        };
        Ok(Self {
            k: k as u32,
            n: n as u32,
            group: group as u32,
            f16_scales,
            order,
            words: put(bytes_of(words))?,
            scales: put(bytes_of(scales))?,
            offsets: offsets.map(|o| put(bytes_of(o))).transpose()?,
        })
    }

    /// The weight as the FP8 prefill GEMM's INT4 operand ([`crate::kernels::fp8_gemm::fp8_i4_gemm`]).
    pub fn operand(&self) -> crate::kernels::fp8_gemm::I4Weight {
        let WeightPtrs {
            words,
            scales,
            offsets,
        } = self.ptrs();
        crate::kernels::fp8_gemm::I4Weight {
            words,
            scales,
            offsets,
            f16_scales: self.f16_scales,
            group: self.group,
            order: self.order,
        }
    }

    /// Device bytes of the weight (words, scales, offsets).
    pub fn bytes(&self) -> usize {
        self.words.bytes() + self.scales.bytes() + self.offsets.as_ref().map_or(0, |o| o.bytes())
    }
}

/// Device pointers of one W4A16 GEMM: `x [m, k]` bf16, `out [m, epilogue.out_cols(n)]` bf16,
/// `residual [m, n]` bf16 for [`Epilogue::Residual`] (else null), `row_scale [m]` f32 or null.
#[derive(Clone, Copy, Debug)]
pub struct Int4Gemm {
    pub x: DevicePtr<bf16>,
    pub m: u32,
    pub out: DevicePtrMut<bf16>,
    pub epilogue: Epilogue,
    pub residual: DevicePtr<bf16>,
    pub row_scale: DevicePtr<f32>,
    /// An RMSNorm folded across this call (its output's norm, or its input's).
    pub norm: NormFold,
    /// The decode q|k|v epilogue's targets in device memory (plain epilogue; `out` is then q,
    /// `[m, heads * 64]`), or null.
    pub qkv: DevicePtr<QkvRopeParams>,
    /// CTAs per 64-column slab along k; 0 lets the plan choose (benchmarks sweep it).
    pub splits: u32,
    /// Launches of at least this many rows use the warpgroup kernels (`int4_gemm_wg_*`) where
    /// the shape allows them, the weight is symmetric and `x` is 16-byte aligned; 0: none.
    /// [`wg_rows_default`] for the process default.
    pub wg_rows: u32,
    /// Time the candidate plans on the first call of each shape and row count and use the
    /// fastest from then on (calls with `splits` 0, up to 32 rows; see [`tune_default`]).
    pub tune: bool,
}

/// An RMSNorm between two W4A16 calls folded into them, so that it takes no launch of its own
/// (`kernels/int4_gemm.cuh`): the call that writes the norm's input `h` also writes `h * gain`
/// (`gained`) and per-row sums of `h^2` by 64-column slab (`ss_out`, `[n / 64][m]` f32); the
/// call that reads the normalized rows reads `gained` as its `x` and those sums (`ss_in`), and
/// scales each row by `rsqrt(sum / k + eps)` in its epilogue. [`NormFold::NONE`]: neither.
#[derive(Clone, Copy, Debug, Default)]
pub struct NormFold {
    /// Producer: the norm's gain `[n]` bf16 (null: this call's output feeds no folded norm).
    pub gain: DevicePtr<bf16>,
    /// Producer: `[m, n]` bf16, `out * gain`.
    pub gained: DevicePtrMut<bf16>,
    /// Producer: `[n / 64][m]` f32.
    pub ss_out: DevicePtrMut<f32>,
    /// Consumer: `[k / 64][m]` f32 from the producer (null: `x` is plain).
    pub ss_in: DevicePtr<f32>,
    /// Consumer: the norm's epsilon.
    pub eps: f32,
}

impl NormFold {
    /// No folded norm on either side.
    pub const NONE: Self = Self {
        gain: DevicePtr::NULL,
        gained: DevicePtrMut::NULL,
        ss_out: DevicePtrMut::NULL,
        ss_in: DevicePtr::NULL,
        eps: 0.0,
    };
}

impl Int4Gemm {
    /// A plain-epilogue call (no residual, no row scale) with the plan's split count, the
    /// warpgroup kernels off.
    pub fn plain(x: DevicePtr<bf16>, m: u32, out: DevicePtrMut<bf16>) -> Self {
        Self {
            x,
            m,
            out,
            epilogue: Epilogue::Plain,
            residual: DevicePtr::NULL,
            row_scale: DevicePtr::NULL,
            norm: NormFold::NONE,
            qkv: DevicePtr::NULL,
            splits: 0,
            wg_rows: 0,
            tune: false,
        }
    }
}

/// A row count 0-32 from environment variable `name`, else `default` (with a warning when it is
/// set to something else).
fn env_rows(name: &str, default: u32) -> u32 {
    match std::env::var(name) {
        Ok(v) => match v.trim().parse::<u32>() {
            Ok(r) if r <= MAX_ROWS => r,
            _ => {
                tracing::warn!("{name}={v:?} is not a row count 0-{MAX_ROWS}; using {default}");
                default
            }
        },
        Err(_) => default,
    }
}

/// Rows from which the warpgroup kernels are used: `STOKE_INT4_WG_ROWS` (0-32, 0: never), else
/// [`WG_ROWS_DEFAULT`].
pub fn wg_rows_default() -> u32 {
    static V: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *V.get_or_init(|| env_rows("STOKE_INT4_WG_ROWS", WG_ROWS_DEFAULT))
}

/// Resident CTAs of a W4A16 entry point on the whole GPU, from the occupancy calculator (the
/// launch bounds' expectation if the kernel can't be loaded; the launch reports that error).
pub fn resident_slots(rt: &Arc<Runtime>) -> impl Fn(&'static str) -> u32 + '_ {
    move |entry| {
        rt.kernel_info(source_of(entry), entry)
            .and_then(|k| rt.resident_ctas(&k, WARPS * 32))
            .unwrap_or_else(|_| launch_bound_ctas(entry))
            * rt.sm_count
    }
}

/// The cluster a W4A16 launch forms: (1, splits, 1) for 2 to [`crate::MAX_CLUSTER_CTAS`] splits
/// where the kernel has the shared-memory split-K reduction (`<entry>_cluster`) and the launch's clusters (one per CTA column) are all resident at
/// once, so the splits of a slab add through each other's shared memory instead of the
/// workspace; else none. Clusters are placed whole inside the GPU's processing clusters, so
/// a grid that fills the resident CTA slots may not fit as clusters: there a cluster launch
/// ran as a second wave, 1.3-1.6x slower (docs/PERFORMANCE.md), and the launch stays plain.
pub fn cluster_dims(
    rt: &Runtime,
    kernel: &KernelInfo,
    launch: &Launch,
) -> Result<Option<(u32, u32, u32)>> {
    let cluster = (1, launch.splits, 1);
    let fits = rt.clusters_fit(kernel, launch.block.0, cluster, u64::from(launch.grid.0))?;
    Ok(fits.then_some(cluster))
}

static WARPGROUP_LAUNCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many launches of the warpgroup kernels (`int4_gemm_wg_*`) [`int4_gemm`] has queued in
/// this process for its calls, not counting the tuner's trial launches (tests check that a
/// path reaches them).
pub fn warpgroup_launches() -> u64 {
    WARPGROUP_LAUNCHES.load(std::sync::atomic::Ordering::Relaxed)
}

/// A planned launch of `k` rows of weights as the GPU runs it: a warpgroup launch on a short
/// k range whose splits cannot all be resident as clusters takes the largest smaller split
/// count whose clusters are ([`wg_clustered`]); any other launch as planned.
pub fn clustered(rt: &Runtime, kernel: &KernelInfo, l: Launch, k: u32) -> Result<Launch> {
    // The driver is asked lazily (cached per entry and cluster size), its first error kept.
    let err = crate::FirstError::default();
    let out = wg_clustered(&l, k, |s| {
        err.ask(|| {
            let trial = Launch {
                splits: s,
                grid: (l.grid.0, s, l.grid.2),
                ..l
            };
            Ok(cluster_dims(rt, kernel, &trial)?.is_some())
        })
    });
    err.finish(out)
}

/// The launches of `call` with the warpgroup kernels from `wg_rows` rows, as the GPU runs them
/// (warpgroup splits re-chosen for clusters when the plan chooses the split count).
fn planned(
    rt: &Arc<Runtime>,
    w: &DeviceInt4,
    call: &Int4Gemm,
    wg_rows: u32,
) -> Result<Vec<Launch>> {
    let launches = plan(
        call.m,
        w.k,
        w.n,
        w.group,
        w.f16_scales,
        call.epilogue,
        &resident_slots(rt),
        call.splits,
        wg_rows,
    )
    .map_err(Error::Shape)?;
    if call.splits != 0 {
        return Ok(launches);
    }
    launches
        .into_iter()
        .map(|l| clustered(rt, &rt.kernel_info(source_of(l.entry), l.entry)?, l, w.k))
        .collect()
}

/// Device pointers of a packed weight's words, scales and offsets (null: symmetric).
#[derive(Clone, Copy, Debug)]
struct WeightPtrs {
    words: DevicePtr<u32>,
    scales: DevicePtr<u16>,
    offsets: DevicePtr<u16>,
}

impl DeviceInt4 {
    fn ptrs(&self) -> WeightPtrs {
        WeightPtrs {
            words: self.words.as_ptr(),
            scales: self.scales.as_ptr(),
            offsets: self
                .offsets
                .as_ref()
                .map_or(DevicePtr::NULL, |o| o.as_ptr()),
        }
    }
}

/// Queues `launches` (a plan of `call`) on the weight `w` describes, at `ptrs` (its own
/// buffers, or a copy of them), writing to `out`.
///
/// # Safety
/// As [`int4_gemm`]; `ptrs` hold a weight like `w`, `out` the call's output.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_planned(
    rt: &Arc<Runtime>,
    w: &DeviceInt4,
    ptrs: WeightPtrs,
    call: &Int4Gemm,
    launches: &[Launch],
    out: DevicePtrMut<bf16>,
    counted: bool,
) -> Result<()> {
    let (kt_stride, slab_stride) = w.order.strides(w.k, w.n);
    // Split-K launches (splits > 1) without clusters add through the workspace.
    let split = launches.iter().any(|l| l.splits != 1);
    let rows = launches.iter().map(|l| l.rows).max().unwrap_or(0) as usize;
    let ws_bytes = rows * w.n as usize * 4;
    let (workspace, counters) = if split {
        let base = rt.zeroed_scratch(ws_bytes.next_multiple_of(256) + counters_len(w.n) * 4)?;
        (
            DevicePtrMut::new(base),
            DevicePtrMut::new(base + ws_bytes.next_multiple_of(256) as u64),
        )
    } else {
        (DevicePtrMut::NULL, DevicePtrMut::NULL)
    };
    let out_cols = call.epilogue.out_cols(w.n as usize) as u64;
    for &l in launches {
        let entry = Entry::from_name(l.entry).ok_or_else(|| {
            Error::Shape(ShapeError::new(
                "W4A16 entry point",
                "an int4_gemm_* entry point",
                l.entry,
            ))
        })?;
        let r0 = l.row0 as usize;
        let params = Int4GemmParams {
            x: call.x.add(r0 * w.k as usize),
            words: ptrs.words,
            scales: ptrs.scales,
            offsets: ptrs.offsets,
            // The q|k|v epilogue places q by the call's row (q's pitch is not n).
            out: if call.qkv.is_null() {
                out.add(r0 * out_cols as usize)
            } else {
                out
            },
            residual: if call.residual.is_null() {
                DevicePtr::NULL
            } else {
                call.residual.add(r0 * w.n as usize)
            },
            row_scale: if call.row_scale.is_null() {
                DevicePtr::NULL
            } else {
                call.row_scale.add(r0)
            },
            workspace,
            counters,
            norm_gain: call.norm.gain,
            gained: if call.norm.gain.is_null() {
                DevicePtrMut::NULL
            } else {
                call.norm.gained.add(r0 * w.n as usize)
            },
            norm_ss: if call.norm.gain.is_null() {
                DevicePtrMut::NULL
            } else {
                call.norm.ss_out.add(r0)
            },
            ss_in: if call.norm.ss_in.is_null() {
                DevicePtr::NULL
            } else {
                call.norm.ss_in.add(r0)
            },
            qkv: call.qkv,
            m: l.rows,
            k: w.k,
            n: w.n,
            group: w.group,
            fold_kt: l.fold_kt,
            splits: l.splits,
            kt_stride,
            slab_stride,
            norm_stride: call.m,
            eps: call.norm.eps,
            row0: l.row0,
            pad: 0,
        };
        // The launch shape (the m32 and warpgroup kernels' shared memory: their `_dyn_smem`
        // global) and cluster of the loaded kernel.
        let placed = |info: &KernelInfo| -> Result<_> {
            let shape = LaunchShape {
                grid: l.grid,
                block: l.block,
                shared_mem_bytes: info.dyn_smem,
            };
            Ok((shape, cluster_dims(rt, info, &l)?))
        };
        // SAFETY: the params mirror the kernel's struct (layout test); the caller guarantees
        // the pointers; the weight buffers live in `w`, borrowed for the call and freed on this
        // stream; the scratch is the runtime's; the kernel reduces within its cluster when
        // launched with one and through the workspace otherwise.
        match entry.entry_point() {
            Err(wg_entry) => {
                // The warpgroup kernels read this launch's rows of x through a tensor map, 4
                // steps (4 x 64 k) per box.
                let box_rows = wg_rows_of(l.entry).unwrap_or(32);
                let x_map = rt.bf16_tensor_map(params.x.addr(), l.rows, w.k, box_rows, 64, 4)?;
                let wg = Int4WgParams { p: params, x_map };
                let kernel = rt.kernel(wg_entry)?;
                let (shape, cluster) = placed(&kernel)?;
                unsafe { rt.launch_cluster(&kernel, shape, cluster, &wg) }?;
                if counted {
                    WARPGROUP_LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            Ok(gemm_entry) => {
                let kernel = rt.kernel(gemm_entry)?;
                let (shape, cluster) = placed(&kernel)?;
                unsafe { rt.launch_cluster(&kernel, shape, cluster, &params) }?;
            }
        }
    }
    Ok(())
}

/// Whether calls that leave the plan to Stoke ([`Int4Gemm::tune`]) time its candidate
/// kernels on the first call of each shape: on unless `STOKE_INT4_TUNE=0`.
pub fn tune_default() -> bool {
    // 0: not read yet, 1: off, 2: on.
    match TUNE.load(std::sync::atomic::Ordering::Relaxed) {
        0 => {
            let on = std::env::var("STOKE_INT4_TUNE").as_deref() != Ok("0");
            set_tune_default(on);
            on
        }
        v => v == 2,
    }
}

/// Sets [`tune_default`] for the rest of the process (a test that must run given kernels).
pub fn set_tune_default(on: bool) {
    TUNE.store(1 + u8::from(on), std::sync::atomic::Ordering::Relaxed);
}

static TUNE: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// What a tuned call's plan depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct TuneKey {
    ordinal: usize,
    m: u32,
    k: u32,
    n: u32,
    group: u32,
    f16_scales: bool,
    order: WordOrder,
    epilogue: Epilogue,
    wg_rows: u32,
}

/// One shape's tuning: each candidate plan's first launch and its time, and the choice.
#[derive(Clone, Debug)]
pub struct TuneRecord {
    pub m: u32,
    pub k: u32,
    pub n: u32,
    pub group: u32,
    pub epilogue: Epilogue,
    /// (entry point, splits, median µs) of each candidate's first launch, the plan's first.
    pub candidates: Vec<(&'static str, u32, f64)>,
    /// Index into `candidates` of the plan the calls use.
    pub chosen: usize,
    /// `wg_rows` of the chosen plan.
    pub wg_rows: u32,
    /// Split count of the chosen plan (0: the plan's own).
    pub splits: u32,
    /// Host milliseconds the tuning added to the shape's first call (copies, graph captures,
    /// timed replays).
    pub tuning_ms: f64,
}

type TuneTable = std::collections::HashMap<TuneKey, TuneRecord>;

fn tune_table() -> &'static std::sync::Mutex<TuneTable> {
    static T: std::sync::OnceLock<std::sync::Mutex<TuneTable>> = std::sync::OnceLock::new();
    T.get_or_init(Default::default)
}

/// Every shape tuned so far in this process (benchmarks and tests report them).
pub fn tune_records() -> Vec<TuneRecord> {
    let mut v: Vec<TuneRecord> = tune_table().lock().unwrap().values().cloned().collect();
    v.sort_by_key(|r| (r.k, r.n, r.m, r.epilogue.name()));
    v
}

/// Timed replays of each candidate's graph (after one untimed replay).
const TUNE_REPS: usize = 5;
/// A candidate replaces the plan only when it is at least this much faster (timing noise).
const TUNE_MARGIN: f64 = 0.02;
/// Most copies of a weight the tuner makes (tiny weights: their launches then may hit the L2).
const TUNE_MAX_COPIES: usize = 2048;

/// `(wg_rows, splits)` for a tuned call: the plan's, the warpgroup kernels from one row, or
/// none (only the last where `wg_rows` is 0: asymmetric weights, unaligned x, none asked for),
/// each at its planned split count or one fewer or more (`splits` 0: the plan's count),
/// whichever ran fastest on this GPU on the first call of the shape (cached per shape). At
/// up to 8 rows the plan's swapped kernel and the warpgroup 8-row kernel each win on some
/// shapes (docs/PERFORMANCE.md) and no rule of the shape separates them. While the stream
/// is capturing a graph nothing can be timed: the plan's choice, not cached.
fn tuned_plan(
    rt: &Arc<Runtime>,
    w: &DeviceInt4,
    call: &Int4Gemm,
    wg_rows: u32,
) -> Result<(u32, u32)> {
    let key = TuneKey {
        ordinal: rt.ordinal,
        m: call.m,
        k: w.k,
        n: w.n,
        group: w.group,
        f16_scales: w.f16_scales,
        order: w.order,
        epilogue: call.epilogue,
        wg_rows,
    };
    if let Some(r) = tune_table().lock().unwrap().get(&key) {
        return Ok((r.wg_rows, r.splits));
    }
    // A choice an earlier process made on this GPU (the kernel cache's tuning file).
    if let Some(plan) = saved_choice(rt, &key) {
        return Ok(plan);
    }
    // Candidates: the plan, the warpgroup kernels at every row count (where allowed), and
    // none, each with its planned split count and one split fewer and more; the same launches
    // once. Without the warpgroup kernels (asymmetric weights, unaligned x, or none asked for):
    // the plan's kernels at the three split counts.
    let mut options: Vec<(u32, u32, Vec<Launch>)> = Vec::new();
    let rows_options: &[u32] = if wg_rows == 0 { &[0] } else { &[wg_rows, 1, 0] };
    for &rows in rows_options {
        let base = planned(rt, w, call, rows)?;
        let s = base[0].splits;
        let mut add = |splits: u32, launches: Vec<Launch>| {
            if !options.iter().any(|(.., l)| *l == launches) {
                options.push((rows, splits, launches));
            }
        };
        add(0, base);
        for near in [s.saturating_sub(1), s + 1] {
            if s > 0 && near > 0 {
                let explicit = Int4Gemm {
                    splits: near,
                    ..*call
                };
                add(near, planned(rt, w, &explicit, rows)?);
            }
        }
    }
    if rt.is_capturing()? {
        return Ok((wg_rows, 0));
    }
    let t0 = std::time::Instant::now();
    // One candidate (the shape rules the warpgroup kernels out): recorded untimed.
    let times = if options.len() < 2 {
        vec![f64::NAN]
    } else {
        match time_plans(rt, w, call, &options) {
            Ok(t) => t,
            // Out of memory for the weight's copies, say: the plan's choice, kept.
            Err(e) => {
                tracing::warn!(
                    "stoke int4: tuning m {} k {} n {} not possible ({e}); the plan's kernels",
                    call.m,
                    w.k,
                    w.n
                );
                vec![f64::NAN; options.len()]
            }
        }
    };
    let best = (0..times.len())
        .min_by(|&a, &b| times[a].total_cmp(&times[b]))
        .unwrap_or(0);
    let chosen = if times[best] < times[0] * (1.0 - TUNE_MARGIN) {
        best
    } else {
        0
    };
    let record = TuneRecord {
        m: call.m,
        k: w.k,
        n: w.n,
        group: w.group,
        epilogue: call.epilogue,
        candidates: options
            .iter()
            .zip(&times)
            .map(|((.., l), &us)| (l[0].entry, l[0].splits, us))
            .collect(),
        chosen,
        wg_rows: options[chosen].0,
        splits: options[chosen].1,
        tuning_ms: t0.elapsed().as_secs_f64() * 1e3,
    };
    tracing::debug!(
        "stoke int4: tuned m {} k {} n {} {}: {:?}, chose {}",
        call.m,
        w.k,
        w.n,
        call.epilogue.name(),
        record.candidates,
        record.candidates[chosen].0
    );
    let plan = (record.wg_rows, record.splits);
    tune_table().lock().unwrap().insert(key, record);
    save_choice(rt, &key, plan);
    Ok(plan)
}

/// The tuning file of `rt`'s GPU in the kernel cache (`STOKE_KERNEL_CACHE`): one line per tuned
/// shape, `key -> wg_rows splits`, so that a later process on the same GPU model skips the
/// timing (a first call's tens of milliseconds per shape).
fn tune_file(rt: &Runtime) -> Option<std::path::PathBuf> {
    let gpu: String = rt
        .name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    Some(crate::compile::kernel_cache_dir()?.join(format!("int4-tune-{gpu}-{}.txt", rt.arch)))
}

fn key_text(k: &TuneKey) -> String {
    format!(
        "m {} k {} n {} group {} f16 {} order {:?} epilogue {} wg_rows {}",
        k.m,
        k.k,
        k.n,
        k.group,
        k.f16_scales,
        k.order,
        k.epilogue.name(),
        k.wg_rows
    )
}

/// Choices read from the tuning files, by GPU ordinal (read once per ordinal).
type SavedChoices = std::collections::HashMap<usize, std::collections::HashMap<String, (u32, u32)>>;

fn saved_choice(rt: &Runtime, key: &TuneKey) -> Option<(u32, u32)> {
    static SAVED: std::sync::OnceLock<std::sync::Mutex<SavedChoices>> = std::sync::OnceLock::new();
    let mut saved = SAVED.get_or_init(Default::default).lock().unwrap();
    let table = saved.entry(rt.ordinal).or_insert_with(|| {
        let text = tune_file(rt)
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let (k, v) = l.split_once(" -> ")?;
                let mut v = v.split_whitespace().map(|x| x.parse::<u32>());
                Some((k.to_string(), (v.next()?.ok()?, v.next()?.ok()?)))
            })
            .collect()
    });
    table.get(&key_text(key)).copied()
}

/// Appends a tuned choice to the tuning file (best effort: the file only saves time).
fn save_choice(rt: &Runtime, key: &TuneKey, (wg_rows, splits): (u32, u32)) {
    use std::io::Write;
    let Some(path) = tune_file(rt) else { return };
    let line = format!("{} -> {wg_rows} {splits}\n", key_text(key));
    let written = std::fs::create_dir_all(path.parent().expect("a file in a directory"))
        .and_then(|_| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
        })
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        tracing::debug!(
            "stoke int4: tuning file {} not written: {e}",
            path.display()
        );
    }
}

/// µs per launch of each plan of `call`, measured as the benchmarks and a decode step meet
/// the kernels: a CUDA graph of back-to-back launches (programmatic launch between them) over
/// copies of the weight spanning twice the L2, so every launch reads its weight from DRAM;
/// the median of [`TUNE_REPS`] replays per plan, the plans interleaved; into a scratch output.
/// The copies are freed afterwards (not pooled).
fn time_plans(
    rt: &Arc<Runtime>,
    w: &DeviceInt4,
    call: &Int4Gemm,
    options: &[(u32, u32, Vec<Launch>)],
) -> Result<Vec<f64>> {
    let out = rt.alloc(call.m as usize * call.epilogue.out_cols(w.n as usize) * 2)?;
    let span = 2 * rt.l2_bytes()?;
    let bytes = w.bytes().max(1);
    let copies = if bytes >= span {
        1
    } else {
        (span.div_ceil(bytes) + 1).min(TUNE_MAX_COPIES)
    };
    let ring = |buf: Option<&DeviceBuffer>| -> Result<Option<DeviceBuffer>> {
        let Some(b) = buf else { return Ok(None) };
        let r = rt.alloc_unpooled(b.bytes() * copies)?;
        for i in 0..copies {
            // SAFETY: slot i of the ring holds b.bytes() bytes.
            unsafe { rt.copy_dtod(r.ptr() + (i * b.bytes()) as u64, b.ptr(), b.bytes()) }?;
        }
        Ok(Some(r))
    };
    let (words, scales, offsets) = if copies > 1 {
        (
            ring(Some(&w.words))?,
            ring(Some(&w.scales))?,
            ring(w.offsets.as_ref())?,
        )
    } else {
        (None, None, None)
    };
    let copy = |i: usize| {
        let at = |ring: &Option<DeviceBuffer>, own: u64, b: usize| {
            ring.as_ref().map_or(own, |r| r.ptr() + (i * b) as u64)
        };
        let own = w.ptrs();
        WeightPtrs {
            words: DevicePtr::new(at(&words, own.words.addr(), w.words.bytes())),
            scales: DevicePtr::new(at(&scales, own.scales.addr(), w.scales.bytes())),
            offsets: w.offsets.as_ref().map_or(DevicePtr::NULL, |o| {
                DevicePtr::new(at(&offsets, own.offsets.addr(), o.bytes()))
            }),
        }
    };
    let launches_per_graph = copies.max(8).next_multiple_of(copies);
    let mut graphs = Vec::new();
    for (.., launches) in options {
        // Once outside the capture: loads the kernels and sizes the zeroed scratch.
        // SAFETY: the caller's pointers (as for the call itself), the weight copies, `out` a
        // scratch output of the call's size.
        unsafe { launch_planned(rt, w, copy(0), call, launches, out.as_mut_ptr(), false) }?;
        let graph = rt.capture(|| {
            (0..launches_per_graph).try_for_each(|i| {
                // SAFETY: as above.
                unsafe {
                    launch_planned(
                        rt,
                        w,
                        copy(i % copies),
                        call,
                        launches,
                        out.as_mut_ptr(),
                        false,
                    )
                }
            })
        })?;
        graph.upload().call("cuGraphUpload")?;
        graph.launch().call("cuGraphLaunch")?;
        graphs.push(graph);
    }
    let events = (0..TUNE_REPS * options.len())
        .map(|_| Ok((rt.timing_event()?, rt.timing_event()?)))
        .collect::<Result<Vec<_>>>()?;
    let mut pairs = events.iter();
    for _ in 0..TUNE_REPS {
        for graph in &graphs {
            let (start, end) = pairs.next().unwrap();
            rt.record(start)?;
            graph.launch().call("cuGraphLaunch")?;
            rt.record(end)?;
        }
    }
    let mut times = vec![Vec::new(); options.len()];
    for (i, (start, end)) in events.iter().enumerate() {
        let ms = start.elapsed_ms(end).call("cuEventElapsedTime")?;
        times[i % options.len()].push(f64::from(ms) * 1e3 / launches_per_graph as f64);
    }
    rt.synchronize()?;
    drop(graphs);
    Ok(times
        .into_iter()
        .map(|mut t| {
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        })
        .collect())
}

/// Queues `out = epilogue(x @ w)` on Stoke's stream (one launch per 32 rows).
///
/// # Safety
/// Every pointer in `call` must be valid device memory of the documented size, 4-byte aligned,
/// and stay valid until the kernels finish (Stoke buffers, or pinned ones).
pub unsafe fn int4_gemm(rt: &Arc<Runtime>, w: &DeviceInt4, call: &Int4Gemm) -> Result<()> {
    if call.m == 0 {
        return Ok(());
    }
    if call.epilogue == Epilogue::Residual && call.residual.is_null() {
        return Err(Error::Shape(ShapeError::new(
            "INT4 GEMM residual epilogue",
            "a residual input",
            "none",
        )));
    }
    if !call.norm.gain.is_null()
        && (call.epilogue == Epilogue::SwiGlu
            || call.norm.gained.is_null()
            || call.norm.ss_out.is_null())
    {
        return Err(Error::Shape(ShapeError::new(
            "INT4 GEMM folded norm output",
            "a plain or residual epilogue with gained and slab-sum outputs",
            format!("{:?} epilogue", call.epilogue),
        )));
    }
    if !call.qkv.is_null() && call.epilogue != Epilogue::Plain {
        return Err(Error::Shape(ShapeError::new(
            "INT4 GEMM q|k|v epilogue",
            "the plain epilogue",
            format!("{:?} epilogue", call.epilogue),
        )));
    }
    if !call.norm.ss_in.is_null() && !w.k.is_multiple_of(64) {
        return Err(Error::Shape(ShapeError::new(
            "INT4 GEMM folded norm input",
            "k a multiple of 64 (the producer's slabs)",
            format!("k {}", w.k),
        )));
    }
    // The warpgroup kernels take symmetric weights only, and x through the copy engine
    // (16-byte aligned rows).
    let mut wg_rows = if w.offsets.is_some() || !call.x.addr().is_multiple_of(16) {
        0
    } else {
        call.wg_rows
    };
    let mut call = *call;
    if call.tune && call.splits == 0 && call.m <= MAX_ROWS {
        (wg_rows, call.splits) = tuned_plan(rt, w, &call, wg_rows)?;
    }
    let call = &call;
    let launches = planned(rt, w, call, wg_rows)?;
    // SAFETY: as guaranteed by the caller.
    unsafe { launch_planned(rt, w, w.ptrs(), call, &launches, call.out, true) }
}
