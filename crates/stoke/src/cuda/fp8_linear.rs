//! `linear` for prefill-sized inputs through Stoke's persistent wgmma GEMM (`stoke_cuda::fp8`),
//! on a packed INT4 weight or a pinned dense bf16 one, with the residual or SwiGLU epilogue on
//! chip. The weight's values (a packed weight's dequantized ones) are copied once, at the first
//! call, beside the weight (`PrefillCopies`):
//! - in bf16 as `[n, k]` (the default): each call reads its bf16 rows as they are;
//! - with FP8 prefill on ([`set_fp8_prefill`]), in E4M3 with one scale per output channel
//!   (`stoke_formats::fp8::Fp8Weight`): each call quantizes its rows to E4M3 with one scale
//!   per row first, except the down projection's: the gate|up GEMM's SwiGLU epilogue writes
//!   them in E4M3 with a delayed per-tensor scale ([`Fp8Activation`]), kept per weight and
//!   request group ([`set_fp8_scale_group`]).

use super::bridge::{DeviceTensor, KernelInput, ResidentTensor, runtime_for};
use crate::packed::PackedWeight;
use crate::tensor::{StokeData, StokeTensor};
use burn_backend::{Backend, DType, Shape, TensorMetadata};
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use stoke_cuda::fp8::{
    DeviceBf16Weight, DeviceDelayedScale, DeviceFp8Rows, DeviceFp8Weight, Fp8LinearEpilogue,
    bf16_linear, fp8_linear, fp8_linear_rows, fp8_swiglu_delayed,
};
use stoke_cuda::kernels::int4_gemm::Epilogue;
use stoke_cuda::{DevicePtr, DevicePtrMut, Runtime};
use stoke_formats::fp8::Fp8Weight;

static ENABLED: AtomicBool = AtomicBool::new(false);
static KERNEL_CALLS: AtomicU64 = AtomicU64::new(0);
static BF16_CALLS: AtomicU64 = AtomicU64::new(0);
static SCALE_GROUP: AtomicU64 = AtomicU64::new(0);
/// Every delayed scale made in this process (for [`delayed_scales`]).
static DELAYED: Mutex<Vec<(u64, Weak<DeviceDelayedScale>)>> = Mutex::new(Vec::new());

/// The copies of one weight that the prefill GEMMs read (made at first use; `None` inside: it
/// could not be made, and that was logged), and the delayed scales of the E4M3 SwiGLU output
/// a gate|up weight writes, one per request group.
#[derive(Default)]
pub(crate) struct PrefillCopies {
    fp8: OnceLock<Option<Arc<DeviceFp8Weight>>>,
    bf16_nk: OnceLock<Option<Arc<DeviceBf16Weight>>>,
    delayed: Mutex<HashMap<u64, Arc<DeviceDelayedScale>>>,
}

impl PrefillCopies {
    /// The delayed scale of the current request group (made at its first use: no history, so
    /// that invocation runs per row and starts it; `None`, logged, where it cannot be made).
    fn delayed(&self, rt: &Arc<Runtime>) -> Option<Arc<DeviceDelayedScale>> {
        let group = fp8_scale_group();
        let mut map = self.delayed.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = map.get(&group) {
            return Some(d.clone());
        }
        match DeviceDelayedScale::new(rt, 1.0, 1.0) {
            Ok(d) => {
                let d = Arc::new(d);
                map.insert(group, d.clone());
                let mut all = DELAYED.lock().unwrap_or_else(|e| e.into_inner());
                all.retain(|(_, w)| w.strong_count() > 0);
                all.push((group, Arc::downgrade(&d)));
                Some(d)
            }
            Err(e) => {
                tracing::warn!("stoke linear: no delayed FP8 scale ({e}); SwiGLU output in bf16");
                None
            }
        }
    }
}

/// Sets the request group whose delayed FP8 scales the following prefills use and update (0
/// at start). The SwiGLU output of FP8 prefill goes to the down projection in E4M3 with one
/// scale per tensor, derived from the largest values of that layer's last
/// [`stoke_formats::fp8::DELAYED_HISTORY`] invocations in the same group: requests of
/// different kinds (languages, tasks, tenants) kept in separate groups do not widen each
/// other's scales. A group's first invocation in each layer runs per row and starts its
/// history.
pub fn set_fp8_scale_group(group: u64) {
    SCALE_GROUP.store(group, Ordering::Relaxed);
}

/// See [`set_fp8_scale_group`].
pub fn fp8_scale_group() -> u64 {
    SCALE_GROUP.load(Ordering::Relaxed)
}

/// One delayed scale's state, read back from the device.
#[derive(Clone, Debug)]
pub struct DelayedScaleState {
    pub group: u64,
    pub state: stoke_formats::fp8::DelayedScale,
}

/// The state of every live delayed FP8 scale (one per gate|up weight and request group that
/// ran FP8 prefill), after Stoke's queued work: their invocations, saturated values and next
/// scales. Waits for the device.
pub fn delayed_scales() -> Result<Vec<DelayedScaleState>, String> {
    let all: Vec<(u64, Arc<DeviceDelayedScale>)> = DELAYED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(|(g, w)| Some((*g, w.upgrade()?)))
        .collect();
    all.into_iter()
        .map(|(group, d)| {
            let state = d.read().map_err(|e| e.to_string())?;
            Ok(DelayedScaleState { group, state })
        })
        .collect()
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
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Whether prefill-sized `linear` calls on packed or pinned bf16 weights run on the FP8 GEMM
/// or on the bf16 one (the default). Off by default: on SmolLM2 FP8 prefill raises perplexity
/// by 2.4% over bf16 with the delayed scales, 3.2% per row
/// (`results/h100-fp8-two-blocks-bdd5bf4.json`), about half of it the E4M3 rounding of the
/// already-INT4 weights. A model's output head stays on bf16 (`FusedOps::output_head`).
pub fn set_fp8_prefill(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// See [`set_fp8_prefill`].
pub fn fp8_prefill() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

thread_local! {
    /// Set while an output head runs on this thread ([`without_fp8`]).
    static HEAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with this thread's prefill GEMMs on bf16 whatever [`set_fp8_prefill`] says: a
/// model's output head (`FusedOps::output_head`), whose logits take its rounding directly.
pub(crate) fn without_fp8<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            HEAD.set(self.0);
        }
    }
    let _restore = Restore(HEAD.replace(true));
    f()
}

/// How many `linear` calls have run on the FP8 GEMM in this process.
pub fn kernel_calls() -> u64 {
    KERNEL_CALLS.load(Ordering::Relaxed)
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
/// `x [.., k]` against `n` columns.
struct Prepared<'a, I: Backend> {
    rt: Arc<Runtime>,
    copy: Copy,
    copies: &'a PrefillCopies,
    device: I::Device,
    m: usize,
    n: usize,
}

/// The prefill GEMM's copy of `weight` for `x` (FP8 when FP8 prefill is on,
/// [`set_fp8_prefill`], else bf16), when `weight` is a [`PackedWeight`] or a pinned bf16
/// weight `[k, n]` (`k` a multiple of 16, `n` even), `x` is bf16 `[.., k]` with more rows than
/// the W4A16 kernels take, `takes_n` accepts the weight's `n` columns, Stoke's runtime runs on
/// the device and the copy could be made (at the first call: the checks come first); `None`
/// otherwise.
fn prepare<'a, I: Backend>(
    x: &StokeTensor<I>,
    weight: &'a StokeTensor<I>,
    takes_n: impl FnOnce(usize) -> bool,
) -> Option<Prepared<'a, I>> {
    let fp8 = fp8_prefill() && !HEAD.get();
    // The weight's shape and the slots its E4M3 and bf16 [n, k] copies are kept in.
    let source = match weight.downcast_ref::<PackedWeight<I>>() {
        Some(pw) => Source::Packed(pw),
        None => Source::Resident(
            weight
                .downcast_ref::<ResidentTensor<I>>()
                .filter(|r| r.dtype() == DType::BF16)?,
        ),
    };
    let (k, n, copies) = match source {
        Source::Packed(pw) => (pw.packed.k, pw.packed.n, &pw.prefill),
        Source::Resident(rw) => match rw.shape().as_slice() {
            &[k, n] => (k, n, &rw.prefill),
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
    })
}

impl Copy {
    /// Counts a call on this copy.
    fn count(&self) {
        match self {
            Copy::Fp8(_) => KERNEL_CALLS.fetch_add(1, Ordering::Relaxed),
            Copy::Bf16(_) => BF16_CALLS.fetch_add(1, Ordering::Relaxed),
        };
    }

    /// Queues `epilogue(x W^T)` into `out` on this copy (FP8: `x` quantized per row first).
    ///
    /// # Safety
    /// As `stoke_cuda::fp8::fp8_linear`.
    unsafe fn linear(
        &self,
        rt: &Arc<Runtime>,
        x: DevicePtr<half::bf16>,
        m: usize,
        out: DevicePtrMut<half::bf16>,
        epilogue: Fp8LinearEpilogue,
    ) -> stoke_cuda::Result<()> {
        // SAFETY: the caller's guarantees; the weight's buffers are held by `self`.
        unsafe {
            match self {
                Copy::Fp8(w) => fp8_linear(rt, w, x, m as u32, out, epilogue),
                Copy::Bf16(w) => bf16_linear(rt, w, x, m as u32, out, epilogue),
            }
        }
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
    let x_in = KernelInput::resolve(&p.rt, x, &p.device);
    if !x_in.ptr.is_multiple_of(16) {
        return None;
    }
    let dims = x.shape();
    let out_shape = super::with_cols(dims.as_slice(), heads * d);
    let out = DeviceTensor::<I>::alloc(&p.rt, out_shape, DType::BF16, p.device.clone());
    let q = DevicePtrMut::new(out.ptr());
    // SAFETY: x is pinned (or Stoke-owned) until the kernel is done, out is a Stoke buffer of
    // m x heads x d bf16, the caches and tables are the caller's.
    let r = unsafe {
        p.copy.linear(
            &p.rt,
            DevicePtr::new(x_in.ptr),
            p.m,
            q,
            Fp8LinearEpilogue::Qkv(target),
        )
    };
    drop(x_in);
    if r.is_ok() {
        p.copy.count();
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
    let Prepared {
        rt,
        copy,
        copies,
        device,
        m,
        n,
    } = prepare(x, weight, |n| {
        super::residual_fits(epilogue, residual, dims, n)
    })?;
    let res_in = residual
        .filter(|_| epilogue == Epilogue::Residual)
        .map(|r| KernelInput::resolve(&rt, r, &device));
    let fe = match (&res_in, epilogue) {
        (Some(r), Epilogue::Residual) => Fp8LinearEpilogue::Residual(DevicePtr::new(r.ptr)),
        (_, Epilogue::SwiGlu) => Fp8LinearEpilogue::SwiGlu,
        _ => Fp8LinearEpilogue::Plain,
    };
    let out_shape = super::with_cols(dims, fe.out_cols(n as u32) as usize);
    let fail = |e: stoke_cuda::Error| -> ! { panic!("stoke linear (prefill GEMM): {e}") };
    // E4M3 rows from an FP8 gate|up projection go to the FP8 GEMM as they are.
    if let (Some(act), Copy::Fp8(w)) = (x.downcast_ref::<Fp8Activation<I>>(), &copy)
        && act.rows.k == w.k
    {
        let out = DeviceTensor::<I>::alloc(&rt, out_shape, DType::BF16, device);
        // SAFETY: the rows live as long as `x`, the residual is pinned (or Stoke-owned) until
        // the kernel is done, out is a Stoke buffer of m * out_cols bf16.
        unsafe { fp8_linear_rows(&rt, w, &act.rows, DevicePtrMut::new(out.ptr()), fe) }
            .unwrap_or_else(|e| fail(e));
        drop(res_in);
        copy.count();
        return Some(StokeTensor::owned(out));
    }
    let x_in = KernelInput::resolve(&rt, x, &device);
    if !x_in.ptr.is_multiple_of(16) {
        return None;
    }
    let xp = DevicePtr::new(x_in.ptr);
    // The SwiGLU output of an FP8 gate|up projection stays in E4M3 for the down projection.
    if let (Copy::Fp8(w), Epilogue::SwiGlu) = (&copy, epilogue)
        && (n / 2).is_multiple_of(16)
        && let Some(state) = copies.delayed(&rt)
    {
        // SAFETY: x is pinned (or Stoke-owned) until the kernels are done.
        let rows =
            unsafe { fp8_swiglu_delayed(&rt, w, xp, m as u32, &state) }.unwrap_or_else(|e| fail(e));
        drop(x_in);
        copy.count();
        return Some(StokeTensor::owned(Fp8Activation::<I> {
            rows: Arc::new(rows),
            rt,
            shape: out_shape,
            device,
            bf16: OnceLock::new(),
        }));
    }
    let out = DeviceTensor::<I>::alloc(&rt, out_shape, DType::BF16, device);
    // SAFETY: x and the residual are pinned (or Stoke-owned) until the kernels are done, out
    // is a Stoke buffer of m * out_cols bf16.
    unsafe { copy.linear(&rt, xp, m, DevicePtrMut::new(out.ptr()), fe) }
        .unwrap_or_else(|e| fail(e));
    drop((x_in, res_in));
    copy.count();
    Some(StokeTensor::owned(out))
}

/// The weight copy one call reads.
enum Copy {
    Fp8(Arc<DeviceFp8Weight>),
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
    fn an_output_head_holds_fp8_off_for_its_call_only() {
        let on = || super::HEAD.get();
        assert!(!on());
        assert_eq!(
            super::without_fp8(|| (on(), super::without_fp8(on), on())),
            (true, true, true)
        );
        assert!(!on());
        // A head that panics does not leave the thread's later prefills on bf16.
        assert!(std::panic::catch_unwind(|| super::without_fp8(|| panic!("head"))).is_err());
        assert!(!on());
    }
}
