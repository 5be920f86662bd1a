//! INT4 weight quantization of a loaded model: round-to-nearest or GPTQ, group-wise, into the
//! packed format of `stoke_formats::int4`.
//!
//! [`quantize`] maps every attention and MLP projection (and the output head only when asked)
//! to packed INT4. On a backend that keeps packed weights (`Stoke<I>`, through
//! `FusedOps::packed_int4_weight`) the projections stay packed and `linear` runs the W4A16
//! kernels; anywhere else they are replaced by their dequantized values (simulated
//! quantization, the reference the kernels are compared with).
//!
//! GPTQ needs each projection's input statistics: [`calibrate`] runs the model over calibration
//! sequences and accumulates `H = Σ xᵀx` at every projection input (one Hessian per input site:
//! q/k/v share one, gate/up share one) with Burn ops on the model's backend, so on the GPU the
//! accumulation runs through burn-cuda. The solve is f64 on the host (`stoke_formats::gptq`).
//! All layers are calibrated in one pass of the full-precision model; memory is `4 k²` bytes
//! per site and layer (tens of MB for SmolLM2, about 30 GB for an 8B model, which needs a
//! layer-by-layer pass instead).
//!
//! [`fold_norm_gains`] moves each RMSNorm's learned gain into the rows of the projections it
//! feeds (`(x̂ ⊙ γ) W = x̂ (diag(γ) W)`), leaving gains of ones: done before quantization the
//! groups then see the weights as the kernels will use them, and a fused kernel can apply the
//! norm as a per-row scale alone. The final norm before the output head is left as is.

use crate::model::{Llama, Site};
use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};
use std::time::Instant;
use stoke::FusedOps;
use stoke_formats::fp8::DelayedScale;
use stoke_formats::gptq::{GptqError, prepare_hessian, quantize_gptq_prepared};
use stoke_formats::int4::{Int4Error, PackedInt4, ScaleType};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Method {
    /// Round to nearest, `scale = amax / 7` per group.
    Rtn,
    /// GPTQ with the Hessians of a [`Calibration`]; `damp` is added to the diagonal as a
    /// fraction of its mean; `act_order` quantizes inputs by decreasing Hessian diagonal.
    Gptq { damp: f64, act_order: bool },
}

#[derive(Clone, Copy, Debug)]
pub struct QuantizeConfig {
    pub method: Method,
    /// Group size along the input dimension; layers whose input size it does not divide use
    /// [`group_for`]'s choice.
    pub group: usize,
    pub scale_type: ScaleType,
    /// Quantize the output head too (kept in the model's dtype by default).
    pub include_lm_head: bool,
}

impl Default for QuantizeConfig {
    fn default() -> Self {
        Self {
            method: Method::Rtn,
            group: 128,
            scale_type: ScaleType::Bf16,
            include_lm_head: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error("layer {layer} {proj}: {source}")]
    Int4 {
        layer: usize,
        proj: &'static str,
        #[source]
        source: Int4Error,
    },
    #[error("layer {layer} {proj}: {source}")]
    Gptq {
        layer: usize,
        proj: &'static str,
        #[source]
        source: GptqError,
    },
    #[error("GPTQ needs a calibration (see quant::calibrate)")]
    NoCalibration,
    #[error("the calibration is for {got} layers, the model has {want}")]
    CalibrationLayers { got: usize, want: usize },
    #[error("calibration sequence {index} is empty")]
    EmptySequence { index: usize },
}

/// The group for an input dimension `k`: `group` when it divides `k`, else the largest power
/// of two from 16 up to `group` that does (576 with 128 -> 64), else `k` (one group per column).
pub fn group_for(k: usize, group: usize) -> usize {
    if group > 0 && k.is_multiple_of(group) {
        return group;
    }
    let mut g = 16;
    let mut best = None;
    while g <= group {
        if k.is_multiple_of(g) {
            best = Some(g);
        }
        g *= 2;
    }
    best.unwrap_or(k)
}

/// `H = Σ xᵀx` per layer and input [`Site`] (`[k, k]`, f32, on the model's device), and how many
/// token rows went into each.
pub struct Calibration<B: FusedOps> {
    pub hessians: Vec<[Option<Tensor<B, 2>>; 4]>,
    pub tokens: usize,
}

/// Runs `model` over `sequences` (token ids, `batch` at a time, each sequence alone in its
/// row: no padding), accumulating the Hessian of every projection input.
pub fn calibrate<B: FusedOps>(
    model: &Llama<B>,
    sequences: &[Vec<u32>],
    batch: usize,
    dtype: DType,
    device: &B::Device,
    mut progress: impl FnMut(usize, usize),
) -> Result<Calibration<B>, QuantError> {
    let layers = model.layers.len();
    let mut hessians: Vec<[Option<Tensor<B, 2>>; 4]> =
        (0..layers).map(|_| [None, None, None, None]).collect();
    let mut tokens = 0;
    if let Some(index) = sequences.iter().position(|s| s.is_empty()) {
        return Err(QuantError::EmptySequence { index });
    }
    for (ci, chunk) in sequences.chunks(batch.max(1)).enumerate() {
        // Equal lengths within a batch keep every row free of padding.
        let len = chunk.iter().map(Vec::len).min().unwrap_or(0);
        let ids: Vec<i64> = chunk
            .iter()
            .flat_map(|s| s[..len].iter().map(|&t| t as i64))
            .collect();
        let t = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [chunk.len(), len]), device);
        let mut cache = crate::model::KvCache::for_model(model, chunk.len(), len, dtype, device);
        let lens = vec![len; chunk.len()];
        model.forward_observed(t, &lens, &mut cache, true, &mut |layer, site, x| {
            let [b, s, k] = x.dims();
            let x2 = x.clone().reshape([b * s, k]).cast(DType::F32);
            let h = x2.clone().transpose().matmul(x2);
            let slot = &mut hessians[layer][site.index()];
            *slot = Some(match slot.take() {
                Some(acc) => acc + h,
                None => h,
            });
        });
        tokens += len * chunk.len();
        progress(ci + 1, sequences.len().div_ceil(batch.max(1)));
    }
    Ok(Calibration { hessians, tokens })
}

fn host_f32<B: FusedOps>(t: Tensor<B, 2>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 values")
}

/// Round-to-nearest INT4 of a weight `[k, n]` in Burn ops on its own backend (on burn-cuda for
/// a model on the GPU): per group of `group` rows and column, `scale = amax / 7` rounded to
/// `scale_type`, `q = clamp(round(w / scale), -8, 7) + 8`. Only the group maxima (`k / group x n`)
/// and the finished nibbles go through the host; equal to `stoke_formats::int4::quantize_rtn`.
pub fn rtn_burn<B: FusedOps>(
    w: Tensor<B, 2>,
    group: usize,
    scale_type: ScaleType,
) -> Result<PackedInt4, Int4Error> {
    let [k, n] = w.dims();
    if group == 0 || !group.is_multiple_of(16) || k % group != 0 {
        return Err(Int4Error::Group { group, k });
    }
    let device = w.device();
    let g = w.cast(DType::F32).reshape([k / group, group, n]);
    let amax = host_f32(g.clone().abs().max_dim(1).reshape([k / group, n]));
    // The scale is rounded to its 16-bit type on the host (not every backend has bf16/f16).
    let bits: Vec<u16> = amax.iter().map(|a| scale_type.from_f32(a / 7.0)).collect();
    // Empty groups divide by 1 instead of 0 (their weights are 0: q = 8, as the reference).
    let d: Vec<f32> = bits
        .iter()
        .map(|b| match scale_type.to_f32(*b) {
            v if v > 0.0 => v,
            _ => 1.0,
        })
        .collect();
    let d = Tensor::<B, 3>::from_data(TensorData::new(d, [k / group, 1, n]), &device);
    let q = (g / d).round().clamp(-8.0, 7.0).add_scalar(8.0);
    let q: Vec<u8> = host_f32(q.reshape([k, n]))
        .into_iter()
        .map(|v| v as u8)
        .collect();
    PackedInt4::pack(&q, k, n, group, scale_type, bits, None)
}

/// A quantized weight as the backend keeps it: packed where it can (`Stoke<I>`), else the
/// dequantized values in `dtype`.
fn packed_param<B: FusedOps>(
    p: PackedInt4,
    dtype: DType,
    device: &B::Device,
) -> Param<Tensor<B, 2>> {
    let (k, n) = (p.k, p.n);
    let t = match B::packed_int4_weight(p.clone(), dtype, device) {
        Some(prim) => Tensor::from_primitive(TensorPrimitive::Float(prim)),
        None => {
            Tensor::<B, 2>::from_data(TensorData::new(p.dequantize(), [k, n]), device).cast(dtype)
        }
    };
    Param::from_tensor(t)
}

/// The output head alone RTN-quantized to INT4 (group `group`, or the largest power of two
/// below it that divides the hidden size), kept packed where the backend keeps packed weights:
/// the INT4 head of a decode step whose projections are already INT4 (a GGUF's Q4 groups).
pub fn quantize_lm_head<B: FusedOps>(
    mut model: Llama<B>,
    group: usize,
    scale_type: ScaleType,
) -> Result<Llama<B>, QuantError> {
    let w = model.lm_head.weight.val();
    let [k, _] = w.dims();
    let (device, dtype) = (w.device(), w.dtype());
    let layer = model.layers.len();
    let packed =
        rtn_burn(w, group_for(k, group), scale_type).map_err(|source| QuantError::Int4 {
            layer,
            proj: "lm_head",
            source,
        })?;
    model.lm_head.weight = packed_param::<B>(packed, dtype, &device);
    Ok(model)
}

/// What [`quantize`] did, per projection.
#[derive(Clone, Debug)]
pub struct QuantReport {
    pub layers: usize,
    pub projections: usize,
    /// (input size, group) pairs used.
    pub groups: Vec<(usize, usize)>,
    pub seconds: f64,
}

/// The packed INT4 weights [`quantize_packed`] made: per layer q|k|v, o, gate|up (interleaved
/// columns) and down, in the model's own fused layout; the head when it was quantized.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedProjections {
    pub layers: Vec<[PackedInt4; 4]>,
    pub lm_head: Option<PackedInt4>,
}

/// Quantizes every attention and MLP projection of `model` (and the head when
/// `cfg.include_lm_head`) with `cfg.method`. GPTQ needs `calibration` from [`calibrate`] on the
/// same model.
pub fn quantize<B: FusedOps>(
    model: Llama<B>,
    cfg: &QuantizeConfig,
    calibration: Option<&Calibration<B>>,
) -> Result<(Llama<B>, QuantReport), QuantError> {
    let (packed, report) = quantize_packed(&model, cfg, calibration)?;
    Ok((apply_packed(model, &packed), report))
}

/// The projections of `model` with their weights replaced by `packed` (see
/// [`PackedProjections`]): kept packed where the backend keeps packed weights (`Stoke<I>`),
/// else their dequantized values in each weight's dtype.
pub fn apply_packed<B: FusedOps>(mut model: Llama<B>, packed: &PackedProjections) -> Llama<B> {
    let put = |lin: &mut Linear<B>, p: &PackedInt4| {
        let w = lin.weight.val();
        let (device, dtype) = (w.device(), w.dtype());
        lin.weight = packed_param::<B>(p.clone(), dtype, &device);
    };
    for (layer, [qkv, o, gate_up, down]) in model.layers.iter_mut().zip(&packed.layers) {
        put(&mut layer.attn.qkv_proj, qkv);
        put(&mut layer.attn.o_proj, o);
        put(&mut layer.mlp.gate_up_proj, gate_up);
        put(&mut layer.mlp.down_proj, down);
    }
    if let Some(head) = &packed.lm_head {
        put(&mut model.lm_head, head);
    }
    model
}

/// One projection's GPTQ inputs on the host: its input Hessian and weight `[k, n]`.
struct GptqJob {
    h: Vec<f64>,
    w: Vec<f32>,
    k: usize,
    n: usize,
    group: usize,
}

/// The four projections of layer `l` (q|k|v, o, gate|up, down), each with its own input site's
/// Hessian.
fn solve_gptq_layer(
    l: usize,
    job: &[GptqJob],
    damp: f64,
    act_order: bool,
    scale_type: ScaleType,
) -> Result<[PackedInt4; 4], QuantError> {
    const PROJ: [&str; 4] = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"];
    const SITE: [&str; 4] = ["qkv input", "o input", "gate/up input", "down input"];
    let mut out = Vec::with_capacity(4);
    for (i, j) in job.iter().enumerate() {
        let prepared =
            prepare_hessian(&j.h, j.k, damp, act_order).map_err(|source| QuantError::Gptq {
                layer: l,
                proj: SITE[i],
                source,
            })?;
        out.push(
            quantize_gptq_prepared(&j.w, j.k, j.n, &prepared, j.group, scale_type).map_err(
                |source| QuantError::Gptq {
                    layer: l,
                    proj: PROJ[i],
                    source,
                },
            )?,
        );
    }
    Ok(out.try_into().expect("four projections"))
}

/// [`quantize`]'s packed weights, the model left as it is (to save them, see
/// `crate::packed_file`).
pub fn quantize_packed<B: FusedOps>(
    model: &Llama<B>,
    cfg: &QuantizeConfig,
    calibration: Option<&Calibration<B>>,
) -> Result<(PackedProjections, QuantReport), QuantError> {
    let t0 = Instant::now();
    if let Method::Gptq { .. } = cfg.method {
        let c = calibration.ok_or(QuantError::NoCalibration)?;
        if c.hessians.len() != model.layers.len() {
            return Err(QuantError::CalibrationLayers {
                got: c.hessians.len(),
                want: model.layers.len(),
            });
        }
    }
    let mut groups = Vec::new();
    // Round to nearest, on the model's backend.
    let rtn = |lin: &Linear<B>,
               layer: usize,
               proj: &'static str,
               groups: &mut Vec<(usize, usize)>|
     -> Result<PackedInt4, QuantError> {
        let w = lin.weight.val();
        let k = w.dims()[0];
        let group = group_for(k, cfg.group);
        if !groups.contains(&(k, group)) {
            groups.push((k, group));
        }
        rtn_burn(w, group, cfg.scale_type).map_err(|source| QuantError::Int4 {
            layer,
            proj,
            source,
        })
    };
    let n_layers = model.layers.len();
    let mut layers = Vec::with_capacity(n_layers);
    match cfg.method {
        Method::Rtn => {
            for (l, layer) in model.layers.iter().enumerate() {
                let (a, m) = (&layer.attn, &layer.mlp);
                layers.push([
                    rtn(&a.qkv_proj, l, "qkv_proj", &mut groups)?,
                    rtn(&a.o_proj, l, "o_proj", &mut groups)?,
                    rtn(&m.gate_up_proj, l, "gate_up_proj", &mut groups)?,
                    rtn(&m.down_proj, l, "down_proj", &mut groups)?,
                ]);
            }
        }
        Method::Gptq { damp, act_order } => {
            // The host solves run on every core, a chunk of layers at a time: this thread reads
            // a chunk's weights and Hessians from the device, then one thread per layer solves
            // its four projections.
            let c = calibration.expect("checked above");
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let mut l0 = 0;
            while l0 < n_layers {
                let chunk = l0..(l0 + threads).min(n_layers);
                let mut jobs = Vec::with_capacity(chunk.len());
                for l in chunk.clone() {
                    let layer = &model.layers[l];
                    let mut job: Vec<GptqJob> = Vec::with_capacity(4);
                    let lins = [
                        &layer.attn.qkv_proj,
                        &layer.attn.o_proj,
                        &layer.mlp.gate_up_proj,
                        &layer.mlp.down_proj,
                    ];
                    for (site, lin) in Site::ALL.into_iter().zip(lins) {
                        let h = c.hessians[l][site.index()]
                            .clone()
                            .ok_or(QuantError::NoCalibration)?;
                        let w = lin.weight.val();
                        let [k, n] = w.dims();
                        let group = group_for(k, cfg.group);
                        if !groups.contains(&(k, group)) {
                            groups.push((k, group));
                        }
                        job.push(GptqJob {
                            h: host_f32(h).into_iter().map(f64::from).collect(),
                            w: host_f32(w),
                            k,
                            n,
                            group,
                        });
                    }
                    jobs.push((l, job));
                }
                let solved: Vec<Result<[PackedInt4; 4], QuantError>> = std::thread::scope(|s| {
                    let handles: Vec<_> = jobs
                        .iter()
                        .map(|(l, job)| {
                            s.spawn(move || {
                                solve_gptq_layer(*l, job, damp, act_order, cfg.scale_type)
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().expect("a GPTQ thread panicked"))
                        .collect()
                });
                for r in solved {
                    layers.push(r?);
                }
                l0 = chunk.end;
            }
        }
    }
    let projections = 4 * n_layers;
    let lm_head = if cfg.include_lm_head {
        // The head's input is the final norm's output; RTN only (no calibration site for it).
        Some(rtn(&model.lm_head, n_layers, "lm_head", &mut groups)?)
    } else {
        None
    };
    Ok((
        PackedProjections { layers, lm_head },
        QuantReport {
            layers: n_layers,
            projections: projections + usize::from(cfg.include_lm_head),
            groups,
            seconds: t0.elapsed().as_secs_f64(),
        },
    ))
}

/// Folds each block's RMSNorm gains into the projections they feed (attention norm into
/// q|k|v, MLP norm into gate|up) and sets those gains to ones. Exact in real arithmetic; the
/// final norm is kept.
pub fn fold_norm_gains<B: FusedOps>(mut model: Llama<B>) -> Llama<B> {
    fn scale_rows<B: FusedOps>(lin: &mut Linear<B>, gamma: &Tensor<B, 1>) {
        let w = lin.weight.val();
        let [k, _] = w.dims();
        let dtype = w.dtype();
        let g = gamma.clone().cast(DType::F32).reshape([k, 1]);
        lin.weight = Param::from_tensor((w.cast(DType::F32) * g).cast(dtype));
    }
    for layer in &mut model.layers {
        let g = layer.attn_norm.val();
        scale_rows(&mut layer.attn.qkv_proj, &g);
        layer.attn_norm = Param::from_tensor(g.ones_like());
        let g = layer.mlp_norm.val();
        scale_rows(&mut layer.mlp.gate_up_proj, &g);
        layer.mlp_norm = Param::from_tensor(g.ones_like());
    }
    model
}

/// Every projection RTN-quantized and dequantized (simulated), the head kept: the shorthand
/// the examples and tests use.
pub fn simulate_rtn<B: FusedOps>(
    model: Llama<B>,
    group: usize,
    scale_type: ScaleType,
) -> Result<Llama<B>, QuantError> {
    let cfg = QuantizeConfig {
        method: Method::Rtn,
        group,
        scale_type,
        include_lm_head: false,
    };
    quantize(model, &cfg, None).map(|(m, _)| m)
}

/// Simulated FP8 prefill, to measure its quality on any backend: the projections' weights
/// and/or inputs rounded through E4M3 ([`stoke_formats::fp8::round_trip`]) with one scale per
/// output channel for a weight and one per row for an input, as the FP8 GEMM scales them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Sim {
    pub weights: bool,
    pub activations: bool,
    /// With `activations`: the down projection's input (the SwiGLU output) scaled as the
    /// gate|up GEMM's FP8 epilogue would write it, one delayed scale per tensor per layer
    /// ([`DelayedScale`], history [`DELAYED_HISTORY`], no margin) instead of one per row. A
    /// layer's first invocation has no history: it runs as the per-row path does (the bf16
    /// SwiGLU output quantized per row) and records its amax, so no calibration is needed.
    pub delayed_down: bool,
}

/// Amax history slots of a simulated delayed scale (the device's).
pub use stoke_formats::fp8::DELAYED_HISTORY;

impl Fp8Sim {
    /// Every projection weight of `model` (q|k|v, o, gate|up, down; the head is kept) replaced
    /// by its rounded values, when the recipe rounds weights.
    pub fn apply_to_weights<B: FusedOps>(&self, mut model: Llama<B>) -> Llama<B> {
        if !self.weights {
            return model;
        }
        let round = |lin: &mut Linear<B>| {
            let w = lin.weight.val();
            let ([k, n], device, dtype) = (w.dims(), w.device(), w.dtype());
            // [k, n] -> [n, k]: each output channel's inputs in a row.
            let mut t = stoke_formats::transpose(&host_f32(w.cast(DType::F32)), k, n);
            t.chunks_mut(k).for_each(stoke_formats::fp8::round_trip);
            let w = stoke_formats::transpose(&t, n, k);
            lin.weight = Param::from_tensor(
                Tensor::<B, 2>::from_data(TensorData::new(w, [k, n]), &device).cast(dtype),
            );
        };
        for layer in &mut model.layers {
            round(&mut layer.attn.qkv_proj);
            round(&mut layer.attn.o_proj);
            round(&mut layer.mlp.gate_up_proj);
            round(&mut layer.mlp.down_proj);
        }
        model
    }

    /// The state of one simulated run over a model of `layers` layers.
    pub fn run(self, layers: usize) -> Fp8SimRun {
        Fp8SimRun {
            sim: self,
            down: (0..layers)
                .map(|_| DelayedScale::new(DELAYED_HISTORY, 1.0, 1.0).expect("valid constants"))
                .collect(),
        }
    }
}

/// A simulation's state across invocations (the delayed scales of the down projections'
/// inputs): pass every projection input through [`Fp8SimRun::input`].
#[derive(Clone, Debug)]
pub struct Fp8SimRun {
    sim: Fp8Sim,
    down: Vec<DelayedScale>,
}

impl Fp8SimRun {
    /// Projection input `x` (`[batch, rows, k]`) of `site` in `layer`, rounded as the recipe
    /// says; `x` itself when it rounds no activations.
    pub fn input<B: FusedOps>(
        &mut self,
        layer: usize,
        site: Site,
        x: Tensor<B, 3>,
    ) -> Tensor<B, 3> {
        if !self.sim.activations {
            return x;
        }
        let (dims, device, dtype) = (x.dims(), x.device(), x.dtype());
        let k = dims[2];
        let mut v = x
            .cast(DType::F32)
            .into_data()
            .to_vec::<f32>()
            .expect("f32 values");
        let scale = &mut self.down[layer];
        if self.sim.delayed_down && site == Site::Down && scale.invocations > 0 {
            let (q, s) = scale.quantize(&v);
            for (o, &c) in v.iter_mut().zip(&q.codes) {
                *o = stoke_formats::fp8::e4m3_to_f32(c) * s;
            }
        } else {
            if self.sim.delayed_down && site == Site::Down {
                // The first invocation's amax starts the history.
                let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
                scale.record(amax, 0);
            }
            v.chunks_mut(k).for_each(stoke_formats::fp8::round_trip);
        }
        Tensor::<B, 3>::from_data(TensorData::new(v, dims), &device).cast(dtype)
    }

    /// Values the delayed scales saturated, over every layer and invocation.
    pub fn saturated(&self) -> u64 {
        self.down.iter().map(|d| d.saturated).sum()
    }
}
