//! A decode step's RMSNorm followed by the W4A16 GEMM it feeds (the qkv and gate/up
//! projections), back to back on Stoke's stream: the RMSNorm kernels let the GEMM launch early
//! (programmatic dependent launch, `STOKE_RMS_PDL_TRIGGER` in `kernels/rms_norm.cu`), so the
//! GEMM's first weight loads overlap the norm, except where the runtime keeps a crowded
//! cluster launch in stream order (`Runtime::launch_cluster`). The GPU test checks that the
//! GEMM still reads the norm's finished output; the benchmark times the pair against each
//! kernel alone.

use crate::int4::{BENCH_SHAPES, get_bf16, put_u16, random_bf16, weight_copies};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::{Value, json};
use std::sync::Arc;
use stoke_cuda::int4::{Int4Gemm, int4_gemm};
use stoke_cuda::kernels::int4_gemm::WordOrder;
use stoke_cuda::kernels::rms_norm::{ElemType, RmsNormParams, entry_point, launch};
use stoke_cuda::{DeviceBuffer, LaunchShape, Runtime};

/// One pair's buffers: the norm's inputs (x, residual) and outputs (normed, sum), the GEMM's
/// output.
struct PairSet {
    x: DeviceBuffer,
    residual: DeviceBuffer,
    normed: DeviceBuffer,
    sum: DeviceBuffer,
    out: DeviceBuffer,
}

fn pair_sets(
    rt: &Arc<Runtime>,
    rng: &mut StdRng,
    sets: usize,
    m: usize,
    k: usize,
    n: usize,
) -> Vec<PairSet> {
    (0..sets)
        .map(|_| PairSet {
            x: put_u16(rt, &random_bf16(rng, m * k)),
            residual: put_u16(rt, &random_bf16(rng, m * k)),
            normed: rt.alloc(m * k * 2).unwrap(),
            sum: rt.alloc(m * k * 2).unwrap(),
            out: rt.alloc(m * n * 2).unwrap(),
        })
        .collect()
}

/// The fused residual RMSNorm of `s` (bf16, m rows of k), launched as `stoke::residual_rms_norm`
/// launches it.
fn norm(
    rt: &Runtime,
    s: &PairSet,
    gamma: &DeviceBuffer,
    m: usize,
    k: usize,
) -> stoke_cuda::Result<()> {
    let l = launch(ElemType::Bf16, true, m as u32, k as u32, true, rt.sm_count);
    let kernel = rt.kernel(entry_point::<half::bf16>(l.entry))?;
    let shape = LaunchShape::from(l);
    let p = RmsNormParams::<half::bf16> {
        x: s.x.as_ptr(),
        residual: s.residual.as_ptr(),
        gamma: gamma.as_ptr(),
        out: s.normed.as_mut_ptr(),
        sum_out: s.sum.as_mut_ptr(),
        rows: m as u32,
        hidden: k as u32,
        eps: 1e-5,
    };
    // SAFETY: every buffer holds m x k bf16 (gamma k) and outlives the kernel.
    unsafe { rt.launch(&kernel, shape, &p) }
}

/// The shipped GEMM call on the set's normed rows (the plan tuned per shape on its first call).
fn gemm_call(s: &PairSet, m: usize) -> Int4Gemm {
    let mut call = Int4Gemm::plain(s.normed.as_ptr(), m as u32, s.out.as_mut_ptr());
    call.wg_rows = stoke_cuda::int4::wg_rows_default();
    call.tune = true;
    call
}

/// A norm then its GEMM, each pair on its own buffers, replayed from one CUDA graph (so the
/// GEMM of pair i would read pair i - 1's rows if it ran ahead of its norm), against the same
/// launches with the stream synchronized after each: the outputs must agree (the split-K sums
/// are in a fixed order, so bit for bit; tolerance 1e-6 relative). 8B qkv shape, rows 1, 8 and
/// 16 (the swapped and warpgroup kernels, both launched programmatically), outputs poisoned
/// before the graph runs.
pub fn rms_norm_then_int4_gemm_matches_synchronized() -> Result<Value, String> {
    let rt = crate::gpu()?;
    let seed: u64 = rand::random();
    let mut rng = StdRng::seed_from_u64(seed);
    let (k, n, sets) = (4096usize, 6144usize, 6usize);
    let w = weight_copies(&rt, &mut rng, k, n, WordOrder::default(), 1);
    let gamma = put_u16(&rt, &random_bf16(&mut rng, k));
    let mut cases = Vec::new();
    for m in [1usize, 8, 16] {
        let s = pair_sets(&rt, &mut rng, sets, m, k, n);
        let pair = |i: usize| -> stoke_cuda::Result<()> {
            norm(&rt, &s[i], &gamma, m, k)?;
            unsafe { int4_gemm(&rt, &w[0], &gemm_call(&s[i], m)) }
        };
        // The reference: each launch finished before the next starts (tunes the GEMM too).
        let mut want = Vec::new();
        for i in 0..sets {
            norm(&rt, &s[i], &gamma, m, k).map_err(|e| e.to_string())?;
            rt.synchronize().map_err(|e| e.to_string())?;
            unsafe { int4_gemm(&rt, &w[0], &gemm_call(&s[i], m)) }.map_err(|e| e.to_string())?;
            rt.synchronize().map_err(|e| e.to_string())?;
            want.push(get_bf16(&s[i].out));
        }
        for set in &s {
            // SAFETY: poisons whole buffers (0xffff: bf16 NaN).
            unsafe {
                rt.fill_bytes(set.out.ptr(), 0xff, set.out.bytes()).unwrap();
                rt.fill_bytes(set.normed.ptr(), 0xff, set.normed.bytes())
                    .unwrap();
            }
        }
        rt.synchronize().map_err(|e| e.to_string())?;
        let graph = rt
            .capture(|| (0..sets).try_for_each(pair))
            .map_err(|e| e.to_string())?;
        graph.launch().map_err(|e| format!("graph launch: {e}"))?;
        rt.synchronize().map_err(|e| e.to_string())?;
        let mut worst = 0.0f64;
        for (i, set) in s.iter().enumerate() {
            let got = get_bf16(&set.out);
            let scale = want[i]
                .iter()
                .fold(0.0f64, |a, v| a.max(v.abs()))
                .max(1e-30);
            for (j, (g, r)) in got.iter().zip(&want[i]).enumerate() {
                let e = (g - r).abs() / scale;
                if !g.is_finite() || e > 1e-6 {
                    return Err(format!(
                        "m {m}: pair {i} output {j} is {g} from the graph, {r} with the stream synchronized between launches"
                    ));
                }
                worst = worst.max(e);
            }
        }
        cases.push(json!({"m": m, "pairs": sets, "max_relative_difference": worst}));
    }
    Ok(json!({"k": k, "n": n, "cases": cases, "seed": seed}))
}

/// Whether the W4A16 benchmark shape `name` is a projection an RMSNorm feeds in a Llama decode
/// step: qkv and gate/up.
fn norm_fed(name: &str) -> bool {
    name.ends_with("_qkv") || name.ends_with("_gate_up")
}

const PAIR_ROWS: &[usize] = &[1, 8, 16];

/// Times, per shape and row count, a graph of back-to-back (residual RMSNorm, GEMM) pairs, the
/// norms alone and the GEMMs alone (weights rotated through >= 160 MB of copies, inputs through
/// 4 sets). `overlap_us` = norm + GEMM - pair.
pub fn bench(copy_gbps: f64) -> Value {
    let rt = crate::gpu().expect("GPU");
    let mut rng = StdRng::seed_from_u64(5);
    let mut rows = Vec::new();
    for &(name, k, n) in BENCH_SHAPES.iter().filter(|s| norm_fed(s.0)) {
        let w = weight_copies(&rt, &mut rng, k, n, WordOrder::default(), 160_000_000);
        let gamma = put_u16(&rt, &random_bf16(&mut rng, k));
        for &m in PAIR_ROWS {
            let s = pair_sets(&rt, &mut rng, 4, m, k, n);
            // The first call tunes the GEMM (outside the timing).
            unsafe { int4_gemm(&rt, &w[0], &gemm_call(&s[0], m)) }.unwrap();
            rt.synchronize().unwrap();
            let iters = (200_000_000 / w[0].bytes()).clamp(20, 2000);
            {
                let g = |i: usize| {
                    unsafe { int4_gemm(&rt, &w[i % w.len()], &gemm_call(&s[i % s.len()], m)) }
                        .unwrap()
                };
                let nm = |i: usize| norm(&rt, &s[i % s.len()], &gamma, m, k).unwrap();
                let held0 = rt.pdl_held();
                let pair_us = crate::bench::time_calls(&rt, 5, iters, |i| {
                    nm(i);
                    g(i);
                })
                .us;
                // GEMM launches of the pairs the runtime kept in stream order (crowded clusters).
                let held = rt.pdl_held() - held0;
                let norm_us = crate::bench::time_calls(&rt, 5, iters, nm).us;
                let gemm_us = crate::bench::time_calls(&rt, 5, iters, g).us;
                let overlap = norm_us + gemm_us - pair_us;
                let bytes = w[0].bytes() + 3 * m * k * 2 + k * 2 + m * n * 2;
                println!(
                    "rms+int4 {name:<12} m {m:2}: pair {pair_us:7.2} us, norm {norm_us:6.2} + gemm {gemm_us:7.2} = {:7.2} us (overlap {overlap:5.2} us); pair at {:5.1}% of copy; {held} GEMM launches in stream order",
                    norm_us + gemm_us,
                    100.0 * bytes as f64 / pair_us / 1e3 / copy_gbps
                );
                let row = json!({"shape": name, "k": k, "n": n, "m": m, "pair_us": pair_us, "norm_us": norm_us,
                    "gemm_us": gemm_us, "overlap_us": overlap, "bytes": bytes,
                    "of_copy": bytes as f64 / pair_us / 1e3 / copy_gbps, "iters": iters, "gemm_launches_in_stream_order": held});
                rows.push(row);
            }
        }
    }
    json!({"copy_gbps": copy_gbps, "runs": rows})
}
