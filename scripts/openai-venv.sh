#!/usr/bin/env bash
# Makes .venv-openai: a Python virtual environment holding the official `openai` client (pinned),
# which the server tests (crates/stoke-serve/tests/server.rs) drive stoke-serve with.
# Prints `export STOKE_OPENAI_PYTHON=<its python>` as its last line.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-openai"
PIN="openai==3.63.0"
if ! "$VENV/bin/python" -c "import openai" 2>/dev/null || [ "$(cat "$VENV/.pin" 2>/dev/null)" != "$PIN" ]; then
    echo "openai-venv: installing $PIN into $VENV" >&2
    python3 -m venv "$VENV" >&2
    "$VENV/bin/pip" install --quiet --disable-pip-version-check "$PIN" >&2
    echo "$PIN" > "$VENV/.pin"
fi
echo "export STOKE_OPENAI_PYTHON=$VENV/bin/python"
