//! The decode step (prefill into a decoder, then `decode_forward` steps through the fused
//! decode ops' reference bodies) against the model's plain forward with a Burn KV cache, on the
//! CPU: the same logits every step, for sequences of different lengths in one batch, on
//! NdArray and on `Stoke<NdArray>`; and the decoder's typed errors.

use burn::tensor::{DType, Int, Tensor, TensorData};
use stoke::{FusedOps, KvCacheFormat};
use stoke_llama::load::load_gguf;
use stoke_llama::model::{KvCache, Llama, PREFILL_CHUNK};
use stoke_llama::synthetic::{PACKABLE, gguf, weights};

fn model<B: FusedOps>(capacity: usize) -> Llama<B> {
    let dir = std::env::temp_dir().join(format!("stoke-decode-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // One file per call: tests run in parallel and the loader maps the file.
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!("packable-{n}.gguf"));
    std::fs::write(&path, gguf(&PACKABLE, &weights(&PACKABLE, true, 11))).unwrap();
    load_gguf::<B>(&path, &Default::default(), DType::F32, capacity)
        .unwrap()
        .model
        .pinned()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![5, 77, 12, 200, 3, 9, 41], vec![8, 150, 23], vec![99]]
}

/// Greedy ids and logits of each sampling through the decoder (prefill, then `steps` steps).
fn decoded<B: FusedOps>(
    m: &Llama<B>,
    steps: usize,
    kv: KvCacheFormat,
) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    decoded_forced(m, steps, kv, None, PREFILL_CHUNK)
}

/// As [`decoded`], with step `s` reading `forced[s]` instead of the greedy ids.
fn decoded_forced<B: FusedOps>(
    m: &Llama<B>,
    steps: usize,
    kv: KvCacheFormat,
    forced: Option<&[Vec<u32>]>,
    chunk: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
    let p = prompts();
    let mut spec = m.decode_spec(p.len(), 32, kv, false);
    spec.keep_logits = true;
    let mut dec = stoke::decoder::<B>(spec, DType::F32, &Default::default()).unwrap();
    m.prefill_chunked(&p, &mut dec, chunk).unwrap();
    let mut ids = vec![stoke::decode_take_ids::<B>(&mut dec).unwrap()];
    let mut logits = vec![stoke::decode_last_logits::<B>(&mut dec).unwrap()];
    for s in 0..steps {
        if let Some(f) = forced {
            stoke::decode_force_ids::<B>(&mut dec, &f[s]).unwrap();
        }
        stoke::decode_step::<B>(&mut dec, &mut |d| m.decode_forward(d)).unwrap();
        ids.push(stoke::decode_take_ids::<B>(&mut dec).unwrap());
        logits.push(stoke::decode_last_logits::<B>(&mut dec).unwrap());
    }
    (ids, logits)
}

/// The same tokens through `Llama::forward` and a Burn cache: each step's last-token logits.
fn forwarded<B: FusedOps>(m: &Llama<B>, ids: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let p = prompts();
    let (b, device) = (p.len(), Default::default());
    let mut cache = KvCache::<B>::for_model(m, b, 32, DType::F32, &device);
    let longest = p.iter().map(Vec::len).max().unwrap();
    let mut flat = vec![];
    for q in &p {
        flat.extend(q.iter().map(|&t| t as i64));
        flat.extend(std::iter::repeat_n(0, longest - q.len()));
    }
    let lens: Vec<usize> = p.iter().map(Vec::len).collect();
    let host = |t: Tensor<B, 3>| t.into_data().convert::<f32>().to_vec::<f32>().unwrap();
    let t = Tensor::<B, 2, Int>::from_data(TensorData::new(flat, [b, longest]), &device);
    let mut out = vec![host(m.forward(t, &lens, &mut cache, true))];
    for step in &ids[..ids.len() - 1] {
        let t = Tensor::<B, 2, Int>::from_data(
            TensorData::new(step.iter().map(|&x| x as i64).collect::<Vec<_>>(), [b, 1]),
            &device,
        );
        out.push(host(m.forward(t, &vec![1; b], &mut cache, true)));
    }
    out
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

fn argmax_rows(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits
        .chunks(vocab)
        .map(|r| {
            r.iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &v)| if v > b.1 { (i, v) } else { b },
                )
                .0 as u32
        })
        .collect()
}

#[test]
fn decode_step_equals_the_forward_with_a_burn_cache() {
    type B = burn_ndarray::NdArray<f32>;
    let m = model::<B>(64);
    let (ids, logits) = decoded(&m, 8, KvCacheFormat::Bf16);
    let want = forwarded(&m, &ids);
    assert_eq!(logits.len(), want.len());
    let d = max_diff(&logits, &want);
    assert!(
        d < 1e-4,
        "decode-step logits differ from the forward's by {d}"
    );
    for (step, (l, i)) in logits.iter().zip(&ids).enumerate() {
        assert_eq!(
            &argmax_rows(l, PACKABLE.vocab),
            i,
            "greedy ids of sampling {step}"
        );
    }
}

#[test]
fn chunked_prefill_equals_the_forward() {
    type B = burn_ndarray::NdArray<f32>;
    let m = model::<B>(64);
    // Prompts of 7, 3 and 1 tokens in chunks that split them (1 row: every token its own
    // chunk; 4: a chunk holding the end of one prompt and the start of the next).
    for chunk in [1, 2, 4, 5, 11] {
        let (ids, logits) = decoded_forced(&m, 4, KvCacheFormat::Bf16, None, chunk);
        let want = forwarded(&m, &ids);
        let d = max_diff(&logits, &want);
        assert!(
            d < 1e-4,
            "chunks of {chunk}: logits differ from the forward's by {d}"
        );
    }
}

#[test]
fn chunked_prefill_reads_earlier_chunks_exact_with_a_quantized_mirror() {
    // Prefill attention reads the exact cache (the FP8/INT4 mirror serves decode steps), so a
    // prompt's prefill logits do not depend on where the chunks split it.
    type B = burn_ndarray::NdArray<f32>;
    let m = model::<B>(64);
    for kv in [KvCacheFormat::Int4, KvCacheFormat::Fp8] {
        let (_, whole) = decoded_forced(&m, 0, kv, None, PREFILL_CHUNK);
        for chunk in [1, 4] {
            let (_, split) = decoded_forced(&m, 0, kv, None, chunk);
            let d = max_diff(&split, &whole);
            assert!(
                d < 1e-4,
                "{kv:?} chunks of {chunk}: prefill logits moved by {d}"
            );
        }
    }
}

#[test]
fn forced_decode_steps_equal_the_forward_on_the_forced_tokens() {
    type B = burn_ndarray::NdArray<f32>;
    let m = model::<B>(64);
    let forced: Vec<Vec<u32>> = (0..6u32)
        .map(|s| (0..3u32).map(|b| (s * 13 + b * 7 + 5) % 250 + 1).collect())
        .collect();
    let (_, logits) = decoded_forced(
        &m,
        forced.len(),
        KvCacheFormat::Bf16,
        Some(&forced),
        PREFILL_CHUNK,
    );
    // `forwarded` feeds ids[s] to step s and ignores the last entry.
    let mut inputs = forced.clone();
    inputs.push(vec![0; 3]);
    let want = forwarded(&m, &inputs);
    let d = max_diff(&logits, &want);
    assert!(
        d < 1e-4,
        "forced decode logits differ from the forward's by {d}"
    );
}

#[test]
fn decode_step_on_stoke_ndarray_equals_ndarray() {
    type P = burn_ndarray::NdArray<f32>;
    type S = stoke::Stoke<burn_ndarray::NdArray<f32>>;
    let (ids_p, logits_p) = decoded(&model::<P>(64), 6, KvCacheFormat::Bf16);
    let (ids_s, logits_s) = decoded(&model::<S>(64), 6, KvCacheFormat::Bf16);
    assert_eq!(ids_p, ids_s);
    // Stoke's CPU kernels sum the projections in another order than burn-ndarray's matmul.
    let scale = logits_p.iter().flatten().fold(0f32, |a, v| a.max(v.abs()));
    let d = max_diff(&logits_p, &logits_s);
    assert!(
        d <= 1e-5 * scale.max(1.0),
        "max |diff| {d} against logits up to {scale}"
    );
}

#[test]
fn simulated_cache_formats_stay_close_to_bf16() {
    type B = burn_ndarray::NdArray<f32>;
    let m = model::<B>(64);
    let (_, exact) = decoded(&m, 4, KvCacheFormat::Bf16);
    for kv in [KvCacheFormat::Fp8, KvCacheFormat::Int4] {
        let (_, l) = decoded(&m, 4, kv);
        // The prefill attends to exact keys; the first step reads the cache format (later
        // steps may follow other tokens).
        assert_eq!(l[0], exact[0]);
        let scale = exact[1].iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = max_diff(&l[1..2], &exact[1..2]);
        assert!(d > 0.0, "{kv:?}: the format changed nothing");
        assert!(d < 0.25 * scale, "{kv:?}: {d} against logits up to {scale}");
    }
}

#[test]
fn decoder_errors_are_typed() {
    type B = burn_ndarray::NdArray<f32>;
    let m = model::<B>(64);
    let spec = m.decode_spec(2, 16, KvCacheFormat::Bf16, false);
    let mut dec = stoke::decoder::<B>(spec.clone(), DType::F32, &Default::default()).unwrap();
    // More prompts than the decoder's lanes.
    let e = m
        .prefill(&[vec![1], vec![2], vec![3]], &mut dec)
        .unwrap_err();
    assert!(matches!(e, stoke::DecodeError::Shape { .. }), "{e}");
    // A prompt that fills the context.
    let e = m.prefill(&[vec![1; 16]], &mut dec).unwrap_err();
    assert!(
        matches!(e, stoke::DecodeError::ContextOverflow { .. }),
        "{e}"
    );
    // Stepping past the context.
    m.prefill(&[vec![1; 15], vec![2]], &mut dec).unwrap();
    stoke::decode_step::<B>(&mut dec, &mut |d| m.decode_forward(d)).unwrap();
    let e = stoke::decode_step::<B>(&mut dec, &mut |d| m.decode_forward(d)).unwrap_err();
    assert!(
        matches!(
            e,
            stoke::DecodeError::ContextOverflow {
                needed: 17,
                capacity: 16
            }
        ),
        "{e}"
    );
    // Forced ids: at most one per lane, inside the vocabulary.
    let e = stoke::decode_force_ids::<B>(&mut dec, &[1, 2, 3]).unwrap_err();
    assert!(matches!(e, stoke::DecodeError::Shape { .. }), "{e}");
    let e = stoke::decode_force_ids::<B>(&mut dec, &[1, PACKABLE.vocab as u32]).unwrap_err();
    assert!(matches!(e, stoke::DecodeError::Shape { .. }), "{e}");
    stoke::decode_force_ids::<B>(&mut dec, &[1, 2]).unwrap();
    // An empty prompt, and packed layouts that do not fit the decoder or the rows.
    let e = m.prefill(&[vec![3], vec![]], &mut dec).unwrap_err();
    assert!(matches!(e, stoke::DecodeError::Shape { .. }), "{e}");
    let width = (spec.heads + 2 * spec.kv_heads) * spec.head_dim;
    let qkv = |rows: usize| Tensor::<B, 3>::zeros([1, rows, width], &Default::default());
    let seq = |slot, pos0, rows| stoke::PackedSeq { slot, pos0, rows };
    for (seqs, rows) in [
        (vec![seq(0, 0, 3)], 4),
        (vec![seq(2, 0, 1)], 1),
        (vec![seq(0, 0, 1), seq(0, 1, 1)], 2),
        (vec![seq(1, 0, 0)], 0),
    ] {
        let e = stoke::prefill_attention::<B>(&mut dec, 0, qkv(rows), &seqs).unwrap_err();
        assert!(
            matches!(e, stoke::DecodeError::Shape { .. }),
            "{seqs:?}: {e}"
        );
    }
    let e = stoke::prefill_attention::<B>(&mut dec, 0, qkv(2), &[seq(1, 15, 2)]).unwrap_err();
    assert!(
        matches!(e, stoke::DecodeError::ContextOverflow { .. }),
        "{e}"
    );
    // A RoPE table shorter than the capacity.
    let mut bad = spec;
    bad.capacity = 1 << 20;
    let e = stoke::decoder::<B>(bad, DType::F32, &Default::default()).unwrap_err();
    assert!(matches!(e, stoke::DecodeError::Shape { .. }), "{e}");
}

#[test]
fn perplexity_through_the_packed_prefill_equals_the_forward() {
    type B = burn_ndarray::NdArray<f32>;
    let dir = std::env::temp_dir().join(format!("stoke-ppl-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("packable.gguf");
    std::fs::write(&path, gguf(&PACKABLE, &weights(&PACKABLE, true, 13))).unwrap();
    let text = "the quick brown fox jumps over the lazy dog; ".repeat(8);
    let window = 40;
    // A RoPE table of window + 1 positions: the decoder's prefill; of window: the forward.
    let ppl = |positions: usize| {
        let l = load_gguf::<B>(&path, &Default::default(), DType::F32, positions).unwrap();
        let m = l.model.pinned();
        stoke_llama::eval::perplexity(
            &m,
            &l.tokenizer,
            &text,
            window,
            3,
            DType::F32,
            None,
            None,
            &Default::default(),
        )
        .unwrap()
    };
    let (prefill, forward) = (ppl(window + 1), ppl(window));
    assert!(prefill.through_prefill && !forward.through_prefill);
    assert_eq!(prefill.predicted_tokens, forward.predicted_tokens);
    assert!(
        (prefill.mean_nll - forward.mean_nll).abs() < 1e-5,
        "{prefill:?} vs {forward:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
