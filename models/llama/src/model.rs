//! Llama in Burn, generic over the backend, read top to bottom: rotary embedding -> KV cache ->
//! attention -> MLP -> block -> model.
//!
//! Written so that `Stoke<B>` routes its hot ops: projections are `burn::nn::Linear`
//! (`ModuleOps::linear`), norms are `stoke::rms_norm` / `stoke::residual_rms_norm`. Attention is
//! the decoder's fused ops in serving (`stoke::prefill_qkv_attention` in [`Llama::prefill`],
//! `stoke::decode_attention` in [`Llama::decode_forward`]) and `burn::tensor::module::attention`
//! (`ModuleOps::attention`) in [`Llama::forward`] (simulated formats, calibration, training).

use crate::config::LlamaConfig;
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor, TensorData, module};
use stoke::FusedOps;

/// Rotary position embedding tables (rotate-half form), `[max_positions, head_dim / 2]`.
#[derive(Module, Debug)]
pub struct Rope<B: Backend> {
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
}

impl<B: Backend> Rope<B> {
    pub fn new(cfg: &LlamaConfig, max_positions: usize, device: &B::Device) -> Self {
        let half = cfg.head_dim / 2;
        let inv_freq = inverse_frequencies(cfg);
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            for f in &inv_freq {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Self {
            cos: Tensor::from_data(TensorData::new(cos, [max_positions, half]), device),
            sin: Tensor::from_data(TensorData::new(sin, [max_positions, half]), device),
        }
    }

    /// The angles as `[positions, head_dim / 2, 2]` (cos, sin) f32 values (for a decoder).
    pub fn table(&self) -> Vec<f32> {
        let host = |t: &Tensor<B, 2>| {
            t.clone()
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .expect("f32 table")
        };
        let (cos, sin) = (host(&self.cos), host(&self.sin));
        cos.iter().zip(&sin).flat_map(|(&c, &s)| [c, s]).collect()
    }

    /// Rotates `x: [batch, heads, seq, head_dim]` by the angles of `positions: [batch, seq]`.
    pub fn apply(&self, x: Tensor<B, 4>, positions: Tensor<B, 2, Int>) -> Tensor<B, 4> {
        let [b, _, s, d] = x.dims();
        let half = d / 2;
        let flat = positions.reshape([b * s]);
        let dtype = x.dtype();
        let cos = self
            .cos
            .clone()
            .select(0, flat.clone())
            .reshape([b, 1, s, half])
            .cast(dtype);
        let sin = self
            .sin
            .clone()
            .select(0, flat)
            .reshape([b, 1, s, half])
            .cast(dtype);
        let x1 = x.clone().narrow(3, 0, half);
        let x2 = x.narrow(3, half, half);
        Tensor::cat(
            vec![
                x1.clone() * cos.clone() - x2.clone() * sin.clone(),
                x2 * cos + x1 * sin,
            ],
            3,
        )
    }
}

/// RoPE inverse frequencies `theta^(-2i/d)`, with Llama-3 scaling when configured.
pub fn inverse_frequencies(cfg: &LlamaConfig) -> Vec<f64> {
    let d = cfg.head_dim as f64;
    let base: Vec<f64> = (0..cfg.head_dim / 2)
        .map(|i| cfg.rope_theta.powf(-((2 * i) as f64) / d))
        .collect();
    let Some(s) = &cfg.rope_scaling else {
        return base;
    };
    let old = s.original_max_position_embeddings as f64;
    let low_wavelen = old / s.low_freq_factor;
    let high_wavelen = old / s.high_freq_factor;
    base.into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / s.factor
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

/// Preallocated keys and values of every layer for a batch of sequences, with each sequence's
/// own length: `[batch, kv_heads, capacity, head_dim]` per layer.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    keys: Vec<Tensor<B, 4>>,
    values: Vec<Tensor<B, 4>>,
    /// Tokens already in the cache, per sequence.
    pub lens: Vec<usize>,
    pub capacity: usize,
    /// Store each new K/V row as its quantized-then-dequantized value (the cache formats of
    /// `stoke_formats::kv`), to measure a cache format's effect on quality on any backend.
    pub quantize: Option<CacheQuant>,
}

/// A simulated KV-cache format: every K and V row (one token, one kv head) is rotated by
/// `rotate_block`-sized normalized Hadamard blocks when set, quantized with one scale per row,
/// dequantized and rotated back, once, when written. Rotating back instead of rotating the
/// query gives the same attention (the rotation is orthonormal).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheQuant {
    pub format: CacheFormat,
    pub rotate_block: Option<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheFormat {
    /// Signed INT4, scale = amax / 7 per row.
    Int4,
    /// FP8 E4M3, scale = amax / 448 per row.
    Fp8,
}

impl CacheQuant {
    /// `x: [batch, kv_heads, seq, head_dim]`, each row through the format (on the host).
    fn apply<B: Backend>(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        use stoke_formats::kv;
        let (dims, device, dtype) = (x.dims(), x.device(), x.dtype());
        let d = dims[3];
        let mut v = x
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .expect("f32 values");
        let rotate = |v: &mut Vec<f32>| {
            if let Some(b) = self.rotate_block {
                kv::hadamard(v, d, b).expect("rotation block divides head_dim");
            }
        };
        rotate(&mut v);
        let mut v = match self.format {
            CacheFormat::Int4 => {
                let (q, s) = kv::quantize_int4(&v, d, kv::Int4Order::Natural).expect("head_dim");
                kv::dequantize_int4(&q, &s, d, kv::Int4Order::Natural)
            }
            CacheFormat::Fp8 => {
                let (q, s) = kv::quantize_fp8(&v, d).expect("head_dim");
                kv::dequantize_fp8(&q, &s, d)
            }
        };
        rotate(&mut v);
        Tensor::<B, 4>::from_data(TensorData::new(v, dims), &device).cast(dtype)
    }
}

impl<B: Backend> KvCache<B> {
    pub fn new(
        cfg: &LlamaConfig,
        batch: usize,
        capacity: usize,
        dtype: burn::tensor::DType,
        device: &B::Device,
    ) -> Self {
        Self::with_sizes(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            batch,
            capacity,
            dtype,
            device,
        )
    }

    /// A cache sized for `model`'s layers and heads.
    pub fn for_model(
        model: &Llama<B>,
        batch: usize,
        capacity: usize,
        dtype: burn::tensor::DType,
        device: &B::Device,
    ) -> Self {
        let a = &model.layers[0].attn;
        Self::with_sizes(
            model.layers.len(),
            a.n_kv_heads,
            a.head_dim,
            batch,
            capacity,
            dtype,
            device,
        )
    }

    fn with_sizes(
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
        batch: usize,
        capacity: usize,
        dtype: burn::tensor::DType,
        device: &B::Device,
    ) -> Self {
        let z = || Tensor::<B, 4>::zeros([batch, kv_heads, capacity, head_dim], device).cast(dtype);
        Self {
            keys: (0..layers).map(|_| z()).collect(),
            values: (0..layers).map(|_| z()).collect(),
            lens: vec![0; batch],
            capacity,
            quantize: None,
        }
    }
}

#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    /// q, k and v side by side: `[hidden, (heads + 2 kv_heads) head_dim]` (concatenated at load).
    pub qkv_proj: Linear<B>,
    pub o_proj: Linear<B>,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl<B: FusedOps> Attention<B> {
    /// `x: [batch, seq, hidden]`; writes the new keys/values at each sequence's `starts[b]`
    /// and attends over `mask` (`true` = hidden) of shape `[batch, 1, seq, keys]`. Returns
    /// `residual + o_proj(attention)`.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: Tensor<B, 3>,
        residual: Tensor<B, 3>,
        rope: &Rope<B>,
        positions: Tensor<B, 2, Int>,
        cache: (&mut Tensor<B, 4>, &mut Tensor<B, 4>),
        quantize: Option<CacheQuant>,
        starts: &[usize],
        mask: Tensor<B, 4, Bool>,
        input: &mut dyn FnMut(Site, Tensor<B, 3>) -> Tensor<B, 3>,
    ) -> Tensor<B, 3> {
        let [b, s, _] = x.dims();
        let x = input(Site::Qkv, x);
        let (h, kvh, d) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let qkv = self.qkv_proj.forward(x);
        let split = |from: usize, heads: usize| {
            qkv.clone()
                .narrow(2, from * d, heads * d)
                .reshape([b, s, heads, d])
                .swap_dims(1, 2)
        };
        let (q, k, v) = (split(0, h), split(h, kvh), split(h + kvh, kvh));
        let q = rope.apply(q, positions.clone());
        let k = rope.apply(k, positions);
        let (k, v) = match quantize {
            Some(cq) => (cq.apply(k), cq.apply(v)),
            None => (k, v),
        };

        let (kc, vc) = cache;
        for (i, &start) in starts.iter().enumerate() {
            let rows = [i..i + 1, 0..kvh, start..start + s, 0..d];
            // Burn's `slice` takes one range per leading dimension: a one-element array is the
            // first dimension's range, not a range to collect.
            #[allow(clippy::single_range_in_vec_init)]
            let (ki, vi) = (k.clone().slice([i..i + 1]), v.clone().slice([i..i + 1]));
            *kc = kc.clone().slice_assign(rows.clone(), ki);
            *vc = vc.clone().slice_assign(rows, vi);
        }
        let keys = mask.dims()[3];
        let expand = |t: Tensor<B, 4>| {
            // GQA: each key/value head serves h / kvh query heads.
            let t = t.slice([0..b, 0..kvh, 0..keys, 0..d]);
            t.reshape([b, kvh, 1, keys, d])
                .expand([b, kvh, h / kvh, keys, d])
                .reshape([b, h, keys, d])
        };
        let (k, v) = (expand(kc.clone()), expand(vc.clone()));
        let mask = mask.expand([b, h, s, keys]);
        let out = module::attention(q, k, v, Some(mask), None, Default::default());
        let out = out.swap_dims(1, 2).reshape([b, s, h * d]);
        let out = input(Site::O, out);
        stoke::linear_residual(out, &self.o_proj, residual)
    }
}

#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// gate and up with their columns interleaved (gate `j` at `2j`, up `j` at `2j + 1`):
    /// `[hidden, 2 intermediate]`, interleaved at load.
    pub gate_up_proj: Linear<B>,
    pub down_proj: Linear<B>,
}

impl<B: FusedOps> Mlp<B> {
    /// Returns `residual + down(silu(gate(x)) * up(x))`.
    fn forward(
        &self,
        x: Tensor<B, 3>,
        residual: Tensor<B, 3>,
        input: &mut dyn FnMut(Site, Tensor<B, 3>) -> Tensor<B, 3>,
    ) -> Tensor<B, 3> {
        let x = input(Site::GateUp, x);
        let h = stoke::linear_swiglu(x, &self.gate_up_proj);
        let h = input(Site::Down, h);
        stoke::linear_residual(h, &self.down_proj, residual)
    }
}

/// Where a projection's input is observed (see [`Llama::forward_observed`]): the input shared
/// by q/k/v, the attention output entering o, the input shared by gate/up, and the SwiGLU
/// product entering down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    Qkv,
    O,
    GateUp,
    Down,
}

impl Site {
    pub const ALL: [Site; 4] = [Site::Qkv, Site::O, Site::GateUp, Site::Down];

    pub fn index(self) -> usize {
        self as usize
    }
}

#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub attn_norm: Param<Tensor<B, 1>>,
    pub attn: Attention<B>,
    pub mlp_norm: Param<Tensor<B, 1>>,
    pub mlp: Mlp<B>,
}

/// Tokens one packed prefill forward runs at most ([`Llama::prefill`]); longer prompts, and
/// batches of prompts with more tokens, run in chunks of this many.
pub const PREFILL_CHUNK: usize = 8192;

#[derive(Module, Debug)]
pub struct Llama<B: Backend> {
    pub embed_tokens: Param<Tensor<B, 2>>,
    pub layers: Vec<Block<B>>,
    pub norm: Param<Tensor<B, 1>>,
    /// The output projection (for tied embeddings, a transposed copy of `embed_tokens`).
    pub lm_head: Linear<B>,
    pub rope: Rope<B>,
    pub rms_norm_eps: f64,
    /// What its ops compute ([`Llama::prepared`] applies it to the weights).
    pub plan: stoke::Plan,
}

/// `param`'s tensor made ready for the backend's kernels as `plan` says.
fn prepare<B: FusedOps, const D: usize>(
    param: Param<Tensor<B, D>>,
    plan: stoke::WeightPlan,
) -> Param<Tensor<B, D>> {
    param.map(|t| {
        let p = B::prepare_weight(t.into_primitive().tensor(), plan);
        Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(p))
    })
}

impl<B: FusedOps> Llama<B> {
    /// Every weight made ready for the backend's kernels once, as the model's plan says
    /// ([`Llama::prepared`] with [`Llama::plan`]).
    pub fn pinned(self) -> Self {
        let plan = self.plan;
        self.prepared(plan)
    }

    /// The model with `plan`: every weight made ready for the backend's kernels once, as the
    /// plan says for its role (`Stoke<Cuda>` resolves each weight's device pointer and keeps
    /// the plan with it: the projections' prefill mode, whether a norm's gain folds into the FP8
    /// projections it feeds; a bf16 output head is kept as its rows `[vocab, hidden]` for the
    /// output-head kernel; the head and the other weights stay on bf16); other backends get the
    /// weights back unchanged.
    pub fn prepared(mut self, plan: stoke::Plan) -> Self {
        use stoke::WeightRole;
        let w = |role| plan.weight(role);
        let other = w(WeightRole::Other);
        let linear = |l: Linear<B>, role| Linear {
            weight: prepare(l.weight, w(role)),
            bias: l.bias.map(|b| prepare(b, other)),
        };
        let n = self.layers.len();
        self.layers = std::mem::take(&mut self.layers)
            .into_iter()
            .map(|b| {
                let proj = WeightRole::Projection;
                let gain = w(WeightRole::NormGain {
                    feeds_projections: true,
                });
                Block {
                    attn_norm: prepare(b.attn_norm, gain),
                    attn: Attention {
                        qkv_proj: linear(b.attn.qkv_proj, proj),
                        o_proj: linear(b.attn.o_proj, proj),
                        ..b.attn
                    },
                    mlp_norm: prepare(b.mlp_norm, gain),
                    mlp: Mlp {
                        gate_up_proj: linear(b.mlp.gate_up_proj, proj),
                        down_proj: linear(b.mlp.down_proj, proj),
                    },
                }
            })
            .collect();
        debug_assert_eq!(self.layers.len(), n);
        // The final norm feeds the head, which stays on bf16.
        self.norm = prepare(
            self.norm,
            w(WeightRole::NormGain {
                feeds_projections: false,
            }),
        );
        self.lm_head = linear(self.lm_head, WeightRole::Head);
        self.embed_tokens = prepare(self.embed_tokens, other);
        self.plan = plan;
        self
    }

    /// Runs `tokens: [batch, seq]` (row `b` holding `new_lens[b]` real tokens, the rest padding),
    /// appending to `cache`. Returns logits `[batch, seq, vocab]`; rows past a sequence's real
    /// tokens are meaningless. Only the last real token's logits are needed for generation:
    /// `last_only` computes just those (`[batch, 1, vocab]`).
    pub fn forward(
        &self,
        tokens: Tensor<B, 2, Int>,
        new_lens: &[usize],
        cache: &mut KvCache<B>,
        last_only: bool,
    ) -> Tensor<B, 3> {
        self.forward_with_inputs(tokens, new_lens, cache, last_only, &mut |_, _, x| x)
    }

    /// [`Llama::forward`], calling `observe(layer, site, input)` with the input of every
    /// projection as it runs (calibration for quantizers: `crate::quant::calibrate`).
    pub fn forward_observed(
        &self,
        tokens: Tensor<B, 2, Int>,
        new_lens: &[usize],
        cache: &mut KvCache<B>,
        last_only: bool,
        observe: &mut dyn FnMut(usize, Site, &Tensor<B, 3>),
    ) -> Tensor<B, 3> {
        self.forward_with_inputs(tokens, new_lens, cache, last_only, &mut |l, site, x| {
            observe(l, site, &x);
            x
        })
    }

    /// [`Llama::forward`] with every projection's input passed through `input(layer, site, x)`
    /// first (to observe it, or to simulate a format it would be quantized to:
    /// `crate::quant::Fp8Sim`).
    pub fn forward_with_inputs(
        &self,
        tokens: Tensor<B, 2, Int>,
        new_lens: &[usize],
        cache: &mut KvCache<B>,
        last_only: bool,
        input: &mut dyn FnMut(usize, Site, Tensor<B, 3>) -> Tensor<B, 3>,
    ) -> Tensor<B, 3> {
        let [b, s] = tokens.dims();
        assert_eq!(new_lens.len(), b, "one length per sequence");
        assert!(
            new_lens.iter().all(|&n| n <= s),
            "a sequence is longer than the token tensor"
        );
        let device = tokens.device();
        let starts = cache.lens.clone();
        let keys = starts.iter().map(|st| st + s).max().unwrap_or(0);
        assert!(
            keys <= cache.capacity,
            "KV cache capacity {} exceeded ({keys} positions)",
            cache.capacity
        );

        // Positions and the mask, per sequence: query i of sequence b sits at starts[b] + i and
        // sees keys 0..=starts[b] + i, never the padding past starts[b] + new_lens[b].
        let mut pos = Vec::with_capacity(b * s);
        let mut hidden = Vec::with_capacity(b * s * keys);
        for (bi, &st) in starts.iter().enumerate() {
            for i in 0..s {
                pos.push((st + i.min(new_lens[bi].saturating_sub(1))) as i64);
                let visible = st + i.min(new_lens[bi].saturating_sub(1));
                hidden.extend((0..keys).map(|j| j > visible));
            }
        }
        let positions = Tensor::<B, 2, Int>::from_data(TensorData::new(pos, [b, s]), &device);
        let mask =
            Tensor::<B, 4, Bool>::from_data(TensorData::new(hidden, [b, 1, s, keys]), &device);

        let embed = self.embed_tokens.val();
        let mut x =
            embed
                .clone()
                .select(0, tokens.reshape([b * s]))
                .reshape([b, s, embed.dims()[1]]);
        let mut normed =
            stoke::rms_norm(x.clone(), self.layers[0].attn_norm.val(), self.rms_norm_eps);
        for (l, layer) in self.layers.iter().enumerate() {
            let h = layer.attn.forward(
                normed,
                x,
                &self.rope,
                positions.clone(),
                (&mut cache.keys[l], &mut cache.values[l]),
                cache.quantize,
                &starts,
                mask.clone(),
                &mut |site, x| input(l, site, x),
            );
            let n = stoke::rms_norm(h.clone(), layer.mlp_norm.val(), self.rms_norm_eps);
            x = layer.mlp.forward(n, h, &mut |site, x| input(l, site, x));
            normed = stoke::rms_norm(x.clone(), self.next_gamma(l), self.rms_norm_eps);
        }
        for (len, n) in cache.lens.iter_mut().zip(new_lens) {
            *len += n;
        }
        let normed = if last_only {
            let rows: Vec<Tensor<B, 3>> = (0..b)
                .map(|i| {
                    normed
                        .clone()
                        .slice([i..i + 1, new_lens[i].max(1) - 1..new_lens[i].max(1)])
                })
                .collect();
            Tensor::cat(rows, 0)
        } else {
            normed
        };
        stoke::output_head(&self.lm_head, normed)
    }

    /// The RMSNorm gain after layer `l`: the next layer's attention norm, or the final norm.
    fn next_gamma(&self, l: usize) -> Tensor<B, 1> {
        match self.layers.get(l + 1) {
            Some(next) => next.attn_norm.val(),
            None => self.norm.val(),
        }
    }

    /// A decoder spec for this model (its dims, RoPE table and norm epsilon) with the given
    /// sizes.
    pub fn spec_with(&self, sizes: stoke_engine::DecoderSizes) -> stoke::DecodeSpec {
        let a = &self.layers[0].attn;
        let [vocab, hidden] = self.embed_tokens.dims();
        stoke::DecodeSpec {
            layers: self.layers.len(),
            heads: a.n_heads,
            kv_heads: a.n_kv_heads,
            head_dim: a.head_dim,
            hidden,
            vocab,
            lanes: sizes.lanes,
            capacity: sizes.capacity,
            page_size: sizes.page_size,
            pages: sizes.pages,
            rope: std::sync::Arc::new(self.rope.table()),
            kv_format: sizes.kv_format,
            rotate_block: if sizes.kv_format == stoke::KvCacheFormat::Bf16 {
                0
            } else {
                a.head_dim
            },
            rms_norm_eps: self.rms_norm_eps,
            eager: sizes.eager,
            keep_logits: false,
        }
    }

    /// A decoder spec for a fixed batch: `lanes` sequences of up to `capacity` positions, every
    /// lane with pages of its own for all of them (what
    /// [`Llama::prefill`] gives them). Tests, benchmarks and perplexity use it; serving sizes
    /// the pool for the workload (`stoke_engine::Engine`).
    pub fn decode_spec(
        &self,
        lanes: usize,
        capacity: usize,
        kv_format: stoke::KvCacheFormat,
        eager: bool,
    ) -> stoke::DecodeSpec {
        let page = stoke::DEFAULT_PAGE_SIZE;
        self.spec_with(stoke_engine::DecoderSizes {
            lanes,
            capacity,
            page_size: page,
            pages: lanes * capacity.div_ceil(page) + 1,
            kv_format,
            eager,
        })
    }

    /// The positions the model's RoPE table covers.
    pub fn max_positions(&self) -> usize {
        self.rope.cos.dims()[0]
    }

    /// Every layer over `x` and its normed copy `normed` (`[batch, rows, hidden]`), with
    /// `attend(layer, normed, qkv_proj)` as the q|k|v projection and the attention (RoPE, cache
    /// write, attention) before the o projection (so a prefill can write the cache from the
    /// projection's GEMM): attention, o projection with the residual, SwiGLU MLP with the
    /// residual. Returns the last layer's output normed with the final gain. `fused`: each
    /// norm between two projections folded into them (a decode step the plan fuses).
    fn layers_forward<E>(
        &self,
        mut x: Tensor<B, 3>,
        mut normed: Tensor<B, 3>,
        fused: bool,
        mut attend: impl FnMut(usize, Tensor<B, 3>, &Linear<B>) -> Result<Tensor<B, 3>, E>,
    ) -> Result<Tensor<B, 3>, E> {
        let eps = self.rms_norm_eps;
        // A residual projection and the norm of its output: folded into the GEMMs around the
        // norm where the step is fused.
        let project_norm = |a: Tensor<B, 3>, proj: &Linear<B>, res: Tensor<B, 3>, gain| {
            if fused {
                stoke::linear_residual_rms_norm(a, proj, res, gain, eps)
            } else {
                let s = stoke::linear_residual(a, proj, res);
                (s.clone(), stoke::rms_norm(s, gain, eps))
            }
        };
        for (l, layer) in self.layers.iter().enumerate() {
            let attn = attend(l, normed, &layer.attn.qkv_proj)?;
            let (h, n) = project_norm(attn, &layer.attn.o_proj, x, layer.mlp_norm.val());
            let g = stoke::linear_swiglu(n, &layer.mlp.gate_up_proj);
            (x, normed) = project_norm(g, &layer.mlp.down_proj, h, self.next_gamma(l));
        }
        Ok(normed)
    }

    /// One decode step's forward over `dec`: the embedding of its current ids, every layer
    /// (q|k|v projection, RoPE + cache append + attention, o projection with the residual,
    /// SwiGLU MLP with the residual), the head, and the next ids sampled into `dec`. Run it
    /// through [`stoke::decode_step`] (which replays it as a CUDA graph on `Stoke<Cuda>`).
    pub fn decode_forward(&self, dec: &mut B::Decoder) {
        let (x, normed) = stoke::decode_embed::<B>(
            dec,
            self.embed_tokens.val(),
            self.layers[0].attn_norm.val(),
            self.rms_norm_eps,
        );
        let [lanes, rows, _] = x.dims();
        let fused = self.plan.fuses_step(lanes * rows);
        let normed = self
            .layers_forward(x, normed, fused, |l, normed, qkv_proj| {
                Ok::<_, std::convert::Infallible>(if fused {
                    stoke::decode_qkv_attention::<B>(dec, l, normed, qkv_proj)
                } else {
                    stoke::decode_attention::<B>(dec, l, qkv_proj.forward(normed))
                })
            })
            .unwrap_or_else(|never| match never {});
        let logits = stoke::output_head(&self.lm_head, normed);
        stoke::decode_sample::<B>(dec, logits);
    }

    /// A fixed batch: `prompts` (token ids, one sequence each) take lanes `0 ..` of `dec`, each
    /// with its own pages for every position the decoder holds (a decoder from
    /// [`Llama::decode_spec`]), and are prefilled packed, one after another without padding, in
    /// chunks of at most [`PREFILL_CHUNK`] tokens (a longer prompt continues in the next chunk,
    /// attending to what the earlier ones cached); each layer writes its keys and values straight
    /// into the lanes' pages ([`stoke::prefill_qkv_attention`]); the head runs on each prompt's
    /// last token only, and the first generated token of each is sampled greedily into its lane,
    /// which decode steps then continue.
    pub fn prefill(
        &self,
        prompts: &[Vec<u32>],
        dec: &mut B::Decoder,
    ) -> Result<(), stoke::DecodeError> {
        self.prefill_chunked(prompts, dec, PREFILL_CHUNK)
    }

    /// [`Llama::prefill`] in chunks of at most `chunk` tokens.
    pub fn prefill_chunked(
        &self,
        prompts: &[Vec<u32>],
        dec: &mut B::Decoder,
        chunk: usize,
    ) -> Result<(), stoke::DecodeError> {
        let greedy = vec![stoke::LaneSampling::GREEDY; prompts.len()];
        self.prefill_with(prompts, dec, chunk, &greedy)
    }

    /// [`Llama::prefill`] in chunks of at most `chunk` tokens, lane `i` sampling with
    /// `sampling[i]`.
    pub fn prefill_with(
        &self,
        prompts: &[Vec<u32>],
        dec: &mut B::Decoder,
        chunk: usize,
        sampling: &[stoke::LaneSampling],
    ) -> Result<(), stoke::DecodeError> {
        self.take_lanes(prompts, dec, sampling)?;
        let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
        let activate: Vec<stoke::LaneOp> = lens
            .iter()
            .enumerate()
            .map(|(lane, &len)| stoke::LaneOp::Activate { lane, pos: len - 1 })
            .collect();
        stoke::decoder_update::<B>(dec, &activate)?;
        // Each prompt's last row after the final norm, as its chunk produces it; one sampling
        // of every prompt's first token at the end.
        let mut last: Vec<Option<Tensor<B, 3>>> = vec![None; prompts.len()];
        for seqs in stoke::pack_prompts(&lens, chunk) {
            let ids: Vec<u32> = seqs
                .iter()
                .flat_map(|s| &prompts[s.slot][s.pos0..s.pos0 + s.rows])
                .copied()
                .collect();
            let normed = self.prefill_rows(dec, &ids, &seqs)?;
            let mut end = 0;
            for s in &seqs {
                end += s.rows;
                if s.pos0 + s.rows == lens[s.slot] {
                    last[s.slot] = Some(normed.clone().narrow(1, end - 1, 1));
                }
            }
        }
        let last: Vec<Tensor<B, 3>> = last
            .into_iter()
            .map(|r| r.expect("every prompt ends in a chunk"))
            .collect();
        let logits = stoke::output_head(&self.lm_head, Tensor::cat(last, 0));
        let lanes: Vec<usize> = (0..prompts.len()).collect();
        stoke::prefill_sample::<B, 3>(dec, logits, &lanes)
    }

    /// Gives `prompts` lanes `0 ..` of `dec`, each the pages of its own for every position (a
    /// decoder from [`Llama::decode_spec`]); lanes that held a sequence are cleared first.
    fn take_lanes(
        &self,
        prompts: &[Vec<u32>],
        dec: &mut B::Decoder,
        sampling: &[stoke::LaneSampling],
    ) -> Result<(), stoke::DecodeError> {
        let spec = stoke::decoder_spec::<B>(dec);
        let mp = spec.max_pages();
        let (lanes, pages) = (spec.lanes, spec.pages);
        if prompts.len() > lanes || prompts.len() * mp + 1 > pages {
            return Err(stoke::DecodeError::Shape {
                what: "prompts for the decoder",
                expected: format!(
                    "at most its {lanes} lanes, each with {mp} pages of its own ({pages} pages)"
                ),
                got: format!("{} prompts", prompts.len()),
            });
        }
        if let Some(i) = prompts.iter().position(Vec::is_empty) {
            return Err(stoke::DecodeError::Shape {
                what: "prompt",
                expected: "at least one token".into(),
                got: format!("prompt {i} is empty"),
            });
        }
        if let Some(p) = prompts.iter().find(|p| p.len() >= spec.capacity) {
            return Err(stoke::DecodeError::ContextOverflow {
                needed: p.len() + 1,
                capacity: spec.capacity,
            });
        }
        let clear: Vec<stoke::LaneOp> = (0..lanes)
            .map(|lane| stoke::LaneOp::Clear { lane })
            .collect();
        stoke::decoder_update::<B>(dec, &clear)?;
        let pages: Vec<Vec<u32>> = (0..prompts.len())
            .map(|i| (0..mp).map(|j| (1 + i * mp + j) as u32).collect())
            .collect();
        let set: Vec<stoke::LaneOp> = prompts
            .iter()
            .enumerate()
            .map(|(lane, p)| stoke::LaneOp::Set {
                lane,
                pages: &pages[lane],
                tokens: p,
                sampling: sampling
                    .get(lane)
                    .copied()
                    .unwrap_or(stoke::LaneSampling::GREEDY),
            })
            .collect();
        stoke::decoder_update::<B>(dec, &set)
    }

    /// One packed prefill chunk into `dec`: `ids` the rows' tokens, `seqs` the layout (each
    /// piece's lane and first position); the pieces of `ends` (indices into `seqs`) end their
    /// sequence's prompt: the head runs on their last rows and samples each sequence's first
    /// token into its lane ([`stoke::prefill_sample`]).
    pub fn prefill_packed(
        &self,
        dec: &mut B::Decoder,
        ids: &[u32],
        seqs: &[stoke::PackedSeq],
        ends: &[usize],
    ) -> Result<(), stoke::DecodeError> {
        let normed = self.prefill_rows(dec, ids, seqs)?;
        if ends.is_empty() {
            return Ok(());
        }
        let mut last = Vec::with_capacity(ends.len());
        let mut row = 0;
        for (i, s) in seqs.iter().enumerate() {
            row += s.rows;
            if ends.contains(&i) {
                last.push(normed.clone().narrow(1, row - 1, 1));
            }
        }
        let lanes: Vec<usize> = ends.iter().map(|&i| seqs[i].slot).collect();
        let logits = stoke::output_head(&self.lm_head, Tensor::cat(last, 0));
        stoke::prefill_sample::<B, 3>(dec, logits, &lanes)
    }

    /// The logits of every position of `prompt` (`[1, len, vocab]`) through the prefill
    /// [`Llama::prefill`] runs (in chunks of at most `chunk` tokens), in lane 0 of `dec`;
    /// nothing is sampled. Perplexity through the path that serves (`crate::eval::perplexity`).
    pub fn prefill_logits(
        &self,
        prompt: &[u32],
        dec: &mut B::Decoder,
        chunk: usize,
    ) -> Result<Tensor<B, 3>, stoke::DecodeError> {
        let prompts = [prompt.to_vec()];
        self.take_lanes(&prompts, dec, &[stoke::LaneSampling::GREEDY])?;
        let mut rows = Vec::new();
        for seqs in stoke::pack_prompts(&[prompt.len()], chunk) {
            let ids: Vec<u32> = seqs
                .iter()
                .flat_map(|s| &prompt[s.pos0..s.pos0 + s.rows])
                .copied()
                .collect();
            rows.push(self.prefill_rows(dec, &ids, &seqs)?);
        }
        Ok(stoke::output_head(&self.lm_head, Tensor::cat(rows, 1)))
    }

    /// The packed prefill of one chunk into `dec` (see [`Llama::prefill_packed`]): its rows
    /// after the final norm, `[1, rows, hidden]`.
    fn prefill_rows(
        &self,
        dec: &mut B::Decoder,
        ids: &[u32],
        seqs: &[stoke::PackedSeq],
    ) -> Result<Tensor<B, 3>, stoke::DecodeError> {
        let device = self.embed_tokens.device();
        let embed = self.embed_tokens.val();
        let hidden = embed.dims()[1];
        let rows = ids.len();
        let ids: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [rows]), &device);
        let x = embed.select(0, ids).reshape([1, rows, hidden]);
        let normed = stoke::rms_norm(x.clone(), self.layers[0].attn_norm.val(), self.rms_norm_eps);
        self.layers_forward(x, normed, false, |l, normed, qkv_proj| {
            stoke::prefill_qkv_attention::<B>(dec, l, normed, qkv_proj, seqs)
        })
    }
}

impl<B: FusedOps> stoke_engine::EngineModel<B> for Llama<B> {
    fn decode_spec(&self, sizes: stoke_engine::DecoderSizes) -> stoke::DecodeSpec {
        self.spec_with(sizes)
    }

    fn max_positions(&self) -> usize {
        Llama::max_positions(self)
    }

    fn vocab(&self) -> usize {
        self.embed_tokens.dims()[0]
    }

    fn plan(&self) -> stoke::Plan {
        self.plan
    }

    fn dtype(&self) -> burn::tensor::DType {
        self.embed_tokens.val().dtype()
    }

    fn device(&self) -> B::Device {
        self.embed_tokens.device()
    }

    fn prefill(
        &self,
        dec: &mut B::Decoder,
        ids: &[u32],
        seqs: &[stoke::PackedSeq],
        sample: &[usize],
    ) -> Result<(), stoke::DecodeError> {
        self.prefill_packed(dec, ids, seqs, sample)
    }

    fn decode_forward(&self, dec: &mut B::Decoder) {
        Llama::decode_forward(self, dec)
    }
}
