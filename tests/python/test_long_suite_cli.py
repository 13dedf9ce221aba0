# SPDX-License-Identifier: Apache-2.0
"""The long suite end to end through kv_study and the committed long-context model
(models/kvstudy-long.pt, issue 34): a CI-sized smoke run (one task per family at 4k; the control
passes every one but multivalue, the model's known failure, each prompt within 1% below 4096 tokens of the model's own tokenizer, each row
records memory and speed), the by-length report, and the refusals that come before any work (a
length beyond the model's positions, a run the machine has no memory for)."""
import json
import os
import subprocess
import tempfile
import unittest

BUILD = os.environ.get("KVCACHE_BUILD_DIR", "build")
KV_STUDY = os.path.abspath(os.path.join(BUILD, "apps", "kv_study", "kv_study"))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG_MODEL = os.path.join(REPO, "models", "kvstudy-long.pt")
# Under ASan/UBSan (the sanitizer build's ctest) the smoke run keeps two families and the control:
# the same code paths, in a fraction of the time.
SANITIZED = os.environ.get("KVCACHE_SANITIZED", "0") == "1"


def run(*args, cwd=REPO, timeout=600):
    return subprocess.run([KV_STUDY, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


@unittest.skipUnless(os.path.exists(KV_STUDY), f"{KV_STUDY} not built")
class LongSuiteCliTest(unittest.TestCase):
    def test_smoke_one_task_per_family_at_4k_control_passes(self):
        with tempfile.TemporaryDirectory() as d:
            suite = os.path.join(d, "long.jsonl")
            r = run("suite", "--suite", "long", "--lengths", "4k", "--out", suite)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(suite) as f:
                tasks = [json.loads(line) for line in f]
            self.assertEqual(len(tasks), 20)
            one = {}
            for t in tasks:
                if t["family"] not in one and (t["family"] != "needle" or t["depth_pct"] == 43):
                    one[t["family"]] = t
            self.assertEqual(sorted(one), ["aggregation", "instruction", "multikey", "multiturn", "multivalue",
                                           "needle", "vartrack"])
            if SANITIZED:
                one = {f: one[f] for f in ("needle", "multikey")}
            smoke = os.path.join(d, "smoke.jsonl")
            with open(smoke, "w") as f:
                for t in one.values():
                    f.write(json.dumps(t) + "\n")
            out = os.path.join(d, "run")
            r = run("run", "--model", LONG_MODEL, "--tasks", smoke, "--configs",
                    "fp32+full" if SANITIZED else "fp32+full,int4+snapkv@2048",
                    "--no-text", "--no-recon", "--no-attn", "--threads", "2", "--quiet", "--out", out)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(os.path.join(out, "results.jsonl")) as f:
                rows = [json.loads(line) for line in f]
            control = [x for x in rows if x["arm"] == "fp32+full"]
            self.assertEqual(len(control), len(one))
            answer = {t["id"]: t["answer"] for t in one.values()}
            for x in control:
                if x["family"] == "multivalue":
                    # the committed model's known failure (models/README.md): it stops after two or
                    # three of the four codes; what it writes first is the first code
                    first = answer[x["task"]].split(",")[0]
                    self.assertTrue(x["output"].startswith(first), f"{x['task']}: {x['output']!r}, want {first!r}...")
                    continue
                self.assertTrue(x["passed"], f"{x['task']}: {x['output']!r}")
                v = x["values"]
                # the generator filled the prompt with the model's own tokenizer: within 1% below 4096
                self.assertLessEqual(v["prompt_tokens"], 4096, x["task"])
                self.assertGreaterEqual(v["prompt_tokens"], 4096 - 40, x["task"])
                for k in ("peak_bytes", "peak_reserved_bytes", "rss_growth_peak_bytes", "prefill_tok_s",
                          "decode_ms_per_token"):
                    self.assertGreater(v[k], 0, f"{x['task']}: {k}")
            if SANITIZED:
                return
            with open(os.path.join(out, "summary.json")) as f:
                s = json.load(f)
            ctrl = next(a for a in s["arms"] if a["arm"] == "fp32+full")
            comp = next(a for a in s["arms"] if a["arm"] == "int4+snapkv@2048")
            self.assertLess(comp["peak_kib_mean"], 0.5 * ctrl["peak_kib_mean"])

    def test_by_length_report(self):
        """Two lengths: summary.md gets the accuracy x length table, the depth x length grid and the
        fronts, summary_by_length.csv one row per arm and length."""
        with tempfile.TemporaryDirectory() as d:
            rows = []
            order = 0
            for arm, acc in (("fp32+full", (1, 1)), ("fp32+h2o@2048", (1, 0))):
                for li, n in enumerate((4096, 8192)):
                    for depth in (0, 100):
                        rows.append({"order": order, "kind": "task", "arm": arm, "task": f"t{n}-{depth}", "model": "m",
                                     "family": "needle", "depth_pct": depth, "context_target": n,
                                     "passed": bool(acc[li]) or depth == 100, "output": "",
                                     "values": {"peak_bytes": (n if arm == "fp32+full" else 2048) * 4096.0,
                                                "prefill_s": 1.0, "decode_s": 0.5, "prompt_tokens": n,
                                                "generated_tokens": 10}})
                        order += 1
            res = os.path.join(d, "results.jsonl")
            with open(res, "w") as f:
                for x in rows:
                    f.write(json.dumps(x) + "\n")
            r = run("report", d, "--quiet")
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(os.path.join(d, "summary.md")) as f:
                md = f.read()
            self.assertIn("## Accuracy by prompt length", md)
            self.assertIn("| fp32+h2o@2048 | 100.0% (0.50×) | 50.0% (0.25×) |", md)
            self.assertIn("## Needle accuracy by depth and length", md)
            self.assertIn("| fp32+h2o@2048 | 8192 | 0.0% | 100.0% |", md)
            self.assertIn("| 8192 | `fp32+h2o@2048` 50.0% at 0.25×, `fp32+full` 100.0% at 1.00× |", md)
            with open(os.path.join(d, "summary_by_length.csv")) as f:
                lines = f.read().strip().split("\n")
            self.assertEqual(len(lines), 5)
            self.assertTrue(lines[0].startswith("arm,length,tasks,passed,accuracy,peak_kib_mean,memory_ratio"))
            self.assertIn("fp32+h2o@2048,8192,2,1,0.5,8192,0.25,", lines[4])

    def test_a_length_beyond_the_models_positions_is_refused_before_any_work(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "run")
            r = run("run", "--suite", "long", "--model", LONG_MODEL, "--lengths", "4k,64k", "--out", out)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("length 64k (65536 tokens + 64 new) is beyond the positions of", r.stderr)
            self.assertIn("max_position_embeddings is 40960", r.stderr)
            self.assertFalse(os.path.exists(out))
            r = run("suite", "--suite", "long", "--model", LONG_MODEL, "--lengths", "64k",
                    "--out", os.path.join(d, "s.jsonl"))
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("max_position_embeddings is 40960", r.stderr)
            self.assertEqual(os.listdir(d), [])

    def test_a_run_the_machine_cannot_hold_is_refused_with_the_estimate(self):
        """--text-tokens 100M: the text rows' logits alone would need far more memory than any
        machine of this project has; the refusal names the estimate and its parts."""
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "run")
            r = run("run", "--suite", "long", "--model", LONG_MODEL, "--lengths", "4k", "--text-tokens", "100000000",
                    "--out", out)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("the run's estimated peak memory", r.stderr)
            self.assertIn("text-row logits", r.stderr)
            self.assertFalse(os.path.exists(out))

    def test_the_default_model_of_the_long_suite_is_the_long_model(self):
        r = run("run", "--help")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("models/kvstudy-long.pt", r.stdout)
        r = run("list")
        self.assertIn("long", r.stdout)


if __name__ == "__main__":
    unittest.main()
