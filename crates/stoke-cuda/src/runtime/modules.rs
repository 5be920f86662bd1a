//! Kernel modules: NVRTC compilation (through the disk cache) and loading of a kernel file,
//! [`Runtime::kernel`], and the `u32` globals a module exports to describe its entry points.

use super::Runtime;
use crate::kernels::{EntryPoint, KernelParams, KernelSource};
use crate::{CompileReport, DriverContext, Error, Result};
use cudarc::driver::{CudaFunction, CudaModule, CudaStream, sys};
use std::sync::Arc;

/// A loaded kernel entry point, typed by the parameter struct it takes (made from an
/// [`EntryPoint`] by [`Runtime::kernel`]): [`Runtime::launch`] takes only that struct. Its
/// facts are those of [`KernelInfo`] (through `Deref`).
///
/// A launch with another kernel's parameter struct does not compile:
/// ```compile_fail
/// # use stoke_cuda::{LaunchShape, Runtime};
/// # use stoke_cuda::kernels::{int4_gemm::Int4GemmParams, rms_norm::entry_point};
/// # fn f(rt: &Runtime, shape: LaunchShape, p: Int4GemmParams) {
/// let k = rt.kernel(entry_point::<f32>("rms_norm_f32")).unwrap();
/// unsafe { rt.launch(&k, shape, &p) }.unwrap(); // expects RmsNormParams<f32>
/// # }
/// ```
pub struct Kernel<P> {
    info: KernelInfo,
    _params: std::marker::PhantomData<fn(P)>,
}

impl<P> Clone for Kernel<P> {
    fn clone(&self) -> Self {
        Self {
            info: self.info.clone(),
            _params: std::marker::PhantomData,
        }
    }
}

impl<P> std::fmt::Debug for Kernel<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.info.fmt(f)
    }
}

impl<P> std::ops::Deref for Kernel<P> {
    type Target = KernelInfo;
    fn deref(&self) -> &KernelInfo {
        &self.info
    }
}

/// A compiled kernel entry point and what the module exports about it.
#[derive(Debug, Clone)]
pub struct KernelInfo {
    pub(super) func: CudaFunction,
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

/// The `__device__` global `name` of `module` (its address and size; looking it up queues nothing
/// on `stream`), or `None` where the module defines no such global.
pub(super) fn module_symbol<'a>(
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

/// What [`Runtime::preload`] did: how long it took and where the modules' cubins came from.
#[derive(Clone, Copy, Debug, Default)]
pub struct Preloaded {
    pub wall: std::time::Duration,
    /// The slowest module's cubin (its compilation, where one was compiled).
    pub slowest: std::time::Duration,
    pub built: usize,
    pub disk_cache: usize,
    pub compiled: usize,
}

impl Runtime {
    /// Loads every module of `sources` not loaded yet (built in, or compiled through the disk
    /// cache, the compilations in parallel on the host's cores, one thread per module), so
    /// that the first call of each kernel finds its module ready.
    pub fn preload(&self, sources: &[&'static KernelSource]) -> Result<Preloaded> {
        let t0 = std::time::Instant::now();
        let todo: Vec<&'static KernelSource> = {
            let modules = self.modules.lock().unwrap();
            sources
                .iter()
                .copied()
                .filter(|s| !modules.contains_key(s.file))
                .collect()
        };
        let mut done = Preloaded::default();
        if todo.is_empty() {
            return Ok(done);
        }
        type Compiled = Result<(
            (Vec<u8>, Vec<CompileReport>, crate::CubinOrigin),
            std::time::Duration,
        )>;
        let compiled: Vec<Compiled> = std::thread::scope(|scope| {
            let handles: Vec<_> = todo
                .iter()
                .map(|src| {
                    let arch = self.arch.clone();
                    scope.spawn(move || {
                        let t = std::time::Instant::now();
                        crate::compile_cubin(src.file, src.source, &arch, &[])
                            .map(|c| (c, t.elapsed()))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a compile thread panicked"))
                .collect()
        });
        let mut modules = self.modules.lock().unwrap();
        self.bind()?;
        for (src, c) in todo.iter().zip(compiled) {
            let ((cubin, report, origin), took) = c?;
            done.slowest = done.slowest.max(took);
            match origin {
                crate::CubinOrigin::Built => done.built += 1,
                crate::CubinOrigin::DiskCache => done.disk_cache += 1,
                crate::CubinOrigin::Compiled => done.compiled += 1,
            }
            if modules.contains_key(src.file) {
                continue;
            }
            let module = self
                .ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                .call("cuModuleLoadData")?;
            tracing::debug!("loaded kernels/{} in {took:?} ({origin})", src.file);
            modules.insert(src.file, (module, report));
        }
        done.wall = t0.elapsed();
        Ok(done)
    }

    /// Loads (compiling on first use, through the disk cache) one kernel entry point.
    pub fn kernel<P: KernelParams>(&self, entry: EntryPoint<P>) -> Result<Kernel<P>> {
        Ok(Kernel {
            info: self.kernel_info(entry.source, entry.name)?,
            _params: std::marker::PhantomData,
        })
    }

    /// [`Runtime::kernel`] without the parameter type: the entry point's facts for occupancy
    /// and cluster queries (a [`KernelInfo`] cannot be launched).
    pub fn kernel_info(&self, src: &KernelSource, entry: &'static str) -> Result<KernelInfo> {
        if let Some(k) = self.functions.lock().unwrap().get(&(src.file, entry)) {
            return Ok(k.clone());
        }
        let mut modules = self.modules.lock().unwrap();
        if !modules.contains_key(src.file) {
            let t0 = std::time::Instant::now();
            let (cubin, report, origin) =
                crate::compile_cubin(src.file, src.source, &self.arch, &[])?;
            self.bind()?;
            let module = self
                .ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                .call("cuModuleLoadData")?;
            tracing::debug!(
                "loaded kernels/{} for {} in {:?} ({origin})",
                src.file,
                self.arch,
                t0.elapsed()
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
        let kernel = KernelInfo {
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
}
