//! CPU kernels behind `Stoke<NdArray>`: `linear` (and its residual and SwiGLU epilogues) on
//! packed INT4 weights kept packed ([`int4`]) and on dense f32 weights read in place
//! ([`dense`]), threaded with rayon, vectorized for the CPU found at run time (pulp).
//!
//! burn-ndarray's matmul copies its right operand on every call (a reshape of a shared array
//! makes an owned one), so a decode step on it copies every weight matrix; these kernels read
//! the weights where they lie. Anything they do not cover (another inner backend, f64 or bf16
//! activations, a weight that is neither) returns `None` and runs the reference composition.

pub mod dense;
pub mod int4;

use crate::packed::PackedWeight;
use crate::tensor::StokeTensor;
use burn_backend::{Backend, TensorData};
use burn_ndarray::NdArrayTensor;
use std::any::Any;
use stoke_cuda::kernels::int4_gemm::Epilogue;

/// A contiguous f32 copy-or-borrow of an NdArray f32 tensor, with its shape.
fn with_f32<I: Backend, T>(
    t: &I::FloatTensorPrimitive,
    f: impl FnOnce(&[f32], &[usize]) -> T,
) -> Option<T> {
    let NdArrayTensor::F32(storage) = (t as &dyn Any).downcast_ref::<NdArrayTensor>()? else {
        return None;
    };
    let view = storage.view();
    let shape = view.shape().to_vec();
    match view.as_slice() {
        Some(s) => Some(f(s, &shape)),
        None => {
            let owned: Vec<f32> = view.iter().copied().collect();
            Some(f(&owned, &shape))
        }
    }
}

/// A kernel's output laid out `[blocks][rows][block]` (each task's columns contiguous) as
/// `[rows, n]`; the last block may be partial.
fn unblock(blocked: &[f32], rows: usize, n: usize, block: usize) -> Vec<f32> {
    let mut y = vec![0f32; rows * n];
    for (b, chunk) in blocked.chunks_exact(rows * block).enumerate() {
        let c0 = b * block;
        let cols = (n - c0).min(block);
        for r in 0..rows {
            y[r * n + c0..][..cols].copy_from_slice(&chunk[r * block..][..cols]);
        }
    }
    y
}

/// Whether the CPU kernels run (`STOKE_DISABLE` turns them off with the GPU ones).
fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| {
        let off = std::env::var_os("STOKE_DISABLE").is_some_and(|v| !v.is_empty() && v != "0");
        if off {
            tracing::info!("Stoke's CPU kernels are disabled by STOKE_DISABLE");
        }
        !off
    })
}

/// Stoke's CPU kernels as a device ([`crate::device::Kernels`]): `linear` under
/// `Stoke<NdArray>`.
pub(crate) struct Host;

impl crate::device::Kernels for Host {
    fn linear<I: Backend>(
        x: &StokeTensor<I>,
        weight: &StokeTensor<I>,
        epilogue: Epilogue,
        residual: Option<&StokeTensor<I>>,
    ) -> Option<StokeTensor<I>> {
        try_linear::<I>(x, weight, epilogue, residual)
    }
}

/// `linear` with `epilogue` on the CPU, or `None` where these kernels do not apply.
pub(crate) fn try_linear<I: Backend>(
    x: &StokeTensor<I>,
    weight: &StokeTensor<I>,
    epilogue: Epilogue,
    residual: Option<&StokeTensor<I>>,
) -> Option<StokeTensor<I>> {
    if std::any::TypeId::of::<I::FloatTensorPrimitive>() != std::any::TypeId::of::<NdArrayTensor>()
        || !enabled()
    {
        return None;
    }
    let StokeTensor::Inner(xi) = x else {
        return None;
    };
    let (y, mut dims, n) = with_f32::<I, _>(xi, |xs, dims| {
        let k = *dims.last()?;
        // Empty inputs go to the reference path (which handles them) rather than the kernels.
        if k == 0 || xs.is_empty() {
            return None;
        }
        let rows = xs.len() / k;
        if let Some(p) = weight.downcast_ref::<PackedWeight<I>>() {
            if p.packed.k != k {
                return None;
            }
            let cpu = p
                .slots
                .get_or_init(|| int4::CpuInt4::from_packed(&p.packed));
            return Some((cpu.matmul(xs, rows), dims.to_vec(), p.packed.n));
        }
        let StokeTensor::Inner(wi) = weight else {
            return None;
        };
        with_f32::<I, _>(wi, |ws, wdims| {
            if wdims.len() != 2 || wdims[0] != k {
                return None;
            }
            let n = wdims[1];
            Some((dense::matmul(xs, rows, ws, k, n), dims.to_vec(), n))
        })
        .flatten()
    })??;
    let y = match (epilogue, residual) {
        (Epilogue::Plain, _) => y,
        (Epilogue::Residual, Some(StokeTensor::Inner(r))) => with_f32::<I, _>(r, |rs, _| {
            (rs.len() == y.len()).then(|| y.iter().zip(rs).map(|(a, b)| a + b).collect())
        })??,
        (Epilogue::Residual, _) => return None,
        (Epilogue::SwiGlu, _) => {
            if n % 2 != 0 {
                return None;
            }
            y.chunks_exact(2)
                .map(|p| {
                    let (g, u) = (p[0], p[1]);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect()
        }
    };
    *dims.last_mut().unwrap() = if epilogue == Epilogue::SwiGlu {
        n / 2
    } else {
        n
    };
    let device = I::float_device(xi);
    Some(StokeTensor::Inner(I::float_from_data(
        TensorData::new(y, dims),
        &device,
    )))
}

#[cfg(test)]
pub(crate) mod tests {
    /// Uniform values in [-1, 1) from a seeded LCG, for the kernels' tests.
    pub(crate) fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}
