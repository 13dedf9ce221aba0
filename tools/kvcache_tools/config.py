"""config.json normalisation and validation (model ABI v1, docs/model-abi.md).

The normalised config is the checkpoint's config.json with every field the runner needs filled in
explicitly (HF defaults of the model class when absent) and checked for what the exporter supports
and for everything the C++ loader (libkvcache/src/model/causal_lm.cpp) checks, so an export never
holds a config the loader rejects: integer fields are JSON integers that fit in int64 and are > 0,
rope_theta / rms_norm_eps are finite numbers > 0, num_attention_heads is a multiple of
num_key_value_heads, and every eos id of config.json and generation_config.json lies in
[0, vocab_size). check_weight_budget bounds the weights a config implies before anything is allocated.
"""
import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple

from .errors import ToolError
from .fileio import shown
from .model import GLOBAL_TENSORS, SHAPE_FIELDS, expected_shapes, per_layer_tensors

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

# Fields the normalised config always carries (besides model_type).
NORMALISED_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "vocab_size",
    "attention_bias", "bos_token_id", "eos_token_id", "max_position_embeddings", "model_type",
)

# Bounds (each message names the one it hits)
INT64_MAX = 2 ** 63 - 1  # the loader reads integer fields as int64
INT64_WHY = "the C++ loader reads it as a 64-bit integer"
MAX_VOCAB_SIZE = 1 << 26  # the C++ tokenizer loader accepts token ids below 2^26 (kMaxTokenId)
VOCAB_WHY = "the C++ tokenizer loader accepts token ids below 2^26"
FLOAT32_MAX = 3.4028234663852886e38  # RoPE frequencies are computed in float32 from rope_theta
MAX_POSITIONS = 10 ** 9  # kMaxTokens (kvcache/spec.h): the library's bound on tokens and positions
POSITIONS_WHY = "the library runs at most 10^9 tokens per request (kMaxTokens, kvcache/spec.h)"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(raw: Dict[str, Any], field: str, where: str, default: Optional[int] = None,
                  maximum: int = INT64_MAX, why: str = INT64_WHY) -> int:
    v = raw.get(field)
    if v is None:
        if default is None:
            raise ToolError(f"{where}: required field '{field}' is missing")
        return default
    if not _is_int(v):
        raise ToolError(f"{where}: field '{field}' = {shown(v)} is not an integer")
    if v <= 0:
        raise ToolError(f"{where}: field '{field}' = {v} must be > 0")
    if v > maximum:
        raise ToolError(f"{where}: field '{field}' = {shown(v)} exceeds the limit {maximum} ({why})")
    return v


def _positive_float(raw: Dict[str, Any], field: str, where: str, default: float,
                    maximum: float, why: str) -> float:
    v = raw.get(field)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ToolError(f"{where}: field '{field}' = {shown(v)} is not a number")
    if not math.isfinite(v):
        raise ToolError(f"{where}: field '{field}' = {shown(v)} is not a finite number")
    if not v > 0:
        raise ToolError(f"{where}: field '{field}' = {shown(v)} must be > 0")
    if v > maximum:
        raise ToolError(f"{where}: field '{field}' = {shown(v)} exceeds the limit {maximum:g} ({why})")
    return float(v)


def _bool(raw: Dict[str, Any], field: str, where: str, default: bool) -> bool:
    v = raw.get(field)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ToolError(f"{where}: field '{field}' = {shown(v)} is not true or false")
    return v


def _token_ids(v: Any, field: str, where: str, vocab_size: int):
    """None, an id or a non-empty list of ids, each in [0, vocab_size)."""
    if v is None:
        return None
    ids = v if isinstance(v, list) else [v]
    if not ids or not all(_is_int(x) for x in ids):
        raise ToolError(f"{where}: field '{field}' = {shown(v)} is not a token id or a list of token ids")
    for x in ids:
        if not 0 <= x < vocab_size:
            which = f" (id {shown(x)})" if isinstance(v, list) else ""
            raise ToolError(f"{where}: field '{field}' = {shown(v)}{which} is outside the vocabulary "
                            f"[0, {vocab_size}) (config.json vocab_size)")
    return list(v) if isinstance(v, list) else v


def normalize_config(raw: Any, where: str = "config.json",
                     generation_config: Optional[Dict[str, Any]] = None,
                     gen_where: str = "generation_config.json") -> Dict[str, Any]:
    """Returns a copy of `raw` with NORMALISED_FIELDS filled and validated.

    Defaults (as the HF model classes): num_key_value_heads = num_attention_heads,
    head_dim = hidden_size / num_attention_heads, rope_theta 10000, rms_norm_eps 1e-6,
    tie_word_embeddings false, max_position_embeddings 2048, attention_bias: always true for qwen2,
    the config's value (default false) for llama. bos/eos token ids fall back to
    generation_config.json, else null; generation_config.json's own bos/eos ids are checked as well
    (the loader stops on the union of both files' eos ids).
    Raises ToolError (naming `where` or `gen_where` and the field) for a value of the wrong type,
    out of its bounds or inconsistent with another field, an unknown model_type, or a feature the
    ABI does not implement (rope_scaling, sliding windows, MLP biases, an activation other than silu).
    """
    if not isinstance(raw, dict):
        raise ToolError(f"{where}: must be a JSON object, got {shown(raw)}")
    cfg = dict(raw)
    mt = raw.get("model_type")
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if mt is None:
        raise ToolError(f"{where}: required field 'model_type' is missing (supported: {supported})")
    if not isinstance(mt, str) or mt not in SUPPORTED_MODEL_TYPES:
        shown_mt = f"'{mt}'" if isinstance(mt, str) else shown(mt)
        raise ToolError(f"{where}: unsupported model_type {shown_mt} (supported: {supported})")

    d = _positive_int(raw, "hidden_size", where)
    n_layers = _positive_int(raw, "num_hidden_layers", where)
    n_heads = _positive_int(raw, "num_attention_heads", where)
    n_kv = _positive_int(raw, "num_key_value_heads", where, default=n_heads)
    if n_heads % n_kv != 0:
        raise ToolError(f"{where}: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
    if raw.get("head_dim") is None:
        if d % n_heads != 0:
            raise ToolError(f"{where}: hidden_size={d} is not divisible by num_attention_heads={n_heads} "
                            f"and no 'head_dim' is given")
        head_dim = d // n_heads
    else:
        head_dim = _positive_int(raw, "head_dim", where)
    if head_dim % 2 != 0:
        raise ToolError(f"{where}: head_dim={head_dim} must be even for RoPE")
    vocab_size = _positive_int(raw, "vocab_size", where, maximum=MAX_VOCAB_SIZE, why=VOCAB_WHY)

    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ToolError(f"{where}: unsupported hidden_act {shown(act)} (supported: silu)")
    rs = raw.get("rope_scaling")
    if rs is not None and not (isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "default"):
        raise ToolError(f"{where}: unsupported rope_scaling {shown(rs, 120)} (only null / default RoPE)")
    prf = raw.get("partial_rotary_factor")
    if prf is not None and (isinstance(prf, bool) or prf != 1):
        raise ToolError(f"{where}: unsupported partial_rotary_factor {shown(prf)} (only 1.0)")
    if mt == "qwen2" and _bool(raw, "use_sliding_window", where, False):
        raise ToolError(f"{where}: unsupported use_sliding_window=true (only full attention)")
    if _bool(raw, "mlp_bias", where, False):
        raise ToolError(f"{where}: unsupported mlp_bias=true (only bias-free MLPs)")

    if mt == "qwen2":
        if not _bool(raw, "attention_bias", where, True):  # Qwen2 always has q/k/v biases (none on o_proj)
            raise ToolError(f"{where}: model_type qwen2 always has q/k/v biases, but attention_bias=false")
        attention_bias = True
    else:
        attention_bias = _bool(raw, "attention_bias", where, False)

    gen = generation_config if isinstance(generation_config, dict) else {}
    ids = {}
    for k in ("bos_token_id", "eos_token_id"):
        gen_ids = _token_ids(gen.get(k), k, gen_where, vocab_size)  # checked even when config.json has its own
        own = _token_ids(raw.get(k), k, where, vocab_size)
        ids[k] = own if own is not None else gen_ids

    cfg.update({
        "model_type": mt,
        "hidden_size": d,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "intermediate_size": _positive_int(raw, "intermediate_size", where),
        "vocab_size": vocab_size,
        "rope_theta": _positive_float(raw, "rope_theta", where, 10000.0, FLOAT32_MAX,
                                      "RoPE frequencies are computed in float32"),
        "rms_norm_eps": _positive_float(raw, "rms_norm_eps", where, 1e-6, 1.0,
                                        "an RMSNorm epsilon is a small positive number"),
        "tie_word_embeddings": _bool(raw, "tie_word_embeddings", where, False),
        "attention_bias": attention_bias,
        "max_position_embeddings": _positive_int(raw, "max_position_embeddings", where, default=2048,
                                                 maximum=MAX_POSITIONS, why=POSITIONS_WHY),
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["eos_token_id"],
        "hidden_act": "silu",
    })
    return cfg


def format_bytes(n: float) -> str:
    """3.58e12 -> '3.6 TB' (decimal units)."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB", "EB"):
        if n < 999.5 or unit == "EB":
            return f"{n:.1f} {unit}" if n < 10 and unit != "B" else f"{n:.0f} {unit}"
        n /= 1000.0
    return f"{n:.0f} EB"


def weight_tensors(cfg: Dict) -> List[Tuple[str, str, List[int], Optional[int]]]:
    """(stacked buffer name, HF tensor name, shape, layer or None) of every tensor a normalised
    config implies, in reading order: per layer (all layers of a buffer in turn), then the global ones."""
    shapes = expected_shapes(cfg)
    out = [(buf, pattern.format(i=i), shapes[buf], i)
           for buf, pattern in per_layer_tensors(cfg).items() for i in range(cfg["num_hidden_layers"])]
    return out + [(buf, GLOBAL_TENSORS[buf], shapes[buf], None) for buf in _global_buffers(cfg)]


def _global_buffers(cfg: Dict) -> List[str]:
    return ["embed_tokens", "final_norm"] + ([] if cfg["tie_word_embeddings"] else ["lm_head"])


def _blamed_field(cfg: Dict, buf: str) -> str:
    """The config field behind the largest dimension of buffer `buf` (for 'x*y' dims, the larger factor)."""
    best = None
    for expr in SHAPE_FIELDS[buf]:
        for field in expr.split("*"):
            if best is None or cfg[field] > cfg[best]:
                best = field
    return best


def check_weight_budget(cfg: Dict, where: str, itemsize: int, dtype_name: str,
                        tensor_limit: Optional[int], total_limit: Optional[int], limit_what: str) -> int:
    """Bounds the weights `cfg` implies, computed from the config alone (nothing is allocated, and
    the cost does not grow with num_hidden_layers): no tensor over tensor_limit bytes and all of
    them together at most total_limit bytes, at `itemsize` bytes per value; `limit_what` describes
    the bound, with {} for its size. Returns the total. The ToolError names the field that makes it
    too large, the tensor, its arithmetic and the bound, e.g. "field 'intermediate_size' =
    1000000000 is too large: tensor '...' would be 1000000000 x 896 x 4 B = 3.6 TB (float32), ..."."""
    shapes = expected_shapes(cfg)
    L = cfg["num_hidden_layers"]

    def size(buf: str, name: str) -> int:
        n = math.prod(shapes[buf]) * itemsize
        if tensor_limit is not None and n > tensor_limit:
            field = _blamed_field(cfg, buf)
            dims = " x ".join(str(s) for s in shapes[buf])
            raise ToolError(f"{where}: field '{field}' = {cfg[field]} is too large: tensor '{name}' would be "
                            f"{dims} x {itemsize} B = {format_bytes(n)} ({dtype_name}), more than "
                            f"{limit_what.format(format_bytes(tensor_limit))}")
        return n

    # layer 0 stands for every layer: they all have the same shapes
    per_layer = sum(size(buf, pattern.format(i=0)) for buf, pattern in per_layer_tensors(cfg).items())
    rest = sum(size(buf, GLOBAL_TENSORS[buf]) for buf in _global_buffers(cfg))
    total = per_layer * L + rest
    if total_limit is not None and total > total_limit:
        more = f"more than {limit_what.format(format_bytes(total_limit))}"
        if L == 1:
            fields = ", ".join(f"{f}={cfg[f]}" for f in ("hidden_size", "intermediate_size", "vocab_size"))
            raise ToolError(f"{where}: the model is too large: {fields} give {format_bytes(total)} of "
                            f"{dtype_name} weights, {more}")
        raise ToolError(f"{where}: field 'num_hidden_layers' = {L} makes the model too large: {L} layers x "
                        f"{format_bytes(per_layer)} + {format_bytes(rest)} embeddings and norm = "
                        f"{format_bytes(total)} of {dtype_name} weights, {more}")
    return total


def physical_memory() -> Optional[int]:
    """Bytes of RAM of this machine (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def dumps_config(cfg: Dict) -> str:
    """The config as the export embeds it (strict JSON: NaN/Infinity cannot appear)."""
    return json.dumps(cfg, indent=1, ensure_ascii=False, allow_nan=False)
