//! Kernel compilation without a GPU: every kernel under `kernels/` compiles for Hopper with no
//! spills, and a kernel that does not compile is an error carrying NVRTC's log (what makes the
//! precompile check fail CI). Needs libnvrtc on the library path (`.ci/run` puts the pinned
//! wheel's there); without it each test prints a visible skip.

use std::io::Write;
use stoke_cuda::{Error, compile::compile_uncached, kernels::ALL, nvrtc_version};

fn nvrtc_or_skip(test: &str) -> bool {
    match nvrtc_version() {
        Ok(_) => true,
        Err(e) => {
            let _ = writeln!(std::io::stdout(), "{test}: skipped: {e}");
            false
        }
    }
}

#[test]
fn every_kernel_compiles_for_sm_90a_without_spills() {
    if !nvrtc_or_skip("every_kernel_compiles_for_sm_90a_without_spills") {
        return;
    }
    for src in ALL {
        let (cubin, reports) = compile_uncached(src.file, src.source, "sm_90a", &[]).unwrap();
        assert!(!cubin.is_empty());
        let entries = (src.entries)();
        assert_eq!(entries.len(), reports.len(), "{}: entry points", src.file);
        for entry in entries {
            let r = reports
                .iter()
                .find(|r| r.entry == entry)
                .unwrap_or_else(|| panic!("{}: no ptxas report for {entry}", src.file));
            assert_eq!(
                r.spill_store_bytes + r.spill_load_bytes,
                0,
                "{}: {entry} spills: {r:?}",
                src.file
            );
            assert_eq!(
                r.stack_bytes, 0,
                "{}: {entry} uses a stack frame: {r:?}",
                src.file
            );
        }
    }
}

#[test]
fn a_kernel_that_does_not_compile_is_an_error_with_the_log() {
    if !nvrtc_or_skip("a_kernel_that_does_not_compile_is_an_error_with_the_log") {
        return;
    }
    let broken =
        r#"extern "C" __global__ void broken_f32(float* out) { out[0] = not_declared(1.0f); }"#;
    match compile_uncached("broken.cu", broken, "sm_90a", &[]) {
        Err(Error::Compile { file, arch, log }) => {
            assert_eq!(file, "broken.cu");
            assert_eq!(arch, "sm_90a");
            assert!(log.contains("not_declared"), "log names the problem: {log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}
