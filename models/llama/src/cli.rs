//! The command-line choices the bundled programs share (the `llama` example and `stoke-serve`):
//! where to run, on which backend, in which precision, with which plan.

use burn::tensor::DType;
use clap::ValueEnum;

/// Where to run.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Device {
    /// CUDA when a driver and a GPU are present (Stoke on Hopper, plain burn-cuda on other
    /// GPUs), the CPU otherwise.
    Auto,
    /// The CPU: `Stoke<NdArray>` (Stoke's CPU kernels for the projections, packed INT4 weights
    /// read in place), or plain burn-ndarray with `--backend burn`.
    Cpu,
    /// GPU 0 through CUDA.
    Cuda,
}

/// Which backend runs the model.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Backend {
    /// `Stoke<Cuda>` / `Stoke<NdArray>`: Stoke's kernels where they apply, the inner backend for
    /// the rest.
    Stoke,
    /// Plain burn-cuda (burn-ndarray on the CPU), for comparison.
    Burn,
}

/// Weight and activation precision.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Precision {
    F32,
    Bf16,
    F16,
}

/// The KV cache format decode attention reads.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum KvCache {
    /// The bf16 cache itself.
    Bf16,
    /// Signed INT4, one amax/7 scale per token and kv head.
    Int4,
    /// FP8 E4M3, one amax/448 scale per token and kv head.
    Fp8,
}

/// The projections' prefill GEMM on `Stoke<Cuda>`.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Prefill {
    Fp8,
    Fp8Int4,
    Bf16,
}

/// `--device auto` resolved ([`crate::device::auto_device`]): the device, and the backend with
/// it (plain burn-cuda on a GPU Stoke does not run on). Prints the choice, and why where it is
/// not `Stoke<Cuda>`, on standard error. Other devices come back as they are.
pub fn pick(device: Device, backend: Backend) -> (Device, Backend) {
    use crate::device::AutoDevice;
    if device != Device::Auto {
        return (device, backend);
    }
    let (picked, reason) = crate::device::auto_device();
    let (device, backend) = match picked {
        AutoDevice::StokeCuda => (Device::Cuda, backend),
        AutoDevice::BurnCuda => (Device::Cuda, Backend::Burn),
        AutoDevice::Cpu => (Device::Cpu, backend),
    };
    let chosen = match (device, backend) {
        (Device::Cuda, Backend::Stoke) => "CUDA GPU 0, Stoke<Cuda>",
        (Device::Cuda, Backend::Burn) => "CUDA GPU 0, plain burn-cuda",
        (_, Backend::Stoke) => "CPU, Stoke<NdArray>",
        (_, Backend::Burn) => "CPU, burn-ndarray",
    };
    match reason {
        None => eprintln!("device: {chosen}"),
        Some(r) => eprintln!("device: {chosen} ({r})"),
    }
    (device, backend)
}

/// The dtype asked for, else f32 on the CPU and bf16 on CUDA.
pub fn dtype(precision: Option<Precision>, device: Device) -> DType {
    match (precision, device) {
        (Some(Precision::F32), _) | (None, Device::Cpu | Device::Auto) => DType::F32,
        (Some(Precision::Bf16), _) | (None, Device::Cuda) => DType::BF16,
        (Some(Precision::F16), _) => DType::F16,
    }
}

/// The model's plan from the prefill and KV-cache choices (`None`: the bf16 cache).
pub fn plan(prefill: Prefill, kv: Option<KvCache>) -> stoke::Plan {
    stoke::Plan {
        prefill: match prefill {
            Prefill::Bf16 => stoke::PrefillMode::Bf16,
            Prefill::Fp8 => stoke::PrefillMode::Fp8,
            Prefill::Fp8Int4 => stoke::PrefillMode::Fp8Int4,
        },
        kv_format: kv_format(kv),
        ..stoke::Plan::default()
    }
}

/// The KV cache format of a `--kv-cache` choice (`None`: bf16).
pub fn kv_format(kv: Option<KvCache>) -> stoke::KvCacheFormat {
    match kv {
        None | Some(KvCache::Bf16) => stoke::KvCacheFormat::Bf16,
        Some(KvCache::Fp8) => stoke::KvCacheFormat::Fp8,
        Some(KvCache::Int4) => stoke::KvCacheFormat::Int4,
    }
}
