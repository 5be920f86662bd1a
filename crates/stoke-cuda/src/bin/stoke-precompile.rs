//! `stoke-precompile`: compiles every kernel under `kernels/` with NVRTC for an architecture,
//! without a GPU, and prints ptxas' registers, shared memory, stack and spills per entry point.
//! Fails (exit 1) if a kernel does not compile or an expected entry point is missing.
//!
//! NVRTC is loaded by name: point `LD_LIBRARY_PATH` at a CUDA 13 `lib` directory (the pinned
//! PyPI wheels installed by `scripts/cuda-venv.sh` provide one).

use std::process::ExitCode;
use stoke_cuda::kernels::ALL;

fn main() -> ExitCode {
    let mut arch = "sm_90a".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--arch" => arch = args.next().expect("--arch needs a value, e.g. sm_90a"),
            "-h" | "--help" => {
                println!("usage: stoke-precompile [--arch sm_90a]");
                return ExitCode::SUCCESS;
            }
            other => {
                eprintln!("unknown argument `{other}` (usage: stoke-precompile [--arch sm_90a])");
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
    let mut failed = false;
    println!(
        "{:<16} {:<36} {:>5} {:>8} {:>6} {:>12}",
        "file", "entry", "regs", "smem", "stack", "spills st/ld"
    );
    for src in ALL {
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
                for entry in src.entries {
                    if !reports.iter().any(|r| r.entry == *entry) {
                        eprintln!(
                            "kernels/{}: entry point `{entry}` missing from the compiled module",
                            src.file
                        );
                        failed = true;
                    }
                }
                println!("{:<16} cubin {} bytes", src.file, cubin.len());
            }
            Err(e) => {
                eprintln!("{e}");
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
