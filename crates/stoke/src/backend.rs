//! The `Stoke<I>` type and its `Backend` impl. The op-trait impls live in `ops/`, generated.

use crate::tensor::StokeTensor;
use burn_backend::{Backend, BackendTypes, DTypeUsageSet, ExecutionError, TensorData};
use core::marker::PhantomData;

/// The Stoke backend decorator around an inner backend `I` (burn-cuda's `Cuda` on the GPU,
/// any Burn backend elsewhere).
#[derive(Clone, Copy, Default, Debug)]
pub struct Stoke<I> {
    _inner: PhantomData<I>,
}

impl<I: Backend> BackendTypes for Stoke<I> {
    type Device = I::Device;
    /// Stoke's own float primitive: the inner backend's tensor, or data that Stoke owns (a
    /// buffer on Stoke's stream, a packed weight) that materializes on demand.
    type FloatTensorPrimitive = StokeTensor<I>;
    type FloatElem = I::FloatElem;
    type IntTensorPrimitive = I::IntTensorPrimitive;
    type IntElem = I::IntElem;
    type BoolTensorPrimitive = I::BoolTensorPrimitive;
    type BoolElem = I::BoolElem;
    type QuantizedTensorPrimitive = I::QuantizedTensorPrimitive;
}

impl<I: Backend> Backend for Stoke<I> {
    fn ad_enabled(device: &Self::Device) -> bool {
        I::ad_enabled(device)
    }

    fn memory_persistent_allocations<
        Output: Send,
        Input: Send,
        Func: Fn(Input) -> Output + Send,
    >(
        device: &Self::Device,
        input: Input,
        func: Func,
    ) -> Output {
        I::memory_persistent_allocations(device, input, func)
    }

    /// Also returns the buffers Stoke pooled on this device to the driver.
    fn memory_cleanup(device: &Self::Device) {
        crate::cuda::memory_cleanup::<I>(device);
        I::memory_cleanup(device)
    }

    fn name(device: &Self::Device) -> String {
        format!("stoke<{}>", I::name(device))
    }

    fn seed(device: &Self::Device, seed: u64) {
        I::seed(device, seed)
    }

    /// Waits for the inner backend and for every kernel Stoke queued on this device.
    fn sync(device: &Self::Device) -> Result<(), ExecutionError> {
        crate::cuda::sync_device::<I>(device)?;
        I::sync(device)
    }

    fn staging<'a, Iter>(data: Iter, device: &Self::Device)
    where
        Iter: Iterator<Item = &'a mut TensorData>,
    {
        I::staging(data, device)
    }

    fn supports_dtype(device: &Self::Device, dtype: burn_backend::DType) -> bool {
        I::supports_dtype(device, dtype)
    }

    fn dtype_usage(device: &Self::Device, dtype: burn_backend::DType) -> DTypeUsageSet {
        I::dtype_usage(device, dtype)
    }

    fn device_count(type_id: u16) -> usize {
        I::device_count(type_id)
    }
}
