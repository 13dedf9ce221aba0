#!/usr/bin/env python3
"""Convert a llama2.c checkpoint (legacy version-0 .bin) + tokenizer (.bin) to an HF-style Llama dir.

Usage: /usr/bin/python3 tools/convert_llama2c.py stories260K.bin tok512.bin OUT_DIR

Writes OUT_DIR/{config.json, model.safetensors (F32), tokenizer.json, tokenizer_config.json,
generation_config.json}, which tools/export_torchscript.py then exports.

llama2.c rotates adjacent pairs (2i, 2i+1) of each head; HF Llama (and model ABI v1) rotates
(i, i + D/2) (rotate_half). As HF's convert_llama_weights_to_hf.py does, the rows of wq and wk are
permuted inside each head (row 2i -> i, row 2i+1 -> i + D/2) so rotate_half reproduces llama2.c
exactly: q.k dot products are unchanged, and post-RoPE keys equal llama2.c's up to that
permutation of the head dimension.

File formats: see ../shared/data/models/stories260K/README.md.
"""
import argparse
import math
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvcache_tools.checkpoint import check_finite  # noqa: E402
from kvcache_tools.config import normalize_config  # noqa: E402
from kvcache_tools.errors import ToolError, run_cli  # noqa: E402
from kvcache_tools.fileio import prepare_output_dir, write_text_atomic  # noqa: E402
from kvcache_tools.safetensors_io import write_safetensors  # noqa: E402
from kvcache_tools.tokenizer_check import check_tokenizer_files  # noqa: E402
from kvcache_tools.tokenizer_json import SPIECE_UNDERLINE, dumps, sentencepiece_bpe  # noqa: E402

HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")


def permute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF convert_llama_weights_to_hf.permute: per head, rows (2i, 2i+1) -> (i, i + D/2)."""
    out_dim, in_dim = w.shape
    return w.view(n_heads, out_dim // n_heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def read_checkpoint(path: str):
    """Returns (header dict, shared_classifier, {name: float32 tensor}) of a version-0 llama2.c file.
    The header is checked against the file size before the weights are read; NaN/Inf weights are
    rejected naming the tensor."""
    if not os.path.isfile(path):
        raise ToolError(f"{path}: llama2.c checkpoint not found")
    size = os.path.getsize(path)
    if size < 28:
        raise ToolError(f"{path}: truncated llama2.c checkpoint: {size} bytes, shorter than the 28-byte header")
    with open(path, "rb") as f:
        head = f.read(28)
    hdr = dict(zip(HEADER_FIELDS, struct.unpack("<7i", head)))
    shared = hdr["vocab_size"] > 0
    hdr["vocab_size"] = abs(hdr["vocab_size"])
    for k, v in hdr.items():
        if v <= 0:
            raise ToolError(f"{path}: header field '{k}' = {v} must be positive (not a version-0 llama2.c checkpoint?)")
    dim, hid, L, nh, nkv, V, S = (hdr[k] for k in HEADER_FIELDS)
    if dim % nh or nh % nkv or (dim // nh) % 2:
        raise ToolError(f"{path}: header dim={dim}, n_heads={nh}, n_kv_heads={nkv} are inconsistent")
    hs = dim // nh
    kv_dim = dim * nkv // nh
    layout = [
        ("tok_embeddings", [V, dim]), ("rms_att", [L, dim]), ("wq", [L, dim, dim]), ("wk", [L, kv_dim, dim]),
        ("wv", [L, kv_dim, dim]), ("wo", [L, dim, dim]), ("rms_ffn", [L, dim]), ("w1", [L, hid, dim]),
        ("w2", [L, dim, hid]), ("w3", [L, hid, dim]), ("rms_final", [dim]),
        ("freq_cis_real", [S, hs // 2]), ("freq_cis_imag", [S, hs // 2]),
    ]
    if not shared:
        layout.append(("wcls", [V, dim]))
    need = 28 + 4 * sum(math.prod(s) for _, s in layout)  # Python ints: no overflow
    if size < need:
        raise ToolError(f"{path}: truncated llama2.c checkpoint: {size} bytes, header "
                        f"({', '.join(f'{k}={hdr[k]}' for k in HEADER_FIELDS)}) needs {need}")
    if size > need:
        raise ToolError(f"{path}: {size} bytes but the header ({', '.join(f'{k}={hdr[k]}' for k in HEADER_FIELDS)}) "
                        f"implies {need}: not a version-0 llama2.c checkpoint")
    with open(path, "rb") as f:
        f.seek(28)
        arr = np.fromfile(f, dtype="<f4", count=(need - 28) // 4)
    if arr.size * 4 + 28 != need:
        raise ToolError(f"{path}: truncated llama2.c checkpoint while reading (the file shrank)")
    tensors, off = {}, 0
    for name, shape in layout:
        n = math.prod(shape)
        tensors[name] = torch.from_numpy(arr[off:off + n].astype(np.float32).reshape(shape))
        if not name.startswith("freq_cis"):  # the RoPE tables are dropped
            check_finite(tensors[name], path, name)
        off += n
    return hdr, shared, tensors


def read_tokenizer(path: str, vocab_size: int):
    """tok512.bin-style file: int32 max_token_length, then per id: float32 score, int32 length, bytes."""
    if not os.path.isfile(path):
        raise ToolError(f"{path}: llama2.c tokenizer not found")
    with open(path, "rb") as f:
        raw = f.read()
    off, pieces, scores = 4, [], []
    for i in range(vocab_size):
        if off + 8 > len(raw):
            raise ToolError(f"{path}: truncated llama2.c tokenizer: piece {i} of {vocab_size} (vocab_size from the checkpoint) missing")
        score, n = struct.unpack("<fi", raw[off:off + 8])
        off += 8
        if not math.isfinite(score):
            raise ToolError(f"{path}: piece {i} has score {score} (not a finite number)")
        if n < 0 or off + n > len(raw):
            raise ToolError(f"{path}: truncated llama2.c tokenizer: piece {i} says {n} bytes")
        try:
            text = raw[off:off + n].decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError(f"{path}: piece {i} is not UTF-8: {raw[off:off + n]!r}") from None
        off += n
        pieces.append(text)
        scores.append(score)
    if off != len(raw):
        raise ToolError(f"{path}: {len(raw) - off} trailing bytes after {vocab_size} pieces "
                        f"(tokenizer and checkpoint vocab_size disagree?)")
    return pieces, scores


def convert(bin_path: str, tok_path: str, out_dir: str) -> None:
    hdr, shared, t = read_checkpoint(bin_path)
    dim, hid, L, nh, nkv, V, S = (hdr[k] for k in HEADER_FIELDS)
    pieces, scores = read_tokenizer(tok_path, V)
    # ids 0/1/2 are <unk>, "\n<s>\n", "\n</s>\n" in llama2.c's file; HF names them <unk>/<s>/</s>
    specials = {0: "<unk>", 1: "<s>", 2: "</s>"}
    hf_pieces = [specials.get(i, p.replace(" ", SPIECE_UNDERLINE)) for i, p in enumerate(pieces)]
    tok = sentencepiece_bpe(hf_pieces, scores, specials, bos="<s>", where=tok_path)

    weights = [("model.embed_tokens.weight", t["tok_embeddings"]), ("model.norm.weight", t["rms_final"])]
    if not shared:
        weights.append(("lm_head.weight", t["wcls"]))
    for i in range(L):
        p = f"model.layers.{i}."
        weights += [
            (p + "input_layernorm.weight", t["rms_att"][i]),
            (p + "self_attn.q_proj.weight", permute_rotary(t["wq"][i], nh)),
            (p + "self_attn.k_proj.weight", permute_rotary(t["wk"][i], nkv)),
            (p + "self_attn.v_proj.weight", t["wv"][i]),
            (p + "self_attn.o_proj.weight", t["wo"][i]),
            (p + "post_attention_layernorm.weight", t["rms_ffn"][i]),
            (p + "mlp.gate_proj.weight", t["w1"][i]),
            (p + "mlp.down_proj.weight", t["w2"][i]),
            (p + "mlp.up_proj.weight", t["w3"][i]),
        ]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": dim, "intermediate_size": hid, "num_hidden_layers": L, "num_attention_heads": nh,
        "num_key_value_heads": nkv, "head_dim": dim // nh, "vocab_size": V, "max_position_embeddings": S,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
        "mlp_bias": False, "tie_word_embeddings": shared, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    tok_config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
                  "unk_token": "<unk>", "clean_up_tokenization_spaces": False, "legacy": False,
                  "tokenizer_class": "LlamaTokenizer", "model_max_length": S}
    gen_config = {"bos_token_id": 1, "eos_token_id": 2}
    # everything is checked as the exporter will check it before anything is written
    normalize_config(config, f"{bin_path}: header (as config.json)", gen_config)
    texts = {name: dumps(doc) + "\n" for name, doc in (("config.json", config), ("tokenizer.json", tok),
                                                       ("tokenizer_config.json", tok_config),
                                                       ("generation_config.json", gen_config))}
    check_tokenizer_files(texts, {"tokenizer.json": f"{tok_path} (as tokenizer.json)",
                                  "tokenizer_config.json": f"{tok_path} (as tokenizer_config.json)"}, V)
    prepare_output_dir(out_dir)
    src = f"{os.path.basename(bin_path)} + {os.path.basename(tok_path)} (llama2.c v0; wq/wk rows permuted to rotate_half)"
    write_safetensors(os.path.join(out_dir, "model.safetensors"), weights, {"format": "pt", "source": src})
    for name, text in texts.items():
        write_text_atomic(os.path.join(out_dir, name), text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="llama2.c model .bin (version 0)")
    ap.add_argument("tokenizer", help="llama2.c tokenizer .bin (e.g. tok512.bin)")
    ap.add_argument("out_dir", help="output directory (created if missing)")
    args = ap.parse_args(argv)
    return run_cli(lambda: convert(args.checkpoint, args.tokenizer, args.out_dir), f"wrote {args.out_dir}")


if __name__ == "__main__":
    sys.exit(main())
