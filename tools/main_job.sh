#!/usr/bin/env bash
# The main job: the kv_study sweep (every default arm x the default task suite) on the embedded
# default model models/kvstudy-default.pt, its seed-style tables printed (and written to
# runs/kvstudy-default/summary.md, .json, .csv), then the plots (tools/plot_results.py).
# Re-running resumes: finished (arm, task) rows in results.jsonl are skipped.
# Without the embedded model (a checkout from before it landed), it exports the real
# TinyStories-656K checkpoint from ../shared/data and runs the small suite on it instead.
# Usage: tools/main_job.sh [extra kv_study run arguments, e.g. --suite small]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
KV_STUDY="$BUILD_DIR/apps/kv_study/kv_study"
[[ -x "$KV_STUDY" ]] || { echo "main_job.sh: $KV_STUDY not built; run tools/setup.sh kv_study first" >&2; exit 1; }

if [[ -f models/kvstudy-default.pt ]]; then
  model=models/kvstudy-default.pt
  out=runs/kvstudy-default
  args=()
else
  src=../shared/data/models/tinystories-656k
  model="$BUILD_DIR/models/tinystories-656k.pt"
  out=runs/tinystories-656k-small
  args=(--suite small)
  [[ -d "$src" ]] || { echo "main_job.sh: no models/kvstudy-default.pt and no $src to export" >&2; exit 1; }
  if [[ ! -f "$model" ]]; then
    mkdir -p "$(dirname "$model")"
    echo "main_job.sh: exporting $src -> $model" >&2
    /usr/bin/python3 tools/export_torchscript.py "$src" "$model"
  fi
fi
"$KV_STUDY" run --model "$model" --out "$out" "${args[@]}" "$@"
if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
  /usr/bin/python3 tools/plot_results.py "$out/summary.json" || echo "main_job.sh: plotting failed (results are in $out/)" >&2
else
  echo "main_job.sh: matplotlib not installed (python3-matplotlib); no plots" >&2
fi
