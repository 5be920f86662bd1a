//! The FP8 prefill GEMM: params mirror and launch of kernels/fp8_gemm.cu
//! (`y = (A W^T) * a_scale[row] * w_scale[col]`, E4M3 operands, then bf16 out, bf16 out plus a
//! residual, SwiGLU to E4M3 with a delayed scale, SwiGLU to bf16, or the q|k|v projection's
//! RoPE and KV-cache placement; `stoke_formats::fp8` holds the references of the first four,
//! `rope_append` in `kernels/decode_attention.cu` the bits of the last).

use super::decode_attention::{KvCacheParams, check_block, check_head_dim};
use super::int4_gemm::WordOrder;
use super::{EntryPoint, FP8_GEMM, KernelParams};
use crate::{DevicePtr, DevicePtrMut, LaunchShape, Result, Runtime, ShapeError, TensorMap};
use half::bf16;

/// `struct Fp8GemmParams` of kernels/fp8_gemm.cu (896 bytes; the `.cu` file asserts it).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Fp8GemmParams {
    /// A `[m, k]` E4M3 codes, boxes of 128 k x 128 rows.
    pub a_map: TensorMap,
    /// W `[n, k]` E4M3 codes, boxes of 128 k x 128 rows.
    pub w_map: TensorMap,
    /// `[m]` per-row scales, or `[1]` with `a_scale_stride` 0.
    pub a_scale: DevicePtr<f32>,
    /// `[n]` per-output-channel scales.
    pub w_scale: DevicePtr<f32>,
    /// Plain, residual: `[m, ldo]` bf16.
    pub out: DevicePtrMut<bf16>,
    /// Residual: `[m, ldr]` bf16.
    pub residual: DevicePtr<bf16>,
    /// SwiGLU: `[m, ldo]` E4M3 (`n / 2` columns).
    pub codes: DevicePtrMut<u8>,
    /// SwiGLU: `[1]` the delayed scale.
    pub out_scale: DevicePtr<f32>,
    /// SwiGLU: `[1]` max |h| as f32 bits (atomicMax).
    pub amax: DevicePtrMut<u32>,
    /// SwiGLU: `[1]` saturated values (atomicAdd).
    pub saturated: DevicePtrMut<u32>,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub ldo: u32,
    pub ldr: u32,
    pub a_scale_stride: u32,
    /// q|k|v: the BF16 cache and the mirror (null `k`: none), the RoPE table, each row's slot,
    /// position and written length, the query heads, the mirror's rotation block, the table's
    /// positions (see [`QkvEpilogue`]).
    pub main: KvCacheParams,
    pub mirror: KvCacheParams,
    pub rope: DevicePtr<f32>,
    pub slot_of: DevicePtr<u32>,
    pub pos: DevicePtr<u32>,
    pub len: DevicePtrMut<u32>,
    pub heads: u32,
    pub block: u32,
    pub max_pos: u32,
    /// INT4 weights (`fp8_i4_*`, `w_map` then over the words): the scales and offsets
    /// `[k / group, n]` 16-bit, boxes of `128 / G` rows x 128 columns, A's code sums
    /// `[m, k / 32]` (with offsets), the group and [`I4_F16`] | [`I4_OFFSETS`].
    pub d_map: TensorMap,
    pub m_map: TensorMap,
    pub a_sums: DevicePtr<f32>,
    pub group: u32,
    pub i4_flags: u32,
}

/// [`Fp8GemmParams::i4_flags`]: the scales and offsets are f16 (else bf16).
pub const I4_F16: u32 = 1;
/// [`Fp8GemmParams::i4_flags`]: the weight has offsets (else `-8 d`).
pub const I4_OFFSETS: u32 = 2;

// SAFETY: the layout is the `.cu` struct's (asserted below); pointers of the kernel's types.
unsafe impl KernelParams for Fp8GemmParams {}

/// `kernels/fp8_gemm.cu`.
pub const SOURCE: &str = include_str!("../../../../kernels/fp8_gemm.cu");

/// Every `extern "C"` entry point in [`SOURCE`].
pub const ENTRY_POINTS: &[&str] = &[
    "fp8_gemm_plain",
    "fp8_gemm_residual",
    "fp8_gemm_swiglu",
    "fp8_gemm_swiglu_bf16",
    "bf16_tc_gemm_plain",
    "bf16_tc_gemm_residual",
    "bf16_tc_gemm_swiglu_bf16",
    "fp8_gemm_qkv",
    "bf16_tc_gemm_qkv",
    "bf16_tc_gemm_plain_n256",
    "bf16_tc_gemm_residual_n256",
    "bf16_tc_gemm_swiglu_bf16_n256",
    "bf16_tc_gemm_qkv_n256",
    "fp8_gemm_plain_n256",
    "fp8_gemm_residual_n256",
    "fp8_gemm_swiglu_n256",
    "fp8_gemm_swiglu_bf16_n256",
    "fp8_gemm_qkv_n256",
    "fp8_i4_gemm_plain_g32",
    "fp8_i4_gemm_residual_g32",
    "fp8_i4_gemm_swiglu_bf16_g32",
    "fp8_i4_gemm_qkv_g32",
    "fp8_i4_gemm_plain_g64",
    "fp8_i4_gemm_residual_g64",
    "fp8_i4_gemm_swiglu_bf16_g64",
    "fp8_i4_gemm_qkv_g64",
    "fp8_i4_gemm_plain_g128",
    "fp8_i4_gemm_residual_g128",
    "fp8_i4_gemm_swiglu_bf16_g128",
    "fp8_i4_gemm_qkv_g128",
];

/// The kernel's tile rows (`BM`), k bytes per stage (`BK`) and threads.
const BM: u32 = 128;
const BK: u32 = 128;
const THREADS: u32 = 384;
/// Tile columns: narrow (`BN`) and wide (`_n256`) tiles.
const BN: u32 = 128;
const BN_WIDE: u32 = 256;

/// Shared memory of `bn`-column tiles (the kernel's `Shape<BN>`): 5 stages of 128 columns,
/// 4 of 256.
const fn smem_bytes(bn: u32) -> u32 {
    let stages = if bn == BN_WIDE { 4 } else { 5 };
    stages * (BM + bn) * BK + 2 * stages * 8 + 1024
}

/// Shared memory of the INT4-weight tiles (`Shape<128, OP_I4>`): 4 stages of A, the E4M3
/// weight tile, its words (64 bytes per column), the raw scale and offset rows (16) and their
/// f32 form (32), and a third barrier per stage.
const I4_SMEM_BYTES: u32 = 4 * ((BM + BN) * BK + 112 * BN) + 3 * 4 * 8 + 1024;

/// A wide tile's work rate against two narrow ones' (measured on an H100:
/// `results/h100-gemm-experiments-67f92b4.json`, 1.02-1.32x where both fill the SMs), as a
/// fraction: `WIDE_RATE.0 / WIDE_RATE.1`.
const WIDE_RATE: (u32, u32) = (6, 5);

/// Whether a call of `m` x `n` runs on 128 x 256 tiles: where its waves of wide tiles (one
/// persistent CTA per SM) take less time than the waves of 128 x 128 ones, a wide tile taking
/// `2 / WIDE_RATE` of a narrow one's time. Calls whose wide tiles would leave SMs idle (the 8B
/// o projection at 512 rows: 64 wide tiles on 132 SMs) keep the narrow ones. The rate is the
/// bf16 tiles'; FP8 calls take the same rule (its wide tiles cut the same quarter of the L2
/// traffic per MMA).
pub fn wide_tiles(m: u32, n: u32, sm_count: u32) -> bool {
    let waves = |bn: u32| {
        (u64::from(m.div_ceil(BM)) * u64::from(n.div_ceil(bn))).div_ceil(u64::from(sm_count.max(1)))
    };
    let (rate, per) = (u64::from(WIDE_RATE.0), u64::from(WIDE_RATE.1));
    2 * per * waves(BN_WIDE) < rate * waves(BN)
}

/// Whether an FP8 call with the q|k|v epilogue may take wide tiles ([`wide_tiles`] decides
/// then): where `k` spans more than 32 k-blocks (4,096 E4M3 values). Its epilogue (RoPE, the
/// cache rows and their mirror quantized) costs a wide tile about 15 µs against about 4 for a
/// narrow one, which 32 blocks of the wide tiles' faster mainloop do not earn back: measured
/// on H100s (`results/h100-qkv-wide-7c04453.json`), the 8B q|k|v (k 4,096, 2,304 rows)
/// took 172.1 µs on wide tiles against 145.5, the 70B one (k 8,192, 2,048 rows) 331.4 against
/// 369.5, the 405B one (k 16,384, 2,048 rows) 958 against 1,314.
pub fn fp8_qkv_wide_k(k: u32) -> bool {
    k.div_ceil(BK) > 32
}

/// What the kernel does with `y`.
#[derive(Clone, Copy, Debug)]
pub enum Fp8Epilogue {
    /// `out = bf16(y)`.
    Plain { out: DevicePtrMut<bf16> },
    /// `out = bf16(y + residual)`, `residual` `[m, ldr]`.
    Residual {
        out: DevicePtrMut<bf16>,
        residual: DevicePtr<bf16>,
        ldr: u32,
    },
    /// Columns `2 j`, `2 j + 1` are gate and up `j`: `codes = e4m3(silu(gate) up / scale)`
    /// with the delayed `scale` (`[1]` on the device), `amax` (`[1]`, f32 bits, start from 0)
    /// and `saturated` (`[1]`) accumulated.
    SwiGlu {
        codes: DevicePtrMut<u8>,
        scale: DevicePtr<f32>,
        amax: DevicePtrMut<u32>,
        saturated: DevicePtrMut<u32>,
    },
    /// The same `silu(gate) up` written as bf16 (`[m, ldo]`, `n / 2` columns).
    SwiGluBf16 { out: DevicePtrMut<bf16> },
    /// The q|k|v projection of a packed prefill, written where attention reads it: q rotated,
    /// k rotated and v into the KV cache (see [`QkvEpilogue`]).
    Qkv(QkvEpilogue),
}

/// The q|k|v epilogue's targets (`crate::kv::DeviceKvCache::qkv_epilogue` fills them for a
/// cache). The `n` columns are `heads + 2 kv_heads` heads of `d` (64 or 128), q | k | v. Row
/// `r`'s values are rounded to bf16 as the plain epilogue writes them; its q and k heads are
/// rotated (rotate-half RoPE) by the angles of position `pos[r]` from `rope` (`[max_pos, d / 2,
/// 2]` cos, sin f32); q goes to `q [m, ldo]` (`heads x d` columns), k and v to slot
/// `slot_of[r]` at `pos[r]` of `main` (bf16 rows) and, rotated by the normalized Walsh-Hadamard
/// transform of `block` and quantized per row, of `mirror`; `len[r] = pos[r] + 1`. The bits
/// equal those of the plain epilogue followed by `rope_append`.
#[derive(Clone, Copy, Debug)]
pub struct QkvEpilogue {
    pub q: DevicePtrMut<bf16>,
    pub main: KvCacheParams,
    pub mirror: KvCacheParams,
    pub rope: DevicePtr<f32>,
    pub max_pos: u32,
    pub slot_of: DevicePtr<u32>,
    pub pos: DevicePtr<u32>,
    pub len: DevicePtrMut<u32>,
    pub heads: u32,
    pub block: u32,
}

impl QkvEpilogue {
    /// The caches' kv heads.
    pub fn kv_heads(&self) -> u32 {
        self.cache().kv_heads
    }

    /// The caches' head dim.
    pub fn head_dim(&self) -> u32 {
        self.cache().d
    }

    /// The cache both writes agree on: `main` where it is written, else the mirror.
    fn cache(&self) -> &KvCacheParams {
        if self.main.k.is_null() {
            &self.mirror
        } else {
            &self.main
        }
    }
}

/// The operands of one call.
#[derive(Clone, Copy, Debug)]
pub struct Fp8Gemm {
    /// A `[m, k]` E4M3, row-major, 16-byte aligned.
    pub a: DevicePtr<u8>,
    /// W `[n, k]` E4M3, row-major, 16-byte aligned.
    pub w: DevicePtr<u8>,
    pub a_scale: DevicePtr<f32>,
    /// Whether `a_scale` holds one scale per row (else one for the tensor).
    pub a_scale_per_row: bool,
    pub w_scale: DevicePtr<f32>,
    pub epilogue: Fp8Epilogue,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    /// Row pitch of the output in elements: at least `n` and even (SwiGLU: at least `n / 2`).
    pub ldo: u32,
}

/// Checks a call's shape: `m`, `n` positive, `k` a positive multiple of 16 (the copy engine's
/// row pitch); bf16 outputs: `ldo >= n` and even (the epilogue's paired stores), a residual
/// pitch of at least `n`; SwiGLU: `n` even and `ldo >= n / 2`.
pub fn check_shape(g: &Fp8Gemm) -> std::result::Result<(), ShapeError> {
    check_call(FP8, g.m, g.n, g.k, g.ldo, g.epilogue).map(|_| ())
}

/// [`check_shape`] of a bf16 call: `k` a positive multiple of 8 and an epilogue other than
/// SwiGLU to E4M3.
pub fn check_bf16_shape(g: &Bf16TcGemm) -> std::result::Result<(), ShapeError> {
    check_call(BF16, g.m, g.n, g.k, g.ldo, g.epilogue).map(|_| ())
}

/// One operand type's name, the multiple `k` must be, and its entry points by epilogue:
/// plain, residual, SwiGLU to E4M3 (none for bf16 operands), SwiGLU to bf16, q|k|v; then the
/// same on wide tiles.
struct Operands {
    what: &'static str,
    k_multiple: u32,
    entries: [Option<&'static str>; 5],
    wide: [Option<&'static str>; 5],
}
const FP8: Operands = Operands {
    what: "FP8 GEMM",
    k_multiple: 16,
    entries: [
        Some("fp8_gemm_plain"),
        Some("fp8_gemm_residual"),
        Some("fp8_gemm_swiglu"),
        Some("fp8_gemm_swiglu_bf16"),
        Some("fp8_gemm_qkv"),
    ],
    wide: [
        Some("fp8_gemm_plain_n256"),
        Some("fp8_gemm_residual_n256"),
        Some("fp8_gemm_swiglu_n256"),
        Some("fp8_gemm_swiglu_bf16_n256"),
        Some("fp8_gemm_qkv_n256"),
    ],
};
const BF16: Operands = Operands {
    what: "bf16 GEMM",
    k_multiple: 8,
    entries: [
        Some("bf16_tc_gemm_plain"),
        Some("bf16_tc_gemm_residual"),
        None,
        Some("bf16_tc_gemm_swiglu_bf16"),
        Some("bf16_tc_gemm_qkv"),
    ],
    wide: [
        Some("bf16_tc_gemm_plain_n256"),
        Some("bf16_tc_gemm_residual_n256"),
        None,
        Some("bf16_tc_gemm_swiglu_bf16_n256"),
        Some("bf16_tc_gemm_qkv_n256"),
    ],
};

/// Checks a call of `ops` and returns the entry point that runs its epilogue (on 128 x 128
/// tiles; [`wide_entry`] names the same on wide ones).
fn check_call(
    ops: Operands,
    m: u32,
    n: u32,
    k: u32,
    ldo: u32,
    epilogue: Fp8Epilogue,
) -> std::result::Result<&'static str, ShapeError> {
    let (what, k_multiple) = (ops.what, ops.k_multiple);
    if m == 0 || n == 0 {
        return Err(ShapeError::new(
            format!("{what} rows and columns"),
            "positive",
            format!("m {m}, n {n}"),
        ));
    }
    if k == 0 || !k.is_multiple_of(k_multiple) {
        return Err(ShapeError::new(
            format!("{what} k"),
            format!("a positive multiple of {k_multiple}"),
            k.to_string(),
        ));
    }
    match epilogue {
        Fp8Epilogue::SwiGlu { .. } | Fp8Epilogue::SwiGluBf16 { .. } => {
            if !n.is_multiple_of(2) || ldo < n / 2 {
                return Err(ShapeError::new(
                    format!("{what} SwiGLU columns and output pitch"),
                    "an even n (gate and up interleaved) and a pitch of at least n / 2",
                    format!("n {n}, pitch {ldo}"),
                ));
            }
        }
        Fp8Epilogue::Qkv(e) => check_qkv(what, n, ldo, &e)?,
        Fp8Epilogue::Plain { .. } | Fp8Epilogue::Residual { .. } => {
            if ldo < n || !ldo.is_multiple_of(2) {
                return Err(ShapeError::new(
                    format!("{what} output row pitch"),
                    format!("an even count of at least n = {n}"),
                    ldo.to_string(),
                ));
            }
            if let Fp8Epilogue::Residual { ldr, .. } = epilogue
                && ldr < n
            {
                return Err(ShapeError::new(
                    format!("{what} residual row pitch"),
                    format!("at least n = {n}"),
                    ldr.to_string(),
                ));
            }
        }
    }
    let slot = match epilogue {
        Fp8Epilogue::Plain { .. } => 0,
        Fp8Epilogue::Residual { .. } => 1,
        Fp8Epilogue::SwiGlu { .. } => 2,
        Fp8Epilogue::SwiGluBf16 { .. } => 3,
        Fp8Epilogue::Qkv(_) => 4,
    };
    ops.entries[slot].ok_or_else(|| {
        ShapeError::new(
            format!("{what} epilogue"),
            "plain, residual or SwiGLU to bf16",
            "SwiGLU to E4M3",
        )
    })
}

/// The wide-tile entry point of `entry` (one of [`check_call`]'s), if it has one.
fn wide_entry(entry: &'static str) -> Option<&'static str> {
    [FP8, BF16].into_iter().find_map(|ops| {
        let i = ops.entries.iter().position(|e| *e == Some(entry))?;
        ops.wide[i]
    })
}

/// The q|k|v epilogue's layout: heads of 64 or 128 (a tile holds whole heads) in both caches
/// alike, `n = (heads + 2 kv_heads) d`, a q pitch of at least `heads x d` (even), a rotation
/// block of 0 or a power of two from 2 to `d`, and the RoPE table's positions.
fn check_qkv(what: &str, n: u32, ldo: u32, e: &QkvEpilogue) -> std::result::Result<(), ShapeError> {
    let c = e.cache();
    let (kvh, d) = (c.kv_heads, c.d);
    let what = format!("{what} q|k|v");
    let err = |field: &str, expected: String, got: String| {
        Err(ShapeError::new(format!("{what} {field}"), expected, got))
    };
    if c.k.is_null() {
        return err("cache", "a main cache or a mirror".into(), "neither".into());
    }
    if !e.main.k.is_null()
        && !e.mirror.k.is_null()
        && (
            e.mirror.kv_heads,
            e.mirror.page_shift,
            e.mirror.d,
            e.mirror.pages,
            e.mirror.max_pages,
        ) != (kvh, e.main.page_shift, d, e.main.pages, e.main.max_pages)
    {
        return err(
            "mirror",
            format!(
                "the main cache's kv heads {kvh}, page of 2^{}, d {d} and page table",
                e.main.page_shift
            ),
            format!(
                "kv heads {}, page of 2^{}, d {}",
                e.mirror.kv_heads, e.mirror.page_shift, e.mirror.d
            ),
        );
    }
    if c.pages.is_null() || c.max_pages == 0 {
        return err(
            "page table",
            "a page table of at least one page per slot".into(),
            format!("{:?} of {} pages per slot", c.pages, c.max_pages),
        );
    }
    check_head_dim(&what, d)?;
    if kvh == 0 || e.heads == 0 || n != (e.heads + 2 * kvh) * d {
        return err(
            "columns",
            format!("(heads + 2 kv_heads) x d = ({} + 2 x {kvh}) x {d}", e.heads),
            n.to_string(),
        );
    }
    if ldo < e.heads * d || !ldo.is_multiple_of(2) {
        return err(
            "q row pitch",
            format!("an even count of at least heads x d = {}", e.heads * d),
            ldo.to_string(),
        );
    }
    check_block(&what, d, e.block)?;
    if e.max_pos == 0 {
        return err("RoPE table", "at least one position".into(), "0".into());
    }
    Ok(())
}

/// Persistent CTAs of a call: one per SM, at most one per output tile.
pub fn grid(m: u32, n: u32, sm_count: u32) -> u32 {
    grid_of(BN, m, n, sm_count)
}

/// [`grid`] of `bn`-column tiles.
fn grid_of(bn: u32, m: u32, n: u32, sm_count: u32) -> u32 {
    (m.div_ceil(BM) * n.div_ceil(bn)).min(sm_count).max(1)
}

/// Fills `p`'s epilogue fields from `epilogue` and launches `entry` (the one
/// [`check_call`] gave for it), one persistent CTA per SM.
///
/// # Safety
/// As [`fp8_gemm`].
unsafe fn launch(
    rt: &Runtime,
    mut p: Fp8GemmParams,
    epilogue: Fp8Epilogue,
    entry: &'static str,
    bn: u32,
    smem: u32,
) -> Result<()> {
    match epilogue {
        Fp8Epilogue::Plain { out } | Fp8Epilogue::SwiGluBf16 { out } => p.out = out,
        Fp8Epilogue::Residual { out, residual, ldr } => {
            (p.out, p.residual, p.ldr) = (out, residual, ldr);
        }
        Fp8Epilogue::SwiGlu {
            codes,
            scale,
            amax,
            saturated,
        } => {
            (p.codes, p.out_scale, p.amax, p.saturated) = (codes, scale, amax, saturated);
        }
        Fp8Epilogue::Qkv(e) => {
            (p.out, p.main, p.mirror, p.rope, p.max_pos) =
                (e.q, e.main, e.mirror, e.rope, e.max_pos);
            (p.slot_of, p.pos, p.len, p.heads, p.block) =
                (e.slot_of, e.pos, e.len, e.heads, e.block);
        }
    }
    let k = rt.kernel(EntryPoint::<Fp8GemmParams>::new(&FP8_GEMM, entry))?;
    let shape = LaunchShape {
        grid: (grid_of(bn, p.m, p.n, rt.sm_count), 1, 1),
        block: (THREADS, 1, 1),
        shared_mem_bytes: smem,
    };
    // SAFETY: the caller's guarantees; the params match the entry point.
    unsafe { rt.launch(&k, shape, &p) }
}

/// The entry point and tile columns of a call that [`check_call`] gave `narrow` for, on the
/// tiles named (`wide`: 128 x 256 where the epilogue has them, else 128 x 128), and its params
/// with the maps of A `[m, row_bytes]` at `a` and W `[n, row_bytes]` at `w`.
#[allow(clippy::too_many_arguments)]
fn tiled_params(
    rt: &Runtime,
    narrow: &'static str,
    wide: bool,
    (a, w, row_bytes): (u64, u64, u32),
    m: u32,
    n: u32,
    k: u32,
    ldo: u32,
) -> Result<(Fp8GemmParams, &'static str, u32)> {
    let (entry, bn) = match wide_entry(narrow) {
        Some(e) if wide => (e, BN_WIDE),
        _ => (narrow, BN),
    };
    let p = params(
        rt.u8_tensor_map_2d(a, m, row_bytes, BM, BK)?,
        rt.u8_tensor_map_2d(w, n, row_bytes, bn, BK)?,
        m,
        n,
        k,
        ldo,
    );
    Ok((p, entry, bn))
}

/// Params with the operands' maps and sizes, no scales and no epilogue yet.
fn params(a_map: TensorMap, w_map: TensorMap, m: u32, n: u32, k: u32, ldo: u32) -> Fp8GemmParams {
    Fp8GemmParams {
        a_map,
        w_map,
        a_scale: DevicePtr::NULL,
        w_scale: DevicePtr::NULL,
        out: DevicePtrMut::NULL,
        residual: DevicePtr::NULL,
        codes: DevicePtrMut::NULL,
        out_scale: DevicePtr::NULL,
        amax: DevicePtrMut::NULL,
        saturated: DevicePtrMut::NULL,
        m,
        n,
        k,
        ldo,
        ldr: 0,
        a_scale_stride: 0,
        main: KvCacheParams::default(),
        mirror: KvCacheParams::default(),
        rope: DevicePtr::NULL,
        slot_of: DevicePtr::NULL,
        pos: DevicePtr::NULL,
        len: DevicePtrMut::NULL,
        heads: 0,
        block: 0,
        max_pos: 0,
        d_map: TensorMap([0; 16]),
        m_map: TensorMap([0; 16]),
        a_sums: DevicePtr::NULL,
        group: 0,
        i4_flags: 0,
    }
}

/// Queues the GEMM and its epilogue.
///
/// # Safety
/// The pointers must be valid device memory of the documented sizes until the kernel is done;
/// with [`Fp8Epilogue::Qkv`], every `slot_of[r]` a slot of the caches and every `pos[r]` below
/// their capacity.
pub unsafe fn fp8_gemm(rt: &Runtime, g: &Fp8Gemm) -> Result<()> {
    let qkv = matches!(g.epilogue, Fp8Epilogue::Qkv { .. });
    let wide = wide_tiles(g.m, g.n, rt.sm_count) && (!qkv || fp8_qkv_wide_k(g.k));
    // SAFETY: the caller's guarantees.
    unsafe { fp8_gemm_tiles(rt, g, wide) }
}

/// [`fp8_gemm`] on the tiles named (`wide`: 128 x 256, where the epilogue has them; else
/// 128 x 128) instead of the ones [`wide_tiles`] picks: for tests and benchmarks that run
/// both.
///
/// # Safety
/// As [`fp8_gemm`].
pub unsafe fn fp8_gemm_tiles(rt: &Runtime, g: &Fp8Gemm, wide: bool) -> Result<()> {
    let narrow = check_call(FP8, g.m, g.n, g.k, g.ldo, g.epilogue)?;
    let operands = (g.a.addr(), g.w.addr(), g.k);
    let (mut p, entry, bn) = tiled_params(rt, narrow, wide, operands, g.m, g.n, g.k, g.ldo)?;
    (p.a_scale, p.w_scale) = (g.a_scale, g.w_scale);
    p.a_scale_stride = u32::from(g.a_scale_per_row);
    // SAFETY: the caller's guarantees.
    unsafe { launch(rt, p, g.epilogue, entry, bn, smem_bytes(bn)) }
}

/// One call of the same persistent GEMM on bf16 operands (`bf16_tc_gemm_*`): `y = A W^T`
/// with f32 accumulation and no scales, then [`Fp8Epilogue::Plain`], `Residual`,
/// `SwiGluBf16` or `Qkv` (the E4M3 SwiGLU output is FP8's alone).
#[derive(Clone, Copy, Debug)]
pub struct Bf16TcGemm {
    /// A `[m, k]` bf16, row-major, 16-byte aligned.
    pub a: DevicePtr<bf16>,
    /// W `[n, k]` bf16, row-major, 16-byte aligned.
    pub w: DevicePtr<bf16>,
    pub epilogue: Fp8Epilogue,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    /// Row pitch of the output in elements, as [`Fp8Gemm::ldo`].
    pub ldo: u32,
}

/// Queues the bf16 GEMM and its epilogue: `k` a positive multiple of 8 (rows of 16 bytes),
/// otherwise as [`fp8_gemm`]. The operands are loaded as bytes, a k-block being 64 bf16.
///
/// # Safety
/// The pointers must be valid device memory of the documented sizes until the kernel is done;
/// with [`Fp8Epilogue::Qkv`], every `slot_of[r]` a slot of the caches and every `pos[r]` below
/// their capacity.
pub unsafe fn bf16_tc_gemm(rt: &Runtime, g: &Bf16TcGemm) -> Result<()> {
    let wide = wide_tiles(g.m, g.n, rt.sm_count);
    // SAFETY: the caller's guarantees.
    unsafe { bf16_tc_gemm_tiles(rt, g, wide) }
}

/// [`bf16_tc_gemm`] on the tiles named (`wide`: 128 x 256, else 128 x 128) instead of the ones
/// [`wide_tiles`] picks: for tests and benchmarks that run both.
///
/// # Safety
/// As [`bf16_tc_gemm`].
pub unsafe fn bf16_tc_gemm_tiles(rt: &Runtime, g: &Bf16TcGemm, wide: bool) -> Result<()> {
    let narrow = check_call(BF16, g.m, g.n, g.k, g.ldo, g.epilogue)?;
    // Rows of bf16 loaded as bytes.
    let operands = (g.a.addr(), g.w.addr(), 2 * g.k);
    let (p, entry, bn) = tiled_params(rt, narrow, wide, operands, g.m, g.n, g.k, g.ldo)?;
    // SAFETY: the caller's guarantees.
    unsafe { launch(rt, p, g.epilogue, entry, bn, smem_bytes(bn)) }
}

/// The INT4 weight of an [`Fp8I4Gemm`]: a packed `[k, n]` weight (docs/INT4_FORMAT.md) as
/// the W4A16 kernels read it (`crate::int4::DeviceInt4::operand`).
#[derive(Clone, Copy, Debug)]
pub struct I4Weight {
    pub words: DevicePtr<u32>,
    /// `[k / group, n]` 16-bit.
    pub scales: DevicePtr<u16>,
    /// `[k / group, n]` 16-bit, or null: symmetric (offset `-8 d`).
    pub offsets: DevicePtr<u16>,
    pub f16_scales: bool,
    pub group: u32,
    pub order: WordOrder,
}

/// One call of the persistent GEMM with an INT4 weight expanded to E4M3 inside its mainloop
/// (`fp8_i4_gemm_*`): `y[r, c] = a_scale[r] sum_k e4m3(A[r, k]) (d q + m)[k, c]`. The nibbles
/// become `q - 8` (exact in E4M3) in shared memory; each group's `d` and `m + 8 d` are applied
/// in f32 when a block of 32, 64 or 128 k ([`i4_promotion`]) is added to the accumulator, the
/// offsets' part through the sums of A's codes. Then [`Fp8Epilogue::Plain`], `Residual`,
/// `SwiGluBf16` or `Qkv`, as [`fp8_gemm`]. A holds E4M3 codes in the interleaved order of
/// `quantize_rows` with `order` 1 (each 16 k as the words' nibbles are), and with offsets
/// `a_sums`, the sums of each 32 codes it writes.
#[derive(Clone, Copy, Debug)]
pub struct Fp8I4Gemm {
    /// A `[m, k]` E4M3 codes, interleaved, 16-byte aligned.
    pub a: DevicePtr<u8>,
    pub a_scale: DevicePtr<f32>,
    pub a_scale_per_row: bool,
    /// `[m, k / 32]` f32: needed when the weight has offsets.
    pub a_sums: DevicePtr<f32>,
    pub w: I4Weight,
    pub epilogue: Fp8Epilogue,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    /// Row pitch of the output in elements, as [`Fp8Gemm::ldo`].
    pub ldo: u32,
}

/// The INT4-weight GEMM's promotion lengths (k per scale application), and their entry points
/// by epilogue (as [`Operands::entries`]).
const I4_PROMOTIONS: [u32; 3] = [32, 64, 128];
const fn i4_operands(g: u32) -> Operands {
    macro_rules! entries {
        ($g:literal) => {
            [
                Some(concat!("fp8_i4_gemm_plain_g", $g)),
                Some(concat!("fp8_i4_gemm_residual_g", $g)),
                None,
                Some(concat!("fp8_i4_gemm_swiglu_bf16_g", $g)),
                Some(concat!("fp8_i4_gemm_qkv_g", $g)),
            ]
        };
    }
    Operands {
        what: "FP8 x INT4 GEMM",
        k_multiple: 32,
        entries: match g {
            32 => entries!("32"),
            64 => entries!("64"),
            _ => entries!("128"),
        },
        wide: [None; 5],
    }
}

/// The promotion length of a weight's group: the largest of 128, 64 and 32 that divides it
/// (None: the group is not a multiple of 32).
pub fn i4_promotion(group: u32) -> Option<u32> {
    I4_PROMOTIONS
        .iter()
        .rev()
        .copied()
        .find(|&g| group > 0 && group.is_multiple_of(g))
}

/// Checks an INT4-weight call ([`check_shape`]'s rules with `k` a multiple of 32, `n` of 64,
/// a group that is a multiple of 32 dividing `k`, the packer's word order, and A's sums where
/// the weight has offsets) and returns its entry point and promotion length.
pub fn check_i4_shape(g: &Fp8I4Gemm) -> std::result::Result<(&'static str, u32), ShapeError> {
    let what = "FP8 x INT4 GEMM";
    let w = &g.w;
    let Some(promo) = i4_promotion(w.group).filter(|_| g.k.is_multiple_of(w.group.max(1))) else {
        return Err(ShapeError::new(
            format!("{what} weight group"),
            format!("a multiple of 32 that divides k = {}", g.k),
            w.group.to_string(),
        ));
    };
    let entry = check_call(i4_operands(promo), g.m, g.n, g.k, g.ldo, g.epilogue)?;
    if !g.n.is_multiple_of(64) {
        return Err(ShapeError::new(
            format!("{what} columns"),
            "a multiple of 64 (the packed weight's column groups)",
            g.n.to_string(),
        ));
    }
    if w.order != WordOrder::KtMajor {
        return Err(ShapeError::new(
            format!("{what} weight word order"),
            "the packer's (k-tile major)",
            format!("{:?}", w.order),
        ));
    }
    if !w.offsets.is_null() && g.a_sums.is_null() {
        return Err(ShapeError::new(
            format!("{what} activation sums"),
            "the sums of A's codes for a weight with offsets",
            "none",
        ));
    }
    Ok((entry, promo))
}

/// Queues the INT4-weight GEMM and its epilogue.
///
/// # Safety
/// The pointers must be valid device memory of the documented sizes until the kernel is done;
/// with [`Fp8Epilogue::Qkv`], every `slot_of[r]` a slot of the caches and every `pos[r]` below
/// their capacity.
pub unsafe fn fp8_i4_gemm(rt: &Runtime, g: &Fp8I4Gemm) -> Result<()> {
    let (entry, promo) = check_i4_shape(g)?;
    let w = &g.w;
    let mut p = params(
        rt.u8_tensor_map_2d(g.a.addr(), g.m, g.k, BM, BK)?,
        // The words as [k / 16, n / 64 x 128] u32: a k-block's 8 k-tiles of a tile's columns.
        rt.plain_tensor_map_2d(4, w.words.addr(), g.k / 16, g.n / 64 * 128, 8, 2 * BN)?,
        g.m,
        g.n,
        g.k,
        g.ldo,
    );
    let (rows, box_rows) = (g.k / w.group, BK / promo);
    p.d_map = rt.plain_tensor_map_2d(2, w.scales.addr(), rows, g.n, box_rows, BN)?;
    p.i4_flags = if w.f16_scales { I4_F16 } else { 0 };
    if !w.offsets.is_null() {
        p.m_map = rt.plain_tensor_map_2d(2, w.offsets.addr(), rows, g.n, box_rows, BN)?;
        p.i4_flags |= I4_OFFSETS;
    }
    (p.a_scale, p.a_sums, p.group) = (g.a_scale, g.a_sums, w.group);
    p.a_scale_stride = u32::from(g.a_scale_per_row);
    // SAFETY: the caller's guarantees.
    unsafe { launch(rt, p, g.epilogue, entry, BN, I4_SMEM_BYTES) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<Fp8GemmParams>(), 896);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, d_map), 576);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, a_sums), 832);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, i4_flags), 844);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, w_map), 128);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, a_scale), 256);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, out), 272);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, saturated), 312);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, m), 320);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, a_scale_stride), 340);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, main), 344);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, mirror), 408);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, rope), 472);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, len), 496);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, max_pos), 512);
        assert!(SOURCE.contains("static_assert(sizeof(Fp8GemmParams) == 896"));
        for (name, v) in [("BM", BM), ("BK", BK)] {
            assert!(SOURCE.contains(&format!("{name} = {v}")), "{name}");
        }
        assert!(SOURCE.contains(&format!(
            "Shape<128>::SMEM_BYTES == {} && Shape<256>::SMEM_BYTES == {} && Shape<128, OP_I4>::SMEM_BYTES == {}",
            smem_bytes(BN),
            smem_bytes(BN_WIDE),
            I4_SMEM_BYTES
        )));
        for g in I4_PROMOTIONS {
            for e in i4_operands(g).entries.iter().flatten() {
                assert!(ENTRY_POINTS.contains(e), "{e}");
            }
        }
        assert_eq!(
            (
                i4_promotion(32),
                i4_promotion(576),
                i4_promotion(4096),
                i4_promotion(16)
            ),
            (Some(32), Some(64), Some(128), None)
        );
        // Every entry point has its wide twin, and each is a kernel entry.
        for ops in [FP8, BF16] {
            for (narrow, wide) in ops.entries.iter().zip(ops.wide) {
                assert_eq!(narrow.map(|e| format!("{e}_n256")).as_deref(), wide);
            }
            for e in ops.entries.iter().chain(ops.wide.iter()).flatten() {
                assert!(ENTRY_POINTS.contains(e), "{e}");
            }
        }
    }

    #[test]
    fn int4_weight_calls_are_checked() {
        let w = I4Weight {
            words: DevicePtr::NULL,
            scales: DevicePtr::NULL,
            offsets: DevicePtr::NULL,
            f16_scales: true,
            group: 32,
            order: WordOrder::KtMajor,
        };
        let call = Fp8I4Gemm {
            a: DevicePtr::NULL,
            a_scale: DevicePtr::NULL,
            a_scale_per_row: true,
            a_sums: DevicePtr::NULL,
            w,
            epilogue: Fp8Epilogue::Plain {
                out: DevicePtrMut::NULL,
            },
            m: 3,
            n: 192,
            k: 576,
            ldo: 192,
        };
        assert_eq!(check_i4_shape(&call), Ok(("fp8_i4_gemm_plain_g32", 32)));
        let per_channel = I4Weight { group: 576, ..w };
        assert_eq!(
            check_i4_shape(&Fp8I4Gemm {
                w: per_channel,
                ..call
            })
            .map(|e| e.1),
            Ok(64)
        );
        let what = |g: Fp8I4Gemm| check_i4_shape(&g).unwrap_err().what;
        let g16 = I4Weight { group: 16, ..w };
        assert_eq!(
            what(Fp8I4Gemm { w: g16, ..call }),
            "FP8 x INT4 GEMM weight group"
        );
        assert_eq!(
            what(Fp8I4Gemm {
                n: 160,
                ldo: 160,
                ..call
            }),
            "FP8 x INT4 GEMM columns"
        );
        assert_eq!(
            what(Fp8I4Gemm { k: 560, ..call }),
            "FP8 x INT4 GEMM weight group"
        );
        let slab = I4Weight {
            order: WordOrder::SlabMajor,
            ..w
        };
        assert_eq!(
            what(Fp8I4Gemm { w: slab, ..call }),
            "FP8 x INT4 GEMM weight word order"
        );
        let offsets = I4Weight {
            offsets: DevicePtr::new(256),
            ..w
        };
        assert_eq!(
            what(Fp8I4Gemm { w: offsets, ..call }),
            "FP8 x INT4 GEMM activation sums"
        );
        let swiglu = Fp8Epilogue::SwiGlu {
            codes: DevicePtrMut::NULL,
            scale: DevicePtr::NULL,
            amax: DevicePtrMut::NULL,
            saturated: DevicePtrMut::NULL,
        };
        assert_eq!(
            what(Fp8I4Gemm {
                epilogue: swiglu,
                ldo: 96,
                ..call
            }),
            "FP8 x INT4 GEMM epilogue"
        );
    }

    #[test]
    fn shapes_are_checked_and_the_grid_is_persistent() {
        let call = |m, n, k, ldo, epilogue| Fp8Gemm {
            a: DevicePtr::NULL,
            w: DevicePtr::NULL,
            a_scale: DevicePtr::NULL,
            a_scale_per_row: true,
            w_scale: DevicePtr::NULL,
            epilogue,
            m,
            n,
            k,
            ldo,
        };
        let plain = Fp8Epilogue::Plain {
            out: DevicePtrMut::NULL,
        };
        let swiglu = Fp8Epilogue::SwiGlu {
            codes: DevicePtrMut::NULL,
            scale: DevicePtr::NULL,
            amax: DevicePtrMut::NULL,
            saturated: DevicePtrMut::NULL,
        };
        let what = |g: Fp8Gemm| check_shape(&g).unwrap_err().what;
        assert!(check_shape(&call(1, 8, 16, 8, plain)).is_ok());
        assert_eq!(what(call(0, 8, 16, 8, plain)), "FP8 GEMM rows and columns");
        assert_eq!(what(call(4, 8, 24, 8, plain)), "FP8 GEMM k");
        assert_eq!(what(call(4, 8, 32, 7, plain)), "FP8 GEMM output row pitch");
        assert!(check_shape(&call(4, 8, 32, 4, swiglu)).is_ok());
        assert_eq!(
            what(call(4, 7, 32, 8, swiglu)),
            "FP8 GEMM SwiGLU columns and output pitch"
        );
        let residual = Fp8Epilogue::Residual {
            out: DevicePtrMut::NULL,
            residual: DevicePtr::NULL,
            ldr: 4,
        };
        assert_eq!(
            what(call(4, 8, 32, 8, residual)),
            "FP8 GEMM residual row pitch"
        );
        // The tile rule at the 8B / 70B projections on 132 SMs: wide tiles from 2048 rows, and
        // at 512 rows where the narrow ones need more waves (q|k|v, gate|up, 70B down).
        for (m, n, wide) in [
            (512, 6144, true),
            (512, 4096, false),
            (512, 10240, false),
            (512, 8192, true),
            (512, 28672, true),
            (2048, 4096, true),
            (2048, 6144, true),
            (8192, 4096, true),
            (64, 960, false),
        ] {
            assert_eq!(wide_tiles(m, n, 132), wide, "m {m} n {n}");
        }
        // FP8 q|k|v: narrow at the 8B projection's k, wide from the 70B one's.
        assert!(!fp8_qkv_wide_k(4096) && fp8_qkv_wide_k(8192) && fp8_qkv_wide_k(16384));
        assert_eq!(
            wide_entry("bf16_tc_gemm_qkv"),
            Some("bf16_tc_gemm_qkv_n256")
        );
        assert_eq!(wide_entry("fp8_gemm_swiglu"), Some("fp8_gemm_swiglu_n256"));
        assert_eq!(wide_entry("fp8_gemm_qkv"), Some("fp8_gemm_qkv_n256"));
        assert_eq!(grid(1, 1, 132), 1);
        assert_eq!(grid(2048, 4096, 132), 132);
        assert_eq!(grid(129, 256, 132), 4);

        // bf16 operands: k a multiple of 8 (16-byte rows), no E4M3 output.
        let bf16_call = |k, epilogue| Bf16TcGemm {
            a: DevicePtr::NULL,
            w: DevicePtr::NULL,
            epilogue,
            m: 4,
            n: 8,
            k,
            ldo: 8,
        };
        assert_eq!(
            check_call(BF16, 4, 8, 24, 8, plain),
            Ok("bf16_tc_gemm_plain")
        );
        assert_eq!(
            check_call(FP8, 4, 8, 32, 8, residual_ok()),
            Ok("fp8_gemm_residual")
        );
        assert!(check_bf16_shape(&bf16_call(24, plain)).is_ok());
        let bf16_what = |g: Bf16TcGemm| check_bf16_shape(&g).unwrap_err().what;
        assert_eq!(bf16_what(bf16_call(12, plain)), "bf16 GEMM k");
        assert_eq!(bf16_what(bf16_call(24, swiglu)), "bf16 GEMM epilogue");
    }

    #[test]
    fn qkv_layout_is_checked() {
        let cache = |d: u32, kv_heads: u32| KvCacheParams {
            k: DevicePtrMut::new(1 << 20),
            v: DevicePtrMut::new(2 << 20),
            pages: DevicePtr::new(3 << 20),
            kv_heads,
            page_shift: 6,
            max_pages: 1,
            d,
            ..Default::default()
        };
        let qkv = |d: u32, heads: u32, block: u32| {
            Fp8Epilogue::Qkv(QkvEpilogue {
                q: DevicePtrMut::NULL,
                main: cache(d, 2),
                mirror: KvCacheParams::default(),
                rope: DevicePtr::NULL,
                max_pos: 64,
                slot_of: DevicePtr::NULL,
                pos: DevicePtr::NULL,
                len: DevicePtrMut::NULL,
                heads,
                block,
            })
        };
        let n = (8 + 2 * 2) * 128;
        assert_eq!(
            check_call(FP8, 100, n, 256, 1024, qkv(128, 8, 128)),
            Ok("fp8_gemm_qkv")
        );
        assert_eq!(
            check_call(BF16, 100, n, 256, 1024, qkv(128, 8, 0)),
            Ok("bf16_tc_gemm_qkv")
        );
        let what = |ops, n, ldo, e| check_call(ops, 100, n, 256, ldo, e).unwrap_err().what;
        assert_eq!(
            what(FP8, n + 128, 1024, qkv(128, 8, 0)),
            "FP8 GEMM q|k|v columns"
        );
        assert_eq!(
            what(BF16, 12 * 96, 768, qkv(96, 8, 0)),
            "bf16 GEMM q|k|v head_dim"
        );
        assert_eq!(
            what(FP8, n, 1000, qkv(128, 8, 0)),
            "FP8 GEMM q|k|v q row pitch"
        );
        assert_eq!(
            what(FP8, n, 1024, qkv(128, 8, 48)),
            "FP8 GEMM q|k|v rotation block"
        );
        let Fp8Epilogue::Qkv(mut e) = qkv(128, 8, 0) else {
            unreachable!()
        };
        e.mirror = cache(64, 2);
        assert_eq!(
            what(FP8, n, 1024, Fp8Epilogue::Qkv(e)),
            "FP8 GEMM q|k|v mirror"
        );
        (e.main, e.mirror) = (KvCacheParams::default(), KvCacheParams::default());
        assert_eq!(
            what(FP8, n, 1024, Fp8Epilogue::Qkv(e)),
            "FP8 GEMM q|k|v cache"
        );
        // A mirror alone sets the layout; the q columns follow the head dim.
        e.mirror = cache(128, 2);
        assert!(check_call(FP8, 100, n, 256, 1024, Fp8Epilogue::Qkv(e)).is_ok());
        assert_eq!(
            crate::prefill_gemm::Fp8LinearEpilogue::Qkv(e).out_cols(n),
            8 * 128
        );
    }

    fn residual_ok() -> Fp8Epilogue {
        Fp8Epilogue::Residual {
            out: DevicePtrMut::NULL,
            residual: DevicePtr::NULL,
            ldr: 8,
        }
    }
}
