//! What `--device auto` picks in the bundled examples.

/// Where a run goes when the device is left to Stoke.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AutoDevice {
    /// A Hopper GPU with a driver and NVRTC: `Stoke<Cuda>`.
    StokeCuda,
    /// Another GPU (or Stoke disabled): plain burn-cuda.
    BurnCuda,
    /// No driver, no GPU or no NVRTC: the CPU.
    Cpu,
}

/// The device `--device auto` picks, and why it is not `Stoke<Cuda>` where it is not. Stoke's
/// runtime is probed first, without touching burn-cuda (which would fail with no driver).
pub fn auto_device() -> (AutoDevice, Option<String>) {
    use stoke::cuda::Unavailable;
    match stoke::cuda::runtime_status::<burn_cuda::Cuda>(&Default::default()) {
        Ok(_) => (AutoDevice::StokeCuda, None),
        Err(e @ (Unavailable::Arch { .. } | Unavailable::Disabled)) => {
            (AutoDevice::BurnCuda, Some(e.to_string()))
        }
        Err(e) => (AutoDevice::Cpu, Some(e.to_string())),
    }
}
