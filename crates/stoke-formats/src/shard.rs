//! Tensor-parallel shards of a Llama layer's packed INT4 projections (Burn's `[k, n]` layout),
//! split the way vLLM and TensorRT-LLM split them: q|k|v and gate|up by output columns (q|k|v
//! by whole KV-head groups, so each rank attends over its own heads with no exchange; gate|up by
//! interleaved gate/up pairs, so SwiGLU stays local), o and down by input rows (each rank's
//! product is a partial sum). One all-reduce (a sum) after o and one after down restore the full
//! rows; norms are replicated. The LM head splits by vocabulary (whole 64-column tiles, as evenly
//! as they go); each rank's logits are a slice of the row, gathered for sampling (greedy: each
//! rank's best token and logit, [`gather_argmax`]). Shapes that do not split evenly, or whose
//! shards would break the packed format's 64-column tiles or the scale groups, are a typed error.

use crate::int4::{Int4Error, PackedInt4};

#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("{what}: {count} does not split into {ranks} equal shards")]
    Uneven {
        what: &'static str,
        count: usize,
        ranks: usize,
    },
    #[error("{what}: shards of {cols} columns; the packed format needs a multiple of 64")]
    Columns { what: &'static str, cols: usize },
    #[error("{what}: shards of {rows} rows do not end on groups of {group}")]
    Rows {
        what: &'static str,
        rows: usize,
        group: usize,
    },
    #[error(transparent)]
    Int4(#[from] Int4Error),
}

/// The attention heads of a layer.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

fn per_rank(what: &'static str, count: usize, ranks: usize) -> Result<usize, ShardError> {
    if ranks == 0 || !count.is_multiple_of(ranks) {
        return Err(ShardError::Uneven { what, count, ranks });
    }
    Ok(count / ranks)
}

fn check_cols(what: &'static str, cols: &[Vec<usize>]) -> Result<(), ShardError> {
    match cols.iter().find(|c| !c.len().is_multiple_of(64)) {
        Some(c) => Err(ShardError::Columns {
            what,
            cols: c.len(),
        }),
        None => Ok(()),
    }
}

/// Each rank's columns of a fused q|k|v weight (`[q heads | k heads | v heads] x head_dim`):
/// its share of the query heads and of the KV heads they read (GQA groups stay whole).
pub fn qkv_columns(h: Heads, ranks: usize) -> Result<Vec<Vec<usize>>, ShardError> {
    let q = per_rank("query heads", h.heads, ranks)?;
    let kv = per_rank("KV heads", h.kv_heads, ranks)?;
    let d = h.head_dim;
    let cols: Vec<Vec<usize>> = (0..ranks)
        .map(|r| {
            let heads = |first: usize, from: usize, count: usize| {
                (first + from * d..first + (from + count) * d).collect::<Vec<_>>()
            };
            let mut c = heads(0, r * q, q);
            c.extend(heads(h.heads * d, r * kv, kv));
            c.extend(heads((h.heads + h.kv_heads) * d, r * kv, kv));
            c
        })
        .collect();
    check_cols("q|k|v", &cols)?;
    Ok(cols)
}

/// Each rank's columns of a gate|up weight whose columns `2 j`, `2 j + 1` are gate and up `j`.
pub fn gate_up_columns(inter: usize, ranks: usize) -> Result<Vec<Vec<usize>>, ShardError> {
    let per = per_rank("MLP columns", inter, ranks)?;
    let cols: Vec<Vec<usize>> = (0..ranks)
        .map(|r| (2 * r * per..2 * (r + 1) * per).collect())
        .collect();
    check_cols("gate|up", &cols)?;
    Ok(cols)
}

/// A row-parallel weight's shards: input rows split in `ranks` equal ranges.
pub fn split_rows(
    what: &'static str,
    w: &PackedInt4,
    ranks: usize,
) -> Result<Vec<PackedInt4>, ShardError> {
    let rows = per_rank(what, w.k, ranks)?;
    if !rows.is_multiple_of(w.group) {
        return Err(ShardError::Rows {
            what,
            rows,
            group: w.group,
        });
    }
    (0..ranks)
        .map(|r| Ok(w.select_rows(r * rows..(r + 1) * rows)?))
        .collect()
}

/// One rank's projections of a layer.
#[derive(Clone, Debug)]
pub struct LayerShard {
    pub qkv: PackedInt4,
    pub o: PackedInt4,
    pub gate_up: PackedInt4,
    pub down: PackedInt4,
}

/// A layer's projections split over `ranks`: q|k|v and gate|up by columns, o and down by rows.
pub fn shard_layer(
    [qkv, o, gate_up, down]: [&PackedInt4; 4],
    h: Heads,
    ranks: usize,
) -> Result<Vec<LayerShard>, ShardError> {
    let qkv_cols = qkv_columns(h, ranks)?;
    let gu_cols = gate_up_columns(gate_up.n / 2, ranks)?;
    let o = split_rows("o rows (query heads x head_dim)", o, ranks)?;
    let down = split_rows("down rows (MLP columns)", down, ranks)?;
    o.into_iter()
        .zip(down)
        .zip(qkv_cols.iter().zip(&gu_cols))
        .map(|((o, down), (qc, gc))| {
            Ok(LayerShard {
                qkv: qkv.select_columns(qc)?,
                o,
                gate_up: gate_up.select_columns(gc)?,
                down,
            })
        })
        .collect()
}

/// Each rank's vocabulary range of the LM head `[hidden, vocab]`: whole 64-column tiles, the
/// first `tiles % ranks` ranks one tile more (a vocabulary need not split evenly: 128256 is
/// 2004 tiles, 250.5 per rank on 8 GPUs); the last range ends at `vocab`.
pub fn head_ranges(vocab: usize, ranks: usize) -> Result<Vec<std::ops::Range<usize>>, ShardError> {
    let tiles = vocab.div_ceil(64);
    if ranks == 0 || tiles < ranks {
        return Err(ShardError::Uneven {
            what: "LM head tiles of 64 tokens",
            count: tiles,
            ranks,
        });
    }
    let (per, extra) = (tiles / ranks, tiles % ranks);
    let mut start = 0;
    Ok((0..ranks)
        .map(|r| {
            let end = (start + 64 * (per + usize::from(r < extra))).min(vocab);
            let range = start..end;
            start = end;
            range
        })
        .collect())
}

/// The LM head's shards, one vocabulary range per rank ([`head_ranges`]).
pub fn shard_head(head: &PackedInt4, ranks: usize) -> Result<Vec<PackedInt4>, ShardError> {
    head_ranges(head.n, ranks)?
        .into_iter()
        .map(|r| Ok(head.select_columns(&r.collect::<Vec<_>>())?))
        .collect()
}

/// The greedy token of a row from each rank's best `(token in its range, logit)`: the highest
/// logit, the lowest token on a tie (as an argmax over the whole row picks).
pub fn gather_argmax(
    ranges: &[std::ops::Range<usize>],
    best: &[(usize, f32)],
) -> Option<(usize, f32)> {
    ranges
        .iter()
        .zip(best)
        .map(|(r, &(t, v))| (r.start + t, v))
        .fold(None, |acc: Option<(usize, f32)>, (t, v)| match acc {
            Some((bt, bv)) if bv > v || (bv == v && bt < t) => Some((bt, bv)),
            _ => Some((t, v)),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::int4::{ScaleType, quantize_rtn};

    struct Lcg(u64);
    impl Lcg {
        fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
            (0..n)
                .map(|_| {
                    self.0 = self
                        .0
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
                })
                .collect()
        }
    }

    /// `x [t, k] @ w [k, n]` in f64 on the dequantized weight.
    fn matmul(x: &[f64], w: &PackedInt4) -> Vec<f64> {
        let (k, n) = (w.k, w.n);
        let d = w.dequantize();
        let t = x.len() / k;
        let mut y = vec![0f64; t * n];
        for r in 0..t {
            for i in 0..k {
                let a = x[r * k + i];
                for j in 0..n {
                    y[r * n + j] += a * f64::from(d[i * n + j]);
                }
            }
        }
        y
    }

    fn rms_norm(x: &[f64], width: usize) -> Vec<f64> {
        x.chunks(width)
            .flat_map(|row| {
                let f = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / width as f64 + 1e-5).sqrt();
                row.iter().map(move |v| v * f)
            })
            .collect()
    }

    /// One rank's share of a layer on `t` tokens: the partial sums its o and down projections
    /// add to the residual stream (`attention`, then `mlp` given the all-reduced stream).
    fn attention_partial(x: &[f64], w: &LayerShard, h: Heads, t: usize) -> Vec<f64> {
        let d = h.head_dim;
        let qkv = matmul(&rms_norm(x, w.qkv.k), &w.qkv);
        let (q_heads, kv_heads) = (h.heads, h.kv_heads);
        let width = (q_heads + 2 * kv_heads) * d;
        let mut att = vec![0f64; t * q_heads * d];
        for hq in 0..q_heads {
            let hk = hq / (q_heads / kv_heads);
            for i in 0..t {
                let q = &qkv[i * width + hq * d..][..d];
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let k = &qkv[j * width + (q_heads + hk) * d..][..d];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (j, p) in e.iter().enumerate() {
                    let v = &qkv[j * width + (q_heads + kv_heads + hk) * d..][..d];
                    for c in 0..d {
                        att[(i * q_heads + hq) * d + c] += p / sum * v[c];
                    }
                }
            }
        }
        matmul(&att, &w.o)
    }

    fn mlp_partial(x: &[f64], w: &LayerShard) -> Vec<f64> {
        let gu = matmul(&rms_norm(x, w.gate_up.k), &w.gate_up);
        let h: Vec<f64> = gu
            .chunks(2)
            .map(|p| p[0] / (1.0 + (-p[0]).exp()) * p[1])
            .collect();
        matmul(&h, &w.down)
    }

    /// The layer with a simulated communicator: each rank's partial sums added on the host.
    fn layer(x: &[f64], shards: &[LayerShard], h: Heads, t: usize) -> Vec<f64> {
        let ranks = shards.len();
        let rank_heads = Heads {
            heads: h.heads / ranks,
            kv_heads: h.kv_heads / ranks,
            head_dim: h.head_dim,
        };
        let all_reduce = |parts: Vec<Vec<f64>>, base: &[f64]| -> Vec<f64> {
            let mut out = base.to_vec();
            for p in parts {
                out.iter_mut().zip(p).for_each(|(o, v)| *o += v);
            }
            out
        };
        let parts = shards
            .iter()
            .map(|w| attention_partial(x, w, rank_heads, t))
            .collect();
        let x = all_reduce(parts, x);
        let parts = shards.iter().map(|w| mlp_partial(&x, w)).collect();
        all_reduce(parts, &x)
    }

    fn weights(hidden: usize, h: Heads, inter: usize, seed: u64) -> [PackedInt4; 4] {
        let mut rng = Lcg(seed);
        let mut q = |k: usize, n: usize| {
            let w = rng.vec(k * n, 1.0 / (k as f32).sqrt());
            quantize_rtn(&w, k, n, 64, ScaleType::Bf16).unwrap()
        };
        let qd = h.heads * h.head_dim;
        [
            q(hidden, qd + 2 * h.kv_heads * h.head_dim),
            q(qd, hidden),
            q(hidden, 2 * inter),
            q(inter, hidden),
        ]
    }

    #[test]
    fn sharded_layer_equals_the_full_layer() {
        let (hidden, inter, t) = (256, 512, 5);
        for (h, rank_counts) in [
            (
                Heads {
                    heads: 8,
                    kv_heads: 8,
                    head_dim: 64,
                },
                &[2usize, 4, 8][..],
            ),
            (
                Heads {
                    heads: 8,
                    kv_heads: 4,
                    head_dim: 64,
                },
                &[2, 4][..],
            ),
        ] {
            let w = weights(hidden, h, inter, 7 + h.kv_heads as u64);
            let x: Vec<f64> = Lcg(3)
                .vec(t * hidden, 1.0)
                .into_iter()
                .map(f64::from)
                .collect();
            let refs = [&w[0], &w[1], &w[2], &w[3]];
            let full = layer(&x, &shard_layer(refs, h, 1).unwrap(), h, t);
            let scale = full.iter().fold(0f64, |a, v| a.max(v.abs()));
            for &ranks in rank_counts {
                let shards = shard_layer(refs, h, ranks).unwrap();
                assert_eq!(shards.len(), ranks);
                let got = layer(&x, &shards, h, t);
                let err = got
                    .iter()
                    .zip(&full)
                    .fold(0f64, |a, (g, f)| a.max((g - f).abs()));
                assert!(
                    err <= 1e-12 * scale,
                    "{h:?} on {ranks} ranks: max |diff| {err}"
                );
            }
        }
    }

    #[test]
    fn uneven_shapes_are_typed_errors() {
        let h = Heads {
            heads: 8,
            kv_heads: 4,
            head_dim: 64,
        };
        let w = weights(256, h, 512, 1);
        let refs = [&w[0], &w[1], &w[2], &w[3]];
        // 4 KV heads on 8 ranks.
        assert!(matches!(
            shard_layer(refs, h, 8),
            Err(ShardError::Uneven {
                what: "KV heads",
                ..
            })
        ));
        assert!(matches!(
            shard_layer(refs, h, 3),
            Err(ShardError::Uneven { .. })
        ));
        // One head of 32 columns each for q, k and v per rank: 96 columns, not whole tiles.
        let small = Heads {
            heads: 2,
            kv_heads: 2,
            head_dim: 32,
        };
        assert!(matches!(
            qkv_columns(small, 2),
            Err(ShardError::Columns { .. })
        ));
        // Rows of a row-parallel shard that cut a scale group.
        let down = &w[3];
        assert!(matches!(
            split_rows("down", down, 16),
            Err(ShardError::Rows { .. })
        ));
        let msg = shard_layer(refs, h, 8).unwrap_err().to_string();
        assert!(msg.contains("KV heads") && msg.contains('8'), "{msg}");
    }

    #[test]
    fn head_shards_cover_the_vocabulary_and_gather_the_argmax() {
        // Real vocabularies: 128256 (2004 tiles) on 8 ranks is 251 or 250 tiles each.
        for (vocab, ranks) in [(128256, 8), (128256, 2), (49152, 4), (320, 3)] {
            let r = head_ranges(vocab, ranks).unwrap();
            assert_eq!(r.len(), ranks);
            assert_eq!((r[0].start, r[ranks - 1].end), (0, vocab));
            assert!(r.windows(2).all(|w| w[0].end == w[1].start));
            assert!(r[..ranks - 1].iter().all(|x| x.len() % 64 == 0));
            let sizes: Vec<usize> = r.iter().map(|x| x.len().div_ceil(64)).collect();
            assert!(sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1);
        }
        assert!(head_ranges(128, 3).is_err());
        assert!(head_ranges(128, 0).is_err());

        // A packed head split by vocabulary: each rank's logits are the full logits' slice,
        // and the gathered greedy token is the full row's argmax.
        let (hidden, vocab, ranks) = (64, 320, 3);
        let mut rng = Lcg(29);
        let w = rng.vec(hidden * vocab, 0.5);
        let head =
            crate::int4::quantize_rtn(&w, hidden, vocab, 32, crate::int4::ScaleType::Bf16).unwrap();
        let x: Vec<f64> = rng.vec(hidden, 1.0).iter().map(|&v| f64::from(v)).collect();
        let full = matmul(&x, &head);
        let shards = shard_head(&head, ranks).unwrap();
        let ranges = head_ranges(vocab, ranks).unwrap();
        let mut best = Vec::new();
        for (s, r) in shards.iter().zip(&ranges) {
            let part = matmul(&x, s);
            assert_eq!(part.len(), r.len());
            for (j, v) in part.iter().enumerate() {
                assert!((v - full[r.start + j]).abs() < 1e-9);
            }
            let b = part
                .iter()
                .enumerate()
                .fold(
                    (0, f64::NEG_INFINITY),
                    |b, (i, &v)| if v > b.1 { (i, v) } else { b },
                );
            best.push((b.0, b.1 as f32));
        }
        let want =
            full.iter().enumerate().fold(
                (0, f64::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            );
        assert_eq!(gather_argmax(&ranges, &best).unwrap().0, want.0);
        // Ties go to the lower token, whichever rank holds it.
        let tie = gather_argmax(&ranges, &[(5, 1.0), (0, 2.0), (3, 2.0)]).unwrap();
        assert_eq!(tie, (ranges[1].start, 2.0));
    }
}
