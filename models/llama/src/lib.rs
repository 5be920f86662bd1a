//! Llama-family models for Stoke: configuration and tokenizer from GGUF metadata (the model,
//! its loaders and generation follow in this crate).

pub mod bench;
pub mod cli;
pub mod config;
pub mod device;
pub mod eval;
pub mod fetch;
pub mod load;
pub mod model;
pub mod packed_file;
pub mod quant;
pub mod run;
pub mod synthetic;
pub mod tokenizer;
pub mod train;

pub use config::LlamaConfig;

/// What a caught panic said (its `&str` or `String` payload; empty for another payload).
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_default()
}
