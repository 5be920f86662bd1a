//! Stoke's packed model file: a Llama whose projections are packed INT4 (the kernel format of
//! `stoke_formats::int4`), saved as one safetensors file with its configuration and tokenizer,
//! so a quantized model loads straight into `Stoke<Cuda>` with no re-quantization and no
//! repacking. `docs/PACKED_FILE.md` describes the file for readers in other languages.
//!
//! - Header: `__metadata__` holds one key, `stoke`, whose value is a JSON document:
//!   `{"format": "stoke-llama-int4", "version": 1, "config": {..}, "quantization": {..}}`;
//!   `config` has the keys of a Hugging Face Llama `config.json`, `quantization` says how the
//!   weights were made (free-form, informative).
//! - `tokenizer.json`: U8 `[bytes]`, the tokenizer as Hugging Face `tokenizers` JSON.
//! - Dense tensors (F32, BF16 or F16): `embed_tokens` `[vocab, hidden]`, `norm` `[hidden]`,
//!   `layers.{l}.attn_norm` and `layers.{l}.mlp_norm` `[hidden]`, and `lm_head.weight`
//!   `[hidden, vocab]` (Burn's `[in, out]` layout) when the head is neither tied nor packed.
//! - Packed projections, per layer `l` and `p` in `qkv_proj`, `o_proj`, `gate_up_proj`,
//!   `down_proj` (and `lm_head` when the head is packed): `{p}.qweight` U32
//!   `[k / 16, n / 64, 32, 4]` (the words in fragment order, exactly `PackedInt4::words`),
//!   `{p}.scales` BF16 or F16 `[k / group, n]` and, for asymmetric weights, `{p}.offsets` of the
//!   same shape and dtype. `k` is the input size, `n` the output size, `group = k / rows of
//!   scales`. q|k|v are side by side (q's columns, then k's, then v's; rotate-half RoPE layout);
//!   gate and up are interleaved (gate `j` at column `2j`, up `j` at `2j + 1`).
//!
//! Reading checks every tensor's name, dtype and shape against the configuration and reports a
//! [`PackedFileError`] naming the file and tensor; [`PackedModel::to_bytes`] of a model read
//! from a file gives that file's bytes back.

use crate::config::{ConfigError, LlamaConfig};
use crate::load::Loaded;
use crate::model::{Attention, Block, Llama, Mlp, Rope};
use crate::quant::PackedProjections;
use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::Path;
use stoke::FusedOps;
use stoke_formats::int4::{Int4Error, PackedInt4, ScaleType};

/// The `format` value of the header.
pub const FORMAT: &str = "stoke-llama-int4";
/// The format version this code writes and reads.
pub const VERSION: u64 = 1;
/// The projections of a layer, in the order of [`PackedLayer::projections`].
pub const PROJECTIONS: [&str; 4] = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"];

#[derive(Debug, thiserror::Error)]
pub enum PackedFileError {
    #[error("{file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: not a valid safetensors file: {reason}")]
    Safetensors { file: String, reason: String },
    #[error("{file}: not a Stoke packed model (no `stoke` entry in the safetensors metadata)")]
    NotPacked { file: String },
    #[error("{file}: header: {what}")]
    Header { file: String, what: String },
    #[error("{file}: format `{format}` version {version} is not supported ({FORMAT} {VERSION} is)")]
    Version {
        file: String,
        format: String,
        version: u64,
    },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{file}: tokenizer: {reason}")]
    Tokenizer { file: String, reason: String },
    #[error("{file}: tensor `{tensor}` is missing")]
    MissingTensor { file: String, tensor: String },
    #[error("{file}: tensor `{tensor}` is not part of the format")]
    UnexpectedTensor { file: String, tensor: String },
    #[error("{file}: tensor `{tensor}` has dtype {found}, expected {expected}")]
    Dtype {
        file: String,
        tensor: String,
        found: String,
        expected: &'static str,
    },
    #[error("{file}: tensor `{tensor}` has shape {actual:?}, expected {expected:?}")]
    Shape {
        file: String,
        tensor: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("{file}: tensor `{tensor}`: {source}")]
    Int4 {
        file: String,
        tensor: String,
        #[source]
        source: Int4Error,
    },
    #[error("{what}: {reason}")]
    Model { what: String, reason: String },
}

/// The float type of a dense tensor in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenseDtype {
    F32,
    Bf16,
    F16,
}

impl DenseDtype {
    fn safetensors(self) -> Dtype {
        match self {
            DenseDtype::F32 => Dtype::F32,
            DenseDtype::Bf16 => Dtype::BF16,
            DenseDtype::F16 => Dtype::F16,
        }
    }
}

/// A dense tensor as stored: shape, float type and little-endian bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Dense {
    pub shape: Vec<usize>,
    pub dtype: DenseDtype,
    pub bytes: Vec<u8>,
}

impl Dense {
    pub fn from_f32(values: &[f32], shape: Vec<usize>, dtype: DenseDtype) -> Self {
        let bytes = match dtype {
            DenseDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DenseDtype::Bf16 => values
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            DenseDtype::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
        };
        Self {
            shape,
            dtype,
            bytes,
        }
    }

    pub fn to_f32(&self) -> Vec<f32> {
        match self.dtype {
            DenseDtype::F32 => self
                .bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            DenseDtype::Bf16 => self
                .bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            DenseDtype::F16 => self
                .bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        }
    }
}

/// The output head as stored.
#[derive(Clone, Debug, PartialEq)]
pub enum Head {
    /// The embedding's transpose (no tensor in the file).
    Tied,
    /// `lm_head.weight`, `[hidden, vocab]`.
    Dense(Dense),
    /// `lm_head.qweight` / `.scales` / `.offsets`.
    Packed(PackedInt4),
}

/// One block: its two RMSNorm gains and its four packed projections (q|k|v, o, gate|up, down).
#[derive(Clone, Debug, PartialEq)]
pub struct PackedLayer {
    pub attn_norm: Dense,
    pub mlp_norm: Dense,
    pub projections: [PackedInt4; 4],
}

/// A packed model, in memory as in the file.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedModel {
    pub config: LlamaConfig,
    /// The tokenizer as `tokenizers` JSON.
    pub tokenizer_json: String,
    /// How the weights were made (method, group, calibration...): informative.
    pub quantization: serde_json::Value,
    pub embed: Dense,
    pub norm: Dense,
    pub head: Head,
    pub layers: Vec<PackedLayer>,
}

/// The configuration as a Hugging Face Llama `config.json` object.
pub fn config_json(c: &LlamaConfig) -> serde_json::Value {
    let mut j = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "eos_token_id": c.eos_token_ids,
    });
    if let Some(b) = c.bos_token_id {
        j["bos_token_id"] = b.into();
    }
    if let Some(s) = &c.rope_scaling {
        j["rope_scaling"] = serde_json::json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        });
    }
    j
}

fn host_f32<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 values")
}

impl PackedModel {
    /// A packed model of `model`'s embedding, norms and head (dense, in `dense`) and the packed
    /// projections `packed` (from `crate::quant::quantize_packed` on that model). `tied`: the
    /// head is the embedding's transpose, as `config` says for models with tied embeddings, and
    /// stays so (not stored) unless `packed` holds a packed head.
    pub fn from_model<B: Backend>(
        model: &Llama<B>,
        config: &LlamaConfig,
        tokenizer: &tokenizers::Tokenizer,
        packed: PackedProjections,
        quantization: serde_json::Value,
        dense: DenseDtype,
        tied: bool,
    ) -> Result<Self, PackedFileError> {
        let bad = |reason: String| PackedFileError::Model {
            what: "packing the model".into(),
            reason,
        };
        if packed.layers.len() != model.layers.len() {
            return Err(bad(format!(
                "{} packed layers for a model of {}",
                packed.layers.len(),
                model.layers.len()
            )));
        }
        let tokenizer_json = tokenizer
            .to_string(false)
            .map_err(|e| bad(format!("serializing the tokenizer: {e}")))?;
        let vector = |t: Tensor<B, 1>| {
            let n = t.dims()[0];
            Dense::from_f32(&host_f32(t), vec![n], dense)
        };
        let head = match (packed.lm_head, tied) {
            (Some(p), _) => Head::Packed(p),
            (None, true) => Head::Tied,
            (None, false) => {
                let w = model.lm_head.weight.val();
                let shape = w.dims().to_vec();
                Head::Dense(Dense::from_f32(&host_f32(w), shape, dense))
            }
        };
        let mut config = config.clone();
        config.tie_word_embeddings = head == Head::Tied;
        let embed = model.embed_tokens.val();
        let embed_shape = embed.dims().to_vec();
        let layers = model
            .layers
            .iter()
            .zip(packed.layers)
            .map(|(b, projections)| PackedLayer {
                attn_norm: vector(b.attn_norm.val()),
                mlp_norm: vector(b.mlp_norm.val()),
                projections,
            })
            .collect();
        let m = Self {
            config,
            tokenizer_json,
            quantization,
            embed: Dense::from_f32(&host_f32(embed), embed_shape, dense),
            norm: vector(model.norm.val()),
            head,
            layers,
        };
        // The same checks a reader makes, so a file written is a file that reads.
        let bytes = m.to_bytes()?;
        Self::from_bytes("(packed model)", &bytes)?;
        Ok(m)
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, PackedFileError> {
        let header = serde_json::json!({
            "format": FORMAT,
            "version": VERSION,
            "config": config_json(&self.config),
            "quantization": self.quantization,
        });
        // One metadata key: safetensors keeps metadata in a hash map, and one entry serializes
        // the same way every time.
        let metadata = HashMap::from([("stoke".to_string(), header.to_string())]);
        let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = vec![(
            "tokenizer.json".into(),
            Dtype::U8,
            vec![self.tokenizer_json.len()],
            self.tokenizer_json.as_bytes().to_vec(),
        )];
        let mut dense = |name: String, d: &Dense| {
            tensors.push((
                name,
                d.dtype.safetensors(),
                d.shape.clone(),
                d.bytes.clone(),
            ))
        };
        dense("embed_tokens".into(), &self.embed);
        dense("norm".into(), &self.norm);
        for (l, layer) in self.layers.iter().enumerate() {
            dense(format!("layers.{l}.attn_norm"), &layer.attn_norm);
            dense(format!("layers.{l}.mlp_norm"), &layer.mlp_norm);
        }
        let mut packed = |name: String, p: &PackedInt4| {
            let dtype = match p.scale_type {
                ScaleType::Bf16 => Dtype::BF16,
                ScaleType::F16 => Dtype::F16,
            };
            let u16s = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
            tensors.push((
                format!("{name}.qweight"),
                Dtype::U32,
                vec![p.k / 16, p.n / 64, 32, 4],
                p.words.iter().flat_map(|w| w.to_le_bytes()).collect(),
            ));
            let groups = vec![p.k / p.group, p.n];
            tensors.push((
                format!("{name}.scales"),
                dtype,
                groups.clone(),
                u16s(&p.scales),
            ));
            if let Some(o) = &p.offsets {
                tensors.push((format!("{name}.offsets"), dtype, groups, u16s(o)));
            }
        };
        for (l, layer) in self.layers.iter().enumerate() {
            for (name, p) in PROJECTIONS.iter().zip(&layer.projections) {
                packed(format!("layers.{l}.{name}"), p);
            }
        }
        match &self.head {
            Head::Tied => {}
            Head::Dense(d) => tensors.push((
                "lm_head.weight".into(),
                d.dtype.safetensors(),
                d.shape.clone(),
                d.bytes.clone(),
            )),
            Head::Packed(p) => packed("lm_head".into(), p),
        }
        let views = tensors
            .iter()
            .map(|(name, dtype, shape, bytes)| {
                TensorView::new(*dtype, shape.clone(), bytes).map(|v| (name.clone(), v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| PackedFileError::Model {
                what: "writing the packed model".into(),
                reason: e.to_string(),
            })?;
        safetensors::serialize(views, Some(metadata)).map_err(|e| PackedFileError::Model {
            what: "writing the packed model".into(),
            reason: e.to_string(),
        })
    }

    /// Writes the file.
    pub fn write(&self, path: &Path) -> Result<(), PackedFileError> {
        let bytes = self.to_bytes()?;
        std::fs::write(path, bytes).map_err(|source| PackedFileError::Io {
            file: path.display().to_string(),
            source,
        })
    }

    /// Reads and checks a file.
    pub fn read(path: &Path) -> Result<Self, PackedFileError> {
        let file = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| PackedFileError::Io {
            file: file.clone(),
            source,
        })?;
        Self::from_bytes(&file, &bytes)
    }

    /// Parses and checks a file's bytes (`file` names it in errors).
    pub fn from_bytes(file: &str, bytes: &[u8]) -> Result<Self, PackedFileError> {
        let f = || file.to_string();
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| {
            PackedFileError::Safetensors {
                file: f(),
                reason: e.to_string(),
            }
        })?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).map_err(|e| {
            PackedFileError::Safetensors {
                file: f(),
                reason: e.to_string(),
            }
        })?;
        let header = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("stoke"))
            .ok_or_else(|| PackedFileError::NotPacked { file: f() })?;
        let header: serde_json::Value =
            serde_json::from_str(header).map_err(|e| PackedFileError::Header {
                file: f(),
                what: format!("invalid JSON: {e}"),
            })?;
        let format = header["format"].as_str().unwrap_or("").to_string();
        let version = header["version"].as_u64().unwrap_or(0);
        if format != FORMAT || version != VERSION {
            return Err(PackedFileError::Version {
                file: f(),
                format,
                version,
            });
        }
        if !header["config"].is_object() {
            return Err(PackedFileError::Header {
                file: f(),
                what: "no `config` object".into(),
            });
        }
        let config = LlamaConfig::from_hf_json(file, &header["config"])?;
        let c = &config;

        // Every tensor is used once; what is left over is not part of the format.
        let left: std::cell::RefCell<std::collections::BTreeSet<String>> =
            std::cell::RefCell::new(st.names().into_iter().map(String::from).collect());
        let take = |name: &str| -> Result<TensorView<'_>, PackedFileError> {
            left.borrow_mut().remove(name);
            st.tensor(name).map_err(|_| PackedFileError::MissingTensor {
                file: f(),
                tensor: name.into(),
            })
        };
        let check_shape = |name: &str, actual: &[usize], expected: &[usize]| {
            if actual == expected {
                Ok(())
            } else {
                Err(PackedFileError::Shape {
                    file: f(),
                    tensor: name.into(),
                    expected: expected.to_vec(),
                    actual: actual.to_vec(),
                })
            }
        };
        let dtype_err = |name: &str, found: Dtype, expected: &'static str| PackedFileError::Dtype {
            file: f(),
            tensor: name.into(),
            found: format!("{found:?}"),
            expected,
        };

        let tok = take("tokenizer.json")?;
        if tok.dtype() != Dtype::U8 {
            return Err(dtype_err("tokenizer.json", tok.dtype(), "U8"));
        }
        let tokenizer_json =
            String::from_utf8(tok.data().to_vec()).map_err(|e| PackedFileError::Tokenizer {
                file: f(),
                reason: e.to_string(),
            })?;
        let dense = |view: TensorView<'_>, name: &str, shape: &[usize]| {
            let dtype = match view.dtype() {
                Dtype::F32 => DenseDtype::F32,
                Dtype::BF16 => DenseDtype::Bf16,
                Dtype::F16 => DenseDtype::F16,
                other => return Err(dtype_err(name, other, "F32, BF16 or F16")),
            };
            check_shape(name, view.shape(), shape)?;
            Ok(Dense {
                shape: shape.to_vec(),
                dtype,
                bytes: view.data().to_vec(),
            })
        };
        let packed = |views: [Option<TensorView<'_>>; 3], name: &str, k: usize, n: usize| {
            let [qweight, scales, offsets] = views;
            let (qname, sname, oname) = (
                format!("{name}.qweight"),
                format!("{name}.scales"),
                format!("{name}.offsets"),
            );
            let qweight = qweight.ok_or_else(|| PackedFileError::MissingTensor {
                file: f(),
                tensor: qname.clone(),
            })?;
            let scales = scales.ok_or_else(|| PackedFileError::MissingTensor {
                file: f(),
                tensor: sname.clone(),
            })?;
            if qweight.dtype() != Dtype::U32 {
                return Err(dtype_err(&qname, qweight.dtype(), "U32"));
            }
            if !k.is_multiple_of(16) || !n.is_multiple_of(64) {
                return Err(PackedFileError::Int4 {
                    file: f(),
                    tensor: qname,
                    source: Int4Error::Shape { k, n },
                });
            }
            check_shape(&qname, qweight.shape(), &[k / 16, n / 64, 32, 4])?;
            let scale_type = match scales.dtype() {
                Dtype::BF16 => ScaleType::Bf16,
                Dtype::F16 => ScaleType::F16,
                other => return Err(dtype_err(&sname, other, "BF16 or F16")),
            };
            let rows = match scales.shape() {
                [rows, cols] if *cols == n && *rows > 0 && k.is_multiple_of(*rows) => *rows,
                other => {
                    return Err(PackedFileError::Shape {
                        file: f(),
                        tensor: sname,
                        expected: vec![k / 128, n],
                        actual: other.to_vec(),
                    });
                }
            };
            let group = k / rows;
            if !group.is_multiple_of(16) {
                return Err(PackedFileError::Int4 {
                    file: f(),
                    tensor: sname,
                    source: Int4Error::Group { group, k },
                });
            }
            let u16s = |v: &TensorView<'_>| -> Vec<u16> {
                v.data()
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect()
            };
            let offsets = match offsets {
                None => None,
                Some(o) => {
                    if o.dtype() != scales.dtype() {
                        return Err(dtype_err(
                            &oname,
                            o.dtype(),
                            match scale_type {
                                ScaleType::Bf16 => "BF16 (as the scales)",
                                ScaleType::F16 => "F16 (as the scales)",
                            },
                        ));
                    }
                    check_shape(&oname, o.shape(), scales.shape())?;
                    Some(u16s(&o))
                }
            };
            Ok(PackedInt4 {
                k,
                n,
                group,
                scale_type,
                scales: u16s(&scales),
                offsets,
                words: qweight
                    .data()
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            })
        };
        let take_packed = |name: &str, k: usize, n: usize| {
            let get = |suffix: &str| {
                let full = format!("{name}.{suffix}");
                left.borrow_mut().remove(&full);
                st.tensor(&full).ok()
            };
            let views = [get("qweight"), get("scales"), get("offsets")];
            packed(views, name, k, n)
        };

        let (hid, h, kvh, d, inter, vocab) = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.intermediate_size,
            c.vocab_size,
        );
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        let shapes = [
            (hid, (h + 2 * kvh) * d),
            (h * d, hid),
            (hid, 2 * inter),
            (inter, hid),
        ];
        for l in 0..c.num_hidden_layers {
            let mut projections = Vec::with_capacity(4);
            for (name, (k, n)) in PROJECTIONS.iter().zip(shapes) {
                projections.push(take_packed(&format!("layers.{l}.{name}"), k, n)?);
            }
            let an = format!("layers.{l}.attn_norm");
            let mn = format!("layers.{l}.mlp_norm");
            let attn_norm = dense(take(&an)?, &an, &[hid])?;
            let mlp_norm = dense(take(&mn)?, &mn, &[hid])?;
            layers.push(PackedLayer {
                attn_norm,
                mlp_norm,
                projections: projections.try_into().expect("four projections"),
            });
        }
        let embed = dense(take("embed_tokens")?, "embed_tokens", &[vocab, hid])?;
        let norm = dense(take("norm")?, "norm", &[hid])?;
        let head = if c.tie_word_embeddings {
            Head::Tied
        } else if st.names().contains(&"lm_head.weight") {
            Head::Dense(dense(
                take("lm_head.weight")?,
                "lm_head.weight",
                &[hid, vocab],
            )?)
        } else {
            Head::Packed(take_packed("lm_head", hid, vocab)?)
        };
        if let Some(extra) = left.into_inner().into_iter().next() {
            return Err(PackedFileError::UnexpectedTensor {
                file: f(),
                tensor: extra,
            });
        }
        Ok(Self {
            config,
            tokenizer_json,
            quantization: header["quantization"].clone(),
            embed,
            norm,
            head,
            layers,
        })
    }

    /// The tokenizer.
    pub fn tokenizer(&self, file: &str) -> Result<tokenizers::Tokenizer, PackedFileError> {
        self.tokenizer_json
            .parse()
            .map_err(|e: tokenizers::Error| PackedFileError::Tokenizer {
                file: file.into(),
                reason: e.to_string(),
            })
    }

    /// The model on `device`, dense weights in `dtype`; each packed projection is what `keep`
    /// makes of it (backends that keep packed weights), else its dequantized values.
    pub fn build<B: Backend>(
        &self,
        device: &B::Device,
        dtype: DType,
        max_positions: usize,
        keep: impl Fn(PackedInt4, DType, &B::Device) -> Option<Tensor<B, 2>>,
    ) -> Llama<B> {
        let c = &self.config;
        let tensor = |v: Vec<f32>, shape: [usize; 2]| {
            Tensor::<B, 2>::from_data(TensorData::new(v, shape), device).cast(dtype)
        };
        let vector = |d: &Dense| {
            let v = d.to_f32();
            let n = v.len();
            Param::from_tensor(
                Tensor::<B, 1>::from_data(TensorData::new(v, [n]), device).cast(dtype),
            )
        };
        let linear = |p: &PackedInt4| {
            let weight = keep(p.clone(), dtype, device)
                .unwrap_or_else(|| tensor(p.dequantize(), [p.k, p.n]));
            Linear {
                weight: Param::from_tensor(weight),
                bias: None,
            }
        };
        let embed = self.embed.to_f32();
        let (vocab, hid) = (c.vocab_size, c.hidden_size);
        let lm_head = match &self.head {
            Head::Tied => Linear {
                weight: Param::from_tensor(tensor(
                    stoke_formats::transpose(&embed, vocab, hid),
                    [hid, vocab],
                )),
                bias: None,
            },
            Head::Dense(d) => Linear {
                weight: Param::from_tensor(tensor(d.to_f32(), [hid, vocab])),
                bias: None,
            },
            Head::Packed(p) => linear(p),
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let [qkv, o, gate_up, down] = &l.projections;
                Block {
                    attn_norm: vector(&l.attn_norm),
                    attn: Attention {
                        qkv_proj: linear(qkv),
                        o_proj: linear(o),
                        n_heads: c.num_attention_heads,
                        n_kv_heads: c.num_key_value_heads,
                        head_dim: c.head_dim,
                    },
                    mlp_norm: vector(&l.mlp_norm),
                    mlp: Mlp {
                        gate_up_proj: linear(gate_up),
                        down_proj: linear(down),
                    },
                }
            })
            .collect();
        Llama {
            embed_tokens: Param::from_tensor(tensor(embed, [vocab, hid])),
            layers,
            norm: vector(&self.norm),
            lm_head,
            rope: Rope::new(
                c,
                max_positions.min(c.max_position_embeddings).max(1),
                device,
            ),
            rms_norm_eps: c.rms_norm_eps,
            plan: stoke::Plan::default(),
        }
    }

    /// The packed projections (to put into another copy of the model with
    /// `crate::quant::apply_packed`).
    pub fn projections(&self) -> PackedProjections {
        PackedProjections {
            layers: self.layers.iter().map(|l| l.projections.clone()).collect(),
            lm_head: match &self.head {
                Head::Packed(p) => Some(p.clone()),
                _ => None,
            },
        }
    }
}

fn loaded<B: Backend>(
    path: &Path,
    model: impl FnOnce(&PackedModel) -> Llama<B>,
) -> Result<Loaded<B>, PackedFileError> {
    let packed = PackedModel::read(path)?;
    let tokenizer = packed.tokenizer(&path.display().to_string())?;
    Ok(Loaded {
        model: model(&packed),
        config: packed.config,
        tokenizer,
        chat_template: None,
    })
}

/// Loads a packed model file onto `device`: the projections stay packed on backends that keep
/// packed weights (`Stoke<I>`, where `linear` runs the W4A16 kernels), elsewhere they are
/// dequantized once.
pub fn load<B: FusedOps>(
    path: &Path,
    device: &B::Device,
    dtype: DType,
    max_positions: usize,
) -> Result<Loaded<B>, PackedFileError> {
    loaded(path, |p| {
        p.build::<B>(device, dtype, max_positions, |w, dtype, device| {
            B::packed_int4_weight(w, dtype, device)
                .map(|t| Tensor::from_primitive(TensorPrimitive::Float(t)))
        })
    })
}

/// Loads a packed model file onto `device` with every projection dequantized (any backend).
pub fn load_dequantized<B: Backend>(
    path: &Path,
    device: &B::Device,
    dtype: DType,
    max_positions: usize,
) -> Result<Loaded<B>, PackedFileError> {
    loaded(path, |p| {
        p.build::<B>(device, dtype, max_positions, |_, _, _| None)
    })
}

/// Whether `path` names a packed model file (by its `.safetensors` extension).
pub fn is_packed_file(path: &Path) -> bool {
    path.is_file() && path.extension().is_some_and(|e| e == "safetensors")
}
