//! The ops Stoke intercepts instead of forwarding (named in `stoke-forwardgen`'s table) and
//! `Stoke<I>`'s [`FusedOps`]: each runs on the first device in [`Active`] that takes it, else on
//! the inner backend (or the fused op's reference composition).

pub(crate) use crate::capture::inner_op;
use crate::device::Kernels;
use crate::fused::{FusedOps, residual_rms_norm_reference, rms_norm_reference, swiglu_reference};
use crate::stoke::Stoke;
use crate::tensor::{StokeTensor, lift_float, lower_float};
use burn_backend::DType;
use burn_backend::ops::{AttentionModuleOptions, FloatTensorOps, ModuleOps};
use burn_backend::tensor::BoolTensor;
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, ExecutionError, TensorData, TensorMetadata};

/// `ModuleOps::linear` (weight `[d_in, d_out]`). A packed INT4 weight with decode-sized bf16
/// input runs the W4A16 kernel, a pinned bf16 weight with up to 32 rows of bf16 input the dense
/// bf16 kernel; anything else goes to the inner backend's matmul (a packed weight then as its
/// dequantized values).
pub(crate) fn linear<I: Backend>(
    x: StokeTensor<I>,
    weight: StokeTensor<I>,
    bias: Option<StokeTensor<I>>,
) -> StokeTensor<I> {
    use stoke_cuda::kernels::int4_gemm::Epilogue;
    if let Some(y) = Active::linear::<I>(&x, &weight, Epilogue::Plain, None) {
        return match bias {
            None => y,
            Some(b) => {
                // bias [n] -> [1, ..., 1, n], as Burn's own linear does.
                let y = lower_float(y);
                let mut dims = vec![1; y.shape().num_dims()];
                let b = lower_float(b);
                *dims.last_mut().unwrap() = b.shape().num_elements();
                lift_float::<I>(I::float_add(y, I::float_reshape(b, dims.into())))
            }
        };
    }
    lift_float::<I>(I::linear(
        lower_float(x),
        lower_float(weight),
        bias.map(lower_float),
    ))
}

impl<I: Backend> FusedOps for Stoke<I> {
    crate::cuda::decoder::stoke_decoder_ops!();

    fn prepare_weight(
        weight: FloatTensor<Self>,
        plan: crate::plan::WeightPlan,
    ) -> FloatTensor<Self> {
        Active::prepare_weight(weight, plan).unwrap_or_else(|w| w)
    }

    fn device_memory(device: &Self::Device) -> Option<(usize, usize)> {
        Active::memory_info::<I>(device)
    }

    fn packed_int4_weight(
        packed: stoke_formats::int4::PackedInt4,
        dtype: DType,
        device: &Self::Device,
    ) -> Option<FloatTensor<Self>> {
        Some(crate::tensor::StokeTensor::owned(
            crate::packed::PackedWeight::<I>::new(packed, dtype, device.clone()),
        ))
    }

    fn linear_residual(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        residual: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        use stoke_cuda::kernels::int4_gemm::Epilogue;
        Active::linear::<I>(&x, &weight, Epilogue::Residual, Some(&residual))
            .unwrap_or_else(|| Self::float_add(Self::linear(x, weight, None), residual))
    }

    fn linear_residual_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if let Some(r) = Active::linear_residual_rms_norm::<I>(&x, &weight, &residual, &gamma, eps)
        {
            return r;
        }
        crate::fused::linear_residual_then_rms_norm::<Self>(x, weight, residual, gamma, eps)
    }

    fn linear_swiglu(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        use stoke_cuda::kernels::int4_gemm::Epilogue;
        Active::linear::<I>(&x, &weight, Epilogue::SwiGlu, None)
            .unwrap_or_else(|| swiglu_reference::<Self>(Self::linear(x, weight, None)))
    }

    fn rms_norm(x: FloatTensor<Self>, gamma: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        // A gain whose plan folds it into FP8 projections: deferred, so that the projection it
        // feeds reads x with the gain folded into its weight.
        if let Some(n) = Active::defer_rms_norm::<I>(&x, &gamma, eps) {
            return n;
        }
        match Active::rms_norm::<I>(&x, None, &gamma, eps) {
            Some((normed, _)) => normed,
            None => rms_norm_reference::<Self>(x, gamma, eps),
        }
    }

    fn residual_rms_norm(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match Active::rms_norm::<I>(&x, Some(&residual), &gamma, eps) {
            Some((normed, Some(sum))) => (sum, normed),
            _ => residual_rms_norm_reference::<Self>(x, residual, gamma, eps),
        }
    }
}

/// `ModuleOps::attention`: forwarded until Stoke's attention kernels apply.
pub(crate) fn attention<I: Backend>(
    query: StokeTensor<I>,
    key: StokeTensor<I>,
    value: StokeTensor<I>,
    mask: Option<BoolTensor<I>>,
    attn_bias: Option<StokeTensor<I>>,
    options: AttentionModuleOptions,
) -> StokeTensor<I> {
    lift_float::<I>(I::attention(
        lower_float(query),
        lower_float(key),
        lower_float(value),
        mask,
        attn_bias.map(lower_float),
        options,
    ))
}

/// The devices Stoke's ops try, in order: its CUDA kernels, then its CPU kernels.
pub(crate) type Active = (crate::cuda::Gpu, crate::cpu::Host);

/// The device, without materializing Stoke-owned data.
pub(crate) fn float_device<I: Backend>(tensor: &StokeTensor<I>) -> I::Device {
    crate::tensor::float_device(tensor)
}

/// Stoke-owned data is never tracked by an autodiff decorator inside Stoke.
pub(crate) fn float_is_require_grad<I: Backend>(tensor: &StokeTensor<I>) -> bool {
    match tensor {
        StokeTensor::Inner(t) => I::float_is_require_grad(t),
        StokeTensor::Owned(_) => false,
    }
}

/// Burn's `Param` marks every parameter through this op. Stoke-owned data (a pinned or packed
/// weight) stays as it is: `Stoke<I>` tracks no gradients itself, so there is nothing to mark,
/// and forwarding would materialize the weight into an ordinary tensor.
pub(crate) fn float_set_require_grad<I: Backend>(
    tensor: StokeTensor<I>,
    require_grad: bool,
) -> StokeTensor<I> {
    match tensor {
        StokeTensor::Inner(t) => StokeTensor::Inner(I::float_set_require_grad(t, require_grad)),
        owned @ StokeTensor::Owned(_) => owned,
    }
}

/// Reads values; Stoke's own buffers are copied straight to the host.
pub(crate) async fn float_into_data<I: Backend>(
    tensor: StokeTensor<I>,
) -> Result<TensorData, ExecutionError> {
    if let StokeTensor::Owned(d) = &tensor
        && let Some(data) = d.read()
    {
        return Ok(data);
    }
    I::float_into_data(tensor.into_inner()).await
}
