//! The E4M3 rows the FP8 prefill GEMM reads: params mirror and launch of kernels/fp8_quant.cu
//! (`stoke_formats::fp8::quantize_rows_fused` is its specification).

use super::{EntryPoint, FP8_QUANT, KernelParams};
use crate::{DevicePtr, DevicePtrMut, LaunchShape, Result, Runtime, ShapeError};
use half::bf16;

/// `struct Fp8RowsParams` of kernels/fp8_quant.cu (48 bytes; the `.cu` file asserts it).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Fp8RowsParams {
    /// `[rows, ldx]` bf16, 16-byte aligned.
    pub x: DevicePtr<bf16>,
    /// `[rows, k]` E4M3 codes.
    pub codes: DevicePtrMut<u8>,
    /// `[rows]`.
    pub scales: DevicePtrMut<f32>,
    pub rows: u32,
    pub k: u32,
    pub ldx: u32,
    pub eps: f32,
    /// 1: the scale carries RMSNorm's row factor.
    pub normalize: u32,
    pub pad: u32,
}

// SAFETY: the layout is the `.cu` struct's (asserted below); pointers of the kernel's types.
unsafe impl KernelParams for Fp8RowsParams {}

/// `kernels/fp8_quant.cu`.
pub const SOURCE: &str = include_str!("../../../../kernels/fp8_quant.cu");

/// Every `extern "C"` entry point in [`SOURCE`].
pub const ENTRY_POINTS: &[&str] = &["quantize_rows_e4m3_bf16"];

/// Threads per CTA (the kernel's `THREADS`).
const THREADS: u32 = 256;

/// Checks a call: `k` a positive multiple of 8, `ldx >= k` a multiple of 8, `x` 16-byte
/// aligned.
pub fn check(p: &Fp8RowsParams) -> std::result::Result<(), ShapeError> {
    if p.k == 0 || !p.k.is_multiple_of(8) || p.ldx < p.k || !p.ldx.is_multiple_of(8) {
        return Err(ShapeError::new(
            "FP8 row quantization k and row pitch",
            "k a positive multiple of 8, the pitch a multiple of 8 of at least k",
            format!("k {}, pitch {}", p.k, p.ldx),
        ));
    }
    if !p.x.addr().is_multiple_of(16) {
        return Err(ShapeError::new(
            "FP8 row quantization input",
            "a 16-byte aligned address",
            format!("{:#x}", p.x.addr()),
        ));
    }
    Ok(())
}

/// Queues the codes and scales of `p.rows` rows.
///
/// # Safety
/// The pointers must be valid device memory of the documented sizes until the kernel is done.
pub unsafe fn quantize_rows(rt: &Runtime, p: &Fp8RowsParams) -> Result<()> {
    if p.rows == 0 {
        return Ok(());
    }
    check(p)?;
    let k = rt.kernel(EntryPoint::<Fp8RowsParams>::new(
        &FP8_QUANT,
        "quantize_rows_e4m3_bf16",
    ))?;
    let shape = LaunchShape {
        grid: (p.rows.min(65535 * 8), 1, 1),
        block: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the caller's guarantees; the params match the entry point.
    unsafe { rt.launch(&k, shape, p) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<Fp8RowsParams>(), 48);
        assert_eq!(std::mem::offset_of!(Fp8RowsParams, rows), 24);
        assert_eq!(std::mem::offset_of!(Fp8RowsParams, eps), 36);
        assert!(SOURCE.contains("static_assert(sizeof(Fp8RowsParams) == 48"));
        assert!(SOURCE.contains(&format!("THREADS = {THREADS};")));
    }
}
