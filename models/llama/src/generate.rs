//! Text generation: batched prompts, greedy or sampled decoding (temperature, top-k, top-p,
//! repetition penalty, seed), stop on EOS or stop strings, streaming of decoded text.

use crate::model::{KvCache, Llama};
use burn::tensor::{DType, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng, rngs::StdRng};
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
}

/// Picks the next token from `logits` (one sequence), given the tokens so far.
pub fn sample(logits: &mut [f32], history: &[u32], cfg: &SamplingConfig, rng: &mut StdRng) -> u32 {
    if cfg.repetition_penalty != 1.0 {
        for &t in history {
            let l = &mut logits[t as usize];
            *l = if *l > 0.0 {
                *l / cfg.repetition_penalty
            } else {
                *l * cfg.repetition_penalty
            };
        }
    }
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0 as u32
    };
    if cfg.temperature <= 0.0 {
        return argmax();
    }
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_unstable_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    if let Some(k) = cfg.top_k {
        idx.truncate(k.max(1));
    }
    let max = logits[idx[0]];
    let mut probs: Vec<f64> = idx
        .iter()
        .map(|&i| (((logits[i] - max) / cfg.temperature) as f64).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if let Some(p) = cfg.top_p {
        let mut acc = 0.0;
        let keep = probs.iter().position(|&q| {
            acc += q;
            acc >= p as f64
        });
        let keep = keep.map_or(probs.len(), |k| k + 1);
        probs.truncate(keep);
        idx.truncate(keep);
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
    }
    let mut r = rng.random::<f64>();
    for (i, p) in idx.iter().zip(&probs) {
        if r < *p {
            return *i as u32;
        }
        r -= p;
    }
    idx[probs.len() - 1] as u32
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
    let longest = encoded.iter().map(Vec::len).max().unwrap_or(0);
    let mut cache = KvCache::<B>::for_model(model, b, context, dtype, device);
    let mut rngs: Vec<StdRng> = (0..b)
        .map(|i| StdRng::seed_from_u64(cfg.seed.wrapping_add(i as u64)))
        .collect();
    let mut generated: Vec<Vec<u32>> = vec![vec![]; b];
    let mut emitted: Vec<usize> = vec![0; b];
    let mut done: Vec<Option<StopReason>> = vec![None; b];
    let mut timings = Timings {
        prefill_tokens: encoded.iter().map(Vec::len).sum(),
        ..Default::default()
    };

    // Prefill: all prompts at once, padded to the longest, each with its own length.
    let mut flat = Vec::with_capacity(b * longest);
    for e in &encoded {
        flat.extend(e.iter().map(|&t| t as i64));
        flat.extend(std::iter::repeat_n(0i64, longest - e.len()));
    }
    let mut tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(flat, [b, longest]), device);
    let mut new_lens: Vec<usize> = encoded.iter().map(Vec::len).collect();
    let mut step = 0;
    loop {
        let t0 = Instant::now();
        let logits = model.forward(tokens, &new_lens, &mut cache, true);
        let host = logits
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("f32 logits");
        if step == 0 {
            timings.prefill = t0.elapsed();
        } else {
            timings.decode += t0.elapsed();
            timings.decode_steps += 1;
            timings.decode_tokens += done.iter().filter(|d| d.is_none()).count();
        }
        let vocab = host.len() / b;
        let mut next = Vec::with_capacity(b);
        for i in 0..b {
            if done[i].is_some() {
                next.push(0i64);
                continue;
            }
            let mut row = host[i * vocab..(i + 1) * vocab].to_vec();
            let history: Vec<u32> = encoded[i].iter().chain(&generated[i]).copied().collect();
            let t = sample(&mut row, &history, cfg, &mut rngs[i]);
            next.push(t as i64);
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
        if done.iter().all(Option::is_some) {
            break;
        }
        tokens = Tensor::from_data(TensorData::new(next, [b, 1]), device);
        new_lens = done.iter().map(|d| usize::from(d.is_none())).collect();
    }
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
