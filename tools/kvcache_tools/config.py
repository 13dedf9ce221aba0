"""config.json normalisation (model ABI v1, docs/model-abi.md).

The normalised config is the checkpoint's config.json with every field the runner needs filled in
explicitly (HF defaults of the model class when absent) and checked for what the exporter supports.
"""
import json
import os
from typing import Any, Dict, Optional

from .errors import ToolError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

# Fields the normalised config always carries (besides model_type).
NORMALISED_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "vocab_size",
    "attention_bias", "bos_token_id", "eos_token_id", "max_position_embeddings", "model_type",
)


def load_json(path: str, what: str) -> Any:
    """Reads a JSON file; ToolError naming the file when missing or malformed."""
    if not os.path.isfile(path):
        raise ToolError(f"{path}: {what} not found")
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ToolError(f"{path}: {what} is not valid JSON: {e}") from None


def _positive_int(raw: Dict[str, Any], field: str, where: str, default: Optional[int] = None) -> int:
    v = raw.get(field, default)
    if v is None:
        raise ToolError(f"{where}: required field '{field}' is missing")
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ToolError(f"{where}: field '{field}' must be a positive integer, got {v!r}")
    return v


def _positive_float(raw: Dict[str, Any], field: str, where: str, default: float) -> float:
    v = raw.get(field, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ToolError(f"{where}: field '{field}' must be a positive number, got {v!r}")
    return float(v)


def _bool(raw: Dict[str, Any], field: str, where: str, default: bool) -> bool:
    v = raw.get(field, default)
    if v is None:
        v = default
    if not isinstance(v, bool):
        raise ToolError(f"{where}: field '{field}' must be true or false, got {v!r}")
    return v


def _token_ids(v: Any, field: str, where: str):
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        return list(v)
    raise ToolError(f"{where}: field '{field}' must be a token id or a list of token ids, got {v!r}")


def normalize_config(raw: Any, where: str = "config.json",
                     generation_config: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Returns a copy of `raw` with NORMALISED_FIELDS filled and validated.

    Defaults (as the HF model classes): num_key_value_heads = num_attention_heads,
    head_dim = hidden_size / num_attention_heads, rope_theta 10000, rms_norm_eps 1e-6,
    tie_word_embeddings false, max_position_embeddings 2048, attention_bias: always true for qwen2,
    the config's value (default false) for llama. bos/eos token ids fall back to
    generation_config.json, else null.
    Raises ToolError for an unknown model_type or a feature the ABI does not implement
    (rope_scaling, sliding windows, MLP biases, an activation other than silu).
    """
    if not isinstance(raw, dict):
        raise ToolError(f"{where}: must be a JSON object")
    cfg = dict(raw)
    mt = raw.get("model_type")
    if mt is None:
        raise ToolError(f"{where}: required field 'model_type' is missing (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ToolError(f"{where}: unsupported model_type '{mt}' (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")

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

    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ToolError(f"{where}: unsupported hidden_act '{act}' (supported: silu)")
    rs = raw.get("rope_scaling")
    if rs is not None and not (isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "default"):
        raise ToolError(f"{where}: unsupported rope_scaling {json.dumps(rs)} (only null / default RoPE)")
    if raw.get("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise ToolError(f"{where}: unsupported partial_rotary_factor {raw.get('partial_rotary_factor')!r} (only 1.0)")
    if mt == "qwen2" and raw.get("use_sliding_window", False):
        raise ToolError(f"{where}: unsupported use_sliding_window=true (only full attention)")
    if raw.get("mlp_bias", False):
        raise ToolError(f"{where}: unsupported mlp_bias=true (only bias-free MLPs)")

    if mt == "qwen2":
        attention_bias = True  # Qwen2 always has q/k/v biases (and none on o_proj)
        if raw.get("attention_bias") is False:
            raise ToolError(f"{where}: model_type qwen2 always has q/k/v biases, but attention_bias=false")
    else:
        attention_bias = _bool(raw, "attention_bias", where, False)

    gen = generation_config if isinstance(generation_config, dict) else {}
    bos, eos = (raw.get(k) if raw.get(k) is not None else gen.get(k) for k in ("bos_token_id", "eos_token_id"))

    cfg.update({
        "model_type": mt,
        "hidden_size": d,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "intermediate_size": _positive_int(raw, "intermediate_size", where),
        "vocab_size": _positive_int(raw, "vocab_size", where),
        "rope_theta": _positive_float(raw, "rope_theta", where, 10000.0),
        "rms_norm_eps": _positive_float(raw, "rms_norm_eps", where, 1e-6),
        "tie_word_embeddings": _bool(raw, "tie_word_embeddings", where, False),
        "attention_bias": attention_bias,
        "max_position_embeddings": _positive_int(raw, "max_position_embeddings", where, default=2048),
        "bos_token_id": _token_ids(bos, "bos_token_id", where),
        "eos_token_id": _token_ids(eos, "eos_token_id", where),
        "hidden_act": "silu",
    })
    return cfg
