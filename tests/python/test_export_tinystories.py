"""tools/export_torchscript.py on the real TinyStories-656K HF checkpoint (bf16 safetensors, GQA 8/4,
tied embeddings): the exported forward and the ABI methods reproduce the golden reference."""
import json
import os
import shutil
import sys
import tempfile
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvtest_util as U  # noqa: E402

from kvcache_tools.safetensors_io import SafetensorsFile, write_safetensors  # noqa: E402

MODEL = U.shared("models", "tinystories-656k")


class TinyStoriesExport(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        U.require_shared_data(cls)
        torch.set_num_threads(2)
        cls.tmp = tempfile.mkdtemp(prefix="kvcache_ts_")
        cls.pt = os.path.join(cls.tmp, "ts.pt")
        rc, out, err = U.run_tool("export_torchscript.py", MODEL, cls.pt)
        assert rc == 0, err
        cls.listing_after_export = sorted(os.listdir(cls.tmp))
        cls.m, cls.files, cls.cfg, cls.info = U.load_export(cls.pt)
        cls.g = U.load_golden(MODEL)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_output_written_atomically_no_temp_left(self):
        self.assertEqual(self.listing_after_export, ["ts.pt"])

    def test_extra_files(self):
        self.assertEqual(self.info, {"format": "libkvcache-torchscript", "abi_version": 1, "model_type": "llama",
                                     "dtype": "float32", "source": "tinystories-656k/model.safetensors (BF16)",
                                     "rope": "rotate_half"})
        self.assertEqual(sorted(self.files), ["config.json", "generation_config.json", "libkvcache_export.json",
                                              "tokenizer.json", "tokenizer_config.json"])
        with open(os.path.join(MODEL, "tokenizer.json"), encoding="utf-8") as f:
            self.assertEqual(self.files["tokenizer.json"], f.read())
        c = self.cfg
        want = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
                "head_dim": 16, "intermediate_size": 384, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                "tie_word_embeddings": True, "vocab_size": 2048, "attention_bias": False, "bos_token_id": 1,
                "eos_token_id": 2, "max_position_embeddings": 512, "model_type": "llama"}
        self.assertEqual({k: c[k] for k in want}, want)

    def test_forward_logits_match_golden(self):
        ids = self.g["prompt_ids"] + self.g["greedy_ids"]
        with torch.no_grad():
            logits = self.m(torch.tensor([ids[:17]]))
        self.assertEqual(logits.dtype, torch.float32)
        self.assertEqual(list(logits.shape), [1, 17, 2048])
        for key, pos in (("pos6_last_prompt", 6), ("pos16", 16)):
            diff = (logits[0, pos] - torch.tensor(self.g["logits"][key])).abs().max().item()
            self.assertLess(diff, 1e-4, key)

    def test_greedy_ids_match_golden(self):
        self.assertEqual(U.greedy(self.m, self.g["prompt_ids"], 60), self.g["greedy_ids"])

    def test_prompt_kv_matches_golden(self):
        L, T, Hkv, D = self.g["kv_cache_prompt"]["shape"]
        with torch.no_grad():
            _, ks, vs = U.compose(self.m, self.cfg, torch.tensor([self.g["prompt_ids"]]))
        k = torch.stack([x[0].transpose(0, 1) for x in ks])  # [L, T, H_kv, D]
        v = torch.stack([x[0].transpose(0, 1) for x in vs])
        gk = torch.tensor(self.g["kv_cache_prompt"]["k_post_rope"]).view(L, T, Hkv, D)
        gv = torch.tensor(self.g["kv_cache_prompt"]["v"]).view(L, T, Hkv, D)
        self.assertLess((k - gk).abs().max().item(), 1e-4)
        self.assertLess((v - gv).abs().max().item(), 1e-4)

    def test_abi_methods_compose_to_forward(self):
        ids = torch.tensor([self.g["prompt_ids"] + self.g["greedy_ids"][:10]] * 2)
        ids[1, 3] = 17  # two different rows
        with torch.no_grad():
            ref = self.m(ids)
            got, _, _ = U.compose(self.m, self.cfg, ids)
        self.assertLess(U.max_rel_diff(got, ref), 1e-5)

    def test_rope_at_position_zero_is_identity_and_preserves_norm(self):
        x = torch.randn(1, 4, 3, 16)
        with torch.no_grad():
            y = self.m.rope(x, torch.tensor([0, 5, 300]))
        self.assertTrue(torch.equal(y[:, :, 0], x[:, :, 0]))
        torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
        # hand-checked: position 1, pair (0, 8) rotates by theta^0 = 1 rad
        e = torch.zeros(1, 1, 1, 16)
        e[..., 0] = 1.0
        r = self.m.rope(e, torch.tensor([1]))
        self.assertAlmostEqual(r[0, 0, 0, 0].item(), 0.5403023, places=6)  # cos 1
        self.assertAlmostEqual(r[0, 0, 0, 8].item(), 0.8414710, places=6)  # sin 1

    def test_bf16_and_fp16_exports(self):
        with torch.no_grad():
            ref = self.m(torch.tensor([self.g["prompt_ids"]]))[0, -1]
        for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            pt = os.path.join(self.tmp, f"ts_{name}.pt")
            rc, _, err = U.run_tool("export_torchscript.py", MODEL, pt, "--dtype", name)
            self.assertEqual(rc, 0, err)
            m, _, cfg, info = U.load_export(pt)
            self.assertEqual(info["dtype"], {"bf16": "bfloat16", "fp16": "float16"}[name])
            ids = torch.tensor([self.g["prompt_ids"]])
            with torch.no_grad():
                self.assertEqual(m.embed(ids).dtype, dt)
                q, k, v = m.qkv(0, m.embed(ids), torch.arange(7))
                self.assertEqual((q.dtype, k.dtype, v.dtype), (dt, dt, dt))
                logits = m(ids)[0, -1]
            self.assertEqual(logits.dtype, torch.float32)
            self.assertEqual(int(logits.argmax()), int(ref.argmax()), name)
            self.assertLess((logits - ref).abs().max().item(), 0.5, name)  # low-precision activations
            with torch.no_grad():  # one token: the GEMV path
                one = m(ids[:, :1])[0, 0]
                one_ref = self.m(ids[:, :1])[0, 0]
            self.assertEqual(one.dtype, torch.float32)
            self.assertLess((one - one_ref).abs().max().item(), 0.5, name)
            os.remove(pt)

    def test_sharded_checkpoint_exports_identically(self):
        d = os.path.join(self.tmp, "sharded")
        os.makedirs(d)
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copyfile(os.path.join(MODEL, name), os.path.join(d, name))
        src = SafetensorsFile(os.path.join(MODEL, "model.safetensors"))
        names = src.keys()
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        wm = {}
        for shard, part in shards.items():
            # BF16 values widen exactly to fp32 and narrow back exactly
            write_safetensors(os.path.join(d, shard), [(n, src.get(n, torch.bfloat16)) for n in part])
            wm.update({n: shard for n in part})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": wm}, f)
        pt = os.path.join(self.tmp, "sharded.pt")
        rc, _, err = U.run_tool("export_torchscript.py", d, pt)
        self.assertEqual(rc, 0, err)
        m, _, _, info = U.load_export(pt)
        self.assertIn("model-00001-of-00002.safetensors+model-00002-of-00002.safetensors", info["source"])
        ids = torch.tensor([self.g["prompt_ids"]])
        with torch.no_grad():
            self.assertTrue(torch.equal(m(ids), self.m(ids)))


if __name__ == "__main__":
    unittest.main()
