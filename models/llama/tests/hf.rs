//! Loading a Hugging Face model directory: the same weights as GGUF (one file or sharded) give
//! identical logits, `generation_config.json` wins for EOS, and bad directories get typed errors
//! naming the file and tensor.

use burn::tensor::{DType, Int, Tensor, TensorData};
use std::path::PathBuf;
use stoke_llama::load::{LoadError, load_gguf, load_hf_dir};
use stoke_llama::model::KvCache;
use stoke_llama::synthetic::{TINY, gguf, weights, write_hf_dir};

type B = burn_ndarray::NdArray<f32>;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("stoke-hf-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn logits(m: &stoke_llama::model::Llama<B>) -> Vec<f32> {
    let mut cache = KvCache::for_model(m, 1, 32, DType::F32, &Default::default());
    let t = Tensor::<B, 2, Int>::from_data(
        TensorData::new(vec![7i64, 70, 170, 42, 3], [1, 5]),
        &Default::default(),
    );
    m.forward(t, &[5], &mut cache, false)
        .into_data()
        .to_vec::<f32>()
        .unwrap()
}

#[test]
fn hf_directory_and_gguf_give_identical_logits() {
    for (tied, shards) in [(true, 1), (false, 3)] {
        let w = weights(&TINY, tied, 31);
        let dir = tmp(&format!("same-{tied}-{shards}"));
        write_hf_dir(&TINY, &w, &dir, shards).unwrap();
        std::fs::write(dir.join("model.gguf"), gguf(&TINY, &w)).unwrap();
        let hf = load_hf_dir::<B>(&dir, &Default::default(), DType::F32, 32).unwrap();
        let gg =
            load_gguf::<B>(&dir.join("model.gguf"), &Default::default(), DType::F32, 32).unwrap();
        assert_eq!(hf.config.tie_word_embeddings, tied);
        assert_eq!(
            hf.config.eos_token_ids,
            vec![299, 298],
            "generation_config.json's EOS list wins"
        );
        assert_eq!(
            logits(&hf.model),
            logits(&gg.model),
            "tied={tied} shards={shards}"
        );
        let ids = hf
            .tokenizer
            .encode("héllo", false)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(ids, gg.tokenizer.encode("héllo", false).unwrap().get_ids());
    }
}

fn load_err(dir: &std::path::Path) -> LoadError {
    load_hf_dir::<B>(dir, &Default::default(), DType::F32, 32)
        .err()
        .expect("an error")
}

#[test]
fn bad_directories_get_typed_errors() {
    let w = weights(&TINY, false, 37);

    let dir = tmp("no-config");
    let e = load_err(&dir);
    assert!(
        matches!(e, LoadError::Io { .. }) && e.to_string().contains("config.json"),
        "{e}"
    );

    let dir = tmp("bad-json");
    write_hf_dir(&TINY, &w, &dir, 1).unwrap();
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    let e = load_err(&dir);
    assert!(
        matches!(e, LoadError::Json { .. }) && e.to_string().contains("config.json"),
        "{e}"
    );

    let dir = tmp("mistral");
    write_hf_dir(&TINY, &w, &dir, 1).unwrap();
    let cfg = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace("\"llama\"", "\"mistral\"")
        .replace("LlamaForCausalLM", "MistralForCausalLM");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    assert!(load_err(&dir).to_string().contains("mistral"));

    let dir = tmp("shape");
    write_hf_dir(&TINY, &w, &dir, 1).unwrap();
    let cfg = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace("\"intermediate_size\": 48", "\"intermediate_size\": 64");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let e = load_err(&dir);
    assert!(
        matches!(e, LoadError::Shape { .. })
            && e.to_string()
                .contains("model.layers.0.mlp.gate_proj.weight"),
        "{e}"
    );

    let dir = tmp("truncated");
    write_hf_dir(&TINY, &w, &dir, 1).unwrap();
    let st = std::fs::read(dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &st[..st.len() / 2]).unwrap();
    let e = load_err(&dir);
    // The header's own check names the first tensor whose data the file no longer holds.
    assert!(
        matches!(e, LoadError::SafetensorsEntry { .. })
            && e.to_string().contains("model.safetensors")
            && e.to_string().contains("model.embed_tokens.weight"),
        "{e}"
    );

    let dir = tmp("missing-tensor");
    write_hf_dir(&TINY, &w, &dir, 2).unwrap();
    let index = std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap();
    // Point one tensor (written to shard 2) at shard 1, which does not hold it.
    let moved = "\"model.norm.weight\": \"model-00002-of-00002.safetensors\"";
    assert!(index.contains(moved), "{index}");
    let index = index.replacen(
        moved,
        "\"model.norm.weight\": \"model-00001-of-00002.safetensors\"",
        1,
    );
    std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
    let e = load_err(&dir);
    assert!(
        matches!(e, LoadError::MissingTensor { .. }) && e.to_string().contains("model.norm.weight"),
        "{e}"
    );
}

#[test]
fn fp8_checkpoints_load_their_dequantized_values() {
    use stoke_llama::load::Fp8Scales;
    use stoke_llama::synthetic::write_hf_dir_fp8;
    let w = weights(&TINY, false, 41);
    for (i, (layout, shards)) in [
        (Fp8Scales::Tensor, 1),
        (Fp8Scales::Channel, 2),
        (Fp8Scales::Block([16, 8]), 3),
        (Fp8Scales::Block([128, 128]), 1),
    ]
    .into_iter()
    .enumerate()
    {
        let dir = tmp(&format!("fp8-{i}"));
        let held = write_hf_dir_fp8(&TINY, &w, &dir, shards, layout).unwrap();
        assert_ne!(held.layers[0][1], w.layers[0][1], "{layout:?}: E4M3 rounds");
        let plain = tmp(&format!("fp8-plain-{i}"));
        write_hf_dir(&TINY, &held, &plain, 1).unwrap();
        let a = load_hf_dir::<B>(&dir, &Default::default(), DType::F32, 32).unwrap();
        let b = load_hf_dir::<B>(&plain, &Default::default(), DType::F32, 32).unwrap();
        assert_eq!(
            logits(&a.model),
            logits(&b.model),
            "{layout:?}, {shards} shards"
        );
    }

    // A weight whose scale tensor is not in the checkpoint.
    let dir = tmp("fp8-no-scale");
    write_hf_dir_fp8(&TINY, &w, &dir, 2, Fp8Scales::Channel).unwrap();
    let path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let name = "model.layers.1.mlp.up_proj.weight";
    let map = index["weight_map"].as_object_mut().unwrap();
    assert!(map.remove(&format!("{name}_scale")).is_some());
    std::fs::write(&path, index.to_string()).unwrap();
    let e = load_err(&dir);
    assert!(
        matches!(e, LoadError::Fp8Scale { .. }) && e.to_string().contains(name),
        "{e}"
    );

    // Block scales whose grid does not match the block size the configuration names.
    let dir = tmp("fp8-bad-block");
    write_hf_dir_fp8(&TINY, &w, &dir, 1, Fp8Scales::Block([16, 8])).unwrap();
    let cfg = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace(
            "\"weight_block_size\": [\n      16,\n      8\n    ]",
            "\"weight_block_size\": [32, 8]",
        );
    assert!(cfg.contains("[32, 8]"), "{cfg}");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let e = load_err(&dir);
    assert!(
        matches!(e, LoadError::Fp8Scale { .. }) && e.to_string().contains("blocks"),
        "{e}"
    );
}
