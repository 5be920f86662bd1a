//! Stoke's data formats and plain reference implementations. No GPU code: everything here is
//! the specification that kernels are tested against, written for clarity in f64.

pub mod bf16;
pub mod fp8;
pub mod gguf;
pub mod gptq;
pub mod int4;
pub mod kv;
pub mod reference;
pub mod sample;
pub mod shard;
