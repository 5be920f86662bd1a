//! Fused ops that Burn has no op for, as an extension trait of `Backend`.
//!
//! Each method's default body is the plain reference composition in Burn ops (f32 math), so
//! model code written against [`FusedOps`] runs on any backend that implements it (an impl that
//! only names the reference decoder: `stoke::reference_decoder_ops!()`); `Stoke<I>` overrides
//! them with its kernels where they apply and falls back to the same composition elsewhere
//! (`route.rs`).

use burn::tensor::{Tensor, TensorPrimitive};
use burn_backend::tensor::FloatTensor;
use burn_backend::{Backend, DType, FloatDType, Scalar, Shape, TensorMetadata};

pub trait FusedOps: Backend {
    /// `x * rsqrt(mean(x^2, last dim) + eps) * gamma`, in f32 and rounded to `x`'s dtype.
    /// `gamma` has shape `[hidden]`, `hidden` being `x`'s last dimension.
    fn rms_norm(x: FloatTensor<Self>, gamma: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        rms_norm_reference::<Self>(x, gamma, eps)
    }

    /// `s = x + residual` (in `x`'s dtype) and `rms_norm(s, gamma, eps)`; returns `(s, normed)`.
    fn residual_rms_norm(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        residual_rms_norm_reference::<Self>(x, residual, gamma, eps)
    }

    /// `residual + x W` for a linear weight `W [k, n]` (Burn's layout): the residual add of an
    /// output projection, fused into the GEMM where a kernel applies.
    fn linear_residual(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        residual: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::float_add(Self::linear(x, weight, None), residual)
    }

    /// `s = residual + x W` and `rms_norm(s, gamma, eps)`; returns `(s, normed)`. Where a kernel
    /// applies the norm takes no launch of its own: the GEMM writes what the projection that
    /// reads `normed` needs (`s * gamma` and `s`'s row statistics), and that projection applies
    /// the row factor in its epilogue; anything else reading `normed` normalizes it first.
    fn linear_residual_rms_norm(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        linear_residual_then_rms_norm::<Self>(x, weight, residual, gamma, eps)
    }

    /// SwiGLU of a gate/up projection whose columns are interleaved (gate `j` at column `2j`,
    /// up `j` at `2j + 1`; see `PackedInt4::interleave_columns`): `silu(x W[:, 2j]) * x W[:, 2j + 1]`,
    /// shape `[.., n / 2]`.
    fn linear_swiglu(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        swiglu_reference::<Self>(Self::linear(x, weight, None))
    }

    /// A model's output head `x W (+ bias)`, its logits: `linear` (the head's weight is
    /// prepared with the head's plan, which keeps it off the FP8 prefill GEMM).
    fn output_head(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        Self::linear(x, weight, bias)
    }

    /// A linear weight `[k, n]` kept in Stoke's packed INT4 format, presenting as a float tensor
    /// of `dtype`, on backends that keep such weights (`Stoke<I>`); `None` elsewhere, where
    /// callers use the dequantized values.
    fn packed_int4_weight(
        packed: stoke_formats::int4::PackedInt4,
        dtype: DType,
        device: &Self::Device,
    ) -> Option<FloatTensor<Self>> {
        let _ = (packed, dtype, device);
        None
    }

    /// A weight made ready for the backend's kernels once, at load, as `plan` says
    /// (`Stoke<I>` resolves its device pointer and keeps the plan with it: how its prefill
    /// GEMMs run, whether a norm's gain folds into FP8 projections); the same tensor elsewhere.
    fn prepare_weight(
        weight: FloatTensor<Self>,
        plan: crate::plan::WeightPlan,
    ) -> FloatTensor<Self> {
        let _ = plan;
        weight
    }

    /// The device's free and total memory in bytes, where the backend knows them (an engine
    /// sizes its KV pool from them); `None` elsewhere.
    fn device_memory(device: &Self::Device) -> Option<(usize, usize)> {
        let _ = device;
        None
    }

    // ---- the decode step (see `crate::decode`) ----

    /// The backend's decoder: the paged KV cache of every layer and its lanes (each lane's
    /// token id, position, pages and sampling settings).
    type Decoder: Send + std::fmt::Debug;

    /// A decoder for `spec` (cache values in `dtype` where the backend keeps Burn tensors).
    fn decoder_new(
        spec: crate::decode::DecodeSpec,
        dtype: DType,
        device: &Self::Device,
    ) -> Result<Self::Decoder, crate::decode::DecodeError>;

    /// What the decoder was made for.
    fn decoder_spec(dec: &Self::Decoder) -> &crate::decode::DecodeSpec;

    /// Applies lane changes in order (`crate::decode::LaneOp`).
    fn decoder_update(
        dec: &mut Self::Decoder,
        ops: &[crate::decode::LaneOp],
    ) -> Result<(), crate::decode::DecodeError>;

    /// RoPE, cache write and causal attention of a packed prefill
    /// (`crate::decode::prefill_attention`).
    fn prefill_attention(
        dec: &mut Self::Decoder,
        layer: usize,
        qkv: FloatTensor<Self>,
        seqs: &[crate::decode::PackedSeq],
    ) -> Result<FloatTensor<Self>, crate::decode::DecodeError>;

    /// The q|k|v projection `x W` of a packed prefill (`W [hidden, (heads + 2 kv_heads)
    /// head_dim]`), then [`Self::prefill_attention`] on it
    /// (`crate::decode::prefill_qkv_attention`); `Stoke<Cuda>` writes q and the cache from the
    /// projection's GEMM where it applies.
    fn prefill_qkv_attention(
        dec: &mut Self::Decoder,
        layer: usize,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        seqs: &[crate::decode::PackedSeq],
    ) -> Result<FloatTensor<Self>, crate::decode::DecodeError> {
        Self::prefill_attention(dec, layer, Self::linear(x, weight, None), seqs)
    }

    /// Embedding of the current ids and its RMSNorm: `(x, normed)`, `[batch, 1, hidden]`.
    fn decode_embed(
        dec: &Self::Decoder,
        table: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// RoPE, cache append and attention of one step (`crate::decode::decode_attention`).
    fn decode_attention(
        dec: &mut Self::Decoder,
        layer: usize,
        qkv: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// The q|k|v projection `x W` and [`FusedOps::decode_attention`] of its output, the RoPE
    /// and cache append done by the projection's GEMM where a kernel applies.
    fn decode_qkv_attention(
        dec: &mut Self::Decoder,
        layer: usize,
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let qkv = Self::linear(x, weight, None);
        Self::decode_attention(dec, layer, qkv)
    }

    /// Picks each active lane's next id from a step's `logits [rows, 1, vocab]`.
    fn decode_sample(dec: &mut Self::Decoder, logits: FloatTensor<Self>);

    /// Picks the first id of each of `lanes` from a prefill's logits, row `i` for `lanes[i]`.
    fn prefill_sample(
        dec: &mut Self::Decoder,
        logits: FloatTensor<Self>,
        lanes: &[usize],
    ) -> Result<(), crate::decode::DecodeError>;

    /// Runs one decode step (`Stoke<Cuda>`: as a replayed CUDA graph).
    fn decode_step(
        dec: &mut Self::Decoder,
        body: &mut dyn FnMut(&mut Self::Decoder),
    ) -> Result<(), crate::decode::DecodeError>;

    /// The tokens of the oldest sampling not taken yet.
    fn decode_take(dec: &mut Self::Decoder) -> Option<crate::decode::Sampled>;

    /// The latest sampling's logits, where the decoder keeps them.
    fn decode_last_logits(dec: &mut Self::Decoder) -> Option<Vec<f32>>;

    /// Replaces the sampled ids the next step reads (teacher forcing, for evaluation).
    fn decode_force_ids(
        dec: &mut Self::Decoder,
        ids: &[u32],
    ) -> Result<(), crate::decode::DecodeError>;
}

/// `silu(y[.., 2j]) * y[.., 2j + 1]` over the last dimension of `y`, on any backend.
pub fn swiglu_reference<B: Backend>(y: FloatTensor<B>) -> FloatTensor<B> {
    let shape = y.shape();
    let dims = shape.as_slice().to_vec();
    let n = *dims.last().expect("rank >= 1");
    let rows = shape.num_elements() / n.max(1);
    let pairs = tensor::<B, 3>(B::float_reshape(y, Shape::new([rows, n / 2, 2])));
    let gate = pairs.clone().narrow(2, 0, 1);
    let up = pairs.narrow(2, 1, 1);
    let out = burn::tensor::activation::silu(gate) * up;
    let mut out_dims = dims;
    *out_dims.last_mut().unwrap() = n / 2;
    B::float_reshape(float(out), Shape::from(out_dims))
}

/// `linear_residual` then `rms_norm` of its output, each as the backend runs it: the
/// composition that [`FusedOps::linear_residual_rms_norm`] stands for. Returns `(s, normed)`.
pub fn linear_residual_then_rms_norm<B: FusedOps>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    residual: FloatTensor<B>,
    gamma: FloatTensor<B>,
    eps: f64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let s = B::linear_residual(x, weight, residual);
    let normed = B::rms_norm(s.clone(), gamma, eps);
    (s, normed)
}

/// The reference residual RMSNorm composition on any backend: `(x + residual, normed)`.
pub fn residual_rms_norm_reference<B: Backend>(
    x: FloatTensor<B>,
    residual: FloatTensor<B>,
    gamma: FloatTensor<B>,
    eps: f64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let sum = B::float_add(x, residual);
    let normed = rms_norm_reference::<B>(sum.clone(), gamma, eps);
    (sum, normed)
}

/// The reference RMSNorm composition on any backend.
pub fn rms_norm_reference<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    eps: f64,
) -> FloatTensor<B> {
    let dtype = x.dtype();
    let shape = x.shape();
    let last = shape.num_dims() - 1;
    let f32_of = |t: FloatTensor<B>| {
        if t.dtype() == DType::F32 {
            t
        } else {
            B::float_cast(t, FloatDType::F32)
        }
    };
    let xf = f32_of(x);
    let mean_sq = B::float_mean_dim(B::float_mul(xf.clone(), xf.clone()), last);
    let inv = B::float_recip(B::float_sqrt(B::float_add_scalar(
        mean_sq,
        Scalar::from(eps),
    )));
    let mut gamma_shape = vec![1; shape.num_dims()];
    gamma_shape[last] = shape[last];
    let g = f32_of(B::float_reshape(gamma, gamma_shape.into()));
    let y = B::float_mul(B::float_mul(xf, inv), g);
    if dtype == DType::F32 {
        y
    } else {
        B::float_cast(y, FloatDType::from(dtype))
    }
}

// The inner backends Stoke is used with get the reference compositions. Another backend opts
// in with `impl stoke::FusedOps for MyBackend { stoke::reference_decoder_ops!(); }`.
impl<E, J, Q> FusedOps for burn_ndarray::NdArray<E, J, Q>
where
    E: burn_ndarray::FloatNdArrayElement,
    J: burn_ndarray::IntNdArrayElement,
    Q: burn_ndarray::QuantElement,
    burn_ndarray::NdArrayTensor:
        From<burn_ndarray::SharedArray<E>> + From<burn_ndarray::SharedArray<J>>,
{
    crate::reference_decoder_ops!();
}

impl<R, F, J, BT> FusedOps for burn_cubecl::CubeBackend<R, F, J, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    J: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    crate::reference_decoder_ops!();
}

// Training: under autodiff the reference composition runs, so gradients flow through ordinary
// ops (train on `Autodiff<Cuda>`, serve the same model code on `Stoke<Cuda>`).
impl<B: Backend, C: burn_autodiff::checkpoint::strategy::CheckpointStrategy> FusedOps
    for burn_autodiff::Autodiff<B, C>
{
    crate::reference_decoder_ops!();
}

fn float<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

fn tensor<B: Backend, const D: usize>(p: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(p))
}

/// RMSNorm over the last dimension: `x * rsqrt(mean(x^2) + eps) * gamma`.
pub fn rms_norm<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    tensor(B::rms_norm(float(x), float(gamma), eps))
}

/// `residual + linear(x)` (the linear's bias included), the add fused into the GEMM where a
/// kernel applies (packed INT4 weights on `Stoke<Cuda>`).
pub fn linear_residual<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    linear: &burn::nn::Linear<B>,
    residual: Tensor<B, D>,
) -> Tensor<B, D> {
    let residual = match &linear.bias {
        Some(b) => residual + b.val().unsqueeze(),
        None => residual,
    };
    tensor(B::linear_residual(
        float(x),
        float(linear.weight.val()),
        float(residual),
    ))
}

/// `s = residual + linear(x)` (the linear's bias included) and `rms_norm(s, gamma, eps)`, the
/// norm folded into the GEMMs around it where kernels apply
/// ([`FusedOps::linear_residual_rms_norm`]). Returns `(s, normed)`.
pub fn linear_residual_rms_norm<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    linear: &burn::nn::Linear<B>,
    residual: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    eps: f64,
) -> (Tensor<B, D>, Tensor<B, D>) {
    let residual = match &linear.bias {
        Some(b) => residual + b.val().unsqueeze(),
        None => residual,
    };
    let (s, normed) = B::linear_residual_rms_norm(
        float(x),
        float(linear.weight.val()),
        float(residual),
        float(gamma),
        eps,
    );
    (tensor(s), tensor(normed))
}

/// A model's output head: `linear.forward(x)` ([`FusedOps::output_head`]).
pub fn output_head<B: FusedOps, const D: usize>(
    linear: &burn::nn::Linear<B>,
    x: Tensor<B, D>,
) -> Tensor<B, D> {
    if D == 1 {
        // Burn's linear takes a single row as a batch of one.
        return output_head(linear, x.unsqueeze::<2>()).squeeze_dim(0);
    }
    let weight = float(linear.weight.val());
    let bias = linear.bias.as_ref().map(|b| float(b.val()));
    tensor(B::output_head(float(x), weight, bias))
}

/// SwiGLU of a gate/up linear with interleaved columns (see [`FusedOps::linear_swiglu`]),
/// fused into the GEMM where a kernel applies. Returns `[.., n / 2]`.
pub fn linear_swiglu<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    linear: &burn::nn::Linear<B>,
) -> Tensor<B, D> {
    match &linear.bias {
        Some(_) => tensor(swiglu_reference::<B>(float(linear.forward(x)))),
        None => tensor(B::linear_swiglu(float(x), float(linear.weight.val()))),
    }
}

/// `s = x + residual` and `rms_norm(s)`, in one pass where a kernel applies. Returns `(s, normed)`.
pub fn residual_rms_norm<B: FusedOps, const D: usize>(
    x: Tensor<B, D>,
    residual: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    eps: f64,
) -> (Tensor<B, D>, Tensor<B, D>) {
    let (sum, normed) = B::residual_rms_norm(float(x), float(residual), float(gamma), eps);
    (tensor(sum), tensor(normed))
}
