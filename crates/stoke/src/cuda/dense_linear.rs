//! `linear` on a pinned bf16 weight through the dense bf16 GEMM (`kernels/bf16_gemm.cu`), and on
//! an output head kept as its rows through the output-head kernel (`kernels/bf16_head.cu`), for
//! decode-sized inputs (up to 64 rows: the kernels' 32 at a time).

use super::bridge::{DeviceTensor, HeadWeight, KernelInput, ResidentTensor, runtime_for};
use crate::tensor::{StokeData, StokeTensor};
use burn_backend::{Backend, DType, TensorMetadata};
use stoke_cuda::bf16::{Bf16Gemm, bf16_gemm};
use stoke_cuda::kernels::bf16_gemm::{Epilogue, MAX_ROWS, check_shape};
use stoke_cuda::{DevicePtr, DevicePtrMut};

/// `(x's shape, its rows)` where `x` and a weight of `w_dtype` are bf16, `x` is `[.., k]` with
/// at least one row, and the rows, `k` and `n` fit the kernels' `u32` sizes; `None` otherwise.
fn bf16_rows<I: Backend>(
    x: &StokeTensor<I>,
    w_dtype: DType,
    k: usize,
    n: usize,
) -> Option<(burn_backend::Shape, usize)> {
    if w_dtype != DType::BF16 || x.dtype() != DType::BF16 {
        return None;
    }
    let shape = x.shape();
    if shape.as_slice().last() != Some(&k) || k == 0 {
        return None;
    }
    let m = shape.num_elements() / k;
    let fits = |v: usize| v <= u32::MAX as usize;
    (m > 0 && fits(m) && fits(k) && fits(n)).then_some((shape, m))
}

/// `(first row, rows)` of each launch that takes `m` rows at most `most` at a time.
fn row_chunks(m: usize, most: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..m)
        .step_by(most)
        .map(move |first| (first, (m - first).min(most)))
}

/// `epilogue(x @ W)` on the dense kernel when `weight` is a pinned ([`ResidentTensor`]) bf16
/// `[k, n]` weight the kernel takes (`k` and `n` multiples of 8, 16-byte aligned), `x` is bf16
/// `[.., k]` with 1 to 64 rows (a decode step's rows; above 32, two launches of up to 32), and
/// Stoke's runtime runs on the device; `None` otherwise (the
/// caller's reference path). `Residual` adds `residual` (bf16, shaped like the output), `SwiGlu`
/// returns `silu(g) * u` of the interleaved gate/up columns (`[.., n / 2]`).
pub(crate) fn try_dense_linear_with<I: Backend>(
    x: &StokeTensor<I>,
    weight: &StokeTensor<I>,
    epilogue: Epilogue,
    residual: Option<&StokeTensor<I>>,
) -> Option<StokeTensor<I>> {
    let rw = weight.downcast_ref::<ResidentTensor<I>>()?;
    let w_shape = rw.shape();
    let &[k, n] = w_shape.as_slice() else {
        return None;
    };
    let (shape, m) = bf16_rows(x, rw.dtype(), k, n)?;
    let dims = shape.as_slice();
    if m > 2 * MAX_ROWS as usize {
        return None;
    }
    let rows = m.min(MAX_ROWS as usize) as u32;
    if check_shape(rows, k as u32, n as u32, epilogue).is_err() || !rw.ptr().is_multiple_of(16) {
        tracing::debug!(
            "stoke linear: bf16 weight [{k}, {n}] at {:#x} not one the dense kernel takes",
            rw.ptr()
        );
        return None;
    }
    if !super::residual_fits(epilogue, residual, dims, n) {
        return None;
    }
    let device = super::float_device(x);
    let rt = runtime_for::<I>(&device)?;
    let x_in = KernelInput::resolve(&rt, x, &device);
    let res_in = residual
        .filter(|_| epilogue == Epilogue::Residual)
        .map(|r| KernelInput::resolve(&rt, r, &device));
    if !x_in.ptr.is_multiple_of(4) || res_in.as_ref().is_some_and(|r| !r.ptr.is_multiple_of(4)) {
        return None;
    }
    let cols = epilogue.out_cols(n);
    let out_shape = super::with_cols(dims, cols);
    let out = DeviceTensor::<I>::alloc(&rt, out_shape, DType::BF16, device);
    // Up to 32 rows per launch, each its own rows of x, out and the residual.
    for (first, rows) in row_chunks(m, MAX_ROWS as usize) {
        let call = Bf16Gemm {
            x: DevicePtr::new(x_in.ptr + (first * k * 2) as u64),
            m: rows as u32,
            k: k as u32,
            n: n as u32,
            w: DevicePtr::new(rw.ptr()),
            out: DevicePtrMut::new(out.ptr() + (first * cols * 2) as u64),
            epilogue,
            residual: res_in.as_ref().map_or(DevicePtr::NULL, |r| {
                DevicePtr::new(r.ptr + (first * cols * 2) as u64)
            }),
        };
        // SAFETY: x and the residual are pinned (or Stoke-owned) until the kernel is done, the
        // weight is pinned for the life of its tensor (released after Stoke's queued work),
        // out is a Stoke buffer of m * cols bf16; the launch's rows lie inside all three.
        if let Err(e) = unsafe { bf16_gemm(&rt, &call) } {
            panic!("stoke linear (bf16): {e}");
        }
    }
    drop((x_in, res_in));
    Some(StokeTensor::owned(out))
}

/// `x @ W` when `weight` is an output head kept as its rows ([`HeadWeight`]), `x` is bf16
/// `[.., k]` at a 16-byte aligned address and Stoke's runtime runs on the device: 1 to 64 rows
/// (a decode step's rows, or a prefill's last rows) on the output-head kernel
/// (`kernels/bf16_head.cu`; above 32, two launches of up to 32), more (every position's logits)
/// on the prefill GEMM reading the rows as they are (`k` a multiple of 16, `n` even). `None`
/// otherwise (the caller's reference path, on the rows' transposed view).
pub(crate) fn try_head_linear<I: Backend>(
    x: &StokeTensor<I>,
    weight: &StokeTensor<I>,
    epilogue: Epilogue,
) -> Option<StokeTensor<I>> {
    use stoke_cuda::bf16::{Bf16Head, bf16_head};
    use stoke_cuda::kernels::bf16_head as head;
    if epilogue != Epilogue::Plain {
        return None;
    }
    let hw = weight.downcast_ref::<HeadWeight<I>>()?;
    let (k, n) = hw.k_n();
    let (shape, m) = bf16_rows(x, hw.dtype(), k, n)?;
    let dims = shape.as_slice();
    let most = head::MAX_ROWS as usize;
    let prefill = m > 2 * most;
    if prefill && (!k.is_multiple_of(16) || !n.is_multiple_of(2)) {
        return None;
    }
    if let Err(e) = head::check_shape(1, k as u32, n as u32) {
        tracing::debug!("stoke output head [{k}, {n}]: {e}");
        return None;
    }
    let device = super::float_device(x);
    let rt = runtime_for::<I>(&device)?;
    let x_in = KernelInput::resolve(&rt, x, &device);
    if !x_in.ptr.is_multiple_of(16) {
        return None;
    }
    let out = DeviceTensor::<I>::alloc(&rt, super::with_cols(dims, n), DType::BF16, device);
    if prefill {
        use stoke_cuda::kernels::fp8_gemm::{Bf16TcGemm, Fp8Epilogue, bf16_tc_gemm};
        let gemm = Bf16TcGemm {
            a: DevicePtr::new(x_in.ptr),
            w: DevicePtr::new(hw.ptr()),
            epilogue: Fp8Epilogue::Plain {
                out: DevicePtrMut::new(out.ptr()),
            },
            m: m as u32,
            n: n as u32,
            k: k as u32,
            ldo: n as u32,
        };
        // SAFETY: as below; the GEMM reads m rows of x and the n rows of the weight and writes
        // m * n bf16.
        if let Err(e) = unsafe { bf16_tc_gemm(&rt, &gemm) } {
            panic!("stoke output head (prefill GEMM): {e}");
        }
        drop(x_in);
        return Some(StokeTensor::owned(out));
    }
    for (first, rows) in row_chunks(m, most) {
        let call = Bf16Head {
            x: DevicePtr::new(x_in.ptr + (first * k * 2) as u64),
            m: rows as u32,
            k: k as u32,
            n: n as u32,
            w: DevicePtr::new(hw.ptr()),
            out: DevicePtrMut::new(out.ptr() + (first * n * 2) as u64),
        };
        // SAFETY: x is pinned (or Stoke-owned) until the kernel is done, the rows are pinned for
        // the life of the weight (released after Stoke's queued work), out is a Stoke buffer of
        // m * n bf16; the launch's rows lie inside all three.
        if let Err(e) = unsafe { bf16_head(&rt, &call, None) } {
            panic!("stoke output head (bf16): {e}");
        }
    }
    drop(x_in);
    Some(StokeTensor::owned(out))
}

#[cfg(test)]
mod tests {
    #[test]
    fn row_chunks_cover_every_row_once() {
        let chunks: Vec<_> = super::row_chunks(64, 32).collect();
        assert_eq!(chunks, [(0, 32), (32, 32)]);
        let chunks: Vec<_> = super::row_chunks(33, 32).collect();
        assert_eq!(chunks, [(0, 32), (32, 1)]);
        assert_eq!(super::row_chunks(5, 32).collect::<Vec<_>>(), [(0, 5)]);
    }
}
