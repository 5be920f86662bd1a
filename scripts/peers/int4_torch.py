#!/usr/bin/env python3
"""PyTorch peers for Stoke's W4A16 GEMM on the same GPU run: torch._weight_int4pack_mm (INT4,
group 128, bf16) and bf16 torch.matmul, on the Llama-3.1-8B/70B projection shapes, M in
{1, 2, 4, 8, 16, 32}, with the same run's device-to-device copy rate.

usage: int4_torch.py OUT.json

Timing: CUDA events around batches of calls (>= ~20 ms per batch), median of 5 batches, the batch
replayed from a CUDA graph (`us`: GPU time per call, as in a graphed or compiled decode step,
without PyTorch's per-call dispatch on the host) and also issued eagerly (`eager_us`: small calls
there are bound by the host's dispatch). Weights rotate through enough copies (>= 160 MB in all)
that the L2 (60 MB) does not serve them, as in a model. `gbps` counts the weight bytes each
implementation reads (INT4 packed + bf16 scales and zeros; bf16 weights) plus activations and
output.
"""
import json
import statistics
import sys

import torch

SHAPES = [("8b_qkv", 4096, 6144), ("8b_o", 4096, 4096), ("8b_gate_up", 4096, 28672),
          ("8b_down", 14336, 4096), ("70b_qkv", 8192, 10240), ("70b_o", 8192, 8192),
          ("70b_gate_up", 8192, 57344), ("70b_down", 28672, 8192)]
ROWS = [1, 2, 4, 8, 16, 32]
GROUP = 128
ROTATE_BYTES = 160e6


def timed(fn, n_inputs, min_calls=20, max_calls=5000):
    """Median µs per call of `fn(i)` over 5 batches of eager calls (about 20 ms per batch,
    `min_calls` to `max_calls` calls), rotating i through `n_inputs` input copies."""
    for i in range(3):
        fn(i % n_inputs)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn(0)
    e.record()
    e.synchronize()
    one = max(s.elapsed_time(e), 1e-3)
    calls = int(min(max_calls, max(min_calls, 20.0 / one)))
    out = []
    for _ in range(5):
        s.record()
        for i in range(calls):
            fn(i % n_inputs)
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1e3 / calls)
    return statistics.median(out)


def timed_graph(fn, n_inputs):
    """(graph µs per call, eager µs per call): a batch of calls (about 20 ms, at most 2000) captured
    once in a CUDA graph and replayed 5 times (median), beside `timed`'s eager batches; the graph
    time is None where capture fails."""
    eager = timed(fn, n_inputs)
    calls = int(min(2000, max(20, 20e3 / max(eager, 1e-3))))
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(3):
                fn(i % n_inputs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fn(i % n_inputs)
        g.replay()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        out = []
        for _ in range(5):
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e) * 1e3 / calls)
        del g
        return statistics.median(out), eager
    except Exception as ex:  # noqa: BLE001 - keep the eager time, say why
        print(f"graph capture failed ({type(ex).__name__}: {ex}); eager time only")
        torch.cuda.synchronize()
        return None, eager


def copy_gbps():
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    us = timed(lambda i: b.copy_(a), 1)
    return 2 * a.numel() / us / 1e3


def copy_record():
    """The same run's copy rate, printed, and the results list that starts with it."""
    copy = copy_gbps()
    print(f"device-to-device copy: {copy:.0f} GB/s")
    return copy, [{"impl": "d2d_copy", "gbps": copy, "device": torch.cuda.get_device_name(),
                   "torch": torch.__version__}]


def main():
    out_path = sys.argv[1]
    dev = torch.device("cuda")
    copy, res = copy_record()
    for name, k, n in SHAPES:
        int4_bytes = k * n // 2 + (k // GROUP) * n * 2 * 2
        bf16_bytes = k * n * 2
        copies4 = max(1, int(ROTATE_BYTES / int4_bytes + 0.999))
        copies16 = max(1, int(ROTATE_BYTES / bf16_bytes + 0.999))
        packed, sz = [], []
        err = None
        try:
            for _ in range(copies4):
                q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
                packed.append(torch._convert_weight_to_int4pack(q, 8))
                sz.append(torch.rand(k // GROUP, n, 2, dtype=torch.bfloat16, device=dev) * 0.01)
        except Exception as e:  # noqa: BLE001 - record why the peer did not run
            err = f"{type(e).__name__}: {e}"
            packed = []
        dense = [torch.randn(k, n, dtype=torch.bfloat16, device=dev) * 0.01 for _ in range(copies16)]
        for m in ROWS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            act = m * k * 2 + m * n * 2
            if packed:
                gus, eager = timed_graph(lambda i: torch._weight_int4pack_mm(x, packed[i], GROUP, sz[i]), copies4)
                us = gus if gus is not None else eager
                g = (int4_bytes + act) / us / 1e3
                res.append({"impl": "torch_weight_int4pack_mm", "shape": name, "k": k, "n": n, "m": m,
                            "group": GROUP, "us": us, "eager_us": eager, "timing": "graph" if gus else "eager",
                            "gbps": g, "of_copy": g / copy})
                print(f"torch int4 {name:12} m {m:2}: {us:8.2f} us {g:7.0f} GB/s (eager {eager:.2f} us)")
            elif err:
                res.append({"impl": "torch_weight_int4pack_mm", "shape": name, "m": m, "error": err})
            gus, eager = timed_graph(lambda i: torch.matmul(x, dense[i]), copies16)
            us = gus if gus is not None else eager
            g = (bf16_bytes + act) / us / 1e3
            res.append({"impl": "torch_bf16_matmul", "shape": name, "k": k, "n": n, "m": m,
                        "us": us, "eager_us": eager, "timing": "graph" if gus else "eager",
                        "gbps": g, "of_copy": g / copy})
            print(f"torch bf16 {name:12} m {m:2}: {us:8.2f} us {g:7.0f} GB/s (eager {eager:.2f} us)")
        del packed, sz, dense
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
