#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Markdown tables from bench_quant's JSON output (median of repetitions).

Usage: build/bench/bench_quant --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
           --benchmark_out=bench.json --benchmark_out_format=json
       python3 tools/bench_quant_table.py bench.json
"""
import json
import sys
from collections import OrderedDict


def main(path):
    with open(path) as f:
        data = json.load(f)
    rows = OrderedDict()  # (kind, spec) -> {shape: {op: (gbps, bpv, err)}}
    shapes = []
    for b in data["benchmarks"]:
        if b.get("aggregate_name", "median") != "median":
            continue
        name = b.get("run_name", b["name"]).rsplit("_median", 1)[0]
        op, spec, shape = name.split("/")
        kind = "ref" if op.startswith("ref_") else "kernel" if op.startswith("kernel_") else "api"
        base_op = op.split("_", 1)[1] if kind != "api" else op
        if shape not in shapes:
            shapes.append(shape)
        cell = rows.setdefault((kind, spec), OrderedDict()).setdefault(shape, {})
        cell[base_op] = (b["bytes_per_second"] / 1e9, b.get("bits_per_value"), b.get("rel_err"))
    print("| impl | spec | bits/value | " + " | ".join(f"{s} q / dq GB/s | rel_err" for s in shapes) + " |")
    print("|---|---|---|" + "---|---|" * len(shapes))
    for (kind, spec), per_shape in rows.items():
        bpv = next(iter(per_shape.values())).get("quantize", (0, 0, 0))[1]
        cells = []
        for s in shapes:
            c = per_shape.get(s)
            if not c:
                cells += ["", ""]
                continue
            q = c.get("quantize", (float("nan"),) * 3)
            d = c.get("dequantize", (float("nan"),) * 3)
            cells += [f"{q[0]:.2f} / {d[0]:.2f}", f"{q[2]:.4f}"]
        print(f"| {kind} | `{spec}` | {bpv:g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
