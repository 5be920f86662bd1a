//! GGUF Q4_1 projections loaded straight into Stoke's packed INT4 format (no re-quantization)
//! hold exactly the weights of the same file dequantized at load, and give its logits (the CPU
//! kernel sums the packed nibbles in another order: equal within f32 rounding).

use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};
use stoke_llama::load::{load_gguf, load_gguf_packed};
use stoke_llama::model::KvCache;
use stoke_llama::synthetic::{PACKABLE, Tiny, gguf_q4_1, weights};

type B = stoke::Stoke<burn_ndarray::NdArray<f32>>;

const SHAPES: Tiny = PACKABLE;

fn logits(m: &stoke_llama::model::Llama<B>) -> Vec<f32> {
    let mut cache = KvCache::for_model(m, 1, 32, DType::F32, &Default::default());
    let t = Tensor::<B, 2, Int>::from_data(
        TensorData::new(vec![7i64, 70, 170, 42, 3, 99], [1, 6]),
        &Default::default(),
    );
    m.forward(t, &[6], &mut cache, false)
        .into_data()
        .to_vec::<f32>()
        .unwrap()
}

#[test]
fn q4_1_loaded_packed_matches_q4_1_dequantized() {
    let w = weights(&SHAPES, true, 41);
    let path = std::env::temp_dir().join(format!("stoke-packed-{}.gguf", std::process::id()));
    std::fs::write(&path, gguf_q4_1(&SHAPES, &w)).unwrap();
    let dense = load_gguf::<B>(&path, &Default::default(), DType::F32, 32)
        .unwrap()
        .model;
    let packed = load_gguf_packed::<B>(&path, &Default::default(), DType::F32, 32)
        .unwrap()
        .model;
    for (lin, plain) in [
        (
            &packed.layers[0].attn.qkv_proj,
            &dense.layers[0].attn.qkv_proj,
        ),
        (&packed.layers[1].attn.o_proj, &dense.layers[1].attn.o_proj),
        (
            &packed.layers[1].mlp.gate_up_proj,
            &dense.layers[1].mlp.gate_up_proj,
        ),
        (
            &packed.layers[1].mlp.down_proj,
            &dense.layers[1].mlp.down_proj,
        ),
    ] {
        assert_eq!(
            lin.weight.val().into_data().to_vec::<f32>().unwrap(),
            plain.weight.val().into_data().to_vec::<f32>().unwrap(),
            "dequantized packed weight"
        );
        let TensorPrimitive::Float(p) = lin.weight.val().into_primitive() else {
            panic!("float weight")
        };
        assert!(
            p.downcast_ref::<stoke::packed::PackedWeight<burn_ndarray::NdArray<f32>>>()
                .is_some(),
            "weights stay packed"
        );
    }
    let (a, b) = (logits(&packed), logits(&dense));
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        diff <= 1e-5 * scale,
        "max |diff| {diff} against logits up to {scale}"
    );
}
