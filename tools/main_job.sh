#!/usr/bin/env bash
# The main job: the kv_study sweep on the default model, with its tables printed.
# Uses models/kvstudy-default.pt (the embedded default model) when it exists; until it is
# committed, exports the real TinyStories-656K checkpoint from ../shared/data and runs the
# small suite on it (a story model scores low on the tasks: its perplexity, KLD/agreement,
# reconstruction and memory tables are the meaningful part).
# Usage: tools/main_job.sh [extra kv_study run arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
KV_STUDY="$BUILD_DIR/apps/kv_study/kv_study"
[[ -x "$KV_STUDY" ]] || { echo "main_job.sh: $KV_STUDY not built; run tools/setup.sh first" >&2; exit 1; }

if [[ -f models/kvstudy-default.pt ]]; then
  exec "$KV_STUDY" run --model models/kvstudy-default.pt --out runs/kvstudy-default "$@"
fi

src=../shared/data/models/tinystories-656k
model="$BUILD_DIR/models/tinystories-656k.pt"
[[ -d "$src" ]] || { echo "main_job.sh: no models/kvstudy-default.pt and no $src to export" >&2; exit 1; }
if [[ ! -f "$model" ]]; then
  mkdir -p "$(dirname "$model")"
  echo "main_job.sh: exporting $src -> $model" >&2
  /usr/bin/python3 tools/export_torchscript.py "$src" "$model"
fi
"$KV_STUDY" run --model "$model" --suite small --out runs/tinystories-656k-small "$@"
if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then
  /usr/bin/python3 tools/plot_results.py runs/tinystories-656k-small/summary.json || echo "main_job.sh: plotting failed (results are in runs/)" >&2
fi
