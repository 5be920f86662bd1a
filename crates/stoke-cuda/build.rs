//! Compiles the kernels under `kernels/` (the top level; the benchmark-only `kernels/bench/`
//! compile at first use) to cubins for Hopper with NVRTC, in parallel, and writes
//! `$OUT_DIR/built_cubins.rs`, the table `src/compile.rs` includes: a process then loads its
//! kernels without compiling anything. NVRTC is opened by name through the library path
//! (`LD_LIBRARY_PATH`, as at run time). Where it is not found, or `STOKE_BUILD_KERNELS=0`, the
//! table is empty and each kernel is compiled at first use (and cached on disk), as before.

#[path = "src/cubin.rs"]
#[allow(dead_code)]
mod cubin;

use std::path::{Path, PathBuf};

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo"));
    let kernels = manifest.join("../../kernels");
    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-changed=src/cubin.rs");
    println!("cargo:rerun-if-env-changed=STOKE_BUILD_KERNELS");
    println!("cargo:rerun-if-env-changed=LD_LIBRARY_PATH");

    let built = if std::env::var("STOKE_BUILD_KERNELS").is_ok_and(|v| v == "0") {
        Vec::new()
    } else if !cubin::nvrtc_present() {
        println!(
            "cargo:warning=stoke-cuda: libnvrtc not found on the library path, so the kernels \
             are not built in; each compiles at its first use instead (point LD_LIBRARY_PATH at \
             a CUDA 13 lib directory to build them in)"
        );
        Vec::new()
    } else {
        compile_all(&kernels, &out)
    };

    let mut table = String::from("static BUILT: &[BuiltCubin] = &[\n");
    for b in &built {
        table.push_str(&format!(
            "    BuiltCubin {{ file: {:?}, arch: {:?}, key: {:?}, cubin: include_bytes!({:?}), log: include_str!({:?}) }},\n",
            b.file,
            b.arch,
            b.key,
            b.cubin.display().to_string(),
            b.log.display().to_string(),
        ));
    }
    table.push_str("];\n");
    std::fs::write(out.join("built_cubins.rs"), table).expect("write built_cubins.rs");
}

struct Built {
    file: String,
    arch: &'static str,
    key: String,
    cubin: PathBuf,
    log: PathBuf,
}

/// Compiles every `*.cu` directly in `dir` for each of [`cubin::EMBEDDED_ARCHS`], one thread
/// per kernel, writing `<stem>-<arch>.cubin` and `.log` into `out`. A kernel that does not
/// compile is left out with a warning (its first use then reports NVRTC's full log).
fn compile_all(dir: &Path, out: &Path) -> Vec<Built> {
    let sources = cubin::kernel_dir_sources(dir)
        .unwrap_or_else(|e| panic!("reading the kernels in {}: {e}", dir.display()));
    let jobs: Vec<(String, String, &'static str)> = sources
        .into_iter()
        .flat_map(|(name, source)| {
            cubin::EMBEDDED_ARCHS
                .iter()
                .map(move |arch| (name.clone(), source.clone(), *arch))
        })
        .collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(file, source, arch)| {
                scope.spawn(move || {
                    let options = cubin::nvrtc_options(arch, &[]);
                    let compiled = cubin::nvrtc_compile(file, source, &options);
                    (
                        file,
                        arch,
                        cubin::cubin_key(source, &options, arch, None),
                        compiled,
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| {
                let (file, arch, key, compiled) = h.join().expect("a compile thread panicked");
                match compiled {
                    Ok((bytes, log)) => {
                        let stem = file.trim_end_matches(".cu");
                        let cubin = out.join(format!("{stem}-{arch}.cubin"));
                        let log_path = out.join(format!("{stem}-{arch}.log"));
                        std::fs::write(&cubin, bytes).expect("write a cubin into OUT_DIR");
                        std::fs::write(&log_path, log).expect("write a log into OUT_DIR");
                        Some(Built {
                            file: file.clone(),
                            arch,
                            key,
                            cubin,
                            log: log_path,
                        })
                    }
                    Err(log) => {
                        let first = log.lines().take(6).collect::<Vec<_>>().join(" | ");
                        println!(
                            "cargo:warning=stoke-cuda: kernels/{file} did not compile for {arch}; it is compiled at first use instead: {first}"
                        );
                        None
                    }
                }
            })
            .collect()
    })
}
