//! The W4A16 GEMM kernels (`kernels/int4_gemm_*.cu`) on the GPU: correctness against
//! `x @ dequantize(packed)` in f64, and speed against the same run's copy rate.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::sync::Arc;
use stoke_cuda::int4::{DeviceInt4, Int4Gemm, int4_gemm};
use stoke_cuda::kernels::int4_gemm::{
    Epilogue, Launch, WordOrder, source_of, wg_eligible, wg_rows_of,
};
use stoke_cuda::kernels::{INT4_GEMM_BATCHED, INT4_GEMM_SWAP, INT4_GEMM_WG};
use stoke_cuda::{DeviceBuffer, DevicePtr, Runtime};
use stoke_formats::bf16;
use stoke_formats::int4::{PackedInt4, ScaleType};
use stoke_formats::reference::relative_error;

/// A random packed weight: nibbles uniform in 0..=15, scales of magnitude ~`1 / sqrt(k)` (so
/// outputs stay O(1)), offsets (asymmetric) around `-8 d`.
pub fn random_weight(
    rng: &mut StdRng,
    k: usize,
    n: usize,
    group: usize,
    scale_type: ScaleType,
    asymmetric: bool,
) -> PackedInt4 {
    let q: Vec<u8> = (0..k * n).map(|_| rng.random_range(0..16u8)).collect();
    let groups = k / group * n;
    let base = 0.25 / (k as f32).sqrt();
    let ds: Vec<f32> = (0..groups)
        .map(|_| base * rng.random_range(0.5f32..1.5))
        .collect();
    let scales = ds.iter().map(|d| scale_type.from_f32(*d)).collect();
    let offsets = asymmetric.then(|| {
        ds.iter()
            .map(|d| scale_type.from_f32(-8.0 * d * rng.random_range(0.7f32..1.3)))
            .collect()
    });
    PackedInt4::pack(&q, k, n, group, scale_type, scales, offsets).expect("valid random weight")
}

pub fn upload(rt: &Arc<Runtime>, p: &PackedInt4) -> DeviceInt4 {
    upload_ordered(rt, p, WordOrder::default())
}

pub fn upload_ordered(rt: &Arc<Runtime>, p: &PackedInt4, order: WordOrder) -> DeviceInt4 {
    DeviceInt4::upload_packed(rt, p, order).expect("upload")
}

/// `len` bf16 values uniform in [-1, 1) (as raw bits).
pub(crate) fn random_bf16(rng: &mut StdRng, len: usize) -> Vec<u16> {
    (0..len)
        .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0)))
        .collect()
}

/// `v` as little-endian bytes (`le` of each value) in a new device buffer of at least one
/// value.
fn put<T: Copy, const N: usize>(rt: &Arc<Runtime>, v: &[T], le: fn(T) -> [u8; N]) -> DeviceBuffer {
    let b = rt.alloc(v.len().max(1) * N).unwrap();
    let bytes: Vec<u8> = v.iter().flat_map(|&x| le(x)).collect();
    unsafe { rt.copy_htod(b.ptr(), &bytes) }.unwrap();
    b
}

pub(crate) fn put_u8(rt: &Arc<Runtime>, v: &[u8]) -> DeviceBuffer {
    put(rt, v, |x| [x])
}

pub(crate) fn put_u16(rt: &Arc<Runtime>, v: &[u16]) -> DeviceBuffer {
    put(rt, v, u16::to_le_bytes)
}

pub(crate) fn put_u32(rt: &Arc<Runtime>, v: &[u32]) -> DeviceBuffer {
    put(rt, v, u32::to_le_bytes)
}

pub(crate) fn put_f32(rt: &Arc<Runtime>, v: &[f32]) -> DeviceBuffer {
    put(rt, v, f32::to_le_bytes)
}

pub(crate) fn get_bf16(buf: &DeviceBuffer) -> Vec<f64> {
    try_get_bf16(buf).unwrap()
}

/// The buffer's bf16 values, or the copy's error (a fault of an earlier kernel shows here).
pub(crate) fn try_get_bf16(buf: &DeviceBuffer) -> Result<Vec<f64>, String> {
    let mut bytes = vec![0u8; buf.bytes()];
    unsafe { buf.runtime().copy_dtoh(&mut bytes, buf.ptr()) }.map_err(|e| e.to_string())?;
    Ok(bytes
        .chunks_exact(2)
        .map(|c| bf16::to_f32(u16::from_le_bytes([c[0], c[1]])) as f64)
        .collect())
}

/// `epilogue(x @ w)` in f64 from the dequantized weight.
fn reference(
    x: &[f32],
    m: usize,
    w: &[f32],
    k: usize,
    n: usize,
    epi: Epilogue,
    residual: &[f32],
    row_scale: Option<&[f32]>,
) -> Vec<f64> {
    let mut acc = vec![0f64; m * n];
    for r in 0..m {
        let out = &mut acc[r * n..(r + 1) * n];
        for kk in 0..k {
            let xv = x[r * k + kk] as f64;
            if xv == 0.0 {
                continue;
            }
            let wr = &w[kk * n..(kk + 1) * n];
            for (o, wv) in out.iter_mut().zip(wr) {
                *o += xv * *wv as f64;
            }
        }
        if let Some(s) = row_scale {
            out.iter_mut().for_each(|v| *v *= s[r] as f64);
        }
    }
    match epi {
        Epilogue::Plain => acc,
        Epilogue::Residual => acc
            .iter()
            .zip(residual)
            .map(|(a, r)| a + *r as f64)
            .collect(),
        Epilogue::SwiGlu => acc
            .chunks_exact(2)
            .map(|gu| gu[0] / (1.0 + (-gu[0]).exp()) * gu[1])
            .collect(),
    }
}

/// A call's residual (`[m, n]`, for [`Epilogue::Residual`], else empty) and row scales (`[m]`,
/// with `with_scale`), on the host and uploaded.
struct EpilogueInputs {
    residual: Vec<f32>,
    rb: Option<DeviceBuffer>,
    rs: Option<Vec<f32>>,
    sb: Option<DeviceBuffer>,
}

fn epilogue_inputs(
    rt: &Arc<Runtime>,
    rng: &mut StdRng,
    (m, n): (usize, usize),
    epi: Epilogue,
    with_scale: bool,
) -> EpilogueInputs {
    let residual: Vec<f32> = if epi == Epilogue::Residual {
        (0..m * n)
            .map(|_| bf16::round(rng.random_range(-3.0f32..3.0)))
            .collect()
    } else {
        Vec::new()
    };
    let rs: Option<Vec<f32>> =
        with_scale.then(|| (0..m).map(|_| rng.random_range(0.2f32..3.0)).collect());
    let rb = (!residual.is_empty()).then(|| {
        let bits: Vec<u16> = residual.iter().map(|v| bf16::from_f32(*v)).collect();
        put_u16(rt, &bits)
    });
    let sb = rs.as_ref().map(|s| put_f32(rt, s));
    EpilogueInputs {
        residual,
        rb,
        rs,
        sb,
    }
}

/// Shapes of the correctness test: (k, n, group, scale type, asymmetric). K values of the issue,
/// N not a multiple of 128, per-channel groups, both scale types, both forms.
const CASES: &[(usize, usize, usize, ScaleType, bool)] = &[
    // k = 4096 at one split gives the swapped kernel's long-stream entry points 64 k-tiles per
    // warp: here with fold units of 2 and 4 k-tiles (the GGUF group of 32, asymmetric; 64).
    (4096, 576, 32, ScaleType::F16, true),
    (4096, 704, 64, ScaleType::Bf16, false),
    (576, 960, 64, ScaleType::F16, true),
    (576, 576, 576, ScaleType::Bf16, false),
    (1536, 4160, 32, ScaleType::F16, true),
    (4096, 1088, 128, ScaleType::Bf16, false),
    (2048, 1472, 64, ScaleType::F16, false),
    (14336, 320, 128, ScaleType::Bf16, true),
];
const ROWS: &[usize] = &[1, 2, 7, 16, 31, 32, 33];
/// Relative (Frobenius) error allowed against the reference's outputs rounded to bf16, the
/// kernels' output type. The rounding alone is ~1.1e-3 of the unrounded reference, and up to
/// 2.1e-3 measured on the 2016 outputs of an m = 7, n = 576 SwiGLU case whose norm a few large
/// products dominate; the report gives the worst such error as `max_relative_error_unrounded`.
const TOLERANCE: f64 = 2e-3;
/// Both device word orders are tested and measured.
const ORDERS: [WordOrder; 2] = [WordOrder::KtMajor, WordOrder::SlabMajor];

/// The kernels (both device word orders; batched, swapped-operand and warpgroup kernels) against the f64 reference over the dequantized weight, on fresh random
/// data with poisoned outputs.
pub fn int4_gemm_matches_dequantized_reference() -> Result<Value, String> {
    let rt = crate::gpu()?;
    drop(rt);
    gemm_matches_reference()
}

fn gemm_matches_reference() -> Result<Value, String> {
    let rt = crate::gpu()?;
    rt.set_poison_allocations(true);
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut worst = 0f64;
    let mut worst_case = String::new();
    let mut worst_unrounded = 0f64; // against the f64 reference before rounding to bf16
    let mut checked = Vec::new();
    for &(k, n, group, st, asym) in CASES {
        let p = random_weight(&mut rng, k, n, group, st, asym);
        let w = p.dequantize();
        let dws = ORDERS.map(|o| upload_ordered(&rt, &p, o));
        for &m in ROWS {
            // Activations rounded to bf16 first, so the reference sees the kernel's inputs.
            let x: Vec<f32> = (0..m * k)
                .map(|_| bf16::round(rng.random_range(-2.0f32..2.0)))
                .collect();
            // x 4 bytes past a 16-byte boundary at m 31 and 33 (the documented alignment is 4
            // bytes): the batched kernels then stage it in 4-byte copies instead of 16-byte ones.
            let x_pad = if m == 31 || m == 33 { 2 } else { 0 };
            let xb = put_u16(
                &rt,
                &std::iter::repeat_n(0u16, x_pad)
                    .chain(x.iter().map(|v| bf16::from_f32(*v)))
                    .collect::<Vec<_>>(),
            );
            let x_ptr = xb.as_ptr::<half::bf16>().add(x_pad);
            let epilogues: &[Epilogue] = if m == 7 || m == 33 {
                &[Epilogue::Plain, Epilogue::Residual, Epilogue::SwiGlu]
            } else {
                &[Epilogue::Plain]
            };
            for &epi in epilogues {
                let scaled: &[bool] = if m == 7 || m == 33 {
                    &[false, true]
                } else {
                    &[false]
                };
                for &with_scale in scaled {
                    let EpilogueInputs {
                        residual,
                        rb,
                        rs,
                        sb,
                    } = epilogue_inputs(&rt, &mut rng, (m, n), epi, with_scale);
                    let cols = epi.out_cols(n);
                    let out = rt.alloc(m * cols * 2).map_err(|e| e.to_string())?;
                    let exact = reference(&x, m, &w, k, n, epi, &residual, rs.as_deref());
                    let want: Vec<f64> = exact
                        .iter()
                        .map(|v| bf16::round(*v as f32) as f64)
                        .collect();
                    // The plan's kernels (swapped up to 8 rows, batched above), also at one
                    // split, where k >= 4096 gives every warp the long-stream entry points'
                    // LONG_STREAM_TILES k-tiles; the warpgroup kernels at every row count
                    // (m 33: n32 then n8), with the plan's splits and one, where the weight and
                    // x allow them (symmetric, groups of 64 and up; x 16-byte aligned for the
                    // copy engine, so not at m 31 and 33).
                    let wg_ok = !asym && wg_eligible(k as u32, group as u32) && x_pad == 0;
                    let runs = dws
                        .iter()
                        .flat_map(|d| [(d, 0, false), (d, 1, false), (d, 0, true), (d, 1, true)]);
                    for (dw, splits, wg) in runs {
                        if (splits == 1 && k < 4096) || (wg && !wg_ok) {
                            continue;
                        }
                        let call = Int4Gemm {
                            x: x_ptr,
                            m: m as u32,
                            out: out.as_mut_ptr(),
                            epilogue: epi,
                            residual: rb.as_ref().map_or(DevicePtr::NULL, |b| b.as_ptr()),
                            row_scale: sb.as_ref().map_or(DevicePtr::NULL, |b| b.as_ptr()),
                            norm: stoke_cuda::int4::NormFold::NONE,
                            qkv: DevicePtr::NULL,
                            splits,
                            wg_rows: u32::from(wg),
                            tune: false,
                        };
                        // Poisoned before each word order's kernel writes it.
                        unsafe { rt.fill_bytes(out.ptr(), 0xFF, out.bytes()) }
                            .map_err(|e| e.to_string())?;
                        let order = dw.order;
                        let what = format!(
                            "seed {seed}: {order:?}{}{} m {m}{} k {k} n {n} group {group} {st:?} {} {epi:?}{}",
                            if wg { " warpgroup" } else { "" },
                            if splits == 1 { " one split" } else { "" },
                            if x_pad > 0 { " (x at +4 bytes)" } else { "" },
                            if asym { "asymmetric" } else { "symmetric" },
                            if with_scale { " row_scale" } else { "" }
                        );
                        // A launch or the copy back failing (a fault in the kernel) names the case.
                        unsafe { int4_gemm(&rt, dw, &call) }.map_err(|e| format!("{what}: {e}"))?;
                        let got = try_get_bf16(&out).map_err(|e| format!("{what}: {e}"))?;
                        if got.iter().any(|v| !v.is_finite()) {
                            return Err(format!(
                                "{what}: unwritten (poisoned) or non-finite outputs"
                            ));
                        }
                        let err = relative_error(&got, &want);
                        let err_unrounded = relative_error(&got, &exact);
                        worst_unrounded = worst_unrounded.max(err_unrounded);
                        if err > worst {
                            worst = err;
                            worst_case = what.clone();
                        }
                        if !(err < TOLERANCE) {
                            return Err(format!("{what}: relative error {err:.3e}"));
                        }
                        checked.push(json!({"warpgroup": wg, "splits": splits, "order": format!("{:?}", dw.order), "m": m, "x_offset_bytes": 2 * x_pad, "k": k, "n": n, "group": group,
                        "epilogue": format!("{epi:?}"), "row_scale": with_scale, "rel_err": err,
                        "rel_err_unrounded": err_unrounded}));
                    }
                }
            }
        }
    }
    rt.set_poison_allocations(false);
    Ok(
        json!({ "seed": seed, "max_relative_error": worst, "worst_case": worst_case, "tolerance": TOLERANCE,
        "max_relative_error_unrounded": worst_unrounded,
        "cases": checked.len(), "shapes": CASES.iter().map(|c| format!("{}x{} g{} {:?} {}", c.0, c.1, c.2, c.3, if c.4 {"asym"} else {"sym"})).collect::<Vec<_>>(), "rows": ROWS }),
    )
}

/// Calls that leave the plan to Stoke (`Int4Gemm::tune`) against the f64 reference, fresh
/// random data, poisoned outputs: the first call of each shape times the candidate kernels
/// (`int4::tune_records` must then hold the shape with two or more), later ones use the
/// choice; a first call while the stream captures a graph uses the plan untimed.
pub fn int4_tuned_plan_matches_reference() -> Result<Value, String> {
    let rt = crate::gpu()?;
    rt.set_poison_allocations(true);
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    // (k, n, group, scale type, asymmetric, rows, captured first)
    let cases: &[(usize, usize, usize, ScaleType, bool, &[usize], bool)] = &[
        (4096, 4096, 128, ScaleType::Bf16, false, &[1, 8, 16], false),
        (8192, 10240, 128, ScaleType::Bf16, false, &[1, 4], false),
        (2048, 1472, 64, ScaleType::F16, false, &[2, 7], false),
        (4096, 576, 32, ScaleType::F16, true, &[1, 16], false),
        (576, 1536, 32, ScaleType::F16, true, &[1, 8], false),
        (1536, 4160, 64, ScaleType::Bf16, false, &[3], true),
    ];
    let mut worst = 0f64;
    let mut checked = Vec::new();
    for &(k, n, group, st, asym, rows, captured) in cases {
        let p = random_weight(&mut rng, k, n, group, st, asym);
        let w = p.dequantize();
        let dw = upload(&rt, &p);
        for &m in rows {
            let x: Vec<f32> = (0..m * k)
                .map(|_| bf16::round(rng.random_range(-2.0f32..2.0)))
                .collect();
            let xb = put_u16(
                &rt,
                &x.iter().map(|v| bf16::from_f32(*v)).collect::<Vec<_>>(),
            );
            let epilogues: &[Epilogue] = if m == 7 || m == 8 {
                &[Epilogue::Plain, Epilogue::Residual, Epilogue::SwiGlu]
            } else {
                &[Epilogue::Plain]
            };
            for &epi in epilogues {
                // The residual call also scales its rows.
                let EpilogueInputs {
                    residual,
                    rb,
                    rs,
                    sb,
                } = epilogue_inputs(&rt, &mut rng, (m, n), epi, epi == Epilogue::Residual);
                let out = rt
                    .alloc(m * epi.out_cols(n) * 2)
                    .map_err(|e| e.to_string())?;
                let call = Int4Gemm {
                    x: xb.as_ptr(),
                    m: m as u32,
                    out: out.as_mut_ptr(),
                    epilogue: epi,
                    residual: rb.as_ref().map_or(DevicePtr::NULL, |b| b.as_ptr()),
                    row_scale: sb.as_ref().map_or(DevicePtr::NULL, |b| b.as_ptr()),
                    norm: stoke_cuda::int4::NormFold::NONE,
                    qkv: DevicePtr::NULL,
                    splits: 0,
                    wg_rows: stoke_cuda::int4::wg_rows_default(),
                    tune: true,
                };
                let what = format!(
                    "tuned m {m} k {k} n {n} group {group} {st:?} {} {epi:?}",
                    if asym { "asymmetric" } else { "symmetric" }
                );
                let tuned = || {
                    stoke_cuda::int4::tune_records().into_iter().find(|r| {
                        (r.m, r.k, r.n, r.epilogue) == (m as u32, k as u32, n as u32, epi)
                    })
                };
                unsafe { rt.fill_bytes(out.ptr(), 0xFF, out.bytes()) }
                    .map_err(|e| e.to_string())?;
                if captured {
                    // The first call inside a capture: nothing timed, nothing recorded.
                    let graph = rt
                        .capture(|| unsafe { int4_gemm(&rt, &dw, &call) })
                        .map_err(|e| format!("{what}: capture: {e}"))?;
                    if tuned().is_some() {
                        return Err(format!("{what}: tuned while capturing a graph"));
                    }
                    graph
                        .launch()
                        .map_err(|e| format!("{what}: graph launch: {e}"))?;
                } else {
                    unsafe { int4_gemm(&rt, &dw, &call) }.map_err(|e| format!("{what}: {e}"))?;
                }
                let want: Vec<f64> = reference(&x, m, &w, k, n, epi, &residual, rs.as_deref())
                    .iter()
                    .map(|v| bf16::round(*v as f32) as f64)
                    .collect();
                let mut errs = Vec::new();
                // Twice: the first call (tuned, or captured), then a call with the choice.
                for pass in 0..2 {
                    if pass == 1 {
                        unsafe { rt.fill_bytes(out.ptr(), 0xFF, out.bytes()) }
                            .map_err(|e| e.to_string())?;
                        unsafe { int4_gemm(&rt, &dw, &call) }
                            .map_err(|e| format!("{what}: {e}"))?;
                    }
                    let got = try_get_bf16(&out).map_err(|e| format!("{what}: {e}"))?;
                    if got.iter().any(|v| !v.is_finite()) {
                        return Err(format!(
                            "{what}: unwritten (poisoned) or non-finite outputs"
                        ));
                    }
                    let err = relative_error(&got, &want);
                    if !(err < TOLERANCE) {
                        return Err(format!(
                            "{what} (call {}): relative error {err:.3e}",
                            pass + 1
                        ));
                    }
                    worst = worst.max(err);
                    errs.push(err);
                }
                // Symmetric weights have two or more candidates at every row count (the swapped
                // or warpgroup kernels and the other); asymmetric ones the plan's kernels at its
                // split count and the neighbours, never a warpgroup kernel (symmetric only).
                let record = tuned();
                match (&record, asym) {
                    (Some(r), false) if r.candidates.len() >= 2 => {}
                    (Some(r), true)
                        if !r.candidates.is_empty()
                            && r.wg_rows == 0
                            && r.candidates
                                .iter()
                                .all(|(e, ..)| !e.starts_with("int4_gemm_wg")) => {}
                    _ => return Err(format!("{what}: unexpected tuning record {record:?}")),
                }
                checked.push(json!({"m": m, "k": k, "n": n, "group": group, "asymmetric": asym,
                    "epilogue": format!("{epi:?}"), "captured_first": captured, "rel_err": errs,
                    "candidates": record.as_ref().map(|r| r.candidates.iter()
                        .map(|(e, s, us)| json!({"entry": e, "splits": s, "us": us})).collect::<Vec<_>>()),
                    "chosen": record.as_ref().map(|r| r.candidates[r.chosen].0),
                    "tuning_ms": record.as_ref().map(|r| r.tuning_ms)}));
            }
        }
    }
    rt.set_poison_allocations(false);
    Ok(
        json!({ "seed": seed, "max_relative_error": worst, "tolerance": TOLERANCE, "cases": checked }),
    )
}

/// Llama-3.1-8B and 70B projection shapes `(name, k, n)`: qkv, o, gate/up (interleaved, one
/// GEMM), down.
pub const BENCH_SHAPES: &[(&str, usize, usize)] = &[
    ("8b_qkv", 4096, 6144),
    ("8b_o", 4096, 4096),
    ("8b_gate_up", 4096, 28672),
    ("8b_down", 14336, 4096),
    ("70b_qkv", 8192, 10240),
    ("70b_o", 8192, 8192),
    ("70b_gate_up", 8192, 57344),
    ("70b_down", 28672, 8192),
];
pub const BENCH_ROWS: &[usize] = &[1, 2, 4, 8, 16, 32];

/// Random group-128 symmetric weights of one bench shape in `order`, enough copies (>= 160 MB)
/// that the L2 (60 MB) never serves the weights, as in a model. The values don't change the
/// speed.
fn bench_weights(
    rt: &Arc<Runtime>,
    rng: &mut StdRng,
    k: usize,
    n: usize,
    order: WordOrder,
) -> Vec<DeviceInt4> {
    weight_copies(rt, rng, k, n, order, 160_000_000)
}

/// Copies of one random group-128 symmetric weight in `order`, at least `min_bytes` in all (one
/// at least).
pub(crate) fn weight_copies(
    rt: &Arc<Runtime>,
    rng: &mut StdRng,
    k: usize,
    n: usize,
    order: WordOrder,
    min_bytes: usize,
) -> Vec<DeviceInt4> {
    let words: Vec<u32> = (0..k * n / 8).map(|_| rng.random()).collect();
    let scales = vec![bf16::from_f32(0.01); k / 128 * n];
    let one = k * n / 2 + k / 128 * n * 2;
    let copies = min_bytes.div_ceil(one).max(1);
    (0..copies)
        .map(|_| {
            DeviceInt4::upload_ordered(rt, (k, n, 128), false, &words, &scales, None, order)
                .unwrap()
        })
        .collect()
}

/// One timed configuration ([`crate::bench::time_calls`]): median µs per call replayed from a
/// CUDA graph, launched back to back from the host, and the host's µs to queue one.
fn time_gemm(
    rt: &Arc<Runtime>,
    dws: &[DeviceInt4],
    call: &Int4Gemm,
    reps: usize,
) -> crate::bench::CallTiming {
    let iters = (200_000_000 / dws[0].bytes()).clamp(20, 2000);
    crate::bench::time_calls(rt, reps, iters, |i| {
        unsafe { int4_gemm(rt, &dws[i % dws.len()], call) }.unwrap()
    })
}

/// The splits per cluster `launch` runs with (`int4::cluster_dims`), or None: unclustered.
fn cluster_splits(rt: &Runtime, launch: &Launch) -> Option<u32> {
    let kernel = rt.kernel_info(source_of(launch.entry), launch.entry).ok()?;
    stoke_cuda::int4::cluster_dims(rt, &kernel, launch)
        .ok()
        .flatten()
        .map(|c| c.1)
}

/// The W4A16 GEMM on the 8B/70B projection shapes, group 128 symmetric bf16 scales: µs,
/// effective GB/s (packed weights + scales + activations + output) and the share of the same
/// run's device-to-device copy rate, for the default word order, or with `STOKE_INT4_BENCH=all`
/// for both orders plus, at one row, a sweep of the split count (CTAs per slab along k).
pub fn bench(copy_gbps: f64) -> Value {
    let all = std::env::var("STOKE_INT4_BENCH").as_deref() == Ok("all");
    let orders: &[WordOrder] = if all { &ORDERS } else { &[WordOrder::KtMajor] };
    let rt = crate::gpu().expect("GPU");
    let (mut rows, mut sweep, mut reads) = (Vec::new(), Vec::new(), Vec::new());
    // The compute side of the roofline: each row's mma count at this rate.
    let mma = crate::bench::mma_rate(&rt);
    let mma_tflops = mma["mma_rate_c8"]["tflops"].as_f64().unwrap_or(0.0);
    // The read side beside the copy rate: one launch reading 1 GiB once.
    let gib = crate::bench::same_size_read(&rt, 1 << 30);
    let read_us = gib.us;
    let read_gbps = (1u64 << 30) as f64 / read_us / 1e3;
    println!(
        "HBM read, one launch over 1 GiB: {read_us:.1} us, {read_gbps:.0} GB/s ({:.1}% of the copy rate; loads {:.1} us, copy engine {:.1} us)",
        100.0 * read_gbps / copy_gbps,
        gib.load_us,
        gib.bulk_us
    );
    bench_shapes(
        &rt, copy_gbps, mma_tflops, orders, all, &mut rows, &mut sweep, &mut reads,
    );
    let regs: Vec<Value> = [INT4_GEMM_SWAP, INT4_GEMM_WG, INT4_GEMM_BATCHED]
        .iter()
        .flat_map(|s| crate::bench::kernel_reports(&rt, s.file))
        .collect();
    json!({ "copy_gbps": copy_gbps, "read_gbps": read_gbps, "read_1gib": gib.summary(), "mma_rate": mma, "runs": rows, "split_sweep": sweep,
        "same_size_read": reads, "kernels": regs })
}

/// The benchmark's rows over every shape.
#[allow(clippy::too_many_arguments)]
fn bench_shapes(
    rt: &Arc<Runtime>,
    copy_gbps: f64,
    mma_tflops: f64,
    orders: &[WordOrder],
    all: bool,
    rows: &mut Vec<Value>,
    sweep: &mut Vec<Value>,
    reads: &mut Vec<Value>,
) {
    let rt = rt.clone();
    let mut rng = StdRng::seed_from_u64(7);
    for &(name, k, n) in BENCH_SHAPES {
        let weights: Vec<Vec<DeviceInt4>> = orders
            .iter()
            .map(|&o| bench_weights(&rt, &mut rng, k, n, o))
            .collect();
        // The ceiling for one launch streaming this matrix: a copy moving its bytes.
        let copy_us = Some({
            let us = crate::bench::same_size_copy_us(&rt, weights[0][0].bytes());
            println!(
                "int4 {name:<12} same-size copy ({} MB moved): {us:8.2} us ({:5.1}% of the copy rate)",
                weights[0][0].bytes() / 1_000_000,
                100.0 * weights[0][0].bytes() as f64 / us / 1e3 / copy_gbps
            );
            us
        });
        // The ceiling at one row: the fastest single launch reading the weight bytes once.
        let read = Some({
            let r = crate::bench::same_size_read(&rt, weights[0][0].bytes());
            let us = r.us;
            println!(
                "int4 {name:<12} same-size read ({} MB read): {us:8.2} us ({:5.1}% of the copy rate; loads {:.2}, copy engine {:.2} us)",
                weights[0][0].bytes() / 1_000_000,
                100.0 * weights[0][0].bytes() as f64 / us / 1e3 / copy_gbps,
                r.load_us,
                r.bulk_us
            );
            reads.push(
                json!({ "shape": name, "bytes": weights[0][0].bytes(), "us": us,
                "load_us": r.load_us, "bulk_us": r.bulk_us, "configs": r.configs }),
            );
            us
        });
        for &m in BENCH_ROWS {
            let xb = put_u16(&rt, &random_bf16(&mut rng, m * k));
            let out = rt.alloc(m * n * 2).unwrap();
            // The plan's kernels without the warpgroup ones (swapped up to 8 rows, batched
            // above) beside the warpgroup kernels at every m. And the shipped call: the plan's kernels tuned per shape on the first call
            // (`Int4Gemm::tune`, on unless STOKE_INT4_TUNE=0).
            let tune = stoke_cuda::int4::tune_default();
            // The tuned call first: in a run where it came fifth, the 70B gate/up points (one
            // 242 MB weight) ran 4-10% slower than the same launch timed second, at m 2-16.
            for (wg, tuned) in [(false, true), (false, false), (true, false)] {
                if tuned && !tune {
                    continue;
                }
                // The shipped default (`default_plan`): SwapAB up to 8 rows, Wgmma from
                // WG_ROWS_DEFAULT; Batched, the kernels for 9-32 rows the warpgroup kernels
                // cannot take.
                let kind = match (wg, m) {
                    _ if tuned => "Tuned",
                    (true, _) => "Wgmma",
                    (false, 0..=8) => "SwapAB",
                    (false, _) => "Batched",
                };
                for dws in &weights {
                    let dw = &dws[0];
                    let mut call = Int4Gemm::plain(xb.as_ptr(), m as u32, out.as_mut_ptr());
                    call.wg_rows = u32::from(wg);
                    if tuned {
                        call.wg_rows = stoke_cuda::int4::wg_rows_default();
                        call.tune = true;
                        // The first call tunes (outside the timing and the graph capture).
                        unsafe { int4_gemm(&rt, dw, &call) }.unwrap();
                        rt.synchronize().unwrap();
                    }
                    let record = stoke_cuda::int4::tune_records().into_iter().find(|r| {
                        tuned
                            && (r.m, r.k, r.n, r.epilogue)
                                == (m as u32, k as u32, n as u32, Epilogue::Plain)
                    });
                    let bytes = dw.bytes() + m * k * 2 + m * n * 2;
                    let plan_with = |splits, wg_rows| {
                        stoke_cuda::kernels::int4_gemm::plan(
                            m as u32,
                            k as u32,
                            n as u32,
                            128,
                            false,
                            Epilogue::Plain,
                            &stoke_cuda::int4::resident_slots(&rt),
                            splits,
                            wg_rows,
                        )
                        .unwrap()[0]
                    };
                    let plan = |splits| {
                        plan_with(
                            splits,
                            // A tuned call's launch: the tuner's choice (the plan's if the
                            // shape had one candidate).
                            record.as_ref().map_or(call.wg_rows, |r| r.wg_rows),
                        )
                    };
                    let timing = time_gemm(&rt, dws, &call, 5);
                    let (us, host_us) = (timing.us, timing.host_us);
                    let gbps = bytes as f64 / us / 1e3;
                    // The launches as run: the plan, and warpgroup splits re-chosen for clusters.
                    let as_run = |l: Launch| {
                        let kernel = rt.kernel_info(source_of(l.entry), l.entry).unwrap();
                        stoke_cuda::int4::clustered(&rt, &kernel, l, k as u32).unwrap()
                    };
                    // A tuned call that chose a split count runs the plan at that count.
                    let launch = match record.as_ref().map_or(0, |r| r.splits) {
                        0 => as_run(plan(0)),
                        splits => plan(splits),
                    };
                    // The launch the shipped plan makes for this call.
                    let shipped = as_run(plan_with(0, stoke_cuda::int4::wg_rows_default()));
                    println!(
                        "int4 {kind} {:?} {name:<12} m {m:2}: {us:8.2} us {gbps:7.0} GB/s ({:5.1}% of copy) splits {} host {host_us:.1} us",
                        dw.order,
                        100.0 * gbps / copy_gbps,
                        launch.splits
                    );
                    let mut row = json!({"variant": kind, "order": format!("{:?}", dw.order), "shape": name, "k": k, "n": n, "m": m, "group": 128, "us": us,
                        "host_us": host_us, "stream_us": timing.stream_us, "weight_bytes": dw.bytes(), "weight_copies": dws.len(), "gbps": gbps, "of_copy": gbps / copy_gbps,
                        "entry": launch.entry, "splits": launch.splits, "grid": [launch.grid.0, launch.grid.1],
                        // With tuning on, the tuned call is the shipped one.
                        "default_plan": if tune { tuned } else { launch == shipped },
                        "cluster": cluster_splits(&rt, &launch)});
                    if let Some(r) = &record {
                        // The tuner's own timings (one launch after an L2 flush, median).
                        row["tuned_candidates"] = json!(
                            r.candidates
                                .iter()
                                .map(|(e, s, us)| json!({"entry": e, "splits": s, "us": us}))
                                .collect::<Vec<_>>()
                        );
                        row["tuning_ms"] = json!(r.tuning_ms);
                    }
                    // The kernel's mma.m16n8k16 count and their time at the same run's rate:
                    // batched, one per 16 rows, 16 k and 8 columns; swapped, one per 8 rows (16 at
                    // m <= 8), 16 k and 16 columns; warpgroup, one wgmma.m64nNk16 (N = 8, 16 or
                    // 32 rows: the launch's entry point) per 16 k and 64 columns, N / 2 of them.
                    let wg_n = wg_rows_of(launch.entry).unwrap_or(32) as usize;
                    // A tuned row counts as the kernel it launched.
                    let kernel_kind = match launch.entry {
                        e if wg_rows_of(e).is_some() => "Wgmma",
                        e if e.contains("swap") => "SwapAB",
                        _ => "Batched",
                    };
                    let mmas = (k / 16) as u64
                        * match kernel_kind {
                            "Batched" => (n / 8 * m.div_ceil(16)) as u64,
                            "Wgmma" => (n / 64 * wg_n / 2) as u64,
                            _ => (n / 16) as u64,
                        };
                    row["mma_count"] = json!(mmas);
                    if mma_tflops > 0.0 {
                        let floor = 2.0 * (mmas * stoke_cuda::kernels::mma_rate::MMA_MACS) as f64
                            / (mma_tflops * 1e6);
                        row["mma_floor_us"] = json!(floor);
                    }
                    if let Some(c) = copy_us {
                        // A copy moving the weight bytes, and the kernel's speed against it.
                        row["same_size_copy_us"] = json!(c);
                        row["of_same_size_copy"] = json!(c / us);
                    }
                    if let Some(r) = read {
                        // One launch reading the weight bytes once, and the kernel against it.
                        row["same_size_read_us"] = json!(r);
                        row["of_same_size_read"] = json!(r / us);
                    }
                    rows.push(row);
                    // The split sweep: at one row with STOKE_INT4_BENCH=all, or at the rows
                    // listed in STOKE_INT4_SWEEP_ROWS (e.g. `1,16`).
                    let sweep_rows = std::env::var("STOKE_INT4_SWEEP_ROWS").unwrap_or_default();
                    let listed = sweep_rows.split(',').any(|s| s.trim() == m.to_string());
                    if !((m == 1 && all) || listed) || tuned {
                        continue;
                    }
                    let mut seen = Vec::new();
                    for splits in [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32] {
                        let l = plan(splits);
                        if seen.contains(&l.splits) {
                            continue;
                        }
                        seen.push(l.splits);
                        call.splits = l.splits;
                        let us = time_gemm(&rt, dws, &call, 3).us;
                        let gbps = bytes as f64 / us / 1e3;
                        let cluster = cluster_splits(&rt, &l);
                        let point = json!({"variant": kind, "order": format!("{:?}", dw.order), "shape": name, "m": m,
                            "splits": l.splits, "ctas": l.grid.0 * l.grid.1, "cluster": cluster, "us": us, "of_copy": gbps / copy_gbps});
                        sweep.push(point);
                    }
                    let best = sweep
                        .iter()
                        .rev()
                        .take(seen.len())
                        .min_by(|a, b| a["us"].as_f64().partial_cmp(&b["us"].as_f64()).unwrap())
                        .unwrap();
                    println!(
                        "    best splits {} ({} CTAs): {:.2} us ({:.1}% of copy)",
                        best["splits"],
                        best["ctas"],
                        best["us"].as_f64().unwrap(),
                        100.0 * best["of_copy"].as_f64().unwrap()
                    );
                }
            }
        }
    }
}

/// A few W4A16 launches to run under a profiler (`ncu`): for each of the named shapes at
/// `m` rows, each word order, the swapped-operand kernel (the plan's at m <= 8) first, then the
/// batched one, then the warpgroup one: two launches each.
pub fn profile_launches(shapes: &[&str], m: usize) {
    let rt = crate::gpu().expect("GPU");
    let mut rng = StdRng::seed_from_u64(7);
    for &(name, k, n) in BENCH_SHAPES.iter().filter(|s| shapes.contains(&s.0)) {
        let xb = put_u16(&rt, &random_bf16(&mut rng, m * k));
        let out = rt.alloc(m * n * 2).unwrap();
        for order in ORDERS {
            let words: Vec<u32> = (0..k * n / 8).map(|_| rng.random()).collect();
            let scales = vec![bf16::from_f32(0.01); k / 128 * n];
            let dw =
                DeviceInt4::upload_ordered(&rt, (k, n, 128), false, &words, &scales, None, order)
                    .unwrap();
            for wg in [false, true] {
                let mut call = Int4Gemm::plain(xb.as_ptr(), m as u32, out.as_mut_ptr());
                call.wg_rows = u32::from(wg);
                for _ in 0..2 {
                    unsafe { int4_gemm(&rt, &dw, &call) }.unwrap();
                }
                rt.synchronize().unwrap();
                println!("profiled {name} m {m} {order:?} warpgroup {wg}");
            }
        }
    }
}

/// `stoke::linear_residual` and `stoke::linear_swiglu` on packed weights (gate/up interleaved
/// with `PackedInt4::interleave_columns`) through backend `B`, against f64 over the
/// dequantized weights: returns the relative errors (residual, swiglu). `x` is `[2, rows, k]`
/// (a 3-D activation), rounded to bf16 first so every backend sees the same inputs.
pub fn linear_epilogues<B: stoke::FusedOps>(
    rows: usize,
    dtype: burn::tensor::DType,
    seed: u64,
) -> (f64, f64) {
    use burn::tensor::{Tensor, TensorData, TensorPrimitive};
    let (k, n) = (256, 192);
    let mut rng = StdRng::seed_from_u64(seed);
    let device = Default::default();
    let wo = random_weight(&mut rng, k, n, 64, ScaleType::F16, true);
    let gate = random_weight(&mut rng, k, n, 64, ScaleType::F16, true);
    let up = random_weight(&mut rng, k, n, 64, ScaleType::F16, false);
    let gu = PackedInt4::interleave_columns(&gate, &up).unwrap();
    let linear = |p: &PackedInt4| -> burn::nn::Linear<B> {
        let w = match B::packed_int4_weight(p.clone(), dtype, &device) {
            Some(t) => Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t)),
            None => Tensor::<B, 2>::from_data(TensorData::new(p.dequantize(), [p.k, p.n]), &device)
                .cast(dtype),
        };
        burn::nn::Linear {
            weight: burn::module::Param::from_tensor(w),
            bias: None,
        }
    };
    let m = 2 * rows;
    let x: Vec<f32> = (0..m * k)
        .map(|_| bf16::round(rng.random_range(-2.0f32..2.0)))
        .collect();
    let r: Vec<f32> = (0..m * n)
        .map(|_| bf16::round(rng.random_range(-3.0f32..3.0)))
        .collect();
    let xt =
        Tensor::<B, 3>::from_data(TensorData::new(x.clone(), [2, rows, k]), &device).cast(dtype);
    let rt =
        Tensor::<B, 3>::from_data(TensorData::new(r.clone(), [2, rows, n]), &device).cast(dtype);
    let got_res = crate::f64s(stoke::linear_residual(xt.clone(), &linear(&wo), rt).into_data());
    let got_glu = crate::f64s(stoke::linear_swiglu(xt, &linear(&gu)).into_data());
    let want_res = reference(&x, m, &wo.dequantize(), k, n, Epilogue::Residual, &r, None);
    let want_glu = reference(
        &x,
        m,
        &gu.dequantize(),
        k,
        2 * n,
        Epilogue::SwiGlu,
        &[],
        None,
    );
    (
        relative_error(&got_res, &want_res),
        relative_error(&got_glu, &want_glu),
    )
}

/// The fused-epilogue linears on `Stoke<Cuda>` with packed weights run the kernels and match
/// f64 over the dequantized weights (bf16 activations and outputs).
pub fn int4_linear_epilogues_match_reference() -> Result<Value, String> {
    crate::gpu()?;
    let seed = crate::seed();
    let calls0 = stoke::cuda::int4_linear::kernel_calls();
    let mut report = json!({ "seed": seed });
    for rows in [1, 5, 20] {
        let (res, glu) =
            linear_epilogues::<crate::StokeCuda>(rows, burn::tensor::DType::BF16, seed);
        report[format!("rows_{rows}")] = json!({ "residual_rel_err": res, "swiglu_rel_err": glu });
        if !(res < 5e-3 && glu < 5e-3) {
            return Err(format!(
                "rows {rows}: relative errors residual {res:.3e}, swiglu {glu:.3e}; {report}"
            ));
        }
    }
    let calls = stoke::cuda::int4_linear::kernel_calls() - calls0;
    if calls != 6 {
        return Err(format!(
            "{calls} kernel calls, expected 6 (the fallback ran): {report}"
        ));
    }
    Ok(report)
}

/// The RMSNorm folded across two W4A16 calls (`NormFold`): a residual producer writes `h`, the
/// gained rows `h * gain` and the per-slab sums of `h^2`; a consumer reads the gained rows and
/// scales each row by `rsqrt(mean(h^2) + eps)` in its epilogue (plain, residual and SwiGLU).
/// Against f64 over the dequantized weights on fresh random data with poisoned buffers: the
/// producer's `h` against `x W1 + r`, its gained rows against `h * gain` rounded, its sums
/// against `h^2` by slab; the consumer against `f (gained W2)` (the kernel's arithmetic) and
/// against `rms_norm(h) W2` (the norm it stands for; bf16 rounding of the normed rows apart).
/// Rows 1-64 (the swapped, warpgroup and batched kernels; two launches past 32), the plan's
/// splits and one, symmetric groups of 64 and asymmetric GGUF groups of 32.
pub fn int4_folded_norm_matches_reference() -> Result<Value, String> {
    let rt = crate::gpu()?;
    rt.set_poison_allocations(true);
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let eps = 1e-5f64;
    let mut worst = [0f64; 4];
    let mut checked = 0usize;
    // (k of the producer, its n = the consumer's k, the consumer's n, group, asymmetric)
    for (k1, n, n2, group, asym) in [
        (576usize, 576usize, 1536usize, 32usize, true),
        (1024, 2048, 1024, 64, false),
    ] {
        let st = ScaleType::F16;
        let p1 = random_weight(&mut rng, k1, n, group, st, asym);
        let p2 = random_weight(&mut rng, n, n2, group, st, asym);
        let (w1, w2) = (p1.dequantize(), p2.dequantize());
        let (d1, d2) = (upload(&rt, &p1), upload(&rt, &p2));
        let gain: Vec<f32> = (0..n)
            .map(|_| bf16::round(rng.random_range(0.5f32..1.5)))
            .collect();
        let gb = put_u16(
            &rt,
            &gain.iter().map(|v| bf16::from_f32(*v)).collect::<Vec<_>>(),
        );
        for m in [1usize, 3, 8, 16, 32, 64] {
            let x: Vec<f32> = (0..m * k1)
                .map(|_| bf16::round(rng.random_range(-2.0f32..2.0)))
                .collect();
            let xb = put_u16(
                &rt,
                &x.iter().map(|v| bf16::from_f32(*v)).collect::<Vec<_>>(),
            );
            let EpilogueInputs { residual, rb, .. } =
                epilogue_inputs(&rt, &mut rng, (m, n), Epilogue::Residual, false);
            for (splits, wg) in [(0u32, false), (1, false), (0, true)] {
                let what = format!(
                    "seed {seed}: m {m} k {k1} n {n} n2 {n2} group {group}{} splits {splits}{}",
                    if asym { " asymmetric" } else { "" },
                    if wg { " warpgroup" } else { "" }
                );
                let h = rt.alloc(m * n * 2).map_err(|e| e.to_string())?;
                let gained = rt.alloc(m * n * 2).map_err(|e| e.to_string())?;
                let ss = rt.alloc(n / 64 * m * 4).map_err(|e| e.to_string())?;
                let producer = Int4Gemm {
                    x: xb.as_ptr(),
                    m: m as u32,
                    out: h.as_mut_ptr(),
                    epilogue: Epilogue::Residual,
                    residual: rb.as_ref().map_or(DevicePtr::NULL, |b| b.as_ptr()),
                    row_scale: DevicePtr::NULL,
                    norm: stoke_cuda::int4::NormFold {
                        gain: gb.as_ptr(),
                        gained: gained.as_mut_ptr(),
                        ss_out: ss.as_mut_ptr(),
                        ..stoke_cuda::int4::NormFold::NONE
                    },
                    qkv: DevicePtr::NULL,
                    splits,
                    wg_rows: u32::from(wg),
                    tune: false,
                };
                unsafe { int4_gemm(&rt, &d1, &producer) }.map_err(|e| format!("{what}: {e}"))?;
                let hv = try_get_bf16(&h).map_err(|e| format!("{what}: {e}"))?;
                let gv = get_bf16(&gained);
                let sv: Vec<f64> = crate::attention::get_f32(&ss)
                    .into_iter()
                    .map(f64::from)
                    .collect();
                if hv.iter().chain(&gv).chain(&sv).any(|v| !v.is_finite()) {
                    return Err(format!("{what}: unwritten (poisoned) producer outputs"));
                }
                let want_h = reference(&x, m, &w1, k1, n, Epilogue::Residual, &residual, None);
                let e_h = relative_error(&hv, &want_h);
                let want_g: Vec<f64> = (0..m * n)
                    .map(|i| bf16::round((hv[i] * gain[i % n] as f64) as f32) as f64)
                    .collect();
                let e_g = relative_error(&gv, &want_g);
                let want_ss: Vec<f64> = (0..n / 64 * m)
                    .map(|i| {
                        let (slab, r) = (i / m, i % m);
                        (0..64).map(|c| hv[r * n + slab * 64 + c].powi(2)).sum()
                    })
                    .collect();
                let e_ss = relative_error(&sv, &want_ss);
                if !(e_h < TOLERANCE && e_g < 1e-3 && e_ss < 1e-5) {
                    return Err(format!(
                        "{what}: producer relative errors h {e_h:.3e}, gained {e_g:.3e}, sums {e_ss:.3e}"
                    ));
                }
                // The row factors from the rounded h, and the rows the norm stands for.
                let f: Vec<f32> = (0..m)
                    .map(|r| {
                        let ms =
                            hv[r * n..(r + 1) * n].iter().map(|v| v * v).sum::<f64>() / n as f64;
                        (1.0 / (ms + eps).sqrt()) as f32
                    })
                    .collect();
                let gained_x: Vec<f32> = gv.iter().map(|v| *v as f32).collect();
                let normed: Vec<f32> = (0..m * n)
                    .map(|i| hv[i] as f32 * f[i / n] * gain[i % n])
                    .collect();
                for epi in [Epilogue::Plain, Epilogue::Residual, Epilogue::SwiGlu] {
                    let EpilogueInputs {
                        residual: r2,
                        rb: rb2,
                        ..
                    } = epilogue_inputs(&rt, &mut rng, (m, n2), epi, false);
                    let y = rt
                        .alloc(m * epi.out_cols(n2) * 2)
                        .map_err(|e| e.to_string())?;
                    let consumer = Int4Gemm {
                        x: gained.as_ptr(),
                        m: m as u32,
                        out: y.as_mut_ptr(),
                        epilogue: epi,
                        residual: rb2.as_ref().map_or(DevicePtr::NULL, |b| b.as_ptr()),
                        row_scale: DevicePtr::NULL,
                        norm: stoke_cuda::int4::NormFold {
                            ss_in: ss.as_ptr(),
                            eps: eps as f32,
                            ..stoke_cuda::int4::NormFold::NONE
                        },
                        qkv: DevicePtr::NULL,
                        splits,
                        wg_rows: u32::from(wg),
                        tune: false,
                    };
                    unsafe { int4_gemm(&rt, &d2, &consumer) }
                        .map_err(|e| format!("{what} {epi:?}: {e}"))?;
                    let yv = try_get_bf16(&y).map_err(|e| format!("{what} {epi:?}: {e}"))?;
                    if yv.iter().any(|v| !v.is_finite()) {
                        return Err(format!("{what} {epi:?}: unwritten (poisoned) outputs"));
                    }
                    let exact = reference(&gained_x, m, &w2, n, n2, epi, &r2, Some(&f));
                    let meant = reference(&normed, m, &w2, n, n2, epi, &r2, None);
                    let (e_y, e_meant) = (relative_error(&yv, &exact), relative_error(&yv, &meant));
                    worst = [
                        worst[0].max(e_h),
                        worst[1].max(e_ss),
                        worst[2].max(e_y),
                        worst[3].max(e_meant),
                    ];
                    checked += 1;
                    if !(e_y < TOLERANCE && e_meant < 1e-2) {
                        return Err(format!(
                            "{what} {epi:?}: consumer relative error {e_y:.3e} (kernel \
                             arithmetic), {e_meant:.3e} (the norm's rows)"
                        ));
                    }
                }
            }
        }
    }
    rt.set_poison_allocations(false);
    Ok(json!({
        "seed": seed, "cases": checked, "max_rel_err_h": worst[0], "max_rel_err_sums": worst[1],
        "max_rel_err_consumer": worst[2], "max_rel_err_vs_normed_rows": worst[3],
        "tolerance": TOLERANCE,
    }))
}
