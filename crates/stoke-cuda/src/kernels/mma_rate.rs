//! The tensor-core rate probe (`kernels/bench/mma_rate.cu`): mma.sync.m16n8k16 bf16 -> f32, the W4A16
//! kernels' instruction, timed in the same run as they are (the compute side of their roofline).

use super::{EntryPoint, KernelParams};
use crate::DevicePtrMut;

/// The kernel source.
pub const SOURCE: &str = include_str!("../../../../kernels/bench/mma_rate.cu");

/// Every `extern "C"` entry point in [`SOURCE`]: eight independent accumulators per warp
/// (throughput), and one dependent chain (latency).
pub const ENTRY_POINTS: &[&str] = &["mma_rate_c8", "mma_rate_c1"];

/// Independent accumulators per warp of each entry point.
pub const CHAINS: [u32; 2] = [8, 1];

/// Multiply-adds of one mma.m16n8k16.
pub const MMA_MACS: u64 = 16 * 8 * 16;

// SAFETY: the layout is the `.cu` struct's (asserted in the tests below).
unsafe impl KernelParams for MmaRateParams {}

/// Entry point `name` of the mma-rate probe.
pub fn entry_point(name: &'static str) -> EntryPoint<MmaRateParams> {
    EntryPoint::new(&super::MMA_RATE, name)
}

/// Mirror of the kernel's `MmaRateParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MmaRateParams {
    /// One f32 per launched thread (written only if the accumulators sum to `never`).
    pub out: DevicePtrMut<f32>,
    /// Rounds of `CHAINS` mma per warp.
    pub iters: u32,
    pub never: f32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_c() {
        assert_eq!(std::mem::size_of::<MmaRateParams>(), 16);
        assert!(SOURCE.contains("static_assert(sizeof(MmaRateParams) == 16"));
        for e in ENTRY_POINTS {
            assert!(
                SOURCE.contains(&format!("void __launch_bounds__(128) {e}(")),
                "{e}"
            );
        }
    }
}
