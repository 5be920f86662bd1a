//! Weight quantization of a loaded model, simulated: every projection (not the output head)
//! is quantized to group-wise INT4 with the packer of `stoke_formats::int4` and replaced by its
//! dequantized values. This is the reference the INT4 kernels are compared with, and the way to
//! measure a quantizer's effect on quality on any backend.

use crate::model::Llama;
use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use stoke_formats::int4::{Int4Error, ScaleType, quantize_rtn};

/// Quantizes one Linear's weight (`[in, out]`) with round-to-nearest, groups of `group` inputs,
/// scales stored as `scale_type`.
pub fn rtn_linear<B: Backend>(
    lin: Linear<B>,
    group: usize,
    scale_type: ScaleType,
) -> Result<Linear<B>, Int4Error> {
    let w = lin.weight.val();
    let [k, n] = w.dims();
    let (device, dtype) = (w.device(), w.dtype());
    let values = w
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 weights");
    let packed = quantize_rtn(&values, k, n, group, scale_type)?;
    let dq = Tensor::<B, 2>::from_data(TensorData::new(packed.dequantize(), [k, n]), &device)
        .cast(dtype);
    Ok(Linear {
        weight: Param::from_tensor(dq),
        bias: lin.bias,
    })
}

/// Every attention and MLP projection of `model`, RTN-quantized (the output head stays).
pub fn simulate_rtn<B: Backend>(
    mut model: Llama<B>,
    group: usize,
    scale_type: ScaleType,
) -> Result<Llama<B>, Int4Error> {
    for layer in &mut model.layers {
        let a = &mut layer.attn;
        for lin in [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj] {
            *lin = rtn_linear(lin.clone(), group, scale_type)?;
        }
        let m = &mut layer.mlp;
        for lin in [&mut m.gate_proj, &mut m.up_proj, &mut m.down_proj] {
            *lin = rtn_linear(lin.clone(), group, scale_type)?;
        }
    }
    Ok(model)
}
