//! The prefill GEMM's q|k|v epilogue (`fp8_gemm_qkv`, `bf16_tc_gemm_qkv` in
//! `kernels/fp8_gemm.cu`) on the GPU: every byte it writes (q, the BF16 cache, the FP8 / INT4
//! mirror rows and scales, the lengths) against the plain epilogue followed by `rope_append`
//! into a second cache, and q, k and v against the f64 reference of the GEMM and RoPE; then its
//! time beside those two launches.

use crate::attention::get_bytes;
use crate::int4::{get_bf16, put_f32, put_u8, put_u16, put_u32};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::sync::Arc;
use stoke_cuda::kernels::decode_attention::KvFormat;
use stoke_cuda::kernels::fp8_gemm::{
    Bf16TcGemm, Fp8Epilogue, Fp8Gemm, bf16_tc_gemm, bf16_tc_gemm_tiles, fp8_gemm, fp8_gemm_tiles,
};
use stoke_cuda::kv::DeviceKvCache;
use stoke_cuda::{DeviceBuffer, Runtime};
use stoke_formats::fp8::{Fp8Weight, e4m3_to_f32, quantize_rows_fused, rope_head};

/// One case: the heads, head dim and K of the projection, the cache's mirror and rotation
/// block, FP8 operands (else bf16), and the packed sequences `(slot, first position, rows)`.
struct Case {
    heads: usize,
    kv_heads: usize,
    d: usize,
    k: usize,
    format: KvFormat,
    block: u32,
    fp8: bool,
    seqs: &'static [(u32, u32, usize)],
}

/// d = 128 and 64 (two heads per tile, a q and a k head sharing one, SmolLM2's 15 heads
/// ending in half a tile); FP8 and INT4 mirrors, whole-head, partial and no rotation, no
/// mirror; single-token sequences, positions past 8k, slots out of order, rows ending inside a
/// tile; Llama-3.1-8B-shaped calls (FP8, bf16) and a 70B-shaped one (FP8). Every case runs on
/// both tile widths.
const CASES: &[Case] = &[
    Case {
        heads: 8,
        kv_heads: 2,
        d: 128,
        k: 256,
        format: KvFormat::Fp8,
        block: 128,
        fp8: false,
        seqs: &[(2, 8190, 1), (0, 0, 130), (1, 4000, 69)],
    },
    Case {
        heads: 9,
        kv_heads: 3,
        d: 64,
        k: 576,
        format: KvFormat::Int4,
        block: 64,
        fp8: true,
        seqs: &[(1, 0, 77)],
    },
    Case {
        heads: 4,
        kv_heads: 4,
        d: 128,
        k: 128,
        format: KvFormat::Bf16,
        block: 0,
        fp8: true,
        seqs: &[(1, 9000, 1)],
    },
    Case {
        heads: 8,
        kv_heads: 1,
        d: 64,
        k: 192,
        format: KvFormat::Fp8,
        block: 16,
        fp8: false,
        seqs: &[(0, 100, 64), (2, 0, 1), (1, 0, 66)],
    },
    Case {
        heads: 8,
        kv_heads: 2,
        d: 128,
        k: 512,
        format: KvFormat::Int4,
        block: 0,
        fp8: false,
        seqs: &[(0, 5, 3), (1, 8300, 40)],
    },
    Case {
        heads: 32,
        kv_heads: 8,
        d: 128,
        k: 4096,
        format: KvFormat::Int4,
        block: 128,
        fp8: true,
        seqs: &[(0, 0, 2048), (1, 0, 128), (2, 640, 128)],
    },
    Case {
        heads: 32,
        kv_heads: 8,
        d: 128,
        k: 4096,
        format: KvFormat::Fp8,
        block: 128,
        fp8: false,
        seqs: &[(0, 0, 1024), (2, 300, 1024)],
    },
    // The 70B q|k|v (k 8,192): the shortest k the FP8 rule gives wide tiles.
    Case {
        heads: 64,
        kv_heads: 8,
        d: 128,
        k: 8192,
        format: KvFormat::Int4,
        block: 128,
        fp8: true,
        seqs: &[(0, 0, 2048)],
    },
];

/// Rows whose f64 reference is computed in a large case (all of them up to this many).
const CHECKED_ROWS: usize = 48;

/// The RoPE table of `positions` x `d / 2` frequencies, `(cos, sin)` f32, as the decoder holds it.
fn rope_table(positions: usize, d: usize) -> Vec<f32> {
    let mut t = Vec::with_capacity(positions * d);
    for p in 0..positions {
        for i in 0..d / 2 {
            let angle = p as f64 * 500000f64.powf(-((2 * i) as f64) / d as f64);
            t.push(angle.cos() as f32);
            t.push(angle.sin() as f32);
        }
    }
    t
}

/// The GEMM's operands on the device and the f64 view of what it multiplies.
struct Operands {
    a: DeviceBuffer,
    w: DeviceBuffer,
    a_scale: Option<DeviceBuffer>,
    w_scale: Option<DeviceBuffer>,
    /// Row r's f64 values (scales applied), `[m][k]`, and the weight's, `[n][k]`.
    a_f64: Vec<Vec<f64>>,
    w_f64: Vec<Vec<f64>>,
    /// The tensor core's error bound, as a fraction of each sum's L1 norm.
    tol_l1: f64,
}

fn operands(rt: &Arc<Runtime>, rng: &mut StdRng, c: &Case, m: usize, n: usize) -> Operands {
    let k = c.k;
    let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    let w: Vec<f32> = (0..n * k)
        .map(|_| rng.random_range(-1.0f32..1.0) / (k as f32).sqrt())
        .collect();
    if c.fp8 {
        let wq = Fp8Weight::quantize(&w, n, k, None).expect("weight quantization");
        let (codes, scales) = quantize_rows_fused(&x, m, k, 0.0, false).expect("rows");
        let a_f64 = (0..m)
            .map(|r| {
                codes[r * k..(r + 1) * k]
                    .iter()
                    .map(|&q| f64::from(e4m3_to_f32(q)) * f64::from(scales[r]))
                    .collect()
            })
            .collect();
        let w_f64 = (0..n)
            .map(|j| {
                wq.codes[j * k..(j + 1) * k]
                    .iter()
                    .map(|&q| f64::from(e4m3_to_f32(q)) * f64::from(wq.scales[j]))
                    .collect()
            })
            .collect();
        Operands {
            a: put_u8(rt, &codes),
            w: put_u8(rt, &wq.codes),
            a_scale: Some(put_f32(rt, &scales)),
            w_scale: Some(put_f32(rt, &wq.scales)),
            a_f64,
            w_f64,
            tol_l1: crate::fp8::TOL_L1,
        }
    } else {
        let (xb, xv) = crate::fp8::bf16_round(&x);
        let (wb, wv) = crate::fp8::bf16_round(&w);
        let rows = |v: &[f32], count: usize| -> Vec<Vec<f64>> {
            (0..count)
                .map(|r| {
                    v[r * k..(r + 1) * k]
                        .iter()
                        .map(|&y| f64::from(y))
                        .collect()
                })
                .collect()
        };
        Operands {
            a: put_u16(rt, &xb),
            w: put_u16(rt, &wb),
            a_scale: None,
            w_scale: None,
            a_f64: rows(&xv, m),
            w_f64: rows(&wv, n),
            tol_l1: crate::fp8::BF16_TOL_L1,
        }
    }
}

impl Operands {
    /// Queues the GEMM with `epilogue` (`ldo` its output pitch) on the tiles `wide` names
    /// (`None`: the ones the call's rule picks).
    fn launch(
        &self,
        rt: &Runtime,
        (m, n, k, ldo): (usize, usize, usize, usize),
        epilogue: Fp8Epilogue,
        wide: Option<bool>,
    ) {
        let (m, n, k, ldo) = (m as u32, n as u32, k as u32, ldo as u32);
        let r = match (&self.a_scale, &self.w_scale) {
            (Some(sa), Some(sw)) => {
                let g = Fp8Gemm {
                    a: self.a.as_ptr(),
                    w: self.w.as_ptr(),
                    a_scale: sa.as_ptr(),
                    a_scale_per_row: true,
                    w_scale: sw.as_ptr(),
                    epilogue,
                    m,
                    n,
                    k,
                    ldo,
                };
                match wide {
                    None => unsafe { fp8_gemm(rt, &g) },
                    Some(w) => unsafe { fp8_gemm_tiles(rt, &g, w) },
                }
            }
            _ => {
                let g = Bf16TcGemm {
                    a: self.a.as_ptr(),
                    w: self.w.as_ptr(),
                    epilogue,
                    m,
                    n,
                    k,
                    ldo,
                };
                match wide {
                    None => unsafe { bf16_tc_gemm(rt, &g) },
                    Some(w) => unsafe { bf16_tc_gemm_tiles(rt, &g, w) },
                }
            }
        };
        r.expect("GEMM launch");
    }

    /// The f64 output of row `r`, column `j`, and its sum of |products|.
    fn reference(&self, r: usize, j: usize) -> (f64, f64) {
        self.a_f64[r]
            .iter()
            .zip(&self.w_f64[j])
            .fold((0.0, 0.0), |(s, l1), (a, w)| {
                (s + a * w, l1 + (a * w).abs())
            })
    }
}

/// Head `head` of row `r` in f64, each value with its error bound: the GEMM's sums, rotated by
/// `stoke_formats::fp8::rope_head` at the table row given for q and k heads. The bound allows
/// two bf16 roundings (the GEMM's output, the rotated value) and the sums' own error through
/// the rotation.
fn reference_head(
    ops: &Operands,
    (r, head, d): (usize, usize, usize),
    rotate: Option<(&[f32], usize)>,
) -> Vec<(f64, f64)> {
    let y: Vec<(f64, f64)> = (0..d).map(|i| ops.reference(r, head * d + i)).collect();
    let Some((table, pos)) = rotate else {
        return y
            .iter()
            .map(|&(x, l1)| (x, x.abs() / 256.0 + ops.tol_l1 * l1))
            .collect();
    };
    let mut v: Vec<f64> = y.iter().map(|t| t.0).collect();
    rope_head(&mut v, table, pos);
    (0..d)
        .map(|i| {
            let ((x, l1), (o, l1o)) = (y[i], y[(i + d / 2) % d]);
            let bound = (x.abs() + o.abs() + v[i].abs()) / 256.0 + ops.tol_l1 * (l1 + l1o);
            (v[i], bound)
        })
        .collect()
}

/// A new buffer of `bytes`, every byte `poison`.
fn poisoned(rt: &Arc<Runtime>, bytes: usize, poison: u8) -> DeviceBuffer {
    let b = rt.alloc(bytes).expect("alloc");
    unsafe { rt.fill_bytes(b.ptr(), poison, bytes) }.expect("poison");
    b
}

/// A cache of 3 slots for the case, every byte poisoned with `byte`.
fn poisoned_cache(rt: &Arc<Runtime>, c: &Case, cap: u32, byte: u8) -> DeviceKvCache {
    // Slot s's pages lie in reverse order in the pool: positions run across scattered pages.
    let pages = 3 * cap.div_ceil(64);
    let order: Vec<u32> = (0..pages).rev().collect();
    let cache = DeviceKvCache::with_order(
        rt,
        c.format,
        (3, c.kv_heads as u32, cap, c.d as u32),
        c.block,
        64,
        &order,
    )
    .expect("cache");
    let mut bufs = vec![&cache.k, &cache.v];
    if let Some(m) = &cache.mirror {
        bufs.extend([&m.k, &m.v, &m.ks, &m.vs]);
    }
    for b in bufs {
        unsafe { rt.fill_bytes(b.ptr(), byte, b.bytes()) }.expect("poison");
    }
    cache
}

/// Every buffer of a cache, named, as bytes.
fn cache_bytes(c: &DeviceKvCache) -> Vec<(&'static str, Vec<u8>)> {
    let mut out = vec![("k", get_bytes(&c.k)), ("v", get_bytes(&c.v))];
    if let Some(m) = &c.mirror {
        out.extend([
            ("mirror k", get_bytes(&m.k)),
            ("mirror v", get_bytes(&m.v)),
            ("mirror k scales", get_bytes(&m.ks)),
            ("mirror v scales", get_bytes(&m.vs)),
        ]);
    }
    out
}

/// The first differing byte of `got` against `want`, and how many differ.
fn compare(what: &str, got: &[u8], want: &[u8]) -> Result<(), String> {
    let differ = got.iter().zip(want).filter(|(a, b)| a != b).count();
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None if got.len() == want.len() => Ok(()),
        None => Err(format!(
            "{what}: {} bytes against {}",
            got.len(),
            want.len()
        )),
        Some(i) => Err(format!(
            "{what}: {differ} of {} bytes differ from rope_append's, the first at byte {i} ({:#04x} against {:#04x})",
            got.len(),
            got[i],
            want[i]
        )),
    }
}

pub fn qkv_epilogue_matches_rope_append() -> Result<Value, String> {
    let rt = crate::gpu()?;
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut reports = Vec::new();
    for c in CASES {
        let (h, kvh, d, k) = (c.heads, c.kv_heads, c.d, c.k);
        let n = (h + 2 * kvh) * d;
        let m: usize = c.seqs.iter().map(|s| s.2).sum();
        let cap = c.seqs.iter().map(|s| s.1 + s.2 as u32).max().unwrap();
        let (mut slot_of, mut pos) = (Vec::new(), Vec::new());
        for &(slot, pos0, rows) in c.seqs {
            slot_of.extend(std::iter::repeat_n(slot, rows));
            pos.extend((pos0..).take(rows));
        }
        let what = format!(
            "seed {seed}: heads {h}/{kvh} d {d} k {k} {:?} block {} {} rows {m}",
            c.format,
            c.block,
            if c.fp8 { "FP8" } else { "bf16" }
        );
        let ops = operands(&rt, &mut rng, c, m, n);
        let table = rope_table(cap as usize, d);
        let rope = put_f32(&rt, &table);
        let (slot_b, pos_b) = (put_u32(&rt, &slot_of), put_u32(&rt, &pos));
        let alloc = |bytes: usize, poison: u8| poisoned(&rt, bytes, poison);

        // The two launches the epilogue replaces, into cache `want`.
        let want = poisoned_cache(&rt, c, cap, 0x5a);
        let qkv = alloc(m * n * 2, 0xff);
        let (q_want, len_want) = (alloc(m * h * d * 2, 0xff), alloc(m * 4, 0xff));
        let plain_out = Fp8Epilogue::Plain {
            out: qkv.as_mut_ptr(),
        };
        let rope_arg = (rope.as_ptr(), cap);
        let plain_then_append = || {
            ops.launch(&rt, (m, n, k, n), plain_out, None);
            unsafe {
                want.rope_append(
                    &rt,
                    qkv.as_ptr(),
                    h as u32,
                    rope_arg,
                    slot_b.as_ptr(),
                    pos_b.as_ptr(),
                    len_want.as_mut_ptr(),
                    m as u32,
                    q_want.as_mut_ptr(),
                )
            }
        };
        plain_then_append().map_err(|e| format!("{what}: rope_append: {e}"))?;

        // The epilogue, into cache `got`, on both tile widths.
        let widths = [false, true];
        let (mut worst, mut rows_checked) = (0f64, 0);
        let mut fused_us = Vec::new();
        let base = what.clone();
        for wide in widths {
            let what = format!("{base}{}", if wide { ", 128 x 256 tiles" } else { "" });
            let got = poisoned_cache(&rt, c, cap, 0x5a);
            let (q_got, len_got) = (alloc(m * h * d * 2, 0xff), alloc(m * 4, 0xff));
            let epilogue = got
                .qkv_epilogue(
                    h as u32,
                    rope_arg,
                    slot_b.as_ptr(),
                    pos_b.as_ptr(),
                    len_got.as_mut_ptr(),
                    q_got.as_mut_ptr(),
                )
                .map_err(|e| format!("{what}: {e}"))?;
            ops.launch(
                &rt,
                (m, n, k, h * d),
                Fp8Epilogue::Qkv(epilogue),
                Some(wide),
            );
            rt.synchronize().map_err(|e| format!("{what}: {e}"))?;

            compare(
                &format!("{what}: q"),
                &get_bytes(&q_got),
                &get_bytes(&q_want),
            )?;
            let lens: Vec<u32> = get_bytes(&len_got)
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            if let Some(r) = (0..m).find(|&r| lens[r] != pos[r] + 1) {
                return Err(format!(
                    "{what}: len[{r}] = {} (position {})",
                    lens[r], pos[r]
                ));
            }
            for ((name, g), (_, w)) in cache_bytes(&got).iter().zip(cache_bytes(&want)) {
                compare(&format!("{what}: cache {name}"), g, &w)?;
            }

            // q, k and v against f64: the GEMM's sums, rotated with the same table.
            let (qv, kc, vc) = (get_bf16(&q_got), get_bf16(&got.k), get_bf16(&got.v));
            let rows: Vec<usize> = if m <= CHECKED_ROWS {
                (0..m).collect()
            } else {
                (0..CHECKED_ROWS)
                    .map(|i| i * (m - 1) / (CHECKED_ROWS - 1))
                    .collect()
            };
            for &r in &rows {
                let p = pos[r] as usize;
                for head in 0..h + 2 * kvh {
                    let rotate = (head < h + kvh).then_some((table.as_slice(), p));
                    let want = reference_head(&ops, (r, head, d), rotate);
                    for i in 0..d {
                        let (want_v, bound) = want[i];
                        let got_v = if head < h {
                            qv[(r * h + head) * d + i]
                        } else {
                            let kv_head = (head - h) % kvh;
                            let row = got.row(slot_of[r], kv_head as u32, p as u32) as usize;
                            if head < h + kvh {
                                kc[row * d + i]
                            } else {
                                vc[row * d + i]
                            }
                        };
                        let err = (got_v - want_v).abs();
                        if !(err <= bound) {
                            return Err(format!(
                                "{what}: row {r} (position {p}) head {head} dim {i}: {got_v} against {want_v} (bound {bound:.3e})"
                            ));
                        }
                        worst = worst.max(err / bound);
                    }
                }
            }
            rows_checked = rows.len();
            if m >= 1024 {
                let t = crate::bench::time_calls(&rt, 3, 50, |_| {
                    ops.launch(
                        &rt,
                        (m, n, k, h * d),
                        Fp8Epilogue::Qkv(epilogue),
                        Some(wide),
                    );
                });
                fused_us.push(json!({"wide_tiles": wide, "us": t.us}));
            }
        }
        let mut report = json!({"case": base, "tile_widths": widths.len(),
            "rows_checked": rows_checked, "worst_error_over_bound": worst,
            "bytes_equal_rope_append": true});

        // Time: the epilogue against the plain GEMM and rope_append.
        if m >= 1024 {
            let unfused = crate::bench::time_calls(&rt, 3, 50, |_| {
                plain_then_append().expect("rope_append");
            });
            let plain = crate::bench::time_calls(&rt, 3, 50, |_| {
                ops.launch(&rt, (m, n, k, n), plain_out, None);
            });
            println!(
                "qkv epilogue {base}: {fused_us:?}, plain GEMM + rope_append {:.1} us, plain GEMM alone {:.1} us",
                unfused.us, plain.us
            );
            report["us"] = json!({"qkv_epilogue": fused_us, "plain_then_rope_append": unfused.us,
                "plain_gemm": plain.us});
        }
        reports.push(report);
    }
    Ok(json!({ "cases": reports }))
}

/// The decode q|k|v epilogue of the W4A16 kernels (`QkvRope` in `kernels/int4_gemm.cuh`, heads
/// of 64): every byte it writes (q, the BF16 cache, the FP8 / INT4 mirror rows and scales, the
/// lengths) against the plain W4A16 call followed by `rope_append` into a second cache. SmolLM2's
/// heads (9 / 3, k 576); rows 1-64 over three slots at scattered positions (the swapped,
/// warpgroup and batched kernels, two launches past 32 rows); GGUF-style asymmetric groups of
/// 32 and symmetric groups of 64; the plan's splits and one; every cache format.
pub fn int4_qkv_epilogue_matches_rope_append() -> Result<Value, String> {
    use stoke_cuda::DevicePtr;
    use stoke_cuda::int4::{Int4Gemm, NormFold, int4_gemm};
    use stoke_cuda::kernels::int4_gemm::{Epilogue, QkvRopeParams};
    use stoke_formats::int4::ScaleType;
    let rt = crate::gpu()?;
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let (h, kvh, d, k) = (9usize, 3usize, 64usize, 576usize);
    let n = (h + 2 * kvh) * d;
    let mut checked = 0usize;
    for (group, asym) in [(32usize, true), (64, false)] {
        let p = crate::int4::random_weight(&mut rng, k, n, group, ScaleType::F16, asym);
        let dw = crate::int4::upload(&rt, &p);
        for (format, block) in [
            (KvFormat::Bf16, 0u32),
            (KvFormat::Fp8, 64),
            (KvFormat::Int4, 64),
            (KvFormat::Int4, 16),
        ] {
            let c = Case {
                heads: h,
                kv_heads: kvh,
                d,
                k,
                format,
                block,
                fp8: false,
                seqs: &[],
            };
            for m in [1usize, 3, 8, 16, 32, 64] {
                // Row r: slot r % 3 at position 200 + 7 (r / 3) + r % 5 (distinct per slot).
                let slot_of: Vec<u32> = (0..m).map(|r| (r % 3) as u32).collect();
                let pos: Vec<u32> = (0..m).map(|r| (200 + 7 * (r / 3) + r % 5) as u32).collect();
                let cap = pos.iter().max().unwrap() + 1;
                let table = rope_table(cap as usize, d);
                let rope = put_f32(&rt, &table);
                let (slot_b, pos_b) = (put_u32(&rt, &slot_of), put_u32(&rt, &pos));
                let x: Vec<u16> = crate::int4::random_bf16(&mut rng, m * k);
                let xb = put_u16(&rt, &x);
                let alloc = |bytes: usize, poison: u8| poisoned(&rt, bytes, poison);
                for (splits, wg) in [(0u32, false), (1, false), (0, true)] {
                    let what = format!(
                        "seed {seed}: m {m} group {group}{} {format:?} block {block} splits {splits}{}",
                        if asym { " asymmetric" } else { "" },
                        if wg { " warpgroup" } else { "" }
                    );
                    let call = |x_out: DevicePtr<QkvRopeParams>, out: &DeviceBuffer| Int4Gemm {
                        x: xb.as_ptr(),
                        m: m as u32,
                        out: out.as_mut_ptr(),
                        epilogue: Epilogue::Plain,
                        residual: DevicePtr::NULL,
                        row_scale: DevicePtr::NULL,
                        norm: NormFold::NONE,
                        qkv: x_out,
                        splits,
                        wg_rows: u32::from(wg),
                        tune: false,
                    };
                    // The plain call and rope_append, into cache `want`.
                    let want = poisoned_cache(&rt, &c, cap, 0x5a);
                    let qkv = alloc(m * n * 2, 0xff);
                    let (q_want, len_want) = (alloc(m * h * d * 2, 0xff), alloc(m * 4, 0xff));
                    unsafe { int4_gemm(&rt, &dw, &call(DevicePtr::NULL, &qkv)) }
                        .map_err(|e| format!("{what}: plain: {e}"))?;
                    unsafe {
                        want.rope_append(
                            &rt,
                            qkv.as_ptr(),
                            h as u32,
                            (rope.as_ptr(), cap),
                            slot_b.as_ptr(),
                            pos_b.as_ptr(),
                            len_want.as_mut_ptr(),
                            m as u32,
                            q_want.as_mut_ptr(),
                        )
                    }
                    .map_err(|e| format!("{what}: rope_append: {e}"))?;
                    // The epilogue, into cache `got`.
                    let got = poisoned_cache(&rt, &c, cap, 0x5a);
                    let (q_got, len_got) = (alloc(m * h * d * 2, 0xff), alloc(m * 4, 0xff));
                    let e = got
                        .qkv_epilogue(
                            h as u32,
                            (rope.as_ptr(), cap),
                            slot_b.as_ptr(),
                            pos_b.as_ptr(),
                            len_got.as_mut_ptr(),
                            stoke_cuda::DevicePtrMut::NULL,
                        )
                        .map_err(|e| format!("{what}: {e}"))?;
                    let t =
                        QkvRopeParams::from_epilogue(&e).ok_or("heads of 64 take the epilogue")?;
                    let tb = alloc(std::mem::size_of::<QkvRopeParams>(), 0);
                    unsafe { rt.copy_htod(tb.ptr(), QkvRopeParams::bytes(&[t])) }
                        .map_err(|e| e.to_string())?;
                    unsafe { int4_gemm(&rt, &dw, &call(tb.as_ptr(), &q_got)) }
                        .map_err(|e| format!("{what}: epilogue: {e}"))?;
                    compare(
                        &format!("{what}: q"),
                        &get_bytes(&q_got),
                        &get_bytes(&q_want),
                    )?;
                    compare(
                        &format!("{what}: lengths"),
                        &get_bytes(&len_got),
                        &get_bytes(&len_want),
                    )?;
                    for ((name, g), (_, w)) in cache_bytes(&got).iter().zip(cache_bytes(&want)) {
                        compare(&format!("{what}: cache {name}"), g, &w)?;
                    }
                    checked += 1;
                }
            }
        }
    }
    Ok(json!({ "seed": seed, "cases": checked, "heads": [h, kvh], "d": d, "k": k }))
}
