#!/usr/bin/env python3
"""PyTorch peers for Stoke's prefill attention on the same GPU run: causal
torch.nn.functional.scaled_dot_product_attention in bf16 for the shapes and prompt lengths of
stoke-gpu's `prefill-attention` benchmark (8B, 70B, SmolLM2 heads; one prompt of 512 ... 8192
tokens), each SDPA backend that takes the call (flash, cuDNN, efficient; GQA by
enable_gqa, or K/V repeated per query head where the backend needs it), and the packed mix (one
2048-token prompt with seven of 128) run padded to 8 x 2048 and, where this PyTorch has it,
through torch.nn.attention.varlen.

usage: prefill_attention_torch.py OUT.json

Timing as in int4_torch.py (a CUDA graph of a batch of calls, median of 5). TFLOP/s count 4 x
heads x d per causal (query, key) pair, as the Stoke benchmark does.
"""
import inspect
import json
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from int4_torch import timed_graph

SHAPES = [("8b", 32, 8, 128), ("70b", 64, 8, 128), ("405b", 128, 8, 128), ("smollm2", 9, 3, 64)]
LENGTHS = [512, 1024, 2048, 4096, 8192]
MIX = [2048] + [128] * 7
BACKENDS = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION)]


def flops(heads, d, lens):
    return 4.0 * heads * d * sum(l * (l + 1) / 2 for l in lens)


def sdpa_point(name, heads, kvh, d, batch, s, backend):
    dev = torch.device("cuda")
    q = torch.randn(batch, heads, s, d, dtype=torch.bfloat16, device=dev)
    k = torch.randn(batch, kvh, s, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn(batch, kvh, s, d, dtype=torch.bfloat16, device=dev)
    bname, b = backend
    with sdpa_kernel([b]):
        try:
            with warnings.catch_warnings():
                # A backend without enable_gqa support warns and refuses: K/V repeated instead.
                warnings.simplefilter("error", UserWarning)
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            fn = lambda i: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            how = "enable_gqa"
        except (RuntimeError, UserWarning):
            kr, vr = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
            try:
                F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
            except RuntimeError as e:
                return {"backend": bname, "error": str(e).splitlines()[0][:200]}
            fn = lambda i: F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
            how = "repeated_kv"
        gus, eager = timed_graph(fn, 1)
    us = gus if gus is not None else eager
    return {"backend": bname, "gqa": how, "us": us, "eager_us": eager}


def varlen_point(heads, kvh, d, lens):
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        return {"error": f"no torch.nn.attention.varlen ({e})"}
    dev = torch.device("cuda")
    t = sum(lens)
    q = torch.randn(t, heads, d, dtype=torch.bfloat16, device=dev)
    k = torch.randn(t, kvh, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn(t, kvh, d, dtype=torch.bfloat16, device=dev)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    # Causal masking is `is_causal=True` in torch 2.10 and `window_size=(-1, 0)` (no keys to
    # the right) from 2.11; GQA without repeated K/V is `enable_gqa` from 2.12.
    params = inspect.signature(varlen_attn).parameters
    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    try:
        if kvh != heads and "enable_gqa" in params:
            kw["enable_gqa"] = True
        elif kvh != heads:
            k, v = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
        fn = lambda i: varlen_attn(q, k, v, cu, cu, max(lens), max(lens), **kw)
        fn(0)
        gus, eager = timed_graph(fn, 1)
    except Exception as e:  # noqa: BLE001 - record why this peer did not run
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return {"us": gus if gus is not None else eager, "eager_us": eager}


def main():
    out_path = sys.argv[1]
    runs = []
    for name, heads, kvh, d in SHAPES:
        for s in LENGTHS:
            for backend in BACKENDS:
                r = sdpa_point(name, heads, kvh, d, 1, s, backend)
                if "us" in r:
                    r["tflops"] = flops(heads, d, [s]) / r["us"] / 1e6
                    print(f"torch sdpa {r['backend']:<9} {name:<8} S {s:5}: {r['us']:9.1f} us {r['tflops']:6.1f} TFLOP/s")
                else:
                    print(f"torch sdpa {r['backend']:<9} {name:<8} S {s:5}: {r['error']}")
                runs.append({"shape": name, "heads": heads, "kv_heads": kvh, "d": d, "lens": [s], **r})
        for backend in BACKENDS:
            r = sdpa_point(name, heads, kvh, d, 8, 2048, backend)
            if "us" in r:
                r["tflops_of_mix"] = flops(heads, d, MIX) / r["us"] / 1e6
                print(f"torch sdpa {r['backend']:<9} {name:<8} mix padded to 8 x 2048: {r['us']:9.1f} us")
            runs.append({"shape": name, "heads": heads, "kv_heads": kvh, "d": d, "lens": MIX, "padded_to": [8, 2048], **r})
        r = varlen_point(heads, kvh, d, MIX)
        if "us" in r:
            r["tflops"] = flops(heads, d, MIX) / r["us"] / 1e6
            print(f"torch varlen_attn {name:<8} mix packed: {r['us']:9.1f} us {r['tflops']:6.1f} TFLOP/s")
        else:
            print(f"torch varlen_attn {name:<8} mix packed: {r['error']}")
        runs.append({"shape": name, "heads": heads, "kv_heads": kvh, "d": d, "lens": MIX, "impl": "varlen_attn", **r})
    with open(out_path, "w") as f:
        json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "runs": runs}, f, indent=1)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
