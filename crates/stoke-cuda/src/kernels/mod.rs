//! Kernel sources (from the top-level `kernels/` directory) and their Rust-side launch rules.
//! Each module mirrors its kernel's `#[repr(C)]` parameter struct and picks entry points.

pub mod decode_attention;
pub mod int4_gemm;
pub mod mma_rate;
pub mod read_rate;
pub mod rms_norm;

/// A kernel source file compiled as one module.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name under `kernels/`.
    pub file: &'static str,
    pub source: &'static str,
    /// `extern "C"` entry points the module must contain.
    pub entries: &'static [&'static str],
}

/// Sets of NVRTC defines written `A=1,B=2;C=3` (`;` between sets, `,` within one; blanks
/// ignored): each set as written (trimmed) with its defines. Benchmarks take them from
/// `STOKE_KERNEL_VARIANTS`, the precompile check from `--variants`.
pub fn parse_define_sets(list: &str) -> Vec<(String, Vec<String>)> {
    list.split(';')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            let defines = item.split(',').map(|d| d.trim().to_string()).collect();
            (item.to_string(), defines)
        })
        .collect()
}

impl KernelSource {
    /// Whether this file has the tuning knob that define `NAME=VALUE` sets (an `#ifndef NAME`
    /// default at its top), so the define applies to it.
    pub fn has_knob(&self, define: &str) -> bool {
        let name = define.split('=').next().unwrap_or("").trim();
        !name.is_empty() && self.source.contains(&format!("#ifndef {name}\n"))
    }
}

/// Every kernel source Stoke ships; the precompile check builds each of them.
pub const ALL: &[KernelSource] = &[
    KernelSource {
        file: "rms_norm.cu",
        source: rms_norm::SOURCE,
        entries: rms_norm::ENTRY_POINTS,
    },
    KernelSource {
        file: "int4_gemm.cu",
        source: int4_gemm::SOURCE,
        entries: int4_gemm::ENTRY_POINTS,
    },
    KernelSource {
        file: "decode_attention.cu",
        source: decode_attention::SOURCE,
        entries: decode_attention::ENTRY_POINTS,
    },
    KernelSource {
        file: "mma_rate.cu",
        source: mma_rate::SOURCE,
        entries: mma_rate::ENTRY_POINTS,
    },
    KernelSource {
        file: "read_rate.cu",
        source: read_rate::SOURCE,
        entries: read_rate::ENTRY_POINTS,
    },
];

pub const RMS_NORM: KernelSource = ALL[0];
pub const INT4_GEMM: KernelSource = ALL[1];
pub const DECODE_ATTENTION: KernelSource = ALL[2];
pub const MMA_RATE: KernelSource = ALL[3];
pub const READ_RATE: KernelSource = ALL[4];
