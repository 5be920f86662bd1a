//! The engine under load: an open-loop synthetic workload (Poisson arrivals, prompt and output
//! lengths from a seeded log-uniform distribution) replayed in-process on
//! `stoke_engine::Engine`, reporting what vLLM's `benchmark_serving` reports: requests/s,
//! output tokens/s, time to first token and inter-token latency percentiles. The same schedules
//! are written as JSON for the transformers peer (`scripts/peers/engine_torch.py`), which
//! replays them on transformers' continuous batching.

use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use stoke::FusedOps;
use stoke_engine::{Engine, EngineModel, Event, Params};
pub use stoke_serve::loadgen::{Arrival, percentiles, schedule, schedule_json};

/// Replays `s` open-loop on `engine` (each request added once its arrival time has passed, the
/// engine stepped whenever it has work), or, with `concurrency`, closed-loop: that many
/// requests in flight, the next added as one ends. Stops admitting after `limit`.
pub fn replay<B: FusedOps, M: EngineModel<B>>(
    engine: &mut Engine<B, M>,
    s: &[Arrival],
    concurrency: Option<usize>,
    limit: Duration,
) -> Value {
    let t0 = Instant::now();
    let mut next = 0;
    let mut arrived: HashMap<u64, f64> = HashMap::new();
    let mut last: HashMap<u64, f64> = HashMap::new();
    let (mut ttft, mut itl) = (Vec::new(), Vec::new());
    let (mut tokens, mut done, mut errors, mut in_flight) = (0usize, 0usize, 0usize, 0usize);
    let mut peak_running = 0;
    let mut steps = 0usize;
    let mut end = 0.0f64;
    loop {
        let now = t0.elapsed().as_secs_f64();
        let open = t0.elapsed() < limit;
        while open && next < s.len() {
            let a = &s[next];
            let due = match concurrency {
                Some(c) => in_flight < c,
                None => a.at <= now,
            };
            if !due {
                break;
            }
            let p = Params {
                ignore_eos: true,
                ..Params::greedy(a.max_tokens)
            };
            match engine.add(a.prompt.clone(), p) {
                Ok(id) => {
                    arrived.insert(id, if concurrency.is_some() { now } else { a.at });
                    in_flight += 1;
                }
                Err(e) => {
                    errors += 1;
                    eprintln!("serving: request {next}: {e}");
                }
            }
            next += 1;
        }
        if !engine.has_work() {
            if next >= s.len() || !open {
                break;
            }
            // Idle until the next arrival.
            let wait = (s[next].at - t0.elapsed().as_secs_f64()).max(0.0);
            std::thread::sleep(Duration::from_secs_f64(wait.min(0.01)));
            continue;
        }
        let events = match engine.step() {
            Ok(e) => e,
            Err(e) => {
                eprintln!("serving: engine step: {e}");
                errors += 1;
                break;
            }
        };
        steps += 1;
        peak_running = peak_running.max(engine.stats().running);
        let now = t0.elapsed().as_secs_f64();
        for e in events {
            match e {
                Event::Token { id, .. } => {
                    tokens += 1;
                    match last.insert(id, now) {
                        None => ttft.push((now - arrived[&id]) * 1e3),
                        Some(prev) => itl.push((now - prev) * 1e3),
                    }
                    end = now;
                }
                Event::Finished { id, .. } => {
                    done += 1;
                    in_flight -= 1;
                    last.remove(&id);
                    end = now;
                }
            }
        }
    }
    let start = if concurrency.is_some() {
        0.0
    } else {
        s.first().map_or(0.0, |a| a.at)
    };
    let duration = (end - start).max(1e-9);
    json!({"requests": s.len(), "admitted": next, "completed": done, "errors": errors,
        "duration_s": duration, "requests_per_s": done as f64 / duration,
        "output_tokens_per_s": tokens as f64 / duration, "output_tokens": tokens,
        "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl), "steps": steps,
        "peak_running": peak_running, "stats": format!("{:?}", engine.stats())})
}

/// One model's serving benchmark: the saturating rate (every request at once), open-loop
/// Poisson rates at fractions of it, closed-loop concurrency 32 beside the static-batch decode
/// figure of `llama --bench` at batch 32, each schedule written to `dir` for the peer.
fn model_bench<B: FusedOps>(
    name: &str,
    model: &stoke_llama::model::Llama<B>,
    n: usize,
    dir: &std::path::Path,
) -> Result<Value, String> {
    let vocab = model.embed_tokens.dims()[0];
    let (prompt, output) = ((32, 2048), (16, 512));
    let cfg = stoke_engine::EngineConfig {
        max_running: 64,
        context: 2048 + 512 + 8,
        kv_memory: 0.5,
        max_prefill_tokens: 2048,
        ..Default::default()
    };
    let engine = || Engine::new(model, cfg.clone(), None).map_err(|e| e.to_string());
    let limit = Duration::from_secs(60);
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let save = |tag: &str, rate: f64, seed: u64, s: &[Arrival]| {
        let path = dir.join(format!("{name}-{tag}.json"));
        let _ = std::fs::write(
            &path,
            schedule_json(&format!("{name} {tag}"), rate, seed, s).to_string(),
        );
    };
    // Warm-up: every row bucket's first step and capture, and the prefill's modules.
    let mut eng = engine()?;
    let warm = schedule(64, f64::INFINITY, (32, 512), (4, 8), vocab, 99);
    replay(&mut eng, &warm, None, limit);
    let all = schedule(n, f64::INFINITY, prompt, output, vocab, 1);
    save("max", f64::INFINITY, 1, &all);
    let max = replay(&mut eng, &all, None, limit);
    let saturating = max["requests_per_s"].as_f64().unwrap_or(0.0);
    println!("serving {name} max: {max}");
    let mut rates = Vec::new();
    for (i, frac) in [0.25, 0.5, 0.75].into_iter().enumerate() {
        let rate = (frac * saturating).max(0.1);
        let seed = 2 + i as u64;
        let s = schedule(n, rate, prompt, output, vocab, seed);
        save(&format!("rate{}", (frac * 100.0) as u32), rate, seed, &s);
        let mut eng = engine()?;
        replay(&mut eng, &warm, None, limit);
        let r = replay(&mut eng, &s, None, limit);
        println!("serving {name} {frac} x saturating ({rate:.1}/s): {r}");
        rates.push(json!({"fraction_of_saturating": frac, "rate": rate, "result": r}));
    }
    // Closed loop at concurrency 32 and the static batch of 32 (`llama --bench`'s decode point).
    let s = schedule(n, f64::INFINITY, prompt, output, vocab, 9);
    let mut eng = engine()?;
    replay(&mut eng, &warm, None, limit);
    let c32 = replay(&mut eng, &s, Some(32), limit);
    println!("serving {name} concurrency 32: {c32}");
    let bench_cfg = stoke_llama::bench::BenchConfig {
        prompt_lens: vec![],
        prefill_mixes: vec![],
        batches: vec![32],
        decode_tokens: 128,
        reps: 2,
        ..Default::default()
    };
    let static32 =
        stoke_llama::bench::run(model, &bench_cfg, |_, _, _| {}).map_err(|e| e.to_string())?;
    let static_tps = static32.first().map_or(0.0, |p| p.median);
    let c32_tps = c32["output_tokens_per_s"].as_f64().unwrap_or(0.0);
    Ok(
        json!({"requests_per_schedule": n, "prompt_tokens": prompt, "output_tokens": output,
        "engine": format!("{cfg:?}"), "saturating": max, "saturating_requests_per_s": saturating,
        "rates": rates, "concurrency_32": c32, "static_batch_32_decode_tokens_per_s": static_tps,
        "concurrency_32_over_static_32": c32_tps / static_tps.max(1e-9)}),
    )
}

/// The serving benchmark: SmolLM2 (the default model, packed Q4_1) and a Llama-3.1-8B-shaped
/// model with random INT4 weights, the schedules written to `dir` (`NAME-TAG.json`).
/// `STOKE_SERVING_MODELS` (smollm2, 8b) picks the parts.
pub fn bench(dir: &std::path::Path) -> Value {
    let report = |r: Result<Value, String>| r.unwrap_or_else(|e| json!({ "error": e }));
    let parts = std::env::var("STOKE_SERVING_MODELS").unwrap_or_else(|_| "smollm2,8b".into());
    let on = |s: &str| parts.split(',').any(|x| x.trim() == s);
    let device = Default::default();
    let mut res = json!({});
    if on("smollm2") {
        res["smollm2"] = report((|| {
            let path = crate::llama::model_path()?;
            let l = stoke_llama::load::load_gguf_packed::<crate::StokeCuda>(
                &path,
                &device,
                burn::tensor::DType::BF16,
                2600,
            )
            .map_err(|e| e.to_string())?;
            model_bench("smollm2", &l.model.pinned(), 256, dir)
        })());
    }
    if on("8b") {
        let cfg = stoke_llama::synthetic::llama_3_1_8b();
        let model = stoke_llama::synthetic::random_int4_model::<crate::StokeCuda>(
            &cfg, 128, false, 2600, 1, &device,
        )
        .pinned();
        res["llama_8b_int4"] = report(model_bench("8b", &model, 128, dir));
    }
    res
}
