#!/usr/bin/env python3
"""Peer baselines for Stoke's RMSNorm kernels: PyTorch eager and torch.compile on this GPU,
with the same run's device-to-device copy bandwidth as the ceiling.

usage: rms_norm_torch.py OUT.json [--rows 1,32,2048,16384] [--hidden 576,4096,8192]
                                  [--dtypes bf16,f32] [--no-compile] [--no-graph] [--dynamic]

Implementations (the `impl` field):
  torch_composition       x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * w
                          (note: for bf16 x this returns f32, as PyTorch promotes)
  torch_rms_norm          torch.nn.functional.rms_norm(x, (hidden,), w, eps)
  compiled_composition    torch.compile of the composition (static shapes unless --dynamic)
  compiled_rms_norm       torch.compile of F.rms_norm
  <impl>@graph            the same calls captured in a CUDA graph and replayed: GPU time
                          without Python/launch overhead
  d2d_copy                a 2 GiB device-to-device copy (rows = hidden = 0)

Timing: CUDA events around batches of calls (each batch >= ~20 ms), median of 7 batches, per
call. Inputs rotate through a pool of views of one large tensor so that the data touched
between two uses of the same input exceeds the L2 (60 MB on H200; read from the device): each
input is cold in L2, as in a model. Outputs come from PyTorch's caching allocator. The graph
variant captures at most 4096 calls, so for the smallest shapes its working set can fit in L2.

Bandwidth (`gbps`, 1e9 bytes/s) counts effective bytes = read x + read gamma + write out, all in
x's dtype, for every implementation (the bf16 composition actually writes f32, i.e. more). The
copy counts bytes read + written.

The JSON written to OUT.json is a list of {rows, hidden, dtype, impl, us, gbps}; the d2d_copy
entry also carries device, torch and triton versions.
"""

import argparse
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F

EPS = 1e-6
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
POOL_MAX_VIEWS = 32768
GRAPH_MAX_CALLS = 4096
BATCH_TARGET_MS = 20.0
SAMPLES = 7


def composition(x, w):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS) * w


def functional(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


class Rotor:
    """Hands out the pool's views in a fixed cycle."""

    def __init__(self, views):
        self.views = views
        self.i = 0

    def next(self):
        v = self.views[self.i]
        self.i = (self.i + 1) % len(self.views)
        return v


def time_per_call_us(run, est_calls=10):
    """Median over SAMPLES batches of (batch time / calls), CUDA events around each batch."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(est_calls):
        run()
    end.record()
    end.synchronize()
    est_ms = max(start.elapsed_time(end) / est_calls, 1e-4)
    n = int(min(max(BATCH_TARGET_MS / est_ms, 5), 50000))
    times = []
    for _ in range(SAMPLES):
        start.record()
        for _ in range(n):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / n)
    return statistics.median(times)


def copy_bandwidth():
    nbytes = 2 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    us = time_per_call_us(lambda: dst.copy_(src), est_calls=3)
    return us, 2 * nbytes / (us * 1e-6) / 1e9


def bench_eager(fn, rotor, w):
    # Warm up over the whole pool once so every view has been touched (and compiled code built).
    for _ in range(max(len(rotor.views), 3)):
        fn(rotor.next(), w)
    torch.cuda.synchronize()
    return time_per_call_us(lambda: fn(rotor.next(), w))


def bench_graph(fn, views, w):
    k = min(len(views), GRAPH_MAX_CALLS)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for j in range(3):
            fn(views[j % len(views)], w)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j in range(k):
            fn(views[j], w)
    graph.replay()
    torch.cuda.synchronize()
    us = time_per_call_us(graph.replay, est_calls=2) / k
    del graph
    return us


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out_json")
    ap.add_argument("--rows", default="1,32,2048,16384")
    ap.add_argument("--hidden", default="576,4096,8192")
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph variants")
    ap.add_argument(
        "--dynamic",
        action="store_true",
        help="torch.compile with default (automatic dynamic) shapes",
    )
    args = ap.parse_args()

    rows_list = [int(v) for v in args.rows.split(",")]
    hidden_list = [int(v) for v in args.hidden.split(",")]
    dtype_names = args.dtypes.split(",")

    torch.manual_seed(0)
    dev = torch.cuda.get_device_properties(0)
    l2 = getattr(dev, "L2_cache_size", 60 << 20) or (60 << 20)
    pool_bytes_target = max(2 * l2, 128 << 20)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    print(
        f"device: {dev.name}, {dev.multi_processor_count} SMs, L2 {l2 >> 20} MiB; "
        f"torch {torch.__version__}, triton {triton_version}"
    )

    impls = {"torch_composition": composition, "torch_rms_norm": functional}
    if not args.no_compile:
        dyn = None if args.dynamic else False
        if not args.dynamic:
            cfg = torch._dynamo.config
            for name in (
                "recompile_limit",
                "cache_size_limit",
                "accumulated_recompile_limit",
                "accumulated_cache_size_limit",
            ):
                if hasattr(cfg, name):
                    setattr(cfg, name, 1024)
        impls["compiled_composition"] = torch.compile(composition, dynamic=dyn)
        impls["compiled_rms_norm"] = torch.compile(functional, dynamic=dyn)

    copy_us, copy_gbps = copy_bandwidth()
    torch.cuda.empty_cache()
    print(f"d2d copy 2 GiB: {copy_us:.1f} us, {copy_gbps:.0f} GB/s (read + write)")
    entries = [
        {
            "rows": 0,
            "hidden": 0,
            "dtype": "u8",
            "impl": "d2d_copy",
            "us": copy_us,
            "gbps": copy_gbps,
            "device": dev.name,
            "torch": torch.__version__,
            "triton": triton_version,
        }
    ]

    header = (
        f"{'rows':>6} {'hidden':>6} {'dtype':>5}  {'impl':<28} {'us':>10} {'GB/s':>8} {'%copy':>6}"
    )
    print(header)
    print("-" * len(header))
    for dname in dtype_names:
        dtype = DTYPES[dname]
        es = torch.tensor([], dtype=dtype).element_size()
        for hidden in hidden_list:
            w = (1.0 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
            for rows in rows_list:
                call_bytes = 2 * rows * hidden * es  # x read + out written
                n_views = int(
                    min(max(2, math.ceil(pool_bytes_target / call_bytes)), POOL_MAX_VIEWS)
                )
                pool = torch.randn(n_views * rows, hidden, device="cuda", dtype=dtype)
                views = [pool[i * rows : (i + 1) * rows] for i in range(n_views)]
                eff_bytes = (2 * rows * hidden + hidden) * es

                # Agreement check between the implementations on one input.
                ref = functional(views[0], w).float()
                for name, fn in impls.items():
                    got = fn(views[0], w).float()
                    err = (got - ref).abs().max().item()
                    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
                    if not err <= tol * max(1.0, ref.abs().max().item()):
                        print(
                            f"warning: {name} differs from F.rms_norm by {err:g} "
                            f"at rows={rows} hidden={hidden} {dname}"
                        )

                for name, fn in impls.items():
                    results = [(name, bench_eager(fn, Rotor(views), w))]
                    if not args.no_graph:
                        results.append((name + "@graph", bench_graph(fn, views, w)))
                    for impl, us in results:
                        gbps = eff_bytes / (us * 1e-6) / 1e9
                        entries.append(
                            {
                                "rows": rows,
                                "hidden": hidden,
                                "dtype": dname,
                                "impl": impl,
                                "us": us,
                                "gbps": gbps,
                            }
                        )
                        pct = 100 * gbps / copy_gbps
                        print(
                            f"{rows:>6} {hidden:>6} {dname:>5}  {impl:<28} "
                            f"{us:>10.2f} {gbps:>8.0f} {pct:>5.0f}%"
                        )
                    sys.stdout.flush()
                del pool, views
                torch.cuda.empty_cache()

    with open(args.out_json, "w") as f:
        json.dump(entries, f, indent=1)
    print(f"wrote {len(entries)} entries to {args.out_json}")


if __name__ == "__main__":
    main()
