//! FP8 (E4M3) prefill operands and the f64 references of the prefill GEMM's epilogues.
//!
//! The prefill GEMM computes `acc[r][j] = sum_i A[r][i] W[j][i]` on E4M3 codes and restores the
//! scales after accumulation: `y[r][j] = acc[r][j] * a_scale(r) * w_scale[j]`. Weights carry one
//! scale per output channel (quantized once, at load, after the preceding RMSNorm's gain is
//! folded into their columns); activations carry one scale per row ([`quantize_rows_fused`],
//! which also carries RMSNorm's row factor), or one delayed per-tensor scale per request group
//! ([`DelayedScale`]). Prompts of different lengths run packed, row
//! after row, described by [`Packed`]. Everything here is the specification the kernels are
//! tested against: plain loops, f64 sums over the exact quantized values.

use crate::kv::row_amax;
pub use crate::kv::{E4M3_MAX, e4m3_to_f32, f32_to_e4m3};

/// Errors of the FP8 operands.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Fp8Error {
    #[error("{what}: expected {expected} values, got {got}")]
    Len {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("{what}: value {index} is not finite")]
    NonFinite { what: &'static str, index: usize },
    #[error("{what}: {detail}")]
    Invalid { what: &'static str, detail: String },
}

fn check_len(what: &'static str, got: usize, expected: usize) -> Result<(), Fp8Error> {
    if got == expected {
        Ok(())
    } else {
        Err(Fp8Error::Len {
            what,
            expected,
            got,
        })
    }
}

fn check_finite(what: &'static str, x: &[f32]) -> Result<(), Fp8Error> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(Fp8Error::NonFinite { what, index }),
        None => Ok(()),
    }
}

/// The scale that maps `amax` onto the largest E4M3 value; 1 for an all-zero row (its codes
/// are zeros whatever the scale, and a zero scale would make the inverse infinite).
pub fn scale_for(amax: f32) -> f32 {
    if amax > 0.0 && amax.is_finite() {
        amax / E4M3_MAX
    } else {
        1.0
    }
}

/// Rounds `x` (one row or output channel) through E4M3 in place with one scale, [`scale_for`]
/// of its amax: the values the FP8 GEMM multiplies, to measure their quality on any backend.
pub fn round_trip(x: &mut [f32]) {
    let s = scale_for(row_amax(x));
    for v in x.iter_mut() {
        *v = e4m3_to_f32(f32_to_e4m3(*v / s)) * s;
    }
}

/// A weight `[n, k]` (output channels by inputs, row-major) in E4M3 with one f32 scale per
/// output channel: `W[j][i] ~= e4m3(codes[j k + i]) * scales[j]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Weight {
    pub n: usize,
    pub k: usize,
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
}

impl Fp8Weight {
    /// Quantizes `w` (`[n, k]`, f32). With `gain` (length `k`, the gain of the RMSNorm whose
    /// output this projection reads) each column is multiplied by its gain first, so the
    /// kernel reads the unscaled normalized row: `W diag(g) x_hat = W (g * x_hat)`.
    pub fn quantize(w: &[f32], n: usize, k: usize, gain: Option<&[f32]>) -> Result<Self, Fp8Error> {
        check_len("weight", w.len(), n * k)?;
        check_finite("weight", w)?;
        if let Some(g) = gain {
            check_len("RMSNorm gain", g.len(), k)?;
            check_finite("RMSNorm gain", g)?;
        }
        let mut codes = vec![0u8; n * k];
        let mut scales = vec![0f32; n];
        let mut row = vec![0f32; k];
        for j in 0..n {
            for (i, r) in row.iter_mut().enumerate() {
                *r = w[j * k + i] * gain.map_or(1.0, |g| g[i]);
            }
            let s = scale_for(row_amax(&row));
            scales[j] = s;
            for (c, &v) in codes[j * k..(j + 1) * k].iter_mut().zip(&row) {
                *c = f32_to_e4m3(v / s);
            }
        }
        Ok(Self {
            n,
            k,
            codes,
            scales,
        })
    }

    /// The values the kernel multiplies: `e4m3(code) * scale`, `[n, k]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.n * self.k];
        for j in 0..self.n {
            for i in 0..self.k {
                out[j * self.k + i] = e4m3_to_f32(self.codes[j * self.k + i]) * self.scales[j];
            }
        }
        out
    }
}

/// The rows the FP8 GEMM reads, as `kernels/fp8_quant.cu` makes them from bf16 rows (given
/// here as their f32 values): `code = e4m3(x * (448 / amax))` in f32 (so the codes match the
/// kernel's bit for bit) and `scale = amax / 448`; with `normalize`, the row is an RMSNorm input
/// and the scale also carries its row factor `rsqrt(mean(x^2) + eps)` (the normalized row has
/// the same codes; the gain is folded into the weights). An all-zero row: zero codes, scale 1.
pub fn quantize_rows_fused(
    x: &[f32],
    rows: usize,
    k: usize,
    eps: f32,
    normalize: bool,
) -> Result<(Vec<u8>, Vec<f32>), Fp8Error> {
    quantize_rows_gained(x, rows, k, None, eps, normalize)
}

/// [`quantize_rows_fused`] of the rows times `gain` (`[k]`; f32 products, as the kernel's
/// `gain`): the codes and amax of `x g`, RMSNorm's row factor (with `normalize`) still from
/// `x`. For weights that cannot carry the gain (INT4 codes).
pub fn quantize_rows_gained(
    x: &[f32],
    rows: usize,
    k: usize,
    gain: Option<&[f32]>,
    eps: f32,
    normalize: bool,
) -> Result<(Vec<u8>, Vec<f32>), Fp8Error> {
    check_len("activations", x.len(), rows * k)?;
    check_finite("activations", x)?;
    if let Some(g) = gain {
        check_len("gain", g.len(), k)?;
        check_finite("gain", g)?;
    }
    let mut codes = vec![0u8; rows * k];
    let mut scales = vec![0f32; rows];
    let mut gained = vec![0f32; k];
    for r in 0..rows {
        let raw = &x[r * k..(r + 1) * k];
        let row = match gain {
            Some(g) => {
                for ((o, &v), &gv) in gained.iter_mut().zip(raw).zip(g) {
                    *o = v * gv;
                }
                &gained[..]
            }
            None => raw,
        };
        let amax = row_amax(row);
        let inv = if amax > 0.0 { E4M3_MAX / amax } else { 1.0 };
        let ss: f64 = raw.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let factor = if normalize {
            1.0 / (ss / k as f64 + f64::from(eps)).sqrt()
        } else {
            1.0
        };
        scales[r] = if amax > 0.0 {
            (f64::from(amax) * factor / f64::from(E4M3_MAX)) as f32
        } else {
            1.0
        };
        for (c, &v) in codes[r * k..(r + 1) * k].iter_mut().zip(row) {
            *c = f32_to_e4m3(v * inv);
        }
    }
    Ok((codes, scales))
}

/// Rows of `k` codes with each 16 consecutive k interleaved as the INT4 words' nibbles are
/// (docs/INT4_FORMAT.md: a lane holds rows 2t, 2t + 8, 2t + 1, 2t + 9 of a k-tile): k at
/// `2 (k % 8) + (k % 16) / 8` of its 16. The FP8 x INT4 GEMM reads A in this order
/// (`kernels/fp8_quant.cu` with `order` 1). `k` must be a multiple of 16.
pub fn interleave_k16(codes: &[u8], k: usize) -> Vec<u8> {
    assert!(
        k.is_multiple_of(16) && codes.len().is_multiple_of(k.max(1)),
        "rows of k, a multiple of 16"
    );
    let mut out = vec![0u8; codes.len()];
    for (b, block) in codes.chunks_exact(16).enumerate() {
        for (i, &c) in block.iter().enumerate() {
            out[16 * b + 2 * (i % 8) + i / 8] = c;
        }
    }
    out
}

/// The sums of each 32 consecutive codes' values of rows of `k` (`[rows, k / 32]`; exact in
/// f32: at most 32 values, multiples of 2^-9 below 448). `k` must be a multiple of 32.
pub fn code_sums32(codes: &[u8], k: usize) -> Vec<f32> {
    assert!(k.is_multiple_of(32), "k a multiple of 32");
    codes
        .chunks_exact(32)
        .map(|c| c.iter().map(|&v| e4m3_to_f32(v)).sum())
        .collect()
}

/// What quantizing with a given per-tensor scale did.
#[derive(Clone, Debug, PartialEq)]
pub struct Quantized {
    pub codes: Vec<u8>,
    /// Values beyond `448 * scale` (written as ±448; NaN and infinities count too and are
    /// written as ±448 by sign, so the output stays finite).
    pub saturated: u64,
    /// Largest |value| seen (the amax the next invocation's scale comes from); non-finite
    /// values are left out.
    pub amax: f32,
}

/// Quantizes `x` with one given scale (the delayed scale), saturating.
pub fn quantize_with_scale(x: &[f32], scale: f32) -> Quantized {
    let mut saturated = 0;
    let mut amax = 0f32;
    let codes = x
        .iter()
        .map(|&v| {
            if v.is_finite() {
                amax = amax.max(v.abs());
            }
            let q = v / scale;
            if !q.is_finite() || q.abs() > E4M3_MAX {
                saturated += 1;
                let neg = if v.is_nan() { false } else { v < 0.0 };
                return if neg { 0x80 | 0x7E } else { 0x7E };
            }
            f32_to_e4m3(q)
        })
        .collect();
    Quantized {
        codes,
        saturated,
        amax,
    }
}

/// Amax history slots of the delayed scales Stoke keeps on the device (the FP8 prefill's
/// SwiGLU output): the scale follows the largest amax of the last 16 invocations.
pub const DELAYED_HISTORY: usize = 16;

/// Delayed per-tensor scaling of one activation (e.g. the SwiGLU output that the down
/// projection reads) for one request group: each invocation quantizes with the scale derived
/// from the amaxes collected by earlier invocations and records its own amax for the next.
///
/// - The first invocation has no history: it uses `initial_amax` (from calibration at load),
///   so it needs no second pass over its output.
/// - An all-zero invocation records nothing (a zero amax would turn the next scale into 0).
/// - Values beyond the scale's range are written as ±448 and counted in `saturated`; a group
///   whose invocations saturate widens its scale at the next invocation, as its amax grew.
#[derive(Clone, Debug, PartialEq)]
pub struct DelayedScale {
    history: Vec<f32>,
    next: usize,
    filled: usize,
    initial_amax: f32,
    /// Headroom: the scale maps `amax * margin` onto 448 (margin >= 1).
    pub margin: f32,
    /// Values saturated over every invocation so far.
    pub saturated: u64,
    /// Invocations recorded.
    pub invocations: u64,
}

impl DelayedScale {
    /// A group with `history` amax slots (the scale follows their maximum), starting from
    /// `initial_amax` and mapping `amax * margin` onto 448.
    pub fn new(history: usize, initial_amax: f32, margin: f32) -> Result<Self, Fp8Error> {
        if history == 0 {
            return Err(Fp8Error::Invalid {
                what: "delayed scale",
                detail: "the amax history needs at least one slot".into(),
            });
        }
        if !(initial_amax.is_finite() && initial_amax > 0.0) {
            return Err(Fp8Error::Invalid {
                what: "delayed scale",
                detail: format!("initial amax {initial_amax} must be finite and positive"),
            });
        }
        if !(margin.is_finite() && margin >= 1.0) {
            return Err(Fp8Error::Invalid {
                what: "delayed scale",
                detail: format!("margin {margin} must be finite and at least 1"),
            });
        }
        Ok(Self {
            history: vec![0.0; history],
            next: 0,
            filled: 0,
            initial_amax,
            margin,
            saturated: 0,
            invocations: 0,
        })
    }

    /// The scale the next invocation quantizes with.
    pub fn scale(&self) -> f32 {
        let amax = if self.filled == 0 {
            self.initial_amax
        } else {
            self.history[..self.filled]
                .iter()
                .fold(0f32, |m, &v| m.max(v))
        };
        scale_for(amax * self.margin)
    }

    /// Quantizes one invocation's values with [`Self::scale`] and records what it saw.
    pub fn quantize(&mut self, x: &[f32]) -> (Quantized, f32) {
        let scale = self.scale();
        let q = quantize_with_scale(x, scale);
        self.record(q.amax, q.saturated);
        (q, scale)
    }

    /// The amax history (`filled` slots hold values; the next record goes to slot `next`):
    /// `(history, next, filled)`.
    pub fn history(&self) -> (&[f32], usize, usize) {
        (&self.history, self.next, self.filled)
    }

    /// The amax the scale starts from while the history is empty.
    pub fn initial_amax(&self) -> f32 {
        self.initial_amax
    }

    /// A state given field by field (as a device copy of it is read back); `None` where the
    /// fields are inconsistent (an empty history, `next` or `filled` out of range, an
    /// initial amax or margin [`Self::new`] would refuse).
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        history: Vec<f32>,
        next: usize,
        filled: usize,
        initial_amax: f32,
        margin: f32,
        saturated: u64,
        invocations: u64,
    ) -> Option<Self> {
        let mut s = Self::new(history.len(), initial_amax, margin).ok()?;
        if next >= history.len() || filled > history.len() {
            return None;
        }
        s.history = history;
        s.next = next;
        s.filled = filled;
        s.saturated = saturated;
        s.invocations = invocations;
        Some(s)
    }

    /// Records an invocation's amax and saturation count (as the kernel's epilogue reports
    /// them).
    pub fn record(&mut self, amax: f32, saturated: u64) {
        self.invocations += 1;
        self.saturated += saturated;
        if amax > 0.0 && amax.is_finite() {
            self.history[self.next] = amax;
            self.next = (self.next + 1) % self.history.len();
            self.filled = (self.filled + 1).min(self.history.len());
        }
    }
}

/// Prompts packed row after row without padding. Sequence `s` owns rows
/// `cu_seqlens[s] .. cu_seqlens[s + 1]`; its row `t` is the token at cache position
/// `start[s] + t` (`start` > 0 when the cache already holds earlier tokens: chunked prefill).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packed {
    pub cu_seqlens: Vec<u32>,
    pub start: Vec<u32>,
}

impl Packed {
    /// Packs sequences of `lens` new tokens each, appended after `start` cached tokens.
    pub fn new(lens: &[usize], start: &[usize]) -> Result<Self, Fp8Error> {
        check_len("sequence starts", start.len(), lens.len())?;
        let mut cu = vec![0u32];
        for &l in lens {
            let next = *cu.last().unwrap() as u64 + l as u64;
            if next > u32::MAX as u64 {
                return Err(Fp8Error::Invalid {
                    what: "packed prompts",
                    detail: format!("{next} rows exceed u32"),
                });
            }
            cu.push(next as u32);
        }
        Ok(Self {
            cu_seqlens: cu,
            start: start.iter().map(|&s| s as u32).collect(),
        })
    }

    pub fn rows(&self) -> usize {
        *self.cu_seqlens.last().unwrap() as usize
    }

    pub fn sequences(&self) -> usize {
        self.start.len()
    }

    /// (sequence, cache position) of a packed row.
    pub fn locate(&self, row: usize) -> (usize, usize) {
        let s = self.cu_seqlens.partition_point(|&c| c as usize <= row) - 1;
        (
            s,
            self.start[s] as usize + row - self.cu_seqlens[s] as usize,
        )
    }
}

/// `acc[r][j] * a_scale[r] * w.scales[j]` in f64 over the exact E4M3 values: `[rows, n]`.
/// `a_scales` has one entry per row, or one for the whole tensor.
pub fn gemm_reference(a_codes: &[u8], a_scales: &[f32], rows: usize, w: &Fp8Weight) -> Vec<f64> {
    assert_eq!(a_codes.len(), rows * w.k, "activation codes");
    assert!(
        a_scales.len() == rows || a_scales.len() == 1,
        "activation scales"
    );
    let wv: Vec<f64> = w.codes.iter().map(|&c| e4m3_to_f32(c) as f64).collect();
    let mut out = vec![0f64; rows * w.n];
    for r in 0..rows {
        let a: Vec<f64> = a_codes[r * w.k..(r + 1) * w.k]
            .iter()
            .map(|&c| e4m3_to_f32(c) as f64)
            .collect();
        let sa = a_scales[if a_scales.len() == 1 { 0 } else { r }] as f64;
        for j in 0..w.n {
            let dot: f64 = a
                .iter()
                .zip(&wv[j * w.k..(j + 1) * w.k])
                .map(|(x, y)| x * y)
                .sum();
            out[r * w.n + j] = dot * sa * w.scales[j] as f64;
        }
    }
    out
}

/// Head layout of a fused q|k|v projection output row: `heads` q heads, then `kv_heads` k
/// heads, then `kv_heads` v heads, each `head_dim` wide.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QkvShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// What the QKV epilogue writes: q for attention (`[rows, heads, head_dim]`, RoPE applied), and
/// for every (sequence, position, kv head) its rotated k row and v row; the cache rows of one
/// sequence are `[position][kv head][head_dim]` in `k_cache[s]` / `v_cache[s]`, each sized for
/// `capacity` positions (rows the prefill does not write stay as they were).
pub struct QkvOut {
    pub q: Vec<f64>,
    pub k_cache: Vec<Vec<f64>>,
    pub v_cache: Vec<Vec<f64>>,
}

/// Rotate-half RoPE of one head at table row `pos` (`rope[pos][d / 2][2]` = cos, sin).
pub fn rope_head(x: &mut [f64], rope: &[f32], pos: usize) {
    let half = x.len() / 2;
    let cs = &rope[pos * half * 2..(pos + 1) * half * 2];
    for i in 0..half {
        let (c, s) = (cs[2 * i] as f64, cs[2 * i + 1] as f64);
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * c - b * s;
        x[i + half] = b * c + a * s;
    }
}

/// The QKV epilogue on the restored GEMM output `y` (`[rows, (heads + 2 kv_heads) head_dim]`):
/// RoPE on q and k at each row's position, q out, k and v placed at their cache slots.
/// `caches` holds each sequence's cache before the prefill (its first `start` positions are
/// earlier tokens).
pub fn qkv_epilogue_reference(
    y: &[f64],
    packed: &Packed,
    shape: QkvShape,
    rope: &[f32],
    mut caches: (Vec<Vec<f64>>, Vec<Vec<f64>>),
) -> QkvOut {
    let QkvShape {
        heads,
        kv_heads,
        head_dim: d,
    } = shape;
    let width = (heads + 2 * kv_heads) * d;
    assert_eq!(y.len(), packed.rows() * width, "q|k|v rows");
    let mut q = vec![0f64; packed.rows() * heads * d];
    for r in 0..packed.rows() {
        let (s, pos) = packed.locate(r);
        let row = &y[r * width..(r + 1) * width];
        for h in 0..heads {
            let out = &mut q[(r * heads + h) * d..(r * heads + h + 1) * d];
            out.copy_from_slice(&row[h * d..(h + 1) * d]);
            rope_head(out, rope, pos);
        }
        for h in 0..kv_heads {
            let at = (pos * kv_heads + h) * d;
            let k = &mut caches.0[s][at..at + d];
            k.copy_from_slice(&row[(heads + h) * d..(heads + h + 1) * d]);
            rope_head(k, rope, pos);
            caches.1[s][at..at + d]
                .copy_from_slice(&row[(heads + kv_heads + h) * d..(heads + kv_heads + h + 1) * d]);
        }
    }
    QkvOut {
        q,
        k_cache: caches.0,
        v_cache: caches.1,
    }
}

/// The O / down epilogue: `x = residual + y` (`[rows, n]`) and each row's sum of squares of
/// the new residual (what the next RMSNorm needs: `rms = sqrt(ss / n + eps)`).
pub fn residual_epilogue_reference(y: &[f64], residual: &[f64], n: usize) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(y.len(), residual.len(), "residual");
    let x: Vec<f64> = y.iter().zip(residual).map(|(a, b)| a + b).collect();
    let ss = x.chunks(n).map(|r| r.iter().map(|v| v * v).sum()).collect();
    (x, ss)
}

/// The row factor a projection applies in its epilogue when it reads the unnormalized residual
/// `x` (gain folded into its weights): `1 / sqrt(ss / n + eps)`.
pub fn rms_factor(ss: f64, n: usize, eps: f64) -> f64 {
    1.0 / (ss / n as f64 + eps).sqrt()
}

/// The gate|up epilogue: `h = silu(gate) * up` from the restored output `y`
/// (`[rows, 2 inter]`, gate and up columns interleaved: column `2 j` is gate `j`, `2 j + 1` is
/// up `j`, as the fused weight's rows are laid out at load), then the E4M3 input of the down
/// projection with the group's delayed scale. Returns (h, quantized h, the scale used).
pub fn swiglu_epilogue_reference(
    y: &[f64],
    inter: usize,
    scale: &mut DelayedScale,
) -> (Vec<f64>, Quantized, f32) {
    let rows = y.len() / (2 * inter);
    let mut h = vec![0f64; rows * inter];
    for r in 0..rows {
        for j in 0..inter {
            let g = y[r * 2 * inter + 2 * j];
            let u = y[r * 2 * inter + 2 * j + 1];
            h[r * inter + j] = g / (1.0 + (-g).exp()) * u;
        }
    }
    let hf: Vec<f32> = h.iter().map(|&v| v as f32).collect();
    let (q, s) = scale.quantize(&hf);
    (h, q, s)
}

#[cfg(test)]
mod tests {

    #[test]
    fn interleaved_rows_follow_the_int4_nibble_order() {
        // Two rows of 32: each 16 k stored as k 0, 8, 1, 9, .. 7, 15.
        let codes: Vec<u8> = (0..64).collect();
        let out = interleave_k16(&codes, 32);
        let block = [0u8, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15];
        for b in 0..4 {
            let want: Vec<u8> = block.iter().map(|&k| k + 16 * b as u8).collect();
            assert_eq!(&out[16 * b..16 * b + 16], &want[..]);
        }
        // The sums of 32 codes: 1.0 (0x38) x 31 and -2.0 (0xc0).
        let mut c = vec![0x38u8; 32];
        c[5] = 0xc0;
        assert_eq!(code_sums32(&c, 32), vec![29.0]);
    }

    #[test]
    fn a_gain_scales_the_codes_not_the_norm() {
        let x = [1.0f32, -2.0, 4.0, 0.5];
        let g = [2.0f32, 1.0, 0.25, 1.0];
        let (c, s) = quantize_rows_gained(&x, 1, 4, Some(&g), 0.0, true).unwrap();
        let (c0, _) = quantize_rows_fused(&[2.0, -2.0, 1.0, 0.5], 1, 4, 0.0, false).unwrap();
        assert_eq!(c, c0);
        // amax(x g) = 2, the row factor from x itself: rsqrt((1 + 4 + 16 + 0.25) / 4).
        let r = 1.0 / ((21.25f64) / 4.0).sqrt();
        assert!((f64::from(s[0]) - 2.0 * r / 448.0).abs() < 1e-9);
    }
    use super::*;

    #[test]
    fn round_trip_scales_each_group() {
        // Two groups of very different size: each keeps its own relative precision (E4M3's
        // 3 mantissa bits: within 1/16 of the value), an all-zero group stays zero.
        let mut x = vec![1000.0, -3.0, 0.5, 7.0, 1e-3, -2e-3, 5e-4, 1e-3, 0.0, 0.0];
        let orig = x.clone();
        x.chunks_mut(4).for_each(round_trip);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() <= b.abs() / 16.0 + 1e-9, "{a} vs {b}");
        }
        assert_eq!(x[0], 1000.0 / 448.0 * 448.0);
        assert_eq!(&x[8..], &[0.0, 0.0]);
        // One group over all: the small values lose everything below the 1000 scale's grid.
        let mut y = orig.clone();
        round_trip(&mut y);
        assert_eq!(y[4], 0.0);
        assert!(x[4] != 0.0);
    }

    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
            (0..n).map(|_| self.next() * scale).collect()
        }
    }

    #[test]
    fn weight_round_trip_is_within_half_an_e4m3_step() {
        let mut g = Lcg(1);
        let (n, k) = (7, 33);
        let w = g.vec(n * k, 3.0);
        let q = Fp8Weight::quantize(&w, n, k, None).unwrap();
        let back = q.dequantize();
        for j in 0..n {
            let amax = w[j * k..(j + 1) * k]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            // The channel's largest value maps onto 448 exactly.
            assert!((q.scales[j] * E4M3_MAX - amax).abs() <= amax * 1e-6);
            for i in 0..k {
                let (a, b) = (w[j * k + i], back[j * k + i]);
                // 3 mantissa bits: relative step 2^-3, half of it 2^-4; subnormals below
                // 2^-6 x scale are absolute.
                let tol = (a.abs() / 16.0).max(q.scales[j] * 2f32.powi(-10));
                assert!((a - b).abs() <= tol * 1.0001, "w[{j}][{i}] {a} -> {b}");
            }
        }
    }

    #[test]
    fn folded_gain_equals_scaling_the_input() {
        let mut g = Lcg(2);
        let (n, k, rows) = (5, 24, 3);
        let w = g.vec(n * k, 1.0);
        let gain = g.vec(k, 2.0);
        let x = g.vec(rows * k, 1.0);
        let folded = Fp8Weight::quantize(&w, n, k, Some(&gain))
            .unwrap()
            .dequantize();
        // W diag(g) x against W (g * x), both on the folded (then quantized) weight: exact up
        // to the quantization of the folded weight, which is what the kernel reads.
        for r in 0..rows {
            for j in 0..n {
                let a: f64 = (0..k)
                    .map(|i| folded[j * k + i] as f64 * x[r * k + i] as f64)
                    .sum();
                let b: f64 = (0..k)
                    .map(|i| w[j * k + i] as f64 * gain[i] as f64 * x[r * k + i] as f64)
                    .sum();
                let scale: f64 = (0..k)
                    .map(|i| (w[j * k + i] * gain[i] * x[r * k + i]).abs() as f64)
                    .sum();
                assert!((a - b).abs() <= scale / 16.0, "row {r} col {j}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn gemm_reference_restores_both_scales() {
        let mut g = Lcg(3);
        let (n, k, rows) = (6, 40, 4);
        let w = g.vec(n * k, 0.5);
        let x = g.vec(rows * k, 20.0);
        let wq = Fp8Weight::quantize(&w, n, k, None).unwrap();
        let (codes, scales) = quantize_rows_fused(&x, rows, k, 0.0, false).unwrap();
        let y = gemm_reference(&codes, &scales, rows, &wq);
        let e = |c: u8| e4m3_to_f32(c) as f64;
        for r in 0..rows {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|i| {
                        e(codes[r * k + i])
                            * scales[r] as f64
                            * e(wq.codes[j * k + i])
                            * wq.scales[j] as f64
                    })
                    .sum();
                assert!((y[r * n + j] - want).abs() <= 1e-9 * want.abs().max(1.0));
            }
        }
    }

    #[test]
    fn errors_name_what_was_wrong() {
        assert_eq!(
            Fp8Weight::quantize(&[0.0; 5], 2, 3, None).unwrap_err(),
            Fp8Error::Len {
                what: "weight",
                expected: 6,
                got: 5
            }
        );
        assert_eq!(
            Fp8Weight::quantize(&[0.0, f32::NAN], 1, 2, None).unwrap_err(),
            Fp8Error::NonFinite {
                what: "weight",
                index: 1
            }
        );
        assert!(matches!(
            Fp8Weight::quantize(&[0.0; 4], 2, 2, Some(&[1.0])),
            Err(Fp8Error::Len {
                what: "RMSNorm gain",
                ..
            })
        ));
        assert!(DelayedScale::new(0, 1.0, 1.0).is_err());
        assert!(DelayedScale::new(4, 0.0, 1.0).is_err());
        assert!(DelayedScale::new(4, 1.0, 0.5).is_err());
        assert!(Packed::new(&[1, 2], &[0]).is_err());
    }

    #[test]
    fn delayed_scale_first_call_zero_input_and_saturation() {
        let mut ds = DelayedScale::new(4, 10.0, 1.0).unwrap();
        // First invocation: the calibration amax.
        assert_eq!(ds.scale(), 10.0 / E4M3_MAX);
        let (q, s) = ds.quantize(&[1.0, -2.0, 5.0]);
        assert_eq!((s, q.saturated, q.amax), (10.0 / E4M3_MAX, 0, 5.0));
        // The next one follows the recorded amax.
        assert_eq!(ds.scale(), 5.0 / E4M3_MAX);
        // All zeros: codes 0, nothing recorded, the scale stays finite and positive.
        let (q, _) = ds.quantize(&[0.0; 8]);
        assert!(q.codes.iter().all(|&c| c == 0));
        assert_eq!(ds.scale(), 5.0 / E4M3_MAX);
        // A saturating input: counted, written as +-448, finite.
        let (q, _) = ds.quantize(&[100.0, -50.0, 1.0, f32::INFINITY, f32::NAN]);
        assert_eq!(q.saturated, 4);
        assert_eq!(e4m3_to_f32(q.codes[0]), 448.0);
        assert_eq!(e4m3_to_f32(q.codes[1]), -448.0);
        assert!(q.codes.iter().all(|&c| e4m3_to_f32(c).is_finite()));
        assert_eq!(ds.saturated, 4);
        assert_eq!(ds.invocations, 3);
        // The grown amax widens the next scale; the history forgets after 4 invocations.
        assert_eq!(ds.scale(), 100.0 / E4M3_MAX);
        for _ in 0..4 {
            ds.quantize(&[2.0]);
        }
        assert_eq!(ds.scale(), 2.0 / E4M3_MAX);
    }

    #[test]
    fn fused_rows_carry_the_rms_factor_in_the_scale() {
        let mut g = Lcg(5);
        let (rows, k, eps) = (3, 64, 1e-5f32);
        let mut x = g.vec(rows * k, 3.0);
        x[k..2 * k].iter_mut().for_each(|v| *v = 0.0);
        let (codes, scales) = quantize_rows_fused(&x, rows, k, eps, true).unwrap();
        let (plain_codes, plain_scales) = quantize_rows_fused(&x, rows, k, eps, false).unwrap();
        assert_eq!(codes, plain_codes);
        assert_eq!((scales[1], plain_scales[1]), (1.0, 1.0));
        assert!(codes[k..2 * k].iter().all(|&c| c == 0));
        for r in [0, 2] {
            let row = &x[r * k..(r + 1) * k];
            let ss: f64 = row.iter().map(|&v| f64::from(v).powi(2)).sum();
            let factor = 1.0 / (ss / k as f64 + f64::from(eps)).sqrt();
            // Dequantized codes times the scale: the normalized row within an E4M3 step.
            for (i, &v) in row.iter().enumerate() {
                let got = f64::from(e4m3_to_f32(codes[r * k + i])) * f64::from(scales[r]);
                let want = f64::from(v) * factor;
                assert!(
                    (got - want).abs() <= want.abs() / 16.0 + 1e-3 * factor,
                    "{r} {i}"
                );
            }
            assert!((f64::from(plain_scales[r]) * factor - f64::from(scales[r])).abs() < 1e-6);
        }
    }

    #[test]
    fn packed_rows_locate_their_sequence_and_position() {
        let p = Packed::new(&[3, 1, 0, 2], &[0, 7, 4, 8190]).unwrap();
        assert_eq!(p.rows(), 6);
        let got: Vec<_> = (0..6).map(|r| p.locate(r)).collect();
        assert_eq!(got, [(0, 0), (0, 1), (0, 2), (1, 7), (3, 8190), (3, 8191)]);
    }

    #[test]
    fn qkv_epilogue_places_rotated_k_and_plain_v_in_the_cache() {
        let mut g = Lcg(4);
        let shape = QkvShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
        };
        let width = (4 + 4) * 8;
        let p = Packed::new(&[2, 1], &[0, 5]).unwrap();
        let y: Vec<f64> = g
            .vec(p.rows() * width, 1.0)
            .iter()
            .map(|&v| v as f64)
            .collect();
        let cap = 8;
        let rope: Vec<f32> = (0..cap)
            .flat_map(|pos| {
                (0..4).flat_map(move |i| {
                    let a = pos as f32 * 10000f32.powf(-(2 * i) as f32 / 8.0);
                    [a.cos(), a.sin()]
                })
            })
            .collect();
        let poison = vec![vec![f64::NAN; cap * 2 * 8]; 2];
        let out = qkv_epilogue_reference(&y, &p, shape, &rope, (poison.clone(), poison));
        // Position 0 is the identity rotation; v is never rotated.
        assert_eq!(&out.q[..8], &y[..8]);
        assert_eq!(&out.k_cache[0][..8], &y[32..40]);
        assert_eq!(
            &out.v_cache[1][(5 * 2) * 8..(5 * 2 + 1) * 8],
            &y[2 * width + 48..2 * width + 56]
        );
        // Rotations keep norms; untouched slots keep their poison.
        let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>();
        let k = &out.k_cache[0][(2 + 1) * 8..(2 + 2) * 8];
        assert!((norm(k) - norm(&y[width + 40..width + 48])).abs() < 1e-6);
        assert!(out.k_cache[0][2 * 2 * 8].is_nan() && out.k_cache[1][0].is_nan());
    }

    #[test]
    fn residual_sums_and_swiglu_follow_their_definitions() {
        let (x, ss) = residual_epilogue_reference(&[1.0, 2.0, 3.0, 4.0], &[1.0, 0.0, -3.0, 0.0], 2);
        assert_eq!(x, [2.0, 2.0, 0.0, 4.0]);
        assert_eq!(ss, [8.0, 16.0]);
        assert!((rms_factor(8.0, 2, 0.0) - 0.5).abs() < 1e-12);
        let mut ds = DelayedScale::new(2, 4.0, 1.0).unwrap();
        let (h, q, s) = swiglu_epilogue_reference(&[0.0, 3.0, 2.0, -1.0], 2, &mut ds);
        let silu = |g: f64| g / (1.0 + (-g).exp());
        assert_eq!(h, [0.0, -silu(2.0)]);
        assert_eq!(s, 4.0 / E4M3_MAX);
        assert_eq!(q.saturated, 0);
        assert_eq!(q.codes.len(), 2);
    }
}
