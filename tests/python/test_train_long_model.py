# SPDX-License-Identifier: Apache-2.0
"""tools/train_long_model.py: positional skips (hand-checked), the encoding of a task's evidence into
supervision targets, the dilution-weighted supervision loss against a hand computation, the copy
initialisation, the training attention against a plain causal softmax, and a --smoke run on the
C++ generator whose export's logits equal the training module's at skipped positions."""
import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvtest_util as U  # noqa: E402

import train_default_model as tdm  # noqa: E402
import train_long_model as L  # noqa: E402

BUILD = os.environ.get("KVCACHE_BUILD_DIR", "build")
KV_STUDY = os.path.join(U.REPO, BUILD, "apps", "kv_study", "kv_study") if not os.path.isabs(BUILD) else \
    os.path.join(BUILD, "apps", "kv_study", "kv_study")


def tiny_cfg(**kw):
    c = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "intermediate_size": 48, "vocab_size": 64, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": False}
    c.update(kw)
    return c


class PositionsAndLosses(unittest.TestCase):
    def test_virtual_positions_put_the_gap_at_the_cuts(self):
        rng = np.random.default_rng(0)
        n, cuts = 10, np.array([3, 7])
        p = L.virtual_positions(n, cuts, 100, rng)
        self.assertEqual(p[-1], 99)                        # the last token sits at virtual_len - 1
        self.assertTrue(np.all(np.diff(p) >= 1))           # strictly increasing
        jumps = [i for i in range(1, n) if p[i] - p[i - 1] > 1]
        self.assertTrue(set(jumps) <= {3, 7})              # gaps only where a sentence starts
        self.assertEqual(list(p[:3]), [0, 1, 2])           # before the first cut: contiguous from 0
        self.assertEqual(list(L.virtual_positions(n, cuts, n, rng)), list(range(n)))  # no extra room: no gap
        self.assertEqual(list(L.virtual_positions(n, np.array([], dtype=np.int64), 50, rng)), list(range(n)))

    def test_supervised_loss_equals_the_hand_computation(self):
        torch.manual_seed(0)
        layer = L.Layer(tiny_cfg())
        q = torch.randn(1, 4, 6, 8)
        k = torch.randn(1, 2, 6, 8)
        # query head 2 (KV head 1) at position 4, targets {1, 3}, dilution F = 10
        layer.sup = (torch.tensor([0]), torch.tensor([4]), torch.tensor([2]), torch.tensor([[1, 3]]),
                     torch.tensor([[True, True]]), torch.tensor([math.log(10.0)]))
        got = float(layer.supervised_loss(q, k)[0])
        s = [float(q[0, 2, 4] @ k[0, 1, j]) for j in range(5)]          # keys 0..4 (causal)
        z = math.exp(s[1]) + math.exp(s[3]) + 10.0 * (math.exp(s[0]) + math.exp(s[2]) + math.exp(s[4]))
        want = -0.5 * (s[1] + s[3]) + math.log(z)
        self.assertAlmostEqual(got, want, places=5)

    def test_training_attention_equals_a_plain_causal_softmax(self):
        torch.manual_seed(1)
        cfg = tiny_cfg()
        m = L.LongQwen2(cfg)
        m.init_weights(torch.Generator().manual_seed(2), 0.3, [(1, 0)])
        ids = torch.randint(0, 64, (2, 37))
        pos = torch.tensor([list(range(37)), [p * 3 + 5 for p in range(37)]])
        a = m(ids, pos, chunk=8)     # five query chunks
        b = m(ids, pos, chunk=64)    # one
        self.assertLess(float((a - b).abs().max()), 1e-5)

    def test_copy_init_writes_the_attended_tokens_embedding(self):
        cfg = tiny_cfg(hidden_size=64, head_dim=16)
        m = L.LongQwen2(cfg)
        # heads 0 and 1 share KV head 0: both must copy through the one value projection
        m.init_weights(torch.Generator().manual_seed(3), 0.3, [(0, 0), (0, 1), (0, 2)])
        layer = m.layers[0]
        x = torch.randn(64)
        for h, kv in ((0, 0), (1, 0), (2, 1)):
            # v_proj rows of the KV head then o_proj columns of the query head: a projection (P^2 = P)
            P = layer.o_proj.weight[:, h * 16:(h + 1) * 16] @ layer.v_proj.weight[kv * 16:(kv + 1) * 16]
            self.assertLess(float((P @ P - P).abs().max()), 1e-5, f"head {h}")
            self.assertAlmostEqual(float(torch.trace(P)), 16.0, places=4)
            self.assertGreater(float(x @ P @ x), 0.0)
        # lm_head starts aligned with the input embedding
        cos = torch.nn.functional.cosine_similarity(m.lm_head.weight, m.embed_tokens.weight, dim=1)
        self.assertGreater(float(cos.min()), 0.9999)


@unittest.skipUnless(os.path.exists(KV_STUDY), f"{KV_STUDY} not built")
class EncodingAndSmoke(unittest.TestCase):
    def test_evidence_becomes_supervision_of_the_right_tokens(self):
        r = subprocess.run([KV_STUDY, "suite", "--suite", "long", "--count", "60", "--seed", "3", "--min-context", "48",
                            "--max-context", "160", "--out", "-"], capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        tasks = [json.loads(x) for x in r.stdout.splitlines()]
        corpus = [tdm.render_chatml(t["messages"], True) + t["answer"] + tdm.IM_END for t in tasks]
        tok = tdm.train_bpe(corpus, 700)
        seen = set()
        for t in tasks:
            s = L.encode_task(tok, t, 0.1)
            self.assertEqual(tok.decode(list(s.ids)), tdm.render_chatml(t["messages"], True) + t["answer"] + tdm.IM_END)
            for q, targets, slot in s.sup:
                predicted = tok.decode([int(s.ids[q + 1])]).strip()
                sources = [tok.decode([int(s.ids[j])]).strip() for j in targets]
                self.assertLess(max(targets), q + 1)  # causal: every source is before the query
                if t["family"] == "aggregation":
                    self.assertEqual(slot, 3)
                    # the answer is one of the colours attended (a reply's first word has no space before
                    # it and may split into more tokens than " amber" does in the prompt)
                    self.assertTrue(any(x.startswith(predicted) for x in sources), (predicted, sources))
                elif t["rule"]["kind"] == "uppercase":
                    self.assertEqual(sources, ["uppercase"])
                elif t["family"] in ("instruction", "multiturn"):
                    self.assertTrue(sources[0].lower().startswith(predicted.lower()), (predicted, sources))
                else:
                    self.assertEqual(predicted, sources[0], t["id"])  # a copy: the same token
                    self.assertIn(slot, (0, 1))
                seen.add((t["family"], slot))
            # the reply's LM weight is 1, a prompt digit's 0
            self.assertEqual(s.w[-2], 1.0)
        self.assertIn(("needle", 0), seen)
        self.assertIn(("needle", 1), seen)
        self.assertIn(("aggregation", 3), seen)
        self.assertIn(("instruction", 2), seen)

    def test_smoke_training_exports_a_model_equal_to_the_training_module(self):
        with tempfile.TemporaryDirectory() as d:
            rc, out, err = U.run_tool("train_long_model.py", "--smoke", "--generator", KV_STUDY, "--out", d,
                                      "--export", os.path.join(d, "m.pt"))
            self.assertEqual(rc, 0, err[-3000:])
            self.assertIn("training done: 7 steps", err)
            module, _, cfg, _ = U.load_export(os.path.join(d, "m.pt"))
            self.assertFalse(cfg["tie_word_embeddings"])
            self.assertEqual(cfg["rope_theta"], 1e6)
            ck = torch.load(os.path.join(d, "ckpt.pt"))
            with open(os.path.join(d, "tokenizer.json")) as f:
                tok = tdm.Tokenizer.from_json(json.load(f))
            a = type("A", (), ck["args"])
            cfgt = L.model_config(a, cfg["vocab_size"], tok)
            m = L.LongQwen2(cfgt)
            m.load_state_dict(ck["model"])
            m.eval()
            ids = torch.randint(0, len(tok), (1, 50))
            pos = torch.arange(50)[None]
            with torch.no_grad():
                want = m(ids, pos)
                got = module.forward(ids)
            self.assertLess(float((want - got).abs().max()), 1e-4)

    def test_stop_after_then_resume_trains_the_same_weights(self):
        """--stop-after N writes the checkpoint at step N and exports nothing; --resume continues
        to the weights of a run without the stop (how the committed model's two-part run is
        reproduced: models/README.md)."""
        with tempfile.TemporaryDirectory() as d:
            a, b = os.path.join(d, "a"), os.path.join(d, "b")
            rc, _, err = U.run_tool("train_long_model.py", "--smoke", "--generator", KV_STUDY, "--out", a,
                                    "--export", os.path.join(a, "m.pt"), "--final-lengths", "", "--threads", "1")
            self.assertEqual(rc, 0, err[-3000:])
            rc, _, err = U.run_tool("train_long_model.py", "--smoke", "--generator", KV_STUDY, "--out", b,
                                    "--export", os.path.join(b, "m.pt"), "--stop-after", "3", "--threads", "1")
            self.assertEqual(rc, 0, err[-3000:])
            self.assertIn("stopped after step 3 of 7", err)
            self.assertFalse(os.path.exists(os.path.join(b, "m.pt")))
            self.assertEqual(torch.load(os.path.join(b, "ckpt.pt"))["step"], 3)
            rc, _, err = U.run_tool("train_long_model.py", "--smoke", "--generator", KV_STUDY, "--out", b,
                                    "--export", os.path.join(b, "m.pt"), "--final-lengths", "", "--resume",
                                    "--threads", "1")
            self.assertEqual(rc, 0, err[-3000:])
            self.assertIn("resumed from", err)
            self.assertIn("training done: 7 steps", err)
            wa, wb = torch.load(os.path.join(a, "ckpt.pt"))["model"], torch.load(os.path.join(b, "ckpt.pt"))["model"]
            self.assertEqual(sorted(wa), sorted(wb))
            # One thread: every run reduces in the same order, so only a real difference shows. On 2
            # threads they differed by up to 1.03e-5 on Zen 3 (CI's sanitizer tree, 2026-12-07):
            # a key bias's gradient is rounding noise (softmax ignores a shift every key shares),
            # and Adam scales noise to a step of its own. A resume that lost a step or the
            # optimizer's state differs by the size of an update (lr ~2e-3).
            for k in wa:
                self.assertLess(float((wa[k] - wb[k]).abs().max()), 1e-5, k)

    def test_bad_arguments_are_refused(self):
        rc, _, err = U.run_tool("train_long_model.py", "--generator", KV_STUDY, "--phases", "10:128:64:0")
        self.assertEqual(rc, 2)
        self.assertIn("need steps > 0 and 48 <= min_ctx <= max_ctx", err)
        rc, _, err = U.run_tool("train_long_model.py", "--generator", KV_STUDY, "--phases", "10:128:512:256")
        self.assertEqual(rc, 2)
        self.assertIn("virtual_len 256 is below max_ctx 512", err)
        rc, _, err = U.run_tool("train_long_model.py", "--generator", KV_STUDY, "--sup-heads", "0,1,2")
        self.assertEqual(rc, 2)
        self.assertIn("expected four head indices", err)
        rc, _, err = U.run_tool("train_long_model.py", "--generator", KV_STUDY, "--stop-after", "-1")
        self.assertEqual(rc, 2)
        self.assertIn("--stop-after -1: expected a number of steps >= 0", err)


if __name__ == "__main__":
    unittest.main()
