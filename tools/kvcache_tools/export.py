"""Export a HF checkpoint directory to one TorchScript .pt following model ABI v1."""
import json
import os
from typing import Dict, Tuple

import torch

from .checkpoint import load_config, load_weights, tokenizer_files
from .errors import ToolError
from .model import KVCacheModel
from .safetensors_io import atomic_output

ABI_VERSION = 1
EXPORT_FORMAT = "libkvcache-torchscript"
EXPORT_INFO_FILE = "libkvcache_export.json"
# CLI name -> (torch dtype, name written to libkvcache_export.json "dtype")
DTYPES: Dict[str, Tuple[torch.dtype, str]] = {
    "fp32": (torch.float32, "float32"),
    "fp16": (torch.float16, "float16"),
    "bf16": (torch.bfloat16, "bfloat16"),
}
# every extra file name a loader may ask for (the C++ side passes these keys to torch::jit::load)
EXTRA_FILE_NAMES = (EXPORT_INFO_FILE, "config.json", "tokenizer.json", "vocab.json", "merges.txt",
                    "tokenizer_config.json", "generation_config.json")


def build_model(ckpt_dir: str, dtype_name: str = "fp32"):
    """Returns (scripted module, extra files dict). Raises ToolError on bad input."""
    if dtype_name not in DTYPES:
        raise ToolError(f"--dtype: unsupported export dtype '{dtype_name}' (supported: {', '.join(DTYPES)})")
    if not os.path.isdir(ckpt_dir):
        raise ToolError(f"{ckpt_dir}: checkpoint directory not found")
    dtype, dtype_str = DTYPES[dtype_name]
    cfg, _gen = load_config(ckpt_dir)
    tok = tokenizer_files(ckpt_dir)  # checked before the (slow) weight load
    weights, files, st_dtypes = load_weights(ckpt_dir, cfg, dtype)
    model = KVCacheModel(cfg, weights, dtype)
    del weights
    model.eval()
    scripted = torch.jit.script(model)
    base = os.path.basename(os.path.normpath(os.path.abspath(ckpt_dir)))
    info = {
        "format": EXPORT_FORMAT,
        "abi_version": ABI_VERSION,
        "model_type": cfg["model_type"],
        "dtype": dtype_str,
        "source": f"{base}/{'+'.join(files)} ({'/'.join(st_dtypes)})",
        "rope": "rotate_half",
    }
    extra = {EXPORT_INFO_FILE: json.dumps(info, indent=1),
             "config.json": json.dumps(cfg, indent=1, ensure_ascii=False)}
    extra.update(tok)
    return scripted, extra


def export_checkpoint(ckpt_dir: str, out_path: str, dtype_name: str = "fp32") -> Dict[str, str]:
    """Builds and saves the module atomically (temp file + rename). Returns the extra files."""
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise ToolError(f"{out_path}: output directory {out_dir} does not exist")
    scripted, extra = build_model(ckpt_dir, dtype_name)
    with atomic_output(out_path) as tmp:
        torch.jit.save(scripted, tmp, _extra_files=extra)
    return extra


def load_export(path: str):
    """Loads an exported .pt: returns (module, extra files present, config dict, export info).
    Raises ToolError when the file lacks libkvcache_export.json (not a libkvcache export)."""
    files = {name: "" for name in EXTRA_FILE_NAMES}
    module = torch.jit.load(path, _extra_files=files, map_location="cpu")
    present = {k: (v.decode("utf-8") if isinstance(v, bytes) else v) for k, v in files.items() if v}
    if EXPORT_INFO_FILE not in present:
        raise ToolError(f"{path}: not a libkvcache export (no {EXPORT_INFO_FILE} extra file)")
    info = json.loads(present[EXPORT_INFO_FILE])
    if info.get("abi_version") != ABI_VERSION:
        raise ToolError(f"{path}: {EXPORT_INFO_FILE} abi_version={info.get('abi_version')!r}, expected {ABI_VERSION}")
    return module, present, json.loads(present["config.json"]), info
