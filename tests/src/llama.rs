//! SmolLM2-135M-Instruct (the default model) on the GPU: greedy continuation checks and
//! prefill/decode speed through plain burn-cuda and through `Stoke<Cuda>`.

use burn::tensor::DType;
use serde_json::{Value, json};
use std::path::PathBuf;
use stoke::FusedOps;
use stoke_llama::generate::{SamplingConfig, generate};
use stoke_llama::load::load_gguf;

/// The greedy continuation of "Once upon a time" (no BOS) that an independent f32 forward of
/// the dequantized model gives.
pub const EXPECTED_CONTINUATION: &str = ", the city of Nova Haven was a thriving metropolis";

pub fn model_path() -> Result<PathBuf, String> {
    stoke_llama::fetch::default_model(|m| eprintln!("{m}")).map_err(|e| e.to_string())
}

/// Greedy `max_tokens` after `prompt`, returning the text.
pub fn greedy<B: FusedOps>(
    path: &PathBuf,
    dtype: DType,
    prompt: &str,
    max_tokens: usize,
) -> Result<String, String> {
    let device = Default::default();
    let l = load_gguf::<B>(path, &device, dtype, 256).map_err(|e| e.to_string())?;
    let cfg = SamplingConfig {
        max_new_tokens: max_tokens,
        eos_token_ids: l.config.eos_token_ids.clone(),
        ..Default::default()
    };
    let (out, _) = generate(
        &l.model,
        &l.tokenizer,
        &[prompt.to_string()],
        &cfg,
        256,
        dtype,
        &device,
        |_, _| {},
    )
    .map_err(|e| e.to_string())?;
    Ok(out[0].text.clone())
}

/// Prefill and decode speed for one backend: prompts of `prompt_tokens` tokens, `batch`
/// sequences, `new_tokens` greedy decode steps. Median of `reps` runs after one warm-up.
fn speed<B: FusedOps>(
    path: &PathBuf,
    dtype: DType,
    batch: usize,
    prompt_tokens: usize,
    new_tokens: usize,
) -> Value {
    let device: B::Device = Default::default();
    let t0 = std::time::Instant::now();
    let mut l = load_gguf::<B>(path, &device, dtype, 2048).unwrap();
    l.model = l.model.pinned();
    B::sync(&device).unwrap();
    let load_s = t0.elapsed().as_secs_f64();
    // A prompt of exactly `prompt_tokens` tokens: a paragraph repeated, then cut.
    let text = "The history of the city begins with a small settlement on the river, where traders met to exchange grain, salt and cloth. ".repeat(64);
    let ids = l.tokenizer.encode(text.as_str(), false).unwrap().get_ids()[..prompt_tokens].to_vec();
    let prompt = l.tokenizer.decode(&ids, false).unwrap();
    let prompts = vec![prompt; batch];
    // No EOS stop: every run decodes exactly `new_tokens` steps.
    let cfg = SamplingConfig {
        max_new_tokens: new_tokens,
        ..Default::default()
    };
    let mut runs = Vec::new();
    for _ in 0..4 {
        let (_, t) = generate(
            &l.model,
            &l.tokenizer,
            &prompts,
            &cfg,
            2048,
            dtype,
            &device,
            |_, _| {},
        )
        .unwrap();
        runs.push(t);
    }
    runs.remove(0);
    let mut prefill: Vec<f64> = runs.iter().map(|t| t.prefill_tokens_per_s()).collect();
    let mut decode: Vec<f64> = runs.iter().map(|t| t.decode_tokens_per_s()).collect();
    prefill.sort_by(f64::total_cmp);
    decode.sort_by(f64::total_cmp);
    let step_ms = 1e3 * batch as f64 / decode[decode.len() / 2];
    json!({
        "backend": B::name(&device), "dtype": format!("{dtype:?}"), "batch": batch, "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens, "load_s": load_s,
        "prefill_tokens_per_s": prefill[prefill.len() / 2], "decode_tokens_per_s": decode[decode.len() / 2],
        "decode_step_ms": step_ms,
    })
}

/// The baseline that Stoke's GEMM and attention kernels are measured against: SmolLM2 through burn-cuda and `Stoke<Cuda>` (only
/// the RMSNorm kernel so far), bf16 and f32, batch 1 and 8.
pub fn bench() -> Result<Value, String> {
    let path = model_path()?;
    let mut rows = Vec::new();
    for dtype in [DType::BF16, DType::F32] {
        for &(batch, prompt, new) in &[(1usize, 512usize, 64usize), (8, 128, 32)] {
            let plain = speed::<crate::PlainCuda>(&path, dtype, batch, prompt, new);
            let stoke = speed::<crate::StokeCuda>(&path, dtype, batch, prompt, new);
            println!(
                "smollm2 {dtype:?} batch {batch} prompt {prompt}: burn-cuda {plain}\n    stoke {stoke}"
            );
            rows.push(plain);
            rows.push(stoke);
        }
    }
    Ok(json!({ "model": path.file_name().unwrap().to_string_lossy(), "runs": rows }))
}
