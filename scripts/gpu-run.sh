#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .bundle/ from scripts/gpu-bundle.sh
# (STOKE_BUNDLE=DIR runs another bundle directory instead):
# every GPU test, then the benchmarks, then the PyTorch peers, writing JSON into OUTDIR.
# Usage: bash scripts/gpu-run.sh OUTDIR [test [NAME...]|bench|all|llama|int4|attention|prefill|pairs|sanitize [TOOL...]|int4-profile [SHAPE...]|fp8-profile [SHAPE...]|attention-profile [SHAPE...]]
#   int4:  the W4A16 GEMM test and benchmark, then its PyTorch peers
#   attention: the decode-attention test and benchmark, then the PyTorch SDPA peer
#   pairs: a decode step's RMSNorm then the W4A16 GEMM it feeds (ordering test, then the pairs
#          timed beside each kernel alone)
#   int4-profile: Nsight Compute reports (OUTDIR/ncu-int4-profile.txt) of the W4A16 kernels on
#          the named benchmark shapes at one row, every kernel family and word order
#   fp8-profile [--m M] [SHAPE...]: the same for the FP8 prefill GEMM (plain epilogue, M rows,
#          default 2048; shapes as in its benchmark, e.g. 8b_o 8b_down; default all)
#   attention-profile [SHAPE --batch B --ctx C --formats int4]: the same for decode attention
#          (OUTDIR/ncu-attention-profile.txt), the named formats (default all; two launches
#          each, so NCU_LAUNCHES=6 covers three). NCU_KERNELS=REGEX picks the kernels profiled
#          (e.g. int4_gemm_swap: int4-profile launches the batched kernels first). With
#          NCU_PEER='SHAPE BATCH CTX' it then profiles PyTorch SDPA's kernels at that point
#          (OUTDIR/ncu-attention-peer.txt; NCU_PEER_KERNELS=REGEX, default flash|fmha|attn|sdpa|cudnn)
#   test fp8_gemm_matches_reference: the FP8 prefill GEMM's test and benchmark, then its
#          PyTorch peers (cuBLAS FP8 rowwise _scaled_mm, bf16 matmul; STOKE_NO_PEERS=1 skips them)
#   prefill-attention: the prefill-attention test and benchmark (single prompts, the packed mix),
#          then the PyTorch SDPA peers (flash, cuDNN, efficient; varlen_attn where present)
#   prefill: the packed-prefill tests (prefill attention, the model's packed prefill against the
#          reference decoder), the 8B-shaped prefill benchmark (STOKE_PREFILL_MIXES=2048,512
#          keeps the named points) and the prefill layer at 70B / 405B shapes
#          (STOKE_PREFILL_SHAPES=8b,70b,405b picks the parts; STOKE_PREFILL_MODES=fp8 times only
#          the FP8 projections; the mixes' names also pick the layers' prompts), then the PyTorch peers: the FP8
#          block (compiled, graphed; 8B / 70B / 405B shapes) and transformers (padded batches);
#          STOKE_NO_PEERS=1 skips them
#   engine: the engine's GPU tests (two plans in one process, SmolLM2 on the engine against an
#          f32 reference), then the serving benchmark (Poisson arrivals at fractions of the
#          saturating rate, closed-loop concurrency 32 beside the static batch; SmolLM2 and an
#          8B-shaped model; STOKE_SERVING_MODELS=smollm2 picks a part; schedules in
#          STOKE_SCHEDULES, default OUTDIR/schedules), then transformers' continuous batching on
#          the SmolLM2 schedules (scripts/peers/engine_torch.py; STOKE_NO_PEERS=1 skips it)
#   decode: the decode-step tests, then the step benchmark (SmolLM2, 8B/70B-shaped models), then
#          the PyTorch decode-step and transformers peers (STOKE_NO_PEERS=1 skips them)
#   serve: stoke-serve (started under setsid) under stoke-load, the saturating rate and fractions of
#          it (SmolLM2, then the 8B-shaped random-INT4 model; STOKE_SERVE_MODELS=smollm2 picks
#          a part; STOKE_LOAD_REQUESTS per rate, default 256; STOKE_SERVE_FLAGS: more server
#          flags, e.g. --max-running 64), each server then stopped with
#          SIGTERM (its exit status recorded); then transformers' continuous batching on the same
#          SmolLM2 schedules (STOKE_NO_PEERS=1 skips it): OUTDIR/load-MODEL.json, serve-MODEL.log
#   soak [SECONDS]: stoke-serve with SmolLM2 at STOKE_SOAK_FRACTION (default 0.7) of the
#          saturating rate for SECONDS (default 480): OUTDIR/soak.json (errors, p99 and memory
#          over time; STOKE_SOAK_WINDOW: seconds per window, default 60)
#   all:   GPU tests, kernel benchmarks, PyTorch peers (fits one 10-minute call)
#   STOKE_BENCH_ONLY=1 skips the int4 / attention test (run it first with `test NAME`).
#   llama: the SmolLM2 prefill/decode baseline alone (needs the model in STOKE_MODEL_CACHE)
#   main-job [FLAGS...]: the README's main job (the bundle's `llama`) twice, first on empty kernel
#          and burn-cuda caches (a fresh machine), then warm: OUTDIR/main-job-{cold,warm}.log
#   sanitize [TOOL...]: the GPU tests of every shipped kernel under compute-sanitizer, each
#          TOOL (default: memcheck racecheck synccheck initcheck) on Stoke's kernels only
#          (burn-cuda's run uninstrumented); logs in OUTDIR/sanitize-TOOL.log, the summary in
#          OUTDIR/sanitize.json. SANITIZE_TESTS='NAME ...' picks the test cases.
set -uo pipefail
out=${1:?usage: gpu-run.sh OUTDIR [test|bench|all|llama]}
what=${2:-all}
shift $(( $# < 2 ? $# : 2 ))   # the rest: test names, for `test`
mkdir -p "$out"
cd "$(dirname "$0")/.."
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export PYTHONUNBUFFERED=1
# Compiled kernels (Stoke's cubins, burn-cuda's PTX) and burn-cuda's autotune choices are cached
# under one directory. The GPU machine forgets it when it goes cold, so the run packs it into
# OUTDIR/gpucache.tar.gz; put that file at .gpucache/gpucache.tar.gz and carry `.gpucache` on
# the next call to skip minutes of compilation and autotuning.
cache=/tmp/stoke-gpucache
mkdir -p "$cache"
[ -f .gpucache/gpucache.tar.gz ] && tar -xzf .gpucache/gpucache.tar.gz -C "$cache"
export STOKE_KERNEL_CACHE=$cache/stoke
# The tests' reference decoders run on burn-cuda, which compiles and autotunes every new shape
# (a packed prefill makes many): tests autotune at the minimal level, since their results,
# not burn-cuda's speed, are what they compare (CUBECL_AUTOTUNE_LEVEL overrides it).
level=${CUBECL_AUTOTUNE_LEVEL:-$([ "$what" = test ] && echo minimal || echo balanced)}
cat > cubecl.toml <<TOML
[compilation]
cache = { file = "$cache/cubecl" }
[autotune]
level = "$level"
cache = { file = "$cache/autotune" }
TOML
pack_cache() { tar -czf "$out/gpucache.tar.gz" -C "$cache" . ; }
trap pack_cache EXIT
bundle=${STOKE_BUNDLE:-.bundle}
for b in stoke-gpu llama stoke-serve stoke-load; do
  if [ -f "$bundle/$b.xz" ]; then xz -dkf "$bundle/$b.xz" && chmod +x "$bundle/$b"; fi
done
(cd "$bundle" && sha256sum -c SHA256SUMS) || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$out/gpu.txt"
commit=$(cat "$bundle/COMMIT")
status=0
if [ "$what" = int4-profile ] || [ "$what" = attention-profile ] || [ "$what" = fp8-profile ]; then
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  case $what in
    int4-profile) default_kernels=int4_gemm ;;
    fp8-profile) default_kernels=fp8_gemm ;;
    *) default_kernels=decode_attn ;;
  esac
  kernels=${NCU_KERNELS:-$default_kernels}
  "$ncu" --target-processes all -k regex:$kernels --launch-count "${NCU_LAUNCHES:-200}" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
      --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
      --section SourceCounters \
      "$bundle/stoke-gpu" --out "$out" "$what" "$@" > "$out/ncu-$what.txt" 2>&1 || status=1
  tail -5 "$out/ncu-$what.txt"
  if [ "$what" = attention-profile ] && [ -n "${NCU_PEER:-}" ]; then
    # The peer's kernels at one point, every launch of its three calls (NCU_PEER_LAUNCHES).
    "$ncu" --target-processes all -k "regex:${NCU_PEER_KERNELS:-flash|fmha|attn|sdpa|cudnn}" --launch-count "${NCU_PEER_LAUNCHES:-6}" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
        python3 scripts/peers/attention_torch.py --profile $NCU_PEER > "$out/ncu-attention-peer.txt" 2>&1 || status=1
    tail -5 "$out/ncu-attention-peer.txt"
  fi
  exit $status
fi
if [ "$what" = sanitize ]; then
  san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  tools=${*:-memcheck racecheck synccheck initcheck}
  tests=${SANITIZE_TESTS:-rms_norm_matches_reference residual_rms_norm_matches_reference int4_gemm_matches_dequantized_reference int4_linear_epilogues_match_reference rms_norm_then_int4_gemm_matches_synchronized decode_attention_matches_reference}
  # Only Stoke's entry points are instrumented where the sanitizer can select kernels by a
  # regular expression; otherwise every kernel is.
  regex='rms_norm|int4_gemm|decode_attn|kv_append'
  filter=()
  if "$san" --help 2>&1 | grep -q -- '--kernel-regex'; then filter=(--kernel-regex "kns=$regex"); fi
  "$san" --version | tail -1 | tee "$out/sanitize-version.txt"
  echo '[' > "$out/sanitize.json"
  sep=''
  for tool in $tools; do
    extra=()
    [ "$tool" = memcheck ] && extra=(--leak-check no)
    [ "$tool" = racecheck ] && extra=(--racecheck-report all)
    t0=$(date +%s)
    "$san" --tool "$tool" "${filter[@]}" "${extra[@]}" --error-exitcode 99 --print-limit 50 \
        "$bundle/stoke-gpu" --out "$out/sanitize-$tool" test $tests > "$out/sanitize-$tool.log" 2>&1
    rc=$?
    summary=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize-$tool.log" | tail -1)
    echo "sanitize $tool: exit $rc, ${summary:-no summary}, $(( $(date +%s) - t0 )) s"
    printf '%s{"tool": "%s", "exit": %d, "summary": "%s", "seconds": %d, "tests": "%s"}\n' \
        "$sep" "$tool" "$rc" "$summary" "$(( $(date +%s) - t0 ))" "$tests" >> "$out/sanitize.json"
    sep=','
    [ $rc -eq 0 ] || status=1
  done
  echo ']' >> "$out/sanitize.json"
  exit $status
fi
if [ "$what" = main-job ]; then
  # The README's main job on an empty kernel cache and burn-cuda cache (a fresh machine: nothing
  # compiled, nothing autotuned), then again on the caches it left (warm); RUST_LOG=stoke=info
  # prints the first token's parts.
  cold=/tmp/stoke-cold
  rm -rf "$cold" && mkdir -p "$cold"
  here=$PWD
  for run in cold warm; do
    (cd "$cold" && STOKE_KERNEL_CACHE="$cold/kernels" RUST_LOG=stoke=info \
      "$here/$bundle/llama" --prompt "Once upon a time" --max-tokens 32 "$@") 2>&1 | tee "$out/main-job-$run.log" || status=1
  done
  exit $status
fi
# Starts stoke-serve (FLAGS...) under setsid on port 8000, logging to OUTDIR/serve-NAME.log;
# sets server_pid once /health answers (600 s at most).
start_server() {
  local name=$1; shift
  setsid "$bundle/stoke-serve" --port 8000 "$@" > "$out/serve-$name.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 600); do
    curl -sf http://127.0.0.1:8000/health > /dev/null && return 0
    kill -0 "$server_pid" 2>/dev/null || { echo "stoke-serve $name exited"; tail -20 "$out/serve-$name.log"; return 1; }
    sleep 1
  done
  echo "stoke-serve $name did not answer within 600 s"; return 1
}
# SIGTERM, then the exit status (and the time it took) into OUTDIR/serve-NAME.exit.
stop_server() {
  local name=$1 t0
  t0=$(date +%s.%N)
  kill -TERM "$server_pid"
  wait "$server_pid"
  local rc=$?
  echo "exit $rc after $(awk "BEGIN{print $(date +%s.%N) - $t0}") s" | tee "$out/serve-$name.exit"
}
if [ "$what" = serve ]; then
  parts=${STOKE_SERVE_MODELS:-smollm2,8b}
  n=${STOKE_LOAD_REQUESTS:-256}
  for m in ${parts//,/ }; do
    case $m in
      smollm2) flags=(); vocab=49152; reqs=$n ;;
      8b) flags=(--synthetic llama-3.1-8b); vocab=49152; reqs=$(( n / 2 )) ;;
      *) echo "unknown model $m"; status=1; continue ;;
    esac
    # shellcheck disable=SC2086
    start_server "$m" --context 4096 "${flags[@]}" ${STOKE_SERVE_FLAGS:-} || { status=1; continue; }
    "$bundle/stoke-load" --url http://127.0.0.1:8000 --rates inf,0.25x,0.5x,0.75x         --requests "$reqs" --vocab "$vocab" --server-pid "$server_pid" --name "$m"         --schedules "$out/schedules" --json "$out/load-$m.json" > /dev/null 2> "$out/load-$m.log" || status=1
    cat "$out/load-$m.log"
    curl -s http://127.0.0.1:8000/metrics > "$out/metrics-$m.txt"
    stop_server "$m"
  done
  if [ -z "${STOKE_NO_PEERS:-}" ] && [[ ",$parts," == *",smollm2,"* ]]; then
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    fi
    sched=()
    for f in "$out"/schedules/smollm2-*.json; do [ -f "$f" ] && sched+=(--schedule "$f"); done
    # shellcheck disable=SC2086
    python3 scripts/peers/engine_torch.py "${sched[@]}" ${STOKE_PEER_ARGS:-} --out "$out/torch-engine.json" 2>&1 | tee "$out/torch-engine.log" || status=1
  fi
  exit $status
fi
if [ "$what" = soak ]; then
  secs=${1:-480}
  start_server soak --context 4096 || exit 1
  "$bundle/stoke-load" --url http://127.0.0.1:8000 --rates inf,"${STOKE_SOAK_FRACTION:-0.7}x"       --requests 256 --duration "$secs" --window "${STOKE_SOAK_WINDOW:-60}" --server-pid "$server_pid" --name soak       --json "$out/soak.json" > /dev/null 2> "$out/soak.log" || status=1
  cat "$out/soak.log"
  curl -s http://127.0.0.1:8000/metrics > "$out/metrics-soak.txt"
  stop_server soak
  exit $status
fi
if [ "$what" = llama ]; then
  "$bundle/stoke-gpu" --out "$out" --commit "$commit" llama 2>&1 | tee "$out/llama.log" || status=1
  exit $status
fi
"$bundle/stoke-gpu" --out "$out" --commit "$commit" "$what" "$@" 2>&1 | tee "$out/stoke-gpu.log" || status=1
if [ "$what" = int4 ]; then
  python3 scripts/peers/int4_torch.py "$out/torch-int4.json" 2>&1 | tee "$out/torch-int4.log" || status=1
fi
if [ "$what" = decode ] && [ -z "${STOKE_NO_PEERS:-}" ]; then
  python3 scripts/peers/decode_torch.py "$out/torch-decode.json" 2>&1 | tee "$out/torch-decode.log" || status=1
fi
if [ "$what" = test ] && [[ " $* " == *" bf16_head_matches_reference "* ]] && [ -z "${STOKE_NO_PEERS:-}" ]; then
  python3 scripts/peers/head_torch.py "$out/torch-head.json" 2>&1 | tee "$out/torch-head.log" || status=1
fi
if [ "$what" = test ] && [[ " $* " == *" fp8_gemm_matches_reference "* ]] && [ -z "${STOKE_NO_PEERS:-}" ]; then
  python3 scripts/peers/fp8_torch.py "$out/torch-fp8.json" 2>&1 | tee "$out/torch-fp8.log" || status=1
fi
if [ "$what" = prefill ] && [ -z "${STOKE_NO_PEERS:-}" ]; then
  python3 scripts/peers/prefill_block_torch.py "$out/torch-prefill-block.json" 2>&1 | tee "$out/torch-prefill-block.log" || status=1
  python3 scripts/peers/prefill_torch.py "$out/torch-prefill.json" 2>&1 | tee "$out/torch-prefill.log" || status=1
fi
if [ "$what" = prefill-attention ] && [ -z "${STOKE_NO_PEERS:-}" ]; then
  python3 scripts/peers/prefill_attention_torch.py "$out/torch-prefill-attention.json" 2>&1 | tee "$out/torch-prefill-attention.log" || status=1
fi
if [ "$what" = engine ] && [ -z "${STOKE_NO_PEERS:-}" ]; then
  # transformers' continuous batching on the same SmolLM2 schedules (its GGUF loader needs the
  # `gguf` wheel, carried in .whl).
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  sched=()
  for f in "${STOKE_SCHEDULES:-$out/schedules}"/smollm2-*.json; do [ -f "$f" ] && sched+=(--schedule "$f"); done
  # STOKE_PEER_ARGS: more flags for the peer (e.g. --time-limit 30).
  # shellcheck disable=SC2086
  python3 scripts/peers/engine_torch.py "${sched[@]}" ${STOKE_PEER_ARGS:-} --out "$out/torch-engine.json" 2>&1 | tee "$out/torch-engine.log" || status=1
fi
if [ "$what" = attention ] && [ -z "${STOKE_NO_PEERS:-}" ]; then
  python3 scripts/peers/attention_torch.py "$out/torch-attention.json" 2>&1 | tee "$out/torch-attention.log" || status=1
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  python3 scripts/peers/rms_norm_torch.py "$out/torch-rms.json" 2>&1 | tee "$out/torch.log" || status=1
fi
exit $status
