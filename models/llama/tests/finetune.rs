//! The fine-tune -> quantize -> save -> serve pipeline on tiny synthetic models (CPU): training
//! lowers the loss, gradients through the fused ops' reference bodies equal those of a plain
//! composition, the packed model file round-trips bit for bit and serves the logits of the
//! dequantized model, and bad files get typed errors.

use burn::module::Param;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Int, Tensor, TensorData, TensorPrimitive};
use stoke_formats::reference::relative_error;
use stoke_llama::load::{LoadError, load_gguf, load_gguf_packed};
use stoke_llama::model::{KvCache, Llama};
use stoke_llama::packed_file::{self, DenseDtype, Head, PackedFileError, PackedModel};
use stoke_llama::quant::{
    Method, PackedProjections, QuantizeConfig, apply_packed, quantize_packed,
};
use stoke_llama::synthetic::{PACKABLE, TINY, Tiny, gguf, gguf_q4_1, weights};
use stoke_llama::train::{self, TrainConfig, next_token_loss};

type Plain = burn_ndarray::NdArray<f32>;
type Packed = stoke::Stoke<burn_ndarray::NdArray<f32>>;
type Ad = burn_autodiff::Autodiff<Plain>;

/// A temporary path of its own (tests run in parallel and the loaders map their files).
fn tmp(name: &str) -> std::path::PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("stoke-finetune-{}-{n}-{name}", std::process::id()))
}

fn load<B: stoke::FusedOps>(t: &Tiny, tied: bool, seed: u64) -> stoke_llama::load::Loaded<B> {
    let path = tmp(&format!(
        "{seed}-{tied}-{}.gguf",
        std::any::type_name::<B>().len()
    ));
    std::fs::write(&path, gguf(t, &weights(t, tied, seed))).unwrap();
    let l = load_gguf::<B>(&path, &Default::default(), DType::F32, 64).unwrap();
    let _ = std::fs::remove_file(&path);
    l
}

fn lcg(n: usize, vocab: usize, mut s: u64) -> Vec<u32> {
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

fn host(t: Tensor<impl Backend, 2>) -> Vec<f64> {
    t.into_data().convert::<f64>().to_vec::<f64>().unwrap()
}

fn logits<B: stoke::FusedOps>(m: &Llama<B>, ids: &[u32]) -> Vec<f64> {
    let n = ids.len();
    let t = Tensor::<B, 2, Int>::from_data(
        TensorData::new(ids.iter().map(|&v| v as i64).collect::<Vec<_>>(), [1, n]),
        &Default::default(),
    );
    let mut cache = KvCache::for_model(m, 1, n, DType::F32, &Default::default());
    m.forward(t, &[n], &mut cache, false)
        .into_data()
        .convert::<f64>()
        .to_vec::<f64>()
        .unwrap()
}

#[test]
fn a_tiny_model_fine_tunes_and_its_loss_falls() {
    let model = load::<Ad>(&TINY, true, 5).model;
    // A stream with structure to learn: a cycle of 23 random tokens.
    let cycle = lcg(23, TINY.vocab, 9);
    let ids: Vec<u32> = (0..2000).map(|i| cycle[i % cycle.len()]).collect();
    let cfg = TrainConfig {
        steps: 12,
        batch: 4,
        seq_len: 16,
        lr: 3e-3,
        min_lr: 3e-4,
        warmup: 1,
        ..Default::default()
    };
    let mut seen = 0;
    let (trained, reports) = train::train(model, &ids, &cfg, |r, _| {
        seen += 1;
        assert_eq!(r.step, seen);
        assert!(r.loss.is_finite() && r.grad_norm.is_finite());
        Ok(())
    })
    .unwrap();
    assert_eq!(reports.len(), 12);
    let first: f64 = reports[..3].iter().map(|r| r.loss).sum::<f64>() / 3.0;
    let last: f64 = reports[9..].iter().map(|r| r.loss).sum::<f64>() / 3.0;
    assert!(last < 0.8 * first, "loss {first:.4} -> {last:.4}");
    // The embedding and head were frozen (the default) and are unchanged.
    let before = load::<Plain>(&TINY, true, 5).model;
    use burn::module::AutodiffModule;
    let after = trained.valid();
    assert_eq!(
        host(after.embed_tokens.val()),
        host(before.embed_tokens.val())
    );
    assert_eq!(
        host(after.lm_head.weight.val()),
        host(before.lm_head.weight.val())
    );
    assert_ne!(
        host(after.layers[0].attn.qkv_proj.weight.val()),
        host(before.layers[0].attn.qkv_proj.weight.val())
    );
    // A checkpoint written by Burn's recorder loads back to the same weights.
    let path = tmp("ckpt");
    train::save_checkpoint(&after, &path).unwrap();
    let back = train::load_checkpoint(before, &path, &Default::default()).unwrap();
    assert_eq!(
        host(back.layers[1].mlp.down_proj.weight.val()),
        host(after.layers[1].mlp.down_proj.weight.val())
    );
    let _ = std::fs::remove_file(path.with_extension("mpk"));
}

#[test]
fn schedule_warms_up_then_follows_the_cosine_to_min_lr() {
    let cfg = TrainConfig {
        steps: 10,
        lr: 1e-3,
        min_lr: 1e-4,
        warmup: 2,
        ..Default::default()
    };
    let lrs = train::schedule(&cfg).unwrap();
    assert_eq!(lrs.len(), 10);
    assert!(lrs[0] < lrs[1] && lrs[1] < lrs[2]);
    assert!((lrs[2] - 1e-3).abs() < 1e-12);
    assert!((lrs[9] - 1e-4).abs() < 1e-9);
    assert!(lrs[2..].windows(2).all(|w| w[1] <= w[0]));
}

/// RMSNorm as a plain composition.
fn rms<B: Backend>(x: Tensor<B, 2>, g: Tensor<B, 1>, eps: f64) -> Tensor<B, 2> {
    let inv = x
        .clone()
        .powi_scalar(2)
        .mean_dim(1)
        .add_scalar(eps)
        .sqrt()
        .recip();
    x * inv * g.unsqueeze::<2>()
}

/// The model's forward written out in plain Burn ops, reading its parameters: no fused op and
/// no `module::attention`.
fn plain_logits<B: Backend>(m: &Llama<B>, tokens: &[i64], b: usize, s: usize) -> Tensor<B, 2> {
    let device = Default::default();
    let eps = m.rms_norm_eps;
    let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(tokens.to_vec(), [b * s]), &device);
    let mut x = m.embed_tokens.val().select(0, ids); // [b s, hidden]
    let pos: Vec<i64> = (0..b).flat_map(|_| 0..s as i64).collect();
    let positions = Tensor::<B, 2, Int>::from_data(TensorData::new(pos, [b, s]), &device);
    let hidden: Vec<bool> = (0..s).flat_map(|i| (0..s).map(move |j| j > i)).collect();
    let mask = Tensor::<B, 2, Bool>::from_data(TensorData::new(hidden, [s, s]), &device);
    for layer in &m.layers {
        let a = &layer.attn;
        let (h, kvh, d) = (a.n_heads, a.n_kv_heads, a.head_dim);
        let n = rms(x.clone(), layer.attn_norm.val(), eps);
        let qkv = n
            .matmul(a.qkv_proj.weight.val())
            .reshape([b, s, (h + 2 * kvh) * d]);
        let split = |from: usize, heads: usize| {
            qkv.clone()
                .narrow(2, from * d, heads * d)
                .reshape([b, s, heads, d])
                .swap_dims(1, 2)
        };
        let q = m.rope.apply(split(0, h), positions.clone());
        let k = m.rope.apply(split(h, kvh), positions.clone());
        let v = split(h + kvh, kvh);
        let rep = |t: Tensor<B, 4>| {
            t.reshape([b, kvh, 1, s, d])
                .expand([b, kvh, h / kvh, s, d])
                .reshape([b, h, s, d])
        };
        let (k, v) = (rep(k), rep(v));
        let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((d as f64).sqrt());
        let scores = scores.mask_fill(
            mask.clone().reshape([1, 1, s, s]).expand([b, h, s, s]),
            f32::NEG_INFINITY,
        );
        let att = burn::tensor::activation::softmax(scores, 3).matmul(v);
        let att = att.swap_dims(1, 2).reshape([b * s, h * d]);
        let h1 = att.matmul(a.o_proj.weight.val()) + x;
        let n2 = rms(h1.clone(), layer.mlp_norm.val(), eps);
        let gu = n2.matmul(layer.mlp.gate_up_proj.weight.val());
        let inter = gu.dims()[1] / 2;
        let pairs = gu.reshape([b * s, inter, 2]);
        let gate = pairs.clone().narrow(2, 0, 1);
        let up = pairs.narrow(2, 1, 1);
        let act =
            (burn::tensor::activation::sigmoid(gate.clone()) * gate * up).reshape([b * s, inter]);
        x = act.matmul(layer.mlp.down_proj.weight.val()) + h1;
    }
    rms(x, m.norm.val(), eps).matmul(m.lm_head.weight.val())
}

#[test]
fn gradients_through_the_fused_reference_bodies_equal_the_plain_composition() {
    let m = load::<Ad>(&TINY, false, 21).model;
    let (b, s) = (2, 9);
    let w = lcg(b * (s + 1), TINY.vocab, 4);
    let w: Vec<i64> = w.iter().map(|&t| t as i64).collect();
    let windows = Tensor::<Ad, 2, Int>::from_data(
        TensorData::new(w.clone(), [b, s + 1]),
        &Default::default(),
    );
    let fused = next_token_loss(&m, windows);

    let inputs: Vec<i64> = (0..b)
        .flat_map(|r| w[r * (s + 1)..r * (s + 1) + s].to_vec())
        .collect();
    let targets: Vec<i64> = (0..b)
        .flat_map(|r| w[r * (s + 1) + 1..(r + 1) * (s + 1)].to_vec())
        .collect();
    let logits = plain_logits(&m, &inputs, b, s);
    let t =
        Tensor::<Ad, 2, Int>::from_data(TensorData::new(targets, [b * s, 1]), &Default::default());
    let plain = burn::tensor::activation::log_softmax(logits, 1)
        .gather(1, t)
        .mean()
        .neg();

    let (lf, lp) = (train::scalar(fused.clone()), train::scalar(plain.clone()));
    assert!((lf - lp).abs() < 1e-5 * lp.abs(), "loss {lf} vs {lp}");
    let (gf, gp) = (fused.backward(), plain.backward());
    let mut params: Vec<(String, Param<Tensor<Ad, 2>>)> = vec![
        ("embed_tokens".into(), m.embed_tokens.clone()),
        ("lm_head".into(), m.lm_head.weight.clone()),
    ];
    let mut vectors: Vec<(String, Param<Tensor<Ad, 1>>)> = vec![("norm".into(), m.norm.clone())];
    for (l, layer) in m.layers.iter().enumerate() {
        params.push((format!("{l}.qkv"), layer.attn.qkv_proj.weight.clone()));
        params.push((format!("{l}.o"), layer.attn.o_proj.weight.clone()));
        params.push((
            format!("{l}.gate_up"),
            layer.mlp.gate_up_proj.weight.clone(),
        ));
        params.push((format!("{l}.down"), layer.mlp.down_proj.weight.clone()));
        vectors.push((format!("{l}.attn_norm"), layer.attn_norm.clone()));
        vectors.push((format!("{l}.mlp_norm"), layer.mlp_norm.clone()));
    }
    let check = |name: &str, a: Vec<f64>, p: Vec<f64>| {
        assert!(p.iter().any(|v| *v != 0.0), "{name}: no gradient");
        let err = relative_error(&a, &p);
        assert!(err < 1e-4, "{name}: relative error {err:e}");
    };
    for (name, p) in params {
        let (a, q) = (p.val().grad(&gf).unwrap(), p.val().grad(&gp).unwrap());
        check(&name, host(a), host(q));
    }
    for (name, p) in vectors {
        let (a, q) = (p.val().grad(&gf).unwrap(), p.val().grad(&gp).unwrap());
        check(&name, host(a.unsqueeze::<2>()), host(q.unsqueeze::<2>()));
    }
}

fn rtn() -> QuantizeConfig {
    QuantizeConfig {
        method: Method::Rtn,
        group: 32,
        scale_type: stoke_formats::int4::ScaleType::Bf16,
        include_lm_head: false,
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Case {
    /// RTN projections, tied head.
    Tied,
    /// RTN projections, untied dense head.
    DenseHead,
    /// GGUF Q4_1 groups as loaded (asymmetric, f16 scales), an RTN-packed head.
    Q4_1PackedHead,
}

/// A packed model of the PACKABLE shapes (vocabulary 320 where the head is packed), and the
/// same model with its projections replaced by the packed values (dequantized).
fn packed_model(dense: DenseDtype, case: Case) -> (PackedModel, Llama<Plain>) {
    let shapes = Tiny {
        vocab: if case == Case::Q4_1PackedHead {
            320
        } else {
            PACKABLE.vocab
        },
        ..PACKABLE
    };
    let l = load::<Plain>(&shapes, case == Case::Tied, 31);
    let packed = match case {
        Case::Tied | Case::DenseHead => quantize_packed(&l.model, &rtn(), None).unwrap().0,
        Case::Q4_1PackedHead => {
            let path = tmp("q41.gguf");
            std::fs::write(&path, gguf_q4_1(&shapes, &weights(&shapes, false, 31))).unwrap();
            let p = load_gguf_packed::<Packed>(&path, &Default::default(), DType::F32, 64)
                .unwrap()
                .model;
            let _ = std::fs::remove_file(&path);
            let get = |lin: &burn::nn::Linear<Packed>| {
                let TensorPrimitive::Float(t) = lin.weight.val().into_primitive() else {
                    panic!("float weight")
                };
                (*t.downcast_ref::<stoke::packed::PackedWeight<Plain>>()
                    .expect("packed")
                    .packed)
                    .clone()
            };
            let layers = p
                .layers
                .iter()
                .map(|b| {
                    [
                        get(&b.attn.qkv_proj),
                        get(&b.attn.o_proj),
                        get(&b.mlp.gate_up_proj),
                        get(&b.mlp.down_proj),
                    ]
                })
                .collect();
            let with_head = QuantizeConfig {
                include_lm_head: true,
                ..rtn()
            };
            let lm_head = quantize_packed(&l.model, &with_head, None)
                .unwrap()
                .0
                .lm_head;
            PackedProjections { layers, lm_head }
        }
    };
    let m = PackedModel::from_model(
        &l.model,
        &l.config,
        &l.tokenizer,
        packed.clone(),
        serde_json::json!({"method": "test"}),
        dense,
        case == Case::Tied,
    )
    .unwrap();
    (m, apply_packed(l.model, &packed))
}

#[test]
fn the_packed_file_round_trips_bit_for_bit() {
    for (dense, case) in [
        (DenseDtype::Bf16, Case::Tied),
        (DenseDtype::F32, Case::DenseHead),
        (DenseDtype::F16, Case::Q4_1PackedHead),
    ] {
        let (m, _) = packed_model(dense, case);
        match case {
            Case::Tied => assert_eq!(m.head, Head::Tied),
            Case::DenseHead => assert!(matches!(m.head, Head::Dense(_))),
            Case::Q4_1PackedHead => {
                assert!(matches!(m.head, Head::Packed(_)));
                assert!(m.layers[0].projections[0].offsets.is_some());
            }
        }
        let path = tmp(&format!("rt-{case:?}.safetensors"));
        m.write(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let back = PackedModel::read(&path).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.to_bytes().unwrap(), bytes);
        // Loaded and packed again from the loaded model's own weights: the same file.
        let loaded =
            packed_file::load::<Packed>(&path, &Default::default(), DType::F32, 64).unwrap();
        let again = PackedModel::from_model(
            &loaded.model,
            &loaded.config,
            &loaded.tokenizer,
            back.projections(),
            back.quantization.clone(),
            dense,
            back.head == Head::Tied,
        )
        .unwrap();
        assert_eq!(again.to_bytes().unwrap(), bytes);
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
fn the_served_packed_file_gives_the_dequantized_models_logits() {
    let (m, simulated) = packed_model(DenseDtype::F32, Case::DenseHead);
    let path = tmp("serve.safetensors");
    m.write(&path).unwrap();
    let ids = [5u32, 17, 200, 3, 99, 42, 7, 7, 150];
    let want = logits(&simulated, &ids);
    let served = packed_file::load::<Packed>(&path, &Default::default(), DType::F32, 64).unwrap();
    let TensorPrimitive::Float(w) = served.model.layers[1]
        .mlp
        .gate_up_proj
        .weight
        .val()
        .into_primitive()
    else {
        panic!("float weight")
    };
    assert!(
        w.downcast_ref::<stoke::packed::PackedWeight<Plain>>()
            .is_some(),
        "kept packed"
    );
    let err = relative_error(&logits(&served.model, &ids), &want);
    assert!(err < 1e-5, "served: relative error {err:e}");
    // The main loader reads the same file, dequantized.
    let plain =
        stoke_llama::load::load::<Plain>(&path, &Default::default(), DType::F32, 64).unwrap();
    let err = relative_error(&logits(&plain.model, &ids), &want);
    assert!(err < 1e-6, "dequantized: relative error {err:e}");
    assert_eq!(
        plain
            .tokenizer
            .encode("abc", false)
            .unwrap()
            .get_ids()
            .len(),
        3
    );
    let _ = std::fs::remove_file(&path);
}

/// A tensor as (name, dtype, shape, bytes).
type Part = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// The file's tensors and its header, to write altered copies.
fn parts(bytes: &[u8]) -> (Vec<Part>, String) {
    let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let header = meta.metadata().as_ref().unwrap()["stoke"].clone();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    (tensors, header)
}

fn assemble(tensors: &[Part], header: Option<&str>) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let meta =
        header.map(|h| std::collections::HashMap::from([("stoke".to_string(), h.to_string())]));
    safetensors::serialize(views, meta).unwrap()
}

#[test]
fn truncated_or_mismatched_files_get_typed_errors() {
    let (m, _) = packed_model(DenseDtype::Bf16, Case::Tied);
    let bytes = m.to_bytes().unwrap();
    let read = |name: &str, b: &[u8]| {
        let path = tmp(name);
        std::fs::write(&path, b).unwrap();
        let r = PackedModel::read(&path);
        let _ = std::fs::remove_file(&path);
        let e = r.expect_err("a bad file");
        assert!(e.to_string().contains(name), "{e} names the file");
        e
    };
    for cut in [4, 100, bytes.len() - 1] {
        let e = read("cut.safetensors", &bytes[..cut]);
        assert!(matches!(e, PackedFileError::Safetensors { .. }), "{e}");
    }
    let (tensors, header) = parts(&bytes);
    let e = read("plain.safetensors", &assemble(&tensors, None));
    assert!(matches!(e, PackedFileError::NotPacked { .. }), "{e}");
    let e = read(
        "v2.safetensors",
        &assemble(
            &tensors,
            Some(&header.replace("\"version\":1", "\"version\":2")),
        ),
    );
    assert!(
        matches!(e, PackedFileError::Version { version: 2, .. }),
        "{e}"
    );
    let e = read("json.safetensors", &assemble(&tensors, Some("{not json")));
    assert!(matches!(e, PackedFileError::Header { .. }), "{e}");
    // A configuration that does not match the tensors.
    let inter = format!("\"intermediate_size\":{}", PACKABLE.inter);
    assert!(header.contains(&inter));
    let e = read(
        "inter.safetensors",
        &assemble(
            &tensors,
            Some(&header.replace(&inter, "\"intermediate_size\":256")),
        ),
    );
    match e {
        PackedFileError::Shape {
            tensor,
            expected,
            actual,
            ..
        } => {
            assert_eq!(tensor, "layers.0.gate_up_proj.qweight");
            assert_eq!(expected, vec![PACKABLE.hidden / 16, 512 / 64, 32, 4]);
            assert_eq!(
                actual,
                vec![PACKABLE.hidden / 16, 2 * PACKABLE.inter / 64, 32, 4]
            );
        }
        other => panic!("{other}"),
    }
    // A tensor missing, one too many, one of the wrong dtype.
    let without: Vec<_> = tensors
        .iter()
        .filter(|t| t.0 != "layers.1.down_proj.scales")
        .cloned()
        .collect();
    let e = read("missing.safetensors", &assemble(&without, Some(&header)));
    assert!(
        matches!(&e, PackedFileError::MissingTensor { tensor, .. } if tensor == "layers.1.down_proj.scales"),
        "{e}"
    );
    let mut extra = tensors.clone();
    extra.push((
        "layers.9.extra".into(),
        safetensors::Dtype::F32,
        vec![1],
        vec![0; 4],
    ));
    let e = read("extra.safetensors", &assemble(&extra, Some(&header)));
    assert!(
        matches!(&e, PackedFileError::UnexpectedTensor { tensor, .. } if tensor == "layers.9.extra"),
        "{e}"
    );
    let mut wrong = tensors.clone();
    let norm = wrong
        .iter_mut()
        .find(|t| t.0 == "layers.0.attn_norm")
        .unwrap();
    norm.1 = safetensors::Dtype::I16;
    let e = read("dtype.safetensors", &assemble(&wrong, Some(&header)));
    assert!(
        matches!(&e, PackedFileError::Dtype { tensor, .. } if tensor == "layers.0.attn_norm"),
        "{e}"
    );
    // Scales whose rows do not divide k into groups of a multiple of 16.
    let mut odd = tensors.clone();
    let sc = odd
        .iter_mut()
        .find(|t| t.0 == "layers.0.o_proj.scales")
        .unwrap();
    let n = sc.2[1];
    sc.2 = vec![32, n]; // groups of 4 rows
    sc.3 = vec![0; sc.2[0] * n * 2];
    let e = read("group.safetensors", &assemble(&odd, Some(&header)));
    assert!(
        matches!(&e, PackedFileError::Int4 { tensor, .. } if tensor == "layers.0.o_proj.scales"),
        "{e}"
    );
    // The main loader passes the typed error on.
    let path = tmp("cut2.safetensors");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let e = stoke_llama::load::load::<Plain>(&path, &Default::default(), DType::F32, 64)
        .err()
        .unwrap();
    assert!(
        matches!(e, LoadError::Packed(PackedFileError::Safetensors { .. })),
        "{e}"
    );
    let _ = std::fs::remove_file(&path);
}
