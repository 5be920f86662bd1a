//! The decode step's fused ops: a decoder (the KV cache of every layer, the step's token ids and
//! positions, the sampling state) owned by the backend, and the ops of one step that use it.
//!
//! Model code calls [`decode_embed`], [`decode_attention`] and [`decode_sample`] between its
//! projections and norms, and runs the step through [`decode_step`]. On any backend the
//! [`RefDecoder`] runs them as plain Burn compositions (host-side ids and positions, the cache
//! as Burn tensors, sampling on the host with the device sampler's algorithm); `Stoke<Cuda>`
//! keeps everything in its own device memory and replays the step as a CUDA graph
//! (`cuda::decoder`).

use crate::fused::{FusedOps, rms_norm_reference};
use burn::tensor::{Bool, Int, Tensor, TensorData, TensorPrimitive, module};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, TensorMetadata};
use std::collections::VecDeque;
use std::sync::Arc;

/// Format of the cache decode attention reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvCacheFormat {
    /// The BF16 cache itself.
    #[default]
    Bf16,
    /// An FP8 E4M3 copy (one scale per row) of Hadamard-rotated rows.
    Fp8,
    /// An INT4 copy (one scale per row) of Hadamard-rotated rows.
    Int4,
}

impl std::str::FromStr for KvCacheFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" => Ok(Self::Bf16),
            "fp8" => Ok(Self::Fp8),
            "int4" => Ok(Self::Int4),
            other => Err(format!(
                "unknown KV cache format {other:?} (bf16, fp8, int4)"
            )),
        }
    }
}

/// How the next token is picked ([`stoke_formats::sample`] is the algorithm).
pub type Sampling = stoke_formats::sample::SamplingParams;

/// What a decoder is built for.
#[derive(Clone, Debug)]
pub struct DecodeSpec {
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub hidden: usize,
    pub vocab: usize,
    /// Sequences decoded together.
    pub batch: usize,
    /// Positions per sequence (prompt and generated tokens).
    pub capacity: usize,
    /// RoPE angles: `[positions, head_dim / 2, 2]` (cos, sin), `positions >= capacity`.
    pub rope: Arc<Vec<f32>>,
    pub kv_format: KvCacheFormat,
    /// Hadamard block of the FP8/INT4 rows (0: no rotation).
    pub rotate_block: usize,
    pub sampling: Sampling,
    pub rms_norm_eps: f64,
    /// Run every step as it is queued, without CUDA graphs (for debugging).
    pub eager: bool,
    /// Keep a copy of each sampling's logits for [`decode_last_logits`] (tests, benchmarks).
    pub keep_logits: bool,
}

/// Why a decoder cannot be made or a step cannot run.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("{what}: expected {expected}, got {got}")]
    Shape {
        what: &'static str,
        expected: String,
        got: String,
    },
    #[error(
        "context overflow: a sequence needs position {needed}, the decoder holds {capacity} per sequence"
    )]
    ContextOverflow { needed: usize, capacity: usize },
    #[error("stoke: {0}")]
    Cuda(#[from] stoke_cuda::Error),
}

fn shape_err(what: &'static str, expected: impl ToString, got: impl ToString) -> DecodeError {
    DecodeError::Shape {
        what,
        expected: expected.to_string(),
        got: got.to_string(),
    }
}

/// One sequence's part of a packed prefill: `rows` consecutive rows of the packed batch that go
/// to the decoder's sequence `slot` at positions `pos0 .. pos0 + rows` (`pos0 > 0`: the
/// positions before it are already in the cache, from an earlier chunk).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedSeq {
    pub slot: usize,
    pub pos0: usize,
    pub rows: usize,
}

/// Packs prompts of `lens` tokens (sequence `i` in slot `i`, from position 0) into chunks of
/// at most `chunk` rows, without padding: a chunk holds whole prompts and the pieces of the ones
/// that do not fit, which continue in the next chunk. Empty prompts get no rows.
pub fn pack_prompts(lens: &[usize], chunk: usize) -> Vec<Vec<PackedSeq>> {
    let chunk = chunk.max(1);
    let mut chunks = Vec::new();
    let (mut current, mut used) = (Vec::new(), 0);
    for (slot, &len) in lens.iter().enumerate() {
        let mut pos0 = 0;
        while pos0 < len {
            let rows = (len - pos0).min(chunk - used);
            current.push(PackedSeq { slot, pos0, rows });
            (pos0, used) = (pos0 + rows, used + rows);
            if used == chunk {
                chunks.push(std::mem::take(&mut current));
                used = 0;
            }
        }
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// Checks a packed prefill's layout against the decoder and the `rows` of its input: every
/// sequence non-empty, in its own slot below the batch, inside the capacity, and the rows
/// adding up.
pub(crate) fn check_packed(
    seqs: &[PackedSeq],
    spec: &DecodeSpec,
    rows: usize,
) -> Result<(), DecodeError> {
    let total: usize = seqs.iter().map(|s| s.rows).sum();
    if total != rows {
        return Err(shape_err(
            "packed prefill rows",
            format!("{total} (the sequences' rows)"),
            rows,
        ));
    }
    for (i, s) in seqs.iter().enumerate() {
        if s.rows == 0 || s.slot >= spec.batch {
            return Err(shape_err(
                "packed prefill sequence",
                format!("at least one row, slot below the batch {}", spec.batch),
                format!("sequence {i}: {s:?}"),
            ));
        }
        if s.pos0 + s.rows > spec.capacity {
            return Err(DecodeError::ContextOverflow {
                needed: s.pos0 + s.rows,
                capacity: spec.capacity,
            });
        }
        if seqs[..i].iter().any(|o| o.slot == s.slot) {
            return Err(shape_err(
                "packed prefill sequence",
                "one part per slot",
                format!("sequence {i}: slot {} twice", s.slot),
            ));
        }
    }
    Ok(())
}

impl DecodeSpec {
    /// Checks the sizes against each other.
    pub fn validate(&self) -> Result<(), DecodeError> {
        let d = self.head_dim;
        if d == 0 || !d.is_multiple_of(2) {
            return Err(shape_err("decoder head_dim", "even and non-zero", d));
        }
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(shape_err(
                "decoder heads",
                "a multiple of the kv heads",
                format!("{} over {} kv heads", self.heads, self.kv_heads),
            ));
        }
        if self.batch == 0 {
            return Err(shape_err("decoder batch", "at least 1", 0));
        }
        let positions = self.rope.len() / d.max(1);
        if !self.rope.len().is_multiple_of(d) || positions < self.capacity {
            return Err(shape_err(
                "decoder RoPE table",
                format!("[>= {}, {}, 2] values", self.capacity, d / 2),
                format!("{} values", self.rope.len()),
            ));
        }
        Ok(())
    }

    /// Positions the RoPE table holds.
    pub fn rope_positions(&self) -> usize {
        self.rope.len() / self.head_dim
    }
}

/// The decoder of any backend: Burn tensors for the cache, ids and positions on the host.
#[derive(Debug)]
pub struct RefDecoder<B: Backend> {
    pub spec: DecodeSpec,
    /// Each layer's cache `[batch, kv_heads, capacity, head_dim]`; `None` only while a row is
    /// written (see [`assign_rows`]).
    keys: Vec<Option<Tensor<B, 4>>>,
    values: Vec<Option<Tensor<B, 4>>>,
    /// With an FP8/INT4 mirror: the exact cache beside it (`keys` / `values` then hold the
    /// mirror's values), which prefill attention reads as the kernels' does; empty for BF16.
    exact_keys: Vec<Option<Tensor<B, 4>>>,
    exact_values: Vec<Option<Tensor<B, 4>>>,
    /// Where each sequence's current token goes (the tokens before it are in the cache).
    pos: Vec<usize>,
    ids: Vec<u32>,
    presence: Vec<Vec<u32>>,
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    pending: VecDeque<Vec<u32>>,
    in_step: bool,
    last_logits: Option<Vec<f32>>,
    device: B::Device,
}

/// Checks ids given to [`decode_force_ids`]: one per sequence, each in the vocabulary.
pub(crate) fn check_forced(ids: &[u32], batch: usize, vocab: usize) -> Result<(), DecodeError> {
    if ids.len() != batch {
        return Err(shape_err(
            "forced ids",
            format!("{batch} (one per sequence)"),
            ids.len(),
        ));
    }
    if let Some(t) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(shape_err(
            "forced id",
            format!("below the vocabulary size {vocab}"),
            t,
        ));
    }
    Ok(())
}

/// The state `prompts` start a decoder of `rows` sequences in, checked against its batch and
/// capacity: each row's next position (the prompt's length; 0 past the prompts) and the
/// presence words of the tokens the repetition penalty sees (`rows x ceil(vocab / 32)`).
pub(crate) fn prompt_state(
    prompts: &[Vec<u32>],
    spec: &DecodeSpec,
    rows: usize,
) -> Result<(Vec<usize>, Vec<u32>), DecodeError> {
    if prompts.len() > spec.batch {
        return Err(shape_err(
            "prompts for the decoder",
            format!("at most its batch {}", spec.batch),
            prompts.len(),
        ));
    }
    let words = words(spec.vocab);
    let mut pos = vec![0; rows];
    let mut presence = vec![0u32; rows * words];
    for (i, p) in prompts.iter().enumerate() {
        if p.len() >= spec.capacity {
            return Err(DecodeError::ContextOverflow {
                needed: p.len() + 1,
                capacity: spec.capacity,
            });
        }
        pos[i] = p.len();
        for &t in p.iter().filter(|&&t| (t as usize) < spec.vocab) {
            presence[i * words + t as usize / 32] |= 1 << (t % 32);
        }
    }
    Ok((pos, presence))
}

/// `slot[rows] = value`, with the cache tensor moved out of `slot` rather than cloned: held
/// once, it is updated in place (a backend with copy-on-write storage, NdArray, would otherwise
/// copy the whole layer cache for each row written).
fn assign_rows<B: Backend>(
    slot: &mut Option<Tensor<B, 4>>,
    rows: [std::ops::Range<usize>; 4],
    value: Tensor<B, 4>,
) {
    let cache = slot.take().expect("the cache is in place between writes");
    *slot = Some(cache.slice_assign(rows, value));
}

fn words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Rotate-half RoPE of `x [rows, heads, d]` by per-row angles `[rows, 1, d / 2]`, in f32 and
/// rounded once to `x`'s dtype (as the kernels do).
fn rope_rows<B: Backend>(x: Tensor<B, 3>, cos: &Tensor<B, 3>, sin: &Tensor<B, 3>) -> Tensor<B, 3> {
    let dtype = x.dtype();
    let half = x.dims()[2] / 2;
    let x = x.cast(DType::F32);
    let x1 = x.clone().narrow(2, 0, half);
    let x2 = x.narrow(2, half, half);
    Tensor::cat(
        vec![
            x1.clone() * cos.clone() - x2.clone() * sin.clone(),
            x2 * cos.clone() + x1 * sin.clone(),
        ],
        2,
    )
    .cast(dtype)
}

impl<B: Backend> RefDecoder<B> {
    pub fn new(spec: DecodeSpec, dtype: DType, device: &B::Device) -> Result<Self, DecodeError> {
        spec.validate()?;
        let (b, kvh, cap, d) = (spec.batch, spec.kv_heads, spec.capacity, spec.head_dim);
        let z = || Some(Tensor::<B, 4>::zeros([b, kvh, cap, d], device).cast(dtype));
        let half = d / 2;
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for pair in spec.rope[..cap * d].chunks(2) {
            cos.push(pair[0]);
            sin.push(pair[1]);
        }
        let exact = if spec.kv_format == KvCacheFormat::Bf16 {
            0
        } else {
            spec.layers
        };
        Ok(Self {
            keys: (0..spec.layers).map(|_| z()).collect(),
            values: (0..spec.layers).map(|_| z()).collect(),
            exact_keys: (0..exact).map(|_| z()).collect(),
            exact_values: (0..exact).map(|_| z()).collect(),
            pos: vec![0; b],
            ids: vec![0; b],
            presence: vec![vec![0; words(spec.vocab)]; b],
            cos: Tensor::from_data(TensorData::new(cos, [cap, half]), device),
            sin: Tensor::from_data(TensorData::new(sin, [cap, half]), device),
            pending: VecDeque::new(),
            in_step: false,
            last_logits: None,
            device: device.clone(),
            spec,
        })
    }

    /// Replaces the ids the next step reads (one per sequence; see [`decode_force_ids`]).
    pub fn force_ids(&mut self, ids: &[u32]) -> Result<(), DecodeError> {
        check_forced(ids, self.ids.len(), self.spec.vocab)?;
        self.ids.copy_from_slice(ids);
        for (r, &t) in ids.iter().enumerate() {
            self.presence[r][t as usize / 32] |= 1 << (t % 32);
        }
        Ok(())
    }

    /// The largest position a sequence's current token goes to.
    pub fn max_position(&self) -> usize {
        self.pos.iter().max().copied().unwrap_or(0)
    }

    /// Marks the ops that follow as inside a step (sampling then advances positions).
    pub fn set_in_step(&mut self, in_step: bool) {
        self.in_step = in_step;
    }

    /// Writes keys and values `[1, kvh, n, d]` at `rows` of `layer`'s cache: the exact values,
    /// and what the mirror holds of them.
    fn store(
        &mut self,
        layer: usize,
        rows: [std::ops::Range<usize>; 4],
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) {
        if !self.exact_keys.is_empty() {
            assign_rows(&mut self.exact_keys[layer], rows.clone(), k.clone());
            assign_rows(&mut self.exact_values[layer], rows.clone(), v.clone());
        }
        let (kq, vq) = (self.through_format(k), self.through_format(v));
        assign_rows(&mut self.keys[layer], rows.clone(), kq);
        assign_rows(&mut self.values[layer], rows, vq);
    }

    /// The simulated mirror format applied to rows `[.., d]` (quantized and back, rotated and
    /// back), so attention sees what the kernels' FP8/INT4 copy holds.
    fn through_format(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        use stoke_formats::kv;
        if self.spec.kv_format == KvCacheFormat::Bf16 {
            return x;
        }
        let (dims, dtype) = (x.dims(), x.dtype());
        let d = dims[3];
        let mut v = x.into_data().convert::<f32>().to_vec::<f32>().expect("f32");
        let block = self.spec.rotate_block;
        let rotate = |v: &mut Vec<f32>| {
            if block > 0 {
                kv::hadamard(v, d, block).expect("rotation block divides head_dim");
            }
        };
        rotate(&mut v);
        let mut v = match self.spec.kv_format {
            KvCacheFormat::Int4 => {
                let (q, s) = kv::quantize_int4(&v, d, kv::Int4Order::Natural).expect("head_dim");
                kv::dequantize_int4(&q, &s, d, kv::Int4Order::Natural)
            }
            _ => {
                let (q, s) = kv::quantize_fp8(&v, d).expect("head_dim");
                kv::dequantize_fp8(&q, &s, d)
            }
        };
        rotate(&mut v);
        Tensor::<B, 4>::from_data(TensorData::new(v, dims), &self.device).cast(dtype)
    }

    fn begin(&mut self, prompts: &[Vec<u32>]) -> Result<(), DecodeError> {
        let (pos, presence) = prompt_state(prompts, &self.spec, self.pos.len())?;
        self.pos = pos;
        let words = words(self.spec.vocab);
        for (row, w) in self.presence.iter_mut().zip(presence.chunks(words)) {
            row.copy_from_slice(w);
        }
        Ok(())
    }

    fn embed(
        &self,
        table: Tensor<B, 2>,
        gamma: Tensor<B, 1>,
        eps: f64,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let b = self.ids.len();
        let ids: Vec<i64> = self.ids.iter().map(|&t| t as i64).collect();
        let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [b]), &self.device);
        let hidden = table.dims()[1];
        let x = table.select(0, ids).reshape([b, 1, hidden]);
        let normed = rms_norm_reference::<B>(float(x.clone()), float(gamma), eps);
        (x, tensor(normed))
    }

    /// RoPE angles `(cos, sin)` of `positions`, each `[positions, 1, head_dim / 2]`.
    fn angles(&self, positions: impl IntoIterator<Item = usize>) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let positions: Vec<i64> = positions.into_iter().map(|p| p as i64).collect();
        let n = positions.len();
        let positions =
            Tensor::<B, 1, Int>::from_data(TensorData::new(positions, [n]), &self.device);
        let half = self.spec.head_dim / 2;
        let angle = |t: &Tensor<B, 2>| t.clone().select(0, positions.clone()).reshape([n, 1, half]);
        (angle(&self.cos), angle(&self.sin))
    }

    fn attention(&mut self, layer: usize, qkv: Tensor<B, 3>) -> Tensor<B, 3> {
        let (h, kvh, d) = (self.spec.heads, self.spec.kv_heads, self.spec.head_dim);
        let b = self.spec.batch;
        let qkv = qkv.reshape([b, h + 2 * kvh, d]);
        let (cos, sin) = self.angles(self.pos.clone());
        let q = rope_rows(qkv.clone().narrow(1, 0, h), &cos, &sin);
        let k = rope_rows(qkv.clone().narrow(1, h, kvh), &cos, &sin);
        let v = qkv.narrow(1, h + kvh, kvh);
        for i in 0..b {
            let p = self.pos[i];
            #[allow(clippy::single_range_in_vec_init)]
            let (ki, vi) = (
                k.clone().slice([i..i + 1]).reshape([1, kvh, 1, d]),
                v.clone().slice([i..i + 1]).reshape([1, kvh, 1, d]),
            );
            self.store(layer, [i..i + 1, 0..kvh, p..p + 1, 0..d], ki, vi);
        }
        // Keys in whole blocks of 256 (masked past each sequence's position), so a backend that
        // compiles per shape (burn-cuda) sees a new shape every 256 steps, not every step.
        let keys = (self.max_position() + 1)
            .next_multiple_of(256)
            .min(self.spec.capacity);
        let hidden: Vec<bool> = self
            .pos
            .iter()
            .flat_map(|&p| (0..keys).map(move |j| j > p))
            .collect();
        // Grouped-query attention without repeating the cache: the `h / kvh` query heads of a
        // kv head are its query rows (one position each), so keys and values are read as they
        // lie, `[b, kvh, keys, d]`.
        let g = h / kvh;
        let mask =
            Tensor::<B, 4, Bool>::from_data(TensorData::new(hidden, [b, 1, 1, keys]), &self.device)
                .expand([b, kvh, g, keys]);
        let window = |t: &Option<Tensor<B, 4>>| {
            let t = t.as_ref().expect("the cache is in place between writes");
            t.clone().slice([0..b, 0..kvh, 0..keys, 0..d])
        };
        let (kk, vv) = (window(&self.keys[layer]), window(&self.values[layer]));
        let q = q.reshape([b, kvh, g, d]);
        let out = module::attention(q, kk, vv, Some(mask), None, Default::default());
        out.reshape([b, 1, h * d])
    }

    /// Packed prefill attention (see [`prefill_attention`]): per sequence, RoPE at its
    /// positions, its keys and values written to its slot (exact, and through the mirror
    /// format), and causal attention over its earlier exact cached keys and its own.
    fn prefill_attention(
        &mut self,
        layer: usize,
        qkv: Tensor<B, 3>,
        seqs: &[PackedSeq],
    ) -> Result<Tensor<B, 3>, DecodeError> {
        let (h, kvh, d) = (self.spec.heads, self.spec.kv_heads, self.spec.head_dim);
        let g = h / kvh;
        let lead = qkv.dims();
        let rows = lead[0] * lead[1];
        if lead[2] != (h + 2 * kvh) * d {
            return Err(shape_err(
                "packed prefill q|k|v",
                format!("rows of {}", (h + 2 * kvh) * d),
                format!("{lead:?}"),
            ));
        }
        check_packed(seqs, &self.spec, rows)?;
        let qkv = qkv.reshape([rows, h + 2 * kvh, d]);
        let mut outs = Vec::with_capacity(seqs.len());
        let mut first = 0;
        for s in seqs {
            let (r, p0) = (s.rows, s.pos0);
            let x = qkv.clone().narrow(0, first, r);
            first += r;
            let (cos, sin) = self.angles(p0..p0 + r);
            let q = rope_rows(x.clone().narrow(1, 0, h), &cos, &sin);
            // [r, kvh, d] -> [1, kvh, r, d], the cache's layout.
            let heads_first = |t: Tensor<B, 3>| t.reshape([1, r, kvh, d]).swap_dims(1, 2);
            let k = heads_first(rope_rows(x.clone().narrow(1, h, kvh), &cos, &sin));
            let v = heads_first(x.narrow(1, h + kvh, kvh));
            let earlier = |t: &Option<Tensor<B, 4>>, new: Tensor<B, 4>| {
                if p0 == 0 {
                    return new;
                }
                let t = t.as_ref().expect("the cache is in place between writes");
                let t = t.clone().slice([s.slot..s.slot + 1, 0..kvh, 0..p0, 0..d]);
                Tensor::cat(vec![t, new], 2)
            };
            // Earlier chunks' keys from the exact cache, as the kernel reads them.
            let (ek, ev) = if self.exact_keys.is_empty() {
                (&self.keys[layer], &self.values[layer])
            } else {
                (&self.exact_keys[layer], &self.exact_values[layer])
            };
            // Query rows padded to a multiple of 64 and keys to one of 256 (zeros, masked), so a
            // backend that compiles per shape (burn-cuda) sees few shapes across pieces.
            let (rp, keys) = (r.next_multiple_of(64), (p0 + r).next_multiple_of(256));
            let device = self.device.clone();
            let pad = |t: Tensor<B, 4>, len: usize| {
                let [a, b, n, e] = t.dims();
                if n == len {
                    return t;
                }
                let z = Tensor::<B, 4>::zeros([a, b, len - n, e], &device).cast(t.dtype());
                Tensor::cat(vec![t, z], 2)
            };
            let (kk, vv) = (
                pad(earlier(ek, k.clone()), keys),
                pad(earlier(ev, v.clone()), keys),
            );
            self.store(layer, [s.slot..s.slot + 1, 0..kvh, p0..p0 + r, 0..d], k, v);
            // The g query heads of a kv head as its query rows: [1, kvh, g rp, d], row
            // (j, i) at position p0 + i sees keys 0 ..= p0 + i (a padding row: key 0).
            let q = pad(q.reshape([1, 1, r, h * d]), rp)
                .reshape([rp, kvh, g, d])
                .permute([1, 2, 0, 3])
                .reshape([1, kvh, g * rp, d]);
            let hidden: Vec<bool> = (0..g)
                .flat_map(|_| 0..rp)
                .flat_map(|i| {
                    let last = if i < r { p0 + i } else { 0 };
                    (0..keys).map(move |j| j > last)
                })
                .collect();
            let mask = Tensor::<B, 4, Bool>::from_data(
                TensorData::new(hidden, [1, 1, g * rp, keys]),
                &self.device,
            )
            .expand([1, kvh, g * rp, keys]);
            let out = module::attention(q, kk, vv, Some(mask), None, Default::default());
            outs.push(
                out.reshape([kvh, g, rp, d])
                    .narrow(2, 0, r)
                    .permute([2, 0, 1, 3])
                    .reshape([r, h * d]),
            );
        }
        Ok(Tensor::cat(outs, 0).reshape([lead[0], lead[1], h * d]))
    }

    fn sample(&mut self, logits: Tensor<B, 3>) {
        let [rows, _, vocab] = logits.dims();
        let host = logits
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("f32 logits");
        let advance = self.in_step;
        for r in 0..rows.min(self.spec.batch) {
            let counter = if advance { self.pos[r] as u32 } else { 0 };
            let id = stoke_formats::sample::sample_row(
                &host[r * vocab..(r + 1) * vocab],
                Some(&self.presence[r]),
                &self.spec.sampling,
                counter,
                r as u32,
            );
            self.ids[r] = id;
            if (id as usize) < self.spec.vocab {
                self.presence[r][id as usize / 32] |= 1 << (id % 32);
            }
            if advance {
                self.pos[r] += 1;
            }
        }
        self.pending.push_back(self.ids.clone());
        if self.spec.keep_logits {
            self.last_logits = Some(host[..rows.min(self.spec.batch) * vocab].to_vec());
        }
    }
}

/// The decode-step ops of the reference decoder, for `impl FusedOps` blocks whose decoder is
/// [`RefDecoder`].
#[macro_export]
#[doc(hidden)]
macro_rules! reference_decoder_ops {
    () => {
        type Decoder = $crate::decode::RefDecoder<Self>;

        fn decoder_new(
            spec: $crate::decode::DecodeSpec,
            dtype: $crate::burn_backend::DType,
            device: &Self::Device,
        ) -> Result<Self::Decoder, $crate::decode::DecodeError> {
            $crate::decode::RefDecoder::new(spec, dtype, device)
        }

        fn decoder_begin(
            dec: &mut Self::Decoder,
            prompts: &[Vec<u32>],
        ) -> Result<(), $crate::decode::DecodeError> {
            $crate::decode::ref_ops::begin(dec, prompts)
        }

        fn prefill_attention(
            dec: &mut Self::Decoder,
            layer: usize,
            qkv: $crate::burn_backend::tensor::FloatTensor<Self>,
            seqs: &[$crate::decode::PackedSeq],
        ) -> Result<$crate::burn_backend::tensor::FloatTensor<Self>, $crate::decode::DecodeError> {
            $crate::decode::ref_ops::prefill_attention(dec, layer, qkv, seqs)
        }

        fn decode_embed(
            dec: &Self::Decoder,
            table: $crate::burn_backend::tensor::FloatTensor<Self>,
            gamma: $crate::burn_backend::tensor::FloatTensor<Self>,
            eps: f64,
        ) -> (
            $crate::burn_backend::tensor::FloatTensor<Self>,
            $crate::burn_backend::tensor::FloatTensor<Self>,
        ) {
            $crate::decode::ref_ops::embed(dec, table, gamma, eps)
        }

        fn decode_attention(
            dec: &mut Self::Decoder,
            layer: usize,
            qkv: $crate::burn_backend::tensor::FloatTensor<Self>,
        ) -> $crate::burn_backend::tensor::FloatTensor<Self> {
            $crate::decode::ref_ops::attention(dec, layer, qkv)
        }

        fn decode_sample(
            dec: &mut Self::Decoder,
            logits: $crate::burn_backend::tensor::FloatTensor<Self>,
        ) {
            $crate::decode::ref_ops::sample(dec, logits)
        }

        fn decode_step(
            dec: &mut Self::Decoder,
            body: &mut dyn FnMut(&mut Self::Decoder),
        ) -> Result<(), $crate::decode::DecodeError> {
            $crate::decode::ref_ops::step(dec, body)
        }

        fn decode_take_ids(dec: &mut Self::Decoder) -> Option<Vec<u32>> {
            $crate::decode::ref_ops::take_ids(dec)
        }

        fn decode_last_logits(dec: &mut Self::Decoder) -> Option<Vec<f32>> {
            $crate::decode::ref_ops::last_logits(dec)
        }

        fn decode_force_ids(
            dec: &mut Self::Decoder,
            ids: &[u32],
        ) -> Result<(), $crate::decode::DecodeError> {
            dec.force_ids(ids)
        }
    };
}

/// The reference decoder's op bodies (what [`reference_decoder_ops`] expands to call).
#[doc(hidden)]
pub mod ref_ops {
    use super::*;

    pub fn begin<B: Backend>(
        dec: &mut RefDecoder<B>,
        prompts: &[Vec<u32>],
    ) -> Result<(), DecodeError> {
        dec.begin(prompts)
    }

    pub fn prefill_attention<B: Backend>(
        dec: &mut RefDecoder<B>,
        layer: usize,
        qkv: FloatTensor<B>,
        seqs: &[PackedSeq],
    ) -> Result<FloatTensor<B>, DecodeError> {
        dec.prefill_attention(layer, tensor(qkv), seqs).map(float)
    }

    pub fn embed<B: Backend>(
        dec: &RefDecoder<B>,
        table: FloatTensor<B>,
        gamma: FloatTensor<B>,
        eps: f64,
    ) -> (FloatTensor<B>, FloatTensor<B>) {
        let (x, n) = dec.embed(tensor(table), tensor(gamma), eps);
        (float(x), float(n))
    }

    pub fn attention<B: Backend>(
        dec: &mut RefDecoder<B>,
        layer: usize,
        qkv: FloatTensor<B>,
    ) -> FloatTensor<B> {
        float(dec.attention(layer, tensor(qkv)))
    }

    pub fn sample<B: Backend>(dec: &mut RefDecoder<B>, logits: FloatTensor<B>) {
        let dims = logits.shape();
        let vocab = *dims.as_slice().last().expect("rank >= 1");
        let rows = dims.num_elements() / vocab.max(1);
        let l = tensor::<B, 1>(B::float_reshape(logits, [rows * vocab].into()))
            .reshape([rows, 1, vocab]);
        dec.sample(l)
    }

    pub fn step<B: Backend>(
        dec: &mut RefDecoder<B>,
        body: &mut dyn FnMut(&mut RefDecoder<B>),
    ) -> Result<(), DecodeError> {
        let needed = dec.max_position() + 1;
        if needed > dec.spec.capacity {
            return Err(DecodeError::ContextOverflow {
                needed,
                capacity: dec.spec.capacity,
            });
        }
        dec.in_step = true;
        body(dec);
        dec.in_step = false;
        Ok(())
    }

    pub fn take_ids<B: Backend>(dec: &mut RefDecoder<B>) -> Option<Vec<u32>> {
        dec.pending.pop_front()
    }

    pub fn last_logits<B: Backend>(dec: &mut RefDecoder<B>) -> Option<Vec<f32>> {
        dec.last_logits.clone()
    }
}

pub(crate) fn float<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

pub(crate) fn tensor<B: Backend, const D: usize>(p: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// Makes a decoder for `spec` on `device` (cache values in `dtype` on the reference path).
pub fn decoder<B: FusedOps>(
    spec: DecodeSpec,
    dtype: DType,
    device: &B::Device,
) -> Result<B::Decoder, DecodeError> {
    B::decoder_new(spec, dtype, device)
}

/// Sets the decoder's sequences to `prompts` (their keys and values are written by
/// [`prefill_attention`]): each sequence's next position and the tokens the repetition penalty
/// sees.
pub fn decoder_begin<B: FusedOps>(
    dec: &mut B::Decoder,
    prompts: &[Vec<u32>],
) -> Result<(), DecodeError> {
    B::decoder_begin(dec, prompts)
}

/// Attention of a packed prefill in layer `layer`: `qkv [1, rows, (heads + 2 kv_heads)
/// head_dim]` holds the q|k|v projections of the sequences of `seqs`, one after another
/// ([`pack_prompts`] makes the layout). Each sequence's rows are rotated (RoPE at positions
/// `pos0 ..`), its keys and values written into its slot of the decoder's cache, and each row
/// attends causally to its sequence's positions `0 ..= pos0 + i`. Returns `[1, rows, heads
/// head_dim]`.
pub fn prefill_attention<B: FusedOps>(
    dec: &mut B::Decoder,
    layer: usize,
    qkv: Tensor<B, 3>,
    seqs: &[PackedSeq],
) -> Result<Tensor<B, 3>, DecodeError> {
    B::prefill_attention(dec, layer, float(qkv), seqs).map(tensor)
}

/// The q|k|v projection `x W` (`linear`, `[hidden, (heads + 2 kv_heads) head_dim]`, no bias)
/// of the packed rows `x [1, rows, hidden]`, then [`prefill_attention`] on it. On
/// `Stoke<Cuda>`, where the prefill GEMM takes the projection, its epilogue rotates q and k and
/// writes k and v straight into the decoder's cache (the same bits as projecting first), so
/// no q|k|v tensor is written; elsewhere the projection runs, then [`prefill_attention`]. A
/// linear with a bias projects first.
pub fn prefill_qkv_attention<B: FusedOps>(
    dec: &mut B::Decoder,
    layer: usize,
    x: Tensor<B, 3>,
    linear: &burn::nn::Linear<B>,
    seqs: &[PackedSeq],
) -> Result<Tensor<B, 3>, DecodeError> {
    if linear.bias.is_some() {
        return prefill_attention::<B>(dec, layer, linear.forward(x), seqs);
    }
    B::prefill_qkv_attention(dec, layer, float(x), float(linear.weight.val()), seqs).map(tensor)
}

/// The step's input: the embedding rows of the decoder's current token ids, and their RMSNorm
/// with `gamma`: `(x, normed)`, each `[batch, 1, hidden]`.
pub fn decode_embed<B: FusedOps>(
    dec: &B::Decoder,
    table: Tensor<B, 2>,
    gamma: Tensor<B, 1>,
    eps: f64,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let (x, n) = B::decode_embed(dec, float(table), float(gamma), eps);
    (tensor(x), tensor(n))
}

/// RoPE on a q|k|v projection's output `[batch, 1, (heads + 2 kv_heads) head_dim]` at each
/// sequence's position, the append of k and v to layer `layer`'s cache, and attention over
/// the sequence's keys: `[batch, 1, heads head_dim]`.
pub fn decode_attention<B: FusedOps>(
    dec: &mut B::Decoder,
    layer: usize,
    qkv: Tensor<B, 3>,
) -> Tensor<B, 3> {
    tensor(B::decode_attention(dec, layer, float(qkv)))
}

/// Picks each sequence's next token from `logits [batch, 1, vocab]` into the decoder (inside
/// a step, each sequence's position advances by one).
pub fn decode_sample<B: FusedOps>(dec: &mut B::Decoder, logits: Tensor<B, 3>) {
    B::decode_sample(dec, float(logits))
}

/// Runs one decode step: `body` is the model's decode forward over the decoder.
pub fn decode_step<B: FusedOps>(
    dec: &mut B::Decoder,
    body: &mut dyn FnMut(&mut B::Decoder),
) -> Result<(), DecodeError> {
    B::decode_step(dec, body)
}

/// The token ids of the oldest sampling whose ids were not taken yet (one per sequence), or
/// `None` when there is none. Waits only for that sampling.
pub fn decode_take_ids<B: FusedOps>(dec: &mut B::Decoder) -> Option<Vec<u32>> {
    B::decode_take_ids(dec)
}

/// The logits of the latest sampling (`[batch, vocab]` f32, real sequences only) when the
/// decoder keeps them ([`DecodeSpec::keep_logits`]); waits for the queued work.
pub fn decode_last_logits<B: FusedOps>(dec: &mut B::Decoder) -> Option<Vec<f32>> {
    B::decode_last_logits(dec)
}

/// Makes the next step read `ids` (one per sequence) instead of the sampled ones: teacher
/// forcing, to evaluate a model on given text through the decode step (the sampled tokens still
/// count for the repetition penalty). Call it between steps, after taking the ids.
pub fn decode_force_ids<B: FusedOps>(dec: &mut B::Decoder, ids: &[u32]) -> Result<(), DecodeError> {
    B::decode_force_ids(dec, ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(slot: usize, pos0: usize, rows: usize) -> PackedSeq {
        PackedSeq { slot, pos0, rows }
    }

    #[test]
    fn prompts_pack_into_chunks_without_padding() {
        assert_eq!(
            pack_prompts(&[7, 3, 1], 4),
            vec![
                vec![seq(0, 0, 4)],
                vec![seq(0, 4, 3), seq(1, 0, 1)],
                vec![seq(1, 1, 2), seq(2, 0, 1)],
            ]
        );
        assert_eq!(
            pack_prompts(&[7, 3, 1], 8192),
            vec![vec![seq(0, 0, 7), seq(1, 0, 3), seq(2, 0, 1)]]
        );
        assert_eq!(
            pack_prompts(&[2, 0, 2], 2),
            vec![vec![seq(0, 0, 2)], vec![seq(2, 0, 2)]]
        );
        assert!(pack_prompts(&[], 16).is_empty());
        // Every token once, in order, for awkward sizes.
        for chunk in 1..9 {
            let lens = [5, 1, 9, 2];
            let chunks = pack_prompts(&lens, chunk);
            assert!(
                chunks
                    .iter()
                    .all(|c| c.iter().map(|s| s.rows).sum::<usize>() <= chunk)
            );
            let mut next = [0; 4];
            for s in chunks.iter().flatten() {
                assert_eq!(s.pos0, next[s.slot]);
                next[s.slot] += s.rows;
            }
            assert_eq!(next, lens);
        }
    }
}
