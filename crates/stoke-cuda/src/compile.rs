//! Kernel cubins: the ones built into the library (see `build.rs`), else NVRTC compilation
//! with a disk cache; and the ptxas resource report.

use crate::cubin::{cubin_key, nvrtc_compile, nvrtc_options};
use crate::{Error, Result};
use std::path::PathBuf;

pub use crate::cubin::BASE_OPTIONS;

/// Resources ptxas reports for one entry point.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CompileReport {
    pub entry: String,
    pub registers: u32,
    pub shared_bytes: u32,
    pub stack_bytes: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
}

/// Where a module's cubin came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CubinOrigin {
    /// Compiled when the library was built (no NVRTC needed at run time).
    Built,
    /// The disk cache of an earlier process's compilation.
    DiskCache,
    /// Compiled by NVRTC now.
    Compiled,
}

impl std::fmt::Display for CubinOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CubinOrigin::Built => "built in",
            CubinOrigin::DiskCache => "disk cache",
            CubinOrigin::Compiled => "compiled",
        })
    }
}

/// A cubin the build compiled into the library (`build.rs`).
struct BuiltCubin {
    file: &'static str,
    arch: &'static str,
    key: &'static str,
    cubin: &'static [u8],
    log: &'static str,
}

// `BUILT: &[BuiltCubin]`, written by `build.rs` (empty where NVRTC was not found at build time).
include!(concat!(env!("OUT_DIR"), "/built_cubins.rs"));

/// The architectures the library carries compiled kernels for (empty where it was built
/// without NVRTC: then every kernel is compiled at first use).
pub fn built_archs() -> Vec<&'static str> {
    let mut archs: Vec<&str> = BUILT.iter().map(|c| c.arch).collect();
    archs.dedup();
    archs
}

/// NVRTC's version, e.g. (13, 0). Errors if libnvrtc cannot be loaded.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !crate::cubin::nvrtc_present() {
        return Err(Error::NvrtcMissing(
            "libnvrtc.so was not found on the library path (set LD_LIBRARY_PATH)".into(),
        ));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::NvrtcMissing(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

/// The kernel cache directory (`STOKE_KERNEL_CACHE`, else `~/.cache/stoke/kernels`); `None`
/// where caching is off (`STOKE_KERNEL_CACHE=`) or no home is known.
pub fn kernel_cache_dir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("STOKE_KERNEL_CACHE") {
        return (!dir.is_empty()).then(|| PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("stoke").join("kernels"))
}

/// The cubin of `source` (the file `file` under `kernels/`, its `#include`s of
/// [`crate::kernels::HEADERS`] written in place) for `arch` (e.g. `sm_90a`): the one built into
/// the library where its source, options and arch match, else NVRTC's through the disk cache.
/// Returns the cubin, the per-entry resource report and where it came from. Set
/// `STOKE_KERNEL_CACHE=` (empty) to disable the disk cache.
pub fn compile_cubin(
    file: &str,
    source: &str,
    arch: &str,
    extra_options: &[&str],
) -> Result<(Vec<u8>, Vec<CompileReport>, CubinOrigin)> {
    let options = nvrtc_options(arch, extra_options);
    let source = &*crate::kernels::expand_includes(source);
    if BUILT.iter().any(|c| c.file == file && c.arch == arch) {
        let key = cubin_key(source, &options, arch, None);
        if let Some(c) = BUILT
            .iter()
            .find(|c| c.file == file && c.arch == arch && c.key == key)
        {
            return Ok((c.cubin.to_vec(), parse_ptxas_log(c.log), CubinOrigin::Built));
        }
    }

    let version = nvrtc_version()?;
    let key = cubin_key(source, &options, arch, Some(version));
    let cached = kernel_cache_dir().map(|d| {
        let stem = file.trim_end_matches(".cu");
        (
            d.join(format!("{stem}-{arch}-{}.cubin", &key[..16])),
            d.join(format!("{stem}-{arch}-{}.log", &key[..16])),
        )
    });
    if let Some((cubin_path, log_path)) = &cached
        && let (Ok(cubin), Ok(log)) = (std::fs::read(cubin_path), std::fs::read_to_string(log_path))
    {
        return Ok((cubin, parse_ptxas_log(&log), CubinOrigin::DiskCache));
    }

    let (cubin, log) = nvrtc_compile(file, source, &options).map_err(|log| Error::Compile {
        file: file.to_string(),
        arch: arch.to_string(),
        log,
    })?;
    if let Some((cubin_path, log_path)) = &cached {
        // The cache is an optimization: failing to write it is not an error for the caller.
        let write = || -> std::io::Result<()> {
            std::fs::create_dir_all(cubin_path.parent().unwrap())?;
            let tmp = cubin_path.with_extension(format!("tmp{}", std::process::id()));
            std::fs::write(&tmp, &cubin)?;
            std::fs::write(log_path, &log)?;
            std::fs::rename(tmp, cubin_path)
        };
        if let Err(e) = write() {
            tracing::debug!("kernel cache not written at {}: {e}", cubin_path.display());
        }
    }
    Ok((cubin, parse_ptxas_log(&log), CubinOrigin::Compiled))
}

/// Compiles with NVRTC, neither the built-in cubins nor the disk cache (the precompile check
/// must really compile).
pub fn compile_uncached(
    file: &str,
    source: &str,
    arch: &str,
    extra_options: &[&str],
) -> Result<(Vec<u8>, Vec<CompileReport>)> {
    nvrtc_version()?;
    let options = nvrtc_options(arch, extra_options);
    let source = crate::kernels::expand_includes(source);
    let (cubin, log) = nvrtc_compile(file, &source, &options).map_err(|log| Error::Compile {
        file: file.to_string(),
        arch: arch.to_string(),
        log,
    })?;
    Ok((cubin, parse_ptxas_log(&log)))
}

/// Parses ptxas' `--verbose` lines:
/// `ptxas info    : Compiling entry function 'name' for 'sm_90a'`,
/// `ptxas info    : Used 40 registers, used 0 barriers, 1024 bytes smem, ...`,
/// `    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads`.
pub fn parse_ptxas_log(log: &str) -> Vec<CompileReport> {
    fn number_before(line: &str, unit: &str) -> Option<u32> {
        let idx = line.find(unit)?;
        line[..idx]
            .split(|c: char| !c.is_ascii_digit())
            .rfind(|s| !s.is_empty())?
            .parse()
            .ok()
    }
    let mut out: Vec<CompileReport> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let entry = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(CompileReport {
                entry,
                ..Default::default()
            });
            continue;
        }
        let Some(cur) = out.last_mut() else { continue };
        if line.contains("Used") && line.contains("registers") {
            cur.registers = number_before(line, " registers").unwrap_or(0);
            cur.shared_bytes = number_before(line, " bytes smem").unwrap_or(0);
        }
        if line.contains("stack frame") {
            cur.stack_bytes = number_before(line, " bytes stack frame").unwrap_or(0);
            cur.spill_store_bytes = number_before(line, " bytes spill stores").unwrap_or(0);
            cur.spill_load_bytes = number_before(line, " bytes spill loads").unwrap_or(0);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shipped kernel loads from the cubins built into the library (none compiled at run
    /// time), with the entry points its Rust side names, where the build found NVRTC.
    #[test]
    fn built_cubins_are_the_kernels() {
        if !built_archs().contains(&"sm_90a") {
            eprintln!("skipped: the kernels were not built in (no NVRTC at build time)");
            return;
        }
        for src in crate::kernels::ALL {
            let (cubin, reports, origin) =
                compile_cubin(src.file, src.source, "sm_90a", &[]).unwrap();
            assert_eq!(origin, CubinOrigin::Built, "kernels/{}", src.file);
            assert!(cubin.len() > 1000, "kernels/{}", src.file);
            for entry in (src.entries)() {
                assert!(
                    reports.iter().any(|r| r.entry == entry),
                    "kernels/{}: {entry} missing from the built cubin",
                    src.file
                );
            }
        }
        // Other options (a benchmark's variant) are not the built cubin.
        let src = &crate::kernels::ALL[0];
        let options = crate::cubin::nvrtc_options("sm_90a", &["-DSTOKE_VARIANT=1"]);
        let key = crate::cubin::cubin_key(
            &crate::kernels::expand_includes(src.source),
            &options,
            "sm_90a",
            None,
        );
        assert!(!BUILT.iter().any(|c| c.key == key));
    }

    #[test]
    fn parses_ptxas_verbose_output() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'rms_norm_bf16' for 'sm_90a'\n\
ptxas info    : Function properties for rms_norm_bf16\n\
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
ptxas info    : Used 38 registers, used 1 barriers, 128 bytes smem, 408 bytes cmem[0]\n";
        let r = parse_ptxas_log(log);
        assert_eq!(r.len(), 1);
        assert_eq!(
            r[0],
            CompileReport {
                entry: "rms_norm_bf16".into(),
                registers: 38,
                shared_bytes: 128,
                stack_bytes: 8,
                spill_store_bytes: 4,
                spill_load_bytes: 4,
            }
        );
    }
}
