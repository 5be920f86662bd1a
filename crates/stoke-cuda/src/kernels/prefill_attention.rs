//! Causal prefill attention over packed variable-length sequences: params mirror and launch of
//! `kernels/prefill_attention.cu` (its header documents the algorithm).

use super::decode_attention::KvCacheParams;
use super::{EntryPoint, KernelParams, PREFILL_ATTENTION};
use crate::{DevicePtr, DevicePtrMut, LaunchShape, Result, Runtime, ShapeError};
use half::bf16;

/// `struct PrefillAttnParams` of kernels/prefill_attention.cu (104 bytes; the `.cu` file asserts
/// it).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PrefillAttnParams {
    /// `[rows, heads, d]` bf16 queries (RoPE applied).
    pub q: DevicePtr<bf16>,
    /// `[rows, heads, d]` bf16.
    pub out: DevicePtrMut<bf16>,
    /// `[n_seqs]` x [`PrefillSeq`].
    pub seqs: DevicePtr<PrefillSeq>,
    /// The BF16 main cache (its pages and page table).
    pub cache: KvCacheParams,
    pub n_seqs: u32,
    pub heads: u32,
    /// `log2(e) / sqrt(d)`.
    pub scale_log2: f32,
    pub pad: u32,
}

// SAFETY: the layout is the `.cu` struct's (asserted below); pointers of the kernel's types.
unsafe impl KernelParams for PrefillAttnParams {}

/// One sequence of a packed prefill batch (four u32, as the kernel reads them).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefillSeq {
    /// Its first row in the packed query and output tensors.
    pub first: u32,
    /// Its rows (tokens of this chunk).
    pub rows: u32,
    /// Its KV cache slot.
    pub slot: u32,
    /// The cache position of its first row (the tokens cached before this chunk).
    pub pos0: u32,
}

impl PrefillSeq {
    /// The descriptors as the little-endian bytes the kernel reads.
    pub fn bytes(seqs: &[PrefillSeq]) -> Vec<u8> {
        seqs.iter()
            .flat_map(|s| [s.first, s.rows, s.slot, s.pos0])
            .flat_map(u32::to_le_bytes)
            .collect()
    }
}

/// `kernels/prefill_attention.cu`.
pub const SOURCE: &str = include_str!("../../../../kernels/prefill_attention.cu");

/// Every `extern "C"` entry point in [`SOURCE`].
pub const ENTRY_POINTS: &[&str] = &["prefill_attn_bf16_d64", "prefill_attn_bf16_d128"];

/// Query rows per CTA and keys per tile (the kernel's `PA_BM`, `PA_BN`), and its threads.
const BM: u32 = 128;
const BN: u32 = 128;
const THREADS: u32 = 256;

/// Dynamic shared memory of the `d` kernel: the query tile, two key and two value tiles of
/// `d` bf16 a row, and 1024 bytes to align them for the swizzle.
pub fn shared_bytes(d: u32) -> u32 {
    (BM + 4 * BN) * d * 2 + 1024
}

/// Checks the shape of a call: head size 64 or 128, whole query-head groups per kv head.
pub fn check_shape(heads: u32, kv_heads: u32, d: u32) -> std::result::Result<(), ShapeError> {
    if d != 64 && d != 128 {
        return Err(ShapeError::new(
            "prefill attention head_dim",
            "64 or 128",
            d.to_string(),
        ));
    }
    if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(ShapeError::new(
            "prefill attention query heads per kv head",
            "a whole number",
            format!("{heads} query heads over {kv_heads} kv heads"),
        ));
    }
    Ok(())
}

/// Checks `seqs` against a cache of `slots` slots of `cap` positions (their page tables' reach)
/// and `rows` packed rows: each sequence's rows inside the packed tensors, its slot below
/// `slots`, its last position below `cap`.
pub fn check_seqs(
    seqs: &[PrefillSeq],
    rows: u32,
    slots: u32,
    cap: u32,
) -> std::result::Result<(), ShapeError> {
    for (i, s) in seqs.iter().enumerate() {
        let end = u64::from(s.first) + u64::from(s.rows);
        let last = u64::from(s.pos0) + u64::from(s.rows);
        if end > u64::from(rows) || s.slot >= slots || last > u64::from(cap) {
            return Err(ShapeError::new(
                "prefill attention sequence",
                format!("rows inside the {rows} packed rows, slot < {slots}, positions < {cap}"),
                format!("sequence {i}: {s:?}"),
            ));
        }
    }
    Ok(())
}

/// Queues causal attention of every sequence in `p.seqs` (`seqs`: the same descriptors on the
/// host, for the grid and the checks).
///
/// # Safety
/// The pointers must be valid device memory of the documented sizes until the kernel is done;
/// `p.seqs` must hold `seqs`; `d` must be the cache's head size.
pub unsafe fn prefill_attention(
    rt: &Runtime,
    p: &PrefillAttnParams,
    seqs: &[PrefillSeq],
    d: u32,
) -> Result<()> {
    check_shape(p.heads, p.cache.kv_heads, d)?;
    let longest = seqs.iter().map(|s| s.rows).max().unwrap_or(0);
    if longest == 0 {
        return Ok(());
    }
    let name = if d == 64 {
        "prefill_attn_bf16_d64"
    } else {
        "prefill_attn_bf16_d128"
    };
    let k = rt.kernel(EntryPoint::<PrefillAttnParams>::new(
        &PREFILL_ATTENTION,
        name,
    ))?;
    let shape = LaunchShape {
        grid: (longest.div_ceil(BM), p.heads, seqs.len() as u32),
        block: (THREADS, 1, 1),
        shared_mem_bytes: shared_bytes(d),
    };
    // SAFETY: the caller's guarantees; the params match the entry point.
    unsafe { rt.launch(&k, shape, p) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_c() {
        assert_eq!(std::mem::size_of::<PrefillAttnParams>(), 104);
        assert!(SOURCE.contains("static_assert(sizeof(PrefillAttnParams) == 104"));
        assert!(SOURCE.contains(&format!("PA_BM = {BM};")));
        assert!(SOURCE.contains(&format!("PA_BN = {BN};")));
        assert!(SOURCE.contains(&format!("PA_WARPS = {};", THREADS / 32)));
        assert!(SOURCE.contains("BYTES = PA_BM * D * 2 + 4 * TILE + 1024"));
    }

    #[test]
    fn sequences_outside_the_cache_are_refused() {
        let s = |first, rows, slot, pos0| PrefillSeq {
            first,
            rows,
            slot,
            pos0,
        };
        assert!(check_seqs(&[s(0, 5, 0, 0), s(5, 3, 1, 10)], 8, 2, 16).is_ok());
        assert!(check_seqs(&[s(0, 5, 0, 0), s(5, 4, 1, 0)], 8, 2, 16).is_err());
        assert!(check_seqs(&[s(0, 5, 2, 0)], 8, 2, 16).is_err());
        assert!(check_seqs(&[s(0, 5, 0, 12)], 8, 2, 16).is_err());
        assert!(check_shape(9, 3, 64).is_ok());
        assert!(check_shape(9, 2, 64).is_err());
        assert!(check_shape(8, 2, 96).is_err());
        assert_eq!(
            PrefillSeq::bytes(&[s(1, 2, 3, 4)]),
            [1u32, 2, 3, 4]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<_>>()
        );
    }
}
