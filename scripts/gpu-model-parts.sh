#!/usr/bin/env bash
# Splits the default model (98 MB, over one GPU call's 64 MiB carry) into four parts under
# .carry/ (git-ignored) for back-to-back GPU calls, and prints the calls to make. Ignored files
# stay on a warm GPU machine between calls, so each call moves its parts out of the tree and
# the last one joins and checks them.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${STOKE_MODEL_CACHE:-$HOME/.cache/stoke/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$model" ] || { echo "no model at $model: run the llama example once to fetch it" >&2; exit 1; }
rm -rf .carry && mkdir -p .carry
split -n 4 -d -a 1 "$model" .carry/p
# The start of the evaluation text for the SmolLM2 decode test (it reads 8 x 64 tokens).
eval_text="${STOKE_EVAL_SOURCE:-../shared/data/enwiki-eval.txt}"
[ -f "$eval_text" ] && head -c 65536 "$eval_text" > .carry/eval.txt
sha=$(sha256sum "$model" | cut -d' ' -f1)
cat <<MSG
parts: $(ls .carry | tr '\n' ' ')
1) carry [".bundle", ".carry/p0"]:  mkdir -p /tmp/m && mv .carry/p0 /tmp/m/
2) carry [".carry/p1", ".carry/p2"]: mv .carry/p1 .carry/p2 /tmp/m/
3) carry [".carry/p3", ".carry/eval.txt"]: mv .carry/p3 /tmp/m/ && mkdir -p /tmp/models && cat /tmp/m/p0 /tmp/m/p1 /tmp/m/p2 /tmp/m/p3 > /tmp/models/$(basename "$model") && echo "$sha  /tmp/models/$(basename "$model")" | sha256sum -c && export STOKE_MODEL_CACHE=/tmp/models STOKE_EVAL_TEXT=\$PWD/.carry/eval.txt && bash scripts/gpu-run.sh \$OUT llama
   (or, for the model tests: ... && bash scripts/gpu-run.sh \$OUT test smollm2_int4_decode_matches_dequantized smollm2_greedy_on_gpu)
   (or, for the server under load and its peer, with .whl carried too: ... && STOKE_PEER_ARGS="--time-limit 15" bash scripts/gpu-run.sh \$OUT serve;
    then, on the same warm machine: STOKE_MODEL_CACHE=/tmp/models bash scripts/gpu-run.sh \$OUT soak 480)
MSG
