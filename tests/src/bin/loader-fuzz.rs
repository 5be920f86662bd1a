//! The long loader-fuzzing run: `--inputs` inputs per reader (GGUF, safetensors, config.json,
//! tokenizer), in chunks of `--chunk` spread over the cores, from `--seed`; writes the counts,
//! wall times, allocation figures and outcome as JSON to `--out`. Exits nonzero on the first
//! failing input (printed, shrunk by proptest).
//!
//! ```sh
//! cargo run --release -p stoke-tests --bin loader-fuzz -- --inputs 1000000 --out results/cpu-loader-fuzz-COMMIT.json
//! ```

use clap::Parser;
use rayon::prelude::*;
use std::time::Instant;
use stoke_tests::loader_fuzz::{CountingAlloc, PANICS, READERS, Reader, Totals, run_chunk};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[derive(Parser)]
struct Args {
    /// Inputs per reader.
    #[arg(long, default_value_t = 1_000_000)]
    inputs: u64,
    /// Seed of the run (each chunk's proptest RNG derives from it, the reader and the chunk).
    #[arg(long, default_value_t = 0x5704e)]
    seed: u64,
    /// Inputs per chunk (one proptest runner each).
    #[arg(long, default_value_t = 10_000)]
    chunk: u32,
    /// Readers to run (gguf, safetensors, config_json, tokenizer); all by default.
    #[arg(long, value_delimiter = ',')]
    readers: Vec<String>,
    /// The JSON results file.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

fn git(args: &[&str]) -> String {
    std::process::Command::new("git")
        .args(args)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn main() {
    let args = Args::parse();
    let readers: Vec<Reader> = if args.readers.is_empty() {
        READERS.to_vec()
    } else {
        args.readers
            .iter()
            .map(|r| Reader::from_name(r).unwrap_or_else(|| panic!("unknown reader `{r}`")))
            .collect()
    };
    let started = Instant::now();
    let mut report = serde_json::Map::new();
    let mut failed = false;
    for reader in readers {
        let t = Instant::now();
        let chunks = args.inputs.div_ceil(args.chunk as u64);
        let results: Vec<Result<Totals, String>> = (0..chunks)
            .into_par_iter()
            .map(|c| {
                let n = (args.inputs - c * args.chunk as u64).min(args.chunk as u64) as u32;
                run_chunk(reader, args.seed, c, n)
            })
            .collect();
        let mut totals = Totals::default();
        let mut failures = Vec::new();
        for r in results {
            match r {
                Ok(t) => totals.merge(&t),
                Err(e) => failures.push(e),
            }
        }
        let wall = t.elapsed().as_secs_f64();
        eprintln!(
            "{}: {} inputs in {wall:.1} s, {} failures: {totals:?}",
            reader.name(),
            totals.inputs,
            failures.len()
        );
        for f in &failures {
            eprintln!("FAILED {f}");
        }
        failed |= !failures.is_empty();
        let mut entry = serde_json::to_value(&totals).expect("serializable");
        entry["wall_s"] = serde_json::json!((wall * 10.0).round() / 10.0);
        entry["chunks"] = serde_json::json!(chunks);
        entry["failing_chunks"] = serde_json::json!(failures);
        report.insert(reader.name().into(), entry);
        // Written after every reader, so a run stopped early leaves its finished readers.
        write(&args, &report, failed, started, false);
    }
    write(&args, &report, failed, started, true);
    if failed {
        std::process::exit(1);
    }
}

fn write(
    args: &Args,
    report: &serde_json::Map<String, serde_json::Value>,
    failed: bool,
    started: Instant,
    done: bool,
) {
    let out = serde_json::json!({
        "what": "loader fuzzing: proptest-generated and mutated GGUF, safetensors, config.json and tokenizer files, each read under catch_unwind with a counting allocator (tests/src/loader_fuzz.rs)",
        "commit": git(&["rev-parse", "--short=12", "HEAD"]),
        "worktree_clean": git(&["status", "--porcelain", "--untracked-files=no"]).is_empty(),
        "date": git(&["log", "-1", "--format=%cI"]),
        "machine": format!(
            "{} cores ({}), {} {}",
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            rayon::current_num_threads(),
            std::env::consts::ARCH,
            std::env::consts::OS
        ),
        "build": if cfg!(debug_assertions) { "debug" } else { "release" },
        "seed": args.seed,
        "inputs_per_reader": args.inputs,
        "chunk": args.chunk,
        "allocation_bound": "one request <= 32 x file bytes + 1 MiB (tests/src/loader_fuzz.rs alloc_bound)",
        "panics_in_readers": PANICS.load(std::sync::atomic::Ordering::Relaxed),
        "outcome": if failed { "FAILED" } else { "no panic, every error names the file, no allocation over the bound" },
        "wall_s": (started.elapsed().as_secs_f64() * 10.0).round() / 10.0,
        "complete": done,
        "readers": report,
    });
    let text = serde_json::to_string_pretty(&out).expect("serializable");
    if done {
        println!("{text}");
    }
    if let Some(path) = &args.out {
        std::fs::write(path, text + "\n").expect("writing the results file");
    }
}
