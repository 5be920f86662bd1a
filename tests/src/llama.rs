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

/// Text for the decode comparison: the file named by `STOKE_EVAL_TEXT`, else a built-in
/// paragraph repeated.
fn eval_text() -> String {
    std::env::var("STOKE_EVAL_TEXT")
        .ok()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .unwrap_or_else(|| {
            "The river valley was settled early: farmers grew barley and flax on the terraces, \
             and a market town grew where the old road crossed the water. In the twelfth \
             century a stone bridge replaced the ferry, and the town's charter granted it a \
             weekly market and two fairs a year. "
                .repeat(40)
        })
}

fn log_softmax_at(logits: &[f64], target: usize) -> f64 {
    let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + logits.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
    logits[target] - lse
}

/// SmolLM2 with its GGUF Q4_1 projections kept packed and run on the W4A16 kernels, decoded
/// token by token (8 sequences x 64 tokens, teacher-forced), against the same model with the
/// weights dequantized at load in plain burn-cuda ops; both bf16. Reports top-1 agreement, the
/// largest logit difference and both models' perplexity over those tokens.
pub fn int4_decode_matches_dequantized() -> Result<Value, String> {
    use burn::tensor::{Int, Tensor, TensorData};
    use stoke_llama::load::load_gguf_packed;
    use stoke_llama::model::KvCache;
    let path = model_path()?;
    let device = Default::default();
    let packed = load_gguf_packed::<crate::StokeCuda>(&path, &device, DType::BF16, 128)
        .map_err(|e| e.to_string())?;
    let plain = load_gguf::<crate::PlainCuda>(&path, &device, DType::BF16, 128)
        .map_err(|e| e.to_string())?;
    let (batch, steps) = (8usize, 64usize);
    let ids: Vec<u32> = packed
        .tokenizer
        .encode(eval_text().as_str(), false)
        .map_err(|e| e.to_string())?
        .get_ids()
        .to_vec();
    if ids.len() < batch * steps {
        return Err(format!(
            "evaluation text has {} tokens, need {}",
            ids.len(),
            batch * steps
        ));
    }
    let seq = |b: usize, s: usize| ids[b * steps + s] as i64;
    let mut cache_k = KvCache::for_model(&packed.model, batch, steps, DType::BF16, &device);
    let mut cache_p = KvCache::for_model(&plain.model, batch, steps, DType::BF16, &device);
    let calls0 = stoke::cuda::int4_linear::kernel_calls();
    let (mut agree, mut total, mut max_diff) = (0usize, 0usize, 0f64);
    let (mut nll_k, mut nll_p, mut predicted) = (0f64, 0f64, 0usize);
    for s in 0..steps {
        let tok: Vec<i64> = (0..batch).map(|b| seq(b, s)).collect();
        let lens = vec![1; batch];
        let tk = Tensor::<crate::StokeCuda, 2, Int>::from_data(
            TensorData::new(tok.clone(), [batch, 1]),
            &device,
        );
        let tp = Tensor::<crate::PlainCuda, 2, Int>::from_data(
            TensorData::new(tok, [batch, 1]),
            &device,
        );
        let lk = crate::f64s(
            packed
                .model
                .forward(tk, &lens, &mut cache_k, true)
                .to_data(),
        );
        let lp = crate::f64s(plain.model.forward(tp, &lens, &mut cache_p, true).to_data());
        let vocab = lk.len() / batch;
        for b in 0..batch {
            let (rk, rp) = (
                &lk[b * vocab..(b + 1) * vocab],
                &lp[b * vocab..(b + 1) * vocab],
            );
            let arg = |r: &[f64]| (0..vocab).max_by(|&i, &j| r[i].total_cmp(&r[j])).unwrap();
            agree += usize::from(arg(rk) == arg(rp));
            total += 1;
            max_diff = rk
                .iter()
                .zip(rp)
                .map(|(a, c)| (a - c).abs())
                .fold(max_diff, f64::max);
            if s + 1 < steps {
                let target = seq(b, s + 1) as usize;
                nll_k -= log_softmax_at(rk, target);
                nll_p -= log_softmax_at(rp, target);
                predicted += 1;
            }
        }
    }
    let kernel_calls = stoke::cuda::int4_linear::kernel_calls() - calls0;
    let (ppl_k, ppl_p) = (
        (nll_k / predicted as f64).exp(),
        (nll_p / predicted as f64).exp(),
    );
    let report = json!({
        "sequences": batch, "tokens_per_sequence": steps, "predicted_tokens": predicted,
        "top1_agreement": agree as f64 / total as f64, "max_logit_diff": max_diff,
        "perplexity_int4_kernels": ppl_k, "perplexity_dequantized_burn_cuda": ppl_p,
        "int4_kernel_calls": kernel_calls,
    });
    if kernel_calls == 0 {
        return Err(format!("the W4A16 kernels never ran: {report}"));
    }
    if (agree as f64) < 0.97 * total as f64 || (ppl_k / ppl_p - 1.0).abs() > 0.01 {
        return Err(format!(
            "INT4 kernel model disagrees with the dequantized one: {report}"
        ));
    }
    Ok(report)
}
