//! A llama-bench-shaped benchmark of a loaded model: prefill tokens/s at prompt lengths
//! (`pp128`, `pp512`, ...) and decode tokens/s at batch sizes (`tg128` at batch 1, 8, 32), each
//! the median of repetitions with their spread, on whatever backend the model is loaded on.
//!
//! Prompts are random token ids from a seeded generator (the same ids for every backend, so
//! two backends compare on the same work). A prefill point times `Llama::prefill` of one
//! prompt up to its first sampled token on the host. A decode point prefills `batch` prompts
//! of `decode_prompt` tokens, runs one warm-up step (on `Stoke<Cuda>` the step's capture), and
//! times `decode_tokens` steps up to the last step's ids on the host.

use crate::generate::GenerateError;
use crate::model::Llama;
use burn::tensor::DType;
use rand::{Rng, SeedableRng};
use std::time::Instant;
use stoke::FusedOps;

#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Prompt lengths of the prefill points.
    pub prompt_lens: Vec<usize>,
    /// Batch sizes of the decode points.
    pub batches: Vec<usize>,
    /// Steps timed at each decode point.
    pub decode_tokens: usize,
    /// Prompt length before the timed decode steps.
    pub decode_prompt: usize,
    /// Timed repetitions of each point (after one untimed warm-up).
    pub reps: usize,
    pub kv_cache: stoke::KvCacheFormat,
    pub eager: bool,
    pub seed: u64,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            prompt_lens: vec![128, 512, 2048],
            batches: vec![1, 8, 32],
            decode_tokens: 128,
            decode_prompt: 16,
            reps: 5,
            kv_cache: stoke::KvCacheFormat::Bf16,
            eager: false,
            seed: 1,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Prefill,
    Decode,
}

/// One point: tokens/s of each repetition and their summary.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Point {
    /// llama-bench's name: `pp512`, `tg128`.
    pub test: String,
    pub kind: Kind,
    pub batch: usize,
    /// Prompt tokens per sequence (prefill), or tokens before the timed steps (decode).
    pub prompt: usize,
    /// Tokens per sequence the point produces: the prompt (prefill) or the decode steps.
    pub tokens: usize,
    pub tokens_per_s: Vec<f64>,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub stddev: f64,
}

impl Point {
    fn new(
        test: String,
        kind: Kind,
        batch: usize,
        prompt: usize,
        tokens: usize,
        s: Vec<f64>,
    ) -> Self {
        let mut sorted = s.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n == 0 {
            0.0
        } else if n % 2 == 1 {
            sorted[n / 2]
        } else {
            0.5 * (sorted[n / 2 - 1] + sorted[n / 2])
        };
        let mean = s.iter().sum::<f64>() / n.max(1) as f64;
        let var = s.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n.max(2) - 1) as f64;
        Self {
            test,
            kind,
            batch,
            prompt,
            tokens,
            median,
            min: sorted.first().copied().unwrap_or(0.0),
            max: sorted.last().copied().unwrap_or(0.0),
            stddev: var.sqrt(),
            tokens_per_s: s,
        }
    }
}

/// Runs every point of `cfg` on `model`. `progress(point_name, done, total)` is called before
/// each timed or warm-up run.
pub fn run<B: FusedOps>(
    model: &Llama<B>,
    cfg: &BenchConfig,
    dtype: DType,
    device: &B::Device,
    mut progress: impl FnMut(&str, usize, usize),
) -> Result<Vec<Point>, GenerateError> {
    let vocab = model.embed_tokens.dims()[0] as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
    let mut prompt =
        |len: usize| -> Vec<u32> { (0..len).map(|_| rng.random_range(0..vocab)).collect() };
    let total = (cfg.prompt_lens.len() + cfg.batches.len()) * (cfg.reps + 1);
    let mut done = 0;
    let mut points = Vec::new();
    let sampling = stoke::Sampling::GREEDY;
    for &len in &cfg.prompt_lens {
        let name = format!("pp{len}");
        let ids = prompt(len);
        let spec = model.decode_spec(1, len + 1, cfg.kv_cache, sampling, cfg.eager);
        let mut dec = stoke::decoder::<B>(spec, dtype, device)?;
        let mut samples = Vec::with_capacity(cfg.reps);
        for rep in 0..=cfg.reps {
            progress(&name, done, total);
            done += 1;
            let t = Instant::now();
            model.prefill(std::slice::from_ref(&ids), &mut dec)?;
            stoke::decode_take_ids::<B>(&mut dec).expect("the prefill sampled");
            let s = t.elapsed().as_secs_f64();
            if rep > 0 {
                samples.push(len as f64 / s);
            }
        }
        points.push(Point::new(name, Kind::Prefill, 1, len, len, samples));
    }
    for &batch in &cfg.batches {
        let name = format!("tg{} b{batch}", cfg.decode_tokens);
        let prompts: Vec<Vec<u32>> = (0..batch).map(|_| prompt(cfg.decode_prompt)).collect();
        let capacity = cfg.decode_prompt + cfg.decode_tokens + 2;
        let spec = model.decode_spec(batch, capacity, cfg.kv_cache, sampling, cfg.eager);
        let mut dec = stoke::decoder::<B>(spec, dtype, device)?;
        let mut samples = Vec::with_capacity(cfg.reps);
        for rep in 0..=cfg.reps {
            progress(&name, done, total);
            done += 1;
            model.prefill(&prompts, &mut dec)?;
            stoke::decode_take_ids::<B>(&mut dec).expect("the prefill sampled");
            // The warm-up step (tuning, module loads, the step's capture) is not timed.
            stoke::decode_step::<B>(&mut dec, &mut |d| model.decode_forward(d))?;
            stoke::decode_take_ids::<B>(&mut dec).expect("a step was queued");
            let t = Instant::now();
            for step in 0..cfg.decode_tokens {
                stoke::decode_step::<B>(&mut dec, &mut |d| model.decode_forward(d))?;
                // Ids are taken one step late, as generation does.
                if step > 0 {
                    stoke::decode_take_ids::<B>(&mut dec).expect("a step was queued");
                }
            }
            stoke::decode_take_ids::<B>(&mut dec).expect("a step was queued");
            let s = t.elapsed().as_secs_f64();
            if rep > 0 {
                samples.push((batch * cfg.decode_tokens) as f64 / s);
            }
        }
        points.push(Point::new(
            name,
            Kind::Decode,
            batch,
            cfg.decode_prompt,
            cfg.decode_tokens,
            samples,
        ));
    }
    progress("", done, total);
    Ok(points)
}
