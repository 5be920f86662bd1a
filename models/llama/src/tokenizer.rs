//! The tokenizer stored in GGUF metadata, rebuilt with the `tokenizers` crate.
//!
//! Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE), with the pre-tokenizers that
//! `tokenizer.ggml.pre` names: `smollm` (single digits, then byte-level splitting) and the
//! plain byte-level regex for `default`/`gpt2`/`llama-bpe`-style files. Tokens of type 3
//! (control) become special tokens; no BOS is added unless the file asks for it.

use stoke_formats::gguf::{Gguf, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{file}: metadata `{key}` is missing or malformed ({expected})")]
    Metadata {
        file: String,
        key: String,
        expected: &'static str,
    },
    #[error("{file}: tokenizer model `{found}` is not supported (gpt2 byte-level BPE is)")]
    Model { file: String, found: String },
    #[error("{file}: pre-tokenizer `{found}` is not supported (smollm, default, gpt2 are)")]
    PreTokenizer { file: String, found: String },
    #[error("{file}: building the tokenizer: {reason}")]
    Build { file: String, reason: String },
    #[error("{file}: metadata `{key}` has {got} entries, `{other}` has {want}")]
    Length {
        file: String,
        key: String,
        got: usize,
        other: String,
        want: usize,
    },
}

/// Runs `f` (a call into the `tokenizers` crate on `file`'s contents); a panic inside it becomes
/// [`TokenizerError::Build`] instead of unwinding through the loader.
fn guard<T>(
    file: &str,
    f: impl FnOnce() -> Result<T, String> + std::panic::UnwindSafe,
) -> Result<T, TokenizerError> {
    let build = |reason| TokenizerError::Build {
        file: file.into(),
        reason,
    };
    match std::panic::catch_unwind(f) {
        Ok(r) => r.map_err(build),
        Err(p) => Err(build(format!(
            "the tokenizers crate panicked: {}",
            crate::panic_message(p.as_ref())
        ))),
    }
}

/// Loads a Hugging Face `tokenizer.json` (`bytes`, the contents of `file`).
///
/// The JSON is parsed before the `tokenizers` crate sees it: its decoder deserializer (0.22)
/// panics (`expect("Helper")`) on a syntax error inside the `decoder` entry.
pub fn from_json(file: &str, bytes: &[u8]) -> Result<Tokenizer, TokenizerError> {
    let json: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| TokenizerError::Build {
            file: file.into(),
            reason: format!("invalid JSON: {e}"),
        })?;
    // The BPE builder (0.22) slices the prefix's length off each merge's second part: a shorter
    // part, or one that would be cut inside a character, panics there.
    let model = &json["model"];
    if let (Some(prefix), Some(merges)) = (
        model["continuing_subword_prefix"].as_str(),
        model["merges"].as_array(),
    ) {
        for (i, m) in merges.iter().enumerate() {
            let second = match m {
                serde_json::Value::String(s) => s.split_once(' ').map(|(_, b)| b),
                serde_json::Value::Array(a) => a.get(1).and_then(serde_json::Value::as_str),
                _ => None,
            };
            if second.is_some_and(|b| !b.is_char_boundary(prefix.len())) {
                return Err(TokenizerError::Metadata {
                    file: file.into(),
                    key: format!("model.merges[{i}]"),
                    expected: "a second part that starts with model.continuing_subword_prefix",
                });
            }
        }
    }
    guard(file, || {
        serde_json::from_value::<Tokenizer>(json).map_err(|e| e.to_string())
    })
}

/// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
pub fn from_gguf(g: &Gguf) -> Result<Tokenizer, TokenizerError> {
    let file = || g.file.clone();
    let missing = |key: &str, expected| TokenizerError::Metadata {
        file: file(),
        key: key.into(),
        expected,
    };
    let model = g
        .metadata
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .ok_or_else(|| missing("tokenizer.ggml.model", "a string"))?;
    if model != "gpt2" {
        return Err(TokenizerError::Model {
            file: file(),
            found: model.into(),
        });
    }
    let strings = |key: &str| -> Result<Vec<String>, TokenizerError> {
        g.metadata
            .get(key)
            .and_then(Value::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|v| v.as_str().map(str::to_string))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| missing(key, "an array of strings"))
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    if u32::try_from(tokens.len()).is_err() {
        return Err(missing("tokenizer.ggml.tokens", "fewer than 2^32 tokens"));
    }
    let types: Vec<u64> = match g.metadata.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<_>>>())
            .ok_or_else(|| missing("tokenizer.ggml.token_type", "an array of integers"))?,
        None => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err(TokenizerError::Length {
            file: file(),
            key: "tokenizer.ggml.token_type".into(),
            got: types.len(),
            other: "tokenizer.ggml.tokens".into(),
            want: tokens.len(),
        });
    }
    let vocab: ahash::AHashMap<String, u32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            let (a, b) = m
                .split_once(' ')
                .ok_or_else(|| missing("tokenizer.ggml.merges", "pairs separated by one space"))?;
            Ok((a.to_string(), b.to_string()))
        })
        .collect::<Result<_, TokenizerError>>()?;
    let bpe = guard(&g.file, || {
        BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| e.to_string())
    })?;
    let mut tok = Tokenizer::new(bpe);
    let pre = g
        .metadata
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let byte_level = ByteLevel::new(false, true, true);
    let pre_tokenizer: PreTokenizerWrapper = match pre {
        "smollm" => Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
        "default" | "gpt2" => byte_level.into(),
        other => {
            return Err(TokenizerError::PreTokenizer {
                file: file(),
                found: other.into(),
            });
        }
    };
    tok.with_pre_tokenizer(Some(pre_tokenizer));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    let specials: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, t)| **t == 3)
        .map(|(s, _)| AddedToken::from(s.clone(), true))
        .collect();
    guard(&g.file, move || {
        tok.add_special_tokens(&specials);
        Ok(tok)
    })
}
