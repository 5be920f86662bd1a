//! Decode attention and KV-cache append: params mirrors and launch plan for
//! `kernels/decode_attention.cu` (its header documents the formats, the algorithm and why it is
//! built that way; `kernels/decode_attention.cuh` holds its building blocks).

use super::{DECODE_ATTENTION, EntryPoint, KernelParams};
use crate::{DevicePtr, DevicePtrMut};
use half::bf16;

/// `struct KvCache` in `kernels/kv_row.cuh`: a pool of pages of `2^page_shift` positions (the
/// cache rows as bytes: bf16 values, FP8 codes or INT4 nibbles by `format`; the mirrors' per-row
/// scales) and the page table of its slots, `[slots, max_pages]` page ids.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct KvCacheParams {
    pub k: DevicePtrMut<u8>,
    pub v: DevicePtrMut<u8>,
    pub ks: DevicePtrMut<f32>,
    pub vs: DevicePtrMut<f32>,
    pub pages: DevicePtr<u32>,
    pub kv_heads: u32,
    pub page_shift: u32,
    pub d: u32,
    pub format: u32,
    pub max_pages: u32,
    pub pad: u32,
}

/// `struct AppendParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AppendParams {
    pub k_new: DevicePtr<bf16>,
    pub v_new: DevicePtr<bf16>,
    pub slot_of: DevicePtr<u32>,
    pub pos: DevicePtr<u32>,
    pub main: KvCacheParams,
    pub mirror: KvCacheParams,
    pub batch: u32,
    pub block: u32,
}

/// `struct AttnParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnParams {
    pub q: DevicePtr<bf16>,
    pub slot_of: DevicePtr<u32>,
    pub len: DevicePtr<u32>,
    pub cache: KvCacheParams,
    pub part_o: DevicePtrMut<f32>,
    pub part_ml: DevicePtrMut<f32>,
    pub out: DevicePtrMut<bf16>,
    pub arrived: DevicePtrMut<u32>,
    pub batch: u32,
    pub heads: u32,
    pub splits: u32,
    pub chunk: u32,
    pub block: u32,
    pub scale: f32,
}

/// `struct RopeAppendParams`: RoPE on a q|k|v projection's output and the cache append of its
/// k and v heads, in one launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RopeAppendParams {
    pub qkv: DevicePtr<bf16>,
    pub q_out: DevicePtrMut<bf16>,
    pub rope: DevicePtr<f32>,
    pub slot_of: DevicePtr<u32>,
    pub pos: DevicePtr<u32>,
    pub len: DevicePtrMut<u32>,
    pub main: KvCacheParams,
    pub mirror: KvCacheParams,
    pub batch: u32,
    pub heads: u32,
    pub block: u32,
    pub max_pos: u32,
}

// SAFETY: the layouts are the `.cu` structs' (asserted in `params_layout_matches_c`).
unsafe impl KernelParams for AppendParams {}
unsafe impl KernelParams for RopeAppendParams {}
unsafe impl KernelParams for AttnParams {}

/// `kernels/decode_attention.cu`, compiled with NVRTC (with `decode_attention.cuh` and
/// `ptx.cuh` and `decode_attention.cuh` written in place of their includes).
pub const SOURCE: &str = include_str!("../../../../kernels/decode_attention.cu");

/// Every `extern "C"` entry point in [`SOURCE`].
pub const ENTRY_POINTS: &[&str] = &[
    "kv_append",
    "rope_append",
    "decode_attn_bf16_d64",
    "decode_attn_bf16_d128",
    "decode_attn_fp8_d64",
    "decode_attn_fp8_d128",
    "decode_attn_int4_d64",
    "decode_attn_int4_d128",
    "decode_attn_bf16_d64_cl",
    "decode_attn_bf16_d128_cl",
    "decode_attn_fp8_d64_cl",
    "decode_attn_fp8_d128_cl",
    "decode_attn_int4_d64_cl",
    "decode_attn_int4_d128_cl",
];

/// A cache format (the `FMT_*` values of the `.cu` file).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvFormat {
    Bf16 = 0,
    Fp8 = 1,
    Int4 = 2,
}

impl KvFormat {
    pub fn name(self) -> &'static str {
        match self {
            KvFormat::Bf16 => "bf16",
            KvFormat::Fp8 => "fp8",
            KvFormat::Int4 => "int4",
        }
    }

    /// Bytes of one cache row of `d` values (K or V), its scale included.
    pub fn row_bytes(self, d: usize) -> usize {
        match self {
            KvFormat::Bf16 => 2 * d,
            KvFormat::Fp8 => d + 4,
            KvFormat::Int4 => d / 2 + 4,
        }
    }
}

/// Most query heads one attention CTA serves (`MAX_GROUP`): the 8 columns of its tensor-core
/// tiles. A larger group is served by [`head_ctas`] CTAs of 8 heads each.
pub const MAX_GROUP: u32 = 8;

pub use crate::ShapeError;

/// Checks an attention shape: head dim 64 or 128, heads a multiple of kv heads, at most
/// [`MAX_GROUP`] query heads per kv head or a multiple of it (Llama-3.1-405B: 16), rotation
/// block 0 or a power of two in 2..=d.
pub fn check_shape(heads: u32, kv_heads: u32, d: u32, block: u32) -> Result<(), ShapeError> {
    check_head_dim("decode attention", d)?;
    let group = heads.checked_div(kv_heads).unwrap_or(0);
    if kv_heads == 0
        || group == 0
        || !heads.is_multiple_of(kv_heads)
        || (group > MAX_GROUP && !group.is_multiple_of(MAX_GROUP))
    {
        return Err(ShapeError::new(
            "decode attention query heads per kv head",
            format!("a whole group of at most {MAX_GROUP}, or a multiple of {MAX_GROUP}"),
            format!("{heads} query heads over {kv_heads} kv heads"),
        ));
    }
    check_block("decode attention", d, block)
}

/// The attention grid's head CTAs for a checked shape ([`check_shape`]): one per kv head whose
/// group is at most [`MAX_GROUP`], else `group / MAX_GROUP` per kv head, each of 8 query heads
/// reading the kv head's cache rows (the kernel's `head_cta`).
pub fn head_ctas(heads: u32, kv_heads: u32) -> u32 {
    kv_heads * (heads / kv_heads).div_ceil(MAX_GROUP)
}

/// The cache rows' head dim, for `what` (the kernels that read or write them): 64 or 128.
pub fn check_head_dim(what: &str, d: u32) -> Result<(), ShapeError> {
    if d != 64 && d != 128 {
        return Err(ShapeError::new(
            format!("{what} head_dim"),
            "64 or 128",
            d.to_string(),
        ));
    }
    Ok(())
}

/// The mirror rows' rotation block, for `what`: 0 (none), or a power of two from 2 to `d`.
pub fn check_block(what: &str, d: u32, block: u32) -> Result<(), ShapeError> {
    if block != 0 && (!block.is_power_of_two() || block < 2 || block > d) {
        return Err(ShapeError::new(
            format!("{what} rotation block"),
            format!("0, or a power of two from 2 to head_dim {d}"),
            block.to_string(),
        ));
    }
    Ok(())
}

/// Keys per split-KV CTA for `batch` sequences of `head_ctas` CTAs each ([`head_ctas`]) and
/// contexts up to `max_len`: returns (chunk, splits), chunks a
/// multiple of 64 keys (one 16-key tile per warp). The time is modeled as waves of resident CTAs
/// times the keys of one CTA plus [`SPLIT_OVERHEAD_KEYS`] (its query setup and partials; none
/// where `clustered(splits)`: the splits merge through distributed shared memory, no partials
/// in global memory); the split count with the least time wins, the fewer splits on a tie. At
/// batch 1 and long contexts this fills the GPU's resident slots as nearly as the chunk
/// rounding allows (8 kv heads, 32k keys: 32 splits of 1024, 256 of 264 CTAs); at batch 32 and
/// 4k keys, one split; at batch 1 and 1k keys 8 clustered splits of 128 where clusters of 8 are
/// resident (16 of 64 without).
pub fn split_plan(
    batch: u32,
    head_ctas: u32,
    max_len: u32,
    sm_count: u32,
    ctas_per_sm: u32,
    clustered: &dyn Fn(u32) -> bool,
) -> (u32, u32) {
    let len = max_len.max(1);
    let base = u64::from(batch.max(1) * head_ctas.max(1));
    let slots = u64::from(ctas_per_sm.max(1) * sm_count.max(1));
    let mut best = (u64::MAX, 64, len.div_ceil(64));
    // Splits past two waves' worth only add overhead.
    let most = (2 * slots / base + 1).min(u64::from(len.div_ceil(64))) as u32;
    for want in 1..=most {
        let chunk = len.div_ceil(want).next_multiple_of(64);
        let splits = len.div_ceil(chunk);
        let waves = (base * u64::from(splits)).div_ceil(slots);
        let overhead = if clustered(splits) {
            0
        } else {
            SPLIT_OVERHEAD_KEYS
        };
        let cost = waves * u64::from(chunk + overhead);
        if cost < best.0 {
            best = (cost, chunk, splits);
        }
    }
    (best.1, best.2)
}

/// A forced split count (benchmarks and tests): `splits` chunks of `ceil(max_len / splits)` keys
/// rounded up to a whole 16-key tile, fewer if that already covers `max_len`; returns (chunk,
/// splits) as [`split_plan`] does.
pub fn forced_split(max_len: u32, splits: u32) -> (u32, u32) {
    let len = max_len.max(1);
    let chunk = len.div_ceil(splits.max(1)).next_multiple_of(16);
    (chunk, len.div_ceil(chunk))
}

/// What one split-KV CTA costs beyond its keys (loading and rotating its queries, writing and
/// merging partials), in keys' worth of time: a tie-breaker toward fewer splits.
pub const SPLIT_OVERHEAD_KEYS: u32 = 64;

fn named(name: String) -> &'static str {
    ENTRY_POINTS
        .iter()
        .find(|e| **e == name)
        .copied()
        .unwrap_or_else(|| panic!("{name} is not a decode-attention entry point"))
}

/// The attention entry point of a cache format and head dim (64 or 128; [`check_shape`]).
pub fn attn_entry(format: KvFormat, d: u32) -> &'static str {
    named(format!("decode_attn_{}_d{d}", format.name()))
}

/// The entry point of a cache format and head dim whose split launches are clusters of their
/// 2-8 splits (`<entry>_cl`), merging through distributed shared memory.
pub fn attn_cluster_entry(format: KvFormat, d: u32) -> &'static str {
    named(format!("decode_attn_{}_d{d}_cl", format.name()))
}

/// The cache append's entry point.
pub fn append_entry_point() -> EntryPoint<AppendParams> {
    EntryPoint::new(&DECODE_ATTENTION, "kv_append")
}

/// The RoPE-and-append entry point.
pub fn rope_append_entry_point() -> EntryPoint<RopeAppendParams> {
    EntryPoint::new(&DECODE_ATTENTION, "rope_append")
}

/// An attention entry point ([`attn_entry`] or [`attn_cluster_entry`]).
pub fn attn_entry_point(name: &'static str) -> EntryPoint<AttnParams> {
    assert!(
        name.starts_with("decode_attn_"),
        "{name} is not an attention entry point"
    );
    EntryPoint::new(&DECODE_ATTENTION, name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_c() {
        assert_eq!(std::mem::size_of::<KvCacheParams>(), 64);
        assert_eq!(std::mem::size_of::<AppendParams>(), 168);
        assert_eq!(std::mem::size_of::<AttnParams>(), 144);
        assert_eq!(std::mem::size_of::<RopeAppendParams>(), 192);
        for (name, size) in [
            ("KvCache", 64),
            ("AppendParams", 168),
            ("AttnParams", 144),
            ("RopeAppendParams", 192),
        ] {
            assert!(
                SOURCE.contains(&format!("static_assert(sizeof({name}) == {size}")),
                "{name}"
            );
        }
    }

    #[test]
    fn entries_are_defined_and_indexed() {
        // No includes but the shared headers, which the compile writes in place.
        assert!(!crate::kernels::expand_includes(SOURCE).contains("#include"));
        for e in ENTRY_POINTS {
            // DECODE_ATTN_ENTRY(NAME, ...) defines NAME and NAME_cl.
            let base = e.strip_suffix("_cl").unwrap_or(e);
            assert!(
                SOURCE.contains(&format!("{e}(")) || SOURCE.contains(&format!("ENTRY({base},")),
                "{e}"
            );
        }
        assert!(SOURCE.contains("NAME##_cl(const AttnParams p)"));
        for (f, name) in [
            (KvFormat::Bf16, "bf16"),
            (KvFormat::Fp8, "fp8"),
            (KvFormat::Int4, "int4"),
        ] {
            for d in [64, 128] {
                assert_eq!(attn_entry(f, d), format!("decode_attn_{name}_d{d}"));
                assert_eq!(
                    attn_cluster_entry(f, d),
                    format!("decode_attn_{name}_d{d}_cl")
                );
            }
        }
    }

    #[test]
    fn splits_cover_the_context_and_fill_the_gpu() {
        for (b, kvh, len) in [
            (1, 8, 1024),
            (8, 8, 1024),
            (32, 8, 4096),
            (1, 8, 32768),
            (1, 3, 1),
            (3, 1, 4097),
        ] {
            for clusters in [false, true] {
                let (chunk, splits) =
                    split_plan(b, kvh, len, 132, 2, &|s| clusters && (2..=8).contains(&s));
                assert!(
                    chunk % 64 == 0 && chunk * splits >= len && chunk * (splits - 1) < len.max(1)
                );
            }
        }
        let none = |_| false;
        // Clusters of 2-8 splits that fit when the whole grid is resident at once (2 CTAs per SM).
        let fit = |b: u32| move |s: u32| (2..=8).contains(&s) && 8 * b * s <= 264;
        // One wave, as full as the chunk rounding allows; one split where batch x kv heads
        // already fill the GPU; the finest split for short contexts.
        assert_eq!(split_plan(1, 8, 32768, 132, 2, &none), (1024, 32));
        assert_eq!(split_plan(32, 8, 4096, 132, 2, &none), (4096, 1));
        assert_eq!(split_plan(8, 8, 1024, 132, 2, &none), (256, 4));
        assert_eq!(split_plan(1, 8, 1024, 132, 2, &none), (64, 16));
        assert_eq!(split_plan(1, 3, 1, 132, 2, &none), (64, 1));
        // Clustered splits (no partials): 8 of 128 keys instead of 16 of 64 at batch 1, ctx
        // 1024; the others as before.
        assert_eq!(split_plan(1, 8, 1024, 132, 2, &fit(1)), (128, 8));
        assert_eq!(split_plan(8, 8, 1024, 132, 2, &fit(8)), (256, 4));
        assert_eq!(split_plan(1, 8, 32768, 132, 2, &fit(1)), (1024, 32));
        assert_eq!(split_plan(32, 8, 4096, 132, 2, &fit(32)), (4096, 1));
        assert_eq!(forced_split(4097, 70), (64, 65));
        assert_eq!(forced_split(32768, 24), (1376, 24));
        assert_eq!(forced_split(17, 0), (32, 1));
    }

    #[test]
    fn bad_shapes_are_named() {
        assert!(check_shape(32, 8, 128, 128).is_ok());
        assert!(check_shape(9, 3, 64, 64).is_ok());
        let e = check_shape(32, 8, 96, 0).unwrap_err();
        assert!(e.what.contains("head_dim") && e.got == "96", "{e}");
        // 405B's 16 heads per kv head: two CTAs of 8 per kv head.
        assert!(check_shape(128, 8, 128, 128).is_ok());
        assert_eq!(head_ctas(128, 8), 16);
        assert_eq!(head_ctas(32, 8), 8);
        assert_eq!(head_ctas(9, 3), 3);
        let e = check_shape(48, 4, 128, 0).unwrap_err();
        assert!(e.got.contains("48 query heads over 4"), "{e}");
        assert!(check_shape(8, 0, 128, 0).is_err() && check_shape(4, 8, 128, 0).is_err());
        let e = check_shape(32, 8, 128, 48).unwrap_err();
        assert!(e.what.contains("rotation block") && e.got == "48", "{e}");
    }
}
