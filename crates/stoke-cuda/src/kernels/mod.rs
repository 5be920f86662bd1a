//! Kernel sources (from the top-level `kernels/` directory) and their Rust-side launch rules.
//! Each module mirrors its kernel's `#[repr(C)]` parameter struct and picks entry points.

pub mod decode_attention;
pub mod int4_gemm;
pub mod mma_rate;
pub mod read_rate;
pub mod rms_norm;

/// Headers the kernel files include (`#include "NAME"`), by name. NVRTC is given each kernel file
/// with those lines replaced by the header's text ([`expand_includes`]), so one translation unit
/// goes to the compiler and the disk cache keys on all of it.
pub const HEADERS: &[(&str, &str)] = &[
    (
        "cluster.cuh",
        include_str!("../../../../kernels/cluster.cuh"),
    ),
    (
        "mbarrier.cuh",
        include_str!("../../../../kernels/mbarrier.cuh"),
    ),
];

/// `source` with each `#include "NAME"` line naming one of [`HEADERS`] replaced by that header's
/// text; other lines (other includes among them) are kept as they are.
pub fn expand_includes(source: &str) -> std::borrow::Cow<'_, str> {
    let header = |line: &str| {
        let name = line.trim().strip_prefix("#include \"")?.strip_suffix('"')?;
        HEADERS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, text)| *text)
    };
    if !source.lines().any(|l| header(l).is_some()) {
        return source.into();
    }
    let mut out = String::with_capacity(source.len() + 4096);
    for line in source.lines() {
        match header(line) {
            Some(text) => out.push_str(text),
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out.into()
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn includes_are_written_in_place() {
        let src =
            "typedef unsigned int u32;\n#include \"cluster.cuh\"\n#include <cuda_fp16.h>\nint x;\n";
        let out = expand_includes(src);
        assert!(out.starts_with("typedef unsigned int u32;\n"));
        assert!(out.contains("__device__ __forceinline__ void cluster_sync()"));
        assert!(!out.contains("#include \"cluster.cuh\""));
        assert!(out.ends_with("#include <cuda_fp16.h>\nint x;\n"));
        assert!(matches!(
            expand_includes("int y;\n"),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    #[test]
    fn every_quoted_include_is_a_known_header() {
        for src in ALL {
            for line in src
                .source
                .lines()
                .filter(|l| l.trim().starts_with("#include \""))
            {
                assert!(
                    HEADERS
                        .iter()
                        .any(|(n, _)| line.contains(&format!("\"{n}\""))),
                    "{}: {line} is not in kernels::HEADERS",
                    src.file
                );
            }
            assert!(
                !expand_includes(src.source).contains("#include \""),
                "{}",
                src.file
            );
        }
    }
}
