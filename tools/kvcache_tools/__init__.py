"""Shared code of libkvcache's Python tools (run with Debian's /usr/bin/python3: torch + numpy only).

Modules:
  errors          ToolError, the one exception type the command-line tools turn into "error: ..." + exit 1
  fileio          strict JSON (what the C++ loader's reader accepts), UTF-8 text, atomic output files
  safetensors_io  a dependency-free safetensors reader/writer (BF16/F16/F32)
  config          config.json normalisation and validation for model_type llama / qwen2, weight budget
  checkpoint      HF checkpoint directory -> stacked per-layer weights + extra files
  model           KVCacheModel, the TorchScript module of model ABI v1 (docs/model-abi.md)
  tokenizer_json  builders for tokenizer.json (byte-level BPE, SentencePiece-style BPE)
  tokenizer_check tokenizer files checked as the C++ tokenizer loader reads them
  export          export a checkpoint directory to one TorchScript .pt (atomic write)
"""
