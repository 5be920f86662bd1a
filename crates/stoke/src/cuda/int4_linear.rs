//! `linear` on a packed INT4 weight through the W4A16 kernels (`kernels/int4_gemm_*.cu`).

use super::bridge::{DeviceTensor, KernelInput, runtime_for};
use crate::packed::PackedWeight;
use crate::tensor::StokeTensor;
use burn_backend::{Backend, DType, TensorMetadata};
use std::sync::Arc;
use stoke_cuda::int4::{DeviceInt4, Int4Gemm, int4_gemm};
use stoke_cuda::kernels::int4_gemm::{Epilogue, WordOrder};
use stoke_cuda::{DevicePtr, DevicePtrMut, Runtime};

static KERNEL_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many `linear` calls have run on the W4A16 kernels in this process.
pub fn kernel_calls() -> u64 {
    KERNEL_CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Most rows the kernels take before a dense GEMM on the dequantized weight wins (each 32
/// rows re-read the weight).
pub const MAX_KERNEL_ROWS: usize = 64;

/// `epilogue(x @ W)` on the kernels when `weight` is a [`PackedWeight`], `x` is bf16 `[.., k]`
/// with at most [`MAX_KERNEL_ROWS`] rows, and Stoke's runtime runs on the device; `None`
/// otherwise. `Residual` adds `residual` (bf16, shaped like the output), `SwiGlu` returns
/// `silu(g) * u` of the interleaved gate/up columns (`[.., n / 2]`).
pub(crate) fn try_linear_with<I: Backend>(
    x: &StokeTensor<I>,
    weight: &StokeTensor<I>,
    epilogue: Epilogue,
    residual: Option<&StokeTensor<I>>,
) -> Option<StokeTensor<I>> {
    let pw = weight.downcast_ref::<PackedWeight<I>>()?;
    let device = super::float_device(x);
    let rt = runtime_for::<I>(&device)?;
    let shape = x.shape();
    let dims = shape.as_slice();
    let (k, n) = (pw.packed.k, pw.packed.n);
    if x.dtype() != DType::BF16 || dims.last() != Some(&k) {
        tracing::debug!(
            "stoke linear: packed weight with {:?} input {dims:?}: dequantized weight",
            x.dtype()
        );
        return None;
    }
    let m = shape.num_elements() / k.max(1);
    if m == 0 || m > MAX_KERNEL_ROWS {
        return None;
    }
    if !super::residual_fits(epilogue, residual, dims, n)
        || (epilogue == Epilogue::SwiGlu && n % 2 != 0)
    {
        return None;
    }
    let dw = device_int4(pw, &rt)?;
    let x_in = KernelInput::resolve(&rt, x, &device);
    let res_in = residual
        .filter(|_| epilogue == Epilogue::Residual)
        .map(|r| KernelInput::resolve(&rt, r, &device));
    let out_shape = super::with_cols(dims, epilogue.out_cols(n));
    let out = DeviceTensor::<I>::alloc(&rt, out_shape, DType::BF16, device);
    let call = Int4Gemm {
        x: DevicePtr::new(x_in.ptr),
        m: m as u32,
        out: DevicePtrMut::new(out.ptr()),
        epilogue,
        residual: res_in
            .as_ref()
            .map_or(DevicePtr::NULL, |r| DevicePtr::new(r.ptr)),
        row_scale: DevicePtr::NULL,
        splits: 0,
        wg_rows: stoke_cuda::int4::wg_rows_default(),
        tune: stoke_cuda::int4::tune_default(),
    };
    // SAFETY: x is pinned (or Stoke-owned) until the kernel is done, out is a Stoke buffer of
    // m * n bf16, the weight buffers are held by `dw` (freed on Stoke's stream).
    if let Err(e) = unsafe { int4_gemm(&rt, &dw, &call) } {
        panic!("stoke linear (INT4): {e}");
    }
    drop((x_in, res_in));
    KERNEL_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Some(StokeTensor::owned(out))
}

/// The packed weight in device memory, uploaded at its first kernel call (`None`, logged once,
/// where the upload failed: the dequantized weight serves instead).
pub(crate) fn device_int4<I: Backend>(
    pw: &PackedWeight<I>,
    rt: &Arc<Runtime>,
) -> Option<Arc<DeviceInt4>> {
    pw.slots
        .get_or_init(|| {
            GpuInt4(
                DeviceInt4::upload_packed(rt, &pw.packed, WordOrder::default())
                    .map(Arc::new)
                    .map_err(|e| {
                        tracing::warn!(
                            "stoke linear: INT4 weight upload failed ({e}); dequantized weight \
                             instead"
                        )
                    })
                    .ok(),
            )
        })
        .0
        .clone()
}

/// A packed weight's upload, in its [`crate::device::DeviceSlots`] (`None`: the upload failed,
/// and was logged).
struct GpuInt4(Option<Arc<DeviceInt4>>);
