//! Token sampling: the CPU reference of `kernels/sample.cu`, written the plain way (sorting
//! where the kernel selects by radix), with the kernel's arithmetic so the two pick the same
//! token.
//!
//! One row of logits becomes one token:
//!
//! 1. NaN logits count as `-inf`. Repetition penalty `p` (HF's rule): the logit `l` of a token
//!    already in the sequence (its bit set in the presence bitmap) becomes `l / p` if `l > 0`,
//!    else `l * p`.
//! 2. Temperature `<= 0`: greedy, the argmax, ties to the lowest index.
//! 3. Otherwise `l' = l / T` (a `-0` result counts as `+0`). Top-k keeps the tokens with
//!    `l' >= t_k`, `t_k` the k-th largest `l'` (ties at the threshold kept).
//! 4. Each kept token weighs `w = exp(l' - max)` as a fixed-point integer ([`weight`]: the
//!    exponential by a fixed sequence of f32 operations, times 2^40, truncated). Sums of weights
//!    are exact integers, so they do not depend on the order the kernel adds them in.
//! 5. Top-p keeps, among the kept, the tokens with `l' >= t_p`, `t_p` the largest value such that
//!    the weight of `{l' >= t_p}` is at least `top_p` times the kept weight ([`ceil_mul`]).
//! 6. `u` in `[0, 1)` from Philox4x32-10 ([`uniform`]); the token is the first in index order
//!    whose running (inclusive) weight exceeds `u` times the kept weight.

/// Fixed-point weight of the largest logit: `exp(0)` times 2^40.
pub const WEIGHT_ONE: u64 = 1 << 40;

/// Below this `l' - max` a token weighs nothing (`exp(-28) * 2^40 < 1`).
pub const WEIGHT_CUTOFF: f32 = -28.0;

/// Sampling settings of one decode step; every row of a batch uses the same.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// `<= 0`: greedy.
    pub temperature: f32,
    /// Keep the `top_k` largest logits (ties at the threshold kept); 0: off.
    pub top_k: u32,
    /// Keep the smallest head of the distribution holding at least this share of the mass;
    /// `>= 1`: off.
    pub top_p: f32,
    /// Divides positive and multiplies negative logits of tokens already present; 1: off.
    pub repetition_penalty: f32,
    /// Philox key: the low 32 bits, then the high 32 bits.
    pub seed: u64,
}

impl SamplingParams {
    /// Argmax, no penalty.
    pub const GREEDY: Self = Self {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        repetition_penalty: 1.0,
        seed: 0,
    };
}

const PHILOX_M0: u32 = 0xD251_1F53;
const PHILOX_M1: u32 = 0xCD9E_8D57;
const PHILOX_W0: u32 = 0x9E37_79B9;
const PHILOX_W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds (Salmon et al., Random123).
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(PHILOX_W0), k[1].wrapping_add(PHILOX_W1)];
        }
        let p0 = u64::from(PHILOX_M0) * u64::from(c[0]);
        let p1 = u64::from(PHILOX_M1) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The 24 random bits of draw `counter` of row `row`: the first Philox word of counter
/// `(counter, row, 0, 0)` under key `(seed low, seed high)`, shifted right by 8.
pub fn uniform_bits(seed: u64, counter: u32, row: u32) -> u32 {
    philox4x32_10([counter, row, 0, 0], [seed as u32, (seed >> 32) as u32])[0] >> 8
}

/// The draw as a number in `[0, 1)`: [`uniform_bits`] times 2^-24.
pub fn uniform(seed: u64, counter: u32, row: u32) -> f32 {
    uniform_bits(seed, counter, row) as f32 * (1.0 / 16_777_216.0)
}

const LOG2E: u32 = 0x3fb8_aa3b;
const LN2_HI: u32 = 0x3f31_7200;
const LN2_LO: u32 = 0x35bf_be8e;
/// 1/7!, 1/6!, ..., 1/2!, 1, 1 as f32 bit patterns (Horner order).
const EXP_POLY: [u32; 8] = [
    0x3950_0d01,
    0x3ab6_0b61,
    0x3c08_8889,
    0x3d2a_aaab,
    0x3e2a_aaab,
    0x3f00_0000,
    0x3f80_0000,
    0x3f80_0000,
];

/// `exp(x) * 2^40` truncated to an integer, for `x = l' - max <= 0`, by exactly the f32
/// operations the kernel uses (each correctly rounded, so both compute the same bits):
/// `n = rint(x * log2 e)`, `r = x - n ln 2` (two-constant Cody-Waite), the degree-7 Taylor
/// polynomial of `exp(r)` by Horner with fused multiply-adds, times `2^(n + 40)`. Relative
/// error about 1e-7. 0 below [`WEIGHT_CUTOFF`] (and for NaN); `x == 0` gives [`WEIGHT_ONE`].
pub fn weight(x: f32) -> u64 {
    if x.is_nan() || x < WEIGHT_CUTOFF {
        return 0;
    }
    let f = f32::from_bits;
    let n = (x * f(LOG2E)).round_ties_even();
    let r = n.mul_add(-f(LN2_HI), x);
    let r = n.mul_add(-f(LN2_LO), r);
    let mut p = f(EXP_POLY[0]);
    for c in &EXP_POLY[1..] {
        p = p.mul_add(r, f(*c));
    }
    let scale = f((((n as i32) + 40 + 127) as u32) << 23);
    (p * scale) as u64
}

/// Weight of a token with scaled logit `lp` when the largest is `max`: [`WEIGHT_ONE`] for the
/// largest itself (so infinite logits work), else `weight(lp - max)`.
pub fn weight_of(lp: f32, max: f32) -> u64 {
    if lp == max {
        WEIGHT_ONE
    } else {
        weight(lp - max)
    }
}

/// `ceil(p * z)` exactly, at least 1: the weight top-p must reach, for `0 < p < 1` (`p <= 0`
/// gives 1).
pub fn ceil_mul(p: f32, z: u64) -> u64 {
    if p.is_nan() || p <= 0.0 {
        return 1;
    }
    let bits = p.to_bits();
    let e = (bits >> 23) & 0xff;
    let mant = u128::from(if e == 0 {
        bits & 0x7f_ffff
    } else {
        (bits & 0x7f_ffff) | 0x80_0000
    });
    // p = mant * 2^-shift; shift >= 24 for p < 1.
    let shift = 150 - e.max(1);
    let prod = mant * u128::from(z);
    let q = if shift >= 128 {
        u128::from(prod != 0)
    } else {
        (prod + (1u128 << shift) - 1) >> shift
    };
    (q as u64).max(1)
}

/// The draw's target: `floor(bits * total / 2^24)`; the chosen token is the first whose running
/// weight exceeds it (running > u * total, exactly).
pub fn target(bits: u32, total: u64) -> u64 {
    ((u128::from(bits) * u128::from(total)) >> 24) as u64
}

/// Whether token `i`'s bit is set in a presence row.
fn present(presence: Option<&[u32]>, i: usize) -> bool {
    presence.is_some_and(|p| p[i / 32] >> (i % 32) & 1 != 0)
}

/// The logits after the NaN rule and the repetition penalty (step 1).
pub fn penalized(logits: &[f32], presence: Option<&[u32]>, penalty: f32) -> Vec<f32> {
    logits
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            let l = if l.is_nan() { f32::NEG_INFINITY } else { l };
            if penalty != 1.0 && present(presence, i) {
                if l > 0.0 { l / penalty } else { l * penalty }
            } else {
                l
            }
        })
        .collect()
}

/// Index of the largest value, the lowest on ties (0 for an empty or all-`-inf` row).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Picks the token of one row of `logits` (`[vocab]`, f32: bf16 logits widened), given the
/// row's presence bitmap (`[(vocab + 31) / 32]` words, bit `i % 32` of word `i / 32` for token
/// `i`; `None`: no token present), the draw `counter` (the row's position) and `row` (the
/// draw's stream, Philox counter word 1: the row's index in the batch, or a request's own).
/// The module doc states the algorithm.
///
/// # Panics
/// If `logits` is empty or `presence` is shorter than `(vocab + 31) / 32`.
pub fn sample_row(
    logits: &[f32],
    presence: Option<&[u32]>,
    params: &SamplingParams,
    counter: u32,
    row: u32,
) -> u32 {
    let n = logits.len();
    assert!(n > 0, "an empty row of logits");
    if let Some(p) = presence {
        assert!(p.len() >= n.div_ceil(32), "presence row too short");
    }
    let l = penalized(logits, presence, params.repetition_penalty);
    if params.temperature.is_nan() || params.temperature <= 0.0 {
        return argmax(&l);
    }
    // `+ 0.0` turns -0 into +0, so that equal values have one bit pattern.
    let lp: Vec<f32> = l.iter().map(|&x| x / params.temperature + 0.0).collect();
    let max = lp.iter().copied().fold(f32::NEG_INFINITY, f32::max);

    let mut threshold = f32::NEG_INFINITY;
    let k = params.top_k as usize;
    if k > 0 && k < n {
        // The k-th largest (no NaN here).
        let mut v = lp.clone();
        threshold = *v.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a)).1;
    }
    let w: Vec<u64> = lp
        .iter()
        .map(|&x| if x >= threshold { weight_of(x, max) } else { 0 })
        .collect();
    if params.top_p < 1.0 {
        let need = ceil_mul(params.top_p, w.iter().sum());
        // The largest value whose upper set (ties included) weighs at least `need`.
        let mut kept: Vec<(f32, u64)> = lp
            .iter()
            .zip(&w)
            .filter(|(x, _)| **x >= threshold)
            .map(|(&x, &wi)| (x, wi))
            .collect();
        kept.sort_by(|a, b| b.0.total_cmp(&a.0));
        let mut acc = 0u64;
        let mut i = 0;
        while i < kept.len() {
            let v = kept[i].0;
            while i < kept.len() && kept[i].0 == v {
                acc += kept[i].1;
                i += 1;
            }
            if acc >= need {
                threshold = v;
                break;
            }
        }
    }
    let w: Vec<u64> = lp
        .iter()
        .zip(&w)
        .map(|(&x, &wi)| if x >= threshold { wi } else { 0 })
        .collect();
    let total: u64 = w.iter().sum();
    let t = target(uniform_bits(params.seed, counter, row), total);
    let mut acc = 0u64;
    for (i, &wi) in w.iter().enumerate() {
        acc += wi;
        if acc > t {
            return i as u32;
        }
    }
    unreachable!("the largest logit always weighs WEIGHT_ONE")
}

/// Log-probabilities of one row of raw logits (the log-softmax, no penalty, no temperature; NaN
/// counts as `-inf`), computed in f64: of token `id` (`-inf` past the vocabulary), and of the
/// `top` largest logits in order (ties to the lower index) as `(token, logprob)`. The reference
/// of the log-probability kernel (`kernels/sample.cu`), which sums in f32.
pub fn logprobs_row(logits: &[f32], id: u32, top: usize) -> (f32, Vec<(u32, f32)>) {
    let clean = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
    let max = logits
        .iter()
        .map(|&x| clean(x))
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (clean(x) as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    let lp = |x: f32| (clean(x) as f64 - lse) as f32;
    let chosen = logits
        .get(id as usize)
        .map_or(f32::NEG_INFINITY, |&x| lp(x));
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    order.sort_by(|&a, &b| {
        clean(logits[b as usize])
            .total_cmp(&clean(logits[a as usize]))
            .then(a.cmp(&b))
    });
    let tops = order
        .into_iter()
        .take(top)
        .map(|i| (i, lp(logits[i as usize])))
        .collect();
    (chosen, tops)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_the_log_softmax_with_the_top_in_order() {
        let l = [1.0f32, 3.0, f32::NAN, 3.0, -2.0];
        let (c, top) = logprobs_row(&l, 1, 3);
        let z: f64 = [1.0f64, 3.0, 3.0, -2.0].iter().map(|x| x.exp()).sum();
        assert!((c as f64 - (3.0 - z.ln())).abs() < 1e-6);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 0]);
        assert!((top[2].1 as f64 - (1.0 - z.ln())).abs() < 1e-6);
        let total: f64 = (0..5)
            .map(|i| (logprobs_row(&l, i, 0).0 as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(logprobs_row(&l, 9, 0).0, f32::NEG_INFINITY);
    }

    /// A small deterministic generator for test logits (SplitMix64).
    struct Mix(u64);
    impl Mix {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        /// Uniform in [-a, a).
        fn f32(&mut self, a: f32) -> f32 {
            ((self.next() >> 40) as f32 / 16_777_216.0 * 2.0 - 1.0) * a
        }
    }

    fn sampled(t: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            seed: 0x1234_5678_9abc_def0,
            ..SamplingParams::GREEDY
        }
    }

    #[test]
    fn philox_known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn uniform_is_in_unit_interval_and_keyed() {
        for c in 0..1000 {
            let u = uniform(7, c, 3);
            assert!((0.0..1.0).contains(&u));
        }
        assert_eq!(uniform(7, 5, 3), uniform(7, 5, 3));
        assert_ne!(uniform(7, 5, 3), uniform(7, 6, 3));
        assert_ne!(uniform(7, 5, 3), uniform(7, 5, 4));
        assert_ne!(uniform(7, 5, 3), uniform(8 << 32 | 7, 5, 3));
    }

    #[test]
    fn weight_is_exp_in_fixed_point() {
        assert_eq!(weight(0.0), WEIGHT_ONE);
        assert_eq!(weight(-30.0), 0);
        assert_eq!(weight(f32::NEG_INFINITY), 0);
        assert_eq!(weight(f32::NAN), 0);
        let mut prev = WEIGHT_ONE;
        for i in 1..=27_000 {
            let x = -(i as f32) * 1e-3;
            let w = weight(x);
            let exact = (x as f64).exp() * WEIGHT_ONE as f64;
            assert!(
                ((w as f64 - exact) / exact).abs() < 3e-7 + 1.0 / exact,
                "x {x}: {w} vs {exact}"
            );
            assert!(w <= prev, "not monotone at {x}");
            prev = w;
        }
        assert_eq!(weight_of(f32::INFINITY, f32::INFINITY), WEIGHT_ONE);
        assert_eq!(weight_of(1.0, f32::INFINITY), 0);
    }

    #[test]
    fn ceil_mul_is_exact() {
        assert_eq!(ceil_mul(0.5, 10), 5);
        assert_eq!(ceil_mul(0.5, 11), 6);
        assert_eq!(ceil_mul(0.75, 4), 3);
        assert_eq!(
            ceil_mul(0.9, 1 << 40),
            (0.9f32 as f64 * (1u64 << 40) as f64).ceil() as u64
        );
        assert_eq!(ceil_mul(1e-30, 1 << 50), 1);
        assert_eq!(ceil_mul(f32::from_bits(1), u64::MAX), 1);
        assert_eq!(ceil_mul(0.0, 100), 1);
        let z = (1u64 << 58) - 12345;
        let p = f32::from_bits(0x3f7f_ffff); // 1 - 2^-24
        assert_eq!(
            u128::from(ceil_mul(p, z)),
            (u128::from(z) * 16_777_215).div_ceil(1 << 24)
        );
        assert_eq!(target(0, 1000), 0);
        assert_eq!(target((1 << 24) - 1, 1 << 24), (1 << 24) - 1);
    }

    #[test]
    fn greedy_is_argmax_with_lowest_index_ties() {
        let p = SamplingParams::GREEDY;
        assert_eq!(sample_row(&[1.0, 3.0, 3.0, 2.0], None, &p, 0, 0), 1);
        assert_eq!(sample_row(&[-5.0, -5.0], None, &p, 0, 0), 0);
        assert_eq!(
            sample_row(&[f32::NEG_INFINITY, f32::NEG_INFINITY], None, &p, 0, 0),
            0
        );
        assert_eq!(sample_row(&[f32::NAN, 1.0, f32::NAN], None, &p, 0, 0), 1);
        let neg = SamplingParams {
            temperature: -1.0,
            ..p
        };
        assert_eq!(sample_row(&[0.0, 0.5, 0.25], None, &neg, 9, 9), 1);
        let mut rng = Mix(1);
        for _ in 0..50 {
            let v: Vec<f32> = (0..1000).map(|_| rng.f32(5.0)).collect();
            let best = (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b });
            assert_eq!(sample_row(&v, None, &p, 0, 0), best as u32);
        }
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut rng = Mix(2);
        for c in 0..200 {
            let v: Vec<f32> = (0..500).map(|_| rng.f32(3.0)).collect();
            let p = SamplingParams {
                top_k: 1,
                ..sampled(0.8)
            };
            let greedy = sample_row(&v, None, &SamplingParams::GREEDY, c, 0);
            assert_eq!(sample_row(&v, None, &p, c, c % 7), greedy);
        }
    }

    #[test]
    fn penalty_divides_positive_and_multiplies_negative() {
        let presence = [0b01u32];
        let pen = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::GREEDY
        };
        // 2.0 / 2 = 1.0 < 1.5.
        assert_eq!(
            sample_row(&[2.0, 1.5, -1.0], Some(&presence), &pen, 0, 0),
            1
        );
        assert_eq!(sample_row(&[2.0, 1.5, -1.0], None, &pen, 0, 0), 0);
        // -1.0 * 2 = -2.0 < -1.5.
        assert_eq!(sample_row(&[-1.0, -1.5], Some(&presence), &pen, 0, 0), 1);
        assert_eq!(
            penalized(&[2.0, -1.0, 4.0, f32::NAN], Some(&[0b1011]), 2.0),
            vec![1.0, -2.0, 4.0, f32::NEG_INFINITY]
        );
        // A penalty below 1 favors present tokens.
        let favor = SamplingParams {
            repetition_penalty: 0.5,
            ..SamplingParams::GREEDY
        };
        assert_eq!(sample_row(&[1.0, 1.5], Some(&presence), &favor, 0, 0), 0);
        // Bits past word 0.
        let mut words = vec![0u32; 3];
        words[2] = 1 << 3; // token 67
        let mut v = vec![0.0f32; 70];
        v[67] = 3.0;
        v[10] = 2.0;
        assert_eq!(sample_row(&v, Some(&words), &pen, 0, 0), 10);
    }

    /// Draw counts over `draws` counters.
    fn counts(v: &[f32], p: &SamplingParams, draws: u32) -> Vec<u64> {
        let mut c = vec![0u64; v.len()];
        for i in 0..draws {
            c[sample_row(v, None, p, i, 5) as usize] += 1;
        }
        c
    }

    fn chi_square(c: &[u64], probs: &[f64]) -> f64 {
        let n: u64 = c.iter().sum();
        c.iter()
            .zip(probs)
            .filter(|(_, p)| **p > 0.0)
            .map(|(&o, &p)| {
                let e = p * n as f64;
                (o as f64 - e).powi(2) / e
            })
            .sum()
    }

    fn softmax(v: &[f32], t: f32) -> Vec<f64> {
        let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = v
            .iter()
            .map(|&x| ((x as f64 - m) / t as f64).exp())
            .collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    #[test]
    fn frequencies_follow_softmax() {
        let v = [1.0f32, 0.5, -0.3, 2.0, 0.0, -1.5, 1.2, 0.7];
        for t in [1.0f32, 0.7, 2.5] {
            let c = counts(&v, &sampled(t), 200_000);
            let chi = chi_square(&c, &softmax(&v, t));
            // 7 degrees of freedom: P(chi2 > 35) is about 1e-5.
            assert!(chi < 35.0, "T {t}: chi-square {chi}, counts {c:?}");
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_sufficient_head() {
        // Probabilities 0.5, 0.3, 0.15, 0.05 (in a shuffled order).
        let probs = [0.15f32, 0.5, 0.05, 0.3];
        let v: Vec<f32> = probs.iter().map(|p| p.ln()).collect();
        let p = |top_p| SamplingParams {
            top_p,
            ..sampled(1.0)
        };
        // 0.5 + 0.3 >= 0.75: tokens 1 and 3, in the ratio 5 : 3.
        let c = counts(&v, &p(0.75), 80_000);
        assert_eq!((c[0], c[2]), (0, 0), "{c:?}");
        assert!(chi_square(&c, &[0.0, 0.625, 0.0, 0.375]) < 20.0, "{c:?}");
        // 0.5 alone reaches 0.5.
        let c = counts(&v, &p(0.5), 1000);
        assert_eq!(c[1], 1000, "{c:?}");
        // 0.85 needs the third.
        let c = counts(&v, &p(0.85), 80_000);
        assert_eq!(c[2], 0, "{c:?}");
        assert!(c[0] > 0 && c[1] > 0 && c[3] > 0, "{c:?}");
        assert!(
            chi_square(&c, &[0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95]) < 25.0,
            "{c:?}"
        );
        // Off at 1.
        let c = counts(&v, &p(1.0), 80_000);
        assert!(c.iter().all(|&x| x > 0), "{c:?}");
        // After top-k 2 the kept mass is 0.8: 0.6 of it is 0.48, reached by 0.5 alone.
        let kp = SamplingParams { top_k: 2, ..p(0.6) };
        assert_eq!(counts(&v, &kp, 500)[1], 500);
        // 0.7 of 0.8 is 0.56: both.
        let kp = SamplingParams { top_k: 2, ..p(0.7) };
        let c = counts(&v, &kp, 20_000);
        assert!(c[1] > 0 && c[3] > 0 && c[0] == 0 && c[2] == 0, "{c:?}");
    }

    #[test]
    fn top_k_keeps_ties_at_the_threshold() {
        let v = [3.0f32, 1.0, 2.0, 2.0, 0.0];
        let p = SamplingParams {
            top_k: 2,
            ..sampled(1.0)
        };
        let c = counts(&v, &p, 50_000);
        assert!(c[0] > 0 && c[2] > 0 && c[3] > 0, "{c:?}");
        assert_eq!((c[1], c[4]), (0, 0), "{c:?}");
        let e = [1.0f64, 0.0, (-1.0f64).exp(), (-1.0f64).exp(), 0.0];
        let s: f64 = e.iter().sum();
        let probs: Vec<f64> = e.iter().map(|x| x / s).collect();
        assert!(chi_square(&c, &probs) < 20.0, "{c:?}");
    }

    #[test]
    fn nan_and_infinite_logits() {
        let nan = f32::NAN;
        let p = sampled(1.0);
        // NaN is -inf: never drawn.
        let v = [nan, 0.0, nan, 0.0, nan];
        let c = counts(&v, &p, 10_000);
        assert_eq!(c[0] + c[2] + c[4], 0, "{c:?}");
        assert!(c[1] > 4000 && c[3] > 4000, "{c:?}");
        // All NaN: every token weighs the same (all equal the maximum, -inf).
        let c = counts(&[nan; 4], &p, 8000);
        assert!(c.iter().all(|&x| x > 1500), "{c:?}");
        // +inf logits share the draw; finite ones get nothing.
        let inf = f32::INFINITY;
        let c = counts(&[1.0, inf, 5.0, inf], &p, 8000);
        assert_eq!(c[0] + c[2], 0, "{c:?}");
        assert!(c[1] > 3000 && c[3] > 3000, "{c:?}");
        // A tiny temperature overflows l / T to inf: the largest logits only.
        let c = counts(&[1e20, 3e30, -1.0], &sampled(1e-10), 100);
        assert_eq!(c[1], 100, "{c:?}");
    }

    #[test]
    fn same_counter_same_token_and_rows_differ() {
        let mut rng = Mix(3);
        let v: Vec<f32> = (0..4096).map(|_| rng.f32(1.0)).collect();
        let p = sampled(1.0);
        let a: Vec<u32> = (0..64).map(|c| sample_row(&v, None, &p, c, 0)).collect();
        let b: Vec<u32> = (0..64).map(|c| sample_row(&v, None, &p, c, 0)).collect();
        let r: Vec<u32> = (0..64).map(|c| sample_row(&v, None, &p, c, 1)).collect();
        assert_eq!(a, b);
        assert_ne!(a, r);
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(distinct.len() > 50, "{a:?}");
    }
}
