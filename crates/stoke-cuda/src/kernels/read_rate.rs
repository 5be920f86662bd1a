//! The HBM read-rate probe (`kernels/bench/read_rate.cu`): one launch streaming a buffer once with the
//! weights' load, or through shared memory by the copy engine, timed in the same run as the
//! W4A16 and attention kernels for the same byte counts (the memory side of their roofline where
//! they read and do not write).

use super::{EntryPoint, KernelParams};
use crate::{DevicePtr, DevicePtrMut};

/// The kernel source.
pub const SOURCE: &str = include_str!("../../../../kernels/bench/read_rate.cu");

/// The load forms: one contiguous chunk per CTA or per warp, 4 or 8 16-byte loads in flight per
/// thread, up to [`MAX_THREADS`] threads.
pub const LOAD_ENTRIES: &[&str] = &[
    "read_rate_cta_u4",
    "read_rate_cta_u8",
    "read_rate_warp_u4",
    "read_rate_warp_u8",
];

/// Every `extern "C"` entry point in [`SOURCE`]: [`LOAD_ENTRIES`] and [`BULK_ENTRY`].
pub const ENTRY_POINTS: &[&str] = &[
    "read_rate_cta_u4",
    "read_rate_cta_u8",
    "read_rate_warp_u4",
    "read_rate_warp_u8",
    BULK_ENTRY,
];

/// Most threads per CTA (the entry points' launch bounds).
pub const MAX_THREADS: u32 = 256;

/// The copy-engine form: one contiguous chunk per CTA through a ring of shared-memory stages
/// (`stage_bytes`, `stages`; dynamic shared memory [`bulk_smem`]), one thread issuing.
pub const BULK_ENTRY: &str = "read_rate_bulk";

/// Threads per CTA of [`BULK_ENTRY`] (its launch bounds).
pub const BULK_THREADS: u32 = 32;

/// Dynamic shared memory of a [`BULK_ENTRY`] launch: the stages and one mbarrier each.
pub const fn bulk_smem(stage_bytes: u32, stages: u32) -> u32 {
    stages * stage_bytes + 8 * stages
}

// SAFETY: the layout is the `.cu` struct's (asserted in the tests below).
unsafe impl KernelParams for ReadRateParams {}

/// Entry point `name` of the read-rate probe.
pub fn entry_point(name: &'static str) -> EntryPoint<ReadRateParams> {
    EntryPoint::new(&super::READ_RATE, name)
}

/// Mirror of the kernel's `ReadRateParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ReadRateParams {
    /// The buffer read (16-byte words).
    pub src: DevicePtr<[u32; 4]>,
    /// Its length in 16-byte words.
    pub words: u64,
    /// One u32 per launched thread (written only if the loaded words XOR to `never`).
    pub out: DevicePtrMut<u32>,
    pub never: u32,
    /// [`BULK_ENTRY`]: bytes per stage (a multiple of 16); ignored by the others.
    pub stage_bytes: u32,
    /// [`BULK_ENTRY`]: stages in the ring; ignored by the others.
    pub stages: u32,
    pub pad: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_c() {
        assert_eq!(std::mem::size_of::<ReadRateParams>(), 40);
        assert!(SOURCE.contains("static_assert(sizeof(ReadRateParams) == 40"));
        assert!(SOURCE.contains(&format!(
            "void __launch_bounds__({BULK_THREADS}) {BULK_ENTRY}("
        )));
        assert_eq!(&ENTRY_POINTS[..LOAD_ENTRIES.len()], LOAD_ENTRIES);
        assert_eq!(ENTRY_POINTS[LOAD_ENTRIES.len()..], [BULK_ENTRY]);
        for e in LOAD_ENTRIES {
            assert!(
                SOURCE.contains(&format!("void __launch_bounds__({MAX_THREADS}) {e}(")),
                "{e}"
            );
        }
    }
}
