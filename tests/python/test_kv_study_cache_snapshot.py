# SPDX-License-Identifier: Apache-2.0
"""`kv_study generate --save-cache F` / `--load-cache F` end to end on the default model
(docs/snapshot-format.md): a restored prompt cache generates exactly what the saving run did,
and every bad input is refused with a message naming the value and what was expected."""
import os
import subprocess
import tempfile
import unittest

BUILD = os.environ.get("KVCACHE_BUILD_DIR", "build")
KV_STUDY = os.path.abspath(os.path.join(BUILD, "apps", "kv_study", "kv_study"))
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_MODEL = os.path.join(REPO, "models", "kvstudy-default.pt")
LONG_MODEL = os.path.join(REPO, "models", "kvstudy-long.pt")
PROMPT = "Remember this. The key is 4417. The door is red. The cat sleeps on the mat. What is the key?"


def generate(*args, max_new="8"):
    return subprocess.run([KV_STUDY, "generate", "--threads", "1", "--max-new-tokens", max_new, *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO)


@unittest.skipUnless(os.path.exists(KV_STUDY), f"{KV_STUDY} not built")
class CacheSnapshotCliTest(unittest.TestCase):
    def test_help_names_both_options(self):
        r = subprocess.run([KV_STUDY, "generate", "--help"], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0)
        self.assertRegex(r.stdout, r"--save-cache FILE\s+write the cache to FILE as a snapshot")
        self.assertRegex(r.stdout, r"--load-cache FILE\s+restore the snapshot FILE")

    def test_options_are_checked_before_the_model_runs(self):
        with tempfile.TemporaryDirectory() as d:
            f = os.path.join(d, "c.kvsnap")
            for args, needle in [
                (("--save-cache", f, "--load-cache", f), "give one of them"),
                (("--save-cache", os.path.join(d, "no", "c.kvsnap")),
                 f"--save-cache '{d}/no/c.kvsnap': directory '{d}/no' does not exist"),
                (("--save-cache", d), f"--save-cache '{d}' is a directory; expected a file path"),
                (("--load-cache", f), f"--load-cache '{f}': no such file; expected a snapshot written by --save-cache"),
                (("--load-cache", d), f"--load-cache '{d}': is a directory"),
            ]:
                r = generate("--model", "/nonexistent.pt", "--prompt", "hi", *args)
                self.assertEqual(r.returncode, 1, (args, r.stderr))
                self.assertIn(needle, r.stderr, args)
                self.assertEqual(r.stderr.count("\n"), 1, r.stderr)  # one line
            self.assertEqual(os.listdir(d), [])

    @unittest.skipUnless(os.path.exists(DEFAULT_MODEL), "models/kvstudy-default.pt is absent")
    def test_restored_cache_generates_what_the_saving_run_did(self):
        with tempfile.TemporaryDirectory() as d:
            f = os.path.join(d, "prompt.kvsnap")
            for arm in ("fp32+full", "int4+h2o@60%", "kivi:k2:v2:g16:r16+snapkv@60%"):
                saved = generate("--arm", arm, "--prompt", PROMPT, "--save-cache", f)
                self.assertEqual(saved.returncode, 0, saved.stderr)
                self.assertIn(f"saved to {f}", saved.stderr)
                with open(f, "rb") as fh:
                    self.assertEqual(fh.read(8), b"\x89KVSNAP\n")
                self.assertEqual(sorted(os.listdir(d)), ["prompt.kvsnap"])  # no temporary left
                loaded = generate("--arm", arm, "--prompt", PROMPT, "--load-cache", f)
                self.assertEqual(loaded.returncode, 0, loaded.stderr)
                self.assertEqual(loaded.stdout, saved.stdout, arm)
                self.assertRegex(loaded.stderr, rf"restored (\d+) prompt tokens from {f} in [0-9.e-]+ s, prefilled 1\b")
                # What the file refuses, each named.
                for args, needle in [
                    (("--arm", "int8+full", "--prompt", PROMPT), "(other-config)"),
                    (("--arm", arm, "--prompt", "A different prompt altogether."),
                     "does not start with (first difference at token"),
                ]:
                    r = generate(*args, "--load-cache", f)
                    self.assertEqual(r.returncode, 1, (arm, args, r.stderr))
                    self.assertIn(needle, r.stderr, (arm, args))
                r = generate("--arm", arm, "--prompt", PROMPT, "--load-cache", f, max_new="64")
                self.assertEqual(r.returncode, 1)
                self.assertIn("save it with at least as many --max-new-tokens", r.stderr)
            # Corrupt, truncated, foreign files.
            with open(f, "rb") as fh:
                good = fh.read()
            bad = os.path.join(d, "bad.kvsnap")
            for data, needle in [(good[:100] + bytes([good[100] ^ 1]) + good[101:], "(checksum)"),
                                 (good[: len(good) // 2], "(truncated)"),
                                 (b"just some text\n", "(not-a-snapshot)")]:
                with open(bad, "wb") as fh:
                    fh.write(data)
                r = generate("--arm", "kivi:k2:v2:g16:r16+snapkv@60%", "--prompt", PROMPT, "--load-cache", bad)
                self.assertEqual(r.returncode, 1, needle)
                self.assertIn(f"snapshot '{bad}': ", r.stderr)
                self.assertIn(needle, r.stderr)
            if os.path.exists(LONG_MODEL):
                r = generate("--model", LONG_MODEL, "--arm", "kivi:k2:v2:g16:r16+snapkv@60%", "--prompt", PROMPT,
                             "--load-cache", f)
                self.assertEqual(r.returncode, 1)
                self.assertIn("(other-model)", r.stderr)


if __name__ == "__main__":
    unittest.main()
