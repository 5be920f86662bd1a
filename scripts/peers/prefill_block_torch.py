#!/usr/bin/env python3
"""PyTorch peer for Stoke's FP8 prefill: one Llama block in FP8, compiled and CUDA-graphed.

The block a PyTorch user would write for FP8 prefill: RMSNorm, per-row E4M3 quantization of
each projection's input, `torch._scaled_mm` with per-row activation and per-output-channel
weight scales (cuBLAS FP8 rowwise) for q|k|v, o, gate|up and down, rotate-half RoPE, causal
flash SDPA (k and v heads repeated for the query heads, which keeps SDPA on its flash kernel),
SwiGLU, the residual adds. `torch.compile(fullgraph=True)` fuses the elementwise work around
the GEMMs; the compiled block is captured in a CUDA graph and replayed.

Points: one prompt of S tokens through one block, at Llama-3.1-8B's shapes (S = 2048, 512,
8192), then at 70B's and 405B's (S = 2048, then 512 and 8192), in that order; random weights (time does not depend
on values). Each point: the median of 20 graph replays (CUDA events), the block's time, and the
effective TFLOP/s counted as Stoke's prefill benchmark counts them (the four projections per
token, QK and PV over the causal pairs). Each point is printed and the report written as it
lands, so a run cut short keeps what it measured.

usage: prefill_block_torch.py OUT.json [MODEL:S ...]   (default: 8b:2048 8b:512 8b:8192
       70b:2048 405b:2048 70b:512 405b:512 70b:8192 405b:8192)
"""
import json
import statistics
import sys

import torch
import torch.nn.functional as F

SHAPES = {
    "8b": dict(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128),
    "70b": dict(hidden=8192, inter=28672, heads=64, kv_heads=8, head_dim=128),
    "405b": dict(hidden=16384, inter=53248, heads=128, kv_heads=8, head_dim=128),
}
E4M3_MAX = 448.0


def flops(cfg, s):
    h, kvh, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    hid, inter = cfg["hidden"], cfg["inter"]
    per_token = hid * (h + 2 * kvh) * d + h * d * hid + 3 * hid * inter
    pairs = s * (s + 1) // 2
    return 2.0 * (s * per_token + 2 * h * d * pairs)


def quant_rows(x):
    """E4M3 codes of x [S, K] with one f32 scale per row ([S, 1])."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def fp8_weight(n, k):
    """A random [n, k] weight's E4M3 codes, as the column-major [k, n] `_scaled_mm` takes, and
    its per-output-channel scales ([1, n])."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    amax = w.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    codes = (w.float() / scale).to(torch.float8_e4m3fn)
    del w
    return codes.t(), scale.t().contiguous()


def mm(x, w):
    codes, scale = quant_rows(x)
    return torch._scaled_mm(codes, w[0], scale_a=scale, scale_b=w[1], out_dtype=torch.bfloat16)


def rms_norm(x, g, eps=1e-5):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * g.float()).to(torch.bfloat16)


def rope(x, cos, sin):
    """Rotate-half RoPE of x [1, heads, S, d] with cos / sin [S, d / 2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, None], sin[None, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(torch.bfloat16)


def make_block(cfg):
    h, kvh, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    hid, inter = cfg["hidden"], cfg["inter"]
    p = dict(
        g1=torch.ones(hid, device="cuda", dtype=torch.bfloat16),
        g2=torch.ones(hid, device="cuda", dtype=torch.bfloat16),
        qkv=fp8_weight((h + 2 * kvh) * d, hid),
        o=fp8_weight(hid, h * d),
        gate_up=fp8_weight(2 * inter, hid),
        down=fp8_weight(hid, inter),
    )

    def block(x, cos, sin):
        s = x.shape[0]
        qkv = mm(rms_norm(x, p["g1"]), p["qkv"])
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        q = rope(q.view(s, h, d).transpose(0, 1)[None], cos, sin)
        k = rope(k.view(s, kvh, d).transpose(0, 1)[None], cos, sin)
        v = v.view(s, kvh, d).transpose(0, 1)[None]
        k = k.repeat_interleave(h // kvh, dim=1)
        v = v.repeat_interleave(h // kvh, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + mm(a[0].transpose(0, 1).reshape(s, h * d), p["o"])
        gu = mm(rms_norm(x, p["g2"]), p["gate_up"])
        g, u = gu.chunk(2, dim=-1)
        return x + mm(F.silu(g.float()).mul(u.float()).to(torch.bfloat16), p["down"])

    return block


def time_point(name, s):
    cfg = SHAPES[name]
    torch.manual_seed(0)
    block = torch.compile(make_block(cfg), fullgraph=True, dynamic=False)
    d = cfg["head_dim"]
    pos = torch.arange(s, device="cuda", dtype=torch.float32)
    inv = 500000.0 ** (-torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    ang = pos[:, None] * inv[None]
    cos, sin = ang.cos(), ang.sin()
    x = torch.randn(s, cfg["hidden"], device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            block(x, cos, sin)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        y = block(x, cos, sin)
    for _ in range(3):
        graph.replay()
    us = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        us.append(a.elapsed_time(b) * 1e3)
    if not torch.isfinite(y.float()).all():
        raise RuntimeError("non-finite block output")
    med = statistics.median(us)
    return {"model": name, "s": s, "us": med, "us_min": min(us),
            "effective_tflops": flops(cfg, s) / (med * 1e-6) / 1e12}


def main():
    out_path = sys.argv[1]
    points = sys.argv[2:] or [
        "8b:2048", "8b:512", "8b:8192", "70b:2048", "405b:2048",
        "70b:512", "405b:512", "70b:8192", "405b:8192",
    ]
    report = {"peer": "PyTorch FP8 Llama block: rowwise torch._scaled_mm, flash SDPA, "
                      "torch.compile(fullgraph), CUDA graph",
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "points": []}
    for spec in points:
        name, s = spec.split(":")
        try:
            point = time_point(name, int(s))
        except Exception as e:  # out of memory, a missing kernel: report it, go on
            point = {"model": name, "s": int(s), "error": repr(e)}
        print(json.dumps(point), flush=True)
        report["points"].append(point)
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
