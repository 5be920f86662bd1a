#!/usr/bin/env bash
# Compares the SASS of every kernel entry point between a commit and the working tree, both
# compiled here (no GPU) by the pinned NVRTC with the options the runtime uses.
#
# Usage: scripts/sass-compare.sh BASE_COMMIT [OUTDIR]
#   Compiles the kernel files of BASE_COMMIT and of the working tree (`kernels/*.cu` and the
#   benchmark-only `kernels/bench/*.cu`, each side with its own `kernels/*.cuh` headers),
#   disassembles each cubin with
#   cuobjdump, splits the SASS per entry point and prints one line per entry point:
#     identical   same SASS: the same instructions and encodings (column padding ignored)
#     differs     both have it, the SASS differs (OUTDIR/diff/<entry>.diff)
#     removed     only BASE_COMMIT has it
#     added       only the working tree has it
#   and a summary. Exit status 0 whatever differs: the reasons belong in the change's note.
set -euo pipefail
base=${1:?usage: scripts/sass-compare.sh BASE_COMMIT [OUTDIR]}
root="$(cd "$(dirname "$0")/.." && pwd)"
out=${2:-$root/target/sass-compare}
cd "$root"
eval "$(scripts/cuda-venv.sh | tail -n 1)"
export LD_LIBRARY_PATH="$STOKE_CUDA_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cargo build -q -p stoke-cuda --bin stoke-precompile
pre="$root/target/debug/stoke-precompile"

rm -rf "$out"
mkdir -p "$out/base/src" "$out/head"
# Each side's kernel files flattened into one directory with its headers.
git archive "$base" kernels | tar -x -C "$out/base/src"
mkdir -p "$out/head/src"
cp "$root"/kernels/*.cu "$root"/kernels/*.cuh "$out/head/src/"
for side in base head; do
    dir="$out/$side/src"
    [ -d "$dir/kernels" ] && dir="$dir/kernels"
    if [ -d "$dir/bench" ]; then cp "$dir"/bench/*.cu "$dir/"; fi
    [ "$side" = head ] && [ -d "$root/kernels/bench" ] && cp "$root"/kernels/bench/*.cu "$dir/"
    "$pre" --dir "$dir" --cubin-out "$out/$side/cubin" >/dev/null
done

for side in base head; do
    mkdir -p "$out/$side/sass"
    for cubin in "$out/$side/cubin"/*.cubin; do
        "$STOKE_CUDA_HOME/bin/cuobjdump" -sass "$cubin" >"$out/$side/sass/$(basename "$cubin" .cubin).sass"
    done
done

python3 - "$out" "$base" <<'PY'
import difflib, os, re, sys
out, base = sys.argv[1], sys.argv[2]

def functions(side):
    funcs = {}
    d = os.path.join(out, side, "sass")
    for name in sorted(os.listdir(d)):
        cur, lines = None, []
        for line in open(os.path.join(d, name)):
            m = re.match(r"\s*Function : (\S+)", line)
            if m:
                if cur:
                    funcs[cur] = (name, lines)
                cur, lines = m.group(1), []
            elif cur is not None:
                # cuobjdump pads columns to the file's longest line: compare the tokens.
                lines.append(" ".join(line.split()) + "\n")
        if cur:
            funcs[cur] = (name, lines)
    return funcs

b, h = functions("base"), functions("head")
os.makedirs(os.path.join(out, "diff"), exist_ok=True)
counts = {"identical": 0, "differs": 0, "removed": 0, "added": 0}
report = []
for entry in sorted(set(b) | set(h)):
    if entry not in h:
        status = "removed"
    elif entry not in b:
        status = "added"
    elif b[entry][1] == h[entry][1]:
        status = "identical"
    else:
        status = "differs"
        diff = difflib.unified_diff(b[entry][1], h[entry][1], f"{base}:{entry}", f"tree:{entry}")
        open(os.path.join(out, "diff", entry + ".diff"), "w").writelines(diff)
    counts[status] += 1
    where = (b.get(entry) or h.get(entry))[0].replace(".sass", ".cu")
    report.append(f"{status:<10} {where:<24} {entry}")
text = "\n".join(report) + "\n" + ", ".join(f"{v} {k}" for k, v in counts.items()) + "\n"
open(os.path.join(out, "report.txt"), "w").write(text)
print(text, end="")
PY
