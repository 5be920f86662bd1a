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
    /// Whether the windows ran through the decoder's packed prefill (else `Llama::forward`).
    pub through_prefill: bool,
    /// Values a simulated delayed FP8 scale saturated ([`Fp8Sim::delayed_down`]).
    pub fp8_saturated: u64,
}

/// Perplexity of `model` on `text`; `Err` if the text has fewer than `windows * window` tokens.
/// Each window runs through the model's packed prefill into a decoder ([`Llama::prefill_logits`],
/// what serving runs) when the model's RoPE table holds `window + 1` positions, else through
/// [`Llama::forward`]; with the KV cache stored in `cache_quant`'s format or the projections'
/// inputs rounded as `fp8` says (simulations), through [`Llama::forward`].
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
    // Without a simulated format, through the prefill that serves (the decoder's packed
    // prefill: Stoke's attention and cache on `Stoke<Cuda>`), where the model's RoPE table
    // covers a window and the position after it.
    let mut decoder = match (cache_quant, fp8) {
        (None, None) => {
            let spec = model.decode_spec(1, window + 1, stoke::KvCacheFormat::Bf16, false);
            stoke::decoder::<B>(spec, dtype, device).ok()
        }
        _ => None,
    };
    let mut sim = fp8.map(|f| f.run(model.layers.len()));
    for w in 0..windows {
        let chunk = &ids[w * window..(w + 1) * window];
        let logits = if let Some(dec) = decoder.as_mut() {
            model
                .prefill_logits(chunk, dec, crate::model::PREFILL_CHUNK)
                .map_err(|e| e.to_string())?
        } else {
            let mut cache = KvCache::for_model(model, 1, window, dtype, device);
            cache.quantize = cache_quant;
            let tokens = Tensor::<B, 2, Int>::from_data(
                TensorData::new(
                    chunk.iter().map(|&t| t as i64).collect::<Vec<_>>(),
                    [1, window],
                ),
                device,
            );
            match sim.as_mut() {
                Some(sim) => model.forward_with_inputs(
                    tokens,
                    &[window],
                    &mut cache,
                    false,
                    &mut |l, site, x| sim.input(l, site, x),
                ),
                None => model.forward(tokens, &[window], &mut cache, false),
            }
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
        through_prefill: decoder.is_some(),
        fp8_saturated: sim.map_or(0, |s| s.saturated()),
    })
}
