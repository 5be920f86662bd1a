//! Loading a Llama model from a GGUF file (memory-mapped): configuration from the metadata,
//! tensors dequantized to f32 and cast to the requested dtype, q/k rows un-permuted from
//! llama.cpp's order to the rotate-half layout, tokenizer from the metadata.

use crate::config::{ConfigError, LlamaConfig};
use crate::model::{Attention, Block, Llama, Mlp, Rope};
use crate::tokenizer::{self, TokenizerError};
use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use std::path::Path;
use stoke_formats::gguf::{Gguf, GgufError, unpermute_qk_rows};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("{file}: tensor `{tensor}` has shape {actual:?}, the configuration implies {expected:?}")]
    Shape { file: String, tensor: String, expected: Vec<usize>, actual: Vec<usize> },
}

/// A loaded model with its configuration and tokenizer.
pub struct Loaded<B: Backend> {
    pub config: LlamaConfig,
    pub model: Llama<B>,
    pub tokenizer: tokenizers::Tokenizer,
}

/// Loads a llama-architecture GGUF file onto `device`, weights in `dtype` (F32, F16 or BF16).
/// `max_positions` bounds the rotary tables (and so the context length used).
pub fn load_gguf<B: Backend>(path: &Path, device: &B::Device, dtype: DType, max_positions: usize) -> Result<Loaded<B>, LoadError> {
    let file = path.display().to_string();
    let f = std::fs::File::open(path).map_err(|source| LoadError::Io { file: file.clone(), source })?;
    // SAFETY: the map is read-only and lives only inside this function; a concurrent writer to
    // the file could change bytes under it, which would at worst produce wrong weights.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|source| LoadError::Io { file: file.clone(), source })?;
    let g = Gguf::parse(&file, &map)?;
    let cfg = LlamaConfig::from_gguf(&g)?;
    let tokenizer = tokenizer::from_gguf(&g)?;
    let (hid, h, kvh, d, inter) = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size);

    let load = |name: &str, shape: &[usize]| -> Result<Vec<f32>, LoadError> {
        let t = g.tensor(name)?;
        if t.shape() != shape {
            return Err(LoadError::Shape { file: file.clone(), tensor: name.into(), expected: shape.to_vec(), actual: t.shape() });
        }
        Ok(g.dequantize(t)?)
    };
    let tensor1 = |v: Vec<f32>| Param::from_tensor(Tensor::<B, 1>::from_data(TensorData::new(v.clone(), [v.len()]), device).cast(dtype));
    // GGUF stores an `[out, in]` matrix; Burn's Linear wants `[in, out]`.
    let linear = |w: Vec<f32>, out: usize, inp: usize| -> Linear<B> {
        let mut t = vec![0f32; w.len()];
        for o in 0..out {
            for i in 0..inp {
                t[i * out + o] = w[o * inp + i];
            }
        }
        let weight = Tensor::<B, 2>::from_data(TensorData::new(t, [inp, out]), device).cast(dtype);
        Linear { weight: Param::from_tensor(weight), bias: None }
    };

    let embed = load("token_embd.weight", &[cfg.vocab_size, hid])?;
    // Tied head: a transposed copy of the embedding made once here, so each step's logits
    // matmul reads a contiguous [hidden, vocab] weight instead of transposing the embedding.
    let tied_head = cfg.tie_word_embeddings.then(|| linear(embed.clone(), cfg.vocab_size, hid));
    let embed_tokens = Param::from_tensor(Tensor::<B, 2>::from_data(TensorData::new(embed, [cfg.vocab_size, hid]), device).cast(dtype));
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for l in 0..cfg.num_hidden_layers {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let q = unpermute_qk_rows(&load(&n("attn_q"), &[h * d, hid])?, h * d, hid, h);
        let k = unpermute_qk_rows(&load(&n("attn_k"), &[kvh * d, hid])?, kvh * d, hid, kvh);
        layers.push(Block {
            attn_norm: tensor1(load(&n("attn_norm"), &[hid])?),
            attn: Attention {
                q_proj: linear(q, h * d, hid),
                k_proj: linear(k, kvh * d, hid),
                v_proj: linear(load(&n("attn_v"), &[kvh * d, hid])?, kvh * d, hid),
                o_proj: linear(load(&n("attn_output"), &[hid, h * d])?, hid, h * d),
                n_heads: h,
                n_kv_heads: kvh,
                head_dim: d,
            },
            mlp_norm: tensor1(load(&n("ffn_norm"), &[hid])?),
            mlp: Mlp {
                gate_proj: linear(load(&n("ffn_gate"), &[inter, hid])?, inter, hid),
                up_proj: linear(load(&n("ffn_up"), &[inter, hid])?, inter, hid),
                down_proj: linear(load(&n("ffn_down"), &[hid, inter])?, hid, inter),
            },
        });
    }
    let lm_head = match tied_head {
        Some(head) => head,
        None => linear(load("output.weight", &[cfg.vocab_size, hid])?, cfg.vocab_size, hid),
    };
    let model = Llama {
        embed_tokens,
        layers,
        norm: tensor1(load("output_norm.weight", &[hid])?),
        lm_head,
        rope: Rope::new(&cfg, max_positions.min(cfg.max_position_embeddings).max(1), device),
        rms_norm_eps: cfg.rms_norm_eps,
    };
    Ok(Loaded { config: cfg, model, tokenizer })
}
