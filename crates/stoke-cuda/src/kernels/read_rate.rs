//! The HBM read-rate probe (`kernels/read_rate.cu`): one launch streaming a buffer once with the
//! weights' load, timed in the same run as the W4A16 kernels for the same byte counts (the memory
//! side of their roofline at one row, where they read and do not write).

/// The kernel source.
pub const SOURCE: &str = include_str!("../../../../kernels/read_rate.cu");

/// Every `extern "C"` entry point in [`SOURCE`]: one contiguous chunk per CTA or per warp, 4 or
/// 8 16-byte loads in flight per thread.
pub const ENTRY_POINTS: &[&str] = &[
    "read_rate_cta_u4",
    "read_rate_cta_u8",
    "read_rate_warp_u4",
    "read_rate_warp_u8",
];

/// Most threads per CTA (the entry points' launch bounds).
pub const MAX_THREADS: u32 = 256;

/// Mirror of the kernel's `ReadRateParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ReadRateParams {
    /// The buffer read.
    pub src: u64,
    /// Its length in 16-byte words.
    pub words: u64,
    /// One u32 per launched thread (written only if the loaded words XOR to `never`).
    pub out: u64,
    pub never: u32,
    pub pad: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_c() {
        assert_eq!(std::mem::size_of::<ReadRateParams>(), 32);
        assert!(SOURCE.contains("static_assert(sizeof(ReadRateParams) == 32"));
        for e in ENTRY_POINTS {
            assert!(
                SOURCE.contains(&format!("void __launch_bounds__({MAX_THREADS}) {e}(")),
                "{e}"
            );
        }
    }
}
