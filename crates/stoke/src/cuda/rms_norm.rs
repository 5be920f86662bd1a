//! `rms_norm` and `residual + rms_norm` on Stoke's kernels (`kernels/rms_norm.cu`).

use super::bridge::{DeviceTensor, KernelInput, runtime_for};
use crate::tensor::StokeTensor;
use burn_backend::{Backend, DType, TensorMetadata};
use stoke_cuda::kernels::rms_norm::{ElemType, RmsElem, RmsNormParams, entry_point, launch};
use stoke_cuda::{DevicePtr, DevicePtrMut, LaunchShape, Runtime};

/// Device addresses of one RMSNorm call (0: none).
struct Addrs {
    x: u64,
    residual: u64,
    gamma: u64,
    out: u64,
    sum_out: u64,
}

/// Launches the chosen entry point on elements `T`.
///
/// # Safety
/// The addresses hold `rows x hidden` (`gamma`: `hidden`) elements of `T` until the kernel is
/// done.
unsafe fn launch_on<T: RmsElem>(
    rt: &Runtime,
    entry: &'static str,
    shape: LaunchShape,
    a: &Addrs,
    (rows, hidden, eps): (u32, u32, f32),
) -> stoke_cuda::Result<()> {
    let params = RmsNormParams::<T> {
        x: DevicePtr::new(a.x),
        residual: DevicePtr::new(a.residual),
        gamma: DevicePtr::new(a.gamma),
        out: DevicePtrMut::new(a.out),
        sum_out: DevicePtrMut::new(a.sum_out),
        rows,
        hidden,
        eps,
    };
    let k = rt.kernel(entry_point::<T>(entry))?;
    // SAFETY: the caller's guarantees.
    unsafe { rt.launch(&k, shape, &params) }
}

/// `rms_norm(x, gamma, eps)` now: the kernel where it applies ([`try_rms_norm`]), else the
/// reference composition.
pub(crate) fn rms_norm_now<I: Backend>(
    x: StokeTensor<I>,
    gamma: StokeTensor<I>,
    eps: f64,
) -> StokeTensor<I> {
    match try_rms_norm::<I>(&x, None, &gamma, eps) {
        Some((normed, _)) => normed,
        None => crate::fused::rms_norm_reference::<crate::Stoke<I>>(x, gamma, eps),
    }
}

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

    let addrs = Addrs {
        x: x_in.ptr,
        residual: res_in.as_ref().map_or(0, |r| r.ptr),
        gamma: g_in.ptr,
        out: out.ptr(),
        sum_out: sum.as_ref().map_or(0, |s| s.ptr()),
    };
    let aligned = [
        addrs.x,
        addrs.residual,
        addrs.gamma,
        addrs.out,
        addrs.sum_out,
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
    let sizes = (rows32, hidden32, eps as f32);
    // SAFETY: inputs are pinned until the kernel is done (KernelInput), outputs are Stoke
    // buffers freed on the same stream, all of `dtype`.
    let result = unsafe {
        match elem {
            ElemType::F32 => launch_on::<f32>(&rt, l.entry, shape, &addrs, sizes),
            ElemType::Bf16 => launch_on::<half::bf16>(&rt, l.entry, shape, &addrs, sizes),
        }
    };
    if let Err(e) = result {
        panic!("stoke rms_norm: {e}");
    }
    drop((x_in, res_in, g_in));
    Some((StokeTensor::owned(out), sum.map(StokeTensor::owned)))
}
