#!/usr/bin/env bash
# Fuzzes every libFuzzer target of a KVCACHE_FUZZ build for a bounded time (docs/ci.md).
# Usage: tools/fuzz.sh [BUILD_DIR [SECONDS]]     (defaults: build-asan, 45 s per target)
#   FUZZ_TARGETS  space-separated subset, e.g. "quant_spec arm" (default: every fuzz/fuzz_*.cpp)
#   FUZZ_OUT      where crashing inputs and logs go (default: BUILD_DIR/fuzz-out)
#   FUZZ_JOBS     targets fuzzed at once (default: nproc; each target is one process on one core,
#                 so on the 2-core machine two run side by side, each for the full SECONDS)
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

jobs=${FUZZ_JOBS:-$(nproc)}
[[ $jobs =~ ^[1-9][0-9]*$ ]] || { echo "fuzz.sh: FUZZ_JOBS=$jobs: expected a positive integer" >&2; exit 2; }
for name in $targets; do
  bin=$build/fuzz/fuzz_$name
  [[ -x $bin ]] || { echo "fuzz.sh: $bin not built (configure with -DKVCACHE_FUZZ=ON)" >&2; exit 2; }
  [[ -d fuzz/corpus/$name ]] || { echo "fuzz.sh: no seed corpus fuzz/corpus/$name" >&2; exit 2; }
done

# One target: fuzz, then report its line (and its reproducers when it fails). Exit status: the
# fuzzer's.
fuzz_one() {
  local name=$1 bin=$build/fuzz/fuzz_$1 dir=$out/$1 dict=() start rc runs cov
  rm -rf "$dir" && mkdir -p "$dir/corpus" "$dir/tmp"
  [[ $name != quant_roundtrip && $name != snapshot && $name != prefix_index ]] &&
    dict=(-dict=fuzz/specs.dict)  # binary inputs: no spec words
  start=$(date +%s)
  set +e
  # Scratch files (fuzz_prefix_index's directories) under the target's own folder: a crash
  # skips the fuzzer's atexit clean-up, and what it leaves is then beside the reproducer, not
  # in /tmp; the next run's rm -rf takes it.
  TMPDIR="$dir/tmp" "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=3072 -print_final_stats=1 \
         "${dict[@]}" -artifact_prefix="$dir/" "$dir/corpus" "fuzz/corpus/$name" > "$dir/log" 2>&1
  rc=$?
  set -e
  runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$dir/log" | grep -oE '[0-9]+$' || echo "?")
  cov=$(grep -oE 'cov: [0-9]+' "$dir/log" | tail -n1 || true)
  {
    echo "fuzz.sh: $name: $runs inputs in $(( $(date +%s) - start )) s, ${cov:-cov: ?}, corpus $(ls "$dir/corpus" | wc -l) new, exit $rc"
    if [[ $rc -ne 0 ]]; then
      grep -vE '^#[0-9]+' "$dir/log" | tail -n 60
      for f in "$dir"/crash-* "$dir"/leak-* "$dir"/timeout-* "$dir"/oom-*; do
        [[ -f $f ]] || continue
        echo "fuzz.sh: $name: reproducer $f ($(stat -c %s "$f") bytes):"
        od -A d -t x1z -v "$f" | head -n 20
      done
    fi
  } > "$dir/report" 2>&1
  return $rc
}

# At most $jobs targets at a time; each one's report is printed when it ends.
declare -A pid_of=()
failed=()
reap() {  # waits for one running target
  local done_pid name
  set +e
  wait -n -p done_pid
  local rc=$?
  set -e
  for name in "${!pid_of[@]}"; do
    if [[ ${pid_of[$name]} == "$done_pid" ]]; then
      cat "$out/$name/report" >&2
      [[ $rc -ne 0 ]] && failed+=("$name")
      unset "pid_of[$name]"
      return
    fi
  done
}
for name in $targets; do
  while [[ ${#pid_of[@]} -ge $jobs ]]; do reap; done
  fuzz_one "$name" &
  pid_of[$name]=$!
done
while [[ ${#pid_of[@]} -gt 0 ]]; do reap; done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "fuzz.sh: FAILED: ${failed[*]} (inputs and logs in $out)" >&2
  exit 1
fi
echo "fuzz.sh: every target ran ${seconds} s without a fault" >&2
