//! Fine-tuning the Llama of `crate::model` with Burn's autodiff: next-token cross-entropy on
//! random windows of a token stream, AdamW, linear warm-up then Burn's cosine schedule, and
//! clipping by the global gradient norm.
//!
//! The model is the same Burn module the server path runs: on `Autodiff<B>` its fused ops
//! (`stoke::rms_norm`, `linear_swiglu`, `linear_residual`) take their reference bodies, plain
//! Burn ops that autodiff differentiates, and attention takes Burn's differentiable fallback.
//! Weights and optimizer state are f32 (Burn 0.21 has no mixed-precision autocast).

use crate::model::{KvCache, Llama};
use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng, rngs::StdRng};
use std::path::Path;
use std::time::Instant;
use stoke::FusedOps;

#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per step.
    pub batch: usize,
    /// Tokens per sequence (each predicts its next token).
    pub seq_len: usize,
    /// Peak learning rate (after warm-up).
    pub lr: f64,
    /// Learning rate at the end of the cosine schedule.
    pub min_lr: f64,
    /// Steps of linear warm-up from `lr / warmup` to `lr`.
    pub warmup: usize,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f32,
    /// Largest global gradient L2 norm (all parameters together); 0 turns clipping off.
    pub clip_norm: f64,
    /// Seed of the window sampler.
    pub seed: u64,
    /// Train the token embedding and the output head too (untying them when tied); by
    /// default both are frozen.
    pub train_embeddings: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            steps: 30,
            batch: 2,
            seq_len: 128,
            lr: 5e-5,
            min_lr: 5e-6,
            warmup: 3,
            weight_decay: 0.01,
            clip_norm: 1.0,
            seed: 0,
            train_embeddings: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("the training text has {tokens} tokens; a window of {seq_len} needs {}", seq_len + 1)]
    TooShort { tokens: usize, seq_len: usize },
    #[error("training configuration: {0}")]
    Config(String),
    #[error("{file}: {reason}")]
    Checkpoint { file: String, reason: String },
}

/// What one optimizer step did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepReport {
    /// 1-based.
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub tokens: usize,
    /// Wall time of the step, including reading the loss back.
    pub seconds: f64,
}

/// Random windows of `seq_len + 1` tokens from a token stream, reproducible from a seed.
pub struct Windows<'a> {
    ids: &'a [u32],
    seq_len: usize,
    rng: StdRng,
}

impl<'a> Windows<'a> {
    pub fn new(ids: &'a [u32], seq_len: usize, seed: u64) -> Result<Self, TrainError> {
        if ids.len() < seq_len + 1 || seq_len == 0 {
            return Err(TrainError::TooShort {
                tokens: ids.len(),
                seq_len,
            });
        }
        Ok(Self {
            ids,
            seq_len,
            rng: StdRng::seed_from_u64(seed),
        })
    }

    /// `batch` windows, `[batch, seq_len + 1]` row-major.
    pub fn next_batch(&mut self, batch: usize) -> Vec<i64> {
        let last = self.ids.len() - (self.seq_len + 1);
        let mut out = Vec::with_capacity(batch * (self.seq_len + 1));
        for _ in 0..batch {
            let at = self.rng.random_range(0..=last);
            out.extend(
                self.ids[at..at + self.seq_len + 1]
                    .iter()
                    .map(|&t| t as i64),
            );
        }
        out
    }
}

/// Mean next-token cross-entropy of `windows: [batch, seq + 1]` (position `i` predicts token
/// `i + 1`), as a one-element tensor (f32), through `model`'s ordinary forward.
pub fn next_token_loss<B: FusedOps>(model: &Llama<B>, windows: Tensor<B, 2, Int>) -> Tensor<B, 1> {
    let [b, s1] = windows.dims();
    let s = s1 - 1;
    let device = windows.device();
    let inputs = windows.clone().narrow(1, 0, s);
    let targets = windows.narrow(1, 1, s).reshape([b * s, 1]);
    let dtype = model.embed_tokens.val().dtype();
    let mut cache = KvCache::for_model(model, b, s, dtype, &device);
    let logits = model.forward(inputs, &vec![s; b], &mut cache, false);
    let vocab = logits.dims()[2];
    let logp =
        burn::tensor::activation::log_softmax(logits.reshape([b * s, vocab]).cast(DType::F32), 1);
    logp.gather(1, targets).mean().neg()
}

/// The value of a one-element tensor (one read back to the host).
pub fn scalar<B: Backend>(t: Tensor<B, 1>) -> f64 {
    t.into_data().iter::<f64>().next().unwrap_or(f64::NAN)
}

/// Freezes the token embedding and the output head (no gradients, no optimizer state).
pub fn freeze_embeddings<B: Backend>(mut model: Llama<B>) -> Llama<B> {
    model.embed_tokens = model.embed_tokens.set_require_grad(false);
    model.lm_head.weight = model.lm_head.weight.set_require_grad(false);
    model
}

/// The model with every float parameter cast to `dtype` (RoPE tables stay f32).
pub fn cast_model<B: Backend>(model: Llama<B>, dtype: DType) -> Llama<B> {
    struct Cast(DType);
    impl<B: Backend> ModuleMapper<B> for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            Param::from_mapped_value(id, tensor.cast(self.0), mapper)
        }
    }
    model.map(&mut Cast(dtype))
}

/// Scales `grads` so that their global L2 norm is at most `max_norm` (0: no clipping) and
/// returns the norm before scaling. One host read per call.
pub fn clip_global_norm<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    max_norm: f64,
) -> f64 {
    struct SumSquares<'a, B: AutodiffBackend> {
        grads: &'a GradientsParams,
        sum: Option<Tensor<B::InnerBackend, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for SumSquares<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
                let s = g.cast(DType::F32).square().sum();
                self.sum = Some(match self.sum.take() {
                    Some(acc) => acc + s,
                    None => s,
                });
            }
        }
    }
    struct Scale<'a, B: AutodiffBackend> {
        grads: &'a mut GradientsParams,
        factor: f64,
        _b: std::marker::PhantomData<B>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                self.grads.register(param.id, g.mul_scalar(self.factor));
            }
        }
    }
    let mut v = SumSquares::<B> { grads, sum: None };
    model.visit(&mut v);
    let norm = match v.sum {
        Some(s) => scalar(s).sqrt(),
        None => 0.0,
    };
    if max_norm > 0.0 && norm > max_norm {
        let mut s = Scale::<B> {
            grads,
            factor: max_norm / (norm + 1e-6),
            _b: std::marker::PhantomData,
        };
        model.visit(&mut s);
    }
    norm
}

/// The learning rate of each step: linear warm-up to `lr`, then Burn's cosine annealing to
/// `min_lr` over the remaining steps.
pub fn schedule(cfg: &TrainConfig) -> Result<Vec<f64>, TrainError> {
    use burn::lr_scheduler::LrScheduler;
    use burn::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
    let warmup = cfg.warmup.min(cfg.steps);
    let mut lrs: Vec<f64> = (0..warmup)
        .map(|i| cfg.lr * (i + 1) as f64 / (warmup + 1) as f64)
        .collect();
    let rest = cfg.steps - warmup;
    if rest > 0 {
        let mut cosine = CosineAnnealingLrSchedulerConfig::new(cfg.lr, rest.max(2) - 1)
            .with_min_lr(cfg.min_lr)
            .init()
            .map_err(TrainError::Config)?;
        lrs.extend((0..rest).map(|_| LrScheduler::step(&mut cosine)));
    }
    Ok(lrs)
}

/// Fine-tunes `model` on random windows of `ids` for `cfg.steps` AdamW steps. `on_step` sees
/// each step's report and the model after it (progress, checkpoints).
pub fn train<B>(
    model: Llama<B>,
    ids: &[u32],
    cfg: &TrainConfig,
    mut on_step: impl FnMut(&StepReport, &Llama<B>) -> Result<(), TrainError>,
) -> Result<(Llama<B>, Vec<StepReport>), TrainError>
where
    B: AutodiffBackend + FusedOps,
{
    let mut windows = Windows::new(ids, cfg.seq_len, cfg.seed)?;
    let lrs = schedule(cfg)?;
    let mut model = if cfg.train_embeddings {
        model
    } else {
        freeze_embeddings(model)
    };
    let mut optim = AdamWConfig::new()
        .with_beta_2(0.95)
        .with_epsilon(1e-8)
        .with_weight_decay(cfg.weight_decay)
        .init::<B, Llama<B>>();
    let device = model.embed_tokens.device();
    let mut reports = Vec::with_capacity(cfg.steps);
    for (i, &lr) in lrs.iter().enumerate() {
        let t0 = Instant::now();
        let batch = windows.next_batch(cfg.batch);
        let w = Tensor::<B, 2, Int>::from_data(
            TensorData::new(batch, [cfg.batch, cfg.seq_len + 1]),
            &device,
        );
        let loss = next_token_loss(&model, w);
        let loss_value = scalar(loss.clone());
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        let grad_norm = clip_global_norm(&model, &mut grads, cfg.clip_norm);
        model = optim.step(lr, model, grads);
        B::sync(&device).map_err(|e| TrainError::Config(format!("device sync: {e:?}")))?;
        let report = StepReport {
            step: i + 1,
            loss: loss_value,
            lr,
            grad_norm,
            tokens: cfg.batch * cfg.seq_len,
            seconds: t0.elapsed().as_secs_f64(),
        };
        on_step(&report, &model)?;
        reports.push(report);
    }
    Ok((model, reports))
}

/// Writes `model`'s parameters with Burn's recorder (named MessagePack, full precision):
/// `path` gets the `.mpk` extension.
pub fn save_checkpoint<B: Backend>(model: &Llama<B>, path: &Path) -> Result<(), TrainError> {
    model
        .clone()
        .save_file(
            path.to_path_buf(),
            &NamedMpkFileRecorder::<FullPrecisionSettings>::new(),
        )
        .map_err(|e| TrainError::Checkpoint {
            file: path.display().to_string(),
            reason: e.to_string(),
        })
}

/// Loads parameters saved by [`save_checkpoint`] into `model` (same shapes).
pub fn load_checkpoint<B: Backend>(
    model: Llama<B>,
    path: &Path,
    device: &B::Device,
) -> Result<Llama<B>, TrainError> {
    model
        .load_file(
            path.to_path_buf(),
            &NamedMpkFileRecorder::<FullPrecisionSettings>::new(),
            device,
        )
        .map_err(|e| TrainError::Checkpoint {
            file: path.display().to_string(),
            reason: e.to_string(),
        })
}
