#!/usr/bin/env bash
# Builds Stoke's GPU test and benchmark binary in release on this (GPU-less) machine and packs
# it into .bundle/ (git-ignored), small and self-contained: the kernels are compiled into the
# binary as source and built by NVRTC on the GPU machine. Carry `.bundle` to the GPU machine
# and run `bash scripts/gpu-run.sh OUTDIR` there.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p stoke-tests --bin stoke-gpu
rm -rf .bundle
mkdir -p .bundle
cp target/release/stoke-gpu .bundle/
git rev-parse --short=12 HEAD > .bundle/COMMIT 2>/dev/null || echo unknown > .bundle/COMMIT
if ! git diff --quiet HEAD 2>/dev/null; then sed -i 's/$/-dirty/' .bundle/COMMIT; fi
(cd .bundle && sha256sum stoke-gpu > SHA256SUMS)
du -sh .bundle/stoke-gpu
echo "bundle ready: commit $(cat .bundle/COMMIT)"
