//! `stoke-gpu`: Stoke's GPU tests and benchmarks in one self-contained binary, for a GPU
//! machine without a Rust toolchain (built and packed by `scripts/gpu-bundle.sh`).

use clap::{Parser, Subcommand};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(about = "Run Stoke's GPU tests and benchmarks and write JSON results")]
struct Cli {
    /// Directory for the JSON results (created if missing).
    #[arg(long, global = true, default_value = ".")]
    out: PathBuf,
    /// Source revision recorded in the results.
    #[arg(long, global = true, env = "STOKE_COMMIT", default_value = "unknown")]
    commit: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the GPU tests (all, or those named, in the order named).
    Test { names: Vec<String> },
    /// Run the benchmarks.
    Bench,
    /// SmolLM2 prefill and decode speed through burn-cuda and `Stoke<Cuda>` (the model comes from
    /// the model cache: STOKE_MODEL_CACHE).
    Llama,
    /// The W4A16 GEMM: its GPU test, then its benchmark beside the same run's copy rate.
    Int4,
    /// Decode attention: its GPU test, then its benchmark beside the same run's copy rate.
    Attention,
    /// Prefill attention: its GPU test, then its benchmark (single prompts and a packed mix).
    PrefillAttention,
    /// The packed prefill: its GPU tests (prefill attention, the model's packed prefill), then
    /// the 8B-shaped prefill benchmark (single prompts, packed mixes; bf16 and FP8 projections)
    /// and the prefill layer at 70B / 405B shapes.
    Prefill,
    /// The whole decode step: its GPU tests, then the step benchmark (SmolLM2, 8B- and
    /// 70B-shaped models) with each point's kernel sum.
    Decode,
    /// A decode step's RMSNorm then the W4A16 GEMM it feeds: the ordering test, then the
    /// pairs' benchmark beside each kernel alone.
    Pairs,
    /// The engine: its GPU tests, then the serving benchmark (Poisson arrivals at fractions of
    /// the saturating rate, closed-loop concurrency 32 beside the static batch; SmolLM2 and an
    /// 8B-shaped model), the schedules written to OUT/schedules (STOKE_SCHEDULES) for the
    /// peer.
    Engine,
    /// A few W4A16 launches (every variant and word order) for a profiler such as `ncu`.
    Int4Profile {
        /// Rows of x.
        #[arg(long, default_value_t = 1)]
        m: usize,
        /// Benchmark shape names (e.g. 70b_gate_up 8b_down).
        shapes: Vec<String>,
    },
    /// Two FP8 GEMM launches per benchmark shape for a profiler such as `ncu`.
    Fp8Profile {
        /// Rows of the activation.
        #[arg(long, default_value_t = 2048)]
        m: usize,
        /// Benchmark shape names (e.g. 8b_o 8b_down); all when none is named.
        shapes: Vec<String>,
    },
    /// A few decode-attention launches (every format) for a profiler.
    AttentionProfile {
        /// Benchmark shape name (8b or 70b).
        #[arg(default_value = "8b")]
        shape: String,
        #[arg(long, default_value_t = 32)]
        batch: u32,
        #[arg(long, default_value_t = 4096)]
        ctx: u32,
        /// Cache formats to launch (bf16, fp8, int4), comma-separated.
        #[arg(long, default_value = "bf16,fp8,int4", value_delimiter = ',')]
        formats: Vec<String>,
    },
    /// Tests, then benchmarks (the exit status fails if either did).
    All,
    /// List the GPU test cases.
    List,
}

/// One kernel's GPU test, then its benchmark beside the same run's copy rate, written to
/// `OUT/{key}.json` under `key` (the exit status fails if either did).
fn run_kernel(cli: &Cli, tests: &[&str], key: &str, bench: fn(f64) -> Value) -> bool {
    // STOKE_BENCH_ONLY=1: the benchmark alone (a variant's test run on its own beforehand, so
    // that a fault there cannot take the benchmark's context with it).
    let ok = if std::env::var("STOKE_BENCH_ONLY").as_deref() == Ok("1") {
        println!("{}: not run (STOKE_BENCH_ONLY=1)", tests.join(", "));
        true
    } else {
        run_tests(
            cli,
            &tests.iter().map(|t| t.to_string()).collect::<Vec<_>>(),
        )
    };
    match stoke_tests::gpu() {
        Ok(rt) => {
            let copy_gbps = stoke_tests::bench::copy_bandwidth(&rt);
            println!("device-to-device copy: {copy_gbps:.0} GB/s (read + write)");
            let v = bench(copy_gbps);
            write(
                &cli.out,
                &format!("{key}.json"),
                &json!({ "meta": meta(&cli.commit), key: v }),
            );
            ok
        }
        Err(e) => {
            eprintln!("{key} benchmark not run: {e}");
            false
        }
    }
}

fn meta(commit: &str) -> Value {
    let gpu = stoke_tests::gpu()
        .map(|rt| rt.name.clone())
        .unwrap_or_else(|e| format!("none: {e}"));
    json!({ "commit": commit, "date_utc": now_utc(), "gpu": gpu })
}

fn now_utc() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let (days, rem) = (secs / 86400, secs % 86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn write(out: &PathBuf, name: &str, v: &Value) {
    std::fs::create_dir_all(out).unwrap();
    let path = out.join(name);
    std::fs::write(&path, serde_json::to_string_pretty(v).unwrap()).unwrap();
    println!("wrote {}", path.display());
}

/// Runs the named GPU cases in the order given (every case, in the list's order, when none is
/// named), printing each result as it ends; an unknown name fails before anything runs.
fn run_tests(cli: &Cli, names: &[String]) -> bool {
    let cases = stoke_tests::gpu::CASES;
    if let Some(n) = names.iter().find(|n| !cases.iter().any(|(c, _)| c == n)) {
        eprintln!("no GPU test named {n}");
        return false;
    }
    let order: Vec<&str> = if names.is_empty() {
        cases.iter().map(|(n, _)| *n).collect()
    } else {
        names.iter().map(String::as_str).collect()
    };
    let mut outcomes = Vec::new();
    for name in order {
        let o = stoke_tests::gpu::run(name);
        println!(
            "{:<40} {:<8} {:7.2}s {}",
            o.name,
            o.status,
            o.seconds,
            if o.message.is_empty() {
                o.details.to_string()
            } else {
                o.message.clone()
            }
        );
        outcomes.push(o);
    }
    let failed = outcomes.iter().filter(|o| o.status == "failed").count();
    let passed = outcomes.iter().filter(|o| o.status == "passed").count();
    let skipped = outcomes.len() - failed - passed;
    println!("{passed} passed, {failed} failed, {skipped} skipped");
    write(
        &cli.out,
        "gpu-tests.json",
        &json!({ "meta": meta(&cli.commit), "tests": outcomes }),
    );
    failed == 0 && skipped == 0
}

fn run_bench(cli: &Cli) -> bool {
    match stoke_tests::bench::all() {
        Ok(v) => {
            write(
                &cli.out,
                "bench.json",
                &json!({ "meta": meta(&cli.commit), "bench": v }),
            );
            true
        }
        Err(e) => {
            eprintln!("benchmarks not run: {e}");
            false
        }
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let ok = match &cli.command {
        Command::List => {
            stoke_tests::gpu::CASES
                .iter()
                .for_each(|(n, _)| println!("{n}"));
            true
        }
        Command::Test { names } => run_tests(&cli, names),
        Command::Bench => run_bench(&cli),
        Command::Int4 => run_kernel(
            &cli,
            &[
                "int4_gemm_matches_dequantized_reference",
                "int4_tuned_plan_matches_reference",
            ],
            "int4",
            stoke_tests::int4::bench,
        ),
        Command::Attention => run_kernel(
            &cli,
            &["decode_attention_matches_reference"],
            "attention",
            stoke_tests::attention::bench,
        ),
        Command::PrefillAttention => run_kernel(
            &cli,
            &["prefill_attention_matches_reference"],
            "prefill-attention",
            stoke_tests::attention::prefill_bench,
        ),
        Command::Prefill => run_kernel(
            &cli,
            &[
                "prefill_attention_matches_reference",
                "packed_prefill_matches_reference",
            ],
            "prefill",
            stoke_tests::decode::prefill_bench,
        ),
        Command::Decode => run_kernel(
            &cli,
            &[
                "decode_step_matches_reference",
                "smollm2_decode_matches_reference",
                "smollm2_graphed_text_matches_burn_cuda",
            ],
            "decode",
            stoke_tests::decode::bench,
        ),
        Command::Engine => {
            let tests = if std::env::var("STOKE_BENCH_ONLY").as_deref() == Ok("1") {
                true
            } else {
                run_tests(
                    &cli,
                    &[
                        "two_plans_in_one_process".to_string(),
                        "engine_matches_f32_reference".to_string(),
                    ],
                )
            };
            // The schedules go beside the results, for the peer (STOKE_SCHEDULES moves them).
            let dir = std::env::var_os("STOKE_SCHEDULES")
                .map_or_else(|| cli.out.join("schedules"), PathBuf::from);
            let v = stoke_tests::serving::bench(&dir);
            write(
                &cli.out,
                "engine.json",
                &json!({ "meta": meta(&cli.commit), "engine": v }),
            );
            tests
        }
        Command::Pairs => run_kernel(
            &cli,
            &["rms_norm_then_int4_gemm_matches_synchronized"],
            "pairs",
            stoke_tests::pairs::bench,
        ),
        Command::Int4Profile { m, shapes } => {
            let names: Vec<&str> = shapes.iter().map(String::as_str).collect();
            stoke_tests::int4::profile_launches(&names, *m);
            true
        }
        Command::Fp8Profile { m, shapes } => {
            let names: Vec<&str> = shapes.iter().map(String::as_str).collect();
            stoke_tests::fp8::profile_launches(&names, *m);
            true
        }
        Command::AttentionProfile {
            shape,
            batch,
            ctx,
            formats,
        } => {
            stoke_tests::attention::profile_launches(shape, *batch, *ctx, formats);
            true
        }
        Command::Llama => match stoke_tests::llama::bench() {
            Ok(v) => {
                write(
                    &cli.out,
                    "llama.json",
                    &json!({ "meta": meta(&cli.commit), "llama": v }),
                );
                true
            }
            Err(e) => {
                eprintln!("llama benchmark not run: {e}");
                false
            }
        },
        Command::All => {
            let tests = run_tests(&cli, &[]);
            run_bench(&cli) && tests
        }
    };
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
