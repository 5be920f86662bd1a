//! Hooks only the benchmarks and GPU tests (the `stoke-tests` crate) use, compiled with the
//! cargo feature `bench`: kernel variants by preprocessor defines, the loaded modules' resource
//! reports, poisoned allocations, reads of a module's globals, and the count of programmatic
//! launches held in stream order.

use super::Runtime;
use super::modules::module_symbol;
use crate::compile::CompileReport;
use crate::{DriverContext, Result};

impl Runtime {
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

    /// Resource reports of the modules loaded so far.
    pub fn loaded_reports(&self) -> Vec<(String, CompileReport)> {
        let modules = self.modules.lock().unwrap();
        modules
            .iter()
            .flat_map(|(file, (_, r))| r.iter().map(|r| (file.to_string(), r.clone())))
            .collect()
    }

    /// Poisons every buffer allocated from now on (see the field's docs).
    pub fn set_poison_allocations(&self, on: bool) {
        self.poison.store(on, std::sync::atomic::Ordering::Relaxed);
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

    /// Programmatic launches this runtime made ordinary by [`Runtime::launch_cluster`]'s
    /// crowding rule (benchmarks report it).
    pub fn pdl_held(&self) -> u64 {
        self.pdl_held.load(std::sync::atomic::Ordering::Relaxed)
    }
}
