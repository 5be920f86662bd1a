//! A short seeded pass of the loader fuzzing (`stoke_tests::loader_fuzz`): mutated and random
//! GGUF, safetensors, config.json and tokenizer files; no reader may panic, return an error that
//! does not name the file, or make an allocation beyond the bound the file's size sets.
//! `STOKE_FUZZ_CASES` and `STOKE_FUZZ_SEED` change the count (per reader) and the seed; the long
//! run is the `loader-fuzz` binary.

use stoke_tests::loader_fuzz::{CountingAlloc, Reader, run_chunk};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn short_pass(reader: Reader) {
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let cases = env("STOKE_FUZZ_CASES", 2000) as u32;
    let seed = env("STOKE_FUZZ_SEED", 0x5704e);
    match run_chunk(reader, seed, 0, cases) {
        Ok(t) => println!("{}: {t:?}", reader.name()),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn gguf_reader_survives_mutated_files() {
    short_pass(Reader::Gguf);
}

#[test]
fn safetensors_reader_survives_mutated_files() {
    short_pass(Reader::Safetensors);
}

#[test]
fn config_json_reader_survives_mutated_files() {
    short_pass(Reader::ConfigJson);
}

#[test]
fn tokenizer_loaders_survive_mutated_files() {
    short_pass(Reader::Tokenizer);
}

/// The bugs the fuzzing and the review of the readers found, one input each.
#[test]
fn known_bad_files_are_typed_errors() {
    use serde_json::json;
    use stoke_llama::{load, tokenizer};
    let named = |e: String, file: &str, what: &str| {
        assert!(e.contains(file) && e.contains(what), "{e}");
    };
    // An empty shard index (once a panic), a shard outside the model directory.
    let e = load::shard_index("i.json", &json!({"weight_map": {}})).unwrap_err();
    named(e.to_string(), "i.json", "empty");
    let e = load::shard_index("i.json", &json!({"weight_map": {"w": "../w.safetensors"}}));
    named(e.unwrap_err().to_string(), "i.json", "weight_map.w");
    // safetensors entries: offsets past the file, a shape that overflows.
    let header = |h: serde_json::Value, data: usize| {
        let text = h.to_string();
        let mut b = (text.len() as u64).to_le_bytes().to_vec();
        b.extend(text.bytes());
        b.resize(b.len() + data, 0);
        b
    };
    let b = header(
        json!({"w": {"dtype": "U8", "shape": [u64::MAX / 2], "data_offsets": [0, u64::MAX / 2]}}),
        4,
    );
    let e = load::read_safetensors("m.safetensors", &b).unwrap_err();
    named(e.to_string(), "m.safetensors", "`w`");
    let b = header(
        json!({"w": {"dtype": "F32", "shape": [u64::MAX, 2], "data_offsets": [0, 0]}}),
        0,
    );
    let e = load::read_safetensors("m.safetensors", &b).unwrap_err();
    named(e.to_string(), "m.safetensors", "overflows");
    // config.json: weight sizes that overflow, a token id past u32.
    let config = |patch: serde_json::Value| {
        let mut c = json!({"model_type": "llama", "vocab_size": 8, "hidden_size": 8,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2});
        for (k, v) in patch.as_object().unwrap() {
            c[k] = v.clone();
        }
        load::config_from_json("c.json", c.to_string().as_bytes()).map(|_| ())
    };
    assert!(config(json!({})).is_ok());
    let e = config(json!({"num_attention_heads": 1u64 << 40, "head_dim": 1u64 << 40}));
    named(e.unwrap_err().to_string(), "c.json", "overflows");
    let e = config(json!({"bos_token_id": 1u64 << 32}));
    named(e.unwrap_err().to_string(), "c.json", "bos_token_id");
    let e = config(json!({"num_hidden_layers": u64::MAX}));
    assert!(e.is_ok(), "a layer count alone allocates nothing: {e:?}");
    // tokenizer.json with a syntax error inside `decoder` (the tokenizers crate panics there).
    let e = tokenizer::from_json("t.json", br#"{"decoder": {"type": "ByteLevel",}}"#).unwrap_err();
    named(e.to_string(), "t.json", "invalid JSON");
    // A BPE merge shorter than the continuing-subword prefix (the tokenizers crate panics there;
    // found by the long run).
    let t = br#"{"model": {"type": "BPE", "continuing_subword_prefix": "@@",
        "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}}"#;
    let e = tokenizer::from_json("t.json", t).unwrap_err();
    named(e.to_string(), "t.json", "model.merges[0]");
}
