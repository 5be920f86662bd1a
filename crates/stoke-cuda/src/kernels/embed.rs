//! Token embedding fused with the first RMSNorm of a decode step: params mirror and launch of
//! kernels/embed.cu.

use super::{EMBED, EntryPoint, KernelParams};
use crate::{DevicePtr, DevicePtrMut, LaunchShape, Result, Runtime};
use half::bf16;

/// `struct EmbedParams` of kernels/embed.cu (56 bytes; the `.cu` file asserts it).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EmbedParams {
    /// `[rows]` token ids.
    pub ids: DevicePtr<u32>,
    /// `[vocab, hidden]` embedding table.
    pub table: DevicePtr<bf16>,
    /// `[hidden]` RMSNorm gain.
    pub gamma: DevicePtr<bf16>,
    /// `[rows, hidden]`: the embedding rows (the residual stream).
    pub x_out: DevicePtrMut<bf16>,
    /// `[rows, hidden]`: their RMSNorm.
    pub normed_out: DevicePtrMut<bf16>,
    pub rows: u32,
    pub hidden: u32,
    pub vocab: u32,
    pub eps: f32,
}

// SAFETY: the layout is the `.cu` struct's (asserted below); pointers of the kernel's types.
unsafe impl KernelParams for EmbedParams {}

/// `kernels/embed.cu`.
pub const SOURCE: &str = include_str!("../../../../kernels/embed.cu");

/// Every `extern "C"` entry point in [`SOURCE`].
pub const ENTRY_POINTS: &[&str] = &["embed_rms_norm_bf16"];

/// Threads per CTA (the kernel's `EMBED_THREADS`).
const THREADS: u32 = 256;

/// Queues `x_out[b] = table[ids[b]]` and `normed_out[b] = rms_norm(x_out[b]) * gamma`.
///
/// # Safety
/// The pointers must be valid device memory of the documented sizes until the kernel is done.
pub unsafe fn embed_rms_norm(rt: &Runtime, p: &EmbedParams) -> Result<()> {
    if p.rows == 0 {
        return Ok(());
    }
    let k = rt.kernel(EntryPoint::<EmbedParams>::new(
        &EMBED,
        "embed_rms_norm_bf16",
    ))?;
    let shape = LaunchShape {
        grid: (p.rows, 1, 1),
        block: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the caller's guarantees; the params match the entry point.
    unsafe { rt.launch(&k, shape, p) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_c() {
        assert_eq!(std::mem::size_of::<EmbedParams>(), 56);
        assert!(SOURCE.contains("static_assert(sizeof(EmbedParams) == 56"));
        assert!(SOURCE.contains(&format!("EMBED_THREADS = {THREADS};")));
    }
}
