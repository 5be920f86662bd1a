//! A llama-bench-shaped benchmark of a loaded model: prefill tokens/s at prompt lengths
//! (`pp128`, `pp512`, ...) and of packed mixes of prompts (`pp2048+7x128`: one prompt of 2048
//! tokens and seven of 128 in one packed prefill), and decode tokens/s at batch sizes (`tg128`
//! at batch 1, 8, 32), each the median of repetitions with their spread, on whatever backend
//! the model is loaded on.
//!
//! Every point runs on the engine (`stoke_engine::Engine`), as serving does. Prompts are random
//! token ids from a seeded generator (the same ids for every backend, so two backends compare on
//! the same work). A prefill point times its prompts, added together, up to their first tokens
//! on the host (one packed prefill). A decode point adds `batch` requests of `decode_prompt`
//! tokens and times the `decode_tokens` steps after each has its first two tokens (the
//! prefill's and one warm-up step's: on `Stoke<Cuda>` the step's capture), up to the last
//! token on the host.

use crate::model::Llama;
use crate::run::complete;
use rand::{Rng, SeedableRng};
use std::time::Instant;
use stoke::FusedOps;
use stoke_engine::{Engine, EngineConfig, EngineError, Event, Params};

#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Prompt lengths of the prefill points.
    pub prompt_lens: Vec<usize>,
    /// Prompt lengths of the packed prefill points, one list per point.
    pub prefill_mixes: Vec<Vec<usize>>,
    /// Batch sizes of the decode points.
    pub batches: Vec<usize>,
    /// Steps timed at each decode point.
    pub decode_tokens: usize,
    /// Prompt length before the timed decode steps.
    pub decode_prompt: usize,
    /// Timed repetitions of each point (after one untimed warm-up).
    pub reps: usize,
    pub eager: bool,
    pub seed: u64,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            prompt_lens: vec![128, 512, 2048],
            prefill_mixes: default_mixes(),
            batches: vec![1, 8, 32],
            decode_tokens: 128,
            decode_prompt: 16,
            reps: 5,
            eager: false,
            seed: 1,
        }
    }
}

/// One long prompt with seven short ones, and the same tokens as eight equal prompts: packed
/// prefill should run both at the same rate.
pub fn default_mixes() -> Vec<Vec<usize>> {
    let mut long_short = vec![2048];
    long_short.extend([128; 7]);
    vec![long_short, vec![368; 8]]
}

/// A mix's name: runs of equal lengths as `countxlen`, joined by `+` (`2048+7x128`).
pub fn mix_name(lens: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < lens.len() {
        let n = lens[i..].iter().take_while(|&&l| l == lens[i]).count();
        parts.push(if n == 1 {
            lens[i].to_string()
        } else {
            format!("{n}x{}", lens[i])
        });
        i += n;
    }
    parts.join("+")
}

/// Parses a mix name back into its lengths (`2048+7x128`).
pub fn parse_mix(s: &str) -> Result<Vec<usize>, String> {
    let mut lens = Vec::new();
    for part in s.split('+') {
        let (n, len) = match part.split_once('x') {
            Some((n, len)) => (n.trim().parse::<usize>(), len.trim().parse::<usize>()),
            None => (Ok(1), part.trim().parse::<usize>()),
        };
        match (n, len) {
            (Ok(n), Ok(len)) if n > 0 && len > 0 => lens.extend(std::iter::repeat_n(len, n)),
            _ => {
                return Err(format!(
                    "prompt mix {s:?}: expected lengths like 2048+7x128, got {part:?}"
                ));
            }
        }
    }
    Ok(lens)
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
    /// Prompt tokens per sequence (prefill; a mix's longest prompt), or tokens before the
    /// timed steps (decode).
    pub prompt: usize,
    /// Tokens the point produces: the prompt (prefill; a mix's prompts together) or the decode
    /// steps per sequence.
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

/// An engine over `model` for one benchmark point: `lanes` requests of up to `context` tokens,
/// the prompts' pages private (no prefix sharing: every repetition computes its prompts), the
/// whole of a point's prompts in one prefill chunk.
fn engine<'m, B: FusedOps>(
    model: &'m Llama<B>,
    cfg: &BenchConfig,
    lanes: usize,
    context: usize,
    prefill: usize,
) -> Result<Engine<B, &'m Llama<B>>, EngineError> {
    Engine::new(
        model,
        EngineConfig {
            max_running: lanes,
            context,
            kv_pages: Some(lanes * context.div_ceil(stoke::DEFAULT_PAGE_SIZE) + 1),
            max_prefill_tokens: prefill.max(1),
            prefix_caching: false,
            eager: cfg.eager,
            ..Default::default()
        },
        None,
    )
}

/// Runs every point of `cfg` on `model`, each on the engine (`stoke_engine::Engine`).
/// `progress(point_name, done, total)` is called before each timed or warm-up run.
pub fn run<B: FusedOps>(
    model: &Llama<B>,
    cfg: &BenchConfig,
    mut progress: impl FnMut(&str, usize, usize),
) -> Result<Vec<Point>, EngineError> {
    let vocab = model.embed_tokens.dims()[0] as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
    let mut prompt =
        |len: usize| -> Vec<u32> { (0..len).map(|_| rng.random_range(0..vocab)).collect() };
    let points = cfg.prompt_lens.len() + cfg.prefill_mixes.len() + cfg.batches.len();
    let total = points * (cfg.reps + 1);
    let mut done = 0;
    let mut points = Vec::new();
    // One prompt per `prompt_lens` point, then the packed mixes: each one packed prefill up to
    // every prompt's first token.
    let singles = cfg.prompt_lens.iter().map(|&len| vec![len]);
    for lens in singles.chain(cfg.prefill_mixes.iter().cloned()) {
        let name = format!("pp{}", mix_name(&lens));
        let prompts: Vec<Vec<u32>> = lens.iter().map(|&n| prompt(n)).collect();
        let tokens: usize = lens.iter().sum();
        let longest = lens.iter().max().copied().unwrap_or(0);
        let mut eng = engine(model, cfg, lens.len(), longest + 2, tokens)?;
        let params = [Params {
            ignore_eos: true,
            ..Params::greedy(1)
        }];
        let mut samples = Vec::with_capacity(cfg.reps);
        for rep in 0..=cfg.reps {
            progress(&name, done, total);
            done += 1;
            let (_, s) = complete(&mut eng, prompts.clone(), &params, |_, _| {})?;
            if rep > 0 {
                samples.push(tokens as f64 / s.wall.as_secs_f64());
            }
        }
        points.push(Point::new(
            name,
            Kind::Prefill,
            lens.len(),
            longest,
            tokens,
            samples,
        ));
    }
    for &batch in &cfg.batches {
        let name = format!("tg{} b{batch}", cfg.decode_tokens);
        let prompts: Vec<Vec<u32>> = (0..batch).map(|_| prompt(cfg.decode_prompt)).collect();
        // The prefill's token, one warm-up step (module loads, tuning, the step's capture),
        // then the timed steps.
        let max_tokens = cfg.decode_tokens + 2;
        let mut eng = engine(
            model,
            cfg,
            batch,
            cfg.decode_prompt + max_tokens,
            batch * cfg.decode_prompt,
        )?;
        let params = Params {
            ignore_eos: true,
            ..Params::greedy(max_tokens)
        };
        let mut samples = Vec::with_capacity(cfg.reps);
        for rep in 0..=cfg.reps {
            progress(&name, done, total);
            done += 1;
            for p in &prompts {
                eng.add(p.clone(), params.clone())?;
            }
            // Steps until every request has its first two tokens; the steps after them are
            // timed, up to the last token on the host.
            let mut got = std::collections::HashMap::<u64, usize>::new();
            let mut start = None;
            let mut timed = 0usize;
            while eng.has_work() {
                for e in eng.step()? {
                    if let Event::Token { id, .. } = e {
                        let n = got.entry(id).or_default();
                        *n += 1;
                        if *n > 2 {
                            timed += 1;
                        }
                    }
                }
                if start.is_none() && got.len() == batch && got.values().all(|&n| n >= 2) {
                    start = Some(Instant::now());
                }
            }
            let s = start.map_or(0.0, |t| t.elapsed().as_secs_f64());
            if rep > 0 {
                samples.push(timed as f64 / s.max(1e-9));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_names_round_trip() {
        let mixes = default_mixes();
        assert_eq!(mix_name(&mixes[0]), "2048+7x128");
        assert_eq!(mix_name(&mixes[1]), "8x368");
        assert_eq!(
            mixes[0].iter().sum::<usize>(),
            mixes[1].iter().sum::<usize>()
        );
        for m in mixes.iter().chain([&vec![5, 5, 1, 5]]) {
            assert_eq!(&parse_mix(&mix_name(m)).unwrap(), m);
        }
        assert!(parse_mix("2048+0x128").is_err());
        assert!(parse_mix("12+ab").is_err());
    }
}
