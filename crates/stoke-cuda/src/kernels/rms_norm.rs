//! RMSNorm kernels: params mirror and launch rule for kernels/rms_norm.cu
//!
//! `out = s * rsqrt(mean(s^2) + eps) * gamma` per row, with `s = x` (`rms_norm_*`) or
//! `s = x + residual`, also stored to `sum_out` (`residual_rms_norm_*`). Math is f32; bf16 is
//! rounded to nearest even once on store, and the bf16 residual op normalizes the rounded sum, so
//! `out == rms_norm(sum_out)` exactly. The `.cu` file's header documents each entry point.

use super::{EntryPoint, KernelParams, RMS_NORM};
use crate::{DevicePtr, DevicePtrMut};

/// The kernels' single argument, passed by value, for elements of type `T` (`f32` or
/// `half::bf16`: the `_f32` and `_bf16` entry points). Mirrors `struct RmsNormParams` in
/// `kernels/rms_norm.cu` field for field: five 64-bit device pointers, then `rows`, `hidden`,
/// `eps`; 52 bytes of fields, padded to 56 (the `.cu` file asserts `sizeof == 56`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RmsNormParams<T> {
    /// `[rows, hidden]`, row-major contiguous.
    pub x: DevicePtr<T>,
    /// `[rows, hidden]`; required by the residual entry points, ignored (may be null) otherwise.
    pub residual: DevicePtr<T>,
    /// `[hidden]`, same dtype as `x`.
    pub gamma: DevicePtr<T>,
    /// `[rows, hidden]`. May equal `x`.
    pub out: DevicePtrMut<T>,
    /// `[rows, hidden]`: `x + residual`, written by the residual entry points only. May equal
    /// `x` or `residual`; must not overlap `out`.
    pub sum_out: DevicePtrMut<T>,
    pub rows: u32,
    pub hidden: u32,
    pub eps: f32,
}

/// An element type the RMSNorm kernels take.
pub trait RmsElem: Copy + Send + 'static {
    const ELEM: ElemType;
}
impl RmsElem for f32 {
    const ELEM: ElemType = ElemType::F32;
}
impl RmsElem for half::bf16 {
    const ELEM: ElemType = ElemType::Bf16;
}

// SAFETY: the layout is the `.cu` struct's (asserted in the tests below) and the pointers are
// of the entry point's element type.
unsafe impl<T: RmsElem> KernelParams for RmsNormParams<T> {}

/// The entry point a [`launch`] rule chose, for elements `T`.
///
/// # Panics
/// If `name` is not an RMSNorm entry point for `T` (the launch rule was asked for another dtype).
pub fn entry_point<T: RmsElem>(name: &'static str) -> EntryPoint<RmsNormParams<T>> {
    assert!(
        ENTRY_POINTS.contains(&name) && name.contains(&format!("_{}", T::ELEM.name())),
        "{name} is not an RMSNorm entry point for {}",
        T::ELEM.name()
    );
    EntryPoint::new(&RMS_NORM, name)
}

/// `kernels/rms_norm.cu`, compiled with NVRTC (no include path needed).
pub const SOURCE: &str = include_str!("../../../../kernels/rms_norm.cu");

/// Every `extern "C"` entry point in [`SOURCE`].
pub const ENTRY_POINTS: &[&str] = &[
    "rms_norm_f32",
    "rms_norm_f32_warp",
    "rms_norm_f32_block",
    "rms_norm_f32_twopass",
    "rms_norm_f32_warp_lat",
    "rms_norm_f32_block_lat",
    "rms_norm_bf16",
    "rms_norm_bf16_warp",
    "rms_norm_bf16_block",
    "rms_norm_bf16_twopass",
    "rms_norm_bf16_warp_lat",
    "rms_norm_bf16_block_lat",
    "residual_rms_norm_f32",
    "residual_rms_norm_f32_warp",
    "residual_rms_norm_f32_block",
    "residual_rms_norm_f32_twopass",
    "residual_rms_norm_f32_warp_lat",
    "residual_rms_norm_f32_block_lat",
    "residual_rms_norm_bf16",
    "residual_rms_norm_bf16_warp",
    "residual_rms_norm_bf16_block",
    "residual_rms_norm_bf16_twopass",
    "residual_rms_norm_bf16_warp_lat",
    "residual_rms_norm_bf16_block_lat",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemType {
    F32,
    Bf16,
}

impl ElemType {
    pub fn size_bytes(self) -> u32 {
        match self {
            ElemType::F32 => 4,
            ElemType::Bf16 => 2,
        }
    }

    /// Elements per 16-byte vector.
    pub fn per_vector(self) -> u32 {
        16 / self.size_bytes()
    }

    /// The dtype as it appears in entry point names: `f32`, `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            ElemType::F32 => "f32",
            ElemType::Bf16 => "bf16",
        }
    }

    /// 16-byte packs each lane of a `_warp` kernel holds (`kWarpPacks` in the `.cu` file).
    fn warp_packs(self) -> u32 {
        match self {
            ElemType::F32 => 5,
            ElemType::Bf16 => 4,
        }
    }
}

/// 16-byte packs each thread of a `_block` kernel holds (`kBlockPacks` in the `.cu` file).
pub const BLOCK_PACKS: u32 = 4;
/// Most threads in one CTA (every entry point is compiled for up to this many).
pub const MAX_THREADS: u32 = 1024;
/// Threads per CTA of the `_twopass` kernels.
pub const TWOPASS_THREADS: u32 = 512;
/// Most threads per CTA of the unvectorized fallback.
pub const FALLBACK_MAX_THREADS: u32 = 512;
/// Most rows (warps) per CTA of the `_warp` kernels.
pub const WARP_MAX_ROWS_PER_CTA: u32 = 4;
/// Largest grid.x the launch rule returns. The kernels stride over rows, so a capped grid still
/// covers every row.
pub const GRID_MAX: u32 = i32::MAX as u32;

/// One kernel launch: entry point name, grid, block and dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub entry: &'static str,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

impl Launch {
    /// Rows one CTA handles per pass over the grid (the kernels stride by the whole grid).
    pub fn rows_per_cta(&self) -> u32 {
        self.block.1
    }
}

/// Entry point suffixes, by `Variant` discriminant.
pub const VARIANT_SUFFIXES: [&str; 6] =
    ["", "_warp", "_block", "_twopass", "_warp_lat", "_block_lat"];

#[derive(Clone, Copy)]
enum Variant {
    Fallback = 0,
    Warp = 1,
    Block = 2,
    TwoPass = 3,
    WarpLat = 4,
    BlockLat = 5,
}

/// The entry point `OP_DT<suffix>` (OP `rms_norm` or `residual_rms_norm`, DT the element type).
fn entry(elem: ElemType, residual: bool, variant: Variant) -> &'static str {
    let name = format!(
        "{}rms_norm_{}{}",
        if residual { "residual_" } else { "" },
        elem.name(),
        VARIANT_SUFFIXES[variant as usize]
    );
    ENTRY_POINTS
        .iter()
        .find(|e| **e == name)
        .expect("every op, dtype and variant has an entry point")
}

fn round_up(v: u32, m: u32) -> u32 {
    v.div_ceil(m) * m
}

fn grid_x(ctas: u32) -> u32 {
    ctas.clamp(1, GRID_MAX)
}

/// Chooses the entry point and launch shape; `aligned` = all pointers 16-byte aligned.
///
/// With `V = 16 / elem size` and `nvec = hidden / V`:
/// - not `aligned`, or `hidden % V != 0`: the unvectorized two-pass fallback `OP_DT`, one CTA
///   per row, `round_up(ceil(hidden / 4), 32)` threads clamped to `32..=512`;
/// - `nvec <= 32 * warp_packs` (hidden <= 640 for f32, <= 1024 for bf16): `OP_DT_warp`, one warp
///   per row, block `(32, W, 1)` with `W` the largest of 4, 2, 1 that still gives at least
///   `2 * sm_count` CTAs (else 1), grid `ceil(rows / W)`;
/// - `nvec <= 1024 * 4` (hidden <= 16384 for f32, <= 32768 for bf16): `OP_DT_block`, one CTA per
///   row, `round_up(ceil(nvec / 4), 32)` threads;
/// - larger: `OP_DT_twopass`, one CTA of 512 threads per row, reading the row twice.
///
/// The `_warp` and `_block` choices become `_warp_lat` / `_block_lat` (gamma loaded with the
/// row: one memory round trip instead of two) when the grid has at most one CTA per SM, i.e.
/// when latency, not bandwidth, bounds the kernel.
///
/// `rows == 0` gives a one-CTA grid that does nothing. No entry point uses dynamic shared memory.
pub fn launch(
    elem: ElemType,
    residual: bool,
    rows: u32,
    hidden: u32,
    aligned: bool,
    sm_count: u32,
) -> Launch {
    let v = elem.per_vector();
    if !aligned || !hidden.is_multiple_of(v) {
        let threads = round_up(hidden.div_ceil(4), 32).clamp(32, FALLBACK_MAX_THREADS);
        return Launch {
            entry: entry(elem, residual, Variant::Fallback),
            grid: (grid_x(rows), 1, 1),
            block: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
    }
    let nvec = hidden / v;
    if nvec <= 32 * elem.warp_packs() {
        let want_ctas = 2 * sm_count.max(1);
        let mut w = WARP_MAX_ROWS_PER_CTA;
        while w > 1 && rows.div_ceil(w) < want_ctas {
            w /= 2;
        }
        let ctas = rows.div_ceil(w);
        let variant = if ctas <= sm_count {
            Variant::WarpLat
        } else {
            Variant::Warp
        };
        return Launch {
            entry: entry(elem, residual, variant),
            grid: (grid_x(ctas), 1, 1),
            block: (32, w, 1),
            shared_mem_bytes: 0,
        };
    }
    if nvec <= MAX_THREADS * BLOCK_PACKS {
        let threads = round_up(nvec.div_ceil(BLOCK_PACKS), 32);
        let variant = if rows <= sm_count {
            Variant::BlockLat
        } else {
            Variant::Block
        };
        return Launch {
            entry: entry(elem, residual, variant),
            grid: (grid_x(rows), 1, 1),
            block: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
    }
    Launch {
        entry: entry(elem, residual, Variant::TwoPass),
        grid: (grid_x(rows), 1, 1),
        block: (TWOPASS_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200_SMS: u32 = 132;

    const ROWS: &[u32] = &[0, 1, 2, 3, 31, 32, 33, 264, 2048, 16384, 1 << 20, u32::MAX];
    const HIDDENS: &[u32] = &[
        0, 1, 2, 3, 4, 7, 8, 9, 15, 16, 64, 511, 512, 576, 577, 640, 644, 648, 1024, 1032, 2048,
        4096, 4100, 8192, 16384, 16388, 32768, 32776, 65536, 1_048_576,
    ];
    const SMS: &[u32] = &[0, 1, H200_SMS];

    fn all_cases() -> Vec<(ElemType, bool, u32, u32, bool, u32)> {
        let mut v = Vec::new();
        for elem in [ElemType::F32, ElemType::Bf16] {
            for residual in [false, true] {
                for &rows in ROWS {
                    for &hidden in HIDDENS {
                        for aligned in [true, false] {
                            for &sms in SMS {
                                v.push((elem, residual, rows, hidden, aligned, sms));
                            }
                        }
                    }
                }
            }
        }
        v
    }

    #[test]
    fn params_layout_matches_c() {
        // static_assert(sizeof(RmsNormParams) == 56) in kernels/rms_norm.cu.
        assert_eq!(std::mem::size_of::<RmsNormParams<f32>>(), 56);
        assert_eq!(std::mem::align_of::<RmsNormParams<f32>>(), 8);
        assert_eq!(std::mem::offset_of!(RmsNormParams<f32>, x), 0);
        assert_eq!(std::mem::offset_of!(RmsNormParams<f32>, residual), 8);
        assert_eq!(std::mem::offset_of!(RmsNormParams<f32>, gamma), 16);
        assert_eq!(std::mem::offset_of!(RmsNormParams<f32>, out), 24);
        assert_eq!(std::mem::offset_of!(RmsNormParams<f32>, sum_out), 32);
        assert_eq!(std::mem::offset_of!(RmsNormParams<f32>, rows), 40);
        assert_eq!(std::mem::offset_of!(RmsNormParams<f32>, hidden), 44);
        assert_eq!(std::mem::offset_of!(RmsNormParams<f32>, eps), 48);
        assert!(SOURCE.contains("static_assert(sizeof(RmsNormParams) == 56"));
    }

    #[test]
    fn source_is_self_contained_and_instantiates_every_entry() {
        for line in SOURCE.lines() {
            assert!(
                !line.trim_start().starts_with("#include") || line.trim() == "#include \"ptx.cuh\"",
                "kernels/rms_norm.cu must include nothing but ptx.cuh: {}",
                line
            );
        }
        // The entry points are stamped out by RMS_NORM_ENTRIES(OP, DT, ...) with the
        // suffixes of VARIANT_SUFFIXES.
        for op in ["rms_norm", "residual_rms_norm"] {
            for dt in ["f32", "bf16"] {
                let inst = format!("RMS_NORM_ENTRIES({op}, {dt},");
                assert!(SOURCE.contains(&inst), "missing {}", inst);
                for suffix in VARIANT_SUFFIXES {
                    let name = format!("{op}_{dt}{suffix}");
                    assert!(
                        ENTRY_POINTS.contains(&name.as_str()),
                        "{} not in ENTRY_POINTS",
                        name
                    );
                }
            }
        }
        for suffix in [
            "_warp(",
            "_block(",
            "_twopass(",
            "_warp_lat(",
            "_block_lat(",
            "OP##_##DT(",
        ] {
            assert!(SOURCE.contains(suffix), "macro lacks {}", suffix);
        }
        assert_eq!(ENTRY_POINTS.len(), 24);
        // The order entry() indexes by.
        for (r, op) in ["rms_norm", "residual_rms_norm"].iter().enumerate() {
            for (d, elem) in [ElemType::F32, ElemType::Bf16].iter().enumerate() {
                for (v, suffix) in VARIANT_SUFFIXES.iter().enumerate() {
                    assert_eq!(
                        ENTRY_POINTS[r * 12 + d * 6 + v],
                        format!("{op}_{}{suffix}", elem.name())
                    );
                }
            }
        }
        let mut sorted = ENTRY_POINTS.to_vec();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), ENTRY_POINTS.len());
    }

    fn gx_of(l: &Launch) -> u32 {
        l.grid.0
    }

    #[test]
    fn every_launch_is_valid() {
        for (elem, residual, rows, hidden, aligned, sms) in all_cases() {
            let l = launch(elem, residual, rows, hidden, aligned, sms);
            let ctx = format!(
                "{elem:?} residual={residual} rows={rows} hidden={hidden} aligned={aligned} sms={sms}: {l:?}"
            );
            assert!(ENTRY_POINTS.contains(&l.entry), "{}", ctx);
            let op = if residual {
                "residual_rms_norm_"
            } else {
                "rms_norm_"
            };
            assert!(l.entry.starts_with(op), "{}", ctx);
            if !residual {
                assert!(!l.entry.starts_with("residual"), "{}", ctx);
            }
            let dt = match elem {
                ElemType::F32 => "f32",
                ElemType::Bf16 => "bf16",
            };
            assert!(l.entry[op.len()..].starts_with(dt), "{}", ctx);

            // Block shape: whole warps, within the compiled bounds.
            let (bx, by, bz) = l.block;
            assert!(bx > 0 && bx % 32 == 0, "{}", ctx);
            assert_eq!(bz, 1, "{}", ctx);
            let threads = bx * by;
            let is_warp = l.entry.ends_with("_warp") || l.entry.ends_with("_warp_lat");
            let is_block = l.entry.ends_with("_block") || l.entry.ends_with("_block_lat");
            if l.entry.ends_with("_lat") {
                // Latency variants only for grids of at most one CTA per SM.
                assert!(gx_of(&l) <= sms.max(1) || gx_of(&l) == 1, "{}", ctx);
            }
            if is_warp {
                assert_eq!(bx, 32, "{}", ctx);
                assert!((1..=WARP_MAX_ROWS_PER_CTA).contains(&by), "{}", ctx);
                assert!(threads <= 256, "{}", ctx); // __launch_bounds__(256, 1)
            } else {
                assert_eq!(by, 1, "{}", ctx);
                assert!(threads <= MAX_THREADS, "{}", ctx);
            }

            // Grid: at least one CTA; covers every row in one pass unless capped (the kernels
            // stride over rows, so a capped grid is still complete).
            let (gx, gy, gz) = l.grid;
            assert_eq!((gy, gz), (1, 1), "{}", ctx);
            assert!((1..=GRID_MAX).contains(&gx), "{}", ctx);
            let covered = gx as u64 * l.rows_per_cta() as u64;
            assert!(covered >= rows as u64 || gx == GRID_MAX, "{}", ctx);
            // Not wildly more CTAs than rows need.
            assert!(
                gx as u64 <= (rows as u64).div_ceil(l.rows_per_cta() as u64).max(1),
                "{}",
                ctx
            );
            assert_eq!(l.shared_mem_bytes, 0, "{}", ctx);

            // Vectorized kernels only with 16-byte aligned rows; capacity respected.
            let v = elem.per_vector();
            let vectorized = is_warp || is_block || l.entry.ends_with("_twopass");
            if vectorized {
                assert!(aligned && hidden % v == 0, "{}", ctx);
            } else {
                assert!(!aligned || hidden % v != 0, "{}", ctx);
            }
            let nvec = hidden / v;
            if is_warp {
                assert!(nvec <= 32 * elem.warp_packs(), "{}", ctx);
            }
            if is_block {
                assert!(nvec <= bx * BLOCK_PACKS, "{}", ctx);
                assert!(nvec > 32 * elem.warp_packs(), "{}", ctx);
                // No warp entirely idle.
                assert!(nvec > (bx - 32) * BLOCK_PACKS, "{}", ctx);
            }
            if l.entry.ends_with("_twopass") {
                assert!(nvec > MAX_THREADS * BLOCK_PACKS, "{}", ctx);
            }
        }
    }

    #[test]
    fn launch_rule_examples() {
        let l = |e, r, rows, h| launch(e, r, rows, h, true, H200_SMS);
        use ElemType::{Bf16, F32};

        // Small hidden: one warp per row, 4 rows per CTA when rows are plentiful.
        assert_eq!(
            l(Bf16, false, 16384, 576),
            Launch {
                entry: "rms_norm_bf16_warp",
                grid: (4096, 1, 1),
                block: (32, 4, 1),
                shared_mem_bytes: 0
            }
        );
        assert_eq!(l(F32, false, 16384, 576).entry, "rms_norm_f32_warp");
        assert_eq!(l(F32, true, 16384, 640).entry, "residual_rms_norm_f32_warp");
        assert_eq!(l(F32, false, 16384, 644).entry, "rms_norm_f32_block");
        assert_eq!(l(Bf16, false, 16384, 1024).entry, "rms_norm_bf16_warp");
        assert_eq!(l(Bf16, false, 16384, 1032).entry, "rms_norm_bf16_block");
        // Few rows: spread them over SMs, one warp per CTA.
        assert_eq!(l(Bf16, false, 32, 576).block, (32, 1, 1));
        assert_eq!(l(Bf16, false, 32, 576).grid, (32, 1, 1));
        assert_eq!(l(Bf16, false, 1, 576).grid, (1, 1, 1));
        assert_eq!(l(Bf16, false, 2048, 576).block, (32, 4, 1));
        assert_eq!(l(Bf16, false, 2048, 576).grid, (512, 1, 1));
        assert_eq!(l(Bf16, false, 300, 576).block, (32, 1, 1)); // 300 CTAs >= 264
        assert_eq!(l(Bf16, false, 600, 576).block, (32, 2, 1));

        // Medium hidden: one CTA per row, 4 packs per thread.
        assert_eq!(
            l(Bf16, true, 16384, 4096),
            Launch {
                entry: "residual_rms_norm_bf16_block",
                grid: (16384, 1, 1),
                block: (128, 1, 1),
                shared_mem_bytes: 0
            }
        );
        assert_eq!(l(F32, false, 16384, 4096).block, (256, 1, 1));
        assert_eq!(l(Bf16, false, 16384, 8192).block, (256, 1, 1));
        assert_eq!(l(F32, false, 16384, 8192).block, (512, 1, 1));
        assert_eq!(l(Bf16, false, 1, 16384).block, (512, 1, 1));
        assert_eq!(l(F32, false, 1, 16384).block, (1024, 1, 1));
        assert_eq!(l(F32, false, 1, 16384).entry, "rms_norm_f32_block_lat");
        assert_eq!(l(Bf16, false, 1, 32768).entry, "rms_norm_bf16_block_lat");
        // Decode-sized row counts (a grid of at most one CTA per SM): the latency variants.
        assert_eq!(l(Bf16, false, 1, 576).entry, "rms_norm_bf16_warp_lat");
        assert_eq!(
            l(Bf16, true, 32, 4096).entry,
            "residual_rms_norm_bf16_block_lat"
        );
        assert_eq!(l(Bf16, false, 132, 4096).entry, "rms_norm_bf16_block_lat");
        assert_eq!(l(Bf16, false, 133, 4096).entry, "rms_norm_bf16_block");
        assert_eq!(l(F32, false, 2048, 4096).entry, "rms_norm_f32_block");

        // Beyond what registers hold: two passes.
        assert_eq!(l(F32, false, 7, 16388).entry, "rms_norm_f32_twopass");
        assert_eq!(
            l(Bf16, true, 7, 32776).entry,
            "residual_rms_norm_bf16_twopass"
        );
        assert_eq!(l(Bf16, true, 7, 32776).block, (TWOPASS_THREADS, 1, 1));
        assert_eq!(l(Bf16, true, 7, 32776).grid, (7, 1, 1));

        // Not vectorizable: the plain fallback.
        assert_eq!(
            l(Bf16, false, 16384, 577),
            Launch {
                entry: "rms_norm_bf16",
                grid: (16384, 1, 1),
                block: (160, 1, 1),
                shared_mem_bytes: 0
            }
        );
        assert_eq!(l(F32, true, 1, 1).entry, "residual_rms_norm_f32");
        assert_eq!(l(F32, true, 1, 1).block, (32, 1, 1));
        assert_eq!(
            launch(F32, false, 16384, 4096, false, H200_SMS).entry,
            "rms_norm_f32"
        );
        assert_eq!(
            launch(Bf16, false, 3, 1 << 20, false, H200_SMS).block,
            (FALLBACK_MAX_THREADS, 1, 1)
        );

        // Degenerate sizes still give a launchable (no-op) grid.
        assert_eq!(l(Bf16, false, 0, 576).grid, (1, 1, 1));
        assert_eq!(l(F32, false, u32::MAX, 4096).grid, (GRID_MAX, 1, 1));
    }
}
