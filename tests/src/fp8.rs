//! The FP8 prefill GEMM (`kernels/fp8_gemm.cu`) on the GPU: against the f64 reference over the
//! same E4M3 codes and scales (`stoke_formats::fp8::gemm_reference`), poisoned outputs, awkward
//! shapes, and its speed at the Llama projection shapes.

use crate::int4::{put_f32, put_u8, put_u16, try_get_bf16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::sync::Arc;
use stoke_cuda::kernels::FP8_GEMM;
use stoke_cuda::kernels::fp8_gemm::{
    Bf16TcGemm, Fp8Epilogue, Fp8Gemm, bf16_tc_gemm_tiles, fp8_gemm, fp8_gemm_tiles, grid,
    wide_tiles,
};
use stoke_cuda::kernels::fp8_quant::{Fp8RowsParams, quantize_rows as quantize_rows_gpu};
use stoke_cuda::{DeviceBuffer, DevicePtr, DevicePtrMut, Runtime};
use stoke_formats::fp8::{Fp8Weight, e4m3_to_f32, quantize_rows_fused};

/// What a test case's epilogue is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Epi {
    Plain,
    Residual,
    /// Delayed scale at this fraction of the true max |h| (below 1: some values saturate).
    SwiGlu(f32),
    /// `silu(gate) up` as bf16.
    SwiGluBf16,
}

/// `(m, n, k, per_row_scales, rows_checked, epilogue)`: one row; rows, columns and k that end
/// inside a tile (k a multiple of 16 only); per-tensor activation scale; a 8B-shaped call (rows
/// checked: a spread sample); the 8B down projection's long k; the residual and SwiGLU
/// epilogues (one with a scale that saturates; one to bf16).
const CASES: &[(usize, usize, usize, bool, usize, Epi)] = &[
    (1, 128, 128, true, 1, Epi::Plain),
    (3, 200, 336, true, 3, Epi::Plain),
    (130, 264, 4096, true, 130, Epi::Plain),
    (300, 1024, 1040, false, 300, Epi::Plain),
    (2048, 4096, 4096, true, 24, Epi::Plain),
    (77, 4096, 14336, true, 12, Epi::Plain),
    (130, 264, 1040, true, 130, Epi::Residual),
    (1, 256, 128, true, 1, Epi::SwiGlu(1.5)),
    (77, 528, 4096, true, 77, Epi::SwiGlu(1.0)),
    (200, 1032, 2048, true, 200, Epi::SwiGlu(0.5)),
    (130, 1032, 576, true, 130, Epi::SwiGluBf16),
];
/// Allowed error of an element: `|got - want| <= |want| 2^-8 + TOL_L1 sum_i |a_i w_i|` (bf16
/// rounding of the output, and the tensor core's FP8 sums within a 128-k block, which keep
/// fewer bits than f32).
pub(crate) const TOL_L1: f64 = 1.0 / 1024.0;
/// The same for the bf16 operands' sums (f32 in the tensor core): `2^-15` of their L1.
pub(crate) const BF16_TOL_L1: f64 = 1.0 / 32768.0;

fn get_u32(buf: &DeviceBuffer) -> Result<u32, String> {
    let mut b = [0u8; 4];
    unsafe { buf.runtime().copy_dtoh(&mut b, buf.ptr()) }.map_err(|e| e.to_string())?;
    Ok(u32::from_le_bytes(b))
}

/// `x` rounded to bf16: the bits, and their values.
pub(crate) fn bf16_round(x: &[f32]) -> (Vec<u16>, Vec<f32>) {
    let bits: Vec<u16> = x
        .iter()
        .map(|&v| stoke_formats::bf16::from_f32(v))
        .collect();
    let values = bits
        .iter()
        .map(|&b| stoke_formats::bf16::to_f32(b))
        .collect();
    (bits, values)
}

/// Activations with a few outlier columns (as after an RMSNorm of a real model).
pub(crate) fn activations(rng: &mut StdRng, m: usize, k: usize) -> Vec<f32> {
    (0..m * k)
        .map(|i| {
            let v: f32 = rng.random_range(-2.0..2.0);
            if i % k % 97 == 5 { v * 30.0 } else { v }
        })
        .collect()
}

/// The f64 GEMM output of row `r` and each element's sum of |a_i w_i| (both scales applied).
fn reference_row(
    codes: &[u8],
    a_scale: f32,
    r: usize,
    wq: &Fp8Weight,
    wv: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let k = wq.k;
    let a: Vec<f64> = codes[r * k..(r + 1) * k]
        .iter()
        .map(|&c| f64::from(e4m3_to_f32(c)))
        .collect();
    (0..wq.n)
        .map(|j| {
            let s = f64::from(a_scale) * f64::from(wq.scales[j]);
            let (mut dot, mut l1) = (0f64, 0f64);
            for (x, y) in a.iter().zip(&wv[j * k..(j + 1) * k]) {
                dot += x * y;
                l1 += (x * y).abs();
            }
            (dot * s, l1 * s)
        })
        .unzip()
}

/// How far the GEMM's own error (`tol` of each sum, `l1_gate` and `l1_up` the sums' L1
/// norms) can move `h = silu(gate) up`: silu's slope is at most 1.1.
fn h_error(gate: f64, up: f64, l1_gate: f64, l1_up: f64, tol: f64) -> f64 {
    (1.1 * up.abs() + (gate / (1.0 + (-gate).exp())).abs()) * tol * (l1_gate + l1_up)
}

/// An E4M3 code `c` written with scale `s` for the f64 value `hv`, which the GEMM's sums may
/// have moved by `dh`.
struct CodeCheck {
    /// Its error over the bound of one E4M3 rounding (half a step: 2^-4 relative, 2^-10 x
    /// the scale below the normal range) plus `dh`, or what missed it.
    ratio: Result<f64, String>,
    /// Whether `hv` lies beyond the scale's range (the code should be +-448).
    saturates: bool,
    /// Whether `hv` lies within 1% of that range's end (the saturation count may differ by it).
    ambiguous: bool,
}

fn check_code(c: u8, hv: f64, s: f64, dh: f64) -> CodeCheck {
    let q = hv / s;
    let want = q.clamp(-448.0, 448.0) * s;
    let deq = f64::from(e4m3_to_f32(c)) * s;
    let bound = want.abs() / 16.0 + s / 1024.0 + dh;
    let ratio = (deq - want).abs() / bound;
    CodeCheck {
        ratio: if ratio <= 1.0 {
            Ok(ratio)
        } else {
            Err(format!(
                "= {c:#04x} ({deq}), reference h {hv} (scale {s}, bound {bound:.3e})"
            ))
        },
        saturates: q.abs() > 448.0,
        ambiguous: (q.abs() - 448.0).abs() < 1e-2 * 448.0,
    }
}

/// The rows of `m` a case checks: all, or `checked` spread out, the first and the last among
/// them.
pub(crate) fn checked_rows(m: usize, checked: usize) -> Vec<usize> {
    if checked >= m {
        (0..m).collect()
    } else {
        (0..checked).map(|i| i * (m - 1) / (checked - 1)).collect()
    }
}

/// The output of a bf16-output epilogue for `m` rows of `n` columns (a pitch 8 past them),
/// poisoned with NaN, and a random residual `[m, n]` on the host and the device.
pub(crate) struct BfOut {
    pub(crate) ldo: usize,
    pub(crate) out: DeviceBuffer,
    pub(crate) residual: Vec<u16>,
    pub(crate) rb: DeviceBuffer,
}

impl BfOut {
    pub(crate) fn new(
        rt: &Arc<Runtime>,
        rng: &mut StdRng,
        m: usize,
        n: usize,
        epi: Epi,
    ) -> Result<Self, String> {
        let cols = if epi == Epi::SwiGluBf16 { n / 2 } else { n };
        let ldo = cols + 8;
        let out = rt.alloc(m * ldo * 2).map_err(|e| e.to_string())?;
        unsafe { rt.fill_bytes(out.ptr(), 0xFF, out.bytes()) }.map_err(|e| e.to_string())?;
        let residual: Vec<u16> = (0..m * n)
            .map(|_| stoke_formats::bf16::from_f32(rng.random_range(-3.0f32..3.0)))
            .collect();
        let rb = put_u16(rt, &residual);
        Ok(Self {
            ldo,
            out,
            residual,
            rb,
        })
    }
}

/// The bf16-output epilogue `epi` (plain, residual from `residual` `[m, n]`, SwiGLU to bf16)
/// writing `out`.
pub(crate) fn bf16_epilogue(
    epi: Epi,
    out: &DeviceBuffer,
    residual: &DeviceBuffer,
    n: usize,
) -> Fp8Epilogue {
    match epi {
        Epi::Residual => Fp8Epilogue::Residual {
            out: out.as_mut_ptr(),
            residual: residual.as_ptr(),
            ldr: n as u32,
        },
        Epi::SwiGluBf16 => Fp8Epilogue::SwiGluBf16 {
            out: out.as_mut_ptr(),
        },
        _ => Fp8Epilogue::Plain {
            out: out.as_mut_ptr(),
        },
    }
}

/// Checks the bf16 outputs `got` (`[m, ldo]`, poisoned with NaN before the call) of `rows`
/// against `refs` (per checked row: its f64 outputs and their sums of |a_i w_i|) for `epi`:
/// each element within `|want| 2^-8` (the output's rounding) plus `tol` of its sums' L1 norm,
/// the padding columns untouched. Returns the worst error over its bound.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_bf16_outputs(
    what: &str,
    got: &[f64],
    rows: &[usize],
    refs: &[(Vec<f64>, Vec<f64>)],
    (n, ldo): (usize, usize),
    epi: Epi,
    residual: &[u16],
    tol: f64,
) -> Result<f64, String> {
    let cols = if epi == Epi::SwiGluBf16 { n / 2 } else { n };
    let mut worst = 0f64;
    for (ri, &r) in rows.iter().enumerate() {
        let (y, l1) = (&refs[ri].0, &refs[ri].1);
        for j in 0..ldo {
            let g = got[r * ldo + j];
            if j >= cols {
                if !g.is_nan() {
                    return Err(format!("{what}: padding column {j} of row {r} was written"));
                }
                continue;
            }
            let (want, dy) = match epi {
                Epi::SwiGluBf16 => {
                    let (gt, up) = (y[2 * j], y[2 * j + 1]);
                    (
                        gt / (1.0 + (-gt).exp()) * up,
                        h_error(gt, up, l1[2 * j], l1[2 * j + 1], tol),
                    )
                }
                Epi::Residual => (
                    y[j] + f64::from(stoke_formats::bf16::to_f32(residual[r * n + j])),
                    tol * l1[j],
                ),
                _ => (y[j], tol * l1[j]),
            };
            let bound = want.abs() / 256.0 + dy + 1e-30;
            let ratio = (g - want).abs() / bound;
            if !(ratio <= 1.0) {
                return Err(format!(
                    "{what}: out[{r}][{j}] = {g}, reference {want} (bound {bound:.3e})"
                ));
            }
            worst = worst.max(ratio);
        }
    }
    Ok(worst)
}

/// The FP8 GEMM against an f64 reference of the same E4M3 operands and scales: each case of
/// `CASES` (one row, M, N and K off the tiles, per-row and per-tensor activation scales, every
/// epilogue but q|k|v, which `qkv_epilogue_matches_rope_append` checks) on both tile widths
/// (128 x 128 and 128 x 256), outputs poisoned first and padding checked untouched; then the
/// benchmark.
pub fn fp8_gemm_matches_reference() -> Result<Value, String> {
    let rt = crate::gpu()?;
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cases = Vec::new();
    let mut worst = 0f64;
    for &(m, n, k, per_row, checked, epi) in CASES {
        let x = activations(&mut rng, m, k);
        let w: Vec<f32> = (0..n * k)
            .map(|_| rng.random_range(-1.0f32..1.0) / (k as f32).sqrt())
            .collect();
        let wq = Fp8Weight::quantize(&w, n, k, None).map_err(|e| e.to_string())?;
        let (codes, scales) = if per_row {
            quantize_rows_fused(&x, m, k, 0.0, false).map_err(|e| e.to_string())?
        } else {
            // One scale for the tensor.
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let s = stoke_formats::fp8::scale_for(amax);
            let q = stoke_formats::fp8::quantize_with_scale(&x, s);
            (q.codes, vec![s])
        };
        let a_scale = |r: usize| scales[if per_row { r } else { 0 }];
        let wv: Vec<f64> = wq
            .codes
            .iter()
            .map(|&c| f64::from(e4m3_to_f32(c)))
            .collect();
        let rows = checked_rows(m, checked);
        let refs: Vec<(Vec<f64>, Vec<f64>)> = rows
            .iter()
            .map(|&r| reference_row(&codes, a_scale(r), r, &wq, &wv))
            .collect();
        let (ab, wb) = (put_u8(&rt, &codes), put_u8(&rt, &wq.codes));
        let (sa, sw) = (put_f32(&rt, &scales), put_f32(&rt, &wq.scales));
        let what = format!("seed {seed}: m {m} n {n} k {k} per-row scales {per_row} {epi:?}");
        let mut call = Fp8Gemm {
            a: ab.as_ptr(),
            w: wb.as_ptr(),
            a_scale: sa.as_ptr(),
            a_scale_per_row: per_row,
            w_scale: sw.as_ptr(),
            epilogue: Fp8Epilogue::Plain {
                out: stoke_cuda::DevicePtrMut::NULL,
            },
            m: m as u32,
            n: n as u32,
            k: k as u32,
            ldo: 0,
        };
        // Each case on both tile widths (the q|k|v epilogue's are in qkv.rs).
        for wide in [false, true] {
            let tiles = if wide { "128 x 256" } else { "128 x 128" };
            let what = format!("{what} on {tiles} tiles");
            let mut case_worst = 0f64;
            let mut detail = json!({});
            if let Epi::SwiGlu(fraction) = epi {
                let inter = n / 2;
                let ldo = inter + 16;
                // The SwiGLU of every checked row in f64, and its largest |h|.
                let h: Vec<Vec<f64>> = refs
                    .iter()
                    .map(|(y, _)| {
                        (0..inter)
                            .map(|j| y[2 * j] / (1.0 + (-y[2 * j]).exp()) * y[2 * j + 1])
                            .collect()
                    })
                    .collect();
                let amax_checked = h.iter().flatten().fold(0f64, |a, v| a.max(v.abs()));
                let scale = stoke_formats::fp8::scale_for(amax_checked as f32 * fraction);
                let out = rt.alloc(m * ldo).map_err(|e| e.to_string())?;
                let sb = put_f32(&rt, &[scale]);
                let (amax_b, sat_b) = (rt.alloc(4).unwrap(), rt.alloc(4).unwrap());
                unsafe {
                    rt.fill_bytes(out.ptr(), 0xFF, out.bytes())
                        .map_err(|e| e.to_string())?;
                    rt.fill_bytes(amax_b.ptr(), 0, 4)
                        .map_err(|e| e.to_string())?;
                    rt.fill_bytes(sat_b.ptr(), 0, 4)
                        .map_err(|e| e.to_string())?;
                }
                call.ldo = ldo as u32;
                call.epilogue = Fp8Epilogue::SwiGlu {
                    codes: out.as_mut_ptr(),
                    scale: sb.as_ptr(),
                    amax: amax_b.as_mut_ptr(),
                    saturated: sat_b.as_mut_ptr(),
                };
                unsafe { fp8_gemm_tiles(&rt, &call, wide) }.map_err(|e| format!("{what}: {e}"))?;
                let mut got = vec![0u8; m * ldo];
                unsafe { rt.copy_dtoh(&mut got, out.ptr()) }.map_err(|e| e.to_string())?;
                let (amax, sat) = (f32::from_bits(get_u32(&amax_b)?), get_u32(&sat_b)?);
                let s = f64::from(scale);
                let (mut want_sat, mut ambiguous) = (0u32, 0u32);
                for (ri, &r) in rows.iter().enumerate() {
                    for j in 0..ldo {
                        let c = got[r * ldo + j];
                        if j >= inter {
                            if c != 0xFF {
                                return Err(format!(
                                    "{what}: padding code {j} of row {r} was written"
                                ));
                            }
                            continue;
                        }
                        let (g, u) = (refs[ri].0[2 * j], refs[ri].0[2 * j + 1]);
                        let dh = h_error(g, u, refs[ri].1[2 * j], refs[ri].1[2 * j + 1], TOL_L1);
                        let code = check_code(c, h[ri][j], s, dh);
                        want_sat += u32::from(code.saturates);
                        ambiguous += u32::from(code.ambiguous);
                        let ratio = code
                            .ratio
                            .map_err(|e| format!("{what}: code [{r}][{j}] {e}"))?;
                        case_worst = case_worst.max(ratio);
                    }
                }
                if rows.len() == m {
                    if sat.abs_diff(want_sat) > ambiguous {
                        return Err(format!(
                            "{what}: {sat} saturated, reference {want_sat} (+- {ambiguous})"
                        ));
                    }
                    let rel = (f64::from(amax) - amax_checked).abs() / amax_checked;
                    if !(rel <= 1e-2) {
                        return Err(format!("{what}: amax {amax}, reference {amax_checked}"));
                    }
                }
                detail = json!({"scale": scale, "saturated": sat, "reference_saturated": want_sat,
                    "amax": amax, "reference_amax": amax_checked});
            } else {
                let BfOut {
                    ldo,
                    out,
                    residual,
                    rb,
                } = BfOut::new(&rt, &mut rng, m, n, epi)?;
                call.ldo = ldo as u32;
                call.epilogue = bf16_epilogue(epi, &out, &rb, n);
                unsafe { fp8_gemm_tiles(&rt, &call, wide) }.map_err(|e| format!("{what}: {e}"))?;
                let got = try_get_bf16(&out).map_err(|e| format!("{what}: {e}"))?;
                case_worst = check_bf16_outputs(
                    &what,
                    &got,
                    &rows,
                    &refs,
                    (n, ldo),
                    epi,
                    &residual,
                    TOL_L1,
                )?;
            }
            worst = worst.max(case_worst);
            cases.push(json!({"m": m, "n": n, "k": k, "per_row_scales": per_row,
                "epilogue": format!("{epi:?}"), "tiles": tiles, "rows_checked": rows.len(),
                "worst_error_over_bound": case_worst, "detail": detail,
                "grid": tiles_grid(wide, m, n, rt.sm_count)}));
        }
    }
    Ok(
        json!({"seed": seed, "tol_l1": TOL_L1, "worst_error_over_bound": worst, "cases": cases,
        "bench": bench()}),
    )
}

/// `(name, k, n)`: the Llama 3.1 8B / 70B projection shapes (q|k|v fused, gate|up fused).
pub const BENCH_SHAPES: &[(&str, usize, usize)] = &[
    ("8b_qkv", 4096, 6144),
    ("8b_o", 4096, 4096),
    ("8b_gate_up", 4096, 28672),
    ("8b_down", 14336, 4096),
    ("70b_qkv", 8192, 10240),
    ("70b_gate_up", 8192, 57344),
    ("70b_down", 28672, 8192),
];
const BENCH_ROWS: &[usize] = &[512, 2048, 8192];

/// `(m, n, k, rows_checked, epilogue)` of the bf16 instantiation: one row; k ending inside a
/// k-block (344 bf16 = 5.4 blocks of 64); an 8B-shaped call and the 8B down projection's long
/// k (a spread of rows checked); the residual and SwiGLU-to-bf16 epilogues.
const BF16_CASES: &[(usize, usize, usize, usize, Epi)] = &[
    (1, 128, 64, 1, Epi::Plain),
    (3, 200, 344, 3, Epi::Plain),
    (130, 264, 4096, 130, Epi::Plain),
    (2048, 4096, 4096, 24, Epi::Plain),
    (77, 4096, 14336, 12, Epi::Plain),
    (130, 264, 1040, 130, Epi::Residual),
    (130, 1032, 576, 130, Epi::SwiGluBf16),
];

/// The persistent GEMM on bf16 operands (`bf16_tc_gemm`) against an f64 reference of the same
/// bf16 values, each epilogue on both tile widths (128 x 128 and 128 x 256), outputs poisoned
/// (NaN) first and the padding columns checked untouched. Bound per element: `|want| 2^-8` (the output's bf16 rounding) plus `2^-15` of
/// the sum of |a_i w_i|: the tensor core's f32 sums are not IEEE f32 sums; on an H100 (a43cb97)
/// their largest error was 0.91-0.97 of `2^-16` of that sum in every case, so the bound
/// keeps a factor of 2 over it.
pub fn bf16_tc_gemm_matches_reference() -> Result<Value, String> {
    let rt = crate::gpu()?;
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let to_f64 = |v: &[u16]| -> Vec<f64> {
        v.iter()
            .map(|&b| f64::from(stoke_formats::bf16::to_f32(b)))
            .collect()
    };
    let tol = BF16_TOL_L1;
    let (mut cases, mut worst) = (Vec::new(), 0f64);
    for &(m, n, k, checked, epi) in BF16_CASES {
        let a16: Vec<u16> = activations(&mut rng, m, k)
            .iter()
            .map(|&v| stoke_formats::bf16::from_f32(v))
            .collect();
        let w16: Vec<u16> = (0..n * k)
            .map(|_| {
                stoke_formats::bf16::from_f32(rng.random_range(-1.0f32..1.0) / (k as f32).sqrt())
            })
            .collect();
        let (a, w) = (to_f64(&a16), to_f64(&w16));
        let rows = checked_rows(m, checked);
        let (ab, wb) = (put_u16(&rt, &a16), put_u16(&rt, &w16));
        // Each checked row's f64 outputs and their sums of |a_i w_i|.
        let refs: Vec<(Vec<f64>, Vec<f64>)> = rows
            .iter()
            .map(|&r| {
                (0..n)
                    .map(|j| {
                        let (ar, wj) = (&a[r * k..(r + 1) * k], &w[j * k..(j + 1) * k]);
                        ar.iter().zip(wj).fold((0f64, 0f64), |(d, l), (x, v)| {
                            (d + x * v, l + (x * v).abs())
                        })
                    })
                    .unzip()
            })
            .collect();
        for wide in [false, true] {
            let tiles = if wide { "128 x 256" } else { "128 x 128" };
            let what = format!("seed {seed}: bf16 m {m} n {n} k {k} {epi:?} on {tiles} tiles");
            let BfOut {
                ldo,
                out,
                residual,
                rb,
            } = BfOut::new(&rt, &mut rng, m, n, epi)?;
            let call = Bf16TcGemm {
                a: ab.as_ptr(),
                w: wb.as_ptr(),
                epilogue: bf16_epilogue(epi, &out, &rb, n),
                m: m as u32,
                n: n as u32,
                k: k as u32,
                ldo: ldo as u32,
            };
            unsafe { bf16_tc_gemm_tiles(&rt, &call, wide) }.map_err(|e| format!("{what}: {e}"))?;
            let got = try_get_bf16(&out).map_err(|e| format!("{what}: {e}"))?;
            let case_worst =
                check_bf16_outputs(&what, &got, &rows, &refs, (n, ldo), epi, &residual, tol)?;
            worst = worst.max(case_worst);
            cases.push(
                json!({"m": m, "n": n, "k": k, "epilogue": format!("{epi:?}"), "tiles": tiles,
                "rows_checked": rows.len(), "worst_error_over_bound": case_worst}),
            );
        }
    }
    Ok(
        json!({"seed": seed, "tol_l1": tol, "worst_error_over_bound": worst, "cases": cases,
        "bench": bf16_bench()}),
    )
}

/// Random E4M3 codes of moderate magnitude (exponents 4 .. 9, either sign).
fn random_codes(rng: &mut StdRng, len: usize) -> Vec<u8> {
    (0..len)
        .map(|_| rng.random_range(0x20u8..0x50) | (rng.random::<u8>() & 0x80))
        .collect()
}

/// The device buffers of one benchmark point: random operands, scales 0.01, a bf16 output.
struct Point {
    a: DeviceBuffer,
    sa: DeviceBuffer,
    out: DeviceBuffer,
}

impl Point {
    fn new(rt: &Arc<Runtime>, rng: &mut StdRng, m: usize, n: usize, k: usize) -> Self {
        Self {
            a: put_u8(rt, &random_codes(rng, m * k)),
            sa: put_f32(rt, &vec![1e-2; m]),
            out: rt.alloc(m * n * 2).unwrap(),
        }
    }

    /// The plain-epilogue call of this point on weight `w` (`[n, k]` codes, scales `sw`).
    fn call(&self, w: &DeviceBuffer, sw: &DeviceBuffer, m: usize, n: usize, k: usize) -> Fp8Gemm {
        Fp8Gemm {
            a: self.a.as_ptr(),
            w: w.as_ptr(),
            a_scale: self.sa.as_ptr(),
            a_scale_per_row: true,
            w_scale: sw.as_ptr(),
            epilogue: Fp8Epilogue::Plain {
                out: self.out.as_mut_ptr(),
            },
            m: m as u32,
            n: n as u32,
            k: k as u32,
            ldo: n as u32,
        }
    }
}

/// Persistent CTAs of an `m` x `n` call on wide (128 x 256) or narrow (128 x 128) tiles.
fn tiles_grid(wide: bool, m: usize, n: usize, sm_count: u32) -> usize {
    (m.div_ceil(128) * n.div_ceil(if wide { 256 } else { 128 })).min(sm_count as usize)
}

/// Times `launch` (`flop` per call) and reports the point as `kind` at `(name, m, n, k)`.
fn time_point(
    rt: &Arc<Runtime>,
    kind: &str,
    (name, m, n, k): (&str, usize, usize, usize),
    launch: &dyn Fn(),
) -> Value {
    let flop = 2.0 * (m * n * k) as f64;
    let iters = (2e13 / flop).clamp(5.0, 500.0) as usize;
    let timing = crate::bench::time_calls(rt, 3, iters, |_| launch());
    let tflops = flop / timing.us / 1e6;
    println!(
        "{kind:<18} {name:<12} m {m:5}: {:9.2} us {tflops:7.1} TFLOP/s",
        timing.us
    );
    json!({"shape": name, "m": m, "n": n, "k": k, "epilogue": kind, "us": timing.us,
        "tflops": tflops, "grid": grid(m as u32, n as u32, rt.sm_count)})
}

/// TFLOP/s of the FP8 GEMM at each shape with the plain epilogue, and with the epilogue each
/// projection runs in the model: residual (o, down), SwiGLU to E4M3 with a delayed scale and
/// SwiGLU to bf16 (gate|up); each on both tile widths (`n256`: 128 x 256), marked where the
/// tile rule picks it.
pub fn bench() -> Value {
    let rt = crate::gpu().expect("GPU");
    let mut rng = StdRng::seed_from_u64(12);
    let mut rows = Vec::new();
    let (scale, amax, sat) = (
        put_f32(&rt, &[1e-2]),
        put_u8(&rt, &[0; 4]),
        put_u8(&rt, &[0; 4]),
    );
    for &(name, k, n) in BENCH_SHAPES {
        let wb = put_u8(&rt, &random_codes(&mut rng, n * k));
        let sw = put_f32(&rt, &vec![1e-2; n]);
        for &m in BENCH_ROWS {
            let point = Point::new(&rt, &mut rng, m, n, k);
            let call = point.call(&wb, &sw, m, n, k);
            let at = (name, m, n, k);
            let mut epilogues = vec![("fp8 plain", call.epilogue, n, None)];
            if name.ends_with("_o") || name.ends_with("_down") {
                let residual = put_u16(&rt, &crate::int4::random_bf16(&mut rng, m * n));
                let out = point.out.as_mut_ptr();
                let e = Fp8Epilogue::Residual {
                    out,
                    residual: residual.as_ptr(),
                    ldr: n as u32,
                };
                epilogues.push(("fp8 residual", e, n, Some(residual)));
            }
            if name.ends_with("_gate_up") {
                let codes = point.out.as_mut_ptr();
                let e = Fp8Epilogue::SwiGlu {
                    codes,
                    scale: scale.as_ptr(),
                    amax: amax.as_mut_ptr(),
                    saturated: sat.as_mut_ptr(),
                };
                epilogues.push(("fp8 swiglu e4m3", e, n / 2, None));
                let out = point.out.as_mut_ptr();
                epilogues.push((
                    "fp8 swiglu bf16",
                    Fp8Epilogue::SwiGluBf16 { out },
                    n / 2,
                    None,
                ));
            }
            // Each epilogue on both tile widths, and which one the rule picks on this GPU.
            let rule = wide_tiles(m as u32, n as u32, rt.sm_count);
            for (kind, epilogue, ldo, _keep) in epilogues {
                let call = Fp8Gemm {
                    epilogue,
                    ldo: ldo as u32,
                    ..call
                };
                for wide in [false, true] {
                    let kind = if wide {
                        format!("{kind} n256")
                    } else {
                        kind.into()
                    };
                    let mut row = time_point(&rt, &kind, at, &|| {
                        unsafe { fp8_gemm_tiles(&rt, &call, wide) }.unwrap()
                    });
                    row["picked_by_rule"] = json!(wide == rule);
                    row["grid"] = json!(tiles_grid(wide, m, n, rt.sm_count));
                    rows.push(row);
                }
            }
        }
    }
    let kernels = crate::bench::kernel_reports(&rt, FP8_GEMM.file);
    json!({ "runs": rows, "kernels": kernels })
}

/// TFLOP/s of the bf16 instantiation (plain epilogue) at the FP8 benchmark's shapes.
pub fn bf16_bench() -> Value {
    let rt = crate::gpu().expect("GPU");
    let mut rng = StdRng::seed_from_u64(13);
    let mut rows = Vec::new();
    for &(name, k, n) in BENCH_SHAPES {
        let w16 = put_u16(&rt, &crate::int4::random_bf16(&mut rng, n * k));
        for &m in BENCH_ROWS {
            let a16 = put_u16(&rt, &crate::int4::random_bf16(&mut rng, m * k));
            let out = rt.alloc(m * n * 2).unwrap();
            let call = Bf16TcGemm {
                a: a16.as_ptr(),
                w: w16.as_ptr(),
                epilogue: Fp8Epilogue::Plain {
                    out: out.as_mut_ptr(),
                },
                m: m as u32,
                n: n as u32,
                k: k as u32,
                ldo: n as u32,
            };
            // Both tile widths, and which one the rule picks on this GPU.
            let rule = wide_tiles(m as u32, n as u32, rt.sm_count);
            for (kind, wide) in [("bf16 plain", false), ("bf16 plain n256", true)] {
                let mut row = time_point(&rt, kind, (name, m, n, k), &|| {
                    unsafe { bf16_tc_gemm_tiles(&rt, &call, wide) }.unwrap()
                });
                row["picked_by_rule"] = json!(wide == rule);
                row["grid"] = json!(tiles_grid(wide, m, n, rt.sm_count));
                rows.push(row);
            }
        }
    }
    json!({ "runs": rows })
}

/// Two plain-epilogue launches at each named benchmark shape (all when none is named) with
/// `m` rows, for a profiler such as `ncu`.
pub fn profile_launches(shapes: &[&str], m: usize) {
    let rt = crate::gpu().expect("GPU");
    let mut rng = StdRng::seed_from_u64(7);
    let picked = BENCH_SHAPES
        .iter()
        .filter(|s| shapes.is_empty() || shapes.contains(&s.0));
    for &(name, k, n) in picked {
        let wb = put_u8(&rt, &random_codes(&mut rng, n * k));
        let sw = put_f32(&rt, &vec![1e-2; n]);
        let point = Point::new(&rt, &mut rng, m, n, k);
        let call = point.call(&wb, &sw, m, n, k);
        for _ in 0..2 {
            unsafe { fp8_gemm(&rt, &call) }.unwrap();
        }
        rt.synchronize().unwrap();
        println!("profiled fp8 {name} m {m}");
    }
}

/// `(rows, k, ldx)` of the row-quantization test: one row, a row pitch wider than k, the 8B and
/// 405B hidden sizes and the 8B intermediate size.
const ROW_CASES: &[(usize, usize, usize)] = &[
    (1, 576, 576),
    (7, 4096, 4104),
    (300, 4096, 4096),
    (33, 14336, 14336),
    (5, 16384, 16384),
];

/// `kernels/fp8_quant.cu` against `quantize_rows_fused`: codes bit for bit, scales within f32
/// summation order, with and without the RMSNorm factor; a zero row gets scale 1.
pub fn fp8_rows_match_reference() -> Result<Value, String> {
    let rt = crate::gpu()?;
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cases = Vec::new();
    for &(rows, k, ldx) in ROW_CASES {
        let mut x: Vec<f32> = activations(&mut rng, rows, ldx);
        if rows > 2 {
            x[ldx..2 * ldx].iter_mut().for_each(|v| *v = 0.0);
        }
        let (bits, xs) = bf16_round(&x);
        let dense: Vec<f32> = (0..rows)
            .flat_map(|r| xs[r * ldx..r * ldx + k].to_vec())
            .collect();
        let xb = put_u16(&rt, &bits);
        for normalize in [false, true] {
            let (want_codes, want_scales) =
                quantize_rows_fused(&dense, rows, k, 1e-5, normalize).map_err(|e| e.to_string())?;
            let codes = rt.alloc(rows * k).map_err(|e| e.to_string())?;
            let scales = rt.alloc(rows * 4).map_err(|e| e.to_string())?;
            unsafe {
                rt.fill_bytes(codes.ptr(), 0xFF, codes.bytes())
                    .map_err(|e| e.to_string())?;
                rt.fill_bytes(scales.ptr(), 0xFF, scales.bytes())
                    .map_err(|e| e.to_string())?;
            }
            let amax = put_u8(&rt, &[0u8; 4]);
            let p = Fp8RowsParams {
                x: xb.as_ptr(),
                codes: codes.as_mut_ptr(),
                scales: scales.as_mut_ptr(),
                amax: amax.as_mut_ptr(),
                gain: DevicePtr::NULL,
                sums: DevicePtrMut::NULL,
                rows: rows as u32,
                k: k as u32,
                ldx: ldx as u32,
                eps: 1e-5,
                normalize: u32::from(normalize),
                order: 0,
            };
            let what = format!("seed {seed}: rows {rows} k {k} pitch {ldx} normalize {normalize}");
            unsafe { quantize_rows_gpu(&rt, &p) }.map_err(|e| format!("{what}: {e}"))?;
            let mut got = vec![0u8; rows * k];
            let mut sb = vec![0u8; rows * 4];
            unsafe {
                rt.copy_dtoh(&mut got, codes.ptr())
                    .map_err(|e| e.to_string())?;
                rt.copy_dtoh(&mut sb, scales.ptr())
                    .map_err(|e| e.to_string())?;
            }
            if let Some(i) = got.iter().zip(&want_codes).position(|(a, b)| a != b) {
                return Err(format!(
                    "{what}: code {i} (row {}, col {}) is {:#04x}, reference {:#04x} (x {})",
                    i / k,
                    i % k,
                    got[i],
                    want_codes[i],
                    dense[i]
                ));
            }
            let want_amax = dense.iter().fold(0f32, |a, v| a.max(v.abs()));
            let got_amax = f32::from_bits(get_u32(&amax)?);
            if got_amax.to_bits() != want_amax.to_bits() {
                return Err(format!("{what}: amax {got_amax}, reference {want_amax}"));
            }
            let mut worst = 0f64;
            for (r, c) in sb.chunks_exact(4).enumerate() {
                let g = f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                let w = f64::from(want_scales[r]);
                let rel = (g - w).abs() / w.abs();
                if !(rel <= 1e-5) {
                    return Err(format!("{what}: scale of row {r} is {g}, reference {w}"));
                }
                worst = worst.max(rel);
            }
            cases.push(
                json!({"rows": rows, "k": k, "ldx": ldx, "normalize": normalize,
                "codes_equal": true, "max_scale_rel_err": worst}),
            );
        }
    }
    Ok(json!({"seed": seed, "cases": cases}))
}

/// The state machine of a delayed scale on the device (`fp8_delayed_record`) against
/// `stoke_formats::fp8::DelayedScale`, exactly: invocations whose gathered amax is zero, NaN,
/// infinite or a value, more of them than the history holds, each handing on the scale it
/// used.
fn delayed_record_matches_reference(rt: &Arc<Runtime>, rng: &mut StdRng) -> Result<Value, String> {
    use stoke_cuda::kernels::fp8_quant::{
        Fp8DelayedState, Fp8RecordParams, STATE_AMAX, STATE_SATURATED, record,
    };
    use stoke_formats::fp8::{DELAYED_HISTORY, DelayedScale};
    let mut want = DelayedScale::new(DELAYED_HISTORY, 3.0, 1.25).map_err(|e| e.to_string())?;
    let state = put_u8(rt, &Fp8DelayedState::of(&want).to_bytes());
    let used = rt.alloc(4).map_err(|e| e.to_string())?;
    let mut amaxes: Vec<f32> = vec![0.0, f32::NAN, f32::INFINITY, 5.0, 0.0];
    amaxes.extend((0..DELAYED_HISTORY + 5).map(|_| rng.random_range(0.01f32..40.0)));
    for (i, &a) in amaxes.iter().enumerate() {
        let saturated = (i * 7 % 5) as u32;
        unsafe {
            rt.copy_htod(state.ptr() + STATE_AMAX as u64, &a.to_bits().to_le_bytes())
                .and_then(|_| {
                    rt.copy_htod(
                        state.ptr() + STATE_SATURATED as u64,
                        &saturated.to_le_bytes(),
                    )
                })
                .and_then(|_| {
                    let p = Fp8RecordParams {
                        state: state.as_mut_ptr(),
                        used: used.as_mut_ptr(),
                    };
                    record(rt, &p)
                })
                .map_err(|e| e.to_string())?;
        }
        let want_used = want.scale();
        want.record(a, u64::from(saturated));
        let mut b = vec![0u8; std::mem::size_of::<Fp8DelayedState>()];
        unsafe { rt.copy_dtoh(&mut b, state.ptr()) }.map_err(|e| e.to_string())?;
        let got = Fp8DelayedState::from_bytes(&b).ok_or("state size")?;
        let got_used = f32::from_bits(get_u32(&used)?);
        let what = format!("invocation {i} (amax {a}, {saturated} saturated)");
        if got_used.to_bits() != want_used.to_bits() {
            return Err(format!(
                "{what}: used scale {got_used}, reference {want_used}"
            ));
        }
        if got.scale.to_bits() != want.scale().to_bits() || got.amax != 0 || got.saturated != 0 {
            return Err(format!(
                "{what}: next scale {} (reference {}), gathered amax {:#x} and saturated {} not reset",
                got.scale,
                want.scale(),
                got.amax,
                got.saturated
            ));
        }
        if got.to_reference().as_ref() != Some(&want) {
            return Err(format!("{what}: state {got:?}, reference {want:?}"));
        }
    }
    Ok(
        json!({"invocations": amaxes.len(), "final_scale": want.scale(), "saturated": want.saturated}),
    )
}

/// `(m, x multiplier)` of each invocation of the delayed-scale SwiGLU case, in order: the
/// first (per row, starting the history), a single row, a tile edge, all-zero inputs, inputs
/// four times larger (so h is up to 16 times larger than the scale expects: saturated, counted,
/// finite), then back to normal.
const DELAYED_INVOCATIONS: &[(usize, f32)] = &[
    (77, 1.0),
    (1, 1.0),
    (130, 1.0),
    (64, 0.0),
    (77, 4.0),
    (100, 1.0),
];

/// The gate|up projection's SwiGLU written in E4M3 with a delayed scale
/// (`stoke_cuda::prefill_gemm::fp8_swiglu_delayed`) and the down projection reading those rows
/// (`fp8_linear_rows`), invocation after invocation (`DELAYED_INVOCATIONS`), against f64
/// references on the same operands; the rows' bf16 dequantization exactly; and the record step
/// alone against the reference state machine (`delayed_record_matches_reference`).
pub fn fp8_delayed_swiglu_matches_reference() -> Result<Value, String> {
    use stoke_cuda::prefill_gemm::{
        DeviceDelayedScale, DeviceFp8Weight, Fp8LinearEpilogue, fp8_linear_rows, fp8_swiglu_delayed,
    };
    use stoke_formats::fp8::{DELAYED_HISTORY, DelayedScale};
    let rt = crate::gpu()?;
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let record = delayed_record_matches_reference(&rt, &mut rng)?;
    let (k, inter, n_down) = (256usize, 144usize, 200usize);
    let weight = |rng: &mut StdRng, n: usize, k: usize| -> Result<(Fp8Weight, Vec<f64>), String> {
        let w: Vec<f32> = (0..n * k)
            .map(|_| rng.random_range(-1.0f32..1.0) / (k as f32).sqrt())
            .collect();
        let q = Fp8Weight::quantize(&w, n, k, None).map_err(|e| e.to_string())?;
        let v = q.codes.iter().map(|&c| f64::from(e4m3_to_f32(c))).collect();
        Ok((q, v))
    };
    let (gu, gu_v) = weight(&mut rng, 2 * inter, k)?;
    let (down, down_v) = weight(&mut rng, n_down, inter)?;
    let (gu_d, down_d) = (
        DeviceFp8Weight::upload(&rt, &gu).map_err(|e| e.to_string())?,
        DeviceFp8Weight::upload(&rt, &down).map_err(|e| e.to_string())?,
    );
    let state = DeviceDelayedScale::new(&rt, 1.0, 1.0).map_err(|e| e.to_string())?;
    let mut want_state = DelayedScale::new(DELAYED_HISTORY, 1.0, 1.0).map_err(|e| e.to_string())?;
    let mut cases = Vec::new();
    let mut worst = 0f64;
    for (inv, &(m, mult)) in DELAYED_INVOCATIONS.iter().enumerate() {
        let what = format!("seed {seed}: invocation {inv} (m {m}, x times {mult})");
        let x: Vec<f32> = activations(&mut rng, m, k)
            .iter()
            .map(|v| v * mult)
            .collect();
        let (bits, xs) = bf16_round(&x);
        let (x_codes, x_scales) =
            quantize_rows_fused(&xs, m, k, 0.0, false).map_err(|e| e.to_string())?;
        let xb = put_u16(&rt, &bits);
        let rows = unsafe { fp8_swiglu_delayed(&rt, &gu_d, xb.as_ptr(), m as u32, &state) }
            .map_err(|e| format!("{what}: {e}"))?;
        let first = inv == 0;
        if rows.per_row != first || (rows.m, rows.k) != (m as u32, inter as u32) {
            return Err(format!("{what}: rows {rows:?}"));
        }
        let mut codes = vec![0u8; m * inter];
        let mut sb = vec![0u8; 4 * if first { m } else { 1 }];
        unsafe {
            rt.copy_dtoh(&mut codes, rows.codes().addr())
                .and_then(|_| rt.copy_dtoh(&mut sb, rows.scales().addr()))
                .map_err(|e| e.to_string())?;
        }
        let scales: Vec<f32> = sb
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let scale_of = |r: usize| scales[if first { r } else { 0 }];
        // The scale a later invocation used is the one the state held before it.
        if !first && scales[0].to_bits() != want_state.scale().to_bits() {
            return Err(format!(
                "{what}: used scale {}, reference {}",
                scales[0],
                want_state.scale()
            ));
        }
        // h in f64 over the same x codes, and what the GEMM's own rounding may move it.
        let (mut want_sat, mut ambiguous, mut amax_ref) = (0u64, 0u64, 0f64);
        let mut case_worst = 0f64;
        for r in 0..m {
            let (y, l1) = reference_row(&x_codes, x_scales[r], r, &gu, &gu_v);
            let s = f64::from(scale_of(r));
            for j in 0..inter {
                let (g, u) = (y[2 * j], y[2 * j + 1]);
                let hv = g / (1.0 + (-g).exp()) * u;
                amax_ref = amax_ref.max(hv.abs());
                // The first invocation rounds h to bf16 before its per-row quantization.
                let dh = h_error(g, u, l1[2 * j], l1[2 * j + 1], TOL_L1)
                    + if first { hv.abs() / 256.0 } else { 0.0 };
                let code = check_code(codes[r * inter + j], hv, s, dh * (1.0 + 1.0 / 16.0));
                want_sat += u64::from(code.saturates);
                ambiguous += u64::from(code.ambiguous);
                let ratio = code
                    .ratio
                    .map_err(|e| format!("{what}: code [{r}][{j}] {e}"))?;
                case_worst = case_worst.max(ratio);
            }
        }
        // What the device gathered, from its history; the rest of the state exactly.
        let got_state = state.read().map_err(|e| format!("{what}: {e}"))?;
        let sat = got_state.saturated - want_state.saturated;
        let (hist, next, _) = got_state.history();
        let recorded = amax_ref > 0.0;
        let amax = if recorded {
            hist[(next + DELAYED_HISTORY - 1) % DELAYED_HISTORY]
        } else {
            0.0
        };
        if recorded && !((f64::from(amax) - amax_ref).abs() <= 1e-2 * amax_ref) {
            return Err(format!(
                "{what}: gathered amax {amax}, reference {amax_ref}"
            ));
        }
        if sat.abs_diff(want_sat) > ambiguous || (first && sat != 0) {
            return Err(format!(
                "{what}: {sat} saturated, reference {want_sat} (+- {ambiguous})"
            ));
        }
        want_state.record(amax, sat);
        if got_state != want_state {
            return Err(format!(
                "{what}: state {got_state:?}, reference {want_state:?}"
            ));
        }
        if mult == 0.0 && codes.iter().any(|&c| c & 0x7F != 0) {
            return Err(format!("{what}: all-zero inputs gave non-zero codes"));
        }
        // The rows' bf16 values: bf16(e4m3 * scale), exactly.
        let deq = rt.alloc(m * inter * 2).map_err(|e| e.to_string())?;
        unsafe { rows.dequantize(&rt, deq.as_mut_ptr()) }.map_err(|e| format!("{what}: {e}"))?;
        let got_deq = try_get_bf16(&deq).map_err(|e| format!("{what}: {e}"))?;
        for (i, (&c, &g)) in codes.iter().zip(&got_deq).enumerate() {
            let want = stoke_formats::bf16::to_f32(stoke_formats::bf16::from_f32(
                e4m3_to_f32(c) * scale_of(i / inter),
            ));
            if g.to_bits() != f64::from(want).to_bits() {
                return Err(format!(
                    "{what}: dequantized [{}][{}] = {g}, reference {want}",
                    i / inter,
                    i % inter
                ));
            }
        }
        // The down projection on the rows as they are.
        let out = rt.alloc(m * n_down * 2).map_err(|e| e.to_string())?;
        unsafe { rt.fill_bytes(out.ptr(), 0xFF, out.bytes()) }.map_err(|e| e.to_string())?;
        unsafe {
            fp8_linear_rows(
                &rt,
                &down_d,
                &rows,
                out.as_mut_ptr(),
                Fp8LinearEpilogue::Plain,
            )
        }
        .map_err(|e| format!("{what}: {e}"))?;
        let got = try_get_bf16(&out).map_err(|e| format!("{what}: {e}"))?;
        let dense: Vec<f64> = (0..m)
            .flat_map(|r| got[r * n_down..(r + 1) * n_down].to_vec())
            .collect();
        let all: Vec<usize> = (0..m).collect();
        let refs: Vec<(Vec<f64>, Vec<f64>)> = all
            .iter()
            .map(|&r| reference_row(&codes, scale_of(r), r, &down, &down_v))
            .collect();
        let down_worst = check_bf16_outputs(
            &what,
            &dense,
            &all,
            &refs,
            (n_down, n_down),
            Epi::Plain,
            &[],
            TOL_L1,
        )?;
        if dense.iter().any(|v| !v.is_finite()) {
            return Err(format!(
                "{what}: the down projection wrote non-finite values"
            ));
        }
        worst = worst.max(case_worst).max(down_worst);
        cases.push(
            json!({"m": m, "x_times": mult, "per_row": first, "scale": scales[0],
            "saturated": sat, "reference_saturated": want_sat, "amax": amax,
            "reference_amax": amax_ref, "worst_code_error_over_bound": case_worst,
            "worst_down_error_over_bound": down_worst}),
        );
    }
    Ok(
        json!({"seed": seed, "record": record, "k": k, "inter": inter, "n_down": n_down,
        "worst_error_over_bound": worst, "invocations": cases}),
    )
}

/// `linear(rms_norm(x, gamma), W)` on `Stoke<Cuda>` with FP8 prefill on, for a pinned bf16
/// weight: the norm is deferred, and the plain, residual and SwiGLU projections read `x`'s
/// E4M3 rows with RMSNorm's row factor in their scales and a copy of `diag(gamma) W` in E4M3.
/// Against the f64 product of the same quantized operands
/// (`quantize_rows_fused` with `normalize`, `Fp8Weight` of the folded weight). Then the
/// deferred norm read as a tensor against the RMSNorm reference, and a second gain on the same
/// weight (not folded: its normalized rows on the plain E4M3 copy) against the f64 linear.
pub fn fp8_folded_norm_matches_reference() -> Result<Value, String> {
    use burn::module::Param;
    use burn::tensor::{DType, Tensor, TensorData};
    use stoke::cuda::prefill_linear as fl;
    let rt = crate::gpu()?;
    rt.set_poison_allocations(true);
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed ^ 0xf01d);
    let device = Default::default();
    // Rows past the W4A16 kernels' 64, not a multiple of the tile; gate|up of 2 x 192.
    let (m, k, n, eps) = (200usize, 512usize, 384usize, 1e-5f64);
    let (_, xs) = bf16_round(&activations(&mut rng, m, k));
    let gains = |rng: &mut StdRng| {
        let g: Vec<f32> = (0..k).map(|_| rng.random_range(0.2f32..2.5)).collect();
        bf16_round(&g).1
    };
    let (gamma, gamma2) = (gains(&mut rng), gains(&mut rng));
    let bound = 1.0 / (k as f32).sqrt();
    let w: Vec<f32> = (0..k * n)
        .map(|_| rng.random_range(-bound..bound))
        .collect();
    let w = bf16_round(&w).1;
    let res: Vec<f32> = (0..m * n).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    let res = bf16_round(&res).1;
    let tensor2 = |v: &[f32], d: [usize; 2]| {
        Tensor::<crate::StokeCuda, 2>::from_data(TensorData::new(v.to_vec(), d), &device)
            .cast(DType::BF16)
    };
    // The gains' plan folds them into FP8 projections; the weight's runs its prefill in FP8.
    let fold = stoke::WeightPlan {
        fold_into_fp8: true,
        ..Default::default()
    };
    let tensor1 = |v: &[f32]| {
        stoke::cuda::prepare(
            Tensor::<crate::StokeCuda, 1>::from_data(TensorData::new(v.to_vec(), [k]), &device)
                .cast(DType::BF16),
            fold,
        )
    };
    let xt = tensor2(&xs, [m, k]);
    let wt = stoke::cuda::prepare(
        tensor2(&w, [k, n]),
        stoke::WeightPlan {
            prefill: stoke::PrefillMode::Fp8,
            ..Default::default()
        },
    );
    let linear = burn::nn::Linear {
        weight: Param::from_tensor(wt.clone()),
        bias: None,
    };
    let (gt, gt2) = (tensor1(&gamma), tensor1(&gamma2));

    let folded0 = fl::folded_norm_calls();
    let normed = stoke::rms_norm(xt.clone(), gt, eps);
    let y = burn::tensor::module::linear(normed.clone(), wt.clone(), None);
    let yr = stoke::linear_residual(normed.clone(), &linear, tensor2(&res, [m, n]));
    let yg = stoke::linear_swiglu(normed.clone(), &linear);
    let folded = fl::folded_norm_calls() - folded0;
    let (got, got_r, got_g) = (
        crate::f64s(y.into_data()),
        crate::f64s(yr.into_data()),
        crate::f64s(yg.into_data()),
    );
    let got_normed = crate::f64s(normed.into_data());
    let folded_after = fl::folded_norm_calls();
    let normed2 = stoke::rms_norm(xt, gt2, eps);
    let got2 = crate::f64s(burn::tensor::module::linear(normed2, wt, None).into_data());
    let folded2 = fl::folded_norm_calls() - folded_after;
    rt.set_poison_allocations(false);
    let what = format!("seed {seed}: x [{m}, {k}], W [{k}, {n}]");
    if folded != 3 || folded2 != 0 {
        return Err(format!(
            "{what}: {folded} of 3 projections read the folded copy (expected 3), {folded2} after a second gain (expected 0)"
        ));
    }

    // The reference over the same quantized operands.
    let (codes, scales) =
        quantize_rows_fused(&xs, m, k, eps as f32, true).map_err(|e| e.to_string())?;
    let folded_nk: Vec<f32> = (0..n)
        .flat_map(|j| (0..k).map(move |i| (i, j)))
        .map(|(i, j)| w[i * n + j] * gamma[i])
        .collect();
    let wq = Fp8Weight::quantize(&folded_nk, n, k, None).map_err(|e| e.to_string())?;
    let want = stoke_formats::fp8::gemm_reference(&codes, &scales, m, &wq);
    let want_r: Vec<f64> = want
        .iter()
        .zip(&res)
        .map(|(a, b)| a + f64::from(*b))
        .collect();
    // Each output against its row's largest |value| (in 2^-8 of it): the GEMM's f32 sums and
    // its bf16 output (2^-9 of the value), the residual's add in f32 before that rounding.
    let row_err = crate::dense::row_scaled_error;
    let (err, err_r) = (row_err(&got, &want, n), row_err(&got_r, &want_r, n));
    let tol = 2.0;
    if !(err <= tol && err_r <= tol) {
        return Err(format!(
            "{what}: folded linear {err:.3}, with the residual {err_r:.3} x 2^-8 of the row's largest value (limit {tol})"
        ));
    }
    // SwiGLU to E4M3 (per row at a delayed scale's first invocation): half an E4M3 step of each
    // value (2^-4), bf16's below it.
    let inter = n / 2;
    let silu = |g: f64| g / (1.0 + (-g).exp());
    let want_g: Vec<f64> = want.chunks(2).map(|p| silu(p[0]) * p[1]).collect();
    let mut err_g = 0f64;
    for (gr, wr) in got_g.chunks(inter).zip(want_g.chunks(inter)) {
        let amax = wr.iter().fold(1e-30f64, |a, v| a.max(v.abs()));
        for (a, b) in gr.iter().zip(wr) {
            let e = (a - b).abs() / (b.abs() / 16.0 + amax / 128.0);
            err_g = err_g.max(if a.is_finite() { e } else { f64::INFINITY });
        }
    }
    if !(err_g <= 1.0) {
        return Err(format!(
            "{what}: folded SwiGLU {err_g:.2} x (half an E4M3 step + 2^-7 of the row's largest value)"
        ));
    }
    let x64: Vec<f64> = xs.iter().map(|&v| f64::from(v)).collect();
    let g64 = |g: &[f32]| g.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>();
    // Against the reference rounded to bf16, as the kernel's output is.
    let want_normed: Vec<f64> = stoke_formats::reference::rms_norm(&x64, &g64(&gamma), k, eps)
        .iter()
        .map(|&v| f64::from(stoke_formats::bf16::round(v as f32)))
        .collect();
    let err_normed = stoke_formats::reference::relative_error(&got_normed, &want_normed);
    if !(err_normed <= 1e-3) {
        return Err(format!(
            "{what}: the deferred norm read as a tensor: relative error {err_normed:.2e}"
        ));
    }
    let normed2_64 = stoke_formats::reference::rms_norm(&x64, &g64(&gamma2), k, eps);
    let want2: Vec<f64> = (0..m)
        .flat_map(|r| {
            let row = &normed2_64[r * k..(r + 1) * k];
            let w = &w;
            (0..n).map(move |j| {
                (0..k)
                    .map(|i| row[i] * f64::from(w[i * n + j]))
                    .sum::<f64>()
            })
        })
        .collect();
    let err2 = stoke_formats::reference::relative_error(&got2, &want2);
    if !(err2 <= 0.05) {
        return Err(format!(
            "{what}: a second gain on the same weight (plain E4M3 copy): relative error {err2:.2e} against the f64 linear"
        ));
    }
    Ok(
        json!({"seed": seed, "m": m, "k": k, "n": n, "folded_calls": folded,
        "linear_row_half_ulps": err, "residual_row_half_ulps": err_r, "swiglu_err_units": err_g,
        "normed_rel_err": err_normed, "second_gain_rel_err": err2}),
    )
}
