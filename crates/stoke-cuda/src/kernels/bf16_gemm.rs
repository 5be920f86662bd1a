//! Dense bf16 GEMM for decode-sized row counts: params mirror, entry points and launch rule of
//! `kernels/bf16_gemm.cu`.
//!
//! `y = x W` for bf16 `x [m, k]` (1 <= m <= 32) and a bf16 weight `W [k, n]` in Burn's row-major
//! Linear layout, used in place; f32 accumulation, bf16 output rounded once, with the plain,
//! residual-add or SwiGLU epilogue of the W4A16 kernels ([`Epilogue`]). The `.cu` header
//! documents the algorithm; [`plan`] picks the entry point, grid and split-K count.

use super::{BF16_GEMM, EntryPoint, KernelParams};
use crate::{DevicePtr, DevicePtrMut, ShapeError};
use half::bf16;

pub use super::int4_gemm::Epilogue;

/// The kernels' single argument, passed by value. Mirrors `struct Bf16GemmParams` in
/// `kernels/bf16_gemm.cu` field for field: six 64-bit device pointers, then five `u32`s; 68
/// bytes of fields, padded to 72 (the `.cu` file asserts `sizeof == 72`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Bf16GemmParams {
    /// `[m, k]` bf16, row-major; 4-byte aligned.
    pub x: DevicePtr<bf16>,
    /// `[k, n]` bf16, row-major; 16-byte aligned.
    pub w: DevicePtr<bf16>,
    /// `[m, n]` bf16 (`[m, n / 2]` for SwiGLU); 8-byte aligned (4 for SwiGLU).
    pub out: DevicePtrMut<bf16>,
    /// `[m, n]` bf16 for the residual epilogue (4-byte aligned); null otherwise.
    pub residual: DevicePtr<bf16>,
    /// `[splits, m, n]` f32 partial sums (16-byte aligned) when `splits > 1`; any contents.
    pub workspace: DevicePtrMut<f32>,
    /// `grid.0` u32 arrival counters when `splits > 1`, all zeros on entry (left zeroed).
    pub counters: DevicePtrMut<u32>,
    pub m: u32,
    pub k: u32,
    pub n: u32,
    /// CTAs per column block along k (`grid.1`).
    pub splits: u32,
    /// k-steps of [`STEP_K`] rows per split.
    pub split_steps: u32,
}

// SAFETY: the layout is the `.cu` struct's (asserted in `params_layout_matches_c`), with the
// pointers' element types as the kernels read and write them.
unsafe impl KernelParams for Bf16GemmParams {}

/// `kernels/bf16_gemm.cu` (includes `ptx.cuh`).
pub const SOURCE: &str = include_str!("../../../../kernels/bf16_gemm.cu");

/// How a CTA's 4 warps share its work (the entry point's `_wide` / `_deep` suffix).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Side by side along n: [`WIDE_COLS`] columns per CTA, every warp on the CTA's whole k
    /// range (one read of x per CTA serves all four).
    Wide,
    /// Along k on the same [`DEEP_COLS`] columns, reduced through shared memory: 4x the CTAs
    /// of [`Layout::Wide`] per k range, for narrow weights.
    Deep,
}

impl Layout {
    /// Columns one CTA covers.
    pub fn cols(self) -> u32 {
        match self {
            Layout::Wide => WIDE_COLS,
            Layout::Deep => DEEP_COLS,
        }
    }

    /// Warps of a CTA along k.
    pub fn warps_k(self) -> u32 {
        match self {
            Layout::Wide => 1,
            Layout::Deep => WARPS,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Layout::Wide => "wide",
            Layout::Deep => "deep",
        }
    }
}

/// Warps per CTA (`WARPS` in the `.cu` file).
pub const WARPS: u32 = 4;
/// Threads per CTA.
pub const THREADS: u32 = WARPS * 32;
/// k rows per step of a warp (`STEP_K`).
pub const STEP_K: u32 = 32;
/// Columns one warp covers (`WARP_COLS`).
pub const WARP_COLS: u32 = 64;
/// Columns of a [`Layout::Wide`] CTA.
pub const WIDE_COLS: u32 = WARP_COLS * WARPS;
/// Columns of a [`Layout::Deep`] CTA.
pub const DEEP_COLS: u32 = WARP_COLS;
/// Most rows one launch takes.
pub const MAX_ROWS: u32 = 32;
/// Row capacities of the entry points (`_m8`, `_m16`, `_m32`).
pub const ROW_TILES: [u32; 3] = [8, 16, 32];
/// `k` and `n` must be multiples of this: 16-byte rows of W, whole 8-row pieces of a step.
pub const ALIGN_ELEMS: u32 = 8;

/// CTAs per SM the plan aims for: at least two resident CTAs on every SM, each with 3 x 16 KB
/// of weight loads in flight.
pub const CTAS_PER_SM: u32 = 2;
/// Most split-K CTAs per column block the plan gives [`Layout::Wide`]; where it would need more,
/// the plan takes [`Layout::Deep`]: the last CTA of a column block adds
/// `splits x rows x WIDE_COLS` partial sums alone, which grows into the kernel's time at 32
/// rows (4096 x 6144 would take 11 wide splits; 3 deep ones).
pub const WIDE_MAX_SPLITS: u32 = 4;
/// Fewest k-steps per warp a split is cut to.
pub const MIN_WARP_STEPS: u32 = 2;

/// One entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Entry {
    pub epilogue: Epilogue,
    /// 8, 16 or 32: the most rows the entry point takes.
    pub rows: u32,
    pub layout: Layout,
}

impl Entry {
    /// Every instantiated entry point, in [`ENTRY_POINTS`]' order.
    pub fn all() -> impl Iterator<Item = Entry> {
        [Epilogue::Plain, Epilogue::Residual, Epilogue::SwiGlu]
            .into_iter()
            .flat_map(|epilogue| {
                ROW_TILES.into_iter().flat_map(move |rows| {
                    [Layout::Wide, Layout::Deep].map(|layout| Entry {
                        epilogue,
                        rows,
                        layout,
                    })
                })
            })
    }

    /// The entry point's symbol, `bf16_gemm_EPI_mROWS_LAYOUT`.
    pub fn name(self) -> &'static str {
        let i = Entry::all()
            .position(|e| e == self)
            .expect("Entry::all lists every entry");
        ENTRY_POINTS[i]
    }

    /// The entry point, typed by its parameter.
    pub fn entry_point(self) -> EntryPoint<Bf16GemmParams> {
        EntryPoint::new(&BF16_GEMM, self.name())
    }
}

/// Every `extern "C"` entry point in [`SOURCE`], in [`Entry::all`]'s order (epilogue, rows,
/// layout).
pub const ENTRY_POINTS: &[&str] = &[
    "bf16_gemm_plain_m8_wide",
    "bf16_gemm_plain_m8_deep",
    "bf16_gemm_plain_m16_wide",
    "bf16_gemm_plain_m16_deep",
    "bf16_gemm_plain_m32_wide",
    "bf16_gemm_plain_m32_deep",
    "bf16_gemm_residual_m8_wide",
    "bf16_gemm_residual_m8_deep",
    "bf16_gemm_residual_m16_wide",
    "bf16_gemm_residual_m16_deep",
    "bf16_gemm_residual_m32_wide",
    "bf16_gemm_residual_m32_deep",
    "bf16_gemm_swiglu_m8_wide",
    "bf16_gemm_swiglu_m8_deep",
    "bf16_gemm_swiglu_m16_wide",
    "bf16_gemm_swiglu_m16_deep",
    "bf16_gemm_swiglu_m32_wide",
    "bf16_gemm_swiglu_m32_deep",
];

/// One launch: the entry point, its grid and block, and the split fields of its params.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub entry: Entry,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    /// CTAs per column block along k (`grid.1`).
    pub splits: u32,
    /// k-steps of [`STEP_K`] rows per split.
    pub split_steps: u32,
}

impl Launch {
    /// Bytes of f32 partial sums the launch needs (`[splits, m, n]`; 0 with one split).
    pub fn workspace_bytes(&self, m: u32, n: u32) -> usize {
        if self.splits > 1 {
            self.splits as usize * m as usize * n as usize * 4
        } else {
            0
        }
    }

    /// Arrival counters the launch needs (one per column block; 0 with one split).
    pub fn counters_len(&self) -> usize {
        if self.splits > 1 {
            self.grid.0 as usize
        } else {
            0
        }
    }
}

/// The split of `steps` k-steps for `blocks` column blocks of CTAs with `warps_k` warps along
/// k: as many splits as bring the grid to `target` CTAs, at most as many as leave every warp
/// [`MIN_WARP_STEPS`] steps, with no split empty. Returns `(splits, split_steps)`.
fn split(blocks: u32, steps: u32, warps_k: u32, target: u32) -> (u32, u32) {
    let want = target.div_ceil(blocks.max(1)).max(1);
    let most = (steps / (warps_k * MIN_WARP_STEPS)).max(1);
    let split_steps = steps.div_ceil(want.min(most));
    (steps.div_ceil(split_steps), split_steps)
}

/// Checks a call's shape: `1 <= m <= 32`, `k` and `n` positive multiples of [`ALIGN_ELEMS`]
/// (SwiGLU: an even `n`, which that implies).
pub fn check_shape(m: u32, k: u32, n: u32, epilogue: Epilogue) -> Result<(), ShapeError> {
    if m == 0 || m > MAX_ROWS {
        return Err(ShapeError::new(
            "bf16 GEMM rows of x",
            format!("1 to {MAX_ROWS}"),
            m.to_string(),
        ));
    }
    if epilogue == Epilogue::SwiGlu && !n.is_multiple_of(2) {
        return Err(ShapeError::new(
            "bf16 GEMM SwiGLU columns (gate and up interleaved)",
            "an even count",
            n.to_string(),
        ));
    }
    for (what, v) in [("bf16 GEMM k", k), ("bf16 GEMM n", n)] {
        if v == 0 || !v.is_multiple_of(ALIGN_ELEMS) {
            return Err(ShapeError::new(
                what,
                format!("a positive multiple of {ALIGN_ELEMS}"),
                v.to_string(),
            ));
        }
    }
    Ok(())
}

/// The launch for `x [m, k] @ W [k, n]` on a GPU of `sm_count` SMs.
///
/// Rows: the smallest of the `_m8`, `_m16`, `_m32` entry points that holds `m`.
///
/// Layout and split-K, with `target = CTAS_PER_SM * sm_count` CTAs and `steps = ceil(k / 32)`:
/// - [`Layout::Wide`] (256 columns per CTA) with `splits = ceil(target / ceil(n / 256))`
///   (cut so that each warp keeps [`MIN_WARP_STEPS`] steps), where that is at most
///   [`WIDE_MAX_SPLITS`]: one split for wide matrices (an LM head), a few for medium ones;
/// - else [`Layout::Deep`] (64 columns per CTA, 4 warps along k) with
///   `splits = ceil(target / ceil(n / 64))`, cut the same way (each of the 4 warps keeping
///   [`MIN_WARP_STEPS`] steps).
///
/// The split count is then trimmed so that no split is empty: `split_steps = ceil(steps /
/// splits)`, `splits = ceil(steps / split_steps)`.
pub fn plan(
    m: u32,
    k: u32,
    n: u32,
    epilogue: Epilogue,
    sm_count: u32,
) -> Result<Launch, ShapeError> {
    check_shape(m, k, n, epilogue)?;
    let rows = ROW_TILES
        .into_iter()
        .find(|&r| m <= r)
        .expect("m <= MAX_ROWS");
    let steps = k.div_ceil(STEP_K);
    let target = CTAS_PER_SM * sm_count.max(1);
    let wide = split(n.div_ceil(WIDE_COLS), steps, 1, target);
    let (layout, (splits, split_steps)) = if wide.0 <= WIDE_MAX_SPLITS {
        (Layout::Wide, wide)
    } else {
        (
            Layout::Deep,
            split(n.div_ceil(DEEP_COLS), steps, WARPS, target),
        )
    };
    Ok(Launch {
        entry: Entry {
            epilogue,
            rows,
            layout,
        },
        grid: (n.div_ceil(layout.cols()), splits, 1),
        block: (THREADS, 1, 1),
        splits,
        split_steps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200_SMS: u32 = 132;

    #[test]
    fn params_layout_matches_c() {
        assert_eq!(std::mem::size_of::<Bf16GemmParams>(), 72);
        assert_eq!(std::mem::align_of::<Bf16GemmParams>(), 8);
        assert_eq!(std::mem::offset_of!(Bf16GemmParams, x), 0);
        assert_eq!(std::mem::offset_of!(Bf16GemmParams, w), 8);
        assert_eq!(std::mem::offset_of!(Bf16GemmParams, out), 16);
        assert_eq!(std::mem::offset_of!(Bf16GemmParams, residual), 24);
        assert_eq!(std::mem::offset_of!(Bf16GemmParams, workspace), 32);
        assert_eq!(std::mem::offset_of!(Bf16GemmParams, counters), 40);
        assert_eq!(std::mem::offset_of!(Bf16GemmParams, m), 48);
        assert_eq!(std::mem::offset_of!(Bf16GemmParams, k), 52);
        assert_eq!(std::mem::offset_of!(Bf16GemmParams, n), 56);
        assert_eq!(std::mem::offset_of!(Bf16GemmParams, splits), 60);
        assert_eq!(std::mem::offset_of!(Bf16GemmParams, split_steps), 64);
        assert!(SOURCE.contains("static_assert(sizeof(Bf16GemmParams) == 72"));
        // The field order of the .cu struct.
        let fields = [
            "const u16* x;",
            "const u16* w;",
            "u16* out;",
            "const u16* residual;",
            "float* workspace;",
            "u32* counters;",
            "u32 m, k, n;",
            "u32 splits;",
            "u32 split_steps;",
        ];
        let mut at = SOURCE.find("struct Bf16GemmParams {").unwrap();
        for f in fields {
            let i = SOURCE[at..]
                .find(f)
                .unwrap_or_else(|| panic!("{f} in order"));
            at += i + f.len();
        }
    }

    #[test]
    fn constants_match_the_source() {
        for (c, v) in [
            ("WARPS", WARPS),
            ("STEP_K", STEP_K),
            ("WARP_COLS", WARP_COLS),
        ] {
            assert!(
                SOURCE.contains(&format!("constexpr int {c} = {v};")),
                "{c} = {v} in kernels/bf16_gemm.cu"
            );
        }
    }

    #[test]
    fn entry_points_are_the_instantiations() {
        // ENTRY_POINTS is Entry::all's order, each name from the .cu macros' pattern.
        let names: Vec<String> = Entry::all()
            .map(|e| {
                format!(
                    "bf16_gemm_{}_m{}_{}",
                    e.epilogue.name(),
                    e.rows,
                    e.layout.name()
                )
            })
            .collect();
        assert_eq!(names, ENTRY_POINTS);
        for e in Entry::all() {
            assert_eq!(Entry::all().find(|x| x.name() == e.name()), Some(e));
        }
        for epi in ["plain", "residual", "swiglu"] {
            assert!(SOURCE.contains(&format!("BF16_GEMM_ENTRIES({epi}, ")));
        }
        for rows in ROW_TILES {
            assert!(SOURCE.contains(&format!("BF16_GEMM_LAYOUTS(EPI_NAME, EPI, {rows})")));
        }
        assert!(SOURCE.contains("BF16_GEMM_ENTRY(EPI_NAME, EPI, ROWS, wide, 4)"));
        assert!(SOURCE.contains("BF16_GEMM_ENTRY(EPI_NAME, EPI, ROWS, deep, 1)"));
    }

    #[test]
    fn bad_shapes_are_shape_errors() {
        let err = |m, k, n, e| plan(m, k, n, e, H200_SMS).unwrap_err();
        assert_eq!(
            err(0, 576, 576, Epilogue::Plain).what,
            "bf16 GEMM rows of x"
        );
        assert_eq!(err(33, 576, 576, Epilogue::Plain).got, "33");
        assert_eq!(err(1, 572, 576, Epilogue::Plain).what, "bf16 GEMM k");
        assert_eq!(err(1, 0, 576, Epilogue::Plain).what, "bf16 GEMM k");
        assert_eq!(err(1, 576, 580, Epilogue::Residual).what, "bf16 GEMM n");
        assert!(err(1, 576, 577, Epilogue::SwiGlu).what.contains("SwiGLU"));
        assert!(plan(32, 8, 8, Epilogue::SwiGlu, H200_SMS).is_ok());
    }

    /// Every launch covers every column and k-step exactly once, within the entry point's rows.
    #[test]
    fn every_launch_covers_the_matrix() {
        let ks = [8, 24, 32, 40, 576, 1536, 4096, 14336, 28672, 8200];
        let ns = [
            8,
            64,
            72,
            576,
            1728,
            4096,
            6144,
            28672,
            49152,
            128256,
            8 * 4099,
        ];
        for sms in [1, 2, 66, H200_SMS] {
            for m in [1, 2, 3, 8, 9, 16, 17, 31, 32] {
                for k in ks {
                    for n in ns {
                        let l = plan(m, k, n, Epilogue::Plain, sms).unwrap();
                        let ctx = format!("m {m} k {k} n {n} sms {sms}: {l:?}");
                        let rows = ROW_TILES.into_iter().find(|&r| m <= r);
                        assert_eq!(Some(l.entry.rows), rows, "{ctx}");
                        assert_eq!(l.block, (THREADS, 1, 1), "{ctx}");
                        let cols = l.entry.layout.cols();
                        assert_eq!(l.grid, (n.div_ceil(cols), l.splits, 1), "{ctx}");
                        assert!((l.grid.0 - 1) * cols < n, "{ctx}");
                        let steps = k.div_ceil(STEP_K);
                        assert!(l.splits >= 1 && l.split_steps >= 1, "{ctx}");
                        assert!(l.splits * l.split_steps >= steps, "{ctx}");
                        assert!(
                            (l.splits - 1) * l.split_steps < steps,
                            "no empty split: {ctx}"
                        );
                        if l.splits > 1 {
                            let wk = l.entry.layout.warps_k();
                            assert!(l.split_steps >= wk * MIN_WARP_STEPS, "{ctx}");
                        }
                        if l.entry.layout == Layout::Wide {
                            assert!(l.splits <= WIDE_MAX_SPLITS, "{ctx}");
                        }
                        assert_eq!(
                            l.workspace_bytes(m, n),
                            if l.splits > 1 {
                                (l.splits * m * n * 4) as usize
                            } else {
                                0
                            }
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn launch_rule_examples() {
        let l = |m, k, n| plan(m, k, n, Epilogue::Plain, H200_SMS).unwrap();
        let summary = |l: Launch| (l.entry.layout, l.entry.rows, l.grid.0, l.splits);
        // Heads: wide, enough column blocks alone (8B) or two splits (SmolLM2).
        assert_eq!(summary(l(1, 4096, 128256)), (Layout::Wide, 8, 501, 1));
        assert_eq!(summary(l(32, 576, 49152)), (Layout::Wide, 32, 192, 2));
        // 8B gate/up: wide with 3 splits; qkv, o and down: deep.
        assert_eq!(summary(l(8, 4096, 28672)), (Layout::Wide, 8, 112, 3));
        assert_eq!(summary(l(16, 4096, 6144)), (Layout::Deep, 16, 96, 3));
        assert_eq!(summary(l(9, 4096, 4096)), (Layout::Deep, 16, 64, 5));
        assert_eq!(summary(l(3, 14336, 4096)), (Layout::Deep, 8, 64, 5));
        assert_eq!(l(3, 14336, 4096).split_steps, 90);
        // Small SmolLM2 shapes: splits limited by the k-steps each warp keeps.
        assert_eq!(summary(l(1, 576, 1728)), (Layout::Deep, 8, 27, 2));
        assert_eq!(summary(l(31, 1536, 576)), (Layout::Deep, 32, 9, 6));
        assert_eq!(l(31, 1536, 576).split_steps, 8);
        // The epilogue picks the entry point only.
        let s = plan(2, 4096, 28672, Epilogue::SwiGlu, H200_SMS).unwrap();
        assert_eq!(s.entry.name(), "bf16_gemm_swiglu_m8_wide");
        assert_eq!(s.grid, l(2, 4096, 28672).grid);
    }
}
