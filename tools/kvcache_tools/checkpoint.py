"""Reading a Hugging Face checkpoint directory (config + safetensors weights + tokenizer files)."""
import json
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from .config import load_json, normalize_config
from .errors import ToolError
from .model import GLOBAL_TENSORS, expected_shapes, per_layer_tensors
from .safetensors_io import SafetensorsFile

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# tensors some checkpoints carry that the model recomputes (ignored when present)
IGNORED_TENSOR = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def open_weight_files(ckpt_dir: str) -> Tuple[Dict[str, SafetensorsFile], List[str]]:
    """Returns (tensor name -> the SafetensorsFile holding it, list of relative file names).
    Reads model.safetensors, or the shards listed by model.safetensors.index.json."""
    single = os.path.join(ckpt_dir, WEIGHTS_FILE)
    index = os.path.join(ckpt_dir, WEIGHTS_INDEX)
    if os.path.isfile(single):
        f = SafetensorsFile(single)
        return {name: f for name in f.keys()}, [WEIGHTS_FILE]
    if os.path.isfile(index):
        idx = load_json(index, "safetensors index")
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise ToolError(f"{index}: field 'weight_map' is missing or empty")
        files: Dict[str, SafetensorsFile] = {}
        owner: Dict[str, SafetensorsFile] = {}
        for shard in sorted(set(wm.values())):
            if not isinstance(shard, str) or os.path.basename(shard) != shard:
                raise ToolError(f"{index}: field 'weight_map' names an invalid shard file {shard!r}")
            path = os.path.join(ckpt_dir, shard)
            if not os.path.isfile(path):
                raise ToolError(f"{path}: weight shard listed in {WEIGHTS_INDEX} 'weight_map' not found")
            files[shard] = SafetensorsFile(path)
        for name, shard in wm.items():
            if name not in files[shard].tensors:
                raise ToolError(f"{files[shard].path}: tensor '{name}' listed in {WEIGHTS_INDEX} "
                                f"'weight_map' is not in this shard")
            owner[name] = files[shard]
        for shard, f in files.items():  # tensors in a shard but not in the map
            for name in f.keys():
                if name not in owner:
                    raise ToolError(f"{f.path}: tensor '{name}' is not listed in {WEIGHTS_INDEX} 'weight_map'")
        return owner, sorted(files)
    raise ToolError(f"{single}: weight file not found (nor a sharded {WEIGHTS_INDEX}) in {ckpt_dir}")


def load_config(ckpt_dir: str) -> Tuple[Dict, Optional[Dict]]:
    """Returns (normalised config, generation_config or None)."""
    gen_path = os.path.join(ckpt_dir, "generation_config.json")
    gen = load_json(gen_path, "generation config") if os.path.isfile(gen_path) else None
    cfg_path = os.path.join(ckpt_dir, "config.json")
    raw = load_json(cfg_path, "model config")
    return normalize_config(raw, cfg_path, gen), gen


def load_weights(ckpt_dir: str, cfg: Dict, dtype: torch.dtype) -> Tuple[Dict[str, torch.Tensor], List[str], List[str]]:
    """Loads every tensor the config implies into stacked [L, ...] tensors of `dtype`.

    Returns (weights by KVCacheModel buffer name, relative weight file names, sorted set of the
    safetensors dtypes found). Raises ToolError for a missing tensor, a wrong shape or an
    unexpected tensor (config and weights disagree), naming the file, tensor and config fields."""
    owner, files = open_weight_files(ckpt_dir)
    L = cfg["num_hidden_layers"]
    shapes = expected_shapes(cfg)
    cfg_desc = {
        "input_norm": "hidden_size", "post_norm": "hidden_size", "final_norm": "hidden_size",
        "wq": "num_attention_heads*head_dim, hidden_size", "bq": "num_attention_heads*head_dim",
        "wk": "num_key_value_heads*head_dim, hidden_size", "bk": "num_key_value_heads*head_dim",
        "wv": "num_key_value_heads*head_dim, hidden_size", "bv": "num_key_value_heads*head_dim",
        "wo": "hidden_size, num_attention_heads*head_dim",
        "w_gate": "intermediate_size, hidden_size", "w_up": "intermediate_size, hidden_size",
        "w_down": "hidden_size, intermediate_size",
        "embed_tokens": "vocab_size, hidden_size", "lm_head": "vocab_size, hidden_size",
    }
    cfg_file = os.path.join(ckpt_dir, "config.json")
    used = set()
    dtypes = set()

    def fetch(buf: str, hf_name: str) -> torch.Tensor:
        f = owner.get(hf_name)
        if f is None:
            where = os.path.join(ckpt_dir, files[0]) if len(files) == 1 else os.path.join(ckpt_dir, WEIGHTS_INDEX)
            hint = f" (config.json num_hidden_layers={L})" if ".layers." in hf_name else ""
            if buf.startswith("b"):
                hint = f" ({cfg_file}: attention_bias={str(cfg['attention_bias']).lower()}, model_type={cfg['model_type']})"
            if buf == "lm_head":
                hint = f" ({cfg_file}: tie_word_embeddings=false)"
            raise ToolError(f"{where}: tensor '{hf_name}' is missing{hint}")
        info = f.tensors[hf_name]
        if info.shape != shapes[buf]:
            raise ToolError(f"{f.path}: tensor '{hf_name}' has shape {info.shape} but {cfg_file} implies "
                            f"{shapes[buf]} [{cfg_desc[buf]}]")
        used.add(hf_name)
        dtypes.add(info.dtype)
        return f.get(hf_name, dtype)

    weights: Dict[str, torch.Tensor] = {}
    for buf, pattern in per_layer_tensors(cfg).items():
        out = torch.empty([L] + shapes[buf], dtype=dtype)
        for i in range(L):
            out[i].copy_(fetch(buf, pattern.format(i=i)))
        weights[buf] = out
    weights["embed_tokens"] = fetch("embed_tokens", GLOBAL_TENSORS["embed_tokens"])
    weights["final_norm"] = fetch("final_norm", GLOBAL_TENSORS["final_norm"])
    if cfg["tie_word_embeddings"]:
        if GLOBAL_TENSORS["lm_head"] in owner:  # tied: HF ignores a stored copy too
            used.add(GLOBAL_TENSORS["lm_head"])
    else:
        weights["lm_head"] = fetch("lm_head", GLOBAL_TENSORS["lm_head"])
    for name, f in owner.items():
        if name in used or IGNORED_TENSOR.match(name):
            continue
        why = ""
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= L:
            why = f" (layer {m.group(1)} but {cfg_file}: num_hidden_layers={L})"
        elif name.endswith(".bias") and not cfg["attention_bias"]:
            why = f" ({cfg_file}: attention_bias=false)"
        raise ToolError(f"{f.path}: unexpected tensor '{name}' not used by config.json{why}")
    return weights, files, sorted(dtypes)


def read_text(path: str, what: str) -> str:
    try:
        with open(path, "r", encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ToolError(f"{path}: {what} is not UTF-8 text: {e}") from None


def tokenizer_files(ckpt_dir: str) -> Dict[str, str]:
    """The tokenizer and generation files to embed: tokenizer.json, else vocab.json + merges.txt
    (one of the two is required); tokenizer_config.json and generation_config.json when present.
    Empty files are left out. JSON files are checked to parse."""
    out: Dict[str, str] = {}
    tj = os.path.join(ckpt_dir, "tokenizer.json")
    vj = os.path.join(ckpt_dir, "vocab.json")
    mt = os.path.join(ckpt_dir, "merges.txt")
    if os.path.isfile(tj):
        names = ["tokenizer.json"]
    elif os.path.isfile(vj) and os.path.isfile(mt):
        names = ["vocab.json", "merges.txt"]
    elif os.path.isfile(vj):
        raise ToolError(f"{mt}: tokenizer file not found (vocab.json needs merges.txt; or give tokenizer.json)")
    else:
        raise ToolError(f"{tj}: tokenizer file not found (need tokenizer.json, or vocab.json + merges.txt) "
                        f"in {ckpt_dir}")
    for opt in ("tokenizer_config.json", "generation_config.json"):
        if os.path.isfile(os.path.join(ckpt_dir, opt)):
            names.append(opt)
    for name in names:
        path = os.path.join(ckpt_dir, name)
        text = read_text(path, name)
        if name.endswith(".json"):
            try:
                json.loads(text) if text.strip() else None
            except json.JSONDecodeError as e:
                raise ToolError(f"{path}: {name} is not valid JSON: {e}") from None
        if text.strip():
            out[name] = text
        elif name in ("tokenizer.json", "vocab.json", "merges.txt"):
            raise ToolError(f"{path}: tokenizer file is empty")
    return out
