//! The dense bf16 GEMM (`kernels/bf16_gemm.cu`) on the GPU: every epilogue against an f64
//! reference over the same bf16 values, determinism and CUDA-graph capture, `linear` through a
//! pinned bf16 weight against burn-cuda's, and the kernel's speed.

use crate::gpu::is_stoke_output;
use crate::int4::{put_u16, try_get_bf16};
use crate::{PlainCuda, StokeCuda};
use burn::tensor::{DType, Tensor, TensorData};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::sync::Arc;
use stoke_cuda::bf16::{Bf16Gemm, bf16_gemm};
use stoke_cuda::kernels::BF16_GEMM;
use stoke_cuda::kernels::bf16_gemm::{Epilogue, Launch};
use stoke_cuda::{DeviceBuffer, DevicePtr, GraphArena, Runtime};
use stoke_formats::bf16;
use stoke_formats::reference::relative_error;

/// Shapes `(k, n, epilogues)` of the correctness test. The plan gives: 576 x 1728 deep, 2
/// splits; 576 x 49152 wide, 2 splits; 1536 x 576 deep, 6 splits; 4096 x 6144 deep, 3;
/// 4096 x 28672 wide, 3; 14336 x 4096 deep, 5; 64 x 67584 wide, one split; 200 x 1000 a k
/// that ends on a partial step of 32 and an n that ends inside a 64-column strip.
const SHAPES: &[(usize, usize, &[Epilogue])] = &[
    (
        576,
        1728,
        &[Epilogue::Plain, Epilogue::Residual, Epilogue::SwiGlu],
    ),
    (576, 49152, &[Epilogue::Plain, Epilogue::SwiGlu]),
    (
        1536,
        576,
        &[Epilogue::Plain, Epilogue::Residual, Epilogue::SwiGlu],
    ),
    (4096, 6144, &[Epilogue::Plain, Epilogue::Residual]),
    (4096, 28672, &[Epilogue::SwiGlu, Epilogue::Plain]),
    (14336, 4096, &[Epilogue::Residual]),
    (64, 67584, &[Epilogue::Plain, Epilogue::Residual]),
    (
        200,
        1000,
        &[Epilogue::Plain, Epilogue::Residual, Epilogue::SwiGlu],
    ),
];
const ROWS: &[usize] = &[1, 2, 3, 8, 16, 31, 32];
/// Rows the reference is computed for once per shape; each call takes the first `m`.
const MAX_ROWS: usize = 32;
/// Allowed error of an output element, in units of 2^-8 times the largest magnitude of its row
/// (the reference's): rounding to bf16 alone is at most 2^-8 of the element's magnitude; the
/// margin covers f32 accumulation and the epilogue's f32 math.
pub(crate) const TOLERANCE: f64 = 1.1;
/// Relative (Frobenius) error allowed between `linear` on `Stoke<Cuda>` and on burn-cuda (each
/// rounds its bf16 output once, about 1.1e-3 each), and of the paths that are not the kernel's
/// against f64.
pub(crate) const ROUTE_TOLERANCE: f64 = 2e-2;
/// 2^-8: the bound of bf16 rounding relative to the rounded value's magnitude.
const BF16_HALF_ULP: f64 = 1.0 / 256.0;

/// Random bf16 values (raw bits) uniform in `[-scale, scale)`.
pub(crate) fn random_bits(rng: &mut StdRng, len: usize, scale: f32) -> Vec<u16> {
    (0..len)
        .map(|_| bf16::from_f32(rng.random_range(-scale..scale)))
        .collect()
}

/// `x [rows, k] @ w [k, n]` in f64 over the bf16 values, rows split over the host's threads.
pub(crate) fn reference_acc(x: &[u16], rows: usize, w: &[u16], k: usize, n: usize) -> Vec<f64> {
    let mut acc = vec![0f64; rows * n];
    let threads = std::thread::available_parallelism()
        .map_or(4, |t| t.get())
        .min(rows.max(1));
    let per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        for (chunk, out) in acc.chunks_mut(per * n).enumerate() {
            s.spawn(move || {
                for (i, orow) in out.chunks_mut(n).enumerate() {
                    let r = chunk * per + i;
                    for kk in 0..k {
                        let xv = bf16::to_f32(x[r * k + kk]) as f64;
                        if xv == 0.0 {
                            continue;
                        }
                        let wr = &w[kk * n..(kk + 1) * n];
                        for (o, wv) in orow.iter_mut().zip(wr) {
                            *o += xv * bf16::to_f32(*wv) as f64;
                        }
                    }
                }
            });
        }
    });
    acc
}

/// The epilogue of the first `m` rows of `acc [.., n]` in f64.
fn epilogue(acc: &[f64], m: usize, n: usize, epi: Epilogue, residual: &[u16]) -> Vec<f64> {
    let acc = &acc[..m * n];
    match epi {
        Epilogue::Plain => acc.to_vec(),
        Epilogue::Residual => acc
            .iter()
            .zip(residual)
            .map(|(a, r)| a + bf16::to_f32(*r) as f64)
            .collect(),
        Epilogue::SwiGlu => acc
            .chunks_exact(2)
            .map(|gu| gu[0] / (1.0 + (-gu[0]).exp()) * gu[1])
            .collect(),
    }
}

/// The largest error of `got` against `want` (both `[rows, cols]`) in units of 2^-8 times the
/// largest magnitude of `want`'s row; infinite where `got` is not finite.
pub(crate) fn row_scaled_error(got: &[f64], want: &[f64], cols: usize) -> f64 {
    got.chunks(cols)
        .zip(want.chunks(cols))
        .map(|(g, w)| {
            let scale = w.iter().fold(0f64, |a, v| a.max(v.abs())).max(1e-30);
            g.iter()
                .zip(w)
                .map(|(a, b)| {
                    if a.is_finite() {
                        (a - b).abs() / (BF16_HALF_ULP * scale)
                    } else {
                        f64::INFINITY
                    }
                })
                .fold(0f64, f64::max)
        })
        .fold(0f64, f64::max)
}

fn launch_json(l: &Launch) -> Value {
    json!({"entry": l.entry.name(), "grid": [l.grid.0, l.grid.1], "splits": l.splits,
        "split_steps": l.split_steps})
}

/// The kernels against the f64 reference on fresh random data, outputs poisoned before each
/// call, for every row count of `ROWS` and the epilogues of each of `SHAPES`; every call
/// run twice (bitwise the same: the split-K sum is deterministic), one per shape also from a
/// CUDA graph captured into an arena (bitwise the same as the eager call). Then the Burn-level
/// route ([`route_matches_burn_cuda`]) and the benchmark ([`bench()`]).
pub fn bf16_gemm_matches_reference() -> Result<Value, String> {
    let rt = crate::gpu()?;
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    rt.set_poison_allocations(true);
    let checked = kernel_cases(&rt, &mut rng, seed);
    rt.set_poison_allocations(false);
    let (cases, worst, worst_case) = checked?;
    let route = route_matches_burn_cuda(seed)?;
    let bench = bench(crate::bench::copy_bandwidth(&rt));
    Ok(json!({ "seed": seed, "tolerance_row_half_ulps": TOLERANCE,
        "max_error_row_half_ulps": worst, "worst_case": worst_case, "cases": cases,
        "route": route, "bench": bench }))
}

fn kernel_cases(
    rt: &Arc<Runtime>,
    rng: &mut StdRng,
    seed: u64,
) -> Result<(Vec<Value>, f64, String), String> {
    let mut cases = Vec::new();
    let (mut worst, mut worst_case) = (0f64, String::new());
    for &(k, n, epis) in SHAPES {
        let w = random_bits(rng, k * n, 1.0 / (k as f32).sqrt());
        let x = random_bits(rng, MAX_ROWS * k, 2.0);
        let res = random_bits(rng, MAX_ROWS * n, 3.0);
        let wb = put_u16(rt, &w);
        let xb = put_u16(rt, &x);
        // x again 4 bytes past the allocation's start (the kernels need 4-byte alignment).
        let xb_off = put_u16(rt, &[&[0, 0][..], &x].concat());
        let rb = put_u16(rt, &res);
        let acc = reference_acc(&x, MAX_ROWS, &w, k, n);
        for &m in ROWS {
            let x_ptr = if m == 31 {
                xb_off.as_ptr::<half::bf16>().add(2)
            } else {
                xb.as_ptr()
            };
            for (ei, &epi) in epis.iter().enumerate() {
                let cols = epi.out_cols(n);
                let want = epilogue(&acc, m, n, epi, &res);
                let out = rt.alloc(m * cols * 2).map_err(|e| e.to_string())?;
                let call = Bf16Gemm {
                    x: x_ptr,
                    m: m as u32,
                    k: k as u32,
                    n: n as u32,
                    w: wb.as_ptr(),
                    out: out.as_mut_ptr(),
                    epilogue: epi,
                    residual: if epi == Epilogue::Residual {
                        rb.as_ptr()
                    } else {
                        DevicePtr::NULL
                    },
                };
                let launch = call.plan(rt).map_err(|e| e.to_string())?;
                let what = format!(
                    "seed {seed}: m {m} k {k} n {n} {epi:?} ({} {} splits){}",
                    launch.entry.name(),
                    launch.splits,
                    if m == 31 { " x at +4 bytes" } else { "" }
                );
                let run = || -> Result<Vec<f64>, String> {
                    unsafe { rt.fill_bytes(out.ptr(), 0xFF, out.bytes()) }
                        .map_err(|e| e.to_string())?;
                    unsafe { bf16_gemm(rt, &call) }.map_err(|e| format!("{what}: {e}"))?;
                    try_get_bf16(&out).map_err(|e| format!("{what}: {e}"))
                };
                let got = run()?;
                let err = row_scaled_error(&got, &want, cols);
                if !(err <= TOLERANCE) {
                    let bad = got.iter().zip(&want).position(|(g, w)| {
                        !g.is_finite() || (g - w).abs() > BF16_HALF_ULP * w.abs().max(1e-3)
                    });
                    return Err(format!(
                        "{what}: error {err:.3} x 2^-8 of the row's scale (first suspect element {bad:?}: got {:?}, want {:?})",
                        bad.map(|i| got[i]),
                        bad.map(|i| want[i])
                    ));
                }
                if err > worst {
                    worst = err;
                    worst_case = what.clone();
                }
                let again = run()?;
                let same = got
                    .iter()
                    .zip(&again)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                if !same {
                    return Err(format!("{what}: a second call gave other bits"));
                }
                let mut graphed = false;
                if m == 8 && ei == 0 {
                    unsafe { rt.fill_bytes(out.ptr(), 0xFF, out.bytes()) }
                        .map_err(|e| e.to_string())?;
                    let arena = GraphArena::new(rt);
                    let graph = rt
                        .capture_into(&arena, || unsafe { bf16_gemm(rt, &call) })
                        .map_err(|e| format!("{what}: capture: {e}"))?;
                    rt.replay(&graph)
                        .map_err(|e| format!("{what}: replay: {e}"))?;
                    let replayed = try_get_bf16(&out).map_err(|e| format!("{what}: {e}"))?;
                    if !got
                        .iter()
                        .zip(&replayed)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                    {
                        return Err(format!("{what}: the graph replay gave other bits"));
                    }
                    drop(graph);
                    graphed = true;
                }
                cases.push(
                    json!({"m": m, "k": k, "n": n, "epilogue": format!("{epi:?}"),
                    "launch": launch_json(&launch), "x_offset_bytes": if m == 31 { 4 } else { 0 },
                    "error_row_half_ulps": err, "rel_err": relative_error(&got, &want),
                    "graph_replayed": graphed}),
                );
            }
        }
    }
    Ok((cases, worst, worst_case))
}

/// `Tensor<Stoke<Cuda>>` linear through a pinned bf16 weight (`stoke::cuda::pin`): plain, with
/// a bias, and the fused residual and SwiGLU linears, for 3-D inputs of 10 and 32 rows (the
/// dense kernel) and 40 rows (burn-cuda's matmul), against burn-cuda's own linear and the f64
/// reference over the same bf16 values.
pub fn route_matches_burn_cuda(seed: u64) -> Result<Value, String> {
    use burn::module::Param;
    use burn::nn::Linear;
    let (k, n) = (576, 1536);
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let device = Default::default();
    let to_f32 = |v: &[u16]| v.iter().map(|b| bf16::to_f32(*b)).collect::<Vec<f32>>();
    let w = random_bits(&mut rng, k * n, 1.0 / (k as f32).sqrt());
    let bias = random_bits(&mut rng, n, 0.5);
    let w_stoke = stoke::cuda::pin(
        Tensor::<StokeCuda, 2>::from_data(TensorData::new(to_f32(&w), [k, n]), &device)
            .cast(DType::BF16),
    );
    let w_plain = Tensor::<PlainCuda, 2>::from_data(TensorData::new(to_f32(&w), [k, n]), &device)
        .cast(DType::BF16);
    let b_stoke = Tensor::<StokeCuda, 1>::from_data(TensorData::new(to_f32(&bias), [n]), &device)
        .cast(DType::BF16);
    let b_plain = Tensor::<PlainCuda, 1>::from_data(TensorData::new(to_f32(&bias), [n]), &device)
        .cast(DType::BF16);
    let linear = Linear {
        weight: Param::from_tensor(w_stoke.clone()),
        bias: None,
    };
    let mut report = json!({});
    for (batch, rows) in [(2, 5), (1, 32), (2, 20)] {
        let m = batch * rows;
        let x = random_bits(&mut rng, m * k, 2.0);
        let res = random_bits(&mut rng, m * n, 3.0);
        let xs = Tensor::<StokeCuda, 3>::from_data(
            TensorData::new(to_f32(&x), [batch, rows, k]),
            &device,
        )
        .cast(DType::BF16);
        let xp = Tensor::<PlainCuda, 3>::from_data(
            TensorData::new(to_f32(&x), [batch, rows, k]),
            &device,
        )
        .cast(DType::BF16);
        let rs = Tensor::<StokeCuda, 3>::from_data(
            TensorData::new(to_f32(&res), [batch, rows, n]),
            &device,
        )
        .cast(DType::BF16);
        let acc = reference_acc(&x, m, &w, k, n);
        let kernel = m <= 32;
        let what = format!("route seed {seed}: x [{batch}, {rows}, {k}]");

        // Plain linear, against f64 and against burn-cuda's.
        let y = burn::tensor::module::linear(xs.clone(), w_stoke.clone(), None);
        if is_stoke_output(&y) != kernel {
            return Err(format!(
                "{what}: linear ran on {} (dense kernel expected: {kernel})",
                if kernel {
                    "burn-cuda"
                } else {
                    "a Stoke kernel"
                }
            ));
        }
        let got = crate::f64s(y.into_data());
        let plain = crate::f64s(
            burn::tensor::module::linear(xp.clone(), w_plain.clone(), None).into_data(),
        );
        let want = epilogue(&acc, m, n, Epilogue::Plain, &[]);
        let err_ref = row_scaled_error(&got, &want, n);
        let err_burn = relative_error(&got, &plain);
        // The kernel is held to the bf16 rounding of its output; burn-cuda's matmul (the path
        // past 32 rows) to its agreement with f64 and the kernel to its agreement with burn-cuda.
        let ref_ok = if kernel {
            err_ref <= TOLERANCE
        } else {
            relative_error(&got, &want) < ROUTE_TOLERANCE
        };
        if !(ref_ok && err_burn < ROUTE_TOLERANCE) {
            return Err(format!(
                "{what}: linear error {err_ref:.3} x 2^-8 of the row's scale, {err_burn:.3e} against burn-cuda"
            ));
        }
        // With a bias (added after the kernel, as Burn's linear does).
        let yb = burn::tensor::module::linear(xs.clone(), w_stoke.clone(), Some(b_stoke.clone()));
        let pb = burn::tensor::module::linear(xp, w_plain.clone(), Some(b_plain.clone()));
        let err_bias = relative_error(&crate::f64s(yb.into_data()), &crate::f64s(pb.into_data()));
        if !(err_bias < ROUTE_TOLERANCE) {
            return Err(format!(
                "{what}: linear with bias {err_bias:.3e} against burn-cuda"
            ));
        }
        // The fused linears.
        let yr = stoke::linear_residual(xs.clone(), &linear, rs);
        let yg = stoke::linear_swiglu(xs, &linear);
        if is_stoke_output(&yr) != kernel || is_stoke_output(&yg) != kernel {
            return Err(format!(
                "{what}: fused linears on a Stoke kernel: residual {}, swiglu {} (expected {kernel})",
                is_stoke_output(&yr),
                is_stoke_output(&yg)
            ));
        }
        let want_r = epilogue(&acc, m, n, Epilogue::Residual, &res);
        let want_g = epilogue(&acc, m, n, Epilogue::SwiGlu, &[]);
        let (got_r, got_g) = (crate::f64s(yr.into_data()), crate::f64s(yg.into_data()));
        let err_r = row_scaled_error(&got_r, &want_r, n);
        let err_g = row_scaled_error(&got_g, &want_g, n / 2);
        // Past 32 rows the reference compositions run (rounding the linear's output first).
        let fused_ok = if kernel {
            err_r <= TOLERANCE && err_g <= TOLERANCE
        } else {
            relative_error(&got_r, &want_r) < ROUTE_TOLERANCE
                && relative_error(&got_g, &want_g) < ROUTE_TOLERANCE
        };
        if !fused_ok {
            return Err(format!(
                "{what}: linear_residual {err_r:.3}, linear_swiglu {err_g:.3} x 2^-8 of the row's scale"
            ));
        }
        report[format!("rows_{m}")] = json!({"dense_kernel": kernel, "linear_row_half_ulps": err_ref,
            "linear_rel_err_vs_burn_cuda": err_burn, "bias_rel_err_vs_burn_cuda": err_bias,
            "residual_row_half_ulps": err_r, "swiglu_row_half_ulps": err_g});
    }
    Ok(report)
}

/// Benchmark shapes `(name, k, n)`: SmolLM2-135M's gate/up, LM head and down, Llama-3.1-8B's
/// qkv, gate/up, down and LM head.
pub const BENCH_SHAPES: &[(&str, usize, usize)] = &[
    ("smol_gate_up", 576, 1728),
    ("smol_head", 576, 49152),
    ("smol_down", 1536, 576),
    ("8b_qkv", 4096, 6144),
    ("8b_gate_up", 4096, 28672),
    ("8b_down", 14336, 4096),
    ("8b_head", 4096, 128256),
];
pub const BENCH_ROWS: &[usize] = &[1, 8, 32];

/// Copies of a `[k, n]` bf16 weight (filled with one finite pattern: the speed does not depend
/// on the values) spanning at least `min_bytes` in all, one at least, so that the L2 never
/// serves the weights, as in a model.
pub(crate) fn weight_copies(
    rt: &Arc<Runtime>,
    k: usize,
    n: usize,
    min_bytes: usize,
) -> Vec<DeviceBuffer> {
    let bytes = k * n * 2;
    (0..min_bytes.div_ceil(bytes).max(1))
        .map(|_| {
            let b = rt.alloc(bytes).unwrap();
            // SAFETY: `b` holds `bytes` bytes.
            unsafe { rt.fill_bytes(b.ptr(), 0x3c, bytes) }.unwrap();
            b
        })
        .collect()
}

/// The plain dense GEMM on [`BENCH_SHAPES`] at [`BENCH_ROWS`] rows: µs per call (CUDA events
/// over many calls replayed from a CUDA graph, and launched back to back from the host), the
/// effective GB/s of the weight bytes and their share of the same run's copy rate, and the
/// launch the plan made; then the kernels' ptxas resources.
pub fn bench(copy_gbps: f64) -> Value {
    let rt = crate::gpu().expect("GPU");
    let mut rows = Vec::new();
    let mut rng = StdRng::seed_from_u64(11);
    for &(name, k, n) in BENCH_SHAPES {
        let weights = weight_copies(&rt, k, n, 160_000_000);
        let w_bytes = k * n * 2;
        for &m in BENCH_ROWS {
            let xb = put_u16(&rt, &random_bits(&mut rng, m * k, 2.0));
            let out = rt.alloc(m * n * 2).unwrap();
            let call = |w: &DeviceBuffer| Bf16Gemm {
                x: xb.as_ptr(),
                m: m as u32,
                k: k as u32,
                n: n as u32,
                w: w.as_ptr(),
                out: out.as_mut_ptr(),
                epilogue: Epilogue::Plain,
                residual: DevicePtr::NULL,
            };
            let launch = call(&weights[0]).plan(&rt).unwrap();
            let iters = (200_000_000 / w_bytes).clamp(20, 2000);
            let timing = crate::bench::time_calls(&rt, 5, iters, |i| {
                unsafe { bf16_gemm(&rt, &call(&weights[i % weights.len()])) }.unwrap()
            });
            let gbps = w_bytes as f64 / timing.us / 1e3;
            println!(
                "bf16 {name:<13} m {m:2}: {:8.2} us {gbps:6.0} GB/s of W ({:5.1}% of copy) {} grid {:?}",
                timing.us,
                100.0 * gbps / copy_gbps,
                launch.entry.name(),
                launch.grid
            );
            rows.push(
                json!({"shape": name, "k": k, "n": n, "m": m, "us": timing.us,
                "stream_us": timing.stream_us, "host_us": timing.host_us, "weight_bytes": w_bytes,
                "weight_copies": weights.len(), "gbps": gbps, "of_copy": gbps / copy_gbps,
                "launch": launch_json(&launch)}),
            );
        }
    }
    let kernels = crate::bench::kernel_reports(&rt, BF16_GEMM.file);
    json!({ "copy_gbps": copy_gbps, "runs": rows, "kernels": kernels })
}
