# SPDX-License-Identifier: Apache-2.0
"""The kv_study CLI end to end, without a model: memory, suite, quant, list, merge, report, and
errors (a message on stderr and a non-zero exit)."""
import json
import os
import subprocess
import tempfile
import unittest

BUILD = os.environ.get("KVCACHE_BUILD_DIR", "build")
KV_STUDY = os.path.join(BUILD, "apps", "kv_study", "kv_study")


def run(*args):
    return subprocess.run([KV_STUDY, *args], capture_output=True, text=True, timeout=120)


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
        for word in ("int4", "kivi", "h2o", "int4+h2o@50%", "needle"):
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


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = os.path.join(REPO, "models", "kvstudy-default.pt")


@unittest.skipUnless(os.path.exists(KV_STUDY), f"{KV_STUDY} not built")
@unittest.skipUnless(os.path.exists(DEFAULT_MODEL), "models/kvstudy-default.pt not committed")
class DefaultModelTest(unittest.TestCase):
    def test_control_on_the_small_suite_is_the_default_model(self):
        """`kv_study run` with no --model uses models/kvstudy-default.pt (relative to the working
        directory, the repo root here); its fp32+full control passes exactly the count that the
        Python greedy loop over the same export gets (test_train_default_model.COMMITTED_SMALL_PASS)."""
        import sys
        sys.path.insert(0, os.path.join(REPO, "tests", "python"))
        from test_train_default_model import COMMITTED_SMALL_PASS
        with tempfile.TemporaryDirectory() as d:
            r = subprocess.run([os.path.abspath(KV_STUDY), "run", "--suite", "small", "--configs", "fp32+full",
                                "--out", d, "--threads", "1", "--no-text", "--no-recon", "--no-attn", "--quiet"],
                               capture_output=True, text=True, timeout=600, cwd=REPO)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("kvstudy-default.pt", r.stderr)
            with open(os.path.join(d, "summary.json")) as f:
                arm = json.load(f)["arms"][0]
        self.assertEqual(arm["arm"], "fp32+full")
        self.assertEqual((arm["passed"], arm["tasks"]), (COMMITTED_SMALL_PASS, 20))

    def test_control_reproduces_unmanaged_generation_on_the_default_suite(self):
        """fp32+full through the CacheManager (block storage, attend() reading the blocks) gives
        every one of the 222 default-suite replies that unmanaged greedy decoding gives: the
        trainer's Python loop over the same export, torch.cat of K/V and at:: attention."""
        import sys
        import torch
        sys.path.insert(0, os.path.join(REPO, "tools"))
        import train_default_model as T
        with tempfile.TemporaryDirectory() as d:
            tasks_path = os.path.join(d, "tasks.jsonl")
            r = subprocess.run([os.path.abspath(KV_STUDY), "suite", "--suite", "default", "--out", tasks_path],
                               capture_output=True, text=True, timeout=120, cwd=REPO)
            self.assertEqual(r.returncode, 0, r.stderr)
            r = subprocess.run([os.path.abspath(KV_STUDY), "run", "--tasks", tasks_path, "--configs", "fp32+full",
                                "--out", os.path.join(d, "run"), "--threads", "1", "--no-text", "--no-recon",
                                "--no-attn", "--quiet"], capture_output=True, text=True, timeout=900, cwd=REPO)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(tasks_path) as f:
                tasks = [json.loads(line) for line in f]
            with open(os.path.join(d, "run", "results.jsonl")) as f:
                managed = {row["task"]: row["output"] for row in map(json.loads, f) if row.get("kind") == "task"}
        self.assertEqual(len(tasks), 222)
        extra = {"config.json": "", "tokenizer.json": ""}
        module = torch.jit.load(DEFAULT_MODEL, _extra_files=extra)
        layers = json.loads(extra["config.json"])["num_hidden_layers"]
        tok = T.Tokenizer.from_json(json.loads(extra["tokenizer.json"]))
        stop = [tok.special_ids[T.IM_END], tok.special_ids[T.ENDOFTEXT]]
        differ = []
        for t in tasks:
            out = T.greedy_generate(module, layers, tok.encode(T.render_chatml(t["messages"], True)),
                                    int(t["max_new_tokens"]), stop)
            reply = tok.decode([i for i in out if i not in stop]).strip()
            if reply != managed[t["id"]].strip():
                differ.append((t["id"], reply, managed[t["id"]]))
        self.assertEqual(differ, [])


if __name__ == "__main__":
    unittest.main()
