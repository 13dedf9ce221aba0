"""Shared helpers of the Python tool tests (not a test module itself: no test_ prefix).

Tests run from the repo root (ctest WORKING_DIRECTORY) with /usr/bin/python3; shared data is read
by the path ../shared/data relative to the repo root, and tests skip only when it is absent.
"""
import contextlib
import io
import json
import os
import subprocess
import sys
import unittest

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO, "tools")
SHARED_DATA = os.path.join(REPO, "..", "shared", "data")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

from kvcache_tools.export import load_export  # noqa: E402,F401


def shared(*parts: str) -> str:
    return os.path.join(SHARED_DATA, *parts)


def require_shared_data(test: unittest.TestCase) -> None:
    if not os.path.isdir(SHARED_DATA):
        raise unittest.SkipTest(f"../shared/data not found (looked in {os.path.normpath(SHARED_DATA)}); "
                                f"the real-model tests need it")


def run_tool(script: str, *args: str):
    """Runs tools/<script> in a fresh interpreter; returns (returncode, stdout, stderr)."""
    p = subprocess.run([sys.executable, os.path.join(TOOLS, script), *args], capture_output=True, text=True,
                       cwd=REPO, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    return p.returncode, p.stdout, p.stderr


def run_main(main, *args: str):
    """Calls a tool's main(argv) in-process; returns (returncode, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(args))
        except SystemExit as e:  # argparse errors
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def attention(q, k, v, q_start: int):
    """Reference causal GQA attention written independently of the module: loops over query heads,
    query head h reads KV head h // (H_q / H_kv); fp32 scores and softmax; query i sits at absolute
    position q_start + i and sees keys 0..q_start+i. q [B,H_q,T,D], k/v post-RoPE [B,H_kv,S,D]."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    group = Hq // Hkv
    out = torch.empty(B, Hq, T, D, dtype=torch.float32)
    pos_q = torch.arange(T).unsqueeze(1) + q_start
    mask = torch.arange(S).unsqueeze(0) > pos_q  # [T, S]
    for h in range(Hq):
        s = q[:, h].float() @ k[:, h // group].float().transpose(-1, -2) / (D ** 0.5)
        s = s.masked_fill(mask, float("-inf"))
        out[:, h] = torch.softmax(s, dim=-1) @ v[:, h // group].float()
    return out.to(q.dtype)


def compose(m, cfg, ids):
    """embed -> per layer (qkv, rope(k), attention, finish) -> head. Returns (logits, [k post-RoPE],
    [v]) with per-layer K/V [B, H_kv, T, D]."""
    T = ids.shape[1]
    pos = torch.arange(T, dtype=torch.int64)
    h = m.embed(ids)
    ks, vs = [], []
    for layer in range(cfg["num_hidden_layers"]):
        q, k, v = m.qkv(layer, h, pos)
        k = m.rope(k, pos)
        ks.append(k)
        vs.append(v)
        h = m.finish(layer, h, attention(q, k, v, 0))
    return m.head(h), ks, vs


def greedy(m, prompt, n):
    """Greedy decoding with the cache-free forward (a full forward per token)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(m(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def spm_bpe_encode(tok: dict, text: str):
    """Minimal reference encoder for a SentencePiece-style BPE tokenizer.json (Prepend+Replace
    normaliser, no pre-tokenizer, byte_fallback): lowest-rank adjacent pair merged first, leftmost
    on ties. Good enough to check vocab/merges on plain ASCII text."""
    model = tok["model"]
    vocab = model["vocab"]
    ranks = {}
    for r, mrg in enumerate(model["merges"]):
        a, b = mrg.split(" ") if isinstance(mrg, str) else mrg
        ranks.setdefault((a, b), r)
    s = "\u2581" + text.replace(" ", "\u2581")
    syms = []
    for ch in s:
        if ch in vocab:
            syms.append(ch)
        else:
            syms += [f"<0x{b:02X}>" for b in ch.encode("utf-8")]
    while True:
        best = None
        for i in range(len(syms) - 1):
            r = ranks.get((syms[i], syms[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    return [vocab[x] for x in syms]


def load_golden(model_dir: str):
    with open(os.path.join(model_dir, "golden_once_upon_a_time.json"), "r", encoding="utf-8") as f:
        return json.load(f)


def max_rel_diff(got, ref) -> float:
    """max |got - ref| divided by max(1, max |ref|): fp32 reassociation (our per-head reference
    attention vs the module's batched one) moves logits by ~1e-6 of their scale."""
    return (got - ref).abs().max().item() / max(1.0, ref.abs().max().item())
