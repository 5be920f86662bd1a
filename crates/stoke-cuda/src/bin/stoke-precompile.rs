//! `stoke-precompile`: compiles every kernel under `kernels/` with NVRTC for an architecture,
//! without a GPU, and prints ptxas' registers, shared memory, stack and spills per entry point.
//! Fails (exit 1) if a kernel does not compile or its entry points are not exactly the ones
//! its Rust description names.
//!
//! `--dir DIR --cubin-out OUT` instead compiles every `*.cu` file directly in DIR (its
//! `#include "NAME"` lines filled from the files in DIR) and writes `OUT/<stem>.cubin`:
//! `scripts/sass-compare.sh` uses it to compile two commits' kernels with the same NVRTC.
//! `--cubin-out OUT` alone writes the shipped kernels' cubins.
//!
//! NVRTC is loaded by name: point `LD_LIBRARY_PATH` at a CUDA 13 `lib` directory (the pinned
//! PyPI wheels installed by `scripts/cuda-venv.sh` provide one).

use std::process::ExitCode;
use stoke_cuda::kernels::{ALL, BENCH};

fn main() -> ExitCode {
    const USAGE: &str = "usage: stoke-precompile [--arch sm_90a] [--dir DIR] [--cubin-out OUT]";
    let mut arch = "sm_90a".to_string();
    let mut dir: Option<std::path::PathBuf> = None;
    let mut cubin_out: Option<std::path::PathBuf> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--arch" => arch = args.next().expect("--arch needs a value, e.g. sm_90a"),
            "--dir" => dir = Some(args.next().expect("--dir needs a directory").into()),
            "--cubin-out" => {
                cubin_out = Some(args.next().expect("--cubin-out needs a directory").into())
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other => {
                eprintln!("unknown argument `{other}` ({USAGE})");
                return ExitCode::FAILURE;
            }
        }
    }
    match stoke_cuda::nvrtc_version() {
        Ok((ma, mi)) => println!("NVRTC {ma}.{mi}, arch {arch}"),
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    }
    if let Some(dir) = dir {
        let Some(out) = cubin_out else {
            eprintln!("--dir needs --cubin-out ({USAGE})");
            return ExitCode::FAILURE;
        };
        return compile_dir(&dir, &out, &arch);
    }
    let mut failed = false;
    println!(
        "{:<16} {:<36} {:>5} {:>8} {:>6} {:>12}",
        "file", "entry", "regs", "smem", "stack", "spills st/ld"
    );
    for src in ALL.iter().chain(BENCH) {
        let label = src.file;
        let t0 = std::time::Instant::now();
        match stoke_cuda::compile::compile_uncached(src.file, src.source, &arch, &[]) {
            Ok((cubin, reports)) => {
                for r in &reports {
                    println!(
                        "{:<16} {:<36} {:>5} {:>8} {:>6} {:>6}/{:<6}",
                        src.file,
                        r.entry,
                        r.registers,
                        r.shared_bytes,
                        r.stack_bytes,
                        r.spill_store_bytes,
                        r.spill_load_bytes
                    );
                }
                // The Rust description of the entry points and the `.cu` instantiations must
                // agree exactly, both ways.
                let expected = (src.entries)();
                for entry in &expected {
                    if !reports.iter().any(|r| r.entry == *entry) {
                        eprintln!(
                            "kernels/{label}: entry point `{entry}` missing from the compiled module"
                        );
                        failed = true;
                    }
                }
                for r in &reports {
                    if !expected.contains(&r.entry.as_str()) {
                        eprintln!(
                            "kernels/{label}: entry point `{}` is compiled but not described on the Rust side",
                            r.entry
                        );
                        failed = true;
                    }
                }
                println!(
                    "{label:<16} cubin {} bytes, compiled in {:.1} s",
                    cubin.len(),
                    t0.elapsed().as_secs_f64()
                );
                if let Some(out) = &cubin_out {
                    let path = out.join(src.file.replace(".cu", ".cubin"));
                    if let Err(e) =
                        std::fs::create_dir_all(out).and_then(|_| std::fs::write(&path, &cubin))
                    {
                        eprintln!("{}: {e}", path.display());
                        failed = true;
                    }
                }
            }
            Err(e) => {
                eprintln!("{label}: {e}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Compiles every `*.cu` file directly in `dir` (headers from the same directory) to
/// `out/<stem>.cubin`.
fn compile_dir(dir: &std::path::Path, out: &std::path::Path, arch: &str) -> ExitCode {
    let sources = match stoke_cuda::kernels::kernel_dir_sources(dir) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = std::fs::create_dir_all(out) {
        eprintln!("{}: {e}", out.display());
        return ExitCode::FAILURE;
    }
    let mut failed = false;
    for (name, source) in &sources {
        match stoke_cuda::compile::compile_uncached(name, source, arch, &[]) {
            Ok((cubin, reports)) => {
                let target = out.join(name.replace(".cu", ".cubin"));
                if let Err(e) = std::fs::write(&target, &cubin) {
                    eprintln!("{}: {e}", target.display());
                    failed = true;
                }
                println!(
                    "{name}: {} entry points, {} bytes",
                    reports.len(),
                    cubin.len()
                );
            }
            Err(e) => {
                eprintln!("{name}: {e}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
