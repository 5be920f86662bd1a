#!/usr/bin/env python3
"""PyTorch peer for Stoke's packed prefill benchmark (`stoke-gpu prefill`), on the same GPU run.

transformers' LlamaForCausalLM at Llama-3.1-8B's shapes (32 layers, hidden 4096, 32 heads, 8 KV
heads, intermediate 14336, vocab 128256), random bf16 weights (time does not depend on values),
SDPA attention. Each point is the prefill Stoke's benchmark times: one prompt of 512, 2048 and
8192 tokens, and the mixes 2048+7x128 and 8x368. transformers has no packed batch, so a mix runs
as one right-padded batch of its longest prompt with an attention mask (8 x 2048 rows for
2048+7x128), the way a padded server would. The forward computes the logits of each prompt's last
row only (`logits_to_keep=1` after gathering: the head runs on [batch, 1]) and the argmax is read
on the host: time to first token.

Timing: wall time between CUDA syncs around forward + argmax + host copy, median of 3 after a
warm-up; `tokens_per_s` counts the prompts' real tokens. `effective_tflops` uses the same FLOP
count as Stoke's benchmark (projections per real token, causal attention pairs of the real
tokens, the head on one row per prompt), so padding shows as lost throughput.

usage: prefill_torch.py OUT.json
"""
import json
import statistics
import sys
import time

import torch


def mix_name(lens):
    parts, i = [], 0
    while i < len(lens):
        n = 1
        while i + n < len(lens) and lens[i + n] == lens[i]:
            n += 1
        parts.append(str(lens[i]) if n == 1 else f"{n}x{lens[i]}")
        i += n
    return "+".join(parts)


def flops(cfg, lens):
    h, kvh, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    hid, inter, layers, vocab = cfg["hidden"], cfg["inter"], cfg["layers"], cfg["vocab"]
    per_token = layers * (hid * (h + 2 * kvh) * d + h * d * hid + 3 * hid * inter)
    pairs = sum(n * (n + 1) // 2 for n in lens)
    return 2.0 * (sum(lens) * per_token + layers * 2 * h * d * pairs + len(lens) * hid * vocab)


def main():
    out_path = sys.argv[1]
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(layers=32, hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256)
    config = LlamaConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["inter"],
        num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"], head_dim=cfg["head_dim"], rope_theta=500000.0,
        max_position_embeddings=131072, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    # Built in bf16 on the GPU directly (16 GB; an f32 model first would need 32 GB more).
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    report = {"peer": "transformers LlamaForCausalLM, 8B shapes, random bf16, SDPA, padded batches",
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "points": []}
    import transformers
    report["transformers"] = transformers.__version__
    mixes = [[512], [2048], [8192], [2048] + [128] * 7, [368] * 8]
    for lens in mixes:
        longest = max(lens)
        ids = torch.randint(1, cfg["vocab"] - 1, (len(lens), longest), device="cuda")
        mask = torch.zeros(len(lens), longest, dtype=torch.long, device="cuda")
        for b, n in enumerate(lens):
            mask[b, :n] = 1
        last = torch.tensor([n - 1 for n in lens], device="cuda")

        def prefill():
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=True).last_hidden_state
                rows = hidden[torch.arange(len(lens), device="cuda"), last].unsqueeze(1)
                first = model.lm_head(rows).argmax(-1).cpu()
            torch.cuda.synchronize()
            del first
            return (time.perf_counter() - t) * 1e3

        try:
            prefill()
            ms = sorted(prefill() for _ in range(3))
            med = statistics.median(ms)
            point = {"prompts": mix_name(lens), "tokens": sum(lens), "padded_rows": len(lens) * longest,
                     "ms": med, "ms_runs": ms, "tokens_per_s": sum(lens) / med * 1e3,
                     "effective_tflops": flops(cfg, lens) / (med * 1e-3) / 1e12}
        except Exception as e:  # out of memory at the longest point, say: report it, go on
            point = {"prompts": mix_name(lens), "error": repr(e)}
        print(json.dumps(point), flush=True)
        report["points"].append(point)
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
