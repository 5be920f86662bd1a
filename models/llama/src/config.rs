//! Llama model configuration, from GGUF metadata (`llama.*` keys).

use stoke_formats::gguf::{Gguf, Value};

/// Llama-3 style RoPE frequency scaling (`rope_scaling` with `rope_type = "llama3"`).
#[derive(Clone, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// A configuration that a file's metadata does not give or contradicts.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: architecture `{found}` is not supported (llama is)")]
    Architecture { file: String, found: String },
    #[error("{file}: metadata `{key}` is missing or not {expected}")]
    Missing {
        file: String,
        key: String,
        expected: &'static str,
    },
    #[error("{file}: {what}")]
    Inconsistent { file: String, what: String },
    #[error("{file}: `{key}` {problem}")]
    Value {
        file: String,
        key: String,
        problem: String,
    },
}

/// A token id read from `key`: an integer below 2^32.
fn token_id(file: &str, key: &str, v: u64) -> Result<u32, ConfigError> {
    u32::try_from(v).map_err(|_| ConfigError::Value {
        file: file.into(),
        key: key.into(),
        problem: format!("= {v} is not a token id (ids are below 2^32)"),
    })
}

impl LlamaConfig {
    /// Reads the `llama.*` metadata of a GGUF file. The vocabulary size comes from
    /// `llama.vocab_size` or the tokenizer's token list; tied embeddings are inferred from the
    /// absence of `output.weight`.
    pub fn from_gguf(g: &Gguf) -> Result<Self, ConfigError> {
        let file = g.file.clone();
        let arch = g
            .metadata
            .get("general.architecture")
            .and_then(Value::as_str)
            .unwrap_or("");
        if arch != "llama" {
            return Err(ConfigError::Architecture {
                file,
                found: arch.to_string(),
            });
        }
        let int = |key: &str| -> Result<usize, ConfigError> {
            g.metadata
                .get(key)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| ConfigError::Missing {
                    file: g.file.clone(),
                    key: key.into(),
                    expected: "an unsigned integer",
                })
        };
        let float = |key: &str| g.metadata.get(key).and_then(Value::as_f64);
        let hidden_size = int("llama.embedding_length")?;
        let num_attention_heads = int("llama.attention.head_count")?;
        let num_key_value_heads =
            int("llama.attention.head_count_kv").unwrap_or(num_attention_heads);
        let head_dim = int("llama.attention.key_length")
            .or_else(|_| int("llama.rope.dimension_count"))
            .unwrap_or(hidden_size / num_attention_heads.max(1));
        let vocab_size = int("llama.vocab_size").or_else(|_| {
            g.metadata
                .get("tokenizer.ggml.tokens")
                .and_then(Value::as_array)
                .map(|t| t.len())
                .ok_or_else(|| ConfigError::Missing {
                    file: file.clone(),
                    key: "llama.vocab_size".into(),
                    expected: "an unsigned integer",
                })
        })?;
        let rope_scaling = match g
            .metadata
            .get("llama.rope.scaling.type")
            .and_then(Value::as_str)
        {
            Some("llama3") => Some(Llama3RopeScaling {
                factor: float("llama.rope.scaling.factor").unwrap_or(8.0),
                low_freq_factor: float("llama.rope.scaling.low_freq_factor").unwrap_or(1.0),
                high_freq_factor: float("llama.rope.scaling.high_freq_factor").unwrap_or(4.0),
                original_max_position_embeddings: int("llama.rope.scaling.original_context_length")
                    .unwrap_or(8192),
            }),
            _ => None,
        };
        let token = |key: &str| -> Result<Option<u32>, ConfigError> {
            g.metadata
                .get(key)
                .and_then(Value::as_u64)
                .map(|v| token_id(&file, key, v))
                .transpose()
        };
        let eos = token("tokenizer.ggml.eos_token_id")?;
        let cfg = LlamaConfig {
            vocab_size,
            hidden_size,
            intermediate_size: int("llama.feed_forward_length")?,
            num_hidden_layers: int("llama.block_count")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rope_theta: float("llama.rope.freq_base").unwrap_or(10000.0),
            rope_scaling,
            rms_norm_eps: float("llama.attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            max_position_embeddings: int("llama.context_length").unwrap_or(4096),
            tie_word_embeddings: !g.tensors.iter().any(|t| t.name == "output.weight"),
            bos_token_id: token("tokenizer.ggml.bos_token_id")?,
            eos_token_ids: eos.into_iter().collect(),
        };
        cfg.validate(&file)?;
        Ok(cfg)
    }

    /// Reads a Hugging Face `config.json` (already parsed) of a Llama model.
    pub fn from_hf_json(file: &str, j: &serde_json::Value) -> Result<Self, ConfigError> {
        let arch_ok = j["model_type"].as_str() == Some("llama")
            || j["architectures"]
                .as_array()
                .is_some_and(|a| a.iter().any(|v| v.as_str() == Some("LlamaForCausalLM")));
        if !arch_ok {
            let found = j["model_type"]
                .as_str()
                .or_else(|| j["architectures"][0].as_str())
                .unwrap_or("none");
            return Err(ConfigError::Architecture {
                file: file.into(),
                found: found.into(),
            });
        }
        let int = |key: &str| -> Result<usize, ConfigError> {
            j[key]
                .as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| ConfigError::Missing {
                    file: file.into(),
                    key: key.into(),
                    expected: "an unsigned integer",
                })
        };
        let hidden_size = int("hidden_size")?;
        let num_attention_heads = int("num_attention_heads")?;
        let rope_scaling = match &j["rope_scaling"] {
            s if s["rope_type"].as_str() == Some("llama3")
                || s["type"].as_str() == Some("llama3") =>
            {
                Some(Llama3RopeScaling {
                    factor: s["factor"].as_f64().unwrap_or(8.0),
                    low_freq_factor: s["low_freq_factor"].as_f64().unwrap_or(1.0),
                    high_freq_factor: s["high_freq_factor"].as_f64().unwrap_or(4.0),
                    original_max_position_embeddings: s["original_max_position_embeddings"]
                        .as_u64()
                        .unwrap_or(8192)
                        as usize,
                })
            }
            serde_json::Value::Null => None,
            other => {
                return Err(ConfigError::Inconsistent {
                    file: file.into(),
                    what: format!("rope_scaling {other} is not supported (llama3 is)"),
                });
            }
        };
        let cfg = LlamaConfig {
            vocab_size: int("vocab_size")?,
            hidden_size,
            intermediate_size: int("intermediate_size")?,
            num_hidden_layers: int("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: int("num_key_value_heads").unwrap_or(num_attention_heads),
            head_dim: int("head_dim").unwrap_or(hidden_size / num_attention_heads.max(1)),
            rope_theta: j["rope_theta"].as_f64().unwrap_or(10000.0),
            rope_scaling,
            rms_norm_eps: j["rms_norm_eps"].as_f64().unwrap_or(1e-5),
            max_position_embeddings: int("max_position_embeddings").unwrap_or(4096),
            tie_word_embeddings: j["tie_word_embeddings"].as_bool().unwrap_or(false),
            bos_token_id: j["bos_token_id"]
                .as_u64()
                .map(|v| token_id(file, "bos_token_id", v))
                .transpose()?,
            eos_token_ids: token_ids(file, "eos_token_id", &j["eos_token_id"])?,
        };
        cfg.validate(file)?;
        Ok(cfg)
    }

    /// Checks the relations between sizes that the model relies on.
    pub fn validate(&self, file: &str) -> Result<(), ConfigError> {
        let bad = |what: String| {
            Err(ConfigError::Inconsistent {
                file: file.into(),
                what,
            })
        };
        if self.num_attention_heads == 0 || self.num_key_value_heads == 0 {
            return bad("head counts must be positive".into());
        }
        for (key, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                return bad(format!("{key} must be positive"));
            }
        }
        // Every weight's element count must be a usize: the loader multiplies these.
        let elements = |a: usize, b: usize| a.checked_mul(b).filter(|&n| n <= isize::MAX as usize);
        for (what, a, b) in [
            (
                "attention heads x head_dim",
                self.num_attention_heads,
                self.head_dim,
            ),
            (
                "key/value heads x head_dim",
                self.num_key_value_heads,
                self.head_dim,
            ),
            (
                "vocab_size x hidden_size",
                self.vocab_size,
                self.hidden_size,
            ),
            (
                "intermediate_size x hidden_size",
                self.intermediate_size,
                self.hidden_size,
            ),
            (
                "attention heads x head_dim x hidden_size",
                self.num_attention_heads.saturating_mul(self.head_dim),
                self.hidden_size,
            ),
        ] {
            if elements(a, b).is_none() {
                return bad(format!("{what} ({a} x {b}) overflows"));
            }
        }
        let finite = |key: &str, v: f64, min_exclusive: bool| {
            if !v.is_finite() || v < 0.0 || (min_exclusive && v == 0.0) {
                bad(format!(
                    "{key} = {v} must be finite and {}",
                    if min_exclusive {
                        "positive"
                    } else {
                        "non-negative"
                    }
                ))
            } else {
                Ok(())
            }
        };
        finite("rope_theta", self.rope_theta, true)?;
        finite("rms_norm_eps", self.rms_norm_eps, false)?;
        if let Some(s) = &self.rope_scaling {
            finite("rope_scaling.factor", s.factor, true)?;
            finite("rope_scaling.low_freq_factor", s.low_freq_factor, true)?;
            finite("rope_scaling.high_freq_factor", s.high_freq_factor, true)?;
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "{} attention heads are not a multiple of {} key/value heads",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} is odd (RoPE rotates pairs)",
                self.head_dim
            ));
        }
        Ok(())
    }
}

/// A token id field `key` of `file` that may be absent (null), one integer or a list of them;
/// anything else (a negative or fractional number, an id of 2^32 or more, a string) is an error.
pub fn token_ids(file: &str, key: &str, v: &serde_json::Value) -> Result<Vec<u32>, ConfigError> {
    let one = |x: &serde_json::Value| {
        x.as_u64()
            .ok_or_else(|| ConfigError::Value {
                file: file.into(),
                key: key.into(),
                problem: format!("holds {x}, not a token id"),
            })
            .and_then(|v| token_id(file, key, v))
    };
    match v {
        serde_json::Value::Null => Ok(Vec::new()),
        serde_json::Value::Array(a) => a.iter().map(one).collect(),
        other => Ok(vec![one(other)?]),
    }
}
