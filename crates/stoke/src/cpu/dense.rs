//! `x W` for a dense f32 weight `[k, n]` read where it lies (no per-call copy): each task owns a
//! block of columns and streams the weight's rows through it once for up to four input rows.

use rayon::prelude::*;

/// Columns per task: four cache lines of each weight row.
const BLOCK: usize = 64;
const ROWS: usize = 4;

/// `x [rows, k]` times `w [k, n]` (both row-major): `[rows, n]`.
pub fn matmul(x: &[f32], rows: usize, w: &[f32], k: usize, n: usize) -> Vec<f32> {
    assert_eq!(x.len(), rows * k, "dense matmul: x is not [rows, k]");
    assert_eq!(w.len(), k * n, "dense matmul: w is not [k, n]");
    let blocks = n.div_ceil(BLOCK);
    let mut blocked = vec![0f32; blocks * rows * BLOCK];
    let arch = pulp::Arch::new();
    blocked
        .par_chunks_mut(rows * BLOCK)
        .enumerate()
        .for_each(|(b, out)| {
            arch.dispatch(BlockTask {
                x,
                w,
                out,
                rows,
                k,
                n,
                c0: b * BLOCK,
            })
        });
    super::unblock(&blocked, rows, n, BLOCK)
}

/// One column block for every input row, compiled for the SIMD level pulp found.
struct BlockTask<'a> {
    x: &'a [f32],
    w: &'a [f32],
    out: &'a mut [f32],
    rows: usize,
    k: usize,
    n: usize,
    c0: usize,
}

impl pulp::WithSimd for BlockTask<'_> {
    type Output = ();
    #[inline(always)]
    fn with_simd<S: pulp::Simd>(self, _: S) {
        let Self {
            x,
            w,
            out,
            rows,
            k,
            n,
            c0,
        } = self;
        let cols = (n - c0).min(BLOCK);
        let mut r0 = 0;
        while r0 < rows {
            let r = (rows - r0).min(ROWS);
            let xs = &x[r0 * k..(r0 + r) * k];
            let o = &mut out[r0 * BLOCK..(r0 + r) * BLOCK];
            if cols == BLOCK {
                match r {
                    4 => block::<4>(xs, w, o, k, n, c0),
                    3 => block::<3>(xs, w, o, k, n, c0),
                    2 => block::<2>(xs, w, o, k, n, c0),
                    _ => block::<1>(xs, w, o, k, n, c0),
                }
            } else {
                edge(xs, r, w, o, k, n, c0, cols);
            }
            r0 += r;
        }
    }
}

#[inline(always)]
fn block<const R: usize>(x: &[f32], w: &[f32], out: &mut [f32], k: usize, n: usize, c0: usize) {
    let mut acc = [[0f32; BLOCK]; R];
    for i in 0..k {
        let row: &[f32; BLOCK] = w[i * n + c0..][..BLOCK].try_into().unwrap();
        for r in 0..R {
            let xv = x[r * k + i];
            for j in 0..BLOCK {
                acc[r][j] = xv.mul_add(row[j], acc[r][j]);
            }
        }
    }
    for r in 0..R {
        out[r * BLOCK..][..BLOCK].copy_from_slice(&acc[r]);
    }
}

/// The last, partial column block.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn edge(
    x: &[f32],
    rows: usize,
    w: &[f32],
    out: &mut [f32],
    k: usize,
    n: usize,
    c0: usize,
    cols: usize,
) {
    for r in 0..rows {
        let o = &mut out[r * BLOCK..][..cols];
        for i in 0..k {
            let xv = x[r * k + i];
            for (j, v) in o.iter_mut().enumerate() {
                *v = xv.mul_add(w[i * n + c0 + j], *v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::cpu::tests::lcg;

    #[test]
    fn matches_f64_reference() {
        let mut seed = 11u64;
        let mut next = || lcg(&mut seed);
        for &(rows, k, n) in &[(1, 8, 64), (5, 33, 100), (4, 576, 192), (2, 7, 3)] {
            let x: Vec<f32> = (0..rows * k).map(|_| next()).collect();
            let w: Vec<f32> = (0..k * n).map(|_| next()).collect();
            let y = super::matmul(&x, rows, &w, k, n);
            for r in 0..rows {
                for c in 0..n {
                    let want: f64 = (0..k)
                        .map(|i| x[r * k + i] as f64 * w[i * n + c] as f64)
                        .sum();
                    let got = y[r * n + c] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (k as f64),
                        "[{rows}, {k}] x [{k}, {n}]: ({r}, {c}) {got} vs {want}"
                    );
                }
            }
        }
    }
}
