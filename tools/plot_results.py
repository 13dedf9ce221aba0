#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Plots of a kv_study summary.json (written by `kv_study run` / `kv_study report`).

Figures (PNG, matplotlib Agg backend):
  pareto.png         accuracy vs peak KV memory (ratio to the control), Pareto front highlighted
  depth_heatmap.png  needle accuracy, arms x depth
  ppl_accuracy.png   perplexity (streaming, else single-pass) vs accuracy
and, when the run swept budgets (`kv_study run --budgets`, summary.json "curves"):
  budget_accuracy.png  accuracy vs budget, one line per method, the control's accuracy dashed
  budget_family.png    the same per task family (one panel each)
  budget_depth.png     needle accuracy vs budget per needle depth (one panel each)
and, when the rows hold two or more prompt lengths (the long suite, `kv_study run --suite long`;
summary.json "lengths" and each arm's "by_length"):
  length_accuracy.png  accuracy vs prompt length, one line per arm
  length_pareto.png    accuracy vs peak KV memory at each length (one panel each), fronts highlighted
  length_depth.png     needle accuracy, arms x (length, depth): the depth x length heatmap per arm
and, when the run had query-agnostic rows (`kv_study run --query-mode agnostic|both`, summary.json
"agnostic"), kept apart from the query-aware list as the report keeps them:
  query_modes.png               accuracy of each arm in both modes, side by side (arms run in both)
  budget_accuracy_agnostic.png  the agnostic list's accuracy vs budget (when it swept budgets)

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


def curve_points(curve, values):
    """(budget in %, accuracy in %) of a curve's points that have a value.

    Percentage budgets are plotted as percentages, token budgets as tokens."""
    pts = []
    for label, b, v in zip(curve["budgets"], curve["budget_values"], values):
        v = _num(v)
        if v is None:
            continue
        pts.append((100.0 * b if label.endswith("%") else float(b), 100.0 * v))
    return pts


def _control_accuracy(summary):
    for a in summary["arms"]:
        if a.get("is_control") and _num(a.get("accuracy")) is not None:
            return 100.0 * _num(a["accuracy"]), a.get("family_accuracy") or {}, a.get("depth_accuracy") or {}
    return None, {}, {}


def _curve_axes(ax, curves, values_of, control, title):
    for c in curves:
        pts = curve_points(c, values_of(c))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, lw=1, label=c["method"])
    if control is not None:
        ax.axhline(100.0 * control, color="k", ls="--", lw=0.8, label="control")
    ax.set_title(title, fontsize=8)
    ax.set_ylim(-3, 103)
    ax.grid(True, alpha=0.3)


def plot_budget_curves(summary, out_path):
    curves = summary.get("curves") or []
    ctrl, _, _ = _control_accuracy(summary)
    fig, ax = plt.subplots(figsize=(7, 5))
    _curve_axes(ax, curves, lambda c: c["accuracy"], None if ctrl is None else ctrl / 100.0,
                f"Accuracy vs KV budget — {summary.get('model', '')}")
    ax.set_xlabel("budget (% of the request's context kept; tokens for token budgets)")
    ax.set_ylabel("task accuracy (%)")
    ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def _panels(summary, out_path, keys, values_of, control_of, title_of, xlabel):
    curves = summary.get("curves") or []
    n = max(1, len(keys))
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for i, k in enumerate(keys):
        ax = axes[i // cols][i % cols]
        _curve_axes(ax, curves, lambda c, k=k: values_of(c, k), control_of(k), title_of(k))
        ax.set_xlabel(xlabel, fontsize=7)
        ax.set_ylabel("accuracy (%)", fontsize=7)
    for j in range(len(keys), rows * cols):
        axes[j // cols][j % cols].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, fontsize=6, loc="lower center", ncol=min(4, len(labels)))
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def plot_budget_family(summary, out_path):
    _, fam, _ = _control_accuracy(summary)
    _panels(summary, out_path, summary.get("families") or [],
            lambda c, f: (c.get("family_accuracy") or {}).get(f, []), lambda f: _num(fam.get(f)),
            lambda f: f"family {f}", "budget (%)")


def plot_budget_depth(summary, out_path):
    _, _, dep = _control_accuracy(summary)
    _panels(summary, out_path, [str(d) for d in summary.get("depths") or []],
            lambda c, d: (c.get("depth_accuracy") or {}).get(d, []), lambda d: _num(dep.get(d)),
            lambda d: f"needle at depth {d}%", "budget (%)")


def mode_pairs(summary):
    """(arm, aware accuracy %, agnostic accuracy %) for every arm with an accuracy in both lists,
    in the agnostic list's order; [] without an agnostic list."""
    agnostic = (summary.get("agnostic") or {}).get("arms") or []
    aware = {a["arm"]: _num(a.get("accuracy")) for a in summary.get("arms") or []}
    pairs = []
    for a in agnostic:
        g, w = _num(a.get("accuracy")), aware.get(a["arm"])
        if g is not None and w is not None:
            pairs.append((a["arm"], 100.0 * w, 100.0 * g))
    return pairs


def plot_query_modes(summary, out_path):
    pairs = mode_pairs(summary)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.0 + 0.7 * len(pairs)), 4.5))
    xs = list(range(len(pairs)))
    ax.bar([x - 0.2 for x in xs], [p[1] for p in pairs], width=0.4, label="query-aware (question in the prompt)")
    ax.bar([x + 0.2 for x in xs], [p[2] for p in pairs], width=0.4, label="query-agnostic (compressed before it)")
    ax.set_xticks(xs)
    ax.set_xticklabels([p[0] for p in pairs], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("task accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"Query-aware vs query-agnostic — {summary.get('model', '')}", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def _by_length(arm, length):
    return (arm.get("by_length") or {}).get(str(length)) or {}


def plot_length_accuracy(summary, out_path):
    lengths = summary.get("lengths") or []
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for a in summary["arms"]:
        xs, ys = [], []
        for n in lengths:
            v = _num(_by_length(a, n).get("accuracy"))
            if v is not None:
                xs.append(n)
                ys.append(100.0 * v)
        if xs:
            ax.plot(xs, ys, "o-", lw=2.2 if a.get("is_control") else 1.0, ms=3, label=a["arm"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths)
    ax.set_xticklabels([f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("task accuracy (%)")
    ax.set_title(f"Accuracy vs prompt length — {summary.get('model', '')}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def plot_length_pareto(summary, out_path):
    lengths = summary.get("lengths") or []
    fig, axes = plt.subplots(1, max(1, len(lengths)), figsize=(5.0 * max(1, len(lengths)), 4.6), squeeze=False)
    for ax, n in zip(axes[0], lengths):
        arms, pts = [], []
        for a in summary["arms"]:
            b = _by_length(a, n)
            m, acc = _num(b.get("memory_ratio")), _num(b.get("accuracy"))
            if m is not None and acc is not None:
                arms.append(a)
                pts.append((m, 100.0 * acc))
        front = set(pareto_front(pts))
        for i, (a, (m, acc)) in enumerate(zip(arms, pts)):
            on = i in front
            ax.scatter([m], [acc], s=45 if on else 20, c="tab:red" if on else "tab:blue", zorder=3)
            ax.annotate(a["arm"], (m, acc), fontsize=6, xytext=(3, 2), textcoords="offset points")
        order = sorted(front, key=lambda i: pts[i][0])
        if order:
            ax.plot([pts[i][0] for i in order], [pts[i][1] for i in order], "r--", lw=1)
        ax.set_title(f"{n} tokens", fontsize=9)
        ax.set_xlabel("peak KV memory (x control)")
        ax.set_ylabel("task accuracy (%)")
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"Accuracy vs KV memory by prompt length — {summary.get('model', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def plot_length_depth(summary, out_path):
    lengths = summary.get("lengths") or []
    depths = summary.get("depths") or []
    arms = summary["arms"]
    cols = [(n, d) for n in lengths for d in depths]
    fig, ax = plt.subplots(figsize=(1.5 + 0.42 * max(1, len(cols)), 1.2 + 0.33 * max(1, len(arms))))
    grid = []
    for a in arms:
        row = []
        for n, d in cols:
            v = _num((_by_length(a, n).get("depth_accuracy") or {}).get(str(d)))
            row.append(float("nan") if v is None else 100.0 * v)
        grid.append(row)
    if cols and arms:
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, "–" if math.isnan(v) else f"{v:.0f}", ha="center", va="center", fontsize=6)
        for k in range(1, len(lengths)):
            ax.axvline(k * len(depths) - 0.5, color="k", lw=1)
        fig.colorbar(im, ax=ax, label="needle accuracy (%)")
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([f"{d}%" for n, d in cols], fontsize=6, rotation=90)
    for k, n in enumerate(lengths):
        ax.text(k * len(depths) + (len(depths) - 1) / 2, -0.9, f"{n // 1024}k" if n % 1024 == 0 else str(n),
                ha="center", va="bottom", fontsize=8)
    ax.set_yticks(range(len(arms)))
    ax.set_yticklabels([a["arm"] for a in arms], fontsize=7)
    ax.set_xlabel("needle depth, by prompt length")
    ax.set_title("Needle accuracy by depth and length", fontsize=9, pad=16)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)


def make_plots(summary_path, out_dir=None):
    """Writes the PNGs (three; three budget-curve plots when the summary has curves; the query-mode
    plots when it has an agnostic list); returns their paths."""
    summary = load_summary(summary_path)
    out_dir = out_dir or os.path.join(os.path.dirname(os.path.abspath(summary_path)), "plots")
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("pareto.png", "depth_heatmap.png", "ppl_accuracy.png")]
    plot_pareto(summary, paths[0])
    plot_depth_heatmap(summary, paths[1])
    plot_ppl_accuracy(summary, paths[2])
    if summary.get("curves"):
        more = [os.path.join(out_dir, n) for n in ("budget_accuracy.png", "budget_family.png", "budget_depth.png")]
        plot_budget_curves(summary, more[0])
        plot_budget_family(summary, more[1])
        plot_budget_depth(summary, more[2])
        paths += more
    if len(summary.get("lengths") or []) >= 2:
        more = [os.path.join(out_dir, n) for n in ("length_accuracy.png", "length_pareto.png", "length_depth.png")]
        plot_length_accuracy(summary, more[0])
        plot_length_pareto(summary, more[1])
        plot_length_depth(summary, more[2])
        paths += more
    agnostic = summary.get("agnostic")
    if agnostic:
        if mode_pairs(summary):
            paths.append(os.path.join(out_dir, "query_modes.png"))
            plot_query_modes(summary, paths[-1])
        if agnostic.get("curves"):
            paths.append(os.path.join(out_dir, "budget_accuracy_agnostic.png"))
            view = dict(agnostic, model=f"{summary.get('model', '')}, query-agnostic")
            plot_budget_curves(view, paths[-1])
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
