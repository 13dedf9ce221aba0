#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Plots of a kv_study summary.json (written by `kv_study run` / `kv_study report`).

Figures (PNG, matplotlib Agg backend):
  pareto.png         accuracy vs peak KV memory (ratio to the control), Pareto front highlighted
  depth_heatmap.png  needle accuracy, arms x depth
  ppl_accuracy.png   perplexity (streaming, else single-pass) vs accuracy

Usage: /usr/bin/python3 tools/plot_results.py runs/x/summary.json [--out runs/x/plots]
"""
import argparse
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _num(v):
    """None/NaN -> None, else float."""
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) else v


def pareto_front(points):
    """Indices of the points not dominated in (lower memory, higher accuracy).

    points: list of (memory, accuracy). A point is dominated if another has memory <= and
    accuracy >= with one of them strict. Returned sorted by memory (ties: input order).
    """
    front = []
    for i, (m, a) in enumerate(points):
        dominated = False
        for j, (m2, a2) in enumerate(points):
            if j != i and m2 <= m and a2 >= a and (m2 < m or a2 > a):
                dominated = True
                break
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: (points[i][0], i))


def load_summary(path):
    with open(path, encoding="utf-8") as f:
        s = json.load(f)
    if "arms" not in s:
        raise ValueError(f"{path}: not a kv_study summary.json (no 'arms')")
    return s


def plot_pareto(summary, out_path):
    arms = [a for a in summary["arms"] if _num(a.get("memory_ratio")) is not None and _num(a.get("accuracy")) is not None]
    fig, ax = plt.subplots(figsize=(7, 5))
    pts = [(_num(a["memory_ratio"]), 100.0 * _num(a["accuracy"])) for a in arms]
    front = set(pareto_front(pts))
    for i, (a, (m, acc)) in enumerate(zip(arms, pts)):
        on = i in front
        ax.scatter([m], [acc], s=50 if on else 25, c="tab:red" if on else "tab:blue", zorder=3)
        ax.annotate(a["arm"], (m, acc), fontsize=7, xytext=(4, 3), textcoords="offset points")
    order = sorted(front, key=lambda i: pts[i][0])
    if order:
        ax.plot([pts[i][0] for i in order], [pts[i][1] for i in order], "r--", lw=1, label="Pareto front")
        ax.legend(loc="lower right")
    ax.set_xlabel(f"peak KV memory (x control {summary.get('control', '')})")
    ax.set_ylabel("task accuracy (%)")
    ax.set_title(f"Accuracy vs KV memory — {summary.get('model', '')}", fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def plot_depth_heatmap(summary, out_path):
    depths = summary.get("depths") or []
    arms = summary["arms"]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * max(1, len(depths)), 1.0 + 0.35 * max(1, len(arms))))
    grid = []
    for a in arms:
        row = []
        for d in depths:
            v = _num(a.get("depth_accuracy", {}).get(str(d)))
            row.append(float("nan") if v is None else 100.0 * v)
        grid.append(row)
    if depths and arms:
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, "–" if math.isnan(v) else f"{v:.0f}", ha="center", va="center", fontsize=7)
        fig.colorbar(im, ax=ax, label="needle accuracy (%)")
    ax.set_xticks(range(len(depths)))
    ax.set_xticklabels([f"{d}%" for d in depths])
    ax.set_yticks(range(len(arms)))
    ax.set_yticklabels([a["arm"] for a in arms], fontsize=7)
    ax.set_xlabel("needle depth")
    ax.set_title("Needle accuracy by depth", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def plot_ppl_accuracy(summary, out_path):
    fig, ax = plt.subplots(figsize=(7, 5))
    for a in summary["arms"]:
        ppl = _num(a.get("ppl_stream"))
        if ppl is None:
            ppl = _num(a.get("ppl_single"))
        acc = _num(a.get("accuracy"))
        if ppl is None or acc is None:
            continue
        ax.scatter([ppl], [100.0 * acc], s=30, c="tab:red" if a.get("is_control") else "tab:blue", zorder=3)
        ax.annotate(a["arm"], (ppl, 100.0 * acc), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("perplexity (streaming through the managed cache; single-pass if absent)")
    ax.set_ylabel("task accuracy (%)")
    ax.set_title("Perplexity vs accuracy", fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def make_plots(summary_path, out_dir=None):
    """Writes the three PNGs; returns their paths."""
    summary = load_summary(summary_path)
    out_dir = out_dir or os.path.join(os.path.dirname(os.path.abspath(summary_path)), "plots")
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("pareto.png", "depth_heatmap.png", "ppl_accuracy.png")]
    plot_pareto(summary, paths[0])
    plot_depth_heatmap(summary, paths[1])
    plot_ppl_accuracy(summary, paths[2])
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("summary", help="summary.json written by kv_study run/report")
    p.add_argument("--out", help="output directory (default: plots/ next to summary.json)")
    args = p.parse_args(argv)
    try:
        for path in make_plots(args.summary, args.out):
            print(path)
    except (OSError, ValueError, KeyError) as e:
        print(f"plot_results: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
