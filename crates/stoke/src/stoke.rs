//! The `Stoke<I>` type: a Burn backend decorator around an inner backend. Its `Backend` impl is in
//! `backend.rs`, the op-trait impls in `ops/` (generated) and `route.rs`.

use crate::tensor::StokeTensor;
use burn_backend::{Backend, BackendTypes};
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
