//! The FP8 prefill linear: a weight's E4M3 codes and per-channel scales in device memory
//! ([`DeviceFp8Weight`]) and [`fp8_linear`], which quantizes bf16 rows to E4M3 with one scale
//! per row (`kernels/fp8_quant.cu`) and runs the persistent FP8 GEMM with one of its epilogues
//! (`kernels/fp8_gemm.cu`). `stoke_formats::fp8` holds the specification of both.

use crate::kernels::fp8_gemm::{Bf16TcGemm, Fp8Epilogue, Fp8Gemm, bf16_tc_gemm, fp8_gemm};
use crate::kernels::fp8_quant::{Fp8RowsParams, quantize_rows};
use crate::{DeviceBuffer, DevicePtr, DevicePtrMut, Error, Result, Runtime, ShapeError};
use half::bf16;
use std::sync::Arc;
use stoke_formats::fp8::Fp8Weight;

/// A weight `[n, k]` in E4M3 with one f32 scale per output channel, in device memory.
pub struct DeviceFp8Weight {
    pub n: u32,
    pub k: u32,
    codes: DeviceBuffer,
    scales: DeviceBuffer,
}

impl std::fmt::Debug for DeviceFp8Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceFp8Weight(e4m3 [{}, {}])", self.n, self.k)
    }
}

impl DeviceFp8Weight {
    /// Uploads `w`. The GEMM reads `k` bytes per row through the copy engine, so `k` must be a
    /// positive multiple of 16.
    pub fn upload(rt: &Arc<Runtime>, w: &Fp8Weight) -> Result<Self> {
        if w.k == 0 || !w.k.is_multiple_of(16) || w.n == 0 {
            return Err(Error::Shape(ShapeError::new(
                format!("FP8 weight [{}, {}]", w.n, w.k),
                "n positive, k a positive multiple of 16",
                format!("n {}, k {}", w.n, w.k),
            )));
        }
        let (n, k) = (u32::try_from(w.n), u32::try_from(w.k));
        let (Ok(n), Ok(k)) = (n, k) else {
            return Err(Error::Shape(ShapeError::new(
                "FP8 weight dimensions",
                "below 2^32",
                format!("[{}, {}]", w.n, w.k),
            )));
        };
        let codes = rt.alloc(w.codes.len())?;
        let scales = rt.alloc(4 * w.scales.len())?;
        let scale_bytes: Vec<u8> = w.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        // SAFETY: each buffer holds exactly the bytes copied.
        unsafe {
            rt.copy_htod(codes.ptr(), &w.codes)?;
            rt.copy_htod(scales.ptr(), &scale_bytes)?;
        }
        Ok(Self {
            n,
            k,
            codes,
            scales,
        })
    }
}

/// What an FP8 linear does with `y = x W^T`.
#[derive(Clone, Copy, Debug)]
pub enum Fp8LinearEpilogue {
    /// `out = y` (`[m, n]`).
    Plain,
    /// `out = y + residual` (`[m, n]` both).
    Residual(DevicePtr<bf16>),
    /// `out = silu(y[2 j]) y[2 j + 1]` (`[m, n / 2]`: gate and up interleaved).
    SwiGlu,
}

impl Fp8LinearEpilogue {
    /// Output columns for `n` weight rows.
    pub fn out_cols(self, n: u32) -> u32 {
        match self {
            Self::SwiGlu => n / 2,
            Self::Plain | Self::Residual(_) => n,
        }
    }

    /// The GEMM's epilogue writing bf16 `out` for `n` weight rows.
    fn gemm(self, out: DevicePtrMut<bf16>, n: u32) -> Fp8Epilogue {
        match self {
            Self::Plain => Fp8Epilogue::Plain { out },
            Self::Residual(residual) => Fp8Epilogue::Residual {
                out,
                residual,
                ldr: n,
            },
            Self::SwiGlu => Fp8Epilogue::SwiGluBf16 { out },
        }
    }
}

/// Queues `epilogue(x W^T)` for bf16 rows `x` (`[m, k]`, dense, 16-byte aligned) into `out`
/// (`[m, epilogue.out_cols(n)]` bf16, dense): the rows' E4M3 codes and scales go to scratch
/// memory on Stoke's stream, then the GEMM reads them.
///
/// # Safety
/// `x`, `out` and a residual must be valid device memory of those sizes until the kernels are
/// done.
pub unsafe fn fp8_linear(
    rt: &Arc<Runtime>,
    w: &DeviceFp8Weight,
    x: DevicePtr<bf16>,
    m: u32,
    out: DevicePtrMut<bf16>,
    epilogue: Fp8LinearEpilogue,
) -> Result<()> {
    if m == 0 {
        return Ok(());
    }
    let (n, k) = (w.n, w.k);
    let codes = rt.alloc(m as usize * k as usize)?;
    let scales = rt.alloc(4 * m as usize)?;
    let rows = Fp8RowsParams {
        x,
        codes: codes.as_mut_ptr(),
        scales: scales.as_mut_ptr(),
        rows: m,
        k,
        ldx: k,
        eps: 0.0,
        normalize: 0,
        pad: 0,
    };
    let out_cols = epilogue.out_cols(n);
    let epilogue = epilogue.gemm(out, n);
    let gemm = Fp8Gemm {
        a: codes.as_ptr(),
        w: w.codes.as_ptr(),
        a_scale: scales.as_ptr(),
        a_scale_per_row: true,
        w_scale: w.scales.as_ptr(),
        epilogue,
        m,
        n,
        k,
        ldo: out_cols,
    };
    // SAFETY: the caller's guarantees for x and out; the scratch buffers are released after
    // the queued kernels (stream-ordered), the weight's buffers live as long as `w`.
    unsafe {
        quantize_rows(rt, &rows)?;
        fp8_gemm(rt, &gemm)
    }
}

/// A weight `[n, k]` in bf16 (a `[k, n]` linear weight transposed) in device memory: the
/// operand of the bf16 prefill GEMM.
pub struct DeviceBf16Weight {
    pub n: u32,
    pub k: u32,
    values: DeviceBuffer,
}

impl std::fmt::Debug for DeviceBf16Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBf16Weight([{}, {}])", self.n, self.k)
    }
}

impl DeviceBf16Weight {
    /// Uploads `w` (`[n, k]` f32 values, rounded to bf16). The GEMM reads rows of `2 k` bytes
    /// through the copy engine, so `k` must be a positive multiple of 8.
    pub fn upload(rt: &Arc<Runtime>, w: &[f32], n: usize, k: usize) -> Result<Self> {
        let dims = (u32::try_from(n), u32::try_from(k));
        let (Ok(n32), Ok(k32)) = dims else {
            return Err(Error::Shape(ShapeError::new(
                "bf16 weight dimensions",
                "below 2^32",
                format!("[{n}, {k}]"),
            )));
        };
        if n == 0 || k == 0 || !k.is_multiple_of(8) || w.len() != n * k {
            return Err(Error::Shape(ShapeError::new(
                format!("bf16 weight [{n}, {k}] of {} values", w.len()),
                "n positive, k a positive multiple of 8, n k values",
                format!("n {n}, k {k}, {} values", w.len()),
            )));
        }
        let bytes: Vec<u8> = w
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect();
        let values = rt.alloc(bytes.len())?;
        // SAFETY: the buffer holds exactly the bytes copied.
        unsafe { rt.copy_htod(values.ptr(), &bytes)? };
        Ok(Self {
            n: n32,
            k: k32,
            values,
        })
    }
}

/// Queues `epilogue(x W^T)` for bf16 rows `x` (`[m, k]`, dense, 16-byte aligned) into `out`
/// (`[m, epilogue.out_cols(n)]` bf16, dense) on the bf16 GEMM: no quantization, f32 sums.
///
/// # Safety
/// `x`, `out` and a residual must be valid device memory of those sizes until the kernel is
/// done.
pub unsafe fn bf16_linear(
    rt: &Arc<Runtime>,
    w: &DeviceBf16Weight,
    x: DevicePtr<bf16>,
    m: u32,
    out: DevicePtrMut<bf16>,
    epilogue: Fp8LinearEpilogue,
) -> Result<()> {
    if m == 0 {
        return Ok(());
    }
    let gemm = Bf16TcGemm {
        a: x,
        w: w.values.as_ptr(),
        epilogue: epilogue.gemm(out, w.n),
        m,
        n: w.n,
        k: w.k,
        ldo: epilogue.out_cols(w.n),
    };
    // SAFETY: the caller's guarantees; the weight's buffer lives as long as `w`.
    unsafe { bf16_tc_gemm(rt, &gemm) }
}
