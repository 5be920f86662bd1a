//! Model quantization (`stoke_llama::quant`): RTN and GPTQ into packed INT4, calibration
//! through the model's projection inputs, and RMSNorm gain folding.

use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};
use stoke_formats::int4::ScaleType;
use stoke_formats::reference::relative_error;
use stoke_llama::load::load_gguf;
use stoke_llama::model::{KvCache, Llama};
use stoke_llama::quant::{
    Method, QuantError, QuantizeConfig, calibrate, fold_norm_gains, group_for, quantize,
};
use stoke_llama::synthetic::{PACKABLE, Tiny, gguf, weights};

type Plain = burn_ndarray::NdArray<f32>;
type Packed = stoke::Stoke<burn_ndarray::NdArray<f32>>;

const SHAPES: Tiny = PACKABLE;

fn model<B: stoke::FusedOps>(seed: u64) -> Llama<B> {
    let w = weights(&SHAPES, true, seed);
    let path = std::env::temp_dir().join(format!(
        "stoke-quant-{}-{seed}-{}.gguf",
        std::process::id(),
        std::any::type_name::<B>().len()
    ));
    std::fs::write(&path, gguf(&SHAPES, &w)).unwrap();
    let m = load_gguf::<B>(&path, &Default::default(), DType::F32, 64)
        .unwrap()
        .model;
    let _ = std::fs::remove_file(&path);
    m
}

/// Token sequences that look like text to nobody but exercise every position.
fn sequences(count: usize, len: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut s = seed;
    (0..count)
        .map(|_| {
            (0..len)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((s >> 33) % SHAPES.vocab as u64) as u32
                })
                .collect()
        })
        .collect()
}

fn logits<B: stoke::FusedOps>(m: &Llama<B>, seqs: &[Vec<u32>]) -> Vec<f64> {
    let len = seqs[0].len();
    let ids: Vec<i64> = seqs.iter().flatten().map(|&t| t as i64).collect();
    let t = Tensor::<B, 2, Int>::from_data(
        TensorData::new(ids, [seqs.len(), len]),
        &Default::default(),
    );
    let mut cache = KvCache::for_model(m, seqs.len(), len, DType::F32, &Default::default());
    m.forward(t, &vec![len; seqs.len()], &mut cache, false)
        .into_data()
        .convert::<f64>()
        .to_vec::<f64>()
        .unwrap()
}

#[test]
fn group_sizes_fall_back_to_a_power_of_two_that_divides_k() {
    assert_eq!(group_for(4096, 128), 128);
    assert_eq!(group_for(576, 128), 64);
    assert_eq!(group_for(1536, 128), 128);
    assert_eq!(group_for(14336, 128), 128);
    assert_eq!(group_for(48, 128), 16);
    assert_eq!(group_for(576, 32), 32);
    assert_eq!(group_for(8, 128), 8); // no multiple of 16 divides it: one group per column
}

#[test]
fn folding_norm_gains_keeps_the_logits() {
    let m = model::<Plain>(11);
    let g = m.layers[0]
        .attn_norm
        .val()
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    assert!(
        g.iter().any(|v| (v - 1.0).abs() > 1e-3),
        "the test needs non-trivial gains"
    );
    let seqs = sequences(2, 12, 5);
    let want = logits(&m, &seqs);
    let folded = fold_norm_gains(m);
    for l in &folded.layers {
        for norm in [&l.attn_norm, &l.mlp_norm] {
            let v = norm.val().into_data().to_vec::<f32>().unwrap();
            assert!(v.iter().all(|x| *x == 1.0));
        }
    }
    let err = relative_error(&logits(&folded, &seqs), &want);
    assert!(err < 1e-5, "relative error {err:e}");
}

#[test]
fn rtn_on_stoke_keeps_weights_packed_with_the_simulated_values() {
    let cfg = QuantizeConfig {
        method: Method::Rtn,
        group: 32,
        scale_type: ScaleType::Bf16,
        include_lm_head: false,
    };
    let (packed, report) = quantize(model::<Packed>(3), &cfg, None).unwrap();
    let (simulated, _) = quantize(model::<Plain>(3), &cfg, None).unwrap();
    assert_eq!(report.projections, 4 * SHAPES.layers);
    assert_eq!(report.groups, vec![(128, 32), (192, 32)]);
    let TensorPrimitive::Float(p) = packed.layers[1].mlp.down_proj.weight.val().into_primitive()
    else {
        panic!("float weight")
    };
    assert!(
        p.downcast_ref::<stoke::packed::PackedWeight<Plain>>()
            .is_some()
    );
    let seqs = sequences(2, 10, 9);
    // The CPU kernel sums the packed nibbles in another order than the simulated matmul.
    let (a, b) = (logits(&packed, &seqs), logits(&simulated, &seqs));
    assert!(relative_error(&a, &b) < 1e-5);
}

#[test]
fn gptq_needs_a_calibration() {
    let cfg = QuantizeConfig {
        method: Method::Gptq {
            damp: 0.01,
            act_order: false,
        },
        ..Default::default()
    };
    assert!(matches!(
        quantize(model::<Plain>(3), &cfg, None),
        Err(QuantError::NoCalibration)
    ));
}

/// Calibrated on the text it is evaluated on, GPTQ's logits are closer to the full-precision
/// model's than RTN's at the same group size (GPTQ minimizes each layer's output error).
#[test]
fn gptq_is_closer_to_the_original_than_rtn() {
    let m = model::<Plain>(21);
    let seqs = sequences(8, 24, 77);
    let want = logits(&m, &seqs);
    let calib = calibrate(&m, &seqs, 4, DType::F32, &Default::default(), |_, _| {}).unwrap();
    assert_eq!(calib.tokens, 8 * 24);
    let cfg = |method| QuantizeConfig {
        method,
        group: 32,
        scale_type: ScaleType::F16,
        include_lm_head: false,
    };
    let (rtn, _) = quantize(m.clone(), &cfg(Method::Rtn), None).unwrap();
    let mut errs = Vec::new();
    for act_order in [false, true] {
        let (gptq, _) = quantize(
            m.clone(),
            &cfg(Method::Gptq {
                damp: 0.01,
                act_order,
            }),
            Some(&calib),
        )
        .unwrap();
        errs.push(relative_error(&logits(&gptq, &seqs), &want));
    }
    let rtn_err = relative_error(&logits(&rtn, &seqs), &want);
    assert!(
        errs.iter().all(|e| *e < 0.8 * rtn_err),
        "GPTQ errors {errs:?} vs RTN {rtn_err}"
    );
}

/// A quantized KV cache quantizes each row once, when it is written, so decoding token by token
/// gives the same logits as one forward over the whole sequence; FP8 stays closer to the exact
/// cache's logits than INT4.
#[test]
fn quantized_caches_are_written_once_per_row() {
    use stoke_llama::model::{CacheFormat, CacheQuant};
    let m = model::<Plain>(5);
    let seq = sequences(1, 9, 3).remove(0);
    let run = |q: Option<CacheQuant>, incremental: bool| -> Vec<f64> {
        let dev = Default::default();
        let mut cache = KvCache::for_model(&m, 1, 16, DType::F32, &dev);
        cache.quantize = q;
        let ids = |s: &[u32]| {
            Tensor::<Plain, 2, Int>::from_data(
                TensorData::new(
                    s.iter().map(|&t| t as i64).collect::<Vec<_>>(),
                    [1, s.len()],
                ),
                &dev,
            )
        };
        let last = if incremental {
            let mut out = None;
            for t in &seq {
                out = Some(m.forward(ids(&[*t]), &[1], &mut cache, true));
            }
            out.unwrap()
        } else {
            m.forward(ids(&seq), &[seq.len()], &mut cache, true)
        };
        last.into_data().convert::<f64>().to_vec::<f64>().unwrap()
    };
    let exact = run(None, false);
    let mut errs = Vec::new();
    for format in [CacheFormat::Fp8, CacheFormat::Int4] {
        for rotate_block in [None, Some(32)] {
            let q = Some(CacheQuant {
                format,
                rotate_block,
            });
            let full = run(q, false);
            let step = run(q, true);
            assert!(relative_error(&step, &full) < 1e-5, "{q:?}");
            errs.push(relative_error(&full, &exact));
        }
    }
    // (The tiny random model amplifies any perturbation: only the ordering is asserted.)
    assert!(errs.iter().all(|e| *e > 0.0 && *e < 1.0), "{errs:?}");
    assert!(
        errs[0] < errs[2] && errs[1] < errs[3],
        "FP8 closer than INT4: {errs:?}"
    );
}

/// RTN in Burn ops gives exactly the reference packer's weight, including halfway cases (a
/// weight on a grid of half-steps) and empty groups.
#[test]
fn rtn_in_burn_ops_equals_the_reference_packer() {
    use stoke_formats::int4::quantize_rtn;
    use stoke_llama::quant::rtn_burn;
    let (k, n) = (128, 64);
    let mut s = 99u64;
    let mut w: Vec<f32> = (0..k * n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
        })
        .collect();
    // Column 3: multiples of a quarter, so w / scale hits exact halves; column 5: all zeros.
    for r in 0..k {
        w[r * n + 3] = ((r % 29) as f32 - 14.0) * 0.25;
        w[r * n + 5] = 0.0;
    }
    for (group, st) in [
        (32, ScaleType::Bf16),
        (64, ScaleType::F16),
        (128, ScaleType::Bf16),
    ] {
        let want = quantize_rtn(&w, k, n, group, st).unwrap();
        let t =
            Tensor::<Plain, 2>::from_data(TensorData::new(w.clone(), [k, n]), &Default::default());
        let got = rtn_burn(t, group, st).unwrap();
        assert_eq!(got, want, "group {group} {st:?}");
    }
}

#[test]
fn the_head_alone_is_quantized_or_a_typed_error() {
    // PACKABLE's vocabulary (300) is not a multiple of 64: the packed layout refuses it.
    let e =
        stoke_llama::quant::quantize_lm_head(model::<Packed>(5), 64, ScaleType::Bf16).unwrap_err();
    assert!(
        matches!(
            e,
            QuantError::Int4 {
                proj: "lm_head",
                ..
            }
        ),
        "{e}"
    );
    let shapes = Tiny {
        vocab: 320,
        ..SHAPES
    };
    let path = std::env::temp_dir().join(format!("stoke-quant-head-{}.gguf", std::process::id()));
    std::fs::write(&path, gguf(&shapes, &weights(&shapes, true, 6))).unwrap();
    let m = load_gguf::<Packed>(&path, &Default::default(), DType::F32, 64)
        .unwrap()
        .model;
    let _ = std::fs::remove_file(&path);
    let q = stoke_llama::quant::quantize_lm_head(m, 64, ScaleType::Bf16).unwrap();
    let TensorPrimitive::Float(p) = q.lm_head.weight.val().into_primitive() else {
        panic!("float weight")
    };
    assert!(
        p.downcast_ref::<stoke::packed::PackedWeight<Plain>>()
            .is_some(),
        "the head stays packed"
    );
}
