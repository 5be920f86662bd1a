//! The dense bf16 GEMM call (`kernels/bf16_gemm.cu`): `epilogue(x @ W)` for decode-sized row
//! counts (1 to 32) on a bf16 weight `[k, n]` in Burn's row-major Linear layout, used in place;
//! and the output head's (`kernels/bf16_head.cu`): `x @ W^T` on a weight stored `[n, k]`.

use crate::kernels::bf16_gemm::{Bf16GemmParams, Epilogue, Launch, plan};
use crate::kernels::bf16_head as head;
use crate::{DevicePtr, DevicePtrMut, Error, LaunchShape, Result, Runtime, ShapeError};
use half::bf16;
use std::sync::Arc;

/// Device pointers and shape of one dense bf16 GEMM: `x [m, k]`, `w [k, n]`, `out [m,
/// epilogue.out_cols(n)]`, all bf16 row-major; `residual [m, n]` bf16 for
/// [`Epilogue::Residual`] (else null). Alignment: `w` 16 bytes, `out` 8 bytes (4 for SwiGLU),
/// `x` and `residual` 4 bytes.
#[derive(Clone, Copy, Debug)]
pub struct Bf16Gemm {
    pub x: DevicePtr<bf16>,
    pub m: u32,
    pub k: u32,
    pub n: u32,
    pub w: DevicePtr<bf16>,
    pub out: DevicePtrMut<bf16>,
    pub epilogue: Epilogue,
    pub residual: DevicePtr<bf16>,
}

impl Bf16Gemm {
    /// The launch [`bf16_gemm`] makes for this call on `rt`'s GPU (entry point, grid, splits),
    /// or why the shape is not one the kernels take.
    pub fn plan(&self, rt: &Runtime) -> Result<Launch> {
        plan(self.m, self.k, self.n, self.epilogue, rt.sm_count).map_err(Error::Shape)
    }

    /// The pointers' alignment and the residual's presence, as the kernels need them.
    fn check_pointers(&self) -> Result<()> {
        let aligned = |what: &str, addr: u64, to: u64| {
            if addr.is_multiple_of(to) {
                Ok(())
            } else {
                Err(Error::Shape(ShapeError::new(
                    format!("bf16 GEMM {what} address"),
                    format!("{to}-byte aligned"),
                    format!("{addr:#x}"),
                )))
            }
        };
        aligned("x", self.x.addr(), 4)?;
        aligned("weight", self.w.addr(), 16)?;
        let out_align = if self.epilogue == Epilogue::SwiGlu {
            4
        } else {
            8
        };
        aligned("output", self.out.addr(), out_align)?;
        if self.epilogue == Epilogue::Residual {
            if self.residual.is_null() {
                return Err(Error::Shape(ShapeError::new(
                    "bf16 GEMM residual epilogue",
                    "a residual input",
                    "none",
                )));
            }
            aligned("residual", self.residual.addr(), 4)?;
        }
        Ok(())
    }
}

/// Queues `out = epilogue(x @ w)` on Stoke's stream: one launch of the plan's entry point
/// ([`crate::kernels::bf16_gemm::plan`]: the layout and the split-K count from `rt.sm_count`).
/// With split-K the partial sums go to a buffer from [`Runtime::alloc`] (a graph's arena while
/// one is captured) and the arrival counters to [`Runtime::zeroed_scratch`], which the kernel
/// leaves zeroed; nothing waits on the host, so the call can be captured into a CUDA graph.
///
/// Errors: [`Error::Shape`] for a shape the kernels do not take (`m` not in 1..=32, `k` or `n`
/// not a positive multiple of 8, SwiGLU with an odd `n`), a misaligned pointer, or a residual
/// epilogue without a residual.
///
/// # Safety
/// Every pointer in `call` must be valid device memory of the documented size and stay valid
/// until the kernel finishes (Stoke buffers, or pinned ones); `out` must not overlap `x`, `w`
/// or `residual`.
pub unsafe fn bf16_gemm(rt: &Arc<Runtime>, call: &Bf16Gemm) -> Result<()> {
    let l = call.plan(rt)?;
    call.check_pointers()?;
    let kernel = rt.kernel(l.entry.entry_point())?;
    let workspace = match l.workspace_bytes(call.m, call.n) {
        0 => None,
        bytes => Some(rt.alloc(bytes)?),
    };
    let counters = match l.counters_len() {
        0 => DevicePtrMut::NULL,
        len => DevicePtrMut::new(rt.zeroed_scratch(len * 4)?),
    };
    let params = Bf16GemmParams {
        x: call.x,
        w: call.w,
        out: call.out,
        residual: if call.epilogue == Epilogue::Residual {
            call.residual
        } else {
            DevicePtr::NULL
        },
        workspace: workspace
            .as_ref()
            .map_or(DevicePtrMut::NULL, |b| b.as_mut_ptr()),
        counters,
        m: call.m,
        k: call.k,
        n: call.n,
        splits: l.splits,
        split_steps: l.split_steps,
    };
    let shape = LaunchShape {
        grid: l.grid,
        block: l.block,
        shared_mem_bytes: kernel.dyn_smem,
    };
    // SAFETY: the params mirror the kernel's struct (layout test); the caller guarantees the
    // pointers; the workspace is a Stoke buffer, dropped after the launch and reused only by
    // work queued after it on the same stream; the counters are the runtime's zeroed scratch,
    // which the kernel leaves zeroed.
    unsafe { rt.launch(&kernel, shape, &params) }?;
    drop(workspace);
    Ok(())
}

/// Device pointers and shape of one output-head call: `x [m, k]`, `w [n, k]` (a row of `k` per
/// output column), `out [m, n]`, all bf16 row-major. Alignment: `x` and `w` 16 bytes, `out` 2.
#[derive(Clone, Copy, Debug)]
pub struct Bf16Head {
    pub x: DevicePtr<bf16>,
    pub m: u32,
    pub k: u32,
    pub n: u32,
    pub w: DevicePtr<bf16>,
    pub out: DevicePtrMut<bf16>,
}

impl Bf16Head {
    /// The launch [`bf16_head`] makes for this call on `rt`'s GPU: `entry`, or with `None` the
    /// plan's entry point for `m` rows ([`crate::kernels::bf16_head::plan`], with the occupancy
    /// calculator's resident CTAs), or why the shape is not one the kernels take.
    pub fn plan(&self, rt: &Runtime, entry: Option<head::Entry>) -> Result<head::Launch> {
        let resident = |e: head::Entry| {
            rt.kernel(e.entry_point())
                .and_then(|k| rt.resident_ctas(&k, head::THREADS))
                .unwrap_or(e.min_ctas)
                * head::WARPS
                * rt.sm_count
        };
        head::plan(self.m, self.k, self.n, entry, resident).map_err(Error::Shape)
    }

    fn check_pointers(&self) -> Result<()> {
        for (what, addr, to) in [
            ("x", self.x.addr(), 16),
            ("weight", self.w.addr(), 16),
            ("output", self.out.addr(), 2),
        ] {
            if !addr.is_multiple_of(to) {
                return Err(Error::Shape(ShapeError::new(
                    format!("output head {what} address"),
                    format!("{to}-byte aligned"),
                    format!("{addr:#x}"),
                )));
            }
        }
        Ok(())
    }
}

/// Queues `out = x @ w^T` on Stoke's stream: one launch of `entry`, or of the plan's entry point
/// with `None` ([`Bf16Head::plan`]). Nothing is allocated and nothing waits on the host, so the
/// call can be captured into a CUDA graph.
///
/// Errors: [`Error::Shape`] for a shape the kernels do not take (`m` not in 1..=32, or more rows
/// than `entry` takes; `k` not a positive multiple of 8; `n` zero) or a misaligned pointer.
///
/// # Safety
/// Every pointer in `call` must be valid device memory of the documented size and stay valid
/// until the kernel finishes; `out` must not overlap `x` or `w`.
pub unsafe fn bf16_head(
    rt: &Arc<Runtime>,
    call: &Bf16Head,
    entry: Option<head::Entry>,
) -> Result<()> {
    let l = call.plan(rt, entry)?;
    call.check_pointers()?;
    let kernel = rt.kernel(l.entry.entry_point())?;
    let params = head::Bf16HeadParams {
        x: call.x,
        w: call.w,
        out: call.out,
        m: call.m,
        k: call.k,
        n: call.n,
        units_per_warp: l.units_per_warp,
    };
    let shape = LaunchShape {
        grid: l.grid,
        block: l.block,
        shared_mem_bytes: 0,
    };
    // SAFETY: the params mirror the kernel's struct (layout test); the caller guarantees the
    // pointers.
    unsafe { rt.launch(&kernel, shape, &params) }
}
