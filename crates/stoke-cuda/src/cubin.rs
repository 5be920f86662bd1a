//! What the build script (`build.rs`, which compiles the kernels into the library where NVRTC
//! is found at build time) and the runtime (which compiles at first use otherwise) share: the
//! NVRTC options, the `#include` expansion, a cubin's key and one NVRTC compilation. Depends
//! only on `std`, `sha2` and `cudarc`'s NVRTC bindings, so `build.rs` includes it by path.

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};
use sha2::{Digest, Sha256};
use std::ffi::{CStr, CString};

/// Options every kernel is compiled with. Part of the cache key.
pub const BASE_OPTIONS: &[&str] = &[
    "--std=c++17",
    "-default-device",
    "--ptxas-options=--verbose",
];

/// The architectures whose cubins the build embeds: Hopper, the GPUs Stoke's kernels are for.
#[allow(dead_code)] // read by build.rs
pub const EMBEDDED_ARCHS: &[&str] = &["sm_90a"];

/// [`BASE_OPTIONS`], the architecture and `extra_options`: the options NVRTC is given.
pub fn nvrtc_options(arch: &str, extra_options: &[&str]) -> Vec<String> {
    let mut options: Vec<String> = BASE_OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    options.extend(extra_options.iter().map(|s| s.to_string()));
    options
}

/// The key of a cubin compiled from `source` (includes expanded) with `options` for `arch`: a
/// hex SHA-256 of all three. The disk cache adds the NVRTC version; an embedded cubin is valid
/// whatever NVRTC the running process has (the driver loads it).
pub fn cubin_key(
    source: &str,
    options: &[String],
    arch: &str,
    nvrtc: Option<(i32, i32)>,
) -> String {
    let mut hasher = Sha256::new();
    hasher.update(source.as_bytes());
    hasher.update(format!("{options:?}|{arch}").as_bytes());
    if let Some((major, minor)) = nvrtc {
        hasher.update(format!("|nvrtc {major}.{minor}").as_bytes());
    }
    format!("{:x}", hasher.finalize())
}

/// `source` with each `#include "NAME"` line for which `lookup` gives a header replaced by that
/// header's text; other lines (other includes among them) are kept as they are.
pub fn expand_includes_from<'a, 'h>(
    source: &'a str,
    lookup: impl Fn(&str) -> Option<&'h str>,
) -> std::borrow::Cow<'a, str> {
    let header = |line: &str| {
        let name = line.trim().strip_prefix("#include \"")?.strip_suffix('"')?;
        lookup(name)
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

/// Every `*.cu` file directly in `dir`, by name, with its `#include "NAME"` lines filled from the
/// `*.cuh` files in `dir`: `(file name, expanded source)`.
pub fn kernel_dir_sources(dir: &std::path::Path) -> std::io::Result<Vec<(String, String)>> {
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    files.sort();
    let with_ext = |x: &'static str| {
        files
            .iter()
            .filter(move |p| p.extension().is_some_and(|e| e == x))
    };
    let name = |p: &std::path::Path| {
        p.file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned()
    };
    let headers: Vec<(String, String)> = with_ext("cuh")
        .map(|p| Ok((name(p), std::fs::read_to_string(p)?)))
        .collect::<std::io::Result<_>>()?;
    with_ext("cu")
        .map(|p| {
            let text = std::fs::read_to_string(p)?;
            let source = expand_includes_from(&text, |h| {
                headers
                    .iter()
                    .find(|(n, _)| n == h)
                    .map(|(_, t)| t.as_str())
            });
            Ok((name(p), source.into_owned()))
        })
        .collect()
}

/// Runs NVRTC on `source` (named `file` in its messages) with `options`; returns the cubin and
/// ptxas' log, or on failure the program log.
pub fn nvrtc_compile(
    file: &str,
    source: &str,
    options: &[String],
) -> std::result::Result<(Vec<u8>, String), String> {
    let src = CString::new(source).map_err(|_| "source contains a NUL byte".to_string())?;
    let name = CString::new(file).map_err(|_| "file name contains a NUL byte".to_string())?;
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

/// Whether libnvrtc can be opened (by name, through the library path).
pub fn nvrtc_present() -> bool {
    // SAFETY: only checks whether the shared library can be opened.
    unsafe { nvrtc_sys::is_culib_present() }
}
