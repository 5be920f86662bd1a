#!/usr/bin/env python3
"""PyTorch peer for Stoke's output head on the same GPU run: torch.nn.functional.linear(x, W)
with the head stored as checkpoints store it (bf16 W [vocab, hidden]), on the SmolLM2-135M,
Llama-3.1-8B and Llama-3.1-70B head shapes at 1, 8, 16, 32 and 64 rows, with the same run's
device-to-device copy rate.

usage: head_torch.py OUT.json

Timing as in int4_torch.py (a graph of back-to-back calls, weights rotated through >= 160 MB).
`gbps` counts the weight bytes.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from int4_torch import ROTATE_BYTES, copy_record, timed_graph  # noqa: E402

SHAPES = [("smol_head", 576, 49152), ("8b_head", 4096, 128256), ("70b_head", 8192, 128256)]
ROWS = [1, 8, 16, 32, 64]


def main():
    out_path = sys.argv[1]
    copy, res = copy_record()
    for name, k, n in SHAPES:
        w_bytes = k * n * 2
        copies = max(1, int(ROTATE_BYTES / w_bytes + 0.999))
        heads = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.01 for _ in range(copies)]
        for m in ROWS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            gus, eager = timed_graph(lambda i: torch.nn.functional.linear(x, heads[i]), copies)
            us = gus if gus is not None else eager
            g = w_bytes / us / 1e3
            res.append({"impl": "torch_linear_bf16", "shape": name, "k": k, "n": n, "m": m, "us": us,
                        "eager_us": eager, "timing": "graph" if gus else "eager", "gbps": g,
                        "of_copy": g / copy})
            print(f"torch head {name:10} m {m:2}: {us:8.2f} us {g:7.0f} GB/s ({100 * g / copy:5.1f}% of copy)")
        del heads
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
