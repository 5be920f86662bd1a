//! `Stoke<I>`'s decoder: the decode step in Stoke's own memory, on Stoke's stream, replayed as a
//! CUDA graph.
//!
//! The decoder owns the paged KV cache of every layer ([`DeviceKvCache`]: a pool of BF16 pages,
//! and an FP8 or INT4 mirror that attention reads, found through one [`PageTable`] of a row per
//! lane), each lane's token id, position, attention length, sampling settings and repetition
//! penalty's token set, and the RoPE table, all in device buffers. Lane changes
//! ([`LaneOp`]) are stream-ordered copies into those buffers, queued between steps. A step is
//! the model's own decode forward (Burn code over the fused ops); its ops read the buffers on the
//! device, so the same work replays with new positions and new lanes:
//!
//! - the first step of each row bucket runs eagerly (kernels load, the W4A16 plans for its row
//!   count are tuned);
//! - the next one is captured ([`Runtime::capture_into`], strict: a crossing to burn-cuda fails
//!   the capture with the op named) into a graph per (row bucket, attention-length bucket,
//!   log-probabilities on or off) (the split-KV grid is planned for the bucket's longest
//!   context: 256, 512, ... up to the capacity), every buffer it allocates taken from the
//!   decoder's [`GraphArena`];
//! - every later step replays the graph of its buckets;
//! - after each sampling the ids (and log-probabilities) are copied to page-locked memory with
//!   an event; the host takes them later ([`decode_take`](crate::decode::decode_take)), so it
//!   never waits for the step it just queued.
//!
//! A step runs lanes `0 ..` its last active lane, padded to the next bucket of 1, 2, 4, 8, 16,
//! 32 or 64 rows; a row whose lane is not active reads and writes the spare page through the
//! table's spare row and is not sampled. Where the step cannot run on Stoke's kernels (no
//! runtime, not bf16, a head size or GQA ratio without a kernel, more than 64 lanes) the
//! decoder is the reference one, with the reason logged.

use super::bridge::{DeviceTensor, KernelInput, runtime_for};
use crate::decode::{
    DecodeError, DecodeSpec, KvCacheFormat, LaneOp, LaneSampling, Lanes, PackedSeq, RefDecoder,
    SPARE_PAGE, Sampled, TokenLogprobs,
};
use crate::stoke::Stoke;
use crate::tensor::StokeTensor;
use burn_backend::{Backend, DType, Shape, TensorMetadata};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use stoke_cuda::kernels::decode_attention::KvFormat;
use stoke_cuda::kernels::int4_gemm::QkvRopeParams;
use stoke_cuda::kernels::prefill_attention::PrefillSeq;
use stoke_cuda::kv::{DeviceKvCache, PageTable};
use stoke_cuda::sample::{MAX_TOP_LOGPROBS, ROW_ACTIVE, ROW_LOGPROB, RowSample};
use stoke_cuda::{CudaEvent, CudaGraph};
use stoke_cuda::{DeviceBuffer, DevicePtr, DevicePtrMut, GraphArena, PinnedHost, Runtime};

/// Most lanes the GPU decoder runs (the W4A16 kernels' rows).
pub const MAX_LANES: usize = 64;

/// Longest context a step's attention is planned for, given the longest sequence it attends to.
fn context_bucket(needed: usize, capacity: usize) -> usize {
    needed.next_power_of_two().max(256).min(capacity)
}

/// f32 values per row of the log-probability kernel's output: (id, logprob) of the chosen token
/// and of the top ones.
const LOGPROB_ROW: usize = 2 * (1 + MAX_TOP_LOGPROBS as usize);

/// Counts of what the decoder's steps did (for tests and benchmarks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    pub steps: u64,
    /// Steps run eagerly (the warm-up of each row bucket, `eager` decoders).
    pub eager_steps: u64,
    pub captures: u64,
    pub replays: u64,
    /// Host synchronizations with Stoke's stream inside captured and replayed steps (0 is the
    /// contract).
    pub host_syncs_in_steps: u64,
    /// Crossings between burn-cuda and Stoke inside captured and replayed steps (0 is the
    /// contract; a strict capture fails on one).
    pub crossings_in_steps: u64,
    /// Host synchronizations inside eager steps (the warm-up tunes the W4A16 plans, timing
    /// them).
    pub host_syncs_in_eager_steps: u64,
    /// Host synchronizations by lane changes and samplings outside steps (0 is the contract:
    /// they are stream-ordered copies).
    pub host_syncs_outside_steps: u64,
}

/// A captured step. The graph is only launched through the runtime that made it, which binds its
/// context to the calling thread first.
struct StepGraph(CudaGraph);
// SAFETY: CUDA graph handles may be used from any thread with the owning context current
// (`Runtime::replay` makes it current); the decoder owning it is used by one thread at a time.
unsafe impl Send for StepGraph {}

/// A sampling whose results are on their way to page-locked memory.
struct Pending {
    host: PinnedHost,
    event: CudaEvent,
    lanes: Vec<usize>,
    /// Each lane's row of log-probabilities in the copy (`None`: it asked for none).
    rows: Vec<Option<(usize, u32)>>,
    /// Lanes whose ids were copied (ids of lanes `0 .. ids`, then the log-probability rows).
    ids: usize,
}

/// The decoder on Stoke's kernels.
pub struct GpuDecoder {
    rt: Arc<Runtime>,
    spec: DecodeSpec,
    lanes: Lanes,
    caches: Vec<DeviceKvCache>,
    table: Arc<PageTable>,
    /// Each lane's table row in a step: its own, or the spare row while it is not active.
    slot_of: DeviceBuffer,
    pos: DeviceBuffer,
    len: DeviceBuffer,
    ids: DeviceBuffer,
    presence: DeviceBuffer,
    cfg: DeviceBuffer,
    logprobs: DeviceBuffer,
    rope: DeviceBuffer,
    /// Each layer's targets of the W4A16 q|k|v epilogue (`QkvRopeParams`, heads of 64), one
    /// after another; `None` for other head dims.
    qkv_rope: Option<DeviceBuffer>,
    /// The step being built: its rows, active lanes, whether it writes log-probabilities, and
    /// the keys its attention is planned for.
    in_step: bool,
    rows: usize,
    step_lanes: Vec<usize>,
    step_logprobs: bool,
    ctx_bucket: usize,
    warmed: HashSet<usize>,
    graphs: HashMap<(usize, usize, bool), StepGraph>,
    arena: Arc<GraphArena>,
    pending: VecDeque<Pending>,
    spare: Vec<(PinnedHost, CudaEvent)>,
    /// The latest sampling's logits as they came (`keep_logits`), and the rows of its sampled
    /// lanes (a step's active lanes; every row of a prefill sampling).
    logits: Option<(DeviceBuffer, Vec<usize>)>,
    logits_bf16: bool,
    /// The latest packed prefill's layout on the device.
    packed: Option<PackedLayout>,
    pub stats: DecodeStats,
}

impl std::fmt::Debug for GpuDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GpuDecoder({} lanes, {} layers, {} pages of {}, capacity {}, {:?}, {} graphs, {:?})",
            self.spec.lanes,
            self.caches.len(),
            self.spec.pages,
            self.spec.page_size,
            self.spec.capacity,
            self.spec.kv_format,
            self.graphs.len(),
            self.arena
        )
    }
}

/// `Stoke<I>`'s decoder: on Stoke's kernels, or the reference one where they don't apply.
#[derive(Debug)]
pub enum StokeDecoder<I: Backend> {
    Gpu(Box<GpuDecoder>),
    Reference(Box<RefDecoder<Stoke<I>>>),
}

impl<I: Backend> StokeDecoder<I> {
    /// The GPU decoder's counters (`None`: the reference decoder runs).
    pub fn stats(&self) -> Option<DecodeStats> {
        match self {
            Self::Gpu(g) => Some(g.stats),
            Self::Reference(_) => None,
        }
    }

    /// Runs the following steps eagerly (`true`) or from their graphs again (`false`); the
    /// graphs already captured are kept.
    pub fn set_eager(&mut self, eager: bool) {
        match self {
            Self::Gpu(g) => g.spec.eager = eager,
            Self::Reference(r) => r.spec.eager = eager,
        }
    }

    /// Bytes of the graph arena (the step graphs' own buffers).
    pub fn graph_bytes(&self) -> usize {
        match self {
            Self::Gpu(g) => g.arena.bytes(),
            Self::Reference(_) => 0,
        }
    }
}

fn fatal(what: &str, e: impl std::fmt::Display) -> ! {
    panic!("stoke decoder: {what}: {e}")
}

fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn upload(rt: &Arc<Runtime>, bytes: &[u8]) -> stoke_cuda::Result<DeviceBuffer> {
    let b = rt.alloc_unpooled(bytes.len().max(4))?;
    // SAFETY: the buffer holds at least `bytes.len()` bytes.
    unsafe { rt.copy_htod(b.ptr(), bytes) }?;
    Ok(b)
}

/// A pooled buffer holding `bytes`, copied in stream order (no host synchronization).
fn upload_async(rt: &Arc<Runtime>, bytes: &[u8]) -> stoke_cuda::Result<DeviceBuffer> {
    let b = rt.alloc(bytes.len().max(4))?;
    // SAFETY: the buffer holds at least `bytes.len()` bytes and is only used on Stoke's stream.
    unsafe { rt.copy_htod_async(b.ptr(), bytes) }?;
    Ok(b)
}

/// A lane's settings as the sampling kernels read them.
fn row_sample(s: &LaneSampling, active: bool) -> RowSample {
    let mut flags = if active { ROW_ACTIVE } else { 0 };
    if let Some(top) = s.logprobs {
        flags |= ROW_LOGPROB | top.min(MAX_TOP_LOGPROBS) << 8;
    }
    let p = &s.params;
    RowSample {
        seed: p.seed,
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: p.top_p,
        repetition_penalty: p.repetition_penalty,
        stream: s.stream,
        flags,
    }
}

impl GpuDecoder {
    /// The GPU decoder, or why the reference one runs instead (`Ok(Err(reason))`).
    fn new(
        rt: Arc<Runtime>,
        spec: DecodeSpec,
        dtype: DType,
    ) -> Result<Result<Self, String>, DecodeError> {
        if dtype != DType::BF16 {
            return Ok(Err(format!(
                "the model runs in {dtype:?}; the kernels take bf16"
            )));
        }
        if spec.lanes > MAX_LANES {
            return Ok(Err(format!(
                "{} lanes; the step's kernels take at most {MAX_LANES}",
                spec.lanes
            )));
        }
        let format = match spec.kv_format {
            KvCacheFormat::Bf16 => KvFormat::Bf16,
            KvCacheFormat::Fp8 => KvFormat::Fp8,
            KvCacheFormat::Int4 => KvFormat::Int4,
        };
        if let Err(e) = stoke_cuda::kernels::decode_attention::check_shape(
            spec.heads as u32,
            spec.kv_heads as u32,
            spec.head_dim as u32,
            spec.rotate_block as u32,
        ) {
            return Ok(Err(e.to_string()));
        }
        // Every module a model's prefill and decode steps launch, loaded now: built in, or
        // compiled in parallel (a fresh machine's first token then waits for the slowest one,
        // not for their sum).
        let sources: Vec<&'static stoke_cuda::kernels::KernelSource> =
            stoke_cuda::kernels::ALL.iter().collect();
        let loaded = rt.preload(&sources)?;
        if !loaded.wall.is_zero() {
            tracing::info!(
                target: "stoke",
                "kernels loaded in {:.3} s: {} built in, {} from the disk cache, {} compiled \
                 (the slowest module {:.2} s)",
                loaded.wall.as_secs_f64(),
                loaded.built,
                loaded.disk_cache,
                loaded.compiled,
                loaded.slowest.as_secs_f64()
            );
        }
        let lanes = spec.lanes;
        // One table row per lane and the spare row, every entry the spare page at first.
        let table = Arc::new(PageTable::new(
            &rt,
            lanes as u32 + 1,
            spec.max_pages() as u32,
            spec.page_size as u32,
            spec.pages as u32,
            SPARE_PAGE,
        )?);
        let caches = (0..spec.layers)
            .map(|_| {
                DeviceKvCache::new(
                    &rt,
                    format,
                    (spec.kv_heads as u32, spec.head_dim as u32),
                    spec.rotate_block as u32,
                    table.clone(),
                )
            })
            .collect::<stoke_cuda::Result<Vec<_>>>()?;
        let spare_rows = vec![lanes as u32; lanes];
        let zeros = vec![0u32; lanes];
        let words = crate::decode::words(spec.vocab);
        let rope: Vec<u8> = spec.rope[..spec.rope_positions() * spec.head_dim]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let (slot_of, pos, len) = (
            upload(&rt, &u32_bytes(&spare_rows))?,
            upload(&rt, &u32_bytes(&zeros))?,
            upload(&rt, &u32_bytes(&zeros))?,
        );
        let rope = upload(&rt, &rope)?;
        // The q|k|v epilogue's targets per layer (heads of 64 only): the decoder's own buffers,
        // so they hold for its life (q comes with each call).
        let targets = caches
            .iter()
            .map(|cache| {
                cache
                    .qkv_epilogue(
                        spec.heads as u32,
                        (rope.as_ptr(), spec.rope_positions() as u32),
                        slot_of.as_ptr(),
                        pos.as_ptr(),
                        len.as_mut_ptr(),
                        DevicePtrMut::NULL,
                    )
                    .map(|e| QkvRopeParams::from_epilogue(&e))
            })
            .collect::<stoke_cuda::Result<Option<Vec<_>>>>()?;
        let qkv_rope = match targets {
            Some(t) if !t.is_empty() => Some(upload(&rt, QkvRopeParams::bytes(&t))?),
            _ => None,
        };
        Ok(Ok(Self {
            slot_of,
            pos,
            len,
            ids: upload(&rt, &u32_bytes(&zeros))?,
            presence: upload(&rt, &vec![0u8; lanes * words * 4])?,
            cfg: upload(&rt, &vec![0u8; lanes * 32])?,
            logprobs: rt.alloc_unpooled(lanes * LOGPROB_ROW * 4)?,
            rope,
            qkv_rope,
            lanes: Lanes::new(&spec),
            in_step: false,
            rows: 0,
            step_lanes: Vec::new(),
            step_logprobs: false,
            ctx_bucket: spec.capacity,
            warmed: HashSet::new(),
            graphs: HashMap::new(),
            arena: GraphArena::new(&rt),
            pending: VecDeque::new(),
            spare: Vec::new(),
            logits: if spec.keep_logits {
                Some((rt.alloc_unpooled(lanes * spec.vocab * 4)?, Vec::new()))
            } else {
                None
            },
            logits_bf16: false,
            packed: None,
            stats: DecodeStats::default(),
            caches,
            table,
            spec,
            rt,
        }))
    }

    /// What the decoder was made for.
    pub fn spec(&self) -> &DecodeSpec {
        &self.spec
    }

    /// `bytes` into `buf` from byte `at`, stream-ordered.
    fn put(&self, buf: &DeviceBuffer, at: usize, bytes: &[u8]) -> stoke_cuda::Result<()> {
        debug_assert!(at + bytes.len() <= buf.bytes());
        // SAFETY: the range lies inside the decoder's buffer, which outlives every copy (they
        // are queued on Stoke's stream, which the buffer's drop waits for).
        unsafe { self.rt.copy_htod_async(buf.ptr() + at as u64, bytes) }
    }

    /// The lane's settings, position and table row as the host knows them, onto the device.
    fn put_lane(&self, lane: usize) -> stoke_cuda::Result<()> {
        let l = &self.lanes.lanes[lane];
        let mut row = l.pages.clone();
        row.resize(self.spec.max_pages(), SPARE_PAGE);
        self.table.write(&self.rt, lane as u32, 0, &row)?;
        let slot = if l.active { lane } else { self.spec.lanes } as u32;
        let pos = if l.active { l.pos } else { 0 } as u32;
        self.put(&self.slot_of, lane * 4, &slot.to_le_bytes())?;
        self.put(&self.pos, lane * 4, &pos.to_le_bytes())?;
        self.put(
            &self.cfg,
            lane * 32,
            &row_sample(&l.sampling, l.active).to_le_bytes(),
        )
    }

    fn update(&mut self, ops: &[LaneOp]) -> Result<(), DecodeError> {
        let words = crate::decode::words(self.spec.vocab);
        for op in ops {
            self.lanes.apply(op)?;
            match *op {
                LaneOp::Set { lane, tokens, .. } => {
                    let p = crate::decode::presence_words(tokens, self.spec.vocab);
                    self.put(&self.presence, lane * words * 4, &u32_bytes(&p))?;
                    self.put_lane(lane)?;
                }
                LaneOp::Pages { lane, first, pages } => {
                    self.table
                        .write(&self.rt, lane as u32, first as u32, pages)?;
                }
                LaneOp::Activate { lane, .. } | LaneOp::Clear { lane } => self.put_lane(lane)?,
                LaneOp::Move { from, to } => {
                    // SAFETY: both ranges lie inside the decoder's buffers.
                    unsafe {
                        self.rt.copy_dtod(
                            self.ids.ptr() + to as u64 * 4,
                            self.ids.ptr() + from as u64 * 4,
                            4,
                        )?;
                        let w = words as u64 * 4;
                        self.rt.copy_dtod(
                            self.presence.ptr() + to as u64 * w,
                            self.presence.ptr() + from as u64 * w,
                            w as usize,
                        )?;
                    }
                    self.put_lane(to)?;
                    self.put_lane(from)?;
                }
            }
        }
        Ok(())
    }

    /// Queues the copy of the latest sampling's ids (lanes `0 .. ids`) and of the
    /// log-probability rows of `rows` to page-locked memory, and its event.
    fn queue_results(
        &mut self,
        lanes: Vec<usize>,
        ids: usize,
        rows: Vec<Option<(usize, u32)>>,
    ) -> stoke_cuda::Result<()> {
        let lp_rows = rows.iter().flatten().map(|r| r.0 + 1).max().unwrap_or(0);
        let bytes = ids * 4 + lp_rows * LOGPROB_ROW * 4;
        let (host, event) = match self
            .spare
            .iter()
            .position(|(h, _)| h.bytes().len() >= bytes)
        {
            Some(i) => self.spare.swap_remove(i),
            None => (
                self.rt.pinned_host(bytes.next_power_of_two().max(256))?,
                self.rt.timing_event()?,
            ),
        };
        // SAFETY: `host` is page-locked and holds `bytes`; both device ranges are the decoder's;
        // the host reads only after the event, recorded after both copies.
        unsafe {
            if lp_rows > 0 {
                let lp = lp_rows * LOGPROB_ROW * 4;
                let at = host.as_mut_ptr().add(ids * 4);
                // The event is recorded again after the ids' copy below.
                self.rt
                    .copy_dtoh_async(at, self.logprobs.ptr(), lp, &event)?;
            }
            self.rt
                .copy_dtoh_async(host.as_mut_ptr(), self.ids.ptr(), ids * 4, &event)?;
        }
        self.pending.push_back(Pending {
            host,
            event,
            lanes,
            rows,
            ids,
        });
        Ok(())
    }

    fn take(&mut self) -> Option<Sampled> {
        let p = self.pending.pop_front()?;
        if let Err(e) = p.event.synchronize() {
            fatal("waiting for a sampling's ids", e);
        }
        let b = p.host.bytes();
        let word =
            |i: usize| u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]);
        let ids = p.lanes.iter().map(|&l| word(l)).collect();
        let logprobs = p
            .rows
            .iter()
            .map(|r| {
                r.map(|(row, top)| {
                    let at = p.ids + row * LOGPROB_ROW;
                    let f = |i: usize| f32::from_bits(word(at + i));
                    TokenLogprobs {
                        logprob: f(1),
                        top: (0..top as usize)
                            .map(|j| (word(at + 2 + 2 * j), f(3 + 2 * j)))
                            .collect(),
                    }
                })
            })
            .collect();
        self.spare.push((p.host, p.event));
        Some(Sampled {
            lanes: p.lanes,
            ids,
            logprobs,
        })
    }
}

fn gpu<I: Backend>(dec: &mut StokeDecoder<I>) -> &mut GpuDecoder {
    match dec {
        StokeDecoder::Gpu(g) => g,
        StokeDecoder::Reference(_) => unreachable!("checked by the caller"),
    }
}

pub(crate) fn decoder_new<I: Backend>(
    spec: DecodeSpec,
    dtype: DType,
    device: &I::Device,
) -> Result<StokeDecoder<I>, DecodeError> {
    spec.validate()?;
    let reason = match runtime_for::<I>(device) {
        None => "Stoke's kernels do not run on this device".to_string(),
        Some(rt) => match GpuDecoder::new(rt, spec.clone(), dtype)? {
            Ok(g) => return Ok(StokeDecoder::Gpu(Box::new(g))),
            Err(reason) => reason,
        },
    };
    tracing::info!("stoke decoder: reference decode step ({reason})");
    Ok(StokeDecoder::Reference(Box::new(RefDecoder::new(
        spec, dtype, device,
    )?)))
}

pub(crate) fn decoder_update<I: Backend>(
    dec: &mut StokeDecoder<I>,
    ops: &[LaneOp],
) -> Result<(), DecodeError> {
    match dec {
        StokeDecoder::Gpu(g) => {
            let (syncs0, _) = g.rt.counters();
            let r = g.update(ops);
            g.stats.host_syncs_outside_steps += g.rt.counters().0 - syncs0;
            r
        }
        StokeDecoder::Reference(r) => r.update(ops),
    }
}

/// The device tables of a packed prefill's layout: per row its slot, position and a scratch
/// length (the append kernel's), and the kernel's sequence descriptors. Every layer of a prefill
/// chunk uses the same layout, so it is uploaded once per chunk.
struct PackedLayout {
    seqs: Vec<PackedSeq>,
    kernel_seqs: Vec<PrefillSeq>,
    seqs_dev: DeviceBuffer,
    slot_of: DeviceBuffer,
    pos: DeviceBuffer,
    len: DeviceBuffer,
}

impl PackedLayout {
    fn new(rt: &Arc<Runtime>, seqs: &[PackedSeq]) -> stoke_cuda::Result<Self> {
        let (mut slot_of, mut pos, mut kernel_seqs) = (Vec::new(), Vec::new(), Vec::new());
        for s in seqs {
            kernel_seqs.push(PrefillSeq {
                first: slot_of.len() as u32,
                rows: s.rows as u32,
                slot: s.slot as u32,
                pos0: s.pos0 as u32,
            });
            slot_of.extend(std::iter::repeat_n(s.slot as u32, s.rows));
            pos.extend((s.pos0..s.pos0 + s.rows).map(|p| p as u32));
        }
        Ok(Self {
            seqs_dev: upload_async(rt, &PrefillSeq::bytes(&kernel_seqs))?,
            len: upload_async(rt, &u32_bytes(&pos))?,
            slot_of: upload_async(rt, &u32_bytes(&slot_of))?,
            pos: upload_async(rt, &u32_bytes(&pos))?,
            seqs: seqs.to_vec(),
            kernel_seqs,
        })
    }
}

impl GpuDecoder {
    /// Checks the packed layout `seqs` of `rows` rows against the decoder and uploads its
    /// tables where they differ from the latest prefill's (`self.packed`).
    fn use_packed(&mut self, seqs: &[PackedSeq], rows: usize) -> Result<(), DecodeError> {
        self.lanes.check_packed(seqs, rows)?;
        if self.packed.as_ref().is_none_or(|l| l.seqs != seqs) {
            self.packed = Some(PackedLayout::new(&self.rt, seqs)?);
        }
        Ok(())
    }

    /// Causal attention of the packed q rows (`rows x heads x d` bf16 at `q`) over layer
    /// `layer`'s BF16 cache in the latest layout ([`Self::use_packed`]), into a new bf16 tensor
    /// of dims `lead` + `heads x d`.
    ///
    /// # Safety
    /// `q` must hold `rows` rows until the kernel is done, `rows` those of the layout.
    unsafe fn attend_packed<I: Backend>(
        &self,
        layer: usize,
        q: DevicePtr<half::bf16>,
        rows: usize,
        lead: &[usize],
        device: I::Device,
    ) -> Result<StokeTensor<I>, DecodeError> {
        let (h, d) = (self.spec.heads, self.spec.head_dim);
        let l = self.packed.as_ref().expect("use_packed first");
        let mut out_dims = lead.to_vec();
        out_dims.push(h * d);
        let out = DeviceTensor::<I>::alloc(&self.rt, Shape::from(out_dims), DType::BF16, device);
        // SAFETY: out holds `rows x h x d` bf16; the layout's descriptors were checked against
        // the decoder's slots and capacity; q is the caller's.
        unsafe {
            self.caches[layer].prefill_attend(
                &self.rt,
                q,
                h as u32,
                &l.kernel_seqs,
                l.seqs_dev.as_ptr(),
                rows as u32,
                DevicePtrMut::new(out.ptr()),
            )?;
        }
        Ok(StokeTensor::owned(out))
    }
}

/// Packed prefill attention on the kernels: RoPE and the append of every row's k and v to its
/// slot (main cache and mirror) in one launch, then causal attention over the BF16 cache.
pub(crate) fn prefill_attention<I: Backend>(
    dec: &mut StokeDecoder<I>,
    layer: usize,
    qkv: StokeTensor<I>,
    seqs: &[PackedSeq],
) -> Result<StokeTensor<I>, DecodeError> {
    let g = match dec {
        StokeDecoder::Gpu(g) => g,
        StokeDecoder::Reference(r) => {
            return crate::decode::ref_ops::prefill_attention(r, layer, qkv, seqs);
        }
    };
    let (h, kvh, d) = (g.spec.heads, g.spec.kv_heads, g.spec.head_dim);
    let width = (h + 2 * kvh) * d;
    let dims = qkv.shape();
    let lead = &dims.as_slice()[..dims.num_dims() - 1];
    if dims.as_slice().last() != Some(&width) || qkv.dtype() != DType::BF16 {
        return Err(DecodeError::Shape {
            what: "packed prefill q|k|v",
            expected: format!("bf16 rows of {width}"),
            got: format!("{:?} {:?}", dims, qkv.dtype()),
        });
    }
    let rows = dims.num_elements() / width;
    g.use_packed(seqs, rows)?;
    let rt = g.rt.clone();
    let l = g.packed.as_ref().expect("set above");
    let device = super::float_device(&qkv);
    let x = KernelInput::resolve(&rt, &qkv, &device);
    let q = rt.alloc(rows * h * d * 2)?;
    // SAFETY: x holds `rows` rows of q|k|v bf16, q `rows x h x d` bf16; the layout's tables
    // hold `rows` entries, checked against the decoder's slots and capacity (the RoPE table
    // covers the capacity).
    let out = unsafe {
        g.caches[layer].rope_append(
            &rt,
            DevicePtr::new(x.ptr),
            h as u32,
            (g.rope.as_ptr(), g.spec.rope_positions() as u32),
            l.slot_of.as_ptr(),
            l.pos.as_ptr(),
            l.len.as_mut_ptr(),
            rows as u32,
            q.as_mut_ptr(),
        )?;
        g.attend_packed(layer, q.as_ptr(), rows, lead, device)?
    };
    drop((x, q));
    Ok(out)
}

/// The q|k|v projection of `x` by `weight` and packed prefill attention, with the projection's
/// GEMM writing q and the cache itself (its q|k|v epilogue: RoPE, the BF16 cache rows and the
/// mirror's, the lengths), then causal attention over the BF16 cache: the bits of
/// [`prefill_attention`] on the plain projection, without its dense q|k|v tensor or the append
/// launch. `None` where that GEMM does not take `x` and `weight` (rows a decode-sized kernel
/// takes, a weight with no prefill copy, the reference decoder): the caller projects and calls
/// [`prefill_attention`].
pub(crate) fn try_prefill_qkv_attention<I: Backend>(
    dec: &mut StokeDecoder<I>,
    layer: usize,
    x: &StokeTensor<I>,
    weight: &StokeTensor<I>,
    seqs: &[PackedSeq],
) -> Option<Result<StokeTensor<I>, DecodeError>> {
    let StokeDecoder::Gpu(g) = dec else {
        return None;
    };
    let dims = x.shape();
    let (lead, hidden) = dims
        .as_slice()
        .split_last()
        .map(|(last, lead)| (lead, *last))?;
    if hidden != g.spec.hidden {
        return None;
    }
    let rows = dims.num_elements() / hidden;
    if let Err(e) = g.use_packed(seqs, rows) {
        return Some(Err(e));
    }
    let l = g.packed.as_ref().expect("set above");
    let target = match g.caches[layer].qkv_epilogue(
        g.spec.heads as u32,
        (g.rope.as_ptr(), g.spec.rope_positions() as u32),
        l.slot_of.as_ptr(),
        l.pos.as_ptr(),
        l.len.as_mut_ptr(),
        DevicePtrMut::NULL,
    ) {
        Ok(t) => t,
        Err(e) => return Some(Err(e.into())),
    };
    // SAFETY: the layout's tables hold `rows` entries, checked against the decoder's slots and
    // capacity (the RoPE table covers the capacity); the cache is the decoder's.
    let q = match unsafe { super::prefill_linear::try_prefill_qkv(x, weight, target) }? {
        Ok(q) => q,
        Err(e) => return Some(Err(e.into())),
    };
    let device = super::float_device(&q);
    let q_in = KernelInput::resolve(&g.rt, &q, &device);
    // SAFETY: q holds `rows x heads x d` bf16 until the kernel is done.
    let out = unsafe { g.attend_packed(layer, DevicePtr::new(q_in.ptr), rows, lead, device) };
    drop((q_in, q));
    Some(out)
}

pub(crate) fn decode_embed<I: Backend>(
    dec: &StokeDecoder<I>,
    table: StokeTensor<I>,
    gamma: StokeTensor<I>,
    eps: f64,
) -> (StokeTensor<I>, StokeTensor<I>) {
    let g = match dec {
        StokeDecoder::Gpu(g) => g,
        StokeDecoder::Reference(r) => return crate::decode::ref_ops::embed(r, table, gamma, eps),
    };
    let hidden = g.spec.hidden;
    let tdims = table.shape();
    if tdims.as_slice() != [g.spec.vocab, hidden]
        || table.dtype() != DType::BF16
        || gamma.dtype() != DType::BF16
    {
        fatal(
            "embedding table",
            format!(
                "{:?} {:?} (expected [{}, {hidden}] bf16)",
                tdims,
                table.dtype(),
                g.spec.vocab
            ),
        );
    }
    let device = super::float_device(&table);
    let rt = &g.rt;
    let (t, gm) = (
        KernelInput::resolve(rt, &table, &device),
        KernelInput::resolve(rt, &gamma, &device),
    );
    let shape = Shape::new([g.rows, 1, hidden]);
    let x = DeviceTensor::<I>::alloc(rt, shape.clone(), DType::BF16, device.clone());
    let n = DeviceTensor::<I>::alloc(rt, shape, DType::BF16, device);
    let p = stoke_cuda::kernels::embed::EmbedParams {
        ids: g.ids.as_ptr(),
        table: DevicePtr::new(t.ptr),
        gamma: DevicePtr::new(gm.ptr),
        x_out: DevicePtrMut::new(x.ptr()),
        normed_out: DevicePtrMut::new(n.ptr()),
        rows: g.rows as u32,
        hidden: hidden as u32,
        vocab: g.spec.vocab as u32,
        eps: eps as f32,
    };
    // SAFETY: the table and gamma are pinned weights, x and n Stoke buffers of rows x hidden.
    if let Err(e) = unsafe { stoke_cuda::kernels::embed::embed_rms_norm(rt, &p) } {
        fatal("embedding", e);
    }
    drop((t, gm));
    (StokeTensor::owned(x), StokeTensor::owned(n))
}

pub(crate) fn decode_attention<I: Backend>(
    dec: &mut StokeDecoder<I>,
    layer: usize,
    qkv: StokeTensor<I>,
) -> StokeTensor<I> {
    let g = match dec {
        StokeDecoder::Gpu(g) => g,
        StokeDecoder::Reference(r) => return crate::decode::ref_ops::attention(r, layer, qkv),
    };
    let (h, kvh, d) = (g.spec.heads, g.spec.kv_heads, g.spec.head_dim);
    let width = (h + 2 * kvh) * d;
    if qkv.shape().num_elements() != g.rows * width || qkv.dtype() != DType::BF16 {
        fatal(
            "q|k|v input",
            format!(
                "{:?} {:?} (expected {} rows of {width} bf16)",
                qkv.shape(),
                qkv.dtype(),
                g.rows
            ),
        );
    }
    let device = super::float_device(&qkv);
    let rt = g.rt.clone();
    let x = KernelInput::resolve(&rt, &qkv, &device);
    let q = rt
        .alloc(g.rows * h * d * 2)
        .unwrap_or_else(|e| fatal("allocating q", e));
    let cache = &g.caches[layer];
    let rows = g.rows as u32;
    // SAFETY: x holds rows x width bf16; q is a Stoke buffer of rows x h x d; the decoder's
    // buffers hold a lane per row; every row's table row (its lane's, or the spare row) covers
    // its position (checked per step); the RoPE table covers the capacity.
    let r = unsafe {
        cache.rope_append(
            &rt,
            DevicePtr::new(x.ptr),
            h as u32,
            (g.rope.as_ptr(), g.spec.rope_positions() as u32),
            g.slot_of.as_ptr(),
            g.pos.as_ptr(),
            g.len.as_mut_ptr(),
            rows,
            q.as_mut_ptr(),
        )
    };
    if let Err(e) = r {
        fatal("decode attention (RoPE and append)", e);
    }
    drop(x);
    // SAFETY: q holds rows x h x d bf16 and is kept until the kernel is done.
    unsafe { attend_q(g, layer, q.as_ptr(), device) }
}

/// Decode attention of layer `layer` for the step's rows over q (`rows x heads x d` bf16,
/// RoPE applied, the rows' keys and values appended and their lengths written): a new
/// `[rows, 1, heads x d]` bf16 tensor.
///
/// # Safety
/// `q` must hold the step's rows until the kernel is done (a Stoke buffer freed on its stream).
unsafe fn attend_q<I: Backend>(
    g: &GpuDecoder,
    layer: usize,
    q: DevicePtr<half::bf16>,
    device: I::Device,
) -> StokeTensor<I> {
    let (h, d) = (g.spec.heads, g.spec.head_dim);
    let rt = &g.rt;
    let out = DeviceTensor::<I>::alloc(rt, Shape::new([g.rows, 1, h * d]), DType::BF16, device);
    // SAFETY: out is a Stoke buffer of rows x h x d; the decoder's buffers hold a lane per
    // row; every row's table row covers its position and the context bucket is at most the
    // capacity; q is the caller's.
    let r = unsafe {
        g.caches[layer].attend(
            rt,
            q,
            h as u32,
            g.slot_of.as_ptr(),
            g.len.as_ptr(),
            g.rows as u32,
            g.ctx_bucket as u32,
            DevicePtrMut::new(out.ptr()),
        )
    };
    if let Err(e) = r {
        fatal("decode attention", e);
    }
    StokeTensor::owned(out)
}

/// The q|k|v projection of `x` by `weight` and decode attention, with the projection's W4A16
/// GEMM doing RoPE, the cache append and the lengths in its epilogue (heads of 64; the bits of
/// the plain projection then [`decode_attention`]'s `rope_append`); that composition where the
/// epilogue does not apply (another head dim, a weight the W4A16 kernels do not take, the
/// reference decoder).
pub(crate) fn decode_qkv_attention<I: Backend>(
    dec: &mut StokeDecoder<I>,
    layer: usize,
    x: StokeTensor<I>,
    weight: StokeTensor<I>,
) -> StokeTensor<I> {
    if let StokeDecoder::Gpu(g) = &*dec
        && let Some(targets) = &g.qkv_rope
    {
        let (h, kvh, d) = (g.spec.heads, g.spec.kv_heads, g.spec.head_dim);
        // The targets' per-row arrays hold the step's rows.
        if layer < g.spec.layers
            && x.shape().num_elements() == g.rows * g.spec.hidden
            && let Some(q) = super::int4_linear::try_qkv_rope(
                &x,
                &weight,
                targets.as_ptr::<QkvRopeParams>().add(layer),
                (h + 2 * kvh) * d,
                h * d,
            )
        {
            let device = super::float_device(&q);
            let qp = KernelInput::resolve(&g.rt, &q, &device);
            // SAFETY: q is the GEMM's Stoke-owned output of rows x h x d, held until attention
            // is queued after it on Stoke's stream (its buffer is freed on that stream).
            let out = unsafe { attend_q(g, layer, DevicePtr::new(qp.ptr), device) };
            drop((qp, q));
            return out;
        }
    }
    let qkv = crate::route::linear::<I>(x, weight, None);
    decode_attention(dec, layer, qkv)
}

/// The sampling call of `logits` (`rows` rows of `vocab`) into the decoder's lane buffers, with
/// each lane's settings; `lane_of`: the lane of each row (null: row = lane).
fn sample_call<T>(
    g: &GpuDecoder,
    logits: u64,
    rows: usize,
    lane_of: DevicePtr<u32>,
) -> stoke_cuda::sample::SampleCall<T> {
    stoke_cuda::sample::SampleCall {
        logits: DevicePtr::new(logits),
        row_stride: g.spec.vocab as u32,
        vocab: g.spec.vocab as u32,
        rows: rows as u32,
        ids_out: g.ids.as_mut_ptr(),
        pos: g.pos.as_mut_ptr(),
        presence: g.presence.as_mut_ptr(),
        params: stoke_cuda::sample::SamplingParams::GREEDY,
        row_cfg: g.cfg.as_ptr(),
        lane_of,
    }
}

/// Samples `rows` rows of logits (their lanes: `lane_of`, null for row = lane) and, with
/// `logprobs`, writes their log-probability rows; keeps the logits where the decoder does.
fn sample_rows<I: Backend>(
    g: &mut GpuDecoder,
    logits: &StokeTensor<I>,
    rows: usize,
    lane_of: DevicePtr<u32>,
    logprobs: bool,
    kept: Vec<usize>,
) -> stoke_cuda::Result<()> {
    let device = super::float_device(logits);
    let rt = g.rt.clone();
    let l = KernelInput::resolve(&rt, logits, &device);
    let lp = g.logprobs.as_mut_ptr();
    // SAFETY: logits hold rows x vocab values of their dtype; the decoder's buffers hold a lane
    // per row (lane_of names lanes below the decoder's), the presence words and settings of
    // each, and `rows` log-probability rows.
    unsafe {
        match logits.dtype() {
            DType::F32 => {
                let call = sample_call::<f32>(g, l.ptr, rows, lane_of);
                stoke_cuda::sample::sample(&rt, &call)?;
                if logprobs {
                    stoke_cuda::sample::logprobs(&rt, &call, lp)?;
                }
            }
            DType::BF16 => {
                let call = sample_call::<half::bf16>(g, l.ptr, rows, lane_of);
                stoke_cuda::sample::sample(&rt, &call)?;
                if logprobs {
                    stoke_cuda::sample::logprobs(&rt, &call, lp)?;
                }
            }
            other => fatal(
                "logits",
                format!("{other:?}: the sampler takes f32 or bf16"),
            ),
        }
    }
    if let Some((keep, kept_rows)) = &mut g.logits {
        *kept_rows = kept;
        let n = rows * g.spec.vocab;
        let elem = if logits.dtype() == DType::F32 { 4 } else { 2 };
        // SAFETY: both hold n values of the logits' dtype (kept as they are).
        unsafe { rt.copy_dtod(keep.ptr(), l.ptr, n * elem) }?;
        g.logits_bf16 = logits.dtype() == DType::BF16;
    }
    drop(l);
    Ok(())
}

fn check_logits<I: Backend>(g: &GpuDecoder, logits: &StokeTensor<I>, most: usize) -> usize {
    let vocab = *logits.shape().as_slice().last().expect("rank >= 1");
    let rows = logits.shape().num_elements() / vocab.max(1);
    if vocab != g.spec.vocab || rows > most {
        fatal(
            "logits",
            format!(
                "{:?} for at most {most} rows of {} tokens",
                logits.shape(),
                g.spec.vocab
            ),
        );
    }
    rows
}

pub(crate) fn decode_sample<I: Backend>(dec: &mut StokeDecoder<I>, logits: StokeTensor<I>) {
    let g = match dec {
        StokeDecoder::Gpu(g) => g,
        StokeDecoder::Reference(r) => return crate::decode::ref_ops::sample(r, logits),
    };
    let rows = check_logits(g, &logits, g.rows);
    let logprobs = g.step_logprobs;
    let kept = g.step_lanes.clone();
    if let Err(e) = sample_rows(g, &logits, rows, DevicePtr::NULL, logprobs, kept) {
        fatal("sampling", e);
    }
}

pub(crate) fn prefill_sample<I: Backend>(
    dec: &mut StokeDecoder<I>,
    logits: StokeTensor<I>,
    lanes: &[usize],
) -> Result<(), DecodeError> {
    let g = match dec {
        StokeDecoder::Gpu(g) => g,
        StokeDecoder::Reference(r) => {
            return crate::decode::ref_ops::prefill_sample(r, logits, lanes);
        }
    };
    let (syncs0, _) = g.rt.counters();
    let rows = check_logits(g, &logits, g.spec.lanes);
    g.lanes.check_sample_lanes(lanes, rows)?;
    let lane_of: Vec<u32> = lanes.iter().map(|&l| l as u32).collect();
    let lane_of = upload_async(&g.rt, &u32_bytes(&lane_of))?;
    let want: Vec<Option<(usize, u32)>> = lanes
        .iter()
        .enumerate()
        .map(|(row, &l)| g.lanes.lanes[l].sampling.logprobs.map(|top| (row, top)))
        .collect();
    let logprobs = want.iter().any(Option::is_some);
    sample_rows(
        g,
        &logits,
        rows,
        lane_of.as_ptr(),
        logprobs,
        (0..rows).collect(),
    )?;
    drop(lane_of);
    // A prefill sampling moves each active lane past its last prompt token (the kernel did so
    // on the device).
    for &l in lanes {
        if g.lanes.lanes[l].active {
            g.lanes.lanes[l].pos += 1;
        }
    }
    g.queue_results(lanes.to_vec(), g.spec.lanes, want)?;
    g.stats.host_syncs_outside_steps += g.rt.counters().0 - syncs0;
    Ok(())
}

pub(crate) fn decode_step<I: Backend>(
    dec: &mut StokeDecoder<I>,
    body: &mut dyn FnMut(&mut StokeDecoder<I>),
) -> Result<(), DecodeError> {
    if let StokeDecoder::Reference(_) = dec {
        // The reference body runs over the enum; its ops take the reference branch.
        let StokeDecoder::Reference(r) = dec else {
            unreachable!()
        };
        r.begin_step()?;
        body(dec);
        if let StokeDecoder::Reference(r) = dec {
            r.end_step();
        }
        return Ok(());
    }
    let g = gpu(dec);
    let rows = g.lanes.step_rows()?;
    let active = g.lanes.active();
    let needed = g.lanes.max_position() + 1;
    let bucket = context_bucket(needed, g.spec.capacity);
    let logprobs = active
        .iter()
        .any(|&l| g.lanes.lanes[l].sampling.logprobs.is_some());
    let want: Vec<Option<(usize, u32)>> = active
        .iter()
        .map(|&l| g.lanes.lanes[l].sampling.logprobs.map(|top| (l, top)))
        .collect();
    g.rows = rows;
    g.step_lanes = active.clone();
    g.step_logprobs = logprobs;
    g.ctx_bucket = bucket;
    let rt = g.rt.clone();
    let (syncs0, crossings0) = rt.counters();
    let eager = g.spec.eager || !g.warmed.contains(&rows);
    let key = (rows, bucket, logprobs);
    if eager {
        g.in_step = true;
        body(dec);
        let g = gpu(dec);
        g.in_step = false;
        g.warmed.insert(rows);
        g.stats.eager_steps += 1;
    } else {
        if !g.graphs.contains_key(&key) {
            let arena = g.arena.clone();
            g.in_step = true;
            let (graph, inner_ops) = crate::capture::strict_capture(|| {
                rt.capture_into(&arena, || {
                    body(dec);
                    Ok(())
                })
            });
            let g = gpu(dec);
            g.in_step = false;
            let graph = graph?;
            if !inner_ops.is_empty() {
                return Err(stoke_cuda::Error::Crossing {
                    ops: inner_ops
                        .iter()
                        .map(|op| format!("burn op `{op}` on the inner backend"))
                        .collect(),
                }
                .into());
            }
            g.graphs.insert(key, StepGraph(graph));
            g.stats.captures += 1;
        }
        let g = gpu(dec);
        rt.replay(&g.graphs[&key].0)?;
        g.stats.replays += 1;
    }
    let g = gpu(dec);
    g.queue_results(active, rows, want)?;
    g.lanes.advance();
    let (syncs1, crossings1) = rt.counters();
    g.stats.steps += 1;
    if eager {
        g.stats.host_syncs_in_eager_steps += syncs1 - syncs0;
    } else {
        g.stats.host_syncs_in_steps += syncs1 - syncs0;
        g.stats.crossings_in_steps += crossings1 - crossings0;
    }
    Ok(())
}

pub(crate) fn decode_last_logits<I: Backend>(dec: &mut StokeDecoder<I>) -> Option<Vec<f32>> {
    let g = match dec {
        StokeDecoder::Gpu(g) => g,
        StokeDecoder::Reference(r) => return crate::decode::ref_ops::last_logits(r),
    };
    let (buf, rows) = g.logits.as_ref()?;
    let vocab = g.spec.vocab;
    let n = (rows.iter().max().map_or(0, |r| r + 1)) * vocab;
    let elem = if g.logits_bf16 { 2 } else { 4 };
    let mut bytes = vec![0u8; n * elem];
    // SAFETY: the buffer holds at least n values of that size.
    if let Err(e) = unsafe { g.rt.copy_dtoh(&mut bytes, buf.ptr()) } {
        fatal("reading logits", e);
    }
    let all: Vec<f32> = if g.logits_bf16 {
        bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()
    } else {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    Some(
        rows.iter()
            .flat_map(|&r| all[r * vocab..(r + 1) * vocab].iter().copied())
            .collect(),
    )
}

pub(crate) fn decode_force_ids<I: Backend>(
    dec: &mut StokeDecoder<I>,
    ids: &[u32],
) -> Result<(), DecodeError> {
    let g = match dec {
        StokeDecoder::Gpu(g) => g,
        StokeDecoder::Reference(r) => return r.force_ids(ids),
    };
    crate::decode::check_forced(ids, g.spec.lanes, g.spec.vocab)?;
    let words = crate::decode::words(g.spec.vocab);
    // The presence words of the forced tokens: read, set, written back (lanes past `ids` keep
    // theirs).
    let mut presence = vec![0u8; ids.len() * words * 4];
    // SAFETY: the buffers hold a lane's id and presence words per lane; both copies wait for
    // the queued steps.
    unsafe { g.rt.copy_dtoh(&mut presence, g.presence.ptr()) }?;
    for (r, &t) in ids.iter().enumerate() {
        let at = (r * words + t as usize / 32) * 4;
        let w = u32::from_le_bytes(presence[at..at + 4].try_into().unwrap()) | 1 << (t % 32);
        presence[at..at + 4].copy_from_slice(&w.to_le_bytes());
    }
    // SAFETY: as above.
    unsafe {
        g.rt.copy_htod(g.ids.ptr(), &u32_bytes(ids))?;
        g.rt.copy_htod(g.presence.ptr(), &presence)?;
    }
    Ok(())
}

pub(crate) fn decode_take<I: Backend>(dec: &mut StokeDecoder<I>) -> Option<Sampled> {
    match dec {
        StokeDecoder::Gpu(g) => g.take(),
        StokeDecoder::Reference(r) => crate::decode::ref_ops::take(r),
    }
}

/// The decode-step ops of `impl FusedOps for Stoke<I>`.
macro_rules! stoke_decoder_ops {
    () => {
        type Decoder = crate::cuda::decoder::StokeDecoder<I>;

        fn decoder_new(
            spec: crate::decode::DecodeSpec,
            dtype: DType,
            device: &Self::Device,
        ) -> Result<Self::Decoder, crate::decode::DecodeError> {
            crate::cuda::decoder::decoder_new::<I>(spec, dtype, device)
        }

        fn decoder_spec(dec: &Self::Decoder) -> &crate::decode::DecodeSpec {
            match dec {
                crate::cuda::decoder::StokeDecoder::Gpu(g) => g.spec(),
                crate::cuda::decoder::StokeDecoder::Reference(r) => &r.spec,
            }
        }

        fn decoder_update(
            dec: &mut Self::Decoder,
            ops: &[crate::decode::LaneOp],
        ) -> Result<(), crate::decode::DecodeError> {
            crate::cuda::decoder::decoder_update(dec, ops)
        }

        fn prefill_attention(
            dec: &mut Self::Decoder,
            layer: usize,
            qkv: FloatTensor<Self>,
            seqs: &[crate::decode::PackedSeq],
        ) -> Result<FloatTensor<Self>, crate::decode::DecodeError> {
            crate::cuda::decoder::prefill_attention(dec, layer, qkv, seqs)
        }

        fn prefill_qkv_attention(
            dec: &mut Self::Decoder,
            layer: usize,
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            seqs: &[crate::decode::PackedSeq],
        ) -> Result<FloatTensor<Self>, crate::decode::DecodeError> {
            match crate::cuda::decoder::try_prefill_qkv_attention(dec, layer, &x, &weight, seqs) {
                Some(r) => r,
                None => crate::cuda::decoder::prefill_attention(
                    dec,
                    layer,
                    <Self as burn_backend::ops::ModuleOps<Self>>::linear(x, weight, None),
                    seqs,
                ),
            }
        }

        fn decode_embed(
            dec: &Self::Decoder,
            table: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            eps: f64,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            crate::cuda::decoder::decode_embed(dec, table, gamma, eps)
        }

        fn decode_attention(
            dec: &mut Self::Decoder,
            layer: usize,
            qkv: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            crate::cuda::decoder::decode_attention(dec, layer, qkv)
        }

        fn decode_qkv_attention(
            dec: &mut Self::Decoder,
            layer: usize,
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            crate::cuda::decoder::decode_qkv_attention(dec, layer, x, weight)
        }

        fn decode_sample(dec: &mut Self::Decoder, logits: FloatTensor<Self>) {
            crate::cuda::decoder::decode_sample(dec, logits)
        }

        fn prefill_sample(
            dec: &mut Self::Decoder,
            logits: FloatTensor<Self>,
            lanes: &[usize],
        ) -> Result<(), crate::decode::DecodeError> {
            crate::cuda::decoder::prefill_sample(dec, logits, lanes)
        }

        fn decode_step(
            dec: &mut Self::Decoder,
            body: &mut dyn FnMut(&mut Self::Decoder),
        ) -> Result<(), crate::decode::DecodeError> {
            crate::cuda::decoder::decode_step(dec, body)
        }

        fn decode_take(dec: &mut Self::Decoder) -> Option<crate::decode::Sampled> {
            crate::cuda::decoder::decode_take(dec)
        }

        fn decode_last_logits(dec: &mut Self::Decoder) -> Option<Vec<f32>> {
            crate::cuda::decoder::decode_last_logits(dec)
        }

        fn decode_force_ids(
            dec: &mut Self::Decoder,
            ids: &[u32],
        ) -> Result<(), crate::decode::DecodeError> {
            crate::cuda::decoder::decode_force_ids(dec, ids)
        }
    };
}
pub(crate) use stoke_decoder_ops;
