#!/usr/bin/env python3
"""Transformers peer for Stoke's serving benchmark: open-loop replay of request schedules.

Each schedule (a JSON file written by Stoke's engine benchmark: {"name", "rate", "seed", "requests":
[{"arrival_s", "prompt": [token ids], "max_tokens"}]}) is replayed on Hugging Face transformers'
in-process continuous batching: every request is submitted at its arrival time (seconds from the
schedule's start, Poisson arrivals; open loop, so a slow engine queues rather than slows the
arrivals), greedy, EOS ignored, max_tokens new tokens. Requests not finished `--time-limit` seconds
after the start are cancelled and not counted (`unfinished`); none is admitted after it.

API: `model.init_continuous_batching(generation_config, continuous_batching_config, workload_hints)`
gives a ContinuousBatchingManager; `warmup()` (pre-captures its CUDA graphs where they are on),
`start()`, then per request `add_request(prompt, request_id=, max_new_tokens=, eos_token_id=-1,
streaming=True, record_timestamps=True)`; `get_result(timeout=)` yields a GenerationOutput per new
token (generated_tokens so far, status, error, and at the end the engine's per-token timestamps);
`cancel_request` at the time limit, `stop()` at the end. Attention, CUDA graphs, compilation and
async batching are transformers' defaults unless a flag sets them. Where the manager is missing,
cannot start or fails (`cb_error` says why; a schedule it failed keeps its `error`), the schedules
from then on are replayed on `model.generate` instead, one request at a time in arrival order
(min_new_tokens = max_new_tokens, a streamer stamping each token): timing only, no batching. `mode`
says which ran.

Metrics per schedule (those of vLLM's benchmark_serving): `completed`; `duration_s`, the schedule's
first arrival to the last token of a completed request; `requests_per_s` and `output_tokens_per_s`
(generated tokens of completed requests) over it; `ttft_ms`, the host time a request's first token
is seen minus its scheduled arrival; `itl_ms`, the gaps between consecutive tokens of a request,
pooled over completed requests; p50/p90/p99 and mean of each. Token times are the host times at
which the replay loop first sees each token; `engine_ttft_ms` and `engine_itl_ms` are the same from
the manager's own timestamps (taken on its thread as each token reaches the host). `short`: completed
requests with fewer tokens than asked; `errors`: requests that failed or were refused. A warm-up of
two short requests through the same path precedes the first schedule. Every failure is caught and
recorded as an `error` field; the JSON is rewritten after each schedule.

usage: engine_torch.py --schedule FILE [--schedule FILE ...] --out OUT.json [--model GGUF]
                       [--device cuda|cpu] [--time-limit S] [continuous batching knobs, see --help]
  --model  a GGUF file, loaded with transformers' GGUF loader (needs the `gguf` and `accelerate`
           packages; transformers 5.17 dequantizes the weights to --dtype, later versions may keep them
           packed). Default: SmolLM2-135M-Instruct.Q4_1.gguf in $STOKE_MODEL_CACHE, else
           $XDG_CACHE_HOME/stoke/models, else ~/.cache/stoke/models
  --attn   attn_implementation at load; the manager makes it a paged one (5.17: paged|sdpa)
"""
import argparse
import json
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: fail fast where transformers looks

import numpy as np  # noqa: E402 - after the environment is set
import torch  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128)
WAKE_S = 0.05  # longest wait for a result before the replay loop looks at the clock again
QUIET_S, DRAIN_S = 0.5, 10.0  # after cancelling: wait for this long without output, at most DRAIN_S


def err(ex):
    return f"{type(ex).__name__}: {ex}"[:2000]


def default_model():
    d = os.environ.get("STOKE_MODEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "stoke", "models")
    return os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")


def load_model(a):
    """(model on a.device in eval mode, seconds to load)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    dtype = getattr(torch, a.dtype)
    kw = {"attn_implementation": a.attn} if a.attn else {}
    t0 = time.perf_counter()
    if a.tiny_random:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**TINY, **kw)).to(dtype)
    else:
        import gguf  # noqa: F401 - transformers reads GGUF files through it; fail early and clearly
        d, name = os.path.split(os.path.abspath(a.model))
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype, **kw)
    model = model.to(a.device).eval()
    if a.device == "cuda":
        torch.cuda.synchronize()
    return model, time.perf_counter() - t0


class Rec:
    """One request of a replay: its scheduled arrival (host perf_counter seconds) and what came back."""

    def __init__(self, arrival, max_tokens):
        self.arrival, self.max_tokens = arrival, max_tokens
        self.seen = []  # host time each token was first seen
        self.engine = None  # the manager's per-token timestamps, when it gives them
        self.done, self.error = False, None


# ---------------------------------------------------------------- continuous batching manager


def cb_config(a):
    """ContinuousBatchingConfig with only the knobs the flags set (and this version knows)."""
    from dataclasses import fields

    from transformers.generation import ContinuousBatchingConfig
    tri = {"on": True, "off": False}
    knobs = {"max_batch_tokens": a.max_batch_tokens, "num_blocks": a.num_blocks,
             "max_requests_per_batch": a.max_requests_per_batch,
             "max_memory_percent": a.max_memory_percent, "use_cuda_graph": tri.get(a.cuda_graph),
             "use_async_batching": tri.get(a.async_batching), "default_compile_level": a.compile_level}
    known = {f.name for f in fields(ContinuousBatchingConfig)}
    return ContinuousBatchingConfig(**{k: v for k, v in knobs.items() if v is not None and k in known})


def start_manager(model, a, schedules):
    """A started ContinuousBatchingManager sized for the largest schedule, and its resolved config."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints
    reqs = [r for s in schedules for r in s["requests"]]
    hints = WorkloadHints(max_prompt_length=max(len(r["prompt"]) for r in reqs),
                          max_generated_length=max(r["max_tokens"] for r in reqs),
                          num_requests=max(len(s["requests"]) for s in schedules))
    gen = GenerationConfig(do_sample=False, eos_token_id=-1)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb_config(a),
                                             workload_hints=hints)
    manager.warmup()
    manager.start()
    resolved = getattr(manager, "continuous_batching_config", None)
    return manager, {k: str(v) for k, v in vars(resolved).items()} if resolved is not None else None


def take(rec, out):
    """Fold one GenerationOutput into its record."""
    now = time.perf_counter()
    rec.seen += [now] * (len(out.generated_tokens) - len(rec.seen))
    if out.error is not None:
        rec.error = str(out.error)
    if out.is_finished():
        rec.done = True
        rec.engine = getattr(out, "timestamps", None)


def replay_cb(manager, requests, limit, tag):
    """Replay requests (dicts) on a running manager: {request id: Rec}."""
    order = sorted(range(len(requests)), key=lambda i: requests[i]["arrival_s"])
    recs, live, nxt = {}, set(), 0
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter() - t0
        if now > limit:
            break
        while nxt < len(order) and requests[order[nxt]]["arrival_s"] <= now:
            r, rid = requests[order[nxt]], f"{tag}-{order[nxt]}"
            recs[rid] = Rec(t0 + r["arrival_s"], r["max_tokens"])
            if manager.add_request(r["prompt"], request_id=rid, max_new_tokens=r["max_tokens"], eos_token_id=-1,
                                   streaming=True, record_timestamps=True) is None:
                recs[rid].error = "refused by the manager"
            else:
                live.add(rid)
            nxt += 1
        if nxt == len(order) and not live:
            break
        if not manager.is_running():
            raise RuntimeError("the generation thread stopped")
        wait = WAKE_S if nxt == len(order) else requests[order[nxt]]["arrival_s"] - now
        out = manager.get_result(timeout=max(0.0, min(WAKE_S, wait, limit - now)))
        while out is not None:
            if out.request_id in recs:
                take(recs[out.request_id], out)
                if recs[out.request_id].done:
                    live.discard(out.request_id)
            out = manager.get_result(timeout=0)
    if live:
        for rid in live:
            manager.cancel_request(rid)
        settle(manager)
    return recs


def settle(manager):
    """Discard outputs until none came for QUIET_S (cancelled requests give none; streaming live ones
    give one a step), at most DRAIN_S, so that the next schedule starts on an idle manager."""
    end = time.perf_counter() + DRAIN_S
    while time.perf_counter() < end and manager.is_running() and manager.get_result(timeout=QUIET_S):
        pass


# ---------------------------------------------------------------- fallback: generate, one request at a time


class Stamper:
    """A generate() streamer: the host time of each new token (batch 1; put() syncs on it)."""

    def __init__(self):
        self.times, self.prompt = [], True

    def put(self, value):
        value.cpu()
        if not self.prompt:
            self.times.append(time.perf_counter())
        self.prompt = False

    def end(self):
        pass


@torch.no_grad()
def replay_generate(model, requests, limit, tag):
    """Replay requests in arrival order, each alone through model.generate: {request id: Rec}."""
    recs = {}
    t0 = time.perf_counter()
    for i in sorted(range(len(requests)), key=lambda i: requests[i]["arrival_s"]):
        r = requests[i]
        if time.perf_counter() - t0 > limit:
            break
        time.sleep(max(0.0, t0 + r["arrival_s"] - time.perf_counter()))
        rec = recs[f"{tag}-{i}"] = Rec(t0 + r["arrival_s"], r["max_tokens"])
        st = Stamper()
        try:
            ids = torch.tensor([r["prompt"]], device=model.device)
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r["max_tokens"],
                           min_new_tokens=r["max_tokens"], do_sample=False, streamer=st,
                           pad_token_id=model.config.pad_token_id or 0)
            rec.seen, rec.done = st.times, True
        except Exception as ex:  # noqa: BLE001 - one failing request is an error, not the end
            rec.error = err(ex)
    return recs


# ---------------------------------------------------------------- metrics


def pct(xs):
    if not xs:
        return None
    p50, p90, p99 = np.percentile(xs, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(xs))}


def latencies(recs, times):
    """(TTFT ms list, pooled ITL ms list) of recs from their token times times(rec)."""
    ttft = [(times(r)[0] - r.arrival) * 1e3 for r in recs]
    itl = [(b - a) * 1e3 for r in recs for a, b in zip(times(r), times(r)[1:])]
    return ttft, itl


def summarize(entry, recs):
    """Fill entry with the metrics of a schedule's replay."""
    done = [r for r in recs.values() if r.done and r.error is None and r.seen]
    tokens = sum(len(r.seen) for r in done)
    first = min((r.arrival for r in recs.values()), default=0.0)
    duration = max((r.seen[-1] for r in done), default=first) - first
    ttft, itl = latencies(done, lambda r: r.seen)
    entry.update(submitted=len(recs), completed=len(done), duration_s=duration, output_tokens=tokens,
                 requests_per_s=len(done) / duration if duration > 0 else None,
                 output_tokens_per_s=tokens / duration if duration > 0 else None,
                 ttft_ms=pct(ttft), itl_ms=pct(itl),
                 unfinished=entry["requests"] - len(done) - sum(r.error is not None for r in recs.values()),
                 errors=sum(r.error is not None for r in recs.values()),
                 short=sum(len(r.seen) < r.max_tokens for r in done))
    stamped = [r for r in done if r.engine and len(r.engine) == len(r.seen)]
    if stamped:
        entry["engine_ttft_ms"], entry["engine_itl_ms"] = map(pct, latencies(stamped, lambda r: r.engine))
    failed = [r.error for r in recs.values() if r.error is not None]
    if failed:
        entry["first_request_error"] = failed[0]


# ---------------------------------------------------------------- driver


class Runner:
    """Replays schedules on the manager while it works, else on generate(); `cb_error` says why not."""

    def __init__(self, model, a, schedules, res):
        self.model, self.res, self.manager = model, res, None
        self.attn = model.config._attn_implementation
        try:
            self.manager, res["cb_config"] = start_manager(model, a, schedules)
        except Exception as ex:  # noqa: BLE001 - no manager in this version, or it failed: fall back
            self.fall_back(ex)

    @property
    def mode(self):
        if self.manager is not None:
            return "ContinuousBatchingManager.add_request(streaming)"
        return "generate (one request at a time)"

    def replay(self, requests, limit, tag):
        if self.manager is None:
            return replay_generate(self.model, requests, limit, tag)
        try:
            return replay_cb(self.manager, requests, limit, tag)
        except Exception as ex:
            self.fall_back(ex)
            raise

    def fall_back(self, ex):
        """Drop the manager (if any) for generate(), the model's attention as it was loaded."""
        self.res["cb_error"] = err(ex)
        print(f"continuous batching dropped ({self.res['cb_error'][:300]}); replaying on generate()")
        self.close()
        if self.model.config._attn_implementation != self.attn:  # a manager that failed to start set a paged one
            self.model.set_attn_implementation(self.attn)

    def close(self):
        if self.manager is not None:
            manager, self.manager = self.manager, None
            try:
                manager.stop(block=True, timeout=30)
            except Exception as ex:  # noqa: BLE001 - record, the results are already in
                self.res["stop_error"] = err(ex)


def warm_up(runner, vocab):
    """Two short requests through the replay path, before the timed schedules; where the manager
    fails them, it is dropped and generate() warmed up instead. Seconds taken."""
    reqs = [{"arrival_s": 0.0, "prompt": [(7 * i + 3) % vocab for i in range(16 + 8 * k)], "max_tokens": 8}
            for k in range(2)]

    def attempt():
        bad = [r.error or "not finished" for r in runner.replay(reqs, 600.0, "warmup").values()
               if not r.done or r.error]
        if bad:
            raise RuntimeError(f"warm-up request failed: {bad[0]}")

    t0, on_manager = time.perf_counter(), runner.manager is not None
    try:
        attempt()
    except Exception as ex:  # noqa: BLE001 - retried on generate() where the manager failed
        if not on_manager:
            raise
        if runner.manager is not None:  # its requests failed, it did not raise
            runner.fall_back(ex)
        attempt()
    return time.perf_counter() - t0


def run_schedule(runner, sched, limit, tag):
    entry = {"name": sched.get("name"), "file": sched["file"], "rate": sched.get("rate"), "seed": sched.get("seed"),
             "requests": len(sched["requests"]), "mode": runner.mode}
    try:
        recs = runner.replay(sched["requests"], limit, tag)
        summarize(entry, recs)
        entry["timed_out"] = entry["unfinished"] > 0
    except Exception as ex:  # noqa: BLE001 - one failing schedule must not lose the others
        entry["error"] = err(ex)
    return entry


def read_schedules(paths):
    """(schedules that parsed, result entries for those that did not)."""
    good, bad = [], []
    for p in paths:
        try:
            with open(p) as f:
                s = json.load(f)
            if not s["requests"]:
                raise ValueError("no requests")
            for r in s["requests"]:
                r["prompt"], r["max_tokens"] = [int(t) for t in r["prompt"]], int(r["max_tokens"])
                r["arrival_s"] = float(r["arrival_s"])
            s["file"] = p
            good.append(s)
        except Exception as ex:  # noqa: BLE001 - a bad file is reported, the others still run
            bad.append({"file": p, "error": err(ex)})
    return good, bad


def fmt(d, k="p50"):
    return f"{d[k]:8.1f}" if d else "       -"


def table(entries):
    print(f"{'schedule':24} {'mode':6} {'done':>9} {'dur s':>7} {'req/s':>6} {'tok/s':>8} "
          f"{'ttft p50':>8} {'ttft p99':>8} {'itl p50':>8} {'itl p99':>8} err")
    for e in entries:
        name = str(e.get("name") or e.get("file"))[:24]
        if "completed" not in e:
            print(f"{name:24} error: {e.get('error', '?')[:100]}")
            continue
        mode = "cb" if e["mode"].startswith("Continuous") else "gen"
        rps, tps = e["requests_per_s"] or 0.0, e["output_tokens_per_s"] or 0.0
        print(f"{name:24} {mode:6} {e['completed']:4}/{e['requests']:<4} {e['duration_s']:7.2f} {rps:6.2f} "
              f"{tps:8.1f} {fmt(e['ttft_ms'])} {fmt(e['ttft_ms'], 'p99')} {fmt(e['itl_ms'])} "
              f"{fmt(e['itl_ms'], 'p99')} {e['errors']}{' (timed out)' if e['timed_out'] else ''}")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", action="append", default=[], help="schedule JSON (repeatable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=default_model(), help="GGUF file")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per schedule")
    ap.add_argument("--attn", help="attn_implementation at load (default: transformers'; e.g. sdpa)")
    ap.add_argument("--max-batch-tokens", type=int)
    ap.add_argument("--num-blocks", type=int)
    ap.add_argument("--max-requests-per-batch", type=int)
    ap.add_argument("--max-memory-percent", type=float)
    ap.add_argument("--cuda-graph", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--async-batching", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--compile-level", type=int, help="ContinuousBatchingConfig.default_compile_level (0-3)")
    ap.add_argument("--tiny-random", action="store_true", help=argparse.SUPPRESS)  # test: a tiny random Llama
    return ap.parse_args()


def main():
    a = parse_args()
    res = {"torch": torch.__version__, "model": "tiny-random" if a.tiny_random else a.model,
           "device": torch.cuda.get_device_name() if a.device == "cuda" and torch.cuda.is_available()
           else platform.processor() or "cpu", "time_limit_s": a.time_limit}

    def dump():
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

    schedules, res["schedules"] = read_schedules(a.schedule)
    runner = None
    try:
        import transformers
        res["transformers"] = transformers.__version__
        print(f"transformers {res['transformers']}, torch {res['torch']} on {res['device']}")
        if not schedules:
            raise ValueError("no schedule to replay")
        model, res["load_s"] = load_model(a)
        print(f"loaded {res['model']} in {res['load_s']:.1f} s")
        runner = Runner(model, a, schedules, res)
        res["warmup_s"] = warm_up(runner, model.config.vocab_size)
    except Exception as ex:  # noqa: BLE001 - no transformers, no model, or no working replay path
        res["error"] = err(ex)
        print(f"error: {res['error'][:500]}")
        schedules = []
    dump()
    for k, s in enumerate(schedules):
        res["schedules"].append(run_schedule(runner, s, a.time_limit, f"s{k}"))
        dump()
    if runner is not None:
        runner.close()
    dump()
    table(res["schedules"])
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
