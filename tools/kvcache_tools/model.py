"""KVCacheModel: the TorchScript module of libkvcache model ABI v1 (see docs/model-abi.md).

Letters: B batch, T tokens, d hidden_size, H_q query heads, H_kv KV heads, D head_dim, V vocab,
L layers, I intermediate_size. Query head h reads KV head h // (H_q / H_kv).
Per-layer weights are stacked into [L, ...] tensors so a runtime `layer: int` can index them
(TorchScript cannot index a ModuleList with a runtime int).

Numerics (HF Llama/Qwen2 conventions): RMSNorm computed in fp32 and cast back to the weight dtype
before the scale; RoPE cos/sin in fp32 from rope_theta (HF rotate_half pairing: dim i with
i + D/2), output in the input's dtype; attention scores and softmax in fp32; logits fp32.
"""
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

# Stacked weight names -> (HF tensor name pattern, per-layer?)
LAYER_TENSORS = {
    "input_norm": "model.layers.{i}.input_layernorm.weight",
    "wq": "model.layers.{i}.self_attn.q_proj.weight",
    "wk": "model.layers.{i}.self_attn.k_proj.weight",
    "wv": "model.layers.{i}.self_attn.v_proj.weight",
    "wo": "model.layers.{i}.self_attn.o_proj.weight",
    "post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "w_gate": "model.layers.{i}.mlp.gate_proj.weight",
    "w_up": "model.layers.{i}.mlp.up_proj.weight",
    "w_down": "model.layers.{i}.mlp.down_proj.weight",
}
BIAS_TENSORS = {
    "bq": "model.layers.{i}.self_attn.q_proj.bias",
    "bk": "model.layers.{i}.self_attn.k_proj.bias",
    "bv": "model.layers.{i}.self_attn.v_proj.bias",
}
GLOBAL_TENSORS = {
    "embed_tokens": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}


def per_layer_tensors(cfg: Dict) -> Dict[str, str]:
    """Stacked buffer name -> HF tensor name pattern (with {i}) of every per-layer tensor the
    config implies (q/k/v biases only with attention_bias)."""
    names = dict(LAYER_TENSORS)
    if cfg["attention_bias"]:
        names.update(BIAS_TENSORS)
    return names


def expected_shapes(cfg: Dict) -> Dict[str, List[int]]:
    """Per-tensor shape (without the leading L) of every stacked buffer, from a normalised config."""
    d, D = cfg["hidden_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    inter, V = cfg["intermediate_size"], cfg["vocab_size"]
    shapes = {
        "input_norm": [d], "wq": [hq, d], "wk": [hkv, d], "wv": [hkv, d], "wo": [d, hq],
        "post_norm": [d], "w_gate": [inter, d], "w_up": [inter, d], "w_down": [d, inter],
        "bq": [hq], "bk": [hkv], "bv": [hkv],
        "embed_tokens": [V, d], "final_norm": [d], "lm_head": [V, d],
    }
    return shapes


# The config fields behind each dimension of expected_shapes (for messages)
SHAPE_FIELDS = {
    "input_norm": ("hidden_size",), "post_norm": ("hidden_size",), "final_norm": ("hidden_size",),
    "wq": ("num_attention_heads*head_dim", "hidden_size"), "bq": ("num_attention_heads*head_dim",),
    "wk": ("num_key_value_heads*head_dim", "hidden_size"), "bk": ("num_key_value_heads*head_dim",),
    "wv": ("num_key_value_heads*head_dim", "hidden_size"), "bv": ("num_key_value_heads*head_dim",),
    "wo": ("hidden_size", "num_attention_heads*head_dim"),
    "w_gate": ("intermediate_size", "hidden_size"), "w_up": ("intermediate_size", "hidden_size"),
    "w_down": ("hidden_size", "intermediate_size"),
    "embed_tokens": ("vocab_size", "hidden_size"), "lm_head": ("vocab_size", "hidden_size"),
}


def _linear(x: Tensor, w: Tensor, b: Optional[Tensor]) -> Tensor:
    """y = x W^T (+ b) for x [..., K], W [N, K].

    One row (decode, B*T == 1) goes through a true GEMV (torch.mv): on CPU LibTorch 1.13 that is
    ~4x faster than linear/addmm with M=1. CPU has no fp16 GEMM in torch 1.13, so fp16 weights
    are computed in fp32 there and the result is cast back to fp16. bf16 keeps F.linear: on a
    CPU without AVX-512 (no oneDNN bf16 path) LibTorch 1.13's bf16 mv accumulates in bf16
    (max error 2.2 on a 512-long dot of unit normals, against 0.2 for F.linear; AMD EPYC Zen 3,
    2026-12-02), and a bf16 export's decode drifted off its own forward."""
    out_dtype = x.dtype
    if w.dtype == torch.float16 and w.device.type == "cpu":
        x = x.float()
        w = w.float()
        if b is not None:
            b = b.float()
    rows = x.numel() // x.size(-1)
    if rows == 1 and w.dtype != torch.bfloat16:
        y = torch.mv(w, x.reshape(-1))
        if b is not None:
            y = y + b
        shape: List[int] = []
        for s in x.size()[:-1]:
            shape.append(s)
        shape.append(w.size(0))
        return y.view(shape).to(out_dtype)
    return F.linear(x, w, b).to(out_dtype)


class KVCacheModel(torch.nn.Module):
    """Decoder-only Llama/Qwen2 model exposing ABI v1: embed, qkv, rope, finish, head, forward."""

    num_layers: torch.jit.Final[int]
    hidden_size: torch.jit.Final[int]
    num_heads: torch.jit.Final[int]
    num_kv_heads: torch.jit.Final[int]
    head_dim: torch.jit.Final[int]
    vocab_size: torch.jit.Final[int]
    eps: torch.jit.Final[float]
    tied: torch.jit.Final[bool]
    attention_bias: torch.jit.Final[bool]

    def __init__(self, cfg: Dict, weights: Dict[str, Tensor], dtype: torch.dtype = torch.float32):
        """cfg: normalised config. weights: stacked tensors named as in LAYER_TENSORS ([L, ...]),
        BIAS_TENSORS ([L, N], only when cfg['attention_bias']), GLOBAL_TENSORS (lm_head only
        when not tied). All are converted to `dtype`; inv_freq stays fp32."""
        super().__init__()
        self.num_layers = int(cfg["num_hidden_layers"])
        self.hidden_size = int(cfg["hidden_size"])
        self.num_heads = int(cfg["num_attention_heads"])
        self.num_kv_heads = int(cfg["num_key_value_heads"])
        self.head_dim = int(cfg["head_dim"])
        self.vocab_size = int(cfg["vocab_size"])
        self.eps = float(cfg["rms_norm_eps"])
        self.tied = bool(cfg["tie_word_embeddings"])
        self.attention_bias = bool(cfg["attention_bias"])
        L = self.num_layers
        empty = torch.zeros(0, dtype=dtype)

        def reg(name: str, t: Optional[Tensor]):
            self.register_buffer(name, empty.clone() if t is None else t.to(dtype).contiguous())

        for name in LAYER_TENSORS:
            reg(name, weights[name])
        for name in BIAS_TENSORS:
            reg(name, weights[name] if self.attention_bias else None)
        reg("embed_tokens", weights["embed_tokens"])
        reg("final_norm", weights["final_norm"])
        reg("lm_head", None if self.tied else weights["lm_head"])
        D = self.head_dim
        theta = float(cfg["rope_theta"])
        # exactly HF's formula: 1 / theta^(arange(0, D, 2) / D), in fp32
        inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
        self.register_buffer("inv_freq", inv_freq.to(torch.float32))
        assert self.wq.shape[0] == L

    def _rms_norm(self, x: Tensor, w: Tensor) -> Tensor:
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(var + self.eps)
        return w * xf.to(w.dtype)

    @torch.jit.export
    def embed(self, ids: Tensor) -> Tensor:
        """ids int64 [B, T] -> h [B, T, d] (export dtype)."""
        return F.embedding(ids, self.embed_tokens)

    @torch.jit.export
    def rope(self, x: Tensor, positions: Tensor) -> Tensor:
        """x [B, H, T, D], positions int64 [T] -> x rotated (HF rotate_half), x's dtype.
        cos/sin and the rotation are computed in fp32."""
        freqs = positions.to(torch.float32).unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]
        cos = emb.cos()
        sin = emb.sin()
        xf = x.float()
        half = self.head_dim // 2
        rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rot * sin).to(x.dtype)

    @torch.jit.export
    def qkv(self, layer: int, h: Tensor, positions: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Layer `layer`'s input RMSNorm and q/k/v projections (with biases if the config has them).
        h [B, T, d], positions int64 [T] -> (q post-RoPE [B, H_q, T, D], k PRE-RoPE [B, H_kv, T, D],
        v [B, H_kv, T, D]), all contiguous, export dtype."""
        B = h.size(0)
        T = h.size(1)
        x = self._rms_norm(h, self.input_norm[layer])
        bq: Optional[Tensor] = None
        bk: Optional[Tensor] = None
        bv: Optional[Tensor] = None
        if self.attention_bias:
            bq = self.bq[layer]
            bk = self.bk[layer]
            bv = self.bv[layer]
        q = _linear(x, self.wq[layer], bq).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = _linear(x, self.wk[layer], bk).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = _linear(x, self.wv[layer], bv).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = self.rope(q, positions)
        return q.contiguous(), k.contiguous(), v.contiguous()

    @torch.jit.export
    def finish(self, layer: int, h: Tensor, attn_out: Tensor) -> Tensor:
        """h [B, T, d] (the layer input), attn_out [B, H_q, T, D] -> the layer output [B, T, d]:
        o_proj, residual add, post-attention RMSNorm, SwiGLU MLP, residual add."""
        B = h.size(0)
        T = h.size(1)
        a = attn_out.to(h.dtype).transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        h = h + _linear(a, self.wo[layer], None)
        x = self._rms_norm(h, self.post_norm[layer])
        # silu in fp32 (CPU torch 1.13 has no fp16 silu; a no-op cast for fp32 exports)
        gate = F.silu(_linear(x, self.w_gate[layer], None).float()).to(x.dtype)
        m = gate * _linear(x, self.w_up[layer], None)
        return h + _linear(m, self.w_down[layer], None)

    @torch.jit.export
    def head(self, h: Tensor) -> Tensor:
        """h [B, T, d] -> logits fp32 [B, T, V] (final RMSNorm + lm_head, tied or not)."""
        x = self._rms_norm(h, self.final_norm)
        w = self.embed_tokens if self.tied else self.lm_head
        return _linear(x, w, None).float()

    def _attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal GQA attention, q [B, H_q, T, D], k/v post-RoPE [B, H_kv, T, D] -> [B, H_q, T, D].
        Scores and softmax in fp32; output in q's dtype."""
        B = q.size(0)
        T = q.size(2)
        group = self.num_heads // self.num_kv_heads
        kf = k.float().unsqueeze(2).expand(B, self.num_kv_heads, group, T, self.head_dim)
        kf = kf.reshape(B, self.num_heads, T, self.head_dim)
        vf = v.float().unsqueeze(2).expand(B, self.num_kv_heads, group, T, self.head_dim)
        vf = vf.reshape(B, self.num_heads, T, self.head_dim)
        scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * (1.0 / float(self.head_dim) ** 0.5)
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, vf).to(q.dtype)

    def forward(self, ids: Tensor) -> Tensor:
        """ids int64 [B, T] -> logits fp32 [B, T, V]: full-sequence causal forward, no cache
        (the unmanaged reference), composed of embed / qkv / rope / finish / head."""
        T = ids.size(1)
        positions = torch.arange(T, dtype=torch.int64, device=ids.device)
        h = self.embed(ids)
        for layer in range(self.num_layers):
            q, k, v = self.qkv(layer, h, positions)
            k = self.rope(k, positions)
            h = self.finish(layer, h, self._attention(q, k, v))
        return self.head(h)
