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

from kvcache_tools.config import load_json, normalize_config  # noqa: E402
from kvcache_tools.errors import ToolError, run_cli  # noqa: E402
from kvcache_tools.export import DTYPES  # noqa: E402
from kvcache_tools.model import GLOBAL_TENSORS, expected_shapes, per_layer_tensors  # noqa: E402
from kvcache_tools.safetensors_io import LazyTensor, write_safetensors, write_text_atomic  # noqa: E402
from kvcache_tools.tokenizer_json import (dumps, qwen2_byte_level, qwen2_tokenizer_config,  # noqa: E402
                                          read_merges)



def random_tensor(name: str, shape, seed: int, std: float, dtype: torch.dtype) -> torch.Tensor:
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return torch.ones(shape, dtype=dtype)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=g, dtype=torch.float32) * std).to(dtype)


def write_tokenizer(tok_dir: str, out_dir: str) -> None:
    if not os.path.isdir(tok_dir):
        raise ToolError(f"{tok_dir}: tokenizer directory not found")
    tj = os.path.join(tok_dir, "tokenizer.json")
    if os.path.isfile(tj):
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if os.path.isfile(os.path.join(tok_dir, name)):
                shutil.copyfile(os.path.join(tok_dir, name), os.path.join(out_dir, name))
        return
    vj, mt = os.path.join(tok_dir, "vocab.json"), os.path.join(tok_dir, "merges.txt")
    for p in (vj, mt):
        if not os.path.isfile(p):
            raise ToolError(f"{p}: tokenizer file not found (need tokenizer.json, or vocab.json + merges.txt)")
    vocab = load_json(vj, "vocab")
    with open(mt, "r", encoding="utf-8") as f:
        merges = read_merges(f.read(), mt)
    if not isinstance(vocab, dict) or len(vocab) != 151643:
        raise ToolError(f"{vj}: expected the Qwen2 vocabulary (151643 entries), got "
                        f"{len(vocab) if isinstance(vocab, dict) else type(vocab).__name__}")
    shutil.copyfile(vj, os.path.join(out_dir, "vocab.json"))
    shutil.copyfile(mt, os.path.join(out_dir, "merges.txt"))
    write_text_atomic(os.path.join(out_dir, "tokenizer.json"), dumps(qwen2_byte_level(vocab, merges)) + "\n")
    templates = sorted(glob.glob(os.path.join(tok_dir, "*.jinja")))
    if len(templates) != 1:
        raise ToolError(f"{tok_dir}: expected exactly one *.jinja chat template, found {len(templates)}")
    with open(templates[0], "r", encoding="utf-8") as f:
        template = f.read().rstrip("\n")
    write_text_atomic(os.path.join(out_dir, "tokenizer_config.json"), dumps(qwen2_tokenizer_config(template)) + "\n")


def make(out_dir: str, config_path: str, tok_dir: str, seed: int, dtype_name: str, num_layers, std: float) -> None:
    raw = load_json(config_path, "model config")
    if num_layers is not None:
        if num_layers <= 0:
            raise ToolError(f"--num-layers must be positive, got {num_layers}")
        raw = dict(raw)
        raw["num_hidden_layers"] = num_layers
        if "max_window_layers" in raw:
            raw["max_window_layers"] = min(raw["max_window_layers"], num_layers)
    cfg = normalize_config(raw, config_path)  # validates; the raw config is what gets written
    dtype, dtype_str = DTYPES[dtype_name]
    shapes = expected_shapes(cfg)
    names = {"embed_tokens": GLOBAL_TENSORS["embed_tokens"], "final_norm": GLOBAL_TENSORS["final_norm"]}
    tensors = [(names[k], shapes[k]) for k in names]
    if not cfg["tie_word_embeddings"]:
        tensors.append((GLOBAL_TENSORS["lm_head"], shapes["lm_head"]))
    per_layer = per_layer_tensors(cfg)
    for i in range(cfg["num_hidden_layers"]):
        tensors += [(pattern.format(i=i), shapes[buf]) for buf, pattern in per_layer.items()]
    os.makedirs(out_dir, exist_ok=True)
    note = f"random weights: Normal(0, {std}) (norms 1), seed {seed}, {dtype_name}; not a trained model"
    lazy = [(n, LazyTensor(s, dtype, (lambda n=n, s=s: random_tensor(n, s, seed, std, dtype)))) for n, s in tensors]
    write_safetensors(os.path.join(out_dir, "model.safetensors"), lazy, {"format": "pt", "note": note})
    raw = dict(raw)
    raw["torch_dtype"] = dtype_str
    raw["_kvcache_note"] = note
    write_text_atomic(os.path.join(out_dir, "config.json"), json.dumps(raw, indent=2) + "\n")
    gen = os.path.join(os.path.dirname(os.path.abspath(config_path)), "generation_config.json")
    if os.path.isfile(gen):
        shutil.copyfile(gen, os.path.join(out_dir, "generation_config.json"))
    write_tokenizer(tok_dir, out_dir)


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
