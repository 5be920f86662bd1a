//! Conversions between Stoke's and the inner backend's versions of Burn's structs that carry
//! float tensors. The generated forwarding calls `Lower::lower` on arguments and `Lift::lift`
//! on results of these types; the tensor conversions themselves are `lower_float`/`lift_float`.

use crate::stoke::Stoke;
use crate::tensor::{lift_float, lower_float};
use burn_backend::Backend;
use burn_backend::TensorPrimitive;
use burn_backend::ops::*;
use burn_backend::quantization::QuantizationParametersPrimitive;

/// Stoke-side value to the inner backend's.
pub trait Lower<I: Backend> {
    type Inner;
    fn lower(self) -> Self::Inner;
}

/// Inner backend's value to Stoke's.
pub trait Lift<I: Backend> {
    type Outer;
    fn lift(self) -> Self::Outer;
}

/// Implements both directions for a struct whose fields are float tensors (`f`), optional
/// float tensors (`o`) or other tensors that pass through (`p`).
macro_rules! convert_struct {
    ($name:ident { $($kind:ident $field:ident),* $(,)? }) => {
        impl<I: Backend> Lift<I> for $name<I> {
            type Outer = $name<Stoke<I>>;
            fn lift(self) -> Self::Outer {
                $name { $($field: convert_struct!(@lift $kind self.$field)),* }
            }
        }
        impl<I: Backend> Lower<I> for $name<Stoke<I>> {
            type Inner = $name<I>;
            fn lower(self) -> Self::Inner {
                $name { $($field: convert_struct!(@lower $kind self.$field)),* }
            }
        }
    };
    (@lift f $e:expr) => { lift_float::<I>($e) };
    (@lift o $e:expr) => { $e.map(lift_float::<I>) };
    (@lift p $e:expr) => { $e };
    (@lower f $e:expr) => { lower_float::<I>($e) };
    (@lower o $e:expr) => { $e.map(lower_float::<I>) };
    (@lower p $e:expr) => { $e };
}

convert_struct!(Conv2dBackward { f x_grad, f weights_grad, o bias_grad });
convert_struct!(Conv3dBackward { f x_grad, f weights_grad, o bias_grad });
convert_struct!(DeformConv2dBackward {
    f x_grad, f offset_grad, f weight_grad, o mask_grad, o bias_grad
});
convert_struct!(MaxPool1dBackward { f x_grad });
convert_struct!(MaxPool2dBackward { f x_grad });
convert_struct!(MaxPool1dWithIndices { f output, p indices });
convert_struct!(MaxPool2dWithIndices { f output, p indices });
convert_struct!(InterpolateBackward { f x_grad });
convert_struct!(QuantizationParametersPrimitive { f scales });

impl<I: Backend> Lower<I> for TransactionPrimitive<Stoke<I>> {
    type Inner = TransactionPrimitive<I>;
    fn lower(self) -> Self::Inner {
        // The read order is kept by the caller (`execute_async`), not by the primitive.
        TransactionPrimitive::new(
            self.read_floats.into_iter().map(lower_float::<I>).collect(),
            self.read_qfloats,
            self.read_ints,
            self.read_bools,
        )
    }
}

impl<I: Backend> Lower<I> for TensorPrimitive<Stoke<I>> {
    type Inner = TensorPrimitive<I>;
    fn lower(self) -> Self::Inner {
        match self {
            TensorPrimitive::Float(t) => TensorPrimitive::Float(lower_float::<I>(t)),
            TensorPrimitive::QFloat(q) => TensorPrimitive::QFloat(q),
        }
    }
}

impl<I: Backend> Lift<I> for TensorPrimitive<I> {
    type Outer = TensorPrimitive<Stoke<I>>;
    fn lift(self) -> Self::Outer {
        match self {
            TensorPrimitive::Float(t) => TensorPrimitive::Float(lift_float::<I>(t)),
            TensorPrimitive::QFloat(q) => TensorPrimitive::QFloat(q),
        }
    }
}
