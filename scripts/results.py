#!/usr/bin/env python3
"""Merges one GPU run's JSON files into a committed results file and renders docs/RESULTS.md.

Usage: scripts/results.py RUN_DIR results/NAME.json [results/EXTRA.json ...]
       (an extra with `prefill` and `cublas_peer`: a prefill run's merged file, see render_prefill)
       scripts/results.py --render results/NAME.json [results/EXTRA.json ...]   (no new run)
       scripts/results.py --attention RUN_DIR results/NAME.json   (a `gpu-run.sh OUT attention` run)
       scripts/results.py --int4 RUN_DIR results/NAME.json   (a `gpu-run.sh OUT int4` run; then --render
                                                              with it among the extras)
       scripts/results.py --pairs RUN_DIR results/NAME.json   (a `gpu-run.sh OUT pairs` run; the same)
RUN_DIR holds what scripts/gpu-run.sh wrote: gpu-tests.json, bench.json, torch-rms.json, gpu.txt.
Docs quote only numbers that come from a committed results file, so RESULTS.md is generated.
"""
import json
import sys
from pathlib import Path


def load(run, name):
    p = Path(run) / name
    return json.loads(p.read_text()) if p.exists() else None


def run_meta(run, meta):
    """A run's meta block with the last line of its nvidia-smi query (gpu.txt) added."""
    gpu_txt = (Path(run) / "gpu.txt").read_text() if (Path(run) / "gpu.txt").exists() else ""
    meta = dict(meta)
    meta["nvidia_smi"] = gpu_txt.strip().splitlines()[-1] if gpu_txt.strip() else ""
    return meta


def merge(run):
    tests = load(run, "gpu-tests.json")
    bench = load(run, "bench.json")
    torch = load(run, "torch-rms.json")
    llama = load(run, "llama.json")
    return {"meta": run_meta(run, bench["meta"]), "gpu_tests": tests["tests"], "bench": bench["bench"], "torch_rms_norm": torch,
            "llama": llama["llama"] if llama else None}


def merge_kernel_run(run, key, peer_file, peer_key):
    """A `gpu-run.sh OUT int4|attention|pairs` run: the kernel's GPU test, its benchmark
    (`key`.json) and its PyTorch peers (`peer_file`, where there are any)."""
    tests = load(run, "gpu-tests.json")
    result = load(run, f"{key}.json")
    merged = {"meta": run_meta(run, result["meta"]), "gpu_tests": tests["tests"] if tests else [], key: result[key]}
    if peer_file:
        merged[peer_key] = load(run, peer_file) or []
    return merged


def render_variants(w, runs, key, label):
    """Rows timed with a kernel variant (NVRTC defines, `STOKE_KERNEL_VARIANTS`) beside the
    shipped kernel's row of the same point."""
    variants = [r for r in runs if r.get("defines")]
    if not variants:
        return
    base = {key(r): r for r in runs if not r.get("defines")}
    w(f"Kernel variants in the same run ({label}; NVRTC defines, µs against the shipped kernel):")
    w("")
    w("| point | defines | µs | shipped µs | ratio |")
    w("| --- | --- | ---: | ---: | ---: |")
    for r in variants:
        b = base.get(key(r))
        w(f"| {' '.join(str(x) for x in key(r))} | `{r['defines']}` | {r['us']:.1f} | " + (f"{b['us']:.1f} | {b['us'] / r['us']:.2f}x |" if b else "- | - |"))
    w("")


# W4A16 kernel families timed in older runs and since removed (docs/PERFORMANCE.md).
REMOVED_INT4 = {"StreamK", "Swap16"}


# How `same_size_read_us` is measured (tests/src/bench.rs `same_size_read`).
READ_PROBE = ("`kernels/bench/read_rate.cu`, best of 32 launch shapes of the kernels' load: a chunk per CTA or per warp, 4 or 8"
              " 16-byte loads in flight per thread, 128 or 256 threads, 1-8 CTAs per SM; and, where the run has it, of 12 shapes"
              " of the copy engine: a chunk per CTA through a ring of 2-12 shared-memory stages of 4-64 KB by `cp.async.bulk`,"
              " 16-192 KB in flight per SM; timed the same way")


def render_read_forms(w, entries):
    """The read probe's best launch of each form, per byte count: entries of (label, bytes,
    loads µs, copy-engine µs)."""
    if not entries:
        return
    w("The read probe by form (the best launch of each; the tables above take the faster):")
    w("")
    w("| bytes read | MB | loads µs | copy engine µs | copy engine / loads |")
    w("| --- | ---: | ---: | ---: | ---: |")
    for label, n, ld, bk in entries:
        w(f"| {label} | {n / 1e6:.0f} | {ld:.2f} | {bk:.2f} | {bk / ld:.2f}x |")
    w("")


def render_attention(w, res, path):
    a = res["attention"]
    section(w, "Decode attention", res, path)
    copy = [e for e in res["torch_attention"] if e.get("impl") == "d2d_copy"]
    torch_copy = f", {copy[0]['gbps']:.0f} GB/s from PyTorch {copy[0]['torch']}" if copy else ""
    w("`kernels/decode_attention.cu`: one query token per sequence, all sequences at the same context, µs per call")
    w("(one launch: the splits and their merge; CUDA events, median of 5 batches, caches rotated through >= 160 MB).")
    w(f"`% copy`: K and V bytes read (scales included) per second over the same run's copy rate ({a['copy_gbps']:.0f} GB/s")
    w(f"from Stoke{torch_copy}). FP8 and INT4 rows rotated (Hadamard block = head_dim). Peer:")
    w("`scaled_dot_product_attention(enable_gqa=True)` on a BF16 cache (`scripts/peers/attention_torch.py`), same run;")
    graphed = any(e.get("timing") == "graph" for e in res["torch_attention"])
    if graphed and any("stream_us" in r for r in a["runs"]):
        w("Stoke's calls and SDPA's are both replayed from a CUDA graph of back-to-back calls (GPU time per call; `SDPA")
        w("eager µs`: SDPA issued from Python, `stream_us` in the file: Stoke's launched from the host).")
    elif graphed:
        w("its calls are replayed from a CUDA graph (GPU time, no dispatch on the host; `SDPA eager µs`: issued from Python).")
        w("Stoke's calls are launched back to back from the host, which queues one in `host µs`, below the kernel time.")
    else:
        w("it is timed from Python, so its small cases include PyTorch's dispatch. `host µs`: Stoke's time to queue one call.")
    read = any("same_size_read_us" in r for r in a["runs"])
    if read:
        w(f"`BF16 read µs`: the fastest single launch reading the BF16 cache's bytes once ({READ_PROBE}), the memory side")
        w("of the roofline; `BF16 / SDPA % of read`: that time over Stoke's BF16 time and over SDPA's.")
    w("")
    w("| shape | batch | ctx | BF16 µs | BF16 % copy | FP8 µs | FP8 % copy | INT4 µs | INT4 % copy | SDPA µs | SDPA % copy | BF16 vs SDPA | host µs |" + (" SDPA eager µs |" if graphed else "") + (" BF16 read µs | BF16 % of read | SDPA % of read |" if read else ""))
    w("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if graphed else "") + (" ---: | ---: | ---: |" if read else ""))
    peers = {(e["shape"], e["batch"], e["ctx"]): e for e in res["torch_attention"] if "us" in e}
    by = {(r["shape"], r["batch"], r["ctx"], r["format"]): r for r in a["runs"] if not r.get("pv_transposed") and not r.get("defines")}
    pvt = {(r["shape"], r["batch"], r["ctx"], r["format"]): r for r in a["runs"] if r.get("pv_transposed") and not r.get("defines")}
    for key in dict.fromkeys((r["shape"], r["batch"], r["ctx"]) for r in a["runs"]):
        f = [by.get(key + (fmt,)) for fmt in ("bf16", "fp8", "int4")]
        pe = peers.get(key)
        cells = []
        for r in f:
            cells += [f"{r['us']:.1f}", f"{100 * r['of_copy']:.1f}%"] if r else ["-", "-"]
        ps = [f"{pe['us']:.1f}", f"{100 * pe['of_copy']:.1f}%", f"{pe['us'] / f[0]['us']:.2f}x"] if pe and f[0] else ["-", "-", "-"]
        host = f"{f[0]['host_us']:.1f}" if f[0] and "host_us" in f[0] else "-"
        eager = (f" {pe['eager_us']:.1f} |" if pe and "eager_us" in pe else " - |") if graphed else ""
        if read:
            rd = f[0].get("same_size_read_us") if f[0] else None
            eager += (f" {rd:.1f} | {100 * rd / f[0]['us']:.0f}% | " + (f"{100 * rd / pe['us']:.0f}% |" if pe else "- |")) if rd else " - | - | - |"
        w(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells + ps) + f" | {host} |" + eager)
    w("")
    forms = {}
    for r in a["runs"]:
        if r["format"] == "bf16" and "same_size_read_bulk_us" in r and not r.get("defines"):
            forms.setdefault(r["bytes"], (f"BF16 cache, batch {r['batch']}, ctx {r['ctx']}", r["bytes"],
                                          r["same_size_read_load_us"], r["same_size_read_bulk_us"]))
    render_read_forms(w, list(forms.values()))
    render_variants(w, a["runs"], lambda r: (r["shape"], r["batch"], r["ctx"], r["format"]), "decode attention")
    if a.get("split_sweep"):
        w("Forced split counts in the same run (shipped kernels), against the plan's row above:")
        w("")
        # Runs since 16c38ba record the plan's split count and whether the splits formed clusters.
        cl = any("cluster" in r for r in a["split_sweep"])
        w("| shape | batch | ctx | format | splits | keys per split | " + ("cluster | " if cl else "") + "µs | % copy | plan's µs |")
        w("| --- | ---: | ---: | --- | ---: | ---: | " + ("--- | " if cl else "") + "---: | ---: | ---: |")
        for r in a["split_sweep"]:
            b = by.get((r["shape"], r["batch"], r["ctx"], r["format"]))
            c = ("yes | " if r.get("cluster", 1) > 1 else "no | ") if cl else ""
            plan = (f"{b['us']:.1f}" + (f" ({b['splits']}{', cluster' if b.get('cluster', 1) > 1 else ''})" if "splits" in b else "") + " |") if b else "- |"
            w(f"| {r['shape']} | {r['batch']} | {r['ctx']} | {r['format']} | {r['splits']} | {r['chunk']} | {c}{r['us']:.1f} | {100 * r['of_copy']:.1f}% | " + plan)
        w("")
    if pvt:
        w("The previous kernels (S = Q K^T, then O^T = V^T P^T: the `*_pvt` entry points, removed after this run) in the same run, µs (% copy):")
        w("")
        w("| shape | batch | ctx | BF16 | FP8 | INT4 |")
        w("| --- | ---: | ---: | ---: | ---: | ---: |")
        for key in dict.fromkeys((r["shape"], r["batch"], r["ctx"]) for r in a["runs"]):
            cells = [pvt.get(key + (fmt,)) for fmt in ("bf16", "fp8", "int4")]
            w(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(f"{r['us']:.1f} ({100 * r['of_copy']:.1f}%)" if r else "-" for r in cells) + " |")
        w("")
    t = [x for x in res["gpu_tests"] if x["name"] == "decode_attention_matches_reference"]
    if t and t[0]["details"]:
        d = t[0]["details"]
        w(f"Test `decode_attention_matches_reference` ({t[0]['status']}): worst kernel error {d['max_kernel_rel_err']:.2e} (tolerance {d['tolerance']:g}) against")
        w("the f64 reference over the cache the kernel read; quantization error against the exact cache:")
        w("")
        w("| format | rotation block | heads / kv heads | d | batch | longest ctx | kernel error | quantization error | appended rows differing |")
        w("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for c in d["cases"]:
            w(f"| {c['format']}{' (P V transposed)' if c.get('pv_transposed') else ''} | {c['block']} | {c['heads']} / {c['kv_heads']} | {c['d']} | {c['batch']} | {c['max_len']} | {c['kernel_rel_err']:.2e} | {100 * c['quantization_rel_err']:.2f}% | {c['append_rows_differing']} of {c['append_rows']} |")
        w("")
        w("Outliers on the kernels (Llama-3.1-8B attention shape, ctx 1024, 4 key channels per head x8; FuTransformer: INT4 22.2%")
        w("unrotated, 7.4% rotated): " + ", ".join(f"{o['format']} block {o['block']}: {100 * o['relative_error']:.1f}%" for o in d["outliers_llama8b_ctx1024_4ch_x8"]))
        w("")
    w("Kernel resources (ptxas): " + ", ".join(f"{k['entry']} {k['registers']} regs / {k['shared_bytes']} B smem / {k['spills']} B spills" for k in sorted(a["kernels"], key=lambda k: k["entry"])))
    w("")


def torch_best(torch, rows, hidden, dtype, impls):
    best = None
    for e in torch or []:
        if e.get("rows") == rows and e.get("hidden") == hidden and e.get("dtype") == dtype and e.get("impl") in impls:
            if best is None or e["us"] < best["us"]:
                best = e
    return best


def render_tests(w, tests, max_details=None):
    w("| test | status | seconds | details |")
    w("| --- | --- | ---: | --- |")
    for t in tests:
        details = t["message"] or json.dumps(t["details"])
        w(f"| {t['name']} | {t['status']} | {t['seconds']:.1f} | `{details[:max_details]}` |")
    w("")


def render_quality(w, res, path):
    m = res["meta"]
    section(w, "Model quality", res, path)
    w(f"`{m['command']}`")
    w("")
    w("| model | weights | text | windows x tokens | predicted tokens | perplexity | reference | commit |")
    w("| --- | --- | --- | --- | ---: | ---: | --- | --- |")
    for q in res["quality"]:
        w(f"| {q['model']} | {q['weights']} | {q['text']} | {q['windows']} x {q['window_tokens']} | {q['predicted_tokens']} | {q['perplexity']:.3f} | {q['reference_perplexity']:.3f} ({q['reference']}) | `{q.get('commit', m['commit'])}` |")
    w("")


def section(w, title, res, path):
    """A section heading naming the results file, its commit, date (and machine), then the run's note."""
    m = res["meta"]
    machine = f", {m['machine']}" if m.get("machine") else ""
    w(f"## {title} ([`{path}`](../{path}), commit `{m['commit']}`, {m['date_utc']}{machine})")
    w("")
    if m.get("note"):
        w(f"Note: {m['note']}")
        w("")


def render_llama(w, res, path):
    section(w, "SmolLM2-135M-Instruct: the baseline", res, path)
    w("Greedy generation through `stoke_llama::generate`, weights dequantized from the GGUF at load. Stoke<Cuda> routes only")
    w("RMSNorm to its kernel so far; every other op is burn-cuda's, and each RMSNorm crosses between the two streams")
    w("(see the crossing costs). Median of 3 runs after a warm-up.")
    w("")
    w("| backend | dtype | batch | prompt tokens | prefill tokens/s | decode tokens/s | decode step ms | load s |")
    w("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in res["llama"]["runs"]:
        w(f"| {r['backend']} | {r['dtype']} | {r['batch']} | {r['prompt_tokens']} | {r['prefill_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.1f} | {r['decode_step_ms']:.2f} | {r['load_s']:.2f} |")
    w("")
    if res.get("gpu_tests"):
        w("GPU tests in that run:")
        w("")
        render_tests(w, res["gpu_tests"], max_details=300)


def render_int4(w, res, path):
    b = res["int4"]
    section(w, "W4A16 GEMM", res, path)
    if res["meta"].get("default_plan_note"):
        w(f"Plan: {res['meta']['default_plan_note']}")
        w("")
    copy = [e for e in res["torch_int4"] if e.get("impl") == "d2d_copy"][0]
    w(f"`kernels/int4_gemm_*.cu`, group 128, symmetric, bf16 scales; Llama-3.1 projection shapes (gate/up as one")
    w(f"interleaved GEMM). µs per call (CUDA events, median of 5 batches), weights rotated through >= 160 MB of")
    w(f"copies so the L2 never serves them. `% copy`: effective bytes (packed weights + scales + activations +")
    w(f"output) per second over the same run's device-to-device copy rate ({b['copy_gbps']:.0f} GB/s from Stoke,")
    w(f"{copy['gbps']:.0f} GB/s from PyTorch {copy['torch']}). Peers from `scripts/peers/int4_torch.py` in the same run:")
    w("`torch._weight_int4pack_mm` (group 128, bf16) and bf16 `torch.matmul` (cuBLAS).")
    if any(e.get("timing") == "graph" for e in res["torch_int4"]):
        if any("stream_us" in r for r in b["runs"]):
            w("Stoke's calls and the peers' are both replayed from a CUDA graph of back-to-back calls (GPU time per call, no")
            w("dispatch on the host; the files also hold each one launched eagerly: `stream_us`, `eager_us`).")
        else:
            w("The peers' calls are replayed from a CUDA graph (GPU time, no dispatch on the host); Stoke's are launched back")
            w("to back from the host (about 4 µs to queue one, below the kernel time).")
    if any(r.get("variant") == "Tuned" for r in b["runs"]):
        w("The main table is the shipped call: the plan's kernels tuned per shape and row count on the first call")
        w("(`Int4Gemm::tune`: the plan, the warpgroup kernels from one row, and the plan without them, each at its")
        w("planned split count and one fewer and more, timed as here; the rows hold the tuner's own times as")
        w("`tuned_candidates`); `kernel` is the entry point it ran, `splits` its split count.")
    same = any("same_size_copy_us" in r for r in b["runs"])
    if same:
        w("`same-size copy`: µs of one device-to-device copy moving the weight bytes (half read, half written), timed")
        w("the same way; `% of it`: that time over Stoke's, the speed of a copy of this size reached.")
    read = any("same_size_read_us" in r for r in b["runs"])
    if read:
        w(f"`same-size read`: µs of the fastest single launch reading the weight bytes once ({READ_PROBE}):")
        w("the memory side of the roofline at one row, where the kernels read and write almost nothing; `% of it`: that time")
        w("over Stoke's.")
        if b.get("read_gbps"):
            w(f"One launch reading 1 GiB that way: {b['read_gbps']:.0f} GB/s, {100 * b['read_gbps'] / b['copy_gbps']:.1f}% of the copy rate.")
            g = b.get("read_1gib")
            if g:
                w(f"The best of each form over 1 GiB: loads {g['load_us']:.1f} µs, copy engine {g['bulk_us']:.1f} µs.")
    mma = b.get("mma_rate")
    if mma:
        w(f"`mma floor`: the kernel's mma.m16n8k16 count (warpgroup rows: their wgmma multiply-adds in m16n8k16 units) at the same run's mma.sync rate, the compute side of its")
        w(f"roofline: {mma['mma_rate_c8']['tflops']:.0f} TFLOP/s (bf16 in, f32 accumulation; `kernels/bench/mma_rate.cu`, 8 independent")
        w(f"accumulators per warp, 16 warps per SM), {mma['mma_rate_c1']['ns_per_round']:.1f} ns per mma along one dependent chain.")
    w("")
    extra = (" same-size copy µs | % of it |" if same else "") + (" same-size read µs | % of it |" if read else "") + (" mma floor µs |" if mma else "")
    # The kernel each row ran (rows from runs that record it), short: `swap`, `wg_n8`, ...
    kern = any("entry" in r for r in b["runs"])
    def kernel(r):
        return r.get("entry", "-").replace("int4_gemm_", "").replace("_plain", "").replace("_bf16s", "")
    w("| shape (k x n) | m | Stoke µs | Stoke % copy | torch int4 µs | torch int4 % copy | Stoke speedup vs torch int4 | bf16 matmul µs | splits |" + (" kernel |" if kern else "") + extra)
    w("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" --- |" if kern else "") + (" ---: | ---: |" if same else "") + (" ---: | ---: |" if read else "") + (" ---: |" if mma else ""))
    peers = {(e["impl"], e["shape"], e["m"]): e for e in res["torch_int4"] if "us" in e}
    # The default kernel and word order in the main table (the swapped-operand kernel at m <= 8
    # where the run has it, else the batched one); the others below it.
    def is_default(r):
        if r.get("order", "KtMajor") != "KtMajor" or r.get("defines"):
            return False
        if any("default_plan" in o for o in b["runs"]):
            # Rows that say whether they are the shipped plan's launch (a kind may be it at
            # some shapes only, e.g. Swap16 above 16 rows).
            return r.get("default_plan", False)
        swapped = any(o.get("variant") == "SwapAB" and o["shape"] == r["shape"] and o["m"] == r["m"] for o in b["runs"])
        return r.get("variant", "Batched") == ("SwapAB" if swapped else "Batched")
    default = [r for r in b["runs"] if is_default(r)]
    for r in default:
        ti = peers.get(("torch_weight_int4pack_mm", r["shape"], r["m"]))
        tb = peers.get(("torch_bf16_matmul", r["shape"], r["m"]))
        ti_us = f"{ti['us']:.1f}" if ti else "-"
        ti_pc = f"{100 * ti['of_copy']:.1f}%" if ti else "-"
        sp = f"{ti['us'] / r['us']:.2f}x" if ti else "-"
        tb_us = f"{tb['us']:.1f}" if tb else "-"
        sc = ""
        if same:
            sc = f" {r['same_size_copy_us']:.1f} | {100 * r['of_same_size_copy']:.0f}% |" if "same_size_copy_us" in r else " - | - |"
        if read:
            sc += f" {r['same_size_read_us']:.1f} | {100 * r['of_same_size_read']:.0f}% |" if "same_size_read_us" in r else " - | - |"
        if mma:
            sc += f" {r['mma_floor_us']:.1f} |" if "mma_floor_us" in r else " - |"
        w(f"| {r['shape']} ({r['k']} x {r['n']}) | {r['m']} | {r['us']:.1f} | {100 * r['of_copy']:.1f}% | {ti_us} | {ti_pc} | {sp} | {tb_us} | {r['splits']} |" + (f" {kernel(r)} |" if kern else "") + sc)
    w("")
    others = [r for r in b["runs"] if r not in default and not r.get("defines")]
    if others:
        if any("default_plan" in o for o in b["runs"]):
            w("Each kernel variant and device word order in the same run (µs; the main table shows the shipped plan's launch: `SwapAB` at m <= 8, `Wgmma` (the warpgroup kernels) beyond where the run has them, else `Batched`, or `Swap16` where the plan takes it):")
            gone = [f"`{v}`" for v in sorted({r["variant"] for r in others if r.get("variant") in REMOVED_INT4})]
            if any(r.get("entry", "").endswith("_m8") for r in others):
                gone.append("the batched m8 kernel (`Batched` at m <= 8)")
            if gone:
                w("")
                w(f"(Kernels since removed: {', '.join(gone)}; see [PERFORMANCE.md](PERFORMANCE.md).)")
        else:
            w("Each kernel variant and device word order in the same run (µs; the default above is `SwapAB` at m <= 8, `Batched` beyond):")
        w("")
        keys = sorted({(r.get("variant", "Batched"), r["order"]) for r in b["runs"] if not r.get("defines")})
        w("| shape | m | " + " | ".join(f"{v} / {o}" for v, o in keys) + " |")
        w("| --- | ---: |" + " ---: |" * len(keys))
        by = {(r["shape"], r["m"], r.get("variant", "Batched"), r["order"]): r for r in b["runs"] if not r.get("defines")}
        for r in default:
            if r["m"] not in (1, 8, 16, 32):
                continue
            cells = [by.get((r["shape"], r["m"], v, o)) for v, o in keys]
            w(f"| {r['shape']} | {r['m']} | " + " | ".join(f"{c['us']:.1f}" if c else "-" for c in cells) + " |")
        w("")
    forms = [(f"{e['shape']} weights", e["bytes"], e["load_us"], e["bulk_us"]) for e in b.get("same_size_read", []) if "bulk_us" in e]
    if forms and b.get("read_1gib"):
        forms.append(("1 GiB", 1 << 30, b["read_1gib"]["load_us"], b["read_1gib"]["bulk_us"]))
    render_read_forms(w, forms)
    render_variants(w, b["runs"], lambda r: (r["shape"], r["m"], r.get("variant", "Batched"), r.get("order", "KtMajor")), "W4A16")
    if b.get("split_sweep"):
        # The shipped kernels' sweep: the default kind at each swept row count (the batched
        # kernel at m = 1 in older runs, which swept only that), default word order.
        swept = [e for e in b["split_sweep"] if not e.get("defines") and e.get("order", "KtMajor") == "KtMajor"]
        kinds = {e.get("variant", "Batched") for e in swept}
        def default_kind(e):
            kind = e.get("variant", "Batched")
            if "SwapAB" not in kinds:
                return kind == "Batched"
            return kind == ("SwapAB" if e["m"] <= 8 else "Batched")
        sweep = [e for e in swept if default_kind(e)]
        rows = sorted({e["m"] for e in sweep})
        w(f"Split-count sweep at m = {', '.join(map(str, rows))} (CTAs per 64-column slab along k; µs, best in bold, `c`: launched as")
        w("clusters of the splits; `splits` in the main table is the plan's choice):")
        w("")
        for shape, m_ in dict.fromkeys((e["shape"], e["m"]) for e in sweep):
            pts = [e for e in sweep if e["shape"] == shape and e["m"] == m_]
            best = min(pts, key=lambda e: e["us"])
            def cell(e):
                t = f"{e['splits']}{'c' if e.get('cluster') else ''}: {e['us']:.1f}"
                return f"**{t}**" if e is best else t
            w(f"- {shape}, m = {m_} ({pts[0].get('variant', 'Batched')}): " + ", ".join(cell(e) for e in pts))
        w("")
    w("Kernel resources (ptxas): " + ", ".join(sorted({f"{k['entry']} {k['registers']} regs / {k['shared_bytes']} B smem / {k['spills']} B spills" for k in b["kernels"] if k["entry"].startswith(("int4_gemm_plain_bf16s", "int4_gemm_swap_plain_bf16s"))})))
    w("")
    w("GPU tests in that run:")
    w("")
    render_tests(w, res["gpu_tests"], max_details=300)


def render_pairs(w, res, path):
    b = res["pairs"]
    section(w, "RMSNorm then W4A16 GEMM", res, path)
    w("A decode step's fused residual RMSNorm (m rows of k, bf16) followed by the W4A16 GEMM it feeds (the shipped,")
    w("tuned call; group 128, symmetric, bf16 scales), as a CUDA graph of back-to-back pairs (weights rotated through")
    w(">= 160 MB of copies, inputs through 4 sets), beside the norms alone and the GEMMs alone timed the same way.")
    w("The RMSNorm kernels let the next kernel launch at once (`griddepcontrol.launch_dependents`), so the GEMM's first")
    w("weight loads, queued before its `griddepcontrol.wait`, overlap the norm; `STOKE_RMS_PDL_TRIGGER=0` rows are the")
    w("kernels without it, same run. `overlap`: norm + GEMM - pair. `% copy`: the pair's bytes over its time, against the")
    w(f"same run's copy rate ({b['copy_gbps']:.0f} GB/s). `in order`: the runtime launched the pairs' GEMMs in stream order")
    w("instead (a clustered GEMM whose clusters, one more per CTA of the norm, would not all be resident at once;")
    w("`Runtime::launch_cluster`).")
    w("")
    order = any("gemm_launches_in_stream_order" in r for r in b["runs"])
    w("| shape (k x n) | m | defines | pair µs | norm µs | GEMM µs | norm + GEMM µs | overlap µs | pair % copy |" + (" in order |" if order else ""))
    w("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |" + (" --- |" if order else ""))
    for r in b["runs"]:
        held = (" yes |" if r.get("gemm_launches_in_stream_order") else " no |") if order else ""
        w(f"| {r['shape']} ({r['k']} x {r['n']}) | {r['m']} | {r.get('defines') or 'shipped'} | {r['pair_us']:.2f} | {r['norm_us']:.2f} | {r['gemm_us']:.2f} | {r['norm_us'] + r['gemm_us']:.2f} | {r['overlap_us']:.2f} | {100 * r['of_copy']:.1f}% |" + held)
    w("")
    if res.get("gpu_tests"):
        w("GPU tests in that run:")
        w("")
        render_tests(w, res["gpu_tests"], max_details=300)


def render_kv(w, res, path):
    m = res["meta"]
    section(w, "KV-cache rotation", res, path)
    w(f"`{m['command']}`: {m['what']}. Peer figure: {m['peer']}.")
    w("")
    w("| shape | outlier channels x factor | block | INT4 unrotated | INT4 rotated | FP8 unrotated | FP8 rotated |")
    w("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in res["runs"]:
        w(f"| {r['shape']} ({r['heads']}/{r['kv_heads']} heads, d {r['head_dim']}) | {r['outlier_channels']} x {r['outlier_factor']:g} | {r['block']} | {100 * r['int4_unrotated']:.1f}% | {100 * r['int4_rotated']:.1f}% | {100 * r['fp8_unrotated']:.2f}% | {100 * r['fp8_rotated']:.2f}% |")
    w("")


def render_prefill(w, res, path):
    """A prefill run (`gpu-run.sh OUT test fp8_gemm_matches_reference ...` and `... prefill`,
    merged by hand into one file): the prefill GEMMs on both tile widths beside cuBLAS (where
    the run has them), the 8B-shaped prefill, the 70B / 405B layers and the SmolLM2 FP8 quality
    test."""
    m = res["meta"]
    w(f"## Prefill ([`{path}`](../{path}), commit `{m['commit']}`, {m['date_utc']}, {m['gpu']})")
    w("")
    for c in m.get("caveats", []):
        w(f"- {c}")
    w("")
    w("### GPU tests")
    w("")
    render_tests(w, [t for t in res["gpu_tests"]], max_details=200)
    peer = {(r["shape"], r["m"]): r for r in res.get("cublas_peer", {}).get("runs", [])}
    for test, title in (("fp8_gemm_matches_reference", "FP8 GEMM"), ("bf16_tc_gemm_matches_reference", "bf16 GEMM")):
        bench = next((t["details"].get("bench") for t in res["gpu_tests"] if t["name"] == test and t.get("details")), None)
        if not bench:
            continue
        runs = {(r["shape"], r["m"], r["epilogue"]): r for r in bench["runs"]}
        w(f"### {title}, each epilogue on 128 x 128 and 128 x 256 tiles (TFLOP/s; * the width `wide_tiles` picks)")
        w("")
        w(f"| shape | M | epilogue | 128 x 128 | 128 x 256 | picked / cuBLAS {'FP8' if title.startswith('FP8') else 'bf16'} | cuBLAS FP8 rowwise | bf16 cuBLAS |")
        w("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for (shape, mm, epi), r in runs.items():
            if epi.endswith(" n256"):
                continue
            wide = runs.get((shape, mm, epi + " n256"))
            pick = r if r.get("picked_by_rule") else wide
            cell = lambda x: "-" if x is None else f"{x['tflops']:.0f}{'*' if x.get('picked_by_rule') else ''}"
            pr = peer.get((shape, mm))
            same = "scaled_mm_rowwise_tflops" if title.startswith("FP8") else "bf16_tflops"
            ratio = f"{pick['tflops'] / pr[same]:.2f}x" if pr and pick else "-"
            fp8p = f"{pr['scaled_mm_rowwise_tflops']:.0f}" if pr else "-"
            bfp = f"{pr['bf16_tflops']:.0f}" if pr else "-"
            w(f"| {shape} | {mm} | {epi} | {cell(r)} | {cell(wide)} | {ratio} | {fp8p} | {bfp} |")
        w("")
    pre = res["prefill"]
    w(f"### {pre.get('model', 'prefill')}")
    w("")
    w("| prompt | bf16 ms | bf16 tokens/s | FP8 ms | FP8 tokens/s | FP8 effective TFLOP/s |")
    w("| --- | ---: | ---: | ---: | ---: | ---: |")
    for b, f in zip(pre["bf16"], pre["fp8"]):
        w(f"| {f['prompts']} | {b['ms']:.2f} | {b['tokens_per_s']:.0f} | {f['ms']:.2f} | {f['tokens_per_s']:.0f} | {f['effective_tflops']:.0f} |")
    w("")
    w("FP8 launches per prompt (µs summed over the prefill's launches of each kernel, and per layer for those launched once or more per layer):")
    w("")
    w("| prompt | kernel | launches | µs | µs per layer |")
    w("| --- | --- | ---: | ---: | ---: |")
    for f in pre["fp8"]:
        for k in sorted(f["kernels"], key=lambda k: -k["us"]):
            per = f"{k['us'] / 32:.1f}" if k["launches"] >= 32 else "-"
            w(f"| {f['prompts']} | {k['entry']} | {k['launches']} | {k['us']:.1f} | {per} |")
    w("")
    for key in ("layer_70b", "layer_405b"):
        lay = pre.get(key)
        if not lay:
            continue
        w(f"### One layer at {lay['shape']} shapes (models of {lay['layers_timed'][1]} minus {lay['layers_timed'][0]} layers)")
        w("")
        w("Where attention did not run on Stoke, the TFLOP/s over Stoke's launches count the projections only.")
        w("")
        w("| mode | prompt | wall µs | TFLOP/s | Stoke launches µs | TFLOP/s over them | attention on Stoke |")
        w("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
        hid, inter, heads, kvh, d = (lay[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim"))
        per_token = hid * (heads + 2 * kvh) * d + heads * d * hid + 3 * hid * inter
        for mode in ("bf16", "fp8"):
            for r in lay[mode]:
                if r.get("error"):
                    w(f"| {mode} | {r['prompt']} | error: {r['error']} | | | | |")
                    continue
                on = r.get("attention_on_stoke")
                if on is None:
                    on = any(k["entry"].startswith("prefill_attn") for k in r["models"][1]["kernels"])
                kt = r["kernel_tflops"] if on or "attention_on_stoke" in r else 2 * r["prompt"] * per_token / (r["layer_kernel_us"] * 1e6)
                w(f"| {mode} | {r['prompt']} | {r['layer_us']:.0f} | {r['tflops']:.0f} | {r['layer_kernel_us']:.0f} | {kt:.0f} | {'yes' if on else 'no (reference path)'} |")
        w("")
    q = res.get("smollm2_fp8_prefill_test")
    if q:
        w("### SmolLM2 FP8 prefill quality (perplexity of the next token, judged by the f32 model)")
        w("")
        w("| model | FP8 | bf16 | FP8 over bf16 | top-1 agreement with f32, FP8 / bf16 |")
        w("| --- | ---: | ---: | ---: | --- |")
        rows = [("packed INT4", q), ("dense bf16", q["dense"])]
        if "served_prefill" in q:
            rows.append(("packed INT4, the prefill that serves", q["served_prefill"]))
        for name, r in rows:
            a = r["top1_agreement_with_f32"]
            w(f"| {name} | {r['perplexity']['fp8']:.2f} | {r['perplexity']['bf16']:.2f} | {100 * r['fp8_over_bf16']:+.1f}% | {a['fp8']:.3f} / {a['bf16']:.3f} |")
        w("")


def render(res, results_path, extras=()):
    m, b = res["meta"], res["bench"]
    out = []
    w = out.append
    w("# Results")
    w("")
    w(f"Generated by `scripts/results.py` from [`{results_path}`](../{results_path}). Every number in the docs comes from this file.")
    w("Each kernel's design, the measurements behind it and the variants rejected: [PERFORMANCE.md](PERFORMANCE.md).")
    w("")
    w(f"- GPU: {m['gpu']} ({b['sm_count']} SMs, kernels built for {b['arch']}); `nvidia-smi`: {m.get('nvidia_smi', '')}")
    w(f"- Commit `{m['commit']}`, run {m['date_utc']}")
    w(f"- Same-run device-to-device copy rate (1 GiB, bytes read + written): **{b['copy_gbps']:.0f} GB/s**")
    w("")
    w("## Summary")
    w("")
    big = [r for r in b["rms_norm"] if r["rows"] == 16384]
    w("RMSNorm at 16384 rows (effective bandwidth as a share of the big-copy rate, and of a copy of the same bytes):")
    w("")
    for r in big:
        dt = "bf16" if r["dtype"] == "BF16" else "f32"
        ratio = r["same_size_copy_us"] / r["kernel_us"]
        flag = " (that copy, a graph memcpy node, ran under the big-copy rate: an anomaly of the copy, not a ceiling)" if ratio > 1.05 else ""
        w(f"- {dt}, hidden {r['hidden']}: {100 * r['fraction_of_copy']:.1f}% of the copy rate, {100 * ratio:.0f}% of a same-size copy's speed{flag}")
    h = b["host_and_crossing"]
    w(f"- Host time per Stoke op through the Burn API: {h['host_us_per_stoke_launch']:.1f} µs; crossing into Stoke {h['cross_in_us']:.0f} µs, out of Stoke {h['cross_out_us']:.0f} µs")
    c = {(x["rows"], x["hidden"]): x for x in b["chain100"]}
    one = c.get((1, 4096))
    if one:
        w(f"- 100 chained RMSNorms at [1, 4096] bf16: {one['stoke_us']:.0f} µs through Stoke vs {one['burn_cuda_us']:.0f} µs as a burn-cuda composition")
    w("")
    w("## GPU tests")
    w("")
    render_tests(w, res["gpu_tests"])
    w("## RMSNorm kernel")
    w("")
    w("Stoke: kernel time per call from a CUDA graph of back-to-back launches (inputs rotated so they come from HBM),")
    w("effective bandwidth over x read + gamma read + out written, against the same-run copy rate; `stream` is the same")
    w("launches issued one by one (bound by host launch rate for small shapes). burn-cuda: the same op as a composition")
    w("of burn-cuda ops (wall-clock). PyTorch (same GPU, same run): `F.rms_norm` and the best `torch.compile`d form,")
    w("both replayed from CUDA graphs.")
    w("")
    w("`copy µs` is a device-to-device copy of the same bytes (x to out), timed the same way: the floor for that size.")
    w("")
    w("| dtype | rows | hidden | Stoke µs | GB/s | % of copy | copy µs | stream µs | burn-cuda µs | torch F.rms_norm µs | torch.compile µs | vs compile |")
    w("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in b["rms_norm"]:
        dt = "bf16" if r["dtype"] == "BF16" else "f32"
        eager = torch_best(res["torch_rms_norm"], r["rows"], r["hidden"], dt, {"torch_rms_norm@graph"})
        comp = torch_best(res["torch_rms_norm"], r["rows"], r["hidden"], dt, {"compiled_rms_norm@graph", "compiled_composition@graph"})
        e = f"{eager['us']:.2f}" if eager else "-"
        c = f"{comp['us']:.2f}" if comp else "-"
        ratio = f"{comp['us'] / r['kernel_us']:.2f}x" if comp else "-"
        w(f"| {dt} | {r['rows']} | {r['hidden']} | {r['kernel_us']:.2f} | {r['effective_gbps']:.0f} | {100 * r['fraction_of_copy']:.1f}% | {r['same_size_copy_us']:.2f} | {r['stream_us']:.2f} | {r['burn_cuda_composition_us']:.1f} | {e} | {c} | {ratio} |")
    w("")
    h = b["host_and_crossing"]
    w("## Host cost and stream crossings")
    w("")
    w(f"Shape [{h['shape'][0]}, {h['shape'][1]}] {h['dtype']}; wall-clock medians, µs.")
    w("")
    w("| what | µs |")
    w("| --- | ---: |")
    rows = [
        ("host time per Stoke `rms_norm` call through the Burn API (no synchronization)", "host_us_per_stoke_launch"),
        ("host time per raw kernel launch (`cuLaunchKernel`)", "host_us_per_raw_launch"),
        ("pooled Stoke buffer allocation + release", "host_us_per_pooled_alloc_release"),
        ("`get_resource` on a burn-cuda tensor", "get_resource_us"),
        ("burn-cuda `sync` of an idle stream", "burn_cuda_sync_idle_us"),
        ("Stoke stream synchronize, idle", "stoke_sync_idle_us"),
        ("crossing in: Stoke op on an unpinned burn-cuda tensor", "cross_in_us"),
        ("crossing out: burn-cuda op on a Stoke output", "cross_out_us"),
        ("round trip: Stoke op, then burn-cuda op on its output", "round_trip_us"),
    ]
    for label, key in rows:
        w(f"| {label} | {h[key]:.2f} |")
    w("")
    w("## A chain of 100 RMSNorms")
    w("")
    w("`x <- rms_norm(x, gamma)` 100 times, bf16, wall-clock from the first call to the final synchronization (median).")
    w("Stoke keeps every intermediate on its stream; burn-cuda runs the composition.")
    w("")
    w("| shape | Stoke µs | burn-cuda µs | speedup |")
    w("| --- | ---: | ---: | ---: |")
    for c in b["chain100"]:
        w(f"| [{c['rows']}, {c['hidden']}] | {c['stoke_us']:.0f} | {c['burn_cuda_us']:.0f} | {c['speedup']:.1f}x |")
    w("")
    if res.get("llama"):
        render_llama(w, res, results_path)
    for path in extras:
        extra = json.loads(Path(path).read_text())
        if "quality" in extra:
            render_quality(w, extra, path)
        elif "prefill" in extra:
            render_prefill(w, extra, path)
        elif "int4" in extra:
            render_int4(w, extra, path)
        elif "attention" in extra:
            render_attention(w, extra, path)
        elif "pairs" in extra:
            render_pairs(w, extra, path)
        elif "int4_unrotated" in json.dumps(extra.get("runs", [])[:1]):
            render_kv(w, extra, path)
        else:
            render_llama(w, extra, path)
    w("## Kernel resources (ptxas, as loaded in this run)")
    w("")
    w("| file | entry | registers | shared bytes | stack | spills (st/ld) |")
    w("| --- | --- | ---: | ---: | ---: | ---: |")
    for k in sorted(b["kernels"], key=lambda k: k["entry"]):
        w(f"| {k['file']} | {k['entry']} | {k['registers']} | {k['shared_bytes']} | {k['stack_bytes']} | {k['spill_store_bytes']}/{k['spill_load_bytes']} |")
    w("")
    return "\n".join(out)


def main():
    if sys.argv[1] in ("--int4", "--attention", "--pairs"):
        run, dest = sys.argv[2], sys.argv[3]
        if sys.argv[1] == "--int4":
            merged = merge_kernel_run(run, "int4", "torch-int4.json", "torch_int4")
        elif sys.argv[1] == "--attention":
            merged = merge_kernel_run(run, "attention", "torch-attention.json", "torch_attention")
        else:
            merged = merge_kernel_run(run, "pairs", None, None)
        Path(dest).write_text(json.dumps(merged, indent=1) + "\n")
        print(f"wrote {dest}")
        return
    run, dest, extras = sys.argv[1], sys.argv[2], sys.argv[3:]
    if run == "--render":
        res = json.loads(Path(dest).read_text())
    else:
        res = merge(run)
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        Path(dest).write_text(json.dumps(res, indent=1) + "\n")
    Path("docs/RESULTS.md").write_text(render(res, dest, extras))
    print(f"wrote {'' if run == '--render' else dest + ' and '}docs/RESULTS.md")


if __name__ == "__main__":
    main()
