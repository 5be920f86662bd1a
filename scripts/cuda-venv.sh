#!/usr/bin/env bash
# Creates (or updates) a Python virtual environment holding a pinned CUDA 13 toolchain from
# PyPI wheels: nvcc, NVVM, NVRTC, the runtime headers/libraries, CCCL, cuobjdump, nvdisasm.
#
# Usage:   scripts/cuda-venv.sh                  # venv at ${STOKE_VENV:-.venv} (repo-relative)
#          eval "$(scripts/cuda-venv.sh | tail -1)"   # sets STOKE_CUDA_HOME
#
# Everything lands in $VENV/lib/python3*/site-packages/nvidia/cu13/{bin,lib,include,nvvm}.
# The last line printed on stdout is `export STOKE_CUDA_HOME=<abs path to .../nvidia/cu13>`.
# Progress messages go to stderr. Re-running is cheap: the install is skipped when the venv
# already imports `nvidia` and its stamp file records the same pin list.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${STOKE_VENV:-.venv}"
case "$VENV" in
    /*) ;;
    *) VENV="$ROOT/$VENV" ;;
esac

PINS=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-nvrtc==13.0.88
    nvidia-cuda-cccl==13.0.85
    nvidia-cuda-cuobjdump==13.2.51
    nvidia-cuda-nvdisasm==13.2.51
)
STAMP="$VENV/.stoke-cuda-pins"
WANT="$(printf '%s\n' "${PINS[@]}")"

log() { echo "cuda-venv: $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv at $VENV"
    python3 -m venv "$VENV" >&2
fi

if "$VENV/bin/python" -c 'import nvidia' >/dev/null 2>&1 \
    && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    log "pins up to date ($STAMP)"
else
    log "installing: ${PINS[*]}"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q "${PINS[@]}" >&2
    printf '%s\n' "$WANT" >"$STAMP"
fi

CU13="$("$VENV/bin/python" - <<'PY'
import glob, os, sys
hits = sorted(glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "cu13")))
if not hits:
    sys.exit("nvidia/cu13 not found under " + sys.prefix)
print(os.path.abspath(hits[0]))
PY
)"

for f in bin/nvcc bin/cuobjdump bin/nvdisasm; do
    [ -e "$CU13/$f" ] || { log "missing $CU13/$f"; exit 1; }
done
# Wheels do not always keep the executable bit on tools.
chmod +x "$CU13"/bin/* "$CU13"/nvvm/bin/* 2>/dev/null || true

echo "export STOKE_CUDA_HOME=$CU13"
