//! Selecting Stoke as a Burn backend: the same model code on the CPU, on plain burn-cuda and
//! on `Stoke<Cuda>`.
//!
//! `cargo run --release -p stoke --example rms_norm -- cuda` (default: `cpu`).

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Distribution, ElementConversion, Tensor};
use stoke::FusedOps;

/// A toy block written once for any backend: RMSNorm then a projection, with a residual.
fn block<B: FusedOps>(x: Tensor<B, 2>, gamma: Tensor<B, 1>, proj: &Linear<B>) -> Tensor<B, 2> {
    let (sum, normed) = stoke::residual_rms_norm(x.clone(), x.clone() * 0.5, gamma, 1e-5);
    sum + proj.forward(normed)
}

fn run<B: FusedOps>(device: B::Device) {
    let proj: Linear<B> = LinearConfig::new(576, 576).init(&device);
    let gamma = Tensor::<B, 1>::ones([576], &device);
    let x = Tensor::<B, 2>::random([16, 576], Distribution::Default, &device);
    let t0 = std::time::Instant::now();
    let y = block(x, gamma, &proj);
    let sum: f32 = y.sum().into_scalar().elem();
    println!(
        "{}: {} params, output sum {sum:.4} in {:?}",
        B::name(&device),
        proj.num_params(),
        t0.elapsed()
    );
}

fn main() {
    tracing_subscriber_init();
    match std::env::args().nth(1).as_deref() {
        Some("cuda") => {
            run::<burn_cuda::Cuda>(Default::default());
            run::<stoke::Stoke<burn_cuda::Cuda>>(Default::default());
        }
        _ => {
            run::<burn_ndarray::NdArray>(Default::default());
            run::<stoke::Stoke<burn_ndarray::NdArray>>(Default::default());
        }
    }
}

fn tracing_subscriber_init() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .try_init();
}
