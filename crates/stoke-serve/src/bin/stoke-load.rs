//! `stoke-load`: an open-loop load generator for an OpenAI-compatible server (Poisson arrivals,
//! seeded prompt and output lengths, streamed completions). Rates are requests per second,
//! `inf` (everything at once: the saturating rate), or `0.5x` (a share of the saturating rate
//! measured by an earlier `inf` in the same list).
//!
//! stoke-load --url http://127.0.0.1:8000 --rates inf,0.25x,0.5x,0.75x --requests 256

use clap::Parser;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::Duration;
use stoke_serve::loadgen::{Target, over_time, replay, schedule, schedule_json, summarize};

#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// The `model` field of each request.
    #[arg(long)]
    model: Option<String>,
    /// Rates to run, in order: N (requests/s), `inf`, or `Fx` (F times the saturating rate of
    /// an earlier `inf`).
    #[arg(long, value_delimiter = ',', default_value = "inf,0.25x,0.5x,0.75x")]
    rates: Vec<String>,
    /// Requests per rate.
    #[arg(long, default_value_t = 256)]
    requests: usize,
    /// Instead of `--requests`: run each finite rate for this many seconds (a soak).
    #[arg(long)]
    duration: Option<f64>,
    /// Prompt lengths (tokens), `MIN:MAX`, log-uniform.
    #[arg(long, default_value = "32:2048", value_parser = range)]
    prompt: (usize, usize),
    /// Output lengths (tokens), `MIN:MAX`, log-uniform.
    #[arg(long, default_value = "16:512", value_parser = range)]
    output: (usize, usize),
    /// Prompt token ids are drawn below this.
    #[arg(long, default_value_t = 49152)]
    vocab: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Requests sent all at once before the first rate (short outputs), to warm the server.
    #[arg(long, default_value_t = 64)]
    warmup: usize,
    /// Seconds a request may take.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Report windows of this many seconds (errors and p99 over time).
    #[arg(long, default_value_t = 60.0)]
    window: f64,
    /// Sample this process's resident memory (and, with nvidia-smi, the GPU's used memory) at
    /// the start and end of each rate.
    #[arg(long)]
    server_pid: Option<u32>,
    /// Write the results as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write each rate's schedule into this directory as `NAME-RATE.json` (the transformers
    /// peer replays them: scripts/peers/engine_torch.py).
    #[arg(long)]
    schedules: Option<PathBuf>,
    /// The NAME of the schedule files.
    #[arg(long, default_value = "load")]
    name: String,
}

fn range(s: &str) -> Result<(usize, usize), String> {
    let (a, b) = s
        .split_once(':')
        .ok_or_else(|| format!("`{s}`: expected MIN:MAX"))?;
    let a: usize = a.parse().map_err(|e| format!("`{a}`: {e}"))?;
    let b: usize = b.parse().map_err(|e| format!("`{b}`: {e}"))?;
    if a == 0 || a > b {
        return Err(format!("`{s}`: expected 1 <= MIN <= MAX"));
    }
    Ok((a, b))
}

/// Resident memory of `pid` (MiB) and the GPU's used memory (MiB), where readable.
fn memory(pid: Option<u32>) -> Value {
    let rss = pid.and_then(|p| {
        let s = std::fs::read_to_string(format!("/proc/{p}/status")).ok()?;
        let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb / 1024.0)
    });
    let gpu = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=memory.used", "--format=csv,noheader,nounits"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()?
                .trim()
                .parse::<f64>()
                .ok()
        });
    json!({"host_rss_mib": rss, "gpu_used_mib": gpu})
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    if let Err(e) = run(args).await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()?;
    let target = Target {
        url: args.url.trim_end_matches('/').to_string(),
        model: args.model.clone(),
        timeout: Duration::from_secs(args.timeout),
    };
    if args.warmup > 0 {
        let warm = schedule(
            args.warmup,
            f64::INFINITY,
            args.prompt,
            (4, 8),
            args.vocab,
            99,
        );
        let (o, wall) = replay(&client, &target, &warm).await;
        eprintln!("warm-up: {}", summarize(&o, wall));
    }
    let mut saturating: Option<f64> = None;
    let mut runs = Vec::new();
    for (i, r) in args.rates.iter().enumerate() {
        let rate = if r == "inf" {
            f64::INFINITY
        } else if let Some(f) = r.strip_suffix('x') {
            let f: f64 = f.parse().map_err(|e| format!("rate `{r}`: {e}"))?;
            f * saturating.ok_or_else(|| format!("rate `{r}` needs an earlier `inf`"))?
        } else {
            r.parse().map_err(|e| format!("rate `{r}`: {e}"))?
        };
        if rate.is_nan() || rate <= 0.0 {
            // A saturating run that completed nothing leaves no rate to take a share of.
            let error = format!("rate `{r}` is {rate} requests/s: not run");
            eprintln!("{error}");
            runs.push(json!({"rate_arg": r, "error": error}));
            continue;
        }
        let n = match args.duration {
            Some(d) if rate.is_finite() => (rate * d).ceil() as usize,
            _ => args.requests,
        };
        let seed = args.seed + i as u64;
        let s = schedule(n, rate, args.prompt, args.output, args.vocab, seed);
        if let Some(dir) = &args.schedules {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            let tag = if rate.is_finite() {
                format!("rate{}", r.trim_end_matches('x').replace('.', "_"))
            } else {
                "max".into()
            };
            let f = dir.join(format!("{}-{tag}.json", args.name));
            std::fs::write(&f, schedule_json(&args.name, rate, seed, &s).to_string())
                .map_err(|e| format!("{}: {e}", f.display()))?;
        }
        let before = memory(args.server_pid);
        // The server's memory every window while the rate runs (nvidia-smi is a process: read
        // off the runtime's threads).
        let samples = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Value>::new()));
        let sampler = {
            let (pid, window, samples) = (args.server_pid, args.window, samples.clone());
            tokio::spawn(async move {
                let t0 = std::time::Instant::now();
                loop {
                    tokio::time::sleep(Duration::from_secs_f64(window)).await;
                    let mut m = tokio::task::spawn_blocking(move || memory(pid))
                        .await
                        .unwrap_or(Value::Null);
                    m["t_s"] = json!(t0.elapsed().as_secs_f64());
                    samples.lock().expect("the sampler's list").push(m);
                }
            })
        };
        let (o, wall) = replay(&client, &target, &s).await;
        sampler.abort();
        let summary = summarize(&o, wall);
        if rate.is_infinite() {
            saturating = summary["requests_per_s"].as_f64();
        }
        eprintln!("rate {r} ({rate:.2}/s, {n} requests): {summary}");
        runs.push(
            json!({"rate_arg": r, "rate": if rate.is_finite() { json!(rate) } else { json!("inf") },
            "seed": seed, "result": summary, "over_time": over_time(&o, args.window),
            "memory_start": before, "memory_end": memory(args.server_pid),
            "memory_over_time": std::mem::take(&mut *samples.lock().expect("the sampler's list"))}),
        );
    }
    let out = json!({"url": args.url, "prompt_tokens": [args.prompt.0, args.prompt.1],
        "output_tokens": [args.output.0, args.output.1], "vocab": args.vocab,
        "runs": runs});
    println!("{}", serde_json::to_string_pretty(&out)?);
    if let Some(f) = &args.json {
        std::fs::write(f, serde_json::to_string_pretty(&out)? + "\n")
            .map_err(|e| format!("{}: {e}", f.display()))?;
    }
    Ok(())
}
