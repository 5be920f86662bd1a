//! Device memory: [`Runtime::alloc`] and its pool of dropped buffers, [`DeviceBuffer`], the
//! shared zeroed scratch, and copies and fills on Stoke's stream.

use super::Runtime;
use crate::{DriverContext, Result};
use cudarc::driver::{result, sys};
use std::sync::Arc;

/// Device memory owned by Stoke, used only on Stoke's stream. Dropping it returns it to the
/// runtime's pool (or frees it, stream-ordered), so any kernel queued before has finished with
/// it by the time a new owner's work runs.
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    rt: Arc<Runtime>,
    /// Returned to the pool when dropped (else freed: [`Runtime::alloc_unpooled`]).
    pooled: bool,
}

impl DeviceBuffer {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// The buffer as `T`s a kernel reads.
    pub fn as_ptr<T>(&self) -> crate::DevicePtr<T> {
        crate::DevicePtr::new(self.ptr)
    }
    /// The buffer as `T`s a kernel writes.
    pub fn as_mut_ptr<T>(&self) -> crate::DevicePtrMut<T> {
        crate::DevicePtrMut::new(self.ptr)
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.rt
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceBuffer({:#x}, {} bytes, GPU {})",
            self.ptr, self.bytes, self.rt.ordinal
        )
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.pooled {
            self.rt.release(self.ptr, self.bytes);
        } else {
            self.rt.free(self.ptr);
        }
    }
}

/// Most bytes the buffer pool keeps for reuse; beyond it dropped buffers are freed.
const POOL_LIMIT_BYTES: usize = 2 << 30;

/// Pool size class of a request: whole 512-byte units (and at least one), so buffers of one
/// tensor shape always share a class.
fn pool_size(bytes: usize) -> usize {
    bytes.max(1).div_ceil(512) * 512
}

impl Runtime {
    /// Allocates `bytes` on Stoke's stream: from the pool of buffers Stoke dropped earlier, or
    /// stream-ordered from the driver's pool (`cuMemAllocAsync`).
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<DeviceBuffer> {
        let size = pool_size(bytes);
        let reused = self
            .pool
            .lock()
            .unwrap()
            .get_mut(&size)
            .and_then(|v| v.pop());
        let ptr = match reused {
            Some(ptr) => {
                self.pooled_bytes
                    .fetch_sub(size, std::sync::atomic::Ordering::Relaxed);
                ptr
            }
            None => {
                self.bind()?;
                // SAFETY: stream-ordered allocation on a live stream; freed on the same stream.
                unsafe { result::malloc_async(self.cu_stream(), size) }.call("cuMemAllocAsync")?
            }
        };
        let buf = DeviceBuffer {
            ptr,
            bytes,
            rt: self.clone(),
            pooled: true,
        };
        if self.poison.load(std::sync::atomic::Ordering::Relaxed) {
            // SAFETY: the buffer holds at least `bytes` bytes.
            unsafe { self.fill_bytes(ptr, 0xFF, bytes) }?;
        }
        Ok(buf)
    }

    /// Device memory for a short while (stream-ordered, not poisoned): freed when dropped, not
    /// kept in the pool (a large one-off buffer would hold its memory there).
    pub fn alloc_unpooled(self: &Arc<Self>, bytes: usize) -> Result<DeviceBuffer> {
        self.bind()?;
        // SAFETY: stream-ordered allocation on a live stream; freed on the same stream.
        let ptr = unsafe { result::malloc_async(self.cu_stream(), bytes.max(1)) }
            .call("cuMemAllocAsync")?;
        Ok(DeviceBuffer {
            ptr,
            bytes,
            rt: self.clone(),
            pooled: false,
        })
    }

    /// Takes back a dropped buffer: pooled while the pool is under its limit, else freed.
    fn release(&self, ptr: sys::CUdeviceptr, bytes: usize) {
        let size = pool_size(bytes);
        let pooled = self.pooled_bytes.load(std::sync::atomic::Ordering::Relaxed);
        if pooled + size <= POOL_LIMIT_BYTES {
            self.pooled_bytes
                .fetch_add(size, std::sync::atomic::Ordering::Relaxed);
            self.pool.lock().unwrap().entry(size).or_default().push(ptr);
            return;
        }
        self.free(ptr);
    }

    /// Frees a buffer allocated on Stoke's stream (by `alloc` or `alloc_unpooled`), stream-ordered:
    /// the free waits for every kernel queued before it.
    fn free(&self, ptr: sys::CUdeviceptr) {
        let _ = self.bind();
        // SAFETY: allocated on this stream and owned by no one now.
        if let Err(e) = unsafe { result::free_async(ptr, self.cu_stream()) } {
            tracing::error!("cuMemFreeAsync failed for {ptr:#x}: {e}");
        }
    }

    /// Returns every pooled buffer to the driver.
    pub fn release_pool(&self) -> Result<()> {
        let drained: Vec<_> = self
            .pool
            .lock()
            .unwrap()
            .drain()
            .flat_map(|(_, v)| v)
            .collect();
        self.pooled_bytes
            .store(0, std::sync::atomic::Ordering::Relaxed);
        self.bind()?;
        for ptr in drained {
            // SAFETY: pooled buffers are owned by no one; the free is ordered after their uses.
            unsafe { result::free_async(ptr, self.cu_stream()) }.call("cuMemFreeAsync")?;
        }
        Ok(())
    }

    /// Queues a device-to-device copy on Stoke's stream.
    ///
    /// # Safety
    /// Both ranges must be valid device memory for the duration of the copy.
    pub unsafe fn copy_dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: guaranteed by the caller.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.cu_stream()) }
            .call("cuMemcpyDtoDAsync")
    }

    /// Copies `src` to the host after Stoke's queued work, and waits for it.
    ///
    /// # Safety
    /// `src` must be valid device memory of at least `dst.len()` bytes.
    pub unsafe fn copy_dtoh(&self, dst: &mut [u8], src: u64) -> Result<()> {
        self.bind()?;
        // SAFETY: guaranteed by the caller; the synchronize below completes the copy before
        // `dst` can be touched again.
        unsafe { result::memcpy_dtoh_async(dst, src, self.cu_stream()) }
            .call("cuMemcpyDtoHAsync")?;
        self.stream.synchronize().call("cuStreamSynchronize")
    }

    /// Copies host bytes into device memory and waits for it.
    ///
    /// # Safety
    /// `dst` must be valid device memory of at least `src.len()` bytes.
    pub unsafe fn copy_htod(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: guaranteed by the caller; synchronized before `src` may be freed.
        unsafe { result::memcpy_htod_async(dst, src, self.cu_stream()) }
            .call("cuMemcpyHtoDAsync")?;
        self.stream.synchronize().call("cuStreamSynchronize")
    }

    /// Fills `bytes` bytes at `dst` with `value` on Stoke's stream (tests poison outputs).
    ///
    /// # Safety
    /// `dst` must be valid device memory of at least `bytes` bytes.
    pub unsafe fn fill_bytes(&self, dst: u64, value: u8, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: guaranteed by the caller.
        unsafe { result::memset_d8_async(dst, value, bytes, self.cu_stream()) }
            .call("cuMemsetD8Async")
    }

    /// At least `bytes` of device memory that is all zeros for the next kernel queued on Stoke's
    /// stream, shared by every user of the runtime: a kernel that uses it must leave it zeroed
    /// (the split-K GEMMs put back zeros where they summed). Grown stream-ordered.
    pub fn zeroed_scratch(&self, bytes: usize) -> Result<u64> {
        let mut z = self.zeroed.lock().unwrap();
        if z.1 < bytes {
            self.bind()?;
            let size = bytes.next_power_of_two().max(1 << 16);
            if z.0 != 0 {
                // SAFETY: allocated below on this stream; the free waits for queued users.
                unsafe { result::free_async(z.0, self.cu_stream()) }.call("cuMemFreeAsync")?;
                *z = (0, 0);
            }
            // SAFETY: stream-ordered allocation, zeroed on the same stream before any use.
            let ptr =
                unsafe { result::malloc_async(self.cu_stream(), size) }.call("cuMemAllocAsync")?;
            // SAFETY: `ptr` holds `size` bytes.
            unsafe { result::memset_d8_async(ptr, 0, size, self.cu_stream()) }
                .call("cuMemsetD8Async")?;
            *z = (ptr, size);
        }
        Ok(z.0)
    }
}
