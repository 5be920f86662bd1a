//! What Stoke's core asks of a device. `crate::cuda` (Stoke's CUDA kernels on Hopper) and
//! `crate::cpu` (its CPU kernels under `Stoke<NdArray>`) each implement [`Kernels`]; the op impls
//! (`route.rs`, `backend.rs`) call the set `route::Active` names, each device trying in turn
//! and the reference composition taking what none takes. The core types (`stoke.rs`,
//! `tensor.rs`, `packed.rs`, `plan.rs`, `decode.rs`, `fused.rs`) import no device module; a
//! device keeps what it derives from a weight (an upload, a reordered copy) in the weight's
//! [`DeviceSlots`].

use crate::tensor::StokeTensor;
use burn_backend::{Backend, ExecutionError};
use std::any::Any;
use std::sync::{Arc, Mutex};
use stoke_cuda::kernels::int4_gemm::Epilogue;

/// A device's kernels for the ops Stoke intercepts, and the hooks of its memory and stream.
/// Every method's default is "not this device's": `None`, the input back, nothing done.
pub(crate) trait Kernels {
    /// `epilogue(x @ weight)` (with `residual` for [`Epilogue::Residual`]) on this device's
    /// kernels, or `None` where none applies.
    fn linear<I: Backend>(
        _x: &StokeTensor<I>,
        _weight: &StokeTensor<I>,
        _epilogue: Epilogue,
        _residual: Option<&StokeTensor<I>>,
    ) -> Option<StokeTensor<I>> {
        None
    }

    /// `s = residual + x @ weight` and `rms_norm(s, gamma, eps)` with the norm folded into the
    /// GEMMs around it: `(s, normed)`, or `None` where no kernel applies.
    fn linear_residual_rms_norm<I: Backend>(
        _x: &StokeTensor<I>,
        _weight: &StokeTensor<I>,
        _residual: &StokeTensor<I>,
        _gamma: &StokeTensor<I>,
        _eps: f64,
    ) -> Option<(StokeTensor<I>, StokeTensor<I>)> {
        None
    }

    /// RMSNorm of `x` (plus `residual`): `(normed, sum)`, `sum` only with a residual; `None`
    /// where no kernel applies.
    fn rms_norm<I: Backend>(
        _x: &StokeTensor<I>,
        _residual: Option<&StokeTensor<I>>,
        _gamma: &StokeTensor<I>,
        _eps: f64,
    ) -> Option<(StokeTensor<I>, Option<StokeTensor<I>>)> {
        None
    }

    /// An RMSNorm left for the projection it feeds to apply (its plan folds the gain into that
    /// projection's weights), or `None`.
    fn defer_rms_norm<I: Backend>(
        _x: &StokeTensor<I>,
        _gamma: &StokeTensor<I>,
        _eps: f64,
    ) -> Option<StokeTensor<I>> {
        None
    }

    /// The weight made ready for this device's kernels as `plan` says; `Err` gives it back
    /// where this device does not take it.
    fn prepare_weight<I: Backend>(
        weight: StokeTensor<I>,
        _plan: crate::plan::WeightPlan,
    ) -> Result<StokeTensor<I>, StokeTensor<I>> {
        Err(weight)
    }

    /// Free and total bytes of the device's memory, where this device knows them.
    fn memory_info<I: Backend>(_device: &I::Device) -> Option<(usize, usize)> {
        None
    }

    /// Returns what this device pooled on `device` to its driver.
    fn memory_cleanup<I: Backend>(_device: &I::Device) {}

    /// Waits for the work this device queued on `device`.
    fn sync<I: Backend>(_device: &I::Device) -> Result<(), ExecutionError> {
        Ok(())
    }
}

/// Devices tried in order: the first that takes an op runs it.
impl<A: Kernels, B: Kernels> Kernels for (A, B) {
    fn linear<I: Backend>(
        x: &StokeTensor<I>,
        weight: &StokeTensor<I>,
        epilogue: Epilogue,
        residual: Option<&StokeTensor<I>>,
    ) -> Option<StokeTensor<I>> {
        A::linear(x, weight, epilogue, residual)
            .or_else(|| B::linear(x, weight, epilogue, residual))
    }

    fn linear_residual_rms_norm<I: Backend>(
        x: &StokeTensor<I>,
        weight: &StokeTensor<I>,
        residual: &StokeTensor<I>,
        gamma: &StokeTensor<I>,
        eps: f64,
    ) -> Option<(StokeTensor<I>, StokeTensor<I>)> {
        A::linear_residual_rms_norm(x, weight, residual, gamma, eps)
            .or_else(|| B::linear_residual_rms_norm(x, weight, residual, gamma, eps))
    }

    fn rms_norm<I: Backend>(
        x: &StokeTensor<I>,
        residual: Option<&StokeTensor<I>>,
        gamma: &StokeTensor<I>,
        eps: f64,
    ) -> Option<(StokeTensor<I>, Option<StokeTensor<I>>)> {
        A::rms_norm(x, residual, gamma, eps).or_else(|| B::rms_norm(x, residual, gamma, eps))
    }

    fn defer_rms_norm<I: Backend>(
        x: &StokeTensor<I>,
        gamma: &StokeTensor<I>,
        eps: f64,
    ) -> Option<StokeTensor<I>> {
        A::defer_rms_norm(x, gamma, eps).or_else(|| B::defer_rms_norm(x, gamma, eps))
    }

    fn prepare_weight<I: Backend>(
        weight: StokeTensor<I>,
        plan: crate::plan::WeightPlan,
    ) -> Result<StokeTensor<I>, StokeTensor<I>> {
        A::prepare_weight(weight, plan).or_else(|w| B::prepare_weight(w, plan))
    }

    fn memory_info<I: Backend>(device: &I::Device) -> Option<(usize, usize)> {
        A::memory_info::<I>(device).or_else(|| B::memory_info::<I>(device))
    }

    fn memory_cleanup<I: Backend>(device: &I::Device) {
        A::memory_cleanup::<I>(device);
        B::memory_cleanup::<I>(device);
    }

    fn sync<I: Backend>(device: &I::Device) -> Result<(), ExecutionError> {
        A::sync::<I>(device)?;
        B::sync::<I>(device)
    }
}

/// What devices derive from one weight (an upload, a reordered copy), one value per type,
/// made at first use by the device that owns the type.
#[derive(Default)]
pub struct DeviceSlots {
    slots: Mutex<Vec<Arc<dyn Any + Send + Sync>>>,
}

impl DeviceSlots {
    /// The value of type `T`, made by `init` the first time (while it runs, other slots of
    /// this weight wait: `init` must not ask this weight for a slot).
    pub fn get_or_init<T: Any + Send + Sync>(&self, init: impl FnOnce() -> T) -> Arc<T> {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = slots.iter().find_map(|s| s.clone().downcast::<T>().ok()) {
            return v;
        }
        let v = Arc::new(init());
        slots.push(v.clone());
        v
    }
}

impl std::fmt::Debug for DeviceSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.slots.lock().map_or(0, |s| s.len());
        write!(f, "DeviceSlots({n})")
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceSlots;

    #[test]
    fn a_slot_is_made_once_per_type() {
        let s = DeviceSlots::default();
        let a = s.get_or_init(|| 7u32);
        let b = s.get_or_init::<u32>(|| unreachable!("made already"));
        assert!(std::sync::Arc::ptr_eq(&a, &b));
        assert_eq!(*s.get_or_init(|| String::from("x")), "x");
        assert_eq!(*s.get_or_init(|| 9u32), 7);
    }
}
