//! The decode step's fused ops: a decoder (the paged KV cache of every layer, each lane's token
//! id, position and sampling settings) owned by the backend, and the ops of one step that use
//! it.
//!
//! A decoder runs up to [`DecodeSpec::lanes`] sequences at once, each in a *lane*. The caller
//! (an engine's scheduler) owns the pages of the KV pool: it gives a lane the pages of its
//! sequence ([`LaneOp::Set`], [`LaneOp::Pages`]), prefills the prompt into them (packed, several
//! sequences per forward: [`prefill_attention`]), activates the lane ([`LaneOp::Activate`]) and
//! samples its first token ([`prefill_sample`]); from then on every decode step ([`decode_step`])
//! feeds each active lane its last token and samples the next one, each lane with its own
//! settings ([`LaneSampling`]). Lanes join and leave between steps; sequences share the pages of
//! a common prompt prefix. Model code calls [`decode_embed`], [`decode_attention`] and
//! [`decode_sample`] between its projections and norms. On any backend the [`RefDecoder`] runs
//! them as plain Burn compositions (the page pool as Burn tensors, sampling on the host with the
//! device sampler's algorithm); `Stoke<Cuda>` keeps everything in its own device memory and
//! replays the step as a CUDA graph (`cuda::decoder`).

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

/// Positions per KV page unless a decoder is made with another size.
pub const DEFAULT_PAGE_SIZE: usize = 64;

/// The page that page-table entries name when they hold no sequence's positions (lanes without
/// a sequence, entries past a sequence's pages). It never holds a sequence's rows: a pool's
/// usable pages are `1 .. pages`.
pub const SPARE_PAGE: u32 = 0;

/// Most top log-probabilities a lane may ask for.
pub const MAX_TOP_LOGPROBS: usize = stoke_cuda::sample::MAX_TOP_LOGPROBS as usize;

/// One lane's sampling settings: a request's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LaneSampling {
    /// The algorithm's settings (temperature, top-k, top-p, repetition penalty; the draws' key,
    /// a request's seed).
    pub params: Sampling,
    /// The draws' stream (Philox counter word 1): two requests with one seed draw differently
    /// when their streams differ (the choices of one request).
    pub stream: u32,
    /// Log-probabilities of each sampled token and of this many most likely ones (at most
    /// [`MAX_TOP_LOGPROBS`]); `None`: none.
    pub logprobs: Option<u32>,
}

impl LaneSampling {
    /// Argmax, no penalty, no log-probabilities.
    pub const GREEDY: Self = Self {
        params: Sampling::GREEDY,
        stream: 0,
        logprobs: None,
    };
}

impl Default for LaneSampling {
    fn default() -> Self {
        Self::GREEDY
    }
}

/// What a decoder is built for.
#[derive(Clone, Debug)]
pub struct DecodeSpec {
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub hidden: usize,
    pub vocab: usize,
    /// Sequences decoded together at most.
    pub lanes: usize,
    /// Positions per sequence at most (prompt and generated tokens).
    pub capacity: usize,
    /// Positions per KV page: a power of two from 16 to 4096.
    pub page_size: usize,
    /// Pages in the pool of every layer (page [`SPARE_PAGE`] included).
    pub pages: usize,
    /// RoPE angles: `[positions, head_dim / 2, 2]` (cos, sin), `positions >= capacity`.
    pub rope: Arc<Vec<f32>>,
    pub kv_format: KvCacheFormat,
    /// Hadamard block of the FP8/INT4 rows (0: no rotation).
    pub rotate_block: usize,
    pub rms_norm_eps: f64,
    /// Run every step as it is queued, without CUDA graphs (for debugging).
    pub eager: bool,
    /// Keep a copy of each sampling's logits for [`decode_last_logits`] (tests, benchmarks).
    pub keep_logits: bool,
}

/// Why a decoder cannot be made or an op cannot run.
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
    #[error("lane {lane}: {reason}")]
    Lane { lane: usize, reason: String },
    #[error("stoke: {0}")]
    Cuda(#[from] stoke_cuda::Error),
}

pub(crate) fn shape_err(
    what: &'static str,
    expected: impl ToString,
    got: impl ToString,
) -> DecodeError {
    DecodeError::Shape {
        what,
        expected: expected.to_string(),
        got: got.to_string(),
    }
}

fn lane_err(lane: usize, reason: impl ToString) -> DecodeError {
    DecodeError::Lane {
        lane,
        reason: reason.to_string(),
    }
}

/// One sequence's part of a packed prefill: `rows` consecutive rows of the packed batch that go
/// to the sequence in lane `slot` at positions `pos0 .. pos0 + rows` (`pos0 > 0`: the positions
/// before it are already in the lane's pages, from an earlier chunk or a shared prefix).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedSeq {
    pub slot: usize,
    pub pos0: usize,
    pub rows: usize,
}

/// Packs prompts of `lens` tokens (sequence `i` in lane `i`, from position 0) into chunks of
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

/// A change to the decoder's lanes, queued in order with its steps (stream-ordered on the GPU:
/// a step queued before it does not see it, one queued after does).
#[derive(Clone, Copy, Debug)]
pub enum LaneOp<'a> {
    /// A sequence takes the free lane `lane`: its pages (entry `i` holds positions `i page ..
    /// (i + 1) page`), the tokens its repetition penalty sees (the prompt) and its sampling
    /// settings. The lane is prefilled next; steps pass it by until it is activated.
    Set {
        lane: usize,
        pages: &'a [u32],
        tokens: &'a [u32],
        sampling: LaneSampling,
    },
    /// More pages for `lane`'s sequence, from page-table entry `first` on.
    Pages {
        lane: usize,
        first: usize,
        pages: &'a [u32],
    },
    /// `lane`'s sequence is prefilled through position `pos` (its last token's): its next
    /// sampling ([`prefill_sample`]) draws with counter `pos`, and every step after it decodes
    /// the lane.
    Activate { lane: usize, pos: usize },
    /// `lane` holds no sequence any more.
    Clear { lane: usize },
    /// The sequence in `from` moves to the free lane `to`: its last sampled token, its tokens,
    /// pages, settings and position (compacting the lanes a step runs over).
    Move { from: usize, to: usize },
}

/// Log-probabilities of one sampled token: the log-softmax of the raw logits at the token, and
/// at the most likely tokens, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// The tokens one sampling drew ([`decode_take`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sampled {
    /// The lanes sampled: a step's active lanes, or the lanes a prefill sampling was given.
    pub lanes: Vec<usize>,
    /// Each lane's token, in `lanes` order.
    pub ids: Vec<u32>,
    /// Each lane's log-probabilities, where it asks for them.
    pub logprobs: Vec<Option<TokenLogprobs>>,
}

/// Rows a step of lanes `0 .. lanes` runs with: the next bucket of 1, 2, 4, 8, 16, 32, 64, ...
pub fn batch_bucket(lanes: usize) -> usize {
    lanes.next_power_of_two().max(1)
}

/// One lane as the host knows it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Lane {
    /// Whether a sequence holds the lane.
    pub held: bool,
    /// Whether steps decode it.
    pub active: bool,
    pub pages: Vec<u32>,
    /// The position of the token the next step feeds (its last token's once activated).
    pub pos: usize,
    pub sampling: LaneSampling,
}

/// The lanes of a decoder: what each holds, checked as ops arrive. Both decoders keep one and
/// mirror it into their own storage.
#[derive(Clone, Debug)]
pub(crate) struct Lanes {
    pub lanes: Vec<Lane>,
    page: usize,
    max_pages: usize,
    pages: usize,
    capacity: usize,
    vocab: usize,
}

impl Lanes {
    pub fn new(spec: &DecodeSpec) -> Self {
        Self {
            lanes: vec![Lane::default(); spec.lanes],
            page: spec.page_size,
            max_pages: spec.capacity.div_ceil(spec.page_size),
            pages: spec.pages,
            capacity: spec.capacity,
            vocab: spec.vocab,
        }
    }

    fn lane(&self, lane: usize) -> Result<&Lane, DecodeError> {
        self.lanes.get(lane).ok_or_else(|| {
            lane_err(
                lane,
                format!("past the decoder's {} lanes", self.lanes.len()),
            )
        })
    }

    fn check_pages(&self, lane: usize, first: usize, pages: &[u32]) -> Result<(), DecodeError> {
        if first + pages.len() > self.max_pages {
            return Err(lane_err(
                lane,
                format!(
                    "pages {first} .. {} past the {} a sequence holds",
                    first + pages.len(),
                    self.max_pages
                ),
            ));
        }
        if let Some(p) = pages
            .iter()
            .find(|&&p| p == SPARE_PAGE || p as usize >= self.pages)
        {
            return Err(lane_err(
                lane,
                format!("page {p} is not one of the pool's 1 .. {}", self.pages),
            ));
        }
        Ok(())
    }

    /// Checks `op` and applies it to the host's view.
    pub fn apply(&mut self, op: &LaneOp) -> Result<(), DecodeError> {
        match *op {
            LaneOp::Set {
                lane,
                pages,
                tokens,
                sampling,
            } => {
                if self.lane(lane)?.held {
                    return Err(lane_err(lane, "already holds a sequence"));
                }
                self.check_pages(lane, 0, pages)?;
                if let Some(t) = tokens.iter().find(|&&t| t as usize >= self.vocab) {
                    return Err(lane_err(
                        lane,
                        format!("token {t} past the vocabulary of {}", self.vocab),
                    ));
                }
                check_sampling(lane, &sampling)?;
                self.lanes[lane] = Lane {
                    held: true,
                    active: false,
                    pages: pages.to_vec(),
                    pos: 0,
                    sampling,
                };
            }
            LaneOp::Pages { lane, first, pages } => {
                let l = self.lane(lane)?;
                if !l.held {
                    return Err(lane_err(lane, "holds no sequence to give pages to"));
                }
                if first > l.pages.len() {
                    return Err(lane_err(
                        lane,
                        format!("pages from {first} leave a gap after its {}", l.pages.len()),
                    ));
                }
                self.check_pages(lane, first, pages)?;
                let l = &mut self.lanes[lane];
                l.pages.truncate(first);
                l.pages.extend_from_slice(pages);
            }
            LaneOp::Activate { lane, pos } => {
                let l = self.lane(lane)?;
                if !l.held {
                    return Err(lane_err(lane, "holds no sequence to activate"));
                }
                if pos >= self.capacity {
                    return Err(DecodeError::ContextOverflow {
                        needed: pos + 1,
                        capacity: self.capacity,
                    });
                }
                let l = &mut self.lanes[lane];
                l.active = true;
                l.pos = pos;
            }
            LaneOp::Clear { lane } => {
                self.lane(lane)?;
                self.lanes[lane] = Lane::default();
            }
            LaneOp::Move { from, to } => {
                if !self.lane(from)?.held {
                    return Err(lane_err(from, "holds no sequence to move"));
                }
                if self.lane(to)?.held {
                    return Err(lane_err(to, "already holds a sequence"));
                }
                self.lanes[to] = std::mem::take(&mut self.lanes[from]);
            }
        }
        Ok(())
    }

    /// The lanes a step decodes.
    pub fn active(&self) -> Vec<usize> {
        (0..self.lanes.len())
            .filter(|&i| self.lanes[i].active)
            .collect()
    }

    /// Rows of the next step (lanes `0 ..` the last active one, in a bucket), after checking
    /// that every active lane has a page for the position it writes.
    pub fn step_rows(&self) -> Result<usize, DecodeError> {
        let active = self.active();
        let Some(&last) = active.last() else {
            return Err(shape_err("decode step", "an active lane", "none"));
        };
        for &i in &active {
            let l = &self.lanes[i];
            if l.pos >= self.capacity {
                return Err(DecodeError::ContextOverflow {
                    needed: l.pos + 1,
                    capacity: self.capacity,
                });
            }
            if l.pos / self.page >= l.pages.len() {
                return Err(lane_err(
                    i,
                    format!(
                        "no page for position {} ({} pages of {})",
                        l.pos,
                        l.pages.len(),
                        self.page
                    ),
                ));
            }
        }
        Ok(batch_bucket(last + 1).min(self.lanes.len()))
    }

    /// The largest position an active lane writes next.
    pub fn max_position(&self) -> usize {
        self.lanes
            .iter()
            .filter(|l| l.active)
            .map(|l| l.pos)
            .max()
            .unwrap_or(0)
    }

    /// After a step: every active lane moves on one position.
    pub fn advance(&mut self) {
        for l in self.lanes.iter_mut().filter(|l| l.active) {
            l.pos += 1;
        }
    }

    /// Checks a packed prefill's layout against the lanes and the `rows` of its input: every
    /// sequence non-empty, in a held lane of its own, inside the lane's pages.
    pub fn check_packed(&self, seqs: &[PackedSeq], rows: usize) -> Result<(), DecodeError> {
        let total: usize = seqs.iter().map(|s| s.rows).sum();
        if total != rows {
            return Err(shape_err(
                "packed prefill rows",
                format!("{total} (the sequences' rows)"),
                rows,
            ));
        }
        for (i, s) in seqs.iter().enumerate() {
            if s.rows == 0 || s.slot >= self.lanes.len() {
                return Err(shape_err(
                    "packed prefill sequence",
                    format!("at least one row, a lane below {}", self.lanes.len()),
                    format!("sequence {i}: {s:?}"),
                ));
            }
            if s.pos0 + s.rows > self.capacity {
                return Err(DecodeError::ContextOverflow {
                    needed: s.pos0 + s.rows,
                    capacity: self.capacity,
                });
            }
            let l = &self.lanes[s.slot];
            if !l.held || s.pos0 + s.rows > l.pages.len() * self.page {
                return Err(lane_err(
                    s.slot,
                    format!(
                        "prefill of positions {} .. {} past its {} pages of {}",
                        s.pos0,
                        s.pos0 + s.rows,
                        l.pages.len(),
                        self.page
                    ),
                ));
            }
            if seqs[..i].iter().any(|o| o.slot == s.slot) {
                return Err(shape_err(
                    "packed prefill sequence",
                    "one part per lane",
                    format!("sequence {i}: lane {} twice", s.slot),
                ));
            }
        }
        Ok(())
    }

    /// Checks the lanes of a prefill sampling of `rows` rows.
    pub fn check_sample_lanes(&self, lanes: &[usize], rows: usize) -> Result<(), DecodeError> {
        if lanes.len() != rows {
            return Err(shape_err(
                "prefill sampling lanes",
                format!("one per row of logits ({rows})"),
                lanes.len(),
            ));
        }
        for (i, &lane) in lanes.iter().enumerate() {
            if !self.lane(lane)?.held {
                return Err(lane_err(lane, "holds no sequence to sample"));
            }
            if lanes[..i].contains(&lane) {
                return Err(lane_err(lane, "sampled twice in one call"));
            }
        }
        Ok(())
    }
}

/// Checks a lane's sampling settings (what the kernels take).
fn check_sampling(lane: usize, s: &LaneSampling) -> Result<(), DecodeError> {
    stoke_cuda::sample::check_params(&s.params).map_err(|e| lane_err(lane, e))?;
    if s.logprobs.is_some_and(|n| n as usize > MAX_TOP_LOGPROBS) {
        return Err(lane_err(
            lane,
            format!(
                "top log-probabilities {:?} past {MAX_TOP_LOGPROBS}",
                s.logprobs
            ),
        ));
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
        if self.lanes == 0 {
            return Err(shape_err("decoder lanes", "at least 1", 0));
        }
        let page = self.page_size;
        if !page.is_power_of_two() || !(16..=4096).contains(&page) {
            return Err(shape_err(
                "decoder page size",
                "a power of two from 16 to 4096 positions",
                page,
            ));
        }
        if self.capacity == 0 {
            return Err(shape_err("decoder capacity", "at least 1 position", 0));
        }
        if self.pages < 2 || self.pages > u32::MAX as usize {
            return Err(shape_err(
                "decoder pages",
                "at least 2 (one is the spare page)",
                self.pages,
            ));
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

    /// Pages a sequence of `capacity` positions holds at most.
    pub fn max_pages(&self) -> usize {
        self.capacity.div_ceil(self.page_size)
    }
}

/// Checks ids given to [`decode_force_ids`]: one per lane from lane 0, each in the vocabulary.
pub(crate) fn check_forced(ids: &[u32], lanes: usize, vocab: usize) -> Result<(), DecodeError> {
    if ids.len() > lanes {
        return Err(shape_err(
            "forced ids",
            format!("at most one per lane ({lanes})"),
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

/// Presence words (`ceil(vocab / 32)`) with the bits of `tokens` set.
pub(crate) fn presence_words(tokens: &[u32], vocab: usize) -> Vec<u32> {
    let mut w = vec![0u32; words(vocab)];
    for &t in tokens.iter().filter(|&&t| (t as usize) < vocab) {
        w[t as usize / 32] |= 1 << (t % 32);
    }
    w
}

pub(crate) fn words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// `slot[rows] = value`, with the pool tensor moved out of `slot` rather than cloned: held
/// once, it is updated in place (a backend with copy-on-write storage, NdArray, would otherwise
/// copy the whole layer pool for each row written).
fn assign_rows<B: Backend>(
    slot: &mut Option<Tensor<B, 4>>,
    rows: [std::ops::Range<usize>; 4],
    value: Tensor<B, 4>,
) {
    let pool = slot.take().expect("the pool is in place between writes");
    *slot = Some(pool.slice_assign(rows, value));
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

/// A lane's state that only the reference decoder keeps (the GPU decoder keeps it on the
/// device): its last sampled token and the presence words of its tokens.
#[derive(Clone, Debug, Default)]
struct RefLane {
    id: u32,
    presence: Vec<u32>,
}

/// The decoder of any backend: each layer's page pool as Burn tensors, the lanes on the host.
#[derive(Debug)]
pub struct RefDecoder<B: Backend> {
    pub spec: DecodeSpec,
    /// Each layer's pool `[pages, kv_heads, page, head_dim]`; `None` only while a row is
    /// written (see [`assign_rows`]).
    keys: Vec<Option<Tensor<B, 4>>>,
    values: Vec<Option<Tensor<B, 4>>>,
    /// With an FP8/INT4 mirror: the exact pool beside it (`keys` / `values` then hold the
    /// mirror's values), which prefill attention reads as the kernels' does; empty for BF16.
    exact_keys: Vec<Option<Tensor<B, 4>>>,
    exact_values: Vec<Option<Tensor<B, 4>>>,
    lanes: Lanes,
    state: Vec<RefLane>,
    /// Rows of the step being run, and its active lanes.
    rows: usize,
    step_lanes: Vec<usize>,
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    pending: VecDeque<Sampled>,
    in_step: bool,
    last_logits: Option<Vec<f32>>,
    device: B::Device,
}

impl<B: Backend> RefDecoder<B> {
    pub fn new(spec: DecodeSpec, dtype: DType, device: &B::Device) -> Result<Self, DecodeError> {
        spec.validate()?;
        let (pages, kvh, page, d) = (spec.pages, spec.kv_heads, spec.page_size, spec.head_dim);
        let z = || Some(Tensor::<B, 4>::zeros([pages, kvh, page, d], device).cast(dtype));
        let half = d / 2;
        let cap = spec.capacity;
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
            lanes: Lanes::new(&spec),
            state: vec![RefLane::default(); spec.lanes],
            rows: 0,
            step_lanes: Vec::new(),
            cos: Tensor::from_data(TensorData::new(cos, [cap, half]), device),
            sin: Tensor::from_data(TensorData::new(sin, [cap, half]), device),
            pending: VecDeque::new(),
            in_step: false,
            last_logits: None,
            device: device.clone(),
            spec,
        })
    }

    /// Applies lane changes in order.
    pub fn update(&mut self, ops: &[LaneOp]) -> Result<(), DecodeError> {
        for op in ops {
            self.lanes.apply(op)?;
            match *op {
                LaneOp::Set { lane, tokens, .. } => {
                    self.state[lane] = RefLane {
                        id: 0,
                        presence: presence_words(tokens, self.spec.vocab),
                    };
                }
                LaneOp::Clear { lane } => self.state[lane] = RefLane::default(),
                LaneOp::Move { from, to } => {
                    self.state[to] = std::mem::take(&mut self.state[from]);
                }
                LaneOp::Pages { .. } | LaneOp::Activate { .. } => {}
            }
        }
        Ok(())
    }

    /// Starts a step over the active lanes (checked: each has a page for its position).
    pub(crate) fn begin_step(&mut self) -> Result<(), DecodeError> {
        self.rows = self.lanes.step_rows()?;
        self.step_lanes = self.lanes.active();
        self.in_step = true;
        Ok(())
    }

    /// Ends a step: every active lane moves on one position.
    pub(crate) fn end_step(&mut self) {
        self.in_step = false;
        self.lanes.advance();
    }

    /// Replaces the ids the next step reads (lanes `0 .. ids.len()`; see [`decode_force_ids`]).
    pub fn force_ids(&mut self, ids: &[u32]) -> Result<(), DecodeError> {
        check_forced(ids, self.state.len(), self.spec.vocab)?;
        for (s, &t) in self.state.iter_mut().zip(ids) {
            s.id = t;
            if !s.presence.is_empty() {
                s.presence[t as usize / 32] |= 1 << (t % 32);
            }
        }
        Ok(())
    }

    /// Writes keys and values `[1, kvh, n, d]` of positions `pos0 .. pos0 + n` into `pages` of
    /// `layer`'s pool, page by page: the exact values, and what the mirror holds of them.
    fn store(
        &mut self,
        layer: usize,
        pages: &[u32],
        pos0: usize,
        k: Tensor<B, 4>,
        v: Tensor<B, 4>,
    ) {
        let (kvh, d, page) = (self.spec.kv_heads, self.spec.head_dim, self.spec.page_size);
        let n = k.dims()[2];
        let (kq, vq) = if self.exact_keys.is_empty() {
            (k.clone(), v.clone())
        } else {
            (
                self.through_format(k.clone()),
                self.through_format(v.clone()),
            )
        };
        let mut done = 0;
        while done < n {
            let pos = pos0 + done;
            let (p, off) = (pages[pos / page] as usize, pos % page);
            let take = (page - off).min(n - done);
            let rows = [p..p + 1, 0..kvh, off..off + take, 0..d];
            let part = |t: &Tensor<B, 4>| t.clone().narrow(2, done, take);
            if !self.exact_keys.is_empty() {
                assign_rows(&mut self.exact_keys[layer], rows.clone(), part(&k));
                assign_rows(&mut self.exact_values[layer], rows.clone(), part(&v));
            }
            assign_rows(&mut self.keys[layer], rows.clone(), part(&kq));
            assign_rows(&mut self.values[layer], rows, part(&vq));
            done += take;
        }
    }

    /// Positions `0 .. len` of a sequence on `pages` from `pool`: `[1, kvh, len, d]`.
    fn gather(&self, pool: &Option<Tensor<B, 4>>, pages: &[u32], len: usize) -> Tensor<B, 4> {
        let (kvh, d, page) = (self.spec.kv_heads, self.spec.head_dim, self.spec.page_size);
        let pool = pool.as_ref().expect("the pool is in place between writes");
        let np = len.div_ceil(page);
        let ids: Vec<i64> = pages[..np].iter().map(|&p| p as i64).collect();
        let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [np]), &self.device);
        pool.clone()
            .select(0, ids)
            .swap_dims(0, 1)
            .reshape([1, kvh, np * page, d])
            .narrow(2, 0, len)
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

    fn embed(
        &self,
        table: Tensor<B, 2>,
        gamma: Tensor<B, 1>,
        eps: f64,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let b = self.rows;
        let ids: Vec<i64> = self.state[..b].iter().map(|s| s.id as i64).collect();
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

    /// Keys in whole blocks of 256 (zeros past the length), so a backend that compiles per shape
    /// (burn-cuda) sees a new shape every 256 positions, not every one.
    fn padded(&self, t: Tensor<B, 4>, len: usize) -> Tensor<B, 4> {
        let [a, b, n, e] = t.dims();
        if n == len {
            return t;
        }
        let z = Tensor::<B, 4>::zeros([a, b, len - n, e], &self.device).cast(t.dtype());
        Tensor::cat(vec![t, z], 2)
    }

    /// One step's attention: each active lane's row rotated at its position, its key and value
    /// written to its page, and attention over its positions `0 ..= pos`; inactive rows give 0.
    fn attention(&mut self, layer: usize, qkv: Tensor<B, 3>) -> Tensor<B, 3> {
        let (h, kvh, d) = (self.spec.heads, self.spec.kv_heads, self.spec.head_dim);
        let b = self.rows;
        let dtype = qkv.dtype();
        let qkv = qkv.reshape([b, h + 2 * kvh, d]);
        let active = self.step_lanes.clone();
        if active.is_empty() {
            return Tensor::<B, 3>::zeros([b, 1, h * d], &self.device).cast(dtype);
        }
        let n = active.len();
        let rows: Vec<i64> = active.iter().map(|&i| i as i64).collect();
        let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [n]), &self.device);
        let x = qkv.select(0, rows);
        let pos: Vec<usize> = active.iter().map(|&i| self.lanes.lanes[i].pos).collect();
        let (cos, sin) = self.angles(pos.iter().copied());
        let q = rope_rows(x.clone().narrow(1, 0, h), &cos, &sin);
        let k = rope_rows(x.clone().narrow(1, h, kvh), &cos, &sin);
        let v = x.narrow(1, h + kvh, kvh);
        for (j, &lane) in active.iter().enumerate() {
            #[allow(clippy::single_range_in_vec_init)]
            let (kj, vj) = (
                k.clone().slice([j..j + 1]).reshape([1, kvh, 1, d]),
                v.clone().slice([j..j + 1]).reshape([1, kvh, 1, d]),
            );
            let pages = self.lanes.lanes[lane].pages.clone();
            self.store(layer, &pages, pos[j], kj, vj);
        }
        // Every active lane's pages in one gather, padded with the spare page (masked) to a
        // whole number of 256-position blocks, so that a backend that compiles per shape
        // (burn-cuda) sees a new shape every 256 positions, not every one.
        let page = self.spec.page_size;
        let np = (pos.iter().max().unwrap() + 1)
            .next_multiple_of(256)
            .div_ceil(page);
        let keys = np * page;
        let ids: Vec<i64> = active
            .iter()
            .flat_map(|&lane| {
                let pages = &self.lanes.lanes[lane].pages;
                (0..np).map(move |i| *pages.get(i).unwrap_or(&SPARE_PAGE) as i64)
            })
            .collect();
        let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [n * np]), &self.device);
        let window = |pool: &Option<Tensor<B, 4>>| {
            let pool = pool.as_ref().expect("the pool is in place between writes");
            pool.clone()
                .select(0, ids.clone())
                .reshape([n, np, kvh, page, d])
                .swap_dims(1, 2)
                .reshape([n, kvh, keys, d])
        };
        let (kk, vv) = (window(&self.keys[layer]), window(&self.values[layer]));
        let hidden: Vec<bool> = pos
            .iter()
            .flat_map(|&p| (0..keys).map(move |j| j > p))
            .collect();
        // Grouped-query attention without repeating the cache: the `h / kvh` query heads of a
        // kv head are its query rows (one position each).
        let g = h / kvh;
        let mask =
            Tensor::<B, 4, Bool>::from_data(TensorData::new(hidden, [n, 1, 1, keys]), &self.device)
                .expand([n, kvh, g, keys]);
        let q = q.reshape([n, kvh, g, d]);
        let out = module::attention(q, kk, vv, Some(mask), None, Default::default()).reshape([
            n,
            1,
            h * d,
        ]);
        if n == b {
            return out;
        }
        // Active rows in lane order, zeros elsewhere.
        let mut parts = Vec::new();
        let mut j = 0;
        for r in 0..b {
            if j < n && active[j] == r {
                #[allow(clippy::single_range_in_vec_init)]
                parts.push(out.clone().slice([j..j + 1]));
                j += 1;
            } else {
                parts.push(Tensor::<B, 3>::zeros([1, 1, h * d], &self.device).cast(dtype));
            }
        }
        Tensor::cat(parts, 0)
    }

    /// Packed prefill attention (see [`prefill_attention`]): per sequence, RoPE at its
    /// positions, its keys and values written to its lane's pages (exact, and through the
    /// mirror format), and causal attention over its earlier exact cached keys and its own.
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
        self.lanes.check_packed(seqs, rows)?;
        let qkv = qkv.reshape([rows, h + 2 * kvh, d]);
        let mut outs = Vec::with_capacity(seqs.len());
        let mut first = 0;
        for s in seqs {
            let (r, p0) = (s.rows, s.pos0);
            let x = qkv.clone().narrow(0, first, r);
            first += r;
            let (cos, sin) = self.angles(p0..p0 + r);
            let q = rope_rows(x.clone().narrow(1, 0, h), &cos, &sin);
            // [r, kvh, d] -> [1, kvh, r, d], the pool's layout.
            let heads_first = |t: Tensor<B, 3>| t.reshape([1, r, kvh, d]).swap_dims(1, 2);
            let k = heads_first(rope_rows(x.clone().narrow(1, h, kvh), &cos, &sin));
            let v = heads_first(x.narrow(1, h + kvh, kvh));
            let pages = self.lanes.lanes[s.slot].pages.clone();
            // Earlier positions from the exact pool, as the kernel reads them.
            let earlier = |pool: &Option<Tensor<B, 4>>, new: Tensor<B, 4>| {
                if p0 == 0 {
                    return new;
                }
                Tensor::cat(vec![self.gather(pool, &pages, p0), new], 2)
            };
            let (ek, ev) = if self.exact_keys.is_empty() {
                (&self.keys[layer], &self.values[layer])
            } else {
                (&self.exact_keys[layer], &self.exact_values[layer])
            };
            // Query rows padded to a multiple of 64 and keys to one of 256 (zeros, masked), so a
            // backend that compiles per shape (burn-cuda) sees few shapes across pieces.
            let (rp, keys) = (r.next_multiple_of(64), (p0 + r).next_multiple_of(256));
            let (kk, vv) = (
                self.padded(earlier(ek, k.clone()), keys),
                self.padded(earlier(ev, v.clone()), keys),
            );
            self.store(layer, &pages, p0, k, v);
            // The g query heads of a kv head as its query rows: [1, kvh, g rp, d], row
            // (j, i) at position p0 + i sees keys 0 ..= p0 + i (a padding row: key 0).
            let pad_rows = |t: Tensor<B, 4>| self.padded(t, rp);
            let q = pad_rows(q.reshape([1, 1, r, h * d]))
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

    /// Samples row `i` of `logits [rows, 1, vocab]` for lane `lanes[i]` with the lane's
    /// settings; each lane's draw counter is its position, advanced where the lane is active.
    fn sample(&mut self, logits: Tensor<B, 3>, lanes: &[usize]) {
        let [_, _, vocab] = logits.dims();
        let host = logits
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("f32 logits");
        let mut out = Sampled::default();
        for (r, &lane) in lanes.iter().enumerate() {
            let row = &host[r * vocab..(r + 1) * vocab];
            let l = &self.lanes.lanes[lane];
            let s = l.sampling;
            let counter = l.pos as u32;
            let st = &mut self.state[lane];
            let id = stoke_formats::sample::sample_row(
                row,
                Some(&st.presence),
                &s.params,
                counter,
                s.stream,
            );
            st.id = id;
            if (id as usize) < self.spec.vocab {
                st.presence[id as usize / 32] |= 1 << (id % 32);
            }
            out.lanes.push(lane);
            out.ids.push(id);
            out.logprobs.push(s.logprobs.map(|top| {
                let (logprob, top) = stoke_formats::sample::logprobs_row(row, id, top as usize);
                TokenLogprobs { logprob, top }
            }));
            if l.active && !self.in_step {
                // A prefill sampling moves the lane past its last prompt token; a step's
                // lanes move on in `step`.
                self.lanes.lanes[lane].pos += 1;
            }
        }
        if self.spec.keep_logits {
            self.last_logits = Some(
                lanes
                    .iter()
                    .enumerate()
                    .flat_map(|(r, _)| host[r * vocab..(r + 1) * vocab].to_vec())
                    .collect(),
            );
        }
        self.pending.push_back(out);
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

        fn decoder_spec(dec: &Self::Decoder) -> &$crate::decode::DecodeSpec {
            &dec.spec
        }

        fn decoder_update(
            dec: &mut Self::Decoder,
            ops: &[$crate::decode::LaneOp],
        ) -> Result<(), $crate::decode::DecodeError> {
            dec.update(ops)
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

        fn prefill_sample(
            dec: &mut Self::Decoder,
            logits: $crate::burn_backend::tensor::FloatTensor<Self>,
            lanes: &[usize],
        ) -> Result<(), $crate::decode::DecodeError> {
            $crate::decode::ref_ops::prefill_sample(dec, logits, lanes)
        }

        fn decode_step(
            dec: &mut Self::Decoder,
            body: &mut dyn FnMut(&mut Self::Decoder),
        ) -> Result<(), $crate::decode::DecodeError> {
            $crate::decode::ref_ops::step(dec, body)
        }

        fn decode_take(dec: &mut Self::Decoder) -> Option<$crate::decode::Sampled> {
            $crate::decode::ref_ops::take(dec)
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

    fn rows3<B: Backend>(logits: FloatTensor<B>) -> Tensor<B, 3> {
        let dims = logits.shape();
        let vocab = *dims.as_slice().last().expect("rank >= 1");
        let rows = dims.num_elements() / vocab.max(1);
        tensor::<B, 1>(B::float_reshape(logits, [rows * vocab].into())).reshape([rows, 1, vocab])
    }

    pub fn sample<B: Backend>(dec: &mut RefDecoder<B>, logits: FloatTensor<B>) {
        let l = rows3(logits);
        // A step's active lanes are its rows of the same index.
        let lanes = dec.step_lanes.clone();
        let rows: Vec<i64> = lanes.iter().map(|&i| i as i64).collect();
        let n = rows.len();
        let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [n]), &dec.device);
        dec.sample(l.select(0, rows), &lanes)
    }

    pub fn prefill_sample<B: Backend>(
        dec: &mut RefDecoder<B>,
        logits: FloatTensor<B>,
        lanes: &[usize],
    ) -> Result<(), DecodeError> {
        let l = rows3(logits);
        dec.lanes.check_sample_lanes(lanes, l.dims()[0])?;
        dec.sample(l, lanes);
        Ok(())
    }

    pub fn step<B: Backend>(
        dec: &mut RefDecoder<B>,
        body: &mut dyn FnMut(&mut RefDecoder<B>),
    ) -> Result<(), DecodeError> {
        dec.begin_step()?;
        body(dec);
        dec.end_step();
        Ok(())
    }

    pub fn take<B: Backend>(dec: &mut RefDecoder<B>) -> Option<Sampled> {
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

/// Makes a decoder for `spec` on `device` (pool values in `dtype` on the reference path).
pub fn decoder<B: FusedOps>(
    spec: DecodeSpec,
    dtype: DType,
    device: &B::Device,
) -> Result<B::Decoder, DecodeError> {
    B::decoder_new(spec, dtype, device)
}

/// What `dec` was made for.
pub fn decoder_spec<B: FusedOps>(dec: &B::Decoder) -> &DecodeSpec {
    B::decoder_spec(dec)
}

/// Applies lane changes in order ([`LaneOp`]), queued with the decoder's work.
pub fn decoder_update<B: FusedOps>(
    dec: &mut B::Decoder,
    ops: &[LaneOp],
) -> Result<(), DecodeError> {
    B::decoder_update(dec, ops)
}

/// Attention of a packed prefill in layer `layer`: `qkv [1, rows, (heads + 2 kv_heads)
/// head_dim]` holds the q|k|v projections of the sequences of `seqs`, one after another
/// ([`pack_prompts`] makes the layout). Each sequence's rows are rotated (RoPE at positions
/// `pos0 ..`), its keys and values written into its lane's pages, and each row attends causally
/// to its sequence's positions `0 ..= pos0 + i`. Returns `[1, rows, heads head_dim]`.
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
/// writes k and v straight into the lanes' pages (the same bits as projecting first), so no
/// q|k|v tensor is written; elsewhere the projection runs, then [`prefill_attention`]. A linear
/// with a bias projects first.
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

/// The step's input: the embedding rows of each lane's last token, and their RMSNorm with
/// `gamma`: `(x, normed)`, each `[rows, 1, hidden]` (the step's rows: lanes `0 ..`).
pub fn decode_embed<B: FusedOps>(
    dec: &B::Decoder,
    table: Tensor<B, 2>,
    gamma: Tensor<B, 1>,
    eps: f64,
) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let (x, n) = B::decode_embed(dec, float(table), float(gamma), eps);
    (tensor(x), tensor(n))
}

/// RoPE on a q|k|v projection's output `[rows, 1, (heads + 2 kv_heads) head_dim]` at each
/// lane's position, the append of k and v to layer `layer`'s pages, and attention over the
/// lane's keys: `[rows, 1, heads head_dim]`.
pub fn decode_attention<B: FusedOps>(
    dec: &mut B::Decoder,
    layer: usize,
    qkv: Tensor<B, 3>,
) -> Tensor<B, 3> {
    tensor(B::decode_attention(dec, layer, float(qkv)))
}

/// The q|k|v projection of `x` (`[rows, 1, hidden]`) by `linear` and [`decode_attention`] of
/// its output, RoPE and the cache append done by the projection's GEMM where a kernel applies
/// ([`FusedOps::decode_qkv_attention`]).
pub fn decode_qkv_attention<B: FusedOps>(
    dec: &mut B::Decoder,
    layer: usize,
    x: Tensor<B, 3>,
    linear: &burn::nn::Linear<B>,
) -> Tensor<B, 3> {
    match &linear.bias {
        Some(_) => decode_attention::<B>(dec, layer, linear.forward(x)),
        None => tensor(B::decode_qkv_attention(
            dec,
            layer,
            float(x),
            float(linear.weight.val()),
        )),
    }
}

/// Picks each active lane's next token from a step's `logits [rows, 1, vocab]` into the
/// decoder, with the lane's settings (each lane's position moves on by one).
pub fn decode_sample<B: FusedOps>(dec: &mut B::Decoder, logits: Tensor<B, 3>) {
    B::decode_sample(dec, float(logits))
}

/// Picks the first token of each lane of `lanes` from `logits [lanes.len(), .., vocab]` (row
/// `i` for lane `lanes[i]`; a prefill's last rows), with the lanes' settings, drawing at each
/// lane's position; an active lane then moves on one position.
pub fn prefill_sample<B: FusedOps, const D: usize>(
    dec: &mut B::Decoder,
    logits: Tensor<B, D>,
    lanes: &[usize],
) -> Result<(), DecodeError> {
    B::prefill_sample(dec, float(logits), lanes)
}

/// Runs one decode step over the active lanes: `body` is the model's decode forward over the
/// decoder.
pub fn decode_step<B: FusedOps>(
    dec: &mut B::Decoder,
    body: &mut dyn FnMut(&mut B::Decoder),
) -> Result<(), DecodeError> {
    B::decode_step(dec, body)
}

/// The tokens of the oldest sampling not taken yet, or `None` when there is none. Waits only
/// for that sampling.
pub fn decode_take<B: FusedOps>(dec: &mut B::Decoder) -> Option<Sampled> {
    B::decode_take(dec)
}

/// [`decode_take`]'s token ids alone.
pub fn decode_take_ids<B: FusedOps>(dec: &mut B::Decoder) -> Option<Vec<u32>> {
    B::decode_take(dec).map(|s| s.ids)
}

/// The logits of the latest sampling (`[rows, vocab]` f32, the sampled lanes' rows) when the
/// decoder keeps them ([`DecodeSpec::keep_logits`]); waits for the queued work.
pub fn decode_last_logits<B: FusedOps>(dec: &mut B::Decoder) -> Option<Vec<f32>> {
    B::decode_last_logits(dec)
}

/// Makes the next step read `ids` (lanes `0 .. ids.len()`) instead of the sampled ones: teacher
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

    fn spec() -> DecodeSpec {
        DecodeSpec {
            layers: 1,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            hidden: 8,
            vocab: 40,
            lanes: 4,
            capacity: 64,
            page_size: 16,
            pages: 9,
            rope: Arc::new(vec![0.0; 64 * 4]),
            kv_format: KvCacheFormat::Bf16,
            rotate_block: 0,
            rms_norm_eps: 1e-5,
            eager: false,
            keep_logits: false,
        }
    }

    #[test]
    fn lane_ops_are_checked_and_tracked() {
        let mut l = Lanes::new(&spec());
        let set = |lane, pages: &'static [u32]| LaneOp::Set {
            lane,
            pages,
            tokens: &[1, 2],
            sampling: LaneSampling::GREEDY,
        };
        l.apply(&set(1, &[3, 4])).unwrap();
        // The same lane twice, the spare page, a page past the pool, more pages than a
        // sequence holds, a lane past the decoder's.
        for bad in [
            set(1, &[5]),
            set(2, &[0]),
            set(2, &[9]),
            set(2, &[1, 2, 3, 5, 6]),
            set(4, &[1]),
        ] {
            assert!(
                matches!(l.apply(&bad), Err(DecodeError::Lane { .. })),
                "{bad:?}"
            );
        }
        let e = l.apply(&LaneOp::Set {
            lane: 2,
            pages: &[5],
            tokens: &[40],
            sampling: LaneSampling::GREEDY,
        });
        assert!(matches!(e, Err(DecodeError::Lane { .. })));
        let e = l.apply(&LaneOp::Set {
            lane: 2,
            pages: &[5],
            tokens: &[],
            sampling: LaneSampling {
                params: Sampling {
                    top_p: 0.0,
                    ..Sampling::GREEDY
                },
                ..LaneSampling::GREEDY
            },
        });
        assert!(matches!(e, Err(DecodeError::Lane { .. })));
        // Nothing active: no step.
        assert!(l.step_rows().is_err());
        l.apply(&LaneOp::Activate { lane: 1, pos: 31 }).unwrap();
        assert_eq!(l.step_rows().unwrap(), 2);
        l.advance();
        // Position 32 needs a third page.
        assert!(matches!(
            l.step_rows(),
            Err(DecodeError::Lane { lane: 1, .. })
        ));
        assert!(
            l.apply(&LaneOp::Pages {
                lane: 1,
                first: 3,
                pages: &[5]
            })
            .is_err()
        );
        l.apply(&LaneOp::Pages {
            lane: 1,
            first: 2,
            pages: &[5],
        })
        .unwrap();
        assert_eq!(l.step_rows().unwrap(), 2);
        // Packed prefill layouts inside the lane's pages only.
        assert!(l.check_packed(&[seq(1, 0, 48)], 48).is_ok());
        assert!(l.check_packed(&[seq(1, 40, 9)], 9).is_err());
        assert!(l.check_packed(&[seq(0, 0, 2)], 2).is_err());
        assert!(l.check_packed(&[seq(1, 0, 2)], 3).is_err());
        // Moving to a held lane fails; to a free one carries everything.
        l.apply(&set(0, &[6])).unwrap();
        assert!(l.apply(&LaneOp::Move { from: 1, to: 0 }).is_err());
        l.apply(&LaneOp::Move { from: 1, to: 3 }).unwrap();
        assert_eq!(l.active(), vec![3]);
        assert_eq!(l.lanes[3].pages, vec![3, 4, 5]);
        assert_eq!(l.step_rows().unwrap(), 4);
        l.apply(&LaneOp::Clear { lane: 3 }).unwrap();
        assert!(l.active().is_empty());
        let e = l.apply(&LaneOp::Activate { lane: 0, pos: 64 });
        assert!(matches!(e, Err(DecodeError::ContextOverflow { .. })));
    }
}
