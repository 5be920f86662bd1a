//! One [`Runtime`] per GPU: the context, Stoke's stream, loaded modules, owned buffers and the
//! list of borrowed allocations held until the kernels that read them have finished.

use crate::kernels::KernelSource;
use crate::{DriverContext, Error, Result, compile::CompileReport};
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, result, sys};
use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Why Stoke's kernels cannot run on a device; the caller falls back to the inner backend.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Unavailable {
    #[error("no CUDA driver (libcuda.so not found)")]
    NoDriver,
    #[error("NVRTC is not available: {0}")]
    NoNvrtc(String),
    #[error("CUDA device {ordinal} cannot be opened: {reason}")]
    NoDevice { ordinal: usize, reason: String },
    #[error("GPU {ordinal} ({name}) is sm_{major}{minor}; Stoke's kernels need Hopper (sm_90)")]
    Arch {
        ordinal: usize,
        name: String,
        major: i32,
        minor: i32,
    },
    #[error("Stoke's kernels are disabled by STOKE_DISABLE")]
    Disabled,
    #[error("the inner backend is not burn-cuda")]
    InnerBackend,
}

/// A compiled kernel entry point.
#[derive(Debug, Clone)]
pub struct Kernel {
    func: CudaFunction,
    pub entry: &'static str,
    /// The most threads per CTA the kernel launches with: its launch bounds, where it has them.
    pub max_threads: u32,
    /// Dynamic shared memory every launch of this kernel needs, in bytes: the value of the
    /// module's `u32` global `<entry>_dyn_smem` where the kernel defines one (its size then
    /// follows the kernel's compile-time knobs, which the host does not see), else 0.
    pub dyn_smem: u32,
    /// Launched with programmatic stream serialization (programmatic dependent launch): the
    /// module's `u32` global `<entry>_pdl` is nonzero. Such a kernel may start before the
    /// previous kernel on the stream has finished, and waits for it (griddepcontrol.wait)
    /// before it reads anything another kernel writes or writes anything itself.
    pub pdl: bool,
    /// The module's `u32` global `<entry>_cluster` is nonzero: the kernel's launches may form
    /// thread-block clusters ([`Runtime::launch_cluster`]), and it works either way.
    pub cluster: bool,
    /// The module's `u32` global `<entry>_early_trigger` is nonzero: the kernel lets the next
    /// kernel launch as soon as it starts (griddepcontrol.launch_dependents) while its few CTAs
    /// hold their SMs (the RMSNorm kernels). See [`Runtime::launch_cluster`] for what that
    /// means for a clustered kernel launched after it.
    pub early_trigger: bool,
}

/// Whether thread-block clusters of `cluster` CTAs tile `grid`: each dimension a positive
/// divisor of the grid's, and at most 8 CTAs in all (the portable cluster size).
pub fn cluster_tiles_grid(grid: (u32, u32, u32), cluster: (u32, u32, u32)) -> bool {
    let (x, y, z) = cluster;
    let ctas = u128::from(x) * u128::from(y) * u128::from(z);
    (1..=8).contains(&ctas)
        && grid.0.is_multiple_of(x)
        && grid.1.is_multiple_of(y)
        && grid.2.is_multiple_of(z)
}

/// Whether a grid of `grid` CTAs in clusters of `cluster` would not have all its clusters
/// resident at once beside `holding` CTAs of another kernel, each taking the place of one
/// cluster at most, where the GPU holds `most` such clusters at once
/// ([`Runtime::launch_cluster`]'s crowding rule).
pub fn crowded_clusters(
    grid: (u32, u32, u32),
    cluster: (u32, u32, u32),
    holding: u64,
    most: u32,
) -> bool {
    let per_cluster = u64::from(cluster.0) * u64::from(cluster.1) * u64::from(cluster.2);
    let ctas = u64::from(grid.0) * u64::from(grid.1) * u64::from(grid.2);
    ctas / per_cluster.max(1) + holding > u64::from(most)
}

/// A tensor map for the copy engine (the driver's opaque 128-byte `CUtensorMap`), passed to
/// kernels by value (`__grid_constant__`), 64-byte aligned as the kernels declare it.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub struct TensorMap(pub [u64; 16]);

/// The launch attribute that cuts a grid into clusters of `cluster` CTAs.
fn cluster_attribute((x, y, z): (u32, u32, u32)) -> sys::CUlaunchAttribute {
    // SAFETY: zero is a valid bit pattern for the attribute (a plain C union).
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = x;
    attr.value.clusterDim.y = y;
    attr.value.clusterDim.z = z;
    attr
}

/// Grid, block and dynamic shared memory of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchShape {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

/// The shape of an RMSNorm launch rule's launch (the rule itself depends on nothing but `std`).
impl From<crate::kernels::rms_norm::Launch> for LaunchShape {
    fn from(l: crate::kernels::rms_norm::Launch) -> Self {
        LaunchShape {
            grid: l.grid,
            block: l.block,
            shared_mem_bytes: l.shared_mem_bytes,
        }
    }
}

/// The `__device__` global `name` of `module` (its address and size; looking it up queues nothing
/// on `stream`), or `None` where the module defines no such global.
fn module_symbol<'a>(
    module: &'a Arc<CudaModule>,
    name: &str,
    stream: &'a Arc<CudaStream>,
) -> Result<Option<cudarc::driver::CudaViewMut<'a, u8>>> {
    match module.get_global(name, stream) {
        Ok(sym) => Ok(Some(sym)),
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_FOUND => Ok(None),
        Err(e) => Err(e).call("cuModuleGetGlobal"),
    }
}

pub struct Runtime {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pub ordinal: usize,
    pub name: String,
    /// NVRTC architecture, e.g. `sm_90a`.
    pub arch: String,
    pub sm_count: u32,
    /// Most shared memory one CTA may use (dynamic included), in bytes.
    pub shared_optin: u32,
    modules: Mutex<HashMap<&'static str, (Arc<CudaModule>, Vec<CompileReport>)>>,
    functions: Mutex<HashMap<(&'static str, &'static str), Kernel>>,
    /// Preprocessor defines (`NAME=VALUE`) a kernel file is compiled with: none by default;
    /// benchmarks set them to time kernel variants (`set_defines`).
    defines: Mutex<HashMap<&'static str, Vec<String>>>,
    /// Bumped by every `set_defines` ([`Runtime::defines_epoch`]).
    defines_epoch: std::sync::atomic::AtomicU64,
    /// Resident CTAs per SM by (entry point, threads per CTA), from the occupancy calculator.
    occupancy: Mutex<HashMap<(&'static str, u32), u32>>,
    /// Clusters resident at once by (entry point, threads per CTA, cluster (x, y, z)).
    cluster_occupancy: Mutex<HashMap<(&'static str, u32, (u32, u32, u32)), u32>>,
    /// Borrowed allocations kept alive until the event after their last use completes.
    in_flight: Mutex<VecDeque<(CudaEvent, Box<dyn Any + Send>)>>,
    /// Buffers returned by dropped `DeviceBuffer`s, by size, for reuse without a driver call.
    /// Reuse is safe because every use of a Stoke buffer is on Stoke's one stream: a new owner's
    /// work is queued after the old owner's.
    pool: Mutex<HashMap<usize, Vec<sys::CUdeviceptr>>>,
    pooled_bytes: std::sync::atomic::AtomicUsize,
    /// Tests set this so every new buffer starts as 0xFF bytes (NaN in f32 and bf16): an
    /// element a kernel forgets to write shows up as NaN.
    poison: std::sync::atomic::AtomicBool,
    /// CTAs of the last kernel launched on the stream where it lets its dependents launch
    /// early ([`Kernel::early_trigger`]), else 0.
    after_early_trigger: std::sync::atomic::AtomicU64,
    /// Programmatic launches made ordinary by [`Runtime::launch_cluster`]'s crowding rule.
    pdl_held: std::sync::atomic::AtomicU64,
    /// Zero-filled scratch that kernels leave zeroed (split-K partial sums and arrival
    /// counters): (pointer, bytes). Grown on demand; never poisoned.
    zeroed: Mutex<(sys::CUdeviceptr, usize)>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stoke runtime on GPU {} ({}, {})",
            self.ordinal, self.name, self.arch
        )
    }
}

impl Runtime {
    /// Opens GPU `ordinal` in its primary context, or says why Stoke can't use it.
    pub fn new(ordinal: usize) -> std::result::Result<Arc<Self>, Unavailable> {
        if std::env::var_os("STOKE_DISABLE").is_some_and(|v| !v.is_empty() && v != "0") {
            return Err(Unavailable::Disabled);
        }
        // SAFETY: only probes whether the shared library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(Unavailable::NoDriver);
        }
        crate::compile::nvrtc_version().map_err(|e| Unavailable::NoNvrtc(e.to_string()))?;
        let no_device = |e: cudarc::driver::DriverError| Unavailable::NoDevice {
            ordinal,
            reason: e.to_string(),
        };
        let ctx = CudaContext::new(ordinal).map_err(no_device)?;
        let (major, minor) = ctx.compute_capability().map_err(no_device)?;
        let name = ctx.name().map_err(no_device)?;
        if major != 9 {
            return Err(Unavailable::Arch {
                ordinal,
                name,
                major,
                minor,
            });
        }
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(no_device)? as u32;
        let shared_optin = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(no_device)? as u32;
        // SAFETY: Stoke synchronizes its own buffers explicitly (one stream, events for
        // borrowed memory); cudarc's per-slice event tracking would only add launches.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(no_device)?;
        Ok(Arc::new(Self {
            ctx,
            stream,
            ordinal,
            name,
            arch: "sm_90a".to_string(),
            sm_count,
            shared_optin,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            defines: Mutex::new(HashMap::new()),
            defines_epoch: Default::default(),
            occupancy: Mutex::new(HashMap::new()),
            cluster_occupancy: Mutex::new(HashMap::new()),
            in_flight: Mutex::new(VecDeque::new()),
            poison: Default::default(),
            after_early_trigger: Default::default(),
            pdl_held: Default::default(),
            pool: Mutex::new(HashMap::new()),
            pooled_bytes: Default::default(),
            zeroed: Mutex::new((0, 0)),
        }))
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().call("cuCtxSetCurrent")
    }

    /// The raw stream handle Stoke's kernels run on.
    pub fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    /// Loads (compiling on first use, through the disk cache) one kernel entry point.
    pub fn kernel(&self, src: &KernelSource, entry: &'static str) -> Result<Kernel> {
        if let Some(k) = self.functions.lock().unwrap().get(&(src.file, entry)) {
            return Ok(k.clone());
        }
        let mut modules = self.modules.lock().unwrap();
        if !modules.contains_key(src.file) {
            let t0 = std::time::Instant::now();
            let defines = (self.defines.lock().unwrap().get(src.file))
                .map(|d| crate::compile::define_options(d))
                .unwrap_or_default();
            let options: Vec<&str> = defines.iter().map(String::as_str).collect();
            let (cubin, report, cached) =
                crate::compile_cubin(src.file, src.source, &self.arch, &options)?;
            self.bind()?;
            let module = self
                .ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                .call("cuModuleLoadData")?;
            tracing::debug!(
                "loaded kernels/{} for {} in {:?}{}",
                src.file,
                self.arch,
                t0.elapsed(),
                if cached { " (disk cache)" } else { "" }
            );
            modules.insert(src.file, (module, report));
        }
        let (module, _) = &modules[src.file];
        let func = module
            .load_function(entry)
            .map_err(|_| Error::MissingEntry {
                file: src.file.to_string(),
                entry: entry.to_string(),
            })?;
        // Kernels may ask for dynamic shared memory up to the device's opt-in limit, less
        // their static shared memory.
        let static_bytes = func
            .get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            .call("cuFuncGetAttribute")?;
        func.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            (self.shared_optin as i32 - static_bytes).max(0),
        )
        .call("cuFuncSetAttribute")?;
        let max_threads = func
            .get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
            .call("cuFuncGetAttribute")? as u32;
        // The lookups queue nothing on the stream they are given; a value is read on a
        // short-lived stream of its own (non-blocking), made only for kernels that export one,
        // so that loading an entry point while Stoke's stream is being captured into a graph
        // adds nothing to the graph.
        let global_u32 = |name: String| -> Result<Option<u32>> {
            match module_symbol(module, &name, &self.stream)? {
                Some(sym) if sym.len() == 4 => {
                    let side = self.ctx.new_stream().call("cuStreamCreate")?;
                    let bytes = side.clone_dtoh(&sym).call("cuMemcpyDtoH")?;
                    Ok(Some(u32::from_le_bytes([
                        bytes[0], bytes[1], bytes[2], bytes[3],
                    ])))
                }
                Some(sym) => Err(Error::KernelResources {
                    file: src.file.to_string(),
                    entry: entry.to_string(),
                    reason: format!("its {name} global is {} bytes, not a u32", sym.len()),
                }),
                None => Ok(None),
            }
        };
        let dyn_smem = global_u32(format!("{entry}_dyn_smem"))?.unwrap_or(0);
        let pdl = global_u32(format!("{entry}_pdl"))?.unwrap_or(0) != 0;
        let cluster = global_u32(format!("{entry}_cluster"))?.unwrap_or(0) != 0;
        let early_trigger = global_u32(format!("{entry}_early_trigger"))?.unwrap_or(0) != 0;
        if dyn_smem as i32 > self.shared_optin as i32 - static_bytes {
            return Err(Error::KernelResources {
                file: src.file.to_string(),
                entry: entry.to_string(),
                reason: format!(
                    "it needs {dyn_smem} bytes of dynamic shared memory beside {static_bytes} static; {} allows {} per CTA in all",
                    self.name, self.shared_optin
                ),
            });
        }
        if dyn_smem > 0 {
            // As much of the on-chip memory as shared memory as the driver allows: the kernels
            // that bring dynamic shared memory size their grids by resident CTAs (a hint, in
            // percent of the maximum).
            func.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                100,
            )
            .call("cuFuncSetAttribute")?;
        }
        let kernel = Kernel {
            func,
            entry,
            max_threads,
            dyn_smem,
            pdl,
            cluster,
            early_trigger,
        };
        self.functions
            .lock()
            .unwrap()
            .insert((src.file, entry), kernel.clone());
        Ok(kernel)
    }

    /// Launches `kernel` on Stoke's stream with `params` as its single by-value argument.
    ///
    /// # Safety
    /// `P` must be the `#[repr(C)]` mirror of the kernel's parameter struct, and every device
    /// pointer in it must stay valid until the kernel finishes (owned by a [`DeviceBuffer`] that
    /// is dropped only on this stream, or held with [`Runtime::hold_until_done`]).
    pub unsafe fn launch<P: Copy>(
        &self,
        kernel: &Kernel,
        shape: LaunchShape,
        params: &P,
    ) -> Result<()> {
        // SAFETY: the caller's guarantees, passed on.
        unsafe { self.launch_cluster(kernel, shape, None, params) }
    }

    /// [`Runtime::launch`] with the grid cut into thread-block clusters of `cluster` CTAs
    /// (each grid dimension a multiple of the cluster's; at most 8 CTAs, the portable size).
    /// `None`: an ordinary launch.
    ///
    /// A kernel with [`Kernel::pdl`] is launched programmatically (it may start while the
    /// previous kernel runs), except a clustered launch right after an early-triggering kernel
    /// ([`Kernel::early_trigger`]) of c CTAs whose clusters, c more, would not all be resident
    /// at once. Started early, such a grid finds a CTA slot taken on the SMs the previous
    /// kernel's CTAs still hold (one slot per CTA for the RMSNorm kernels at decode sizes:
    /// each uses fewer registers than one GEMM CTA), which costs at most one cluster each; when
    /// those CTAs end, the freed slots are scattered, one or two per processing cluster, too
    /// few for a whole cluster, so the clusters that did not fit wait for the first wave to
    /// finish. Measured
    /// (`results/experiments/h200-rms-gemm-pairs-dd16a4e.json`): 70B qkv at 16 rows, RMSNorm
    /// then the GEMM (3 splits in clusters of 3), 28.2 us programmatically against 21.3 us in
    /// stream order.
    ///
    /// # Safety
    /// As [`Runtime::launch`]; with a cluster, the kernel must be written for one.
    pub unsafe fn launch_cluster<P: Copy>(
        &self,
        kernel: &Kernel,
        shape: LaunchShape,
        cluster: Option<(u32, u32, u32)>,
        params: &P,
    ) -> Result<()> {
        self.bind()?;
        let mut p = *params;
        let mut args = [&mut p as *mut P as *mut c_void];
        if let Some((x, y, z)) = cluster
            && !cluster_tiles_grid(shape.grid, (x, y, z))
        {
            return Err(Error::Shape(format!(
                "{}: cluster ({x}, {y}, {z}) does not tile grid {:?} (at most 8 CTAs per cluster)",
                kernel.entry, shape.grid
            )));
        }
        let ctas = u64::from(shape.grid.0) * u64::from(shape.grid.1) * u64::from(shape.grid.2);
        let before = self.after_early_trigger.swap(
            if kernel.early_trigger { ctas } else { 0 },
            std::sync::atomic::Ordering::Relaxed,
        );
        let programmatic = kernel.pdl
            && !(before > 0
                && match cluster {
                    Some(c) => self.crowded(kernel, shape, c, before)?,
                    None => false,
                });
        if kernel.pdl && !programmatic {
            self.pdl_held
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if programmatic || cluster.is_some() {
            // SAFETY: zero is a valid bit pattern for the attributes (plain C unions).
            let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
            let mut n = 0;
            if programmatic {
                attrs[n].id =
                    sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attrs[n].value.programmaticStreamSerializationAllowed = 1;
                n += 1;
            }
            if let Some(c) = cluster {
                attrs[n] = cluster_attribute(c);
                n += 1;
            }
            let config = sys::CUlaunchConfig {
                gridDimX: shape.grid.0,
                gridDimY: shape.grid.1,
                gridDimZ: shape.grid.2,
                blockDimX: shape.block.0,
                blockDimY: shape.block.1,
                blockDimZ: shape.block.2,
                sharedMemBytes: shape.shared_mem_bytes,
                hStream: self.cu_stream(),
                attrs: attrs.as_mut_ptr(),
                numAttrs: n as u32,
            };
            // SAFETY: as below; the kernel waits for the previous one before it touches what
            // that one writes (Kernel::pdl), a clustered kernel is written for its cluster (the
            // caller), and the config and attributes outlive the call.
            return unsafe {
                sys::cuLaunchKernelEx(
                    &config,
                    kernel.func.cu_function(),
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
            .result()
            .call("cuLaunchKernelEx");
        }
        // SAFETY: the caller guarantees the parameter layout and pointer lifetimes; the driver
        // copies the argument block before returning.
        unsafe {
            result::launch_kernel(
                kernel.func.cu_function(),
                shape.grid,
                shape.block,
                shape.shared_mem_bytes,
                self.cu_stream(),
                &mut args,
            )
        }
        .call("cuLaunchKernel")?;
        Ok(())
    }

    /// Whether a launch of `kernel` in `shape` as clusters of `cluster` would not have all its
    /// clusters resident at once beside `holding` CTAs of another kernel (each taking the place
    /// of one cluster at most).
    fn crowded(
        &self,
        kernel: &Kernel,
        shape: LaunchShape,
        cluster: (u32, u32, u32),
        holding: u64,
    ) -> Result<bool> {
        let most = self.max_active_clusters(kernel, shape.block.0, cluster)?;
        Ok(crowded_clusters(shape.grid, cluster, holding, most))
    }

    /// Programmatic launches this runtime made ordinary by [`Runtime::launch_cluster`]'s
    /// crowding rule (benchmarks report it).
    pub fn pdl_held(&self) -> u64 {
        self.pdl_held.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Keeps `keep` (e.g. a burn-cuda buffer pin) alive until everything queued on Stoke's
    /// stream so far has finished. Completed entries are dropped on later calls.
    pub fn hold_until_done(&self, keep: Box<dyn Any + Send>) -> Result<()> {
        let event = self.ctx.new_event(None).call("cuEventCreate")?;
        event.record(&self.stream).call("cuEventRecord")?;
        let mut list = self.in_flight.lock().unwrap();
        while list.front().is_some_and(|(e, _)| e.is_complete()) {
            list.pop_front();
        }
        list.push_back((event, keep));
        Ok(())
    }

    /// Waits for all of Stoke's work on this device and releases held allocations.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().call("cuStreamSynchronize")?;
        self.in_flight.lock().unwrap().clear();
        Ok(())
    }

    /// The bytes of the `__device__` global `name` of `file`'s loaded module, after the work
    /// queued so far (diagnostics such as a kernel's trace buffer): `None` when the module is not
    /// loaded or defines no such global.
    pub fn module_global(&self, file: &'static str, name: &str) -> Result<Option<Vec<u8>>> {
        self.synchronize()?;
        let modules = self.modules.lock().unwrap();
        let Some((module, _)) = modules.get(file) else {
            return Ok(None);
        };
        module_symbol(module, name, &self.stream)?
            .map(|sym| self.stream.clone_dtoh(&sym).call("cuMemcpyDtoH"))
            .transpose()
    }

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

    /// Compiles kernel file `file` with these preprocessor defines (`NAME=VALUE`) from now on:
    /// its loaded module and functions are dropped, so the next [`Runtime::kernel`] call builds
    /// the variant (cached on disk under its options). For benchmarks that time kernel variants
    /// in one process; an empty list restores the shipped kernels.
    pub fn set_defines(&self, file: &'static str, defines: &[String]) {
        self.defines.lock().unwrap().insert(file, defines.to_vec());
        let mut modules = self.modules.lock().unwrap();
        modules.remove(file);
        self.functions
            .lock()
            .unwrap()
            .retain(|(f, _), _| *f != file);
        self.occupancy.lock().unwrap().clear();
        self.cluster_occupancy.lock().unwrap().clear();
        self.defines_epoch
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Resident CTAs per SM of `kernel` launched with `block_threads` threads and its dynamic
    /// shared memory (`Kernel::dyn_smem`): the occupancy calculator over its registers, shared
    /// memory and launch bounds (cached). Launch plans size their grids by it.
    pub fn resident_ctas(&self, kernel: &Kernel, block_threads: u32) -> Result<u32> {
        let key = (kernel.entry, block_threads);
        if let Some(n) = self.occupancy.lock().unwrap().get(&key) {
            return Ok(*n);
        }
        self.bind()?;
        let n = kernel
            .func
            .occupancy_max_active_blocks_per_multiprocessor(
                block_threads,
                kernel.dyn_smem as usize,
                None,
            )
            .call("cuOccupancyMaxActiveBlocksPerMultiprocessor")?
            .max(1);
        self.occupancy.lock().unwrap().insert(key, n);
        Ok(n)
    }

    /// Whether `count` clusters of `cluster` CTAs of `kernel` (`block_threads` threads each)
    /// can all be resident at once ([`Runtime::max_active_clusters`]). Never for a kernel not
    /// built for clusters (`Kernel::cluster`) or a cluster of fewer than 2 or more than
    /// [`MAX_CLUSTER_CTAS`] CTAs (the driver is not asked then).
    pub fn clusters_fit(
        &self,
        kernel: &Kernel,
        block_threads: u32,
        cluster: (u32, u32, u32),
        count: u64,
    ) -> Result<bool> {
        let ctas = cluster.0 * cluster.1 * cluster.2;
        if !kernel.cluster || !(2..=MAX_CLUSTER_CTAS).contains(&ctas) {
            return Ok(false);
        }
        let resident = self.max_active_clusters(kernel, block_threads, cluster)?;
        Ok(count <= u64::from(resident))
    }

    /// Clusters of `cluster` CTAs of `kernel` (`block_threads` threads each, its dynamic shared
    /// memory) the GPU holds resident at once: the driver's occupancy calculator for cluster
    /// launches (cached), which counts where clusters fit in the GPU's processing clusters, so
    /// it may be less than the resident CTAs divided by the cluster size.
    pub fn max_active_clusters(
        &self,
        kernel: &Kernel,
        block_threads: u32,
        cluster: (u32, u32, u32),
    ) -> Result<u32> {
        let key = (kernel.entry, block_threads, cluster);
        if let Some(n) = self.cluster_occupancy.lock().unwrap().get(&key) {
            return Ok(*n);
        }
        self.bind()?;
        let mut attr = cluster_attribute(cluster);
        let config = sys::CUlaunchConfig {
            gridDimX: cluster.0,
            gridDimY: cluster.1,
            gridDimZ: cluster.2,
            blockDimX: block_threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: kernel.dyn_smem,
            hStream: self.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut n: std::ffi::c_int = 0;
        // SAFETY: the function is loaded in this context, the config and its attribute outlive
        // the call, and `n` is a valid out pointer.
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, kernel.func.cu_function(), &config) }
            .result()
            .call("cuOccupancyMaxActiveClusters")?;
        let n = n.max(0) as u32;
        self.cluster_occupancy.lock().unwrap().insert(key, n);
        Ok(n)
    }

    /// A tensor map for the copy engine over a row-major bf16 matrix of `rows` x `cols` at
    /// `ptr`, seen as 3-D (`box_cols` columns, rows, column blocks of `box_cols`): boxes of
    /// `box_cols` x `box_rows` x `box_blocks` consecutive column blocks, landing in shared
    /// memory block after block (each `box_rows` rows of `box_cols` columns), 128-byte swizzle
    /// (`box_cols * 2` must be 128 or less and divide `cols * 2`), elements past the matrix
    /// read as zeros. `ptr` must be 16-byte aligned and the row pitch (`cols * 2`) a multiple
    /// of 16.
    pub fn bf16_tensor_map(
        &self,
        ptr: u64,
        rows: u32,
        cols: u32,
        box_rows: u32,
        box_cols: u32,
        box_blocks: u32,
    ) -> Result<TensorMap> {
        if !ptr.is_multiple_of(16)
            || (u64::from(cols) * 2) % 16 != 0
            || box_cols == 0
            || box_cols * 2 > 128
            || !box_cols.is_multiple_of(8)
            || !cols.is_multiple_of(box_cols)
        {
            return Err(Error::Shape(format!(
                "tensor map of a bf16 [{rows}, {cols}] matrix at {ptr:#x} (box {box_rows} x {box_cols} x {box_blocks}): needs a 16-byte aligned address, a row pitch that is a multiple of 16 bytes and boxes at most 128 bytes wide, a multiple of 16 bytes, dividing the row"
            )));
        }
        self.bind()?;
        let mut map = TensorMap([0; 16]);
        let dims: [u64; 3] = [
            u64::from(box_cols),
            u64::from(rows),
            u64::from(cols / box_cols),
        ];
        let strides: [u64; 2] = [u64::from(cols) * 2, u64::from(box_cols) * 2];
        let boxes: [u32; 3] = [box_cols, box_rows, box_blocks];
        let elem: [u32; 3] = [1, 1, 1];
        // SAFETY: `map` is 64-byte aligned and 128 bytes (the driver's CUtensorMap); the arrays
        // have the rank's lengths (strides: rank - 1) and outlive the call.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                (&mut map as *mut TensorMap).cast::<sys::CUtensorMap>(),
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                3,
                ptr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elem.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result()
        .call("cuTensorMapEncodeTiled")?;
        Ok(map)
    }

    /// Poisons every buffer allocated from now on (see the field's docs).
    pub fn set_poison_allocations(&self, on: bool) {
        self.poison.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Resource reports of the modules loaded so far.
    pub fn loaded_reports(&self) -> Vec<(String, CompileReport)> {
        let modules = self.modules.lock().unwrap();
        modules
            .iter()
            .flat_map(|(file, (_, r))| r.iter().map(|r| (file.to_string(), r.clone())))
            .collect()
    }

    /// How many times [`Runtime::set_defines`] has changed what the kernels are compiled with
    /// (choices measured on the kernels, such as the W4A16 tuning, keep it in their keys).
    pub fn defines_epoch(&self) -> u64 {
        self.defines_epoch
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether Stoke's stream is capturing a CUDA graph now (work queued is recorded, not run).
    pub fn is_capturing(&self) -> Result<bool> {
        let status = self.stream.capture_status().call("cuStreamIsCapturing")?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// The device's L2 cache size in bytes.
    pub fn l2_bytes(&self) -> Result<usize> {
        let b = self
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .call("cuDeviceGetAttribute")?;
        Ok(b.max(0) as usize)
    }

    /// Creates a timing event (for benchmarks).
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

/// Most CTAs in one cluster Stoke launches (the portable cluster size).
pub const MAX_CLUSTER_CTAS: u32 = 8;

/// Most bytes the buffer pool keeps for reuse; beyond it dropped buffers are freed.
const POOL_LIMIT_BYTES: usize = 2 << 30;

/// Pool size class of a request: whole 512-byte units (and at least one), so buffers of one
/// tensor shape always share a class.
fn pool_size(bytes: usize) -> usize {
    bytes.max(1).div_ceil(512) * 512
}

#[cfg(test)]
mod tests {
    use super::{cluster_tiles_grid, crowded_clusters};

    #[test]
    fn crowding_counts_one_cluster_place_per_holding_cta() {
        // 160 clusters of 3 (70B qkv at 16 rows, 3 splits): with 16 norm CTAs beside them
        // they need 176 places.
        assert!(crowded_clusters((160, 3, 1), (1, 3, 1), 16, 175));
        assert!(!crowded_clusters((160, 3, 1), (1, 3, 1), 16, 176));
        // Nothing holding: crowded only past what fits at all.
        assert!(!crowded_clusters((96, 4, 1), (1, 4, 1), 0, 96));
        assert!(crowded_clusters((96, 4, 1), (1, 4, 1), 0, 95));
        // One norm CTA beside 96 clusters of 4 where 120 fit.
        assert!(!crowded_clusters((96, 4, 1), (1, 4, 1), 1, 120));
    }

    #[test]
    fn clusters_must_tile_the_grid() {
        assert!(cluster_tiles_grid((96, 4, 1), (1, 4, 1)));
        assert!(cluster_tiles_grid((160, 3, 1), (1, 3, 1)));
        assert!(cluster_tiles_grid((64, 8, 1), (1, 8, 1)));
        assert!(
            !cluster_tiles_grid((64, 6, 1), (1, 4, 1)),
            "6 splits in clusters of 4"
        );
        assert!(
            !cluster_tiles_grid((64, 16, 1), (1, 16, 1)),
            "past the portable size"
        );
        assert!(
            !cluster_tiles_grid((64, 4, 1), (0, 4, 1)),
            "an empty dimension"
        );
        assert!(
            !cluster_tiles_grid((64, 4, 1), (u32::MAX, u32::MAX, 2)),
            "no overflow"
        );
    }
}
