//! Stoke's float tensor primitive.
//!
//! A [`StokeTensor`] is either the inner backend's own float tensor, or data that Stoke owns
//! ([`StokeData`]): an activation left in Stoke's memory by a fused kernel, a weight whose
//! device pointer Stoke resolved once, later a packed INT4/FP8 weight. Stoke's ops look inside
//! and use what they recognize; every other op calls [`lower_float`], which materializes
//! Stoke-owned data into an ordinary inner tensor, so an unmodified Burn model keeps working
//! whatever its tensors hold.

use burn_backend::{Backend, DType, Shape, TensorData, TensorMetadata};
use std::any::Any;
use std::fmt::Debug;
use std::sync::Arc;

/// Data that Stoke owns behind a float tensor.
pub trait StokeData<I: Backend>: Send + Sync + Debug + 'static {
    fn shape(&self) -> Shape;
    fn dtype(&self) -> DType;
    fn device(&self) -> I::Device;
    /// The same values as an ordinary tensor of the inner backend. Called whenever an op that
    /// Stoke does not handle receives this tensor; implementations should cache the result.
    fn materialize(&self) -> I::FloatTensorPrimitive;
    /// The values, read where they are without materializing (a device buffer copied to the
    /// host); `None`: read through [`StokeData::materialize`].
    fn read(&self) -> Option<TensorData> {
        None
    }
    /// For the ops that recognize this kind of data.
    fn as_any(&self) -> &dyn Any;
}

/// Stoke's float tensor primitive.
#[derive(Clone, Debug)]
pub enum StokeTensor<I: Backend> {
    /// The inner backend's own tensor.
    Inner(I::FloatTensorPrimitive),
    /// Data that Stoke owns; behaves as a float tensor everywhere through materialization.
    Owned(Arc<dyn StokeData<I>>),
}

impl<I: Backend> StokeTensor<I> {
    pub fn owned(data: impl StokeData<I>) -> Self {
        Self::Owned(Arc::new(data))
    }

    /// The Stoke-owned data, if it is of type `T`.
    pub fn downcast_ref<T: 'static>(&self) -> Option<&T> {
        match self {
            Self::Owned(data) => data.as_any().downcast_ref::<T>(),
            Self::Inner(_) => None,
        }
    }

    /// The inner backend's tensor, materializing Stoke-owned data.
    pub fn into_inner(self) -> I::FloatTensorPrimitive {
        match self {
            Self::Inner(t) => t,
            Self::Owned(data) => data.materialize(),
        }
    }
}

impl<I: Backend> TensorMetadata for StokeTensor<I> {
    fn dtype(&self) -> DType {
        match self {
            Self::Inner(t) => t.dtype(),
            Self::Owned(d) => d.dtype(),
        }
    }

    fn shape(&self) -> Shape {
        match self {
            Self::Inner(t) => t.shape(),
            Self::Owned(d) => d.shape(),
        }
    }
}

/// Stoke's float primitive to the inner backend's (used by the generated forwarding).
#[inline]
pub fn lower_float<I: Backend>(t: StokeTensor<I>) -> I::FloatTensorPrimitive {
    t.into_inner()
}

/// The inner backend's float primitive to Stoke's.
#[inline]
pub fn lift_float<I: Backend>(t: I::FloatTensorPrimitive) -> StokeTensor<I> {
    StokeTensor::Inner(t)
}

/// The device of a Stoke tensor, without materializing it.
pub(crate) fn float_device<I: Backend>(t: &StokeTensor<I>) -> I::Device {
    match t {
        StokeTensor::Inner(t) => I::float_device(t),
        StokeTensor::Owned(d) => d.device(),
    }
}
