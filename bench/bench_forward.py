#!/usr/bin/env python3
"""Plain Python-torch decode loop over a libkvcache export (or an HF checkpoint), as the baseline
the C++ runner is compared against (docs/performance.md).

Usage:
  /usr/bin/python3 bench/bench_forward.py --pt qwen.pt [--prompt-len 512] [--new-tokens 32] [--threads 2]
  /usr/bin/python3 bench/bench_forward.py --checkpoint DIR ...     (eager module built from the checkpoint, fp32)

The loop uses only the ABI v1 methods (embed, qkv, rope, finish, head) and a bare concatenating
cache of post-RoPE K and V per layer (torch.cat each step); attention is GQA with fp32 scores and
softmax, causal within the prefill. Prompt: random token ids (fixed seed); decode: greedy.
Reports prefill and decode tokens/s, weight memory and peak RSS; --json prints one JSON line.
A warm-up prefill + decode runs first (TorchScript's profiling executor optimises on first calls).
Not a test: timings depend on the machine and its load.
"""
import argparse
import json
import os
import resource
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

from kvcache_tools.errors import ToolError  # noqa: E402


def attend(q, k, v, q_start: int):
    """q [B,H_q,T,D]; k/v [B,H_kv,S,D] post-RoPE; causal (query i at position q_start + i)."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qf = q.float().view(B, Hkv, g * T, D)  # query heads of one KV head share its keys: no K copy
    scores = torch.matmul(qf, k.float().transpose(-1, -2)).mul_(1.0 / D ** 0.5).view(B, Hkv, g, T, S)
    if T > 1:
        mask = torch.arange(S).unsqueeze(0) > (torch.arange(T).unsqueeze(1) + q_start)
        scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(B, Hkv, g * T, S)
    return torch.matmul(probs, v.float()).view(B, Hq, T, D).to(q.dtype)


class ConcatCache:
    def __init__(self, n_layers):
        self.k = [None] * n_layers
        self.v = [None] * n_layers

    def append(self, layer, k, v):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]


def step(m, n_layers, cache, ids, start):
    T = ids.shape[1]
    pos = torch.arange(start, start + T, dtype=torch.int64)
    h = m.embed(ids)
    for layer in range(n_layers):
        q, k, v = m.qkv(layer, h, pos)
        k, v = cache.append(layer, m.rope(k, pos), v)
        h = m.finish(layer, h, attend(q, k, v, start))
    return m.head(h[:, -1:])  # only the last position's logits are needed


def generate(m, n_layers, prompt, new_tokens):
    cache = ConcatCache(n_layers)
    t0 = time.perf_counter()
    logits = step(m, n_layers, cache, prompt, 0)
    t1 = time.perf_counter()
    out = []
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    for i in range(new_tokens):
        out.append(int(nxt))
        logits = step(m, n_layers, cache, nxt, prompt.shape[1] + i)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
    t2 = time.perf_counter()
    return out, t1 - t0, t2 - t1


def load(args):
    if args.pt:
        from kvcache_tools.export import load_export
        m, _, cfg, info = load_export(args.pt)
        return m, cfg, f"{os.path.basename(args.pt)} (TorchScript, {info['dtype']})"
    from kvcache_tools.checkpoint import load_config, load_weights
    from kvcache_tools.model import KVCacheModel
    cfg, _ = load_config(args.checkpoint)
    weights, _, _ = load_weights(args.checkpoint, cfg, torch.float32)
    m = KVCacheModel(cfg, weights, torch.float32).eval()
    return m, cfg, f"{os.path.basename(os.path.normpath(args.checkpoint))} (eager, float32)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--pt", help="exported .pt (tools/export_torchscript.py)")
    src.add_argument("--checkpoint", help="HF checkpoint dir (eager module, fp32)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        m, cfg, what = load(args)
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n_layers = cfg["num_hidden_layers"]
    weight_bytes = sum(b.numel() * b.element_size() for b in m.buffers())
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg["vocab_size"], (1, args.prompt_len), generator=g)
    with torch.no_grad():
        generate(m, n_layers, prompt[:, :min(16, args.prompt_len)], 3)  # warm-up
        tokens, t_prefill, t_decode = generate(m, n_layers, prompt, args.new_tokens)
    res = {
        "model": what,
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "prefill_tok_s": args.prompt_len / t_prefill,
        "decode_tok_s": args.new_tokens / t_decode if args.new_tokens else None,
        "decode_ms_per_token": 1e3 * t_decode / args.new_tokens if args.new_tokens else None,
        "weight_bytes": weight_bytes,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "first_tokens": tokens[:8],
        "load_average_1min": os.getloadavg()[0],  # other work on the machine skews the timings
    }
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{what}: {args.threads} threads, prompt {args.prompt_len}, {args.new_tokens} new tokens")
        print(f"  prefill {res['prefill_tok_s']:.1f} tok/s ({t_prefill:.3f} s)")
        if args.new_tokens:
            print(f"  decode  {res['decode_tok_s']:.2f} tok/s ({res['decode_ms_per_token']:.1f} ms/token)")
        print(f"  weights {weight_bytes / 2**20:.1f} MiB, peak RSS {res['peak_rss_bytes'] / 2**20:.1f} MiB")
        print(f"  load average (1 min) {res['load_average_1min']:.2f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
