//! Token sampling kernels: params mirror and entry points of kernels/sample.cu
//!
//! One CTA of [`THREADS`] threads per batch row picks the row's next token: greedy, or
//! temperature with top-k, top-p and a repetition penalty, drawn with Philox4x32-10 from the
//! row's position counter, which the kernel advances. `stoke_formats::sample` is the CPU
//! reference; the `.cu` file's header documents the algorithm.

use super::{EntryPoint, KernelParams, SAMPLE};
use crate::{DevicePtr, DevicePtrMut};

/// One lane's sampling settings (`struct RowSample` in `kernels/sample.cu`, 32 bytes): a
/// request's own, read by the sampling and log-probability kernels.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RowSample {
    /// Philox key.
    pub seed: u64,
    /// `<= 0`: greedy.
    pub temperature: f32,
    /// 0 (or at least `vocab`): off.
    pub top_k: u32,
    /// `>= 1`: off.
    pub top_p: f32,
    /// 1: off.
    pub repetition_penalty: f32,
    /// Philox counter word 1 (two requests with one seed and different streams draw
    /// differently).
    pub stream: u32,
    /// [`ROW_ACTIVE`] | [`ROW_LOGPROB`] | top log-probabilities `<< 8`.
    pub flags: u32,
}

impl RowSample {
    /// The struct as the kernels read it from device memory (little-endian, 32 bytes).
    pub fn to_le_bytes(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&self.seed.to_le_bytes());
        let words = [
            self.temperature.to_bits(),
            self.top_k,
            self.top_p.to_bits(),
            self.repetition_penalty.to_bits(),
            self.stream,
            self.flags,
        ];
        for (i, w) in words.iter().enumerate() {
            b[8 + 4 * i..12 + 4 * i].copy_from_slice(&w.to_le_bytes());
        }
        b
    }
}

/// [`RowSample::flags`]: the lane's draw counter advances (a lane with no request keeps it).
pub const ROW_ACTIVE: u32 = 1;
/// [`RowSample::flags`]: the log-probability kernel writes this lane's row.
pub const ROW_LOGPROB: u32 = 2;
/// Most top log-probabilities per row (`kMaxTopLogprobs`).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// The sampling kernels' single argument, passed by value, for logits of type `T` (`f32` or
/// `half::bf16`: `sample_f32`, `sample_bf16`). Mirrors `struct SampleParams` in
/// `kernels/sample.cu` field for field: four 64-bit device pointers, the seed, seven 32-bit
/// fields, 4 bytes of padding and two more pointers: 88 bytes (the `.cu` file asserts it).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SampleParams<T> {
    /// `[rows, row_stride]`; the first `vocab` of each row are the logits.
    pub logits: DevicePtr<T>,
    /// `[lanes]`: the chosen token of each row's lane.
    pub ids_out: DevicePtrMut<u32>,
    /// `[lanes]`: each lane's draw counter (its position), written back plus one; null: counter
    /// 0, nothing written.
    pub pos: DevicePtrMut<u32>,
    /// `[lanes, (vocab + 31) / 32]` bitmap of the tokens in each sequence (bit `i % 32` of word
    /// `i / 32`), read for the repetition penalty; the chosen token's bit is set. May be null.
    pub presence: DevicePtrMut<u32>,
    /// Philox key: the low 32 bits, then the high 32 bits.
    pub seed: u64,
    /// Elements from one row to the next, at least `vocab`.
    pub row_stride: u32,
    pub vocab: u32,
    pub rows: u32,
    /// `<= 0`: greedy.
    pub temperature: f32,
    /// 0 (or at least `vocab`): off.
    pub top_k: u32,
    /// `>= 1`: off.
    pub top_p: f32,
    /// 1: off.
    pub repetition_penalty: f32,
    /// `[lanes]` each lane's own settings (the ones above then go unused); null: the ones above
    /// for every row, with stream = row.
    pub row_cfg: DevicePtr<RowSample>,
    /// `[rows]` the lane of each row; null: row `r` is lane `r`.
    pub lane_of: DevicePtr<u32>,
}

/// The log-probability kernels' argument (`struct LogprobParams`, 56 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct LogprobParams<T> {
    /// `[rows, row_stride]` logits.
    pub logits: DevicePtr<T>,
    /// `[lanes]` the chosen tokens.
    pub ids: DevicePtr<u32>,
    /// `[lanes]` settings: [`ROW_LOGPROB`] and the top count.
    pub row_cfg: DevicePtr<RowSample>,
    /// `[rows]` the lane of each row; null: row `r` is lane `r`.
    pub lane_of: DevicePtr<u32>,
    /// `[rows, 1 + MAX_TOP_LOGPROBS, 2]`: (id bits, log-probability) of the chosen token, then of
    /// the top ones.
    pub out: DevicePtrMut<f32>,
    pub row_stride: u32,
    pub vocab: u32,
    pub rows: u32,
    pub pad: u32,
}

/// A logit type the sampling kernels take.
pub trait SampleElem: Copy + Send + 'static {
    /// The entry point for logits of this type.
    const ENTRY: &'static str;
    /// The log-probability entry point for logits of this type.
    const LOGPROBS: &'static str;
    /// Logits per 16-byte vector (the kernel's per-thread chunks are whole vectors).
    const VEC: u32;
}
impl SampleElem for f32 {
    const ENTRY: &'static str = "sample_f32";
    const LOGPROBS: &'static str = "logprobs_f32";
    const VEC: u32 = 4;
}
impl SampleElem for half::bf16 {
    const ENTRY: &'static str = "sample_bf16";
    const LOGPROBS: &'static str = "logprobs_bf16";
    const VEC: u32 = 8;
}

// SAFETY: the layout is the `.cu` struct's (asserted in the tests below) and the pointers are
// of the entry point's element types.
unsafe impl<T: SampleElem> KernelParams for SampleParams<T> {}
// SAFETY: as above.
unsafe impl<T: SampleElem> KernelParams for LogprobParams<T> {}

/// The entry point for logits of type `T`.
pub fn entry_point<T: SampleElem>() -> EntryPoint<SampleParams<T>> {
    EntryPoint::new(&SAMPLE, T::ENTRY)
}

/// The log-probability entry point for logits of type `T`.
pub fn logprobs_entry_point<T: SampleElem>() -> EntryPoint<LogprobParams<T>> {
    EntryPoint::new(&SAMPLE, T::LOGPROBS)
}

/// `kernels/sample.cu`, compiled with NVRTC (no include path needed).
pub const SOURCE: &str = include_str!("../../../../kernels/sample.cu");

/// Every `extern "C"` entry point in [`SOURCE`].
pub const ENTRY_POINTS: &[&str] = &["sample_f32", "sample_bf16", "logprobs_f32", "logprobs_bf16"];

/// Threads per CTA (`kThreads` in the `.cu` file; the entry points' launch bounds).
pub const THREADS: u32 = 1024;

/// Largest vocabulary: the weights of a row (each at most 2^40) must sum below 2^64.
pub const MAX_VOCAB: u32 = (1 << 24) - 1;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn row_sample_bytes_are_its_memory() {
        let r = RowSample {
            seed: 0x0102_0304_0506_0708,
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            repetition_penalty: 1.1,
            stream: 3,
            flags: ROW_ACTIVE | 5 << 8,
        };
        // SAFETY: RowSample is #[repr(C)], 32 bytes with no padding (the layout test).
        let mem: [u8; 32] = unsafe { std::mem::transmute(r) };
        assert_eq!(r.to_le_bytes(), mem);
    }

    #[test]
    fn params_layout_matches_c() {
        type P = SampleParams<f32>;
        assert_eq!(size_of::<P>(), 88);
        assert_eq!(align_of::<P>(), 8);
        assert_eq!(size_of::<SampleParams<half::bf16>>(), 88);
        assert_eq!(size_of::<RowSample>(), 32);
        assert_eq!(size_of::<LogprobParams<f32>>(), 56);
        assert!(SOURCE.contains("static_assert(sizeof(SampleParams) == 88"));
        assert!(SOURCE.contains("static_assert(sizeof(RowSample) == 32"));
        assert!(SOURCE.contains("static_assert(sizeof(LogprobParams) == 56"));
        assert!(SOURCE.contains(&format!("kMaxTopLogprobs = {MAX_TOP_LOGPROBS};")));
        assert!(SOURCE.contains(&format!(
            "ROW_ACTIVE = {ROW_ACTIVE}, ROW_LOGPROB = {ROW_LOGPROB}"
        )));
        assert!(SOURCE.contains("static_assert(alignof(SampleParams) == 8"));
        let offsets = [
            (offset_of!(P, logits), "logits 0"),
            (offset_of!(P, ids_out), "ids_out 8"),
            (offset_of!(P, pos), "pos 16"),
            (offset_of!(P, presence), "presence 24"),
            (offset_of!(P, seed), "seed 32"),
            (offset_of!(P, row_stride), "row_stride 40"),
            (offset_of!(P, vocab), "vocab 44"),
            (offset_of!(P, rows), "rows 48"),
            (offset_of!(P, temperature), "temperature 52"),
            (offset_of!(P, top_k), "top_k 56"),
            (offset_of!(P, top_p), "top_p 60"),
            (offset_of!(P, repetition_penalty), "repetition_penalty 64"),
            (offset_of!(P, row_cfg), "row_cfg 72"),
            (offset_of!(P, lane_of), "lane_of 80"),
        ];
        for (off, text) in offsets {
            let (_, at) = text.split_once(' ').unwrap();
            assert_eq!(off.to_string(), at, "{text}");
            // The .cu file lists the same offsets.
            assert!(
                SOURCE.contains(text),
                "{text} not in the .cu offsets comment"
            );
        }
    }

    #[test]
    fn entry_points_are_the_source_s() {
        for e in ENTRY_POINTS {
            let params = if e.starts_with("sample") {
                "SampleParams"
            } else {
                "LogprobParams"
            };
            assert!(
                SOURCE.contains(&format!(
                    "__launch_bounds__({THREADS}, 1) {e}(const {params} p)"
                )),
                "{e}"
            );
        }
        assert_eq!(entry_point::<f32>().name, "sample_f32");
        assert_eq!(entry_point::<half::bf16>().name, "sample_bf16");
        assert!(SOURCE.contains(&format!("constexpr u32 kThreads = {THREADS};")));
        assert!(!crate::kernels::expand_includes(SOURCE).contains("#include"));
    }
}
