#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Markdown tables from bench_attention's JSON output (medians of repetitions), one per T.

Usage: build/bench/bench_attention --benchmark_filter='BM_Copy|BM_Read|BM_Scaling|BM_AttendBaseline/|BM_Attend/|BM_AttendQ8/|BM_AttendKV1/' \
           --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
           --benchmark_out=att.json --benchmark_out_format=json
       python3 tools/bench_attention_table.py att.json

Per spec and thread count: wall µs per decode step; × baseline (BM_AttendBaseline at the same T and
threads: the float32 copy + at:: path); MB a step reads (`MB_per_step`); × its bandwidth floor
(`floor_ms`: those bytes at the run's STREAM copy bandwidth); × its arithmetic floor
(`mac_floor_ms`: the multiply-add instructions the kernels issue at the run's measured rate; see
bench/bench_attention.cpp); and 1 thread ÷ 2 threads, the thread ratio (goal: ≥ 1.8 at 32k).
Rows `fused, core API` are BM_AttendCore, `fused, int8 query` BM_AttendQ8 (the same call with
kvcache::set_attention_query("int8")).
Rows `fused, 1 KV head` are BM_AttendKV1 (7 query heads over one KV head, whose keys two threads
split between them); they have no baseline (BM_AttendBaseline has two KV heads). The bits per
stored value (`bits_per_value`: metadata and any fp16 window counted) stand beside each spec, and
a BM_Attend row whose cache the fused kernels do not read (`fused_read` = 0: int3,
had(...), GEAR, KVQuant) says "generic (no fused kernel)": its time is the generic path's.
Missing cases leave empty cells.
"""
import json
import re
import sys
from collections import OrderedDict

BASELINE = "baseline: float32 copy + at::"
KV1 = "fused, 1 KV head"
Q8 = "fused, int8 query"
CORE = "fused, core API"
KINDS = {"BM_Attend": "fused", "BM_AttendCore": CORE, "BM_AttendQ8": Q8, "BM_AttendGeneric": "generic", "BM_AttendKV1": KV1}
ORDER = {"baseline": 0, "fused": 1, CORE: 2, Q8: 3, "generic": 4, KV1: 5}


def median_rows(data):
    """{(kind, spec, T, threads): benchmark} for the median aggregates (or single runs)."""
    out = {}
    for b in data["benchmarks"]:
        if b.get("aggregate_name", "median") != "median":
            continue
        name = b.get("run_name", b["name"])
        name = re.sub(r"(/real_time)?(_median)?$", "", name)
        parts = name.split("/")
        if parts[0] == "BM_AttendBaseline" and len(parts) == 3:
            out[("baseline", BASELINE, int(parts[1]), int(parts[2]))] = b
        elif parts[0] in KINDS and len(parts) == 4:
            out[(KINDS[parts[0]], parts[1], int(parts[2]), int(parts[3]))] = b
    return out


def us(b):
    """Wall time of one step in µs."""
    scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[b.get("time_unit", "ns")]
    return b["real_time"] * scale


def ratio(b, base):
    """How many times faster `b` ran than `base` (None when either is missing)."""
    return us(base) / us(b) if b is not None and base is not None else None


def over(b, key):
    """`b`'s time over the floor its counter `key` gives in ms (None when missing)."""
    return us(b) / (b[key] * 1e3) if b is not None and b.get(key) else None


def fmt(x, digits=2):
    return "" if x is None else f"{x:,.{digits}f}"


def main(path):
    with open(path) as f:
        data = json.load(f)
    rows = median_rows(data)
    copy = next((b for b in data["benchmarks"] if b["name"].startswith("BM_Copy") and b.get("aggregate_name", "median") == "median"), None)
    if copy is not None and "copy_GBps" in copy:
        print(f"BM_Copy: {copy['copy_GBps']:.1f} GB/s (STREAM convention, one thread)\n")
    scaling = {}
    for b in data["benchmarks"]:
        m = re.match(r"BM_Scaling/(mac|copy|fork)/(\d+)", b["name"])
        if m and b.get("aggregate_name", "median") == "median":
            scaling[(m.group(1), int(m.group(2)))] = b
    if scaling:
        print("What a second thread is worth here (BM_Scaling, the library's parallel_for):\n")
        print("| probe | 1 thread | 2 threads | 2 ÷ 1 |")
        print("|---|---:|---:|---:|")
        for probe, key, unit in (("mac", "mac_per_ns", "multiply-add instr/ns"), ("copy", "copy_GBps", "GB/s")):
            one, two = scaling.get((probe, 1)), scaling.get((probe, 2))
            if one and two and key in one and key in two:
                print(f"| {probe} ({unit}) | {one[key]:.2f} | {two[key]:.2f} | {two[key] / one[key]:.2f} |")
        one, two = scaling.get(("fork", 1)), scaling.get(("fork", 2))
        if one and two:
            print(f"| fork/join of an empty region (µs) | {us(one):.2f} | {us(two):.2f} | |")
        print()
    ts = sorted({k[2] for k in rows})
    for t in ts:
        specs = OrderedDict()
        for (kind, spec, tt, _), _b in rows.items():
            if tt == t:
                specs.setdefault((kind, spec), None)
        print(f"T = {t:,} tokens\n")
        print("| spec | bits/value | path | 1 thread µs | × baseline | MB/step | × its floor | × its arithmetic floor "
              "| 2 threads µs | × baseline (2 threads) | 1 thread ÷ 2 threads |")
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        order = sorted(specs, key=lambda k: ORDER[k[0]])
        base1, base2 = rows.get(("baseline", BASELINE, t, 1)), rows.get(("baseline", BASELINE, t, 2))
        for kind, spec in order:
            one, two = rows.get((kind, spec, t, 1)), rows.get((kind, spec, t, 2))
            b1, b2 = (None, None) if kind == KV1 else (base1, base2)
            ref = one or two
            mb = ref.get("MB_per_step") if ref else None

            label = spec if kind == "baseline" else f"`{spec}`"
            bits = ref.get("bits_per_value") if ref and kind != "baseline" else None
            path = kind
            if kind == "fused" and ref is not None and ref.get("fused_read", 1) == 0:
                path = "generic (no fused kernel)"
            print(f"| {label} | {fmt(bits, 3)} | {path} | {fmt(us(one), 0) if one else ''} | {fmt(ratio(one, b1))} | {fmt(mb, 1)} "
                  f"| {fmt(over(one, 'floor_ms'), 1)} | {fmt(over(one, 'mac_floor_ms'), 1)} "
                  f"| {fmt(us(two), 0) if two else ''} | {fmt(ratio(two, b2))} "
                  f"| {fmt(us(one) / us(two) if one and two else None)} |")
        print()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
