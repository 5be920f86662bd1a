//! The ops Stoke intercepts instead of forwarding (named in `stoke-forwardgen`'s table).
//! Each either runs a Stoke kernel or forwards to the inner backend.

use crate::cuda;
use crate::tensor::{StokeTensor, lift_float, lower_float};
use burn_backend::ops::AttentionModuleOptions;
use burn_backend::tensor::BoolTensor;
use burn_backend::{Backend, ExecutionError, TensorData, TensorMetadata};

/// `ModuleOps::linear` (weight `[d_in, d_out]`). A packed INT4 weight with decode-sized bf16
/// input runs the W4A16 kernel; anything else goes to the inner backend's matmul (a packed
/// weight then as its dequantized values).
pub(crate) fn linear<I: Backend>(
    x: StokeTensor<I>,
    weight: StokeTensor<I>,
    bias: Option<StokeTensor<I>>,
) -> StokeTensor<I> {
    if let Some(y) = cuda::int4_linear::try_linear::<I>(&x, &weight) {
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

/// The device, without materializing Stoke-owned data.
pub(crate) fn float_device<I: Backend>(tensor: &StokeTensor<I>) -> I::Device {
    cuda::float_device(tensor)
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
pub(crate) fn float_into_data<I: Backend>(
    tensor: StokeTensor<I>,
) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
    cuda::float_into_data(tensor)
}
