//! One [`Runtime`] per GPU: the context, Stoke's stream, loaded modules, owned buffers and the
//! list of borrowed allocations held until the kernels that read them have finished.
//!
//! `Runtime` is one type; its methods are grouped by concern, one file each:
//! - this file: the struct, [`Runtime::new`] (or why the device is [`Unavailable`]) and the
//!   device facts;
//! - `modules`: NVRTC compilation and module loading, [`Runtime::kernel`], [`Kernel`];
//! - `launch`: [`Runtime::launch`], [`Runtime::launch_cluster`], [`LaunchShape`], the cluster
//!   and programmatic-launch rules, [`Runtime::hold_until_done`];
//! - `memory`: [`Runtime::alloc`], the buffer pool, [`DeviceBuffer`], copies and fills,
//!   [`Runtime::zeroed_scratch`];
//! - `graph`: stream order: graph capture, [`Runtime::synchronize`], events;
//! - `occupancy`: resident CTAs and clusters, [`TensorMap`], the L2 size;
//! - `bench` (cargo feature `bench`): hooks only the benchmarks and GPU tests use.

#[cfg(feature = "bench")]
mod bench;
mod graph;
mod launch;
mod memory;
mod modules;
mod occupancy;

pub use graph::PinnedHost;
pub use launch::{LaunchShape, MAX_CLUSTER_CTAS};
pub use memory::{DeviceBuffer, GraphArena};
pub use modules::{Kernel, KernelInfo, Preloaded};
pub use occupancy::TensorMap;

use crate::compile::CompileReport;
use crate::{DriverContext, Result};
use cudarc::driver::{CudaContext, CudaEvent, CudaModule, CudaStream, sys};
use std::any::Any;
use std::collections::{HashMap, VecDeque};
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

/// Loaded modules by kernel file, with the compile reports of their entry points.
type Modules = HashMap<&'static str, (Arc<CudaModule>, Vec<CompileReport>)>;

/// Clusters resident at once by (entry point, threads per CTA, cluster (x, y, z)).
type ClusterOccupancy = HashMap<(&'static str, u32, (u32, u32, u32)), u32>;

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
    modules: Mutex<Modules>,
    functions: Mutex<HashMap<(&'static str, &'static str), KernelInfo>>,
    /// Resident CTAs per SM by (entry point, threads per CTA), from the occupancy calculator.
    occupancy: Mutex<HashMap<(&'static str, u32), u32>>,
    /// Clusters resident at once by (entry point, threads per CTA, cluster (x, y, z)).
    cluster_occupancy: Mutex<ClusterOccupancy>,
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
    /// Outgrown zeroed scratch buffers, kept because a graph may still hold their addresses.
    retired: Mutex<Vec<sys::CUdeviceptr>>,
    /// The arena new buffers come from while a graph is captured ([`Runtime::capture_into`]).
    arena: Mutex<Option<Arc<GraphArena>>>,
    /// Crossings between burn-cuda and Stoke reported during a strict capture.
    crossings: Mutex<Vec<String>>,
    /// Whether a strict capture is running (crossings are recorded, and fail it).
    strict: std::sync::atomic::AtomicBool,
    /// Stream synchronizations by the host ([`Runtime::synchronize`], copies to the host).
    host_syncs: std::sync::atomic::AtomicU64,
    /// Crossings between burn-cuda and Stoke so far ([`Runtime::note_crossing`]).
    crossings_total: std::sync::atomic::AtomicU64,
    /// Whether each launch is timed alone (benchmarks: the sum of a step's kernel times).
    profiling: std::sync::atomic::AtomicBool,
    /// The timed launches: (entry point, event before, event after).
    #[allow(clippy::type_complexity)]
    profile: Mutex<Option<Vec<(&'static str, CudaEvent, CudaEvent)>>>,
    /// Page-locked staging buffers of stream-ordered uploads ([`Runtime::copy_htod_async`]),
    /// each free again once the event after its copy completes.
    staging: Mutex<Vec<(CudaEvent, graph::PinnedHost)>>,
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
        // Kernels built into the library need no NVRTC; without them every kernel compiles.
        if !crate::compile::built_archs().contains(&"sm_90a") {
            crate::compile::nvrtc_version().map_err(|e| Unavailable::NoNvrtc(e.to_string()))?;
        }
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
            occupancy: Mutex::new(HashMap::new()),
            cluster_occupancy: Mutex::new(HashMap::new()),
            in_flight: Mutex::new(VecDeque::new()),
            poison: Default::default(),
            after_early_trigger: Default::default(),
            pdl_held: Default::default(),
            pool: Mutex::new(HashMap::new()),
            pooled_bytes: Default::default(),
            zeroed: Mutex::new((0, 0)),
            retired: Mutex::new(Vec::new()),
            arena: Mutex::new(None),
            crossings: Mutex::new(Vec::new()),
            strict: Default::default(),
            host_syncs: Default::default(),
            crossings_total: Default::default(),
            profiling: Default::default(),
            profile: Mutex::new(None),
            staging: Mutex::new(Vec::new()),
        }))
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().call("cuCtxSetCurrent")
    }

    /// The raw stream handle Stoke's kernels run on.
    pub fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }
}
