"""Reading a Hugging Face checkpoint directory (config + safetensors weights + tokenizer files)."""
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from .config import normalize_config, weight_tensors
from .errors import ToolError
from .fileio import load_json, read_text, shown
from .model import GLOBAL_TENSORS, SHAPE_FIELDS
from .safetensors_io import SafetensorsFile
from .tokenizer_check import check_tokenizer_files

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# tensors some checkpoints carry that the model recomputes (ignored when present)
IGNORED_TENSOR = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def open_weight_files(ckpt_dir: str) -> Tuple[Dict[str, SafetensorsFile], List[str]]:
    """Returns (tensor name -> the SafetensorsFile holding it, list of relative file names).
    Reads model.safetensors, or the shards listed by model.safetensors.index.json (headers only)."""
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
        for name, shard in wm.items():
            if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard:
                raise ToolError(f"{index}: field 'weight_map.{name}' names an invalid shard file {shown(shard)}")
        files: Dict[str, SafetensorsFile] = {}
        owner: Dict[str, SafetensorsFile] = {}
        for shard in sorted(set(wm.values())):
            path = os.path.join(ckpt_dir, shard)
            if not os.path.isfile(path):
                raise ToolError(f"{path}: weight shard listed in {WEIGHTS_INDEX} 'weight_map' not found")
            files[shard] = SafetensorsFile(path)
        for name, shard in wm.items():
            if name not in files[shard].tensors:
                raise ToolError(f"{files[shard].path}: tensor '{name}' listed in {WEIGHTS_INDEX} "
                                f"'weight_map' is not in this shard")
            owner[name] = files[shard]
        for shard, f in files.items():  # tensors in a shard but not in the map, or in two shards
            for name in f.keys():
                if name not in owner:
                    raise ToolError(f"{f.path}: tensor '{name}' is not listed in {WEIGHTS_INDEX} 'weight_map'")
                if owner[name] is not f:
                    raise ToolError(f"{f.path}: tensor '{name}' is also in {owner[name].path}, "
                                    f"where {WEIGHTS_INDEX} 'weight_map' puts it")
        return owner, sorted(files)
    raise ToolError(f"{single}: weight file not found (nor a sharded {WEIGHTS_INDEX}) in {ckpt_dir}")


def load_config(ckpt_dir: str) -> Tuple[Dict, Optional[Dict]]:
    """Returns (normalised config, generation_config or None)."""
    gen_path = os.path.join(ckpt_dir, "generation_config.json")
    gen = load_json(gen_path, "generation config") if os.path.exists(gen_path) else None
    cfg_path = os.path.join(ckpt_dir, "config.json")
    raw = load_json(cfg_path, "model config")
    return normalize_config(raw, cfg_path, gen, gen_path), gen


def check_finite(t: torch.Tensor, where: str, name: str, what: str = "") -> None:
    """ToolError naming the tensor when it holds NaN or +-Inf values (counts and the first index).
    `what` says how they arose when not in the file itself (e.g. "after conversion to float16")."""
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        n_nan = int(torch.isnan(t).sum())
        n_inf = int(bad.sum()) - n_nan
        first = [int(i) for i in bad.nonzero()[0]]
        kinds = ", ".join(k for k in (f"{n_nan} NaN" if n_nan else "", f"{n_inf} infinite" if n_inf else "") if k)
        raise ToolError(f"{where}: tensor '{name}' has {kinds} value{'s' if n_nan + n_inf > 1 else ''}"
                        f"{what} (first at index {first}); the export would compute NaN logits")


def load_weights(ckpt_dir: str, cfg: Dict, dtype: torch.dtype) -> Tuple[Dict[str, torch.Tensor], List[str], List[str]]:
    """Loads every tensor the config implies into stacked [L, ...] tensors of `dtype`.

    Every tensor's presence and header shape is checked against the config before any tensor
    data is read or any buffer allocated. Returns (weights by KVCacheModel buffer name, relative
    weight file names, sorted set of the safetensors dtypes found). Raises ToolError for a missing
    tensor, a wrong shape, an unexpected tensor (config and weights disagree) or a NaN/Inf value
    (in the file, or from the cast to `dtype`), naming the file, tensor and config fields."""
    owner, files = open_weight_files(ckpt_dir)
    L = cfg["num_hidden_layers"]
    cfg_file = os.path.join(ckpt_dir, "config.json")
    plan = weight_tensors(cfg)
    used = {name for _, name, _, _ in plan}
    for buf, hf_name, shape, _ in plan:  # 1. headers against the config: nothing is read yet
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
        if info.shape != shape:
            raise ToolError(f"{f.path}: tensor '{hf_name}' has shape {info.shape} but {cfg_file} implies "
                            f"{shape} [{', '.join(SHAPE_FIELDS[buf])}]")
    if cfg["tie_word_embeddings"]:
        used.add(GLOBAL_TENSORS["lm_head"])  # tied: HF ignores a stored copy too
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

    dtype_name = str(dtype).replace("torch.", "")
    weights: Dict[str, torch.Tensor] = {}
    dtypes = set()
    for buf, hf_name, shape, layer in plan:  # 2. read, check, place
        f = owner[hf_name]
        dtypes.add(f.tensors[hf_name].dtype)
        t = f.get(hf_name)
        check_finite(t, f.path, hf_name)
        t = t.to(dtype)
        if dtype != torch.float32:
            check_finite(t, f.path, hf_name, f" after conversion to {dtype_name} (out of its range)")
        if layer is not None:
            if buf not in weights:
                weights[buf] = torch.empty([L] + shape, dtype=dtype)
            weights[buf][layer].copy_(t)
        else:
            weights[buf] = t
    return weights, files, sorted(dtypes)


def tokenizer_files(ckpt_dir: str, vocab_size: int) -> Dict[str, str]:
    """The tokenizer and generation files to embed: tokenizer.json, else vocab.json + merges.txt
    (one of the two is required); tokenizer_config.json and generation_config.json when present.
    Each is checked as the C++ loader reads it (tokenizer_check; every token id inside the
    model's vocab_size); an empty one is an error."""
    out: Dict[str, str] = {}
    tj = os.path.join(ckpt_dir, "tokenizer.json")
    vj = os.path.join(ckpt_dir, "vocab.json")
    mt = os.path.join(ckpt_dir, "merges.txt")
    if os.path.exists(tj):
        names = ["tokenizer.json"]
    elif os.path.exists(vj) and os.path.exists(mt):
        names = ["vocab.json", "merges.txt"]
    elif os.path.exists(vj):
        raise ToolError(f"{mt}: tokenizer file not found (vocab.json needs merges.txt; or give tokenizer.json)")
    else:
        raise ToolError(f"{tj}: tokenizer file not found (need tokenizer.json, or vocab.json + merges.txt) "
                        f"in {ckpt_dir}")
    for opt in ("tokenizer_config.json", "generation_config.json"):
        if os.path.exists(os.path.join(ckpt_dir, opt)):
            names.append(opt)
    paths = {name: os.path.join(ckpt_dir, name) for name in names}
    for name in names:
        text = read_text(paths[name], name)
        if not text.strip():
            raise ToolError(f"{paths[name]}: {name} is empty")
        out[name] = text
    # generation_config.json was parsed and checked with config.json (load_config)
    check_tokenizer_files(out, paths, vocab_size)
    return out
