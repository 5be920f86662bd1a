//! W4A16 GEMM kernels: params mirror, entry points and launch plan for `kernels/int4_gemm_*.cu`.
//!
//! `y = x W` for bf16 `x [m, k]` and a packed INT4 `W [k, n]` (docs/INT4_FORMAT.md), f32
//! accumulation, bf16 output, with a plain, residual-add or SwiGLU epilogue and an optional
//! per-row scale. One launch covers up to 32 rows; [`plan`] cuts larger `m` into 32-row chunks.
//! `kernels/int4_gemm.cuh` and each family's `.cu` header document the algorithm.
//!

/// The kernels' single argument, passed by value. Mirrors `struct Int4GemmParams` in
/// `kernels/int4_gemm.cuh` field for field (the header asserts `sizeof == 160`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Int4GemmParams {
    /// `[m, k]` bf16, row-major.
    pub x: DevicePtr<bf16>,
    /// `k * n / 8` words in fragment order.
    pub words: DevicePtr<u32>,
    /// `[k / group, n]` 16-bit scales (bf16 or f16 bits: the entry point's `_bf16s` / `_f16s`).
    pub scales: DevicePtr<u16>,
    /// `[k / group, n]` 16-bit offsets, or null for symmetric weights.
    pub offsets: DevicePtr<u16>,
    /// `[m, n]` bf16 (`[m, n / 2]` for SwiGLU).
    pub out: DevicePtrMut<bf16>,
    /// `[m, n]` bf16, for the residual epilogue; null otherwise.
    pub residual: DevicePtr<bf16>,
    /// `[m]` f32 row factors, or null.
    pub row_scale: DevicePtr<f32>,
    /// `[m, n]` f32, all zeros on entry (left zeroed); needed when `splits != 1` and the
    /// launch forms no clusters.
    pub workspace: DevicePtrMut<f32>,
    /// [`counters_len`] u32, all zeros on entry (left zeroed); needed when `splits != 1`.
    pub counters: DevicePtrMut<u32>,
    /// The gain `[n]` bf16 of an RMSNorm folded into the GEMM that reads `out` (null: none);
    /// the kernel then also writes `gained` and `norm_ss` (`kernels/int4_gemm.cuh`).
    pub norm_gain: DevicePtr<bf16>,
    /// `[m, n]` bf16: `out * norm_gain` (with `norm_gain`).
    pub gained: DevicePtrMut<bf16>,
    /// `[n / 64][norm_stride]` f32: each 64-column slab's sum of `out^2` per row (with
    /// `norm_gain`).
    pub norm_ss: DevicePtrMut<f32>,
    /// `[k / 64][norm_stride]` f32 slab sums of a folded norm's input, or null: `x` is the
    /// producer's `gained`, and each row is scaled by `rsqrt(sum / k + eps)`.
    pub ss_in: DevicePtr<f32>,
    /// The decode q|k|v epilogue ([`QkvRopeParams`] in device memory; plain epilogue), or null.
    pub qkv: DevicePtr<QkvRopeParams>,
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
    /// Rows between slabs of `norm_ss` and `ss_in` (the call's rows).
    pub norm_stride: u32,
    /// The folded norm's epsilon (with `ss_in`).
    pub eps: f32,
    /// The launch's first row in the call (`qkv`'s per-row arrays).
    pub row0: u32,
    pub pad: u32,
}

/// `struct QkvRope` of `kernels/int4_gemm.cuh`: the decode q|k|v epilogue's targets for heads of
/// 64 (a 64-column slab is one head, q heads then k then v). Row `r`'s values are rounded to
/// bf16, its q and k heads rotated (rotate-half RoPE) at `pos[r]` from `rope` (`[max_pos, 32,
/// 2]` cos, sin), q written to the GEMM's `out` (`[m, heads * 64]`), k and v appended at slot
/// `slot_of[r]`, position `pos[r]` of `main` and (rotated, quantized) `mirror`, and `len[r]` is
/// `pos[r] + 1`: the bits of the plain epilogue followed by `rope_append`. The kernels read it
/// from device memory (one per layer of a decoder).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct QkvRopeParams {
    pub rope: DevicePtr<f32>,
    pub slot_of: DevicePtr<u32>,
    pub pos: DevicePtr<u32>,
    pub len: DevicePtrMut<u32>,
    pub main: super::decode_attention::KvCacheParams,
    pub mirror: super::decode_attention::KvCacheParams,
    pub heads: u32,
    pub block: u32,
    pub max_pos: u32,
    pub pad: u32,
}

impl QkvRopeParams {
    /// `targets` (one per layer) as the bytes a device copy holds.
    pub fn bytes(targets: &[Self]) -> &[u8] {
        // SAFETY: #[repr(C)] structs of pointers and integers whose padding is explicit (the
        // `pad` fields), so every byte is initialized; the length covers the same memory.
        unsafe {
            std::slice::from_raw_parts(
                targets.as_ptr().cast::<u8>(),
                std::mem::size_of_val(targets),
            )
        }
    }

    /// The targets of a prefill q|k|v epilogue, for the decode kernels (heads of 64; `None`
    /// for other head dims, which span two slabs).
    pub fn from_epilogue(e: &super::fp8_gemm::QkvEpilogue) -> Option<Self> {
        (e.head_dim() == 64).then_some(Self {
            rope: e.rope,
            slot_of: e.slot_of,
            pos: e.pos,
            len: e.len,
            main: e.main,
            mirror: e.mirror,
            heads: e.heads,
            block: e.block,
            max_pos: e.max_pos,
            pad: 0,
        })
    }
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

use super::{EntryPoint, KernelParams};
use crate::{DevicePtr, DevicePtrMut};
use half::bf16;

// SAFETY: the layouts are the `.cu` structs' (asserted in `params_layout_matches_c`), with the
// pointers' element types as the kernels read and write them.
unsafe impl KernelParams for Int4GemmParams {}
unsafe impl KernelParams for Int4WgParams {}

/// The kernel families, one source file each (all include `kernels/int4_gemm.cuh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// `int4_gemm_swap_EPI_SC[_long]` (`kernels/int4_gemm_swap.cu`): up to 8 rows, weights as
    /// the mma A operand; `long`: the deeper load ring for long k streams.
    Swap { long: bool },
    /// `int4_gemm_wg_EPI_SC_nN` (`kernels/int4_gemm_wg.cu`): up to `rows` = 8, 16 or 32 rows on
    /// the warpgroup MMA; symmetric weights with groups of 64 and more ([`wg_eligible`]).
    Warpgroup { rows: u32 },
    /// `int4_gemm_EPI_SC_mROWS` (`kernels/int4_gemm_batched.cu`): up to `rows` = 16 or 32 rows
    /// of any weight the warpgroup kernels cannot take.
    Batched { rows: u32 },
}

impl Family {
    /// Every family instantiated by the sources, in the order [`Entry::all`] lists them.
    pub const ALL: [Family; 7] = [
        Family::Swap { long: false },
        Family::Swap { long: true },
        Family::Warpgroup { rows: 8 },
        Family::Warpgroup { rows: 16 },
        Family::Warpgroup { rows: 32 },
        Family::Batched { rows: 16 },
        Family::Batched { rows: 32 },
    ];

    /// The source file that instantiates this family's entry points.
    pub fn source(self) -> &'static super::KernelSource {
        match self {
            Family::Swap { .. } => &super::INT4_GEMM_SWAP,
            Family::Warpgroup { .. } => &super::INT4_GEMM_WG,
            Family::Batched { .. } => &super::INT4_GEMM_BATCHED,
        }
    }
}

/// One W4A16 entry point: the single description of the set of instantiated kernels. Its
/// [`name`](Entry::name) is the `extern "C"` symbol the `.cu` macros produce; the precompile
/// check (CI) compiles every source and fails unless the compiled entry points are exactly
/// [`Entry::all`]'s names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Entry {
    pub family: Family,
    pub epilogue: Epilogue,
    /// f16 scales and offsets (`_f16s`), else bf16 (`_bf16s`).
    pub f16_scales: bool,
}

impl Entry {
    /// Every instantiated entry point: each family x epilogue x scale type.
    pub fn all() -> impl Iterator<Item = Entry> {
        Family::ALL.into_iter().flat_map(|family| {
            [Epilogue::Plain, Epilogue::Residual, Epilogue::SwiGlu]
                .into_iter()
                .flat_map(move |epilogue| {
                    [false, true].map(|f16_scales| Entry {
                        family,
                        epilogue,
                        f16_scales,
                    })
                })
        })
    }

    fn format(self) -> String {
        let (epi, sc) = (
            self.epilogue.name(),
            if self.f16_scales { "f16s" } else { "bf16s" },
        );
        match self.family {
            Family::Swap { long: false } => format!("int4_gemm_swap_{epi}_{sc}"),
            Family::Swap { long: true } => format!("int4_gemm_swap_{epi}_{sc}_long"),
            Family::Warpgroup { rows } => format!("int4_gemm_wg_{epi}_{sc}_n{rows}"),
            Family::Batched { rows } => format!("int4_gemm_{epi}_{sc}_m{rows}"),
        }
    }

    /// Every entry point with its symbol, made once.
    fn table() -> &'static [(Entry, &'static str)] {
        static NAMES: std::sync::OnceLock<Vec<(Entry, &'static str)>> = std::sync::OnceLock::new();
        NAMES.get_or_init(|| {
            Entry::all()
                .map(|e| (e, &*Box::leak(e.format().into_boxed_str())))
                .collect()
        })
    }

    /// The entry point's symbol.
    pub fn name(self) -> &'static str {
        Self::table()
            .iter()
            .find(|(e, _)| *e == self)
            .map(|(_, n)| *n)
            .expect("Entry::all lists every entry")
    }

    /// The entry point, typed by its parameter: `Ok` for the kernels that take
    /// [`Int4GemmParams`], `Err` for the warpgroup kernels, which take [`Int4WgParams`].
    pub fn entry_point(self) -> Result<EntryPoint<Int4GemmParams>, EntryPoint<Int4WgParams>> {
        match self.family {
            Family::Warpgroup { .. } => Err(EntryPoint::new(self.family.source(), self.name())),
            _ => Ok(EntryPoint::new(self.family.source(), self.name())),
        }
    }

    /// The entry point of symbol `name`, if it is one.
    pub fn from_name(name: &str) -> Option<Entry> {
        Self::table()
            .iter()
            .find(|(_, n)| *n == name)
            .map(|(e, _)| *e)
    }
}

/// The source file of entry point `entry` (the swapped kernels' for a name that is none: the
/// runtime then reports the entry point missing).
pub fn source_of(entry: &str) -> &'static super::KernelSource {
    Entry::from_name(entry).map_or(&super::INT4_GEMM_SWAP, |e| e.family.source())
}

/// The names of the entry points `file` instantiates.
pub fn entry_names(file: &str) -> Vec<&'static str> {
    Entry::all()
        .filter(|e| e.family.source().file == file)
        .map(Entry::name)
        .collect()
}

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
    match Entry::from_name(entry)?.family {
        Family::Warpgroup { rows } => Some(rows),
        _ => None,
    }
}

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
/// Resident CTAs per SM an entry point's launch bounds ask for (warpgroup n8: 5, swapped and
/// warpgroup n16 / n32: 4, batched m16: 3, m32: 2).
/// The runtime plans with the occupancy calculator instead ([`crate::Runtime::resident_ctas`]);
/// this is the expectation for code without a GPU (shape checks, tests).
pub fn launch_bound_ctas(entry: &str) -> u32 {
    match Entry::from_name(entry).map(|e| e.family) {
        Some(Family::Warpgroup { rows: 8 }) => 5,
        Some(Family::Swap { .. } | Family::Warpgroup { .. }) => 4,
        Some(Family::Batched { rows: 32 }) => 2,
        _ => 3,
    }
}

/// Resident CTAs on a whole GPU of `sm_count` SMs by the launch bounds (see
/// [`launch_bound_ctas`]).
pub fn launch_bound_slots(sm_count: u32) -> impl Fn(&'static str) -> u32 {
    move |entry| launch_bound_ctas(entry) * sm_count
}

/// Rows the swapped kernels take: up to 8 (one 8-row n-tile per CTA).
pub const SWAP_ROWS: u32 = 8;
/// Rows from which the plan uses the warpgroup kernels by default (`int4_gemm_wg_*`, where the
/// shape, the weight and x allow them): 9. At 16 and 32 rows they are faster than every other
/// kernel on all 16 benchmark points (results/h200-int4.json). At 1 row the swapped kernel is
/// faster on 6 of the 8 shapes, ties on 8B qkv and is slower on 70B qkv, so it keeps 8 rows
/// and fewer by default; the per-shape tuner (`int4::tuned_plan`) takes the warpgroup n8
/// kernel where it measures faster.
pub const WG_ROWS_DEFAULT: u32 = 9;

/// Split-K counters (u32) a launch of `n` columns needs: one per CTA column of the grid.
pub fn counters_len(n: u32) -> usize {
    (n / 64) as usize
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

pub use crate::ShapeError;

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The launches for `x [m, k] @ W [k, n]` with `group`-row scale groups on a GPU that holds
/// `slots(entry)` resident CTAs of an entry point at once: one launch per 32-row chunk of `m`.
///
/// Kernels: up to 8 rows the swapped kernels ([`Family::Swap`]); from `wg_rows` rows (0:
/// never; [`WG_ROWS_DEFAULT`]) the warpgroup kernels where the shape allows them
/// ([`wg_eligible`]; symmetric weights only, which the caller knows: `wg_rows` 0 otherwise);
/// 9-32 rows of other weights the batched kernels ([`Family::Batched`]).
///
/// Split-K: the k range is dealt out in fold units (`fold_kt` 16-row k-tiles, dividing both
/// the group and 8); a 64-column slab gets as many CTAs along k as fit in one wave of resident
/// CTAs (measured best: a second, partial wave costs more than the split-K reduction saves),
/// keeping at least two units per warp (the swapped kernel may go to one unit per warp when
/// that deals the units out exactly). `splits > 0` overrides the choice (at most one warp per
/// unit). Warpgroup launches deal the k range in blocks of `max(4, fold_kt)` k-tiles, as many
/// splits as fill one wave with at least [`WG_MIN_TILES`] k-tiles each.
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
    wg_rows: u32,
) -> Result<Vec<Launch>, ShapeError> {
    if k == 0 || !k.is_multiple_of(16) || n == 0 || !n.is_multiple_of(64) {
        return Err(ShapeError::new(
            "INT4 GEMM [k, n]",
            "k % 16 == 0 and n % 64 == 0",
            format!("k = {k}, n = {n}"),
        ));
    }
    if group == 0 || !group.is_multiple_of(16) || !k.is_multiple_of(group) {
        return Err(ShapeError::new(
            "INT4 GEMM group",
            format!("a multiple of 16 dividing k = {k}"),
            group.to_string(),
        ));
    }
    let fold_kt = gcd(group / 16, 8);
    let units = k / 16 / fold_kt;
    let slabs = n / 64;
    let explicit = splits;
    let entry = |family| {
        Entry {
            family,
            epilogue,
            f16_scales,
        }
        .name()
    };
    let mut out = Vec::new();
    let mut row0 = 0;
    while row0 < m {
        let rows = (m - row0).min(MAX_ROWS);
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
            let tier = [8, 16, 32].into_iter().find(|&t| rows <= t).unwrap();
            let entry = entry(Family::Warpgroup { rows: tier });
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
        let swapped = rows <= SWAP_ROWS;
        let family = if swapped {
            Family::Swap { long: false }
        } else {
            Family::Batched {
                rows: if rows <= 16 { 16 } else { 32 },
            }
        };
        // A kernel's two ring forms have the same launch bounds, so the split count is planned
        // on the first.
        let first = entry(family);
        let splits = if explicit > 0 {
            explicit.min(units.div_ceil(WARPS)).clamp(1, 65535)
        } else {
            // One wave of resident CTAs, each warp at least two fold units; the swapped kernel
            // may go to one unit per warp when that deals the units out exactly (8B o-proj).
            let one_wave = slots(first) / slabs;
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
        let long = swapped && units * fold_kt >= LONG_STREAM_TILES * splits * WARPS;
        let entry = if long {
            entry(Family::Swap { long: true })
        } else {
            first
        };
        out.push(launch(entry, (slabs, splits, 1), splits));
        row0 += rows;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plan on a 132-SM H200 with the launch bounds' resident CTAs; `wg`: the warpgroup
    /// kernels from 9 rows.
    #[allow(clippy::too_many_arguments)]
    fn plan_h200(
        m: u32,
        k: u32,
        n: u32,
        group: u32,
        f16_scales: bool,
        epilogue: Epilogue,
        splits: u32,
        wg: bool,
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
            if wg { WG_ROWS_DEFAULT } else { 0 },
        )
    }

    #[test]
    fn params_layout_matches_c() {
        let header = include_str!("../../../../kernels/int4_gemm.cuh");
        assert_eq!(std::mem::size_of::<Int4WgParams>(), 320);
        assert_eq!(std::mem::offset_of!(Int4WgParams, x_map), 192);
        assert!(
            super::super::INT4_GEMM_WG
                .source
                .contains(r#"static_assert(sizeof(Int4WgParams) == 320"#)
        );
        assert_eq!(wg_rows_of("int4_gemm_wg_swiglu_f16s_n32"), Some(32));
        assert_eq!(wg_rows_of("int4_gemm_swap_plain_bf16s"), None);
        assert_eq!(std::mem::size_of::<Int4GemmParams>(), 160);
        assert!(header.contains(r#"static_assert(sizeof(Int4GemmParams) == 160"#));
        assert_eq!(std::mem::offset_of!(Int4GemmParams, norm_gain), 72);
        assert_eq!(std::mem::offset_of!(Int4GemmParams, ss_in), 96);
        assert_eq!(std::mem::offset_of!(Int4GemmParams, qkv), 104);
        assert_eq!(std::mem::offset_of!(Int4GemmParams, m), 112);
        assert_eq!(std::mem::offset_of!(Int4GemmParams, splits), 132);
        assert_eq!(std::mem::offset_of!(Int4GemmParams, slab_stride), 140);
        assert_eq!(std::mem::offset_of!(Int4GemmParams, eps), 148);
        assert_eq!(std::mem::offset_of!(Int4GemmParams, row0), 152);
        assert_eq!(std::mem::size_of::<QkvRopeParams>(), 176);
        assert!(header.contains(r#"static_assert(sizeof(QkvRope) == 176"#));
        assert_eq!(std::mem::offset_of!(QkvRopeParams, main), 32);
        assert_eq!(std::mem::offset_of!(QkvRopeParams, heads), 160);
    }

    #[test]
    fn entry_names_are_unique_and_round_trip() {
        let all: Vec<Entry> = Entry::all().collect();
        assert_eq!(all.len(), 7 * 6);
        let mut names: Vec<&str> = all.iter().map(|e| e.name()).collect();
        for (e, n) in all.iter().zip(&names) {
            assert_eq!(Entry::from_name(n), Some(*e));
        }
        assert_eq!(
            Entry {
                family: Family::Swap { long: true },
                epilogue: Epilogue::SwiGlu,
                f16_scales: true
            }
            .name(),
            "int4_gemm_swap_swiglu_f16s_long"
        );
        names.sort();
        names.dedup();
        assert_eq!(names.len(), all.len());
        let per_file: usize = [
            "int4_gemm_swap.cu",
            "int4_gemm_wg.cu",
            "int4_gemm_batched.cu",
        ]
        .iter()
        .map(|f| entry_names(f).len())
        .sum();
        assert_eq!(per_file, all.len());
    }

    #[test]
    fn sources_instantiate_each_family_once_per_epilogue() {
        for (file, src, macro_name) in [
            (
                "swap",
                super::super::INT4_GEMM_SWAP.source,
                "INT4_GEMM_SWAP_ENTRIES(",
            ),
            (
                "wg",
                super::super::INT4_GEMM_WG.source,
                "INT4_GEMM_WG_ENTRIES(",
            ),
            (
                "batched",
                super::super::INT4_GEMM_BATCHED.source,
                "INT4_GEMM_ENTRIES(",
            ),
        ] {
            for epi in ["plain", "residual", "swiglu"] {
                assert!(
                    src.contains(&format!("\n{macro_name}{epi}, ")),
                    "{file}: {epi}"
                );
            }
            assert!(
                !crate::kernels::expand_includes(src).contains("#include"),
                "{file}"
            );
        }
    }

    #[test]
    fn families_by_rows_epilogue_and_scales() {
        for epi in [Epilogue::Plain, Epilogue::Residual, Epilogue::SwiGlu] {
            for f16 in [false, true] {
                let name = |family| {
                    Entry {
                        family,
                        epilogue: epi,
                        f16_scales: f16,
                    }
                    .name()
                };
                for rows in [1, 8] {
                    let l = plan_h200(rows, 4096, 4096, 128, f16, epi, 0, false).unwrap();
                    assert_eq!(l[0].entry, name(Family::Swap { long: false }));
                }
                // 9-32 rows of weights the warpgroup kernels cannot take (groups of 32).
                let l = plan_h200(16, 1536, 4160, 32, f16, epi, 0, true).unwrap();
                assert_eq!(l[0].entry, name(Family::Batched { rows: 16 }));
                let l = plan_h200(20, 1536, 4160, 32, f16, epi, 0, true).unwrap();
                assert_eq!(l[0].entry, name(Family::Batched { rows: 32 }));
                // The deeper ring when every warp streams LONG_STREAM_TILES k-tiles.
                let long = plan_h200(1, 8192, 57344, 128, f16, epi, 0, true).unwrap();
                assert_eq!(long[0].entry, name(Family::Swap { long: true }));
                let l = plan_h200(16, 4096, 4096, 128, f16, epi, 0, true).unwrap();
                assert_eq!(l[0].entry, name(Family::Warpgroup { rows: 16 }));
            }
        }
        // Explicit splits, capped at one warp per unit.
        let l = plan_h200(1, 4096, 4096, 128, false, Epilogue::Plain, 3, false).unwrap();
        assert_eq!(l[0].splits, 3);
        let l = plan_h200(1, 4096, 4096, 128, false, Epilogue::Plain, 99, false).unwrap();
        assert_eq!(l[0].splits, 4096 / 16 / 8 / WARPS);
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
            for m in [1, 2, 7, 16, 31, 32, 33, 100] {
                let plan = plan_h200(m, k, n, group, false, Epilogue::Plain, 0, false).unwrap();
                let covered: u32 = plan.iter().map(|l| l.rows).sum();
                assert_eq!(covered, m);
                for (i, l) in plan.iter().enumerate() {
                    assert_eq!(l.row0, i as u32 * 32);
                    assert!(group % (16 * l.fold_kt) == 0);
                    assert!(8 % l.fold_kt == 0);
                    let units = k / 16 / l.fold_kt;
                    assert!(
                        l.splits * WARPS <= units.max(WARPS) + WARPS,
                        "{k} {n} {l:?}"
                    );
                    assert_eq!(l.grid, (n / 64, l.splits, 1));
                    assert!(l.grid.0 as usize <= counters_len(n));
                    if l.rows <= 8 {
                        assert!(l.entry.starts_with("int4_gemm_swap_"), "{l:?}");
                    } else {
                        let tile = if l.rows <= 16 { 16 } else { 32 };
                        assert!(l.entry.ends_with(&format!("_m{tile}")), "{l:?}");
                    }
                }
            }
        }
        // A square matrix is split along k up to one wave of CTAs (8 per slab at 4 CTAs per
        // SM), here one fold unit per warp since that deals the 32 units out exactly.
        let l = plan_h200(1, 4096, 4096, 128, false, Epilogue::Plain, 0, false).unwrap()[0];
        assert_eq!((l.fold_kt, l.splits), (8, 8));
        let l = plan_h200(1, 576, 576, 64, true, Epilogue::SwiGlu, 0, false).unwrap()[0];
        assert_eq!(l.entry, "int4_gemm_swap_swiglu_f16s");
        let l = plan_h200(20, 576, 576, 64, false, Epilogue::Residual, 0, false).unwrap();
        assert_eq!(l[0].entry, "int4_gemm_residual_bf16s_m32");
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
