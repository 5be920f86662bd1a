#!/usr/bin/env python3
"""PyTorch peer for Stoke's decode attention on the same GPU run:
torch.nn.functional.scaled_dot_product_attention(enable_gqa=True) on a BF16 cache, one query
token per sequence, for the Llama-3.1-8B and 70B attention shapes at (batch, context) in
{(1, 1024), (8, 1024), (32, 4096), (1, 32768)}, with the same run's device-to-device copy rate.

usage: attention_torch.py OUT.json
       attention_torch.py --profile SHAPE BATCH CTX   (a few eager calls at one point, for a
                                                       profiler such as ncu; writes nothing)

Timing as in int4_torch.py (CUDA events around batches of calls, median of 5; `us` from a CUDA
graph of the batch, `eager_us` issued eagerly, which small points spend in dispatch). Caches rotate
through enough copies (>= 160 MB) that the L2 does not serve them. `gbps` counts the K and V
bytes read.
"""
import json
import sys

import torch
import torch.nn.functional as F

from int4_torch import copy_record, timed_graph

SHAPES = [("8b", 32, 8, 128), ("70b", 64, 8, 128), ("405b", 128, 8, 128)]
POINTS = [(1, 1024), (8, 1024), (32, 4096), (1, 32768)]
ROTATE_BYTES = 160e6


def profile(shape, batch, ctx):
    """Three eager calls at one point (the first may pick and load SDPA's kernel)."""
    name, heads, kvh, d = next(s for s in SHAPES if s[0] == shape)
    dev = torch.device("cuda")
    k = torch.randn(batch, kvh, ctx, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn(batch, kvh, ctx, d, dtype=torch.bfloat16, device=dev)
    q = torch.randn(batch, heads, 1, d, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.cuda.synchronize()
    print(f"torch sdpa {name} b {batch} ctx {ctx}: 3 calls")


def main():
    if sys.argv[1] == "--profile":
        profile(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    out_path = sys.argv[1]
    dev = torch.device("cuda")
    copy, res = copy_record()
    for name, heads, kvh, d in SHAPES:
        for batch, ctx in POINTS:
            one = 2 * batch * kvh * ctx * d * 2
            copies = max(1, min(64, int(ROTATE_BYTES / one + 0.999)))
            kv = [(torch.randn(batch, kvh, ctx, d, dtype=torch.bfloat16, device=dev),
                   torch.randn(batch, kvh, ctx, d, dtype=torch.bfloat16, device=dev)) for _ in range(copies)]
            q = torch.randn(batch, heads, 1, d, dtype=torch.bfloat16, device=dev)
            entry = {"impl": "torch_sdpa_bf16", "shape": name, "heads": heads, "kv_heads": kvh, "d": d,
                     "batch": batch, "ctx": ctx}
            try:
                gus, eager = timed_graph(lambda i: F.scaled_dot_product_attention(q, kv[i][0], kv[i][1], enable_gqa=True), copies)
                us = gus if gus is not None else eager
                g = one / us / 1e3
                entry.update({"us": us, "eager_us": eager, "timing": "graph" if gus else "eager", "gbps": g,
                              "of_copy": g / copy})
                print(f"torch sdpa {name:4} b {batch:2} ctx {ctx:5}: {us:8.2f} us {g:7.0f} GB/s (eager {eager:.2f} us)")
            except Exception as e:  # noqa: BLE001 - record why the peer did not run
                entry["error"] = f"{type(e).__name__}: {e}"
            res.append(entry)
            del kv
            torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
