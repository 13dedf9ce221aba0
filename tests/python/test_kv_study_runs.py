# SPDX-License-Identifier: Apache-2.0
"""kv_study's runs on the committed default model (models/kvstudy-default.pt), end to end: the
control against unmanaged generation, ratio sweeps, query modes, KVQuant calibration, generate's
errors and warnings, the prefix workloads and their pool and disk tier. (The CLI without a model,
its parsing and refusals: test_kv_study_cli.py; the two files run as two ctest entries, side by
side.)"""
import json
import os
import subprocess
import tempfile
import unittest

BUILD = os.environ.get("KVCACHE_BUILD_DIR", "build")
KV_STUDY = os.path.join(BUILD, "apps", "kv_study", "kv_study")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = os.path.join(REPO, "models", "kvstudy-default.pt")
# The sanitizer tree (KVCACHE_SANITIZED=1, docs/ci.md) skips the two runs whose cost is scale, not
# code: each path they take is run under the sanitizers by a smaller test here.
SANITIZED = os.environ.get("KVCACHE_SANITIZED", "0") == "1"


def release_only(why):
    return unittest.skipIf(SANITIZED, f"release tree only: {why}")


def run(*args):
    return subprocess.run([KV_STUDY, *args], capture_output=True, text=True, timeout=120)


def small_suite_run(out, configs, *extra):
    """`kv_study run` of the small suite on one thread, task rows only, no tables printed."""
    return [os.path.abspath(KV_STUDY), "run", "--suite", "small", "--configs", configs, *extra, "--out", out,
            "--threads", "1", "--no-text", "--no-recon", "--no-attn", "--quiet"]


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
            r = subprocess.run(small_suite_run(d, "fp32+full"), capture_output=True, text=True, timeout=600, cwd=REPO)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("kvstudy-default.pt", r.stderr)
            with open(os.path.join(d, "summary.json")) as f:
                arm = json.load(f)["arms"][0]
        self.assertEqual(arm["arm"], "fp32+full")
        self.assertEqual((arm["passed"], arm["tasks"]), (COMMITTED_SMALL_PASS, 20))

    def test_bad_inputs_create_no_file(self):
        """A run whose arm list or task file is bad creates nothing (it once left an empty
        results.jsonl): every input is checked before the output directory exists."""
        with tempfile.TemporaryDirectory() as d:
            empty = os.path.join(d, "empty.jsonl")
            open(empty, "w").close()
            for args, needle in [(("--configs", "int5+full"), "unknown cache scheme 'int5'"),
                                 (("--configs", "fp32+window@0.5"), "token budget must be an integer"),
                                 (("--tasks", empty), "the sweep has no task"),
                                 (("--query-mode", "blind"),
                                  "--query-mode: query mode 'blind' is none of aware, agnostic, both"),
                                 (("--tasks", d), f"cannot open task file '{d}': it is a directory")]:
                out = os.path.join(d, "run")
                r = subprocess.run([os.path.abspath(KV_STUDY), "run", *args, "--out", out, "--threads", "1"],
                                   capture_output=True, text=True, timeout=120, cwd=REPO)
                self.assertEqual(r.returncode, 1, args)
                self.assertIn(needle, r.stderr, args)
                self.assertFalse(os.path.exists(out), args)

    def test_prefix_checks_arm_specs_before_loading_the_model(self):
        """`kv_study prefix` refuses a bad arm spec (a zero budget, an unknown scheme) before it
        loads the model: a missing model does not hide it, and no output directory is made."""
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "p")
            for configs, needle in [("int4+window@0", "token budget must be an integer in [1, 1000000000], got 0"),
                                    ("int5+full", "unknown cache scheme 'int5'")]:
                r = subprocess.run([os.path.abspath(KV_STUDY), "prefix", "--configs", configs, "--model",
                                    os.path.join(d, "no-such-model.pt"), "--out", out],
                                   capture_output=True, text=True, timeout=120, cwd=REPO)
                self.assertEqual(r.returncode, 1, configs)
                self.assertIn(needle, r.stderr, configs)
                self.assertNotIn("no-such-model.pt", r.stderr, configs)
                self.assertFalse(os.path.exists(out), configs)

    def test_generate_errors_and_warnings(self):
        def generate(*args):
            new = () if "--max-new-tokens" in args else ("--max-new-tokens", "2")
            return subprocess.run([os.path.abspath(KV_STUDY), "generate", "--threads", "1", *new, *args],
                                  capture_output=True, timeout=120, cwd=REPO)
        # The byte offset of bad UTF-8 is the one in the text the user passed.
        r = generate("--prompt", b"a\xffb")
        self.assertEqual(r.returncode, 1)
        self.assertIn(b"the user message (message 1) is not valid UTF-8 at byte 1 of its content (byte value 0xff)",
                      r.stderr)
        # A budget that holds the whole request evicts nothing: a warning through the library's
        # logger, silenced by --log-level error.
        warning = b"kvcache: warning: eviction policy 'window@1000' evicts nothing from a request of"
        r = generate("--prompt", "hi", "--arm", "fp32+window@1000")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(warning, r.stderr)
        r = generate("--prompt", "hi", "--arm", "fp32+window@1000", "--log-level", "error")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertNotIn(b"kvcache:", r.stderr)
        # A prompt longer than the model's positions runs, with a warning.
        r = generate("--prompt", " ".join(["the dog"] * 560), "--max-new-tokens", "1")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(b"kvcache: warning: generate: the prompt of ", r.stderr)
        self.assertIn(b"tokens is longer than the model's max_position_embeddings of 1024", r.stderr)
        # --query-mode: one mode, agnostic needs the question; the control replies the same in
        # both modes (nothing is compressed), and agnostic mode says how many tokens followed.
        ctx = "Remember this. The key is 4417. The door is red. The cat sleeps on the mat."
        r = generate("--prompt", ctx, "--query-mode", "agnostic")
        self.assertEqual(r.returncode, 1)
        self.assertIn(b"--query-mode agnostic needs --question", r.stderr)
        r = generate("--prompt", ctx, "--query-mode", "both")
        self.assertEqual(r.returncode, 1)
        self.assertIn(b"generate runs one mode, aware or agnostic (got 'both'", r.stderr)
        replies = {}
        for mode in ("aware", "agnostic"):
            r = generate("--prompt", ctx, "--question", "What is the key?", "--query-mode", mode,
                         "--max-new-tokens", "6")
            self.assertEqual(r.returncode, 0, r.stderr)
            replies[mode] = r.stdout
            self.assertEqual(b"query-agnostic:" in r.stderr, mode == "agnostic", r.stderr)
        self.assertEqual(replies["aware"], replies["agnostic"])
        # A scheme that validates runs (kivi r0 once validated, then failed at the first flush).
        r = generate("--prompt", "hi", "--arm", "kivi:k2:v2:g4:r0")
        self.assertEqual(r.returncode, 1)
        self.assertIn(b"r=0 out of range [1, 1000000000]", r.stderr)
        r = generate("--prompt", "hi", "--arm", "kivi:k2:v2:g4:r4")
        self.assertEqual(r.returncode, 0, r.stderr)

    def test_ratio_sweep_runs_each_budget_resumes_and_draws_curves(self):
        """`--budgets` runs the evicting arm once per budget and the control once; the summary holds
        the method's curve, a rerun runs nothing, and plot_results draws the three budget plots."""
        with tempfile.TemporaryDirectory() as d:
            cmd = small_suite_run(d, "fp32+full,fp32+h2o@50%", "--budgets", "25%,75%")
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("3 arms x 20 tasks", r.stderr)
            with open(os.path.join(d, "results.jsonl")) as f:
                arms = sorted({row["arm"] for row in map(json.loads, f)})
            self.assertEqual(arms, ["fp32+full", "fp32+h2o@25%", "fp32+h2o@75%"])
            with open(os.path.join(d, "summary.json")) as f:
                s = json.load(f)
            self.assertEqual(len(s["curves"]), 1)
            c = s["curves"][0]
            self.assertEqual((c["method"], c["budgets"], c["budget_values"]), ("fp32+h2o", ["@25%", "@75%"], [0.25, 0.75]))
            by_arm = {a["arm"]: a["accuracy"] for a in s["arms"]}
            self.assertEqual(c["accuracy"], [by_arm["fp32+h2o@25%"], by_arm["fp32+h2o@75%"]])
            self.assertEqual(sorted(c["depth_accuracy"]), ["35", "5", "65", "95"])
            self.assertTrue(any(rec["rule"] == "Smallest budget of fp32+h2o within one task of the control"
                                for rec in s["recommendations"]))
            with open(os.path.join(d, "summary.md")) as f:
                self.assertIn("## Accuracy vs budget (ratio sweep)", f.read())
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("0 items run, 60 already done", r.stderr)
            p = subprocess.run(["/usr/bin/python3", os.path.join(REPO, "tools", "plot_results.py"),
                                os.path.join(d, "summary.json")], capture_output=True, text=True, timeout=300)
            self.assertEqual(p.returncode, 0, p.stderr)
            # the small suite's three prompt lengths also give the by-length plots
            self.assertEqual([os.path.basename(x) for x in p.stdout.split()][3:],
                             ["budget_accuracy.png", "budget_family.png", "budget_depth.png", "length_accuracy.png",
                              "length_pareto.png", "length_depth.png"])

    @release_only("a full-size KVQuant calibration (184 s under ASan on Zen 3); calibration runs instrumented in "
                  "test_kvquant_calibrate_then_generate")
    def test_kvquant_cal_auto_calibrates_once_per_run_directory(self):
        """`cal=auto` (the deepdive set's KVQuant arms): kv_study run fits the model's calibration
        into OUT/calibration/, names it in the arm's rows, and a rerun reuses it and runs nothing;
        a bad arm beside it leaves no directory behind; outside kv_study run it is refused."""
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "run")
            cmd = small_suite_run(out, "kvquant:b3:cal=auto+full")
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
            self.assertEqual(r.returncode, 0, r.stderr)
            cal = os.path.join(out, "calibration", "kvstudy-default.kvqcal")
            self.assertIn("calibrating", r.stderr)
            with open(cal, "rb") as f:
                self.assertEqual(f.read(8), b"KVQCALIB")
            with open(os.path.join(out, "results.jsonl")) as f:
                arms = {json.loads(line)["arm"] for line in f}
            self.assertEqual(arms, {f"kvquant:b3:cal={cal}+full"})
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertNotIn("calibrating", r.stderr)
            self.assertIn("0 items run", r.stderr)
            bad = os.path.join(d, "bad")
            r = subprocess.run([os.path.abspath(KV_STUDY), "run", "--suite", "small", "--configs",
                                "kvquant:b3:cal=auto+full,int5+full", "--out", bad, "--quiet"],
                               capture_output=True, text=True, timeout=120, cwd=REPO)
            self.assertEqual(r.returncode, 1)
            self.assertFalse(os.path.exists(bad))
            r = subprocess.run([os.path.abspath(KV_STUDY), "generate", "--threads", "1", "--prompt", "hi",
                                "--arm", "kvquant:b3:cal=auto"], capture_output=True, text=True, timeout=120, cwd=REPO)
            self.assertEqual(r.returncode, 1)
            self.assertIn("cal=auto is resolved by 'kv_study run'", r.stderr)

    def test_kvquant_calibrate_then_generate(self):
        """`kv_study calibrate` writes a calibration the kvquant arms read (keys pre-RoPE, set by
        the study from the scheme); a missing calibration is an error naming the file, and the
        scheme is listed."""
        with tempfile.TemporaryDirectory() as d:
            cal = os.path.join(d, "default.kvqcal")
            r = subprocess.run([os.path.abspath(KV_STUDY), "calibrate", "--tokens", "512", "--threads", "1",
                                "--out", cal], capture_output=True, text=True, timeout=300, cwd=REPO)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("4 layers x 2 KV heads x head_dim 32; wrote " + cal, r.stderr)
            with open(cal, "rb") as f:
                self.assertEqual(f.read(8), b"KVQCALIB")
            for arm in (f"kvquant:b3:o1:cal={cal}+full", f"kvquant:b2:o1:f2:qnorm:cal={cal}"):
                r = subprocess.run([os.path.abspath(KV_STUDY), "generate", "--threads", "1", "--max-new-tokens", "2",
                                    "--prompt", "hi", "--arm", arm], capture_output=True, text=True, timeout=120,
                                   cwd=REPO)
                self.assertEqual(r.returncode, 0, r.stderr)
            missing = os.path.join(d, "none.kvqcal")
            r = subprocess.run([os.path.abspath(KV_STUDY), "generate", "--threads", "1", "--prompt", "hi",
                                "--arm", f"kvquant:b3:cal={missing}"], capture_output=True, text=True, timeout=120,
                               cwd=REPO)
            self.assertEqual(r.returncode, 1)
            self.assertIn(f"cannot open KVQuant calibration '{missing}'", r.stderr)
            r = subprocess.run([os.path.abspath(KV_STUDY), "calibrate", "--seed", "1234", "--out", cal],
                               capture_output=True, text=True, timeout=120, cwd=REPO)
            self.assertEqual(r.returncode, 1)
            self.assertIn("is the evaluation seed", r.stderr)
        r = run("list")
        self.assertIn("kvquant", r.stdout)
        self.assertIn("cal=<text>", r.stdout)

    def test_query_modes_run_apart_resume_and_report_two_lists(self):
        """`--query-mode both` runs every task row in both modes; the agnostic rows carry the mode
        (the aware ones do not), the summary keeps the two lists apart, and a rerun runs nothing.
        With the full cache both modes compute the same replies (nothing is compressed)."""
        with tempfile.TemporaryDirectory() as d:
            cmd = small_suite_run(d, "fp32+full,fp32+snapkv@50%", "--query-mode", "both")
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(os.path.join(d, "results.jsonl")) as f:
                rows = [json.loads(line) for line in f]
            self.assertEqual(len(rows), 80)
            agnostic = [x for x in rows if x.get("query_mode") == "agnostic"]
            self.assertEqual(len(agnostic), 40)
            self.assertTrue(all("query_mode" not in x for x in rows if x not in agnostic))
            # Tasks with a question feed it after the context; the summary family has none.
            for x in agnostic:
                self.assertEqual(x["values"]["question_tokens"] > 0, x["family"] != "summary", x["task"])
            full = {(x["task"], x.get("query_mode", "aware")): x["output"] for x in rows if x["arm"] == "fp32+full"}
            for (task, mode), out in full.items():
                if mode == "agnostic":
                    self.assertEqual(out, full[(task, "aware")], task)
            with open(os.path.join(d, "summary.json")) as f:
                s = json.load(f)
            self.assertEqual([a["arm"] for a in s["arms"]], ["fp32+full", "fp32+snapkv@50%"])
            self.assertEqual([a["query_mode"] for a in s["agnostic"]["arms"]], ["agnostic", "agnostic"])
            self.assertEqual(s["agnostic"]["arms"][0]["passed"], s["arms"][0]["passed"])
            with open(os.path.join(d, "summary.md")) as f:
                md = f.read()
            self.assertIn("## Query-agnostic mode", md)
            self.assertIn("## Query-aware vs query-agnostic accuracy", md)
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("0 items run, 80 already done", r.stderr)

    @release_only("222 tasks against the Python loop, a parity check (225 s under ASan on Zen 3); the control's path "
                  "runs instrumented in test_control_on_the_small_suite_is_the_default_model")
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

    def test_prefix_workloads_write_their_table(self):
        """`kv_study prefix`: every arm with sharing off and on, the table printed and written
        (prefix.md, prefix.json with one object per run); sharing computes fewer prefill tokens
        and reuses prompt tokens, and gives fp32's replies unchanged (same_as_baseline: every
        scored one); a scheme this model cannot run is refused before any run."""
        with tempfile.TemporaryDirectory() as d:
            r = subprocess.run([os.path.abspath(KV_STUDY), "prefix", "--workloads", "1", "--requests", "3",
                                "--configs", "fp32+full", "--out", d], capture_output=True, text=True, timeout=300,
                               cwd=REPO)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("| system_prompt | fp32+full | on |", r.stdout)
            self.assertIn("What each lever saves", r.stdout)
            self.assertIn("| fewshot | fp32+full | on |", r.stdout)
            self.assertIn("| accuracy | same reply as baseline |", r.stdout)
            with open(os.path.join(d, "prefix.md")) as f:
                self.assertEqual(f.read(), r.stdout)
            with open(os.path.join(d, "prefix.json")) as f:
                runs = json.load(f)
        self.assertEqual([(x["family"], x["sharing"]) for x in runs],
                         [("system_prompt", False), ("system_prompt", True), ("multiturn", False), ("multiturn", True),
                          ("fewshot", False), ("fewshot", True)])
        for off, on in ((runs[0], runs[1]), (runs[2], runs[3]), (runs[4], runs[5])):
            self.assertEqual(off["prompt_tokens_hit"], 0)
            self.assertGreater(on["prompt_tokens_hit"], 0)
            self.assertEqual(on["computed_tokens"], on["prompt_tokens"] - on["prompt_tokens_hit"])
            self.assertEqual(off["computed_tokens"], off["prompt_tokens"])
            self.assertEqual(on["outputs"], off["outputs"])
            self.assertEqual((off["same_as_baseline"], on["same_as_baseline"]), (off["scored"], on["scored"]))
            self.assertEqual((off["compared_with_baseline"], on["compared_with_baseline"]), (off["scored"], on["scored"]))
        # The default block size follows each arm's token groups; a given one must fit them.
        r = subprocess.run([os.path.abspath(KV_STUDY), "prefix", "--block-tokens", "16",
                            "--configs", "kivi:k2:v2:g32:r128"],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("block tokens (--block-tokens) = 16 is not a multiple of arm 'kivi:k2:v2:g32:r128+full''s "
                      "quantizer group of 32 tokens: pass a multiple of 32, or 0 to choose per arm", r.stderr)


    def test_prefix_pool_full_path_is_counted(self):
        """`kv_study prefix --pool-mib 4`: 8 fp32 requests behind one system prompt need about 8.5
        MiB without sharing, so some end early (refused, or preempted for an older request),
        counted in the table and the JSON and scored as failed, while the others pass; with
        sharing all fit. A --when-full outside preempt|refuse is refused, naming it."""
        with tempfile.TemporaryDirectory() as d:
            r = subprocess.run([os.path.abspath(KV_STUDY), "prefix", "--workloads", "1", "--requests", "8",
                                "--block-tokens", "32", "--configs", "fp32+full", "--pool-mib", "4", "--out", d],
                               capture_output=True, text=True, timeout=300, cwd=REPO)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("| sharing ratio | preempted | refused |", r.stdout)
            with open(os.path.join(d, "prefix.json")) as f:
                runs = json.load(f)
        off, on = runs[0], runs[1]
        self.assertEqual((off["sharing"], on["sharing"]), (False, True))
        self.assertGreater(off["preempted"] + off["refused"], 0)
        self.assertEqual(off["refused"], off["pool_refusals"])
        self.assertLessEqual(off["preempted"], off["pool_preemptions"])
        self.assertLessEqual(off["peak_pool_bytes"], 4 << 20)
        self.assertEqual(off["passed"], off["scored"] - off["preempted"] - off["refused"])
        # The baseline itself: its requests that ended early are compared with nothing.
        self.assertEqual(off["compared_with_baseline"], off["scored"] - off["preempted"] - off["refused"])
        self.assertEqual(off["same_as_baseline"], off["compared_with_baseline"])
        self.assertEqual((on["preempted"], on["refused"], on["pool_preemptions"], on["pool_refusals"]), (0, 0, 0, 0))
        self.assertEqual(on["passed"], on["scored"])
        r = subprocess.run([os.path.abspath(KV_STUDY), "prefix", "--when-full", "drop"],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("drop", r.stderr)

    def test_prefix_disk_tier_restores_from_disk(self):
        """`kv_study prefix --disk-tier DIR --disk-mib M`: each sharing run is followed by a
        second pass after every cached page was reclaimed to the disk tier; the pass restores its
        prefixes from disk (hits by tier in the JSON and the disk table), replies exactly as the
        first pass, and the tier's files are gone afterwards. Each flag needs the other; a
        --disk-mib out of range is refused."""
        with tempfile.TemporaryDirectory() as d:
            tier = os.path.join(d, "tier")
            r = subprocess.run([os.path.abspath(KV_STUDY), "prefix", "--workloads", "1", "--requests", "2",
                                "--configs", "int4+full", "--disk-tier", tier, "--disk-mib", "64", "--out", d],
                               capture_output=True, text=True, timeout=300, cwd=REPO)
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("### Disk tier: a second pass restored from disk", r.stdout)
            self.assertIn("| restore ms/token | recompute ms/token | × faster | replies equal |", r.stdout)
            with open(os.path.join(d, "prefix.json")) as f:
                runs = json.load(f)
            self.assertEqual(os.listdir(tier), [])
        for run in runs:
            if not run["sharing"]:
                self.assertIsNone(run["disk_pass"])
                continue
            p = run["disk_pass"]
            self.assertGreater(p["pages_spilled"], 0, run["workload"])
            self.assertGreater(p["prompt_tokens_hit_disk"], 0, run["workload"])
            self.assertGreater(p["disk_pages_read"], 0)
            self.assertGreater(p["disk_bytes_read"], 0)
            self.assertEqual(p["disk_failures"], 0)
            self.assertEqual(p["same_outputs"], run["requests"], run["workload"])
            self.assertEqual(p["computed_tokens"],
                             run["prompt_tokens"] - p["prompt_tokens_hit_memory"] - p["prompt_tokens_hit_disk"])
            self.assertGreater(p["restore_seconds_per_token"], 0)
            self.assertGreater(p["recompute_seconds_per_token"], 0)
        for args, message in ((["--disk-mib", "8"], "--disk-mib requires --disk-tier"),
                              (["--disk-tier", "/tmp/x"], "--disk-tier requires --disk-mib"),
                              (["--disk-tier", "/tmp/x", "--disk-mib", "0"], "--disk-mib")):
            r = subprocess.run([os.path.abspath(KV_STUDY), "prefix"] + args, capture_output=True, text=True,
                               timeout=120, cwd=REPO)
            self.assertNotEqual(r.returncode, 0, args)
            self.assertIn(message, r.stderr, args)



if __name__ == "__main__":
    unittest.main()
