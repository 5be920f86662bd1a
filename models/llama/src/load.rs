//! Loading a Llama model: from a GGUF file or a Hugging Face model directory, both
//! memory-mapped. Both sources feed one builder that checks every tensor's shape against the
//! configuration and converts it to the requested dtype on the device.
//!
//! - GGUF: configuration from the `llama.*` metadata, tensors dequantized (F32/F16/BF16/Q8_0/
//!   Q4_0/Q4_1), q/k rows un-permuted from llama.cpp's order to the rotate-half layout,
//!   tokenizer from the metadata.
//! - Hugging Face: `config.json`, `model.safetensors` or the shards listed in
//!   `model.safetensors.index.json` (F32/F16/BF16), `tokenizer.json`, and
//!   `generation_config.json` when present (its `eos_token_id` wins).

use crate::config::{ConfigError, LlamaConfig};
use crate::model::{Attention, Block, Llama, Mlp, Rope};
use crate::tokenizer::{self, TokenizerError};
use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::TensorPrimitive;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use std::collections::BTreeMap;
use std::path::Path;
use stoke::FusedOps;
use stoke_formats::gguf::{GgmlType, Gguf, GgufError, unpermute_qk_index, unpermute_qk_rows};
use stoke_formats::int4::{PackedInt4, from_gguf_q4};

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
    #[error(
        "{file}: tensor `{tensor}` has shape {actual:?}, the configuration implies {expected:?}"
    )]
    Shape {
        file: String,
        tensor: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("{file}: {what}")]
    Json { file: String, what: String },
    #[error("{file}: not a valid safetensors file: {reason}")]
    Safetensors { file: String, reason: String },
    #[error("{file}: tensor `{tensor}` is missing")]
    MissingTensor { file: String, tensor: String },
    #[error("{file}: tensor `{tensor}` has dtype {dtype}; F32, F16 and BF16 are supported")]
    Dtype {
        file: String,
        tensor: String,
        dtype: String,
    },
}

/// A loaded model with its configuration and tokenizer.
pub struct Loaded<B: Backend> {
    pub config: LlamaConfig,
    pub model: Llama<B>,
    pub tokenizer: tokenizers::Tokenizer,
}

/// The weights the model needs, independent of any file's naming.
#[derive(Clone, Copy, Debug)]
pub enum Weight {
    Embed,
    FinalNorm,
    Head,
    AttnNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    MlpNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
}

impl Weight {
    /// Shape in row-major `[out, in]` order (vectors `[n]`).
    fn shape(self, c: &LlamaConfig) -> Vec<usize> {
        let (h, q, kv, i, v) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
            c.intermediate_size,
            c.vocab_size,
        );
        match self {
            Weight::Embed | Weight::Head => vec![v, h],
            Weight::FinalNorm | Weight::AttnNorm(_) | Weight::MlpNorm(_) => vec![h],
            Weight::Q(_) => vec![q, h],
            Weight::K(_) | Weight::V(_) => vec![kv, h],
            Weight::O(_) => vec![h, q],
            Weight::Gate(_) | Weight::Up(_) => vec![i, h],
            Weight::Down(_) => vec![h, i],
        }
    }

    fn gguf_name(self) -> String {
        match self {
            Weight::Embed => "token_embd.weight".into(),
            Weight::FinalNorm => "output_norm.weight".into(),
            Weight::Head => "output.weight".into(),
            Weight::AttnNorm(l) => format!("blk.{l}.attn_norm.weight"),
            Weight::Q(l) => format!("blk.{l}.attn_q.weight"),
            Weight::K(l) => format!("blk.{l}.attn_k.weight"),
            Weight::V(l) => format!("blk.{l}.attn_v.weight"),
            Weight::O(l) => format!("blk.{l}.attn_output.weight"),
            Weight::MlpNorm(l) => format!("blk.{l}.ffn_norm.weight"),
            Weight::Gate(l) => format!("blk.{l}.ffn_gate.weight"),
            Weight::Up(l) => format!("blk.{l}.ffn_up.weight"),
            Weight::Down(l) => format!("blk.{l}.ffn_down.weight"),
        }
    }

    fn hf_name(self) -> String {
        match self {
            Weight::Embed => "model.embed_tokens.weight".into(),
            Weight::FinalNorm => "model.norm.weight".into(),
            Weight::Head => "lm_head.weight".into(),
            Weight::AttnNorm(l) => format!("model.layers.{l}.input_layernorm.weight"),
            Weight::Q(l) => format!("model.layers.{l}.self_attn.q_proj.weight"),
            Weight::K(l) => format!("model.layers.{l}.self_attn.k_proj.weight"),
            Weight::V(l) => format!("model.layers.{l}.self_attn.v_proj.weight"),
            Weight::O(l) => format!("model.layers.{l}.self_attn.o_proj.weight"),
            Weight::MlpNorm(l) => format!("model.layers.{l}.post_attention_layernorm.weight"),
            Weight::Gate(l) => format!("model.layers.{l}.mlp.gate_proj.weight"),
            Weight::Up(l) => format!("model.layers.{l}.mlp.up_proj.weight"),
            Weight::Down(l) => format!("model.layers.{l}.mlp.down_proj.weight"),
        }
    }
}

/// Builds the model from `get(weight)` (values in the Hugging Face layout, shape already
/// checked), with a progress bar over the tensors. q, k and v become one q|k|v projection
/// (columns side by side), gate and up one projection with interleaved columns (for the SwiGLU
/// epilogue). `packed(weight)` may supply a projection in Stoke's packed INT4 format (GGUF Q4
/// groups as they are); when every part of a projection is packed and `keep` takes the
/// combined weight (backends that keep packed weights), it stays packed; otherwise `get` gives
/// the values.
fn build<B: Backend>(
    cfg: &LlamaConfig,
    device: &B::Device,
    dtype: DType,
    max_positions: usize,
    get: impl Fn(Weight) -> Result<Vec<f32>, LoadError>,
    packed: impl Fn(Weight) -> Result<Option<PackedInt4>, LoadError>,
    keep: impl Fn(PackedInt4) -> Option<Tensor<B, 2>>,
) -> Result<Llama<B>, LoadError> {
    let (hid, h, kvh, d, inter) = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    );
    let total = 3 + 9 * cfg.num_hidden_layers as u64;
    let bar = indicatif::ProgressBar::new(total).with_style(
        indicatif::ProgressStyle::with_template("loading {bar:40} {pos}/{len} tensors {elapsed}")
            .expect("valid template"),
    );
    let get = |w: Weight| {
        bar.inc(1);
        get(w)
    };
    // Burn's Linear wants `[in, out]`; the sources give `[out, in]`.
    let linear = |w: Vec<f32>, out: usize, inp: usize| -> Linear<B> {
        let mut t = vec![0f32; w.len()];
        for o in 0..out {
            for i in 0..inp {
                t[i * out + o] = w[o * inp + i];
            }
        }
        let weight = Tensor::<B, 2>::from_data(TensorData::new(t, [inp, out]), device).cast(dtype);
        Linear {
            weight: Param::from_tensor(weight),
            bias: None,
        }
    };
    #[derive(Clone, Copy)]
    enum Combine {
        /// Output columns side by side.
        Concat,
        /// Output columns interleaved (two parts).
        Interleave,
    }
    // One projection of the parts `ws` (each `[out_i, inp]` in the source layout).
    let project =
        |ws: &[(Weight, usize)], inp: usize, combine: Combine| -> Result<Linear<B>, LoadError> {
            let mut parts = Vec::with_capacity(ws.len());
            for &(w, _) in ws {
                match packed(w)? {
                    Some(p) => parts.push(p),
                    None => break,
                }
            }
            if parts.len() == ws.len() {
                let refs: Vec<&PackedInt4> = parts.iter().collect();
                let combined = match (combine, refs.as_slice()) {
                    (_, [one]) => Ok((*one).clone()),
                    (Combine::Interleave, [a, b]) => PackedInt4::interleave_columns(a, b),
                    _ => PackedInt4::concat_columns(&refs),
                };
                if let Some(t) = combined.ok().and_then(&keep) {
                    bar.inc(ws.len() as u64);
                    return Ok(Linear {
                        weight: Param::from_tensor(t),
                        bias: None,
                    });
                }
            }
            let values: Vec<Vec<f32>> =
                ws.iter().map(|&(w, _)| get(w)).collect::<Result<_, _>>()?;
            let out: usize = ws.iter().map(|&(_, o)| o).sum();
            let rows: Vec<f32> = match combine {
                Combine::Concat => values.concat(),
                Combine::Interleave => {
                    let n = ws[0].1;
                    (0..2 * n)
                        .flat_map(|r| {
                            let v = &values[r % 2];
                            v[(r / 2) * inp..(r / 2 + 1) * inp].iter().copied()
                        })
                        .collect()
                }
            };
            Ok(linear(rows, out, inp))
        };
    let vector = |v: Vec<f32>| {
        Param::from_tensor(
            Tensor::<B, 1>::from_data(TensorData::new(v.clone(), [v.len()]), device).cast(dtype),
        )
    };
    let embed = get(Weight::Embed)?;
    // Tied head: a transposed copy of the embedding made once here, so each step's logits
    // matmul reads a contiguous [hidden, vocab] weight instead of transposing the embedding.
    let lm_head = if cfg.tie_word_embeddings {
        bar.inc(1);
        linear(embed.clone(), cfg.vocab_size, hid)
    } else {
        linear(get(Weight::Head)?, cfg.vocab_size, hid)
    };
    let embed_tokens = Param::from_tensor(
        Tensor::<B, 2>::from_data(TensorData::new(embed, [cfg.vocab_size, hid]), device)
            .cast(dtype),
    );
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for l in 0..cfg.num_hidden_layers {
        layers.push(Block {
            attn_norm: vector(get(Weight::AttnNorm(l))?),
            attn: Attention {
                qkv_proj: project(
                    &[
                        (Weight::Q(l), h * d),
                        (Weight::K(l), kvh * d),
                        (Weight::V(l), kvh * d),
                    ],
                    hid,
                    Combine::Concat,
                )?,
                o_proj: project(&[(Weight::O(l), hid)], h * d, Combine::Concat)?,
                n_heads: h,
                n_kv_heads: kvh,
                head_dim: d,
            },
            mlp_norm: vector(get(Weight::MlpNorm(l))?),
            mlp: Mlp {
                gate_up_proj: project(
                    &[(Weight::Gate(l), inter), (Weight::Up(l), inter)],
                    hid,
                    Combine::Interleave,
                )?,
                down_proj: project(&[(Weight::Down(l), hid)], inter, Combine::Concat)?,
            },
        });
    }
    let norm = vector(get(Weight::FinalNorm)?);
    bar.finish_and_clear();
    Ok(Llama {
        embed_tokens,
        layers,
        norm,
        lm_head,
        rope: Rope::new(
            cfg,
            max_positions.min(cfg.max_position_embeddings).max(1),
            device,
        ),
        rms_norm_eps: cfg.rms_norm_eps,
    })
}

fn mmap(path: &Path) -> Result<memmap2::Mmap, LoadError> {
    let io = |source| LoadError::Io {
        file: path.display().to_string(),
        source,
    };
    let f = std::fs::File::open(path).map_err(io)?;
    // SAFETY: the map is read-only and lives only while loading; a concurrent writer to the file
    // could change bytes under it, which would at worst produce wrong weights.
    unsafe { memmap2::Mmap::map(&f) }.map_err(io)
}

/// Loads a llama-architecture GGUF file onto `device`, weights in `dtype` (F32, F16 or BF16).
/// `max_positions` bounds the rotary tables (and so the context length used).
pub fn load_gguf<B: Backend>(
    path: &Path,
    device: &B::Device,
    dtype: DType,
    max_positions: usize,
) -> Result<Loaded<B>, LoadError> {
    load_gguf_with::<B>(path, device, dtype, max_positions, |_, _, _| None)
}

/// Like [`load_gguf`], but Q4_0 / Q4_1 projections stay in their 4-bit groups: loaded straight
/// into Stoke's packed INT4 format (no re-quantization) on backends that keep packed weights
/// (`Stoke<I>`); elsewhere they are dequantized as `load_gguf` does.
pub fn load_gguf_packed<B: FusedOps>(
    path: &Path,
    device: &B::Device,
    dtype: DType,
    max_positions: usize,
) -> Result<Loaded<B>, LoadError> {
    load_gguf_with::<B>(path, device, dtype, max_positions, |p, dtype, device| {
        B::packed_int4_weight(p, dtype, device)
            .map(|t| Tensor::from_primitive(TensorPrimitive::Float(t)))
    })
}

fn load_gguf_with<B: Backend>(
    path: &Path,
    device: &B::Device,
    dtype: DType,
    max_positions: usize,
    keep_packed: impl Fn(PackedInt4, DType, &B::Device) -> Option<Tensor<B, 2>>,
) -> Result<Loaded<B>, LoadError> {
    let file = path.display().to_string();
    let map = mmap(path)?;
    let g = Gguf::parse(&file, &map)?;
    let cfg = LlamaConfig::from_gguf(&g)?;
    let tokenizer = tokenizer::from_gguf(&g)?;
    let tensor = |w: Weight| -> Result<(&stoke_formats::gguf::TensorInfo, Vec<usize>), LoadError> {
        let (name, shape) = (w.gguf_name(), w.shape(&cfg));
        let t = g.tensor(&name)?;
        if t.shape() != shape {
            return Err(LoadError::Shape {
                file: file.clone(),
                tensor: name,
                expected: shape,
                actual: t.shape(),
            });
        }
        Ok((t, shape))
    };
    // Rows of q and k come in llama.cpp's order; this is where each row comes from.
    // Rows of q and k come in llama.cpp's order, per head.
    let qk_heads = |w: Weight| match w {
        Weight::Q(_) => Some(cfg.num_attention_heads),
        Weight::K(_) => Some(cfg.num_key_value_heads),
        _ => None,
    };
    let get = |w: Weight| {
        let (t, shape) = tensor(w)?;
        let v = g.dequantize(t)?;
        Ok(match qk_heads(w) {
            Some(heads) => unpermute_qk_rows(&v, shape[0], shape[1], heads),
            None => v,
        })
    };
    let packed = |w: Weight| -> Result<Option<PackedInt4>, LoadError> {
        let (t, shape) = tensor(w)?;
        let asymmetric = match t.ggml_type {
            GgmlType::Q4_0 => false,
            GgmlType::Q4_1 => true,
            _ => return Ok(None),
        };
        // The kernel layout needs k % 16 and n % 64: other shapes stay dequantized.
        let Ok(p) = from_gguf_q4(g.raw(t)?, shape[0], shape[1], asymmetric) else {
            return Ok(None);
        };
        // GGUF rows are the packed weight's columns.
        let p = match qk_heads(w) {
            Some(heads) => p
                .permute_columns(&unpermute_qk_index(shape[0], heads))
                .expect("a permutation of the columns"),
            None => p,
        };
        Ok(Some(p))
    };
    let keep = |p: PackedInt4| keep_packed(p, dtype, device);
    let model = build::<B>(&cfg, device, dtype, max_positions, get, packed, keep)?;
    Ok(Loaded {
        config: cfg,
        model,
        tokenizer,
    })
}

/// Loads `path`: a Hugging Face model directory, or else a GGUF file.
pub fn load<B: Backend>(
    path: &Path,
    device: &B::Device,
    dtype: DType,
    max_positions: usize,
) -> Result<Loaded<B>, LoadError> {
    if path.is_dir() {
        load_hf_dir(path, device, dtype, max_positions)
    } else {
        load_gguf(path, device, dtype, max_positions)
    }
}

fn read_json(path: &Path) -> Result<serde_json::Value, LoadError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Io {
        file: file.clone(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| LoadError::Json {
        file,
        what: format!("invalid JSON: {e}"),
    })
}

/// Loads a Hugging Face Llama model directory (see the module docs) onto `device`.
pub fn load_hf_dir<B: Backend>(
    dir: &Path,
    device: &B::Device,
    dtype: DType,
    max_positions: usize,
) -> Result<Loaded<B>, LoadError> {
    let config_path = dir.join("config.json");
    let mut cfg = LlamaConfig::from_hf_json(
        &config_path.display().to_string(),
        &read_json(&config_path)?,
    )?;
    let gen_path = dir.join("generation_config.json");
    if gen_path.exists() {
        let eos = crate::config::token_ids(&read_json(&gen_path)?["eos_token_id"]);
        if !eos.is_empty() {
            cfg.eos_token_ids = eos;
        }
    }
    let tok_path = dir.join("tokenizer.json");
    let tokenizer =
        tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| TokenizerError::Build {
            file: tok_path.display().to_string(),
            reason: e.to_string(),
        })?;

    // The shards: one file, or the files the index's weight map names.
    let index_path = dir.join("model.safetensors.index.json");
    let mut shard_of: BTreeMap<String, String> = BTreeMap::new();
    let shards: Vec<String> = if index_path.exists() {
        let index = read_json(&index_path)?;
        let map = index["weight_map"]
            .as_object()
            .ok_or_else(|| LoadError::Json {
                file: index_path.display().to_string(),
                what: "no `weight_map` object".into(),
            })?;
        for (k, v) in map {
            let f = v.as_str().ok_or_else(|| LoadError::Json {
                file: index_path.display().to_string(),
                what: format!("`weight_map.{k}` is not a file name"),
            })?;
            shard_of.insert(k.clone(), f.to_string());
        }
        let mut files: Vec<String> = shard_of.values().cloned().collect();
        files.sort();
        files.dedup();
        files
    } else {
        vec!["model.safetensors".to_string()]
    };
    let maps: Vec<(String, memmap2::Mmap)> = shards
        .iter()
        .map(|s| mmap(&dir.join(s)).map(|m| (s.clone(), m)))
        .collect::<Result<_, _>>()?;
    let parsed: Vec<(String, safetensors::SafeTensors)> = maps
        .iter()
        .map(|(name, m)| {
            let file = dir.join(name).display().to_string();
            safetensors::SafeTensors::deserialize(m)
                .map(|st| (name.clone(), st))
                .map_err(|e| LoadError::Safetensors {
                    file,
                    reason: e.to_string(),
                })
        })
        .collect::<Result<_, _>>()?;
    let model = build::<B>(
        &cfg,
        device,
        dtype,
        max_positions,
        |w| {
            let (name, shape) = (w.hf_name(), w.shape(&cfg));
            let shard = shard_of
                .get(&name)
                .cloned()
                .unwrap_or_else(|| shards[0].clone());
            let file = dir.join(&shard).display().to_string();
            let st = &parsed
                .iter()
                .find(|(n, _)| *n == shard)
                .expect("every shard was parsed")
                .1;
            let view = st.tensor(&name).map_err(|_| LoadError::MissingTensor {
                file: file.clone(),
                tensor: name.clone(),
            })?;
            if view.shape() != shape.as_slice() {
                return Err(LoadError::Shape {
                    file,
                    tensor: name,
                    expected: shape,
                    actual: view.shape().to_vec(),
                });
            }
            let data = view.data();
            Ok(match view.dtype() {
                safetensors::Dtype::F32 => data
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
                safetensors::Dtype::F16 => data
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                safetensors::Dtype::BF16 => data
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                other => {
                    return Err(LoadError::Dtype {
                        file,
                        tensor: name,
                        dtype: format!("{other:?}"),
                    });
                }
            })
        },
        |_| Ok(None),
        |_| None,
    )?;
    Ok(Loaded {
        config: cfg,
        model,
        tokenizer,
    })
}
