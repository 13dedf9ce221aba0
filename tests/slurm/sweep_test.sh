#!/usr/bin/env bash
# The sharded sweep on a real Slurm cluster, with a fault (docs/slurm.md; issue 16).
#
# Installs Debian's slurm-wlm and munge if missing (root), starts a one-node cluster on this
# machine from a temporary directory (its own munge key and socket, slurm.conf, ports, state and
# logs: nothing system-wide is configured or started), and then:
#   1. runs the small suite unsharded (the reference);
#   2. submits the same sweep as a 3-task job array with tools/slurm/kv_study_array.sbatch, and
#      tools/slurm/kv_study_merge.sbatch with --dependency=afterok on the array;
#   3. cancels array task 1 once it has written a third of its rows (scancel), waits for it to
#      be CANCELLED, and requeues it (scontrol requeue; then StartTime=now, as a requeued job is
#      otherwise held back for about two minutes);
#   4. waits for the array. Slurm never satisfies an afterok on an array one of whose tasks was
#      cancelled, even once that task is requeued and completes: the merge submitted in step 2
#      then pends with DependencyNeverSatisfied, and the test cancels it and submits the merge
#      again with afterok on each of the array's tasks, as docs/slurm.md says to. Then it checks
#      - every row task 1 had finished before the cancel is in its shard file exactly once, and
#        its rerun skipped them (resumed) instead of recomputing them;
#      - no shard file and no merge has a duplicate row; the merged rows are the unsharded run's
#        rows (same keys in the same order, same pass/fail and outputs);
#      - the merged summary.json equals the unsharded one, except what measures time or the
#        process (prefill_tps, decode_tps, total_seconds, rss_growth_kib_mean, and the
#        recommendation ranked by decode tokens/s).
# Usage: tests/slurm/sweep_test.sh [BUILD_DIR]   (default: build; run from anywhere)
# Env: KEEP=1 keeps the temporary directory; SLURM_TEST_TIMEOUT (s, default 900) bounds each wait.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
build=${1:-build}
kv_study=$repo/$build/apps/kv_study/kv_study
[[ -x $kv_study ]] || { echo "sweep_test: $kv_study not built" >&2; exit 1; }
model=models/kvstudy-default.pt
[[ -f $model ]] || { echo "sweep_test: $model missing" >&2; exit 1; }
timeout_s=${SLURM_TEST_TIMEOUT:-900}
say() { echo "sweep_test: $*" >&2; }
fail() { say "FAIL: $*"; exit 1; }

# docs/slurm.md shows the two scripts this test submits: they must be the same text.
/usr/bin/python3 - <<'PY' || fail "docs/slurm.md's copy of a tools/slurm script differs from the file"
import re
doc = open("docs/slurm.md").read()
for path in ("tools/slurm/kv_study_array.sbatch", "tools/slurm/kv_study_merge.sbatch"):
    m = re.search(r"## [^\n]*`" + re.escape(path) + r"`\n\n```bash\n(.*?)```\n", doc, re.S)
    assert m and m.group(1) == open(path).read(), path
PY

# ---- packages ---------------------------------------------------------------------------------
need=()
for p in slurm-wlm munge; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [[ ${#need[@]} -gt 0 ]]; then
  [[ $(id -u) -eq 0 ]] || fail "needs root to install ${need[*]}"
  say "installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
[[ $(id -u) -eq 0 ]] || fail "needs root (slurmd runs the jobs as the submitting user; SlurmUser=root)"

# ---- a one-node cluster in $tmp ----------------------------------------------------------------
tmp=$(mktemp -d /tmp/kvcache-slurm.XXXXXX)
chmod 0700 "$tmp"
cleanup() {
  local rc=$?
  if [[ -f $tmp/slurmctld.pid ]]; then  # end this cluster's jobs first: their slurmstepd outlive slurmd
    if [[ $rc -ne 0 ]]; then  # every job's state and reason, for the failure's log
      echo "---- scontrol show job -o" >&2
      scontrol show job -o 2>/dev/null | grep -oE '^JobId=[^ ]+|(ArrayTaskId|JobState|Reason|Dependency|Restarts|ExitCode)=[^ ]+' | paste -sd ' ' | sed 's/ JobId=/\nJobId=/g' >&2 || true
    fi
    scancel --quiet --full --user=root 2>/dev/null || true
    for _ in $(seq 50); do [[ -z $(squeue -h 2>/dev/null) ]] && break; sleep 0.2; done
  fi
  for pf in "$tmp"/slurmd.pid "$tmp"/slurmctld.pid "$tmp"/munged.pid; do
    [[ -f $pf ]] && kill "$(cat "$pf")" 2>/dev/null || true
  done
  sleep 1
  if [[ $rc -ne 0 ]]; then
    for log in "$tmp"/slurmctld.log "$tmp"/slurmd.log "$tmp"/logs/*.log; do
      [[ -f $log ]] || continue
      echo "---- $log (last 40 lines)" >&2
      tail -n 40 "$log" >&2
    done
  fi
  if [[ ${KEEP:-0} == 1 ]]; then say "kept $tmp"; else rm -rf "$tmp"; fi
  exit $rc
}
trap cleanup EXIT

free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
host=$(hostname -s)
ctld_port=$(free_port)
slurmd_port=$(free_port)
while [[ $slurmd_port == "$ctld_port" ]]; do slurmd_port=$(free_port); done
mem_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
cpus=$(nproc)

mkdir -p "$tmp"/state "$tmp"/spool "$tmp"/logs "$tmp"/munge
chmod 0700 "$tmp"/munge
dd if=/dev/urandom of="$tmp"/munge/munge.key bs=1024 count=1 status=none
chmod 0400 "$tmp"/munge/munge.key
munged --force --socket="$tmp"/munge/munge.socket --key-file="$tmp"/munge/munge.key \
       --pid-file="$tmp"/munged.pid --log-file="$tmp"/munged.log --seed-file="$tmp"/munge/munge.seed

export SLURM_CONF=$tmp/slurm.conf
cat > "$SLURM_CONF" <<EOF
ClusterName=kvcachetest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$tmp/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/slurmctld.log
SlurmdLogFile=$tmp/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MinJobAge=3600
KillWait=5
NodeName=kvnode NodeHostname=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=test Nodes=kvnode Default=YES MaxTime=INFINITE State=UP
EOF
slurmctld -f "$SLURM_CONF" -i   # -i: ignore (there is no) saved state
slurmd -f "$SLURM_CONF" -N kvnode

deadline() { echo $(( $(date +%s) + timeout_s )); }
until_true() {  # until_true WHAT CMD...: polls CMD every 0.2 s until it succeeds
  local what=$1 end
  shift
  end=$(deadline)
  until "$@"; do
    [[ $(date +%s) -lt $end ]] || fail "timed out after ${timeout_s}s waiting for $what"
    sleep 0.2
  done
}
node_idle() { sinfo -h -N -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; }
until_true "the node to come up" node_idle
say "cluster up: $(sinfo -h -o '%P %a %D %T %C') (slurmctld :$ctld_port, slurmd :$slurmd_port)"

job_field() { scontrol show job -o "$1" 2>/dev/null | grep -o " $2=[^ ]*" | head -n1 | cut -d= -f2; }  # job_field JOB NAME
job_state() { job_field "$1" JobState; }
state_is() { local s; s=$(job_state "$1"); [[ " ${*:2} " == *" $s "* ]]; }
complete_rows() { if [[ -f $1 ]]; then wc -l < "$1"; else echo 0; fi; }  # rows end with '\n'; a torn one does not

# ---- the sweep ---------------------------------------------------------------------------------
arms='fp32+full,int4+full,int8+sink@50%,fp32+h2o@50%,kivi:k2:v2:g32:r128+full,int2+full'
printf '%s\n' ${arms//,/ } > "$tmp"/arms.txt
t0=$(date +%s)
"$kv_study" run --model "$model" --suite small --configs "$tmp"/arms.txt --threads 1 --quiet \
  --out "$tmp"/unsharded 2> "$tmp"/unsharded.log || { cat "$tmp"/unsharded.log >&2; fail "unsharded run"; }
total=$(complete_rows "$tmp"/unsharded/results.jsonl)
say "unsharded: $total rows in $(( $(date +%s) - t0 )) s"

export KV_STUDY=$kv_study MODEL=$model SUITE=small CONFIGS=$tmp/arms.txt OUT=$tmp/sharded N=3 PLOTS=0
array=$(sbatch --parsable --array=0-2 --cpus-per-task=1 --mem=1G --open-mode=append --chdir="$repo" \
          --output="$tmp/logs/kv_study_%A_%a.log" tools/slurm/kv_study_array.sbatch)
merge=$(sbatch --parsable --dependency=afterok:"$array" --mem=1G --chdir="$repo" \
          --output="$tmp/logs/kv_study_merge_%j.log" tools/slurm/kv_study_merge.sbatch)
say "submitted array $array (3 tasks) and merge $merge (afterok:$array)"

# Task 1 owns about total/3 items; cancel it a third of the way through.
shard1=$tmp/sharded/results.shard1of3.jsonl
owned=$(( (total + 1) / 3 ))
mid_run() { state_is "${array}_1" RUNNING && [[ $(complete_rows "$shard1") -ge $(( owned / 3 )) ]]; }
until_true "task 1 to write a third of its rows" mid_run
before_cancel=$(complete_rows "$shard1")
[[ $before_cancel -lt $owned ]] || fail "task 1 finished ($before_cancel of $owned rows) before it could be cancelled"
scancel "${array}_1"
until_true "task 1 to be cancelled" state_is "${array}_1" CANCELLED
cp "$shard1" "$tmp"/shard1.at-cancel.jsonl
at_cancel=$(complete_rows "$tmp"/shard1.at-cancel.jsonl)
say "cancelled task ${array}_1 mid-run: $at_cancel of $owned rows written"
[[ $at_cancel -lt $owned ]] || fail "task 1 completed before the cancel took effect ($at_cancel rows)"

scontrol requeue "${array}_1"
scontrol update JobId="${array}_1" StartTime=now
say "requeued ${array}_1: $(job_state "${array}_1")"
all_done() { state_is "${array}_0" COMPLETED && state_is "${array}_1" COMPLETED && state_is "${array}_2" COMPLETED; }
until_true "the array to complete" all_done
restarts=$(job_field "${array}_1" Restarts)
[[ $restarts -eq 1 ]] || fail "task 1 ran $(( restarts + 1 )) times, expected 2 (cancelled, requeued)"
# The scheduler evaluates the merge's dependency on a later pass, not when the last task ends
# (slurmctld batches job-completion events, batch_sched_delay 3 s by default, and its periodic
# pass runs every sched_interval, 60 s): wait until the merge has left reason Dependency, i.e.
# either runs (or ran) or pends with DependencyNeverSatisfied. A fixed sleep raced that pass: a
# check 2 s after the array found Dependency still, and the merge then pended for good.
merge_decided() { ! state_is "$merge" PENDING || [[ $(job_field "$merge" Reason) != Dependency ]]; }
until_true "the scheduler to decide the merge's dependency" merge_decided
if state_is "$merge" PENDING && [[ $(job_field "$merge" Reason) == DependencyNeverSatisfied ]]; then
  scancel "$merge"
  merge=$(sbatch --parsable --dependency=afterok:"${array}_0:${array}_1:${array}_2" --mem=1G --chdir="$repo" \
            --output="$tmp/logs/kv_study_merge_%j.log" tools/slurm/kv_study_merge.sbatch)
  say "merge pended with DependencyNeverSatisfied after the cancel; resubmitted as $merge (afterok on each task)"
fi
until_true "the merge job to finish" state_is "$merge" COMPLETED FAILED CANCELLED TIMEOUT
[[ $(job_state "$merge") == COMPLETED ]] || fail "merge job $merge: $(job_state "$merge")"
say "array and merge done in $(( $(date +%s) - t0 )) s"

# ---- checks ------------------------------------------------------------------------------------
rerun=$(grep -h 'items run' "$tmp"/logs/kv_study_"${array}"_1.log | tail -n1)
say "task 1 rerun: $rerun"
grep -q "shard 1/3" "$tmp"/logs/kv_study_"${array}"_1.log || fail "task 1 log does not name shard 1/3"
/usr/bin/python3 - "$tmp" "$at_cancel" "$rerun" <<'PY'
import glob, json, os, re, sys

tmp, at_cancel, rerun = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def rows(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.endswith("\n")]  # a row torn by the kill has no newline

def key(r):
    return (r["arm"], r["task"], r["model"])

def fail(msg):
    print(f"sweep_test: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)

ref = rows(os.path.join(tmp, "unsharded", "results.jsonl"))
shards = {p: rows(p) for p in sorted(glob.glob(os.path.join(tmp, "sharded", "results.shard*of3.jsonl")))}
if len(shards) != 3:
    fail(f"expected 3 shard files, found {list(shards)}")
for p, rs in shards.items():
    keys = [key(r) for r in rs]
    if len(keys) != len(set(keys)):
        fail(f"{p}: duplicate rows")

# The cancelled task: what it had finished is still there, once, and was not recomputed.
cancelled = rows(os.path.join(tmp, "shard1.at-cancel.jsonl"))
final1 = shards[os.path.join(tmp, "sharded", "results.shard1of3.jsonl")]
if final1[: len(cancelled)] != cancelled:
    fail("the rows task 1 finished before the cancel changed or moved after the requeue")
m = re.search(r"(\d+) items run, (\d+) already done", rerun)
if not m or int(m.group(2)) != at_cancel:
    fail(f"task 1's rerun did not resume from its {at_cancel} finished rows: '{rerun}'")

# The merge: every row of the unsharded run, once, in its order, with the same results.
merged = rows(os.path.join(tmp, "sharded", "results.jsonl"))
if [key(r) for r in merged] != [key(r) for r in ref]:
    fail(f"merged rows ({len(merged)}) are not the unsharded run's rows ({len(ref)}) in order")
if sum(len(rs) for rs in shards.values()) != len(ref):
    fail("the shards hold more or fewer rows than the unsharded run")
for a, b in zip(merged, ref):
    for field in ("order", "kind", "passed", "output", "error", "family", "depth_pct", "context_target"):
        if a.get(field) != b.get(field):
            fail(f"row {key(a)}: {field} {a.get(field)!r} (merged) vs {b.get(field)!r} (unsharded)")

# The summaries: equal except what measures time or the process.
TIMING = {"prefill_tps", "decode_tps", "decode_ms_per_token", "total_seconds", "rss_growth_kib_mean"}

def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k not in TIMING}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x

def load_summary(path):
    with open(path) as f:
        s = strip(json.load(f))
    # A recommendation ranked by measured speed ("Fastest decode (tokens/s) ...") is timing too.
    s["recommendations"] = [r for r in s["recommendations"] if "tokens/s" not in r["rule"]]
    return s

s_merged = load_summary(os.path.join(tmp, "sharded", "summary.json"))
s_ref = load_summary(os.path.join(tmp, "unsharded", "summary.json"))
if s_merged != s_ref:
    for k in s_ref:
        if s_merged.get(k) != s_ref[k]:
            print(f"summary.json differs at '{k}':\n  merged    {json.dumps(s_merged.get(k))[:600]}\n"
                  f"  unsharded {json.dumps(s_ref[k])[:600]}", file=sys.stderr)
    fail("merged summary.json differs from the unsharded run's")
arms = [a["arm"] for a in s_ref["arms"]]
print(f"sweep_test: {len(merged)} rows merged = unsharded; summary.json equal for {len(arms)} arms "
      f"({', '.join(arms)}) apart from timing", file=sys.stderr)
PY
grep -h "kv_study merge:" "$tmp"/logs/kv_study_merge_"$merge".log >&2 || true
grep -q " 0 duplicates dropped, 0 conflicting" "$tmp"/logs/kv_study_merge_"$merge".log || fail "the merge dropped duplicates"
say "PASS ($(( $(date +%s) - t0 )) s after the cluster came up)"
