#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes the seed corpus of fuzz_quant_roundtrip (fuzz/corpus/quant_roundtrip/): one input per
spec of its table, in the input format fuzz_quant_roundtrip.cpp describes, with random normal
values and a few adversarial ones (constant groups, large offsets, fp16 max, denormals)."""
import os
import random
import struct
import sys

NUM_SPECS = 34          # kSpecs in fuzz_quant_roundtrip.cpp
HEAD_DIMS = [1, 2, 4, 8, 16, 32, 64, 128]
FMT = {0: "<f", 1: "<e", 3: "<d"}  # float32, float16, float64 (bf16: the top half of a float32)


def encode(values, dtype):
    if dtype == 2:
        return b"".join(struct.pack("<f", v)[2:] for v in values)
    return b"".join(struct.pack(FMT[dtype], v) for v in values)


def seed(spec, dtype, layout, b, h, t, dsel_index, values):
    head = bytes([spec, dtype, layout])
    shape = struct.pack("<HHHH", b - 1, h - 1, t, 1 | (dsel_index << 1))
    return head + shape + encode(values, dtype)


def main(out):
    rng = random.Random(1234)
    os.makedirs(out, exist_ok=True)
    for spec in range(NUM_SPECS):
        dtype = spec % 3
        d_index = 5 if spec % 2 == 0 else 6  # D = 32 or 64
        b, h, t = 1, 2, 32
        n = min(b * h * t * HEAD_DIMS[d_index], 512)  # the target cycles the bytes
        kind = spec % 4
        if kind == 0:
            values = [rng.gauss(0, 1) for _ in range(n)]
        elif kind == 1:
            values = [1000.3 + 0.01 * (i % 4) for i in range(n)]  # large offset, tiny range
        elif kind == 2:
            values = [65504.0 if i % 2 else -65504.0 for i in range(n)]
        else:
            values = [1e-30 * (i % 7) for i in range(n)]
        with open(os.path.join(out, f"spec{spec:02d}"), "wb") as f:
            f.write(seed(spec, dtype, spec % 4, b, h, t, d_index, values))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus", "quant_roundtrip"))
