//! `Stoke<I>`'s `Backend` impl: everything goes to the inner backend, and the device's hooks
//! (Stoke's stream and buffer pool, through [`crate::device::Kernels`]) run beside it. The
//! op-trait impls live in `ops/` (generated) and `route.rs`.

use crate::device::Kernels;
use crate::route::Active;
use crate::stoke::Stoke;
use burn_backend::{Backend, DTypeUsageSet, ExecutionError, TensorData};

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
        Active::memory_cleanup::<I>(device);
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
        Active::sync::<I>(device)?;
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
