#!/usr/bin/env python3
"""Export a Hugging Face Llama / Qwen2 checkpoint directory to a libkvcache TorchScript module.

Usage: /usr/bin/python3 tools/export_torchscript.py CHECKPOINT_DIR OUT.pt [--dtype fp32|fp16|bf16]

CHECKPOINT_DIR holds config.json (model_type llama or qwen2), model.safetensors or a sharded
model.safetensors.index.json (BF16/F16/F32), tokenizer.json or vocab.json + merges.txt, and
optionally tokenizer_config.json / generation_config.json. The output follows model ABI v1
(docs/model-abi.md). Every input is checked first -- as strict JSON, against what the C++ loader
checks (config values, token ids inside the vocabulary, the tokenizer files), tensor shapes against
the config from the headers, the weight size against RAM and disk, NaN/Inf weights -- and a bad one
is one line "error: FILE: field ...", exit status 1. The file is written to a temp file in the
output directory, fsync'ed and renamed, so a failed or interrupted run leaves nothing.
Needs only torch + numpy (no transformers, no safetensors package, no network).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvcache_tools.errors import run_cli  # noqa: E402
from kvcache_tools.export import DTYPES, export_checkpoint  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint_dir", help="HF checkpoint directory")
    ap.add_argument("out", help="output .pt path")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES),
                    help="weight/activation dtype of the export (default fp32; logits are always fp32)")
    args = ap.parse_args(argv)
    t0 = time.time()
    extra = {}

    def action():
        extra.update(export_checkpoint(args.checkpoint_dir, args.out, args.dtype))

    rc = run_cli(action, f"wrote {args.out}")
    if rc == 0:
        print(f"  {os.path.getsize(args.out) / 1e6:.1f} MB, {args.dtype}, extra files: {', '.join(sorted(extra))}, "
              f"{time.time() - t0:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
