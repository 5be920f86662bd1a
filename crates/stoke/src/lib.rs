//! # Stoke
//!
//! `Stoke<B>` is a Burn backend decorator. Every Burn op goes to the inner backend `B`, except
//! the few that Stoke routes to its own CUDA kernels on Hopper GPUs (linear, RMSNorm,
//! attention). A Burn user selects it like any backend:
//!
//! ```no_run
//! use burn::tensor::Tensor;
//! type B = stoke::Stoke<burn_cuda::Cuda>;
//! let device = Default::default();
//! let x = Tensor::<B, 2>::ones([4, 576], &device);
//! let gamma = Tensor::<B, 1>::ones([576], &device);
//! let y = stoke::rms_norm(x, gamma, 1e-5);
//! ```
//!
//! On a machine without a usable Hopper GPU, the same code runs on the inner backend (Stoke
//! logs the reason once). With `Stoke<NdArray>` the fused ops run their reference compositions
//! on the CPU, so model code is written once.

// The core: the types and traits, the reference compositions, what a device is asked for.
mod capture;
pub mod decode;
mod device;
pub mod fused;
pub mod packed;
pub mod plan;
mod stoke;
pub mod tensor;
// The devices: Stoke's CUDA kernels and its CPU kernels (`device::Kernels`).
pub mod cpu;
pub mod cuda;
// The backend assembled from both: `Stoke<I>`'s trait impls.
mod backend;
mod ops;
mod route;

#[doc(hidden)]
pub use burn_backend;
pub use decode::{
    DEFAULT_PAGE_SIZE, DecodeError, DecodeSpec, KvCacheFormat, LaneOp, LaneSampling,
    MAX_TOP_LOGPROBS, PackedSeq, RefDecoder, SPARE_PAGE, Sampled, Sampling, TokenLogprobs,
    decode_attention, decode_embed, decode_force_ids, decode_last_logits, decode_qkv_attention,
    decode_sample, decode_step, decode_take, decode_take_ids, decoder, decoder_spec,
    decoder_update, pack_prompts, prefill_attention, prefill_qkv_attention, prefill_sample,
};
pub use fused::{
    FusedOps, linear_residual, linear_residual_rms_norm, linear_swiglu, output_head,
    residual_rms_norm, rms_norm,
};
pub use plan::{FUSED_STEP_ROWS, Plan, PrefillMode, WeightPlan, WeightRole};
pub use stoke::Stoke;
pub use tensor::{StokeData, StokeTensor};
