//! The E4M3 rows the FP8 prefill GEMM reads: params mirror and launch of kernels/fp8_quant.cu
//! (`stoke_formats::fp8::quantize_rows_fused` is its specification), the device state of a
//! delayed per-tensor scale and its record step (`stoke_formats::fp8::DelayedScale`), and the
//! rows' dequantization to bf16.

use super::{EntryPoint, FP8_QUANT, KernelParams};
use crate::{DevicePtr, DevicePtrMut, LaunchShape, Result, Runtime, ShapeError};
use half::bf16;
use stoke_formats::fp8::{DELAYED_HISTORY, DelayedScale};

/// `struct Fp8RowsParams` of kernels/fp8_quant.cu (72 bytes; the `.cu` file asserts it).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Fp8RowsParams {
    /// `[rows, ldx]` bf16, 16-byte aligned.
    pub x: DevicePtr<bf16>,
    /// `[rows, k]` E4M3 codes.
    pub codes: DevicePtrMut<u8>,
    /// `[rows]`.
    pub scales: DevicePtrMut<f32>,
    /// `[1]`: the largest |x| of all rows as f32 bits (atomicMax), or null.
    pub amax: DevicePtrMut<u32>,
    /// `[k]` bf16 the rows are multiplied by first (16-byte aligned), or null.
    pub gain: DevicePtr<bf16>,
    /// `[rows, k / 32]`: the sums of each 32 codes' values (with `order` 1), or null.
    pub sums: DevicePtrMut<f32>,
    pub rows: u32,
    pub k: u32,
    pub ldx: u32,
    pub eps: f32,
    /// 1: the scale carries RMSNorm's row factor.
    pub normalize: u32,
    /// 1: each 16 k's codes interleaved as the INT4 words' nibbles are (k at `2 (k % 8) +
    /// (k % 16) / 8`; `stoke_formats::fp8::interleave_k16`); needs `k` a multiple of 32.
    pub order: u32,
}

// SAFETY: the layout is the `.cu` struct's (asserted below); pointers of the kernel's types.
unsafe impl KernelParams for Fp8RowsParams {}

/// `kernels/fp8_quant.cu`.
pub const SOURCE: &str = include_str!("../../../../kernels/fp8_quant.cu");

/// Every `extern "C"` entry point in [`SOURCE`].
pub const ENTRY_POINTS: &[&str] = &[
    "quantize_rows_e4m3_bf16",
    "fp8_delayed_record",
    "dequantize_rows_e4m3_bf16",
];

/// Threads per CTA (the kernel's `THREADS`).
const THREADS: u32 = 256;

/// Checks a call: `k` a positive multiple of 8, `ldx >= k` a multiple of 8, `x` 16-byte
/// aligned.
pub fn check(p: &Fp8RowsParams) -> std::result::Result<(), ShapeError> {
    if p.order != 0 && !p.k.is_multiple_of(32) {
        return Err(ShapeError::new(
            "FP8 row quantization k (interleaved for INT4 weights)",
            "a multiple of 32",
            p.k.to_string(),
        ));
    }
    if !p.gain.addr().is_multiple_of(16) {
        return Err(ShapeError::new(
            "FP8 row quantization gain",
            "a 16-byte aligned address",
            format!("{:#x}", p.gain.addr()),
        ));
    }
    if p.k == 0 || !p.k.is_multiple_of(8) || p.ldx < p.k || !p.ldx.is_multiple_of(8) {
        return Err(ShapeError::new(
            "FP8 row quantization k and row pitch",
            "k a positive multiple of 8, the pitch a multiple of 8 of at least k",
            format!("k {}, pitch {}", p.k, p.ldx),
        ));
    }
    if !p.x.addr().is_multiple_of(16) {
        return Err(ShapeError::new(
            "FP8 row quantization input",
            "a 16-byte aligned address",
            format!("{:#x}", p.x.addr()),
        ));
    }
    Ok(())
}

/// Queues the codes and scales of `p.rows` rows.
///
/// # Safety
/// The pointers must be valid device memory of the documented sizes until the kernel is done.
pub unsafe fn quantize_rows(rt: &Runtime, p: &Fp8RowsParams) -> Result<()> {
    if p.rows == 0 {
        return Ok(());
    }
    check(p)?;
    let k = rt.kernel(EntryPoint::<Fp8RowsParams>::new(
        &FP8_QUANT,
        "quantize_rows_e4m3_bf16",
    ))?;
    let shape = LaunchShape {
        grid: (p.rows.min(65535 * 8), 1, 1),
        block: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the caller's guarantees; the params match the entry point.
    unsafe { rt.launch(&k, shape, p) }
}

/// `struct Fp8DelayedState` of kernels/fp8_quant.cu (112 bytes, asserted there): the device
/// copy of a [`DelayedScale`] with [`DELAYED_HISTORY`] slots, plus the current invocation's
/// gathered amax and saturation count, which the GEMM's SwiGLU epilogue (or
/// [`quantize_rows`]) accumulates and [`record`] consumes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8DelayedState {
    pub history: [f32; DELAYED_HISTORY],
    /// The scale the next invocation quantizes with.
    pub scale: f32,
    /// This invocation's max |h| as f32 bits (0 between invocations).
    pub amax: u32,
    /// This invocation's saturated values (0 between invocations).
    pub saturated: u32,
    pub filled: u32,
    pub next: u32,
    pub initial_amax: f32,
    pub margin: f32,
    pub pad: u32,
    pub saturated_total: u64,
    pub invocations: u64,
}

/// Byte offsets of the fields the GEMM's epilogue and the row quantizer write.
pub const STATE_SCALE: usize = std::mem::offset_of!(Fp8DelayedState, scale);
pub const STATE_AMAX: usize = std::mem::offset_of!(Fp8DelayedState, amax);
pub const STATE_SATURATED: usize = std::mem::offset_of!(Fp8DelayedState, saturated);

impl Fp8DelayedState {
    /// The device state of `d` (between invocations).
    pub fn of(d: &DelayedScale) -> Self {
        let (h, next, filled) = d.history();
        let mut history = [0f32; DELAYED_HISTORY];
        let kept = h.len().min(DELAYED_HISTORY);
        history[..kept].copy_from_slice(&h[..kept]);
        Self {
            history,
            scale: d.scale(),
            amax: 0,
            saturated: 0,
            filled: filled as u32,
            next: next as u32,
            initial_amax: d.initial_amax(),
            margin: d.margin,
            pad: 0,
            saturated_total: d.saturated,
            invocations: d.invocations,
        }
    }

    /// The state as the reference holds it (`None`: the fields are inconsistent).
    pub fn to_reference(&self) -> Option<DelayedScale> {
        DelayedScale::from_parts(
            self.history.to_vec(),
            self.next as usize,
            self.filled as usize,
            self.initial_amax,
            self.margin,
            self.saturated_total,
            self.invocations,
        )
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(std::mem::size_of::<Self>());
        self.history.iter().for_each(|v| b.extend(v.to_le_bytes()));
        for v in [
            self.scale.to_bits(),
            self.amax,
            self.saturated,
            self.filled,
            self.next,
        ] {
            b.extend(v.to_le_bytes());
        }
        for v in [self.initial_amax.to_bits(), self.margin.to_bits(), self.pad] {
            b.extend(v.to_le_bytes());
        }
        b.extend(self.saturated_total.to_le_bytes());
        b.extend(self.invocations.to_le_bytes());
        b
    }

    /// The state from its device bytes (`None` unless exactly the struct's size).
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != std::mem::size_of::<Self>() {
            return None;
        }
        let u = |i: usize| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        let q = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let h = DELAYED_HISTORY;
        Some(Self {
            history: std::array::from_fn(|i| f32::from_bits(u(i))),
            scale: f32::from_bits(u(h)),
            amax: u(h + 1),
            saturated: u(h + 2),
            filled: u(h + 3),
            next: u(h + 4),
            initial_amax: f32::from_bits(u(h + 5)),
            margin: f32::from_bits(u(h + 6)),
            pad: u(h + 7),
            saturated_total: q(std::mem::offset_of!(Self, saturated_total)),
            invocations: q(std::mem::offset_of!(Self, invocations)),
        })
    }
}

/// `struct Fp8RecordParams` of kernels/fp8_quant.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Fp8RecordParams {
    /// The [`Fp8DelayedState`].
    pub state: DevicePtrMut<u8>,
    /// `[1]`: receives the scale the invocation used, or null.
    pub used: DevicePtrMut<f32>,
}

// SAFETY: the layout is the `.cu` struct's (asserted below); pointers of the kernel's types.
unsafe impl KernelParams for Fp8RecordParams {}

/// Queues the end of one invocation of a delayed scale: the scale it used to `p.used`, its
/// gathered amax and saturation count into the history and totals (both reset), the next
/// invocation's scale.
///
/// # Safety
/// `p.state` must be a valid [`Fp8DelayedState`] and `p.used` null or `[1]` f32, until the
/// kernel is done.
pub unsafe fn record(rt: &Runtime, p: &Fp8RecordParams) -> Result<()> {
    let k = rt.kernel(EntryPoint::<Fp8RecordParams>::new(
        &FP8_QUANT,
        "fp8_delayed_record",
    ))?;
    let shape = LaunchShape {
        grid: (1, 1, 1),
        block: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the caller's guarantees; the params match the entry point.
    unsafe { rt.launch(&k, shape, p) }
}

/// `struct Fp8DequantParams` of kernels/fp8_quant.cu (40 bytes; the `.cu` file asserts it).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Fp8DequantParams {
    /// `[rows, k]` E4M3, 8-byte aligned.
    pub codes: DevicePtr<u8>,
    /// `[rows]`, or `[1]` with `scale_stride` 0.
    pub scales: DevicePtr<f32>,
    /// `[rows, k]` bf16, 16-byte aligned.
    pub out: DevicePtrMut<bf16>,
    pub rows: u32,
    pub k: u32,
    /// 1: one scale per row; 0: one for every row.
    pub scale_stride: u32,
    pub pad: u32,
}

// SAFETY: the layout is the `.cu` struct's (asserted below); pointers of the kernel's types.
unsafe impl KernelParams for Fp8DequantParams {}

/// Queues `out = bf16(e4m3(codes) * scale)` row by row (`k` a positive multiple of 8).
///
/// # Safety
/// The pointers must be valid device memory of the documented sizes until the kernel is done.
pub unsafe fn dequantize_rows(rt: &Runtime, p: &Fp8DequantParams) -> Result<()> {
    if p.rows == 0 {
        return Ok(());
    }
    if p.k == 0 || !p.k.is_multiple_of(8) || p.scale_stride > 1 {
        return Err(ShapeError::new(
            "E4M3 rows to dequantize",
            "k a positive multiple of 8, a scale stride of 0 or 1",
            format!("k {}, scale stride {}", p.k, p.scale_stride),
        )
        .into());
    }
    if !p.codes.addr().is_multiple_of(8) || !p.out.addr().is_multiple_of(16) {
        return Err(ShapeError::new(
            "E4M3 rows to dequantize",
            "codes 8-byte and output 16-byte aligned",
            format!("{:#x}, {:#x}", p.codes.addr(), p.out.addr()),
        )
        .into());
    }
    let k = rt.kernel(EntryPoint::<Fp8DequantParams>::new(
        &FP8_QUANT,
        "dequantize_rows_e4m3_bf16",
    ))?;
    let groups = u64::from(p.rows) * u64::from(p.k / 8);
    let shape = LaunchShape {
        grid: (
            groups.div_ceil(u64::from(THREADS)).min(65535 * 8) as u32,
            1,
            1,
        ),
        block: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the caller's guarantees; the params match the entry point.
    unsafe { rt.launch(&k, shape, p) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<Fp8RowsParams>(), 72);
        assert_eq!(std::mem::offset_of!(Fp8RowsParams, amax), 24);
        assert_eq!(std::mem::offset_of!(Fp8RowsParams, rows), 48);
        assert_eq!(std::mem::offset_of!(Fp8RowsParams, eps), 60);
        assert!(SOURCE.contains("static_assert(sizeof(Fp8RowsParams) == 72"));
        assert!(SOURCE.contains(&format!("THREADS = {THREADS};")));
        assert_eq!(std::mem::size_of::<Fp8DelayedState>(), 112);
        assert_eq!(STATE_SCALE, 64);
        assert_eq!(std::mem::offset_of!(Fp8DelayedState, saturated_total), 96);
        assert!(SOURCE.contains("static_assert(sizeof(Fp8DelayedState) == 112"));
        assert!(SOURCE.contains(&format!("HISTORY = {DELAYED_HISTORY};")));
        assert_eq!(std::mem::size_of::<Fp8RecordParams>(), 16);
        assert!(SOURCE.contains("static_assert(sizeof(Fp8RecordParams) == 16"));
        assert_eq!(std::mem::size_of::<Fp8DequantParams>(), 40);
        assert!(SOURCE.contains("static_assert(sizeof(Fp8DequantParams) == 40"));
    }

    #[test]
    fn delayed_state_round_trips_through_its_bytes_and_the_reference() {
        let mut d = DelayedScale::new(DELAYED_HISTORY, 3.0, 1.25).unwrap();
        for (i, a) in [2.0, 0.0, 7.5, f32::NAN, 1.0].into_iter().enumerate() {
            d.record(a, i as u64);
        }
        let s = Fp8DelayedState::of(&d);
        let b = s.to_bytes();
        assert_eq!(b.len(), 112);
        assert_eq!(
            f32::from_le_bytes(b[STATE_SCALE..STATE_SCALE + 4].try_into().unwrap()),
            d.scale()
        );
        let back = Fp8DelayedState::from_bytes(&b).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.to_reference().unwrap(), d);
        assert!(Fp8DelayedState::from_bytes(&b[..100]).is_none());
    }
}
