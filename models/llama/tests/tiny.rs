//! A tiny random-weight Llama written to GGUF by the test itself: the Burn model's logits
//! against a plain f64 forward written here, incremental decoding against a full forward,
//! batched sequences of different lengths against each alone, and loader errors.

use burn::tensor::{DType, Int, Tensor, TensorData};
use stoke_formats::gguf::{Value, Writer};
use stoke_formats::reference::relative_error;
use stoke_llama::load::{LoadError, load_gguf};
use stoke_llama::model::KvCache;
use stoke_llama::synthetic::{TINY, Tiny, Weights, byte_tokens, gguf, weights};

type B = burn_ndarray::NdArray<f32>;

/// y = W x for W `[out, in]` row-major.
fn matvec(w: &[f64], x: &[f64], out: usize) -> Vec<f64> {
    let inp = x.len();
    (0..out)
        .map(|o| (0..inp).map(|i| w[o * inp + i] * x[i]).sum())
        .collect()
}

fn rms(x: &[f64], g: &[f64], eps: f64) -> Vec<f64> {
    stoke_formats::reference::rms_norm(x, g, x.len(), eps)
}

/// Plain f64 Llama forward over a whole sequence; returns logits per position.
fn reference_forward(t: &Tiny, w: &Weights, tokens: &[usize]) -> Vec<Vec<f64>> {
    let (hd, d, half) = (t.hidden, t.head_dim, t.head_dim / 2);
    let rope = |v: &mut [f64], pos: usize| {
        for i in 0..half {
            let a = pos as f64 * t.theta.powf(-(2.0 * i as f64) / d as f64);
            let (x1, x2) = (v[i], v[i + half]);
            v[i] = x1 * a.cos() - x2 * a.sin();
            v[i + half] = x2 * a.cos() + x1 * a.sin();
        }
    };
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&tk| w.embed[tk * hd..(tk + 1) * hd].to_vec())
        .collect();
    for lw in &w.layers {
        let normed: Vec<Vec<f64>> = xs.iter().map(|x| rms(x, &lw[0], t.eps)).collect();
        let mut qs: Vec<Vec<f64>> = normed
            .iter()
            .map(|x| matvec(&lw[1], x, t.heads * d))
            .collect();
        let mut ks: Vec<Vec<f64>> = normed
            .iter()
            .map(|x| matvec(&lw[2], x, t.kv_heads * d))
            .collect();
        let vs: Vec<Vec<f64>> = normed
            .iter()
            .map(|x| matvec(&lw[3], x, t.kv_heads * d))
            .collect();
        for (p, (q, k)) in qs.iter_mut().zip(ks.iter_mut()).enumerate() {
            q.chunks_mut(d).for_each(|hq| rope(hq, p));
            k.chunks_mut(d).for_each(|hk| rope(hk, p));
        }
        for p in 0..xs.len() {
            let mut attn = vec![0.0; t.heads * d];
            for hh in 0..t.heads {
                let kvh = hh / (t.heads / t.kv_heads);
                let q = &qs[p][hh * d..(hh + 1) * d];
                let scores: Vec<f64> = (0..=p)
                    .map(|j| {
                        q.iter()
                            .zip(&ks[j][kvh * d..(kvh + 1) * d])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for c in 0..d {
                        attn[hh * d + c] += ej / z * vs[j][kvh * d + c];
                    }
                }
            }
            let o = matvec(&lw[4], &attn, hd);
            xs[p].iter_mut().zip(o).for_each(|(x, y)| *x += y);
            let n = rms(&xs[p], &lw[5], t.eps);
            let g = matvec(&lw[6], &n, t.inter);
            let u = matvec(&lw[7], &n, t.inter);
            let act: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = matvec(&lw[8], &act, hd);
            xs[p].iter_mut().zip(down).for_each(|(x, y)| *x += y);
        }
    }
    let head = w.head.as_ref().unwrap_or(&w.embed);
    xs.iter()
        .map(|x| matvec(head, &rms(x, &w.norm, t.eps), t.vocab))
        .collect()
}

fn write_tmp(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("stoke-llama-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn logits(
    model: &stoke_llama::model::Llama<B>,
    tokens: &[Vec<usize>],
    cache: &mut KvCache<B>,
) -> Vec<f64> {
    let b = tokens.len();
    let s = tokens.iter().map(Vec::len).max().unwrap();
    let mut flat = vec![];
    for t in tokens {
        flat.extend(t.iter().map(|&x| x as i64));
        flat.extend(std::iter::repeat_n(0, s - t.len()));
    }
    let lens: Vec<usize> = tokens.iter().map(Vec::len).collect();
    let x = Tensor::<B, 2, Int>::from_data(TensorData::new(flat, [b, s]), &Default::default());
    model
        .forward(x, &lens, cache, false)
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

#[test]
fn logits_match_an_f64_reference_with_gqa_tied_and_untied() {
    for tied in [true, false] {
        let w = weights(&TINY, tied, 7 + tied as u64);
        let path = write_tmp(&format!("tiny-{tied}.gguf"), &gguf(&TINY, &w));
        let loaded = load_gguf::<B>(&path, &Default::default(), DType::F32, 64).unwrap();
        assert_eq!(loaded.config.tie_word_embeddings, tied);
        let tokens = vec![3usize, 141, 59, 26, 5, 35, 8, 97];
        let mut cache = KvCache::for_model(&loaded.model, 1, 64, DType::F32, &Default::default());
        let got = logits(&loaded.model, std::slice::from_ref(&tokens), &mut cache);
        let want: Vec<f64> = reference_forward(&TINY, &w, &tokens).concat();
        let err = relative_error(&got, &want);
        assert!(err < 1e-5, "tied={tied}: relative error {err:e}");
    }
}

#[test]
fn incremental_decoding_matches_the_full_forward() {
    let w = weights(&TINY, true, 11);
    let path = write_tmp("tiny-incremental.gguf", &gguf(&TINY, &w));
    let m = load_gguf::<B>(&path, &Default::default(), DType::F32, 64)
        .unwrap()
        .model;
    let tokens = vec![1usize, 2, 3, 250, 17, 42, 9];
    let mut full_cache = KvCache::for_model(&m, 1, 64, DType::F32, &Default::default());
    let full = logits(&m, std::slice::from_ref(&tokens), &mut full_cache);
    let mut cache = KvCache::for_model(&m, 1, 64, DType::F32, &Default::default());
    let mut steps = logits(&m, &[tokens[..3].to_vec()], &mut cache);
    for &t in &tokens[3..] {
        steps.extend(logits(&m, &[vec![t]], &mut cache));
    }
    assert_eq!(cache.lens, vec![tokens.len()]);
    assert!(relative_error(&steps, &full) < 1e-5);
}

#[test]
fn a_batch_of_different_lengths_matches_each_sequence_alone() {
    let w = weights(&TINY, false, 13);
    let path = write_tmp("tiny-batch.gguf", &gguf(&TINY, &w));
    let m = load_gguf::<B>(&path, &Default::default(), DType::F32, 64)
        .unwrap()
        .model;
    let seqs = vec![vec![5usize, 6, 7, 8, 9], vec![100usize, 200]];
    let mut cache = KvCache::for_model(&m, 2, 64, DType::F32, &Default::default());
    let batched = logits(&m, &seqs, &mut cache);
    // Then one more token each, from different positions.
    let next = logits(&m, &[vec![11], vec![12]], &mut cache);
    let v = TINY.vocab;
    for (i, s) in seqs.iter().enumerate() {
        let mut alone_cache = KvCache::for_model(&m, 1, 64, DType::F32, &Default::default());
        let alone = logits(&m, std::slice::from_ref(s), &mut alone_cache);
        let got = &batched[i * 5 * v..(i * 5 + s.len()) * v];
        assert!(relative_error(got, &alone) < 1e-5, "sequence {i} prefill");
        let alone_next = logits(&m, &[vec![11 + i]], &mut alone_cache);
        assert!(
            relative_error(&next[i * v..(i + 1) * v], &alone_next) < 1e-5,
            "sequence {i} decode"
        );
    }
}

#[test]
fn loader_errors_name_the_file_and_tensor() {
    let w = weights(&TINY, true, 17);
    let bytes = gguf(&TINY, &w);
    let load = |name: &str, b: &[u8]| {
        load_gguf::<B>(&write_tmp(name, b), &Default::default(), DType::F32, 64)
            .err()
            .expect("an error")
    };

    let e = load("truncated.gguf", &bytes[..bytes.len() - 100]);
    assert!(
        matches!(e, LoadError::Gguf(_)) && e.to_string().contains("truncated.gguf"),
        "{e}"
    );

    // A shape that contradicts the configuration: layer 1's o_proj with 16 input columns.
    let bytes2 = with_o_proj_inputs(&bytes, 1, 16);
    let e = load("shape.gguf", &bytes2);
    assert!(
        matches!(e, LoadError::Shape { .. }) && e.to_string().contains("blk.1.attn_output.weight"),
        "{e}"
    );

    let e = load(
        "notllama.gguf",
        &Writer::default()
            .meta("general.architecture", Value::String("mamba".into()))
            .to_bytes(),
    );
    assert!(e.to_string().contains("mamba"), "{e}");

    let missing = Writer::default()
        .meta("general.architecture", Value::String("llama".into()))
        .meta("llama.embedding_length", Value::U32(32))
        .meta("llama.feed_forward_length", Value::U32(48))
        .meta("llama.block_count", Value::U32(1))
        .meta("llama.attention.head_count", Value::U32(4))
        .meta("llama.vocab_size", Value::U32(256))
        .meta("tokenizer.ggml.model", Value::String("gpt2".into()))
        .meta(
            "tokenizer.ggml.tokens",
            Value::Array(byte_tokens().into_iter().map(Value::String).collect()),
        )
        .meta("tokenizer.ggml.merges", Value::Array(vec![]))
        .to_bytes();
    let e = load("missing.gguf", &missing);
    assert!(
        e.to_string()
            .contains("no tensor named `token_embd.weight`"),
        "{e}"
    );
}

/// `bytes` with the directory entry of layer `layer`'s o_proj claiming `inputs` input columns.
fn with_o_proj_inputs(bytes: &[u8], layer: usize, inputs: u64) -> Vec<u8> {
    let needle = format!("blk.{layer}.attn_output.weight");
    let pos = bytes
        .windows(needle.len())
        .position(|w| w == needle.as_bytes())
        .unwrap()
        + needle.len();
    let mut out = bytes.to_vec();
    // After the name: rank (u32), then dims[0] (u64), the input size.
    out[pos + 4..pos + 12].copy_from_slice(&inputs.to_le_bytes());
    out
}

#[test]
fn tokenizer_round_trips_bytes() {
    let w = weights(&TINY, true, 23);
    let path = write_tmp("tiny-tok.gguf", &gguf(&TINY, &w));
    let tok = load_gguf::<B>(&path, &Default::default(), DType::F32, 64)
        .unwrap()
        .tokenizer;
    let text = "héllo, wörld 123\n";
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    assert_eq!(ids.len(), text.len(), "one token per byte with no merges");
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}
