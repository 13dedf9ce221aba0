#!/usr/bin/env python3
"""Train the long-context default model of kv_study (issue 34): a small Qwen2-architecture decoder
(GQA, head_dim 64, RoPE theta 1e6) that does the long suite's seven families (`kv_study suite
--suite long`) at 4k-32k tokens, trained on the 2-core CPU machine in under two hours.

Usage:
  /usr/bin/python3 tools/train_long_model.py --generator BUILD/apps/kv_study/kv_study \
      [--out runs/long-model] [--export models/kvstudy-long.pt] [--seed 1234] [--resume] [--smoke]

How a model that trains on sequences of at most a few thousand tokens answers at 32k
(docs/long-model.md gives the measurements behind each choice):
 1. Positional skips (PoSE, arXiv 2309.10400): a training sequence of T tokens stands for a task of
    a virtual length L up to --max-positions: its document gets random gaps in its positions at
    sentence boundaries, so the question and reply sit at position ~L and the evidence anywhere
    before. Every relative distance up to L is seen, at the cost of T tokens.
 2. Attention supervision with dilution: one query head per retrieval kind is trained to attend,
    from the position that predicts a copied token, to its source in the prompt (the evidence the
    generator writes: a code's digit, a variable, a rule word, every colour mention). The loss
    counts the other keys' attention mass F times over (F = --sup-context / keys visible), as a
    context of --sup-context tokens would: the margin learned at T tokens then holds at 32k.
 3. A copying initialisation: the supervised heads start as copy circuits (value = an orthonormal
    projection of the input, o_proj its transpose), a gather head in the layer below addresses
    each copied value by its key, and the output embedding is untied.
 4. A length curriculum: the skills at 48-128 tokens, then longer real sequences with skips.

Pipeline (deterministic for a fixed --seed and torch 1.13 CPU on 2 threads):
 1. Data: `kv_study suite --suite long --count N --seed S --min-context A --max-context B` per
    phase (seeds 5000 + 100*seed + phase: disjoint from the suite seed), cached in OUT/data/.
 2. Tokenizer: a byte-level BPE trained on that corpus (train_default_model's trainer, Qwen2 split
    regex), HF tokenizer.json; ChatML with <|im_end|> as EOS.
 3. Model: Qwen2 (RMSNorm, SwiGLU, q/k/v biases, untied output embedding), AdamW; loss on replies (weight
    1), prompts (--lm-weight; none on random digits), the evidence tokens again (--key-weight),
    plus the supervision above.
 4. Output: an HF dir OUT/hf exported to --export (model ABI v1), then the long suite's control
    arm through kv_study (`run --suite long --configs fp32+full`) at --final-lengths.

Progress goes to stderr; OUT/ckpt.pt every --ckpt-minutes; --resume continues it to the same
result (--stop-after N stops at a known step). --smoke: a tiny model and corpus (seconds), for the tests.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import train_default_model as tdm  # noqa: E402  (tokenizer, BPE, export, scoring: shared)
from kvcache_tools.errors import ToolError  # noqa: E402
from kvcache_tools.safetensors_io import write_text_atomic  # noqa: E402

REPO = tdm.REPO
LONG_FAMILIES = ("needle", "multikey", "multivalue", "vartrack", "aggregation", "instruction", "multiturn")
# steps : min context : max context (approximate tokens of the prompt) : largest virtual length
# (PoSE positions; 0 = no skips) [: families]
DEFAULT_PHASES = "800:48:128:0,500:128:512:40960,500:256:1024:40960,250:1024:3072:40960,70:3072:6144:40960"
DEFAULT_SUP_LAYER = 2
# first token of each copied span / later tokens (induction) / rules and styles / aggregation:
# the first two in different KV groups (each copy with a value projection of its own, as the
# default model's run e5 found)
DEFAULT_SUP_HEADS = "0,2,1,3"
SUP_SLOTS = 4
IM_END, ENDOFTEXT = tdm.IM_END, tdm.ENDOFTEXT


# ---------------------------------------------------------------------------------------------
# Tokens with character offsets
# ---------------------------------------------------------------------------------------------
def encode_offsets(tok: tdm.Tokenizer, text: str) -> Tuple[List[int], List[int]]:
    """tok.encode(text) and the character offset where each token starts (ASCII text: one byte per
    character; NFC leaves ASCII alone)."""
    ids: List[int] = []
    starts: List[int] = []
    at = 0
    for seg in tdm.SPECIAL_SPLIT.split(text):
        if not seg:
            continue
        if seg in tok.special_ids:
            ids.append(tok.special_ids[seg])
            starts.append(at)
            at += len(seg)
            continue
        for w in tdm.pretokenize(seg):
            for t in tok._bpe(w):
                ids.append(t)
                starts.append(at)
                at += len(tok.inv[t])  # byte-level symbols: one per byte
    return ids, starts


def tokens_in(starts: List[int], end: int, lo: int, hi: int) -> List[int]:
    """Indices of the tokens that overlap characters [lo, hi) (starts: token start offsets, end:
    the text's length)."""
    import bisect
    i = max(0, bisect.bisect_right(starts, lo) - 1)
    out = []
    while i < len(starts) and starts[i] < hi:
        nxt = starts[i + 1] if i + 1 < len(starts) else end
        if nxt > lo:
            out.append(i)
        i += 1
    return out


class Seq:
    """One training sequence: ids, per-position loss weights (of predicting token t+1 from t), the
    key-token mask, the supervision entries (query position, target positions, slot), the gather
    entries (query position, target positions: what a keyed copy is matched by) and where
    positional skips may go (token indices that start a sentence of the document)."""
    __slots__ = ("ids", "w", "key", "first", "sup", "gather", "cuts", "family")

    def __init__(self, ids, w, key, first, sup, gather, cuts, family):
        self.ids, self.w, self.key, self.first, self.sup = ids, w, key, first, sup
        self.gather, self.cuts, self.family = gather, cuts, family


# The keyed sentences of the long suite's grammar (long_suite.cpp) and their questions: what the
# copied token is addressed by.
KEYED = {
    "multikey": re.compile(r"The access code for the (?P<key>[a-z]+) is (?P<val>[0-9])"),
    "multivalue": re.compile(r"The (?P<ord>first|second|third|fourth) access code for the (?P<key>[a-z]+) is (?P<val>[0-9])"),
    "vartrack": re.compile(r"Let (?P<key>[a-z]+) be (?P<val>[a-z0-9])"),
}
QUESTION_KEY = re.compile(r"(?:for the|value of) (?P<key>[a-z]+)\?$")


def gather_targets(task: Dict, full: str, starts: List[int], n_prompt_chars: int, sup) -> List[Tuple[int, List[int]]]:
    """The layer-0 'gather' supervision of the keyed families: the first token of a keyed value
    (a code's first digit, a variable's value) attends to the words that address it in its
    sentence (the key, and the ordinal of a multivalue code), and the reply position that
    copies a value attends to the words that address it there (the question's key, the ordinal or
    the variable the reply just wrote). A copy head one layer up then matches the two."""
    fam = task["family"]
    if fam not in KEYED:
        return []
    end = len(full)
    out = []

    def tok_at(c):
        t = tokens_in(starts, end, c, c + 1)
        return t[0] if t else None
    for m in KEYED[fam].finditer(full, 0, n_prompt_chars):
        v = tok_at(m.start("val"))
        tg = [tok_at(m.start(g)) for g in ("ord", "key") if g in m.groupdict() and m.group(g)]
        if v is not None and all(t is not None for t in tg):
            out.append((v, sorted(set(tg))))
    prompt = full[:n_prompt_chars]
    qm = QUESTION_KEY.search(prompt[:prompt.rfind(tdm.IM_END)])
    q_key = tok_at(qm.start("key")) if qm else None
    reply = full[n_prompt_chars:]
    for q, targets, slot in sup:
        if slot != 0:
            continue  # only the first token of a copied span is addressed by a key
        c = starts[q + 1] - n_prompt_chars  # the copied token's offset in the reply
        tg = []
        if fam == "vartrack":
            w = re.search(r"([a-z]+) is ?$", reply[:c])  # "... delta is" -> delta
            if w:
                tg.append(tok_at(n_prompt_chars + w.start(1)))
        else:
            if q_key is not None:
                tg.append(q_key)
            if fam == "multivalue":
                w = re.search(r"(first|second|third|fourth) $", reply[:c])
                if w:
                    tg.append(tok_at(n_prompt_chars + w.start(1)))
        tg = [t for t in tg if t is not None]
        if tg:
            out.append((q, sorted(set(tg))))
    return out


def encode_task(tok: tdm.Tokenizer, task: Dict, lm_weight: float) -> Seq:
    msgs = task["messages"]
    offsets: List[int] = []
    text = ""
    for m in msgs:
        text += f"{tdm.IM_START}{m['role']}\n"
        offsets.append(len(text))
        text += m["content"] + f"{IM_END}\n"
    text += f"{tdm.IM_START}assistant\n"
    n_prompt_chars = len(text)
    answer = task["answer"]
    full = text + answer + IM_END
    ids, starts = encode_offsets(tok, full)
    n = len(ids)
    # the reply starts at the first token at or after the prompt's end (special-token split keeps it)
    n_prompt = next(i for i, s in enumerate(starts) if s >= n_prompt_chars)
    w = np.full(n, lm_weight, dtype=np.float32)
    w[n_prompt - 1:] = 1.0  # positions that predict the reply and its <|im_end|>
    # earlier assistant turns are part of the dialogue: weight 1 on their contents
    for mi, m in enumerate(msgs):
        if m["role"] == "assistant":
            for j in tokens_in(starts, len(full), offsets[mi], offsets[mi] + len(m["content"]) + len(IM_END)):
                if j > 0:
                    w[j - 1] = 1.0
    # random digits of the prompt (codes) are unpredictable: no LM loss on them
    for j in range(1, n_prompt):
        if tok.inv[ids[j]].isdigit():
            w[j - 1] = 0.0
    w[-1] = 0.0
    key = np.zeros(n, dtype=np.float32)
    first = np.zeros(n, dtype=np.float32)  # the first token of each copied span (a code's first digit)
    sup: List[Tuple[int, List[int], int]] = []
    fam = task["family"]
    for ev in task.get("evidence", []):
        rb, re_ = ev["reply"]
        reply_toks = tokens_in(starts, len(full), n_prompt_chars + rb, n_prompt_chars + re_)
        src = []
        for m_i, b, e in ev["src"]:
            toks = tokens_in(starts, len(full), offsets[m_i] + b, offsets[m_i] + e)
            if toks:
                src.append(toks[0])
        if not reply_toks or not src:
            continue
        for j in reply_toks:
            key[j - 1] = 1.0
        if rb == 0 or answer[rb - 1] in " ,":
            first[reply_toks[0] - 1] = 1.0
        if fam in ("needle", "multikey", "multivalue", "vartrack"):
            # slot 0: the first token of a copied span; slot 1: a later one (an induction step)
            slot = 1 if first[reply_toks[0] - 1] == 0 else 0
        else:
            slot = 3 if fam == "aggregation" else 2  # aggregation / rules and styles
        sup.append((reply_toks[0] - 1, sorted(set(src)), slot))
    # sentence starts inside the document: after the first user turn's start (the rule turn of a
    # multiturn task stays before the gaps), before the question (or the last user turn)
    last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    first_user = min(i for i, m in enumerate(msgs) if m["role"] == "user")
    q = task.get("question")
    doc_lo = offsets[first_user] + (len(msgs[first_user]["content"]) if fam == "multiturn" else 0)
    doc_hi = offsets[q["message"]] + q["begin"] if q else offsets[last_user]
    cuts = [j for j in range(1, n_prompt) if doc_lo <= starts[j] < doc_hi
            and tok.inv[ids[j - 1]].endswith((".", "?", "!", "\u010a"))]
    gather = gather_targets(task, full, starts, n_prompt_chars, sup)
    return Seq(np.array(ids, dtype=np.int64), w, key, first, sup, gather, np.array(cuts, dtype=np.int64), fam)


def virtual_positions(n: int, cuts: np.ndarray, virtual_len: int, rng: np.random.Generator) -> np.ndarray:
    """Positions 0..n-1 with the gap virtual_len - n spread over random cut points (a random
    number of them, Dirichlet weights), so that the last position is virtual_len - 1."""
    pos = np.arange(n, dtype=np.int64)
    extra = virtual_len - n
    if extra <= 0 or len(cuts) == 0:
        return pos
    k = int(min(len(cuts), rng.integers(1, 33)))
    chosen = np.sort(rng.choice(cuts, size=k, replace=False))
    share = rng.dirichlet(np.ones(k))
    gaps = np.floor(share * extra).astype(np.int64)
    gaps[-1] += extra - gaps.sum()
    add = np.zeros(n, dtype=np.int64)
    for c, g in zip(chosen, gaps):
        add[c:] += g
    return pos + add


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
class Layer(torch.nn.Module):
    def __init__(self, c: Dict):
        super().__init__()
        d, D, H, Hk, I = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], \
            c["intermediate_size"]
        self.H, self.Hk, self.D = H, Hk, D
        self.input_layernorm = tdm.RMSNorm(d, c["rms_norm_eps"])
        self.q_proj = torch.nn.Linear(d, H * D, bias=True)
        self.k_proj = torch.nn.Linear(d, Hk * D, bias=True)
        self.v_proj = torch.nn.Linear(d, Hk * D, bias=True)
        self.o_proj = torch.nn.Linear(H * D, d, bias=False)
        self.post_attention_layernorm = tdm.RMSNorm(d, c["rms_norm_eps"])
        self.gate_proj = torch.nn.Linear(d, I, bias=False)
        self.up_proj = torch.nn.Linear(d, I, bias=False)
        self.down_proj = torch.nn.Linear(I, d, bias=False)
        self.sup = None      # (rows, query pos, head, targets [N, K], target mask [N, K], log F [N])
        self.sup_loss = None

    def qkv(self, h, cos, sin):
        B, T, _ = h.shape
        x = self.input_layernorm(h)
        q = self.q_proj(x).view(B, T, self.H, self.D).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.Hk, self.D).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.Hk, self.D).transpose(1, 2)
        q = (q * cos + tdm.rotate_half(q) * sin) * (1.0 / math.sqrt(self.D))
        k = k * cos + tdm.rotate_half(k) * sin
        return q, k, v

    def finish(self, h, o):
        B, T = h.shape[0], h.shape[1]
        o = o.reshape(B, self.H, T, self.D).transpose(1, 2).reshape(B, T, self.H * self.D)
        h = h + self.o_proj(o)
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def supervised_loss(self, q, k):
        """Per supervised query n: -mean over its targets t of log(e^s_t / (sum_targets e^s +
        F_n * sum_others e^s)), s the scores of query head hd[n] at row b[n], position qp[n] over
        the keys up to qp[n]. Targets uniform: a set (every colour mention) is attended evenly."""
        b, qp, hd, tg, tm, logf = self.sup
        qv = q[b, hd, qp]                                           # [N, D]
        kv = k[b, hd // (self.H // self.Hk)]                        # [N, T, D]
        s = torch.einsum("nd,ntd->nt", qv, kv)
        t = torch.arange(s.shape[1])
        s = s.masked_fill(t[None, :] > qp[:, None], float("-inf"))
        is_t = torch.zeros_like(s, dtype=torch.bool)
        is_t.scatter_(1, tg, tm)
        lse_t = torch.logsumexp(s.masked_fill(~is_t, float("-inf")), dim=1)
        lse_o = torch.logsumexp(s.masked_fill(is_t, float("-inf")), dim=1) + logf
        z = torch.logaddexp(lse_t, lse_o)
        st = s.gather(1, tg)
        mean_t = (st * tm).sum(1) / tm.sum(1)
        return z - mean_t

    def forward(self, h, cos, sin, chunk: int):
        q, k, v = self.qkv(h, cos, sin)
        B, T = h.shape[0], h.shape[1]
        g = self.H // self.Hk
        q4 = q.reshape(B * self.Hk, g, T, self.D)
        kt = k.reshape(B * self.Hk, T, self.D).transpose(1, 2)
        vf = v.reshape(B * self.Hk, T, self.D)
        outs = []
        for q0 in range(0, T, chunk):
            q1 = min(T, q0 + chunk)
            qg = q4[:, :, q0:q1].reshape(B * self.Hk, g * (q1 - q0), self.D)
            mask = torch.zeros(q1 - q0, q1).masked_fill(
                torch.arange(q1)[None, :] > torch.arange(q0, q1)[:, None], float("-inf")).repeat(g, 1)
            p = torch.softmax(torch.baddbmm(mask, qg, kt[:, :, :q1]), dim=-1)
            outs.append(torch.bmm(p, vf[:, :q1]).view(B * self.Hk, g, q1 - q0, self.D))
        if self.sup is not None:
            self.sup_loss = self.supervised_loss(q, k)
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return self.finish(h, o)


class LongQwen2(torch.nn.Module):
    def __init__(self, c: Dict):
        super().__init__()
        self.c = c
        self.embed_tokens = torch.nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = torch.nn.ModuleList([Layer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = tdm.RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        # Untied output embedding (--tie 0): with tied embeddings the reply's loss, while the copy
        # is still at chance, pulls the digits' shared embeddings together (cosine 0.65-0.74 after
        # 150 steps), and the copy head's values then cannot tell the digits apart
        # (docs/long-model.md).
        self.lm_head = None if c["tie_word_embeddings"] else torch.nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        D = c["head_dim"]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
        self.register_buffer("inv_freq", inv, persistent=False)

    def init_weights(self, gen: torch.Generator, embed_std: float = 0.02, copy_heads: Sequence[Tuple[int, int]] = ()):
        """The default model's init (std 0.02), the input embedding at `embed_std`, an untied
        output embedding equal to the input one, and for each (layer, query head) in copy_heads a
        copying OV circuit: the head's KV group's value projection is a random orthonormal
        projection Q^T of the normalised input (d -> D) and the head's slice of o_proj is Q (D ->
        d) (lm_head starts as the input embedding scaled to std 0.02), so that attending to a token writes (the projection of) its own embedding into the
        residual stream, which the output embedding reads back as that token. Supervision then
        only has to teach where to attend; without it the value path first learns a shared
        "a digit comes" feature and the copy sits at chance for hundreds of steps
        (docs/long-model.md)."""
        tdm.Qwen2Small.init_weights(self, gen)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.randn(self.embed_tokens.weight.shape, generator=gen) * embed_std)
            if self.lm_head is not None:  # aligned with the input embedding, at the usual 0.02 scale
                self.lm_head.weight.copy_(self.embed_tokens.weight * (0.02 / embed_std))
            groups: Dict[Tuple[int, int], torch.Tensor] = {}
            for li, h in copy_heads:
                layer = self.layers[li]
                d, D = layer.v_proj.weight.shape[1], layer.D
                kv = h // (layer.H // layer.Hk)
                if (li, kv) not in groups:  # one projection per KV group: its query heads share the values
                    q, _ = torch.linalg.qr(torch.randn(d, D, generator=gen))  # [d, D], orthonormal columns
                    groups[(li, kv)] = q
                    layer.v_proj.weight[kv * D:(kv + 1) * D] = q.t()
                layer.o_proj.weight[:, h * D:(h + 1) * D] = groups[(li, kv)]

    def hf_state(self) -> Dict[str, torch.Tensor]:
        out = tdm.Qwen2Small.hf_state(self)
        if self.lm_head is not None:
            out["lm_head.weight"] = out.pop("model.lm_head.weight")
        return out

    def logits(self, h):
        return self.lm_head(self.norm(h)) if self.lm_head is not None else F.linear(self.norm(h), self.embed_tokens.weight)

    def rope(self, positions):
        """positions [B, T] int64 -> cos, sin [B, 1, T, D] (fp32, as the export computes them)."""
        ang = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((ang, ang), dim=-1)[:, None]
        return emb.cos(), emb.sin()

    def forward(self, ids, positions, chunk: int = 256):
        cos, sin = self.rope(positions)
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h, cos, sin, chunk)
        return self.logits(h)

    @torch.no_grad()
    def generate(self, prompt: List[int], max_new: int, stop: Sequence[int], chunk: int = 512) -> List[int]:
        """Greedy decoding with a float32 K/V cache (evaluation during training)."""
        ks: List[List[torch.Tensor]] = [[] for _ in self.layers]
        vs: List[List[torch.Tensor]] = [[] for _ in self.layers]

        def step(ids: List[int], p0: int):
            t = torch.tensor([ids], dtype=torch.int64)
            cos, sin = self.rope(torch.arange(p0, p0 + len(ids))[None])
            h = self.embed_tokens(t)
            for li, layer in enumerate(self.layers):
                q, k, v = layer.qkv(h, cos, sin)
                ks[li].append(k)
                vs[li].append(v)
                K, V = torch.cat(ks[li], dim=2), torch.cat(vs[li], dim=2)
                ks[li], vs[li] = [K], [V]
                g = layer.H // layer.Hk
                Kr = K.repeat_interleave(g, dim=1)
                Vr = V.repeat_interleave(g, dim=1)
                s = torch.matmul(q, Kr.transpose(-1, -2))
                T, S = q.shape[2], K.shape[2]
                if T > 1:
                    qi = torch.arange(T)[:, None] + (S - T)
                    s = s.masked_fill(torch.arange(S)[None, :] > qi, float("-inf"))
                h = layer.finish(h, torch.matmul(torch.softmax(s, dim=-1), Vr))
            return self.logits(h[:, -1])[0]

        logits = None
        for a in range(0, len(prompt), chunk):
            logits = step(prompt[a:a + chunk], a)
        out: List[int] = []
        p = len(prompt)
        while True:
            nxt = int(logits.argmax())
            out.append(nxt)
            if nxt in stop or len(out) >= max_new:
                return out
            logits = step([nxt], p)
            p += 1


def model_config(args, vocab_size: int, tok: tdm.Tokenizer) -> Dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "intermediate_size": args.intermediate,
        "vocab_size": vocab_size,
        "max_position_embeddings": args.max_positions,
        "rope_theta": args.rope_theta,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": bool(args.tie),
        "attention_bias": True,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "rope_scaling": None,
        "torch_dtype": "float32",
        "bos_token_id": tok.special_ids[ENDOFTEXT],
        "eos_token_id": tok.special_ids[IM_END],
    }


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def parse_phases(spec: str) -> List[Tuple[int, int, int, int, str]]:
    """'steps:min_ctx:max_ctx:virtual[:fam+fam],...' -> [(steps, min, max, virtual, families)]."""
    out = []
    for p in spec.split(","):
        f = p.split(":")
        if len(f) not in (4, 5):
            raise ToolError(f"bad phase {p!r}: expected steps:min_ctx:max_ctx:virtual_len[:family+family]")
        try:
            s, lo, hi, virt = (int(x) for x in f[:4])
        except ValueError:
            raise ToolError(f"bad phase {p!r}: steps, min_ctx, max_ctx and virtual_len must be integers") from None
        fams = f[4].split("+") if len(f) == 5 and f[4] else []
        for fam in fams:
            if fam not in LONG_FAMILIES:
                raise ToolError(f"bad phase {p!r}: unknown family {fam!r} (expected {', '.join(LONG_FAMILIES)})")
        if s <= 0 or lo > hi or lo < 48:
            raise ToolError(f"bad phase {p!r}: need steps > 0 and 48 <= min_ctx <= max_ctx")
        if virt and virt < hi:
            raise ToolError(f"bad phase {p!r}: virtual_len {virt} is below max_ctx {hi} (0: no skips)")
        out.append((s, lo, hi, virt, ",".join(fams)))
    return out


def generate_tasks(gen: str, path: str, args: List[str]) -> List[Dict]:
    if not os.path.exists(path):
        tmp = path + ".tmp"
        cmd = [gen, "suite"] + args + ["--out", tmp]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise ToolError(f"task generator failed ({' '.join(cmd)}): {r.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def make_batches(seqs: List[Seq], budget: int, rng: np.random.Generator) -> List[List[int]]:
    """Packs sequences of similar length: rows * max_len <= budget (a longer sequence alone)."""
    order = rng.permutation(len(seqs))
    batches = []
    for s in range(0, len(order), 256):
        win = sorted(order[s:s + 256], key=lambda i: len(seqs[i].ids))
        cur: List[int] = []
        for i in win:
            n = len(seqs[i].ids)
            if cur and (len(cur) + 1) * n > budget:
                batches.append(cur)
                cur = []
            cur.append(int(i))
        if cur:
            batches.append(cur)
    return [batches[i] for i in rng.permutation(len(batches))]


def collate(seqs: List[Seq], idx: List[int], virt: int, max_pos: int, rng: np.random.Generator,
            sup_context: int, heads: Sequence[int], gather_head: int = 0):
    T = max(len(seqs[i].ids) for i in idx)
    B = len(idx)
    ids = np.zeros((B, T), dtype=np.int64)
    pos = np.zeros((B, T), dtype=np.int64)
    w = np.zeros((B, T), dtype=np.float32)
    key = np.zeros((B, T), dtype=np.float32)
    first = np.zeros((B, T), dtype=np.float32)
    sup, gather = [], []
    for r, i in enumerate(idx):
        s = seqs[i]
        n = len(s.ids)
        ids[r, :n], w[r, :n], key[r, :n], first[r, :n] = s.ids, s.w, s.key, s.first
        vl = n
        if virt > n and rng.random() < 0.85:
            vl = int(round(math.exp(rng.uniform(math.log(n), math.log(virt)))))
        p = virtual_positions(n, s.cuts, min(vl, max_pos), rng)
        pos[r, :n] = p
        pos[r, n:] = p[-1] + 1 + np.arange(T - n)
        for q, tg, slot in s.sup:
            # F: the other keys' mass counted as in a context of sup_context tokens
            f = max(1.0, sup_context / (q + 1)) if sup_context > 0 else 1.0
            sup.append((r, q, heads[slot], tg, math.log(f), slot))
        for q, tg in s.gather:  # local: no dilution
            gather.append((r, q, gather_head, tg, 0.0, 0))
    return (torch.from_numpy(ids), torch.from_numpy(pos), torch.from_numpy(w), torch.from_numpy(key),
            torch.from_numpy(first), sup, gather)


def sup_tensors(sup):
    if not sup:
        return None
    K = max(len(s[3]) for s in sup)
    tg = torch.zeros((len(sup), K), dtype=torch.int64)
    tm = torch.zeros((len(sup), K), dtype=torch.bool)
    for n, s in enumerate(sup):
        tg[n, :len(s[3])] = torch.tensor(s[3])
        tm[n, :len(s[3])] = True
    b = torch.tensor([s[0] for s in sup])
    qp = torch.tensor([s[1] for s in sup])
    hd = torch.tensor([s[2] for s in sup])
    logf = torch.tensor([s[4] for s in sup], dtype=torch.float32)
    return b, qp, hd, tg, tm, logf


def evaluate(model: LongQwen2, tok: tdm.Tokenizer, tasks: Sequence[Dict]) -> Dict:
    stop = [tok.special_ids[IM_END], tok.special_ids[ENDOFTEXT]]
    rows = []
    for t in tasks:
        prompt = tok.encode(tdm.render_chatml(t["messages"], True))
        out = model.generate(prompt, int(t["max_new_tokens"]), stop)
        text = tok.decode(out)
        rows.append({"id": t["id"], "family": t["family"], "depth_pct": t["depth_pct"],
                     "context_target": t["context_target"], "prompt_tokens": len(prompt),
                     "pass": tdm.score_output(t["rule"], text), "output": text})
    return tdm.summarize(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generator", help="kv_study binary (task generator); default: $KVCACHE_BUILD_DIR or "
                                        "build/apps/kv_study/kv_study")
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "long-model"), help="work dir")
    ap.add_argument("--export", default=os.path.join(REPO, "models", "kvstudy-long.pt"), help="exported model")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-seed", type=int, default=4321, help="seed of the periodic evaluation tasks")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    ap.add_argument("--export-only", action="store_true", help="export OUT/ckpt.pt as it is (and --final-lengths)")
    ap.add_argument("--init-from", help="experiments: start from the weights of this OUT/ckpt.pt (same tokenizer: copy "
                                        "its tokenizer.json into --out), with a fresh optimizer at step 0")
    ap.add_argument("--smoke", action="store_true", help="tiny model and corpus (seconds), for the tests")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--embed-std", type=float, default=0.3,
                    help="init std of the input embedding (0.02 elsewhere): token identity dominates the residual "
                         "stream of the first layers, so a copy head's values tell the tokens apart")
    ap.add_argument("--first-key-only", type=int, default=1,
                    help="1: the --key-only-steps warm-up trains the first token of each copied span only (a "
                         "code's first digit, ...): the later digits, at chance, would teach 'a digit follows a "
                         "digit' and pull the digits' embeddings together")
    ap.add_argument("--copy-init", type=int, default=1,
                    help="1: initialise the supervised heads as copying OV circuits (init_weights)")
    ap.add_argument("--tie", type=int, default=0, help="1: tie the output embedding to the input one (0: untied)")
    ap.add_argument("--max-positions", type=int, default=40960)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--phases", default=DEFAULT_PHASES,
                    help="curriculum 'steps:min_ctx:max_ctx:virtual_len[:family+family],...' (contexts in approx "
                         "tokens; virtual_len: positional skips up to that length, 0 = none)")
    ap.add_argument("--tokens-per-batch", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--lm-weight", type=float, default=0.1)
    ap.add_argument("--key-weight", type=float, default=1.0)
    ap.add_argument("--key-only-steps", type=int, default=0,
                    help="warm-up: for the first N steps only the evidence tokens of the replies carry LM loss "
                         "(plus the supervision), as the default model's key-token warm-up")
    ap.add_argument("--sup", type=float, default=1.0, help="weight of the attention supervision (0: off)")
    ap.add_argument("--sup-layer", type=int, default=DEFAULT_SUP_LAYER)
    ap.add_argument("--sup-heads", default=DEFAULT_SUP_HEADS,
                    help="query heads A,B,C,D supervised for the first token of a copied span, the later ones, "
                         "the rules and styles, and the aggregation")
    ap.add_argument("--gather", type=float, default=1.0,
                    help="weight (x --sup) of the gather supervision of the keyed families (gather_targets; 0: off)")
    ap.add_argument("--gather-layer", type=int, default=0)
    ap.add_argument("--gather-head", type=int, default=0)
    ap.add_argument("--sup-context", type=int, default=32768,
                    help="context the supervision's dilution simulates in the phases with positional skips (F = this "
                         "/ keys visible; 0: none)")
    ap.add_argument("--chunk", type=int, default=256, help="query rows per chunk of the training attention")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-lengths", default="1k,2k")
    ap.add_argument("--final-lengths", default="4k,8k,16k,32k")
    ap.add_argument("--final-reps", type=int, default=5)
    ap.add_argument("--ckpt-minutes", type=float, default=5.0)
    ap.add_argument("--stop-after", type=int, default=0,
                    help="stop after this many steps in all, writing OUT/ckpt.pt (as an interruption would, "
                         "but at a known step); --resume continues, with these --phases or others")
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args(argv)
    try:
        args.sup_heads = [int(x) for x in args.sup_heads.split(",")]
        if len(args.sup_heads) != SUP_SLOTS:
            raise ValueError
    except ValueError:
        print(f"error: --sup-heads {args.sup_heads!r}: expected four head indices 'A,B,C,D'", file=sys.stderr)
        return 2
    if args.smoke:
        args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate = 64, 2, 2, 1, 128
        args.phases, args.tokens_per_batch, args.warmup = "4:96:200:0,3:200:400:4096", 2048, 2
        args.eval_every, args.log_every, args.vocab, args.max_positions = 0, 1, 600, 4096
        args.sup_layer, args.sup_heads, args.final_lengths, args.eval_lengths = 1, [0, 1, 1, 0], "", "512"
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    try:
        return run(args, t0)
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args, t0: float) -> int:
    log = lambda m: tdm.log(m, t0)  # noqa: E731
    gen = tdm.find_generator(args.generator)
    phases = parse_phases(args.phases)
    if not 0 <= args.sup_layer < args.layers:
        raise ToolError(f"--sup-layer {args.sup_layer}: the model has {args.layers} layers")
    if any(not 0 <= h < args.heads for h in args.sup_heads):
        raise ToolError(f"--sup-heads {args.sup_heads}: the model has {args.heads} query heads")
    if args.gather > 0 and not (0 <= args.gather_layer < args.sup_layer and 0 <= args.gather_head < args.heads):
        raise ToolError(f"--gather-layer {args.gather_layer} / --gather-head {args.gather_head}: expected a head of a "
                        f"layer below --sup-layer {args.sup_layer}")
    if args.stop_after < 0:
        raise ToolError(f"--stop-after {args.stop_after}: expected a number of steps >= 0 (0: train to the end)")
    if any(p[3] > args.max_positions for p in phases):
        raise ToolError(f"a phase's virtual length exceeds --max-positions {args.max_positions}")
    os.makedirs(os.path.join(args.out, "data"), exist_ok=True)
    total = sum(p[0] for p in phases)

    # ---- data ----
    phase_tasks = []
    for pi, (steps, lo, hi, virt, fams) in enumerate(phases):
        avg = 0.5 * (lo + hi) + 16
        count = int(math.ceil(steps * args.tokens_per_batch * 0.85 / avg))
        seed = 5000 + 100 * args.seed + pi
        tag = "-" + fams.replace(",", "+") if fams else ""
        path = os.path.join(args.out, "data", f"long-s{seed}-n{count}-c{lo}-{hi}{tag}.jsonl")
        extra = ["--families", fams] if fams else []
        phase_tasks.append(generate_tasks(gen, path, ["--suite", "long", "--count", str(count), "--seed", str(seed),
                                                      "--min-context", str(lo), "--max-context", str(hi)] + extra))
        log(f"phase {pi}: {len(phase_tasks[-1])} tasks (seed {seed}, contexts {lo}..{hi}, virtual {virt or '-'}, "
            f"families {fams or 'all'}) for {steps} steps")
    eval_tasks = generate_tasks(gen, os.path.join(args.out, "data", f"eval-s{args.eval_seed}-{args.eval_lengths}.jsonl"),
                                ["--suite", "long", "--seed", str(args.eval_seed), "--lengths", args.eval_lengths,
                                 "--approx-tokens"])

    # ---- tokenizer ----
    tok_path = os.path.join(args.out, "tokenizer.json")
    if os.path.exists(tok_path):
        with open(tok_path, encoding="utf-8") as f:
            tok = tdm.Tokenizer.from_json(json.load(f))
    else:
        corpus = [tdm.render_chatml(t["messages"], True) + t["answer"] + IM_END + "\n"
                  for ts in phase_tasks for t in ts[:4000]]
        n = tdm.check_split_regex(corpus)
        log(f"split regex: ASCII regex == Qwen2 regex (perl) on {n} pre-tokens")
        tok = tdm.train_bpe(corpus, args.vocab)
        write_text_atomic(tok_path, json.dumps(tdm.tokenizer_json(tok), ensure_ascii=False, indent=1) + "\n")
    log(f"tokenizer: {len(tok)} tokens ({len(tok.merges)} merges)")
    for t in eval_tasks[:20]:
        s = tdm.render_chatml(t["messages"], True) + t["answer"]
        if tok.decode(tok.encode(s)) != s:
            raise ToolError("tokenizer does not round-trip suite text")

    data = [[encode_task(tok, t, args.lm_weight) for t in ts] for ts in phase_tasks]
    log(f"encoded: {sum(len(d) for d in data)} sequences, {sum(len(s.ids) for d in data for s in d)} tokens, "
        f"longest {max(len(s.ids) for d in data for s in d)}")

    # ---- model ----
    vocab_size = int(math.ceil(len(tok) / 64) * 64)
    cfg = model_config(args, vocab_size, tok)
    model = LongQwen2(cfg)
    model.init_weights(torch.Generator().manual_seed(args.seed), args.embed_std,
                       sorted({(args.sup_layer, h) for h in args.sup_heads} |
                              ({(args.gather_layer, args.gather_head)} if args.gather > 0 else set()))
                       if args.copy_init else ())
    # no weight decay on the input embedding: decay shrinks the rare tokens' identity (a digit seen
    # only inside codes) toward their shared "digit" direction
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "embed_tokens.weight"]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or n == "embed_tokens.weight"]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M params, " + json.dumps({k: cfg[k] for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "vocab_size", "rope_theta", "max_position_embeddings")}))
    step, train_time = 0, 0.0
    ckpt_path = os.path.join(args.out, "ckpt.pt")
    if args.init_from:
        if not os.path.isfile(args.init_from):
            raise ToolError(f"--init-from: {args.init_from} is not a file (expected a run's OUT/ckpt.pt)")
        try:
            model.load_state_dict(torch.load(args.init_from)["model"])
        except (RuntimeError, KeyError) as e:
            raise ToolError(f"--init-from {args.init_from}: not a checkpoint of this model and tokenizer: "
                            f"{str(e).strip().splitlines()[-1].strip()}") from None
        log(f"weights from {args.init_from} (optimizer and step start fresh)")
    if (args.resume or args.export_only) and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, train_time = ck["step"], ck["train_time"]
        log(f"resumed from {ckpt_path} at step {step}")
    elif args.export_only:
        raise ToolError(f"--export-only: {ckpt_path} does not exist")

    def save_ckpt():
        tmp = ckpt_path + ".tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "train_time": train_time,
                    "args": vars(args)}, tmp)
        os.replace(tmp, ckpt_path)

    bounds = np.cumsum([0] + [p[0] for p in phases])
    sup_layer = model.layers[args.sup_layer]
    gather_layer = model.layers[args.gather_layer] if args.gather > 0 else None
    last_ckpt = time.time()
    acc = {"loss": 0.0, "n": 0, "reply": 0.0, "reply_n": 0.0, "sup": np.zeros(SUP_SLOTS), "sup_n": np.zeros(SUP_SLOTS),
           "fam_key": {}, "tokens": 0, "first": 0.0, "first_n": 0.0, "gather": 0.0, "gather_n": 0}
    model.train()
    end = min(total, args.stop_after) if args.stop_after > 0 else total
    while step < end and not args.export_only:
        pi = int(np.searchsorted(bounds, step, side="right") - 1)
        seqs = data[pi]
        virt = phases[pi][3]
        local, epoch = step - int(bounds[pi]), 0
        batches = make_batches(seqs, args.tokens_per_batch, np.random.default_rng([args.seed, pi, epoch]))
        while local >= len(batches):
            local -= len(batches)
            epoch += 1
            batches = make_batches(seqs, args.tokens_per_batch, np.random.default_rng([args.seed, pi, epoch]))
        while local < len(batches) and step < min(int(bounds[pi + 1]), end):
            ts = time.time()
            rng = np.random.default_rng([args.seed, 7, step])
            # the dilution of the supervision simulates a long context where positions do (PoSE phases)
            ids, pos, w, key, first, sup, gather = collate(seqs, batches[local], virt, args.max_positions, rng,
                                                           args.sup_context if virt > 0 else 0, args.sup_heads,
                                                           args.gather_head)
            sup_layer.sup = sup_tensors(sup) if args.sup > 0 else None
            if gather_layer is not None:
                gather_layer.sup = sup_tensors(gather) if args.sup > 0 and args.gather else None
            lr = tdm.lr_at(step, total, args.lr, args.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            logits = model(ids, pos, args.chunk)
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                  reduction="none").view(ids.shape[0], -1)
            ww, kk = w[:, :-1], key[:, :-1]
            key_term = (nll * kk).sum() / kk.sum().clamp_min(1.0)
            if step < args.key_only_steps:
                kf = first[:, :-1] if args.first_key_only else kk
                loss = (nll * kf).sum() / kf.sum().clamp_min(1.0)
            else:
                loss = (nll * ww).sum() / ww.sum().clamp_min(1e-6) + args.key_weight * key_term
            if gather_layer is not None and gather_layer.sup is not None:
                gl = gather_layer.sup_loss
                loss = loss + args.sup * args.gather * gl.mean()
                acc["gather"] += float(gl.detach().sum())
                acc["gather_n"] += len(gl)
            if gather_layer is not None:
                gather_layer.sup, gather_layer.sup_loss = None, None
            if sup_layer.sup is not None:
                sl = sup_layer.sup_loss
                loss = loss + args.sup * sl.mean()
                slot = np.array([s[5] for s in sup])
                sv = sl.detach().numpy()
                for k2 in range(SUP_SLOTS):
                    acc["sup"][k2] += sv[slot == k2].sum()
                    acc["sup_n"][k2] += (slot == k2).sum()
            sup_layer.sup, sup_layer.sup_loss = None, None
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            local += 1
            train_time += time.time() - ts
            acc["loss"] += float(loss)
            acc["n"] += 1
            acc["tokens"] += int((ids != 0).sum())
            am = ww == 1.0
            acc["reply"] += float((nll * am).sum())
            acc["reply_n"] += float(am.sum())
            fk = first[:, :-1]
            acc["first"] += float((nll * fk).sum())
            acc["first_n"] += float(fk.sum())
            kn = (nll * kk).sum(1).detach().numpy()
            kc = kk.sum(1).numpy()
            for r, i in enumerate(batches[local - 1]):
                if kc[r] > 0:
                    f = seqs[i].family
                    a, c = acc["fam_key"].get(f, (0.0, 0))
                    acc["fam_key"][f] = (a + kn[r] / kc[r], c + 1)
            if step % args.log_every == 0 or step == total:
                keys = " ".join(f"{f[:4] + f[-2:]} {a / c:.2f}" for f, (a, c) in sorted(acc["fam_key"].items()))
                sups = " ".join(f"{acc['sup'][k2] / max(acc['sup_n'][k2], 1):.2f}" for k2 in range(SUP_SLOTS))
                log(f"step {step}/{total} phase {pi} lr {lr:.2e} loss {acc['loss'] / acc['n']:.4f} "
                    f"reply {acc['reply'] / max(acc['reply_n'], 1):.4f} first {acc['first'] / max(acc['first_n'], 1):.3f} "
                    f"key [{keys}] sup [{sups}] gather {acc['gather'] / max(acc['gather_n'], 1):.2f} "
                    f"batch {ids.shape[0]}x{ids.shape[1]} {acc['tokens'] / max(train_time, 1e-9):.0f} tok/s(cum) "
                    f"train {train_time / 60:.1f} min")
                acc.update({"loss": 0.0, "n": 0, "reply": 0.0, "reply_n": 0.0, "sup": np.zeros(SUP_SLOTS),
                            "sup_n": np.zeros(SUP_SLOTS), "fam_key": {}, "first": 0.0, "first_n": 0.0,
                            "gather": 0.0, "gather_n": 0})
            if time.time() - last_ckpt > args.ckpt_minutes * 60:
                save_ckpt()
                last_ckpt = time.time()
            if args.eval_every and step % args.eval_every == 0 and step < total:
                model.eval()
                te = time.time()
                s = evaluate(model, tok, eval_tasks)
                log(f"eval step {step}: {tdm.fmt_summary(s)} ({time.time() - te:.0f}s)")
                model.train()
    if not args.export_only:
        save_ckpt()
    if step < total and not args.export_only:
        log(f"stopped after step {step} of {total} (--stop-after); {ckpt_path} holds it, --resume continues")
        return 0
    model.eval()
    log(f"training done: {step} steps, {train_time / 60:.1f} min of training")
    s = evaluate(model, tok, eval_tasks)
    log(f"eval (python, {args.eval_lengths}): {tdm.fmt_summary(s)}")
    hf_dir = os.path.join(args.out, "hf")
    tdm.write_hf_dir(hf_dir, model, cfg, tok, {"step": step, "seed": args.seed})
    tdm.export(hf_dir, args.export)
    res = {"params": n_params, "steps": step, "train_minutes": train_time / 60, "seed": args.seed,
           "export_bytes": os.path.getsize(args.export), "python_eval": {k: v for k, v in s.items() if k != "rows"}}
    if args.final_lengths:
        ev_dir = os.path.join(args.out, "final-eval")
        cmd = [gen, "run", "--model", args.export, "--suite", "long", "--lengths", args.final_lengths,
               "--reps", str(args.final_reps), "--configs", "fp32+full", "--threads", str(args.threads),
               "--out", ev_dir]
        log("final evaluation: " + " ".join(cmd))
        r = subprocess.run(cmd)
        if r.returncode != 0:
            raise ToolError(f"final evaluation failed (exit {r.returncode})")
        res["final_eval_dir"] = ev_dir
    write_text_atomic(os.path.join(args.out, "eval.json"), json.dumps(res, indent=1) + "\n")
    log(f"wrote {args.export} ({os.path.getsize(args.export) / 1e6:.2f} MB), {os.path.join(args.out, 'eval.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
