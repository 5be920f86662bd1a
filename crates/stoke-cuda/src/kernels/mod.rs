//! Kernel sources (from the top-level `kernels/` directory) and their Rust-side launch rules.
//! Each module mirrors its kernel's `#[repr(C)]` parameter struct and picks entry points.

pub mod bf16_gemm;
pub mod bf16_head;
pub mod decode_attention;
pub mod embed;
pub mod fp8_gemm;
pub mod fp8_quant;
pub mod int4_gemm;
pub mod mma_rate;
pub mod prefill_attention;
pub mod read_rate;
pub mod rms_norm;
pub mod sample;

/// Headers the kernel files include (`#include "NAME"`), by name. NVRTC is given each kernel file
/// with those lines replaced by the header's text ([`expand_includes`]), so one translation unit
/// goes to the compiler and the disk cache keys on all of it.
pub const HEADERS: &[(&str, &str)] = &[
    ("ptx.cuh", include_str!("../../../../kernels/ptx.cuh")),
    (
        "int4_gemm.cuh",
        include_str!("../../../../kernels/int4_gemm.cuh"),
    ),
    ("kv_row.cuh", include_str!("../../../../kernels/kv_row.cuh")),
    (
        "decode_attention.cuh",
        include_str!("../../../../kernels/decode_attention.cuh"),
    ),
];

/// `source` with each `#include "NAME"` line naming one of [`HEADERS`] replaced by that header's
/// text; other lines (other includes among them) are kept as they are.
pub fn expand_includes(source: &str) -> std::borrow::Cow<'_, str> {
    expand_includes_from(source, |name| {
        HEADERS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, text)| *text)
    })
}

/// [`expand_includes`] with the headers looked up by `lookup` (the SASS comparison compiles
/// the kernel files of another commit, with that commit's headers).
pub use crate::cubin::expand_includes_from;

/// The kernel files of a directory, their includes written in place (the SASS comparison
/// compiles another commit's `kernels/`; the build compiles this one's).
pub use crate::cubin::kernel_dir_sources;

/// A kernel source file compiled as one module.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name under `kernels/` (`bench/NAME` for the benchmark-only kernels).
    pub file: &'static str,
    pub source: &'static str,
    /// `extern "C"` entry points the module contains: exactly these (the precompile check).
    pub entries: fn() -> Vec<&'static str>,
}

/// A `#[repr(C)]` parameter struct that a kernel entry point takes by value.
///
/// # Safety
/// The struct's layout must be the `.cu` struct's, field for field (each kernel module's tests
/// assert the size and offsets against the source's `static_assert`s), and every pointer in it
/// must be a [`crate::DevicePtr`] / [`crate::DevicePtrMut`] of the element type the kernel
/// reads or writes there.
pub unsafe trait KernelParams: Copy + Send + 'static {}

/// One entry point of a kernel source, typed by the parameter struct it takes: only the kernel
/// module that knows the entry point's `.cu` signature makes one (`EntryPoint::new` is private
/// to this crate), and [`crate::Runtime::kernel`] turns it into a [`crate::Kernel`] that
/// launches with that struct and no other.
pub struct EntryPoint<P> {
    pub source: &'static KernelSource,
    pub name: &'static str,
    _params: std::marker::PhantomData<fn(P)>,
}

impl<P> Clone for EntryPoint<P> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<P> Copy for EntryPoint<P> {}
impl<P> std::fmt::Debug for EntryPoint<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.source.file, self.name)
    }
}

impl<P: KernelParams> EntryPoint<P> {
    /// Entry point `name` of `source`; its kernel module vouches that it takes `P`.
    pub(crate) fn new(source: &'static KernelSource, name: &'static str) -> Self {
        debug_assert!(
            (source.entries)().contains(&name),
            "{name} is not an entry point of kernels/{}",
            source.file
        );
        Self {
            source,
            name,
            _params: std::marker::PhantomData,
        }
    }
}

fn rms_norm_entries() -> Vec<&'static str> {
    rms_norm::ENTRY_POINTS.to_vec()
}
fn decode_attention_entries() -> Vec<&'static str> {
    decode_attention::ENTRY_POINTS.to_vec()
}
fn int4_swap_entries() -> Vec<&'static str> {
    int4_gemm::entry_names("int4_gemm_swap.cu")
}
fn int4_wg_entries() -> Vec<&'static str> {
    int4_gemm::entry_names("int4_gemm_wg.cu")
}
fn int4_batched_entries() -> Vec<&'static str> {
    int4_gemm::entry_names("int4_gemm_batched.cu")
}
fn bf16_gemm_entries() -> Vec<&'static str> {
    bf16_gemm::ENTRY_POINTS.to_vec()
}
fn bf16_head_entries() -> Vec<&'static str> {
    bf16_head::entry_points()
}
fn embed_entries() -> Vec<&'static str> {
    embed::ENTRY_POINTS.to_vec()
}
fn fp8_gemm_entries() -> Vec<&'static str> {
    fp8_gemm::ENTRY_POINTS.to_vec()
}
fn fp8_quant_entries() -> Vec<&'static str> {
    fp8_quant::ENTRY_POINTS.to_vec()
}
fn prefill_attention_entries() -> Vec<&'static str> {
    prefill_attention::ENTRY_POINTS.to_vec()
}
fn sample_entries() -> Vec<&'static str> {
    sample::ENTRY_POINTS.to_vec()
}
fn mma_rate_entries() -> Vec<&'static str> {
    mma_rate::ENTRY_POINTS.to_vec()
}
fn read_rate_entries() -> Vec<&'static str> {
    read_rate::ENTRY_POINTS.to_vec()
}

pub const RMS_NORM: KernelSource = KernelSource {
    file: "rms_norm.cu",
    source: rms_norm::SOURCE,
    entries: rms_norm_entries,
};
pub const INT4_GEMM_SWAP: KernelSource = KernelSource {
    file: "int4_gemm_swap.cu",
    source: include_str!("../../../../kernels/int4_gemm_swap.cu"),
    entries: int4_swap_entries,
};
pub const INT4_GEMM_WG: KernelSource = KernelSource {
    file: "int4_gemm_wg.cu",
    source: include_str!("../../../../kernels/int4_gemm_wg.cu"),
    entries: int4_wg_entries,
};
pub const INT4_GEMM_BATCHED: KernelSource = KernelSource {
    file: "int4_gemm_batched.cu",
    source: include_str!("../../../../kernels/int4_gemm_batched.cu"),
    entries: int4_batched_entries,
};
pub const DECODE_ATTENTION: KernelSource = KernelSource {
    file: "decode_attention.cu",
    source: decode_attention::SOURCE,
    entries: decode_attention_entries,
};
pub const BF16_GEMM: KernelSource = KernelSource {
    file: "bf16_gemm.cu",
    source: bf16_gemm::SOURCE,
    entries: bf16_gemm_entries,
};
pub const BF16_HEAD: KernelSource = KernelSource {
    file: "bf16_head.cu",
    source: bf16_head::SOURCE,
    entries: bf16_head_entries,
};
pub const EMBED: KernelSource = KernelSource {
    file: "embed.cu",
    source: embed::SOURCE,
    entries: embed_entries,
};
pub const FP8_GEMM: KernelSource = KernelSource {
    file: "fp8_gemm.cu",
    source: fp8_gemm::SOURCE,
    entries: fp8_gemm_entries,
};
pub const FP8_QUANT: KernelSource = KernelSource {
    file: "fp8_quant.cu",
    source: fp8_quant::SOURCE,
    entries: fp8_quant_entries,
};
pub const PREFILL_ATTENTION: KernelSource = KernelSource {
    file: "prefill_attention.cu",
    source: prefill_attention::SOURCE,
    entries: prefill_attention_entries,
};
pub const SAMPLE: KernelSource = KernelSource {
    file: "sample.cu",
    source: sample::SOURCE,
    entries: sample_entries,
};
/// Benchmark-only: the tensor-core rate probe.
pub const MMA_RATE: KernelSource = KernelSource {
    file: "bench/mma_rate.cu",
    source: mma_rate::SOURCE,
    entries: mma_rate_entries,
};
/// Benchmark-only: the HBM read-rate probe.
pub const READ_RATE: KernelSource = KernelSource {
    file: "bench/read_rate.cu",
    source: read_rate::SOURCE,
    entries: read_rate_entries,
};

/// Every kernel source Stoke ships; the precompile check builds each of them.
pub const ALL: &[KernelSource] = &[
    RMS_NORM,
    INT4_GEMM_SWAP,
    INT4_GEMM_WG,
    INT4_GEMM_BATCHED,
    DECODE_ATTENTION,
    EMBED,
    BF16_GEMM,
    BF16_HEAD,
    SAMPLE,
    FP8_GEMM,
    FP8_QUANT,
    PREFILL_ATTENTION,
];

/// The kernels only the benchmarks load (`kernels/bench/`); the precompile check builds them too.
pub const BENCH: &[KernelSource] = &[MMA_RATE, READ_RATE];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn includes_are_written_in_place() {
        let src =
            "typedef unsigned int u32;\n#include \"ptx.cuh\"\n#include <cuda_fp16.h>\nint x;\n";
        let out = expand_includes(src);
        assert!(out.starts_with("typedef unsigned int u32;\n"));
        assert!(out.contains("__device__ __forceinline__ void cluster_sync()"));
        assert!(!out.contains("#include \"ptx.cuh\""));
        assert!(out.ends_with("#include <cuda_fp16.h>\nint x;\n"));
        assert!(matches!(
            expand_includes("int y;\n"),
            std::borrow::Cow::Borrowed(_)
        ));
    }

    #[test]
    fn every_quoted_include_is_a_known_header() {
        for src in ALL.iter().chain(BENCH) {
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
