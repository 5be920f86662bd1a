//! Stream order: CUDA graph capture of Stoke's stream, [`Runtime::synchronize`] and events.

use super::{GraphArena, Runtime};
use crate::{DriverContext, Error, Result};
use cudarc::driver::{CudaEvent, sys};
use std::sync::Arc;
use std::sync::atomic::Ordering;

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

    /// [`Runtime::capture`] for a step that is replayed while other work runs between its
    /// replays: every buffer allocated during the capture comes from `arena` (and goes back to
    /// it), so no address baked into the graph is reused outside it. Strict: a crossing between
    /// burn-cuda and Stoke during the capture ([`Runtime::note_crossing`]) fails it with
    /// [`Error::Crossing`] naming each one, since burn-cuda's work is not on Stoke's stream and
    /// would not be in the graph.
    pub fn capture_into(
        &self,
        arena: &Arc<GraphArena>,
        body: impl FnOnce() -> Result<()>,
    ) -> Result<cudarc::driver::CudaGraph> {
        *self.arena.lock().unwrap() = Some(arena.clone());
        self.crossings.lock().unwrap().clear();
        self.strict.store(true, Ordering::SeqCst);
        let graph = self.capture(body);
        self.strict.store(false, Ordering::SeqCst);
        *self.arena.lock().unwrap() = None;
        let crossings = std::mem::take(&mut *self.crossings.lock().unwrap());
        if !crossings.is_empty() {
            return Err(Error::Crossing { ops: crossings });
        }
        graph
    }

    /// Reports a crossing between burn-cuda and Stoke (`what`: the op and tensor). Inside a
    /// strict capture it is recorded and fails the capture; otherwise it is only counted.
    pub fn note_crossing(&self, what: impl FnOnce() -> String) {
        self.crossings_total.fetch_add(1, Ordering::Relaxed);
        if self.strict.load(Ordering::SeqCst) {
            self.crossings.lock().unwrap().push(what());
        }
    }

    /// Whether a strict capture ([`Runtime::capture_into`]) is running.
    pub fn strict_capture(&self) -> bool {
        self.strict.load(Ordering::SeqCst)
    }

    /// Host synchronizations with Stoke's stream so far (waits for the stream, copies to and
    /// from the host) and crossings between burn-cuda and Stoke so far.
    pub fn counters(&self) -> (u64, u64) {
        (
            self.host_syncs.load(Ordering::Relaxed),
            self.crossings_total.load(Ordering::Relaxed),
        )
    }

    /// Whether Stoke's stream is capturing a CUDA graph now (work queued is recorded, not run).
    pub fn is_capturing(&self) -> Result<bool> {
        let status = self.stream.capture_status().call("cuStreamIsCapturing")?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Waits for all of Stoke's work on this device and releases held allocations.
    pub fn synchronize(&self) -> Result<()> {
        self.host_syncs.fetch_add(1, Ordering::Relaxed);
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

    /// Queues one replay of `graph` on Stoke's stream.
    pub fn replay(&self, graph: &cudarc::driver::CudaGraph) -> Result<()> {
        self.bind()?;
        graph.launch().call("cuGraphLaunch")
    }

    /// Queues a copy of `bytes` device bytes to page-locked host memory on Stoke's stream and
    /// returns at once; the host reads `dst` after `event` (recorded after the copy) completes.
    ///
    /// # Safety
    /// `src` holds `bytes` bytes and `dst` is page-locked host memory of `bytes` bytes that
    /// nothing reads or frees before the event completes.
    pub unsafe fn copy_dtoh_async(
        &self,
        dst: *mut u8,
        src: u64,
        bytes: usize,
        event: &CudaEvent,
    ) -> Result<()> {
        self.bind()?;
        // SAFETY: guaranteed by the caller.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, self.cu_stream()) }
            .result()
            .call("cuMemcpyDtoHAsync")?;
        self.record(event)
    }

    /// Queues a copy of `src` into device memory at `dst` on Stoke's stream and returns at once:
    /// the bytes go through a page-locked staging buffer (reused once the copy that last used
    /// it has completed), so the copy lands after the work queued before it and before the
    /// work queued after it, with no host synchronization. Not for use while capturing.
    ///
    /// # Safety
    /// `dst` must be valid device memory of at least `src.len()` bytes until the copy is done.
    pub unsafe fn copy_htod_async(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let mut staging = self.staging.lock().unwrap();
        let free = staging
            .iter()
            .position(|(e, h)| h.bytes >= src.len() && e.is_complete());
        let (event, host) = match free {
            Some(i) => staging.swap_remove(i),
            None => (
                self.ctx.new_event(None).call("cuEventCreate")?,
                self.pinned_host(src.len().next_power_of_two().max(4096))?,
            ),
        };
        // SAFETY: `host` holds at least `src.len()` bytes and no copy reads it (its last
        // copy's event completed, or it is new).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), host.as_mut_ptr(), src.len()) };
        // SAFETY: `dst` is the caller's; `host` stays alive (in `staging`) until the event
        // recorded after the copy completes.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, host.as_mut_ptr().cast(), src.len(), self.cu_stream())
        }
        .result()
        .call("cuMemcpyHtoDAsync")?;
        event.record(&self.stream).call("cuEventRecord")?;
        staging.push((event, host));
        // Buffers beyond a few dozen are not kept: the oldest finished ones go.
        while staging.len() > 64 {
            match staging.iter().position(|(e, _)| e.is_complete()) {
                Some(i) => drop(staging.remove(i)),
                None => break,
            }
        }
        Ok(())
    }

    /// Page-locked host memory of `bytes` bytes (for [`Runtime::copy_dtoh_async`]).
    pub fn pinned_host(&self, bytes: usize) -> Result<PinnedHost> {
        self.bind()?;
        let mut ptr = std::ptr::null_mut();
        // SAFETY: allocates; freed by `PinnedHost::drop`.
        unsafe { sys::cuMemAllocHost_v2(&mut ptr, bytes.max(1)) }
            .result()
            .call("cuMemAllocHost")?;
        Ok(PinnedHost {
            ptr: ptr.cast(),
            bytes,
        })
    }
}

/// Page-locked host memory ([`Runtime::pinned_host`]).
pub struct PinnedHost {
    ptr: *mut u8,
    bytes: usize,
}

// SAFETY: plain host memory; access is through `&self` / `&mut self`.
unsafe impl Send for PinnedHost {}
unsafe impl Sync for PinnedHost {}

impl PinnedHost {
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }
    /// The bytes. Only read them after the event of the copy that wrote them completed.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` holds `bytes` bytes for the lifetime of self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAllocHost.
        let _ = unsafe { sys::cuMemFreeHost(self.ptr.cast()) };
    }
}
