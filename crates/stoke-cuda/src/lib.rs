//! Stoke's CUDA runtime.
//!
//! - Runs in the device's primary context, the one burn-cuda (cubecl) uses, so device pointers
//!   pass freely between the two; Stoke's kernels run on a stream of Stoke's own.
//! - Loads the kernels under `kernels/` as cubins the build compiled for Hopper (`build.rs`,
//!   where NVRTC was found at build time); otherwise compiles them with NVRTC for the device's
//!   architecture at first use, and caches the cubin on disk keyed by source, options, arch and
//!   NVRTC version.
//! - Launches with one flat `#[repr(C)]` parameter struct per kernel, holding typed device
//!   pointers ([`DevicePtr`], [`DevicePtrMut`]); a [`Kernel`] is typed by its struct, so a
//!   launch with another struct does not compile.
//! - Holds what a queued kernel borrows from other owners (burn-cuda buffers) until an event
//!   says the kernel finished, so the owner can't reuse the memory under it.
//!
//! Every CUDA call's status is checked and returned as [`Error`].

pub mod bf16;
pub mod compile;
mod cubin;
pub mod int4;
pub mod kernels;
pub mod kv;
pub mod prefill_gemm;
mod ptr;
mod runtime;
pub mod sample;

pub use compile::{CompileReport, CubinOrigin, built_archs, compile_cubin, nvrtc_version};
pub use cudarc::driver::{CudaEvent, CudaGraph};
pub use ptr::{DevicePtr, DevicePtrMut};
pub use runtime::{
    DeviceBuffer, GraphArena, Kernel, KernelInfo, LaunchShape, MAX_CLUSTER_CTAS, PinnedHost,
    Preloaded, Runtime, TensorMap, Unavailable,
};

use cudarc::driver::DriverError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("CUDA driver call `{call}` failed: {source}")]
    Driver {
        call: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("NVRTC could not compile kernels/{file} for {arch}:\n{log}")]
    Compile {
        file: String,
        arch: String,
        log: String,
    },
    #[error("NVRTC is not available: {0}")]
    NvrtcMissing(String),
    #[error("kernel `{entry}` not found in kernels/{file}")]
    MissingEntry { file: String, entry: String },
    #[error("kernel `{entry}` in kernels/{file} cannot launch: {reason}")]
    KernelResources {
        file: String,
        entry: String,
        reason: String,
    },
    #[error("{0}")]
    Shape(#[from] ShapeError),
    #[error(
        "a strict graph capture crossed between burn-cuda and Stoke (burn-cuda's work is not in the graph): {}",
        ops.join("; ")
    )]
    Crossing { ops: Vec<String> },
    #[error("kernel cache at {path}: {source}")]
    Cache {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, Error>;

/// A shape, size or layout a kernel cannot take: what was checked, what it must be, and what
/// it is.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what}: expected {expected}, got {got}")]
pub struct ShapeError {
    pub what: String,
    pub expected: String,
    pub got: String,
}

impl ShapeError {
    pub fn new(
        what: impl Into<String>,
        expected: impl Into<String>,
        got: impl Into<String>,
    ) -> Self {
        Self {
            what: what.into(),
            expected: expected.into(),
            got: got.into(),
        }
    }
}

/// Attaches the failing call's name to a driver error.
pub(crate) trait DriverContext<T> {
    fn call(self, call: &'static str) -> Result<T>;
}

impl<T> DriverContext<T> for std::result::Result<T, DriverError> {
    fn call(self, call: &'static str) -> Result<T> {
        self.map_err(|source| Error::Driver { call, source })
    }
}

/// The first error of driver queries made from a yes/no predicate (the launch planners ask the
/// driver lazily, inside search loops that take plain `bool`s): each failed query answers no and
/// is kept if it is the first; [`FirstError::finish`] returns it in place of the search's result.
#[derive(Default)]
pub(crate) struct FirstError(std::cell::RefCell<Option<Error>>);

impl FirstError {
    /// `query`'s answer, or `false` (keeping its error) when it fails or an earlier one did.
    pub(crate) fn ask(&self, query: impl FnOnce() -> Result<bool>) -> bool {
        if self.0.borrow().is_some() {
            return false;
        }
        query().unwrap_or_else(|e| {
            self.0.borrow_mut().get_or_insert(e);
            false
        })
    }

    /// `value`, or the first error a query returned.
    pub(crate) fn finish<T>(self, value: T) -> Result<T> {
        self.0.into_inner().map_or(Ok(value), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_error_keeps_the_first_failure_and_stops_asking() {
        let err = FirstError::default();
        assert!(err.ask(|| Ok(true)));
        assert!(!err.ask(|| Ok(false)));
        assert!(!err.ask(|| Err(Error::Shape(ShapeError::new("first", "x", "y")))));
        assert!(!err.ask(|| panic!("not asked after a failure")));
        match err.finish(7) {
            Err(Error::Shape(m)) => assert_eq!(m.what, "first"),
            other => panic!("expected the first error, got {other:?}"),
        }
        assert_eq!(FirstError::default().finish(7).unwrap(), 7);
    }
}
