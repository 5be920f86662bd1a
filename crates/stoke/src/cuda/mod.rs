//! The bridge between burn-cuda and Stoke's CUDA runtime.
//!
//! Stoke's kernels run on Stoke's own stream (cubecl's stream cannot be reached). The rules
//! that keep the two streams coherent, each crossing paying for exactly one synchronization:
//!
//! - **Into Stoke** (a kernel reads a burn-cuda tensor): the buffer is pinned with
//!   `get_resource` and burn-cuda's stream is synchronized once, so the kernel sees finished
//!   data. The pin is released only after an event on Stoke's stream says the kernel is done,
//!   so cubecl cannot hand the memory to another tensor while Stoke still reads it.
//! - **Inside Stoke** (a kernel reads another Stoke kernel's output): outputs are
//!   [`DeviceTensor`]s in memory Stoke allocates and frees on its own stream. A chain of Stoke
//!   ops needs no synchronization and no `get_resource`.
//! - **Weights** are pinned once with [`pin`] ([`ResidentTensor`]): their pointer is resolved at
//!   load, never per op.
//! - **Out of Stoke** (a burn-cuda op reads a Stoke output): the tensor materializes once into
//!   a burn-cuda buffer: burn's stream is synchronized (the new buffer may be memory a queued
//!   burn kernel still uses), Stoke's stream copies, and Stoke's stream is synchronized before
//!   burn-cuda can read it. The copy is cached, so each output crosses at most once.

mod bridge;
pub mod decoder;
pub(crate) mod dense_linear;
pub mod int4_linear;
pub mod prefill_linear;
pub(crate) mod rms_norm;

pub(crate) use crate::tensor::float_device;
pub use bridge::{
    DeviceTensor, HeadWeight, ResidentTensor, pin, pin_module, pin_tensor, prepare, prepare_tensor,
    runtime_for, runtime_status,
};
pub(crate) use bridge::{memory_cleanup, sync_device};
pub use stoke_cuda::Unavailable;

/// Turns on cubecl's compiled-kernel cache (the PTX of burn-cuda's kernels) under Stoke's kernel
/// cache (`STOKE_KERNEL_CACHE`, else `~/.cache/stoke/kernels`, in `cubecl/`), so that a process
/// after the first compiles none of burn-cuda's kernels again. Leaves cubecl as it is where a
/// `cubecl.toml` / `burn.toml` above the working directory sets a cache, where the cache
/// directory is off, or where cubecl's configuration has been read already (call it first in
/// `main`). Returns whether it set the cache.
pub fn cache_burn_kernels() -> bool {
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig, cache::CacheConfig};
    let Some(dir) = stoke_cuda::compile::kernel_cache_dir() else {
        return false;
    };
    let mut cfg = CubeClRuntimeConfig::from_current_dir().override_from_env();
    if cfg.compilation.cache.is_some() {
        return false;
    }
    cfg.compilation.cache = Some(CacheConfig::File(dir.join("cubecl")));
    let mut slot = CubeClRuntimeConfig::storage().lock();
    if slot.is_some() {
        return false;
    }
    *slot = Some(std::sync::Arc::new(cfg));
    true
}

/// Stoke's CUDA kernels as a device ([`crate::device::Kernels`]): they run where a Hopper GPU
/// and Stoke's runtime are present, and decline everything elsewhere.
pub(crate) struct Gpu;

impl crate::device::Kernels for Gpu {
    fn linear<I: burn_backend::Backend>(
        x: &crate::tensor::StokeTensor<I>,
        weight: &crate::tensor::StokeTensor<I>,
        epilogue: stoke_cuda::kernels::int4_gemm::Epilogue,
        residual: Option<&crate::tensor::StokeTensor<I>>,
    ) -> Option<crate::tensor::StokeTensor<I>> {
        try_linear::<I>(x, weight, epilogue, residual)
    }

    fn linear_residual_rms_norm<I: burn_backend::Backend>(
        x: &crate::tensor::StokeTensor<I>,
        weight: &crate::tensor::StokeTensor<I>,
        residual: &crate::tensor::StokeTensor<I>,
        gamma: &crate::tensor::StokeTensor<I>,
        eps: f64,
    ) -> Option<(crate::tensor::StokeTensor<I>, crate::tensor::StokeTensor<I>)> {
        int4_linear::try_linear_residual_rms_norm::<I>(x, weight, residual, gamma, eps)
    }

    fn rms_norm<I: burn_backend::Backend>(
        x: &crate::tensor::StokeTensor<I>,
        residual: Option<&crate::tensor::StokeTensor<I>>,
        gamma: &crate::tensor::StokeTensor<I>,
        eps: f64,
    ) -> Option<(
        crate::tensor::StokeTensor<I>,
        Option<crate::tensor::StokeTensor<I>>,
    )> {
        rms_norm::try_rms_norm::<I>(x, residual, gamma, eps)
    }

    fn defer_rms_norm<I: burn_backend::Backend>(
        x: &crate::tensor::StokeTensor<I>,
        gamma: &crate::tensor::StokeTensor<I>,
        eps: f64,
    ) -> Option<crate::tensor::StokeTensor<I>> {
        prefill_linear::RmsNormed::defer(x, gamma, eps).map(crate::tensor::StokeTensor::owned)
    }

    fn prepare_weight<I: burn_backend::Backend>(
        weight: crate::tensor::StokeTensor<I>,
        plan: crate::plan::WeightPlan,
    ) -> Result<crate::tensor::StokeTensor<I>, crate::tensor::StokeTensor<I>> {
        Ok(prepare_tensor(weight, plan))
    }

    fn memory_info<I: burn_backend::Backend>(device: &I::Device) -> Option<(usize, usize)> {
        runtime_for::<I>(device)?.memory_info().ok()
    }

    fn memory_cleanup<I: burn_backend::Backend>(device: &I::Device) {
        memory_cleanup::<I>(device)
    }

    fn sync<I: burn_backend::Backend>(
        device: &I::Device,
    ) -> Result<(), burn_backend::ExecutionError> {
        sync_device::<I>(device)
    }
}

/// `epilogue(x @ W)` on Stoke's GEMMs: the W4A16 kernels for a packed INT4 weight (decode
/// rows), the persistent wgmma GEMM on the weight's bf16 or E4M3 copy (prefill rows), the
/// dense bf16 kernel for a pinned bf16 weight (decode rows), the output-head kernel for a head
/// kept as its rows (decode rows); `None` where none applies (the caller's reference path).
/// `Residual` adds `residual`, `SwiGlu` returns `silu(g) * u` of interleaved columns.
pub(crate) fn try_linear<I: burn_backend::Backend>(
    x: &crate::tensor::StokeTensor<I>,
    weight: &crate::tensor::StokeTensor<I>,
    epilogue: stoke_cuda::kernels::int4_gemm::Epilogue,
    residual: Option<&crate::tensor::StokeTensor<I>>,
) -> Option<crate::tensor::StokeTensor<I>> {
    int4_linear::try_linear_with(x, weight, epilogue, residual)
        .or_else(|| prefill_linear::try_prefill_linear_with(x, weight, epilogue, residual))
        .or_else(|| dense_linear::try_dense_linear_with(x, weight, epilogue, residual))
        .or_else(|| dense_linear::try_head_linear(x, weight, epilogue))
}

/// `dims` (an input's `[.., k]`) with the last dimension set to `cols`: a GEMM output's shape.
pub(crate) fn with_cols(dims: &[usize], cols: usize) -> burn_backend::Shape {
    let mut out = dims.to_vec();
    if let Some(last) = out.last_mut() {
        *last = cols;
    }
    burn_backend::Shape::from(out)
}

/// Whether a GEMM's epilogue inputs fit its output `[.., n]` (`dims` with the last dimension
/// `n`): the `Residual` epilogue needs a bf16 residual of exactly that shape.
pub(crate) fn residual_fits<I: burn_backend::Backend>(
    epilogue: stoke_cuda::kernels::int4_gemm::Epilogue,
    residual: Option<&crate::tensor::StokeTensor<I>>,
    dims: &[usize],
    n: usize,
) -> bool {
    use burn_backend::TensorMetadata;
    match (epilogue, residual) {
        (stoke_cuda::kernels::int4_gemm::Epilogue::Residual, Some(r)) => {
            r.dtype() == burn_backend::DType::BF16 && r.shape() == with_cols(dims, n)
        }
        (stoke_cuda::kernels::int4_gemm::Epilogue::Residual, None) => false,
        _ => true,
    }
}
