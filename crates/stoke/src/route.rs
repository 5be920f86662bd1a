//! The ops Stoke intercepts instead of forwarding (named in `stoke-forwardgen`'s table).
//! Each either runs a Stoke kernel or forwards to the inner backend.

use crate::cuda;
use crate::tensor::{StokeTensor, lift_float, lower_float};
use burn_backend::ops::AttentionModuleOptions;
use burn_backend::tensor::BoolTensor;
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
    if let Some(y) = cuda::try_linear::<I>(&x, &weight, Epilogue::Plain, None)
        .or_else(|| crate::cpu::try_linear::<I>(&x, &weight, Epilogue::Plain, None))
    {
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

/// Set while a strict decode-step capture runs ([`strict_capture`]).
static STRICT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// The forwarded ops called during a strict capture.
static INNER_OPS: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());

/// Called by every generated forwarding (`ops/*.rs`) before it calls the inner backend.
#[inline]
pub(crate) fn inner_op(name: &'static str) {
    if STRICT.load(std::sync::atomic::Ordering::Relaxed) {
        INNER_OPS.lock().unwrap().push(name);
    }
}

/// Runs `body` with forwarded ops recorded; returns its result and the ops the inner backend
/// ran meanwhile (a decode step captured into a CUDA graph must have none: they run on the inner
/// backend's stream, outside the graph).
pub(crate) fn strict_capture<T>(body: impl FnOnce() -> T) -> (T, Vec<&'static str>) {
    INNER_OPS.lock().unwrap().clear();
    STRICT.store(true, std::sync::atomic::Ordering::SeqCst);
    let out = body();
    STRICT.store(false, std::sync::atomic::Ordering::SeqCst);
    (out, std::mem::take(&mut *INNER_OPS.lock().unwrap()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn forwarded_ops_are_recorded_during_a_strict_capture() {
        type S = crate::Stoke<burn_ndarray::NdArray<f32>>;
        let (_, ops) = super::strict_capture(|| {
            burn::tensor::Tensor::<S, 1>::ones([4], &Default::default()).exp()
        });
        assert!(ops.contains(&"float_ones"), "{ops:?}");
        assert!(ops.contains(&"float_exp"), "{ops:?}");
    }
}
