"""tools/train_default_model.py: the byte-level BPE and ChatML rendering (hand-made text), the
Python scoring rules, and a --smoke training run on the C++ task generator (kv_study) that must
write a loadable ABI v1 export whose forward equals the training module's logits, with a
tokenizer that round-trips the suite text and splits it exactly like the Qwen2 regex."""
import json
import os
import re
import shutil
import sys
import tempfile
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvtest_util as U  # noqa: E402

import train_default_model as T  # noqa: E402
from kvcache_tools.safetensors_io import SafetensorsFile  # noqa: E402

CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Read the text.\n\nThe access code is 40712. The cat likes tea.\n\n"
                                    "Question: What is the access code?"}]


class Tokenizer(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        text = T.render_chatml(CHAT, True) + "40712" + T.IM_END + "\n"
        cls.tok = T.train_bpe([text] * 3 + ["It is a cold day in the park. The old dog sits by the river."] * 2, 400)

    def test_vocab_layout(self):
        tok = self.tok
        self.assertEqual(tok.vocab[T.BYTE_ENC[ord("a")]], ord("a"))  # bytes first, by value
        n = len(tok)
        self.assertLessEqual(n, 400)
        self.assertEqual([tok.vocab[s] for s in T.SPECIALS], [n - 3, n - 2, n - 1])
        self.assertEqual(len(tok.merges), n - 256 - 3)

    def test_specials_and_digits(self):
        tok = self.tok
        ids = tok.encode("<|im_start|>user\nThe code is 40712.<|im_end|>")
        self.assertEqual(ids[0], tok.special_ids[T.IM_START])
        self.assertEqual(ids[-1], tok.special_ids[T.IM_END])
        digits = [tok.decode([i]) for i in ids if tok.decode([i]).isdigit()]
        self.assertEqual(digits, ["4", "0", "7", "1", "2"])  # one token per digit
        self.assertIn(tok.vocab["Ġcode"], ids)  # a frequent word is one token, with its space

    def test_round_trip(self):
        for s in [T.render_chatml(CHAT, True), "Unseen words: zebra xylophone 123!?\n\n  x", "a  b\t\nc"]:
            self.assertEqual(self.tok.decode(self.tok.encode(s)), s)

    def test_pretokenize_matches_qwen2_rules(self):
        self.assertEqual(T.pretokenize("Hello, it's 42 o'clock!\n\n  Bye  now"),
                         ["Hello", ",", " it", "'s", " ", "4", "2", " o", "'clock", "!\n\n", " ", " Bye", " ", " now"])
        n = T.check_split_regex([T.render_chatml(CHAT, True), "It's  12 ab\n\n cd!? e", "x\r\n\ty  "])
        if n == 0:
            self.skipTest("perl not installed: the Qwen2 regex check needs it")
        self.assertGreater(n, 40)

    def test_tokenizer_json_round_trip(self):
        doc = T.tokenizer_json(self.tok)
        self.assertEqual(doc["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"], T.QWEN2_SPLIT_REGEX)
        self.assertEqual(doc["normalizer"], {"type": "NFC"})
        again = T.Tokenizer.from_json(json.loads(json.dumps(doc)))
        s = T.render_chatml(CHAT, True)
        self.assertEqual(again.encode(s), self.tok.encode(s))

    def test_chatml_default_system_prompt(self):
        self.assertEqual(T.render_chatml([{"role": "user", "content": "Hi"}], True),
                         "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                         "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")

    def test_loss_weights(self):
        task = {"messages": CHAT, "answer": "40712"}
        ids, w = T.encode_task(self.tok, task, 0.25)
        self.assertEqual(len(ids), len(w))
        # the reply (5 digits) and <|im_end|> are the last 6 targets, weight 1; the last position predicts nothing
        self.assertEqual(w[-1], 0.0)
        self.assertEqual(list(w[-7:-1]), [1.0] * 6)
        self.assertEqual(float(w[-8]), 0.25)
        self.assertEqual(self.tok.decode(ids[-6:].tolist()), "40712<|im_end|>")


    def test_key_token_warmup_weights(self):
        task = {"messages": CHAT, "answer": "40712", "rule": {"kind": "word", "arg": "40712"}}
        ids, w = T.encode_task(self.tok, task, 0.25)
        self.assertEqual(T.key_token_index(self.tok, task), 0)  # a needle's key is its first digit
        f = T.key_token_weights(w, 6, 0)
        self.assertEqual(float(f.sum()), 1.0)
        # the position that predicts the reply's first digit "4" (the "\n" after "assistant")
        at = int(f.argmax())
        self.assertEqual(at, len(ids) - 7)
        self.assertEqual(self.tok.decode([int(ids[at + 1])]), "4")
        # key 3: the position that predicts "1"; no key: no loss at all
        self.assertEqual(self.tok.decode([int(ids[int(T.key_token_weights(w, 6, 3).argmax()) + 1])]), "1")
        self.assertEqual(float(T.key_token_weights(w, 6, None).sum()), 0.0)
        # the key term's span: the five digits, not the <|im_end|>
        self.assertEqual(T.key_token_span(self.tok, task), (0, 5))
        f = T.key_token_weights(w, 6, 0, 5)
        self.assertEqual("".join(self.tok.decode([int(ids[i + 1])]) for i in range(len(f)) if f[i]), "40712")
        with self.assertRaises(T.ToolError):
            T.key_token_weights(w, 6, 2, 2)  # an empty span
        with self.assertRaises(T.ToolError):
            T.key_token_weights(w, len(w), 0)
        with self.assertRaises(T.ToolError):
            T.key_token_weights(w, 6, 6)

    def test_batch_loss_adds_the_key_token_term(self):
        nll = torch.tensor([[1.0, 2.0, 4.0], [3.0, 5.0, 0.5]])
        w = torch.tensor([[0.5, 1.0, 1.0], [1.0, 1.0, 0.0]])
        kw = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # one key token (nll 2), row 1: none
        main = (1 * 0.5 + 2 + 4 + 3 + 5) / 4.5
        self.assertAlmostEqual(float(T.batch_loss(nll, w, kw, 1.0, 0.0)), main, places=5)
        self.assertAlmostEqual(float(T.batch_loss(nll, w, kw, 1.0, 2.0)), main + 2 * 2.0, places=5)
        self.assertAlmostEqual(float(T.batch_loss(nll, w, kw, 0.0, 1.0)), 2.0, places=6)  # warm-up step
        kw[1, 0] = 1.0  # two key tokens: their mean
        self.assertAlmostEqual(float(T.batch_loss(nll, w, kw, 0.0, 1.0)), 2.5, places=6)
        self.assertEqual(float(T.batch_loss(nll, w, torch.zeros_like(kw), 0.0, 1.0)), 0.0)

    def test_key_token_index_finds_the_rule_word(self):
        def key(answer, kind, arg=""):
            task = {"answer": answer, "rule": {"kind": kind, "arg": arg}}
            i = T.key_token_index(self.tok, task)
            return None if i is None else self.tok.decode([self.tok.encode(answer)[i]])
        self.assertEqual(key("The code, dog.", "ends_with", "dog"), " dog")
        self.assertEqual(key("Code the code.", "starts_with", "code"), "C")  # case-insensitive, first token
        self.assertEqual(key("codes 12 code", "word", "code"), " code")  # whole words only
        self.assertEqual(key("a 40712 b", "word", "0712"), None)
        self.assertEqual(key("GOODBYE.", "uppercase"), None)

        def span(answer, kind, arg=""):
            r = T.key_token_span(self.tok, {"answer": answer, "rule": {"kind": kind, "arg": arg}})
            return None if r is None else "|".join(self.tok.decode([t]) for t in self.tok.encode(answer)[r[0]:r[1]])
        self.assertEqual(span("The code is 40712.", "word", "40712"), "4|0|7|1|2")
        self.assertEqual(span("Bye, dog.", "ends_with", "dog"), " dog")
        self.assertEqual(span("GOODBYE.", "uppercase"), None)


    def test_attn_targets_point_at_the_argument_in_the_prompt(self):
        """Attention supervision targets: the position before each reply key token (query) and the
        prompt token that spells the same piece of the argument (key); slot 0 for the first."""
        tok = self.tok
        user = CHAT[1]["content"]
        b = user.index("The access code")
        task = {"messages": CHAT, "answer": "40712", "rule": {"kind": "word", "arg": "40712"},
                "span": {"message": 1, "begin": b, "end": b + len("The access code is 40712.")}}
        ids, _ = T.encode_task(tok, task, 0.1)
        ans = tok.encode("40712")
        rows = T.attn_targets(tok, task, ids, ans)
        n_prompt = len(ids) - len(ans) - 1
        self.assertEqual(rows[:, 0].tolist(), list(range(n_prompt - 1, n_prompt + 4)))
        self.assertEqual(rows[:, 2].tolist(), [0, 1, 1, 1, 1])
        self.assertEqual([tok.decode([ids[q + 1]]) for q in rows[:, 0]], list("40712"))  # the reply's digits
        self.assertEqual([tok.decode([ids[k]]) for k in rows[:, 1]], list("40712"))  # the prompt's digits
        self.assertTrue((rows[:, 1] < n_prompt).all() and (rows[:, 1] == rows[0, 1] + range(5)).all())
        # another spelling in the reply ("Tea" against " tea"): the first key token only
        t2 = {"messages": [CHAT[0], {"role": "user", "content": "Always start with the word tea. Hi."}],
              "answer": "Tea, hi.", "rule": {"kind": "starts_with", "arg": "tea"},
              "span": {"message": 1, "begin": 0, "end": 30}}
        ids2, _ = T.encode_task(tok, t2, 0.1)
        r2 = T.attn_targets(tok, t2, ids2, tok.encode("Tea, hi."))
        self.assertEqual(len(r2), 1)
        self.assertEqual(tok.decode([ids2[r2[0, 1]]]).strip(), "tea")
        self.assertEqual(tok.decode([ids2[r2[0, 0]]]), "\n")  # the end of "<|im_start|>assistant\n"
        # no argument, or no span: nothing to supervise
        self.assertEqual(T.attn_targets(tok, dict(t2, rule={"kind": "uppercase", "arg": ""}), ids2,
                                        tok.encode("Tea, hi.")).shape, (0, 3))
        self.assertEqual(T.attn_targets(tok, dict(t2, span=None), ids2, tok.encode("Tea, hi.")).shape, (0, 3))


class Phases(unittest.TestCase):
    def test_parse(self):
        self.assertEqual(T.parse_phases("1200:48:160:needle:150,2000:48:800"),
                         [(1200, 48, 160, "needle", 150), (2000, 48, 800, "", 0)])
        self.assertEqual(T.parse_phases("10:48:100:needle+summary"), [(10, 48, 100, "needle,summary", 0)])
        self.assertEqual(T.parse_phases("10:48:100::10"), [(10, 48, 100, "", 10)])
        # a family named twice is drawn twice as often by the generator (it picks uniformly from the list)
        self.assertEqual(T.parse_phases("10:48:64:needle+needle+summary"), [(10, 48, 64, "needle,needle,summary", 0)])
        phases = T.parse_phases(T.DEFAULT_PHASES)
        self.assertEqual(len(phases), 7)
        self.assertEqual(sum(p[0] for p in phases), 5600)
        self.assertEqual(phases[0], (800, 48, 64, "", 500))  # all four, key-token warm-up (finding 16)
        self.assertEqual(phases[-2][1:4], (400, 800, "needle,needle,multiturn,instruction,summary"))
        self.assertEqual(max(p[2] for p in phases), 800)  # the suite's 768-token contexts are trained
        self.assertEqual(T.generator_cmd("kv", "train", "o.jsonl", 7, 5, 48, 100, "needle")[-2:],
                         ["--families", "needle"])

    def test_bad_phases_name_the_problem(self):
        for bad, want in [("10:48", "steps:min_ctx:max_ctx"), ("x:48:100", "integers"),
                          ("10:48:100:poem", "unknown family 'poem'"), ("10:200:100", "min_ctx <= max_ctx"),
                          ("0:48:100", "steps > 0"), ("10:48:100::11", "key_steps <= steps"),
                          ("10:48:100::x", "integers"), ("10:48:100:needle:1:2", "steps:min_ctx:max_ctx")]:
            with self.assertRaises(T.ToolError) as cm:
                T.parse_phases(bad)
            self.assertIn(want, str(cm.exception))


class TrainingAttention(unittest.TestCase):
    def test_chunked_causal_attention_matches_a_naive_reference(self):
        """The training model's query-chunked attention (Layer.forward) equals plain causal
        softmax attention with repeated KV heads, for a sequence cut into several uneven chunks."""
        c = dict(hidden_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                 rms_norm_eps=1e-6, num_hidden_layers=1, vocab_size=50, rope_theta=10000.0)
        m = T.Qwen2Small(c)
        m.init_weights(torch.Generator().manual_seed(3))
        ids = torch.randint(0, 50, (2, 71), generator=torch.Generator().manual_seed(4))
        saved = T.ATTN_CHUNK
        L = m.layers[0]
        # attention supervision rows: (batch row, query position, key position, query head)
        sup = [torch.tensor(c) for c in ([0, 1, 1, 0], [70, 5, 40, 10], [3, 5, 39, 0], [0, 1, 3, 2])]
        try:
            T.ATTN_CHUNK = 20  # 71 rows -> 4 chunks (17, 18, 18, 18 rows)
            L.sup = tuple(sup)
            with torch.no_grad():
                got = m(ids)
        finally:
            T.ATTN_CHUNK = saved
            L.sup = None
        B, S = ids.shape
        pos = torch.arange(S, dtype=torch.float32)
        ang = pos[:, None] * m.inv_freq[None, :]
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        with torch.no_grad():
            h = m.embed_tokens(ids)
            x = L.input_layernorm(h)
            q = L.q_proj(x).view(B, S, 4, 8).transpose(1, 2)
            k = L.k_proj(x).view(B, S, 2, 8).transpose(1, 2)
            v = L.v_proj(x).view(B, S, 2, 8).transpose(1, 2)
            q, k = q * cos + T.rotate_half(q) * sin, k * cos + T.rotate_half(k) * sin
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
            sc = (q @ k.transpose(-1, -2)) / 8 ** 0.5
            sc = sc.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
            logp = torch.log_softmax(sc, -1)
            want_nll = torch.stack([-logp[b, hd, qp, kp] for b, qp, kp, hd in zip(*sup)])
            o = (torch.softmax(sc, -1) @ v).transpose(1, 2).reshape(B, S, 32)
            h = h + L.o_proj(o)
            x = L.post_attention_layernorm(h)
            h = h + L.down_proj(torch.nn.functional.silu(L.gate_proj(x)) * L.up_proj(x))
            want = torch.nn.functional.linear(m.norm(h), m.embed_tokens.weight)
        self.assertLess(float((got - want).abs().max()), 1e-5)
        # the supervised heads' -log attention, against the reference's probabilities
        self.assertLess(float((L.sup_nll - want_nll).abs().max()), 1e-5)
        self.assertGreater(float(want_nll.min()), 0.0)


class Scoring(unittest.TestCase):
    def test_rules(self):
        S = T.score_output
        self.assertTrue(S({"kind": "word", "arg": "4071"}, " 4071<|im_end|>junk"))
        self.assertFalse(S({"kind": "word", "arg": "4071"}, "40712"))
        self.assertFalse(S({"kind": "word", "arg": ""}, "anything"))  # as contains_word in task.cpp
        self.assertTrue(S({"kind": "word", "arg": "-12"}, "x-12"))  # no boundary where the word is not alnum
        self.assertTrue(S({"kind": "uppercase", "arg": ""}, "GOODBYE, SEE YOU SOON."))
        self.assertFalse(S({"kind": "uppercase", "arg": ""}, "GOODBYE, see"))
        self.assertFalse(S({"kind": "uppercase", "arg": ""}, "123"))
        self.assertTrue(S({"kind": "starts_with", "arg": "mango"}, "Mango, the sky is blue."))
        self.assertTrue(S({"kind": "ends_with", "arg": "mango"}, "The sky is blue, mango."))
        self.assertFalse(S({"kind": "ends_with", "arg": "mango"}, "The sky is blue, mangos."))
        self.assertTrue(S({"kind": "exact", "arg": "a b"}, "  a b\n"))
        self.assertTrue(S({"kind": "contains", "arg": "Red"}, "a red house"))


class SmokeRun(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        try:
            cls.gen = T.find_generator(None)
        except T.ToolError as e:
            raise unittest.SkipTest(str(e))
        torch.set_num_threads(1)
        cls.tmp = tempfile.mkdtemp(prefix="kvcache_train_")
        cls.out = os.path.join(cls.tmp, "run")
        cls.pt = os.path.join(cls.tmp, "model.pt")
        rc, _, err = U.run_tool("train_default_model.py", "--smoke", "--threads", "1", "--generator", cls.gen,
                                "--out", cls.out, "--export", cls.pt)
        if rc != 0:
            raise AssertionError(f"--smoke run failed ({rc}):\n{err[-3000:]}")
        cls.err = err

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_export_loads_and_matches_training_module(self):
        m = torch.jit.load(self.pt)
        module, extra, cfg, info = U.load_export(self.pt)
        self.assertEqual(info["model_type"], "qwen2")
        self.assertEqual(cfg["num_key_value_heads"], 2)
        self.assertTrue(cfg["tie_word_embeddings"])
        self.assertIn("<|im_start|>", json.loads(extra["tokenizer_config.json"])["chat_template"])
        tok = T.Tokenizer.from_json(json.loads(extra["tokenizer.json"]))
        ids = torch.tensor([tok.encode(T.render_chatml(CHAT, True))])
        logits = m.forward(ids)
        self.assertEqual(list(logits.shape), [1, ids.shape[1], cfg["vocab_size"]])
        # the training module with the safetensors weights gives the same logits
        ref = T.Qwen2Small(cfg)
        st = SafetensorsFile(os.path.join(self.out, "hf", "model.safetensors"))
        names = {k: k for k in st.tensors}
        sd = {}
        for k in ref.state_dict():
            hf = "model." + k.replace(".q_proj", ".self_attn.q_proj").replace(".k_proj", ".self_attn.k_proj") \
                .replace(".v_proj", ".self_attn.v_proj").replace(".o_proj", ".self_attn.o_proj") \
                .replace(".gate_proj", ".mlp.gate_proj").replace(".up_proj", ".mlp.up_proj") \
                .replace(".down_proj", ".mlp.down_proj")
            sd[k] = st.get(names[hf], torch.float32)
        ref.load_state_dict(sd)
        with torch.no_grad():
            want = ref(ids)
        self.assertLess(float((logits - want).abs().max()), 1e-4)

    def test_tokenizer_round_trips_suite(self):
        with open(os.path.join(self.out, "tokenizer.json"), encoding="utf-8") as f:
            tok = T.Tokenizer.from_json(json.load(f))
        with open(os.path.join(self.out, "data", "suite-small-s1234.jsonl"), encoding="utf-8") as f:
            suite = [json.loads(x) for x in f]
        self.assertEqual(len(suite), 20)
        texts = [T.render_chatml(t["messages"], True) + t["answer"] for t in suite]
        for s in texts:
            self.assertEqual(tok.decode(tok.encode(s)), s)
        if T.check_split_regex(texts) == 0:
            self.skipTest("perl not installed: the Qwen2 regex check needs it")

    def test_eval_written(self):
        with open(os.path.join(self.out, "eval.json")) as f:
            res = json.load(f)
        self.assertEqual(res["overall"][1], 20)
        self.assertEqual(res["steps"], 10)
        self.assertIn("step 10/10", self.err)

    def test_resume_is_a_no_op_at_the_end(self):
        rc, _, err = U.run_tool("train_default_model.py", "--smoke", "--threads", "1", "--generator", self.gen,
                                "--out", self.out, "--export", self.pt + ".2.pt", "--resume", "--final-eval", "none")
        self.assertEqual(rc, 0, err[-2000:])
        self.assertIn("resumed from", err)
        a = U.load_export(self.pt)[0]
        b = U.load_export(self.pt + ".2.pt")[0]
        ids = torch.arange(12).view(1, 12)
        self.assertTrue(torch.equal(a.forward(ids), b.forward(ids)))


    def test_warmup_gate_restarts_with_the_next_init_seed(self):
        """A key-token warm-up that ends above --warmup-gate starts the run over from step 0 with
        init seed seed + 7919 (--max-restarts 1: once), and the run still completes."""
        out = os.path.join(self.tmp, "gate")
        rc, _, err = U.run_tool("train_default_model.py", "--smoke", "--threads", "1", "--generator", self.gen,
                                "--out", out, "--export", os.path.join(out, "m.pt"), "--final-eval", "none",
                                "--warmup-gate", "0.001", "--max-restarts", "1")
        self.assertEqual(rc, 0, err[-2000:])
        self.assertIn("restart 1/1 from step 0 with init seed 9153", err)  # 1234 + 7919
        self.assertIn("(no restart left)", err)
        self.assertIn("training done: 10 steps", err)
        self.assertEqual(torch.load(os.path.join(out, "ckpt.pt"))["attempt"], 1)

    def test_init_from_takes_the_weights_and_names_a_bad_checkpoint(self):
        out = os.path.join(self.tmp, "init")
        os.makedirs(out)
        shutil.copy(os.path.join(self.out, "tokenizer.json"), out)  # the same tokenizer: the same shapes
        common = ["--smoke", "--threads", "1", "--generator", self.gen, "--out", out,
                  "--export", os.path.join(out, "m.pt"), "--final-eval", "none"]
        rc, _, err = U.run_tool("train_default_model.py", *common, "--init-from", os.path.join(self.out, "ckpt.pt"))
        self.assertEqual(rc, 0, err[-2000:])
        self.assertIn("weights from", err)
        rc, _, err = U.run_tool("train_default_model.py", *common, "--init-from", os.path.join(out, "missing.pt"))
        self.assertEqual(rc, 2)
        self.assertIn("missing.pt is not a file", err)

    def test_attention_supervision_runs_and_names_bad_heads(self):
        # the smoke run supervises layer 1, heads 0 and 2 (defaults): the log carries its NLL
        self.assertRegex(self.err, r"\| attn first \d+\.\d+ later \d+\.\d+\]")
        later = [float(x) for x in re.findall(r"later (\d+\.\d+)\]", self.err)]
        self.assertGreater(max(later), 0.5)  # a tiny model's attention on the later digits is far from exact
        common = ["--smoke", "--threads", "1", "--generator", self.gen, "--out", os.path.join(self.tmp, "bad"),
                  "--final-eval", "none"]
        rc, _, err = U.run_tool("train_default_model.py", *common, "--attn-sup-heads", "0,4")
        self.assertEqual(rc, 2)
        self.assertIn("--attn-sup-heads: head 4 out of range (the model has 4 query heads)", err)
        rc, _, err = U.run_tool("train_default_model.py", *common, "--attn-sup-heads", "0")
        self.assertEqual(rc, 2)
        self.assertIn("expected two head indices", err)
        rc, _, err = U.run_tool("train_default_model.py", *common, "--attn-sup-layer", "2")
        self.assertEqual(rc, 2)
        self.assertIn("--attn-sup-layer 2: the model has 2 layers", err)

COMMITTED = os.path.join(U.REPO, "models", "kvstudy-default.pt")
# pass count of the committed model on the small suite (seed 1234, 20 tasks) with the Python greedy
# loop over its ABI methods (train_default_model.evaluate); update together with the model
COMMITTED_SMALL_PASS = 20


class CommittedModel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists(COMMITTED):
            raise unittest.SkipTest(f"{COMMITTED} not committed yet")
        torch.set_num_threads(1)
        cls.module, cls.extra, cls.cfg, cls.info = U.load_export(COMMITTED)
        cls.tok = T.Tokenizer.from_json(json.loads(cls.extra["tokenizer.json"]))

    def test_loads_with_the_chat_format(self):
        self.assertEqual(self.info["model_type"], "qwen2")
        self.assertEqual(self.info["dtype"], "float32")
        self.assertLessEqual(os.path.getsize(COMMITTED), 16_000_000)
        self.assertGreaterEqual(self.cfg["max_position_embeddings"], 1024)
        self.assertEqual(self.cfg["num_key_value_heads"], 2)
        tc = json.loads(self.extra["tokenizer_config.json"])
        self.assertIn("<|im_start|>", tc["chat_template"])
        self.assertEqual(tc["default_system_prompt"], T.DEFAULT_SYSTEM_PROMPT)
        self.assertEqual(self.cfg["eos_token_id"], self.tok.special_ids[T.IM_END])
        ids = torch.tensor([self.tok.encode(T.render_chatml(CHAT, True))])
        logits = self.module.forward(ids)
        self.assertEqual(list(logits.shape), [1, ids.shape[1], self.cfg["vocab_size"]])
        self.assertTrue(bool(torch.isfinite(logits).all()))

    def test_tokenizer_round_trips_chat_text(self):
        for s in [T.render_chatml(CHAT, True) + "40712<|im_end|>\n", "Unseen: zebra 0987!\n\n  x"]:
            self.assertEqual(self.tok.decode(self.tok.encode(s)), s)

    def test_small_suite_exact_pass_count(self):
        try:
            gen = T.find_generator(None)
        except T.ToolError as e:
            self.skipTest(str(e))
        with tempfile.TemporaryDirectory() as d:
            suite = T.generate(gen, "small", os.path.join(d, "small.jsonl"), seed=1234)
        for t in suite:
            s = T.render_chatml(t["messages"], True) + t["answer"]
            self.assertEqual(self.tok.decode(self.tok.encode(s)), s)
        res = T.evaluate(self.module, self.cfg["num_hidden_layers"], self.tok, suite)
        self.assertEqual(res["overall"], (COMMITTED_SMALL_PASS, 20), T.fmt_summary(res))


if __name__ == "__main__":
    unittest.main()
