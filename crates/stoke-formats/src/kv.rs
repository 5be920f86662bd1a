//! KV-cache formats for decode attention (`docs/KV_CACHE_FORMAT.md` draws them): the
//! normalized block-diagonal Walsh-Hadamard rotation, and the FP8 E4M3 and INT4 mirrors of the
//! BF16 cache, each with one f32 scale per (token, kv head) row. Packers, exact inverses and the
//! f64 decode-attention reference the kernels are tested against.
//!
//! A cache row is the `head_dim` values of one token in one kv head.

/// Errors of the cache formats.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KvError {
    #[error(
        "rotation block {block} must be a power of two from 2 to {max} dividing head_dim {head_dim}"
    )]
    Block {
        block: usize,
        head_dim: usize,
        max: usize,
    },
    #[error("head_dim {0} must be a multiple of 16")]
    HeadDim(usize),
    #[error("{what} has {actual} values, not a multiple of head_dim {head_dim}")]
    Len {
        what: &'static str,
        actual: usize,
        head_dim: usize,
    },
}

fn check_rows(what: &'static str, len: usize, head_dim: usize) -> Result<usize, KvError> {
    if head_dim == 0 || !head_dim.is_multiple_of(16) {
        return Err(KvError::HeadDim(head_dim));
    }
    if !len.is_multiple_of(head_dim) {
        return Err(KvError::Len {
            what,
            actual: len,
            head_dim,
        });
    }
    Ok(len / head_dim)
}

/// Rotates every `block` consecutive values of `x` by the normalized Walsh-Hadamard matrix
/// `H / sqrt(block)` (Sylvester order). It is orthonormal and symmetric, so it is its own
/// inverse: applied to K, V and q, attention scores are unchanged, and applying it again to the
/// attention output undoes the rotation of V.
pub fn hadamard(x: &mut [f32], head_dim: usize, block: usize) -> Result<(), KvError> {
    if !block.is_power_of_two() || block < 2 || !head_dim.is_multiple_of(block) || block > 256 {
        return Err(KvError::Block {
            block,
            head_dim,
            max: 256,
        });
    }
    check_rows("x", x.len(), head_dim)?;
    let norm = 1.0 / (block as f64).sqrt();
    for chunk in x.chunks_exact_mut(block) {
        let mut v: Vec<f64> = chunk.iter().map(|&a| a as f64).collect();
        let mut h = 1;
        while h < block {
            for i in (0..block).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (v[j], v[j + h]);
                    v[j] = a + b;
                    v[j + h] = a - b;
                }
            }
            h *= 2;
        }
        for (c, a) in chunk.iter_mut().zip(v) {
            *c = (a * norm) as f32;
        }
    }
    Ok(())
}

/// Largest finite FP8 E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The value of an E4M3 code (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no
/// infinities; 0x7F / 0xFF are NaN).
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((code >> 3) & 0xF) as i32;
    let m = (code & 7) as f32;
    if e == 15 && code & 7 == 7 {
        return f32::NAN;
    }
    let v = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    sign * v
}

/// Nearest E4M3 code of `x` (ties to the even code), saturating at ±448; NaN -> 0x7F.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    // Codes 0..=0x7E are increasing in value: find the two neighbours of `a`.
    let (mut lo, mut hi) = (0u8, 0x7Eu8);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (vl, vh) = (e4m3_to_f32(lo), e4m3_to_f32(hi));
    let code = if a - vl < vh - a || (a - vl == vh - a && lo % 2 == 0) {
        lo
    } else {
        hi
    };
    sign | code
}

/// Per-row amax, the basis of every row scale.
pub(crate) fn row_amax(row: &[f32]) -> f32 {
    row.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// FP8 E4M3 rows: `code = e4m3(x / s)` with `s = amax / 448` per row. Returns (codes, scales).
pub fn quantize_fp8(x: &[f32], head_dim: usize) -> Result<(Vec<u8>, Vec<f32>), KvError> {
    let rows = check_rows("x", x.len(), head_dim)?;
    let mut codes = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(rows);
    for row in x.chunks_exact(head_dim) {
        let s = row_amax(row) / E4M3_MAX;
        scales.push(s);
        codes.extend(
            row.iter()
                .map(|&v| if s > 0.0 { f32_to_e4m3(v / s) } else { 0 }),
        );
    }
    Ok((codes, scales))
}

pub fn dequantize_fp8(codes: &[u8], scales: &[f32], head_dim: usize) -> Vec<f32> {
    codes
        .chunks_exact(head_dim)
        .zip(scales)
        .flat_map(|(row, &s)| row.iter().map(move |&c| e4m3_to_f32(c) * s))
        .collect()
}

/// Byte order of INT4 rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int4Order {
    /// Byte `j` holds values `2j` (low nibble) and `2j + 1` (high nibble): the device cache's
    /// order for keys and values.
    Natural,
    /// Within each 16-value chunk, byte `2t` holds values `2t, 2t + 1` and byte `2t + 1` holds
    /// `2t + 8, 2t + 9` (t = 0..3): lane `4g + t`'s `mma.m16n8k16` B fragment of key `g` in one
    /// 16-bit load. The decode kernels store keys in [`Int4Order::Natural`] instead and permute
    /// the head dimensions of the reduction (docs/KV_CACHE_FORMAT.md), which gives each lane one
    /// contiguous 16-byte slice.
    Mma,
}

/// Position (byte, high nibble?) of value `i` of a row in `order`.
pub fn int4_position(i: usize, order: Int4Order) -> (usize, bool) {
    match order {
        Int4Order::Natural => (i / 2, i % 2 == 1),
        Int4Order::Mma => {
            let (chunk, r) = (i / 16, i % 16);
            let (second, t, hi) = (r / 8, (r % 8) / 2, r % 2 == 1);
            (chunk * 8 + 2 * t + second, hi)
        }
    }
}

/// INT4 rows: `q = clamp(round(x / s), -8, 7)` with `s = amax / 7` per row, two's-complement
/// nibbles. Returns (bytes, scales).
pub fn quantize_int4(
    x: &[f32],
    head_dim: usize,
    order: Int4Order,
) -> Result<(Vec<u8>, Vec<f32>), KvError> {
    let rows = check_rows("x", x.len(), head_dim)?;
    let mut bytes = vec![0u8; x.len() / 2];
    let mut scales = Vec::with_capacity(rows);
    for (r, row) in x.chunks_exact(head_dim).enumerate() {
        let s = row_amax(row) / 7.0;
        scales.push(s);
        let out = &mut bytes[r * head_dim / 2..(r + 1) * head_dim / 2];
        for (i, &v) in row.iter().enumerate() {
            let q = if s > 0.0 {
                (v / s).round_ties_even().clamp(-8.0, 7.0) as i8
            } else {
                0
            };
            let (b, hi) = int4_position(i, order);
            let nib = (q as u8) & 0xF;
            out[b] |= if hi { nib << 4 } else { nib };
        }
    }
    Ok((bytes, scales))
}

/// The exact inverse of [`quantize_int4`]'s packing: the signed values, as f32 times scale.
pub fn dequantize_int4(
    bytes: &[u8],
    scales: &[f32],
    head_dim: usize,
    order: Int4Order,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(bytes.len() * 2);
    for (row, &s) in bytes.chunks_exact(head_dim / 2).zip(scales) {
        for i in 0..head_dim {
            let (b, hi) = int4_position(i, order);
            let nib = if hi { row[b] >> 4 } else { row[b] & 0xF };
            let q = ((nib << 4) as i8) >> 4;
            out.push(q as f32 * s);
        }
    }
    out
}

/// Decode attention for one sequence, f64: `q [heads, d]`, `k`/`v [ctx, kv_heads, d]`; query
/// head `h` reads kv head `h / (heads / kv_heads)`; softmax over all `ctx` keys, scaled by
/// `1 / sqrt(d)`. Returns `[heads, d]`.
pub fn decode_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    heads: usize,
    kv_heads: usize,
    d: usize,
) -> Vec<f64> {
    let ctx = k.len() / (kv_heads * d);
    let group = heads / kv_heads;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0f64; heads * d];
    for h in 0..heads {
        let kvh = h / group;
        let qh = &q[h * d..(h + 1) * d];
        let scores: Vec<f64> = (0..ctx)
            .map(|t| {
                let kr = &k[(t * kv_heads + kvh) * d..(t * kv_heads + kvh + 1) * d];
                qh.iter()
                    .zip(kr)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    * scale
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = w.iter().sum();
        for (t, wt) in w.iter().enumerate() {
            let vr = &v[(t * kv_heads + kvh) * d..(t * kv_heads + kvh + 1) * d];
            for (o, x) in out[h * d..(h + 1) * d].iter_mut().zip(vr) {
                *o += wt / sum * *x as f64;
            }
        }
    }
    out
}

/// [`decode_attention`] over K and V rows that were rotated by `block`-sized Hadamard blocks
/// (0: not rotated): q is rotated the same way and the output rotated back (in f32, which keeps
/// more than any kernel output does), so over an exact rotated cache the result equals
/// attention over the unrotated one.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_rotated(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    heads: usize,
    kv_heads: usize,
    d: usize,
    block: usize,
) -> Result<Vec<f64>, KvError> {
    if block == 0 {
        return Ok(decode_attention(q, k, v, heads, kv_heads, d));
    }
    let mut qr = q.to_vec();
    hadamard(&mut qr, d, block)?;
    let o = decode_attention(&qr, k, v, heads, kv_heads, d);
    let mut o32: Vec<f32> = o.iter().map(|&a| a as f32).collect();
    hadamard(&mut o32, d, block)?;
    Ok(o32.into_iter().map(f64::from).collect())
}

/// Relative attention-output errors (`‖o - o_ref‖ / ‖o_ref‖`, f64) of one cache format, with
/// and without the rotation.
#[derive(Clone, Copy, Debug)]
pub struct RotationErrors {
    pub unrotated: f64,
    pub rotated: f64,
}

/// The outlier experiment: one decode step over a synthetic cache of `ctx` tokens whose keys
/// are N(0, 1) except `outliers` channels per kv head scaled by `factor`; values and queries
/// N(0, 1). Attention over the quantized-then-dequantized cache vs over the exact one, for
/// INT4 and FP8 rows, unrotated and rotated with `block`-sized Hadamard blocks (q rotated the
/// same way, the output rotated back).
#[allow(clippy::too_many_arguments)]
pub fn rotation_experiment(
    heads: usize,
    kv_heads: usize,
    d: usize,
    ctx: usize,
    outliers: usize,
    factor: f32,
    block: usize,
    seed: u64,
) -> Result<(RotationErrors, RotationErrors), KvError> {
    let mut state = seed.max(1);
    let mut uniform = || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    let mut normal = || {
        let (u1, u2) = (uniform(), uniform());
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    };
    let q: Vec<f32> = (0..heads * d).map(|_| normal()).collect();
    let mut k: Vec<f32> = (0..ctx * kv_heads * d).map(|_| normal()).collect();
    let v: Vec<f32> = (0..ctx * kv_heads * d).map(|_| normal()).collect();
    // The same few channels of every kv head carry outliers, in every token (as in real keys).
    let channels: Vec<usize> = (0..outliers).map(|i| (i * 37 + 11) % d).collect();
    for row in k.chunks_exact_mut(d) {
        for &c in &channels {
            row[c] *= factor;
        }
    }
    let reference = decode_attention(&q, &k, &v, heads, kv_heads, d);
    let rel = |o: &[f64]| {
        let num: f64 = o.iter().zip(&reference).map(|(a, b)| (a - b).powi(2)).sum();
        let den: f64 = reference.iter().map(|b| b * b).sum();
        (num / den).sqrt()
    };
    let int4 = |x: &[f32], order| -> Result<Vec<f32>, KvError> {
        let (b, s) = quantize_int4(x, d, order)?;
        Ok(dequantize_int4(&b, &s, d, order))
    };
    let fp8 = |x: &[f32]| -> Result<Vec<f32>, KvError> {
        let (c, s) = quantize_fp8(x, d)?;
        Ok(dequantize_fp8(&c, &s, d))
    };
    type Quant<'a> = &'a dyn Fn(&[f32], bool) -> Result<Vec<f32>, KvError>;
    let run = |quant: Quant| -> Result<RotationErrors, KvError> {
        let unrotated = rel(&decode_attention(
            &q,
            &quant(&k, true)?,
            &quant(&v, false)?,
            heads,
            kv_heads,
            d,
        ));
        let (mut kr, mut vr) = (k.clone(), v.clone());
        hadamard(&mut kr, d, block)?;
        hadamard(&mut vr, d, block)?;
        let o = decode_attention_rotated(
            &q,
            &quant(&kr, true)?,
            &quant(&vr, false)?,
            heads,
            kv_heads,
            d,
            block,
        )?;
        Ok(RotationErrors {
            unrotated,
            rotated: rel(&o),
        })
    };
    let int4_errors = run(&|x, key| {
        int4(
            x,
            if key {
                Int4Order::Mma
            } else {
                Int4Order::Natural
            },
        )
    })?;
    let fp8_errors = run(&|x, _| fp8(x))?;
    Ok((int4_errors, fp8_errors))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn hadamard_is_orthonormal_and_its_own_inverse() {
        let mut s = 1;
        for block in [32, 64, 128] {
            let x: Vec<f32> = (0..256).map(|_| lcg(&mut s)).collect();
            let mut y = x.clone();
            hadamard(&mut y, 128.max(block), block).unwrap();
            let n = |v: &[f32]| v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>();
            assert!((n(&x) - n(&y)).abs() < 1e-4 * n(&x));
            hadamard(&mut y, 128.max(block), block).unwrap();
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() < 1e-5);
            }
        }
        // A spike spreads evenly over its block.
        let mut e = vec![0f32; 64];
        e[5] = 8.0;
        hadamard(&mut e, 64, 64).unwrap();
        assert!(e.iter().all(|v| (v.abs() - 1.0).abs() < 1e-6));
        assert!(hadamard(&mut vec![0.0; 64], 64, 48).is_err());
        assert!(hadamard(&mut vec![0.0; 64], 64, 128).is_err());
    }

    #[test]
    fn e4m3_codes_round_trip_and_round_to_nearest_even() {
        for code in 0u8..=0xFE {
            if code & 0x7F == 0x7F {
                continue;
            }
            let v = e4m3_to_f32(code);
            let back = f32_to_e4m3(v);
            // +0 and -0 both encode; every other value maps back to its code.
            assert!(back == code || v == 0.0, "{code:#x} {v} {back:#x}");
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(f32_to_e4m3(1000.0), 0x7E);
        assert_eq!(f32_to_e4m3(-1000.0), 0xFE);
        // 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39): ties go to the even code.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3A);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7F);
    }

    #[test]
    fn fp8_rows_dequantize_within_half_a_step() {
        let mut s = 7;
        let d = 64;
        let x: Vec<f32> = (0..d * 5).map(|_| lcg(&mut s) * 3.0).collect();
        let (c, sc) = quantize_fp8(&x, d).unwrap();
        let y = dequantize_fp8(&c, &sc, d);
        for (r, (xr, yr)) in x.chunks(d).zip(y.chunks(d)).enumerate() {
            let amax = row_amax(xr);
            assert!(
                (row_amax(yr) - amax).abs() <= amax * 1e-6,
                "row {r} amax kept"
            );
            for (a, b) in xr.iter().zip(yr) {
                // 3 mantissa bits: relative step 2^-3 at most, half of it after rounding.
                assert!(
                    (a - b).abs() <= a.abs() / 16.0 + sc[r] * 2f32.powi(-9),
                    "{a} {b}"
                );
            }
        }
    }

    #[test]
    fn int4_rows_round_trip_in_both_orders() {
        let mut s = 9;
        let d = 128;
        let x: Vec<f32> = (0..d * 3).map(|_| lcg(&mut s)).collect();
        for order in [Int4Order::Natural, Int4Order::Mma] {
            let (b, sc) = quantize_int4(&x, d, order).unwrap();
            assert_eq!(b.len(), x.len() / 2);
            let y = dequantize_int4(&b, &sc, d, order);
            for (i, (a, v)) in x.iter().zip(&y).enumerate() {
                let st = sc[i / d];
                assert!((a - v).abs() <= st / 2.0 + 1e-7, "{order:?} {i}: {a} {v}");
            }
        }
        // Every value has its own nibble in both orders.
        for order in [Int4Order::Natural, Int4Order::Mma] {
            let mut seen = std::collections::HashSet::new();
            for i in 0..d {
                assert!(seen.insert(int4_position(i, order)));
            }
        }
        // Lane t's 16-bit load at byte 2t of a chunk: values 2t, 2t+1, 2t+8, 2t+9.
        for t in 0..4 {
            assert_eq!(int4_position(2 * t, Int4Order::Mma), (2 * t, false));
            assert_eq!(int4_position(2 * t + 1, Int4Order::Mma), (2 * t, true));
            assert_eq!(int4_position(2 * t + 8, Int4Order::Mma), (2 * t + 1, false));
            assert_eq!(int4_position(2 * t + 9, Int4Order::Mma), (2 * t + 1, true));
        }
        assert!(quantize_int4(&x[..100], d, Int4Order::Natural).is_err());
        assert!(quantize_int4(&x, 24, Int4Order::Natural).is_err());
    }

    /// The rotation spreads outlier channels over the block, so the per-row INT4 scale is no
    /// longer set by them: a Llama-8B-shaped step with 4 key channels per head scaled 8x.
    #[test]
    fn rotation_cuts_the_int4_error_of_outlier_keys() {
        let (int4, fp8) = rotation_experiment(32, 8, 128, 256, 4, 8.0, 128, 3).unwrap();
        assert!(int4.rotated < 0.5 * int4.unrotated, "{int4:?}");
        assert!(
            fp8.unrotated < int4.unrotated && fp8.rotated < int4.rotated,
            "{fp8:?}"
        );
    }

    #[test]
    fn decode_attention_reference_matches_a_hand_case() {
        // One head, two keys: equal scores give the mean of the values.
        let q = vec![1.0f32, 0.0];
        let k = vec![0.5f32, 1.0, 0.5, -1.0];
        let v = vec![2.0f32, 0.0, 0.0, 4.0];
        let o = decode_attention(&q, &k, &v, 1, 1, 2);
        assert!((o[0] - 1.0).abs() < 1e-12 && (o[1] - 2.0).abs() < 1e-12);
    }
}
