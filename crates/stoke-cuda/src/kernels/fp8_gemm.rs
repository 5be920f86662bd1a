//! The FP8 prefill GEMM: params mirror and launch of kernels/fp8_gemm.cu
//! (`y = (A W^T) * a_scale[row] * w_scale[col]`, E4M3 operands, bf16 out;
//! `stoke_formats::fp8::gemm_reference` is its specification).

use super::{EntryPoint, FP8_GEMM, KernelParams};
use crate::{DevicePtr, DevicePtrMut, LaunchShape, Result, Runtime, ShapeError, TensorMap};
use half::bf16;

/// `struct Fp8GemmParams` of kernels/fp8_gemm.cu (320 bytes; the `.cu` file asserts it).
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
    /// `[m, ldo]` bf16.
    pub out: DevicePtrMut<bf16>,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub ldo: u32,
    pub a_scale_stride: u32,
    pub pad: u32,
}

// SAFETY: the layout is the `.cu` struct's (asserted below); pointers of the kernel's types.
unsafe impl KernelParams for Fp8GemmParams {}

/// `kernels/fp8_gemm.cu`.
pub const SOURCE: &str = include_str!("../../../../kernels/fp8_gemm.cu");

/// Every `extern "C"` entry point in [`SOURCE`].
pub const ENTRY_POINTS: &[&str] = &["fp8_gemm_plain"];

/// The kernel's tile (`BM` x `BN`), k per stage (`BK`), stages, and its shared memory.
const BM: u32 = 128;
const BN: u32 = 128;
const BK: u32 = 128;
const STAGES: u32 = 5;
const SMEM_BYTES: u32 = STAGES * (BM + BN) * BK + 2 * STAGES * 8 + 1024;
const THREADS: u32 = 384;

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
    pub out: DevicePtrMut<bf16>,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    /// Row pitch of `out` in elements (at least `n`, even).
    pub ldo: u32,
}

/// Checks a call's shape: `m`, `n` positive, `k` a positive multiple of 16 (the copy engine's
/// row pitch), `ldo >= n` and even (the epilogue's paired stores).
pub fn check_shape(m: u32, n: u32, k: u32, ldo: u32) -> std::result::Result<(), ShapeError> {
    if m == 0 || n == 0 {
        return Err(ShapeError::new(
            "FP8 GEMM rows and columns",
            "positive",
            format!("m {m}, n {n}"),
        ));
    }
    if k == 0 || !k.is_multiple_of(16) {
        return Err(ShapeError::new(
            "FP8 GEMM k",
            "a positive multiple of 16",
            k.to_string(),
        ));
    }
    if ldo < n || !ldo.is_multiple_of(2) {
        return Err(ShapeError::new(
            "FP8 GEMM output row pitch",
            format!("an even count of at least n = {n}"),
            ldo.to_string(),
        ));
    }
    Ok(())
}

/// Persistent CTAs of a call: one per SM, at most one per output tile.
pub fn grid(m: u32, n: u32, sm_count: u32) -> u32 {
    (m.div_ceil(BM) * n.div_ceil(BN)).min(sm_count).max(1)
}

/// Queues `out = (A W^T) * a_scale * w_scale`.
///
/// # Safety
/// The pointers must be valid device memory of the documented sizes until the kernel is done.
pub unsafe fn fp8_gemm(rt: &Runtime, g: &Fp8Gemm) -> Result<()> {
    check_shape(g.m, g.n, g.k, g.ldo)?;
    let p = Fp8GemmParams {
        a_map: rt.u8_tensor_map_2d(g.a.addr(), g.m, g.k, BM, BK)?,
        w_map: rt.u8_tensor_map_2d(g.w.addr(), g.n, g.k, BN, BK)?,
        a_scale: g.a_scale,
        w_scale: g.w_scale,
        out: g.out,
        m: g.m,
        n: g.n,
        k: g.k,
        ldo: g.ldo,
        a_scale_stride: u32::from(g.a_scale_per_row),
        pad: 0,
    };
    let k = rt.kernel(EntryPoint::<Fp8GemmParams>::new(
        &FP8_GEMM,
        "fp8_gemm_plain",
    ))?;
    let shape = LaunchShape {
        grid: (grid(g.m, g.n, rt.sm_count), 1, 1),
        block: (THREADS, 1, 1),
        shared_mem_bytes: SMEM_BYTES,
    };
    // SAFETY: the caller's guarantees; the params match the entry point.
    unsafe { rt.launch(&k, shape, &p) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<Fp8GemmParams>(), 320);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, w_map), 128);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, a_scale), 256);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, out), 272);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, m), 280);
        assert_eq!(std::mem::offset_of!(Fp8GemmParams, pad), 300);
        assert!(SOURCE.contains("static_assert(sizeof(Fp8GemmParams) == 320"));
        for (name, v) in [("BM", BM), ("BN", BN), ("BK", BK)] {
            assert!(SOURCE.contains(&format!("{name} = {v}")), "{name}");
        }
        assert!(SOURCE.contains(&format!("STAGES = {STAGES};")));
    }

    #[test]
    fn shapes_are_checked_and_the_grid_is_persistent() {
        assert!(check_shape(1, 8, 16, 8).is_ok());
        assert_eq!(
            check_shape(0, 8, 16, 8).unwrap_err().what,
            "FP8 GEMM rows and columns"
        );
        assert_eq!(check_shape(4, 8, 24, 8).unwrap_err().what, "FP8 GEMM k");
        assert_eq!(
            check_shape(4, 8, 32, 7).unwrap_err().what,
            "FP8 GEMM output row pitch"
        );
        assert_eq!(grid(1, 1, 132), 1);
        assert_eq!(grid(2048, 4096, 132), 132);
        assert_eq!(grid(129, 256, 132), 4);
    }
}
