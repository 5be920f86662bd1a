//! W4A16 GEMM kernels: params mirror and launch plan for `kernels/int4_gemm.cu`.
//!
//! `y = x W` for bf16 `x [m, k]` and a packed INT4 `W [k, n]` (docs/INT4_FORMAT.md), f32
//! accumulation, bf16 output, with a plain, residual-add or SwiGLU epilogue and an optional
//! per-row scale. One launch covers up to 32 rows; [`plan`] cuts larger `m` into 32-row chunks.
//! The `.cu` file's header documents the algorithm.
//!
//! This module depends on nothing but `std`.

/// The kernels' single argument, passed by value. Mirrors `struct Int4GemmParams` in
/// `kernels/int4_gemm.cu` field for field (the `.cu` file asserts `sizeof == 96`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Int4GemmParams {
    /// `[m, k]` bf16, row-major.
    pub x: u64,
    /// `k * n / 8` words in fragment order.
    pub words: u64,
    /// `[k / group, n]` 16-bit scales.
    pub scales: u64,
    /// `[k / group, n]` 16-bit offsets, or 0 for symmetric weights.
    pub offsets: u64,
    /// `[m, n]` bf16 (`[m, n / 2]` for SwiGLU).
    pub out: u64,
    /// `[m, n]` bf16, for the residual epilogue; 0 otherwise.
    pub residual: u64,
    /// `[m]` f32 row factors, or 0.
    pub row_scale: u64,
    /// `[m, n]` f32, all zeros on entry (left zeroed); needed when `splits != 1` (split-K, or
    /// 0: stream-K).
    pub workspace: u64,
    /// [`counters_len`] u32, all zeros on entry (left zeroed); needed when `splits != 1`.
    pub counters: u64,
    pub m: u32,
    pub k: u32,
    pub n: u32,
    pub group: u32,
    pub fold_kt: u32,
    pub splits: u32,
    /// 512-byte word blocks between consecutive k-tiles of one 64-column slab, and between
    /// consecutive slabs of one k-tile: `(n / 64, 1)` for [`WordOrder::KtMajor`],
    /// `(k / 16, 1)` swapped for [`WordOrder::SlabMajor`] (see [`WordOrder::strides`]).
    pub kt_stride: u32,
    pub slab_stride: u32,
}

/// The order of the 512-byte blocks (one k-tile of 16 rows x one slab of 64 columns) of a
/// packed weight in device memory. Within a block the order is the fragment order of
/// docs/INT4_FORMAT.md either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WordOrder {
    /// Block `kt * (n / 64) + slab`: the packer's order (docs/INT4_FORMAT.md).
    #[default]
    KtMajor,
    /// Block `slab * (k / 16) + kt`: one slab's k range is contiguous, so each warp streams
    /// one contiguous range.
    SlabMajor,
}

impl WordOrder {
    /// `(kt_stride, slab_stride)` in 512-byte blocks for a `[k, n]` weight.
    pub fn strides(self, k: u32, n: u32) -> (u32, u32) {
        match self {
            WordOrder::KtMajor => (n / 64, 1),
            WordOrder::SlabMajor => (1, k / 16),
        }
    }

    /// Block index of (k-tile, slab).
    pub fn block(self, kt: usize, slab: usize, k: usize, n: usize) -> usize {
        match self {
            WordOrder::KtMajor => kt * (n / 64) + slab,
            WordOrder::SlabMajor => slab * (k / 16) + kt,
        }
    }
}

/// `kernels/int4_gemm.cu`, compiled with NVRTC (no include path needed).
pub const SOURCE: &str = include_str!("../../../../kernels/int4_gemm.cu");

/// Every `extern "C"` entry point in [`SOURCE`].
pub const ENTRY_POINTS: &[&str] = &[
    "int4_gemm_plain_bf16s_m8",
    "int4_gemm_plain_bf16s_m16",
    "int4_gemm_plain_bf16s_m32",
    "int4_gemm_plain_f16s_m8",
    "int4_gemm_plain_f16s_m16",
    "int4_gemm_plain_f16s_m32",
    "int4_gemm_residual_bf16s_m8",
    "int4_gemm_residual_bf16s_m16",
    "int4_gemm_residual_bf16s_m32",
    "int4_gemm_residual_f16s_m8",
    "int4_gemm_residual_f16s_m16",
    "int4_gemm_residual_f16s_m32",
    "int4_gemm_swiglu_bf16s_m8",
    "int4_gemm_swiglu_bf16s_m16",
    "int4_gemm_swiglu_bf16s_m32",
    "int4_gemm_swiglu_f16s_m8",
    "int4_gemm_swiglu_f16s_m16",
    "int4_gemm_swiglu_f16s_m32",
    "int4_gemm_swap_plain_bf16s",
    "int4_gemm_swap_plain_f16s",
    "int4_gemm_swap_residual_bf16s",
    "int4_gemm_swap_residual_f16s",
    "int4_gemm_swap_swiglu_bf16s",
    "int4_gemm_swap_swiglu_f16s",
    "int4_gemm_swap_plain_bf16s_long",
    "int4_gemm_swap_plain_f16s_long",
    "int4_gemm_swap_residual_bf16s_long",
    "int4_gemm_swap_residual_f16s_long",
    "int4_gemm_swap_swiglu_bf16s_long",
    "int4_gemm_swap_swiglu_f16s_long",
    "int4_gemm_swap16_plain_bf16s",
    "int4_gemm_swap16_plain_f16s",
    "int4_gemm_swap16_residual_bf16s",
    "int4_gemm_swap16_residual_f16s",
    "int4_gemm_swap16_swiglu_bf16s",
    "int4_gemm_swap16_swiglu_f16s",
    "int4_gemm_swap16_plain_bf16s_long",
    "int4_gemm_swap16_plain_f16s_long",
    "int4_gemm_swap16_residual_bf16s_long",
    "int4_gemm_swap16_residual_f16s_long",
    "int4_gemm_swap16_swiglu_bf16s_long",
    "int4_gemm_swap16_swiglu_f16s_long",
    "int4_gemm_swapk_plain_bf16s",
    "int4_gemm_swapk_plain_f16s",
    "int4_gemm_swapk_residual_bf16s",
    "int4_gemm_swapk_residual_f16s",
    "int4_gemm_swapk_swiglu_bf16s",
    "int4_gemm_swapk_swiglu_f16s",
    "int4_gemm_wg_plain_bf16s_n8",
    "int4_gemm_wg_plain_bf16s_n16",
    "int4_gemm_wg_plain_bf16s_n32",
    "int4_gemm_wg_plain_f16s_n8",
    "int4_gemm_wg_plain_f16s_n16",
    "int4_gemm_wg_plain_f16s_n32",
    "int4_gemm_wg_residual_bf16s_n8",
    "int4_gemm_wg_residual_bf16s_n16",
    "int4_gemm_wg_residual_bf16s_n32",
    "int4_gemm_wg_residual_f16s_n8",
    "int4_gemm_wg_residual_f16s_n16",
    "int4_gemm_wg_residual_f16s_n32",
    "int4_gemm_wg_swiglu_bf16s_n8",
    "int4_gemm_wg_swiglu_bf16s_n16",
    "int4_gemm_wg_swiglu_bf16s_n32",
    "int4_gemm_wg_swiglu_f16s_n8",
    "int4_gemm_wg_swiglu_f16s_n16",
    "int4_gemm_wg_swiglu_f16s_n32",
];

/// The warpgroup entry points' parameter (`Int4WgParams` in the `.cu` file): the common one
/// and the copy engine's map of this launch's rows of x (boxes of 64 k x N rows).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Int4WgParams {
    pub p: Int4GemmParams,
    pub x_map: crate::TensorMap,
}

/// Rows of x a warpgroup entry point takes (its `_nN` suffix), or None for the other kernels.
pub fn wg_rows_of(entry: &str) -> Option<u32> {
    entry
        .strip_prefix("int4_gemm_wg_")
        .and_then(|e| e.rsplit_once("_n"))
        .and_then(|(_, n)| n.parse().ok())
}

/// Index in [`ENTRY_POINTS`] of the first warpgroup entry point (`int4_gemm_wg_*`), laid out by
/// epilogue, scale type, then rows 8 / 16 / 32.
const WG_BASE: usize = 48;

/// K-tiles per warp from which the swapped kernel's `_long` entry points (a deeper load ring)
/// are used: at 64 and more they were faster on every benchmark shape, below it slower
/// (results/experiments/h200-int4-ring-depth-3ab5433.json).
pub const LONG_STREAM_TILES: u32 = 64;

/// What the kernel does with each finished value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// `out = x W`
    Plain,
    /// `out = residual + x W` (residual `[m, n]` bf16)
    Residual,
    /// `out[:, j] = silu((x W)[:, 2j]) * (x W)[:, 2j + 1]`: gate and up columns interleaved,
    /// output `[m, n / 2]`.
    SwiGlu,
}

impl Epilogue {
    pub fn name(self) -> &'static str {
        match self {
            Epilogue::Plain => "plain",
            Epilogue::Residual => "residual",
            Epilogue::SwiGlu => "swiglu",
        }
    }

    /// Position in [`ENTRY_POINTS`]' order (plain, residual, swiglu).
    fn index(self) -> usize {
        match self {
            Epilogue::Plain => 0,
            Epilogue::Residual => 1,
            Epilogue::SwiGlu => 2,
        }
    }

    /// Output columns for a weight of `n` columns.
    pub fn out_cols(self, n: usize) -> usize {
        match self {
            Epilogue::SwiGlu => n / 2,
            _ => n,
        }
    }
}

/// Warps per CTA (`WARPS` in the `.cu` file).
pub const WARPS: u32 = 4;
/// Most rows one launch handles.
pub const MAX_ROWS: u32 = 32;
/// Resident CTAs per SM an entry point's launch bounds ask for (m32: 2, warpgroup n8: 5,
/// swapped m <= 8 and warpgroup n16 / n32: 4, else 3).
/// The runtime plans with the occupancy calculator instead ([`crate::Runtime::resident_ctas`]);
/// this is the expectation for code without a GPU (shape checks, tests).
pub fn launch_bound_ctas(entry: &str) -> u32 {
    if entry.starts_with("int4_gemm_wg_") && entry.ends_with("_n8") {
        5
    } else if entry.starts_with("int4_gemm_swap_")
        || entry.starts_with("int4_gemm_swapk_")
        || entry.starts_with("int4_gemm_wg_")
    {
        4
    } else if entry.starts_with("int4_gemm_swap16_") {
        3
    } else if entry.ends_with("_m32") {
        2
    } else {
        3
    }
}

/// Resident CTAs on a whole GPU of `sm_count` SMs by the launch bounds (see
/// [`launch_bound_ctas`]).
pub fn launch_bound_slots(sm_count: u32) -> impl Fn(&'static str) -> u32 {
    move |entry| launch_bound_ctas(entry) * sm_count
}

/// Rows up to which [`plan`] uses the swapped kernels by default: 8. The swap16 kernels
/// (9-32 rows) were no faster than the batched ones at m = 16 and mixed at m = 32 (faster on
/// 70B qkv 60.2 -> 50.3 us, slower on 70B down 109.8 -> 132.3 us;
/// results/experiments/h200-int4-swap16-3d5e22e.json), so they are opt-in
/// (`STOKE_INT4_SWAP_ROWS=32`), except where [`plan`] finds the batched m32 kernel without
/// split-K on an under-filled GPU (70B qkv).
pub const SWAP_ROWS_DEFAULT: u32 = 8;
/// Rows from which the plan uses the warpgroup kernels by default (`int4_gemm_wg_*`, where the
/// shape, the weight and x allow them): 9. At 16 and 32 rows they are faster than the batched
/// and swap16 kernels on all 16 benchmark points (results/h200-int4.json at 1f2848b: 70B
/// gate/up m16 79.0 us against 121.4, m32 92.4 against 193.7). At 1 row the swapped kernel
/// is faster on 5 of the 8 shapes (70B gate/up 66.9 against 72.2 us), ties on 2 and is slower
/// on 70B qkv (16.7 against 16.2), so it keeps 8 rows and fewer.
pub const WG_ROWS_DEFAULT: u32 = 9;
/// `swap_rows` for the swapped kernels at every row count.
pub const SWAP_ALL: u32 = MAX_ROWS;

/// CTAs per slab of a swap16 launch of `rows` rows: one per 16 rows. They are adjacent in the
/// grid (x = slab * groups + group), so the second reads the slab's weights from L2.
pub fn row_groups(rows: u32) -> u32 {
    rows.div_ceil(16)
}

/// Split-K counters (u32) a launch of `n` columns needs: one per CTA column of the grid.
pub fn counters_len(n: u32) -> usize {
    (n / 64 * row_groups(MAX_ROWS)) as usize
}

/// One launch: entry point, grid, block, and the plan fields of its params.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub entry: &'static str,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    /// First row of `x` (and of the output) this launch covers, and how many rows.
    pub row0: u32,
    pub rows: u32,
    pub fold_kt: u32,
    pub splits: u32,
}

/// Most k-tiles per CTA at which a warpgroup launch whose splits cannot all be resident as
/// clusters takes fewer splits that can ([`wg_clustered`]): on short k ranges the reduction
/// through the clusters' shared memory outweighs the lost parallelism (16 rows at 164ece4:
/// 8B qkv 5 unclustered splits 11.4 us, 4 clustered 8.7; 8B o 8 unclustered 9.6, 6 clustered
/// 7.3), on long ones it does not (8B down, 112 k-tiles per split: 8 unclustered 15.5, 6
/// clustered 17.0; 70B down 45.1 against 55.5).
pub const WG_CLUSTER_MAX_TILES: u32 = 64;

/// A warpgroup launch of `k` rows of weights re-split for clusters: when its splits cannot all
/// be resident as clusters (`fits(splits)` false) and each split streams at most
/// [`WG_CLUSTER_MAX_TILES`] k-tiles, the largest smaller split count (2 or more) whose clusters
/// fit; else the launch as it is.
pub fn wg_clustered(launch: &Launch, k: u32, mut fits: impl FnMut(u32) -> bool) -> Launch {
    let mut l = *launch;
    // `fits` asks the driver: called only where the answer matters, largest count first.
    if wg_rows_of(l.entry).is_none()
        || l.splits < 2
        || k / 16 / l.splits > WG_CLUSTER_MAX_TILES
        || fits(l.splits)
    {
        return l;
    }
    if let Some(s) = (2..l.splits).rev().find(|&s| fits(s)) {
        l.splits = s;
        l.grid.1 = s;
    }
    l
}

/// Fewest k-tiles per CTA the plan gives a warpgroup launch by default (explicit splits may go
/// down to one block).
pub const WG_MIN_TILES: u32 = 16;

/// Whether the warpgroup kernels take a (valid) shape: fold units of 4 or 8 k-tiles (groups of
/// 64 and more; `fold_kt = gcd(group / 16, 8)`) and k a whole number of blocks of
/// `max(4, fold_kt)` k-tiles. Symmetric weights only: the caller checks that.
pub fn wg_eligible(k: u32, group: u32) -> bool {
    let fold_kt = gcd(group / 16, 8);
    fold_kt >= 4 && (k / 16).is_multiple_of(fold_kt.max(4))
}

/// Why a shape can't run on these kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl std::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The launches for `x [m, k] @ W [k, n]` with `group`-row scale groups on a GPU that holds
/// `slots(entry)` resident CTAs of an entry point at once: one launch per 32-row chunk of `m`.
///
/// Split-K: the k range is dealt out in fold units (`fold_kt` 16-row k-tiles, dividing both
/// the group and 8); a 64-column slab gets as many CTAs along k as fit in one wave of resident
/// CTAs (measured best: a second, partial wave costs more than the split-K reduction saves),
/// keeping at least two units per warp. `splits > 0` overrides the choice (at most one warp
/// per unit). `swap_rows`: launches of at most that many rows use the swapped-operand kernels
/// (weights as the mma A operand, x as B): `int4_gemm_swap_*` up to 8 rows,
/// `int4_gemm_swap16_*` (two 8-row n-tiles per CTA, one CTA per 16 rows of a slab,
/// [`row_groups`]) above; 0: the batched kernels throughout ([`SWAP_ROWS_DEFAULT`]). Above 16
/// rows the plan also takes swap16 where the batched kernel's slabs fill more than half of its
/// resident slots but not all (no split-K left; 70B qkv), unless `swap_rows` is 0 or `splits`
/// is given.
/// `stream_k`: launches that use `int4_gemm_swap_*` use its stream-K form instead
/// (`int4_gemm_swapk_*`: one CTA per resident slot at most, each warp an equal share of all
/// the slabs' fold units, at least one; `splits` 0 in the launch).
/// `wg_rows`: launches of at least that many rows (0: none) use the warpgroup kernels
/// (`int4_gemm_wg_*`, wgmma with the weights as the register operand; 8, 16 or 32 rows) where
/// the shape allows them ([`wg_eligible`]; symmetric weights only, which the caller knows):
/// one CTA per slab and split, the k range dealt in blocks of `max(4, fold_kt)` k-tiles, as
/// many splits as fill one wave of resident CTAs with at least [`WG_MIN_TILES`] k-tiles each.
#[allow(clippy::too_many_arguments)]
pub fn plan(
    m: u32,
    k: u32,
    n: u32,
    group: u32,
    f16_scales: bool,
    epilogue: Epilogue,
    slots: &dyn Fn(&'static str) -> u32,
    splits: u32,
    swap_rows: u32,
    stream_k: bool,
    wg_rows: u32,
) -> Result<Vec<Launch>, ShapeError> {
    if k == 0 || !k.is_multiple_of(16) || n == 0 || !n.is_multiple_of(64) {
        return Err(ShapeError(format!(
            "INT4 GEMM needs k % 16 == 0 and n % 64 == 0, got k = {k}, n = {n}"
        )));
    }
    if group == 0 || !group.is_multiple_of(16) || !k.is_multiple_of(group) {
        return Err(ShapeError(format!(
            "INT4 GEMM group {group} must be a multiple of 16 dividing k = {k}"
        )));
    }
    let fold_kt = gcd(group / 16, 8);
    let units = k / 16 / fold_kt;
    let slabs = n / 64;
    let explicit = splits;
    let mut out = Vec::new();
    let mut row0 = 0;
    while row0 < m {
        let rows = (m - row0).min(MAX_ROWS);
        let scale = usize::from(f16_scales);
        let launch = move |entry: &'static str, grid: (u32, u32, u32), splits: u32| Launch {
            entry,
            grid,
            block: (WARPS * 32, 1, 1),
            row0,
            rows,
            fold_kt,
            splits,
        };
        if wg_rows > 0 && rows >= wg_rows && wg_eligible(k, group) {
            let n_index = match rows {
                0..=8 => 0,
                9..=16 => 1,
                _ => 2,
            };
            let entry = ENTRY_POINTS[WG_BASE + epilogue.index() * 6 + scale * 3 + n_index];
            let blocks = k / 16 / fold_kt.max(4);
            let most = (k / 16 / WG_MIN_TILES).clamp(1, blocks);
            let splits = if explicit > 0 {
                explicit.min(blocks).clamp(1, 65535)
            } else {
                (slots(entry) / slabs).clamp(1, most)
            };
            out.push(launch(entry, (slabs, splits, 1), splits));
            row0 += rows;
            continue;
        }
        let mut mt = match rows {
            0..=8 if rows <= swap_rows => 3,
            _ if rows <= swap_rows => 4,
            0..=8 => 0,
            9..=16 => 1,
            _ => 2,
        };
        if mt == 2 && explicit == 0 && swap_rows > 0 {
            // 17-32 rows where the batched m32 kernel's slabs alone take more than half of its
            // resident slots (no split-K) but not all of them: swap16, whose two row groups per
            // slab fill them (70B qkv m32: 55.3 -> 46.7 us, results/h200-int4.json at d82164e).
            // Not with `swap_rows` 0 (the batched kernels throughout).
            let batched = slots(ENTRY_POINTS[epilogue.index() * 6 + scale * 3 + 2]);
            if slabs * 2 > batched && slabs < batched {
                mt = 4;
            }
        }
        let swapped = mt >= 3;
        let groups = if mt == 4 { row_groups(rows) } else { 1 };
        // ENTRY_POINTS runs epilogue, scale type, m-tile, then the swapped kernels by epilogue
        // and scale type, then their `_long` forms, then the same two for swap16, then the
        // stream-K kernels (the test below checks). A kernel's two forms have the same launch bounds, so the split count
        // is planned on the first.
        let swap_base = if mt == 4 { 30 } else { 18 };
        let entry = if swapped {
            ENTRY_POINTS[swap_base + epilogue.index() * 2 + scale]
        } else {
            ENTRY_POINTS[epilogue.index() * 6 + scale * 3 + mt]
        };
        let (entry, grid, splits) = if mt == 3 && stream_k {
            let entry = ENTRY_POINTS[42 + epilogue.index() * 2 + scale];
            let ctas = slots(entry).min((units * slabs).div_ceil(WARPS)).max(1);
            (entry, (ctas, 1, 1), 0)
        } else {
            let splits = if explicit > 0 {
                explicit.min(units.div_ceil(WARPS)).clamp(1, 65535)
            } else {
                // One wave of resident CTAs, each warp at least two fold units; the swapped
                // kernel may go to one unit per warp when that deals the units out exactly (8B
                // o-proj: 7.97 us at 8 splits against 9.25 us at 4,
                // results/experiments/h200-int4-orders-splits-9413a06.json).
                let one_wave = slots(entry) / (slabs * groups);
                let exact_single = swapped
                    && one_wave > 1
                    && one_wave * WARPS <= units
                    && units.is_multiple_of(one_wave * WARPS);
                if exact_single {
                    one_wave
                } else {
                    one_wave.clamp(1, (units / (2 * WARPS)).max(1))
                }
            };
            let entry = if swapped && units * fold_kt >= LONG_STREAM_TILES * splits * WARPS {
                ENTRY_POINTS[swap_base + 6 + epilogue.index() * 2 + scale]
            } else {
                entry
            };
            (entry, (slabs * groups, splits, 1), splits)
        };
        out.push(launch(entry, grid, splits));
        row0 += rows;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan on a 132-SM H200 with the launch bounds' resident CTAs.
    #[allow(clippy::too_many_arguments)]
    fn plan_h200(
        m: u32,
        k: u32,
        n: u32,
        group: u32,
        f16_scales: bool,
        epilogue: Epilogue,
        splits: u32,
        swap: bool,
    ) -> Result<Vec<Launch>, ShapeError> {
        plan(
            m,
            k,
            n,
            group,
            f16_scales,
            epilogue,
            &launch_bound_slots(132),
            splits,
            if swap { SWAP_ALL } else { 0 },
            false,
            0,
        )
    }

    #[test]
    fn params_layout_matches_c() {
        assert_eq!(std::mem::size_of::<Int4WgParams>(), 256);
        assert_eq!(std::mem::offset_of!(Int4WgParams, x_map), 128);
        assert!(SOURCE.contains(r#"static_assert(sizeof(Int4WgParams) == 256"#));
        assert_eq!(wg_rows_of("int4_gemm_wg_swiglu_f16s_n32"), Some(32));
        assert_eq!(wg_rows_of("int4_gemm_swap16_plain_bf16s"), None);
        assert_eq!(std::mem::size_of::<Int4GemmParams>(), 104);
        assert!(SOURCE.contains(r#"static_assert(sizeof(Int4GemmParams) == 104"#));
        assert_eq!(std::mem::offset_of!(Int4GemmParams, m), 72);
        assert_eq!(std::mem::offset_of!(Int4GemmParams, splits), 92);
        assert_eq!(std::mem::offset_of!(Int4GemmParams, slab_stride), 100);
    }

    #[test]
    fn entry_points_are_indexed_by_epilogue_scales_rows() {
        for (e, epi) in [Epilogue::Plain, Epilogue::Residual, Epilogue::SwiGlu]
            .into_iter()
            .enumerate()
        {
            for (s, sc) in ["bf16s", "f16s"].into_iter().enumerate() {
                for (r, rows) in [8, 16, 32].into_iter().enumerate() {
                    assert_eq!(
                        ENTRY_POINTS[e * 6 + s * 3 + r],
                        format!("int4_gemm_{}_{sc}_m{rows}", epi.name())
                    );
                    let l = plan_h200(rows, 64, 64, 32, s == 1, epi, 0, false).unwrap();
                    assert_eq!(l[0].entry, ENTRY_POINTS[e * 6 + s * 3 + r]);
                    let l = plan_h200(rows, 64, 64, 32, s == 1, epi, 0, true).unwrap();
                    if rows <= 8 {
                        assert_eq!(l[0].entry, format!("int4_gemm_swap_{}_{sc}", epi.name()));
                        assert_eq!(l[0].entry, ENTRY_POINTS[18 + e * 2 + s]);
                    } else {
                        assert_eq!(l[0].entry, format!("int4_gemm_swap16_{}_{sc}", epi.name()));
                        assert_eq!(l[0].entry, ENTRY_POINTS[30 + e * 2 + s]);
                        assert_eq!(l[0].grid.0, row_groups(rows));
                    }
                }
            }
        }
        // The swapped kernel's deeper ring when every warp streams LONG_STREAM_TILES k-tiles:
        // 70B gate/up (one split, 128 per warp) yes, 8B o-proj (8 splits, 8 per warp) no.
        for (e, epi) in [Epilogue::Plain, Epilogue::Residual, Epilogue::SwiGlu]
            .into_iter()
            .enumerate()
        {
            for (s, sc) in ["bf16s", "f16s"].into_iter().enumerate() {
                let long = plan_h200(1, 8192, 57344, 128, s == 1, epi, 0, true).unwrap();
                assert_eq!(long[0].entry, ENTRY_POINTS[24 + e * 2 + s]);
                assert_eq!(
                    long[0].entry,
                    format!("int4_gemm_swap_{}_{sc}_long", epi.name())
                );
                let short = plan_h200(1, 4096, 4096, 128, s == 1, epi, 0, true).unwrap();
                assert_eq!(
                    short[0].entry,
                    format!("int4_gemm_swap_{}_{sc}", epi.name())
                );
                let long = plan_h200(32, 8192, 57344, 128, s == 1, epi, 0, true).unwrap();
                assert_eq!(long[0].entry, ENTRY_POINTS[36 + e * 2 + s]);
                assert_eq!(
                    long[0].entry,
                    format!("int4_gemm_swap16_{}_{sc}_long", epi.name())
                );
            }
        }
        // An explicit split count is kept, up to one warp per fold unit.
        let l = plan_h200(1, 4096, 4096, 128, false, Epilogue::Plain, 3, false).unwrap();
        assert_eq!(l[0].splits, 3);
        let l = plan_h200(1, 4096, 4096, 128, false, Epilogue::Plain, 99, false).unwrap();
        assert_eq!(l[0].splits, 8);
    }

    #[test]
    fn word_orders_are_permutations_of_the_blocks() {
        let (k, n) = (64usize, 192usize);
        for order in [WordOrder::KtMajor, WordOrder::SlabMajor] {
            let mut seen = vec![false; k / 16 * n / 64];
            for kt in 0..k / 16 {
                for slab in 0..n / 64 {
                    let b = order.block(kt, slab, k, n);
                    assert!(!seen[b]);
                    seen[b] = true;
                    let (ks, ss) = order.strides(k as u32, n as u32);
                    assert_eq!(b, kt * ks as usize + slab * ss as usize);
                }
            }
        }
    }

    #[test]
    fn source_is_self_contained_and_instantiates_every_entry() {
        // No includes but the shared headers, which the compile writes in place.
        assert!(!crate::kernels::expand_includes(SOURCE).contains("#include"));
        for e in ENTRY_POINTS {
            // The swapped entry points come from INT4_GEMM_SWAP_ENTRIES(prefix, ...): one per
            // epilogue, scale type and ring form.
            let swapped = ["int4_gemm_swap16", "int4_gemm_swap"]
                .into_iter()
                .find(|p| e.starts_with(&format!("{p}_")));
            let defined = match swapped {
                Some(prefix) => {
                    SOURCE.contains(&format!("INT4_GEMM_SWAP_ENTRIES({prefix},"))
                        && SOURCE.contains(&format!(
                            "INT4_GEMM_SWAP_ENTRY(PREFIX##{},",
                            &e[prefix.len()..]
                        ))
                }
                None if e.starts_with("int4_gemm_wg_") => {
                    // INT4_GEMM_WG_ENTRIES(epilogue, ...) instantiates both scale types and rows.
                    let epi = e["int4_gemm_wg_".len()..].split('_').next().unwrap();
                    SOURCE.contains(&format!("INT4_GEMM_WG_ENTRIES({epi},"))
                        && SOURCE.contains(&format!(
                            "INT4_GEMM_WG_ENTRY(int4_gemm_wg_##EPI_NAME##{},",
                            &e["int4_gemm_wg_".len() + epi.len()..]
                        ))
                }
                None => {
                    SOURCE.contains(&format!("INT4_GEMM_ENTRY({e},"))
                        || SOURCE.contains(&format!("INT4_GEMM_SWAPK_ENTRY({e},"))
                }
            };
            assert!(defined, "{e}");
        }
        let defined = SOURCE.matches("INT4_GEMM_ENTRY(int4_gemm_").count()
            + 12 * SOURCE.matches("INT4_GEMM_SWAP_ENTRIES(int4_gemm_").count()
            + SOURCE
                .matches("INT4_GEMM_SWAPK_ENTRY(int4_gemm_swapk_")
                .count()
            + 6 * SOURCE.matches("\nINT4_GEMM_WG_ENTRIES(").count();
        assert_eq!(defined, ENTRY_POINTS.len());
        assert_eq!(SOURCE.matches("INT4_GEMM_SWAP_ENTRY(PREFIX##").count(), 12);
    }

    #[test]
    fn swap16_above_16_rows_where_the_batched_slabs_leave_no_split() {
        // The plan's first launch with the default swap rows and `splits` (0: the plan's),
        // warpgroup kernels off.
        let default = |m, k, n, splits| {
            let slots = launch_bound_slots(132);
            plan(
                m,
                k,
                n,
                128,
                false,
                Epilogue::Plain,
                &slots,
                splits,
                SWAP_ROWS_DEFAULT,
                false,
                0,
            )
            .unwrap()[0]
        };
        // 70B qkv: 160 slabs against 264 batched m32 slots; two row groups per slab.
        let l = default(32, 8192, 10240, 0);
        assert_eq!(l.grid, (320, 1, 1));
        // (rows, k, n, splits) -> entry. 17-32 rows on 70B qkv: swap16. 16 rows, slabs that
        // allow split-K, more slabs than slots, or forced splits: the batched kernels.
        for (m, k, n, splits, entry) in [
            (32, 8192, 10240, 0, "int4_gemm_swap16_plain_bf16s_long"),
            (17, 8192, 10240, 0, "int4_gemm_swap16_plain_bf16s_long"),
            (16, 8192, 10240, 0, "int4_gemm_plain_bf16s_m16"),
            (32, 8192, 8192, 0, "int4_gemm_plain_bf16s_m32"),
            (32, 8192, 57344, 0, "int4_gemm_plain_bf16s_m32"),
            (32, 8192, 10240, 2, "int4_gemm_plain_bf16s_m32"),
        ] {
            assert_eq!(
                default(m, k, n, splits).entry,
                entry,
                "m {m} k {k} n {n} splits {splits}"
            );
        }
        // Batched throughout (swap_rows 0) keeps the batched kernel.
        let batched = plan_h200(32, 8192, 10240, 128, false, Epilogue::Plain, 0, false).unwrap();
        assert_eq!(batched[0].entry, "int4_gemm_plain_bf16s_m32");
    }

    #[test]
    fn plans_cover_every_row_once_and_fill_the_gpu() {
        for &(k, n, group) in &[
            (576, 576, 64),
            (576, 1536, 32),
            (4096, 4096, 128),
            (14336, 4096, 128),
            (4096, 57344, 128),
            (1536, 4160, 32),
            (4096, 960, 4096),
        ] {
            for (m, swap) in [1, 2, 7, 16, 31, 32, 33, 100]
                .into_iter()
                .flat_map(|m| [(m, false), (m, true)])
            {
                let plan = plan_h200(m, k, n, group, false, Epilogue::Plain, 0, swap).unwrap();
                let covered: u32 = plan.iter().map(|l| l.rows).sum();
                assert_eq!(covered, m);
                for (i, l) in plan.iter().enumerate() {
                    assert_eq!(l.row0, i as u32 * 32);
                    assert!((16 * l.fold_kt) % 16 == 0 && group % (16 * l.fold_kt) == 0);
                    assert!(8 % l.fold_kt == 0);
                    let units = k / 16 / l.fold_kt;
                    assert!(
                        l.splits * WARPS <= units.max(WARPS) + WARPS,
                        "{k} {n} {l:?}"
                    );
                    let tile = [8, 16, 32].into_iter().find(|t| l.rows <= *t).unwrap();
                    let groups = if swap && tile > 8 {
                        row_groups(l.rows)
                    } else {
                        1
                    };
                    assert_eq!(l.grid, (n / 64 * groups, l.splits, 1));
                    assert!(l.grid.0 as usize <= counters_len(n));
                    if swap && tile == 8 {
                        assert!(l.entry.starts_with("int4_gemm_swap_"), "{l:?}");
                    } else if swap {
                        assert!(l.entry.starts_with("int4_gemm_swap16_"), "{l:?}");
                    } else {
                        assert!(l.entry.ends_with(&format!("_m{tile}")));
                    }
                }
            }
        }
        // A big square matrix is split along k up to one wave of CTAs, two units per warp.
        let l = plan_h200(1, 4096, 4096, 128, false, Epilogue::Plain, 0, false).unwrap()[0];
        assert_eq!((l.fold_kt, l.splits), (8, 4));
        let l = plan_h200(1, 576, 576, 64, true, Epilogue::SwiGlu, 0, false).unwrap()[0];
        assert_eq!(l.entry, "int4_gemm_swiglu_f16s_m8");
        let l = plan_h200(20, 576, 576, 64, false, Epilogue::Residual, 0, false).unwrap();
        assert_eq!(l[0].entry, "int4_gemm_residual_bf16s_m32");
        let l = plan_h200(20, 576, 576, 64, false, Epilogue::Residual, 0, true).unwrap();
        assert_eq!(l[0].entry, "int4_gemm_swap16_residual_bf16s");
        assert_eq!(l[0].grid.0, 9 * 2);
        // Stream-K: the swapped m <= 8 launches only, one CTA per resident slot at most and
        // at least one fold unit per warp.
        for (e, epi) in [Epilogue::Plain, Epilogue::Residual, Epilogue::SwiGlu]
            .into_iter()
            .enumerate()
        {
            for (s, sc) in ["bf16s", "f16s"].into_iter().enumerate() {
                let sk = |m, k, n| {
                    plan(
                        m,
                        k,
                        n,
                        128,
                        s == 1,
                        epi,
                        &launch_bound_slots(132),
                        0,
                        8,
                        true,
                        0,
                    )
                    .unwrap()
                };
                let l = sk(8, 8192, 57344);
                assert_eq!(l[0].entry, ENTRY_POINTS[42 + e * 2 + s]);
                assert_eq!(l[0].entry, format!("int4_gemm_swapk_{}_{sc}", epi.name()));
                assert_eq!((l[0].grid, l[0].splits), ((528, 1, 1), 0));
                // 8B o-proj: 64 slabs x 32 units = 2048 units, one per warp.
                assert_eq!(sk(1, 4096, 4096)[0].grid, (512, 1, 1));
                // Rows past 8 keep their kernels.
                let l = sk(40, 4096, 4096);
                assert_eq!(l.len(), 2);
                assert!(l[0].entry.ends_with("_m32") && l[1].entry.starts_with("int4_gemm_swapk_"));
            }
        }
        let bad = |k, n, g| plan_h200(1, k, n, g, false, Epilogue::Plain, 0, false).is_err();
        assert!(bad(100, 64, 16) && bad(128, 96, 16) && bad(128, 64, 48));
    }

    #[test]
    fn warpgroup_launches_where_the_shape_allows_them() {
        let wg = |m, k, n, group, splits, wg_rows| {
            plan(
                m,
                k,
                n,
                group,
                true,
                Epilogue::SwiGlu,
                &launch_bound_slots(132),
                splits,
                SWAP_ROWS_DEFAULT,
                false,
                wg_rows,
            )
            .unwrap()
        };
        // Groups of 32 (fold units of 2 k-tiles) and k not a whole number of blocks: never.
        assert!(!wg_eligible(1536, 32) && !wg_eligible(64 * 9 + 32, 64 * 9 + 32));
        assert!(wg_eligible(576, 64) && wg_eligible(576, 576) && wg_eligible(4096, 128));
        assert!(!wg_eligible(4096 + 64, 128));
        let l = wg(1536, 1536, 4160, 32, 0, 1);
        assert!(l.iter().all(|l| !l.entry.starts_with("int4_gemm_wg_")));
        // 8B qkv at 16 and 40 rows from 9 rows on: one wave of 528 CTAs over 96 slabs, 5 splits;
        // the 8-row tail keeps the swapped kernel.
        let l = wg(16, 4096, 6144, 128, 0, 9);
        assert_eq!(l[0].entry, "int4_gemm_wg_swiglu_f16s_n16");
        assert_eq!((l[0].grid, l[0].splits, l[0].fold_kt), ((96, 5, 1), 5, 8));
        let l = wg(40, 4096, 6144, 128, 0, 9);
        assert_eq!(l.len(), 2);
        assert_eq!(l[0].entry, "int4_gemm_wg_swiglu_f16s_n32");
        assert_eq!((l[1].row0, l[1].rows), (32, 8));
        assert!(l[1].entry.starts_with("int4_gemm_swap_"));
        // At least WG_MIN_TILES k-tiles per CTA by default; explicit splits down to one block.
        let l = wg(1, 1024, 64, 128, 0, 1);
        assert_eq!(
            (l[0].entry, l[0].splits),
            ("int4_gemm_wg_swiglu_f16s_n8", 4)
        );
        assert_eq!(wg(1, 1024, 64, 128, 99, 1)[0].splits, 8);
        assert_eq!(wg(1, 576, 64, 64, 99, 1)[0].splits, 9);
        // 0: never.
        assert!(
            !wg(32, 4096, 6144, 128, 0, 0)[0]
                .entry
                .starts_with("int4_gemm_wg_")
        );
    }

    #[test]
    fn warpgroup_splits_rechosen_for_clusters_on_short_ranges() {
        let l = |entry, slabs, splits| Launch {
            entry,
            grid: (slabs, splits, 1),
            block: (128, 1, 1),
            row0: 0,
            rows: 16,
            fold_kt: 8,
            splits,
        };
        let up_to = |most| move |s: u32| s <= most;
        // 8B qkv at 16 rows: 5 splits of 51 k-tiles whose clusters do not fit -> 4.
        let r = wg_clustered(&l("int4_gemm_wg_plain_bf16s_n16", 96, 5), 4096, up_to(4));
        assert_eq!((r.splits, r.grid), (4, (96, 4, 1)));
        // 8B o: 8 splits of 32 k-tiles -> the largest that fits, 6.
        assert_eq!(
            wg_clustered(&l("int4_gemm_wg_plain_bf16s_n16", 64, 8), 4096, up_to(6)).splits,
            6
        );
        // Clusters that fit, long ranges (8B down: 112 k-tiles per split), nothing that fits,
        // and other kernels: unchanged.
        let same = |x: Launch, k, fits: &dyn Fn(u32) -> bool| wg_clustered(&x, k, fits) == x;
        assert!(same(
            l("int4_gemm_wg_plain_bf16s_n16", 96, 5),
            4096,
            &up_to(5)
        ));
        assert!(same(
            l("int4_gemm_wg_plain_bf16s_n16", 64, 8),
            14336,
            &up_to(6)
        ));
        assert!(same(
            l("int4_gemm_wg_plain_bf16s_n16", 96, 5),
            4096,
            &up_to(1)
        ));
        assert!(same(
            l("int4_gemm_swap_plain_bf16s", 96, 5),
            4096,
            &up_to(4)
        ));
    }
}
