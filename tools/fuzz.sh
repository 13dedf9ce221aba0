#!/usr/bin/env bash
# Fuzzes every libFuzzer target of a KVCACHE_FUZZ build for a bounded time (docs/ci.md).
# Usage: tools/fuzz.sh [BUILD_DIR [SECONDS]]     (defaults: build-asan, 45 s per target)
#   FUZZ_TARGETS  space-separated subset, e.g. "quant_spec arm" (default: every fuzz/fuzz_*.cpp)
#   FUZZ_OUT      where crashing inputs and logs go (default: BUILD_DIR/fuzz-out)
# Each target starts from its committed seed corpus fuzz/corpus/<name>/ (left unchanged: new
# inputs go to FUZZ_OUT/<name>/corpus). A crash, sanitizer report, leak, uncaught exception
# (fuzz/fuzz_util.h), an input slower than 10 s or a process over 3 GiB fails the target: its
# input is saved as FUZZ_OUT/<name>/crash-*, printed in hex, and the script exits 1 after the
# other targets have run. Replay one with: BUILD_DIR/fuzz/fuzz_<name> FILE
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-asan}
seconds=${2:-45}
out=${FUZZ_OUT:-$build/fuzz-out}
targets=${FUZZ_TARGETS:-$(ls fuzz/fuzz_*.cpp | sed 's|fuzz/fuzz_||; s|\.cpp$||' | tr '\n' ' ')}

failed=()
for name in $targets; do
  bin=$build/fuzz/fuzz_$name
  [[ -x $bin ]] || { echo "fuzz.sh: $bin not built (configure with -DKVCACHE_FUZZ=ON)" >&2; exit 2; }
  [[ -d fuzz/corpus/$name ]] || { echo "fuzz.sh: no seed corpus fuzz/corpus/$name" >&2; exit 2; }
  dir=$out/$name
  rm -rf "$dir" && mkdir -p "$dir/corpus"
  dict=()
  [[ $name != quant_roundtrip ]] && dict=(-dict=fuzz/specs.dict)
  start=$(date +%s)
  set +e
  "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=3072 -print_final_stats=1 \
         "${dict[@]}" -artifact_prefix="$dir/" "$dir/corpus" "fuzz/corpus/$name" > "$dir/log" 2>&1
  rc=$?
  set -e
  runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$dir/log" | grep -oE '[0-9]+$' || echo "?")
  cov=$(grep -oE 'cov: [0-9]+' "$dir/log" | tail -n1 || true)
  echo "fuzz.sh: $name: $runs inputs in $(( $(date +%s) - start )) s, ${cov:-cov: ?}, corpus $(ls "$dir/corpus" | wc -l) new, exit $rc" >&2
  if [[ $rc -ne 0 ]]; then
    failed+=("$name")
    grep -vE '^#[0-9]+' "$dir/log" | tail -n 60 >&2
    for f in "$dir"/crash-* "$dir"/leak-* "$dir"/timeout-* "$dir"/oom-*; do
      [[ -f $f ]] || continue
      echo "fuzz.sh: $name: reproducer $f ($(stat -c %s "$f") bytes):" >&2
      od -A d -t x1z -v "$f" | head -n 20 >&2
    done
  fi
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "fuzz.sh: FAILED: ${failed[*]} (inputs and logs in $out)" >&2
  exit 1
fi
echo "fuzz.sh: every target ran ${seconds} s without a fault" >&2
