#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Writes the seed corpus of fuzz_prefix_index (fuzz/corpus/prefix_index/): inputs in the format
fuzz_prefix_index.cpp describes — [case][flags][edits of 8 bytes] — for every cache case: the
valid index loaded into a fresh cache, into one with an index and a running request, into one
with a block too little room, and the disk tier's spilled pages read back untouched; then a
few edits of each kind (resealed, the manifest restated) that reach the content checks. The
target builds the files it edits itself, so every seed is a few bytes."""
import os
import struct
import sys

NUM_CASES = 5  # kCases in fuzz_prefix_index.cpp
RESEAL, RESTATE, BUSY, TIGHT, DISK = 1, 2, 4, 8, 16
XOR, U32, U64, TRUNCATE, INSERT, ERASE, DUPLICATE, REMOVE = range(8)
MANIFEST = 0x80  # an edit's target bit: the manifest instead of the pages file


def edit(op, target, offset, value):
    return struct.pack("<BBHI", op, target, offset, value)


def main(out):
    os.makedirs(out, exist_ok=True)
    for old in os.listdir(out):
        os.remove(os.path.join(out, old))
    seeds = []
    for case in range(NUM_CASES):
        seeds.append(bytes([case, 0]))
        seeds.append(bytes([case, BUSY]))
        seeds.append(bytes([case, TIGHT]))
    for case in (0, 1, 2):
        seeds.append(bytes([case, DISK]))
        # A spilled page's block bytes (section 1 is its one DPAG section), resealed.
        seeds.append(bytes([case, DISK | RESEAL]) + edit(XOR, 2, 600, 0x10))
        seeds.append(bytes([case, DISK]) + edit(TRUNCATE, 3, 100, 0))
    edits = [
        (RESEAL | RESTATE, edit(XOR, 2, 4, 0x09)),           # page 0's parent
        (RESEAL | RESTATE, edit(U64, 1, 0, 7)),              # HEAD: the library string's length
        (RESEAL | RESTATE, edit(U32, 3, 0, 2)),              # page 1's namespace
        (RESEAL | RESTATE, edit(INSERT, 2, 80, 0x0104)),     # bytes inside page 0's block lists
        (RESEAL | RESTATE, edit(ERASE, 2, 90, 3)),
        (RESEAL | RESTATE, edit(DUPLICATE, 2, 0, 0)),        # page 0 twice
        (RESEAL | RESTATE, edit(REMOVE, 2, 0, 0)),           # page 0 gone: page 1's parent dangles
        (RESEAL | RESTATE, edit(U64, 2, 12, 9)),             # a token id
        (RESEAL, edit(XOR, MANIFEST | 1, 20, 0x01)),         # the manifest's pages file name
        (RESEAL | RESTATE | BUSY, edit(XOR, 4, 120, 0x40)),  # block bytes, loaded beside an index
        (0, edit(XOR, 0, 9, 0x01)),                          # the preamble's version, not resealed
    ]
    for i, (flags, e) in enumerate(edits):
        seeds.append(bytes([i % NUM_CASES, flags]) + e)
    # Several edits at once (libFuzzer's length limit starts at the longest seed).
    seeds.append(bytes([0, RESEAL | RESTATE]) + edit(U64, 2, 12, 9) + edit(XOR, 3, 100, 0x02) +
                 edit(DUPLICATE, 3, 0, 0) + edit(ERASE, 4, 40, 8))
    seeds.append(bytes([3, RESEAL | RESTATE | BUSY]) + edit(REMOVE, 3, 0, 0) + edit(U32, 2, 0, 1) +
                 edit(INSERT, 1, 30, 0x2003) + edit(XOR, MANIFEST | 1, 40, 0x80))
    seeds.append(bytes([2, DISK | RESEAL]) + edit(XOR, 2, 700, 0x7f) + edit(XOR, 3, 700, 0x7f) +
                 edit(U64, 2, 0, 3) + edit(ERASE, 3, 300, 20))
    for i, s in enumerate(seeds):
        with open(os.path.join(out, "seed%d" % i), "wb") as f:
            f.write(s)
    print("make_prefix_index_seeds.py: %d seeds in %s" % (len(seeds), out))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "corpus", "prefix_index"))
