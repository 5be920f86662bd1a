//! Random-weight Llama models written as GGUF files, for tests of the model and its loader on
//! any backend (no real checkpoint needed). Weights are kept in the Hugging Face layout, f64,
//! so tests can run a plain reference forward over them.

use rand::{Rng, SeedableRng, rngs::StdRng};
use stoke_formats::gguf::{GgmlType, Value, Writer};

/// Sizes of a synthetic Llama.
#[derive(Clone, Copy, Debug)]
pub struct Tiny {
    pub vocab: usize,
    pub hidden: usize,
    pub inter: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub theta: f64,
    pub eps: f64,
}

/// The default tiny model: GQA (4 query heads on 2 key/value heads), 2 layers.
pub const TINY: Tiny = Tiny {
    vocab: 300,
    hidden: 32,
    inter: 48,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    head_dim: 8,
    theta: 10000.0,
    eps: 1e-5,
};

/// The smallest shapes Stoke's packed INT4 layout takes (k % 16, n % 64), with GQA.
pub const PACKABLE: Tiny = Tiny {
    vocab: 300,
    hidden: 128,
    inter: 192,
    layers: 2,
    heads: 4,
    kv_heads: 2,
    head_dim: 32,
    theta: 10000.0,
    eps: 1e-5,
};

/// Weights in the Hugging Face layout (`[out, in]` row-major), f64.
#[derive(Clone)]
pub struct Weights {
    pub embed: Vec<f64>,
    pub head: Option<Vec<f64>>,
    pub norm: Vec<f64>,
    pub layers: Vec<[Vec<f64>; 9]>, // attn_norm, q, k, v, o, ffn_norm, gate, up, down
}

fn random(rng: &mut StdRng, n: usize, scale: f64) -> Vec<f64> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// Random weights; `tied` leaves out the output projection.
pub fn weights(t: &Tiny, tied: bool, seed: u64) -> Weights {
    let mut rng = StdRng::seed_from_u64(seed);
    let (h, d) = (t.hidden, t.head_dim);
    let layers = (0..t.layers)
        .map(|_| {
            [
                (0..h).map(|_| rng.random_range(0.5..1.5)).collect(),
                random(&mut rng, t.heads * d * h, 0.3),
                random(&mut rng, t.kv_heads * d * h, 0.3),
                random(&mut rng, t.kv_heads * d * h, 0.3),
                random(&mut rng, h * t.heads * d, 0.3),
                (0..h).map(|_| rng.random_range(0.5..1.5)).collect(),
                random(&mut rng, t.inter * h, 0.3),
                random(&mut rng, t.inter * h, 0.3),
                random(&mut rng, h * t.inter, 0.3),
            ]
        })
        .collect();
    Weights {
        embed: random(&mut rng, t.vocab * h, 1.0),
        head: (!tied).then(|| random(&mut rng, t.vocab * h, 0.3)),
        norm: (0..h).map(|_| rng.random_range(0.5..1.5)).collect(),
        layers,
    }
}

/// llama.cpp's permutation of q/k rows (the inverse of what the loader undoes).
pub fn permute(w: &[f64], rows: usize, cols: usize, n_head: usize) -> Vec<f64> {
    let half = rows / n_head / 2;
    let mut out = vec![0.0; w.len()];
    for hh in 0..n_head {
        for j in 0..2 {
            for i in 0..half {
                let hf = (hh * 2 + j) * half + i; // HF row (h, j, i)
                let gg = (hh * half + i) * 2 + j; // GGUF row (h, i, j)
                out[gg * cols..(gg + 1) * cols].copy_from_slice(&w[hf * cols..(hf + 1) * cols]);
            }
        }
    }
    out
}

/// GPT-2's byte-to-unicode table: the 256 single-byte tokens of a byte-level BPE vocabulary.
pub fn byte_tokens() -> Vec<String> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut table = vec![String::new(); 256];
    for (b, c) in bs.iter().zip(cs) {
        table[*b as usize] = char::from_u32(c).unwrap().to_string();
    }
    table
}

fn f32_bytes(v: &[f64]) -> Vec<u8> {
    v.iter().flat_map(|x| (*x as f32).to_le_bytes()).collect()
}

/// The model as GGUF bytes (F32 tensors, q/k rows in llama.cpp's order, a byte-level tokenizer).
pub fn gguf(t: &Tiny, w: &Weights) -> Vec<u8> {
    gguf_with(t, w, |m, _cols| (GgmlType::F32, f32_bytes(m)))
}

/// [`gguf`] with every projection stored as Q4_1 blocks.
pub fn gguf_q4_1(t: &Tiny, w: &Weights) -> Vec<u8> {
    gguf_with(t, w, |m, cols| (GgmlType::Q4_1, q4_1_bytes(m, cols)))
}

/// [`gguf_writer`] plus the projections, each `[rows, cols]` matrix stored as `encode` gives.
fn gguf_with(
    t: &Tiny,
    w: &Weights,
    encode: impl Fn(&[f64], usize) -> (GgmlType, Vec<u8>),
) -> Vec<u8> {
    let (h, d) = (t.hidden, t.head_dim);
    let (qh, kvh, inter) = (t.heads * d, t.kv_heads * d, t.inter);
    let mut g = gguf_writer(t, w);
    for (l, lw) in w.layers.iter().enumerate() {
        // (name, weight [out, in], out, in); q and k rows in llama.cpp's order.
        let projections = [
            ("attn_q", permute(&lw[1], qh, h, t.heads), qh, h),
            ("attn_k", permute(&lw[2], kvh, h, t.kv_heads), kvh, h),
            ("attn_v", lw[3].clone(), kvh, h),
            ("attn_output", lw[4].clone(), h, qh),
            ("ffn_gate", lw[6].clone(), inter, h),
            ("ffn_up", lw[7].clone(), inter, h),
            ("ffn_down", lw[8].clone(), h, inter),
        ];
        for (name, m, out, inp) in projections {
            let (ty, bytes) = encode(&m, inp);
            g = g.tensor(
                &format!("blk.{l}.{name}.weight"),
                &[inp as u64, out as u64],
                ty,
                bytes,
            );
        }
    }
    g.to_bytes()
}

/// The metadata, tokenizer, embedding, norms and head of [`gguf`] (no projections).
fn gguf_writer(t: &Tiny, w: &Weights) -> Writer {
    let h = t.hidden as u64;
    let mut tokens = byte_tokens();
    while tokens.len() < t.vocab {
        tokens.push(format!("<extra_{}>", tokens.len()));
    }
    let mut g = Writer::default()
        .meta("general.architecture", Value::String("llama".into()))
        .meta("llama.embedding_length", Value::U32(t.hidden as u32))
        .meta("llama.feed_forward_length", Value::U32(t.inter as u32))
        .meta("llama.block_count", Value::U32(t.layers as u32))
        .meta("llama.attention.head_count", Value::U32(t.heads as u32))
        .meta(
            "llama.attention.head_count_kv",
            Value::U32(t.kv_heads as u32),
        )
        .meta("llama.rope.dimension_count", Value::U32(t.head_dim as u32))
        .meta("llama.rope.freq_base", Value::F32(t.theta as f32))
        .meta(
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(t.eps as f32),
        )
        .meta("llama.context_length", Value::U32(4096))
        .meta("tokenizer.ggml.model", Value::String("gpt2".into()))
        .meta("tokenizer.ggml.pre", Value::String("default".into()))
        .meta(
            "tokenizer.ggml.tokens",
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        )
        .meta("tokenizer.ggml.merges", Value::Array(vec![]))
        .meta("tokenizer.ggml.eos_token_id", Value::U32(299))
        .tensor(
            "token_embd.weight",
            &[h, t.vocab as u64],
            GgmlType::F32,
            f32_bytes(&w.embed),
        )
        .tensor(
            "output_norm.weight",
            &[h],
            GgmlType::F32,
            f32_bytes(&w.norm),
        );
    if let Some(head) = &w.head {
        g = g.tensor(
            "output.weight",
            &[h, t.vocab as u64],
            GgmlType::F32,
            f32_bytes(head),
        );
    }
    for (l, lw) in w.layers.iter().enumerate() {
        g = g
            .tensor(
                &format!("blk.{l}.attn_norm.weight"),
                &[h],
                GgmlType::F32,
                f32_bytes(&lw[0]),
            )
            .tensor(
                &format!("blk.{l}.ffn_norm.weight"),
                &[h],
                GgmlType::F32,
                f32_bytes(&lw[5]),
            );
    }
    g
}

/// Writes the model as a Hugging Face directory: `config.json`, `tokenizer.json` (the byte-level
/// tokenizer of [`gguf`]), `generation_config.json`, and the weights in F32 safetensors, split
/// over `shards` files with a `model.safetensors.index.json` when `shards > 1`.
pub fn write_hf_dir(
    t: &Tiny,
    w: &Weights,
    dir: &std::path::Path,
    shards: usize,
) -> std::io::Result<()> {
    write_hf_dir_as(t, w, dir, shards, None).map(|_| ())
}

/// [`write_hf_dir`] with the projections (q, k, v, o, gate, up, down) as an FP8 checkpoint
/// holds them: E4M3 codes with one scale per tensor or per output channel (`weight_scale`,
/// `[]` / `[out, 1]`) or per block (`weight_scale_inv`, with `quantization_config.
/// weight_block_size` in `config.json`), each scale the amax of what it covers over 448.
/// Returns the weights as the files hold them (the projections' dequantized values).
pub fn write_hf_dir_fp8(
    t: &Tiny,
    w: &Weights,
    dir: &std::path::Path,
    shards: usize,
    scales: crate::load::Fp8Scales,
) -> std::io::Result<Weights> {
    write_hf_dir_as(t, w, dir, shards, Some(scales))
}

/// E4M3 codes of a weight `[out, inp]` and its scales in the `layout` (row-major over the
/// blocks), each the amax of what it covers over 448.
fn fp8_codes(
    w: &[f64],
    [out, inp]: [usize; 2],
    layout: crate::load::Fp8Scales,
) -> (Vec<u8>, Vec<f64>) {
    use crate::load::Fp8Scales;
    let [bo, bi] = match layout {
        Fp8Scales::Tensor => [out, inp],
        Fp8Scales::Channel => [1, inp],
        Fp8Scales::Block(b) => b,
    };
    let cols = inp.div_ceil(bi);
    let mut amax = vec![0f64; out.div_ceil(bo) * cols];
    for r in 0..out {
        for c in 0..inp {
            let a = &mut amax[(r / bo) * cols + c / bi];
            *a = a.max(w[r * inp + c].abs());
        }
    }
    let scales: Vec<f64> = amax
        .iter()
        .map(|&a| f64::from(stoke_formats::fp8::scale_for(a as f32)))
        .collect();
    let codes = (0..out * inp)
        .map(|x| {
            let s = scales[(x / inp / bo) * cols + (x % inp) / bi];
            stoke_formats::fp8::f32_to_e4m3((w[x] / s) as f32)
        })
        .collect();
    (codes, scales)
}

/// The directory of [`write_hf_dir`], the projections in FP8 with `fp8`; returns the weights as
/// the files hold them.
fn write_hf_dir_as(
    t: &Tiny,
    w: &Weights,
    dir: &std::path::Path,
    shards: usize,
    fp8: Option<crate::load::Fp8Scales>,
) -> std::io::Result<Weights> {
    use safetensors::tensor::{Dtype, TensorView};
    std::fs::create_dir_all(dir)?;
    let mut config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": t.vocab, "hidden_size": t.hidden, "intermediate_size": t.inter,
        "num_hidden_layers": t.layers, "num_attention_heads": t.heads, "num_key_value_heads": t.kv_heads,
        "head_dim": t.head_dim, "rope_theta": t.theta, "rms_norm_eps": t.eps,
        "max_position_embeddings": 4096, "tie_word_embeddings": w.head.is_none(),
        "bos_token_id": 298, "eos_token_id": 299,
    });
    if let Some(crate::load::Fp8Scales::Block(b)) = fp8 {
        config["quantization_config"] =
            serde_json::json!({ "quant_method": "fp8", "weight_block_size": b });
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"eos_token_id": [299, 298]}"#,
    )?;
    let bytes = gguf(t, w);
    let g = stoke_formats::gguf::Gguf::parse("synthetic.gguf", &bytes).expect("own GGUF parses");
    let tok = crate::tokenizer::from_gguf(&g).expect("own tokenizer builds");
    tok.save(dir.join("tokenizer.json"), false)
        .map_err(|e| std::io::Error::other(e.to_string()))?;

    let (h, d) = (t.hidden, t.head_dim);
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = vec![
        (
            "model.embed_tokens.weight".into(),
            Dtype::F32,
            vec![t.vocab, h],
            f32_bytes(&w.embed),
        ),
        (
            "model.norm.weight".into(),
            Dtype::F32,
            vec![h],
            f32_bytes(&w.norm),
        ),
    ];
    if let Some(head) = &w.head {
        tensors.push((
            "lm_head.weight".into(),
            Dtype::F32,
            vec![t.vocab, h],
            f32_bytes(head),
        ));
    }
    let mut held = w.clone();
    for (l, lw) in w.layers.iter().enumerate() {
        let p = |s: &str| format!("model.layers.{l}.{s}.weight");
        let (q, kv) = (t.heads * d, t.kv_heads * d);
        let norm = |name: &str, v: &[f64]| (p(name), Dtype::F32, vec![h], f32_bytes(v));
        tensors.push(norm("input_layernorm", &lw[0]));
        tensors.push(norm("post_attention_layernorm", &lw[5]));
        for (name, j, out, inp) in [
            ("self_attn.q_proj", 1, q, h),
            ("self_attn.k_proj", 2, kv, h),
            ("self_attn.v_proj", 3, kv, h),
            ("self_attn.o_proj", 4, h, q),
            ("mlp.gate_proj", 6, t.inter, h),
            ("mlp.up_proj", 7, t.inter, h),
            ("mlp.down_proj", 8, h, t.inter),
        ] {
            let Some(layout) = fp8 else {
                tensors.push((p(name), Dtype::F32, vec![out, inp], f32_bytes(&lw[j])));
                continue;
            };
            let (codes, scales) = fp8_codes(&lw[j], [out, inp], layout);
            let s32: Vec<f32> = scales.iter().map(|&x| x as f32).collect();
            held.layers[l][j] = layout
                .dequantize(&codes, [out, inp], &s32)
                .into_iter()
                .map(f64::from)
                .collect();
            let (suffix, shape) = match layout {
                crate::load::Fp8Scales::Tensor => ("_scale", vec![]),
                crate::load::Fp8Scales::Channel => ("_scale", vec![out, 1]),
                crate::load::Fp8Scales::Block([bo, bi]) => {
                    ("_scale_inv", vec![out.div_ceil(bo), inp.div_ceil(bi)])
                }
            };
            tensors.push((
                format!("{}{suffix}", p(name)),
                Dtype::F32,
                shape,
                f32_bytes(&scales),
            ));
            tensors.push((p(name), Dtype::F8_E4M3, vec![out, inp], codes));
        }
    }
    let shards = shards.max(1);
    let mut weight_map = serde_json::Map::new();
    for s in 0..shards {
        let file = if shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{shards:05}.safetensors", s + 1)
        };
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .enumerate()
            .filter(|(i, _)| i % shards == s)
            .map(|(_, (name, dtype, shape, data))| {
                weight_map.insert(name.clone(), serde_json::Value::String(file.clone()));
                (
                    name.clone(),
                    TensorView::new(*dtype, shape.clone(), data).expect("consistent view"),
                )
            })
            .collect();
        let bytes = safetensors::serialize(views, None)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        std::fs::write(dir.join(&file), bytes)?;
    }
    if shards > 1 {
        let index = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)?,
        )?;
    }
    Ok(held)
}

/// GGUF Q4_1 blocks of an `[rows, cols]` f64 matrix (`cols` a multiple of 32): per block of 32,
/// `d = (max - min) / 15`, `m = min`, `q = round((w - m) / d)`.
pub fn q4_1_bytes(w: &[f64], cols: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for block in w.chunks_exact(32) {
        let min = block.iter().cloned().fold(f64::INFINITY, f64::min);
        let max = block.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let d = half::f16::from_f64((max - min) / 15.0);
        let m = half::f16::from_f64(min);
        out.extend(d.to_le_bytes());
        out.extend(m.to_le_bytes());
        let (df, mf) = (d.to_f64(), m.to_f64());
        let q: Vec<u8> = block
            .iter()
            .map(|&v| {
                if df > 0.0 {
                    ((v - mf) / df).round().clamp(0.0, 15.0) as u8
                } else {
                    0
                }
            })
            .collect();
        out.extend((0..16).map(|j| q[j] | (q[j + 16] << 4)));
    }
    assert_eq!(w.len() % cols, 0);
    out
}

/// A Llama-3.1-shaped configuration (8 KV heads of 128, RoPE theta 500,000 with Llama-3
/// scaling, untied head) of the given sizes; [`llama_3_1_8b`] is the 8B one.
pub fn llama3_shape(
    layers: usize,
    hidden: usize,
    inter: usize,
    heads: usize,
    vocab: usize,
) -> crate::config::LlamaConfig {
    crate::config::LlamaConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: inter,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: 8,
        head_dim: 128,
        rope_theta: 500000.0,
        rope_scaling: Some(crate::config::Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
        rms_norm_eps: 1e-5,
        max_position_embeddings: 131072,
        tie_word_embeddings: false,
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

/// Llama-3.1-8B's shape: 32 layers, hidden 4096, MLP 14336, 32 heads, 128,256 tokens.
pub fn llama_3_1_8b() -> crate::config::LlamaConfig {
    llama3_shape(32, 4096, 14336, 32, 128256)
}

/// A Llama of `cfg`'s shapes with random packed INT4 projections (group `group`, bf16 scales,
/// random nibbles and small scales written straight into the packed layout, so an 8B or 70B
/// shape builds in seconds), a bf16 random embedding, an untied head (bf16, or packed INT4 with
/// `int4_head`), unit norms: for speed
/// measurements at real model sizes without a download (its outputs mean nothing). On backends
/// that keep no packed weights the projections are their dequantized values.
pub fn random_int4_model<B: stoke::FusedOps>(
    cfg: &crate::config::LlamaConfig,
    group: usize,
    int4_head: bool,
    max_positions: usize,
    seed: u64,
    device: &B::Device,
) -> crate::model::Llama<B> {
    use crate::model::{Attention, Block, Llama, Mlp, Rope};
    use burn::module::Param;
    use burn::nn::Linear;
    use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};
    use stoke_formats::int4::{PackedInt4, ScaleType};
    let state = std::cell::Cell::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let next = || {
        // xorshift64*: fast enough for billions of nibbles.
        let mut x = state.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        state.set(x);
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let packed = |k: usize, n: usize| -> Linear<B> {
        let words: Vec<u32> = (0..k * n / 8).map(|_| next() as u32).collect();
        let scales: Vec<u16> = (0..k / group * n)
            .map(|_| ScaleType::Bf16.from_f32(0.002 + (next() % 1000) as f32 * 2e-6))
            .collect();
        let p = PackedInt4 {
            k,
            n,
            group,
            scale_type: ScaleType::Bf16,
            scales,
            offsets: None,
            words,
        };
        let weight = match B::packed_int4_weight(p.clone(), DType::BF16, device) {
            Some(t) => Tensor::from_primitive(TensorPrimitive::Float(t)),
            None => Tensor::<B, 2>::from_data(TensorData::new(p.dequantize(), [k, n]), device)
                .cast(DType::BF16),
        };
        Linear {
            weight: Param::from_tensor(weight),
            bias: None,
        }
    };
    let (hid, h, kvh, d, inter) = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    );
    let ones = |n: usize| Param::from_tensor(Tensor::<B, 1>::ones([n], device).cast(DType::BF16));
    let layers = (0..cfg.num_hidden_layers)
        .map(|_| Block {
            attn_norm: ones(hid),
            attn: Attention {
                qkv_proj: packed(hid, (h + 2 * kvh) * d),
                o_proj: packed(h * d, hid),
                n_heads: h,
                n_kv_heads: kvh,
                head_dim: d,
            },
            mlp_norm: ones(hid),
            mlp: Mlp {
                gate_up_proj: packed(hid, 2 * inter),
                down_proj: packed(inter, hid),
            },
        })
        .collect();
    let dense = |rows: usize, cols: usize| -> Tensor<B, 2> {
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04)
            .collect();
        Tensor::<B, 2>::from_data(TensorData::new(v, [rows, cols]), device).cast(DType::BF16)
    };
    let embed = dense(cfg.vocab_size, hid);
    let lm_head = if int4_head {
        packed(hid, cfg.vocab_size)
    } else {
        Linear {
            weight: Param::from_tensor(dense(hid, cfg.vocab_size)),
            bias: None,
        }
    };
    Llama {
        embed_tokens: Param::from_tensor(embed),
        layers,
        norm: ones(hid),
        lm_head,
        rope: Rope::new(cfg, max_positions, device),
        rms_norm_eps: cfg.rms_norm_eps,
        plan: stoke::Plan::default(),
    }
}
