#!/usr/bin/env python3
"""Merges one GPU run's JSON files into a committed results file and renders docs/RESULTS.md.

Usage: scripts/results.py RUN_DIR results/NAME.json [results/EXTRA.json ...]
       (an extra with `prefill` and `cublas_peer`: a prefill run's merged file, see render_prefill;
       hand-merged runs of two or more bundles in one file, each with its own layout: see
       render_coalesced, render_swiglu_stores, render_prefill_attn_wgmma, render_fp8_int4)
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


def render_prefill_model(w, pre, note=None):
    """The model-shaped prefill of a prefill run (`pre`: `model`, and `bf16` / `fp8` lists of
    prompts with their launches): time, rate and the FP8 launches per kernel."""
    w(f"### {pre.get('model', 'prefill')}")
    w("")
    if note:
        w(note)
        w("")
    w("| prompt | bf16 ms | bf16 tokens/s | FP8 ms | FP8 tokens/s | FP8 effective TFLOP/s |")
    w("| --- | ---: | ---: | ---: | ---: | ---: |")
    for b, f in zip(pre["bf16"], pre["fp8"]):
        w(f"| {f['prompts']} | {b['ms']:.2f} | {b['tokens_per_s']:.0f} | {f['ms']:.2f} | {f['tokens_per_s']:.0f} | {f['effective_tflops']:.0f} |")
    w("")
    w("FP8 launches per prompt (µs summed over the prefill's launches of each kernel, and per layer for those launched once or more per layer):")
    w("")
    render_launches(w, pre["fp8"])


def render_launches(w, runs):
    """One prefill mode's launches per prompt: µs summed over each kernel's launches, and per
    layer (32 layers) for those launched once or more per layer."""
    w("| prompt | kernel | launches | µs | µs per layer |")
    w("| --- | --- | ---: | ---: | ---: |")
    for f in runs:
        for k in sorted(f["kernels"], key=lambda k: -k["us"]):
            per = f"{k['us'] / 32:.1f}" if k["launches"] >= 32 else "-"
            w(f"| {f['prompts']} | {k['entry']} | {k['launches']} | {k['us']:.1f} | {per} |")
    w("")


def render_layer(w, lay, note=None):
    """One layer at a larger model's shapes: the time of a model of 2 layers minus that of 1, per
    mode (the modes the file has)."""
    w(f"### One layer at {lay['shape']} shapes (models of {lay['layers_timed'][1]} minus {lay['layers_timed'][0]} layers)")
    w("")
    if note:
        w(note)
        w("")
    w("Where attention did not run on Stoke, the TFLOP/s over Stoke's launches count the projections only.")
    w("")
    w("| mode | prompt | wall µs | TFLOP/s | Stoke launches µs | TFLOP/s over them | attention on Stoke |")
    w("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    hid, inter, heads, kvh, d = (lay[k] for k in ("hidden", "intermediate", "heads", "kv_heads", "head_dim"))
    per_token = hid * (heads + 2 * kvh) * d + heads * d * hid + 3 * hid * inter
    for mode in ("bf16", "fp8"):
        for r in lay.get(mode, []):
            if r.get("error"):
                w(f"| {mode} | {r['prompt']} | error: {r['error']} | | | | |")
                continue
            on = r.get("attention_on_stoke")
            if on is None:
                on = any(k["entry"].startswith("prefill_attn") for k in r["models"][1]["kernels"])
            kt = r["kernel_tflops"] if on or "attention_on_stoke" in r else 2 * r["prompt"] * per_token / (r["layer_kernel_us"] * 1e6)
            w(f"| {mode} | {r['prompt']} | {r['layer_us']:.0f} | {r['tflops']:.0f} | {r['layer_kernel_us']:.0f} | {kt:.0f} | {'yes' if on else 'no (reference path)'} |")
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
    render_prefill_model(w, pre)
    for key in ("layer_70b", "layer_405b"):
        if pre.get(key):
            render_layer(w, pre[key])
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


# Hand-merged GPU runs since the prefill runs above: each holds two or more bundles (commits)
# run side by side, so their numbers compare within the file. Their layouts differ;
# the renderers below take each as it is and write only what the file holds.

ACROSS_FILES = ("Rates across results files (other calls, often another card) are not comparable: compare the bundles"
                " within this file.")


def run_section(w, title, res, path):
    """A section heading naming the results file, its commit(s), date and GPU, then the file's
    own account of the run (`what`, the commands in `runs`, `tests`) and the note on comparing."""
    m = res["meta"]
    w(f"## {title} ([`{path}`](../{path}), {m['date_utc']}, {m['gpu']})")
    w("")
    w(f"Commit: {m['commit']}.")
    w("")
    if m.get("what"):
        w(m["what"])
        w("")
    if m.get("runs"):
        w("Commands in the call:")
        w("")
        for r in m["runs"]:
            w(f"- {r}")
        w("")
    if m.get("tests"):
        w(f"Tests: {m['tests']}.")
        w("")
    w(ACROSS_FILES)
    w("")


def bench_of(entry):
    """The benchmark runs of a GEMM test as a file holds it: a test entry (`details.bench`) or
    the test's details themselves (`bench`)."""
    d = entry.get("details", entry)
    return (d.get("bench") or {}).get("runs", [])


def render_speedups(w, summary, label):
    """A file's summary of time ratios per epilogue: plain numbers, or {geomean_speedup, min,
    max, points}."""
    w(f"{label}:")
    w("")
    detailed = any(isinstance(v, dict) for v in summary.values())
    if detailed:
        w("| epilogue | geometric mean | min | max | points |")
        w("| --- | ---: | ---: | ---: | ---: |")
        for k, v in summary.items():
            w(f"| {k} | {v['geomean_speedup']:.3f} | {v['min']:.3f} | {v['max']:.3f} | {v['points']} |")
    else:
        w("| epilogue | geometric mean |")
        w("| --- | ---: |")
        for k, v in summary.items():
            w(f"| {k} | {v:.3f} |")
    w("")


def render_gemm_ab(w, new, base, operand, new_label, base_label, peer=None):
    """One operand type's GEMM benchmark in two bundles of one call: per shape, M and epilogue,
    both tile widths, µs in each bundle, their ratio (base µs over new µs: above 1, the new
    bundle is faster) and the new bundle's TFLOP/s; * marks the width `wide_tiles` picks (in the
    new bundle). `peer`: cuBLAS of the same call by (shape, m), where the file has it."""
    new = [r for r in new if r["epilogue"].startswith(operand + " ")]
    old = {(r["shape"], r["m"], r["epilogue"]): r for r in base if r["epilogue"].startswith(operand + " ")}
    if not new:
        return
    by = {(r["shape"], r["m"], r["epilogue"]): r for r in new}
    head = "| shape | M | epilogue |"
    rule = "| --- | ---: | --- |"
    for width in ("128 x 128", "128 x 256"):
        head += f" {width}: {base_label} µs | {new_label} µs | ratio | {new_label} TFLOP/s |"
        rule += " ---: | ---: | ---: | ---: |"
    if peer:
        head += " cuBLAS FP8 rowwise TFLOP/s | bf16 cuBLAS TFLOP/s |"
        rule += " ---: | ---: |"
    w(head)
    w(rule)
    for (shape, mm, epi), r in by.items():
        if epi.endswith(" n256"):
            continue
        cells = []
        for key in ((shape, mm, epi), (shape, mm, epi + " n256")):
            x, b = by.get(key), old.get(key)
            if x is None:
                cells += ["-"] * 4
                continue
            star = "*" if x.get("picked_by_rule") else ""
            cells += [f"{b['us']:.1f}" if b else "-", f"{x['us']:.1f}{star}", f"{b['us'] / x['us']:.3f}" if b else "-", f"{x['tflops']:.0f}"]
        if peer:
            pr = peer.get((shape, mm))
            cells += [f"{pr['scaled_mm_rowwise_tflops']:.0f}", f"{pr['bf16_tflops']:.0f}"] if pr else ["-", "-"]
        w(f"| {shape} | {mm} | {epi[len(operand) + 1:]} | " + " | ".join(cells) + " |")
    w("")


def gemm_ab_intro(w, new_label, base_label):
    w(f"µs per call from the GEMM tests' benchmarks (M x N x K at Llama 8B / 70B projection shapes); `ratio`: {base_label} µs")
    w(f"over {new_label} µs (above 1, {new_label} is faster); * the tile width `wide_tiles` picks. TFLOP/s: 2 M N K per second.")
    w("")


def render_test_entries(w, entries, label):
    """Test entries as the merged files hold them: name, status, seconds and the details'
    worst error over the test's bound (and its l1 tolerance, where recorded)."""
    w(f"{label}:")
    w("")
    w("| test | status | seconds | worst error / bound | cases |")
    w("| --- | --- | ---: | ---: | ---: |")
    for t in entries:
        d = t.get("details") or t
        worst = d.get("worst_error_over_bound")
        w(f"| {t['name']} | {t.get('status', '-')} | {t['seconds']:.1f} | " + (f"{worst:.3f}" if worst is not None else "-") + f" | {len(d.get('cases', []))} |")
    w("")


def render_coalesced(w, res, path):
    """results/h100-fp8-coalesced-b55fdd3.json: the GEMM tests and benchmarks of two bundles
    (lists of test entries under one key per bundle)."""
    run_section(w, "FP8 and bf16 GEMM epilogues: 16-byte stores", res, path)
    bundles = [k for k in res if k not in ("meta", "summary")]
    new_key, base_key = bundles[0], bundles[1]
    new_label, base_label = new_key.split("_")[-1], base_key.split("_")[-1]
    for key in bundles:
        render_test_entries(w, res[key], f"GPU tests, bundle {key.split('_')[-1]}")
    s = res["summary"]
    for operand in ("fp8", "bf16"):
        if operand in s:
            render_speedups(w, s[operand], f"The file's summary, {operand} operands ({base_label} µs over {new_label} µs)")
    if s.get("note"):
        w(f"Summary note: {s['note']}")
        w("")
    runs = lambda key, name: next((bench_of(t) for t in res[key] if t["name"] == name), [])
    for name, operand, title in (("fp8_gemm_matches_reference", "fp8", "FP8"), ("bf16_tc_gemm_matches_reference", "bf16", "bf16")):
        w(f"### {title} GEMM, {base_label} and {new_label}")
        w("")
        gemm_ab_intro(w, new_label, base_label)
        render_gemm_ab(w, runs(new_key, name), runs(base_key, name), operand, new_label, base_label)


def render_swiglu_stores(w, res, path):
    """results/h100-fp8-swiglu-stores-c99dce3.json: main (e91cd66) and two branches in one call;
    the GEMM tests' details per bundle (a dict of test name to details), the q|k|v epilogue's
    timed cases per bundle in the summary."""
    run_section(w, "FP8 and bf16 GEMM epilogues: SwiGLU stores; the wide q|k|v epilogue row by row", res, path)
    s = res["summary"]
    bundles = [k for k in res if k not in ("meta", "summary")]
    base_key, new_key = bundles[0], bundles[1]
    key = next(k for k in s if k.startswith("swiglu_stores_speedup"))
    render_speedups(w, s[key], f"The file's summary, `{key}` ({base_key} µs over {new_key} µs)")
    if s.get("verdict"):
        w(f"Verdict recorded in the file: {s['verdict']}")
        w("")
    for name, operand, title in (("fp8_gemm_matches_reference", "fp8", "FP8"), ("bf16_tc_gemm_matches_reference", "bf16", "bf16")):
        w(f"### {title} GEMM, {base_key} and {new_key}")
        w("")
        gemm_ab_intro(w, new_key, base_key)
        render_gemm_ab(w, bench_of(res[new_key].get(name, {})), bench_of(res[base_key].get(name, {})), operand, new_key, base_key)
        worst = {b: res[b][name]["worst_error_over_bound"] for b in (base_key, new_key) if name in res[b]}
        w(f"`{name}`, worst error over the bound: " + ", ".join(f"{b} {v:.3f}" for b, v in worst.items()))
        w("")
    qkv = s.get("qkv_timed_cases")
    if qkv:
        w("### q|k|v epilogue (`qkv_epilogue_matches_rope_append`'s timed cases)")
        w("")
        w("µs of the plain GEMM, the plain GEMM then the separate rope-and-append, and the q|k|v epilogue on each tile width;")
        w("`bytes equal`: the epilogue's output equals the separate path's byte for byte.")
        w("")
        w("| bundle | case | plain GEMM µs | plain then rope_append µs | q\\|k\\|v epilogue 128 x 128 µs | q\\|k\\|v epilogue wide µs | bytes equal | worst error / bound |")
        w("| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |")
        for bundle, cases in qkv.items():
            for c in cases:
                ep = {e["wide_tiles"]: e["us"] for e in c["us"]["qkv_epilogue"]}
                cell = lambda v: "-" if v is None else f"{v:.1f}"
                case = c["case"].split(": ", 1)[-1]
                w(f"| {bundle} | {case} | {c['us']['plain_gemm']:.1f} | {c['us']['plain_then_rope_append']:.1f} | {cell(ep.get(False))} | {cell(ep.get(True))} | {'yes' if c['bytes_equal_rope_append'] else 'no'} | {c['worst_error_over_bound']:.3f} |")
        w("")


def render_prefill_attn_wgmma(w, res, path):
    """results/h100-prefill-attn-wgmma-d25aa29.json: prefill attention in two bundles beside the
    SDPA peers, the FP8 GEMM in two bundles beside cuBLAS, the delayed-scale SwiGLU test and the
    8B-shaped prefill (one call)."""
    run_section(w, "Prefill attention on wgmma; SwiGLU epilogues on the MUFU units", res, path)
    att = sorted(k for k in res if k.startswith("prefill_attention_"))
    new_key = next(k for k in att if res["meta"]["commit"].startswith(k.split("_")[-1][:7]))
    base_key = next(k for k in att if k != new_key)
    new_label, base_label = new_key.split("_")[-1], base_key.split("_")[-1]
    new = {(r["shape"], tuple(r["lens"])): r for r in res[new_key]["runs"]}
    base = {(r["shape"], tuple(r["lens"])): r for r in res[base_key]["runs"]}
    sdpa = res.get("sdpa_peers", {})
    peers = {}
    for p in sdpa.get("runs", []):
        peers[(p["shape"], tuple(p["lens"]), p.get("backend") or p.get("impl"))] = p
    w(f"### Prefill attention, {base_label} and {new_label}, beside PyTorch SDPA")
    w("")
    w("Causal prefill attention over a bf16 cache, one prompt per row below; µs per call from a CUDA graph of back-to-back")
    w("calls (Stoke: `tests/src/attention.rs` `prefill_bench`; SDPA: `scripts/peers/prefill_attention_torch.py`, PyTorch")
    w(f"{sdpa.get('torch', '?')} on {sdpa.get('gpu', '?')}, a CUDA graph of a batch of calls, median of 5). TFLOP/s count 4 x heads x d per")
    w(f"causal (query, key) pair, for Stoke and the peers alike. `vs`: the other's µs over {new_label}'s (above 1, {new_label} is faster).")
    gqa = dict.fromkeys((p["backend"], p["gqa"]) for p in sdpa.get("runs", []) if "backend" in p and "gqa" in p)
    if gqa:
        w("How each SDPA backend takes the kv heads: " + ", ".join(f"{b} `{g}`" for b, g in gqa) + " (`repeated_kv`: K and V repeated per query head).")
    w("")
    w(f"| shape | heads / kv heads, d | tokens | {base_label} µs | {new_label} µs | {new_label} TFLOP/s | {new_label} vs {base_label} | flash µs | flash TFLOP/s | cuDNN µs | cuDNN TFLOP/s | efficient µs | vs flash | vs cuDNN |")
    w("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    cell = lambda p, k, f: f"{p[k]:{f}}" if p and k in p else "-"
    for (shape, lens), r in new.items():
        if len(lens) != 1:
            continue
        b = base.get((shape, lens))
        fl, cu, ef = (peers.get((shape, lens, x)) for x in ("flash", "cudnn", "efficient"))
        w(f"| {shape} | {r['heads']} / {r['kv_heads']}, {r['d']} | {lens[0]} | {cell(b, 'us', '.1f')} | {r['us']:.1f} | {r['tflops']:.0f} | "
          + (f"{b['us'] / r['us']:.2f}x" if b else "-") + f" | {cell(fl, 'us', '.1f')} | {cell(fl, 'tflops', '.0f')} | {cell(cu, 'us', '.1f')} | {cell(cu, 'tflops', '.0f')} | {cell(ef, 'us', '.1f')} | "
          + (f"{fl['us'] / r['us']:.2f}x" if fl else "-") + " | " + (f"{cu['us'] / r['us']:.2f}x" if cu else "-") + " |")
    w("")
    mixes = [(k, r) for k, r in new.items() if len(k[1]) > 1]
    if mixes:
        lens = mixes[0][0][1]
        desc = " + ".join(f"{n} x {l}" if n > 1 else f"{l}" for l, n in _runs_of(lens))
        w(f"The packed mix ({desc} tokens): Stoke packed and the same prompts padded to 8 x 2048; SDPA padded to 8 x 2048 (TFLOP/s")
        w("over the mix's own pairs) and `varlen_attn` (packed):")
        w("")
        w(f"| shape | {base_label} packed µs | {new_label} packed µs | {new_label} TFLOP/s | {new_label} padded 8 x 2048 µs | varlen_attn µs | varlen_attn TFLOP/s | flash padded µs | cuDNN padded µs | efficient padded µs |")
        w("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for (shape, ls), r in mixes:
            b = base.get((shape, ls))
            vl, fl, cu, ef = (peers.get((shape, ls, x)) for x in ("varlen_attn", "flash", "cudnn", "efficient"))
            w(f"| {shape} | {cell(b, 'us', '.1f')} | {r['us']:.1f} | {r['tflops']:.0f} | {r['padded_8x2048_us']:.1f} | {cell(vl, 'us', '.1f')} | {cell(vl, 'tflops', '.0f')} | {cell(fl, 'us', '.1f')} | {cell(cu, 'us', '.1f')} | {cell(ef, 'us', '.1f')} |")
        w("")
    eager = [p for p in sdpa.get("runs", []) if "eager_us" in p and p["lens"] == [2048]]
    if eager:
        w("SDPA issued from Python instead of replayed from a graph (`eager_us`; 2048 tokens shown, the file holds every point):")
        w("")
        backs = list(dict.fromkeys(p.get("backend") or p.get("impl") for p in eager))
        w("| shape | " + " | ".join(f"{b} eager µs" for b in backs) + " |")
        w("| --- |" + " ---: |" * len(backs))
        for shape in dict.fromkeys(p["shape"] for p in eager):
            e = {(p.get("backend") or p.get("impl")): p for p in eager if p["shape"] == shape}
            w(f"| {shape} | " + " | ".join(f"{e[b]['eager_us']:.1f}" if b in e else "-" for b in backs) + " |")
        w("")
    for key in (base_key, new_key):
        w(f"Kernel resources (ptxas), {key.split('_')[-1]}: " + ", ".join(f"{k['entry']} {k['registers']} regs / {k['shared_bytes']} B smem / {k['spills']} B spills" for k in res[key]["kernels"]))
        w("")
    gemm = sorted(k for k in res if k.startswith("fp8_gemm_"))
    g_new = next((k for k in gemm if k.endswith(new_label)), None)
    g_base = next((k for k in gemm if k != g_new), None)
    if g_new and g_base:
        s = res["summary"]
        key = next((k for k in s if k.startswith("fp8_gemm_speedup")), None)
        w(f"### FP8 GEMM, {base_label} and {new_label}, beside cuBLAS")
        w("")
        if key:
            render_speedups(w, s[key], f"The file's summary, `{key}` ({base_label} µs over {new_label} µs)")
        gemm_ab_intro(w, new_label, base_label)
        cp = res.get("cublas_peers", {})
        cm = cp.get("meta", {})
        w(f"cuBLAS in the same call (PyTorch {cm.get('torch', '?')} on {cm.get('device', '?')}): `torch._scaled_mm` with rowwise scales and bf16")
        w("`torch.matmul`, without the epilogues.")
        w("")
        peer = {(r["shape"], r["m"]): r for r in cp.get("runs", [])}
        render_gemm_ab(w, bench_of(res[g_new]), bench_of(res[g_base]), "fp8", new_label, base_label, peer=peer)
        w(f"`fp8_gemm_matches_reference`, worst error over the bound: {base_label} {res[g_base]['worst_error_over_bound']:.3f}, {new_label} {res[g_new]['worst_error_over_bound']:.3f}")
        w("")
    dl = next((k for k in res if k.startswith("fp8_delayed_")), None)
    if dl:
        d = res[dl]
        w(f"### `fp8_delayed_swiglu_matches_reference` ({dl.split('_')[-1]})")
        w("")
        w(f"k {d['k']}, intermediate {d['inter']}, down projection n {d['n_down']}; worst error over the bound {d['worst_error_over_bound']:.3f}. Per call:")
        w("")
        w("| rows | per-row scales | x times | amax | reference amax | saturated | reference saturated | scale | code error / bound | down error / bound |")
        w("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for i in d["invocations"]:
            w(f"| {i['m']} | {'yes' if i['per_row'] else 'no'} | {i['x_times']:g} | {i['amax']:.3f} | {i['reference_amax']:.3f} | {i['saturated']} | {i['reference_saturated']} | {i['scale']:.5f} | {i['worst_code_error_over_bound']:.3f} | {i['worst_down_error_over_bound']:.3f} |")
        w("")
        rec = d.get("record")
        if rec:
            w(f"The delayed record over {rec['invocations']} calls: final scale {rec['final_scale']:.5f}, {rec['saturated']} values saturated.")
            w("")
    pk = next((k for k in res if k.startswith("prefill_") and not k.startswith("prefill_attention")), None)
    if pk:
        pre = res[pk]
        render_prefill_model(w, pre, note=f"At {pk.split('_')[-1]}: 32 layers, bf16 and `--prefill fp8`; ms: the median of the runs in `ms_runs`.")
        summ = res["summary"].get("prefill_8b_shaped")
        if summ:
            w("One layer's launches (the file's summary: each kernel's µs in the prefill over its 32 layers, summed over kernels), µs:")
            w("")
            modes = [m_ for m_ in ("bf16", "fp8") if m_ in summ]
            w("| prompt | " + " | ".join(f"{m_} layer launches µs" for m_ in modes) + " |")
            w("| --- |" + " ---: |" * len(modes))
            for rows in zip(*(summ[m_] for m_ in modes)):
                w(f"| {rows[0]['prompts']} | " + " | ".join(f"{r['layer_launches_us']:.0f}" for r in rows) + " |")
            w("")
            w("bf16 launches per prompt (as the FP8 table above):")
            w("")
            render_launches(w, pre["bf16"])


def _runs_of(lens):
    """Run-length pairs (length, count) of a list of prompt lengths."""
    out = []
    for l in lens:
        if out and out[-1][0] == l:
            out[-1] = (l, out[-1][1] + 1)
        else:
            out.append((l, 1))
    return out


def render_fp8_int4(w, res, path):
    """results/h100-fp8-int4-mainloop-19eea74.json: the FP8 GEMM with INT4 weights expanded in its
    mainloop beside the FP8 GEMM on E4M3 copies (two bundles), the 8B-shaped prefill at 2,048
    tokens with fp8 and fp8-int4, the SmolLM2 quality test and the 405B FP8 layer."""
    run_section(w, res["meta"].get("title", "FP8 GEMM with INT4 weights expanded in the mainloop"), res, path)
    s = res["summary"]
    if s.get("tests_passed"):
        w("Tests passed: " + ", ".join(f"`{t}`" for t in s["tests_passed"]) + ".")
        w("")
    benches = [k for k in res if k.startswith("fp8_i4_gemm_")]
    new_key = next(k for k in benches if res["meta"]["commit"].startswith(k.split("_")[-1][:7]))
    bundles = [new_key] + [k for k in benches if k != new_key]
    t = res[new_key]
    w(f"### `fp8_i4_gemm_matches_reference` ({new_key.split('_')[-1]}; worst error over the bound {t['worst_error_over_bound']:.3f}, l1 tolerance {t['tol_l1']:g})")
    w("")
    w("| epilogue | group | f16 scales | offsets | gain | M | N | K | rows checked | error / bound |")
    w("| --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    yn = lambda v: "yes" if v else "no"
    for c in t["cases"]:
        w(f"| {c['epilogue']} | {c['group']} | {yn(c['f16_scales'])} | {yn(c['offsets'])} | {yn(c['gain'])} | {c['m']} | {c['n']} | {c['k']} | {c['rows_checked']} | {c['worst_error_over_bound']:.3f} |")
    w("")
    other = [k for k in res if k.endswith("_tests_" + new_key.split("_")[-1]) and isinstance(res[k], list)]
    for k in other:
        render_test_entries(w, res[k], f"The FP8 and bf16 GEMM tests ({k.split('_')[-1]})")
    w("### INT4-weight FP8 GEMM against the FP8 GEMM on E4M3 copies")
    w("")
    w("Summary in the file: the INT4-weight kernels' rate over the E4M3-copy kernel's (128 x 128 tiles) per point, geometric")
    w("mean and range, and their TFLOP/s range:")
    w("")
    w("| bundle | weights | vs E4M3 copy, geometric mean | min | max | TFLOP/s | points |")
    w("| --- | --- | ---: | ---: | ---: | --- | ---: |")
    for b in bundles:
        for kind, v in s.get("int4_gemm_" + b.split("_")[-1], {}).items():
            w(f"| {b.split('_')[-1]} | {kind} | {v['vs_fp8_e4m3_geomean']:.3f} | {v['min']:.3f} | {v['max']:.3f} | {v['tflops_min']:.1f}-{v['tflops_max']:.1f} | {v['points']} |")
    w("")
    for b in bundles:
        runs = res[b]["bench"]["runs"]
        kinds = list(dict.fromkeys(r["kernel"] for r in runs))
        gemms = [k for k in kinds if any("tflops" in r for r in runs if r["kernel"] == k)]
        rest = [k for k in kinds if k not in gemms]
        ref = gemms[0]
        by = {(r["shape"], r["m"], r["kernel"]): r for r in runs}
        label = b.split("_")[-1]
        w(f"Bundle {label}: µs per call (TFLOP/s; for the INT4 weights, the rate over the `{ref}` kernel's at the same point)" + (f"; {', '.join(f'`{k}`' for k in rest)}: µs" if rest else "") + ":")
        w("")
        w("| shape | M | N | K | " + " | ".join(gemms + rest) + " |")
        w("| --- | ---: | ---: | ---: |" + " ---: |" * (len(gemms) + len(rest)))
        for shape, mm in dict.fromkeys((r["shape"], r["m"]) for r in runs):
            base = by.get((shape, mm, ref))
            cells = []
            for k in gemms:
                r = by.get((shape, mm, k))
                if not r:
                    cells.append("-")
                elif k == ref:
                    cells.append(f"{r['us']:.1f} ({r['tflops']:.0f})")
                else:
                    cells.append(f"{r['us']:.1f} ({r['tflops']:.0f}, {base['us'] / r['us']:.2f}x)" if base else f"{r['us']:.1f} ({r['tflops']:.0f})")
            cells += [f"{by[(shape, mm, k)]['us']:.1f}" if (shape, mm, k) in by else "-" for k in rest]
            g = base or next(r for r in runs if r["shape"] == shape and r["m"] == mm and "n" in r)
            w(f"| {shape} | {mm} | {g['n']} | {g['k']} | " + " | ".join(cells) + " |")
        w("")
    w(f"Kernel resources (ptxas), {new_key.split('_')[-1]}: " + ", ".join(f"{k['entry']} {k['registers']} regs / {k['shared_bytes']} B smem / {k['spills']} B spills" for k in res[new_key]["bench"]["kernels"] if k["entry"].startswith("fp8_i4_")))
    w("")
    pf = [k for k in s if k.startswith("prefill_")]
    if pf:
        w("### llama-3.1-8b-shaped prefill, `--prefill fp8` and `--prefill fp8-int4`")
        w("")
        w("32 layers, random INT4 weights (groups of 128); fp8: the FP8 GEMM on E4M3 copies of the weights, fp8-int4: on the packed weights.")
        w("")
        w("| bundle | mode | prompt | ms | tokens/s | TFLOP/s | Stoke kernels ms |")
        w("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for k in pf:
            for mode, r in s[k].items():
                if r.get("error"):
                    w(f"| {k.split('_')[-1]} | {mode} | {r['prompts']} | error: {r['error']} | | | |")
                    continue
                w(f"| {k.split('_')[-1]} | {mode} | {r['prompts']} | {r['ms']:.2f} | {r['tokens_per_s']:.0f} | {r['tflops']:.0f} | {r['stoke_kernel_ms']:.2f} |")
        w("")
    qk = next((k for k in res if k.startswith("smollm2_fp8_prefill_")), None)
    if qk:
        q = res[qk]
        w(f"### SmolLM2 FP8 prefill quality with INT4 weights in the mainloop ({qk.split('_')[-1]})")
        w("")
        w(f"Perplexity of the next token over {q['batch']} windows of {q['len']} tokens, judged by the f32 model; `over bf16`: the")
        w("excess over the bf16 prefill of the same weights and prefill path. fp8: E4M3 copies of the weights; fp8-int4: the")
        w("packed weights expanded in the mainloop; `fp8_first_per_row`: the first FP8 prefill, whose SwiGLU outputs go to the down")
        w("projections per row and start the delayed scales (the second, with those scales, is the one judged).")
        w("")
        w("| weights | prefill | mode | perplexity | over bf16 | top-1 agreement with f32 |")
        w("| --- | --- | --- | ---: | ---: | ---: |")
        p, a = q["perplexity"], q["top1_agreement_with_f32"]
        w(f"| packed INT4 | test | f32 | {p['f32']:.3f} | - | - |")
        w(f"| packed INT4 | test | bf16 | {p['bf16']:.3f} | - | {a['bf16']:.3f} |")
        w(f"| packed INT4 | test | fp8 | {p['fp8']:.3f} | {100 * q['fp8_over_bf16']:+.1f}% | {a['fp8']:.3f} |")
        if "fp8_first_per_row" in p:
            w(f"| packed INT4 | test | fp8, the first prefill (`fp8_first_per_row`) | {p['fp8_first_per_row']:.3f} | - | " + (f"{q['fp8_first_top1_agreement_with_f32']:.3f}" if "fp8_first_top1_agreement_with_f32" in q else "-") + " |")
        i4 = q.get("fp8_int4")
        if i4:
            w(f"| packed INT4 | test | fp8-int4 | {i4['perplexity']:.3f} | {100 * i4['over_bf16']:+.1f}% | {i4['top1_agreement_with_f32']:.3f} |")
        sv = q.get("served_prefill")
        if sv:
            w(f"| packed INT4 | the prefill that serves | bf16 | {sv['perplexity']['bf16']:.3f} | - | {sv['top1_agreement_with_f32']['bf16']:.3f} |")
            w(f"| packed INT4 | the prefill that serves | fp8 | {sv['perplexity']['fp8']:.3f} | {100 * sv['fp8_over_bf16']:+.1f}% | {sv['top1_agreement_with_f32']['fp8']:.3f} |")
            if i4 and i4.get("served"):
                v = i4["served"]
                w(f"| packed INT4 | the prefill that serves | fp8-int4 | {v['perplexity']:.3f} | {100 * v['over_bf16']:+.1f}% | {v['top1_agreement_with_f32']:.3f} |")
        dn = q.get("dense")
        if dn:
            w(f"| dense bf16 | test | bf16 | {dn['perplexity']['bf16']:.3f} | - | {dn['top1_agreement_with_f32']['bf16']:.3f} |")
            w(f"| dense bf16 | test | fp8 | {dn['perplexity']['fp8']:.3f} | {100 * dn['fp8_over_bf16']:+.1f}% | {dn['top1_agreement_with_f32']['fp8']:.3f} |")
        w("")
        counts = [(k, q[k]) for k in ("fp8_gemm_calls", "folded_norm_calls", "delayed_scales", "delayed_saturated") if k in q]
        if i4:
            counts += [(f"fp8_int4.{k}", i4[k]) for k in ("gemm_calls", "int4_weight_calls") if k in i4]
        if counts:
            w("Counts in the test: " + ", ".join(f"`{k}` {v}" for k, v in counts) + ".")
            w("")
    lk = next((k for k in res if k.startswith("layer_")), None)
    if lk:
        lay = res[lk]
        render_layer(w, lay, note=f"At {lk.split('_')[-1]} (the file's meta: the same FP8 kernels).")
        parts = next((v for k, v in s.items() if k.startswith("layer_") and isinstance(v, dict) and "parts_us" in v), None)
        if parts:
            w("Its launches by kernel (the 2-layer model's µs minus the 1-layer model's, the file's summary):")
            w("")
            w("| kernel | µs |")
            w("| --- | ---: |")
            for k, v in sorted(parts["parts_us"].items(), key=lambda kv: -kv[1]):
                w(f"| {k} | {v:.1f} |")
            w("")


def render_engine(w, res, path):
    """A paged-cache / engine results file: paged against contiguous decode attention and decode
    steps, the main job's first token, the serving benchmark and its peer, the tests."""
    m = res["meta"]
    w(f"## Paged KV cache and the engine ({m['gpu']}, commit `{m['commit']}`, {m['date_utc'][:10]})")
    w("")
    w(f"From [`{path}`](../{path}). {m.get('note', '')}")
    w("")
    if res.get("decode_attention"):
        w("| decode attention | batch | context | cache | contiguous µs | paged µs | paged / contiguous | paged, % of copy rate |")
        w("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
        for a in res["decode_attention"]:
            w(f"| {a['shape']} | {a['batch']} | {a['context']} | {a['kv']} | {a['contiguous_us']:.2f} | {a['paged_us']:.2f} | {a['paged_over_contiguous']:.3f} | {a['paged_copy_pct']:.1f} |")
        w("")
    if res.get("decode_step"):
        w("| decode step | batch | context | cache | contiguous µs | paged µs | paged / contiguous | launches | tokens/s |")
        w("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for a in res["decode_step"]:
            w(f"| {a['model']} | {a['batch']} | {a['context']} | {a['kv']} | {a['contiguous_us']:.1f} | {a['paged_us']:.1f} | {a['paged_over_contiguous']:.3f} | {a['launches_per_step']} | {a['tokens_per_s']:.0f} |")
        w("")
    if res.get("main_job"):
        w("| main job (`llama`, 4-token prompt) | load s | kernels s | first token ms | of which host work ms | decode tokens/s |")
        w("| --- | ---: | ---: | ---: | ---: | ---: |")
        for run, r in res["main_job"].items():
            w(f"| {run} | {r.get('load_s', 0):.2f} | {r.get('kernels_s', 0):.2f} | {r.get('first_token_ms', 0):.1f} | {r.get('host_work_ms', 0):.1f} | {r.get('decode_tokens_per_s', 0):.0f} |")
        w("")
    for model, b in res.get("serving", {}).items():
        if "error" in b:
            w(f"Serving {model}: error `{b['error']}`")
            w("")
            continue
        w(f"Serving {model} ({b['requests_per_schedule']} requests per schedule, prompts {b['prompt_tokens']}, outputs {b['output_tokens']} tokens):")
        w("")
        w("| schedule | requests/s | output tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms |")
        w("| --- | ---: | ---: | ---: | ---: |")
        def row(label, r):
            t, i = r.get("ttft_ms", {}), r.get("itl_ms", {})
            w(f"| {label} | {r.get('requests_per_s', 0):.1f} | {r.get('output_tokens_per_s', 0):.0f} | {t.get('p50', 0):.1f} / {t.get('p99', 0):.1f} | {i.get('p50', 0):.2f} / {i.get('p99', 0):.2f} |")
        row("all at once (saturating)", b["saturating"])
        for r in b["rates"]:
            row(f"{r['fraction_of_saturating']:.2f} x saturating ({r['rate']:.1f}/s)", r["result"])
        row("closed loop, concurrency 32", b["concurrency_32"])
        w("")
        w(f"Concurrency 32 against the static batch of 32 (`llama --bench`, {b['static_batch_32_decode_tokens_per_s']:.0f} tokens/s): {b['concurrency_32_over_static_32']:.2f}.")
        w("")
    if res.get("peer"):
        w("transformers continuous batching on the same SmolLM2 schedules:")
        w("")
        w("| schedule | mode | requests/s | output tokens/s | TTFT p50 ms | finished |")
        w("| --- | --- | ---: | ---: | ---: | ---: |")
        for r in res["peer"]:
            if "completed" not in r:
                w(f"| {r.get('name') or r.get('file')} | error: {r.get('error', '?')[:80]} | | | | |")
                continue
            rate = r.get("rate")
            rate = "all at once" if rate in (None, "inf") else f"{rate:.3g}/s"
            w(f"| {r.get('name', '')}, {rate} | {r.get('mode', '')} | {r['requests_per_s'] or 0:.2f} | {r['output_tokens_per_s'] or 0:.0f} | {(r.get('ttft_ms') or {}).get('p50', 0):.0f} | {r['completed']}/{r['requests']} |")
        w("")
    if res.get("tests"):
        render_tests(w, [{"name": t["name"], "status": t["status"], "seconds": t.get("seconds", 0.0),
                          "message": t.get("message") or "", "details": t.get("details", {})}
                         for t in res["tests"]], max_details=200)


def render_serve(w, res, path):
    """An HTTP serving results file: stoke-load against stoke-serve at rates up to saturation
    (per model), the transformers peer on the same schedules, soak runs over time."""
    m = res["meta"]
    w(f"## The HTTP server under load ({m['gpu']}, commit `{m['commit']}`, {m['date_utc'][:10]})")
    w("")
    w(f"From [`{path}`](../{path}). {m.get('note', '')}")
    w("")
    def ms(d, k):
        d = d.get(k) or {}
        return f"{d.get('p50', 0):.1f} / {d.get('p90', 0):.1f} / {d.get('p99', 0):.1f}"
    for model, load in res.get("http_serving", {}).items():
        w(f"stoke-load against stoke-serve, {model} (prompts {load['prompt_tokens']}, outputs {load['output_tokens']} tokens, streamed):")
        w("")
        w("| rate | requests | errors | requests/s | output tokens/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms |")
        w("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in load["runs"]:
            if "result" not in r:
                w(f"| {r['rate_arg']} | | | | | {r.get('error', 'not run')} | |")
                continue
            x = r["result"]
            rate = "all at once" if r["rate"] == "inf" else f"{r['rate_arg']} ({r['rate']:.3g}/s)"
            w(f"| {rate} | {x['requests']} | {x['errors']} | {x['requests_per_s']:.3g} | {x['output_tokens_per_s']:.0f} | {ms(x, 'ttft_ms')} | {ms(x, 'itl_ms')} |")
        w("")
    if res.get("shutdown"):
        w("Shutdown (SIGTERM): " + "; ".join(f"{k}, {v}" for k, v in res["shutdown"].items()) + ".")
        w("")
    if res.get("peer"):
        w("transformers continuous batching, in process, on the same SmolLM2 schedules:")
        w("")
        w("| schedule | mode | requests/s | output tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | finished |")
        w("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for r in res["peer"]:
            if "completed" not in r:
                w(f"| {r.get('name') or r.get('file')} | error: {r.get('error', '?')[:80]} | | | | | |")
                continue
            t, i = r.get("ttft_ms") or {}, r.get("itl_ms") or {}
            rate = r.get("rate")
            rate = "all at once" if rate in (None, "inf") else f"{rate:.3g}/s"
            w(f"| {r.get('name', '')}, {rate} | {r.get('mode', '')} | {r['requests_per_s'] or 0:.2f} | {r['output_tokens_per_s'] or 0:.0f} | {t.get('p50', 0):.0f} / {t.get('p99', 0):.0f} | {i.get('p50', 0):.1f} / {i.get('p99', 0):.1f} | {r['completed']}/{r['requests']} |")
        w("")
    for key, label in (("soak_gpu", "Soak on the GPU"), ("soak_cpu", "Soak on the CPU")):
        soak = res.get(key)
        if not soak:
            continue
        run = soak["runs"][-1]
        x = run["result"]
        def mem(m):
            parts = [f"{m[k]:.1f} MiB {name}" for k, name in (("host_rss_mib", "resident"), ("gpu_used_mib", "GPU")) if m.get(k) is not None]
            return ", ".join(parts) or "not read"
        w(f"{label} ({soak.get('where', '')}): {x['requests']} requests at {run['rate']:.3g}/s over {x['wall_s']:.0f} s, {x['errors']} errors, {x['output_tokens_per_s']:.0f} output tokens/s, TTFT p50 / p99 {(x.get('ttft_ms') or {}).get('p50', 0):.0f} / {(x.get('ttft_ms') or {}).get('p99', 0):.0f} ms, ITL p50 / p99 {(x.get('itl_ms') or {}).get('p50', 0):.1f} / {(x.get('itl_ms') or {}).get('p99', 0):.1f} ms; server memory at the start {mem(run['memory_start'])}, at the end {mem(run['memory_end'])}.")
        w("")
        mem_t = run.get("memory_over_time") or []
        def at_end(i, k):
            v = (mem_t[i] or {}).get(k) if i < len(mem_t) else None
            return "" if v is None else f"{v:.0f}"
        w("| from s | requests | errors | TTFT p99 ms | ITL p99 ms | resident MiB at its end | GPU MiB at its end |")
        w("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for i, win in enumerate(run["over_time"]):
            w(f"| {win['from_s']:.0f} | {win['requests']} | {win['errors']} | {win['ttft_p99_ms'] or 0:.1f} | {win['itl_p99_ms'] or 0:.1f} | {at_end(i, 'host_rss_mib')} | {at_end(i, 'gpu_used_mib')} |")
        w("")


def render(res, results_path, extras=()):
    m, b = res["meta"], res["bench"]
    out = []
    w = out.append
    w("# Results")
    w("")
    w(f"Generated by `scripts/results.py` from [`{results_path}`](../{results_path}) and the results files named in the sections below; every number in the docs comes from one of them.")
    w(f"Regenerate with `python3 scripts/results.py --render {' '.join([results_path, *extras])}`.")
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
        if any(k in extra for k in ("http_serving", "soak_cpu", "soak_gpu")):
            render_serve(w, extra, path)
        elif "decode_step" in extra or "serving" in extra:
            render_engine(w, extra, path)
        elif any(k.startswith("coalesced_") for k in extra):
            render_coalesced(w, extra, path)
        elif any(k.startswith("swiglu_stores_") for k in extra.get("summary", {})):
            render_swiglu_stores(w, extra, path)
        elif any(k.startswith("prefill_attention_") for k in extra):
            render_prefill_attn_wgmma(w, extra, path)
        elif any(k.startswith("fp8_i4_gemm_") for k in extra):
            render_fp8_int4(w, extra, path)
        elif "quality" in extra:
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
