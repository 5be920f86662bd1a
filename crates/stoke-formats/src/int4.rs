//! Group-wise INT4 weights in the tensor-core fragment order Stoke's W4A16 kernels read.
//! The packer in this module is the specification; `docs/INT4_FORMAT.md` draws it.
//!
//! A weight `W` of `k` input rows and `n` output columns (`y = x W`, Burn's Linear layout) is
//! split into groups of `group` consecutive rows per column. Every element is an unsigned
//! nibble `q` in 0..=15 and its group has a scale `d` and an offset `m`:
//!
//! ```text
//!     w = d * q + m          (asymmetric: GGUF Q4_1, AWQ/GPTQ zero points)
//!     w = d * (q - 8)        (symmetric: RTN, GPTQ, GGUF Q4_0), i.e. m = -8 d, exact
//! ```
//!
//! so the kernel's inner loop is the same for both: nibbles become the bf16 values `128 + q`
//! exactly (one magic-number LOP3 per pair), and the group's `d` and `m` are applied to the
//! finished sums (`docs/INT4_FORMAT.md`). Scales and offsets are stored as raw 16-bit patterns of `scale_dtype` (bf16 or f16:
//! GGUF's f16 scales load exactly).
//!
//! Nibble order. `mma.sync.m16n8k16` takes B as 16x8 (k x n) tiles; lane `l` of a warp
//! (`g = l / 4`, `t = l % 4`) holds column `g`, rows `2t, 2t+1` in register `b0` and rows
//! `2t+8, 2t+9` in `b1` (PTX ISA, "Matrix Fragments for mma.m16n8k16"). One 32-bit word per lane
//! covers a 16x16 tile (two n-tiles, so four registers):
//!
//! ```text
//!     bits  0..4 | 16..20  -> n-tile 0, b0: rows 2t, 2t+1    (column g)
//!     bits  4..8 | 20..24  -> n-tile 0, b1: rows 2t+8, 2t+9  (column g)
//!     bits  8..12| 24..28  -> n-tile 1, b0: rows 2t, 2t+1    (column 8+g)
//!     bits 12..16| 28..32  -> n-tile 1, b1: rows 2t+8, 2t+9  (column 8+g)
//! ```
//!
//! so `(word >> 4i) & 0x000f000f` is register `i`'s two values, low half first. Words are
//! stored tile-major: for each 16-row k-tile, for each group of four 16-column tiles, the 32
//! lanes' four words in a row, so a lane fetches four tiles' words with one 16-byte load:
//! `words[((kt * (n / 64) + nq) * 32 + lane) * 4 + j]` for column tile `nt = 4 nq + j`.
//! `k` must be a multiple of 16 and `n` of 64 (callers pad); `group` a multiple of 16 dividing
//! `k`.

/// The 16-bit float type of scales and offsets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleType {
    Bf16,
    F16,
}

impl ScaleType {
    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            ScaleType::Bf16 => half::bf16::from_bits(bits).to_f32(),
            ScaleType::F16 => half::f16::from_bits(bits).to_f32(),
        }
    }
    pub fn from_f32(self, v: f32) -> u16 {
        match self {
            ScaleType::Bf16 => half::bf16::from_f32(v).to_bits(),
            ScaleType::F16 => half::f16::from_f32(v).to_bits(),
        }
    }
}

/// A packed INT4 weight.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedInt4 {
    pub k: usize,
    pub n: usize,
    pub group: usize,
    pub scale_type: ScaleType,
    /// `[k / group, n]` row-major.
    pub scales: Vec<u16>,
    /// `[k / group, n]` row-major; `None` for symmetric weights (offset = -8 x scale).
    pub offsets: Option<Vec<u16>>,
    /// `k * n / 8` words in fragment order (see the module docs).
    pub words: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Int4Error {
    #[error("INT4 weight of {k} x {n}: k must be a multiple of 16 and n of 64")]
    Shape { k: usize, n: usize },
    #[error("INT4 group size {group} must be a multiple of 16 that divides k = {k}")]
    Group { group: usize, k: usize },
    #[error("INT4 {what} has {actual} values, expected {expected}")]
    Len {
        what: &'static str,
        expected: usize,
        actual: usize,
    },
    #[error("INT4 weights to interleave differ: [k, n, group] {a:?} vs {b:?} (or scale types)")]
    Mismatch {
        a: (usize, usize, usize),
        b: (usize, usize, usize),
    },
    #[error("INT4 value {value} at ({row}, {col}) is outside 0..=15")]
    Range { row: usize, col: usize, value: u8 },
}

/// Position of element `(row, col)`: (word index, bit shift of its nibble).
pub fn nibble_position(n: usize, row: usize, col: usize) -> (usize, u32) {
    let (kt, r) = (row / 16, row % 16);
    let (nt, c) = (col / 16, col % 16);
    let (nq, j) = (nt / 4, nt % 4);
    let (half, g) = (c / 8, c % 8); // which n-tile of the pair, and the fragment column
    let (reg_k, t, hi) = (r / 8, (r % 8) / 2, r % 2); // b0 or b1, thread in group, second value
    let lane = g * 4 + t;
    let reg = half * 2 + reg_k;
    let word = ((kt * (n / 64) + nq) * 32 + lane) * 4 + j;
    (word, reg as u32 * 4 + hi as u32 * 16)
}

fn check_shape(k: usize, n: usize, group: usize) -> Result<(), Int4Error> {
    if !k.is_multiple_of(16) || !n.is_multiple_of(64) || k == 0 || n == 0 {
        return Err(Int4Error::Shape { k, n });
    }
    if group == 0 || !group.is_multiple_of(16) || !k.is_multiple_of(group) {
        return Err(Int4Error::Group { group, k });
    }
    Ok(())
}

impl PackedInt4 {
    /// Packs unsigned nibbles `q` (`[k, n]` row-major, values 0..=15) with their groups' scales
    /// and offsets (`None`: symmetric).
    pub fn pack(
        q: &[u8],
        k: usize,
        n: usize,
        group: usize,
        scale_type: ScaleType,
        scales: Vec<u16>,
        offsets: Option<Vec<u16>>,
    ) -> Result<Self, Int4Error> {
        check_shape(k, n, group)?;
        let len = |what, expected: usize, actual: usize| {
            if expected == actual {
                Ok(())
            } else {
                Err(Int4Error::Len {
                    what,
                    expected,
                    actual,
                })
            }
        };
        len("q", k * n, q.len())?;
        len("scales", k / group * n, scales.len())?;
        if let Some(o) = &offsets {
            len("offsets", k / group * n, o.len())?;
        }
        let mut words = vec![0u32; k * n / 8];
        for row in 0..k {
            for col in 0..n {
                let v = q[row * n + col];
                if v > 15 {
                    return Err(Int4Error::Range { row, col, value: v });
                }
                let (w, shift) = nibble_position(n, row, col);
                words[w] |= (v as u32) << shift;
            }
        }
        Ok(Self {
            k,
            n,
            group,
            scale_type,
            scales,
            offsets,
            words,
        })
    }

    /// The exact inverse of [`PackedInt4::pack`]'s nibble placement: `q` as `[k, n]`.
    pub fn unpack_q(&self) -> Vec<u8> {
        let mut q = vec![0u8; self.k * self.n];
        for row in 0..self.k {
            for col in 0..self.n {
                let (w, shift) = nibble_position(self.n, row, col);
                q[row * self.n + col] = ((self.words[w] >> shift) & 0xF) as u8;
            }
        }
        q
    }

    /// Scale and offset of the group holding `(row, col)`, as f32.
    pub fn group_params(&self, row: usize, col: usize) -> (f32, f32) {
        let i = (row / self.group) * self.n + col;
        let d = self.scale_type.to_f32(self.scales[i]);
        let m = match &self.offsets {
            Some(o) => self.scale_type.to_f32(o[i]),
            None => -8.0 * d,
        };
        (d, m)
    }

    /// The weight as f32 `[k, n]`: `d * q + m` per element, computed in f32 (the reference the
    /// kernels are tested against).
    pub fn dequantize(&self) -> Vec<f32> {
        let q = self.unpack_q();
        let mut out = vec![0f32; self.k * self.n];
        for row in 0..self.k {
            for col in 0..self.n {
                let (d, m) = self.group_params(row, col);
                out[row * self.n + col] = d * q[row * self.n + col] as f32 + m;
            }
        }
        out
    }

    /// The same weight with its columns reordered: new column `c` is old column `from[c]`.
    pub fn permute_columns(&self, from: &[usize]) -> Result<Self, Int4Error> {
        if from.len() != self.n {
            return Err(Int4Error::Len {
                what: "column permutation",
                expected: self.n,
                actual: from.len(),
            });
        }
        self.select_columns(from)
    }

    /// The weight of columns `from` (new column `c` is old column `from[c]`; `from.len()` a
    /// multiple of 64): a column-parallel shard, or a reordering.
    pub fn select_columns(&self, from: &[usize]) -> Result<Self, Int4Error> {
        let (k, n, groups, m) = (self.k, self.n, self.k / self.group, from.len());
        if let Some(&c) = from.iter().find(|&&c| c >= n) {
            return Err(Int4Error::Len {
                what: "column selection (a column index)",
                expected: n,
                actual: c + 1,
            });
        }
        let q = self.unpack_q();
        let select = |v: &[u16]| -> Vec<u16> {
            (0..groups * m)
                .map(|i| v[(i / m) * n + from[i % m]])
                .collect()
        };
        let q2: Vec<u8> = (0..k * m).map(|i| q[(i / m) * n + from[i % m]]).collect();
        PackedInt4::pack(
            &q2,
            k,
            m,
            self.group,
            self.scale_type,
            select(&self.scales),
            self.offsets.as_deref().map(select),
        )
    }

    /// The weight of input rows `rows` (a row-parallel shard): the range must start and end on
    /// group boundaries.
    pub fn select_rows(&self, rows: std::ops::Range<usize>) -> Result<Self, Int4Error> {
        let (n, g) = (self.n, self.group);
        if !rows.start.is_multiple_of(g)
            || !rows.end.is_multiple_of(g)
            || rows.end > self.k
            || rows.is_empty()
        {
            return Err(Int4Error::Group {
                group: g,
                k: rows.len(),
            });
        }
        let q = self.unpack_q();
        let groups = rows.start / g..rows.end / g;
        let part = |v: &[u16]| v[groups.start * n..groups.end * n].to_vec();
        PackedInt4::pack(
            &q[rows.start * n..rows.end * n],
            rows.len(),
            n,
            g,
            self.scale_type,
            part(&self.scales),
            self.offsets.as_deref().map(part),
        )
    }

    /// The groups' offsets, those of a symmetric weight written out (`m = -8 d`, exact): for
    /// combining it with an asymmetric one.
    fn offsets_written_out(&self) -> Vec<u16> {
        match &self.offsets {
            Some(o) => o.clone(),
            None => self
                .scales
                .iter()
                .map(|&d| self.scale_type.from_f32(-8.0 * self.scale_type.to_f32(d)))
                .collect(),
        }
    }

    /// Two weights of the same shape side by side with their columns interleaved: column `2j` is
    /// `a`'s column `j`, column `2j + 1` is `b`'s (gate and up for a SwiGLU epilogue). A symmetric
    /// weight paired with an asymmetric one gets its offsets written out (`m = -8 d`, exact).
    pub fn interleave_columns(a: &PackedInt4, b: &PackedInt4) -> Result<PackedInt4, Int4Error> {
        if a.k != b.k || a.n != b.n || a.group != b.group || a.scale_type != b.scale_type {
            return Err(Int4Error::Mismatch {
                a: (a.k, a.n, a.group),
                b: (b.k, b.n, b.group),
            });
        }
        let (k, n, groups) = (a.k, a.n, a.k / a.group);
        let (qa, qb) = (a.unpack_q(), b.unpack_q());
        let q: Vec<u8> = (0..k * 2 * n)
            .map(|i| {
                let (row, col) = (i / (2 * n), i % (2 * n));
                let src = if col % 2 == 0 { &qa } else { &qb };
                src[row * n + col / 2]
            })
            .collect();
        let mix = |x: &[u16], y: &[u16]| -> Vec<u16> {
            (0..groups * 2 * n)
                .map(|i| {
                    let (g, col) = (i / (2 * n), i % (2 * n));
                    let src = if col % 2 == 0 { x } else { y };
                    src[g * n + col / 2]
                })
                .collect()
        };
        let offsets = if a.offsets.is_none() && b.offsets.is_none() {
            None
        } else {
            Some(mix(&a.offsets_written_out(), &b.offsets_written_out()))
        };
        PackedInt4::pack(
            &q,
            k,
            2 * n,
            a.group,
            a.scale_type,
            mix(&a.scales, &b.scales),
            offsets,
        )
    }

    /// Weights of the same `k`, group and scale type side by side: the columns of `parts[0]`,
    /// then those of `parts[1]`, ... (q, k and v into one q|k|v projection). Symmetric parts
    /// next to asymmetric ones get their offsets written out (`m = -8 d`, exact).
    pub fn concat_columns(parts: &[&PackedInt4]) -> Result<PackedInt4, Int4Error> {
        let first = *parts.first().ok_or(Int4Error::Len {
            what: "weights to concatenate",
            expected: 1,
            actual: 0,
        })?;
        if let Some(b) = parts
            .iter()
            .find(|p| p.k != first.k || p.group != first.group || p.scale_type != first.scale_type)
        {
            return Err(Int4Error::Mismatch {
                a: (first.k, first.n, first.group),
                b: (b.k, b.n, b.group),
            });
        }
        let (k, groups) = (first.k, first.k / first.group);
        let n: usize = parts.iter().map(|p| p.n).sum();
        // Column `c` of the result: (part, its column).
        let source: Vec<(usize, usize)> = parts
            .iter()
            .enumerate()
            .flat_map(|(i, p)| (0..p.n).map(move |c| (i, c)))
            .collect();
        let qs: Vec<Vec<u8>> = parts.iter().map(|p| p.unpack_q()).collect();
        let q: Vec<u8> = (0..k * n)
            .map(|i| {
                let (part, c) = source[i % n];
                qs[part][(i / n) * parts[part].n + c]
            })
            .collect();
        let gather = |of: &dyn Fn(&PackedInt4) -> Vec<u16>| -> Vec<u16> {
            let vals: Vec<Vec<u16>> = parts.iter().map(|p| of(p)).collect();
            (0..groups * n)
                .map(|i| {
                    let (part, c) = source[i % n];
                    vals[part][(i / n) * parts[part].n + c]
                })
                .collect()
        };
        let offsets = if parts.iter().all(|p| p.offsets.is_none()) {
            None
        } else {
            Some(gather(&PackedInt4::offsets_written_out))
        };
        PackedInt4::pack(
            &q,
            k,
            n,
            first.group,
            first.scale_type,
            gather(&|p: &PackedInt4| p.scales.clone()),
            offsets,
        )
    }

    /// Bytes the kernel reads: packed words plus scales (and offsets).
    pub fn bytes(&self) -> usize {
        self.words.len() * 4
            + self.scales.len() * 2
            + self.offsets.as_ref().map_or(0, |o| o.len() * 2)
    }
}

/// Round-to-nearest symmetric quantization of `w` (`[k, n]` row-major, f32): per group of
/// `group` rows and per column, `scale = amax / 7`, `q = clamp(round(w / scale), -8, 7) + 8`
/// (round half to even, as Burn's `round`).
/// The scale is rounded to `scale_type` first, and `q` computed with the rounded scale.
pub fn quantize_rtn(
    w: &[f32],
    k: usize,
    n: usize,
    group: usize,
    scale_type: ScaleType,
) -> Result<PackedInt4, Int4Error> {
    check_shape(k, n, group)?;
    if w.len() != k * n {
        return Err(Int4Error::Len {
            what: "w",
            expected: k * n,
            actual: w.len(),
        });
    }
    let groups = k / group;
    let mut scales = vec![0u16; groups * n];
    let mut q = vec![0u8; k * n];
    for gi in 0..groups {
        for col in 0..n {
            let rows = gi * group..(gi + 1) * group;
            let amax = rows
                .clone()
                .map(|r| w[r * n + col].abs())
                .fold(0f32, f32::max);
            let bits = scale_type.from_f32(amax / 7.0);
            scales[gi * n + col] = bits;
            let d = scale_type.to_f32(bits);
            for r in rows {
                let v = if d > 0.0 {
                    (w[r * n + col] / d).round_ties_even().clamp(-8.0, 7.0)
                } else {
                    0.0
                };
                q[r * n + col] = (v as i32 + 8) as u8;
            }
        }
    }
    PackedInt4::pack(&q, k, n, group, scale_type, scales, None)
}

/// GGUF Q4_0 / Q4_1 blocks of a `[n, k]` (out x in) matrix, loaded into the kernel format
/// without re-quantization: each 32-value block along `k` is one group of its column (`x W`
/// layout transposes the file's rows), the block's f16 `d` (and `m`) kept bit for bit.
/// `asymmetric`: Q4_1 (`d * q + m`); otherwise Q4_0 (`d * (q - 8)`).
pub fn from_gguf_q4(
    raw: &[u8],
    out_features: usize,
    in_features: usize,
    asymmetric: bool,
) -> Result<PackedInt4, Int4Error> {
    let (k, n, group) = (in_features, out_features, 32);
    check_shape(k, n, group)?;
    let block = if asymmetric { 20 } else { 18 };
    let blocks_per_row = k / 32;
    let expected = n * blocks_per_row * block;
    if raw.len() != expected {
        return Err(Int4Error::Len {
            what: "GGUF Q4 bytes",
            expected,
            actual: raw.len(),
        });
    }
    let mut q = vec![0u8; k * n];
    let mut scales = vec![0u16; (k / group) * n];
    let mut offsets = asymmetric.then(|| vec![0u16; (k / group) * n]);
    for col in 0..n {
        for b in 0..blocks_per_row {
            let blk = &raw[(col * blocks_per_row + b) * block..][..block];
            scales[b * n + col] = u16::from_le_bytes([blk[0], blk[1]]);
            let qs = if asymmetric {
                offsets.as_mut().unwrap()[b * n + col] = u16::from_le_bytes([blk[2], blk[3]]);
                &blk[4..20]
            } else {
                &blk[2..18]
            };
            // Byte j holds element j (low nibble) and element j + 16 (high nibble).
            for (j, &byte) in qs.iter().enumerate() {
                q[(b * 32 + j) * n + col] = byte & 0xF;
                q[(b * 32 + j + 16) * n + col] = byte >> 4;
            }
        }
    }
    PackedInt4::pack(&q, k, n, group, ScaleType::F16, scales, offsets)
}

#[cfg(test)]
mod tests {
    #[test]
    fn selected_rows_and_columns_dequantize_to_the_slices() {
        use super::*;
        let (k, n) = (128, 192);
        let q: Vec<u8> = (0..k * n).map(|i| ((i * 11 + 3) % 16) as u8).collect();
        let sc = |seed: usize| -> Vec<u16> {
            (0..k / 32 * n)
                .map(|i| ScaleType::Bf16.from_f32(0.01 * (1 + (i + seed) % 7) as f32))
                .collect()
        };
        let w = PackedInt4::pack(&q, k, n, 32, ScaleType::Bf16, sc(0), Some(sc(4))).unwrap();
        let d = w.dequantize();
        let cols: Vec<usize> = (0..64).map(|c| (c * 5 + 17) % n).collect();
        let wc = w.select_columns(&cols).unwrap();
        let dc = wc.dequantize();
        for r in 0..k {
            for (j, &c) in cols.iter().enumerate() {
                assert_eq!(dc[r * 64 + j], d[r * n + c]);
            }
        }
        let wr = w.select_rows(32..96).unwrap();
        assert_eq!(wr.dequantize(), d[32 * n..96 * n].to_vec());
        assert!(w.select_rows(16..96).is_err());
        assert!(w.select_columns(&[n; 64]).is_err());
        assert!(w.select_columns(&cols[..32]).is_err());
    }

    #[test]
    fn interleaved_columns_dequantize_to_the_two_weights() {
        use super::*;
        let (k, n) = (64, 64);
        let q = |seed: u32| -> Vec<u8> {
            (0..k * n)
                .map(|i| ((i as u32 * 7 + seed) % 16) as u8)
                .collect()
        };
        let sc = |seed: u16| -> Vec<u16> {
            (0..k / 32 * n)
                .map(|i| ScaleType::F16.from_f32(0.01 * (1 + (i as u16 + seed) % 5) as f32))
                .collect()
        };
        let a = PackedInt4::pack(&q(1), k, n, 32, ScaleType::F16, sc(0), None).unwrap();
        let b = PackedInt4::pack(&q(5), k, n, 32, ScaleType::F16, sc(2), Some(sc(3))).unwrap();
        let ab = PackedInt4::interleave_columns(&a, &b).unwrap();
        assert_eq!((ab.k, ab.n), (k, 2 * n));
        let (da, db, dab) = (a.dequantize(), b.dequantize(), ab.dequantize());
        for r in 0..k {
            for j in 0..n {
                assert_eq!(dab[r * 2 * n + 2 * j], da[r * n + j]);
                assert_eq!(dab[r * 2 * n + 2 * j + 1], db[r * n + j]);
            }
        }
        let c = PackedInt4::pack(&q(1), k, n, 64, ScaleType::F16, vec![0; n], None).unwrap();
        assert!(PackedInt4::interleave_columns(&a, &c).is_err());
    }

    #[test]
    fn concatenated_columns_dequantize_to_the_parts() {
        use super::*;
        let k = 64;
        let part = |n: usize, seed: u32, asym: bool| {
            let q: Vec<u8> = (0..k * n)
                .map(|i| ((i as u32 * 5 + seed) % 16) as u8)
                .collect();
            let sc = |s: u16| -> Vec<u16> {
                (0..k / 32 * n)
                    .map(|i| ScaleType::F16.from_f32(0.01 * (1 + (i as u16 + s) % 7) as f32))
                    .collect()
            };
            PackedInt4::pack(
                &q,
                k,
                n,
                32,
                ScaleType::F16,
                sc(seed as u16),
                asym.then(|| sc(3)),
            )
            .unwrap()
        };
        let (a, b, c) = (part(128, 1, false), part(64, 2, true), part(64, 3, false));
        let abc = PackedInt4::concat_columns(&[&a, &b, &c]).unwrap();
        assert_eq!((abc.k, abc.n), (k, 256));
        let d = abc.dequantize();
        let mut col = 0;
        for p in [&a, &b, &c] {
            let dp = p.dequantize();
            for r in 0..k {
                for j in 0..p.n {
                    assert_eq!(d[r * 256 + col + j], dp[r * p.n + j]);
                }
            }
            col += p.n;
        }
        let other = PackedInt4::pack(
            &vec![0; 32 * 64],
            32,
            64,
            32,
            ScaleType::F16,
            vec![0; 64],
            None,
        )
        .unwrap();
        assert!(PackedInt4::concat_columns(&[&a, &other]).is_err());
        assert!(PackedInt4::concat_columns(&[]).is_err());
    }

    use super::*;

    fn lcg(seed: &mut u64) -> u32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 33) as u32
    }

    #[test]
    fn every_nibble_has_its_own_place() {
        let (k, n) = (64, 128);
        let mut seen = vec![false; k * n * 4];
        for row in 0..k {
            for col in 0..n {
                let (w, s) = nibble_position(n, row, col);
                assert!(s % 4 == 0 && s < 32);
                let slot = w * 8 + (s / 4) as usize;
                assert!(!seen[slot], "({row}, {col}) collides");
                seen[slot] = true;
            }
        }
        assert!(seen.iter().take(k * n).all(|&b| b));
    }

    #[test]
    fn fragment_registers_hold_the_mma_b_layout() {
        // Lane l = 4g + t, register i = 2*half + reg_k: rows 2t(+8) and 2t+1(+8), column 8*half + g.
        let n = 64;
        for lane in 0..32 {
            let (g, t) = (lane / 4, lane % 4);
            for reg in 0..4u32 {
                let (half, reg_k) = ((reg / 2) as usize, (reg % 2) as usize);
                let col = 8 * half + g;
                let lo_row = 2 * t + 8 * reg_k;
                assert_eq!(nibble_position(n, lo_row, col), (lane * 4, reg * 4));
                assert_eq!(
                    nibble_position(n, lo_row + 1, col),
                    (lane * 4, reg * 4 + 16)
                );
            }
        }
    }

    #[test]
    fn pack_and_unpack_round_trip() {
        let mut seed = 1;
        for &(k, n, group) in &[(16, 64, 16), (576, 128, 64), (256, 192, 128)] {
            let q: Vec<u8> = (0..k * n).map(|_| (lcg(&mut seed) % 16) as u8).collect();
            let scales: Vec<u16> = (0..k / group * n)
                .map(|i| half::bf16::from_f32(0.01 + i as f32 * 1e-4).to_bits())
                .collect();
            let p = PackedInt4::pack(&q, k, n, group, ScaleType::Bf16, scales, None).unwrap();
            assert_eq!(p.unpack_q(), q);
            assert_eq!(p.words.len(), k * n / 8);
        }
    }

    #[test]
    fn rtn_error_is_within_half_a_step() {
        let (k, n, group) = (128, 64, 64);
        let mut seed = 7;
        let w: Vec<f32> = (0..k * n)
            .map(|_| lcg(&mut seed) as f32 / u32::MAX as f32 - 0.25)
            .collect();
        let p = quantize_rtn(&w, k, n, group, ScaleType::Bf16).unwrap();
        let dq = p.dequantize();
        for row in 0..k {
            for col in 0..n {
                let (d, _) = p.group_params(row, col);
                let err = (dq[row * n + col] - w[row * n + col]).abs();
                // Half a step, plus the clamp of the positive extreme (+8 is not representable).
                assert!(
                    err <= 0.5 * d + 1e-6 || w[row * n + col] > 7.0 * d,
                    "({row},{col}) err {err} step {d}"
                );
            }
        }
    }

    #[test]
    fn gguf_q4_blocks_load_exactly() {
        use crate::gguf::{GgmlType, dequantize_into};
        let (out_f, in_f) = (64, 64);
        let mut seed = 3;
        for asym in [false, true] {
            let block = if asym { 20 } else { 18 };
            let mut raw = Vec::new();
            for _ in 0..out_f * in_f / 32 {
                raw.extend(
                    half::f16::from_f32(0.01 + (lcg(&mut seed) % 100) as f32 * 1e-3).to_le_bytes(),
                );
                if asym {
                    raw.extend(
                        half::f16::from_f32(-0.1 + (lcg(&mut seed) % 100) as f32 * 1e-3)
                            .to_le_bytes(),
                    );
                }
                raw.extend((0..16).map(|_| (lcg(&mut seed) % 256) as u8));
            }
            assert_eq!(raw.len(), out_f * in_f / 32 * block);
            let p = from_gguf_q4(&raw, out_f, in_f, asym).unwrap();
            let mut file_order = Vec::new(); // [out, in]
            dequantize_into(
                if asym { GgmlType::Q4_1 } else { GgmlType::Q4_0 },
                &raw,
                &mut file_order,
            );
            let dq = p.dequantize(); // [in, out]
            for o in 0..out_f {
                for i in 0..in_f {
                    assert_eq!(
                        dq[i * out_f + o],
                        file_order[o * in_f + i],
                        "asym={asym} ({o}, {i})"
                    );
                }
            }
        }
    }

    #[test]
    fn column_permutation_moves_values_scales_and_offsets() {
        let (k, n, group) = (32, 64, 16);
        let mut seed = 5;
        let q: Vec<u8> = (0..k * n).map(|_| (lcg(&mut seed) % 16) as u8).collect();
        let scales: Vec<u16> = (0..k / group * n)
            .map(|i| half::f16::from_f32(0.01 * (i + 1) as f32).to_bits())
            .collect();
        let offsets: Vec<u16> = (0..k / group * n)
            .map(|i| half::f16::from_f32(-0.001 * i as f32).to_bits())
            .collect();
        let p = PackedInt4::pack(&q, k, n, group, ScaleType::F16, scales, Some(offsets)).unwrap();
        let from: Vec<usize> = (0..n).rev().collect();
        let (a, b) = (
            p.dequantize(),
            p.permute_columns(&from).unwrap().dequantize(),
        );
        for r in 0..k {
            for c in 0..n {
                assert_eq!(b[r * n + c], a[r * n + from[c]]);
            }
        }
    }

    #[test]
    fn bad_shapes_and_values_are_errors() {
        assert!(matches!(
            PackedInt4::pack(
                &[0; 16 * 32],
                16,
                32,
                16,
                ScaleType::Bf16,
                vec![0; 32],
                None
            ),
            Err(Int4Error::Shape { .. })
        ));
        assert!(matches!(
            PackedInt4::pack(
                &[0; 48 * 64],
                48,
                64,
                32,
                ScaleType::Bf16,
                vec![0; 64],
                None
            ),
            Err(Int4Error::Group { .. })
        ));
        let mut q = vec![0u8; 16 * 64];
        q[5] = 16;
        assert!(matches!(
            PackedInt4::pack(&q, 16, 64, 16, ScaleType::Bf16, vec![0; 64], None),
            Err(Int4Error::Range { row: 0, col: 5, .. })
        ));
    }
}
