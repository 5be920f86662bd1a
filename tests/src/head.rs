//! The output-head kernel (`kernels/bf16_head.cu`) on the GPU: every entry point against an
//! f64 reference over the same bf16 values, determinism, CUDA-graph capture and nothing written
//! past the output; the output head of a Burn model prepared with the head's plan
//! (`stoke::WeightRole::Head`) against burn-cuda's; and the kernel's speed beside the dense bf16
//! kernel, the same-size read ceiling and the copy rate (the PyTorch peer runs in the same call:
//! `scripts/peers/head_torch.py`).

use crate::dense::{TOLERANCE, random_bits, reference_acc, row_scaled_error, weight_copies};
use crate::gpu::is_stoke_output;
use crate::int4::put_u16;
use crate::{PlainCuda, StokeCuda};
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_json::{Value, json};
use std::sync::Arc;
use stoke_cuda::bf16::{Bf16Gemm, Bf16Head, bf16_gemm, bf16_head};
use stoke_cuda::kernels::BF16_HEAD;
use stoke_cuda::kernels::bf16_gemm::Epilogue;
use stoke_cuda::kernels::bf16_head::{ENTRIES, Entry, Launch, M8, MAX_ROWS};
use stoke_cuda::{DeviceBuffer, DevicePtr, GraphArena, Runtime};
use stoke_formats::bf16;
use stoke_formats::reference::relative_error;

/// Shapes `(k, n)` of the correctness test: SmolLM2's head; a Llama-2-sized one; a k that ends
/// inside a step of 32 and an n inside a strip of 16; a k of one partial step; an n that ends
/// half way through a 32-column unit.
const SHAPES: &[(usize, usize)] = &[
    (576, 49152),
    (4096, 32000),
    (200, 1000),
    (8, 24),
    (1024, 4104),
];
const ROWS: &[usize] = &[1, 2, 3, 7, 8, 9, 16, 17, 31, 32];
/// Bytes past the output that must stay poisoned.
const GUARD_BYTES: usize = 256;

/// `w [rows, cols]` transposed: `[cols, rows]`.
fn transpose(w: &[u16], rows: usize, cols: usize) -> Vec<u16> {
    let mut t = vec![0u16; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = w[r * cols + c];
        }
    }
    t
}

/// The buffer's 16-bit words, or the copy's error (a fault of an earlier kernel shows here).
fn get_u16(buf: &DeviceBuffer) -> Result<Vec<u16>, String> {
    let mut bytes = vec![0u8; buf.bytes()];
    unsafe { buf.runtime().copy_dtoh(&mut bytes, buf.ptr()) }.map_err(|e| e.to_string())?;
    Ok(bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect())
}

fn launch_json(l: &Launch) -> Value {
    json!({"entry": l.entry.name, "grid": l.grid.0, "units_per_warp": l.units_per_warp})
}

/// Every entry point against the f64 reference on fresh random data, outputs and a guard past
/// them poisoned before each call, at every row count of `ROWS` it takes, on each of `SHAPES`;
/// every call run twice (bitwise the same), the plan's 8-row call of each shape also from a CUDA
/// graph (bitwise the same as the eager call). Then the Burn-level route
/// ([`head_route_matches_burn_cuda`]) and the benchmark ([`bench()`]).
pub fn bf16_head_matches_reference() -> Result<Value, String> {
    let rt = crate::gpu()?;
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    rt.set_poison_allocations(true);
    let checked = kernel_cases(&rt, &mut rng, seed);
    rt.set_poison_allocations(false);
    let (cases, worst, worst_case) = checked?;
    let route = head_route_matches_burn_cuda(seed)?;
    let bench = bench(&rt, crate::bench::copy_bandwidth(&rt));
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
    let max_rows = MAX_ROWS as usize;
    for &(k, n) in SHAPES {
        let w = random_bits(rng, n * k, 1.0 / (k as f32).sqrt());
        let x = random_bits(rng, max_rows * k, 2.0);
        let wb = put_u16(rt, &w);
        let xb = put_u16(rt, &x);
        let acc = reference_acc(&x, max_rows, &transpose(&w, n, k), k, n);
        for entry in ENTRIES.iter().copied() {
            for &m in ROWS.iter().filter(|&&m| m <= entry.rows as usize) {
                let want = &acc[..m * n];
                let out = rt
                    .alloc(m * n * 2 + GUARD_BYTES)
                    .map_err(|e| e.to_string())?;
                let call = Bf16Head {
                    x: xb.as_ptr(),
                    m: m as u32,
                    k: k as u32,
                    n: n as u32,
                    w: wb.as_ptr(),
                    out: out.as_mut_ptr(),
                };
                let launch = call.plan(rt, Some(entry)).map_err(|e| e.to_string())?;
                let what = format!("seed {seed}: m {m} k {k} n {n} {}", entry.name);
                let run = || -> Result<(Vec<f64>, bool), String> {
                    unsafe { rt.fill_bytes(out.ptr(), 0xFF, out.bytes()) }
                        .map_err(|e| e.to_string())?;
                    unsafe { bf16_head(rt, &call, Some(entry)) }
                        .map_err(|e| format!("{what}: {e}"))?;
                    let all = get_u16(&out)?;
                    let guard = all[m * n..].iter().all(|&b| b == 0xFFFF);
                    let got = all[..m * n]
                        .iter()
                        .map(|b| bf16::to_f32(*b) as f64)
                        .collect();
                    Ok((got, guard))
                };
                let (got, guard) = run()?;
                if !guard {
                    return Err(format!("{what}: wrote past the output"));
                }
                let err = row_scaled_error(&got, want, n);
                if !(err <= TOLERANCE) {
                    let bad = got.iter().zip(want).position(|(g, w)| {
                        !g.is_finite() || (g - w).abs() > w.abs().max(1e-3) / 256.0
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
                let (again, _) = run()?;
                if !got
                    .iter()
                    .zip(&again)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
                {
                    return Err(format!("{what}: a second call gave other bits"));
                }
                let mut graphed = false;
                if m == 8 && entry == M8 {
                    unsafe { rt.fill_bytes(out.ptr(), 0xFF, out.bytes()) }
                        .map_err(|e| e.to_string())?;
                    let arena = GraphArena::new(rt);
                    let graph = rt
                        .capture_into(&arena, || unsafe { bf16_head(rt, &call, None) })
                        .map_err(|e| format!("{what}: capture: {e}"))?;
                    rt.replay(&graph)
                        .map_err(|e| format!("{what}: replay: {e}"))?;
                    let all = get_u16(&out)?;
                    let replayed: Vec<f64> = all[..m * n]
                        .iter()
                        .map(|b| bf16::to_f32(*b) as f64)
                        .collect();
                    if !got
                        .iter()
                        .zip(&replayed)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
                    {
                        return Err(format!("{what}: the graph replay gave other bits"));
                    }
                    graphed = true;
                }
                cases.push(
                    json!({"m": m, "k": k, "n": n, "launch": launch_json(&launch),
                    "error_row_half_ulps": err, "rel_err": relative_error(&got, want),
                    "graph_replayed": graphed}),
                );
            }
        }
    }
    Ok((cases, worst, worst_case))
}

/// A Burn `Linear` head `[k, n]` prepared with the head's plan: kept as its rows
/// (`stoke::cuda::HeadWeight`), reading back as the same `[k, n]` values, and
/// `stoke::output_head` on 1 to 64 rows on the head kernel (two launches past 32), on 70 rows
/// on the prefill GEMM reading the rows, and with a bias (added after the kernel), each against
/// burn-cuda's linear and the f64 reference over the same bf16 values.
pub fn head_route_matches_burn_cuda(seed: u64) -> Result<Value, String> {
    use burn::module::Param;
    use burn::nn::Linear;
    let (k, n) = (576, 4104);
    let mut rng = StdRng::seed_from_u64(seed ^ 0x4ead);
    let device = Default::default();
    let to_f32 = |v: &[u16]| v.iter().map(|b| bf16::to_f32(*b)).collect::<Vec<f32>>();
    // The head as Burn holds it, [k, n].
    let w_kn = random_bits(&mut rng, k * n, 1.0 / (k as f32).sqrt());
    let plan = stoke::Plan::default().weight(stoke::WeightRole::Head);
    let w_stoke = stoke::cuda::prepare(
        Tensor::<StokeCuda, 2>::from_data(TensorData::new(to_f32(&w_kn), [k, n]), &device)
            .cast(DType::BF16),
        plan,
    );
    let rows_kept = match w_stoke.clone().into_primitive() {
        TensorPrimitive::Float(p) => p
            .downcast_ref::<stoke::cuda::HeadWeight<burn_cuda::Cuda>>()
            .is_some(),
        _ => false,
    };
    if !rows_kept {
        return Err("the head's plan did not keep the head as its rows".into());
    }
    let back = crate::f64s(w_stoke.clone().into_data());
    let want_back: Vec<f64> = w_kn.iter().map(|b| bf16::to_f32(*b) as f64).collect();
    if back != want_back || w_stoke.dims() != [k, n] {
        return Err(format!(
            "the head kept as rows reads back as {:?} with other values",
            w_stoke.dims()
        ));
    }
    let w_plain =
        Tensor::<PlainCuda, 2>::from_data(TensorData::new(to_f32(&w_kn), [k, n]), &device)
            .cast(DType::BF16);
    let linear = Linear {
        weight: Param::from_tensor(w_stoke),
        bias: None,
    };
    let mut report = json!({});
    for m in [1usize, 5, 32, 33, 64, 70] {
        let x = random_bits(&mut rng, m * k, 2.0);
        let xs = Tensor::<StokeCuda, 2>::from_data(TensorData::new(to_f32(&x), [m, k]), &device)
            .cast(DType::BF16);
        let xp = Tensor::<PlainCuda, 2>::from_data(TensorData::new(to_f32(&x), [m, k]), &device)
            .cast(DType::BF16);
        let kernel = m <= 2 * MAX_ROWS as usize;
        let what = format!("head route seed {seed}: x [{m}, {k}]");
        let y = stoke::output_head(&linear, xs);
        if !is_stoke_output(&y) {
            return Err(format!("{what}: the head ran on burn-cuda"));
        }
        let got = crate::f64s(y.into_data());
        let plain =
            crate::f64s(burn::tensor::module::linear(xp, w_plain.clone(), None).into_data());
        let want = reference_acc(&x, m, &w_kn, k, n);
        let err_ref = row_scaled_error(&got, &want, n);
        let err_burn = relative_error(&got, &plain);
        // Both Stoke paths round the f32 sums to bf16 once.
        if !(err_ref <= TOLERANCE && err_burn < crate::dense::ROUTE_TOLERANCE) {
            return Err(format!(
                "{what}: error {err_ref:.3} x 2^-8 of the row's scale, {err_burn:.3e} against burn-cuda"
            ));
        }
        report[format!("rows_{m}")] = json!({"head_kernel": kernel, "row_half_ulps": err_ref,
            "rel_err_vs_burn_cuda": err_burn});
        if m == 5 {
            // With a bias (added after the kernel, as Burn's linear does).
            let bias = random_bits(&mut rng, n, 0.5);
            let with_bias = Linear {
                weight: linear.weight.clone(),
                bias: Some(Param::from_tensor(
                    Tensor::<StokeCuda, 1>::from_data(TensorData::new(to_f32(&bias), [n]), &device)
                        .cast(DType::BF16),
                )),
            };
            let xs =
                Tensor::<StokeCuda, 2>::from_data(TensorData::new(to_f32(&x), [m, k]), &device)
                    .cast(DType::BF16);
            let yb = crate::f64s(stoke::output_head(&with_bias, xs).into_data());
            let want_b: Vec<f64> = want
                .iter()
                .enumerate()
                .map(|(i, v)| v + bf16::to_f32(bias[i % n]) as f64)
                .collect();
            let err_b = relative_error(&yb, &want_b);
            if !(err_b < crate::dense::ROUTE_TOLERANCE) {
                return Err(format!(
                    "{what}: with a bias {err_b:.3e} from the reference"
                ));
            }
            report["bias_rel_err"] = json!(err_b);
        }
    }
    Ok(report)
}

/// Benchmark shapes `(name, k, n)`: the heads of SmolLM2-135M, Llama-3.1-8B and Llama-3.1-70B.
pub const BENCH_SHAPES: &[(&str, usize, usize)] = &[
    ("smol_head", 576, 49152),
    ("8b_head", 4096, 128256),
    ("70b_head", 8192, 128256),
];
pub const BENCH_ROWS: &[usize] = &[1, 8, 16, 32, 64];

/// The head kernel on [`BENCH_SHAPES`] at [`BENCH_ROWS`] rows (64: two launches of 32, as the
/// route makes them) and the other entry points of each row tile; beside it the dense bf16 kernel on the
/// same bytes read as `[k, n]` (up to 32 rows) and, once per shape, the fastest pure read of
/// the weight's bytes. µs per call (CUDA events over a CUDA graph of back-to-back calls,
/// weights rotated through >= 160 MB), GB/s of the weight bytes and their share of the copy rate.
pub fn bench(rt: &Arc<Runtime>, copy_gbps: f64) -> Value {
    let mut rows = Vec::new();
    let mut rng = StdRng::seed_from_u64(12);
    for &(name, k, n) in BENCH_SHAPES {
        let weights = weight_copies(rt, n, k, 160_000_000);
        let w_bytes = k * n * 2;
        let read = crate::bench::same_size_read(rt, w_bytes);
        println!(
            "head {name:<9} read ceiling {:8.2} us ({:5.1}% of copy)",
            read.us,
            100.0 * w_bytes as f64 / read.us / 1e3 / copy_gbps
        );
        let iters = (200_000_000 / w_bytes).clamp(20, 2000);
        for &m in BENCH_ROWS {
            let xb = put_u16(rt, &random_bits(&mut rng, m * k, 2.0));
            let out = rt.alloc(m * n * 2).unwrap();
            let head_call = |w: &DeviceBuffer, first: usize, rows: usize| Bf16Head {
                x: DevicePtr::new(xb.ptr() + (first * k * 2) as u64),
                m: rows as u32,
                k: k as u32,
                n: n as u32,
                w: w.as_ptr(),
                out: stoke_cuda::DevicePtrMut::new(out.ptr() + (first * n * 2) as u64),
            };
            let time_entry = |entry: Option<Entry>, label: &str| {
                let launch = head_call(&weights[0], 0, m.min(32))
                    .plan(rt, entry)
                    .unwrap();
                let t = crate::bench::time_calls(rt, 5, iters, |i| {
                    let w = &weights[i % weights.len()];
                    let mut first = 0;
                    while first < m {
                        let r = (m - first).min(32);
                        unsafe { bf16_head(rt, &head_call(w, first, r), entry) }.unwrap();
                        first += r;
                    }
                });
                let gbps = w_bytes as f64 / t.us / 1e3;
                println!(
                    "head {name:<9} m {m:2} {label:<22}: {:8.2} us {gbps:6.0} GB/s ({:5.1}% of copy, {:5.1}% of read) grid {}",
                    t.us,
                    100.0 * gbps / copy_gbps,
                    100.0 * read.us / t.us,
                    launch.grid.0
                );
                json!({"shape": name, "k": k, "n": n, "m": m, "kernel": label,
                    "us": t.us, "gbps": gbps, "of_copy": gbps / copy_gbps,
                    "of_read": read.us / t.us, "launch": launch_json(&launch)})
            };
            rows.push(time_entry(None, "head"));
            // The other entry points of the same row tile.
            let tile = [8, 16, 32]
                .into_iter()
                .find(|&t| m.min(32) <= t)
                .unwrap_or(32);
            let planned = head_call(&weights[0], 0, m.min(32)).plan(rt, None).unwrap();
            for e in ENTRIES.iter().copied() {
                if e.rows as usize == tile && e != planned.entry {
                    rows.push(time_entry(Some(e), e.name));
                }
            }
            if m <= 32 {
                let dense = |w: &DeviceBuffer| Bf16Gemm {
                    x: xb.as_ptr(),
                    m: m as u32,
                    k: k as u32,
                    n: n as u32,
                    w: w.as_ptr(),
                    out: out.as_mut_ptr(),
                    epilogue: Epilogue::Plain,
                    residual: DevicePtr::NULL,
                };
                let t = crate::bench::time_calls(rt, 5, iters, |i| {
                    unsafe { bf16_gemm(rt, &dense(&weights[i % weights.len()])) }.unwrap()
                });
                let gbps = w_bytes as f64 / t.us / 1e3;
                println!(
                    "head {name:<9} m {m:2} {:<22}: {:8.2} us {gbps:6.0} GB/s ({:5.1}% of copy)",
                    "dense [k, n]",
                    t.us,
                    100.0 * gbps / copy_gbps
                );
                rows.push(
                    json!({"shape": name, "k": k, "n": n, "m": m, "kernel": "dense_k_n",
                    "us": t.us, "gbps": gbps, "of_copy": gbps / copy_gbps,
                    "of_read": read.us / t.us}),
                );
            }
        }
        rows.push(json!({"shape": name, "k": k, "n": n, "read_ceiling": read.summary()}));
    }
    let kernels = crate::bench::kernel_reports(rt, BF16_HEAD.file);
    json!({ "copy_gbps": copy_gbps, "runs": rows, "kernels": kernels })
}
