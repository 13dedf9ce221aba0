"""Export a HF checkpoint directory to one TorchScript .pt following model ABI v1."""
import json
import os
import shutil
from typing import Dict, Optional, Tuple

import torch

from .checkpoint import load_config, load_weights, tokenizer_files
from .config import check_weight_budget, dumps_config, format_bytes, physical_memory
from .errors import ToolError
from .fileio import atomic_output, check_output_path
from .model import KVCacheModel

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


def build_model(ckpt_dir: str, dtype_name: str = "fp32", out_dir: Optional[str] = None):
    """Returns (scripted module, extra files dict). Raises ToolError on bad input: everything is
    checked (config, its size against this machine's RAM and, with out_dir, the free disk space
    there, the tokenizer files, every tensor header) before the weights are read."""
    if dtype_name not in DTYPES:
        raise ToolError(f"--dtype: unsupported export dtype '{dtype_name}' (supported: {', '.join(DTYPES)})")
    if not os.path.isdir(ckpt_dir):
        raise ToolError(f"{ckpt_dir}: checkpoint directory not found")
    dtype, dtype_str = DTYPES[dtype_name]
    cfg, _gen = load_config(ckpt_dir)
    cfg_path = os.path.join(ckpt_dir, "config.json")
    ram = physical_memory()
    budget = ram // 2 if ram else None
    total = check_weight_budget(cfg, cfg_path, torch.finfo(dtype).bits // 8, dtype_str, budget, budget,
                                "the {} the export may use (half this machine's RAM: it holds every "
                                "weight, then the serialised file, in memory)")
    if out_dir is not None:
        free = shutil.disk_usage(out_dir).free
        if total > free:
            raise ToolError(f"{cfg_path}: the export needs {format_bytes(total)} of {dtype_str} weights, "
                            f"more than the {format_bytes(free)} free in the output directory {out_dir}")
    tok = tokenizer_files(ckpt_dir, cfg["vocab_size"])  # checked before the (slow) weight load
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
             "config.json": dumps_config(cfg)}
    extra.update(tok)
    return scripted, extra


def export_checkpoint(ckpt_dir: str, out_path: str, dtype_name: str = "fp32") -> Dict[str, str]:
    """Builds and saves the module atomically (temp file in the output directory, created first so
    an unwritable directory fails at once; fsync; rename). Returns the extra files. On any failure,
    Ctrl-C or a full disk included, neither the output nor a temp file is left.

    The archive is serialised in memory and written by Python: LibTorch 1.13's file writer
    (torch.jit.save to a path) throws from its destructor on a write error, which aborts the
    process before any cleanup can run."""
    out_dir = check_output_path(out_path)
    with atomic_output(out_path) as tmp:
        scripted, extra = build_model(ckpt_dir, dtype_name, out_dir)
        data = scripted.save_to_buffer(_extra_files=extra)
        del scripted
        with open(tmp, "wb") as f:
            f.write(data)
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
