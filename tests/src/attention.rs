//! Decode attention and the KV-cache append (`kernels/decode_attention.cu`) on the GPU:
//! correctness against the f64 reference of `stoke_formats::kv`, and speed against the same
//! run's copy rate.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::sync::Arc;
use stoke_cuda::kernels::decode_attention::KvFormat;
use stoke_cuda::kernels::prefill_attention::PrefillSeq;
use stoke_cuda::kernels::{DECODE_ATTENTION, PREFILL_ATTENTION};
use stoke_cuda::kv::DeviceKvCache;
use stoke_cuda::{DeviceBuffer, Runtime};
use stoke_formats::bf16;
use stoke_formats::kv::{self, Int4Order};
use stoke_formats::reference::relative_error;

use crate::int4::{get_bf16, put_u8, put_u16, put_u32};

pub(crate) fn get_bytes(buf: &DeviceBuffer) -> Vec<u8> {
    let mut bytes = vec![0u8; buf.bytes()];
    unsafe { buf.runtime().copy_dtoh(&mut bytes, buf.ptr()) }.unwrap();
    bytes
}

pub(crate) fn get_f32(buf: &DeviceBuffer) -> Vec<f32> {
    get_bytes(buf)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn bf16s(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            // Box-Muller: N(0, 1).
            let (u1, u2): (f32, f32) = (rng.random_range(f32::EPSILON..1.0), rng.random());
            let v = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
            bf16::round(v * scale)
        })
        .collect()
}

fn to_bf16(v: &[f32]) -> Vec<u16> {
    v.iter().map(|x| bf16::from_f32(*x)).collect()
}

/// One test cache: `batch` sequences in slots `batch - 1 - b` (slots out of order on purpose),
/// sequence `b` holding `lens[b]` tokens; K and V `[seq][pos][kv_head][d]` on the host.
struct Case {
    heads: usize,
    kv_heads: usize,
    d: usize,
    lens: Vec<usize>,
    /// Key channels per kv head scaled by `outlier` (0: none).
    outliers: usize,
    outlier: f32,
    /// Split-KV CTAs forced (`DeviceKvCache::attend_splits`); `None`: the plan's.
    splits: Option<u32>,
}

struct Filled {
    cache: DeviceKvCache,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    slot_of: Vec<u32>,
}

/// Pages of the KV pool in the paged kernels' tests and benchmarks (the engine's default).
pub const PAGE: u32 = 64;

/// A cache of `slots` slots of `cap` positions whose pages are the pool's in a random order, so
/// that every slot's positions lie on scattered pages (what a pool looks like after requests
/// came and went).
pub fn scattered_cache(
    rt: &Arc<Runtime>,
    rng: &mut StdRng,
    format: KvFormat,
    (slots, kvh, cap, d): (u32, u32, u32, u32),
    block: u32,
) -> DeviceKvCache {
    let n = slots * cap.div_ceil(PAGE).max(1);
    let mut order: Vec<u32> = (0..n).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    DeviceKvCache::with_order(rt, format, (slots, kvh, cap, d), block, PAGE, &order).unwrap()
}

/// Builds the cache through the append kernel: every (sequence, position) row in one launch,
/// each sequence's rows on scattered pages.
fn fill(rt: &Arc<Runtime>, rng: &mut StdRng, c: &Case, format: KvFormat, block: u32) -> Filled {
    let batch = c.lens.len();
    let cap = c.lens.iter().copied().max().unwrap().max(1) as u32;
    let cache = scattered_cache(
        rt,
        rng,
        format,
        (batch as u32, c.kv_heads as u32, cap, c.d as u32),
        block,
    );
    let slot_of: Vec<u32> = (0..batch).map(|b| (batch - 1 - b) as u32).collect();
    let (mut k, mut v) = (Vec::new(), Vec::new());
    let (mut rows_k, mut rows_v, mut slots, mut pos) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (b, &len) in c.lens.iter().enumerate() {
        let mut kb = bf16s(rng, len * c.kv_heads * c.d, 1.0);
        if let Some(every) = c.d.checked_div(c.outliers) {
            for (i, x) in kb.iter_mut().enumerate() {
                if (i % c.d) % every == 3 {
                    *x = bf16::round(*x * c.outlier);
                }
            }
        }
        let vb = bf16s(rng, len * c.kv_heads * c.d, 1.0);
        for p in 0..len {
            slots.push(slot_of[b]);
            pos.push(p as u32);
        }
        rows_k.extend_from_slice(&kb);
        rows_v.extend_from_slice(&vb);
        k.push(kb);
        v.push(vb);
    }
    let (kb, vb) = (
        put_u16(rt, &to_bf16(&rows_k)),
        put_u16(rt, &to_bf16(&rows_v)),
    );
    let (sb, pb) = (put_u32(rt, &slots), put_u32(rt, &pos));
    unsafe {
        cache.append(
            rt,
            kb.as_ptr(),
            vb.as_ptr(),
            sb.as_ptr(),
            pb.as_ptr(),
            slots.len() as u32,
        )
    }
    .unwrap();
    rt.synchronize().unwrap();
    Filled {
        cache,
        k,
        v,
        slot_of,
    }
}

/// The device cache copied to the host once.
enum HostCache {
    Bf16(Vec<f64>, Vec<f64>),
    Mirror(Vec<u8>, Vec<u8>, Vec<f32>, Vec<f32>),
}

fn download(c: &DeviceKvCache) -> HostCache {
    match &c.mirror {
        None => HostCache::Bf16(get_bf16(&c.k), get_bf16(&c.v)),
        Some(m) => HostCache::Mirror(
            get_bytes(&m.k),
            get_bytes(&m.v),
            get_f32(&m.ks),
            get_f32(&m.vs),
        ),
    }
}

/// The cache rows of sequence `b` as the kernel sees them, `[pos][kv_head][d]`, dequantized
/// (still rotated for the mirrors).
fn read_back(f: &Filled, host: &HostCache, b: usize, len: usize) -> (Vec<f32>, Vec<f32>) {
    let c = &f.cache;
    let (kvh, d) = (c.kv_heads as usize, c.d as usize);
    let slot = f.slot_of[b];
    let mut k = vec![0f32; len * kvh * d];
    let mut v = vec![0f32; len * kvh * d];
    let row = |h: usize, p: usize| c.row(slot, h as u32, p as u32) as usize;
    match host {
        HostCache::Bf16(kk, vv) => {
            for h in 0..kvh {
                for p in 0..len {
                    for i in 0..d {
                        k[(p * kvh + h) * d + i] = kk[row(h, p) * d + i] as f32;
                        v[(p * kvh + h) * d + i] = vv[row(h, p) * d + i] as f32;
                    }
                }
            }
        }
        HostCache::Mirror(kb, vb, ks, vs) => {
            for h in 0..kvh {
                for p in 0..len {
                    let r = row(h, p);
                    let (kr, vr) = match c.format {
                        KvFormat::Fp8 => (
                            kv::dequantize_fp8(&kb[r * d..(r + 1) * d], &ks[r..r + 1], d),
                            kv::dequantize_fp8(&vb[r * d..(r + 1) * d], &vs[r..r + 1], d),
                        ),
                        _ => (
                            kv::dequantize_int4(
                                &kb[r * d / 2..(r + 1) * d / 2],
                                &ks[r..r + 1],
                                d,
                                Int4Order::Natural,
                            ),
                            kv::dequantize_int4(
                                &vb[r * d / 2..(r + 1) * d / 2],
                                &vs[r..r + 1],
                                d,
                                Int4Order::Natural,
                            ),
                        ),
                    };
                    k[(p * kvh + h) * d..(p * kvh + h + 1) * d].copy_from_slice(&kr);
                    v[(p * kvh + h) * d..(p * kvh + h + 1) * d].copy_from_slice(&vr);
                }
            }
        }
    }
    (k, v)
}

/// The host's version of what the append should have stored for sequence `b` (rotated and
/// quantized with `stoke_formats::kv`, dequantized again).
fn host_mirror(f: &Filled, b: usize) -> (Vec<f32>, Vec<f32>) {
    let c = &f.cache;
    let d = c.d as usize;
    let mirror = |x: &[f32], order: Int4Order| -> Vec<f32> {
        let mut r = x.to_vec();
        if c.block > 0 {
            kv::hadamard(&mut r, d, c.block as usize).unwrap();
        }
        match c.format {
            KvFormat::Fp8 => {
                let (codes, s) = kv::quantize_fp8(&r, d).unwrap();
                kv::dequantize_fp8(&codes, &s, d)
            }
            KvFormat::Int4 => {
                let (bytes, s) = kv::quantize_int4(&r, d, order).unwrap();
                kv::dequantize_int4(&bytes, &s, d, order)
            }
            KvFormat::Bf16 => r,
        }
    };
    (
        mirror(&f.k[b], Int4Order::Natural),
        mirror(&f.v[b], Int4Order::Natural),
    )
}

const KERNEL_TOLERANCE: f64 = 5e-3;

/// Every format and head dim against the f64 reference over the cache the kernel read (kernel
/// error), and over the exact cache (quantization error, reported); the append against the host
/// quantizer; and the outlier experiment with and without the rotation.
pub fn decode_attention_matches_reference() -> Result<Value, String> {
    let rt = crate::gpu()?;
    rt.set_poison_allocations(true);
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    // GQA 8, d = 128, three sequences of 4097, 1000 and 17 keys, `splits` forced.
    let forced = |splits| Case {
        heads: 64,
        kv_heads: 8,
        d: 128,
        lens: vec![4097, 1000, 17],
        outliers: 0,
        outlier: 1.0,
        splits: Some(splits),
    };
    let cases = [
        // (heads, kv heads, d, lens): GQA ratios 4, 3, 1, 8 (16 below); contexts 1, 17, 1024, 4097.
        Case {
            heads: 32,
            kv_heads: 8,
            d: 128,
            lens: vec![1, 17, 1024, 4097, 300, 1, 2000, 33],
            outliers: 0,
            outlier: 1.0,
            splits: None,
        },
        Case {
            heads: 9,
            kv_heads: 3,
            d: 64,
            lens: (0..32)
                .map(|i| {
                    ([1usize, 17, 1024, 4097][i % 4])
                        .saturating_sub((i / 4) % 3)
                        .max(1)
                })
                .collect(),
            outliers: 0,
            outlier: 1.0,
            splits: None,
        },
        Case {
            heads: 8,
            kv_heads: 8,
            d: 128,
            lens: vec![4097],
            outliers: 0,
            outlier: 1.0,
            splits: None,
        },
        Case {
            heads: 64,
            kv_heads: 8,
            d: 64,
            lens: vec![17],
            outliers: 0,
            outlier: 1.0,
            splits: None,
        },
        // 32 x 8 kv heads fill the H200 in one split: the attention kernel writes the output
        // itself (d = 128, GQA 8, the rotation undone there).
        Case {
            heads: 64,
            kv_heads: 8,
            d: 128,
            lens: (0..32)
                .map(|i| [1usize, 17, 1024, 640][i % 4].saturating_sub(i / 8))
                .map(|l| l.max(1))
                .collect(),
            outliers: 0,
            outlier: 1.0,
            splits: None,
        },
        // Llama-3.1-405B's 16 query heads per kv head: two CTAs of 8 heads per kv head, each
        // reading its cache rows; split launches both clustered and merged by the last split.
        Case {
            heads: 32,
            kv_heads: 2,
            d: 128,
            lens: vec![1, 4097, 700, 33],
            outliers: 0,
            outlier: 1.0,
            splits: None,
        },
        Case {
            heads: 32,
            kv_heads: 2,
            d: 64,
            lens: vec![4097, 17],
            outliers: 0,
            outlier: 1.0,
            splits: Some(70),
        },
        // 65 forced splits of 64 keys: the last split's merge walks three chunks of 32 splits,
        // a warp merges two heads (GQA 8 over 4 or 6 warps), and the shorter sequences leave
        // splits empty.
        forced(70),
        // 8 forced splits: clusters of 8 CTAs where they are all resident, merging through
        // distributed shared memory (a head per CTA); the 17-key sequence leaves 7 splits empty.
        forced(8),
    ];
    let mut report = Vec::new();
    let mut worst = 0f64;
    for c in &cases {
        for (format, block) in [
            (KvFormat::Bf16, 0),
            (KvFormat::Fp8, c.d as u32),
            (KvFormat::Int4, c.d as u32),
            (KvFormat::Int4, 0),
        ] {
            let f = fill(&rt, &mut rng, c, format, block);
            let batch = c.lens.len();
            let what = format!(
                "seed {seed}: {} block {block}, {} heads / {} kv heads, d {}, lens {:?}",
                format.name(),
                c.heads,
                c.kv_heads,
                c.d,
                &c.lens[..c.lens.len().min(8)]
            );
            // Once per cache: the references over the cache the kernel reads (kernel error) and
            // over the exact rows (quantization error), and the append against the host
            // quantizer, value by value.
            let q = bf16s(&mut rng, batch * c.heads * c.d, 1.0);
            let host = download(&f.cache);
            let (mut want, mut exact) = (Vec::new(), Vec::new());
            let (mut append_mismatch, mut append_rows) = (0usize, 0usize);
            for b in 0..batch {
                let qs = &q[b * c.heads * c.d..(b + 1) * c.heads * c.d];
                let (k_dev, v_dev) = read_back(&f, &host, b, c.lens[b]);
                want.push(
                    kv::decode_attention_rotated(
                        qs,
                        &k_dev,
                        &v_dev,
                        c.heads,
                        c.kv_heads,
                        c.d,
                        block as usize,
                    )
                    .unwrap(),
                );
                exact.push(kv::decode_attention(
                    qs, &f.k[b], &f.v[b], c.heads, c.kv_heads, c.d,
                ));
                let (k_host, v_host) = host_mirror(&f, b);
                for (dev, host) in [(&k_dev, &k_host), (&v_dev, &v_host)] {
                    for (rd, rh) in dev.chunks(c.d).zip(host.chunks(c.d)) {
                        append_rows += 1;
                        if rd
                            .iter()
                            .zip(rh)
                            .any(|(a, b)| (a - b).abs() > 1e-6 * b.abs().max(1e-3))
                        {
                            append_mismatch += 1;
                        }
                    }
                }
            }
            // Rounding of the rotated row in f32 may move a value across a rounding boundary in
            // a rare row; a systematic difference shows in many.
            if append_mismatch * 100 > append_rows {
                return Err(format!(
                    "{what}: {append_mismatch} of {append_rows} appended rows differ from the host quantizer"
                ));
            }
            let qb = put_u16(&rt, &to_bf16(&q));
            let lens: Vec<u32> = c.lens.iter().map(|l| *l as u32).collect();
            let (sb, lb) = (put_u32(&rt, &f.slot_of), put_u32(&rt, &lens));
            let max_len = *lens.iter().max().unwrap();
            let out = rt.alloc(batch * c.heads * c.d * 2).unwrap();
            unsafe { rt.fill_bytes(out.ptr(), 0xFF, out.bytes()) }.unwrap();
            unsafe {
                f.cache.attend_splits(
                    &rt,
                    qb.as_ptr(),
                    c.heads as u32,
                    sb.as_ptr(),
                    lb.as_ptr(),
                    batch as u32,
                    max_len,
                    out.as_mut_ptr(),
                    c.splits,
                )
            }
            .map_err(|e| e.to_string())?;
            let got = get_bf16(&out);
            if got.iter().any(|x| !x.is_finite()) {
                return Err(format!(
                    "{what}: unwritten (poisoned) or non-finite outputs"
                ));
            }
            let (mut kern_err, mut quant_err) = (0f64, 0f64);
            for b in 0..batch {
                let g = &got[b * c.heads * c.d..(b + 1) * c.heads * c.d];
                kern_err = kern_err.max(relative_error(g, &want[b]));
                quant_err = quant_err.max(relative_error(g, &exact[b]));
            }
            worst = worst.max(kern_err);
            if !(kern_err < KERNEL_TOLERANCE) {
                return Err(format!(
                    "{what}: kernel relative error {kern_err:.3e} against the reference over its own cache"
                ));
            }
            let (_, splits, cluster) = f
                .cache
                .split_launch(&rt, c.heads as u32, batch as u32, max_len, c.splits)
                .map_err(|e| e.to_string())?;
            report.push(json!({"format": format.name(), "block": block, "heads": c.heads, "kv_heads": c.kv_heads, "d": c.d,
            "batch": batch, "max_len": max_len, "splits": splits, "cluster": cluster, "kernel_rel_err": kern_err, "quantization_rel_err": quant_err,
            "append_rows_differing": append_mismatch, "append_rows": append_rows}));
        }
    }
    // The outlier experiment on the kernels: Llama-8B attention shape, 4 key channels per head
    // scaled 8x, ctx 1024.
    let mut outlier = Vec::new();
    for (format, block) in [
        (KvFormat::Int4, 0),
        (KvFormat::Int4, 128),
        (KvFormat::Fp8, 0),
        (KvFormat::Fp8, 128),
    ] {
        let c = Case {
            heads: 32,
            kv_heads: 8,
            d: 128,
            lens: vec![1024],
            outliers: 4,
            outlier: 8.0,
            splits: None,
        };
        let f = fill(&rt, &mut rng, &c, format, block);
        let q = bf16s(&mut rng, c.heads * c.d, 1.0);
        let qb = put_u16(&rt, &to_bf16(&q));
        let (sb, lb) = (put_u32(&rt, &f.slot_of), put_u32(&rt, &[1024]));
        let out = rt.alloc(c.heads * c.d * 2).unwrap();
        unsafe {
            f.cache.attend(
                &rt,
                qb.as_ptr(),
                32,
                sb.as_ptr(),
                lb.as_ptr(),
                1,
                1024,
                out.as_mut_ptr(),
            )
        }
        .map_err(|e| e.to_string())?;
        let got = get_bf16(&out);
        let exact = kv::decode_attention(&q, &f.k[0], &f.v[0], 32, 8, 128);
        outlier.push(json!({"format": format.name(), "block": block, "relative_error": relative_error(&got, &exact)}));
    }
    rt.set_poison_allocations(false);
    Ok(
        json!({"seed": seed, "tolerance": KERNEL_TOLERANCE, "max_kernel_rel_err": worst, "cases": report,
        "outliers_llama8b_ctx1024_4ch_x8": outlier}),
    )
}

/// Attention shapes `(name, heads, kv_heads, head_dim)`: Llama-3.1-8B, 70B and 405B (16 query
/// heads per kv head: two CTAs per kv head).
pub const BENCH_SHAPES: &[(&str, u32, u32, u32)] = &[
    ("8b", 32, 8, 128),
    ("70b", 64, 8, 128),
    ("405b", 128, 8, 128),
];
/// (batch, context) points.
pub const BENCH_POINTS: &[(u32, u32)] = &[(1, 1024), (8, 1024), (32, 4096), (1, 32768)];

/// One benchmark decode step: every sequence at the same context `ctx`, random K/V rows for all
/// of its positions (appended by `fill`) and random queries.
struct BenchStep {
    heads: u32,
    batch: u32,
    ctx: u32,
    rows: u32,
    kx: DeviceBuffer,
    vx: DeviceBuffer,
    slots: DeviceBuffer,
    pos: DeviceBuffer,
    q: DeviceBuffer,
    slot_of: DeviceBuffer,
    lens: DeviceBuffer,
    out: DeviceBuffer,
}

impl BenchStep {
    fn new(
        rt: &Arc<Runtime>,
        rng: &mut StdRng,
        (heads, kvh, d): (u32, u32, u32),
        batch: u32,
        ctx: u32,
    ) -> Self {
        let rows = batch * ctx;
        let n = rows as usize;
        let slots: Vec<u32> = (0..rows).map(|i| i / ctx).collect();
        let pos: Vec<u32> = (0..rows).map(|i| i % ctx).collect();
        Self {
            heads,
            batch,
            ctx,
            rows,
            kx: put_u16(rt, &to_bf16(&bf16s(rng, n * (kvh * d) as usize, 1.0))),
            vx: put_u16(rt, &to_bf16(&bf16s(rng, n * (kvh * d) as usize, 1.0))),
            slots: put_u32(rt, &slots),
            pos: put_u32(rt, &pos),
            q: put_u16(rt, &to_bf16(&bf16s(rng, (batch * heads * d) as usize, 1.0))),
            slot_of: put_u32(rt, &(0..batch).collect::<Vec<_>>()),
            lens: put_u32(rt, &vec![ctx; batch as usize]),
            out: rt.alloc((batch * heads * d * 2) as usize).unwrap(),
        }
    }

    /// Appends every position's K and V rows to `cache` (one launch).
    fn fill(&self, rt: &Arc<Runtime>, cache: &DeviceKvCache) {
        unsafe {
            cache.append(
                rt,
                self.kx.as_ptr(),
                self.vx.as_ptr(),
                self.slots.as_ptr(),
                self.pos.as_ptr(),
                self.rows,
            )
        }
        .unwrap();
    }

    /// Queues one decode attention over `cache` (`splits`: forced, else the plan's).
    fn attend(&self, rt: &Arc<Runtime>, cache: &DeviceKvCache, splits: Option<u32>) {
        unsafe {
            cache.attend_splits(
                rt,
                self.q.as_ptr(),
                self.heads,
                self.slot_of.as_ptr(),
                self.lens.as_ptr(),
                self.batch,
                self.ctx,
                self.out.as_mut_ptr(),
                splits,
            )
        }
        .unwrap();
    }
}

/// Decode attention (one launch: the splits and their merge) for each shape, point and
/// format: µs, cache bytes read per second, share of the same run's copy rate; then a sweep of
/// forced split counts around the plan's at a few points.
pub fn bench(copy_gbps: f64) -> Value {
    let rt = crate::gpu().expect("GPU");
    let mut rows = Vec::new();
    // The fastest one launch reads each point's cache bytes once, by byte count.
    let mut reads = std::collections::HashMap::new();
    bench_points(&rt, copy_gbps, &mut rows, &mut reads);
    // The kernels' resources (ptxas).
    let regs = crate::bench::kernel_reports(&rt, DECODE_ATTENTION.file);
    let mut sweep = Vec::new();
    let mut rng = StdRng::seed_from_u64(12);
    for (shape, batch, ctx, counts) in SPLIT_SWEEP {
        let (name, heads, kvh, d) = BENCH_SHAPES[*shape];
        for format in [KvFormat::Bf16, KvFormat::Int4] {
            for &s in *counts {
                let t = time_point(
                    &rt,
                    &mut rng,
                    (heads, kvh, d),
                    *batch,
                    *ctx,
                    format,
                    Some(s),
                );
                let gbps = t.bytes as f64 / t.us / 1e3;
                println!(
                    "attention {name:<4} b {batch:2} ctx {ctx:5} {:<4} {s:3} splits: {:8.2} us ({:5.1}% of copy)",
                    format.name(),
                    t.us,
                    100.0 * gbps / copy_gbps
                );
                sweep.push(json!({"shape": name, "batch": batch, "ctx": ctx, "format": format.name(),
                    "splits": s, "cluster": t.cluster, "chunk": t.chunk, "us": t.us, "gbps": gbps, "of_copy": gbps / copy_gbps}));
            }
        }
    }
    json!({"copy_gbps": copy_gbps, "runs": rows, "kernels": regs, "split_sweep": sweep})
}

/// Forced split counts timed at (shape index in BENCH_SHAPES, batch, context) points (the plan
/// picks 1 at B = 32, ctx 4096, 32 at B = 1, ctx 32k, 4 at B = 8, ctx 1024 and 16 at B = 1,
/// ctx 1024; 2-8 splits form clusters). At ctx 32k, 33 splits of 1008 keys fill all 264
/// resident slots of an H200 (the plan's 32 fill 256).
const SPLIT_SWEEP: &[(usize, u32, u32, &[u32])] = &[
    (0, 32, 4096, &[2, 4]),
    (0, 1, 32768, &[16, 33, 64]),
    (1, 1, 32768, &[16, 33]),
    (0, 8, 1024, &[1, 2, 8]),
    (1, 8, 1024, &[1, 2, 8]),
    (0, 1, 1024, &[4, 8]),
    (1, 1, 1024, &[4, 8]),
];

/// One timed benchmark point.
struct PointTime {
    /// Replayed from a CUDA graph; `stream_us` launched back to back from the host.
    us: f64,
    stream_us: f64,
    host_us: f64,
    bytes: usize,
    copies: usize,
    /// Keys per split of a forced split count (0: the plan's).
    chunk: u32,
    /// Split-KV CTAs per (sequence, kv head), and CTAs per cluster (1: the splits merge
    /// through global memory; else they form one cluster).
    splits: u32,
    cluster: u32,
}

/// Times decode attention at one point: enough caches (>= 160 MB) that the L2 never holds the
/// one being read, filled with random rows through the append.
fn time_point(
    rt: &Arc<Runtime>,
    rng: &mut StdRng,
    (heads, kvh, d): (u32, u32, u32),
    batch: u32,
    ctx: u32,
    format: KvFormat,
    splits: Option<u32>,
) -> PointTime {
    let block = if format == KvFormat::Bf16 { 0 } else { d };
    let one = 2 * batch as usize * ctx as usize * kvh as usize * format.row_bytes(d as usize);
    let copies = 160_000_000usize.div_ceil(one).clamp(1, 64);
    let caches: Vec<DeviceKvCache> = (0..copies)
        .map(|_| scattered_cache(rt, rng, format, (batch, kvh, ctx, d), block))
        .collect();
    let step = BenchStep::new(rt, rng, (heads, kvh, d), batch, ctx);
    for c in &caches {
        step.fill(rt, c);
    }
    rt.synchronize().unwrap();
    let iters = (400_000_000 / one).clamp(10, 500);
    // Also the host's time to queue one call (the split partials' allocation, one launch).
    let t = crate::bench::time_calls(rt, 5, iters, |i| {
        step.attend(rt, &caches[i % copies], splits)
    });
    let (chunk, used, cluster) = caches[0]
        .split_launch(rt, heads, batch, ctx, splits)
        .unwrap();
    PointTime {
        us: t.us,
        stream_us: t.stream_us,
        host_us: t.host_us,
        bytes: caches[0].bytes_read(step.rows as usize),
        copies,
        chunk,
        splits: used,
        cluster,
    }
}

/// Every benchmark shape, point and format, timed with the plan's split count, beside the
/// same-size read of the memory roofline.
fn bench_points(
    rt: &Arc<Runtime>,
    copy_gbps: f64,
    rows: &mut Vec<Value>,
    // The read probe's (best, loads' best, copy engine's best) µs by byte count.
    reads: &mut std::collections::HashMap<usize, (f64, f64, f64)>,
) {
    let mut rng = StdRng::seed_from_u64(11);
    for &(name, heads, kvh, d) in BENCH_SHAPES {
        for &(batch, ctx) in BENCH_POINTS {
            for format in [KvFormat::Bf16, KvFormat::Fp8, KvFormat::Int4] {
                let block = if format == KvFormat::Bf16 { 0 } else { d };
                let t = time_point(rt, &mut rng, (heads, kvh, d), batch, ctx, format, None);
                let (us, host_us, bytes) = (t.us, t.host_us, t.bytes);
                let gbps = bytes as f64 / us / 1e3;
                println!(
                    "attention {name:<4} b {batch:2} ctx {ctx:5} {:<4}: {us:8.2} us {gbps:7.0} GB/s ({:5.1}% of copy) host {host_us:.1} us",
                    format.name(),
                    100.0 * gbps / copy_gbps
                );
                let mut row = json!({"shape": name, "heads": heads, "kv_heads": kvh, "d": d, "batch": batch, "ctx": ctx,
                "format": format.name(), "block": block, "us": us, "host_us": host_us, "bytes": bytes, "gbps": gbps,
                "of_copy": gbps / copy_gbps, "copies": t.copies, "stream_us": t.stream_us, "splits": t.splits,
                "cluster": t.cluster});
                // The memory side of the roofline: one launch reading the same bytes once.
                let (read_us, load_us, bulk_us) = *reads.entry(bytes).or_insert_with(|| {
                    let r = crate::bench::same_size_read(rt, bytes);
                    (r.us, r.load_us, r.bulk_us)
                });
                row["same_size_read_us"] = json!(read_us);
                row["of_same_size_read"] = json!(read_us / us);
                row["same_size_read_load_us"] = json!(load_us);
                row["same_size_read_bulk_us"] = json!(bulk_us);
                rows.push(row);
            }
        }
    }
}

/// A few decode-attention launches to run under a profiler (`ncu`): the named benchmark shape
/// at one (batch, context), each of `formats` (by name), two calls each.
pub fn profile_launches(shape: &str, batch: u32, ctx: u32, formats: &[String]) {
    let rt = crate::gpu().expect("GPU");
    let mut rng = StdRng::seed_from_u64(11);
    let Some(&(_, heads, kvh, d)) = BENCH_SHAPES.iter().find(|s| s.0 == shape) else {
        eprintln!("unknown attention shape {shape}");
        return;
    };
    let step = BenchStep::new(&rt, &mut rng, (heads, kvh, d), batch, ctx);
    for format in [KvFormat::Bf16, KvFormat::Fp8, KvFormat::Int4] {
        if !formats.iter().any(|f| f == format.name()) {
            continue;
        }
        let block = if format == KvFormat::Bf16 { 0 } else { d };
        let cache = scattered_cache(&rt, &mut rng, format, (batch, kvh, ctx, d), block);
        step.fill(&rt, &cache);
        for _ in 0..2 {
            step.attend(&rt, &cache, None);
        }
        rt.synchronize().unwrap();
        println!("profiled {shape} b {batch} ctx {ctx} {}", format.name());
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill attention (kernels/prefill_attention.cu)
// ---------------------------------------------------------------------------------------------

/// One packed prefill case: `(rows, pos0)` per sequence (the sequence's cache holds `pos0`
/// earlier tokens, then its `rows` new ones).
struct PrefillCase {
    heads: usize,
    kv_heads: usize,
    d: usize,
    seqs: Vec<(usize, usize)>,
}

/// The packed descriptors of `seqs` in slots `slot_of` (rows one sequence after another).
fn packed(seqs: &[(usize, usize)], slot_of: &[u32]) -> Vec<PrefillSeq> {
    let mut first = 0u32;
    seqs.iter()
        .zip(slot_of)
        .map(|(&(rows, pos0), &slot)| {
            let s = PrefillSeq {
                first,
                rows: rows as u32,
                slot,
                pos0: pos0 as u32,
            };
            first += rows as u32;
            s
        })
        .collect()
}

/// Prefill attention against the f64 reference (each row: decode attention over the keys up to
/// its own position), on caches filled through the append kernel: single-row sequences, rows
/// not a multiple of the 64-row tile, chunks appended after earlier tokens (past 8k), GQA 1 /
/// 3 / 4 / 8 / 16, head sizes 64 and 128, the BF16 cache and the main cache of an INT4 one. Poisoned
/// outputs: every row must be written.
pub fn prefill_attention_matches_reference() -> Result<Value, String> {
    let rt = crate::gpu()?;
    rt.set_poison_allocations(true);
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let cases = [
        PrefillCase {
            heads: 9,
            kv_heads: 3,
            d: 64,
            seqs: vec![(1, 0), (300, 0), (64, 0), (65, 0), (17, 8200), (1, 5000)],
        },
        PrefillCase {
            heads: 32,
            kv_heads: 8,
            d: 128,
            seqs: vec![(130, 0), (1, 0), (100, 1000), (63, 1)],
        },
        PrefillCase {
            heads: 8,
            kv_heads: 8,
            d: 128,
            seqs: vec![(129, 0)],
        },
        PrefillCase {
            heads: 64,
            kv_heads: 8,
            d: 64,
            seqs: vec![(33, 7), (2, 0)],
        },
        // 16 query heads per kv head, as Llama-3.1-405B's 128 over 8.
        PrefillCase {
            heads: 32,
            kv_heads: 2,
            d: 128,
            seqs: vec![(70, 0), (1, 3)],
        },
    ];
    let mut report = Vec::new();
    let mut worst = 0f64;
    for c in &cases {
        for format in [KvFormat::Bf16, KvFormat::Int4] {
            let lens: Vec<usize> = c.seqs.iter().map(|(r, p)| r + p).collect();
            let case = Case {
                heads: c.heads,
                kv_heads: c.kv_heads,
                d: c.d,
                lens,
                outliers: 0,
                outlier: 1.0,
                splits: None,
            };
            let block = if format == KvFormat::Bf16 {
                0
            } else {
                c.d as u32
            };
            let f = fill(&rt, &mut rng, &case, format, block);
            let seqs = packed(&c.seqs, &f.slot_of);
            let rows: usize = c.seqs.iter().map(|s| s.0).sum();
            let width = c.heads * c.d;
            let q = bf16s(&mut rng, rows * width, 1.0);
            let (qb, sb) = (
                put_u16(&rt, &to_bf16(&q)),
                put_u8(&rt, &PrefillSeq::bytes(&seqs)),
            );
            let out = rt.alloc(rows * width * 2).unwrap();
            unsafe { rt.fill_bytes(out.ptr(), 0xFF, out.bytes()) }.unwrap();
            unsafe {
                f.cache.prefill_attend(
                    &rt,
                    qb.as_ptr(),
                    c.heads as u32,
                    &seqs,
                    sb.as_ptr(),
                    rows as u32,
                    out.as_mut_ptr(),
                )
            }
            .map_err(|e| e.to_string())?;
            let got = get_bf16(&out);
            let what = format!(
                "seed {seed}: {} cache, {} heads / {} kv heads, d {}, (rows, pos0) {:?}",
                format.name(),
                c.heads,
                c.kv_heads,
                c.d,
                c.seqs
            );
            if got.iter().any(|x| !x.is_finite()) {
                return Err(format!(
                    "{what}: unwritten (poisoned) or non-finite outputs"
                ));
            }
            let mut errs = Vec::new();
            for (b, s) in seqs.iter().enumerate() {
                let kvw = c.kv_heads * c.d;
                let (mut want, mut have) = (Vec::new(), Vec::new());
                for i in 0..s.rows as usize {
                    let r = s.first as usize + i;
                    let keys = s.pos0 as usize + i + 1;
                    want.extend(kv::decode_attention(
                        &q[r * width..(r + 1) * width],
                        &f.k[b][..keys * kvw],
                        &f.v[b][..keys * kvw],
                        c.heads,
                        c.kv_heads,
                        c.d,
                    ));
                    have.extend_from_slice(&got[r * width..(r + 1) * width]);
                }
                let e = relative_error(&have, &want);
                worst = worst.max(e);
                errs.push(e);
                if !(e < KERNEL_TOLERANCE) {
                    return Err(format!(
                        "{what}: sequence {b} {s:?}: relative error {e:.3e} against the f64 reference"
                    ));
                }
            }
            report.push(
                json!({"format": format.name(), "heads": c.heads, "kv_heads": c.kv_heads, "d": c.d,
                "seqs_rows_pos0": c.seqs, "rel_err": errs}),
            );
        }
    }
    rt.set_poison_allocations(false);
    Ok(json!({"seed": seed, "tolerance": KERNEL_TOLERANCE, "max_rel_err": worst, "cases": report}))
}

/// Prefill attention shapes `(name, heads, kv_heads, head_dim)`.
const PREFILL_SHAPES: &[(&str, u32, u32, u32)] = &[
    ("8b", 32, 8, 128),
    ("70b", 64, 8, 128),
    ("405b", 128, 8, 128),
    ("smollm2", 9, 3, 64),
];
/// Single-prompt lengths, and the packed mix (one 2048-token prompt with seven of 128).
const PREFILL_LENGTHS: &[usize] = &[512, 1024, 2048, 4096, 8192];
const PREFILL_MIX: &[usize] = &[2048, 128, 128, 128, 128, 128, 128, 128];

/// Times prefill attention of fresh prompts of `lens` (packed, each in its own slot): µs and
/// TFLOP/s (4 heads d per (row, key attended) pair, causal pairs only).
fn time_prefill(
    rt: &Arc<Runtime>,
    rng: &mut StdRng,
    (heads, kvh, d): (u32, u32, u32),
    lens: &[usize],
) -> (f64, f64) {
    let cap = *lens.iter().max().unwrap() as u32;
    let n = lens.len() as u32;
    let cache = scattered_cache(rt, rng, KvFormat::Bf16, (n, kvh, cap, d), 0);
    let rows: usize = lens.iter().sum();
    let seqs = packed(
        &lens.iter().map(|&l| (l, 0)).collect::<Vec<_>>(),
        &(0..n).collect::<Vec<_>>(),
    );
    // The cache's K and V are random: filled in place, every value a finite bf16.
    let kv_vals = cache.k.bytes() / 2;
    for buf in [&cache.k, &cache.v] {
        let vals = to_bf16(&bf16s(rng, kv_vals, 1.0));
        let bytes: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
        unsafe { rt.copy_htod(buf.ptr(), &bytes) }.unwrap();
    }
    let q = put_u16(rt, &to_bf16(&bf16s(rng, rows * (heads * d) as usize, 1.0)));
    let sb = put_u8(rt, &PrefillSeq::bytes(&seqs));
    let out = rt.alloc(rows * (heads * d) as usize * 2).unwrap();
    let t = crate::bench::time_calls(rt, 5, 20, |_| {
        unsafe {
            cache.prefill_attend(
                rt,
                q.as_ptr(),
                heads,
                &seqs,
                sb.as_ptr(),
                rows as u32,
                out.as_mut_ptr(),
            )
        }
        .unwrap()
    });
    let pairs: f64 = lens.iter().map(|&l| (l * (l + 1) / 2) as f64).sum();
    let flops = 4.0 * (heads * d) as f64 * pairs;
    (t.us, flops / t.us / 1e6)
}

/// Prefill attention for each shape: single prompts of 512 ... 8192 tokens, and the packed mix
/// (one 2048-token prompt with seven of 128) beside the same mix padded to 8 x 2048.
pub fn prefill_bench(_copy_gbps: f64) -> Value {
    let rt = crate::gpu().expect("GPU");
    let mut rng = StdRng::seed_from_u64(21);
    let mut runs = Vec::new();
    for &(name, heads, kvh, d) in PREFILL_SHAPES {
        for &s in PREFILL_LENGTHS {
            let (us, tflops) = time_prefill(&rt, &mut rng, (heads, kvh, d), &[s]);
            println!("prefill attention {name:<8} S {s:5}: {us:9.1} us {tflops:6.1} TFLOP/s");
            runs.push(json!({"shape": name, "heads": heads, "kv_heads": kvh, "d": d, "lens": [s], "us": us, "tflops": tflops}));
        }
        let (us, tflops) = time_prefill(&rt, &mut rng, (heads, kvh, d), PREFILL_MIX);
        let (pad_us, _) = time_prefill(&rt, &mut rng, (heads, kvh, d), &[2048; 8]);
        println!(
            "prefill attention {name:<8} mix 2048 + 7 x 128: {us:9.1} us {tflops:6.1} TFLOP/s (8 x 2048 padded: {pad_us:.1} us)"
        );
        runs.push(json!({"shape": name, "heads": heads, "kv_heads": kvh, "d": d, "lens": PREFILL_MIX, "us": us, "tflops": tflops,
            "padded_8x2048_us": pad_us}));
    }
    let regs = crate::bench::kernel_reports(&rt, PREFILL_ATTENTION.file);
    json!({"runs": runs, "kernels": regs})
}
