#!/usr/bin/env bash
# ctest fuzz.known.<target>.<file>: the known fault of REPRODUCER (fuzz/known/README.md) must still
# reproduce with the targets' skips off. Usage: check_known.sh FUZZ_BINARY REPRODUCER
set -uo pipefail
bin=$1 input=$2
out=$(KVCACHE_FUZZ_KNOWN=1 "$bin" "$input" 2>&1)
if grep -qE "runtime error:|==fuzz== FAULT|ERROR: AddressSanitizer|ERROR: LeakSanitizer" <<< "$out"; then
  grep -m1 -E "runtime error:|==fuzz== FAULT|ERROR: AddressSanitizer|ERROR: LeakSanitizer" <<< "$out"
  echo "check_known: $input still reproduces its known fault (the fuzz targets skip it)"
  exit 0
fi
tail -n 5 <<< "$out"
echo "check_known: $input no longer reproduces its fault: it looks fixed. Delete its skip in"
echo "fuzz/known_issues.h, move the file into fuzz/corpus/<target>/ and drop its row from"
echo "fuzz/known/README.md (the fuzz targets then cover that input again)."
exit 1
