//! Text generation: batched prompts, greedy or sampled decoding (temperature, top-k, top-p,
//! repetition penalty, seed), stop on EOS or stop strings, streaming of decoded text.
//!
//! The prompts are prefilled as one batch into a decoder (`stoke::decoder`), which samples each
//! sequence's first token; every further token comes from one decode step (the model's
//! `decode_forward`, replayed as a CUDA graph on `Stoke<Cuda>`). The host queues step `t + 1`
//! before it takes the ids of step `t`, so the GPU never waits for the host: stop conditions
//! are seen one step late, and the extra step's tokens are dropped.

use crate::model::Llama;
use burn::tensor::DType;
use std::time::{Duration, Instant};
use stoke::FusedOps;
use tokenizers::Tokenizer;

#[derive(Clone, Debug)]
pub struct SamplingConfig {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    /// 1.0 means none; > 1 discourages tokens already in the sequence.
    pub repetition_penalty: f32,
    pub seed: u64,
    pub max_new_tokens: usize,
    pub stop_strings: Vec<String>,
    pub eos_token_ids: Vec<u32>,
    /// The format of the KV cache decode attention reads.
    pub kv_cache: stoke::KvCacheFormat,
    /// Run each decode step as it is queued, without CUDA graphs.
    pub eager: bool,
}

impl SamplingConfig {
    /// The decoder's sampling parameters.
    pub fn sampling(&self) -> stoke::Sampling {
        stoke::Sampling {
            temperature: self.temperature,
            top_k: self.top_k.unwrap_or(0) as u32,
            top_p: self.top_p.unwrap_or(1.0),
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
        }
    }
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            repetition_penalty: 1.0,
            seed: 0,
            max_new_tokens: 64,
            stop_strings: vec![],
            eos_token_ids: vec![],
            kv_cache: stoke::KvCacheFormat::Bf16,
            eager: false,
        }
    }
}

/// Why a sequence stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Eos,
    StopString,
    MaxTokens,
}

#[derive(Clone, Debug)]
pub struct Output {
    pub prompt_tokens: usize,
    pub tokens: Vec<u32>,
    pub text: String,
    pub stop: StopReason,
}

#[derive(Clone, Debug, Default)]
pub struct Timings {
    /// From the start of the prefill to the first tokens on the host (time to first token).
    pub prefill: Duration,
    pub prefill_tokens: usize,
    pub decode: Duration,
    pub decode_steps: usize,
    pub decode_tokens: usize,
}

impl Timings {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prefill_tokens as f64 / self.prefill.as_secs_f64().max(1e-9)
    }
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.decode_tokens as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("prompt {index} is empty after tokenization")]
    EmptyPrompt { index: usize },
    #[error(
        "prompt {index} has {tokens} tokens; with {max_new} new tokens that exceeds the context of {context}"
    )]
    TooLong {
        index: usize,
        tokens: usize,
        max_new: usize,
        context: usize,
    },
    #[error("decoder: {0}")]
    Decode(#[from] stoke::DecodeError),
}

/// Wraps a user message in the ChatML template (`<|im_start|>user ... <|im_start|>assistant`).
pub fn chatml(prompt: &str) -> String {
    format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
}

/// Generates a completion for each prompt, as one batch. `on_text(i, piece)` receives decoded
/// text of sequence `i` as soon as it is complete (whole UTF-8 characters, stop strings cut).
#[allow(clippy::too_many_arguments)]
pub fn generate<B: FusedOps>(
    model: &Llama<B>,
    tokenizer: &Tokenizer,
    prompts: &[String],
    cfg: &SamplingConfig,
    context: usize,
    dtype: DType,
    device: &B::Device,
    mut on_text: impl FnMut(usize, &str),
) -> Result<(Vec<Output>, Timings), GenerateError> {
    let encoded: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            tokenizer
                .encode(p.as_str(), false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| GenerateError::Tokenizer(e.to_string()))
        })
        .collect::<Result<_, _>>()?;
    for (index, e) in encoded.iter().enumerate() {
        if e.is_empty() {
            return Err(GenerateError::EmptyPrompt { index });
        }
        if e.len() + cfg.max_new_tokens > context {
            return Err(GenerateError::TooLong {
                index,
                tokens: e.len(),
                max_new: cfg.max_new_tokens,
                context,
            });
        }
    }
    let b = prompts.len();
    let spec = model.decode_spec(b, context, cfg.kv_cache, cfg.sampling(), cfg.eager);
    let mut dec = stoke::decoder::<B>(spec, dtype, device)?;
    let mut generated: Vec<Vec<u32>> = vec![vec![]; b];
    let mut emitted: Vec<usize> = vec![0; b];
    let mut done: Vec<Option<StopReason>> = vec![None; b];
    let mut timings = Timings {
        prefill_tokens: encoded.iter().map(Vec::len).sum(),
        ..Default::default()
    };

    let t0 = Instant::now();
    model.prefill(&encoded, &mut dec)?;
    let mut step = 0;
    let mut decode_start = t0;
    loop {
        // Queue the next step before waiting for this one's ids (it reads them on the device);
        // the first token is taken as soon as the prefill has it, before the first step (which
        // also warms up: loads and tunes kernels, captures the step).
        let more = step + 1 < cfg.max_new_tokens;
        if more && step > 0 {
            stoke::decode_step::<B>(&mut dec, &mut |d| model.decode_forward(d))?;
        }
        let ids = stoke::decode_take_ids::<B>(&mut dec).expect("a sampling was queued");
        if step == 0 {
            timings.prefill = t0.elapsed();
            decode_start = Instant::now();
            if more {
                stoke::decode_step::<B>(&mut dec, &mut |d| model.decode_forward(d))?;
            }
        } else {
            timings.decode_steps += 1;
            timings.decode_tokens += done.iter().filter(|d| d.is_none()).count();
        }
        for i in 0..b {
            if done[i].is_some() {
                continue;
            }
            let t = ids[i];
            if cfg.eos_token_ids.contains(&t) {
                done[i] = Some(StopReason::Eos);
            } else {
                generated[i].push(t);
            }
            let text = tokenizer
                .decode(&generated[i], false)
                .map_err(|e| GenerateError::Tokenizer(e.to_string()))?;
            let mut end = text.len();
            if let Some(pos) = cfg
                .stop_strings
                .iter()
                .filter_map(|s| text.find(s.as_str()))
                .min()
            {
                end = pos;
                done[i] = Some(StopReason::StopString);
            } else if done[i].is_none() && generated[i].len() >= cfg.max_new_tokens {
                done[i] = Some(StopReason::MaxTokens);
            }
            // Hold back an incomplete UTF-8 character (decoded as U+FFFD) and any tail that
            // could still grow into a stop string.
            let mut safe = end;
            if done[i].is_none() {
                if text.ends_with('\u{FFFD}') {
                    safe = text.trim_end_matches('\u{FFFD}').len();
                }
                for s in &cfg.stop_strings {
                    for k in (1..s.len()).rev() {
                        if s.is_char_boundary(k) && text[..safe].ends_with(&s[..k]) {
                            safe = safe.min(text[..safe].len() - k);
                            break;
                        }
                    }
                }
            }
            if safe > emitted[i] && text.is_char_boundary(safe) && text.is_char_boundary(emitted[i])
            {
                on_text(i, &text[emitted[i]..safe]);
                emitted[i] = safe;
            }
        }
        step += 1;
        if done.iter().all(Option::is_some) || !more {
            // The step queued past the end (if any) is taken so the decoder is idle.
            if more {
                let _ = stoke::decode_take_ids::<B>(&mut dec);
            }
            break;
        }
    }
    timings.decode = decode_start.elapsed();
    let outputs = (0..b)
        .map(|i| {
            let text = tokenizer.decode(&generated[i], false).unwrap_or_default();
            let end = cfg
                .stop_strings
                .iter()
                .filter_map(|s| text.find(s.as_str()))
                .min()
                .unwrap_or(text.len());
            Output {
                prompt_tokens: encoded[i].len(),
                tokens: generated[i].clone(),
                text: text[..end].to_string(),
                stop: done[i].unwrap_or(StopReason::MaxTokens),
            }
        })
        .collect();
    Ok((outputs, timings))
}
