//! SmolLM2-135M-Instruct (the default model) on the GPU: greedy continuation checks and
//! prefill/decode speed through plain burn-cuda and through `Stoke<Cuda>`.

use burn::tensor::DType;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use stoke::FusedOps;
use stoke_llama::load::load_gguf;
use stoke_llama::model::Llama;
use stoke_llama::run::{GenerateOptions, generate};

/// The greedy continuation of "Once upon a time" (no BOS) that an independent f32 forward of
/// the dequantized model gives.
pub const EXPECTED_CONTINUATION: &str = ", the city of Nova Haven was a thriving metropolis";

pub fn model_path() -> Result<PathBuf, String> {
    stoke_llama::fetch::default_model(|m| eprintln!("{m}")).map_err(|e| e.to_string())
}

/// Greedy `max_tokens` after `prompt`, returning the text.
pub fn greedy<B: FusedOps>(
    path: &Path,
    dtype: DType,
    prompt: &str,
    max_tokens: usize,
) -> Result<String, String> {
    let device = Default::default();
    let l = load_gguf::<B>(path, &device, dtype, 256).map_err(|e| e.to_string())?;
    greedy_on(&l, dtype, &device, prompt, max_tokens, false)
}

/// [`greedy`] with GGUF Q4 projections kept packed (Stoke's W4A16 kernels on `Stoke<Cuda>`;
/// dequantized at load elsewhere) and the weights pinned, as the main job runs.
pub fn greedy_packed<B: FusedOps>(
    path: &Path,
    prompt: &str,
    max_tokens: usize,
    eager: bool,
) -> Result<String, String> {
    let device = Default::default();
    let mut l = stoke_llama::load::load_gguf_packed::<B>(path, &device, DType::BF16, 256)
        .map_err(|e| e.to_string())?;
    l.model = l.model.pinned();
    greedy_on(&l, DType::BF16, &device, prompt, max_tokens, eager)
}

/// Greedy generation on a loaded model (context 256).
fn greedy_on<B: FusedOps>(
    l: &stoke_llama::load::Loaded<B>,
    dtype: DType,
    device: &B::Device,
    prompt: &str,
    max_tokens: usize,
    eager: bool,
) -> Result<String, String> {
    let _ = (dtype, device);
    let opts = GenerateOptions {
        context: 256,
        eager,
        eos: l.config.eos_token_ids.clone(),
    };
    let (out, _) = generate(
        &l.model,
        &l.tokenizer,
        &[prompt.to_string()],
        &stoke_engine::Params::greedy(max_tokens),
        &opts,
        |_, _| {},
    )
    .map_err(|e| e.to_string())?;
    Ok(out[0].text.clone())
}

/// Prefill and decode speed for one backend: prompts of `prompt_tokens` tokens, `batch`
/// sequences, `new_tokens` greedy decode steps. Median of `reps` runs after one warm-up.
fn speed<B: FusedOps>(
    path: &Path,
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
    let opts = GenerateOptions {
        context: 2048,
        eager: false,
        eos: Vec::new(),
    };
    let mut runs = Vec::new();
    for _ in 0..4 {
        let (_, t) = generate(
            &l.model,
            &l.tokenizer,
            &prompts,
            &stoke_engine::Params::greedy(new_tokens),
            &opts,
            |_, _| {},
        )
        .unwrap();
        runs.push(t);
    }
    runs.remove(0);
    let mut prefill: Vec<f64> = runs.iter().map(|t| t.prefill_tokens_per_s()).collect();
    let mut decode: Vec<f64> = runs.iter().map(|t| t.decode_tokens_per_s(batch)).collect();
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

/// The evaluation text's token ids under a loaded model's tokenizer.
fn eval_ids<B: burn::tensor::backend::Backend>(
    l: &stoke_llama::load::Loaded<B>,
) -> Result<Vec<u32>, String> {
    let e = l.tokenizer.encode(eval_text().as_str(), false);
    Ok(e.map_err(|e| e.to_string())?.get_ids().to_vec())
}

fn log_softmax_at(logits: &[f64], target: usize) -> f64 {
    let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + logits.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
    logits[target] - lse
}

/// SmolLM2 with its GGUF Q4_1 projections kept packed and run on the W4A16 kernels (bf16),
/// decoded token by token (8 sequences x 64 tokens, teacher-forced), beside the same model with
/// the weights dequantized at load in plain burn-cuda ops, in bf16 and in f32. The f32 model is
/// the reference: two bf16 computations of the same model differ in their roundings (the plain
/// one also rounds every weight to bf16), so the kernels pass when they agree with the f32
/// model at least about as well as the plain bf16 model does. Reports top-1 agreement, the
/// largest logit difference and each model's perplexity over those tokens.
pub fn int4_decode_matches_dequantized() -> Result<Value, String> {
    use stoke_llama::load::load_gguf_packed;
    let path = model_path()?;
    let device = Default::default();
    let packed = load_gguf_packed::<crate::StokeCuda>(&path, &device, DType::BF16, 128)
        .map_err(|e| e.to_string())?;
    let plain16 = load_gguf::<crate::PlainCuda>(&path, &device, DType::BF16, 128)
        .map_err(|e| e.to_string())?;
    let plain32 = load_gguf::<crate::PlainCuda>(&path, &device, DType::F32, 128)
        .map_err(|e| e.to_string())?;
    let ids = eval_ids(&packed)?;
    let models = (&packed.model, &plain16.model, &plain32.model);
    kernels_vs_dequantized(models, &ids, (8, 64), &device)
}

/// SmolLM2 quantized at load by round-to-nearest into symmetric INT4 (group 128, 64 where k is
/// 576, bf16 scales), decoded token by token at 16 sequences x 32 tokens: 16 rows per
/// projection, so `linear` runs the warpgroup kernels (`int4_gemm_wg_*`). Beside it the same
/// quantization in plain burn-cuda ops, where `quantize` keeps the dequantized weights
/// (simulated quantization), in bf16 and in f32, judged as in
/// [`int4_decode_matches_dequantized`]; fails unless warpgroup launches ran. Per-shape tuning
/// is off for it, so the plan's warpgroup kernels are what runs.
pub fn rtn_int4_decode_warpgroup_matches_simulated() -> Result<Value, String> {
    use stoke_llama::quant::{QuantizeConfig, quantize};
    let path = model_path()?;
    let device = Default::default();
    let cfg = QuantizeConfig::default();
    let rtn = |e: stoke_llama::quant::QuantError| e.to_string();
    let load = |e: stoke_llama::load::LoadError| e.to_string();
    let kernels = load_gguf::<crate::StokeCuda>(&path, &device, DType::BF16, 64).map_err(load)?;
    let ids = eval_ids(&kernels)?;
    let kernels = quantize(kernels.model, &cfg, None).map_err(rtn)?.0;
    let plain16 = load_gguf::<crate::PlainCuda>(&path, &device, DType::BF16, 64).map_err(load)?;
    let plain16 = quantize(plain16.model, &cfg, None).map_err(rtn)?.0;
    let plain32 = load_gguf::<crate::PlainCuda>(&path, &device, DType::F32, 64).map_err(load)?;
    let plain32 = quantize(plain32.model, &cfg, None).map_err(rtn)?.0;
    // The plan's kernels, untuned: the tuner may prefer other kernels on these small shapes.
    let tune = stoke_cuda::int4::tune_default();
    stoke_cuda::int4::set_tune_default(false);
    let wg0 = stoke_cuda::int4::warpgroup_launches();
    let report = kernels_vs_dequantized((&kernels, &plain16, &plain32), &ids, (16, 32), &device);
    let wg = stoke_cuda::int4::warpgroup_launches() - wg0;
    stoke_cuda::int4::set_tune_default(tune);
    let mut report = report?;
    report["warpgroup_launches"] = json!(wg);
    if wg == 0 {
        return Err(format!("the warpgroup kernels never ran: {report}"));
    }
    Ok(report)
}

/// Decodes `batch` sequences of `steps` tokens of the evaluation text, teacher-forced, through
/// the INT4 kernel model and the plain bf16 and f32 models, and judges the kernels by the f32
/// model: they pass when their top-1 agreement with it is at most 0.02 below the plain bf16
/// model's and their perplexity's relative distance from it at most 0.005 above, and when the
/// W4A16 kernels ran.
fn kernels_vs_dequantized(
    (kernels, plain16, plain32): (
        &Llama<crate::StokeCuda>,
        &Llama<crate::PlainCuda>,
        &Llama<crate::PlainCuda>,
    ),
    ids: &[u32],
    (batch, steps): (usize, usize),
    device: &burn_cuda::CudaDevice,
) -> Result<Value, String> {
    use burn::tensor::{Int, Tensor, TensorData};
    use stoke_llama::model::KvCache;
    if ids.len() < batch * steps {
        return Err(format!(
            "evaluation text has {} tokens, need {}",
            ids.len(),
            batch * steps
        ));
    }
    let seq = |b: usize, s: usize| ids[b * steps + s] as i64;
    // Logits of every step, [steps][batch * vocab], for one model.
    fn decode<B: FusedOps>(
        m: &Llama<B>,
        dtype: DType,
        tokens: &dyn Fn(usize, usize) -> i64,
        (batch, steps): (usize, usize),
        device: &B::Device,
    ) -> Vec<Vec<f64>> {
        let mut cache = KvCache::for_model(m, batch, steps, dtype, device);
        (0..steps)
            .map(|s| {
                let tok: Vec<i64> = (0..batch).map(|b| tokens(b, s)).collect();
                let t = Tensor::<B, 2, Int>::from_data(TensorData::new(tok, [batch, 1]), device);
                crate::f64s(m.forward(t, &vec![1; batch], &mut cache, true).to_data())
            })
            .collect()
    }
    let calls0 = stoke::cuda::int4_linear::kernel_calls();
    let lk = decode(kernels, DType::BF16, &seq, (batch, steps), device);
    let kernel_calls = stoke::cuda::int4_linear::kernel_calls() - calls0;
    let l16 = decode(plain16, DType::BF16, &seq, (batch, steps), device);
    let l32 = decode(plain32, DType::F32, &seq, (batch, steps), device);
    let vocab = lk[0].len() / batch;
    let argmax = |r: &[f64]| (0..r.len()).max_by(|&i, &j| r[i].total_cmp(&r[j])).unwrap();
    // Top-1 agreement and largest logit difference of `a` against `b`.
    let compare = |a: &[Vec<f64>], b: &[Vec<f64>]| {
        let (mut agree, mut max_diff) = (0usize, 0f64);
        for (sa, sb) in a.iter().zip(b) {
            for bi in 0..batch {
                let (ra, rb) = (
                    &sa[bi * vocab..(bi + 1) * vocab],
                    &sb[bi * vocab..(bi + 1) * vocab],
                );
                agree += usize::from(argmax(ra) == argmax(rb));
                max_diff = ra
                    .iter()
                    .zip(rb)
                    .map(|(x, y)| (x - y).abs())
                    .fold(max_diff, f64::max);
            }
        }
        (agree as f64 / (steps * batch) as f64, max_diff)
    };
    let perplexity = |l: &[Vec<f64>]| {
        let mut nll = 0f64;
        for s in 0..steps - 1 {
            for bi in 0..batch {
                let r = &l[s][bi * vocab..(bi + 1) * vocab];
                nll -= log_softmax_at(r, seq(bi, s + 1) as usize);
            }
        }
        (nll / ((steps - 1) * batch) as f64).exp()
    };
    let (k_vs_16, k_vs_16_diff) = compare(&lk, &l16);
    let (k_vs_32, k_vs_32_diff) = compare(&lk, &l32);
    let (p16_vs_32, p16_vs_32_diff) = compare(&l16, &l32);
    let (ppl_k, ppl_16, ppl_32) = (perplexity(&lk), perplexity(&l16), perplexity(&l32));
    let report = json!({
        "sequences": batch, "tokens_per_sequence": steps, "predicted_tokens": (steps - 1) * batch,
        "int4_kernel_calls": kernel_calls,
        "top1_agreement": {"int4_kernels_vs_dequantized_bf16": k_vs_16,
            "int4_kernels_vs_dequantized_f32": k_vs_32, "dequantized_bf16_vs_f32": p16_vs_32},
        "max_logit_diff": {"int4_kernels_vs_dequantized_bf16": k_vs_16_diff,
            "int4_kernels_vs_dequantized_f32": k_vs_32_diff, "dequantized_bf16_vs_f32": p16_vs_32_diff},
        "perplexity": {"int4_kernels_bf16": ppl_k, "dequantized_bf16": ppl_16, "dequantized_f32": ppl_32},
    });
    if kernel_calls == 0 {
        return Err(format!("the W4A16 kernels never ran: {report}"));
    }
    let ppl_err = |p: f64| (p / ppl_32 - 1.0).abs();
    if k_vs_32 < p16_vs_32 - 0.02 || ppl_err(ppl_k) > ppl_err(ppl_16) + 0.005 {
        return Err(format!(
            "the INT4 kernel model is further from the f32 model than the plain bf16 one: {report}"
        ));
    }
    Ok(report)
}

/// SmolLM2's packed model, and the same weights dense (pinned bf16), prefilling 4 windows of
/// 256 tokens of the evaluation text in one batch (1,024 rows per projection) with FP8 prefill
/// (the FP8 GEMM on E4M3 copies of the weights) and with bf16 prefill (the bf16 GEMM on bf16
/// copies), judged by the same weights dequantized into plain burn-cuda in f32. FP8 runs twice:
/// the first prefill's SwiGLU outputs go to the down projections per row and start their
/// delayed scales, the second's in E4M3 with those delayed scales (the one judged; the first is
/// reported). The packed model also runs the prefill that serves (`Llama::prefill_logits`, a
/// window per prefill: the q|k|v epilogue writes the decoder's cache, Stoke's prefill attention
/// reads it) in FP8 and bf16, and both of the packed model's FP8 prefills again with its INT4
/// weights read as they are (`PrefillMode::Fp8Int4`). Each mode is its own copy of the model,
/// prepared with that plan (the output heads stay on bf16 in every plan). Passes when the FP8 GEMM ran, on the same projections in both models
/// (with INT4 weights: on every packed one), every norm's gain was folded into the projections
/// it feeds, FP8's perplexity is within 5% of bf16's, and its top-1 agreement
/// with f32 is at most 0.15 below bf16's, on each path. These bounds catch a broken integration
/// (a wrong scale, layout or epilogue sends perplexity into the hundreds), not FP8's quality
/// cost, which the report carries (measured at 9f354c9 on an H100: packed +1.2%, agreement
/// 0.901 against 0.978; dense +1.9%).
pub fn fp8_prefill_matches_bf16() -> Result<Value, String> {
    use burn::tensor::{Int, Tensor, TensorData};
    use stoke_llama::load::load_gguf_packed;
    use stoke_llama::model::KvCache;
    let (batch, len) = (4usize, 256usize);
    let path = model_path()?;
    let device = Default::default();
    // RoPE for a window and the position after it, which the served prefill's decoder holds.
    let mut packed = load_gguf_packed::<crate::StokeCuda>(&path, &device, DType::BF16, len + 1)
        .map_err(|e| e.to_string())?;
    // Pinned as the main job pins it: the norms' gains too, which FP8 prefill folds.
    packed.model = packed.model.pinned();
    let plain32 = load_gguf::<crate::PlainCuda>(&path, &device, DType::F32, len)
        .map_err(|e| e.to_string())?;
    let ids = eval_ids(&packed)?;
    if ids.len() < batch * (len + 1) {
        return Err(format!("evaluation text has {} tokens", ids.len()));
    }
    let vocab = packed.config.vocab_size;
    fn prefill<B: FusedOps>(
        m: &Llama<B>,
        ids: &[u32],
        (batch, len): (usize, usize),
        dtype: DType,
        device: &B::Device,
    ) -> Vec<f32> {
        let tokens: Vec<i64> = (0..batch)
            .flat_map(|b| {
                ids[b * (len + 1)..b * (len + 1) + len]
                    .iter()
                    .map(|&t| t as i64)
            })
            .collect();
        let t = Tensor::<B, 2, Int>::from_data(TensorData::new(tokens, [batch, len]), device);
        let mut cache = KvCache::for_model(m, batch, len, dtype, device);
        m.forward(t, &vec![len; batch], &mut cache, false)
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("f32 logits")
    }
    // The prefill that serves (`Llama::prefill_logits`: the decoder's cache written by the
    // q|k|v epilogue, Stoke's prefill attention), one window at a time.
    fn prefill_packed<B: FusedOps>(
        m: &Llama<B>,
        ids: &[u32],
        (batch, len): (usize, usize),
        device: &B::Device,
    ) -> Result<Vec<f32>, String> {
        let spec = m.decode_spec(1, len + 1, stoke::KvCacheFormat::Bf16, false);
        let mut dec = stoke::decoder::<B>(spec, DType::BF16, device).map_err(|e| e.to_string())?;
        let mut out = Vec::with_capacity(batch * len);
        for b in 0..batch {
            let window = &ids[b * (len + 1)..b * (len + 1) + len];
            let logits = m
                .prefill_logits(window, &mut dec, stoke_llama::model::PREFILL_CHUNK)
                .map_err(|e| e.to_string())?;
            out.extend(
                logits
                    .into_data()
                    .convert::<f32>()
                    .to_vec::<f32>()
                    .map_err(|e| format!("{e:?}"))?,
            );
        }
        Ok(out)
    }
    // The same weights dense (pinned bf16): their FP8 copies come from the bf16 values.
    let dense = load_gguf::<crate::StokeCuda>(&path, &device, DType::BF16, len)
        .map_err(|e| e.to_string())?
        .model
        .pinned();
    let plan = |prefill| stoke::Plan {
        prefill,
        ..Default::default()
    };
    use stoke::PrefillMode::{Bf16, Fp8, Fp8Int4};
    let (packed_fp8, packed_bf16, packed_int4) = (
        packed.model.clone().prepared(plan(Fp8)),
        packed.model.clone().prepared(plan(Bf16)),
        packed.model.clone().prepared(plan(Fp8Int4)),
    );
    let (dense_fp8, dense_bf16) = (
        dense.clone().prepared(plan(Fp8)),
        dense.clone().prepared(plan(Bf16)),
    );
    let run = |m: &Llama<crate::StokeCuda>| {
        let calls0 = stoke::cuda::prefill_linear::kernel_calls();
        let folded0 = stoke::cuda::prefill_linear::folded_norm_calls();
        let logits = prefill(m, &ids, (batch, len), DType::BF16, &device);
        let calls = stoke::cuda::prefill_linear::kernel_calls() - calls0;
        (
            logits,
            calls,
            stoke::cuda::prefill_linear::folded_norm_calls() - folded0,
        )
    };
    let (fp8_first, _, _) = run(&packed_fp8);
    let (fp8, fp8_calls, folded_calls) = run(&packed_fp8);
    let (bf16, _, _) = run(&packed_bf16);
    run(&dense_fp8);
    let (fp8_dense, fp8_dense_calls, folded_dense_calls) = run(&dense_fp8);
    let (bf16_dense, _, _) = run(&dense_bf16);
    let run_packed = |m: &Llama<crate::StokeCuda>| {
        let folded0 = stoke::cuda::prefill_linear::folded_norm_calls();
        let logits = prefill_packed(m, &ids, (batch, len), &device);
        (
            logits,
            stoke::cuda::prefill_linear::folded_norm_calls() - folded0,
        )
    };
    let (served_fp8, served_folded) = run_packed(&packed_fp8);
    let (served_bf16, _) = run_packed(&packed_bf16);
    // The packed weights read as they are by the FP8 GEMM (no E4M3 copy): the same windows,
    // and served (the q|k|v epilogue on the INT4 weight).
    let int4_calls0 = stoke::cuda::prefill_linear::int4_kernel_calls();
    let (int4, int4_all_calls, _) = run(&packed_int4);
    let int4_calls = stoke::cuda::prefill_linear::int4_kernel_calls() - int4_calls0;
    let (served_int4, _) = run_packed(&packed_int4);
    // The delayed scales of the FP8 models' gate|up weights.
    let delayed: Vec<stoke_formats::fp8::DelayedScale> = [&packed_fp8, &dense_fp8]
        .iter()
        .flat_map(|m| m.layers.iter())
        .filter_map(|l| {
            let w = l.mlp.gate_up_proj.weight.val().into_primitive().tensor();
            stoke::cuda::prefill_linear::delayed_scale(&w)
        })
        .collect::<Result<_, _>>()?;
    let saturated: u64 = delayed.iter().map(|d| d.saturated).sum();
    let f32 = prefill(&plain32.model, &ids, (batch, len), DType::F32, &device);
    // Mean NLL of the next token and top-1 agreement with f32, per model.
    let argmax = stoke_formats::sample::argmax;
    let judge = |logits: &[f32]| {
        let (mut nll, mut agree) = (0f64, 0usize);
        for (r, row) in logits.chunks(vocab).enumerate() {
            let (b, s) = (r / len, r % len);
            let row64: Vec<f64> = row.iter().map(|&v| f64::from(v)).collect();
            nll -= log_softmax_at(&row64, ids[b * (len + 1) + s + 1] as usize);
            agree += usize::from(argmax(row) == argmax(&f32[r * vocab..(r + 1) * vocab]));
        }
        let rows = (batch * len) as f64;
        ((nll / rows).exp(), agree as f64 / rows)
    };
    let ((p8, a8), (p16, a16), (p32, _)) = (judge(&fp8), judge(&bf16), judge(&f32));
    let ((d8, da8), (d16, da16)) = (judge(&fp8_dense), judge(&bf16_dense));
    let (p8_first, a8_first) = judge(&fp8_first);
    let ((s8, sa8), (s16, sa16)) = (judge(&served_fp8?), judge(&served_bf16?));
    let ((i8, ia8), (si8, sia8)) = (judge(&int4), judge(&served_int4?));
    let report = json!({"batch": batch, "len": len, "fp8_gemm_calls": fp8_calls,
        "folded_norm_calls": folded_calls,
        "perplexity": {"fp8": p8, "bf16": p16, "f32": p32, "fp8_first_per_row": p8_first},
        "delayed_scales": delayed.len(), "delayed_saturated": saturated,
        "fp8_first_top1_agreement_with_f32": a8_first,
        "fp8_over_bf16": p8 / p16 - 1.0,
        "top1_agreement_with_f32": {"fp8": a8, "bf16": a16},
        "dense": {"fp8_gemm_calls": fp8_dense_calls, "folded_norm_calls": folded_dense_calls,
            "perplexity": {"fp8": d8, "bf16": d16}, "fp8_over_bf16": d8 / d16 - 1.0,
            "top1_agreement_with_f32": {"fp8": da8, "bf16": da16}},
        "served_prefill": {"folded_norm_calls": served_folded,
            "perplexity": {"fp8": s8, "bf16": s16}, "fp8_over_bf16": s8 / s16 - 1.0,
            "top1_agreement_with_f32": {"fp8": sa8, "bf16": sa16}},
        "fp8_int4": {"gemm_calls": int4_all_calls, "int4_weight_calls": int4_calls,
            "perplexity": i8, "over_bf16": i8 / p16 - 1.0, "top1_agreement_with_f32": ia8,
            "served": {"perplexity": si8, "over_bf16": si8 / s16 - 1.0,
                "top1_agreement_with_f32": sia8}}});
    // Every packed projection (the same calls as the E4M3 copies') on the INT4 weights.
    if int4_calls == 0 || int4_calls != fp8_calls || int4_all_calls != fp8_calls {
        return Err(format!(
            "the FP8 GEMM did not read every packed weight as it is: {report}"
        ));
    }
    if fp8_calls == 0 || fp8_dense_calls == 0 {
        return Err(format!("the FP8 GEMM never ran: {report}"));
    }
    // Half the projections (q|k|v and gate|up of each layer) read a norm's input with its gain
    // folded into their E4M3 copy; in the served prefill too (one prefill per window).
    if 2 * folded_calls != fp8_calls
        || 2 * folded_dense_calls != fp8_dense_calls
        || served_folded != batch as u64 * folded_calls
    {
        return Err(format!(
            "the norms' gains were not folded into every projection they feed: {report}"
        ));
    }
    // The same projections on both models; the dense model's output head is a pinned bf16
    // weight the FP8 GEMM would take, but `stoke::output_head` keeps it on bf16.
    if fp8_dense_calls != fp8_calls {
        return Err(format!("the output head ran on the FP8 GEMM: {report}"));
    }
    let strays = |p8: f64, p16: f64, a8: f64, a16: f64| {
        !((p8 / p16 - 1.0).abs() <= 0.05) || !(a8 >= a16 - 0.15)
    };
    if strays(p8, p16, a8, a16)
        || strays(d8, d16, da8, da16)
        || strays(s8, s16, sa8, sa16)
        || strays(i8, p16, ia8, a16)
        || strays(si8, s16, sia8, sa16)
    {
        return Err(format!("FP8 prefill strays from bf16: {report}"));
    }
    Ok(report)
}
