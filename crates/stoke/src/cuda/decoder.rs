//! `Stoke<I>`'s decoder: the decode step in Stoke's own memory, on Stoke's stream, replayed as a
//! CUDA graph.
//!
//! The decoder owns the KV cache of every layer ([`DeviceKvCache`]: BF16, and an FP8 or INT4
//! mirror that attention reads), the step's token ids, positions and attention lengths, the
//! repetition penalty's token sets and the RoPE table, all in device buffers. A step is the
//! model's own decode forward (Burn code over the fused ops); its ops read those buffers on the
//! device, so the same work replays with new positions:
//!
//! - the first step runs eagerly (kernels load, the W4A16 plans are tuned);
//! - the next one is captured ([`Runtime::capture_into`], strict: a crossing to burn-cuda fails
//!   the capture with the op named) into a graph per attention-length bucket (the split-KV grid
//!   is planned for the bucket's longest context: 256, 512, ... up to the capacity), every
//!   buffer it allocates taken from the decoder's [`GraphArena`];
//! - every later step replays the graph of its bucket;
//! - after each step the sampled ids are copied to page-locked memory with an event; the host
//!   takes them one step later ([`decode_take_ids`](crate::decode::decode_take_ids)), so it
//!   never waits for the step it just queued.
//!
//! Batches run padded to the next bucket of 1, 2, 4, 8, 16, 32 or 64 rows; padding rows decode
//! token 0 in their own cache slots and are never returned. Where the step cannot run on
//! Stoke's kernels (no runtime, not bf16, a head size or GQA ratio without a kernel, more than
//! 64 sequences) the decoder is the reference one, with the reason logged.

use super::bridge::{DeviceTensor, KernelInput, runtime_for};
use crate::backend::Stoke;
use crate::decode::{DecodeError, DecodeSpec, KvCacheFormat, PackedSeq, RefDecoder};
use crate::tensor::StokeTensor;
use burn_backend::{Backend, DType, Shape, TensorMetadata};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use stoke_cuda::kernels::decode_attention::KvFormat;
use stoke_cuda::kernels::prefill_attention::PrefillSeq;
use stoke_cuda::kv::DeviceKvCache;
use stoke_cuda::{CudaEvent, CudaGraph};
use stoke_cuda::{DeviceBuffer, DevicePtr, DevicePtrMut, GraphArena, PinnedHost, Runtime};

/// Rows a step of `batch` sequences runs with.
pub fn batch_bucket(batch: usize) -> Option<usize> {
    [1, 2, 4, 8, 16, 32, 64].into_iter().find(|&b| b >= batch)
}

/// Longest context a step's attention is planned for, given the longest sequence it attends to.
fn context_bucket(needed: usize, capacity: usize) -> usize {
    needed.next_power_of_two().max(256).min(capacity)
}

/// Counts of what the decoder's steps did (for tests and benchmarks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    pub steps: u64,
    /// Steps run eagerly (the warm-up, `eager` decoders).
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
}

/// A captured step. The graph is only launched through the runtime that made it, which binds its
/// context to the calling thread first.
struct StepGraph(CudaGraph);
// SAFETY: CUDA graph handles may be used from any thread with the owning context current
// (`Runtime::replay` makes it current); the decoder owning it is used by one thread at a time.
unsafe impl Send for StepGraph {}

/// The decoder on Stoke's kernels.
pub struct GpuDecoder {
    rt: Arc<Runtime>,
    spec: DecodeSpec,
    /// Rows of every step (the batch bucket).
    rows: usize,
    caches: Vec<DeviceKvCache>,
    slot_of: DeviceBuffer,
    pos: DeviceBuffer,
    len: DeviceBuffer,
    ids: DeviceBuffer,
    presence: DeviceBuffer,
    rope: DeviceBuffer,
    /// The host's copy of `pos` (advanced by one per step).
    host_pos: Vec<usize>,
    in_step: bool,
    /// Keys the step being built plans its attention for.
    ctx_bucket: usize,
    warmed: bool,
    graphs: HashMap<usize, StepGraph>,
    arena: Arc<GraphArena>,
    pending: VecDeque<(PinnedHost, CudaEvent)>,
    spare: Vec<(PinnedHost, CudaEvent)>,
    /// The latest sampling's logits as they came (`keep_logits`), and how many rows they hold.
    logits: Option<(DeviceBuffer, usize)>,
    logits_bf16: bool,
    /// The latest packed prefill's layout on the device.
    packed: Option<PackedLayout>,
    pub stats: DecodeStats,
}

impl std::fmt::Debug for GpuDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GpuDecoder({} rows, {} layers, capacity {}, {:?}, {} graphs, {:?})",
            self.rows,
            self.caches.len(),
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
        let Some(rows) = batch_bucket(spec.batch) else {
            return Ok(Err(format!(
                "{} sequences; the step's kernels take at most 64",
                spec.batch
            )));
        };
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
        let caches = (0..spec.layers)
            .map(|_| {
                DeviceKvCache::new(
                    &rt,
                    format,
                    (
                        rows as u32,
                        spec.kv_heads as u32,
                        spec.capacity as u32,
                        spec.head_dim as u32,
                    ),
                    spec.rotate_block as u32,
                )
            })
            .collect::<stoke_cuda::Result<Vec<_>>>()?;
        let slots: Vec<u32> = (0..rows as u32).collect();
        let zeros = vec![0u32; rows];
        let words = spec.vocab.div_ceil(32);
        let rope: Vec<u8> = spec.rope[..spec.rope_positions() * spec.head_dim]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        Ok(Ok(Self {
            slot_of: upload(&rt, &u32_bytes(&slots))?,
            pos: upload(&rt, &u32_bytes(&zeros))?,
            len: upload(&rt, &u32_bytes(&zeros))?,
            ids: upload(&rt, &u32_bytes(&zeros))?,
            presence: upload(&rt, &vec![0u8; rows * words * 4])?,
            rope: upload(&rt, &rope)?,
            host_pos: vec![0; rows],
            in_step: false,
            ctx_bucket: spec.capacity,
            warmed: false,
            graphs: HashMap::new(),
            arena: GraphArena::new(&rt),
            pending: VecDeque::new(),
            spare: Vec::new(),
            logits: if spec.keep_logits {
                Some((rt.alloc_unpooled(rows * spec.vocab * 4)?, 0))
            } else {
                None
            },
            logits_bf16: false,
            packed: None,
            stats: DecodeStats::default(),
            caches,
            rows,
            spec,
            rt,
        }))
    }

    fn begin(&mut self, prompts: &[Vec<u32>]) -> Result<(), DecodeError> {
        let (pos, presence) = crate::decode::prompt_state(prompts, &self.spec, self.rows)?;
        self.host_pos = pos;
        let pos: Vec<u32> = self.host_pos.iter().map(|&p| p as u32).collect();
        let rt = &self.rt;
        // SAFETY: the buffers hold `rows` u32 and `rows * words` u32.
        unsafe {
            rt.copy_htod(self.pos.ptr(), &u32_bytes(&pos))?;
            rt.copy_htod(self.ids.ptr(), &u32_bytes(&vec![0; self.rows]))?;
            rt.copy_htod(self.presence.ptr(), &u32_bytes(&presence))?;
        }
        self.pending.clear();
        Ok(())
    }

    /// Queues the copy of the step's ids to page-locked memory and its event.
    fn queue_ids(&mut self) -> stoke_cuda::Result<()> {
        let (host, event) = match self.spare.pop() {
            Some(s) => s,
            None => (self.rt.pinned_host(self.rows * 4)?, self.rt.timing_event()?),
        };
        // SAFETY: `ids` holds `rows` u32; `host` is page-locked, `rows * 4` bytes, read only
        // after the event.
        unsafe {
            self.rt
                .copy_dtoh_async(host.as_mut_ptr(), self.ids.ptr(), self.rows * 4, &event)
        }?;
        self.pending.push_back((host, event));
        Ok(())
    }

    fn take_ids(&mut self) -> Option<Vec<u32>> {
        let (host, event) = self.pending.pop_front()?;
        if let Err(e) = event.synchronize() {
            fatal("waiting for a step's ids", e);
        }
        let ids = host
            .bytes()
            .chunks_exact(4)
            .take(self.spec.batch)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        self.spare.push((host, event));
        Some(ids)
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

pub(crate) fn decoder_begin<I: Backend>(
    dec: &mut StokeDecoder<I>,
    prompts: &[Vec<u32>],
) -> Result<(), DecodeError> {
    match dec {
        StokeDecoder::Gpu(g) => g.begin(prompts),
        StokeDecoder::Reference(r) => crate::decode::ref_ops::begin(r, prompts),
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
            seqs_dev: upload(rt, &PrefillSeq::bytes(&kernel_seqs))?,
            len: upload(rt, &u32_bytes(&pos))?,
            slot_of: upload(rt, &u32_bytes(&slot_of))?,
            pos: upload(rt, &u32_bytes(&pos))?,
            seqs: seqs.to_vec(),
            kernel_seqs,
        })
    }
}

impl GpuDecoder {
    /// Checks the packed layout `seqs` of `rows` rows against the decoder and uploads its
    /// tables where they differ from the latest prefill's (`self.packed`).
    fn use_packed(&mut self, seqs: &[PackedSeq], rows: usize) -> Result<(), DecodeError> {
        crate::decode::check_packed(seqs, &self.spec, rows)?;
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
    let q = match unsafe { super::fp8_linear::try_prefill_qkv(x, weight, target) }? {
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
    let out = DeviceTensor::<I>::alloc(&rt, Shape::new([g.rows, 1, h * d]), DType::BF16, device);
    let cache = &g.caches[layer];
    let rows = g.rows as u32;
    // SAFETY: x holds rows x width bf16; q and out are Stoke buffers of rows x h x d; the
    // decoder's buffers hold `rows` entries; positions stay below the capacity (checked per
    // step) and the context bucket is at most the capacity.
    let r = unsafe {
        cache
            .rope_append(
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
            .and_then(|_| {
                cache.attend(
                    &rt,
                    q.as_ptr(),
                    h as u32,
                    g.slot_of.as_ptr(),
                    g.len.as_ptr(),
                    rows,
                    g.ctx_bucket as u32,
                    DevicePtrMut::new(out.ptr()),
                )
            })
    };
    if let Err(e) = r {
        fatal("decode attention", e);
    }
    drop((x, q));
    StokeTensor::owned(out)
}

pub(crate) fn decode_sample<I: Backend>(dec: &mut StokeDecoder<I>, logits: StokeTensor<I>) {
    let g = match dec {
        StokeDecoder::Gpu(g) => g,
        StokeDecoder::Reference(r) => return crate::decode::ref_ops::sample(r, logits),
    };
    let vocab = *logits.shape().as_slice().last().expect("rank >= 1");
    let rows = logits.shape().num_elements() / vocab.max(1);
    if vocab != g.spec.vocab || rows > g.rows {
        fatal(
            "logits",
            format!(
                "{:?} for {} rows of {} tokens",
                logits.shape(),
                g.rows,
                g.spec.vocab
            ),
        );
    }
    let device = super::float_device(&logits);
    let rt = g.rt.clone();
    let l = KernelInput::resolve(&rt, &logits, &device);
    let params = g.spec.sampling;
    // Inside a step each row's position advances (the token just sampled goes one further);
    // after the prefill the position stays the prompt's length.
    let pos = if g.in_step {
        g.pos.as_mut_ptr()
    } else {
        DevicePtrMut::NULL
    };
    fn call<T>(
        logits: u64,
        rows: usize,
        vocab: usize,
        g: &GpuDecoder,
        pos: DevicePtrMut<u32>,
        params: stoke_cuda::sample::SamplingParams,
    ) -> stoke_cuda::sample::SampleCall<T> {
        stoke_cuda::sample::SampleCall {
            logits: DevicePtr::new(logits),
            row_stride: vocab as u32,
            vocab: vocab as u32,
            rows: rows as u32,
            ids_out: g.ids.as_mut_ptr(),
            pos,
            presence: g.presence.as_mut_ptr(),
            params,
        }
    }
    // SAFETY: logits hold rows x vocab values of their dtype; the decoder's buffers hold
    // `rows` ids and positions and `rows x ceil(vocab / 32)` presence words.
    let r = unsafe {
        match logits.dtype() {
            DType::F32 => {
                stoke_cuda::sample::sample::<f32>(&rt, &call(l.ptr, rows, vocab, g, pos, params))
            }
            DType::BF16 => stoke_cuda::sample::sample::<half::bf16>(
                &rt,
                &call(l.ptr, rows, vocab, g, pos, params),
            ),
            other => fatal(
                "logits",
                format!("{other:?}: the sampler takes f32 or bf16"),
            ),
        }
    };
    if let Err(e) = r {
        fatal("sampling", e);
    }
    if let Some((keep, kept_rows)) = &mut g.logits {
        *kept_rows = rows;
        let n = rows * vocab;
        // SAFETY: both hold n values of the logits' dtype (f32 kept as is, bf16 widened below).
        let r = match logits.dtype() {
            DType::F32 => unsafe { rt.copy_dtod(keep.ptr(), l.ptr, n * 4) },
            _ => unsafe { rt.copy_dtod(keep.ptr(), l.ptr, n * 2) },
        };
        if let Err(e) = r {
            fatal("keeping logits", e);
        }
        g.logits_bf16 = logits.dtype() == DType::BF16;
    }
    drop(l);
    if !g.in_step
        && let Err(e) = g.queue_ids()
    {
        fatal("queueing the ids copy", e);
    }
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
        let needed = r.max_position() + 1;
        if needed > r.spec.capacity {
            return Err(DecodeError::ContextOverflow {
                needed,
                capacity: r.spec.capacity,
            });
        }
        r.set_in_step(true);
        body(dec);
        if let StokeDecoder::Reference(r) = dec {
            r.set_in_step(false);
        }
        return Ok(());
    }
    let g = gpu(dec);
    let needed = g.host_pos.iter().max().copied().unwrap_or(0) + 1;
    if needed > g.spec.capacity {
        return Err(DecodeError::ContextOverflow {
            needed,
            capacity: g.spec.capacity,
        });
    }
    let bucket = context_bucket(needed, g.spec.capacity);
    g.ctx_bucket = bucket;
    let rt = g.rt.clone();
    let (syncs0, crossings0) = rt.counters();
    let eager = g.spec.eager || !g.warmed;
    if eager {
        g.in_step = true;
        body(dec);
        let g = gpu(dec);
        g.in_step = false;
        g.warmed = true;
        g.stats.eager_steps += 1;
    } else {
        if !g.graphs.contains_key(&bucket) {
            let arena = g.arena.clone();
            g.in_step = true;
            let (graph, inner_ops) = crate::route::strict_capture(|| {
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
            g.graphs.insert(bucket, StepGraph(graph));
            g.stats.captures += 1;
        }
        let g = gpu(dec);
        rt.replay(&g.graphs[&bucket].0)?;
        g.stats.replays += 1;
    }
    let g = gpu(dec);
    g.queue_ids()?;
    g.host_pos.iter_mut().for_each(|p| *p += 1);
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
    let n = rows.min(&g.spec.batch) * g.spec.vocab;
    let elem = if g.logits_bf16 { 2 } else { 4 };
    let mut bytes = vec![0u8; n * elem];
    // SAFETY: the buffer holds at least n values of that size.
    if let Err(e) = unsafe { g.rt.copy_dtoh(&mut bytes, buf.ptr()) } {
        fatal("reading logits", e);
    }
    Some(if g.logits_bf16 {
        bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect()
    } else {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    })
}

pub(crate) fn decode_force_ids<I: Backend>(
    dec: &mut StokeDecoder<I>,
    ids: &[u32],
) -> Result<(), DecodeError> {
    let g = match dec {
        StokeDecoder::Gpu(g) => g,
        StokeDecoder::Reference(r) => return r.force_ids(ids),
    };
    crate::decode::check_forced(ids, g.spec.batch, g.spec.vocab)?;
    let words = g.spec.vocab.div_ceil(32);
    // The presence words of the forced tokens: read, set, written back (rows beyond the
    // batch keep theirs).
    let mut presence = vec![0u8; g.rows * words * 4];
    // SAFETY: the buffers hold `rows` ids and `rows * words` presence words; both copies wait
    // for the queued steps.
    unsafe { g.rt.copy_dtoh(&mut presence, g.presence.ptr()) }?;
    for (r, &t) in ids.iter().enumerate() {
        let at = (r * words + t as usize / 32) * 4;
        let w = u32::from_le_bytes(presence[at..at + 4].try_into().unwrap()) | 1 << (t % 32);
        presence[at..at + 4].copy_from_slice(&w.to_le_bytes());
    }
    let mut all = ids.to_vec();
    all.resize(g.rows, 0);
    // SAFETY: as above.
    unsafe {
        g.rt.copy_htod(g.ids.ptr(), &u32_bytes(&all))?;
        g.rt.copy_htod(g.presence.ptr(), &presence)?;
    }
    Ok(())
}

pub(crate) fn decode_take_ids<I: Backend>(dec: &mut StokeDecoder<I>) -> Option<Vec<u32>> {
    match dec {
        StokeDecoder::Gpu(g) => g.take_ids(),
        StokeDecoder::Reference(r) => crate::decode::ref_ops::take_ids(r),
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

        fn decoder_begin(
            dec: &mut Self::Decoder,
            prompts: &[Vec<u32>],
        ) -> Result<(), crate::decode::DecodeError> {
            crate::cuda::decoder::decoder_begin(dec, prompts)
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

        fn decode_sample(dec: &mut Self::Decoder, logits: FloatTensor<Self>) {
            crate::cuda::decoder::decode_sample(dec, logits)
        }

        fn decode_step(
            dec: &mut Self::Decoder,
            body: &mut dyn FnMut(&mut Self::Decoder),
        ) -> Result<(), crate::decode::DecodeError> {
            crate::cuda::decoder::decode_step(dec, body)
        }

        fn decode_take_ids(dec: &mut Self::Decoder) -> Option<Vec<u32>> {
            crate::cuda::decoder::decode_take_ids(dec)
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
