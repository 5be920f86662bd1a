//! The KV cache on the GPU (`kernels/decode_attention.cu`): the BF16 main cache, an optional
//! FP8 or INT4 mirror, the append of each step's K and V rows, and split-KV decode attention.
//!
//! Slots are stable batch indices; which slot each row of a step belongs to, where it writes
//! and how many keys it attends to are device buffers (`slot_of`, `pos`, `len`), so a captured
//! decode step replays with new positions.

use crate::kernels::decode_attention::{
    AppendParams, AttnParams, KvCacheParams, KvFormat, RopeAppendParams, append_entry_point,
    attn_cluster_entry, attn_entry, attn_entry_point, check_shape, forced_split, head_ctas,
    rope_append_entry_point, split_plan,
};
use crate::kernels::fp8_gemm::QkvEpilogue;
use crate::kernels::prefill_attention::{self, PrefillAttnParams, PrefillSeq};
use crate::{DeviceBuffer, DevicePtr, DevicePtrMut, Error, Kernel, LaunchShape, Result, Runtime};
use half::bf16;
use std::sync::Arc;

/// The launch of the append kernels (`kv_append`, `rope_append`): one warp per item, four
/// warps per CTA.
fn warp_per_item(items: u32) -> LaunchShape {
    LaunchShape {
        grid: (items.div_ceil(4), 1, 1),
        block: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One mirror's buffers: K and V rows, and their per-row f32 scales.
#[derive(Debug)]
pub struct Mirror {
    pub k: DeviceBuffer,
    pub v: DeviceBuffer,
    pub ks: DeviceBuffer,
    pub vs: DeviceBuffer,
}

/// A KV cache of `slots` sequences x `kv_heads` x `cap` positions x `d` dims.
#[derive(Debug)]
pub struct DeviceKvCache {
    /// The format decode attention reads: the BF16 main cache itself, or a mirror.
    pub format: KvFormat,
    pub slots: u32,
    pub kv_heads: u32,
    pub cap: u32,
    pub d: u32,
    /// Hadamard block of the mirror rows (0: not rotated).
    pub block: u32,
    pub k: DeviceBuffer,
    pub v: DeviceBuffer,
    pub mirror: Option<Mirror>,
}

impl DeviceKvCache {
    /// Allocates a zeroed cache. `block` is the rotation block for the FP8/INT4 mirror (0 for
    /// none; ignored for BF16).
    pub fn new(
        rt: &Arc<Runtime>,
        format: KvFormat,
        (slots, kv_heads, cap, d): (u32, u32, u32, u32),
        block: u32,
    ) -> Result<Self> {
        check_shape(kv_heads, kv_heads, d, block).map_err(Error::Shape)?;
        let rows = slots as usize * kv_heads as usize * cap as usize;
        let zeroed = |bytes: usize| -> Result<DeviceBuffer> {
            let b = rt.alloc(bytes.max(4))?;
            // SAFETY: the buffer holds at least `bytes` bytes.
            unsafe { rt.fill_bytes(b.ptr(), 0, bytes.max(4)) }?;
            Ok(b)
        };
        let d_us = d as usize;
        let mirror = match format {
            KvFormat::Bf16 => None,
            KvFormat::Fp8 | KvFormat::Int4 => {
                let row = if format == KvFormat::Fp8 {
                    d_us
                } else {
                    d_us / 2
                };
                Some(Mirror {
                    k: zeroed(rows * row)?,
                    v: zeroed(rows * row)?,
                    ks: zeroed(rows * 4)?,
                    vs: zeroed(rows * 4)?,
                })
            }
        };
        Ok(Self {
            format,
            slots,
            kv_heads,
            cap,
            d,
            block: if format == KvFormat::Bf16 { 0 } else { block },
            k: zeroed(rows * d_us * 2)?,
            v: zeroed(rows * d_us * 2)?,
            mirror,
        })
    }

    fn main_params(&self) -> KvCacheParams {
        KvCacheParams {
            k: self.k.as_mut_ptr(),
            v: self.v.as_mut_ptr(),
            ks: DevicePtrMut::NULL,
            vs: DevicePtrMut::NULL,
            kv_heads: self.kv_heads,
            cap: self.cap,
            d: self.d,
            format: KvFormat::Bf16 as u32,
        }
    }

    /// The mirror's parameters for the append kernels (null pointers: no mirror).
    fn mirror_params(&self) -> KvCacheParams {
        if self.mirror.is_some() {
            self.read_params()
        } else {
            KvCacheParams::default()
        }
    }

    /// The cache decode attention reads.
    fn read_params(&self) -> KvCacheParams {
        match &self.mirror {
            None => self.main_params(),
            Some(m) => KvCacheParams {
                k: m.k.as_mut_ptr(),
                v: m.v.as_mut_ptr(),
                ks: m.ks.as_mut_ptr(),
                vs: m.vs.as_mut_ptr(),
                kv_heads: self.kv_heads,
                cap: self.cap,
                d: self.d,
                format: self.format as u32,
            },
        }
    }

    /// Queues the append of one step: row `b` of `k_new`/`v_new` (`[batch, kv_heads, d]` bf16)
    /// goes to slot `slot_of[b]` at position `pos[b]` (`[batch]` u32 device buffers) of the
    /// main cache and, rotated and quantized, of the mirror.
    ///
    /// # Safety
    /// The pointers must be valid device memory of those sizes until the kernel finishes, with
    /// every slot below `slots` and every position below `cap`.
    pub unsafe fn append(
        &self,
        rt: &Arc<Runtime>,
        k_new: DevicePtr<bf16>,
        v_new: DevicePtr<bf16>,
        slot_of: DevicePtr<u32>,
        pos: DevicePtr<u32>,
        batch: u32,
    ) -> Result<()> {
        if batch == 0 {
            return Ok(());
        }
        let params = AppendParams {
            k_new,
            v_new,
            slot_of,
            pos,
            main: self.main_params(),
            mirror: self.mirror_params(),
            batch,
            block: self.block,
        };
        let kernel = rt.kernel(append_entry_point())?;
        let shape = warp_per_item(batch * self.kv_heads * 2);
        // SAFETY: params mirror the kernel's struct (layout test); the caller guarantees the
        // pointers; the cache buffers are owned by self.
        unsafe { rt.launch(&kernel, shape, &params) }
    }

    /// Queues RoPE and the append of one decode step straight from a q|k|v projection's output:
    /// `qkv [batch, (heads + 2 kv_heads) d]` bf16 (each row q | k | v); q and k are rotated
    /// (rotate-half) by the angles of position `pos[b]` from `rope` (`[max_pos, d / 2, 2]` cos,
    /// sin f32), q is written to `q_out [batch, heads, d]`, k and v go to slot `slot_of[b]` at
    /// `pos[b]` as in [`Self::append`], and `len[b] = pos[b] + 1` is written for attention.
    ///
    /// # Safety
    /// The pointers must be valid device memory of those sizes until the kernel finishes, with
    /// every slot below `slots` and every position below `cap` and `max_pos`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rope_append(
        &self,
        rt: &Arc<Runtime>,
        qkv: DevicePtr<bf16>,
        heads: u32,
        rope: (DevicePtr<f32>, u32),
        slot_of: DevicePtr<u32>,
        pos: DevicePtr<u32>,
        len: DevicePtrMut<u32>,
        batch: u32,
        q_out: DevicePtrMut<bf16>,
    ) -> Result<()> {
        check_shape(heads, self.kv_heads, self.d, self.block).map_err(Error::Shape)?;
        if batch == 0 {
            return Ok(());
        }
        let params = RopeAppendParams {
            qkv,
            q_out,
            rope: rope.0,
            slot_of,
            pos,
            len,
            main: self.main_params(),
            mirror: self.mirror_params(),
            batch,
            heads,
            block: self.block,
            max_pos: rope.1,
        };
        let kernel = rt.kernel(rope_append_entry_point())?;
        let shape = warp_per_item(batch * (heads + 2 * self.kv_heads));
        // SAFETY: params mirror the kernel's struct (layout test); the caller guarantees the
        // pointers; the cache buffers are owned by self.
        unsafe { rt.launch(&kernel, shape, &params) }
    }

    /// The targets of the prefill GEMM's q|k|v epilogue for this cache ([`QkvEpilogue`]): the
    /// same writes as [`Self::rope_append`] on the GEMM's output, with the same arguments, made
    /// by the GEMM itself. Checks the heads, head dim and rotation block as `rope_append` does.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_epilogue(
        &self,
        heads: u32,
        rope: (DevicePtr<f32>, u32),
        slot_of: DevicePtr<u32>,
        pos: DevicePtr<u32>,
        len: DevicePtrMut<u32>,
        q_out: DevicePtrMut<bf16>,
    ) -> Result<QkvEpilogue> {
        check_shape(heads, self.kv_heads, self.d, self.block).map_err(Error::Shape)?;
        Ok(QkvEpilogue {
            q: q_out,
            main: self.main_params(),
            mirror: self.mirror_params(),
            rope: rope.0,
            max_pos: rope.1,
            slot_of,
            pos,
            len,
            heads,
            block: self.block,
        })
    }

    /// Queues decode attention for `batch` rows: `q [batch, heads, d]` bf16, row `b` attends
    /// to positions `0 .. len[b]` of slot `slot_of[b]`; `out [batch, heads, d]` bf16.
    /// `max_len` bounds every `len[b]` (it sizes the split-KV grid).
    ///
    /// # Safety
    /// As for [`DeviceKvCache::append`]; `len[b] <= max_len <= cap`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend(
        &self,
        rt: &Arc<Runtime>,
        q: DevicePtr<bf16>,
        heads: u32,
        slot_of: DevicePtr<u32>,
        len: DevicePtr<u32>,
        batch: u32,
        max_len: u32,
        out: DevicePtrMut<bf16>,
    ) -> Result<()> {
        // SAFETY: as documented; the plan's split count.
        unsafe { self.attend_splits(rt, q, heads, slot_of, len, batch, max_len, out, None) }
    }

    /// [`Self::attend`] with the split count forced (`Some(s)`: [`forced_split`]`(max_len, s)`);
    /// for benchmarks and tests that compare split plans. `None`: the plan's.
    ///
    /// # Safety
    /// As for [`Self::attend`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend_splits(
        &self,
        rt: &Arc<Runtime>,
        q: DevicePtr<bf16>,
        heads: u32,
        slot_of: DevicePtr<u32>,
        len: DevicePtr<u32>,
        batch: u32,
        max_len: u32,
        out: DevicePtrMut<bf16>,
        splits: Option<u32>,
    ) -> Result<()> {
        check_shape(heads, self.kv_heads, self.d, self.block).map_err(Error::Shape)?;
        if max_len > self.cap {
            return Err(Error::Shape(crate::ShapeError::new(
                "decode attention max_len",
                format!("at most the cache capacity {}", self.cap),
                max_len.to_string(),
            )));
        }
        if batch == 0 {
            return Ok(());
        }
        let (kernel, chunk, splits, cluster) = self.attn_plan(rt, heads, batch, max_len, splits)?;
        let ctas = head_ctas(heads, self.kv_heads);
        let threads = kernel.max_threads;
        // One split: the attention kernel writes the output itself (no partials). Splits that
        // form a cluster merge through each other's shared memory (no partials either). Else
        // each split writes its partials and the last to finish merges them; the arrival counts
        // come from the runtime's zeroed scratch, which the kernel leaves zeroed.
        let parts = if splits > 1 && cluster.is_none() {
            let items = batch as usize * heads as usize * splits as usize;
            let arrived = rt.zeroed_scratch(batch as usize * ctas as usize * 4)?;
            Some((
                rt.alloc(items * self.d as usize * 4)?,
                // Records of (max, sum).
                rt.alloc(items * 8)?,
                arrived,
            ))
        } else {
            None
        };
        let part_ptrs = parts.as_ref().map_or(
            (DevicePtrMut::NULL, DevicePtrMut::NULL, DevicePtrMut::NULL),
            |(o, ml, a)| (o.as_mut_ptr(), ml.as_mut_ptr(), DevicePtrMut::new(*a)),
        );
        let params = AttnParams {
            q,
            slot_of,
            len,
            cache: self.read_params(),
            part_o: part_ptrs.0,
            part_ml: part_ptrs.1,
            out,
            arrived: part_ptrs.2,
            batch,
            heads,
            splits,
            chunk,
            block: self.block,
            scale: 1.0 / (self.d as f32).sqrt(),
        };
        let shape = LaunchShape {
            grid: (splits, ctas, batch),
            block: (threads, 1, 1),
            shared_mem_bytes: kernel.dyn_smem,
        };
        // SAFETY: as above; the partials are Stoke buffers freed on this stream after use; the
        // kernel is written for clusters of its splits (`<entry>_cluster`).
        unsafe { rt.launch_cluster(&kernel, shape, cluster, &params) }
    }

    /// The split-KV launch [`Self::attend_splits`] makes for `batch` sequences of at most
    /// `max_len` keys and `heads` query heads with `splits` (None: the plan's): (keys per split,
    /// splits, CTAs per cluster: the split count when the splits merge through distributed shared
    /// memory, else 1).
    pub fn split_launch(
        &self,
        rt: &Runtime,
        heads: u32,
        batch: u32,
        max_len: u32,
        splits: Option<u32>,
    ) -> Result<(u32, u32, u32)> {
        let (_, chunk, splits, cluster) = self.attn_plan(rt, heads, batch, max_len, splits)?;
        Ok((chunk, splits, cluster.map_or(1, |c| c.0)))
    }

    /// The attention kernel of this cache and its split-KV plan for `batch` sequences of at
    /// most `max_len` keys and `heads` query heads (`forced`: that many splits,
    /// [`forced_split`]): (kernel, keys per split, splits, cluster). Split launches whose
    /// clusters fit run on the cluster entry point as clusters of their splits. The block size
    /// is the kernel's launch bounds (its warps per CTA, chosen per format in the kernel file).
    #[allow(clippy::type_complexity)]
    fn attn_plan(
        &self,
        rt: &Runtime,
        heads: u32,
        batch: u32,
        max_len: u32,
        forced: Option<u32>,
    ) -> Result<(Kernel<AttnParams>, u32, u32, Option<(u32, u32, u32)>)> {
        let kernel = rt.kernel(attn_entry_point(attn_entry(self.format, self.d)))?;
        let cl = rt.kernel(attn_entry_point(attn_cluster_entry(self.format, self.d)))?;
        // The driver is asked lazily (the runtime caches it per entry and cluster size), its
        // first error kept.
        let err = crate::FirstError::default();
        // A launch of `s` splits forms clusters where every (sequence, head CTA)'s cluster is
        // resident at once (a waiting cluster would hold its finished CTAs' slots), on an entry
        // point built with the cluster merge (its `<entry>_cluster` global).
        let head_ctas = head_ctas(heads, self.kv_heads);
        let clusters = u64::from(batch) * u64::from(head_ctas);
        let fits = |s: u32| err.ask(|| rt.clusters_fit(&cl, cl.max_threads, (s, 1, 1), clusters));
        let (chunk, splits) = match forced {
            Some(s) => forced_split(max_len, s),
            None => {
                let ctas = rt.resident_ctas(&kernel, kernel.max_threads)?;
                split_plan(batch, head_ctas, max_len, rt.sm_count, ctas, &fits)
            }
        };
        let clustered = fits(splits);
        err.finish(if clustered {
            (cl, chunk, splits, Some((splits, 1, 1)))
        } else {
            (kernel, chunk, splits, None)
        })
    }

    /// Queues causal prefill attention of packed sequences over the BF16 main cache: `seqs`
    /// (host copy) and `seqs_dev` (the same descriptors on the device) say which rows of
    /// `q [rows, heads, d]` belong to which slot and from which position; row `i` of a
    /// sequence attends to positions `0 ..= pos0 + i` of its slot (the keys must already be
    /// appended, as [`Self::rope_append`] does). Writes `out [rows, heads, d]` bf16.
    ///
    /// # Safety
    /// The pointers must be valid device memory of those sizes until the kernel finishes and
    /// `seqs_dev` must hold `seqs`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn prefill_attend(
        &self,
        rt: &Arc<Runtime>,
        q: DevicePtr<bf16>,
        heads: u32,
        seqs: &[PrefillSeq],
        seqs_dev: DevicePtr<PrefillSeq>,
        rows: u32,
        out: DevicePtrMut<bf16>,
    ) -> Result<()> {
        prefill_attention::check_shape(heads, self.kv_heads, self.d).map_err(Error::Shape)?;
        prefill_attention::check_seqs(seqs, rows, self.slots, self.cap).map_err(Error::Shape)?;
        let p = PrefillAttnParams {
            q,
            k: self.k.as_ptr(),
            v: self.v.as_ptr(),
            out,
            seqs: seqs_dev,
            n_seqs: seqs.len() as u32,
            heads,
            kv_heads: self.kv_heads,
            cap: self.cap,
            scale_log2: std::f32::consts::LOG2_E / (self.d as f32).sqrt(),
            pad: 0,
        };
        // SAFETY: the caller's guarantees; the cache buffers are owned by self and hold
        // slots x kv_heads x cap x d bf16.
        unsafe { prefill_attention::prefill_attention(rt, &p, seqs, self.d) }
    }

    /// Bytes decode attention reads for `keys` cached tokens (K and V rows, scales included).
    pub fn bytes_read(&self, keys: usize) -> usize {
        2 * keys * self.kv_heads as usize * self.format.row_bytes(self.d as usize)
    }
}
