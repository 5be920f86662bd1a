//! # stoke-engine
//!
//! Continuous batching on a Stoke decoder: requests are added and aborted at any time, and each
//! [`Engine::step`] admits waiting requests into free lanes, runs one packed prefill chunk of the
//! prompts being read (under a token budget) and one decode step over every running request,
//! each request with its own sampling parameters, stop conditions and log-probabilities.
//!
//! The KV cache is a pool of pages ([`pages::PagePool`]): a request holds the pages of its
//! tokens, gets one more as it grows, and shares the pages of a prompt prefix it has in common
//! with an earlier request (full pages, matched by their tokens). When the pool runs out, the
//! latest admitted request is preempted: its pages go back and it waits again, to be recomputed
//! from its prompt and the tokens it had produced (draws are keyed by position, so its tokens do
//! not change).
//!
//! The engine never waits for the step it has just queued: [`Engine::step`] queues this
//! iteration's work on the device, then takes the tokens of the previous one (stop conditions are
//! therefore seen one step late; the extra token is dropped). The model is anything that runs a
//! packed prefill and a decode step over the decoder ([`EngineModel`]).

pub mod pages;
pub mod params;
pub mod text;

pub use pages::PagePool;
pub use params::{ParamError, Params};
pub use text::{Detokenize, Text};

use burn::tensor::DType;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;
use stoke::{DecodeError, FusedOps, KvCacheFormat, LaneOp, PackedSeq, TokenLogprobs};

/// A model the engine can run.
pub trait EngineModel<B: FusedOps> {
    /// A decoder spec for the model with these sizes (its dims, RoPE table and norm epsilon).
    fn decode_spec(&self, sizes: DecoderSizes) -> stoke::DecodeSpec;
    /// Positions the model's RoPE table covers (the longest context it can run).
    fn max_positions(&self) -> usize;
    fn vocab(&self) -> usize;
    /// What its ops compute (the engine's decoder takes its KV cache format).
    fn plan(&self) -> stoke::Plan;
    /// The dtype its decoder computes in, and its device.
    fn dtype(&self) -> DType;
    fn device(&self) -> B::Device;
    /// One packed prefill chunk: `ids` holds the rows' tokens, `seqs` the layout (each piece's
    /// lane and first position); the pieces of `sample` (indices into `seqs`) end their
    /// sequence's prompt: their last rows' logits sample each sequence's first token into its
    /// lane ([`stoke::prefill_sample`]).
    fn prefill(
        &self,
        dec: &mut B::Decoder,
        ids: &[u32],
        seqs: &[PackedSeq],
        sample: &[usize],
    ) -> Result<(), DecodeError>;
    /// One decode step's forward over the decoder ([`stoke::decode_step`] runs it).
    fn decode_forward(&self, dec: &mut B::Decoder);
}

impl<B: FusedOps, M: EngineModel<B>> EngineModel<B> for &M {
    fn decode_spec(&self, sizes: DecoderSizes) -> stoke::DecodeSpec {
        (**self).decode_spec(sizes)
    }
    fn max_positions(&self) -> usize {
        (**self).max_positions()
    }
    fn vocab(&self) -> usize {
        (**self).vocab()
    }
    fn plan(&self) -> stoke::Plan {
        (**self).plan()
    }
    fn dtype(&self) -> DType {
        (**self).dtype()
    }
    fn device(&self) -> B::Device {
        (**self).device()
    }
    fn prefill(
        &self,
        dec: &mut B::Decoder,
        ids: &[u32],
        seqs: &[PackedSeq],
        sample: &[usize],
    ) -> Result<(), DecodeError> {
        (**self).prefill(dec, ids, seqs, sample)
    }
    fn decode_forward(&self, dec: &mut B::Decoder) {
        (**self).decode_forward(dec)
    }
}

/// The sizes of a decoder the engine asks a model for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecoderSizes {
    pub lanes: usize,
    pub capacity: usize,
    pub page_size: usize,
    pub pages: usize,
    pub kv_format: KvCacheFormat,
    pub eager: bool,
}

/// How the engine is sized and scheduled.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Requests decoded together at most (the decoder's lanes; 64 at most on the GPU).
    pub max_running: usize,
    /// Tokens per request at most, prompt and output (at most the model's RoPE table).
    pub context: usize,
    /// Positions per KV page.
    pub page_size: usize,
    /// Pages in the pool; `None`: sized from `kv_memory` and the device's free memory, or, where
    /// the backend reports none, enough for `max_running` requests of `context` tokens.
    pub kv_pages: Option<usize>,
    /// Share of the device's free memory (at start) the KV pool may take.
    pub kv_memory: f64,
    /// Prompt tokens one step prefills at most (a longer prompt continues in the next steps).
    pub max_prefill_tokens: usize,
    /// Requests waiting at most; [`Engine::add`] refuses more ([`EngineError::QueueFull`]).
    pub max_waiting: usize,
    /// Share pages of identical prompt prefixes.
    pub prefix_caching: bool,
    /// Decode steps without CUDA graphs.
    pub eager: bool,
    /// The model's end-of-sequence tokens (a request stops on them unless it ignores them).
    pub eos: Vec<u32>,
    /// Seed of the generator that gives requests without a seed theirs.
    pub seed: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_running: 32,
            context: 4096,
            page_size: stoke::DEFAULT_PAGE_SIZE,
            kv_pages: None,
            kv_memory: 0.8,
            max_prefill_tokens: 2048,
            max_waiting: 4096,
            prefix_caching: true,
            eager: false,
            eos: Vec::new(),
            seed: 0,
        }
    }
}

/// A request's handle.
pub type RequestId = u64;

/// Why a request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or one of its stop tokens (not part of the output).
    StopToken(u32),
    /// One of its stop strings (the text ends before it).
    StopString(String),
    /// It produced `max_tokens` tokens.
    MaxTokens,
    /// Its tokens filled the context.
    ContextFull,
    /// [`Engine::abort`].
    Aborted,
}

impl FinishReason {
    /// The OpenAI API's `finish_reason`: `stop` or `length` (or `abort`).
    pub fn openai(&self) -> &'static str {
        match self {
            Self::StopToken(_) | Self::StopString(_) => "stop",
            Self::MaxTokens | Self::ContextFull => "length",
            Self::Aborted => "abort",
        }
    }
}

/// What a step produced for one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A generated token, and the text it completes (may be empty: an incomplete character, or
    /// text that may still turn out to start a stop string).
    Token {
        id: RequestId,
        token: u32,
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    /// The request ended: the rest of its text, why, and its token counts.
    Finished {
        id: RequestId,
        text: String,
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
}

/// Why the engine could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid parameter: {0}")]
    Param(#[from] ParamError),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("prompt token {token} is past the vocabulary of {vocab}")]
    Token { token: u32, vocab: usize },
    #[error(
        "the prompt has {prompt} tokens and max_tokens is {max_tokens}: {} tokens, over the context of {context}",
        prompt + max_tokens
    )]
    TooLong {
        prompt: usize,
        max_tokens: usize,
        context: usize,
    },
    #[error("the request needs {needed} KV pages; the pool holds {usable}")]
    TooLarge { needed: usize, usable: usize },
    #[error("{waiting} requests are waiting already (the limit)")]
    QueueFull { waiting: usize },
    #[error("stop strings need a detokenizer, and the engine has none")]
    NoDetokenizer,
    #[error("engine configuration: {0}")]
    Config(String),
    #[error("decoder: {0}")]
    Decode(#[from] DecodeError),
}

/// The engine's counters (a snapshot).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub waiting: usize,
    /// Requests holding a lane (prefilling or decoding).
    pub running: usize,
    pub pages_used: usize,
    pub pages_total: usize,
    /// Registered prefix pages (held or idle).
    pub pages_cached: usize,
    pub prefix_hits: u64,
    pub prefix_lookups: u64,
    pub preemptions: u64,
    pub steps: u64,
    pub prefill_tokens: u64,
    pub generated_tokens: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Waiting,
    /// Holding `lane`; its first `done` tokens are in its pages (computed or shared).
    Prefilling {
        lane: usize,
        done: usize,
    },
    /// Holding `lane`, decoding.
    Running {
        lane: usize,
    },
}

struct Request {
    prompt: Vec<u32>,
    /// Tokens produced so far (as the host has seen them).
    output: Vec<u32>,
    params: Params,
    seed: u64,
    state: State,
    pages: Vec<u32>,
    /// The keys of the registered full prompt pages, in order (the chain's last is the parent
    /// of the next one).
    keys: Vec<u64>,
    /// The position the next decode step writes (its last token's), while running.
    pos: usize,
    /// Admission order (the latest is preempted first).
    admitted: u64,
    text: Text,
    arrived: Instant,
}

impl Request {
    /// The tokens its pages hold or will hold: the prompt, then what it produced (a
    /// preempted request is recomputed from both).
    fn tokens(&self) -> Vec<u32> {
        let mut t = self.prompt.clone();
        t.extend_from_slice(&self.output);
        t
    }
}

/// One sampling queued on the decoder: which request each lane held when it was queued.
struct Issued {
    owners: HashMap<usize, (RequestId, u64)>,
}

/// Continuous batching over one decoder.
pub struct Engine<B: FusedOps, M: EngineModel<B>> {
    model: M,
    dec: B::Decoder,
    cfg: EngineConfig,
    pool: PagePool,
    detok: Option<Arc<dyn Detokenize>>,
    requests: HashMap<RequestId, Request>,
    waiting: VecDeque<RequestId>,
    /// Each lane's request and the lane's epoch (a count of its owners), so a sampling queued
    /// before a lane changed hands is not credited to the new owner.
    lanes: Vec<Option<RequestId>>,
    epochs: Vec<u64>,
    issued: VecDeque<Issued>,
    next_id: RequestId,
    next_admit: u64,
    rng: rand::rngs::StdRng,
    vocab: usize,
    stats: EngineStats,
    finished: Vec<Event>,
    /// Row buckets a decode step has run at: the first step at a new one warms up (loads,
    /// tunes, captures), so the tokens before it are taken first.
    buckets: std::collections::HashSet<usize>,
    /// Until the first token: when the engine was made and what its start took.
    startup: Option<Startup>,
}

/// Runs one request through a small engine over `model` before the KV pool is sized from the
/// device's free memory: a prompt of the longest prefill chunk (or the context, less one
/// token), then a decode step. The weights' device copies that kernels make at their first call
/// (a packed weight's upload, its prefill copy) and the step's working memory are then taken,
/// so the pool leaves them room, and the first real request finds the kernels loaded.
fn profile<B: FusedOps, M: EngineModel<B>>(
    model: &M,
    cfg: &EngineConfig,
) -> Result<(), EngineError> {
    let context = cfg.context.min(model.max_positions());
    let prompt = cfg.max_prefill_tokens.min(context.saturating_sub(2)).max(1);
    let small = EngineConfig {
        kv_pages: Some((prompt + 2).div_ceil(cfg.page_size.max(1)) + 1),
        max_waiting: 1,
        prefix_caching: false,
        ..cfg.clone()
    };
    let mut engine = Engine::<B, &M>::build(model, small, None)?;
    let vocab = model.vocab().max(1);
    let ids = (0..prompt)
        .map(|i| ((i * 7919 + 1) % vocab) as u32)
        .collect();
    engine.add(
        ids,
        Params {
            max_tokens: 2,
            ignore_eos: true,
            ..Default::default()
        },
    )?;
    while engine.has_work() {
        engine.step()?;
    }
    Ok(())
}

/// What the first token waited for (logged at `info` under the target `stoke`).
#[derive(Clone, Copy, Debug)]
struct Startup {
    made: Instant,
    decoder: std::time::Duration,
    queue: std::time::Duration,
    wait: std::time::Duration,
}

impl<B: FusedOps, M: EngineModel<B>> Engine<B, M> {
    /// An engine over `model`, its decoder sized by `cfg`; `detok` turns tokens into text
    /// (needed for stop strings; without it events carry no text).
    pub fn new(
        model: M,
        cfg: EngineConfig,
        detok: Option<Arc<dyn Detokenize>>,
    ) -> Result<Self, EngineError> {
        let device = model.device();
        if cfg.kv_pages.is_none() && B::device_memory(&device).is_some() {
            // The pool is sized from the memory left free: what the weights and a step take
            // is known only once they ran (a packed weight's device copies are made at its
            // first kernel call).
            profile(&model, &cfg)?;
            B::memory_cleanup(&device);
        }
        Self::build(model, cfg, detok)
    }

    /// [`Engine::new`] without the profiling run.
    fn build(
        model: M,
        cfg: EngineConfig,
        detok: Option<Arc<dyn Detokenize>>,
    ) -> Result<Self, EngineError> {
        use rand::SeedableRng;
        let page = cfg.page_size;
        if cfg.max_running == 0 || cfg.max_prefill_tokens == 0 {
            return Err(EngineError::Config(
                "max_running and max_prefill_tokens must be at least 1".into(),
            ));
        }
        let context = cfg.context.min(model.max_positions());
        if context == 0 {
            return Err(EngineError::Config("a context of 0 tokens".into()));
        }
        let capacity = context;
        let max_pages = capacity.div_ceil(page.max(1));
        let device = model.device();
        let spec_for = |pages: usize| {
            model.decode_spec(DecoderSizes {
                lanes: cfg.max_running,
                capacity,
                page_size: page,
                pages,
                kv_format: model.plan().kv_format,
                eager: cfg.eager,
            })
        };
        let pages = match cfg.kv_pages {
            Some(p) => p,
            None => {
                let probe = spec_for(2);
                match B::device_memory(&device) {
                    Some((free, _)) => {
                        let per_page = kv_page_bytes(&probe, model.dtype());
                        ((free as f64 * cfg.kv_memory) as usize / per_page.max(1)).max(2)
                    }
                    None => cfg.max_running * max_pages + 1,
                }
            }
        };
        let pages = pages.min(u32::MAX as usize);
        let spec = spec_for(pages);
        let t0 = Instant::now();
        let dec = stoke::decoder::<B>(spec, model.dtype(), &device)?;
        let startup = Startup {
            made: t0,
            decoder: t0.elapsed(),
            queue: Default::default(),
            wait: Default::default(),
        };
        tracing::info!(
            "stoke engine: {} lanes, context {context}, {pages} KV pages of {page} positions ({} positions)",
            cfg.max_running,
            (pages - 1) * page
        );
        let vocab = model.vocab();
        let lanes = cfg.max_running;
        Ok(Self {
            dec,
            pool: PagePool::new(pages),
            detok,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            lanes: vec![None; lanes],
            epochs: vec![0; lanes],
            issued: VecDeque::new(),
            next_id: 0,
            next_admit: 0,
            rng: rand::rngs::StdRng::seed_from_u64(cfg.seed),
            vocab,
            stats: EngineStats {
                pages_total: pages - 1,
                ..Default::default()
            },
            finished: Vec::new(),
            buckets: Default::default(),
            startup: Some(startup),
            cfg: EngineConfig { context, ..cfg },
            model,
        })
    }

    /// The model.
    pub fn model(&self) -> &M {
        &self.model
    }

    /// The decoder (for its counters).
    pub fn decoder(&self) -> &B::Decoder {
        &self.dec
    }

    /// The configuration in force (the context clipped to the model's).
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Adds a request: `prompt` token ids, generated as `params` say. Checked at once: the
    /// parameters, the prompt's tokens, its length against the context and the pool, the queue.
    pub fn add(&mut self, prompt: Vec<u32>, params: Params) -> Result<RequestId, EngineError> {
        use rand::Rng;
        params.validate(self.vocab)?;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if let Some(&token) = prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(EngineError::Token {
                token,
                vocab: self.vocab,
            });
        }
        if !params.stop.is_empty() && self.detok.is_none() {
            return Err(EngineError::NoDetokenizer);
        }
        let total = prompt.len() + params.max_tokens;
        if total > self.cfg.context {
            return Err(EngineError::TooLong {
                prompt: prompt.len(),
                max_tokens: params.max_tokens,
                context: self.cfg.context,
            });
        }
        let needed = total.div_ceil(self.cfg.page_size);
        if needed > self.pool.usable() {
            return Err(EngineError::TooLarge {
                needed,
                usable: self.pool.usable(),
            });
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(EngineError::QueueFull {
                waiting: self.waiting.len(),
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        let seed = params.seed.unwrap_or_else(|| self.rng.random());
        self.requests.insert(
            id,
            Request {
                prompt,
                output: Vec::new(),
                params,
                seed,
                state: State::Waiting,
                pages: Vec::new(),
                keys: Vec::new(),
                pos: 0,
                admitted: 0,
                text: Text::default(),
                arrived: Instant::now(),
            },
        );
        self.waiting.push_back(id);
        Ok(id)
    }

    /// Ends a request now: its lane and pages are given back, and a `Finished` event with
    /// [`FinishReason::Aborted`] comes out of the next [`Engine::step`]. `false` for an unknown
    /// (or already finished) request.
    pub fn abort(&mut self, id: RequestId) -> Result<bool, EngineError> {
        if !self.requests.contains_key(&id) {
            return Ok(false);
        }
        self.finish(id, FinishReason::Aborted)?;
        Ok(true)
    }

    /// Whether anything is waiting, running or on its way back from the device.
    pub fn has_work(&self) -> bool {
        !self.requests.is_empty() || !self.issued.is_empty() || !self.finished.is_empty()
    }

    /// How long a request has been in the engine.
    pub fn age(&self, id: RequestId) -> Option<std::time::Duration> {
        self.requests.get(&id).map(|r| r.arrived.elapsed())
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            waiting: self.waiting.len(),
            running: self.lanes.iter().flatten().count(),
            pages_used: self.pool.used(),
            pages_cached: self.pool.cached(),
            prefix_hits: self.pool.hits,
            prefix_lookups: self.pool.lookups,
            ..self.stats.clone()
        }
    }

    /// One iteration: page growth for the running requests (preempting the latest admitted
    /// where the pool runs out), admission of waiting requests into free lanes, one packed
    /// prefill chunk, one decode step; then the tokens of the previous iteration's samplings as
    /// events (and the requests that ended).
    pub fn step(&mut self) -> Result<Vec<Event>, EngineError> {
        let t0 = Instant::now();
        self.grow()?;
        self.admit()?;
        let (ids, seqs, sample, activate) = self.plan_prefill();
        // Lanes whose prompt ends in this chunk decode from this step on: activated before the
        // prefill samples their first token.
        let act: Vec<LaneOp> = activate
            .iter()
            .map(|&(id, pos)| LaneOp::Activate {
                lane: self.lane_of(id),
                pos,
            })
            .collect();
        // Samplings queued in this iteration (taken by the next one).
        let mut fresh = 0;
        self.apply(&act)?;
        if !seqs.is_empty() {
            self.model.prefill(&mut self.dec, &ids, &seqs, &sample)?;
            self.stats.prefill_tokens += ids.len() as u64;
            self.register_prefix(&seqs);
            if !sample.is_empty() {
                let owners = sample.iter().map(|&i| self.owner(seqs[i].slot)).collect();
                self.issued.push_back(Issued { owners });
                fresh += 1;
            }
        }
        for &(rid, pos) in &activate {
            let r = self
                .requests
                .get_mut(&rid)
                .expect("activated requests exist");
            let lane = match r.state {
                State::Prefilling { lane, .. } => lane,
                s => unreachable!("activating a request in {s:?}"),
            };
            r.state = State::Running { lane };
            r.pos = pos + 1;
        }
        let mut running = self.running_lanes();
        let mut events = std::mem::take(&mut self.finished);
        if let Some(&last) = running.last() {
            // The first step at a new row bucket warms up: the tokens queued before it (a
            // prefill's first tokens) are taken first, so that they do not wait for it.
            let bucket = stoke::decode::batch_bucket(last + 1);
            if self.buckets.insert(bucket) {
                let t = Instant::now();
                while !self.issued.is_empty() {
                    self.take_one(&mut events)?;
                }
                fresh = 0;
                self.startup_wait(t);
                // Those tokens may have ended requests: their lanes are free now.
                running = self.running_lanes();
            }
        }
        if !running.is_empty() {
            let model = &self.model;
            stoke::decode_step::<B>(&mut self.dec, &mut |d| model.decode_forward(d))?;
            let owners = running.iter().map(|&l| self.owner(l)).collect();
            self.issued.push_back(Issued { owners });
            fresh += 1;
            for &l in &running {
                let id = self.lanes[l].expect("running lanes are held");
                self.requests.get_mut(&id).expect("held").pos += 1;
            }
            self.stats.steps += 1;
        }
        // The samplings of earlier iterations (all of them when nothing new was queued).
        let queued = t0.elapsed();
        let t = Instant::now();
        // With nothing new queued, everything on its way back is taken now.
        while self.issued.len() > fresh {
            self.take_one(&mut events)?;
        }
        events.append(&mut self.finished);
        self.startup_wait(t);
        if let Some(s) = &mut self.startup {
            s.queue += queued;
            if events.iter().any(|e| matches!(e, Event::Token { .. })) {
                tracing::info!(
                    target: "stoke",
                    "first token {:.1} ms after the engine was made: decoder and kernels {:.1} ms \
                     (at its making), steps' host work {:.1} ms, waiting for the device {:.1} ms",
                    s.made.elapsed().as_secs_f64() * 1e3,
                    s.decoder.as_secs_f64() * 1e3,
                    s.queue.as_secs_f64() * 1e3,
                    s.wait.as_secs_f64() * 1e3,
                );
                self.startup = None;
            }
        }
        Ok(events)
    }

    /// Takes the oldest sampling on its way back and credits its tokens.
    fn take_one(&mut self, events: &mut Vec<Event>) -> Result<(), EngineError> {
        let issued = self.issued.pop_front().expect("a sampling was issued");
        let sampled = stoke::decode_take::<B>(&mut self.dec)
            .ok_or_else(|| EngineError::Config("a queued sampling is missing".into()))?;
        self.credit(issued, sampled, events)
    }

    fn startup_wait(&mut self, since: Instant) {
        if let Some(s) = &mut self.startup {
            s.wait += since.elapsed();
        }
    }

    /// The lanes whose requests decode (their prompts done), in order.
    fn running_lanes(&self) -> Vec<usize> {
        (0..self.lanes.len())
            .filter(|&l| {
                self.lanes[l]
                    .is_some_and(|id| matches!(self.requests[&id].state, State::Running { .. }))
            })
            .collect()
    }

    fn owner(&self, lane: usize) -> (usize, (RequestId, u64)) {
        (
            lane,
            (self.lanes[lane].expect("a held lane"), self.epochs[lane]),
        )
    }

    fn lane_of(&self, id: RequestId) -> usize {
        match self.requests[&id].state {
            State::Prefilling { lane, .. } | State::Running { lane } => lane,
            State::Waiting => unreachable!("a waiting request holds no lane"),
        }
    }

    fn apply(&mut self, ops: &[LaneOp]) -> Result<(), EngineError> {
        if !ops.is_empty() {
            stoke::decoder_update::<B>(&mut self.dec, ops)?;
        }
        Ok(())
    }

    /// A page for the position each running request writes next; where the pool has none, the
    /// latest admitted request gives its pages back and waits again.
    fn grow(&mut self) -> Result<(), EngineError> {
        let page = self.cfg.page_size;
        let mut order: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| matches!(r.state, State::Running { .. }))
            .map(|(&id, _)| id)
            .collect();
        order.sort_by_key(|id| self.requests[id].admitted);
        for id in order {
            while let Some(r) = self.requests.get(&id) {
                let State::Running { lane } = r.state else {
                    break;
                };
                if r.pos / page < r.pages.len() {
                    break;
                }
                if let Some(p) = self.pool.alloc() {
                    let r = self.requests.get_mut(&id).expect("checked");
                    let first = r.pages.len();
                    r.pages.push(p);
                    let op = LaneOp::Pages {
                        lane,
                        first,
                        pages: &[p],
                    };
                    stoke::decoder_update::<B>(&mut self.dec, &[op])?;
                    continue;
                }
                let victim = self
                    .requests
                    .iter()
                    .filter(|(_, r)| !matches!(r.state, State::Waiting))
                    .max_by_key(|(_, r)| r.admitted)
                    .map(|(&v, _)| v)
                    .expect("the requester itself holds a lane");
                self.preempt(victim)?;
            }
        }
        Ok(())
    }

    /// Gives back `id`'s lane and pages and puts it first in line, to be recomputed from its
    /// prompt and output.
    fn preempt(&mut self, id: RequestId) -> Result<(), EngineError> {
        tracing::debug!("stoke engine: preempting request {id}");
        self.release(id)?;
        self.waiting.push_front(id);
        self.stats.preemptions += 1;
        Ok(())
    }

    /// Gives back `id`'s lane and pages (it is then waiting, or about to be removed).
    fn release(&mut self, id: RequestId) -> Result<(), EngineError> {
        let r = self.requests.get_mut(&id).expect("a known request");
        let lane = match r.state {
            State::Waiting => None,
            State::Prefilling { lane, .. } | State::Running { lane } => Some(lane),
        };
        r.state = State::Waiting;
        r.keys.clear();
        for p in std::mem::take(&mut r.pages) {
            self.pool.release(p);
        }
        if let Some(lane) = lane {
            self.lanes[lane] = None;
            self.epochs[lane] += 1;
            stoke::decoder_update::<B>(&mut self.dec, &[LaneOp::Clear { lane }])?;
        }
        Ok(())
    }

    /// Ends `id`: lane and pages back, a `Finished` event queued.
    fn finish(&mut self, id: RequestId, reason: FinishReason) -> Result<(), EngineError> {
        self.release(id)?;
        self.waiting.retain(|&w| w != id);
        let mut r = self.requests.remove(&id).expect("a known request");
        let text = r.text.finish();
        self.finished.push(Event::Finished {
            id,
            text,
            reason,
            prompt_tokens: r.prompt.len(),
            completion_tokens: r.output.len(),
        });
        Ok(())
    }

    /// Admits waiting requests in order while a lane is free and the pool holds the pages of
    /// their tokens and the first one they generate (beyond one growth page per request holding
    /// a lane): their shared prefix pages, then new ones.
    fn admit(&mut self) -> Result<(), EngineError> {
        let page = self.cfg.page_size;
        while let Some(&id) = self.waiting.front() {
            let Some(lane) = (0..self.lanes.len()).find(|&l| self.lanes[l].is_none()) else {
                break;
            };
            let tokens = self.requests[&id].tokens();
            // Shared pages: full prompt pages found in the cache, leaving at least one token to
            // compute (its logits sample the next token).
            let mut shared = Vec::new();
            let mut keys = Vec::new();
            if self.cfg.prefix_caching {
                let mut parent = 0;
                for chunk in tokens[..tokens.len() - 1].chunks_exact(page) {
                    match self.pool.share(parent, chunk) {
                        Some(p) => {
                            shared.push(p);
                            parent = pages::page_key(parent, chunk);
                            keys.push(parent);
                        }
                        None => break,
                    }
                }
            }
            let running = self.lanes.iter().flatten().count();
            let need = (tokens.len() + 1).div_ceil(page) - shared.len();
            let fresh = if self.pool.available() >= need + running {
                self.pool.alloc_n(need)
            } else {
                None
            };
            let Some(fresh) = fresh else {
                for p in shared {
                    self.pool.release(p);
                }
                break;
            };
            self.waiting.pop_front();
            let done = shared.len() * page;
            let mut pages = shared;
            pages.extend(fresh);
            let r = self.requests.get_mut(&id).expect("waiting requests exist");
            r.pages = pages.clone();
            r.keys = keys;
            r.state = State::Prefilling { lane, done };
            r.admitted = self.next_admit;
            self.next_admit += 1;
            let sampling = r.params.lane_sampling(r.seed);
            self.lanes[lane] = Some(id);
            self.epochs[lane] += 1;
            // The op borrows its slices: apply it now rather than keep it.
            let op = LaneOp::Set {
                lane,
                pages: &pages,
                tokens: &tokens,
                sampling,
            };
            stoke::decoder_update::<B>(&mut self.dec, &[op])?;
        }
        Ok(())
    }

    /// The next prefill chunk: pieces of the prefilling requests' tokens in admission order, up
    /// to the token budget. Returns the rows' ids, the layout, the pieces that end a prompt
    /// (indices into the layout), and those requests with their last token's position.
    #[allow(clippy::type_complexity)]
    fn plan_prefill(
        &mut self,
    ) -> (
        Vec<u32>,
        Vec<PackedSeq>,
        Vec<usize>,
        Vec<(RequestId, usize)>,
    ) {
        let mut order: Vec<(u64, RequestId)> = self
            .requests
            .iter()
            .filter(|(_, r)| matches!(r.state, State::Prefilling { .. }))
            .map(|(&id, r)| (r.admitted, id))
            .collect();
        order.sort();
        let mut budget = self.cfg.max_prefill_tokens;
        let (mut ids, mut seqs, mut sample, mut activate) = (vec![], vec![], vec![], vec![]);
        for (_, id) in order {
            if budget == 0 {
                break;
            }
            let r = self.requests.get_mut(&id).expect("listed");
            let State::Prefilling { lane, done } = r.state else {
                unreachable!()
            };
            let tokens = r.tokens();
            let rows = (tokens.len() - done).min(budget);
            ids.extend_from_slice(&tokens[done..done + rows]);
            seqs.push(PackedSeq {
                slot: lane,
                pos0: done,
                rows,
            });
            budget -= rows;
            r.state = State::Prefilling {
                lane,
                done: done + rows,
            };
            if done + rows == tokens.len() {
                sample.push(seqs.len() - 1);
                activate.push((id, tokens.len() - 1));
            }
        }
        (ids, seqs, sample, activate)
    }

    /// Registers the full prompt pages the chunk `seqs` completed, for later prompts to share.
    fn register_prefix(&mut self, seqs: &[PackedSeq]) {
        if !self.cfg.prefix_caching {
            return;
        }
        let page = self.cfg.page_size;
        for s in seqs {
            let Some(&id) = self.lanes[s.slot].as_ref() else {
                continue;
            };
            let r = self.requests.get_mut(&id).expect("held");
            let prompt_pages = r.prompt.len() / page;
            let full = ((s.pos0 + s.rows) / page).min(prompt_pages);
            while r.keys.len() < full {
                let i = r.keys.len();
                let parent = r.keys.last().copied().unwrap_or(0);
                let key =
                    self.pool
                        .register(r.pages[i], parent, &r.prompt[i * page..(i + 1) * page]);
                r.keys.push(key);
            }
        }
    }

    /// Credits one sampling's tokens to the requests that held its lanes when it was queued.
    fn credit(
        &mut self,
        issued: Issued,
        sampled: stoke::Sampled,
        events: &mut Vec<Event>,
    ) -> Result<(), EngineError> {
        for (i, &lane) in sampled.lanes.iter().enumerate() {
            let Some(&(id, epoch)) = issued.owners.get(&lane) else {
                continue;
            };
            if self.lanes[lane] != Some(id) || self.epochs[lane] != epoch {
                continue; // it ended or was preempted since: the token is dropped
            }
            let token = sampled.ids[i];
            let logprobs = sampled.logprobs.get(i).cloned().flatten();
            self.accept(id, token, logprobs, events)?;
        }
        Ok(())
    }

    fn accept(
        &mut self,
        id: RequestId,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        events: &mut Vec<Event>,
    ) -> Result<(), EngineError> {
        let r = self.requests.get_mut(&id).expect("credited requests exist");
        let stop_token = (!r.params.ignore_eos && self.cfg.eos.contains(&token))
            || r.params.stop_token_ids.contains(&token);
        if stop_token {
            return self.finish(id, FinishReason::StopToken(token));
        }
        r.output.push(token);
        self.stats.generated_tokens += 1;
        let text = match &self.detok {
            Some(d) => r.text.push(d.as_ref(), &r.output, &r.params.stop),
            None => String::new(),
        };
        events.push(Event::Token {
            id,
            token,
            text,
            logprobs,
        });
        let reason = if let Some(s) = r.text.stopped.clone() {
            Some(FinishReason::StopString(s))
        } else if r.output.len() >= r.params.max_tokens {
            Some(FinishReason::MaxTokens)
        } else if r.prompt.len() + r.output.len() >= self.cfg.context {
            Some(FinishReason::ContextFull)
        } else {
            None
        };
        if let Some(reason) = reason {
            self.finish(id, reason)?;
            events.append(&mut self.finished);
        }
        Ok(())
    }
}

/// Device bytes of one KV page of every layer (BF16 rows, and the mirror's codes and scales).
pub fn kv_page_bytes(spec: &stoke::DecodeSpec, dtype: DType) -> usize {
    let rows = spec.layers * spec.kv_heads * spec.page_size;
    let elem = dtype.size();
    let mirror = match spec.kv_format {
        KvCacheFormat::Bf16 => 0,
        KvCacheFormat::Fp8 => spec.head_dim + 4,
        KvCacheFormat::Int4 => spec.head_dim / 2 + 4,
    };
    2 * rows * (spec.head_dim * elem + mirror)
}
