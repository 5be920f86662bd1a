//! The prefill GEMMs, bf16 and FP8, on one persistent wgmma mainloop (`kernels/fp8_gemm.cu`).
//!
//! The FP8 prefill linear: a weight's E4M3 codes and per-channel scales in device memory
//! ([`DeviceFp8Weight`]), bf16 rows quantized to E4M3 with one scale per row
//! ([`DeviceFp8Rows::quantize`], or an RMSNorm's input with its row factor:
//! [`DeviceFp8Rows::quantize_rms_normed`]; `kernels/fp8_quant.cu`) and [`fp8_linear_rows`],
//! which runs the persistent FP8 GEMM on them with one of its epilogues
//! (`kernels/fp8_gemm.cu`); the gate|up projection's SwiGLU straight to the down projection's
//! E4M3 rows with a delayed per-tensor scale ([`fp8_swiglu_delayed`], [`DeviceDelayedScale`]);
//! the bf16 prefill linear on the same mainloop ([`bf16_linear`]).
//! `stoke_formats::fp8` holds the specification.

use crate::int4::DeviceInt4;
use crate::kernels::fp8_gemm::{
    Bf16TcGemm, Fp8Epilogue, Fp8Gemm, Fp8I4Gemm, QkvEpilogue, bf16_tc_gemm, fp8_gemm, fp8_i4_gemm,
};
use crate::kernels::fp8_quant::{
    Fp8DelayedState, Fp8DequantParams, Fp8RecordParams, Fp8RowsParams, STATE_AMAX, STATE_SATURATED,
    STATE_SCALE, dequantize_rows, quantize_rows, record,
};
use crate::{DeviceBuffer, DevicePtr, DevicePtrMut, Error, Result, Runtime, ShapeError};
use half::bf16;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use stoke_formats::fp8::{DELAYED_HISTORY, DelayedScale, Fp8Weight};

/// A weight `[n, k]` in E4M3 with one f32 scale per output channel, in device memory.
pub struct DeviceFp8Weight {
    pub n: u32,
    pub k: u32,
    codes: DeviceBuffer,
    scales: DeviceBuffer,
}

impl std::fmt::Debug for DeviceFp8Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceFp8Weight(e4m3 [{}, {}])", self.n, self.k)
    }
}

impl DeviceFp8Weight {
    /// Uploads `w`. The GEMM reads `k` bytes per row through the copy engine, so `k` must be a
    /// positive multiple of 16.
    pub fn upload(rt: &Arc<Runtime>, w: &Fp8Weight) -> Result<Self> {
        if w.k == 0 || !w.k.is_multiple_of(16) || w.n == 0 {
            return Err(Error::Shape(ShapeError::new(
                format!("FP8 weight [{}, {}]", w.n, w.k),
                "n positive, k a positive multiple of 16",
                format!("n {}, k {}", w.n, w.k),
            )));
        }
        let (n, k) = (u32::try_from(w.n), u32::try_from(w.k));
        let (Ok(n), Ok(k)) = (n, k) else {
            return Err(Error::Shape(ShapeError::new(
                "FP8 weight dimensions",
                "below 2^32",
                format!("[{}, {}]", w.n, w.k),
            )));
        };
        let codes = rt.alloc(w.codes.len())?;
        let scales = rt.alloc(4 * w.scales.len())?;
        let scale_bytes: Vec<u8> = w.scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        // SAFETY: each buffer holds exactly the bytes copied.
        unsafe {
            rt.copy_htod(codes.ptr(), &w.codes)?;
            rt.copy_htod(scales.ptr(), &scale_bytes)?;
        }
        Ok(Self {
            n,
            k,
            codes,
            scales,
        })
    }
}

/// What an FP8 linear does with `y = x W^T`.
#[derive(Clone, Copy, Debug)]
pub enum Fp8LinearEpilogue {
    /// `out = y` (`[m, n]`).
    Plain,
    /// `out = y + residual` (`[m, n]` both).
    Residual(DevicePtr<bf16>),
    /// `out = silu(y[2 j]) y[2 j + 1]` (`[m, n / 2]`: gate and up interleaved).
    SwiGlu,
    /// A packed prefill's q|k|v projection: `out` is q (`[m, heads x d]`, rotated), k and v go
    /// rotated into the KV cache (see [`QkvEpilogue`]; its `q` is replaced by `out`).
    Qkv(QkvEpilogue),
}

impl Fp8LinearEpilogue {
    /// Output columns for `n` weight rows.
    pub fn out_cols(self, n: u32) -> u32 {
        match self {
            Self::SwiGlu => n / 2,
            Self::Plain | Self::Residual(_) => n,
            Self::Qkv(e) => e.heads * e.head_dim(),
        }
    }

    /// The GEMM's epilogue writing bf16 `out` for `n` weight rows.
    fn gemm(self, out: DevicePtrMut<bf16>, n: u32) -> Fp8Epilogue {
        match self {
            Self::Plain => Fp8Epilogue::Plain { out },
            Self::Residual(residual) => Fp8Epilogue::Residual {
                out,
                residual,
                ldr: n,
            },
            Self::SwiGlu => Fp8Epilogue::SwiGluBf16 { out },
            Self::Qkv(e) => Fp8Epilogue::Qkv(QkvEpilogue { q: out, ..e }),
        }
    }
}

/// E4M3 rows `[m, k]` in device memory with their scales, one per row or one for every row:
/// the input of the FP8 GEMM.
pub struct DeviceFp8Rows {
    pub m: u32,
    pub k: u32,
    /// Whether `scales` holds one scale per row (else one, `[1]`).
    pub per_row: bool,
    codes: DeviceBuffer,
    scales: DeviceBuffer,
    /// For INT4 weights ([`int4_fp8_linear_rows`]): the codes of each 16 k interleaved as the
    /// weight's nibbles are, and the sums of each 32 codes `[m, k / 32]`.
    sums: Option<DeviceBuffer>,
}

impl std::fmt::Debug for DeviceFp8Rows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scales = if self.per_row { "per row" } else { "one scale" };
        write!(f, "DeviceFp8Rows(e4m3 [{}, {}], {scales})", self.m, self.k)
    }
}

impl DeviceFp8Rows {
    /// Buffers for `m` rows of `k` codes and their scales.
    fn alloc(rt: &Arc<Runtime>, m: u32, k: u32, per_row: bool) -> Result<Self> {
        let scales = if per_row { m as usize } else { 1 };
        Ok(Self {
            m,
            k,
            per_row,
            codes: rt.alloc(m as usize * k as usize)?,
            scales: rt.alloc(4 * scales)?,
            sums: None,
        })
    }

    /// Queues the E4M3 rows an INT4-weight GEMM reads ([`int4_fp8_linear_rows`]) from bf16 rows
    /// `x` (`[m, k]`, dense, 16-byte aligned; `k` a multiple of 32): one scale per row, the codes
    /// of each 16 k interleaved as the weight's nibbles are, and the sums of each 32 codes. With
    /// `gain` (`[k]` bf16, 16-byte aligned, or null) the rows are multiplied by it first, and
    /// with `normalize` = Some(eps) they are RMSNorm's input: the scales carry its row factor,
    /// so the codes are those of the normalized rows (an INT4 weight cannot hold the gain).
    ///
    /// # Safety
    /// `x` (and `gain`) must be valid device memory of those sizes until the kernel is done.
    pub unsafe fn quantize_interleaved(
        rt: &Arc<Runtime>,
        x: DevicePtr<bf16>,
        m: u32,
        k: u32,
        gain: DevicePtr<bf16>,
        normalize: Option<f32>,
    ) -> Result<Self> {
        // SAFETY: the caller's guarantees.
        unsafe { Self::quantize_with(rt, x, m, k, DevicePtrMut::NULL, gain, normalize, true) }
    }

    /// Queues the E4M3 codes of bf16 rows `x` (`[m, k]`, dense, 16-byte aligned; `k` a
    /// multiple of 16) with one scale per row; their largest |x| also goes to `amax` (f32
    /// bits, atomicMax) unless it is null.
    ///
    /// # Safety
    /// `x` must be valid device memory of `m k` bf16 and `amax` null or `[1]` u32 until the
    /// kernel is done.
    pub unsafe fn quantize(
        rt: &Arc<Runtime>,
        x: DevicePtr<bf16>,
        m: u32,
        k: u32,
        amax: DevicePtrMut<u32>,
    ) -> Result<Self> {
        // SAFETY: the caller's guarantees.
        unsafe { Self::quantize_with(rt, x, m, k, amax, DevicePtr::NULL, None, false) }
    }

    /// Queues the E4M3 rows of RMSNorm's output for bf16 rows `x` (`[m, k]`, as for
    /// [`quantize`](Self::quantize)), with RMSNorm's gain folded into the weight that reads
    /// them: the codes of `x` itself (the per-row scale cancels RMSNorm's row factor `r =
    /// rsqrt(mean(x^2) + eps)`) and the scale `amax(x) r / 448`
    /// (`stoke_formats::fp8::quantize_rows_fused` with `normalize`). No normalized row is
    /// written.
    ///
    /// # Safety
    /// `x` must be valid device memory of `m k` bf16 until the kernel is done.
    pub unsafe fn quantize_rms_normed(
        rt: &Arc<Runtime>,
        x: DevicePtr<bf16>,
        m: u32,
        k: u32,
        eps: f32,
    ) -> Result<Self> {
        // SAFETY: the caller's guarantee.
        unsafe {
            Self::quantize_with(
                rt,
                x,
                m,
                k,
                DevicePtrMut::NULL,
                DevicePtr::NULL,
                Some(eps),
                false,
            )
        }
    }

    /// [`quantize`](Self::quantize), with `normalize` = Some(eps)
    /// [`quantize_rms_normed`](Self::quantize_rms_normed), with `interleaved`
    /// [`quantize_interleaved`](Self::quantize_interleaved) (the codes' order and their sums).
    ///
    /// # Safety
    /// As [`quantize`](Self::quantize); `gain` null or `[k]` bf16.
    #[allow(clippy::too_many_arguments)]
    unsafe fn quantize_with(
        rt: &Arc<Runtime>,
        x: DevicePtr<bf16>,
        m: u32,
        k: u32,
        amax: DevicePtrMut<u32>,
        gain: DevicePtr<bf16>,
        normalize: Option<f32>,
        interleaved: bool,
    ) -> Result<Self> {
        let mut rows = Self::alloc(rt, m, k, true)?;
        let sums = if interleaved {
            Some(rt.alloc(4 * m as usize * (k as usize / 32).max(1))?)
        } else {
            None
        };
        let p = Fp8RowsParams {
            x,
            codes: rows.codes.as_mut_ptr(),
            scales: rows.scales.as_mut_ptr(),
            amax,
            gain,
            sums: sums.as_ref().map_or(DevicePtrMut::NULL, |s| s.as_mut_ptr()),
            rows: m,
            k,
            ldx: k,
            eps: normalize.unwrap_or(0.0),
            normalize: u32::from(normalize.is_some()),
            order: u32::from(interleaved),
        };
        // SAFETY: the caller's guarantees; the buffers are the rows' own.
        unsafe { quantize_rows(rt, &p)? };
        rows.sums = sums;
        Ok(rows)
    }

    pub fn codes(&self) -> DevicePtr<u8> {
        self.codes.as_ptr()
    }

    pub fn scales(&self) -> DevicePtr<f32> {
        self.scales.as_ptr()
    }

    /// Queues `out = bf16(e4m3(codes) * scale)` (`[m, k]` bf16, dense, 16-byte aligned).
    ///
    /// # Safety
    /// `out` must be valid device memory of `m k` bf16 until the kernel is done.
    pub unsafe fn dequantize(&self, rt: &Runtime, out: DevicePtrMut<bf16>) -> Result<()> {
        let p = Fp8DequantParams {
            codes: self.codes(),
            scales: self.scales(),
            out,
            rows: self.m,
            k: self.k,
            scale_stride: u32::from(self.per_row),
            pad: 0,
        };
        // SAFETY: the caller's guarantee for out; the codes and scales are the rows' own.
        unsafe { dequantize_rows(rt, &p) }
    }
}

/// A delayed per-tensor scale in device memory ([`Fp8DelayedState`], the device copy of
/// [`DelayedScale`] with [`DELAYED_HISTORY`] slots): the state of one activation (the SwiGLU
/// output a down projection reads) for one request group. Every step of it is queued on
/// Stoke's stream; the host only counts the invocations it queued.
pub struct DeviceDelayedScale {
    state: DeviceBuffer,
    queued: AtomicU64,
}

impl std::fmt::Debug for DeviceDelayedScale {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceDelayedScale({} queued)", self.queued())
    }
}

impl DeviceDelayedScale {
    /// A fresh state: no history, the scale of `initial_amax * margin` (see
    /// [`DelayedScale::new`]).
    pub fn new(rt: &Arc<Runtime>, initial_amax: f32, margin: f32) -> Result<Self> {
        let d = DelayedScale::new(DELAYED_HISTORY, initial_amax, margin).map_err(|e| {
            ShapeError::new(
                "delayed FP8 scale",
                "a finite positive initial amax and a margin of at least 1",
                e.to_string(),
            )
        })?;
        let state = rt.alloc(std::mem::size_of::<Fp8DelayedState>())?;
        // SAFETY: the buffer holds exactly the state's bytes.
        unsafe { rt.copy_htod(state.ptr(), &Fp8DelayedState::of(&d).to_bytes())? };
        Ok(Self {
            state,
            queued: AtomicU64::new(0),
        })
    }

    /// Invocations queued so far.
    pub fn queued(&self) -> u64 {
        self.queued.load(Ordering::Relaxed)
    }

    /// The state after Stoke's queued work (waits for it), as the reference holds it.
    pub fn read(&self) -> Result<DelayedScale> {
        let mut b = vec![0u8; self.state.bytes()];
        // SAFETY: the buffer holds exactly `bytes()` bytes.
        unsafe { self.state.runtime().copy_dtoh(&mut b, self.state.ptr())? };
        Fp8DelayedState::from_bytes(&b)
            .and_then(|s| s.to_reference())
            .ok_or_else(|| {
                ShapeError::new(
                    "delayed FP8 scale read back",
                    "a consistent state",
                    format!("{:?}", Fp8DelayedState::from_bytes(&b)),
                )
                .into()
            })
    }

    fn field(&self, offset: usize) -> u64 {
        self.state.ptr() + offset as u64
    }

    /// Queues the end of an invocation (see [`record`]).
    ///
    /// # Safety
    /// `used` must be null or valid for one f32 until the kernel is done.
    unsafe fn record(&self, rt: &Runtime, used: DevicePtrMut<f32>) -> Result<()> {
        let p = Fp8RecordParams {
            state: DevicePtrMut::new(self.state.ptr()),
            used,
        };
        // SAFETY: the state is this buffer; the caller's guarantee for `used`.
        unsafe { record(rt, &p) }
    }
}

/// Queues `h = silu(y[2 j]) y[2 j + 1]` of `y = x W^T` (bf16 rows `x` `[m, k]`, dense, 16-byte
/// aligned; gate and up interleaved in W's rows) as E4M3 rows `[m, n / 2]` for the down
/// projection, scaled by the delayed scale `state`:
/// - the state's first invocation has no history: `h` goes out in bf16, is quantized per row,
///   and its largest |h| starts the history (no calibration needed);
/// - later invocations write `h` in E4M3 straight from the GEMM's epilogue with the state's
///   scale (one for the tensor), gather max |h| and the saturated values for the next, and
///   the returned rows hold the scale they were written with.
///
/// `n / 2` must be a multiple of 16 (the down GEMM's k).
///
/// # Safety
/// `x` must be valid device memory of `m k` bf16 until the kernels are done.
pub unsafe fn fp8_swiglu_delayed(
    rt: &Arc<Runtime>,
    w: &DeviceFp8Weight,
    x: DevicePtr<bf16>,
    m: u32,
    state: &DeviceDelayedScale,
) -> Result<DeviceFp8Rows> {
    check_swiglu(w, m)?;
    // SAFETY: the caller's guarantee for x; the rows are freed stream-ordered after the GEMM.
    unsafe {
        let xq = DeviceFp8Rows::quantize(rt, x, m, w.k, DevicePtrMut::NULL)?;
        fp8_swiglu_delayed_rows(rt, w, &xq, state)
    }
}

/// The shapes [`fp8_swiglu_delayed`] takes.
fn check_swiglu(w: &DeviceFp8Weight, m: u32) -> Result<()> {
    if !w.n.is_multiple_of(2) || !(w.n / 2).is_multiple_of(16) || m == 0 {
        return Err(ShapeError::new(
            format!(
                "delayed-scale SwiGLU of [{m}, {}] x [{}, {}]",
                w.k, w.n, w.k
            ),
            "at least one row, gate|up rows n with n / 2 a multiple of 16",
            format!("m {m}, n {}", w.n),
        )
        .into());
    }
    Ok(())
}

/// [`fp8_swiglu_delayed`] on E4M3 rows `xq` (e.g. [`DeviceFp8Rows::quantize_rms_normed`]'s).
pub fn fp8_swiglu_delayed_rows(
    rt: &Arc<Runtime>,
    w: &DeviceFp8Weight,
    xq: &DeviceFp8Rows,
    state: &DeviceDelayedScale,
) -> Result<DeviceFp8Rows> {
    let (m, inter) = (xq.m, w.n / 2);
    check_swiglu(w, m)?;
    let amax = DevicePtrMut::<u32>::new(state.field(STATE_AMAX));
    // SAFETY: every buffer is owned here or by `xq`, `state` and `w`, and freed stream-ordered
    // after the queued kernels.
    unsafe {
        if state.queued.fetch_add(1, Ordering::Relaxed) == 0 {
            let h = rt.alloc(m as usize * inter as usize * 2)?;
            gemm_rows(
                rt,
                w,
                xq,
                Fp8Epilogue::SwiGluBf16 {
                    out: h.as_mut_ptr(),
                },
                inter,
            )?;
            let rows = DeviceFp8Rows::quantize(rt, h.as_ptr(), m, inter, amax)?;
            state.record(rt, DevicePtrMut::NULL)?;
            return Ok(rows);
        }
        let rows = DeviceFp8Rows::alloc(rt, m, inter, false)?;
        let epilogue = Fp8Epilogue::SwiGlu {
            codes: rows.codes.as_mut_ptr(),
            scale: DevicePtr::new(state.field(STATE_SCALE)),
            amax,
            saturated: DevicePtrMut::new(state.field(STATE_SATURATED)),
        };
        gemm_rows(rt, w, xq, epilogue, inter)?;
        state.record(rt, rows.scales.as_mut_ptr())?;
        Ok(rows)
    }
}

/// Queues the FP8 GEMM of `rows` and `w` with `epilogue` (output pitch `ldo`).
///
/// # Safety
/// The epilogue's buffers must be valid until the kernel is done.
unsafe fn gemm_rows(
    rt: &Runtime,
    w: &DeviceFp8Weight,
    rows: &DeviceFp8Rows,
    epilogue: Fp8Epilogue,
    ldo: u32,
) -> Result<()> {
    if rows.k != w.k {
        return Err(ShapeError::new(
            format!(
                "FP8 GEMM of E4M3 rows [{}, {}] and weight [{}, {}]",
                rows.m, rows.k, w.n, w.k
            ),
            "the rows' k equal to the weight's",
            format!("{} and {}", rows.k, w.k),
        )
        .into());
    }
    let gemm = Fp8Gemm {
        a: rows.codes(),
        w: w.codes.as_ptr(),
        a_scale: rows.scales(),
        a_scale_per_row: rows.per_row,
        w_scale: w.scales.as_ptr(),
        epilogue,
        m: rows.m,
        n: w.n,
        k: w.k,
        ldo,
    };
    // SAFETY: the caller's guarantee for the epilogue; the operands live as long as `rows`
    // and `w`.
    unsafe { fp8_gemm(rt, &gemm) }
}

/// Queues `epilogue(rows W^T)` for E4M3 rows (as [`fp8_swiglu_delayed`] returns them) into
/// `out` (`[m, epilogue.out_cols(n)]` bf16, dense).
///
/// # Safety
/// `out` and a residual must be valid device memory of those sizes until the kernel is done.
pub unsafe fn fp8_linear_rows(
    rt: &Arc<Runtime>,
    w: &DeviceFp8Weight,
    rows: &DeviceFp8Rows,
    out: DevicePtrMut<bf16>,
    epilogue: Fp8LinearEpilogue,
) -> Result<()> {
    // SAFETY: the caller's guarantees.
    unsafe { gemm_rows(rt, w, rows, epilogue.gemm(out, w.n), epilogue.out_cols(w.n)) }
}

/// Queues `epilogue(rows W)` for a packed INT4 weight `w` (`[k, n]`, as the W4A16 kernels read
/// it) on the FP8 GEMM, the weight expanded to E4M3 inside its mainloop
/// ([`crate::kernels::fp8_gemm::fp8_i4_gemm`]), from rows made by
/// [`DeviceFp8Rows::quantize_interleaved`], into `out` (`[m, epilogue.out_cols(n)]` bf16,
/// dense; SwiGLU to bf16).
///
/// # Safety
/// `out` and a residual must be valid device memory of those sizes until the kernel is done.
pub unsafe fn int4_fp8_linear_rows(
    rt: &Arc<Runtime>,
    w: &DeviceInt4,
    rows: &DeviceFp8Rows,
    out: DevicePtrMut<bf16>,
    epilogue: Fp8LinearEpilogue,
) -> Result<()> {
    let Some(sums) = rows.sums.as_ref().filter(|_| rows.k == w.k) else {
        return Err(ShapeError::new(
            format!(
                "FP8 x INT4 GEMM of E4M3 rows [{}, {}] and weight [{}, {}]",
                rows.m, rows.k, w.k, w.n
            ),
            "interleaved rows (DeviceFp8Rows::quantize_interleaved) of the weight's k",
            format!(
                "k {}, {}",
                rows.k,
                if rows.sums.is_some() {
                    "interleaved"
                } else {
                    "not interleaved"
                }
            ),
        )
        .into());
    };
    let gemm = Fp8I4Gemm {
        a: rows.codes(),
        a_scale: rows.scales(),
        a_scale_per_row: rows.per_row,
        a_sums: sums.as_ptr(),
        w: w.operand(),
        epilogue: epilogue.gemm(out, w.n),
        m: rows.m,
        n: w.n,
        k: w.k,
        ldo: epilogue.out_cols(w.n),
    };
    // SAFETY: the caller's guarantees; the operands live as long as `rows` and `w`.
    unsafe { fp8_i4_gemm(rt, &gemm) }
}

/// Whether [`int4_fp8_linear_rows`] takes a packed weight of `[k, n]` in groups of `group`:
/// `k` a multiple of 32, `n` of 64, the group a multiple of 32 dividing `k`.
pub fn int4_fp8_takes(k: usize, n: usize, group: usize) -> bool {
    k.is_multiple_of(32)
        && n.is_multiple_of(64)
        && group > 0
        && k.is_multiple_of(group)
        && u32::try_from(group)
            .ok()
            .and_then(crate::kernels::fp8_gemm::i4_promotion)
            .is_some()
}

/// A weight `[n, k]` in bf16 (a `[k, n]` linear weight transposed) in device memory: the
/// operand of the bf16 prefill GEMM.
pub struct DeviceBf16Weight {
    pub n: u32,
    pub k: u32,
    values: DeviceBuffer,
}

impl std::fmt::Debug for DeviceBf16Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBf16Weight([{}, {}])", self.n, self.k)
    }
}

impl DeviceBf16Weight {
    /// Uploads `w` (`[n, k]` f32 values, rounded to bf16). The GEMM reads rows of `2 k` bytes
    /// through the copy engine, so `k` must be a positive multiple of 8.
    pub fn upload(rt: &Arc<Runtime>, w: &[f32], n: usize, k: usize) -> Result<Self> {
        let dims = (u32::try_from(n), u32::try_from(k));
        let (Ok(n32), Ok(k32)) = dims else {
            return Err(Error::Shape(ShapeError::new(
                "bf16 weight dimensions",
                "below 2^32",
                format!("[{n}, {k}]"),
            )));
        };
        if n == 0 || k == 0 || !k.is_multiple_of(8) || w.len() != n * k {
            return Err(Error::Shape(ShapeError::new(
                format!("bf16 weight [{n}, {k}] of {} values", w.len()),
                "n positive, k a positive multiple of 8, n k values",
                format!("n {n}, k {k}, {} values", w.len()),
            )));
        }
        let bytes: Vec<u8> = w
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect();
        let values = rt.alloc(bytes.len())?;
        // SAFETY: the buffer holds exactly the bytes copied.
        unsafe { rt.copy_htod(values.ptr(), &bytes)? };
        Ok(Self {
            n: n32,
            k: k32,
            values,
        })
    }
}

/// Queues `epilogue(x W^T)` for bf16 rows `x` (`[m, k]`, dense, 16-byte aligned) into `out`
/// (`[m, epilogue.out_cols(n)]` bf16, dense) on the bf16 GEMM: no quantization, f32 sums.
///
/// # Safety
/// `x`, `out` and a residual must be valid device memory of those sizes until the kernel is
/// done.
pub unsafe fn bf16_linear(
    rt: &Arc<Runtime>,
    w: &DeviceBf16Weight,
    x: DevicePtr<bf16>,
    m: u32,
    out: DevicePtrMut<bf16>,
    epilogue: Fp8LinearEpilogue,
) -> Result<()> {
    if m == 0 {
        return Ok(());
    }
    let gemm = Bf16TcGemm {
        a: x,
        w: w.values.as_ptr(),
        epilogue: epilogue.gemm(out, w.n),
        m,
        n: w.n,
        k: w.k,
        ldo: epilogue.out_cols(w.n),
    };
    // SAFETY: the caller's guarantees; the weight's buffer lives as long as `w`.
    unsafe { bf16_tc_gemm(rt, &gemm) }
}
