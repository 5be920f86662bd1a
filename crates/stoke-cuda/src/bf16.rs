//! The dense bf16 GEMM call (`kernels/bf16_gemm.cu`): `epilogue(x @ W)` for decode-sized row
//! counts (1 to 32) on a bf16 weight `[k, n]` in Burn's row-major Linear layout, used in place.

use crate::kernels::bf16_gemm::{Bf16GemmParams, Epilogue, Launch, plan};
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
