# SPDX-License-Identifier: Apache-2.0
"""The kv_study CLI end to end, without a model: memory, suite, quant, list, merge, report, and
errors (a message on stderr and a non-zero exit). Runs on the default model:
test_kv_study_runs.py."""
import concurrent.futures
import json
import os
import re
import resource
import subprocess
import tempfile
import unittest

BUILD = os.environ.get("KVCACHE_BUILD_DIR", "build")
KV_STUDY = os.path.join(BUILD, "apps", "kv_study", "kv_study")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args):
    return subprocess.run([KV_STUDY, *args], capture_output=True, text=True, timeout=120)


def run_bounded(*args, timeout=60):
    """kv_study with 2 GiB of data and `timeout` seconds at most (a reader without bounds ran out
    of memory on /dev/zero, and one that opened a FIFO waited forever); None if it timed out."""
    def limit():
        resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))
    env = None
    if os.environ.get("KVCACHE_SANITIZED", "0") == "1":
        # ASan reserves terabytes of shadow address space at start-up, which RLIMIT_DATA forbids:
        # there its own RSS watchdog bounds the process instead (a reader without bounds is
        # killed, and the test fails as it would at the rlimit).
        opts = [o for o in (os.environ.get("ASAN_OPTIONS", ""), "hard_rss_limit_mb=3072") if o]
        env = dict(os.environ, ASAN_OPTIONS=":".join(opts))
        limit = None
    try:
        return subprocess.run([KV_STUDY, *args], capture_output=True, text=True, timeout=timeout, preexec_fn=limit,
                              env=env)
    except subprocess.TimeoutExpired:
        return None


# Numbers a user may type by mistake or in malice (the floating-point options get them all).
HOSTILE_NUMBERS = ["nan", "-inf", "1e999", "0x10", ""]
# Under ASan + UBSan (the sanitizer tree's ctest, docs/ci.md) each case is a process start that
# loads LibTorch under the sanitizers' runtime (~2 s): there the floating-point options get two of
# the five (a NaN and an overflow; the parser's code path is the same for all five, which the
# release tree's run checks one by one).
SANITIZED = os.environ.get("KVCACHE_SANITIZED", "0") == "1"
if SANITIZED:
    HOSTILE_NUMBERS = ["nan", "1e999"]
# Options holding numbers in text (lists, budgets, shards), parsed by the library: (subcommand,
# option, template with {} for the hostile number).
TEXT_NUMBER_OPTIONS = [("memory", "--context", "4096,{}"), ("quant", "--bits", "2,{}"),
                       ("calibrate", "--bits", "{}"), ("calibrate", "--sparsity", "{}"),
                       ("run", "--shard", "{}/2"), ("run", "--budget", "{}"), ("run", "--budgets", "25%,{}%")]
# Arguments that let each subcommand get past parsing and then fail fast (a missing model):
# a number the option wrongly let through shows as an error about something else.
BASE_ARGS = {"memory": [], "suite": ["--out", "-"], "quant": [], "run": ["--model", "/nonexistent.pt"],
             "generate": ["--model", "/nonexistent.pt", "--prompt", "hi"], "prefix": ["--model", "/nonexistent.pt"],
             "layers": ["--model", "/nonexistent.pt", "--choices", "int8,int4"],
             "calibrate": ["--model", "/nonexistent.pt", "--out", "/nonexistent/x.kvqcal"]}


def row(order, arm, task, passed, peak):
    return {"order": order, "kind": "task", "arm": arm, "task": task, "model": "m", "family": "needle",
            "depth_pct": 35, "context_target": 256, "passed": passed, "output": "1234",
            "values": {"peak_bytes": peak, "prefill_s": 0.1, "decode_s": 0.1, "prompt_tokens": 100,
                       "generated_tokens": 3}}


@unittest.skipUnless(os.path.exists(KV_STUDY), f"{KV_STUDY} not built")
class KvStudyCliTest(unittest.TestCase):
    def test_memory_deep_dive_numbers(self):
        r = run("memory", "--model", "llama-3-8b", "--context", "4096,131072", "--quant", "fp16,int2")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("fp16 131072 B/token (128 KiB)", r.stdout)
        self.assertIn("| fp16 | 4096 | 131072 | 0.54 GB |", r.stdout)
        self.assertIn("| fp16 | 131072 | 131072 | 17.18 GB |", r.stdout)
        self.assertIn("| int2 | 131072 | 16384 | 2.15 GB |", r.stdout)

    def test_bad_fused_isa_is_refused_before_any_work(self):
        """KVCACHE_FUSED_ISA names the attention kernels; a value that is not one is refused up front
        (exit 1, the value named), not turned into an error row per task."""
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, KVCACHE_FUSED_ISA="avx9")
            r = subprocess.run([os.path.abspath(KV_STUDY), "run", "--suite", "small", "--configs", "int4+full",
                                "--out", d], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("KVCACHE_FUSED_ISA=avx9: expected avx512, avx2 or none", r.stderr)
            self.assertEqual(os.listdir(d), [])

    def test_bad_attention_query_is_refused_before_any_work(self):
        """KVCACHE_ATTENTION_QUERY (exact or int8) names the query arithmetic of the attention
        kernels; another value is refused up front (exit 1, the value named)."""
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, KVCACHE_ATTENTION_QUERY="q4")
            r = subprocess.run([os.path.abspath(KV_STUDY), "run", "--suite", "small", "--configs", "int4+full",
                                "--out", d], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("KVCACHE_ATTENTION_QUERY=q4: expected exact", r.stderr)
            self.assertEqual(os.listdir(d), [])

    def test_suite_and_training_data(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "small.jsonl")
            r = run("suite", "--suite", "small", "--out", out)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(out) as f:
                tasks = [json.loads(l) for l in f]
            self.assertEqual(len(tasks), 20)
            self.assertEqual(tasks[0]["id"], "s1234-needle-L256-d5-r0")
            r = run("suite", "--seed", "7", "--count", "5", "--out", "-")
            self.assertEqual(r.returncode, 0, r.stderr)
            lines = r.stdout.strip().split("\n")
            self.assertEqual([json.loads(l)["id"] for l in lines], [f"train-s7-{i}" for i in range(5)])

    def test_quant_tables_without_a_model(self):
        r = run("quant", "--tokens", "64", "--specs", "fp32,int4,kivi:k2:v2:g32:r128")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("| fp32 | 32.00 | 0.0000 | 0.0000 |", r.stdout)
        self.assertIn("| per-channel K + per-token V (KIVI) |", r.stdout)

    def test_list(self):
        r = run("list")
        self.assertEqual(r.returncode, 0, r.stderr)
        for word in ("int4", "kivi", "gear", "h2o", "int4+h2o@50%", "needle", "deepdive",
                     "gear:b2:g32:s0.02:r2:loop3:nb64+full"):
            self.assertIn(word, r.stdout)

    def test_merge_and_report(self):
        with tempfile.TemporaryDirectory() as d:
            a, b = os.path.join(d, "a.jsonl"), os.path.join(d, "b.jsonl")
            with open(a, "w") as f:
                f.write(json.dumps(row(0, "fp32+full", "t0", True, 1024)) + "\n")
                f.write(json.dumps(row(3, "int4+full", "t1", False, 256)) + "\n")
            with open(b, "w") as f:
                f.write(json.dumps(row(1, "fp32+full", "t1", True, 1024)) + "\n")
                f.write(json.dumps(row(2, "int4+full", "t0", True, 256)) + "\n")
                f.write('{"order": 4, "ki')  # torn last line
            merged = os.path.join(d, "results.jsonl")
            r = run("merge", a, b, "--out", merged)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("1 partial lines skipped", r.stderr)
            with open(merged) as f:
                self.assertEqual([json.loads(l)["order"] for l in f], [0, 1, 2, 3])
            r = run("report", d)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("| int4+full | 1/2 | 50.0% | -50.0 pp (-1) | 0.2 | 0.25 |", r.stdout)
            with open(os.path.join(d, "summary.json")) as f:
                summary = json.load(f)
            self.assertEqual(summary["recommendations"][0]["arm"], "int4+full")
            self.assertTrue(os.path.exists(os.path.join(d, "summary.csv")))

    def test_errors_exit_non_zero_with_a_message(self):
        for args, needle in [(("memory", "--model", "gpt-5"), "unknown model preset 'gpt-5'"),
                             (("memory", "--quant", "int9"), "int9"),
                             (("suite", "--count", "2", "--families", "math", "--out", "-"), "unknown task family"),
                             (("run", "--shard", "3/2", "--configs", "fp32+full"), "shard '3/2'"),
                             (("report", "/nonexistent/results.jsonl"), "cannot open results file"),
                             (("frobnicate",), "")]:
            r = run(*args)
            self.assertNotEqual(r.returncode, 0, args)
            self.assertIn(needle, r.stderr, args)

    def test_numbers_out_of_range_name_the_value_and_the_range(self):
        """Every number a user types is range-checked where it is parsed: one clean line naming
        the value as written and the allowed range, a non-zero exit, no LibTorch backtrace."""
        for args, needle in [
                (("memory", "--context", "9223372036854775807", "--batch", "4"),
                 "--context = 9223372036854775807 is out of range [0, 1000000000]"),
                (("memory", "--batch", "0"), "--batch: 0 is out of range [1, 1000000]"),
                (("memory", "--batch", "99999999999999999999"), "--batch: 99999999999999999999 is out of range"),
                (("memory", "--quant", "int4:g99999999999999999999"),
                 "g=99999999999999999999 out of range [0, 65536]"),
                (("memory", "--quant", "kivi:k2:v2:g4:r0"), "r=0 out of range [1, 1000000000]"),
                (("run", "--shard", "99999999999999999999/2"),
                 "shard '99999999999999999999/2': i = 99999999999999999999 is out of range [0, 1000000]"),
                (("run", "--seed", "-1"), "--seed: -1 is out of range [0, 9223372036854775807]"),
                (("run", "--threads", "100000"), "--threads: 100000 is out of range [1, 256]"),
                (("run", "--budget", "1e300"), "budget '@1e300': token budget must be an integer in [1, 1000000000]"),
                (("run", "--budgets", "25%,150%"),
                 "--budgets '25%,150%': item '150%' is not a budget: budget '@150%': percentage must be in (0, 100]"),
                (("run", "--budgets", "50%,50.0%"), "--budgets '50%,50.0%': budget '50.0%' appears twice"),
                (("run", "--budget", "50%", "--budgets", "25%,75%"), "--budget '50%' and --budgets '25%,75%' exclude"),
                (("generate", "--prompt", "hi", "--max-new-tokens", "999999999999999"),
                 "--max-new-tokens: 999999999999999 is out of range [1, 1000000000]"),
                (("suite", "--count", "-5", "--out", "-"), "--count: -5 is out of range [0, 10000000]"),
                (("suite", "--count", "99999999999999", "--out", "-"), "--count: 99999999999999 is out of range"),
                (("quant", "--tokens", "99999999999"), "--tokens: 99999999999 is out of range [1, 65536]"),
                (("quant", "--group", "99999999999"), "--group: 99999999999 is out of range [1, 65536]"),
                (("quant", "--outlier-scale", "nan"), "--outlier-scale: 'nan' is not a number"),
                (("quant", "--bits", "0"), "--bits = 0 is out of range [1, 16]")]:
            r = run(*args)
            self.assertNotEqual(r.returncode, 0, args)
            self.assertIn(needle, r.stderr, args)
            self.assertNotIn("frame #", r.stderr, args)
            self.assertNotIn("unexpected error", r.stderr, args)
            self.assertEqual(r.stdout, "", args)  # nothing printed before the check

    def test_every_numeric_option_refuses_hostile_numbers(self):
        """Property over every numeric option of every subcommand, read from --help: each INT/UINT
        option checks its text with IntRange (kvcache::parse_integer: no NaN, no wrap, no rounding)
        and each FLOAT option with NumberRange (finite numbers only), which --help shows as their
        validators. Then each floating-point option, the options holding numbers in text and a
        sample of integer ones refuse hostile numbers — a non-zero exit, the option named, no
        backtrace, no 'unexpected' error, no number the user did not type (issue 39, fault 5:
        `prefix --pool-mib nan` passed CLI::Range and came back as -9223372036854775808; `prefix
        --seed` had no check at all)."""
        cases = [("prefix", "--seed", "nan"), ("calibrate", "--seqlen", "99999999999999999999")]
        numeric = []
        for cmd in BASE_ARGS:
            help_text = run(cmd, "--help").stdout
            for opt, kind, validator in re.findall(r"^\s+(--[\w-]+) (INT|UINT|FLOAT):(\S+ in \[)", help_text, re.M):
                numeric.append((cmd, opt))
                want = "NUMBER in [" if kind == "FLOAT" else "INT in ["
                self.assertEqual(validator, want, f"{cmd} {opt}: checked by {validator!r}")
                if kind == "FLOAT":
                    cases.extend((cmd, opt, v) for v in HOSTILE_NUMBERS)
            for line in re.findall(r"^\s+--[\w-]+ (?:INT|UINT|FLOAT)\b.*$", help_text, re.M):
                self.assertRegex(line, r" (INT|UINT|FLOAT):\S+ in \[", f"{cmd}: a numeric option without a range check")
        self.assertIn(("prefix", "--pool-mib"), numeric)
        self.assertIn(("prefix", "--seed"), numeric)
        self.assertGreater(len(numeric), 20)
        cases.extend((cmd, opt, template.format("nan")) for cmd, opt, template in TEXT_NUMBER_OPTIONS)
        # (two at a time; OMP_WAIT_POLICY set so that kv_study does not start itself again)
        env = dict(os.environ, OMP_WAIT_POLICY="passive")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda c: subprocess.run([KV_STUDY, c[0], *BASE_ARGS[c[0]], c[1], c[2]],
                                                             capture_output=True, text=True, timeout=120, env=env),
                                    cases))
        for (cmd, opt, value), r in zip(cases, results):
            args = (cmd, *BASE_ARGS[cmd], opt, value)
            self.assertNotEqual(r.returncode, 0, args)
            self.assertNotIn("unexpected", r.stderr, args)
            self.assertNotIn("frame #", r.stderr, args)
            named = opt in r.stderr or (
                opt == "--shard" and "shard '" in r.stderr) or (opt == "--budget" and "budget '@" in r.stderr)
            self.assertTrue(named, f"{args}: refused, but not by {opt}: {r.stderr!r}")
            # No number the user did not type: an int64 wrapped from a cast, a NaN or Inf made up.
            for made_up in ("-9223372036854775808", r"\bnan\b", r"\binf\b"):
                if re.search(made_up, r.stderr, re.I) and not re.search(made_up, value, re.I):
                    self.fail(f"{args}: the error shows {made_up!r}, typed {value!r}: {r.stderr!r}")
            self.assertEqual(r.stdout, "", args)

    def test_files_that_are_not_regular_are_refused_before_reading(self):
        """`calibrate --text`, the results readers (`merge`, `report`) and `memory --model`'s
        config.json refuse a directory, a device and a FIFO before reading (issue 39, fault 5: --text DIR failed with 'unexpected
        error: basic_filebuf::underflow'; /dev/zero was read until memory ran out; a FIFO blocked),
        and bound what they read: the file size and the line length, each limit named."""
        with tempfile.TemporaryDirectory() as d:
            fifo = os.path.join(d, "fifo")
            os.mkfifo(fifo)
            cal = ("calibrate", "--model", "/nonexistent.pt", "--out", os.path.join(d, "c.kvqcal"), "--text")
            out = ("--out", os.path.join(d, "m.jsonl"))
            for args, needle in [
                    (cal + (d,), f"--text: cannot read calibration text '{d}': it is a directory"),
                    (cal + ("/dev/zero",), "--text: cannot read calibration text '/dev/zero': it is a character "
                                           "device, not a regular file"),
                    (cal + (fifo,), f"--text: cannot read calibration text '{fifo}': it is a FIFO (named pipe), "
                                    f"not a regular file"),
                    (("merge", "/dev/zero") + out, "cannot read results file '/dev/zero': it is a character device"),
                    (("merge", fifo) + out, f"cannot read results file '{fifo}': it is a FIFO (named pipe)"),
                    (("report", "/dev/zero"), "cannot read results file '/dev/zero': it is a character device"),
                    (("memory", "--model", "/dev/zero"), "cannot read model config '/dev/zero': it is a character "
                                                         "device, not a regular file"),
                    (("memory", "--model", fifo), f"cannot read model config '{fifo}': it is a FIFO (named pipe), "
                                                  f"not a regular file")]:
                r = run_bounded(*args)
                self.assertIsNotNone(r, f"{args}: still running after 60 s (blocked on a FIFO?)")
                self.assertEqual(r.returncode, 1, (args, r.stderr))
                self.assertTrue(r.stderr.startswith(f"kv_study: error: {needle}"), (args, r.stderr))
                self.assertEqual(r.stderr.count("\n"), 1, (args, r.stderr))
                self.assertNotIn("unexpected", r.stderr, args)
            self.assertEqual(sorted(os.listdir(d)), ["fifo"])
            # Size limits: sparse files one byte over, a line one byte over.
            big = os.path.join(d, "big.jsonl")
            with open(big, "wb") as f:
                f.truncate((1 << 30) + 1)
            r = run_bounded("merge", big, *out)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn(f"cannot read results file '{big}': it is 1073741825 bytes, more than the 1073741824 "
                          f"bytes (1 GiB) a results file may have", r.stderr)
            text = os.path.join(d, "big.txt")
            with open(text, "wb") as f:
                f.truncate((64 << 20) + 1)
            r = run_bounded(*cal, text)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("it is 67108865 bytes, more than the 67108864 bytes (64 MiB) a calibration text may have",
                          r.stderr)
            long_line = os.path.join(d, "long.jsonl")
            with open(long_line, "w") as f:
                f.write(json.dumps(row(0, "fp32+full", "t0", True, 1024)) + "\n" + "x" * ((16 << 20) + 1) + "\n")
            r = run_bounded("report", long_line)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn(f"results file '{long_line}': line 2 is 16777217 bytes long, more than the 16777216 bytes "
                          f"(16 MiB) a line may have", r.stderr)

    def test_memory_of_huge_contexts_does_not_overflow(self):
        r = run("memory", "--model", "llama-3-8b", "--context", "1000000000", "--batch", "1000000", "--quant", "fp16")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("| fp16 | 1000000000 | 131072 | 131072000000.00 GB |", r.stdout)
        self.assertIn("| 16.000 | 1.00x |", r.stdout)

    def test_quant_with_a_bad_spec_exits_non_zero(self):
        """`quant --specs int5` was exit 0 with the error inside a table cell."""
        for spec, needle in [("int5", "unknown cache scheme 'int5'"),
                             ("int4:g48", "head_dim D = 64 is not divisible by the group size g = 48"),
                             ("fp32,int4:g32:chan", "groups 32 tokens per channel but the sample has only 8 tokens")]:
            r = run("quant", "--tokens", "8", "--specs", spec)
            self.assertEqual(r.returncode, 1, spec)
            self.assertIn(needle, r.stderr, spec)
            self.assertEqual(r.stdout, "", spec)
        # A default spec that does not fit the samples is left out, saying so.
        r = run("quant", "--tokens", "8")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("Left out (not measurable on these samples):\n- int4:g32:chan: ", r.stdout)
        self.assertIn("| int4:g32 | 5.00 |", r.stdout)

    def test_failed_writes_leave_no_temporary_file(self):
        with tempfile.TemporaryDirectory() as d:
            a = os.path.join(d, "a.jsonl")
            with open(a, "w") as f:
                f.write(json.dumps(row(0, "fp32+full", "t0", True, 1024)) + "\n")
            out = os.path.join(d, "out")
            os.mkdir(out)
            r = run("merge", a, "--out", out)
            self.assertEqual(r.returncode, 1)
            self.assertIn(f"cannot write '{out}': Is a directory", r.stderr)
            os.mkdir(os.path.join(d, "summary.md"))
            r = run("report", a, "--quiet")
            self.assertEqual(r.returncode, 1)
            self.assertIn("Is a directory", r.stderr)
            r = run("suite", "--suite", "small", "--out", out)
            self.assertEqual(r.returncode, 1)
            self.assertEqual(sorted(os.listdir(d)), ["a.jsonl", "out", "summary.md"])
            self.assertEqual(os.listdir(out), [])
            r = run("report", d)  # a directory: its results.jsonl is missing
            self.assertEqual(r.returncode, 1)
            self.assertIn("cannot open results file", r.stderr)

    def test_memory_of_a_per_layer_scheme(self):
        # Qwen2.5-0.5B: 24 layers x 2 KV heads x head_dim 64; int8 (8.5 bits) in 12 layers, int4 (4.5) in 12.
        r = run("memory", "--model", "qwen2.5-0.5b", "--context", "4096", "--quant", "layers(int8*12;int4*12)")
        self.assertEqual(r.returncode, 0, r.stderr)
        # raw: 6 bits x (K, V) x 24 x 2 x 64 values / 8 = 4608 B per token, the mean of int8 (6144) and int4 (3072)
        self.assertIn("| layers(int8*12;int4*12) | 4096 | 4608 | 0.02 GB | 18.0 MiB |", r.stdout)
        self.assertIn("| 6.500 |", r.stdout)
        r = run("memory", "--model", "qwen2.5-0.5b", "--quant", "layers(int8*12;int4*11)")
        self.assertEqual(r.returncode, 1)
        self.assertIn("its runs cover 23 layers (12 + 11), the model has 24", r.stderr)

    def test_layers_argument_errors(self):
        """kv_study layers checks the choices against the budget option before it loads a model."""
        for args, msg in ((("--choices", "h2o@25%,full", "--avg-bits", "4"),
                           "'h2o@25%,full' are eviction policies: give their mean budget with --avg-budget"),
                          (("--choices", "int8,int4", "--avg-budget", "50%"),
                           "'int8,int4' are cache schemes: give their mean bits/value with --avg-bits"),
                          (("--choices", "h2o@25,h2o@50", "--avg-budget", "50%"),
                           "--avg-budget '50%' is in percent, choice 'h2o@25' budgets tokens"),
                          (("--choices", "int8", "--avg-bits", "4", "--avg-budget", "50%"), "excludes")):
            r = run("layers", "--model", "/nonexistent.pt", *args)
            self.assertNotEqual(r.returncode, 0, args)
            self.assertIn(msg, r.stderr, args)

    def test_log_level_is_checked(self):
        r = run("--log-level", "verbose", "list")
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("--log-level: verbose not in {trace,debug,info,warn,error,off}", r.stderr)
        r = run("list", "--log-level", "off")
        self.assertEqual(r.returncode, 0, r.stderr)


if __name__ == "__main__":
    unittest.main()
