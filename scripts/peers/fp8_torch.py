#!/usr/bin/env python3
"""PyTorch peers for Stoke's FP8 prefill GEMM in the same GPU run: cuBLAS FP8 with rowwise scales
(torch._scaled_mm, E4M3 activations [M, K] with one scale per row, E4M3 weights [N, K] with one
scale per output channel, bf16 out, no epilogue) and bf16 torch.matmul, at the Llama 3.1 8B / 70B
projection shapes (q|k|v and gate|up fused), M in {512, 2048, 8192}.

usage: fp8_torch.py OUT.json

Timing: int4_torch.timed (CUDA events around batches of 5-500 calls, about 20 ms each,
median of 5 batches).
"""
import json
import sys

import torch

from int4_torch import timed

SHAPES = [("8b_qkv", 4096, 6144), ("8b_o", 4096, 4096), ("8b_gate_up", 4096, 28672),
          ("8b_down", 14336, 4096), ("70b_qkv", 8192, 10240), ("70b_gate_up", 8192, 57344),
          ("70b_down", 28672, 8192)]
ROWS = [512, 2048, 8192]


def main():
    out_path = sys.argv[1]
    dev = torch.device("cuda")
    rows = []
    for name, k, n in SHAPES:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        w8 = w.to(torch.float8_e4m3fn)
        sw = torch.full((1, n), 1e-2, device=dev, dtype=torch.float32)
        for m in ROWS:
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            a8 = a.to(torch.float8_e4m3fn)
            sa = torch.full((m, 1), 1e-2, device=dev, dtype=torch.float32)
            flop = 2.0 * m * n * k
            row = {"shape": name, "m": m, "n": n, "k": k}
            try:
                us = timed(lambda _: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sw,
                                                      out_dtype=torch.bfloat16), 1, 5, 500)
                row["scaled_mm_rowwise_us"] = us
                row["scaled_mm_rowwise_tflops"] = flop / us / 1e6
            except Exception as e:  # noqa: BLE001 - reported in the JSON
                row["scaled_mm_rowwise_error"] = str(e)
            us = timed(lambda _: a @ w.t(), 1, 5, 500)
            row["bf16_us"] = us
            row["bf16_tflops"] = flop / us / 1e6
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    with open(out_path, "w") as f:
        json.dump({"meta": meta, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
