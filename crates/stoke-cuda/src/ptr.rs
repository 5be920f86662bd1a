//! Typed device addresses: what the kernels' `#[repr(C)]` parameter structs hold instead of bare
//! `u64`s, so a params struct says what each pointer points at and whether the kernel writes
//! through it, and a buffer of one element type cannot be put where another is expected.
//!
//! Both types are `#[repr(transparent)]` over the 64-bit address, so a params struct keeps the
//! layout of its `.cu` mirror (its tests assert the offsets). Making one from an address is the
//! trust boundary ([`DevicePtr::new`]): the launch that passes it to a kernel is `unsafe`, and
//! its caller guarantees the memory behind it.

use std::fmt;
use std::marker::PhantomData;

/// The address of device memory holding `T`s that a kernel reads (null: none, where the kernel
/// takes an optional input).
#[repr(transparent)]
pub struct DevicePtr<T> {
    addr: u64,
    _elem: PhantomData<fn() -> T>,
}

/// The address of device memory holding `T`s that a kernel writes (and may read).
#[repr(transparent)]
pub struct DevicePtrMut<T> {
    addr: u64,
    _elem: PhantomData<fn() -> T>,
}

macro_rules! device_ptr_common {
    ($ty:ident, $what:literal) => {
        impl<T> $ty<T> {
            /// The null address: no buffer.
            pub const NULL: Self = Self::new(0);

            #[doc = concat!("A ", $what, " at device address `addr`.")]
            pub const fn new(addr: u64) -> Self {
                Self {
                    addr,
                    _elem: PhantomData,
                }
            }

            /// The device address.
            pub const fn addr(self) -> u64 {
                self.addr
            }

            pub const fn is_null(self) -> bool {
                self.addr == 0
            }

            /// The address `count` elements on (the same null stays null only at count 0).
            pub const fn add(self, count: usize) -> Self {
                Self::new(self.addr + (count * std::mem::size_of::<T>()) as u64)
            }
        }

        impl<T> Clone for $ty<T> {
            fn clone(&self) -> Self {
                *self
            }
        }
        impl<T> Copy for $ty<T> {}
        impl<T> Default for $ty<T> {
            fn default() -> Self {
                Self::NULL
            }
        }
        impl<T> PartialEq for $ty<T> {
            fn eq(&self, other: &Self) -> bool {
                self.addr == other.addr
            }
        }
        impl<T> Eq for $ty<T> {}
        impl<T> fmt::Debug for $ty<T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    f,
                    "{}<{}>({:#x})",
                    stringify!($ty),
                    std::any::type_name::<T>(),
                    self.addr
                )
            }
        }
    };
}

device_ptr_common!(DevicePtr, "read-only pointer");
device_ptr_common!(DevicePtrMut, "writable pointer");

impl<T> DevicePtrMut<T> {
    /// The same memory, read-only (an output one kernel writes and the next reads).
    pub const fn as_const(self) -> DevicePtr<T> {
        DevicePtr::new(self.addr)
    }
}

impl<T> From<DevicePtrMut<T>> for DevicePtr<T> {
    fn from(p: DevicePtrMut<T>) -> Self {
        p.as_const()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transparent_over_the_address() {
        assert_eq!(std::mem::size_of::<DevicePtr<half::bf16>>(), 8);
        assert_eq!(std::mem::align_of::<DevicePtrMut<f32>>(), 8);
        let p = DevicePtrMut::<f32>::new(0x1000);
        assert_eq!(p.add(3).addr(), 0x100c);
        assert_eq!(DevicePtr::from(p).addr(), 0x1000);
        assert!(DevicePtr::<u32>::default().is_null());
        assert_eq!(
            format!("{:?}", DevicePtr::<u16>::new(16)),
            "DevicePtr<u16>(0x10)"
        );
    }
}
