//! `linear` on a packed INT4 weight through the W4A16 kernels (`kernels/int4_gemm_*.cu`).

use super::bridge::{DeviceTensor, KernelInput, runtime_for};
use crate::packed::PackedWeight;
use crate::tensor::{StokeData, StokeTensor};
use burn_backend::{Backend, DType, Shape, TensorData, TensorMetadata};
use std::any::Any;
use std::sync::{Arc, OnceLock};
use stoke_cuda::int4::{DeviceInt4, Int4Gemm, NormFold, int4_gemm};
use stoke_cuda::kernels::int4_gemm::{Epilogue, QkvRopeParams, WordOrder};
use stoke_cuda::{DevicePtr, DevicePtrMut, Runtime};

static KERNEL_CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many `linear` calls have run on the W4A16 kernels in this process.
pub fn kernel_calls() -> u64 {
    KERNEL_CALLS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Most rows the kernels take before a dense GEMM on the dequantized weight wins (each 32
/// rows re-read the weight).
pub const MAX_KERNEL_ROWS: usize = 64;

/// `epilogue(x @ W)` on the kernels when `weight` is a [`PackedWeight`], `x` is bf16 `[.., k]`
/// with at most [`MAX_KERNEL_ROWS`] rows, and Stoke's runtime runs on the device; `None`
/// otherwise. `Residual` adds `residual` (bf16, shaped like the output), `SwiGlu` returns
/// `silu(g) * u` of the interleaved gate/up columns (`[.., n / 2]`). An `x` that is a
/// [`FoldedNorm`] is read as its gained rows with the norm's row factor in the epilogue.
pub(crate) fn try_linear_with<I: Backend>(
    x: &StokeTensor<I>,
    weight: &StokeTensor<I>,
    epilogue: Epilogue,
    residual: Option<&StokeTensor<I>>,
) -> Option<StokeTensor<I>> {
    run(x, weight, epilogue, residual, None, None).map(|(out, _)| out)
}

/// `s = residual + x @ W` on the kernels (as [`try_linear_with`] takes them) with the RMSNorm
/// of `s` by `gamma` (bf16 `[n]`) folded in: `(s, normed)`, `normed` a [`FoldedNorm`]; `None`
/// where the kernels do not take the call.
pub(crate) fn try_linear_residual_rms_norm<I: Backend>(
    x: &StokeTensor<I>,
    weight: &StokeTensor<I>,
    residual: &StokeTensor<I>,
    gamma: &StokeTensor<I>,
    eps: f64,
) -> Option<(StokeTensor<I>, StokeTensor<I>)> {
    let n = weight.downcast_ref::<PackedWeight<I>>()?.packed.n;
    if gamma.dtype() != DType::BF16 || gamma.shape().as_slice() != [n] {
        return None;
    }
    let (s, normed) = run(
        x,
        weight,
        Epilogue::Residual,
        Some(residual),
        Some((gamma, eps)),
        None,
    )?;
    Some((s, StokeTensor::owned(normed?)))
}

/// The q|k|v projection `x @ W` (`n` = `width` columns, heads of 64) with the decode q|k|v
/// epilogue (`targets`: a decoder's [`QkvRopeParams`] of one layer in device memory): RoPE, the
/// cache append and the lengths written by the GEMM; returns q (`[.., q_cols]` bf16). `None`
/// where the kernels do not take the call (as [`try_linear_with`]) or `W` is not `width` wide.
pub(crate) fn try_qkv_rope<I: Backend>(
    x: &StokeTensor<I>,
    weight: &StokeTensor<I>,
    targets: DevicePtr<QkvRopeParams>,
    width: usize,
    q_cols: usize,
) -> Option<StokeTensor<I>> {
    if weight.downcast_ref::<PackedWeight<I>>()?.packed.n != width {
        return None;
    }
    run(
        x,
        weight,
        Epilogue::Plain,
        None,
        None,
        Some((targets, q_cols)),
    )
    .map(|(out, _)| out)
}

/// The kernel call behind [`try_linear_with`], [`try_linear_residual_rms_norm`] and
/// [`try_qkv_rope`] (`norm`: the gain and epsilon of the folded norm of the output, whose
/// inputs it returns; `qkv`: the q|k|v epilogue's targets and q's columns, the output).
fn run<I: Backend>(
    x: &StokeTensor<I>,
    weight: &StokeTensor<I>,
    epilogue: Epilogue,
    residual: Option<&StokeTensor<I>>,
    norm: Option<(&StokeTensor<I>, f64)>,
    qkv: Option<(DevicePtr<QkvRopeParams>, usize)>,
) -> Option<(StokeTensor<I>, Option<FoldedNorm<I>>)> {
    let pw = weight.downcast_ref::<PackedWeight<I>>()?;
    let device = super::float_device(x);
    let rt = runtime_for::<I>(&device)?;
    let shape = x.shape();
    let dims = shape.as_slice();
    let (k, n) = (pw.packed.k, pw.packed.n);
    if x.dtype() != DType::BF16 || dims.last() != Some(&k) {
        tracing::debug!(
            "stoke linear: packed weight with {:?} input {dims:?}: dequantized weight",
            x.dtype()
        );
        return None;
    }
    let m = shape.num_elements() / k.max(1);
    if m == 0 || m > MAX_KERNEL_ROWS {
        return None;
    }
    if !super::residual_fits(epilogue, residual, dims, n)
        || (epilogue == Epilogue::SwiGlu && n % 2 != 0)
    {
        return None;
    }
    let dw = device_int4(pw, &rt)?;
    // A folded norm's input: its gained rows, the row factor from its sums.
    let folded = x
        .downcast_ref::<FoldedNorm<I>>()
        .filter(|f| f.ss_rows == m && k.is_multiple_of(64));
    let x_in = match folded {
        Some(f) => KernelInput::resolve(&rt, &f.gained, &device),
        None => KernelInput::resolve(&rt, x, &device),
    };
    let res_in = residual
        .filter(|_| epilogue == Epilogue::Residual)
        .map(|r| KernelInput::resolve(&rt, r, &device));
    let out_shape = super::with_cols(dims, qkv.map_or(epilogue.out_cols(n), |(_, q)| q));
    let mut fold = NormFold::NONE;
    if let Some(f) = folded {
        fold.ss_in = f.ss.as_ptr();
        fold.eps = f.eps as f32;
    }
    // The folded norm of the output: its gain, the gained rows and the slab sums.
    let produced = norm.map(|(gamma, eps)| {
        let gained = DeviceTensor::<I>::alloc(&rt, out_shape.clone(), DType::BF16, device.clone());
        let ss = rt
            .alloc(n / 64 * m * 4)
            .unwrap_or_else(|e| panic!("stoke linear (INT4): allocating norm sums: {e}"));
        (
            KernelInput::resolve(&rt, gamma, &device),
            gained,
            ss,
            gamma,
            eps,
        )
    });
    if let Some((g, gained, ss, ..)) = &produced {
        fold.gain = DevicePtr::new(g.ptr);
        fold.gained = DevicePtrMut::new(gained.ptr());
        fold.ss_out = ss.as_mut_ptr();
    }
    let out = DeviceTensor::<I>::alloc(&rt, out_shape, DType::BF16, device);
    let call = Int4Gemm {
        x: DevicePtr::new(x_in.ptr),
        m: m as u32,
        out: DevicePtrMut::new(out.ptr()),
        epilogue,
        residual: res_in
            .as_ref()
            .map_or(DevicePtr::NULL, |r| DevicePtr::new(r.ptr)),
        row_scale: DevicePtr::NULL,
        norm: fold,
        qkv: qkv.map_or(DevicePtr::NULL, |(t, _)| t),
        splits: 0,
        wg_rows: stoke_cuda::int4::wg_rows_default(),
        tune: stoke_cuda::int4::tune_default(),
    };
    // SAFETY: x is pinned (or Stoke-owned) until the kernel is done, out is a Stoke buffer of
    // m * n bf16, the weight buffers are held by `dw` (freed on Stoke's stream); a folded
    // norm's gained rows are m x k bf16 and its sums [k / 64][m] f32 (checked above: its rows
    // are m); the produced norm's gain holds n bf16 (checked by the caller), its gained rows
    // m x n bf16 and its sums [n / 64][m] f32; the q|k|v targets are the decoder's (its
    // buffers hold a lane per row) and out holds m x q_cols bf16.
    if let Err(e) = unsafe { int4_gemm(&rt, &dw, &call) } {
        panic!("stoke linear (INT4): {e}");
    }
    drop((x_in, res_in));
    KERNEL_CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let out = StokeTensor::owned(out);
    let normed = produced.map(|(g, gained, ss, gamma, eps)| {
        drop(g);
        FoldedNorm {
            s: out.clone(),
            gamma: gamma.clone(),
            eps,
            gained: StokeTensor::owned(gained),
            ss,
            ss_rows: m,
            normed: OnceLock::new(),
        }
    });
    Some((out, normed))
}

/// `rms_norm(s, gamma, eps)` folded into the W4A16 GEMMs around it
/// (`FusedOps::linear_residual_rms_norm` on `Stoke<Cuda>`): the GEMM that wrote `s` also wrote
/// `s * gamma` (`gained`) and each row's sums of `s^2` by 64-column slab (`ss`, `[n / 64][rows]`
/// f32). A W4A16
/// projection that reads it reads `gained` and applies the row factor in its epilogue; anything
/// else reads the normalized rows, which the RMSNorm kernel computes at the first such read.
pub struct FoldedNorm<I: Backend> {
    s: StokeTensor<I>,
    gamma: StokeTensor<I>,
    eps: f64,
    gained: StokeTensor<I>,
    ss: stoke_cuda::DeviceBuffer,
    ss_rows: usize,
    normed: OnceLock<StokeTensor<I>>,
}

impl<I: Backend> std::fmt::Debug for FoldedNorm<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FoldedNorm({:?})", self.s.shape())
    }
}

impl<I: Backend> FoldedNorm<I> {
    /// The normalized rows (computed at the first call, on Stoke's stream).
    pub(crate) fn normed(&self) -> &StokeTensor<I> {
        self.normed.get_or_init(|| {
            super::rms_norm::rms_norm_now::<I>(self.s.clone(), self.gamma.clone(), self.eps)
        })
    }
}

impl<I: Backend> StokeData<I> for FoldedNorm<I> {
    fn shape(&self) -> Shape {
        self.s.shape()
    }
    fn dtype(&self) -> DType {
        DType::BF16
    }
    fn device(&self) -> I::Device {
        super::float_device(&self.s)
    }
    fn read(&self) -> Option<TensorData> {
        match self.normed() {
            StokeTensor::Owned(d) => d.read(),
            StokeTensor::Inner(_) => None,
        }
    }
    fn materialize(&self) -> I::FloatTensorPrimitive {
        self.normed().clone().into_inner()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The packed weight in device memory, uploaded at its first kernel call (`None`, logged once,
/// where the upload failed: the dequantized weight serves instead).
pub(crate) fn device_int4<I: Backend>(
    pw: &PackedWeight<I>,
    rt: &Arc<Runtime>,
) -> Option<Arc<DeviceInt4>> {
    pw.slots
        .get_or_init(|| {
            GpuInt4(
                DeviceInt4::upload_packed(rt, &pw.packed, WordOrder::default())
                    .map(Arc::new)
                    .map_err(|e| {
                        tracing::warn!(
                            "stoke linear: INT4 weight upload failed ({e}); dequantized weight \
                             instead"
                        )
                    })
                    .ok(),
            )
        })
        .0
        .clone()
}

/// A packed weight's upload, in its [`crate::device::DeviceSlots`] (`None`: the upload failed,
/// and was logged).
struct GpuInt4(Option<Arc<DeviceInt4>>);
