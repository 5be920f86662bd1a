//! `stoke-precompile`: compiles every kernel under `kernels/` with NVRTC for an architecture,
//! without a GPU, and prints ptxas' registers, shared memory, stack and spills per entry point.
//! Fails (exit 1) if a kernel does not compile or an expected entry point is missing.
//! `--variants 'A=1,B=2;C=3'` also compiles every file that names those macros with each
//! `;`-separated set of defines (the tuning knobs at the top of each kernel file), so a knob's
//! code path keeps compiling while it is off.
//!
//! NVRTC is loaded by name: point `LD_LIBRARY_PATH` at a CUDA 13 `lib` directory (the pinned
//! PyPI wheels installed by `scripts/cuda-venv.sh` provide one).

use std::process::ExitCode;
use stoke_cuda::compile::define_options;
use stoke_cuda::kernels::{ALL, parse_define_sets};

fn main() -> ExitCode {
    const USAGE: &str = "usage: stoke-precompile [--arch sm_90a] [--variants 'A=1,B=2;C=3']";
    let mut arch = "sm_90a".to_string();
    let mut variants: Vec<Vec<String>> = vec![Vec::new()];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--arch" => arch = args.next().expect("--arch needs a value, e.g. sm_90a"),
            "--variants" => {
                let list = args
                    .next()
                    .expect("--variants needs a list, e.g. 'A=1,B=2;C=3'");
                variants.extend(parse_define_sets(&list).into_iter().map(|(_, d)| d));
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
    let mut failed = false;
    println!(
        "{:<16} {:<36} {:>5} {:>8} {:>6} {:>12}",
        "file", "entry", "regs", "smem", "stack", "spills st/ld"
    );
    for (src, defines) in ALL
        .iter()
        .flat_map(|s| variants.iter().map(move |v| (s, v)))
    {
        // A variant only for the files that have every one of its knobs.
        if !defines.iter().all(|d| src.has_knob(d)) {
            continue;
        }
        let options = define_options(defines);
        let options: Vec<&str> = options.iter().map(String::as_str).collect();
        let label = if defines.is_empty() {
            src.file.to_string()
        } else {
            format!("{} [{}]", src.file, defines.join(","))
        };
        match stoke_cuda::compile::compile_uncached(src.file, src.source, &arch, &options) {
            Ok((cubin, reports)) => {
                if !defines.is_empty() {
                    println!("{label}");
                }
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
                            "kernels/{label}: entry point `{entry}` missing from the compiled module"
                        );
                        failed = true;
                    }
                }
                println!("{label:<16} cubin {} bytes", cubin.len());
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
