//! Loading a Llama model: from a GGUF file or a Hugging Face model directory, both
//! memory-mapped. Both sources feed one builder that checks every tensor's shape against the
//! configuration and converts it to the requested dtype on the device.
//!
//! - GGUF: configuration from the `llama.*` metadata, tensors dequantized (F32/F16/BF16/Q8_0/
//!   Q4_0/Q4_1), q/k rows un-permuted from llama.cpp's order to the rotate-half layout,
//!   tokenizer from the metadata.
//! - Hugging Face: `config.json`, `model.safetensors` or the shards listed in
//!   `model.safetensors.index.json` (F32/F16/BF16, and FP8 E4M3 checkpoints: a weight's codes
//!   with its `weight_scale`, one per tensor or per output channel, or its `weight_scale_inv`,
//!   one per block of `quantization_config.weight_block_size`), `tokenizer.json`, and
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
    #[error(
        "{file}: tensor `{tensor}` has dtype {dtype}; F32, F16 and BF16 are supported, and \
         F8_E4M3 for a weight with its `weight_scale` or `weight_scale_inv`"
    )]
    Dtype {
        file: String,
        tensor: String,
        dtype: String,
    },
    #[error("{file}: FP8 weight `{tensor}`: {problem}")]
    Fp8Scale {
        file: String,
        tensor: String,
        problem: String,
    },
    #[error("{file}: safetensors header entry `{tensor}`: {problem}")]
    SafetensorsEntry {
        file: String,
        tensor: String,
        problem: String,
    },
    #[error(transparent)]
    Packed(#[from] crate::packed_file::PackedFileError),
}

/// A loaded model with its configuration and tokenizer.
pub struct Loaded<B: Backend> {
    pub config: LlamaConfig,
    pub model: Llama<B>,
    pub tokenizer: tokenizers::Tokenizer,
    /// The chat template the file carries (Jinja, as Hugging Face writes it): GGUF
    /// `tokenizer.chat_template`, or a model directory's `tokenizer_config.json` /
    /// `chat_template.jinja`.
    pub chat_template: Option<String>,
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
    let total = (cfg.num_hidden_layers as u64)
        .saturating_mul(9)
        .saturating_add(3);
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
    // Grown layer by layer: each is backed by tensors the file holds, whatever the
    // configuration's layer count says.
    let mut layers = Vec::new();
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
        plan: stoke::Plan::default(),
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

/// The tokenizer a GGUF file's metadata describes, without loading its weights.
pub fn gguf_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer, LoadError> {
    let map = mmap(path)?;
    let g = Gguf::parse(&path.display().to_string(), &map)?;
    Ok(tokenizer::from_gguf(&g)?)
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
    let chat_template = g
        .metadata
        .get("tokenizer.chat_template")
        .and_then(stoke_formats::gguf::Value::as_str)
        .map(str::to_string);
    Ok(Loaded {
        config: cfg,
        model,
        tokenizer,
        chat_template,
    })
}

/// The chat template of a Hugging Face model directory: `chat_template.jinja`, else
/// `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates: the one
/// named `default`, else the first).
fn hf_chat_template(dir: &Path) -> Result<Option<String>, LoadError> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return std::fs::read_to_string(&jinja)
            .map(Some)
            .map_err(|source| LoadError::Io {
                file: jinja.display().to_string(),
                source,
            });
    }
    let path = dir.join("tokenizer_config.json");
    if !path.exists() {
        return Ok(None);
    }
    let json = read_json(&path)?;
    Ok(match &json["chat_template"] {
        serde_json::Value::String(t) => Some(t.clone()),
        serde_json::Value::Array(named) => named
            .iter()
            .find(|t| t["name"] == "default")
            .or(named.first())
            .and_then(|t| t["template"].as_str())
            .map(str::to_string),
        _ => None,
    })
}

/// Loads `path` as the bundled programs do: a Stoke packed model file keeps its INT4
/// projections packed where the backend keeps packed weights; with `packed`, a GGUF file's
/// Q4_0/Q4_1 projections do too ([`load_gguf_packed`]); anything else goes through [`load`].
pub fn open<B: FusedOps>(
    path: &Path,
    packed: bool,
    device: &B::Device,
    dtype: DType,
    max_positions: usize,
) -> Result<Loaded<B>, LoadError> {
    if crate::packed_file::is_packed_file(path) {
        Ok(crate::packed_file::load::<B>(
            path,
            device,
            dtype,
            max_positions,
        )?)
    } else if packed && !path.is_dir() {
        load_gguf_packed::<B>(path, device, dtype, max_positions)
    } else {
        load::<B>(path, device, dtype, max_positions)
    }
}

/// Loads `path`: a Hugging Face model directory, a Stoke packed model (`.safetensors`, see
/// `crate::packed_file`; projections dequantized here, `packed_file::load` keeps them packed),
/// or else a GGUF file.
pub fn load<B: Backend>(
    path: &Path,
    device: &B::Device,
    dtype: DType,
    max_positions: usize,
) -> Result<Loaded<B>, LoadError> {
    if crate::packed_file::is_packed_file(path) {
        Ok(crate::packed_file::load_dequantized(
            path,
            device,
            dtype,
            max_positions,
        )?)
    } else if path.is_dir() {
        load_hf_dir(path, device, dtype, max_positions)
    } else {
        load_gguf(path, device, dtype, max_positions)
    }
}

fn read_json(path: &Path) -> Result<serde_json::Value, LoadError> {
    let file = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| LoadError::Io {
        file: file.clone(),
        source,
    })?;
    parse_json(&file, &bytes)
}

/// Parses the JSON document `bytes` (the contents of `file`).
pub fn parse_json(file: &str, bytes: &[u8]) -> Result<serde_json::Value, LoadError> {
    serde_json::from_slice(bytes).map_err(|e| LoadError::Json {
        file: file.into(),
        what: format!("invalid JSON: {e}"),
    })
}

/// Reads a Hugging Face `config.json` (`bytes`, the contents of `file`).
pub fn config_from_json(file: &str, bytes: &[u8]) -> Result<LlamaConfig, LoadError> {
    Ok(LlamaConfig::from_hf_json(file, &parse_json(file, bytes)?)?)
}

/// The `weight_map` of a `model.safetensors.index.json` (`index`, read from `file`): tensor
/// name -> shard file name. Shard names must be plain file names in the model directory.
pub fn shard_index(
    file: &str,
    index: &serde_json::Value,
) -> Result<BTreeMap<String, String>, LoadError> {
    let json = |what: String| LoadError::Json {
        file: file.into(),
        what,
    };
    let map = index["weight_map"]
        .as_object()
        .ok_or_else(|| json("no `weight_map` object".into()))?;
    if map.is_empty() {
        return Err(json("`weight_map` is empty".into()));
    }
    let mut shard_of = BTreeMap::new();
    for (k, v) in map {
        let f = v
            .as_str()
            .ok_or_else(|| json(format!("`weight_map.{k}` is not a file name")))?;
        let plain = !f.is_empty()
            && f != "."
            && f != ".."
            && !f.contains(['/', '\\'])
            && !Path::new(f).is_absolute();
        if !plain {
            return Err(json(format!(
                "`weight_map.{k}` = {f:?} is not a file name in the model directory"
            )));
        }
        shard_of.insert(k.clone(), f.to_string());
    }
    Ok(shard_of)
}

/// Checks the header of the safetensors file `bytes` (the contents of `file`) and returns its
/// tensor views. Every entry is checked before the `safetensors` crate sees the file, so a bad
/// entry's error names it: a dtype the format does not know, a shape whose size overflows, data
/// offsets that are reversed, disagree with the shape, leave gaps, overlap or run past the file.
pub fn read_safetensors<'a>(
    file: &str,
    bytes: &'a [u8],
) -> Result<safetensors::SafeTensors<'a>, LoadError> {
    let whole = |reason: String| LoadError::Safetensors {
        file: file.into(),
        reason,
    };
    let Some((n, rest)) = bytes.split_first_chunk::<8>() else {
        return Err(whole(format!(
            "{} bytes, shorter than the 8-byte header length",
            bytes.len()
        )));
    };
    let n = u64::from_le_bytes(*n);
    let Some(header) = usize::try_from(n).ok().and_then(|n| rest.get(..n)) else {
        return Err(whole(format!(
            "header length {n} exceeds the {} bytes after it",
            rest.len()
        )));
    };
    let data_len = (rest.len() - header.len()) as u64;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header)
        .map_err(|e| whole(format!("header is not a JSON object: {e}")))?;
    let mut spans = Vec::with_capacity(header.len());
    for (name, info) in &header {
        let entry = |problem: String| LoadError::SafetensorsEntry {
            file: file.into(),
            tensor: name.clone(),
            problem,
        };
        if name == "__metadata__" {
            let strings = info
                .as_object()
                .is_some_and(|m| m.values().all(serde_json::Value::is_string));
            if !strings {
                return Err(entry("not an object of strings".into()));
            }
            continue;
        }
        let dtype: safetensors::Dtype =
            serde_json::from_value(info["dtype"].clone()).map_err(|_| {
                entry(format!(
                    "dtype {} is not a safetensors dtype",
                    info["dtype"]
                ))
            })?;
        let shape = info["shape"]
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(serde_json::Value::as_u64)
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| entry(format!("shape {} is not a list of sizes", info["shape"])))?;
        let offsets = info["data_offsets"]
            .as_array()
            .filter(|a| a.len() == 2)
            .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
            .ok_or_else(|| {
                entry(format!(
                    "data_offsets {} is not [start, end]",
                    info["data_offsets"]
                ))
            })?;
        let bits = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.bitsize() as u64))
            .filter(|&b| usize::try_from(b / 8).is_ok())
            .ok_or_else(|| entry(format!("shape {shape:?} of {dtype:?} overflows")))?;
        if bits % 8 != 0 {
            return Err(entry(format!(
                "shape {shape:?} of {dtype:?} is not a whole number of bytes"
            )));
        }
        let (start, end) = offsets;
        if start > end || end > data_len {
            return Err(entry(format!(
                "data_offsets [{start}, {end}) do not lie in the {data_len} data bytes"
            )));
        }
        if end - start != bits / 8 {
            return Err(entry(format!(
                "data_offsets [{start}, {end}) hold {} bytes, shape {shape:?} of {dtype:?} needs {}",
                end - start,
                bits / 8
            )));
        }
        spans.push((start, end, name));
    }
    spans.sort();
    let mut at = 0;
    for &(start, end, name) in &spans {
        if start != at {
            return Err(LoadError::SafetensorsEntry {
                file: file.into(),
                tensor: name.clone(),
                problem: format!(
                    "data_offsets [{start}, {end}) {} the data before it (ending at {at})",
                    if start < at {
                        "overlap"
                    } else {
                        "leave a gap after"
                    }
                ),
            });
        }
        at = end;
    }
    if at != data_len {
        return Err(whole(format!(
            "the tensors' data ends at {at}, the file's data section at {data_len}"
        )));
    }
    safetensors::SafeTensors::deserialize(bytes).map_err(|e| whole(e.to_string()))
}

/// The values of tensor `name` of the safetensors file `st` (read from `file`) as f32, after
/// checking that its shape is `shape` and its dtype F32, F16 or BF16.
pub fn safetensors_values(
    file: &str,
    st: &safetensors::SafeTensors,
    name: &str,
    shape: &[usize],
) -> Result<Vec<f32>, LoadError> {
    let view = st.tensor(name).map_err(|_| LoadError::MissingTensor {
        file: file.into(),
        tensor: name.into(),
    })?;
    if view.shape() != shape {
        return Err(LoadError::Shape {
            file: file.into(),
            tensor: name.into(),
            expected: shape.to_vec(),
            actual: view.shape().to_vec(),
        });
    }
    float_values(file, name, &view)
}

/// A float tensor's values as f32 (F32, F16 or BF16).
fn float_values(
    file: &str,
    name: &str,
    view: &safetensors::tensor::TensorView,
) -> Result<Vec<f32>, LoadError> {
    let data = view.data();
    Ok(match view.dtype() {
        safetensors::Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
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
                file: file.into(),
                tensor: name.into(),
                dtype: format!("{other:?}"),
            });
        }
    })
}

/// How an FP8 weight's scale tensor applies, from its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Scales {
    /// One scale (`[]` or `[1]`).
    Tensor,
    /// One per output channel (`[out]` or `[out, 1]`).
    Channel,
    /// One per block of `[rows, cols]` (`[ceil(out / rows), ceil(in / cols)]`).
    Block([usize; 2]),
}

impl Fp8Scales {
    /// The layout of a scale tensor of `scale_shape` for a weight `[out, inp]`; blocks are
    /// `block` (the checkpoint's `weight_block_size`) or, without it, the power of two that
    /// gives the scale's shape.
    pub fn of(
        scale_shape: &[usize],
        [out, inp]: [usize; 2],
        block: Option<[usize; 2]>,
    ) -> Result<Self, String> {
        match scale_shape {
            [] | [1] => return Ok(Self::Tensor),
            [n] | [n, 1] if *n == out => return Ok(Self::Channel),
            _ => {}
        }
        let [a, b] = scale_shape else {
            return Err(format!(
                "scale shape {scale_shape:?} is none of [], [1], [{out}], [{out}, 1] or a block grid"
            ));
        };
        let [bo, bi] = block.unwrap_or([
            out.div_ceil((*a).max(1)).next_power_of_two(),
            inp.div_ceil((*b).max(1)).next_power_of_two(),
        ]);
        if bo == 0 || bi == 0 || out.div_ceil(bo) != *a || inp.div_ceil(bi) != *b {
            return Err(format!(
                "scale shape {scale_shape:?} is no grid of [{bo}, {bi}] blocks over [{out}, {inp}]"
            ));
        }
        Ok(Self::Block([bo, bi]))
    }

    /// The f32 values `e4m3(code) * scale` of a weight `[out, inp]` whose scales are `scales`.
    pub fn dequantize(self, codes: &[u8], [out, inp]: [usize; 2], scales: &[f32]) -> Vec<f32> {
        use stoke_formats::fp8::e4m3_to_f32;
        let cols = match self {
            Self::Block([_, bi]) => inp.div_ceil(bi),
            _ => 0,
        };
        let mut v = Vec::with_capacity(out * inp);
        for r in 0..out {
            for c in 0..inp {
                let s = match self {
                    Self::Tensor => scales[0],
                    Self::Channel => scales[r],
                    Self::Block([bo, bi]) => scales[(r / bo) * cols + c / bi],
                };
                v.push(e4m3_to_f32(codes[r * inp + c]) * s);
            }
        }
        v
    }
}

/// Loads a Hugging Face Llama model directory (see the module docs) onto `device`.
pub fn load_hf_dir<B: Backend>(
    dir: &Path,
    device: &B::Device,
    dtype: DType,
    max_positions: usize,
) -> Result<Loaded<B>, LoadError> {
    let config_path = dir.join("config.json");
    let config_json = read_json(&config_path)?;
    let mut cfg = LlamaConfig::from_hf_json(&config_path.display().to_string(), &config_json)?;
    let gen_path = dir.join("generation_config.json");
    if gen_path.exists() {
        let eos = crate::config::token_ids(
            &gen_path.display().to_string(),
            "eos_token_id",
            &read_json(&gen_path)?["eos_token_id"],
        )?;
        if !eos.is_empty() {
            cfg.eos_token_ids = eos;
        }
    }
    let tok_path = dir.join("tokenizer.json");
    let tok_file = tok_path.display().to_string();
    let tok_bytes = std::fs::read(&tok_path).map_err(|source| LoadError::Io {
        file: tok_file.clone(),
        source,
    })?;
    let tokenizer = tokenizer::from_json(&tok_file, &tok_bytes)?;

    // The shards: one file, or the files the index's weight map names.
    let index_path = dir.join("model.safetensors.index.json");
    let mut shard_of: BTreeMap<String, String> = BTreeMap::new();
    let shards: Vec<String> = if index_path.exists() {
        let index_file = index_path.display().to_string();
        shard_of = shard_index(&index_file, &read_json(&index_path)?)?;
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
            read_safetensors(&file, m).map(|st| (name.clone(), st))
        })
        .collect::<Result<_, _>>()?;
    // The shard that holds `name`, and its parsed file.
    let locate = |name: &str| -> Result<(String, &safetensors::SafeTensors), LoadError> {
        // With an index, a tensor it does not list is missing (not looked for in a shard).
        let shard = match shard_of.get(name) {
            Some(s) => s.as_str(),
            None if index_path.exists() => {
                return Err(LoadError::MissingTensor {
                    file: index_path.display().to_string(),
                    tensor: name.into(),
                });
            }
            None => shards[0].as_str(),
        };
        let st = &parsed
            .iter()
            .find(|(n, _)| n == shard)
            .expect("every shard was parsed")
            .1;
        Ok((dir.join(shard).display().to_string(), st))
    };
    // FP8 checkpoints with block scales name their block size.
    let block = config_json["quantization_config"]["weight_block_size"]
        .as_array()
        .and_then(|b| Some([b.first()?.as_u64()? as usize, b.get(1)?.as_u64()? as usize]));
    let model = build::<B>(
        &cfg,
        device,
        dtype,
        max_positions,
        |w| {
            let (name, shape) = (w.hf_name(), w.shape(&cfg));
            let (file, st) = locate(&name)?;
            let view = st.tensor(&name).map_err(|_| LoadError::MissingTensor {
                file: file.clone(),
                tensor: name.clone(),
            })?;
            if view.dtype() != safetensors::Dtype::F8_E4M3 || shape.len() != 2 {
                return safetensors_values(&file, st, &name, &shape);
            }
            if view.shape() != shape {
                return Err(LoadError::Shape {
                    file,
                    tensor: name,
                    expected: shape,
                    actual: view.shape().to_vec(),
                });
            }
            let fp8_err = |problem: String| LoadError::Fp8Scale {
                file: file.clone(),
                tensor: name.clone(),
                problem,
            };
            let (scale_name, scale_file, sview) =
                [format!("{name}_scale"), format!("{name}_scale_inv")]
                    .into_iter()
                    .find_map(|n| {
                        let (f, st) = locate(&n).ok()?;
                        let view = st.tensor(&n).ok()?;
                        Some((n, f, view))
                    })
                    .ok_or_else(|| {
                        fp8_err(format!("no `{name}_scale` or `{name}_scale_inv` tensor"))
                    })?;
            let scales = float_values(&scale_file, &scale_name, &sview)?;
            let dims = [shape[0], shape[1]];
            let layout = Fp8Scales::of(sview.shape(), dims, block).map_err(&fp8_err)?;
            if let Some(bad) = scales.iter().find(|s| !s.is_finite() || **s < 0.0) {
                return Err(fp8_err(format!("`{scale_name}` holds the scale {bad}")));
            }
            Ok(layout.dequantize(view.data(), dims, &scales))
        },
        |_| Ok(None),
        |_| None,
    )?;
    Ok(Loaded {
        config: cfg,
        model,
        tokenizer,
        chat_template: hf_chat_template(dir)?,
    })
}

#[cfg(test)]
mod tests {
    use super::Fp8Scales;

    #[test]
    fn a_gguf_tokenizer_alone_is_the_loaded_models() {
        use crate::synthetic::{PACKABLE, gguf, weights};
        let path =
            std::env::temp_dir().join(format!("stoke-gguf-tokenizer-{}.gguf", std::process::id()));
        std::fs::write(&path, gguf(&PACKABLE, &weights(&PACKABLE, true, 3))).unwrap();
        let alone = super::gguf_tokenizer(&path).unwrap();
        let loaded = super::load_gguf::<burn_ndarray::NdArray<f32>>(
            &path,
            &Default::default(),
            burn::tensor::DType::F32,
            16,
        )
        .unwrap()
        .tokenizer;
        let _ = std::fs::remove_file(&path);
        assert_eq!(alone.get_vocab_size(true), loaded.get_vocab_size(true));
        let ids =
            |t: &tokenizers::Tokenizer| t.encode("hello world", false).unwrap().get_ids().to_vec();
        assert_eq!(ids(&alone), ids(&loaded));
        assert!(!ids(&alone).is_empty());
    }

    #[test]
    fn fp8_scale_layouts_follow_their_shapes() {
        let w = [4096, 14336];
        assert_eq!(Fp8Scales::of(&[], w, None), Ok(Fp8Scales::Tensor));
        assert_eq!(Fp8Scales::of(&[1], w, None), Ok(Fp8Scales::Tensor));
        assert_eq!(Fp8Scales::of(&[4096], w, None), Ok(Fp8Scales::Channel));
        assert_eq!(Fp8Scales::of(&[4096, 1], w, None), Ok(Fp8Scales::Channel));
        assert_eq!(
            Fp8Scales::of(&[32, 112], w, None),
            Ok(Fp8Scales::Block([128, 128]))
        );
        assert_eq!(
            Fp8Scales::of(&[32, 112], w, Some([128, 128])),
            Ok(Fp8Scales::Block([128, 128]))
        );
        // A size that is no multiple of the block: the last block is partial.
        assert_eq!(
            Fp8Scales::of(&[8, 1], [1000, 100], Some([128, 128])),
            Ok(Fp8Scales::Block([128, 128]))
        );
        assert!(Fp8Scales::of(&[32, 112], w, Some([64, 128])).is_err());
        assert!(Fp8Scales::of(&[4095], w, None).is_err());
        assert!(Fp8Scales::of(&[2, 2, 2], w, None).is_err());
    }

    #[test]
    fn fp8_values_are_codes_times_their_scale() {
        // 0x38 is 1.0 and 0x40 is 2.0 in E4M3.
        let codes = [0x38, 0x40, 0x38, 0x40, 0x38, 0x40];
        let v = Fp8Scales::Channel.dequantize(&codes, [2, 3], &[0.5, 3.0]);
        assert_eq!(v, vec![0.5, 1.0, 0.5, 6.0, 3.0, 6.0]);
        let v = Fp8Scales::Block([1, 2]).dequantize(&codes, [2, 3], &[1.0, 10.0, 2.0, 20.0]);
        assert_eq!(v, vec![1.0, 2.0, 10.0, 4.0, 2.0, 40.0]);
    }
}
