#!/usr/bin/env bash
# Builds Stoke's GPU test and benchmark binary and the main job (the `llama` example) in release
# on this (GPU-less) machine and packs them into DIR (default .bundle/, git-ignored), small and
# self-contained: the kernels are built into the binary as sm_90a cubins (stoke-cuda's build.rs,
# with the pinned NVRTC wheel of scripts/cuda-venv.sh), so the GPU machine compiles none of them;
# the binary is stripped and xz-compressed (gpu-run.sh unpacks them). Carry DIR to the GPU machine and run
# `bash scripts/gpu-run.sh OUTDIR` there. A second bundle (another commit, e.g. DIR .carry/base,
# git-ignored) runs there with `STOKE_BUNDLE=.carry/base bash scripts/gpu-run.sh ...`, so two
# commits are timed in one call on one card.
# Usage: scripts/gpu-bundle.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.bundle}
eval "$(scripts/cuda-venv.sh | tail -n 1)"
export LD_LIBRARY_PATH="$STOKE_CUDA_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cargo build --release -p stoke-tests --bin stoke-gpu
# The main job too (the README's `llama` example), for its cold and warm first token there,
# and the server with its load generator.
cargo build --release -p stoke-llama --example llama
cargo build --release -p stoke-serve --bins
target=${CARGO_TARGET_DIR:-target}
rm -rf "$dir"
mkdir -p "$dir"
strip -o "$dir/stoke-gpu" "$target/release/stoke-gpu"
strip -o "$dir/llama" "$target/release/examples/llama"
strip -o "$dir/stoke-serve" "$target/release/stoke-serve"
strip -o "$dir/stoke-load" "$target/release/stoke-load"
git rev-parse --short=12 HEAD > "$dir/COMMIT" 2>/dev/null || echo unknown > "$dir/COMMIT"
if ! git diff --quiet HEAD 2>/dev/null; then sed -i 's/$/-dirty/' "$dir/COMMIT"; fi
(cd "$dir" && sha256sum stoke-gpu llama stoke-serve stoke-load > SHA256SUMS)
xz -9 -T2 "$dir/stoke-gpu" "$dir/llama" "$dir/stoke-serve" "$dir/stoke-load"
du -sh "$dir"/*.xz
echo "bundle ready in $dir: commit $(cat "$dir/COMMIT")"
