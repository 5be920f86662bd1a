//! Packed INT4 weights in the CPU kernel's layout, and the kernel.
//!
//! The GPU format stores nibbles in tensor-core fragment order; the CPU kernel wants each
//! 16-column block's two rows in one 16-byte load. [`CpuInt4::from_packed`] reorders the same
//! nibbles once (lossless, 4 bits per weight, scales and offsets as f32), so a decode step reads
//! 4.5 bits per weight plus the group parameters, never a dequantized copy.
//!
//! `y[i, c] = sum_g (d[g, c] * sum_{r in g} x[i, r] q[r, c] + m[g, c] * sum_{r in g} x[i, r])`:
//! the same value as `x` times the dequantized weight `d q + m`, summed in another order.

use rayon::prelude::*;
use stoke_formats::int4::PackedInt4;

/// Columns per block: one 16-byte load holds a row pair's nibbles for all of them.
const BLOCK: usize = 16;
/// Input rows sharing one decode of the nibbles.
const ROWS: usize = 4;

/// A packed INT4 weight `[k, n]` in the CPU layout.
pub struct CpuInt4 {
    pub k: usize,
    pub n: usize,
    pub group: usize,
    /// `[n / 16][k / 2][16]`: byte `j` of row pair `p` holds `q[2p, c]` (low nibble) and
    /// `q[2p + 1, c]` (high nibble) of column `c = 16 b + j`.
    q: Vec<u8>,
    /// `[n / 16][k / group][16]` scales and offsets (`w = d q + m`).
    d: Vec<f32>,
    m: Vec<f32>,
}

impl std::fmt::Debug for CpuInt4 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuInt4([{}, {}], group {})", self.k, self.n, self.group)
    }
}

impl CpuInt4 {
    /// The CPU layout of `p` (`k` a multiple of 16 and `n` of 64, as the packed format keeps).
    pub fn from_packed(p: &PackedInt4) -> Self {
        let (k, n, group) = (p.k, p.n, p.group);
        let q = p.unpack_q();
        let blocks = n / BLOCK;
        let groups = k / group;
        let mut qb = vec![0u8; n * k / 2];
        qb.par_chunks_mut(k / 2 * BLOCK)
            .enumerate()
            .for_each(|(b, out)| {
                for pair in 0..k / 2 {
                    let lo = &q[2 * pair * n + b * BLOCK..][..BLOCK];
                    let hi = &q[(2 * pair + 1) * n + b * BLOCK..][..BLOCK];
                    for j in 0..BLOCK {
                        out[pair * BLOCK + j] = lo[j] | (hi[j] << 4);
                    }
                }
            });
        let mut d = vec![0f32; groups * n];
        let mut m = vec![0f32; groups * n];
        for b in 0..blocks {
            for g in 0..groups {
                for j in 0..BLOCK {
                    let (dd, mm) = p.group_params(g * group, b * BLOCK + j);
                    d[(b * groups + g) * BLOCK + j] = dd;
                    m[(b * groups + g) * BLOCK + j] = mm;
                }
            }
        }
        Self {
            k,
            n,
            group,
            q: qb,
            d,
            m,
        }
    }

    /// Bytes the kernel reads per call: nibbles, scales and offsets.
    pub fn bytes(&self) -> usize {
        self.q.len() + 4 * (self.d.len() + self.m.len())
    }

    /// `x [rows, k]` (row-major) times the weight: `[rows, n]`.
    pub fn matmul(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let (k, n, group) = (self.k, self.n, self.group);
        assert_eq!(x.len(), rows * k, "CpuInt4::matmul: x is not [rows, k]");
        let groups = k / group;
        // Row sums of x over each group, for the offsets.
        let xsum: Vec<f32> = x
            .chunks_exact(group)
            .map(|c| c.iter().sum::<f32>())
            .collect();
        // Output as [n / 16][rows][16]: each block's part is one contiguous chunk.
        let mut blocked = vec![0f32; n * rows];
        let arch = pulp::Arch::new();
        blocked
            .par_chunks_mut(rows * BLOCK)
            .enumerate()
            .for_each(|(b, out)| {
                arch.dispatch(BlockTask {
                    q: &self.q[b * (k / 2) * BLOCK..][..(k / 2) * BLOCK],
                    d: &self.d[b * groups * BLOCK..][..groups * BLOCK],
                    m: &self.m[b * groups * BLOCK..][..groups * BLOCK],
                    x,
                    xsum: &xsum,
                    out,
                    rows,
                    k,
                    group,
                })
            });
        super::unblock(&blocked, rows, n, BLOCK)
    }
}

/// One 16-column block for every input row, compiled for the SIMD level pulp found (the body
/// is inlined into its `target_feature` function, so the loops vectorize for it).
struct BlockTask<'a> {
    q: &'a [u8],
    d: &'a [f32],
    m: &'a [f32],
    x: &'a [f32],
    xsum: &'a [f32],
    out: &'a mut [f32],
    rows: usize,
    k: usize,
    group: usize,
}

impl pulp::WithSimd for BlockTask<'_> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let Self {
            q,
            d,
            m,
            x,
            xsum,
            out,
            rows,
            k,
            group,
        } = self;
        let groups = k / group;
        let mut r0 = 0;
        while r0 < rows {
            let r = (rows - r0).min(ROWS);
            let xs = &x[r0 * k..(r0 + r) * k];
            let ss = &xsum[r0 * groups..(r0 + r) * groups];
            let o = &mut out[r0 * BLOCK..(r0 + r) * BLOCK];
            match r {
                4 => block::<4>(q, d, m, xs, ss, o, k, group),
                3 => block::<3>(q, d, m, xs, ss, o, k, group),
                2 => block::<2>(q, d, m, xs, ss, o, k, group),
                _ => block::<1>(q, d, m, xs, ss, o, k, group),
            }
            r0 += r;
        }
    }
}

/// One 16-column block for `R` input rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block<const R: usize>(
    q: &[u8],
    d: &[f32],
    m: &[f32],
    x: &[f32],
    xsum: &[f32],
    out: &mut [f32],
    k: usize,
    group: usize,
) {
    let groups = k / group;
    let mut y = [[0f32; BLOCK]; R];
    for g in 0..groups {
        let mut acc = [[0f32; BLOCK]; R];
        for pair in g * group / 2..(g + 1) * group / 2 {
            let bytes: &[u8; BLOCK] = q[pair * BLOCK..][..BLOCK].try_into().unwrap();
            let mut lo = [0f32; BLOCK];
            let mut hi = [0f32; BLOCK];
            for j in 0..BLOCK {
                lo[j] = (bytes[j] & 0xF) as f32;
                hi[j] = (bytes[j] >> 4) as f32;
            }
            for r in 0..R {
                let x0 = x[r * k + 2 * pair];
                let x1 = x[r * k + 2 * pair + 1];
                for j in 0..BLOCK {
                    acc[r][j] = x1.mul_add(hi[j], x0.mul_add(lo[j], acc[r][j]));
                }
            }
        }
        let dg = &d[g * BLOCK..][..BLOCK];
        let mg = &m[g * BLOCK..][..BLOCK];
        for r in 0..R {
            let s = xsum[r * groups + g];
            for j in 0..BLOCK {
                y[r][j] = dg[j].mul_add(acc[r][j], mg[j].mul_add(s, y[r][j]));
            }
        }
    }
    for r in 0..R {
        out[r * BLOCK..][..BLOCK].copy_from_slice(&y[r]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::tests::lcg;
    use stoke_formats::int4::{ScaleType, quantize_rtn};

    /// The kernel against x times the dequantized weight in f64, symmetric and with offsets,
    /// for every row count the kernel splits into.
    #[test]
    fn matches_dequantized_reference() {
        let mut seed = 7;
        for &(k, n, group, rows) in &[
            (64, 64, 32, 1),
            (128, 128, 64, 3),
            (576, 192, 64, 5),
            (1536, 64, 128, 9),
        ] {
            let w: Vec<f32> = (0..k * n).map(|_| lcg(&mut seed)).collect();
            let mut p = quantize_rtn(&w, k, n, group, ScaleType::Bf16).unwrap();
            if rows % 2 == 1 {
                // Asymmetric groups (GGUF Q4_1, AWQ): explicit offsets.
                let offsets = p
                    .scales
                    .iter()
                    .map(|&s| ScaleType::Bf16.from_f32(-7.5 * ScaleType::Bf16.to_f32(s)))
                    .collect();
                p.offsets = Some(offsets);
            }
            let deq = p.dequantize();
            let x: Vec<f32> = (0..rows * k).map(|_| lcg(&mut seed)).collect();
            let cpu = CpuInt4::from_packed(&p);
            let mut y = cpu.matmul(&x, rows);
            assert_eq!(y.len(), rows * n);
            for r in 0..rows {
                for c in 0..n {
                    let want: f64 = (0..k)
                        .map(|i| x[r * k + i] as f64 * deq[i * n + c] as f64)
                        .sum();
                    let scale: f64 = (0..k)
                        .map(|i| (x[r * k + i] as f64 * deq[i * n + c] as f64).abs())
                        .sum();
                    let got = y[r * n + c] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * scale.max(1.0),
                        "k {k} n {n} group {group} rows {rows}: ({r}, {c}) {got} vs {want}"
                    );
                    y[r * n + c] = f32::NAN; // every element checked exactly once
                }
            }
            assert!(y.iter().all(|v| v.is_nan()));
        }
    }
}
