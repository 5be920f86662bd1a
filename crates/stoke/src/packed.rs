//! Weights in Stoke's packed INT4 format (`stoke_formats::int4`) behind a float tensor.
//!
//! `linear` hands these to a device's kernels (on Hopper: the W4A16 kernels for bf16
//! activations of up to 64 rows, the prefill GEMMs on a bf16 or E4M3 copy made once for more;
//! on the CPU: a reordered copy of the nibbles); every other use, and every backend or GPU where
//! those kernels don't run, sees the dequantized values (`d * q + m`, computed in f32 exactly as
//! the format's reference does), materialized once and cached (prefill-sized inputs use a dense
//! GEMM on them). What a device derives from the weight lives in its `DeviceSlots` (`device.rs`).

use crate::device::DeviceSlots;
use crate::tensor::StokeData;
use burn_backend::{Backend, DType, FloatDType, Shape, TensorData};
use std::any::Any;
use std::sync::{Arc, OnceLock};
use stoke_formats::int4::PackedInt4;

/// A packed INT4 weight `[k, n]` (Burn's Linear layout) presenting as a float tensor of `dtype`.
pub struct PackedWeight<I: Backend> {
    pub packed: Arc<PackedInt4>,
    dtype: DType,
    device: I::Device,
    /// How its prefill GEMMs run (its model's plan).
    pub prefill_mode: crate::plan::PrefillMode,
    materialized: OnceLock<I::FloatTensorPrimitive>,
    /// What the devices' kernels derive from it at first use (its upload, the prefill GEMMs'
    /// copies and delayed scales, the CPU kernel's layout of the nibbles).
    pub(crate) slots: DeviceSlots,
}

impl<I: Backend> PackedWeight<I> {
    pub fn new(packed: PackedInt4, dtype: DType, device: I::Device) -> Self {
        Self {
            packed: Arc::new(packed),
            dtype,
            device,
            prefill_mode: Default::default(),
            materialized: OnceLock::new(),
            slots: DeviceSlots::default(),
        }
    }

    /// The same packed weight with its prefill GEMMs run as `mode` says (the copies and uploads
    /// are made afresh, at first use; the packed data is shared).
    pub fn with_prefill(&self, mode: crate::plan::PrefillMode) -> Self {
        Self {
            packed: self.packed.clone(),
            dtype: self.dtype,
            device: self.device.clone(),
            prefill_mode: mode,
            materialized: OnceLock::new(),
            slots: DeviceSlots::default(),
        }
    }
}

impl<I: Backend> std::fmt::Debug for PackedWeight<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.packed;
        write!(
            f,
            "PackedWeight(int4 [{}, {}], group {}, {:?})",
            p.k, p.n, p.group, self.dtype
        )
    }
}

impl<I: Backend> StokeData<I> for PackedWeight<I> {
    fn shape(&self) -> Shape {
        Shape::new([self.packed.k, self.packed.n])
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn device(&self) -> I::Device {
        self.device.clone()
    }
    fn materialize(&self) -> I::FloatTensorPrimitive {
        self.materialized
            .get_or_init(|| {
                let data =
                    TensorData::new(self.packed.dequantize(), [self.packed.k, self.packed.n]);
                let t = I::float_from_data(data, &self.device);
                if self.dtype == DType::F32 {
                    t
                } else {
                    I::float_cast(t, FloatDType::from(self.dtype))
                }
            })
            .clone()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
