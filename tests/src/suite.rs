//! A suite of ordinary Burn ops that exercises every kind of primitive (float, int, bool) and
//! the op traits the decorator forwards. Run on `Stoke<X>` and on `X`, the results must be
//! identical: Stoke forwards to the same kernels.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData, activation, module};

/// Inputs: `a` `[8, 16]`, `b` `[16, 12]`, both f32. `bf16`: also cast through bf16 (not every
/// backend has it: NdArray does not).
pub fn run<B: Backend>(
    a: TensorData,
    b: TensorData,
    bf16: bool,
    device: &B::Device,
) -> Vec<(&'static str, TensorData)> {
    let a = Tensor::<B, 2>::from_data(a, device);
    let b = Tensor::<B, 2>::from_data(b, device);
    let mut out = Vec::new();
    let mut push = |name, d: TensorData| out.push((name, d));

    // Float tensor ops.
    let mm = a.clone().matmul(b.clone());
    push("matmul", mm.to_data());
    push(
        "add_mul_div",
        ((a.clone() + 1.5) * a.clone() / (a.clone().abs() + 2.0)).to_data(),
    );
    push(
        "exp_log_tanh",
        (a.clone().exp() + a.clone().abs().add_scalar(1.0).log() + a.clone().tanh()).to_data(),
    );
    push(
        "powf_sqrt",
        a.clone().abs().powf_scalar(1.7).sqrt().to_data(),
    );
    push(
        "sum_mean_max",
        Tensor::cat(
            vec![
                a.clone().sum_dim(1),
                a.clone().mean_dim(1),
                a.clone().max_dim(1),
            ],
            1,
        )
        .to_data(),
    );
    push(
        "transpose_reshape",
        a.clone().transpose().reshape([4, 32]).to_data(),
    );
    push(
        "slice_cat",
        Tensor::cat(
            vec![
                a.clone().slice([0..4, 2..10]),
                a.clone().slice([4..8, 0..8]),
            ],
            0,
        )
        .to_data(),
    );
    if bf16 {
        push(
            "cast_bf16",
            a.clone()
                .cast(burn::tensor::DType::BF16)
                .cast(burn::tensor::DType::F32)
                .to_data(),
        );
    }
    push("cumsum_sort", a.clone().cumsum(1).sort(1).to_data());
    // Activations.
    push("softmax", activation::softmax(mm.clone(), 1).to_data());
    push(
        "relu_gelu_silu",
        (activation::relu(a.clone()) + activation::gelu(a.clone()) + activation::silu(a.clone()))
            .to_data(),
    );
    // Int ops.
    let idx: Tensor<B, 2, Int> = mm.clone().argmax(1);
    push("argmax", idx.clone().to_data());
    push("int_arith", (idx.clone() * 3 + 1).sum().to_data());
    push("gather", mm.clone().gather(1, idx.clone()).to_data());
    // Bool ops.
    let mask = a.clone().greater_elem(0.0);
    push(
        "mask_fill",
        a.clone().mask_fill(mask.clone(), -1.0).to_data(),
    );
    push(
        "bool_any_not",
        Tensor::cat(
            vec![mask.clone().any_dim(1).int(), mask.bool_not().int()],
            1,
        )
        .to_data(),
    );
    // Module ops: linear (Stoke intercepts it and forwards plain weights) and attention.
    let w = b.clone().slice([0..16, 0..8]);
    push("linear", module::linear(a.clone(), w, None).to_data());
    let q = a.clone().reshape([1, 2, 8, 8]);
    let k = a.clone().flip([0]).reshape([1, 2, 8, 8]);
    let v = a.clone().sin().reshape([1, 2, 8, 8]);
    push(
        "attention",
        module::attention(q, k, v, None, None, Default::default()).to_data(),
    );
    out
}

/// Random `[rows, cols]` f32 data in [-1, 1).
pub fn random(rng: &mut impl rand::Rng, rows: usize, cols: usize) -> TensorData {
    let v: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    TensorData::new(v, [rows, cols])
}
