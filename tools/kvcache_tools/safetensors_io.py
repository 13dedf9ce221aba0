"""A small safetensors reader/writer (no `safetensors` package needed).

Format (https://github.com/huggingface/safetensors): 8-byte little-endian unsigned header length N,
then N bytes of UTF-8 JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, optional
"__metadata__": {str: str}}, then the data section; offsets are relative to the start of the data
section, tensors are C-contiguous little-endian. Supported dtypes: F32, F16, BF16.
"""
import json
import os
import struct
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .errors import ToolError
from .fileio import atomic_output, parse_json, write_text_atomic  # noqa: F401  (write_text_atomic: re-exported)

# dtype name -> bytes per element
DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2}
TORCH_TO_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
# a header larger than this is not a model checkpoint header (real ones are < 1 MiB)
MAX_HEADER_BYTES = 100 * 1024 * 1024
# BF16 data labelled F16: BF16 bits read as F16 put every value of magnitude 2^-23 .. 2^9 into
# F16's [0.25, 4) (the F16 exponent is the top 5 bits of the BF16 one). A weight matrix of at
# least MIN_MISLABEL_VALUES nonzero values with at least this fraction of them there is refused:
# real F16 weights spread over magnitudes (TinyStories-656K's: 50-70% in that band; a typical
# N(0, 0.02) matrix: none).
MISLABEL_FRACTION = 0.999
MIN_MISLABEL_VALUES = 1024


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class TensorInfo:
    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name: str, dtype: str, shape: List[int], begin: int, end: int):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class SafetensorsFile:
    """Parses and validates the header on construction; reads tensors lazily with `get`.

    Validation (each failure raises ToolError naming the file and the tensor/field):
    file shorter than the header it announces (truncated), header not JSON, entry without
    dtype/shape/data_offsets, unsupported dtype, data_offsets span != numel * itemsize
    (header/shape mismatch), data_offsets past the end of the file (truncated), two tensors
    whose data_offsets overlap (aliased bytes); on reading (`get`), an F16 weight matrix whose
    values are BF16 bits (see MISLABEL_FRACTION).
    """

    def __init__(self, path: str):
        self.path = path
        if os.path.exists(path) and not os.path.isfile(path):
            raise ToolError(f"{path}: weight file is not a regular file")
        if not os.path.isfile(path):
            raise ToolError(f"{path}: weight file not found")
        self.file_size = os.path.getsize(path)
        if self.file_size < 8:
            raise ToolError(f"{path}: truncated safetensors file: {self.file_size} bytes, "
                            f"shorter than the 8-byte header length field")
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise ToolError(f"{path}: not a safetensors file: header length field says {n} bytes "
                                f"(limit {MAX_HEADER_BYTES})")
            if 8 + n > self.file_size:
                raise ToolError(f"{path}: truncated safetensors file: header length field says {n} bytes "
                                f"but only {self.file_size - 8} bytes follow it")
            raw = f.read(n)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ToolError(f"{path}: safetensors header is not valid JSON: not UTF-8: {e}") from None
        header = parse_json(text, path, "safetensors header")
        if not isinstance(header, dict):
            raise ToolError(f"{path}: safetensors header must be a JSON object, got {type(header).__name__}")
        self.data_start = 8 + n
        self.data_size = self.file_size - self.data_start
        meta = header.pop("__metadata__", None)
        self.metadata: Dict[str, str] = meta if isinstance(meta, dict) else {}
        self.tensors: Dict[str, TensorInfo] = {}
        for name, e in header.items():
            self.tensors[name] = self._parse_entry(name, e)
        # Each tensor its own bytes: two whose (non-empty) spans overlap would alias each other.
        spans = sorted((t for t in self.tensors.values() if t.end > t.begin), key=lambda t: (t.begin, t.end))
        for a, b in zip(spans, spans[1:]):
            if b.begin < a.end:
                raise ToolError(f"{path}: tensors '{a.name}' and '{b.name}' overlap: data_offsets "
                                f"[{a.begin}, {a.end}] and [{b.begin}, {b.end}] share bytes (each tensor must "
                                f"have its own bytes in the data section)")

    def _parse_entry(self, name: str, e) -> TensorInfo:
        where = f"{self.path}: tensor '{name}'"
        if not isinstance(e, dict):
            raise ToolError(f"{where}: header entry must be an object, got {e!r}")
        for field in ("dtype", "shape", "data_offsets"):
            if field not in e:
                raise ToolError(f"{where}: header entry lacks field '{field}'")
        dtype = e["dtype"]
        if dtype not in DTYPE_SIZES:
            raise ToolError(f"{where}: unsupported dtype '{dtype}' (supported: {', '.join(DTYPE_SIZES)})")
        shape = e["shape"]
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise ToolError(f"{where}: field 'shape' must be a list of non-negative ints, got {shape!r}")
        offs = e["data_offsets"]
        if (not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise ToolError(f"{where}: field 'data_offsets' must be [begin, end] with 0 <= begin <= end, "
                            f"got {offs!r}")
        info = TensorInfo(name, dtype, list(shape), offs[0], offs[1])
        need = info.numel() * DTYPE_SIZES[dtype]
        if offs[1] - offs[0] != need:
            raise ToolError(f"{where}: header/shape mismatch: shape {shape} of dtype {dtype} needs {need} bytes "
                            f"but data_offsets {offs} span {offs[1] - offs[0]}")
        if offs[1] > self.data_size:
            raise ToolError(f"{self.path}: truncated safetensors file: tensor '{name}' ends at data "
                            f"offset {offs[1]} but the data section has only {self.data_size} bytes")
        return info

    def keys(self) -> List[str]:
        return list(self.tensors)

    def _check_f16_label(self, name: str, arr: np.ndarray) -> None:
        """ToolError when an F16 weight matrix holds BF16 bits (MISLABEL_FRACTION)."""
        bits = arr.view("<u2")
        nonzero = (bits & 0x7FFF) != 0
        n = int(nonzero.sum())
        if n < MIN_MISLABEL_VALUES:
            return
        exponent = (bits >> 10) & 0x1F
        in_band = int((nonzero & (exponent >= 13) & (exponent <= 16)).sum())
        if in_band >= MISLABEL_FRACTION * n:
            raise ToolError(f"{self.path}: tensor '{name}' is labelled F16 but holds BF16 data: {in_band} of its {n} "
                            f"nonzero values have magnitude in [0.25, 4), as BF16 bits read as F16 do (F16 weights "
                            f"spread over magnitudes); fix its dtype in the header to BF16")

    def get(self, name: str, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Reads one tensor. BF16 is widened exactly to float32 (the 16 bits shifted into the top of
        a float32); F16/F32 are returned as stored. With out_dtype the result is cast to it."""
        info = self.tensors[name]
        itemsize = DTYPE_SIZES[info.dtype]
        count = (info.end - info.begin) // itemsize
        raw_dtype = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}[info.dtype]
        with open(self.path, "rb") as f:
            f.seek(self.data_start + info.begin)
            arr = np.fromfile(f, dtype=raw_dtype, count=count)
        if arr.size != count:  # the file shrank after the header check
            raise ToolError(f"{self.path}: truncated safetensors file while reading tensor '{name}'")
        if info.dtype == "F16" and len(info.shape) >= 2:
            self._check_f16_label(name, arr)
        if info.dtype == "BF16":  # the upper 16 bits of an IEEE float32: widen exactly
            wide = arr.astype(np.uint32)
            wide <<= np.uint32(16)
            arr = wide.view(np.float32)
        elif not arr.dtype.isnative:  # big-endian host
            arr = arr.astype(arr.dtype.newbyteorder("="))
        t = torch.from_numpy(arr.reshape(info.shape))
        if out_dtype is not None and t.dtype != out_dtype:
            t = t.to(out_dtype)
        return t


class LazyTensor:
    """A tensor to be produced while writing (keeps peak memory at one tensor)."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, make: Callable[[], torch.Tensor]):
        self.shape, self.dtype, self.make = list(shape), dtype, make


TensorLike = Union[torch.Tensor, LazyTensor]


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    if t.dtype == torch.float16:
        return t.numpy().astype("<f2", copy=False).tobytes()
    if t.dtype == torch.float32:
        return t.numpy().astype("<f4", copy=False).tobytes()
    raise ToolError(f"cannot write dtype {t.dtype} to safetensors (supported: float32, float16, bfloat16)")


def write_safetensors(path: str, tensors: Iterable[Tuple[str, TensorLike]],
                      metadata: Optional[Dict[str, str]] = None) -> None:
    """Writes tensors (name order kept as sorted, like the reference implementation) atomically:
    to PATH.tmp-XXXX first, renamed over PATH when complete."""
    items = sorted(tensors, key=lambda kv: kv[0])
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in items:
        if t.dtype not in TORCH_TO_ST:
            raise ToolError(f"{path}: tensor '{name}': cannot write dtype {t.dtype}")
        st = TORCH_TO_ST[t.dtype]
        n = 1
        for s in t.shape:
            n *= int(s)
        size = n * DTYPE_SIZES[st]
        header[name] = {"dtype": st, "shape": [int(s) for s in t.shape], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * ((8 - len(raw) % 8) % 8)  # pad so the data section is 8-byte aligned
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name, t in items:
                tensor = t.make() if isinstance(t, LazyTensor) else t
                if list(tensor.shape) != list(t.shape) or tensor.dtype != t.dtype:
                    raise ToolError(f"{path}: tensor '{name}' produced {list(tensor.shape)} {tensor.dtype}, "
                                    f"announced {list(t.shape)} {t.dtype}")
                f.write(_tensor_bytes(tensor))
