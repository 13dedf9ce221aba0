#!/usr/bin/env python3
"""Write a random-weight HF checkpoint directory with exactly a given config (e.g. Qwen2.5-0.5B-Instruct).

Usage:
  /usr/bin/python3 tools/make_random_checkpoint.py OUT_DIR \
      --config ../shared/data/models/qwen2.5-0.5b-instruct/config.json \
      --tokenizer-dir ../shared/data/tokenizers/qwen2 [--seed 0] [--dtype bf16] [--num-layers N]

Writes OUT_DIR/{config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json} (+ vocab.json/merges.txt when the tokenizer dir has them).
Weights: every matrix, embedding and bias ~ Normal(0, --std) (default 0.02, like HF's
initializer_range), RMSNorm weights 1. Each tensor has its own generator seeded from --seed and
the tensor name, so a --num-layers variant shares its layers' weights with the full model.
The tokenizer dir either has a tokenizer.json (copied, with tokenizer_config.json if present), or
the Qwen2 vocab.json + merges.txt pair, from which a Qwen2 byte-level tokenizer.json and a
tokenizer_config.json with the ChatML chat template (the dir's *.jinja file) are built.
generation_config.json is copied from the config's directory when present.
The full Qwen2.5-0.5B shape is ~0.5 B parameters: ~1 GB in bf16. Never commit the output.
"""
import argparse
import glob
import json
import os
import shutil
import sys
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from kvcache_tools.config import (check_weight_budget, normalize_config, physical_memory,  # noqa: E402
                                  weight_tensors)
from kvcache_tools.errors import ToolError, run_cli  # noqa: E402
from kvcache_tools.export import DTYPES  # noqa: E402
from kvcache_tools.fileio import (load_json, parse_json, prepare_output_dir, read_text,  # noqa: E402
                                  write_text_atomic)
from kvcache_tools.safetensors_io import LazyTensor, write_safetensors  # noqa: E402
from kvcache_tools.tokenizer_check import check_tokenizer_files  # noqa: E402
from kvcache_tools.tokenizer_json import dumps, qwen2_byte_level, qwen2_tokenizer_config, read_merges  # noqa: E402


def random_tensor(name: str, shape, seed: int, std: float, dtype: torch.dtype) -> torch.Tensor:
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return torch.ones(shape, dtype=dtype)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=g, dtype=torch.float32) * std).to(dtype)


def tokenizer_texts(tok_dir: str, vocab_size: int):
    """The tokenizer files to write (name -> text), read and checked as the exporter will check
    them (token ids inside vocab_size) before anything is written."""
    if not os.path.isdir(tok_dir):
        raise ToolError(f"{tok_dir}: tokenizer directory not found")
    tj = os.path.join(tok_dir, "tokenizer.json")
    out = {}
    if os.path.exists(tj):
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            path = os.path.join(tok_dir, name)
            if os.path.exists(path):
                out[name] = read_text(path, name)
        if "special_tokens_map.json" in out:  # not read by the loader; still must be JSON
            load_json(os.path.join(tok_dir, "special_tokens_map.json"), "special tokens map")
        paths = {name: os.path.join(tok_dir, name) for name in out}
    else:
        vj, mt = os.path.join(tok_dir, "vocab.json"), os.path.join(tok_dir, "merges.txt")
        for p in (vj, mt):
            if not os.path.exists(p):
                raise ToolError(f"{p}: tokenizer file not found (need tokenizer.json, or vocab.json + merges.txt)")
        vocab_text = read_text(vj, "vocab")
        vocab = parse_json(vocab_text, vj, "vocab")
        merges_text = read_text(mt, "merges.txt")
        merges = read_merges(merges_text, mt)
        if not isinstance(vocab, dict) or len(vocab) != 151643:
            raise ToolError(f"{vj}: expected the Qwen2 vocabulary (151643 entries), got "
                            f"{len(vocab) if isinstance(vocab, dict) else type(vocab).__name__}")
        templates = sorted(glob.glob(os.path.join(tok_dir, "*.jinja")))
        if len(templates) != 1:
            raise ToolError(f"{tok_dir}: expected exactly one *.jinja chat template, found {len(templates)}")
        template = read_text(templates[0], "chat template").rstrip("\n")
        out = {"vocab.json": vocab_text, "merges.txt": merges_text,
               "tokenizer.json": dumps(qwen2_byte_level(vocab, merges)) + "\n",
               "tokenizer_config.json": dumps(qwen2_tokenizer_config(template)) + "\n"}
        paths = {"vocab.json": vj, "merges.txt": mt, "tokenizer.json": f"{tok_dir} (built tokenizer.json)",
                 "tokenizer_config.json": f"{tok_dir} (built tokenizer_config.json)"}
    check_tokenizer_files({k: v for k, v in out.items() if k != "special_tokens_map.json"}, paths, vocab_size)
    return out


def make(out_dir: str, config_path: str, tok_dir: str, seed: int, dtype_name: str, num_layers, std: float) -> None:
    raw = load_json(config_path, "model config")
    if not isinstance(raw, dict):
        raise ToolError(f"{config_path}: must be a JSON object")
    if num_layers is not None:
        if num_layers <= 0:
            raise ToolError(f"--num-layers must be positive, got {num_layers}")
        raw = dict(raw)
        raw["num_hidden_layers"] = num_layers
        if isinstance(raw.get("max_window_layers"), int):
            raw["max_window_layers"] = min(raw["max_window_layers"], num_layers)
    gen_path = os.path.join(os.path.dirname(os.path.abspath(config_path)), "generation_config.json")
    gen_text = read_text(gen_path, "generation config") if os.path.exists(gen_path) else None
    gen = load_json(gen_path, "generation config") if gen_text is not None else None
    cfg = normalize_config(raw, config_path, gen, gen_path)  # validates; the raw config is what gets written
    dtype, dtype_str = DTYPES[dtype_name]
    itemsize = torch.finfo(dtype).bits // 8
    ram = physical_memory()
    # one tensor at a time: drawn in float32, cast, serialised in memory (~3 copies)
    check_weight_budget(cfg, config_path, itemsize, dtype_str, ram // 3 if ram else None, None,
                        "the {} one tensor may take (a third of this machine's RAM: each is drawn in "
                        "float32, cast and serialised in memory)")
    disk = os.path.abspath(out_dir)
    while not os.path.isdir(disk):  # the directory it will be created in
        disk = os.path.dirname(disk)
    check_weight_budget(cfg, config_path, itemsize, dtype_str, None, shutil.disk_usage(disk).free,
                        f"the {{}} free in {disk}")
    tok = tokenizer_texts(tok_dir, cfg["vocab_size"])
    prepare_output_dir(out_dir)

    note = f"random weights: Normal(0, {std}) (norms 1), seed {seed}, {dtype_name}; not a trained model"
    lazy = [(name, LazyTensor(shape, dtype, (lambda n=name, s=shape: random_tensor(n, s, seed, std, dtype))))
            for _, name, shape, _ in weight_tensors(cfg)]
    write_safetensors(os.path.join(out_dir, "model.safetensors"), lazy, {"format": "pt", "note": note})
    raw = dict(raw)
    raw["torch_dtype"] = dtype_str
    raw["_kvcache_note"] = note
    write_text_atomic(os.path.join(out_dir, "config.json"),
                      json.dumps(raw, indent=2, allow_nan=False) + "\n")
    if gen_text is not None:
        write_text_atomic(os.path.join(out_dir, "generation_config.json"), gen_text)
    for name, text in tok.items():
        write_text_atomic(os.path.join(out_dir, name), text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--config", required=True, help="config.json to reproduce")
    ap.add_argument("--tokenizer-dir", required=True, help="dir with tokenizer.json, or Qwen2 vocab.json + merges.txt + *.jinja")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--num-layers", type=int, default=None, help="override num_hidden_layers (quick variants)")
    ap.add_argument("--std", type=float, default=0.02, help="init std (default 0.02)")
    args = ap.parse_args(argv)
    return run_cli(lambda: make(args.out_dir, args.config, args.tokenizer_dir, args.seed, args.dtype,
                                args.num_layers, args.std), f"wrote {args.out_dir}")


if __name__ == "__main__":
    sys.exit(main())
