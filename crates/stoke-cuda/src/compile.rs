//! NVRTC compilation to cubin, with a disk cache and the ptxas resource report.

use crate::{Error, Result};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use sha2::{Digest, Sha256};
use std::ffi::{CStr, CString};
use std::path::PathBuf;

/// Options every kernel is compiled with. Part of the cache key.
pub const BASE_OPTIONS: &[&str] = &[
    "--std=c++17",
    "-default-device",
    "--ptxas-options=--verbose",
];

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

/// NVRTC's version, e.g. (13, 0). Errors if libnvrtc cannot be loaded.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    // SAFETY: only checks whether the shared library can be opened.
    if !unsafe { nvrtc_sys::is_culib_present() } {
        return Err(Error::NvrtcMissing(
            "libnvrtc.so was not found on the library path (set LD_LIBRARY_PATH)".into(),
        ));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::NvrtcMissing(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

fn cache_dir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("STOKE_KERNEL_CACHE") {
        return (!dir.is_empty()).then(|| PathBuf::from(dir));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("stoke").join("kernels"))
}

/// Compiles `source` (the file `file` under `kernels/`, its `#include`s of
/// [`crate::kernels::HEADERS`] written in place) to a cubin for `arch` (e.g. `sm_90a`).
/// Returns the cubin, the per-entry resource report and whether it came from the disk cache.
/// Set `STOKE_KERNEL_CACHE=` (empty) to disable the cache.
pub fn compile_cubin(
    file: &str,
    source: &str,
    arch: &str,
    extra_options: &[&str],
) -> Result<(Vec<u8>, Vec<CompileReport>, bool)> {
    let version = nvrtc_version()?;
    let options = nvrtc_options(arch, extra_options);
    let source = &*crate::kernels::expand_includes(source);

    let mut hasher = Sha256::new();
    hasher.update(source.as_bytes());
    hasher.update(format!("{options:?}|{arch}|nvrtc {}.{}", version.0, version.1).as_bytes());
    let key = format!("{:x}", hasher.finalize());
    let cached = cache_dir().map(|d| {
        let stem = file.trim_end_matches(".cu");
        (
            d.join(format!("{stem}-{arch}-{}.cubin", &key[..16])),
            d.join(format!("{stem}-{arch}-{}.log", &key[..16])),
        )
    });
    if let Some((cubin_path, log_path)) = &cached
        && let (Ok(cubin), Ok(log)) = (std::fs::read(cubin_path), std::fs::read_to_string(log_path))
    {
        return Ok((cubin, parse_ptxas_log(&log), true));
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
    Ok((cubin, parse_ptxas_log(&log), false))
}

fn nvrtc_options(arch: &str, extra_options: &[&str]) -> Vec<String> {
    let mut options: Vec<String> = BASE_OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    options.extend(extra_options.iter().map(|s| s.to_string()));
    options
}

/// Compiles with no disk cache (the precompile check must really compile).
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

/// Runs NVRTC; on failure returns the program log.
fn nvrtc_compile(
    file: &str,
    source: &str,
    options: &[String],
) -> std::result::Result<(Vec<u8>, String), String> {
    let src = CString::new(source).map_err(|_| "source contains a NUL byte".to_string())?;
    let name = CString::new(file).unwrap();
    let prog = nvrtc::create_program(&src, Some(&name)).map_err(|e| format!("{e:?}"))?;
    struct Guard(nvrtc_sys::nvrtcProgram);
    impl Drop for Guard {
        fn drop(&mut self) {
            // SAFETY: the program was created above and is destroyed once.
            let _ = unsafe { nvrtc::destroy_program(self.0) };
        }
    }
    let prog = Guard(prog);
    // SAFETY: `prog` is a live program; options are valid C strings.
    let compiled = unsafe { nvrtc::compile_program(prog.0, options) };
    // SAFETY: `prog` is live; the log is a NUL-terminated string NVRTC owns a copy of.
    let log = unsafe { nvrtc::get_program_log(prog.0) }
        .map(|raw| {
            unsafe { CStr::from_ptr(raw.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        })
        .unwrap_or_default();
    if let Err(e) = compiled {
        return Err(format!("{e:?}\n{log}"));
    }
    let mut size = 0usize;
    // SAFETY: out-parameter on a compiled program.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBINSize: {e:?} (was a real sm_XX arch given?)"))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has exactly the size NVRTC reported.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr() as *mut _) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
    Ok((cubin, log))
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
