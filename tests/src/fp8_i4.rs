//! The FP8 GEMM with INT4 weights expanded to E4M3 inside its mainloop
//! (`fp8_i4_gemm_*` in `kernels/fp8_gemm.cu`) and the interleaved activation rows it reads
//! (`quantize_rows_e4m3_bf16` with `order` 1): against f64 references over the same E4M3 codes
//! and the dequantized INT4 weight, and its speed beside the FP8 GEMM on an E4M3 copy.

use crate::fp8::{
    BfOut, Epi, TOL_L1, activations, bf16_epilogue, check_bf16_outputs, checked_rows,
};
use crate::int4::{put_f32, put_u8, put_u16, random_weight, try_get_bf16, upload};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::sync::Arc;
use stoke_cuda::int4::DeviceInt4;
use stoke_cuda::kernels::fp8_gemm::{Fp8Epilogue, Fp8Gemm, Fp8I4Gemm, fp8_gemm_tiles, fp8_i4_gemm};
use stoke_cuda::kernels::fp8_quant::{Fp8RowsParams, quantize_rows};
use stoke_cuda::{DeviceBuffer, DevicePtr, DevicePtrMut, Runtime};
use stoke_formats::fp8::{code_sums32, e4m3_to_f32, interleave_k16, quantize_rows_gained};
use stoke_formats::int4::{PackedInt4, ScaleType};

/// `(m, n, k, group, offsets, f16 scales, gain, rows checked, epilogue)`: one row; GGUF Q4_1
/// blocks (group 32, f16, offsets) with k ending inside a k-block and n inside a tile;
/// per-channel groups of 576 (promotions of 64); the residual and SwiGLU epilogues; an
/// 8B-shaped call with GPTQ-like groups of 128, and the 8B down projection's long k with
/// offsets.
#[allow(clippy::type_complexity)]
const CASES: &[(usize, usize, usize, usize, bool, bool, bool, usize, Epi)] = &[
    (1, 128, 128, 128, false, false, false, 1, Epi::Plain),
    (3, 192, 576, 32, true, true, true, 3, Epi::Plain),
    (130, 320, 576, 576, false, false, true, 130, Epi::Residual),
    (
        200,
        1024,
        1024,
        64,
        true,
        false,
        false,
        200,
        Epi::SwiGluBf16,
    ),
    (300, 512, 4096, 32, false, true, true, 300, Epi::Plain),
    (2048, 4096, 4096, 128, false, false, true, 24, Epi::Plain),
    (77, 4096, 14336, 128, true, false, false, 12, Epi::Plain),
];

/// The interleaved rows of `x` (`[m, k]` bf16 bits) on the device: codes, per-row scales and
/// the sums of each 32 codes, by `quantize_rows` with `order` 1 (`gain`: the bf16 gain).
struct Rows {
    codes: DeviceBuffer,
    scales: DeviceBuffer,
    sums: DeviceBuffer,
}

impl Rows {
    /// Poisoned buffers for `m` rows of `k`.
    fn new(rt: &Arc<Runtime>, m: usize, k: usize) -> Result<Self, String> {
        let alloc = |b: usize| -> Result<DeviceBuffer, String> {
            let buf = rt.alloc(b).map_err(|e| e.to_string())?;
            unsafe { rt.fill_bytes(buf.ptr(), 0xFF, buf.bytes()) }.map_err(|e| e.to_string())?;
            Ok(buf)
        };
        Ok(Self {
            codes: alloc(m * k)?,
            scales: alloc(m * 4)?,
            sums: alloc(m * k / 32 * 4)?,
        })
    }

    /// The row quantization of `x` into these buffers (with `gain`: an RMSNorm input).
    fn params(
        &self,
        x: &DeviceBuffer,
        gain: Option<&DeviceBuffer>,
        m: usize,
        k: usize,
    ) -> Fp8RowsParams {
        Fp8RowsParams {
            x: x.as_ptr(),
            codes: self.codes.as_mut_ptr(),
            scales: self.scales.as_mut_ptr(),
            amax: DevicePtrMut::NULL,
            gain: gain.map_or(DevicePtr::NULL, |g| g.as_ptr()),
            sums: self.sums.as_mut_ptr(),
            rows: m as u32,
            k: k as u32,
            ldx: k as u32,
            eps: 1e-5,
            normalize: u32::from(gain.is_some()),
            order: 1,
        }
    }
}

impl Rows {
    /// The GEMM of these `m` rows of `k` and the weight `w` (`n` columns) with `epilogue`.
    fn call(
        &self,
        w: &DeviceInt4,
        epilogue: Fp8Epilogue,
        (m, n, k): (usize, usize, usize),
        ldo: usize,
    ) -> Fp8I4Gemm {
        Fp8I4Gemm {
            a: self.codes.as_ptr(),
            a_scale: self.scales.as_ptr(),
            a_scale_per_row: true,
            a_sums: self.sums.as_ptr(),
            w: w.operand(),
            epilogue,
            m: m as u32,
            n: n as u32,
            k: k as u32,
            ldo: ldo as u32,
        }
    }
}

fn quantize(
    rt: &Arc<Runtime>,
    x: &DeviceBuffer,
    gain: Option<&DeviceBuffer>,
    m: usize,
    k: usize,
) -> Result<Rows, String> {
    let rows = Rows::new(rt, m, k)?;
    unsafe { quantize_rows(rt, &rows.params(x, gain, m, k)) }.map_err(|e| e.to_string())?;
    Ok(rows)
}

fn get<T: Copy + Default>(buf: &DeviceBuffer, len: usize) -> Result<Vec<T>, String> {
    let mut v = vec![T::default(); len];
    let bytes = unsafe {
        std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), len * std::mem::size_of::<T>())
    };
    unsafe { buf.runtime().copy_dtoh(bytes, buf.ptr()) }.map_err(|e| e.to_string())?;
    Ok(v)
}

/// The f64 output of row `r` of `codes` (natural order) times the dequantized weight `wv`
/// (`[k, n]`), and each element's sum of |a_i w_i|, the row scale applied.
fn reference_row(
    codes: &[u8],
    a_scale: f32,
    r: usize,
    wv: &[f64],
    k: usize,
    n: usize,
) -> (Vec<f64>, Vec<f64>) {
    let (mut y, mut l1) = (vec![0f64; n], vec![0f64; n]);
    for (i, &c) in codes[r * k..(r + 1) * k].iter().enumerate() {
        let a = f64::from(e4m3_to_f32(c));
        if a == 0.0 {
            continue;
        }
        for (j, w) in wv[i * n..(i + 1) * n].iter().enumerate() {
            y[j] += a * w;
            l1[j] += (a * w).abs();
        }
    }
    let s = f64::from(a_scale);
    (
        y.iter().map(|v| v * s).collect(),
        l1.iter().map(|v| v * s).collect(),
    )
}

/// The interleaved row quantization against `quantize_rows_gained` + `interleave_k16` (codes
/// bit for bit, scales within summation order, sums exactly), then the INT4-weight GEMM
/// against the f64 product of those codes and the dequantized weight: each case of `CASES`
/// (symmetric and offset weights, bf16 and f16 scales, promotions of 32, 64 and 128 k), outputs
/// poisoned (NaN) first and the padding checked untouched. The bound per element is the FP8
/// GEMM test's: `|want| 2^-8 + 2^-10 sum |a_i w_i|`.
pub fn fp8_i4_gemm_matches_reference() -> Result<Value, String> {
    let rt = crate::gpu()?;
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut cases = Vec::new();
    let mut worst = 0f64;
    for &(m, n, k, group, offsets, f16, with_gain, checked, epi) in CASES {
        let what = format!(
            "seed {seed}: m {m} n {n} k {k} group {group} offsets {offsets} f16 {f16} gain {with_gain} {epi:?}"
        );
        let (bits, xs) = crate::fp8::bf16_round(&activations(&mut rng, m, k));
        let gain: Option<(Vec<u16>, Vec<f32>)> = with_gain.then(|| {
            crate::fp8::bf16_round(
                &(0..k)
                    .map(|_| rng.random_range(0.5f32..1.5))
                    .collect::<Vec<_>>(),
            )
        });
        let (want_codes, want_scales) =
            quantize_rows_gained(&xs, m, k, gain.as_ref().map(|g| &g.1[..]), 1e-5, with_gain)
                .map_err(|e| e.to_string())?;
        let xb = put_u16(&rt, &bits);
        let gb = gain.as_ref().map(|g| put_u16(&rt, &g.0));
        let rows = quantize(&rt, &xb, gb.as_ref(), m, k).map_err(|e| format!("{what}: {e}"))?;
        let got_codes: Vec<u8> = get(&rows.codes, m * k)?;
        let want_inter = interleave_k16(&want_codes, k);
        if let Some(i) = got_codes.iter().zip(&want_inter).position(|(a, b)| a != b) {
            return Err(format!(
                "{what}: interleaved code {i} (row {}, position {}) is {:#04x}, reference {:#04x}",
                i / k,
                i % k,
                got_codes[i],
                want_inter[i]
            ));
        }
        let got_scales: Vec<f32> = get(&rows.scales, m)?;
        for (r, (g, w)) in got_scales.iter().zip(&want_scales).enumerate() {
            if !((g - w).abs() <= 1e-5 * w.abs()) {
                return Err(format!("{what}: row {r} scale {g}, reference {w}"));
            }
        }
        let got_sums: Vec<f32> = get(&rows.sums, m * k / 32)?;
        let want_sums = code_sums32(&want_codes, k);
        if let Some(i) = got_sums.iter().zip(&want_sums).position(|(a, b)| a != b) {
            return Err(format!(
                "{what}: code sum {i} is {}, reference {}",
                got_sums[i], want_sums[i]
            ));
        }

        let scale_type = if f16 { ScaleType::F16 } else { ScaleType::Bf16 };
        let w: PackedInt4 = random_weight(&mut rng, k, n, group, scale_type, offsets);
        let wv: Vec<f64> = w.dequantize().iter().map(|&v| f64::from(v)).collect();
        let dw = upload(&rt, &w);
        let checked = checked_rows(m, checked);
        let refs: Vec<(Vec<f64>, Vec<f64>)> = checked
            .iter()
            .map(|&r| reference_row(&want_codes, got_scales[r], r, &wv, k, n))
            .collect();
        let BfOut {
            ldo,
            out,
            residual,
            rb,
        } = BfOut::new(&rt, &mut rng, m, n, epi)?;
        let call = rows.call(&dw, bf16_epilogue(epi, &out, &rb, n), (m, n, k), ldo);
        unsafe { fp8_i4_gemm(&rt, &call) }.map_err(|e| format!("{what}: {e}"))?;
        let got = try_get_bf16(&out).map_err(|e| format!("{what}: {e}"))?;
        let case_worst = check_bf16_outputs(
            &what,
            &got,
            &checked,
            &refs,
            (n, ldo),
            epi,
            &residual,
            TOL_L1,
        )?;
        worst = worst.max(case_worst);
        cases.push(
            json!({"m": m, "n": n, "k": k, "group": group, "offsets": offsets, "f16_scales": f16,
            "gain": with_gain, "epilogue": format!("{epi:?}"), "rows_checked": checked.len(),
            "worst_error_over_bound": case_worst}),
        );
    }
    Ok(
        json!({"seed": seed, "tol_l1": TOL_L1, "worst_error_over_bound": worst, "cases": cases, "bench": bench()}),
    )
}

/// The FP8 GEMM benchmark's shapes ([`crate::fp8::BENCH_SHAPES`]) this one times: the 8B
/// projections and the 70B gate|up.
const BENCH_SHAPE_NAMES: &[&str] = &["8b_qkv", "8b_o", "8b_gate_up", "8b_down", "70b_gate_up"];

/// TFLOP/s of the INT4-weight GEMM (plain epilogue) at each shape and M = 512, 2048, 8192:
/// symmetric groups of 128 (GPTQ / RTN) and GGUF Q4_1-like groups of 32 with f16 scales and
/// offsets, beside the FP8 GEMM on an E4M3 copy of the same shape (128 x 128 tiles, the same
/// tile walk) in the same run, and the row quantization that feeds it.
pub fn bench() -> Value {
    let rt = crate::gpu().expect("GPU");
    let mut rng = StdRng::seed_from_u64(14);
    let keep = |name: &str| crate::decode::prefill_env_keeps("STOKE_PREFILL_SHAPES", name);
    let mut runs = Vec::new();
    let shapes = crate::fp8::BENCH_SHAPES
        .iter()
        .filter(|s| BENCH_SHAPE_NAMES.contains(&s.0));
    for &(name, k, n) in shapes {
        if !keep(name.split('_').next().unwrap_or(name)) {
            continue;
        }
        let fp8_w = put_u8(
            &rt,
            &(0..n * k)
                .map(|_| rng.random_range(0x20u8..0x50) | (rng.random::<u8>() & 0x80))
                .collect::<Vec<_>>(),
        );
        let fp8_s = put_f32(&rt, &vec![1e-2; n]);
        let weights = [
            (
                "g128 sym",
                random_weight(&mut rng, k, n, 128, ScaleType::Bf16, false),
            ),
            (
                "g32 f16 offsets",
                random_weight(&mut rng, k, n, 32, ScaleType::F16, true),
            ),
        ];
        let uploaded: Vec<_> = weights
            .iter()
            .map(|(kind, w)| (*kind, upload(&rt, w)))
            .collect();
        for &m in &[512usize, 2048, 8192] {
            let x = put_u16(&rt, &crate::int4::random_bf16(&mut rng, m * k));
            let rows = quantize(&rt, &x, None, m, k).expect("quantize");
            let out = rt.alloc(m * n * 2).expect("out");
            let flop = 2.0 * (m * n * k) as f64;
            let iters = (2e13 / flop).clamp(5.0, 300.0) as usize;
            let mut point = |kind: &str, launch: &dyn Fn()| {
                let t = crate::bench::time_calls(&rt, 3, iters, |_| launch());
                let tflops = flop / t.us / 1e6;
                println!(
                    "{kind:<22} {name:<12} m {m:5}: {:9.2} us {tflops:7.1} TFLOP/s",
                    t.us
                );
                runs.push(json!({"shape": name, "m": m, "n": n, "k": k, "kernel": kind, "us": t.us, "tflops": tflops}));
            };
            let plain = Fp8Epilogue::Plain {
                out: out.as_mut_ptr(),
            };
            let fp8 = Fp8Gemm {
                a: rows.codes.as_ptr(),
                w: fp8_w.as_ptr(),
                a_scale: rows.scales.as_ptr(),
                a_scale_per_row: true,
                w_scale: fp8_s.as_ptr(),
                epilogue: plain,
                m: m as u32,
                n: n as u32,
                k: k as u32,
                ldo: n as u32,
            };
            point("fp8 e4m3 weights", &|| {
                unsafe { fp8_gemm_tiles(&rt, &fp8, false) }.unwrap()
            });
            for (kind, dw) in &uploaded {
                let call = rows.call(dw, plain, (m, n, k), n);
                point(&format!("int4 {kind}"), &|| {
                    unsafe { fp8_i4_gemm(&rt, &call) }.unwrap()
                });
            }
            let p = rows.params(&x, None, m, k);
            let t = crate::bench::time_calls(&rt, 3, 50, |_| {
                unsafe { quantize_rows(&rt, &p) }.unwrap()
            });
            println!(
                "{:<22} {name:<12} m {m:5}: {:9.2} us",
                "quantize interleaved", t.us
            );
            runs.push(json!({"shape": name, "m": m, "k": k, "kernel": "quantize rows interleaved, with sums", "us": t.us}));
        }
    }
    let kernels = crate::bench::kernel_reports(&rt, stoke_cuda::kernels::FP8_GEMM.file);
    json!({"runs": runs, "kernels": kernels})
}
