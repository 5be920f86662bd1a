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
    home: Home,
}

/// Where a [`DeviceBuffer`] goes when dropped.
enum Home {
    /// The runtime's pool ([`Runtime::alloc`]).
    Pool,
    /// Freed, stream-ordered ([`Runtime::alloc_unpooled`]).
    Free,
    /// Back to the arena it came from (allocated while a graph was captured into it).
    Arena(Arc<GraphArena>),
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
        match &self.home {
            Home::Pool => self.rt.release(self.ptr, self.bytes),
            Home::Free => self.rt.free(self.ptr),
            Home::Arena(arena) => arena.release(self.ptr, self.bytes),
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
        let arena = self.arena.lock().unwrap().clone();
        if let Some(arena) = arena {
            let ptr = arena.take(self, size)?;
            return Ok(DeviceBuffer {
                ptr,
                bytes,
                rt: self.clone(),
                home: Home::Arena(arena),
            });
        }
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
            home: Home::Pool,
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
            home: Home::Free,
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

    /// The device's free and total memory in bytes (`cuMemGetInfo`).
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two integers.
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }
            .result()
            .call("cuMemGetInfo")?;
        Ok((free, total))
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
        self.host_syncs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
        self.host_syncs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
    /// (the split-K GEMMs put back zeros where they summed). Grown stream-ordered; an outgrown
    /// scratch is never freed, so an address a CUDA graph holds stays valid.
    pub fn zeroed_scratch(&self, bytes: usize) -> Result<u64> {
        let mut z = self.zeroed.lock().unwrap();
        if z.1 < bytes {
            self.bind()?;
            let size = bytes.next_power_of_two().max(1 << 16);
            if z.0 != 0 {
                // Not freed: a captured graph may have the old address baked in. Kept until
                // the runtime is dropped (the scratch grows a few times per process at most).
                self.retired.lock().unwrap().push(z.0);
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

/// Device memory owned by CUDA graphs: every buffer allocated while a graph is captured into
/// the arena ([`Runtime::capture_into`]) comes from here and returns here when dropped, so an
/// address baked into a graph is never handed to a tensor outside it. The memory goes back to
/// the driver when the arena (held by its graphs and by its live buffers) is dropped.
pub struct GraphArena {
    rt: std::sync::Weak<Runtime>,
    /// Every block the arena allocated: (pointer, bytes).
    blocks: std::sync::Mutex<Vec<(sys::CUdeviceptr, usize)>>,
    /// Dropped buffers by size class, reused by the next capture into this arena.
    free: std::sync::Mutex<std::collections::HashMap<usize, Vec<sys::CUdeviceptr>>>,
}

impl GraphArena {
    pub fn new(rt: &Arc<Runtime>) -> Arc<Self> {
        Arc::new(Self {
            rt: Arc::downgrade(rt),
            blocks: Default::default(),
            free: Default::default(),
        })
    }

    /// Bytes the arena holds.
    pub fn bytes(&self) -> usize {
        self.blocks.lock().unwrap().iter().map(|b| b.1).sum()
    }

    fn take(&self, rt: &Runtime, size: usize) -> Result<sys::CUdeviceptr> {
        if let Some(ptr) = self
            .free
            .lock()
            .unwrap()
            .get_mut(&size)
            .and_then(|v| v.pop())
        {
            return Ok(ptr);
        }
        rt.bind()?;
        // Not stream-ordered: the allocation outlives the capture and belongs to no graph node.
        // SAFETY: a plain device allocation, freed in `drop`.
        let ptr = unsafe { result::malloc_sync(size) }.call("cuMemAlloc")?;
        self.blocks.lock().unwrap().push((ptr, size));
        Ok(ptr)
    }

    fn release(&self, ptr: sys::CUdeviceptr, bytes: usize) {
        self.free
            .lock()
            .unwrap()
            .entry(pool_size(bytes))
            .or_default()
            .push(ptr);
    }
}

impl Drop for GraphArena {
    fn drop(&mut self) {
        let Some(rt) = self.rt.upgrade() else {
            return;
        };
        // A replay still queued may use the memory: wait for it before freeing.
        if let Err(e) = rt.synchronize() {
            tracing::error!("stoke: graph arena: {e}; its memory is not freed");
            return;
        }
        for (ptr, _) in self.blocks.lock().unwrap().drain(..) {
            // SAFETY: allocated by `take`; the stream is idle and no buffer of the arena lives
            // (each holds the arena).
            if let Err(e) = unsafe { result::free_sync(ptr) } {
                tracing::error!("cuMemFree failed for {ptr:#x}: {e}");
            }
        }
    }
}

impl std::fmt::Debug for GraphArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphArena({} bytes)", self.bytes())
    }
}
