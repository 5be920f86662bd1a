//! `rms_norm` and `residual + rms_norm` on Stoke's kernels (`kernels/rms_norm.cu`).

use super::bridge::{DeviceTensor, KernelInput, runtime_for};
use crate::tensor::StokeTensor;
use burn_backend::{Backend, DType, TensorMetadata};
use stoke_cuda::LaunchShape;
use stoke_cuda::kernels::RMS_NORM;
use stoke_cuda::kernels::rms_norm::{ElemType, RmsNormParams, launch};

/// Runs the kernel when it applies: a Stoke runtime on the device, f32 or bf16 `x` with the
/// same dtype for every input, `gamma` of shape `[hidden]`, `residual` shaped like `x`.
/// Otherwise returns `None` and the caller uses the reference composition.
/// Returns `(normed, sum)`, `sum` only for the residual variant.
pub(crate) fn try_rms_norm<I: Backend>(
    x: &StokeTensor<I>,
    residual: Option<&StokeTensor<I>>,
    gamma: &StokeTensor<I>,
    eps: f64,
) -> Option<(StokeTensor<I>, Option<StokeTensor<I>>)> {
    let device = super::float_device(x);
    let rt = runtime_for::<I>(&device)?;
    let dtype = x.dtype();
    let elem = match dtype {
        DType::F32 => ElemType::F32,
        DType::BF16 => ElemType::Bf16,
        other => {
            tracing::debug!("stoke rms_norm: {other:?} input uses the reference composition");
            return None;
        }
    };
    let shape = x.shape();
    let hidden = *shape.as_slice().last()?;
    let rows = shape.num_elements() / hidden.max(1);
    let same =
        |t: &StokeTensor<I>, dims: &[usize]| t.dtype() == dtype && t.shape().as_slice() == dims;
    if hidden == 0
        || rows == 0
        || !same(gamma, &[hidden])
        || residual.is_some_and(|r| !same(r, shape.as_slice()))
    {
        tracing::debug!(
            "stoke rms_norm: shapes/dtypes outside the kernel's contract, using the reference"
        );
        return None;
    }
    let (Ok(rows32), Ok(hidden32)) = (u32::try_from(rows), u32::try_from(hidden)) else {
        return None;
    };

    let x_in = KernelInput::resolve(&rt, x, &device);
    let res_in = residual.map(|r| KernelInput::resolve(&rt, r, &device));
    let g_in = KernelInput::resolve(&rt, gamma, &device);
    let out = DeviceTensor::<I>::alloc(&rt, shape.clone(), dtype, device.clone());
    let sum = residual.map(|_| DeviceTensor::<I>::alloc(&rt, shape.clone(), dtype, device.clone()));

    let params = RmsNormParams {
        x: x_in.ptr,
        residual: res_in.as_ref().map_or(0, |r| r.ptr),
        gamma: g_in.ptr,
        out: out.ptr(),
        sum_out: sum.as_ref().map_or(0, |s| s.ptr()),
        rows: rows32,
        hidden: hidden32,
        eps: eps as f32,
    };
    let aligned = [
        params.x,
        params.residual,
        params.gamma,
        params.out,
        params.sum_out,
    ]
    .iter()
    .all(|p| p % 16 == 0);
    let l = launch(
        elem,
        residual.is_some(),
        rows32,
        hidden32,
        aligned,
        rt.sm_count,
    );
    let shape = LaunchShape::from(l);
    let result = rt.kernel(&RMS_NORM, l.entry).and_then(|k| {
        // SAFETY: `RmsNormParams` mirrors the kernel's struct (checked by a size test against the
        // C static_assert); inputs are pinned until the kernel is done (KernelInput), outputs
        // are Stoke buffers freed on the same stream.
        unsafe { rt.launch(&k, shape, &params) }
    });
    if let Err(e) = result {
        panic!("stoke rms_norm: {e}");
    }
    drop((x_in, res_in, g_in));
    Some((StokeTensor::owned(out), sum.map(StokeTensor::owned)))
}
