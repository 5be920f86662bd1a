//! Stoke's GPU tests and benchmarks.
//!
//! The test bodies live here, in a library, so that two front ends run the same code: `cargo
//! test` (tests/tests/gpu.rs; each GPU test prints `skipped: no CUDA device` where there is none)
//! and the `stoke-gpu` binary, the self-contained bundle that runs on a GPU machine without a
//! Rust toolchain and writes JSON results.

// The tolerance checks are written `!(err < TOL)` so that a NaN error fails them.
#![allow(clippy::neg_cmp_op_on_partial_ord)]
// Test and benchmark cases pass their buffers and shapes as plain arguments and index their
// parallel arrays directly, as the kernels do.
#![allow(
    clippy::too_many_arguments,
    clippy::type_complexity,
    clippy::needless_range_loop
)]

pub mod attention;
pub mod bench;
pub mod decode;
pub mod dense;
pub mod fp8;
pub mod fp8_i4;
pub mod gpu;
pub mod head;
pub mod int4;
pub mod llama;
pub mod loader_fuzz;
pub mod pairs;
pub mod qkv;
pub mod sample;
pub mod serving;
pub mod suite;

use std::sync::Arc;
use stoke_cuda::Runtime;

/// Stoke on burn-cuda: the backend under test.
pub type StokeCuda = stoke::Stoke<burn_cuda::Cuda>;
/// Plain burn-cuda: the peer for forwarded ops and compositions.
pub type PlainCuda = burn_cuda::Cuda;
/// The CPU backend.
pub type Cpu = burn_ndarray::NdArray<f32>;

/// Stoke's runtime on GPU 0, or why there is none.
pub fn gpu() -> Result<Arc<Runtime>, String> {
    // Opening the runtime never touches burn-cuda, which would panic with no driver.
    stoke::cuda::runtime_status::<burn_cuda::Cuda>(&Default::default()).map_err(|e| e.to_string())
}

/// Result of one GPU test case.
#[derive(Debug, serde::Serialize)]
pub struct Outcome {
    pub name: &'static str,
    /// "passed", "failed" or "skipped".
    pub status: &'static str,
    pub message: String,
    pub seconds: f64,
    pub details: serde_json::Value,
}

/// Runs GPU case `name` for `cargo test`: prints a visible skip without a usable GPU, panics on
/// failure.
pub fn cargo_test(name: &str) {
    use std::io::Write;
    let outcome = gpu::run(name);
    match outcome.status {
        // Written past libtest's capture, so the skip shows in a normal `cargo test` run.
        "skipped" => {
            let _ = writeln!(
                std::io::stdout(),
                "{name}: skipped: no CUDA device ({})",
                outcome.message
            );
        }
        "passed" => println!(
            "{name}: passed in {:.2}s {}",
            outcome.seconds, outcome.details
        ),
        _ => panic!("{name} failed: {}", outcome.message),
    }
}

/// A tensor's values as f64 (for comparisons with the f64 references).
pub fn f64s(d: burn::tensor::TensorData) -> Vec<f64> {
    d.convert::<f32>()
        .to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

/// A fresh seed per run (printed with every result so a failure can be replayed with
/// `STOKE_TEST_SEED`).
pub fn seed() -> u64 {
    std::env::var("STOKE_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        })
}
