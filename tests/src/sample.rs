//! Token sampling (`kernels/sample.cu`) on the GPU: every row's token against the CPU
//! reference `stoke_formats::sample::sample_row` on the same logits, presence bitmap and
//! counter, the counters and bitmaps the kernel writes back, replays of one counter, and the
//! time of one launch.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use std::sync::Arc;
use stoke_cuda::sample::{SampleCall, SampleElem, SamplingParams, sample};
use stoke_cuda::{DeviceBuffer, DevicePtrMut, Runtime};
use stoke_formats::bf16;
use stoke_formats::sample as reference;

use crate::int4::put_u32;

const VOCABS: &[u32] = &[49152, 128256];
const ROWS: &[u32] = &[1, 3, 8, 32];
/// Launches per configuration and shape; each advances the counters by one.
const DRAWS: u32 = 3;
/// Share of sampled (row, counter) draws that must pick the reference's token. The kernel and
/// the reference compute the same integer weights, so every draw is expected to agree.
const MIN_AGREEMENT: f64 = 0.99;
/// (name, temperature, top_k, top_p).
const CONFIGS: &[(&str, f32, u32, f32)] = &[
    ("greedy", 0.0, 0, 1.0),
    ("temperature", 0.8, 0, 1.0),
    ("top_k", 0.9, 50, 1.0),
    ("top_p", 1.0, 0, 0.9),
    ("top_k_top_p", 0.7, 100, 0.8),
];
const PENALTIES: &[f32] = &[1.0, 1.3];

fn get_u32(buf: &DeviceBuffer) -> Result<Vec<u32>, String> {
    let mut bytes = vec![0u8; buf.bytes()];
    unsafe { buf.runtime().copy_dtoh(&mut bytes, buf.ptr()) }.map_err(|e| e.to_string())?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn set_u32(buf: &DeviceBuffer, v: &[u32]) {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    unsafe { buf.runtime().copy_htod(buf.ptr(), &bytes) }.unwrap();
}

/// Random logits `[rows, stride]` (the padding poisoned with NaN): normal with a per-row spread,
/// a few tokens lifted far above the rest as a language model's head does, and in some rows a
/// few NaN and -inf. Rounded to bf16 when the kernel reads bf16.
fn logits(rng: &mut StdRng, rows: u32, vocab: u32, stride: u32, round: bool) -> Vec<f32> {
    let mut v = vec![f32::NAN; (rows * stride) as usize];
    for r in 0..rows {
        let sigma = 1.0 + 3.0 * rng.random::<f32>();
        let odd = r % 4 == 1;
        for i in 0..vocab {
            let (u1, u2): (f32, f32) = (rng.random_range(f32::EPSILON..1.0), rng.random());
            let mut x = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos() * sigma;
            if rng.random::<f32>() < 1e-3 {
                x += 6.0 + 6.0 * rng.random::<f32>();
            }
            if odd && rng.random::<f32>() < 1e-3 {
                x = if rng.random() {
                    f32::NAN
                } else {
                    f32::NEG_INFINITY
                };
            }
            v[(r * stride + i) as usize] = if round { bf16::round(x) } else { x };
        }
    }
    v
}

/// One launch: `T`'s entry point over the buffers.
#[allow(clippy::too_many_arguments)]
fn launch<T: SampleElem>(
    rt: &Runtime,
    logits: &DeviceBuffer,
    stride: u32,
    vocab: u32,
    rows: u32,
    ids: &DeviceBuffer,
    pos: Option<&DeviceBuffer>,
    presence: Option<&DeviceBuffer>,
    params: SamplingParams,
) -> Result<(), String> {
    let call = SampleCall::<T> {
        logits: logits.as_ptr(),
        row_stride: stride,
        vocab,
        rows,
        ids_out: ids.as_mut_ptr(),
        pos: pos.map_or(DevicePtrMut::NULL, |b| b.as_mut_ptr()),
        presence: presence.map_or(DevicePtrMut::NULL, |b| b.as_mut_ptr()),
        params,
        row_cfg: stoke_cuda::DevicePtr::NULL,
        lane_of: stoke_cuda::DevicePtr::NULL,
    };
    // SAFETY: every buffer is allocated at the sizes the call names and outlives the kernel
    // (freed on Stoke's stream).
    unsafe { sample(rt, &call) }.map_err(|e| e.to_string())
}

/// The reference's token for every row (rows in parallel).
fn reference_ids(
    host: &[f32],
    stride: u32,
    vocab: u32,
    presence: Option<&[u32]>,
    params: &reference::SamplingParams,
    counters: &[u32],
) -> Vec<u32> {
    let words = vocab.div_ceil(32) as usize;
    let rows = counters.len();
    let mut out = vec![0u32; rows];
    std::thread::scope(|s| {
        let per = rows.div_ceil(8).max(1);
        for (c, chunk) in out.chunks_mut(per).enumerate() {
            s.spawn(move || {
                for (j, id) in chunk.iter_mut().enumerate() {
                    let r = c * per + j;
                    let row = &host[r * stride as usize..r * stride as usize + vocab as usize];
                    let pres = presence.map(|p| &p[r * words..(r + 1) * words]);
                    *id = reference::sample_row(row, pres, params, counters[r], r as u32);
                }
            });
        }
    });
    out
}

/// Agreement tallies of one configuration.
#[derive(Default)]
struct Tally {
    draws: u64,
    agree: u64,
}

/// Every configuration on one logits tensor: `DRAWS` launches, each checked against the
/// reference, then a replay of the first counters.
#[allow(clippy::too_many_arguments)]
fn check_shape<T: SampleElem>(
    rt: &Arc<Runtime>,
    rng: &mut StdRng,
    dtype: &str,
    vocab: u32,
    rows: u32,
    stride: u32,
    host: &[f32],
    dev: &DeviceBuffer,
    tallies: &mut [Tally],
) -> Result<(), String> {
    let words = vocab.div_ceil(32);
    let what = |name: &str, pen: f32| {
        format!("{dtype} vocab {vocab} rows {rows} stride {stride} {name} penalty {pen}")
    };
    for (ci, &(name, temperature, top_k, top_p)) in CONFIGS.iter().enumerate() {
        for &pen in PENALTIES {
            let seed = rng.random::<u64>();
            let cuda = SamplingParams {
                temperature,
                top_k,
                top_p,
                repetition_penalty: pen,
                seed,
            };
            let host_params = reference::SamplingParams {
                temperature,
                top_k,
                top_p,
                repetition_penalty: pen,
                seed,
            };
            // About one token in 32 present.
            let presence0: Vec<u32> = (0..rows * words)
                .map(|_| (0..4).fold(rng.random::<u32>(), |a, _| a & rng.random::<u32>()))
                .collect();
            let pos0: Vec<u32> = (0..rows).map(|_| rng.random_range(0..1_000_000)).collect();
            let (pres_buf, pos_buf) = (put_u32(rt, &presence0), put_u32(rt, &pos0));
            let ids = rt.alloc(rows as usize * 4).unwrap();
            let (mut presence, mut pos) = (presence0.clone(), pos0.clone());
            let mut first = Vec::new();
            for draw in 0..DRAWS {
                launch::<T>(
                    rt,
                    dev,
                    stride,
                    vocab,
                    rows,
                    &ids,
                    Some(&pos_buf),
                    Some(&pres_buf),
                    cuda,
                )?;
                let got = get_u32(&ids)?;
                let want = reference_ids(host, stride, vocab, Some(&presence), &host_params, &pos);
                let w = what(name, pen);
                if let Some(r) = got.iter().position(|&id| id >= vocab) {
                    return Err(format!(
                        "{w}: row {r} got token {} (unwritten or out of range)",
                        got[r]
                    ));
                }
                if temperature <= 0.0 && got != want {
                    let r = (0..rows as usize).find(|&r| got[r] != want[r]).unwrap();
                    return Err(format!(
                        "{w}: greedy row {r} picked {} not {}",
                        got[r], want[r]
                    ));
                }
                let t = &mut tallies[ci];
                t.draws += rows as u64;
                t.agree += got.iter().zip(&want).filter(|(g, w)| g == w).count() as u64;
                let pos_dev = get_u32(&pos_buf)?;
                for r in 0..rows as usize {
                    pos[r] += 1;
                    presence[r * words as usize + (got[r] / 32) as usize] |= 1 << (got[r] % 32);
                }
                if pos_dev != pos {
                    return Err(format!(
                        "{w}: draw {draw}: counters {pos_dev:?}, expected {pos:?}"
                    ));
                }
                if get_u32(&pres_buf)? != presence {
                    return Err(format!(
                        "{w}: draw {draw}: the presence bitmap is not the old one plus the chosen tokens"
                    ));
                }
                if draw == 0 {
                    first = got;
                }
            }
            // The same counters (and history) again: the same tokens.
            set_u32(&pos_buf, &pos0);
            set_u32(&pres_buf, &presence0);
            launch::<T>(
                rt,
                dev,
                stride,
                vocab,
                rows,
                &ids,
                Some(&pos_buf),
                Some(&pres_buf),
                cuda,
            )?;
            if get_u32(&ids)? != first {
                return Err(format!(
                    "{}: a replay of the first counters picked other tokens",
                    what(name, pen)
                ));
            }
        }
    }
    // No counters and no bitmap: counter 0, nothing written back.
    let p = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 0.95,
        repetition_penalty: 1.0,
        seed: 11,
    };
    let ids = rt.alloc(rows as usize * 4).unwrap();
    launch::<T>(rt, dev, stride, vocab, rows, &ids, None, None, p)?;
    let want = reference_ids(
        host,
        stride,
        vocab,
        None,
        &reference::SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.95,
            repetition_penalty: 1.0,
            seed: 11,
        },
        &vec![0; rows as usize],
    );
    let got = get_u32(&ids)?;
    let t = &mut tallies[CONFIGS.len()];
    t.draws += rows as u64;
    t.agree += got.iter().zip(&want).filter(|(g, w)| g == w).count() as u64;
    Ok(())
}

/// µs of one launch of each configuration (mean of 20 launches, median of 5).
fn time_shape<T: SampleElem>(
    rt: &Arc<Runtime>,
    dev: &DeviceBuffer,
    vocab: u32,
    rows: u32,
    stride: u32,
) -> Result<Value, String> {
    let words = vocab.div_ceil(32) as usize;
    let pos = put_u32(rt, &vec![0; rows as usize]);
    let pres = put_u32(rt, &vec![0; rows as usize * words]);
    let ids = rt.alloc(rows as usize * 4).unwrap();
    let mut us = json!({});
    for &(name, temperature, top_k, top_p) in CONFIGS {
        let p = SamplingParams {
            temperature,
            top_k,
            top_p,
            repetition_penalty: 1.1,
            seed: 3,
        };
        launch::<T>(
            rt,
            dev,
            stride,
            vocab,
            rows,
            &ids,
            Some(&pos),
            Some(&pres),
            p,
        )?;
        us[name] = json!(crate::bench::time_events(rt, 5, 20, |_| {
            launch::<T>(
                rt,
                dev,
                stride,
                vocab,
                rows,
                &ids,
                Some(&pos),
                Some(&pres),
                p,
            )
            .unwrap()
        }));
    }
    Ok(us)
}

/// f32 and bf16 logits, vocab 49152 and 128256, 1 to 32 rows (some with a padded or an
/// unaligned row stride), every configuration with and without the penalty.
pub fn sample_matches_reference() -> Result<Value, String> {
    let rt = crate::gpu()?;
    rt.set_poison_allocations(true);
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tallies: Vec<Tally> = (0..=CONFIGS.len()).map(|_| Tally::default()).collect();
    let mut timings = Vec::new();
    for dtype in ["f32", "bf16"] {
        for &vocab in VOCABS {
            for &rows in ROWS {
                // Padded rows, and rows 4-byte apart only (the kernel's scalar path).
                let stride = match rows {
                    3 => vocab + 8,
                    8 => vocab + 1,
                    _ => vocab,
                };
                let host = logits(&mut rng, rows, vocab, stride, dtype == "bf16");
                let (dev, us) = if dtype == "f32" {
                    let bytes: Vec<u8> = host.iter().flat_map(|x| x.to_le_bytes()).collect();
                    let dev = rt.alloc(bytes.len()).unwrap();
                    unsafe { rt.copy_htod(dev.ptr(), &bytes) }.unwrap();
                    check_shape::<f32>(
                        &rt,
                        &mut rng,
                        dtype,
                        vocab,
                        rows,
                        stride,
                        &host,
                        &dev,
                        &mut tallies,
                    )?;
                    let us = time_shape::<f32>(&rt, &dev, vocab, rows, stride)?;
                    (dev, us)
                } else {
                    let bytes: Vec<u8> = host
                        .iter()
                        .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
                        .collect();
                    let dev = rt.alloc(bytes.len()).unwrap();
                    unsafe { rt.copy_htod(dev.ptr(), &bytes) }.unwrap();
                    check_shape::<half::bf16>(
                        &rt,
                        &mut rng,
                        dtype,
                        vocab,
                        rows,
                        stride,
                        &host,
                        &dev,
                        &mut tallies,
                    )?;
                    let us = time_shape::<half::bf16>(&rt, &dev, vocab, rows, stride)?;
                    (dev, us)
                };
                drop(dev);
                timings.push(json!({"dtype": dtype, "vocab": vocab, "rows": rows, "stride": stride, "us": us}));
            }
        }
    }
    rt.set_poison_allocations(false);
    let mut agreement = json!({});
    let mut failures = Vec::new();
    let names = CONFIGS.iter().map(|c| c.0).chain(["no_counters"]);
    for (name, t) in names.zip(&tallies) {
        let rate = t.agree as f64 / t.draws.max(1) as f64;
        agreement[name] = json!({"draws": t.draws, "agree": t.agree, "rate": rate});
        if !(rate >= MIN_AGREEMENT) {
            failures.push(format!("{name}: {} of {} draws agree", t.agree, t.draws));
        }
    }
    if !failures.is_empty() {
        return Err(format!(
            "seed {seed}: sampled tokens differ from the reference: {failures:?}; {agreement}"
        ));
    }
    Ok(
        json!({"seed": seed, "draws_per_config": DRAWS, "agreement": agreement, "launch_us": timings}),
    )
}

/// Each lane its own settings (`row_cfg`), rows scattered to lanes (`lane_of`), an inactive
/// lane skipped, and the log-probability kernel: 6 rows of f32 and of bf16 logits (vocab
/// 49152) into 10 lanes, 4 draws each, against the reference with every lane's own settings,
/// counter and stream; the inactive lane's id, counter and presence words untouched; the
/// log-probabilities of the chosen and the top tokens against `logprobs_row` (f64).
pub fn lane_sampling_matches_reference() -> Result<Value, String> {
    use stoke_cuda::DevicePtr;
    use stoke_cuda::sample::{ROW_ACTIVE, ROW_LOGPROB, RowSample, logprobs};
    let rt = crate::gpu()?;
    let seed = crate::seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let (vocab, rows, lanes) = (49152u32, 6usize, 10usize);
    let words = vocab.div_ceil(32) as usize;
    let lane_of: [u32; 6] = [7, 2, 9, 0, 5, 3];
    let (mut agree, mut draws, mut lp_worst) = (0usize, 0usize, 0f32);
    for dtype in ["f32", "bf16"] {
        let host = logits(&mut rng, rows as u32, vocab, vocab, dtype == "bf16");
        let dev = if dtype == "f32" {
            let b: Vec<u8> = host.iter().flat_map(|x| x.to_le_bytes()).collect();
            crate::int4::put_u8(&rt, &b)
        } else {
            let b: Vec<u8> = host
                .iter()
                .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
                .collect();
            crate::int4::put_u8(&rt, &b)
        };
        // Settings: greedy, sampled with each filter, a penalty, log-probabilities on some;
        // row 4's lane inactive.
        let cfg: Vec<RowSample> = (0..lanes)
            .map(|l| RowSample {
                seed: rng.random(),
                temperature: if l % 3 == 0 {
                    0.0
                } else {
                    0.7 + 0.1 * l as f32
                },
                top_k: if l % 4 == 1 { 40 } else { 0 },
                top_p: if l % 4 == 2 { 0.9 } else { 1.0 },
                repetition_penalty: if l % 2 == 0 { 1.2 } else { 1.0 },
                stream: l as u32 * 7,
                flags: if l == 5 {
                    0
                } else {
                    ROW_ACTIVE
                        | if l % 2 == 1 {
                            ROW_LOGPROB | (3 + l as u32) << 8
                        } else {
                            0
                        }
                },
            })
            .collect();
        let cfg_bytes: Vec<u8> = cfg.iter().flat_map(|r| r.to_le_bytes()).collect();
        let cfg_dev = crate::int4::put_u8(&rt, &cfg_bytes);
        let lane_dev = put_u32(&rt, &lane_of);
        let mut pos: Vec<u32> = (0..lanes).map(|_| rng.random_range(0..100_000)).collect();
        let mut presence: Vec<u32> = (0..lanes * words)
            .map(|_| (0..4).fold(rng.random::<u32>(), |a, _| a & rng.random::<u32>()))
            .collect();
        let mut ids: Vec<u32> = vec![0xdead_beef; lanes];
        let (pos_dev, pres_dev, ids_dev) = (
            put_u32(&rt, &pos),
            put_u32(&rt, &presence),
            put_u32(&rt, &ids),
        );
        let lp_dev = rt.alloc(rows * 42 * 4).map_err(|e| e.to_string())?;
        for draw in 0..4 {
            let run = |call: &SampleCall<f32>| unsafe {
                sample(&rt, call).and_then(|_| logprobs(&rt, call, lp_dev.as_mut_ptr()))
            };
            let call = SampleCall::<f32> {
                logits: dev.as_ptr(),
                row_stride: vocab,
                vocab,
                rows: rows as u32,
                ids_out: ids_dev.as_mut_ptr(),
                pos: pos_dev.as_mut_ptr(),
                presence: pres_dev.as_mut_ptr(),
                params: SamplingParams::GREEDY,
                row_cfg: cfg_dev.as_ptr(),
                lane_of: lane_dev.as_ptr(),
            };
            let r = if dtype == "f32" {
                run(&call)
            } else {
                let c = SampleCall::<half::bf16> {
                    logits: DevicePtr::new(call.logits.addr()),
                    row_stride: call.row_stride,
                    vocab: call.vocab,
                    rows: call.rows,
                    ids_out: call.ids_out,
                    pos: call.pos,
                    presence: call.presence,
                    params: call.params,
                    row_cfg: call.row_cfg,
                    lane_of: call.lane_of,
                };
                unsafe { sample(&rt, &c).and_then(|_| logprobs(&rt, &c, lp_dev.as_mut_ptr())) }
            };
            r.map_err(|e| e.to_string())?;
            let (got_ids, got_pos, got_pres) =
                (get_u32(&ids_dev)?, get_u32(&pos_dev)?, get_u32(&pres_dev)?);
            let lp = get_u32(&lp_dev)?;
            for (r, &lane) in lane_of.iter().enumerate() {
                let l = lane as usize;
                let c = cfg[l];
                let row = &host[r * vocab as usize..(r + 1) * vocab as usize];
                let what = format!("seed {seed} {dtype} draw {draw} row {r} lane {l}");
                if c.flags & ROW_ACTIVE == 0 {
                    if got_ids[l] != ids[l]
                        || got_pos[l] != pos[l]
                        || got_pres[l * words..(l + 1) * words]
                            != presence[l * words..(l + 1) * words]
                    {
                        return Err(format!("{what}: an inactive lane was written"));
                    }
                    continue;
                }
                let params = reference::SamplingParams {
                    temperature: c.temperature,
                    top_k: c.top_k,
                    top_p: c.top_p,
                    repetition_penalty: c.repetition_penalty,
                    seed: c.seed,
                };
                let want = reference::sample_row(
                    row,
                    Some(&presence[l * words..(l + 1) * words]),
                    &params,
                    pos[l],
                    c.stream,
                );
                let got = got_ids[l];
                if got >= vocab {
                    return Err(format!("{what}: token {got}"));
                }
                if c.temperature <= 0.0 && got != want {
                    return Err(format!("{what}: greedy picked {got}, not {want}"));
                }
                draws += 1;
                agree += usize::from(got == want);
                ids[l] = got;
                pos[l] += 1;
                presence[l * words + got as usize / 32] |= 1 << (got % 32);
                if got_pos[l] != pos[l] {
                    return Err(format!("{what}: counter {} not {}", got_pos[l], pos[l]));
                }
                if c.flags & ROW_LOGPROB != 0 {
                    let top = (c.flags >> 8) as usize;
                    let (want_lp, want_top) = reference::logprobs_row(row, got, top);
                    let at = r * 42;
                    let f = |i: usize| f32::from_bits(lp[at + i]);
                    let mut worst = (f(1) - want_lp).abs();
                    if lp[at] != got {
                        return Err(format!(
                            "{what}: log-probability row names token {}",
                            lp[at]
                        ));
                    }
                    for (j, &(tok, v)) in want_top.iter().enumerate() {
                        let (gt, gv) = (lp[at + 2 + 2 * j], f(3 + 2 * j));
                        if gt != tok {
                            return Err(format!("{what}: top {j} is {gt}, not {tok}"));
                        }
                        worst = worst.max((gv - v).abs());
                    }
                    if !(worst < 2e-3) {
                        return Err(format!("{what}: log-probabilities off by {worst}"));
                    }
                    lp_worst = lp_worst.max(worst);
                }
            }
            if got_pres != presence {
                return Err(format!(
                    "seed {seed} {dtype} draw {draw}: presence words differ"
                ));
            }
        }
    }
    if (agree as f64) < MIN_AGREEMENT * draws as f64 {
        return Err(format!(
            "seed {seed}: {agree} of {draws} draws agree with the reference"
        ));
    }
    Ok(json!({"seed": seed, "draws": draws, "agree": agree, "logprob_max_abs_err": lp_worst}))
}
