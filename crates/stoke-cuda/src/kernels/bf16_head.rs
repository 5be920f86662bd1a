//! The output head for decode-sized row counts: params mirror, entry points and launch rule of
//! `kernels/bf16_head.cu`.
//!
//! `logits = x W^T` for bf16 `x [m, k]` (1 <= m <= 32 per launch) and a bf16 weight `W [n, k]`
//! stored one row of `k` per output column (a checkpoint's LM head, or a tied embedding, as
//! stored); f32 accumulation, bf16 logits rounded once. Each warp streams whole rows of `W`;
//! the `.cu` header documents the algorithm, [`plan`] picks the entry point and deals the work.

use super::{BF16_HEAD, EntryPoint, KernelParams};
use crate::{DevicePtr, DevicePtrMut, ShapeError};
use half::bf16;

/// The kernels' single argument, passed by value. Mirrors `struct Bf16HeadParams` in
/// `kernels/bf16_head.cu` field for field: three 64-bit device pointers, then four `u32`s (40
/// bytes; the `.cu` file asserts `sizeof == 40`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Bf16HeadParams {
    /// `[m, k]` bf16, row-major; 16-byte aligned.
    pub x: DevicePtr<bf16>,
    /// `[n, k]` bf16, row-major (a row per output column); 16-byte aligned.
    pub w: DevicePtr<bf16>,
    /// `[m, n]` bf16; 2-byte aligned.
    pub out: DevicePtrMut<bf16>,
    pub m: u32,
    pub k: u32,
    pub n: u32,
    /// Units ([`Entry::unit_cols`] columns each) per warp.
    pub units_per_warp: u32,
}

// SAFETY: the layout is the `.cu` struct's (asserted in `params_layout_matches_c`), with the
// pointers' element types as the kernels read and write them.
unsafe impl KernelParams for Bf16HeadParams {}

/// `kernels/bf16_head.cu` (includes `ptx.cuh`).
pub const SOURCE: &str = include_str!("../../../../kernels/bf16_head.cu");

/// Warps per CTA (`WARPS` in the `.cu` file).
pub const WARPS: u32 = 4;
/// Threads per CTA.
pub const THREADS: u32 = WARPS * 32;
/// Most rows one launch takes.
pub const MAX_ROWS: u32 = 32;
/// `k` must be a multiple of this: whole 16-byte pieces of a row.
pub const ALIGN_ELEMS: u32 = 8;

/// One entry point: the most rows it takes and its compile-time shape (strips of 16 columns
/// per unit, 16-byte pieces per row and step, ring depth in steps), and the CTAs per SM its
/// launch bounds ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Entry {
    pub name: &'static str,
    pub rows: u32,
    pub strips: u32,
    pub pieces: u32,
    pub ring: u32,
    pub min_ctas: u32,
}

impl Entry {
    /// Output columns of one unit of work.
    pub fn unit_cols(self) -> u32 {
        16 * self.strips
    }

    /// The entry point, typed by its parameter.
    pub fn entry_point(self) -> EntryPoint<Bf16HeadParams> {
        EntryPoint::new(&BF16_HEAD, self.name)
    }
}

const fn entry(
    name: &'static str,
    rows: u32,
    strips: u32,
    pieces: u32,
    ring: u32,
    min_ctas: u32,
) -> Entry {
    Entry {
        name,
        rows,
        strips,
        pieces,
        ring,
        min_ctas,
    }
}

/// Up to 8 rows, one strip per unit, 128 bytes of each row per step: the plan's one-row call on
/// rows of at least [`ONE_ROW_LONG_K`] values (one row of x costs nothing to load: every lane
/// reads the same values).
pub const M8_ONE_ROW: Entry = entry("bf16_head_m8_s1_p2_r4", 8, 1, 2, 4, 4);
/// Up to 8 rows, two strips per unit (each 16-byte piece of x serves twice the weights), 128
/// bytes of each row per step.
pub const M8: Entry = entry("bf16_head_m8_s2_p2_r3", 8, 2, 2, 3, 3);
/// Up to 16 rows.
pub const M16: Entry = entry("bf16_head_m16_s2_p1_r4", 16, 2, 1, 4, 3);
/// Up to 32 rows.
pub const M32: Entry = entry("bf16_head_m32_s4_p1_r2", 32, 4, 1, 2, 2);

/// The entry points the plan picks from.
pub const ENTRIES: [Entry; 4] = [M8_ONE_ROW, M8, M16, M32];

/// Rows of at least this many values take [`M8_ONE_ROW`] for a single row of x: on an H100 it
/// streamed the 8B and 70B heads (k = 4096, 8192) at 97.6-97.9% of the copy rate, against
/// 89.8-90.6% for [`M8`]; SmolLM2's (k = 576: 5 steps a unit) at 70.9% against 95.7%.
pub const ONE_ROW_LONG_K: u32 = 2048;

/// Every `extern "C"` entry point in [`SOURCE`]: [`ENTRIES`].
pub fn entry_points() -> Vec<&'static str> {
    ENTRIES.iter().map(|e| e.name).collect()
}

/// One launch: the entry point, its grid and the units each warp takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub entry: Entry,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub units_per_warp: u32,
}

/// Checks a call's shape: `1 <= m <= 32`, `k` a positive multiple of [`ALIGN_ELEMS`], `n >= 1`.
pub fn check_shape(m: u32, k: u32, n: u32) -> Result<(), ShapeError> {
    if m == 0 || m > MAX_ROWS {
        return Err(ShapeError::new(
            "output head rows of x",
            format!("1 to {MAX_ROWS}"),
            m.to_string(),
        ));
    }
    if k == 0 || !k.is_multiple_of(ALIGN_ELEMS) {
        return Err(ShapeError::new(
            "output head k (hidden size)",
            format!("a positive multiple of {ALIGN_ELEMS}"),
            k.to_string(),
        ));
    }
    if n == 0 {
        return Err(ShapeError::new(
            "output head n (vocabulary)",
            "at least 1",
            "0",
        ));
    }
    Ok(())
}

/// The launch of `entry` (or, with `None`, the plan's: [`M8_ONE_ROW`] for one row of at least
/// [`ONE_ROW_LONG_K`] values, else the smallest of [`M8`], [`M16`], [`M32`] that holds `m`
/// rows) for `x [m, k] @ W^T`, `W [n, k]`, on a GPU where `resident_warps` warps of the entry
/// point are resident at once.
///
/// The `ceil(n / unit_cols)` units are dealt in equal contiguous runs, as few per warp as let
/// every warp be resident: `units_per_warp = ceil(units / resident_warps)`, then
/// `ceil(units / units_per_warp)` warps, in CTAs of [`WARPS`].
pub fn plan(
    m: u32,
    k: u32,
    n: u32,
    entry: Option<Entry>,
    resident_warps: impl Fn(Entry) -> u32,
) -> Result<Launch, ShapeError> {
    check_shape(m, k, n)?;
    let entry = match entry {
        Some(e) if m <= e.rows => e,
        Some(e) => {
            return Err(ShapeError::new(
                format!("rows of x for {}", e.name),
                format!("1 to {}", e.rows),
                m.to_string(),
            ));
        }
        None => match m {
            1 if k >= ONE_ROW_LONG_K => M8_ONE_ROW,
            0..=8 => M8,
            9..=16 => M16,
            _ => M32,
        },
    };
    let units = n.div_ceil(entry.unit_cols());
    let units_per_warp = units.div_ceil(resident_warps(entry).max(1));
    let warps = units.div_ceil(units_per_warp);
    Ok(Launch {
        entry,
        grid: (warps.div_ceil(WARPS), 1, 1),
        block: (THREADS, 1, 1),
        units_per_warp,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_c() {
        assert_eq!(std::mem::size_of::<Bf16HeadParams>(), 40);
        assert_eq!(std::mem::align_of::<Bf16HeadParams>(), 8);
        assert_eq!(std::mem::offset_of!(Bf16HeadParams, x), 0);
        assert_eq!(std::mem::offset_of!(Bf16HeadParams, w), 8);
        assert_eq!(std::mem::offset_of!(Bf16HeadParams, out), 16);
        assert_eq!(std::mem::offset_of!(Bf16HeadParams, m), 24);
        assert_eq!(std::mem::offset_of!(Bf16HeadParams, k), 28);
        assert_eq!(std::mem::offset_of!(Bf16HeadParams, n), 32);
        assert_eq!(std::mem::offset_of!(Bf16HeadParams, units_per_warp), 36);
        assert!(SOURCE.contains("static_assert(sizeof(Bf16HeadParams) == 40"));
        let fields = [
            "const u16* x;",
            "const u16* w;",
            "u16* out;",
            "u32 m, k, n;",
            "u32 units_per_warp;",
        ];
        let mut at = SOURCE.find("struct Bf16HeadParams {").unwrap();
        for f in fields {
            at += SOURCE[at..]
                .find(f)
                .unwrap_or_else(|| panic!("{f} out of order"));
        }
    }

    #[test]
    fn every_entry_is_instantiated_with_its_shape() {
        for e in ENTRIES.iter() {
            let line = format!(
                "BF16_HEAD_ENTRY({}, {}, {}, {}, {}, {})",
                e.name, e.rows, e.strips, e.pieces, e.ring, e.min_ctas
            );
            assert!(SOURCE.contains(&line), "{line} not in bf16_head.cu");
        }
        assert_eq!(SOURCE.matches("\nBF16_HEAD_ENTRY(").count(), ENTRIES.len());
    }

    #[test]
    fn the_plan_deals_units_in_one_wave() {
        // 8B head, one row, on 132 SMs with 16 resident warps per SM: 8016 units of 16 columns
        // over 2112 warps -> 4 per warp, 2004 warps, 501 CTAs.
        let l = plan(1, 4096, 128256, None, |_| 132 * 16).unwrap();
        assert_eq!(l.entry, M8_ONE_ROW);
        assert_eq!(l.units_per_warp, 4);
        assert_eq!(l.grid, (501, 1, 1));
        // Rows (and one row's length) pick the entry point; every unit is covered once.
        for (m, k, e) in [
            (1, 576, M8),
            (2, 4096, M8),
            (8, 576, M8),
            (9, 576, M16),
            (32, 576, M32),
        ] {
            let l = plan(m, k, 49152, None, |_| 132 * 8).unwrap();
            assert_eq!(l.entry, e, "m {m} k {k}");
            let units = 49152u32.div_ceil(l.entry.unit_cols());
            let warps = l.grid.0 * WARPS;
            assert!(warps * l.units_per_warp >= units);
            assert!((warps - WARPS) * l.units_per_warp < units);
        }
        assert!(plan(0, 576, 100, None, |_| 1).is_err());
        assert!(plan(33, 576, 100, None, |_| 1).is_err());
        assert!(plan(1, 580, 100, None, |_| 1).is_err());
        assert!(plan(1, 576, 0, None, |_| 1).is_err());
        assert!(plan(9, 576, 100, Some(M8), |_| 1).is_err());
    }
}
