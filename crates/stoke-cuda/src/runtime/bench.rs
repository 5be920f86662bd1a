//! Hooks only the benchmarks and GPU tests (the `stoke-tests` crate) use, compiled with the
//! cargo feature `bench`: the loaded modules' resource reports, poisoned allocations, and the
//! count of programmatic launches held in stream order.

use super::Runtime;
use crate::compile::CompileReport;

impl Runtime {
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

    /// Programmatic launches this runtime made ordinary by [`Runtime::launch_cluster`]'s
    /// crowding rule (benchmarks report it).
    pub fn pdl_held(&self) -> u64 {
        self.pdl_held.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Times every launch from now on alone (an event before and after it, so each kernel runs
    /// in plain stream order), until [`Runtime::take_profile`].
    pub fn start_profile(&self) {
        *self.profile.lock().unwrap() = Some(Vec::new());
        self.profiling
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Stops timing launches; waits for the stream and returns each timed launch's entry point
    /// and milliseconds, in launch order.
    pub fn take_profile(&self) -> crate::Result<Vec<(&'static str, f32)>> {
        use crate::DriverContext;
        self.profiling
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let launches = self.profile.lock().unwrap().take().unwrap_or_default();
        self.synchronize()?;
        launches
            .into_iter()
            .map(|(name, a, b)| Ok((name, a.elapsed_ms(&b).call("cuEventElapsedTime")?)))
            .collect()
    }
}
