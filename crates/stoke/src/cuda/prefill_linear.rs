//! `linear` for prefill-sized inputs through Stoke's persistent wgmma GEMM (`stoke_cuda::prefill_gemm`),
//! on a packed INT4 weight or a pinned dense bf16 one, with the residual or SwiGLU epilogue on
//! chip. How a weight runs is its plan's prefill mode (`crate::plan::PrefillMode`, given when
//! its model prepared it). The weight's values (a packed weight's dequantized ones) are copied
//! once, at the first call, beside the weight (`PrefillCopies`):
//! - `Bf16`: in bf16 as `[n, k]`; each call reads its bf16 rows as they are;
//! - `Fp8`: in E4M3 with one scale per output channel (`stoke_formats::fp8::Fp8Weight`): each
//!   call quantizes its rows to E4M3 with one scale per row first, except the down
//!   projection's: the gate|up GEMM's SwiGLU epilogue writes them in E4M3 with a delayed
//!   per-tensor scale ([`Fp8Activation`]), kept with the gate|up weight;
//! - `Fp8Int4`: a packed weight is not copied: the FP8 GEMM reads its INT4 words and group
//!   scales as they are and expands them to E4M3 inside its mainloop; its rows are quantized in
//!   the words' k order, with an RMSNorm's gain.
//!
//! An RMSNorm of prefill rows whose gain's plan folds it into FP8 projections is deferred
//! ([`RmsNormed`]): a projection that reads it reads a second E4M3 copy with the norm's gain
//! folded into its rows (`diag(gamma) W`, quantized after the fold) and quantizes the norm's
//! input with the row factor carried in the row scales, so no normalized activation is
//! written. Anything else that reads the norm's output gets it from the RMSNorm kernel, once.

use super::bridge::{DeviceTensor, KernelInput, ResidentTensor, runtime_for};
use crate::packed::PackedWeight;
use crate::tensor::{StokeData, StokeTensor};
use burn_backend::{Backend, DType, Shape, TensorData, TensorMetadata};
use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use stoke_cuda::int4::DeviceInt4;
use stoke_cuda::kernels::int4_gemm::Epilogue;
use stoke_cuda::prefill_gemm::{
    DeviceBf16Weight, DeviceDelayedScale, DeviceFp8Rows, DeviceFp8Weight, Fp8LinearEpilogue,
    bf16_linear, fp8_linear_rows, fp8_swiglu_delayed_rows, int4_fp8_linear_rows, int4_fp8_takes,
};
use stoke_cuda::{DevicePtr, DevicePtrMut, Runtime};
use stoke_formats::fp8::Fp8Weight;

// Counters of the calls each path took (diagnostics for tests and reports; no op reads them).
static INT4_CALLS: AtomicU64 = AtomicU64::new(0);
static KERNEL_CALLS: AtomicU64 = AtomicU64::new(0);
static BF16_CALLS: AtomicU64 = AtomicU64::new(0);
static FOLDED_CALLS: AtomicU64 = AtomicU64::new(0);

/// The copies of one weight that the prefill GEMMs read (made at first use; `None` inside: it
/// could not be made, and that was logged), and the delayed scale of the E4M3 SwiGLU output a
/// gate|up weight writes.
#[derive(Default)]
pub(crate) struct PrefillCopies {
    fp8: OnceLock<Option<Arc<DeviceFp8Weight>>>,
    /// The E4M3 copy with the gain of the RMSNorm that feeds the weight folded in (the first
    /// gain it is called with; calls after a different norm read the plain copy).
    fp8_folded: OnceLock<Option<FoldedFp8>>,
    bf16_nk: OnceLock<Option<Arc<DeviceBf16Weight>>>,
    delayed: Mutex<Option<Arc<DeviceDelayedScale>>>,
}

impl PrefillCopies {
    /// The weight's delayed scale (made at its first use: no history, so that invocation runs
    /// per row and starts it; `None`, logged, where it cannot be made).
    fn delayed(&self, rt: &Arc<Runtime>) -> Option<Arc<DeviceDelayedScale>> {
        let mut slot = self.delayed.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = slot.as_ref() {
            return Some(d.clone());
        }
        match DeviceDelayedScale::new(rt, 1.0, 1.0) {
            Ok(d) => {
                let d = Arc::new(d);
                *slot = Some(d.clone());
                Some(d)
            }
            Err(e) => {
                tracing::warn!("stoke linear: no delayed FP8 scale ({e}); SwiGLU output in bf16");
                None
            }
        }
    }
}

/// An E4M3 copy of `diag(gamma) W`, and the gain it holds (kept alive, so that its address
/// names it).
struct FoldedFp8 {
    gamma_ptr: u64,
    _gamma: Box<dyn Any + Send + Sync>,
    w: Arc<DeviceFp8Weight>,
}

/// The output of an RMSNorm of prefill rows whose gain folds into FP8 projections, not yet
/// computed: the projections that read it (the prefill GEMM's `linear` and q|k|v calls) take `x` and
/// the gain folded into their E4M3 copy; anything else reads the normalized bf16 rows, which
/// the RMSNorm kernel computes at the first such read (on Stoke's stream).
pub struct RmsNormed<I: Backend> {
    x: StokeTensor<I>,
    gamma: StokeTensor<I>,
    gamma_ptr: u64,
    eps: f64,
    normed: OnceLock<StokeTensor<I>>,
}

impl<I: Backend> std::fmt::Debug for RmsNormed<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RmsNormed({:?})", self.x.shape())
    }
}

impl<I: Backend> RmsNormed<I> {
    /// `rms_norm(x, gamma, eps)` deferred, where `gamma` is a pinned bf16 `[hidden]` weight
    /// whose plan folds it into FP8 projections, `x` is bf16 `[.., hidden]` with more rows than
    /// the W4A16 kernels take and `hidden` a multiple of 16, and Stoke's runtime runs on the
    /// device; `None` otherwise.
    pub(crate) fn defer(x: &StokeTensor<I>, gamma: &StokeTensor<I>, eps: f64) -> Option<Self> {
        let g = gamma.downcast_ref::<ResidentTensor<I>>()?;
        if !g.plan.fold_into_fp8 || x.dtype() != DType::BF16 {
            return None;
        }
        let shape = x.shape();
        let hidden = *shape.as_slice().last()?;
        let rows = shape.num_elements() / hidden.max(1);
        if hidden == 0
            || !hidden.is_multiple_of(16)
            || rows <= super::int4_linear::MAX_KERNEL_ROWS
            || rows > u32::MAX as usize
            || g.dtype() != DType::BF16
            || g.shape().as_slice() != [hidden]
        {
            return None;
        }
        runtime_for::<I>(&super::float_device(x))?;
        Some(Self {
            x: x.clone(),
            gamma: gamma.clone(),
            gamma_ptr: g.ptr(),
            eps,
            normed: OnceLock::new(),
        })
    }

    /// The normalized rows (computed at the first call).
    pub(crate) fn normed(&self) -> &StokeTensor<I> {
        self.normed.get_or_init(|| {
            super::rms_norm::rms_norm_now::<I>(self.x.clone(), self.gamma.clone(), self.eps)
        })
    }
}

impl<I: Backend> StokeData<I> for RmsNormed<I> {
    fn shape(&self) -> Shape {
        self.x.shape()
    }
    fn dtype(&self) -> DType {
        DType::BF16
    }
    fn device(&self) -> I::Device {
        super::float_device(&self.x)
    }
    fn materialize(&self) -> I::FloatTensorPrimitive {
        self.normed().clone().into_inner()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The state of `weight`'s delayed FP8 scale (a gate|up weight that ran FP8 prefill: the scale
/// of its SwiGLU output), after Stoke's queued work: its invocations, saturated values and next
/// scale; `None` for a weight without one. Waits for the device.
pub fn delayed_scale<I: Backend>(
    weight: &StokeTensor<I>,
) -> Option<Result<stoke_formats::fp8::DelayedScale, String>> {
    let packed_copies;
    let copies = match weight.downcast_ref::<PackedWeight<I>>() {
        Some(p) => {
            packed_copies = p.slots.get_or_init(PrefillCopies::default);
            &*packed_copies
        }
        None => &weight.downcast_ref::<ResidentTensor<I>>()?.prefill,
    };
    let d = copies
        .delayed
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()?;
    Some(d.read().map_err(|e| e.to_string()))
}

/// The E4M3 SwiGLU output of an FP8 gate|up projection (`[.., inter]`, presenting as bf16):
/// the down projection's FP8 GEMM reads the codes and their scale as they are; anything else
/// reads their bf16 values, dequantized on Stoke's stream once.
pub struct Fp8Activation<I: Backend> {
    rows: Arc<DeviceFp8Rows>,
    rt: Arc<Runtime>,
    shape: Shape,
    device: I::Device,
    bf16: OnceLock<DeviceTensor<I>>,
}

impl<I: Backend> std::fmt::Debug for Fp8Activation<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fp8Activation({:?}, {:?})", self.shape, self.rows)
    }
}

impl<I: Backend> Fp8Activation<I> {
    /// The bf16 values in a Stoke buffer (dequantized at the first call).
    pub(crate) fn bf16(&self) -> &DeviceTensor<I> {
        self.bf16.get_or_init(|| {
            let out = DeviceTensor::<I>::alloc(
                &self.rt,
                self.shape.clone(),
                DType::BF16,
                self.device.clone(),
            );
            // SAFETY: out holds m k bf16 and lives as long as `self`.
            unsafe { self.rows.dequantize(&self.rt, DevicePtrMut::new(out.ptr())) }
                .unwrap_or_else(|e| panic!("stoke: dequantizing E4M3 rows failed: {e}"));
            out
        })
    }
}

impl<I: Backend> StokeData<I> for Fp8Activation<I> {
    fn shape(&self) -> Shape {
        self.shape.clone()
    }
    fn dtype(&self) -> DType {
        DType::BF16
    }
    fn device(&self) -> I::Device {
        self.device.clone()
    }
    fn materialize(&self) -> I::FloatTensorPrimitive {
        self.bf16().materialize()
    }
    fn read(&self) -> Option<TensorData> {
        StokeData::read(self.bf16())
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// How many of the [`kernel_calls`] read a packed INT4 weight as it is (`PrefillMode::Fp8Int4`).
pub fn int4_kernel_calls() -> u64 {
    INT4_CALLS.load(Ordering::Relaxed)
}

/// How many `linear` calls have run on the FP8 GEMM in this process.
pub fn kernel_calls() -> u64 {
    KERNEL_CALLS.load(Ordering::Relaxed)
}

/// How many of the [`kernel_calls`] read an RMSNorm's input with its gain folded into the
/// weight's E4M3 copy, or on a packed weight read as it is into the input's quantization
/// ([`RmsNormed`]).
pub fn folded_norm_calls() -> u64 {
    FOLDED_CALLS.load(Ordering::Relaxed)
}

/// How many `linear` calls have run on the bf16 prefill GEMM in this process.
pub fn bf16_kernel_calls() -> u64 {
    BF16_CALLS.load(Ordering::Relaxed)
}

/// The `[n, k]` E4M3 copy of a weight given as its `[n, k]` f32 values: `Fp8Weight::quantize`
/// on blocks of output channels across the host's cores (each channel's scale is its own, so
/// the blocks put together are the whole weight's copy).
fn fp8_of_values(t: &[f32], k: usize, n: usize) -> Result<Fp8Weight, String> {
    use rayon::prelude::*;
    const CHANNELS: usize = 64;
    let blocks: Vec<Fp8Weight> = t
        .par_chunks((CHANNELS * k).max(1))
        .map(|b| Fp8Weight::quantize(b, b.len() / k.max(1), k, None))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let mut w = Fp8Weight {
        n,
        k,
        codes: Vec::with_capacity(n * k),
        scales: Vec::with_capacity(n),
    };
    for b in blocks {
        w.codes.extend(b.codes);
        w.scales.extend(b.scales);
    }
    if w.scales.len() != n || w.codes.len() != n * k {
        return Err(format!("E4M3 copy of [{n}, {k}] from {} values", t.len()));
    }
    Ok(w)
}

/// A packed weight's dequantized values transposed to `[n, k]` (`d * q + m` in f32, as
/// `PackedInt4::dequantize` computes them), one output channel per task across the host's
/// cores: an 8B model's copies are made at its first prefill.
fn packed_values_nk(p: &stoke_formats::int4::PackedInt4) -> Vec<f32> {
    use rayon::prelude::*;
    let (k, n) = (p.k, p.n);
    let mut out = vec![0f32; n * k];
    out.par_chunks_mut(k.max(1))
        .enumerate()
        .for_each(|(col, row)| {
            for (i, v) in row.iter_mut().enumerate() {
                let (w, shift) = stoke_formats::int4::nibble_position(n, i, col);
                let q = (p.words[w] >> shift) & 0xF;
                let (d, m) = p.group_params(i, col);
                *v = d * q as f32 + m;
            }
        });
    out
}

/// A weight the FP8 GEMM takes: a packed INT4 one, or a pinned bf16 `[k, n]` one.
#[derive(Clone, Copy)]
enum Source<'a, I: Backend> {
    Packed(&'a PackedWeight<I>),
    Resident(&'a ResidentTensor<I>),
}

/// The values of a pinned bf16 weight `[k, n]`, read from the device, transposed to `[n, k]`.
fn resident_values_nk<I: Backend>(
    rt: &stoke_cuda::Runtime,
    w: &ResidentTensor<I>,
    k: usize,
    n: usize,
) -> Result<Vec<f32>, String> {
    use rayon::prelude::*;
    let mut bytes = vec![0u8; k * n * 2];
    // SAFETY: the pinned weight holds k x n bf16 and lives as long as `w`.
    unsafe { rt.copy_dtoh(&mut bytes, w.ptr()) }.map_err(|e| e.to_string())?;
    let mut out = vec![0f32; n * k];
    out.par_chunks_mut(k.max(1))
        .enumerate()
        .for_each(|(col, row)| {
            for (i, v) in row.iter_mut().enumerate() {
                let b = 2 * (i * n + col);
                *v = half::bf16::from_le_bytes([bytes[b], bytes[b + 1]]).to_f32();
            }
        });
    Ok(out)
}

/// A prefill GEMM call made ready: the weight's copy for the mode, the runtime, `m` rows of
/// `x [.., k]` against `n` columns; `normed`: `x` is an [`RmsNormed`] whose gain the (E4M3)
/// copy holds folded in.
struct Prepared<'a, I: Backend> {
    rt: Arc<Runtime>,
    copy: Copy,
    copies: Arc<PrefillCopies>,
    device: I::Device,
    m: usize,
    n: usize,
    normed: Option<&'a RmsNormed<I>>,
}

impl<I: Backend> Prepared<'_, I> {
    /// The E4M3 rows of the call's input `x` for the FP8 copy `w`: an FP8 gate|up
    /// projection's output as it is, an [`RmsNormed`]'s input quantized with the norm's row
    /// factor where the copy holds its gain, otherwise `x` quantized per row (queued on
    /// Stoke's stream). `None` where `x`'s rows are not 16-byte aligned.
    fn fp8_rows(
        &self,
        x: &StokeTensor<I>,
        w: &DeviceFp8Weight,
    ) -> Option<stoke_cuda::Result<Arc<DeviceFp8Rows>>> {
        if let Some(act) = x.downcast_ref::<Fp8Activation<I>>()
            && act.rows.k == w.k
        {
            return Some(Ok(act.rows.clone()));
        }
        let src = self.normed.map_or(x, |nx| &nx.x);
        let x_in = KernelInput::resolve(&self.rt, src, &self.device);
        if !x_in.ptr.is_multiple_of(16) {
            return None;
        }
        let (xp, m) = (DevicePtr::new(x_in.ptr), self.m as u32);
        // SAFETY: x is pinned (or Stoke-owned) until the kernel is done (KernelInput); the
        // rows are freed stream-ordered after the kernels that read them.
        let rows = unsafe {
            match self.normed {
                Some(nx) => DeviceFp8Rows::quantize_rms_normed(&self.rt, xp, m, w.k, nx.eps as f32),
                None => DeviceFp8Rows::quantize(&self.rt, xp, m, w.k, DevicePtrMut::NULL),
            }
        };
        drop(x_in);
        Some(rows.map(Arc::new))
    }

    /// Queues `epilogue(x W^T)` into `out` on the call's copy: on the FP8 copy from `x`'s
    /// E4M3 rows ([`Prepared::fp8_rows`]), on the bf16 one from `x` as it is. `None` where
    /// `x`'s rows are not 16-byte aligned.
    ///
    /// # Safety
    /// `out` and the epilogue's buffers must be valid device memory for the call's `m` rows
    /// until the kernel is done.
    unsafe fn linear(
        &self,
        x: &StokeTensor<I>,
        out: DevicePtrMut<half::bf16>,
        epilogue: Fp8LinearEpilogue,
    ) -> Option<stoke_cuda::Result<()>> {
        match &self.copy {
            Copy::Fp8(w) => Some(self.fp8_rows(x, w)?.and_then(|rows| {
                // SAFETY: the caller's guarantees; the rows and the weight live until the
                // kernel is done (freed stream-ordered).
                unsafe { fp8_linear_rows(&self.rt, w, &rows, out, epilogue) }
            })),
            Copy::Int4(w) => Some(self.int4_rows(x, w.k)?.and_then(|rows| {
                // SAFETY: the caller's guarantees; the rows and the weight live until the
                // kernel is done (freed stream-ordered).
                unsafe { int4_fp8_linear_rows(&self.rt, w, &rows, out, epilogue) }
            })),
            Copy::Bf16(w) => {
                let x_in = KernelInput::resolve(&self.rt, x, &self.device);
                if !x_in.ptr.is_multiple_of(16) {
                    return None;
                }
                let xp = DevicePtr::new(x_in.ptr);
                // SAFETY: the caller's guarantees; x is pinned (or Stoke-owned) until the
                // kernel is done.
                Some(unsafe { bf16_linear(&self.rt, w, xp, self.m as u32, out, epilogue) })
            }
        }
    }

    /// The interleaved E4M3 rows an INT4 weight of `k` rows reads: an [`RmsNormed`]'s input
    /// times the norm's gain with its row factor in the scales, otherwise `x` (queued on
    /// Stoke's stream). `None` where `x`'s rows or the gain are not 16-byte aligned.
    fn int4_rows(&self, x: &StokeTensor<I>, k: u32) -> Option<stoke_cuda::Result<DeviceFp8Rows>> {
        let (src, gain) = match self.normed {
            Some(nx) => (&nx.x, Some(&nx.gamma)),
            None => (x, None),
        };
        let x_in = KernelInput::resolve(&self.rt, src, &self.device);
        let g_in = gain.map(|g| KernelInput::resolve(&self.rt, g, &self.device));
        if !x_in.ptr.is_multiple_of(16) || g_in.as_ref().is_some_and(|g| !g.ptr.is_multiple_of(16))
        {
            return None;
        }
        let gain = g_in
            .as_ref()
            .map_or(DevicePtr::NULL, |g| DevicePtr::new(g.ptr));
        // SAFETY: x and the gain are pinned (or Stoke-owned) until the kernel is done
        // (KernelInput); the rows are freed stream-ordered after the kernels that read them.
        let rows = unsafe {
            DeviceFp8Rows::quantize_interleaved(
                &self.rt,
                DevicePtr::new(x_in.ptr),
                self.m as u32,
                k,
                gain,
                self.normed.map(|nx| nx.eps as f32),
            )
        };
        drop((x_in, g_in));
        Some(rows)
    }

    /// Counts a call.
    fn count(&self) {
        self.copy.count();
        if self.normed.is_some() {
            FOLDED_CALLS.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The E4M3 copy of `diag(gamma) W` for a weight fed by the deferred RMSNorm `nx` (made at
/// the first call from `values`, `[n, k]`; the gain read from the device once); `None` where
/// the weight's folded copy holds another gain or could not be made.
fn folded_copy<I: Backend>(
    rt: &Arc<Runtime>,
    copies: &PrefillCopies,
    nx: &RmsNormed<I>,
    k: usize,
    n: usize,
    values: impl FnOnce() -> Result<Vec<f32>, String>,
) -> Option<Arc<DeviceFp8Weight>> {
    let folded = copies.fp8_folded.get_or_init(|| {
        let t = std::time::Instant::now();
        let make = || -> Result<Arc<DeviceFp8Weight>, String> {
            let g = nx
                .gamma
                .downcast_ref::<ResidentTensor<I>>()
                .ok_or("the gain is not pinned")?;
            // The pinned gain holds k bf16 (checked by RmsNormed::defer): a [k, 1] weight.
            let gamma = resident_values_nk(rt, g, k, 1)?;
            let mut t = values()?;
            fold_gain(&mut t, &gamma);
            let w = fp8_of_values(&t, k, n)?;
            DeviceFp8Weight::upload(rt, &w)
                .map(Arc::new)
                .map_err(|e| e.to_string())
        };
        match make() {
            Ok(w) => {
                tracing::debug!(
                    "stoke linear: gain-folded E4M3 copy of [{k}, {n}] made in {:.1} ms",
                    t.elapsed().as_secs_f64() * 1e3
                );
                Some(FoldedFp8 {
                    gamma_ptr: nx.gamma_ptr,
                    _gamma: Box::new(nx.gamma.clone()),
                    w,
                })
            }
            Err(e) => {
                tracing::warn!(
                    "stoke linear: no gain-folded E4M3 copy of [{k}, {n}] ({e}); the norm's \
                     output is computed and read by the plain copy"
                );
                None
            }
        }
    });
    folded
        .as_ref()
        .filter(|f| f.gamma_ptr == nx.gamma_ptr)
        .map(|f| f.w.clone())
}

/// `diag(gamma) W` in place for `t` = `W^T` (`[n, k]`): each row's `i`-th value times
/// `gamma[i]`.
fn fold_gain(t: &mut [f32], gamma: &[f32]) {
    use rayon::prelude::*;
    t.par_chunks_mut(gamma.len().max(1)).for_each(|row| {
        for (v, g) in row.iter_mut().zip(gamma) {
            *v *= g;
        }
    });
}

/// The prefill GEMM's copy of `weight` for `x` (by the weight's plan: bf16, E4M3, or the packed
/// INT4 weight itself; the gain-folded FP8 copy for an [`RmsNormed`] `x`), when
/// `weight` is a [`PackedWeight`] or a pinned bf16 weight `[k, n]` (`k` a multiple of 16, `n`
/// even), `x` is bf16 `[.., k]` with more rows than the W4A16 kernels take, `takes_n` accepts
/// the weight's `n` columns, Stoke's runtime runs on the device and the copy could be made (at
/// the first call: the checks come first); `None` otherwise.
fn prepare<'a, I: Backend>(
    x: &'a StokeTensor<I>,
    weight: &'a StokeTensor<I>,
    takes_n: impl FnOnce(usize) -> bool,
) -> Option<Prepared<'a, I>> {
    // The weight's shape and the slots its E4M3 and bf16 [n, k] copies are kept in.
    let source = match weight.downcast_ref::<PackedWeight<I>>() {
        Some(pw) => Source::Packed(pw),
        None => Source::Resident(
            weight
                .downcast_ref::<ResidentTensor<I>>()
                .filter(|r| r.dtype() == DType::BF16)?,
        ),
    };
    let mode = match source {
        Source::Packed(pw) => pw.prefill_mode,
        Source::Resident(rw) => rw.plan.prefill,
    };
    let fp8 = mode.is_fp8();
    let (k, n, copies) = match source {
        Source::Packed(pw) => (
            pw.packed.k,
            pw.packed.n,
            pw.slots.get_or_init(PrefillCopies::default),
        ),
        Source::Resident(rw) => match rw.shape().as_slice() {
            &[k, n] => (k, n, rw.prefill.clone()),
            _ => return None,
        },
    };
    let shape = x.shape();
    if x.dtype() != DType::BF16 || shape.as_slice().last() != Some(&k) {
        return None;
    }
    let m = shape.num_elements() / k.max(1);
    if m <= super::int4_linear::MAX_KERNEL_ROWS
        || !k.is_multiple_of(16)
        || !n.is_multiple_of(2)
        || m > u32::MAX as usize
        || n > u32::MAX as usize
        || !takes_n(n)
    {
        return None;
    }
    let device = super::float_device(x);
    let rt = runtime_for::<I>(&device)?;
    // The weight's values `[n, k]` (a packed weight's dequantized ones).
    let values = || match source {
        Source::Packed(pw) => Ok(packed_values_nk(&pw.packed)),
        Source::Resident(rw) => resident_values_nk(&rt, rw, k, n),
    };
    let normed = x.downcast_ref::<RmsNormed<I>>().filter(|_| fp8);
    // A packed weight read as it is: the gain (if any) goes into the activations.
    if mode == crate::plan::PrefillMode::Fp8Int4
        && let Source::Packed(pw) = source
        && int4_fp8_takes(k, n, pw.packed.group)
        && let Some(w) = super::int4_linear::device_int4(pw, &rt)
    {
        return Some(Prepared {
            rt,
            copy: Copy::Int4(w),
            copies,
            device,
            m,
            n,
            normed,
        });
    }
    if let Some(nx) = normed
        && let Some(w) = folded_copy(&rt, &copies, nx, k, n, values)
    {
        return Some(Prepared {
            rt,
            copy: Copy::Fp8(w),
            copies,
            device,
            m,
            n,
            normed: Some(nx),
        });
    }
    let copy = if fp8 {
        Copy::Fp8(made(&copies.fp8, "E4M3", k, n, || {
            values()
                .and_then(|t| fp8_of_values(&t, k, n))
                .and_then(|w| DeviceFp8Weight::upload(&rt, &w).map_err(|e| e.to_string()))
        })?)
    } else {
        Copy::Bf16(made(&copies.bf16_nk, "bf16 [n, k]", k, n, || {
            values()
                .and_then(|t| DeviceBf16Weight::upload(&rt, &t, n, k).map_err(|e| e.to_string()))
        })?)
    };
    Some(Prepared {
        rt,
        copy,
        copies,
        device,
        m,
        n,
        normed: None,
    })
}

impl Copy {
    /// Counts a call on this copy.
    fn count(&self) {
        match self {
            Copy::Fp8(_) => KERNEL_CALLS.fetch_add(1, Ordering::Relaxed),
            Copy::Int4(_) => {
                INT4_CALLS.fetch_add(1, Ordering::Relaxed);
                KERNEL_CALLS.fetch_add(1, Ordering::Relaxed)
            }
            Copy::Bf16(_) => BF16_CALLS.fetch_add(1, Ordering::Relaxed),
        };
    }
}

/// The q|k|v projection of a packed prefill on the prefill GEMM with its q|k|v epilogue: q
/// (`[.., heads x d]` bf16, returned) rotated, k and v rotated into the KV cache that `target`
/// names (its `q` is the returned tensor's buffer), or the launch's error. `None` where the GEMM
/// does not take `x` and `weight` (see [`prepare`]), or `weight` is not `[k, (heads + 2
/// kv_heads) d]`.
///
/// # Safety
/// `target`'s caches and row tables must be valid as `stoke_cuda::kernels::fp8_gemm::fp8_gemm`
/// requires until the kernel is done, for the rows of `x`.
pub(crate) unsafe fn try_prefill_qkv<I: Backend>(
    x: &StokeTensor<I>,
    weight: &StokeTensor<I>,
    target: stoke_cuda::kernels::fp8_gemm::QkvEpilogue,
) -> Option<stoke_cuda::Result<StokeTensor<I>>> {
    let (d, heads) = (target.head_dim() as usize, target.heads as usize);
    let p = prepare(x, weight, |n| {
        n == (heads + 2 * target.kv_heads() as usize) * d
    })?;
    let out_shape = super::with_cols(x.shape().as_slice(), heads * d);
    let out = DeviceTensor::<I>::alloc(&p.rt, out_shape, DType::BF16, p.device.clone());
    let q = DevicePtrMut::new(out.ptr());
    // SAFETY: out is a Stoke buffer of m x heads x d bf16, the caches and tables are the
    // caller's.
    let r = unsafe { p.linear(x, q, Fp8LinearEpilogue::Qkv(target)) }?;
    if r.is_ok() {
        p.count();
    }
    Some(r.map(|()| StokeTensor::owned(out)))
}

/// `epilogue(x @ W)` on the prefill GEMM where [`prepare`] takes `x` and `weight` and the
/// residual fits; `None` otherwise.
pub(crate) fn try_prefill_linear_with<I: Backend>(
    x: &StokeTensor<I>,
    weight: &StokeTensor<I>,
    epilogue: Epilogue,
    residual: Option<&StokeTensor<I>>,
) -> Option<StokeTensor<I>> {
    let shape = x.shape();
    let dims = shape.as_slice();
    let p = prepare(x, weight, |n| {
        super::residual_fits(epilogue, residual, dims, n)
    })?;
    let (rt, n) = (&p.rt, p.n);
    let res_in = residual
        .filter(|_| epilogue == Epilogue::Residual)
        .map(|r| KernelInput::resolve(rt, r, &p.device));
    let fe = match (&res_in, epilogue) {
        (Some(r), Epilogue::Residual) => Fp8LinearEpilogue::Residual(DevicePtr::new(r.ptr)),
        (_, Epilogue::SwiGlu) => Fp8LinearEpilogue::SwiGlu,
        _ => Fp8LinearEpilogue::Plain,
    };
    let out_shape = super::with_cols(dims, fe.out_cols(n as u32) as usize);
    let fail = |e: stoke_cuda::Error| -> ! { panic!("stoke linear (prefill GEMM): {e}") };
    // The SwiGLU output of an FP8 gate|up projection stays in E4M3 for the down projection.
    if let (Copy::Fp8(w), Epilogue::SwiGlu) = (&p.copy, epilogue)
        && (n / 2).is_multiple_of(16)
        && let Some(state) = p.copies.delayed(rt)
    {
        let rows = p.fp8_rows(x, w)?.unwrap_or_else(|e| fail(e));
        let h = fp8_swiglu_delayed_rows(rt, w, &rows, &state).unwrap_or_else(|e| fail(e));
        p.count();
        return Some(StokeTensor::owned(Fp8Activation::<I> {
            rows: Arc::new(h),
            rt: rt.clone(),
            shape: out_shape,
            device: p.device.clone(),
            bf16: OnceLock::new(),
        }));
    }
    let out = DeviceTensor::<I>::alloc(rt, out_shape, DType::BF16, p.device.clone());
    // SAFETY: the residual is pinned (or Stoke-owned) until the kernel is done, out is a Stoke
    // buffer of m * out_cols bf16.
    unsafe { p.linear(x, DevicePtrMut::new(out.ptr()), fe) }?.unwrap_or_else(|e| fail(e));
    drop(res_in);
    p.count();
    Some(StokeTensor::owned(out))
}

/// The weight copy one call reads.
enum Copy {
    Fp8(Arc<DeviceFp8Weight>),
    /// The packed weight itself (`PrefillMode::Fp8Int4`).
    Int4(Arc<DeviceInt4>),
    Bf16(Arc<DeviceBf16Weight>),
}

/// The copy in `slot`, made by `make` at the first call (logged; `None` for good, and logged,
/// when it cannot be made: the inner backend's matmul serves instead).
fn made<W>(
    slot: &OnceLock<Option<Arc<W>>>,
    what: &str,
    k: usize,
    n: usize,
    make: impl FnOnce() -> Result<W, String>,
) -> Option<Arc<W>> {
    slot.get_or_init(|| {
        let t = std::time::Instant::now();
        match make() {
            Ok(w) => {
                tracing::debug!(
                    "stoke linear: {what} copy of [{k}, {n}] made in {:.1} ms",
                    t.elapsed().as_secs_f64() * 1e3
                );
                Some(Arc::new(w))
            }
            Err(e) => {
                tracing::warn!(
                    "stoke linear: no {what} copy of [{k}, {n}] ({e}); the inner backend's \
                     matmul instead"
                );
                None
            }
        }
    })
    .clone()
}

#[cfg(test)]
mod tests {
    use stoke_formats::fp8::Fp8Weight;
    use stoke_formats::int4::{ScaleType, quantize_rtn};
    use stoke_formats::kv::E4M3_MAX;

    #[test]
    fn prefill_copies_are_the_transposed_dequantized_weight() {
        let (k, n) = (64, 128);
        let w: Vec<f32> = (0..k * n)
            .map(|i| ((i * 7919) % 263) as f32 / 131.0 - 1.0)
            .collect();
        let packed = quantize_rtn(&w, k, n, 32, ScaleType::Bf16).unwrap();
        let deq = packed.dequantize();
        let t = super::packed_values_nk(&packed);
        assert_eq!(t, stoke_formats::transpose(&deq, k, n));
        let f = super::fp8_of_values(&t, k, n).unwrap();
        assert_eq!(f, Fp8Weight::quantize(&t, n, k, None).unwrap());
        assert_eq!((f.n, f.k), (n, k));
        let back = f.dequantize();
        for j in 0..n {
            let amax = (0..k).map(|i| deq[i * n + j].abs()).fold(0f32, f32::max);
            assert!((f.scales[j] - amax / E4M3_MAX).abs() <= 1e-7 * amax);
            for i in 0..k {
                let (want, got) = (deq[i * n + j], back[j * k + i]);
                // One E4M3 rounding: half a step, 2^-4 of the value (2^-10 of the scale below
                // the normal range).
                assert!(
                    (got - want).abs() <= want.abs() / 16.0 + f.scales[j] / 1024.0,
                    "[{i}][{j}]: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn a_folded_copy_is_the_quantized_product_with_the_gain() {
        let (k, n) = (48, 40);
        let w: Vec<f32> = (0..k * n)
            .map(|i| ((i * 7919) % 211) as f32 / 97.0 - 1.0)
            .collect();
        let gamma: Vec<f32> = (0..k).map(|i| 0.25 + (i % 7) as f32 * 0.5).collect();
        // W^T [n, k], then diag(gamma) W: row j's i-th value times gamma[i].
        let mut t = stoke_formats::transpose(&w, k, n);
        super::fold_gain(&mut t, &gamma);
        let want: Vec<f32> = (0..n)
            .flat_map(|j| (0..k).map(move |i| (i, j)))
            .map(|(i, j)| w[i * n + j] * gamma[i])
            .collect();
        assert_eq!(t, want);
        assert_eq!(
            super::fp8_of_values(&t, k, n).unwrap(),
            Fp8Weight::quantize(&want, n, k, None).unwrap()
        );
    }
}
