//! Stream order: CUDA graph capture of Stoke's stream, [`Runtime::synchronize`] and events.

use super::Runtime;
use crate::{DriverContext, Error, Result};
use cudarc::driver::{CudaEvent, sys};

impl Runtime {
    /// Captures the work `body` queues on Stoke's stream into a CUDA graph.
    pub fn capture(&self, body: impl FnOnce() -> Result<()>) -> Result<cudarc::driver::CudaGraph> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .call("cuStreamBeginCapture")?;
        let queued = body();
        let graph = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .call("cuStreamEndCapture")?;
        queued?;
        graph.ok_or(Error::Driver {
            call: "cuStreamEndCapture",
            source: cudarc::driver::DriverError(
                sys::cudaError_enum::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
            ),
        })
    }

    /// Whether Stoke's stream is capturing a CUDA graph now (work queued is recorded, not run).
    pub fn is_capturing(&self) -> Result<bool> {
        let status = self.stream.capture_status().call("cuStreamIsCapturing")?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Waits for all of Stoke's work on this device and releases held allocations.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().call("cuStreamSynchronize")?;
        self.in_flight.lock().unwrap().clear();
        Ok(())
    }

    /// Creates a timing event (the W4A16 tuner and the benchmarks time kernels with it).
    pub fn timing_event(&self) -> Result<CudaEvent> {
        self.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .call("cuEventCreate")
    }

    /// Records `event` on Stoke's stream.
    pub fn record(&self, event: &CudaEvent) -> Result<()> {
        event.record(&self.stream).call("cuEventRecord")
    }
}
