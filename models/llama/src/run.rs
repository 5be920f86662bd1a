//! Running requests to completion on the engine (`stoke_engine::Engine`): the main job, the
//! benchmark, the fine-tune-then-serve pipeline and the tests all go through [`complete`],
//! which adds the requests and steps the engine until every one has finished, streaming each
//! one's text as it comes.

use std::time::{Duration, Instant};
use stoke::{FusedOps, TokenLogprobs};
use stoke_engine::{Detokenize, Engine, EngineError, EngineModel, Event, FinishReason, Params};
use tokenizers::Tokenizer;

/// A tokenizer as the engine's detokenizer.
pub struct TokenizerText(pub Tokenizer);

impl Detokenize for TokenizerText {
    fn decode(&self, ids: &[u32]) -> String {
        self.0.decode(ids, false).unwrap_or_default()
    }
}

/// Wraps a user message in the ChatML template (`<|im_start|>user ... <|im_start|>assistant`).
pub fn chatml(prompt: &str) -> String {
    format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
}

/// One request's result.
#[derive(Clone, Debug)]
pub struct Completion {
    pub prompt_tokens: usize,
    /// The generated tokens (a stop token not included).
    pub tokens: Vec<u32>,
    /// Their text, up to a stop string.
    pub text: String,
    pub finish: FinishReason,
    /// From the call's start to the request's first token on the host.
    pub first_token: Duration,
    /// Each token's log-probabilities, where the request asked for them.
    pub logprobs: Vec<TokenLogprobs>,
}

/// What a [`complete`] call took.
#[derive(Clone, Debug, Default)]
pub struct RunStats {
    /// From the start to the first token of any request on the host.
    pub first_token: Duration,
    /// From the start to the last request's end.
    pub wall: Duration,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Engine steps taken.
    pub steps: usize,
}

impl RunStats {
    /// Prompt tokens per second up to the first token.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.first_token.as_secs_f64().max(1e-9)
    }

    /// Tokens after each request's first, per second after the first token.
    pub fn decode_tokens_per_s(&self, requests: usize) -> f64 {
        let after = self.generated_tokens.saturating_sub(requests);
        after as f64 / (self.wall - self.first_token).as_secs_f64().max(1e-9)
    }
}

/// Adds `prompts` to `engine` (request `i` with `params[i]`, or the last of `params` where
/// there are fewer) and steps it until all have finished; `on_text(i, piece)` gets each piece
/// of request `i`'s text as soon as it is final (whole characters, stop strings cut).
pub fn complete<B: FusedOps, M: EngineModel<B>>(
    engine: &mut Engine<B, M>,
    prompts: Vec<Vec<u32>>,
    params: &[Params],
    mut on_text: impl FnMut(usize, &str),
) -> Result<(Vec<Completion>, RunStats), EngineError> {
    let t0 = Instant::now();
    let n = prompts.len();
    let mut stats = RunStats {
        prompt_tokens: prompts.iter().map(Vec::len).sum(),
        ..Default::default()
    };
    let mut index = std::collections::HashMap::new();
    let mut out: Vec<Option<Completion>> = vec![None; n];
    let mut partial: Vec<Completion> = Vec::with_capacity(n);
    for (i, p) in prompts.into_iter().enumerate() {
        let par = params.get(i).or(params.last()).cloned().unwrap_or_default();
        partial.push(Completion {
            prompt_tokens: p.len(),
            tokens: Vec::new(),
            text: String::new(),
            finish: FinishReason::MaxTokens,
            first_token: Duration::ZERO,
            logprobs: Vec::new(),
        });
        let id = engine.add(p, par)?;
        index.insert(id, i);
    }
    let mut seen_first = false;
    while out.iter().any(Option::is_none) {
        let events = engine.step()?;
        stats.steps += 1;
        for e in events {
            match e {
                Event::Token {
                    id,
                    token,
                    text,
                    logprobs,
                } => {
                    let Some(&i) = index.get(&id) else { continue };
                    let c = &mut partial[i];
                    if c.tokens.is_empty() {
                        c.first_token = t0.elapsed();
                        if !seen_first {
                            stats.first_token = c.first_token;
                            seen_first = true;
                        }
                    }
                    c.tokens.push(token);
                    c.logprobs.extend(logprobs);
                    if !text.is_empty() {
                        on_text(i, &text);
                        c.text.push_str(&text);
                    }
                    stats.generated_tokens += 1;
                }
                Event::Finished {
                    id, text, reason, ..
                } => {
                    let Some(&i) = index.get(&id) else { continue };
                    if !text.is_empty() {
                        on_text(i, &text);
                        partial[i].text.push_str(&text);
                    }
                    if !seen_first {
                        stats.first_token = t0.elapsed();
                        seen_first = true;
                    }
                    let mut c = partial[i].clone();
                    c.finish = reason;
                    if c.tokens.is_empty() {
                        c.first_token = t0.elapsed();
                    }
                    out[i] = Some(c);
                }
            }
        }
    }
    stats.wall = t0.elapsed();
    Ok((
        out.into_iter().map(|c| c.expect("all finished")).collect(),
        stats,
    ))
}

/// Why [`generate`] could not run.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("tokenizing prompt {index}: {reason}")]
    Tokenizer { index: usize, reason: String },
    #[error("prompt {index} is empty after tokenization")]
    EmptyPrompt { index: usize },
    #[error("{0}")]
    Engine(#[from] EngineError),
}

/// How [`generate`] sizes its engine (the KV cache format is the model's plan's).
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Tokens per prompt at most (prompt and output); the pool holds every prompt's whole
    /// context at once.
    pub context: usize,
    pub eager: bool,
    /// The model's end-of-sequence tokens.
    pub eos: Vec<u32>,
}

/// Tokenizes `prompts` and generates for all of them at once on an engine made for them
/// (every prompt in a lane of its own), each with `params`; see [`complete`].
pub fn generate<B: FusedOps>(
    model: &crate::model::Llama<B>,
    tokenizer: &Tokenizer,
    prompts: &[String],
    params: &Params,
    opts: &GenerateOptions,
    on_text: impl FnMut(usize, &str),
) -> Result<(Vec<Completion>, RunStats), GenerateError> {
    let mut ids = Vec::with_capacity(prompts.len());
    for (index, p) in prompts.iter().enumerate() {
        let e = tokenizer
            .encode(p.as_str(), false)
            .map_err(|e| GenerateError::Tokenizer {
                index,
                reason: e.to_string(),
            })?;
        if e.get_ids().is_empty() {
            return Err(GenerateError::EmptyPrompt { index });
        }
        ids.push(e.get_ids().to_vec());
    }
    let n = ids.len().max(1);
    let page = stoke::DEFAULT_PAGE_SIZE;
    let mut engine = Engine::new(
        model,
        stoke_engine::EngineConfig {
            max_running: n.min(stoke::cuda::decoder::MAX_LANES),
            context: opts.context,
            kv_pages: Some(n * opts.context.div_ceil(page) + 1),
            max_prefill_tokens: crate::model::PREFILL_CHUNK,
            eager: opts.eager,
            eos: opts.eos.clone(),
            ..Default::default()
        },
        Some(std::sync::Arc::new(TokenizerText(tokenizer.clone()))),
    )?;
    Ok(complete(
        &mut engine,
        ids,
        std::slice::from_ref(params),
        on_text,
    )?)
}
