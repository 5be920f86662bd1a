//! Perplexity over fixed windows of a text (the protocol Stoke's quality numbers use): tokenize
//! without BOS, take the first `windows` non-overlapping windows of `window` tokens, run a full
//! causal forward per window, and report `exp(mean NLL)` over every predicted token.

use crate::model::{CacheQuant, KvCache, Llama};
use crate::quant::Fp8Sim;
use burn::tensor::{DType, Int, Tensor, TensorData};
use stoke::FusedOps;
use tokenizers::Tokenizer;

#[derive(Clone, Debug)]
pub struct Perplexity {
    pub perplexity: f64,
    pub mean_nll: f64,
    pub predicted_tokens: usize,
    pub windows: usize,
}

/// Perplexity of `model` on `text` (with the KV cache stored in `cache_quant`'s format, and the
/// projections' inputs rounded as `fp8` says, when given); `Err` if the text has fewer than
/// `windows * window` tokens.
#[allow(clippy::too_many_arguments)]
pub fn perplexity<B: FusedOps>(
    model: &Llama<B>,
    tokenizer: &Tokenizer,
    text: &str,
    window: usize,
    windows: usize,
    dtype: DType,
    cache_quant: Option<CacheQuant>,
    fp8: Option<Fp8Sim>,
    device: &B::Device,
) -> Result<Perplexity, String> {
    let ids = tokenizer
        .encode(text, false)
        .map_err(|e| e.to_string())?
        .get_ids()
        .to_vec();
    if ids.len() < window * windows {
        return Err(format!(
            "text has {} tokens, {} windows of {window} need {}",
            ids.len(),
            windows,
            window * windows
        ));
    }
    let mut nll = 0.0f64;
    let mut count = 0usize;
    for w in 0..windows {
        let chunk = &ids[w * window..(w + 1) * window];
        let mut cache = KvCache::for_model(model, 1, window, dtype, device);
        cache.quantize = cache_quant;
        let tokens = Tensor::<B, 2, Int>::from_data(
            TensorData::new(
                chunk.iter().map(|&t| t as i64).collect::<Vec<_>>(),
                [1, window],
            ),
            device,
        );
        let logits = match fp8 {
            Some(sim) => {
                model.forward_with_inputs(tokens, &[window], &mut cache, false, &mut |_, _, x| {
                    sim.apply_to_input(x)
                })
            }
            None => model.forward(tokens, &[window], &mut cache, false),
        };
        let host = logits
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .map_err(|e| format!("{e:?}"))?;
        let vocab = host.len() / window;
        for (p, &next) in chunk.iter().enumerate().skip(1) {
            let row = &host[(p - 1) * vocab..p * vocab];
            let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&v| (v as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            nll += lse - row[next as usize] as f64;
            count += 1;
        }
    }
    let mean_nll = nll / count as f64;
    Ok(Perplexity {
        perplexity: mean_nll.exp(),
        mean_nll,
        predicted_tokens: count,
        windows,
    })
}
