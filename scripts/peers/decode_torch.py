#!/usr/bin/env python3
"""PyTorch peers for Stoke's whole decode step, on the same GPU run.

1. `own_step`: a Llama decode step written in PyTorch with random weights (time does not depend on
   values) at the shapes of Stoke's decode benchmark, compiled and replayed from one CUDA graph. Per
   step: embedding of the token ids; per layer RMSNorm, fused q|k|v projection, RoPE at each row's
   position, k and v written into a static BF16 cache at that position (device indices), SDPA of the
   one query over the cache with a length mask, o projection + residual, RMSNorm, gate|up, SiLU * up,
   down + residual; final norm, bf16 LM head, argmax written into the token ids and positions
   advanced, all on the device, so that replays advance as decoding does. Weights bf16 (F.linear) or
   INT4 (torch._weight_int4pack_mm, bf16 scales and zeros, group 128; 64 for SmolLM2, whose K = 576
   is no multiple of 128); the LM head is bf16 in both. SmolLM2-135M at batch 1, 8, 32, context
   1024; Llama-3.1-8B at batch 1 and 8, context 1024, and batch 32, context 4096. The cache is a K
   and a V tensor [batch, kv_heads, ctx, head_dim] per layer (the [layers, 2, ...] cache split by
   layer, as transformers' StaticCache does, so each compiled layer call writes its inputs in place).
   GQA: the heads/kv_heads queries of a kv head go to SDPA as that head's query rows, so no backend
   needs GQA support and the cache is never repeated.
2. `hf_generate`: transformers `generate` on SmolLM2-135M-Instruct loaded from the GGUF (dequantized
   to bf16; needs the `gguf` package), greedy, "Once upon a time", 128 new tokens (min_new_tokens too),
   batch 1 and 8 (copies of the prompt, left padding): eager with the default dynamic cache, and
   cache_implementation="static" with its default torch.compile.

usage: decode_torch.py OUT.json [--model GGUF] [--quick] [--whole]
  --model  part 2's GGUF (default: SmolLM2-135M-Instruct.Q4_1.gguf in $STOKE_MODEL_CACHE, else
           $XDG_CACHE_HOME/stoke/models, else ~/.cache/stoke/models)
  --quick  part 1 at batch 1 of each model, part 2 at batch 1 (a smoke run)
  --whole  compile the whole step as one function instead of per layer (minutes per point)

Compilation: torch.compile (default mode, dynamic=False, fullgraph=True, Inductor's coordinate-descent
tuning, caches under /tmp) of one layer function per point, called by every layer (regional
compilation); each call ends with the next layer's RMSNorm (or the final norm), so a layer boundary
costs no kernel more than whole-step compilation. The embedding (+ first norm) and the head (+ argmax
and updates) are compiled functions of their own; the step, 2 + layers compiled calls, is captured in
one CUDA graph. Where compiling or capturing fails, the eager step is captured instead (`graph`:
"eager", and `compile_error` says why).

Timing: rows start at position ctx - 24; CUDA events around 20 back-to-back replays of the step's
graph (positions ctx-24 .. ctx-5, reset before each batch outside the timed region), median of 5
batches after a warm one: `us` per step, `tokens_per_s` = batch * 1e6 / us; `compile_s` the 3 warm-up
calls that compile, `capture_s` the capture. `weight_mb`: layer weights (packed INT4 + scales and
zeros, or bf16) and LM head; `cache_mb`: K and V bytes one step's attention reads. Part 2: wall time
of generate() between CUDA syncs, best of two calls after a warm-up call (`warmup_s`: it holds the
static mode's compilation).
"""
import argparse
import gc
import json
import os
import statistics
import time
from collections import namedtuple
from typing import NamedTuple

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/stoke-peers/inductor")
os.environ.setdefault("TRITON_CACHE_DIR", "/tmp/stoke-peers/triton")

import torch  # noqa: E402 - after the cache directories are set
import torch._dynamo  # noqa: E402
import torch._inductor.config  # noqa: E402
import torch.nn.functional as F  # noqa: E402


# group: the INT4 group along K; theta: the RoPE base
Cfg = namedtuple("Cfg", "name vocab hidden inter layers heads kv_heads head_dim tied group theta")
SMOLLM2 = Cfg("smollm2_135m", 49152, 576, 1536, 30, 9, 3, 64, True, 64, 1e5)
LLAMA8B = Cfg("llama31_8b", 128256, 4096, 14336, 32, 32, 8, 128, False, 128, 5e5)
POINTS = [(SMOLLM2, [(1, 1024), (8, 1024), (32, 1024)]), (LLAMA8B, [(1, 1024), (8, 1024), (32, 4096)])]
STEPS, BATCHES, BACK = 20, 5, 24
EPS = 1e-5
PROMPT, NEW_TOKENS = "Once upon a time", 128
REFERENCE = ", the city of Nova Haven was a thriving metropolis"  # independent f32 forward, NOTES.md


class Layer(NamedTuple):
    attn_norm: torch.Tensor
    qkv: object  # bf16 [out, in], or (int4 packed, bf16 scales and zeros [in / group, out, 2])
    o: object
    ffn_norm: torch.Tensor
    gate_up: object
    down: object


Weights = namedtuple("Weights", "embed layers final_norm head")


class State(NamedTuple):
    tokens: torch.Tensor  # int64 [batch]: this step's input ids, the argmax written back
    pos: torch.Tensor  # int64 [batch]: the position this step writes, advanced by the step
    pos0: torch.Tensor
    k: list  # per layer bf16 [batch, kv_heads, ctx, head_dim]
    v: list
    cos: torch.Tensor  # f32 [ctx, head_dim / 2]
    sin: torch.Tensor


def err(ex):
    return f"{type(ex).__name__}: {ex}"[:2000]


def make_weights(c, kind, dev):
    bf = torch.bfloat16

    def dense(n, k):
        return torch.randn(n, k, dtype=bf, device=dev).mul_(0.02)

    def proj(n, k):
        if kind == "bf16":
            return dense(n, k)
        # the packer needs K a multiple of 16 * inner k-tiles: 8 where it can, 4 for K = 576
        inner = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
        return (torch._convert_weight_to_int4pack(q, inner),
                torch.rand(k // c.group, n, 2, dtype=bf, device=dev).mul_(0.01))

    def ones():
        return torch.ones(c.hidden, dtype=bf, device=dev)

    qkv_n = (c.heads + 2 * c.kv_heads) * c.head_dim
    layers = [Layer(ones(), proj(qkv_n, c.hidden), proj(c.hidden, c.heads * c.head_dim), ones(),
                    proj(2 * c.inter, c.hidden), proj(c.hidden, c.inter)) for _ in range(c.layers)]
    embed = dense(c.vocab, c.hidden)
    return Weights(embed, layers, ones(), embed if c.tied else dense(c.vocab, c.hidden))


def weight_bytes(w):
    mats = [m for lw in w.layers for m in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    return sum(t.nbytes for m in mats for t in (m if isinstance(m, tuple) else (m,))) + w.head.nbytes


def make_state(c, batch, ctx, dev):
    shape = (batch, c.kv_heads, ctx, c.head_dim)
    inv = c.theta ** (-torch.arange(0, c.head_dim, 2, dtype=torch.float64, device=dev) / c.head_dim)
    ang = torch.arange(ctx, dtype=torch.float64, device=dev)[:, None] * inv[None, :]
    pos0 = torch.full((batch,), ctx - BACK, dtype=torch.int64, device=dev)
    return State(torch.randint(0, c.vocab, (batch,), device=dev), pos0.clone(), pos0,
                 [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(c.layers)],
                 [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(c.layers)],
                 ang.cos().float(), ang.sin().float())


def linear(x, w, group):
    if isinstance(w, tuple):
        return torch._weight_int4pack_mm(x.contiguous(), w[0], group, w[1])
    return F.linear(x, w)


def rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def rope(x, cos, sin):
    """Rotate-half RoPE of x [batch, heads, head_dim] with cos, sin [batch, 1, head_dim / 2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def embed_fn(tokens, embed, norm):
    h = F.embedding(tokens, embed)
    return h, rms_norm(h, norm)


def layer_fn(h, x, pos, k_cache, v_cache, cos_t, sin_t, w, next_norm, c):
    """One layer on x = its normed input; returns the residual stream and next_norm of it."""
    b, hd, kvh = x.shape[0], c.head_dim, c.kv_heads
    q, k, v = linear(x, w.qkv, c.group).split((c.heads * hd, kvh * hd, kvh * hd), dim=-1)
    cos, sin = cos_t[pos].unsqueeze(1), sin_t[pos].unsqueeze(1)
    # one query token: the heads/kv_heads query heads of a kv head become its query rows
    q = rope(q.view(b, c.heads, hd), cos, sin).view(b, kvh, c.heads // kvh, hd)
    rows = torch.arange(b, device=x.device)
    k_cache[rows, :, pos] = rope(k.view(b, kvh, hd), cos, sin)
    v_cache[rows, :, pos] = v.view(b, kvh, hd)
    live = torch.arange(k_cache.shape[2], device=x.device)[None, :] <= pos[:, None]
    o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=live[:, None, None, :])
    h = h + linear(o.reshape(b, c.heads * hd), w.o, c.group)
    gate, up = linear(rms_norm(h, w.ffn_norm), w.gate_up, c.group).chunk(2, dim=-1)
    h = h + linear(F.silu(gate) * up, w.down, c.group)
    return h, rms_norm(h, next_norm)


def head_fn(x, head, tokens, pos):
    tokens.copy_(torch.argmax(F.linear(x, head), dim=-1))
    pos.add_(1)


PLAIN = (embed_fn, layer_fn, head_fn)


def decode_step(fns, w, st, c):
    embed, layer, head = fns
    h, x = embed(st.tokens, w.embed, w.layers[0].attn_norm)
    for i, lw in enumerate(w.layers):
        nxt = w.layers[i + 1].attn_norm if i + 1 < len(w.layers) else w.final_norm
        h, x = layer(h, x, st.pos, st.k[i], st.v[i], st.cos, st.sin, lw, nxt, c)
    head(x, w.head, st.tokens, st.pos)


def whole_step(w, st, c):
    decode_step(PLAIN, w, st, c)


def make_step(mode, w, st, c):
    def comp(f):
        return torch.compile(f, dynamic=False, fullgraph=True)
    if mode == "regional":
        fns = tuple(comp(f) for f in PLAIN)
        return lambda: decode_step(fns, w, st, c)
    if mode == "whole":
        f = comp(whole_step)
        return lambda: f(w, st, c)
    return lambda: decode_step(PLAIN, w, st, c)


def capture(step, st):
    """3 warm-up steps on a side stream (they compile), then one step captured in a CUDA graph:
    (graph, warm-up seconds, capture seconds)."""
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    st.pos.copy_(st.pos0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    torch.cuda.synchronize()
    return g, t1 - t0, time.perf_counter() - t1


def time_graph(g, st):
    """µs per step: median over BATCHES timed batches (after one warm batch) of STEPS replays."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for i in range(BATCHES + 1):
        st.pos.copy_(st.pos0)
        s.record()
        for _ in range(STEPS):
            g.replay()
        e.record()
        e.synchronize()
        if i:
            out.append(s.elapsed_time(e) * 1e3 / STEPS)
    return statistics.median(out), out


def sdpa_backend(c, st):
    """The backend SDPA picks (eagerly) for this point's attention call."""
    try:
        from torch.nn.attention import SDPBackend
        b, _, ctx, _ = st.k[0].shape
        q = torch.zeros(b, c.kv_heads, c.heads // c.kv_heads, c.head_dim, dtype=torch.bfloat16, device=st.k[0].device)
        live = torch.ones(b, 1, 1, ctx, dtype=torch.bool, device=q.device)
        n = torch._fused_sdp_choice(q, st.k[0], st.v[0], live)
        return {int(v): k for k, v in SDPBackend.__members__.items()}.get(n, n)
    except Exception as ex:  # noqa: BLE001 - informative only
        return err(ex)


def own_point(c, kind, w, batch, ctx, mode, dev):
    entry = {"model": c.name, "weights": kind, "batch": batch, "ctx": ctx, "start_pos": ctx - BACK,
             "group": c.group if kind == "int4" else None, "weight_mb": weight_bytes(w) / 1e6,
             "cache_mb": 2 * c.layers * batch * c.kv_heads * ctx * c.head_dim * 2 / 1e6}
    st = make_state(c, batch, ctx, dev)
    entry["sdpa_backend"] = sdpa_backend(c, st)
    try:
        g, entry["compile_s"], entry["capture_s"] = capture(make_step(mode, w, st, c), st)
        entry["graph"] = mode
    except Exception as ex:  # noqa: BLE001 - fall back to the eager step, say why
        print(f"  compiled step failed ({err(ex)[:300]}); capturing the eager step")
        entry["compile_error"] = err(ex)
        torch._dynamo.reset()
        torch.cuda.synchronize()
        st.pos.copy_(st.pos0)
        try:
            g, entry["compile_s"], entry["capture_s"] = capture(make_step("eager", w, st, c), st)
        except Exception as ex2:  # noqa: BLE001 - report both failures
            raise RuntimeError(f"compiled: {entry['compile_error']}; eager: {err(ex2)}") from ex2
        entry["graph"] = "eager"
    entry["us"], entry["us_batches"] = time_graph(g, st)
    entry["tokens_per_s"] = batch * 1e6 / entry["us"]
    entry["positions_advanced"] = bool((st.pos - st.pos0).eq(STEPS).all().item())
    del g
    return entry


@torch.no_grad()
def own_step(res, quick, mode, dump):
    dev = torch.device("cuda")
    for c, points in POINTS:
        points = points[:1] if quick else points
        for kind in ("bf16", "int4"):
            try:
                w = make_weights(c, kind, dev)
            except Exception as ex:  # noqa: BLE001 - record why, keep the other points
                w, why = None, err(ex)
            for batch, ctx in points:
                head = f"own step {c.name:12} {kind} b {batch:2} ctx {ctx}"
                try:
                    if w is None:
                        raise RuntimeError(f"weights: {why}")
                    entry = own_point(c, kind, w, batch, ctx, mode, dev)
                    print(f"{head}: {entry['us']:8.1f} us/step {entry['tokens_per_s']:9.0f} tokens/s "
                          f"({entry['graph']} graph, compile {entry['compile_s']:.1f} s, "
                          f"sdpa {entry['sdpa_backend']})")
                except Exception as ex:  # noqa: BLE001 - one failing point must not lose the others
                    entry = {"model": c.name, "weights": kind, "batch": batch, "ctx": ctx, "error": err(ex)}
                    print(f"{head}: error {err(ex)[:300]}")
                res.append(entry)
                dump()
                torch._dynamo.reset()
                gc.collect()
                torch.cuda.empty_cache()
            del w
            gc.collect()
            torch.cuda.empty_cache()


def timed_generate(model, enc, kw):
    """(generated ids, seconds) of one generate() call between CUDA syncs."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    ids = model.generate(**enc, **kw)
    torch.cuda.synchronize()
    return ids, time.perf_counter() - t


def hf_generate(path, batches, res, dump):
    out = res["hf_generate"] = {"model": path, "prompt": PROMPT, "new_tokens": NEW_TOKENS, "points": []}
    try:
        import gguf  # noqa: F401 - transformers reads GGUF files through it
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
        out["transformers"] = transformers.__version__
        d, name = os.path.split(os.path.abspath(path))
        t0 = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.bfloat16).to("cuda").eval()
        out["load_s"], out["dtype"] = time.perf_counter() - t0, str(model.dtype)
    except Exception as ex:  # noqa: BLE001 - no gguf package, no file, or a loader error: skip part 2
        out["error"] = err(ex)
        print(f"hf generate: skipped ({out['error'][:300]})")
        return
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    for batch in batches:
        enc = tok([PROMPT] * batch, return_tensors="pt", padding=True).to("cuda")
        for mode in ("eager", "static"):
            p = {"mode": mode, "batch": batch}
            kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                      pad_token_id=tok.pad_token_id)
            if mode == "static":
                kw["cache_implementation"] = "static"
            try:
                _, p["warmup_s"] = timed_generate(model, enc, kw)
                (ids, a), (_, b) = timed_generate(model, enc, kw), timed_generate(model, enc, kw)
                best = min(a, b)
                new = ids[:, enc["input_ids"].shape[1]:]
                p.update(seconds=[a, b], generated=new.shape[1], tokens_per_s=batch * new.shape[1] / best,
                         ms_per_step=best * 1e3 / new.shape[1])
                if batch == 1:
                    p["text"] = tok.decode(new[0], skip_special_tokens=True)
                    p["starts_like_reference"] = p["text"].startswith(REFERENCE)
                print(f"hf generate {mode:6} b {batch}: {p['tokens_per_s']:7.0f} tokens/s "
                      f"{p['ms_per_step']:6.2f} ms/step (warm-up {p['warmup_s']:.1f} s)")
            except Exception as ex:  # noqa: BLE001 - keep the other points
                p["error"] = err(ex)
                print(f"hf generate {mode:6} b {batch}: error {p['error'][:300]}")
            out["points"].append(p)
            dump()
            if "text" in p:
                print(f"  greedy text: {p['text'][:100]!r}")


def default_model():
    d = os.environ.get("STOKE_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "stoke", "models")
    return os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--whole", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    # part 1's settings (gpt-fast's); part 2 runs with transformers' and torch's defaults
    defaults = {"coordinate_descent_tuning": torch._inductor.config.coordinate_descent_tuning}
    torch._inductor.config.coordinate_descent_tuning = True
    torch._inductor.config.fx_graph_cache = True
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    defaults[limit] = getattr(torch._dynamo.config, limit)
    setattr(torch._dynamo.config, limit, 64)
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "quick": a.quick,
           "compile": "whole" if a.whole else "regional", "steps_per_batch": STEPS, "batches": BATCHES,
           "own_step": [], "hf_generate": None}
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        pass
    print(f"torch {res['torch']} on {res['device']}")

    def dump():
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    t0 = time.perf_counter()
    own_step(res["own_step"], a.quick, res["compile"], dump)
    print(f"own step: {time.perf_counter() - t0:.0f} s")
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch._inductor.config.coordinate_descent_tuning = defaults.pop("coordinate_descent_tuning")
    setattr(torch._dynamo.config, limit, defaults[limit])
    hf_generate(a.model, [1] if a.quick else [1, 8], res, dump)
    res["total_s"] = time.perf_counter() - t0
    dump()
    print(f"wrote {a.out} ({res['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
