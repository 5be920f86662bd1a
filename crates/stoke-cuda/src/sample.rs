//! Token sampling on the GPU (`kernels/sample.cu`): the next token of every batch row of a
//! decode step, greedy or drawn (temperature, top-k, top-p, repetition penalty), without a
//! host synchronization, so a captured decode step replays it.
//!
//! Each row's draw counter is a device buffer (`pos`) that the kernel advances, and the
//! presence bitmap that the penalty reads gets the chosen token's bit, so a replayed graph
//! samples the next position with the updated history. `stoke_formats::sample::sample_row` is
//! the CPU reference, token for token.

use crate::kernels::sample::{
    LogprobParams, MAX_VOCAB, SampleParams, THREADS, entry_point, logprobs_entry_point,
};
pub use crate::kernels::sample::{
    MAX_TOP_LOGPROBS, ROW_ACTIVE, ROW_LOGPROB, RowSample, SampleElem,
};
use crate::{DevicePtr, DevicePtrMut, Error, LaunchShape, Result, Runtime, ShapeError};

/// Sampling settings of one launch; every row uses the same (the CPU reference's type).
pub use stoke_formats::sample::SamplingParams;

/// Checks that the kernel can take these settings.
pub fn check_params(p: &SamplingParams) -> std::result::Result<(), ShapeError> {
    if p.temperature.is_nan() || p.temperature == f32::INFINITY {
        return Err(ShapeError::new(
            "sampling temperature",
            "a number below +inf (<= 0: greedy)",
            p.temperature.to_string(),
        ));
    }
    if p.top_p.is_nan() || p.top_p <= 0.0 {
        return Err(ShapeError::new(
            "sampling top_p",
            "above 0 (>= 1: off)",
            p.top_p.to_string(),
        ));
    }
    if !(p.repetition_penalty > 0.0 && p.repetition_penalty.is_finite()) {
        return Err(ShapeError::new(
            "sampling repetition_penalty",
            "positive and finite (1: off)",
            p.repetition_penalty.to_string(),
        ));
    }
    Ok(())
}

/// One sampling launch over `rows` rows of logits.
#[derive(Clone, Copy, Debug)]
pub struct SampleCall<T> {
    /// `[rows, row_stride]` logits; the first `vocab` of each row are used.
    pub logits: DevicePtr<T>,
    /// Elements from one row to the next, at least `vocab`.
    pub row_stride: u32,
    /// 1 to [`MAX_VOCAB`].
    pub vocab: u32,
    pub rows: u32,
    /// `[rows]`: the chosen tokens.
    pub ids_out: DevicePtrMut<u32>,
    /// `[rows]`: each row's draw counter, read as the Philox counter and written back plus
    /// one. Null: counter 0 for every launch, nothing written.
    pub pos: DevicePtrMut<u32>,
    /// `[rows, (vocab + 31) / 32]` words: bit `i % 32` of word `i / 32` marks token `i` as in
    /// the sequence (the repetition penalty applies to it); the chosen token's bit is set.
    /// Null: no penalty, nothing written.
    pub presence: DevicePtrMut<u32>,
    /// The settings of every row where `row_cfg` is null (stream = row).
    pub params: SamplingParams,
    /// `[lanes]` each lane's own settings; null: `params`.
    pub row_cfg: DevicePtr<RowSample>,
    /// `[rows]` the lane whose id, counter, presence words and settings row `r` uses; null:
    /// lane `r`. (`ids_out`, `pos` and `presence` then hold lanes, not rows.)
    pub lane_of: DevicePtr<u32>,
}

impl<T: SampleElem> SampleCall<T> {
    /// The kernel's parameter struct, once the shapes and settings are checked.
    pub fn kernel_params(&self) -> Result<SampleParams<T>> {
        check_params(&self.params)?;
        if !(1..=MAX_VOCAB).contains(&self.vocab) {
            return Err(Error::Shape(ShapeError::new(
                "sampling vocab",
                format!("1 to {MAX_VOCAB}"),
                self.vocab.to_string(),
            )));
        }
        if self.row_stride < self.vocab {
            return Err(Error::Shape(ShapeError::new(
                "sampling row_stride",
                format!("at least vocab {}", self.vocab),
                self.row_stride.to_string(),
            )));
        }
        if self.rows > i32::MAX as u32 {
            return Err(Error::Shape(ShapeError::new(
                "sampling rows",
                format!("at most {} (one CTA per row)", i32::MAX),
                self.rows.to_string(),
            )));
        }
        if self.rows > 0 && (self.logits.is_null() || self.ids_out.is_null()) {
            return Err(Error::Shape(ShapeError::new(
                "sampling buffers",
                "non-null logits and ids_out",
                format!("logits {:?}, ids_out {:?}", self.logits, self.ids_out),
            )));
        }
        Ok(SampleParams {
            logits: self.logits,
            ids_out: self.ids_out,
            pos: self.pos,
            presence: self.presence,
            seed: self.params.seed,
            row_stride: self.row_stride,
            vocab: self.vocab,
            rows: self.rows,
            temperature: self.params.temperature,
            top_k: self.params.top_k,
            top_p: self.params.top_p,
            repetition_penalty: self.params.repetition_penalty,
            row_cfg: self.row_cfg,
            lane_of: self.lane_of,
        })
    }
}

/// Checks one lane's settings as [`check_params`] does.
pub fn check_row(r: &RowSample) -> std::result::Result<(), ShapeError> {
    check_params(&SamplingParams {
        temperature: r.temperature,
        top_k: r.top_k,
        top_p: r.top_p,
        repetition_penalty: r.repetition_penalty,
        seed: r.seed,
    })
}

/// Queues the log-probabilities of the rows of `call` whose lane settings ask for them
/// ([`ROW_LOGPROB`], up to [`MAX_TOP_LOGPROBS`] top tokens) after the sampling `call` made:
/// `out [rows, 1 + MAX_TOP_LOGPROBS, 2]` (id bits, log-probability) of the chosen token, then
/// of the top tokens, the log-softmax of the raw logits. `call.row_cfg` must be set.
///
/// # Safety
/// As for [`sample`]; `out` holds `rows x (1 + MAX_TOP_LOGPROBS) x 2` f32.
pub unsafe fn logprobs<T: SampleElem>(
    rt: &Runtime,
    call: &SampleCall<T>,
    out: DevicePtrMut<f32>,
) -> Result<()> {
    call.kernel_params()?;
    if call.row_cfg.is_null() || out.is_null() {
        return Err(Error::Shape(ShapeError::new(
            "log-probabilities",
            "per-lane settings and an output buffer",
            format!("row_cfg {:?}, out {:?}", call.row_cfg, out),
        )));
    }
    if call.rows == 0 {
        return Ok(());
    }
    let params = LogprobParams {
        logits: call.logits,
        ids: call.ids_out.as_const(),
        row_cfg: call.row_cfg,
        lane_of: call.lane_of,
        out,
        row_stride: call.row_stride,
        vocab: call.vocab,
        rows: call.rows,
        pad: 0,
    };
    let kernel = rt.kernel(logprobs_entry_point::<T>())?;
    let shape = LaunchShape {
        grid: (call.rows, 1, 1),
        block: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the params mirror the kernel's struct (layout test); the caller guarantees the
    // buffers.
    unsafe { rt.launch(&kernel, shape, &params) }
}

/// Queues the sampling of `call.rows` rows on Stoke's stream (one CTA per row). Works inside a
/// graph capture: it reads and writes only device memory.
///
/// # Safety
/// `call.logits` must hold `(rows - 1) * row_stride + vocab` elements, `ids_out` and a
/// non-null `pos` `rows` words, a non-null `presence` `rows * ((vocab + 31) / 32)` words, all
/// valid until the kernel finishes (see [`Runtime::launch`]); `ids_out`, `pos` and `presence`
/// must not overlap each other or the logits.
pub unsafe fn sample<T: SampleElem>(rt: &Runtime, call: &SampleCall<T>) -> Result<()> {
    let params = call.kernel_params()?;
    if call.rows == 0 {
        return Ok(());
    }
    let kernel = rt.kernel(entry_point::<T>())?;
    let shape = LaunchShape {
        grid: (call.rows, 1, 1),
        block: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the params mirror the kernel's struct (layout test); the caller guarantees the
    // buffers.
    unsafe { rt.launch(&kernel, shape, &params) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(params: SamplingParams) -> SampleCall<f32> {
        SampleCall {
            logits: DevicePtr::new(0x1000),
            row_stride: 100,
            vocab: 100,
            rows: 3,
            ids_out: DevicePtrMut::new(0x2000),
            pos: DevicePtrMut::NULL,
            presence: DevicePtrMut::NULL,
            params,
            row_cfg: DevicePtr::NULL,
            lane_of: DevicePtr::NULL,
        }
    }

    fn what(r: Result<SampleParams<f32>>) -> String {
        match r {
            Err(Error::Shape(e)) => e.what,
            other => panic!("expected a shape error, got {other:?}"),
        }
    }

    #[test]
    fn sample_call_checks_settings_and_shapes() {
        let ok = call(SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            repetition_penalty: 1.1,
            seed: 5,
        });
        let p = ok.kernel_params().unwrap();
        assert_eq!((p.vocab, p.rows, p.top_k, p.seed), (100, 3, 40, 5));
        assert!(call(SamplingParams::GREEDY).kernel_params().is_ok());
        let with = |f: fn(&mut SamplingParams)| {
            let mut s = ok.params;
            f(&mut s);
            what(call(s).kernel_params())
        };
        assert_eq!(with(|s| s.temperature = f32::NAN), "sampling temperature");
        assert_eq!(
            with(|s| s.temperature = f32::INFINITY),
            "sampling temperature"
        );
        assert_eq!(with(|s| s.top_p = 0.0), "sampling top_p");
        assert_eq!(with(|s| s.top_p = f32::NAN), "sampling top_p");
        assert_eq!(
            with(|s| s.repetition_penalty = 0.0),
            "sampling repetition_penalty"
        );
        assert_eq!(
            with(|s| s.repetition_penalty = f32::INFINITY),
            "sampling repetition_penalty"
        );
        let mut c = ok;
        c.vocab = 0;
        assert_eq!(what(c.kernel_params()), "sampling vocab");
        c.vocab = MAX_VOCAB + 1;
        c.row_stride = u32::MAX;
        assert_eq!(what(c.kernel_params()), "sampling vocab");
        let mut c = ok;
        c.row_stride = 99;
        assert_eq!(what(c.kernel_params()), "sampling row_stride");
        let mut c = ok;
        c.ids_out = DevicePtrMut::NULL;
        assert_eq!(what(c.kernel_params()), "sampling buffers");
        c.rows = 0;
        assert!(c.kernel_params().is_ok());
        let mut c = ok;
        c.rows = u32::MAX;
        assert_eq!(what(c.kernel_params()), "sampling rows");
    }
}
