//! The KV cache on the GPU (`kernels/decode_attention.cu`): a pool of pages holding the BF16
//! main cache and an optional FP8 or INT4 mirror, the append of each step's K and V rows, and
//! split-KV decode attention.
//!
//! A page holds `page` consecutive positions of every kv head. Each sequence slot has a row of
//! the [`PageTable`] (shared by every layer's cache of a decoder): entry `i` names the page of its
//! positions `i page .. (i + 1) page`. Kernels find every row through it (`kv_row` in
//! `kernels/kv_row.cuh`), so sequences grow page by page without moving and share the pages of
//! a common prompt prefix. Which slot each row of a step belongs to, where it writes and how
//! many keys it attends to are device buffers (`slot_of`, `pos`, `len`), so a captured decode
//! step replays with new positions; the page table is written by stream-ordered copies between
//! steps.

use crate::kernels::decode_attention::{
    AppendParams, AttnParams, KvCacheParams, KvFormat, RopeAppendParams, append_entry_point,
    attn_cluster_entry, attn_entry, attn_entry_point, check_shape, forced_split, head_ctas,
    rope_append_entry_point, split_plan,
};
use crate::kernels::fp8_gemm::QkvEpilogue;
use crate::kernels::prefill_attention::{self, PrefillAttnParams, PrefillSeq};
use crate::{
    DeviceBuffer, DevicePtr, DevicePtrMut, Error, Kernel, LaunchShape, Result, Runtime, ShapeError,
};
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

/// Positions per page the kernels take: a power of two from 16 (one key tile of decode
/// attention lies in one page) to 4096.
pub fn check_page_size(page: u32) -> std::result::Result<(), ShapeError> {
    if !page.is_power_of_two() || !(16..=4096).contains(&page) {
        return Err(ShapeError::new(
            "KV cache page size",
            "a power of two from 16 to 4096 positions",
            page.to_string(),
        ));
    }
    Ok(())
}

/// The page table of a decoder's caches: `[slots, max_pages]` u32 page ids in device memory,
/// entry `(s, i)` the page of slot `s`'s positions `i page .. (i + 1) page`. Every entry names a
/// page of the pool (unused ones a spare page), so no lookup leaves the pool.
#[derive(Debug)]
pub struct PageTable {
    pub buf: DeviceBuffer,
    pub slots: u32,
    pub max_pages: u32,
    /// Positions per page.
    pub page: u32,
    /// Pages in the pool the entries name.
    pub pages: u32,
    /// The entries as written (the device's once the queued copies land).
    host: std::sync::Mutex<Vec<u32>>,
}

impl PageTable {
    /// A table with every entry `fill`.
    pub fn new(
        rt: &Arc<Runtime>,
        slots: u32,
        max_pages: u32,
        page: u32,
        pages: u32,
        fill: u32,
    ) -> Result<Self> {
        check_page_size(page).map_err(Error::Shape)?;
        if slots == 0 || max_pages == 0 || fill >= pages {
            return Err(Error::Shape(ShapeError::new(
                "KV page table",
                "at least one slot and one page per slot, entries inside the pool",
                format!("{slots} slots x {max_pages} pages, fill {fill} of {pages} pages"),
            )));
        }
        let n = slots as usize * max_pages as usize;
        let buf = rt.alloc_unpooled(n * 4)?;
        let t = Self {
            buf,
            slots,
            max_pages,
            page,
            pages,
            host: std::sync::Mutex::new(vec![fill; n]),
        };
        // SAFETY: the table holds `n` entries.
        unsafe { rt.copy_htod(t.buf.ptr(), &words(&vec![fill; n])) }?;
        Ok(t)
    }

    /// A table of `slots` slots of `cap` positions whose pages are the pool's in the order of
    /// `order` (a permutation of `0 .. slots ceil(cap / page)`: slot `s`'s entry `i` is
    /// `order[s max_pages + i]`), so that a slot's positions lie on scattered pages (tests and
    /// benchmarks of the paged kernels).
    pub fn with_order(
        rt: &Arc<Runtime>,
        slots: u32,
        cap: u32,
        page: u32,
        order: &[u32],
    ) -> Result<Self> {
        check_page_size(page).map_err(Error::Shape)?;
        let max_pages = cap.div_ceil(page).max(1);
        let n = slots * max_pages;
        let mut sorted = order.to_vec();
        sorted.sort_unstable();
        if sorted != (0..n).collect::<Vec<_>>() {
            return Err(Error::Shape(ShapeError::new(
                "KV page order",
                format!("a permutation of 0 .. {n}"),
                format!("{} entries", order.len()),
            )));
        }
        let t = Self::new(rt, slots, max_pages, page, n, 0)?;
        // SAFETY: the table holds slots x max_pages entries.
        unsafe { rt.copy_htod(t.buf.ptr(), &words(order)) }?;
        t.host.lock().unwrap().copy_from_slice(order);
        Ok(t)
    }

    /// The pool row of (slot, kv head `h`, position `pos`) in a pool of `kv_heads` heads: the
    /// kernels' `kv_row`, from the entries as written.
    pub fn row(&self, kv_heads: u32, slot: u32, h: u32, pos: u32) -> u64 {
        let host = self.host.lock().unwrap();
        let page = host[(slot * self.max_pages + pos / self.page) as usize];
        (u64::from(page) * u64::from(kv_heads) + u64::from(h)) * u64::from(self.page)
            + u64::from(pos % self.page)
    }

    /// A contiguous table: slot `s` owns pages `s max_pages .. (s + 1) max_pages` of a pool of
    /// `slots max_pages` pages, enough for `cap` positions (a slot of the unpaged layout).
    pub fn contiguous(rt: &Arc<Runtime>, slots: u32, cap: u32, page: u32) -> Result<Self> {
        check_page_size(page).map_err(Error::Shape)?;
        let max_pages = cap.div_ceil(page).max(1);
        let t = Self::new(rt, slots, max_pages, page, slots * max_pages, 0)?;
        let ids: Vec<u32> = (0..slots * max_pages).collect();
        // SAFETY: the table holds slots x max_pages entries.
        unsafe { rt.copy_htod(t.buf.ptr(), &words(&ids)) }?;
        t.host.lock().unwrap().copy_from_slice(&ids);
        Ok(t)
    }

    /// Positions a slot reaches.
    pub fn cap(&self) -> u32 {
        self.max_pages * self.page
    }

    /// Writes slot `slot`'s entries from entry `first` on, stream-ordered (after the work queued
    /// so far, before the work queued next).
    pub fn write(&self, rt: &Runtime, slot: u32, first: u32, ids: &[u32]) -> Result<()> {
        if slot >= self.slots
            || first as usize + ids.len() > self.max_pages as usize
            || ids.iter().any(|&p| p >= self.pages)
        {
            return Err(Error::Shape(ShapeError::new(
                "KV page table entries",
                format!(
                    "slot < {}, entries inside {} pages per slot, pages < {}",
                    self.slots, self.max_pages, self.pages
                ),
                format!("slot {slot}, {} entries from {first}", ids.len()),
            )));
        }
        let first_entry = slot as usize * self.max_pages as usize + first as usize;
        self.host.lock().unwrap()[first_entry..first_entry + ids.len()].copy_from_slice(ids);
        // SAFETY: the range lies inside the table (checked above).
        unsafe { rt.copy_htod_async(self.buf.ptr() + first_entry as u64 * 4, &words(ids)) }
    }
}

fn words(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// One mirror's buffers: K and V rows, and their per-row f32 scales.
#[derive(Debug)]
pub struct Mirror {
    pub k: DeviceBuffer,
    pub v: DeviceBuffer,
    pub ks: DeviceBuffer,
    pub vs: DeviceBuffer,
}

/// One layer's KV cache: a pool of `pages` pages of `kv_heads` x `page` positions x `d` dims,
/// found through `table`.
#[derive(Debug)]
pub struct DeviceKvCache {
    /// The format decode attention reads: the BF16 main cache itself, or a mirror.
    pub format: KvFormat,
    pub kv_heads: u32,
    pub d: u32,
    /// Hadamard block of the mirror rows (0: not rotated).
    pub block: u32,
    pub k: DeviceBuffer,
    pub v: DeviceBuffer,
    pub mirror: Option<Mirror>,
    pub table: Arc<PageTable>,
}

impl DeviceKvCache {
    /// Allocates a zeroed pool of `table.pages` pages for `table`. `block` is the rotation block
    /// for the FP8/INT4 mirror (0 for none; ignored for BF16).
    pub fn new(
        rt: &Arc<Runtime>,
        format: KvFormat,
        (kv_heads, d): (u32, u32),
        block: u32,
        table: Arc<PageTable>,
    ) -> Result<Self> {
        check_shape(kv_heads, kv_heads, d, block).map_err(Error::Shape)?;
        let rows = table.pages as usize * kv_heads as usize * table.page as usize;
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
            kv_heads,
            d,
            block: if format == KvFormat::Bf16 { 0 } else { block },
            k: zeroed(rows * d_us * 2)?,
            v: zeroed(rows * d_us * 2)?,
            mirror,
            table,
        })
    }

    /// A cache of `slots` sequences of `cap` positions each, every slot on its own pages
    /// ([`PageTable::contiguous`], pages of 64 positions): the unpaged layout, for tests and
    /// benchmarks.
    pub fn contiguous(
        rt: &Arc<Runtime>,
        format: KvFormat,
        (slots, kv_heads, cap, d): (u32, u32, u32, u32),
        block: u32,
    ) -> Result<Self> {
        let table = PageTable::contiguous(rt, slots, cap, 64)?;
        Self::new(rt, format, (kv_heads, d), block, Arc::new(table))
    }

    /// The same cache with its slots' pages in the pool order `order` ([`PageTable::with_order`]).
    pub fn with_order(
        rt: &Arc<Runtime>,
        format: KvFormat,
        (slots, kv_heads, cap, d): (u32, u32, u32, u32),
        block: u32,
        page: u32,
        order: &[u32],
    ) -> Result<Self> {
        let table = PageTable::with_order(rt, slots, cap, page, order)?;
        Self::new(rt, format, (kv_heads, d), block, Arc::new(table))
    }

    /// The pool row of (slot, kv head `h`, position `pos`) ([`PageTable::row`]).
    pub fn row(&self, slot: u32, h: u32, pos: u32) -> u64 {
        self.table.row(self.kv_heads, slot, h, pos)
    }

    /// Sequence slots (rows of the page table).
    pub fn slots(&self) -> u32 {
        self.table.slots
    }

    /// Positions a slot reaches.
    pub fn cap(&self) -> u32 {
        self.table.cap()
    }

    /// Positions per page.
    pub fn page(&self) -> u32 {
        self.table.page
    }

    /// Bytes of one page of this cache (K and V, mirror included).
    pub fn page_bytes(format: KvFormat, kv_heads: u32, page: u32, d: u32) -> usize {
        let rows = kv_heads as usize * page as usize;
        let mirror = match format {
            KvFormat::Bf16 => 0,
            KvFormat::Fp8 => d as usize + 4,
            KvFormat::Int4 => d as usize / 2 + 4,
        };
        2 * rows * (2 * d as usize + mirror)
    }

    fn params(
        &self,
        k: &DeviceBuffer,
        v: &DeviceBuffer,
        scales: Option<(&DeviceBuffer, &DeviceBuffer)>,
        format: KvFormat,
    ) -> KvCacheParams {
        KvCacheParams {
            k: k.as_mut_ptr(),
            v: v.as_mut_ptr(),
            ks: scales.map_or(DevicePtrMut::NULL, |s| s.0.as_mut_ptr()),
            vs: scales.map_or(DevicePtrMut::NULL, |s| s.1.as_mut_ptr()),
            pages: self.table.buf.as_ptr(),
            kv_heads: self.kv_heads,
            page_shift: self.table.page.trailing_zeros(),
            d: self.d,
            format: format as u32,
            max_pages: self.table.max_pages,
            pad: 0,
        }
    }

    fn main_params(&self) -> KvCacheParams {
        self.params(&self.k, &self.v, None, KvFormat::Bf16)
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
            Some(m) => self.params(&m.k, &m.v, Some((&m.ks, &m.vs)), self.format),
        }
    }

    /// Queues the append of one step: row `b` of `k_new`/`v_new` (`[batch, kv_heads, d]` bf16)
    /// goes to slot `slot_of[b]` at position `pos[b]` (`[batch]` u32 device buffers) of the
    /// main cache and, rotated and quantized, of the mirror.
    ///
    /// # Safety
    /// The pointers must be valid device memory of those sizes until the kernel finishes, with
    /// every slot below [`Self::slots`] and every position below [`Self::cap`].
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
    /// every slot below [`Self::slots`] and every position below [`Self::cap`] and `max_pos`.
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
        if max_len > self.cap() {
            return Err(Error::Shape(crate::ShapeError::new(
                "decode attention max_len",
                format!("at most a slot's capacity {}", self.cap()),
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
        prefill_attention::check_seqs(seqs, rows, self.slots(), self.cap())
            .map_err(Error::Shape)?;
        let p = PrefillAttnParams {
            q,
            out,
            seqs: seqs_dev,
            cache: self.main_params(),
            n_seqs: seqs.len() as u32,
            heads,
            scale_log2: std::f32::consts::LOG2_E / (self.d as f32).sqrt(),
            pad: 0,
        };
        // SAFETY: the caller's guarantees; the pool is owned by self and every page-table entry
        // names one of its pages.
        unsafe { prefill_attention::prefill_attention(rt, &p, seqs, self.d) }
    }

    /// Bytes decode attention reads for `keys` cached tokens (K and V rows, scales included).
    pub fn bytes_read(&self, keys: usize) -> usize {
        2 * keys * self.kv_heads as usize * self.format.row_bytes(self.d as usize)
    }
}
