"""tools/convert_llama2c.py on Karpathy's stories260K (llama2.c v0 .bin + tok512.bin), then
tools/export_torchscript.py: the export reproduces the golden reference of the original llama2.c
model, whose RoPE rotates adjacent pairs (the converter permutes wq/wk rows to rotate_half)."""
import json
import os
import shutil
import struct
import sys
import tempfile
import unittest

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvtest_util as U  # noqa: E402

import convert_llama2c  # noqa: E402  (tools/ is on sys.path via kvtest_util)
from kvcache_tools.safetensors_io import SafetensorsFile  # noqa: E402

MODEL = U.shared("models", "stories260K")


class Stories260KConvertExport(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        U.require_shared_data(cls)
        torch.set_num_threads(2)
        cls.tmp = tempfile.mkdtemp(prefix="kvcache_s260_")
        cls.hf = os.path.join(cls.tmp, "stories260K-hf")
        rc, _, err = U.run_tool("convert_llama2c.py", os.path.join(MODEL, "stories260K.bin"),
                                os.path.join(MODEL, "tok512.bin"), cls.hf)
        assert rc == 0, err
        cls.pt = os.path.join(cls.tmp, "s260.pt")
        rc, _, err = U.run_tool("export_torchscript.py", cls.hf, cls.pt)
        assert rc == 0, err
        cls.m, cls.files, cls.cfg, cls.info = U.load_export(cls.pt)
        cls.g = U.load_golden(MODEL)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_hf_dir_contents(self):
        self.assertEqual(sorted(os.listdir(self.hf)), ["config.json", "generation_config.json", "model.safetensors",
                                                       "tokenizer.json", "tokenizer_config.json"])
        c = self.cfg
        want = {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 5, "num_attention_heads": 8,
                "num_key_value_heads": 4, "head_dim": 8, "vocab_size": 512, "max_position_embeddings": 512,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "attention_bias": False,
                "bos_token_id": 1, "eos_token_id": 2, "model_type": "llama"}
        self.assertEqual({k: c[k] for k in want}, want)
        st = SafetensorsFile(os.path.join(self.hf, "model.safetensors"))
        self.assertEqual(len(st.keys()), 2 + 5 * 9)  # embed, norm, 9 per layer; tied: no lm_head
        self.assertEqual({st.tensors[n].dtype for n in st.keys()}, {"F32"})
        # 260,032 parameters (README), the legacy RoPE tables dropped
        self.assertEqual(sum(st.tensors[n].numel() for n in st.keys()), 260032)

    def test_rotary_permutation_hand_checked(self):
        # head of 4 rows (D=4): llama2.c pairs (0,1),(2,3) -> HF halves (0,2),(1,3): order 0,2,1,3
        w = torch.arange(8.0).view(8, 1)  # 2 heads x 4 rows
        self.assertEqual(convert_llama2c.permute_rotary(w, 2).view(-1).tolist(), [0, 2, 1, 3, 4, 6, 5, 7])

    def test_forward_logits_match_golden(self):
        ids = self.g["prompt_ids"] + self.g["greedy_ids"]
        with torch.no_grad():
            logits = self.m(torch.tensor([ids[:15]]))
        for key, pos in (("pos0_after_BOS", 0), ("pos4_last_prompt", 4), ("pos14", 14)):
            diff = (logits[0, pos] - torch.tensor(self.g["logits"][key])).abs().max().item()
            self.assertLess(diff, 1e-4, key)

    def test_greedy_ids_match_golden(self):
        self.assertEqual(U.greedy(self.m, self.g["prompt_ids"], 60), self.g["greedy_ids"])

    def test_prompt_kv_matches_golden_up_to_rotary_permutation(self):
        L, T, Hkv, D = self.g["kv_cache_prompt"]["shape"]
        with torch.no_grad():
            _, ks, vs = U.compose(self.m, self.cfg, torch.tensor([self.g["prompt_ids"]]))
        k = torch.stack([x[0].transpose(0, 1) for x in ks])  # [L, T, H_kv, D], rotate_half layout
        v = torch.stack([x[0].transpose(0, 1) for x in vs])
        # back to llama2.c's interleaved layout: HF dim j <-> llama2.c 2j, HF j + D/2 <-> 2j + 1
        k_l2c = torch.stack([k[..., :D // 2], k[..., D // 2:]], dim=-1).reshape(L, T, Hkv, D)
        gk = torch.tensor(self.g["kv_cache_prompt"]["k_post_rope"]).view(L, T, Hkv, D)
        gv = torch.tensor(self.g["kv_cache_prompt"]["v"]).view(L, T, Hkv, D)
        self.assertLess((k_l2c - gk).abs().max().item(), 1e-4)
        self.assertLess((v - gv).abs().max().item(), 1e-4)
        self.assertGreater((k - gk).abs().max().item(), 1e-2)  # the permutation is real, not a no-op

    def test_abi_methods_compose_to_forward(self):
        ids = torch.tensor([self.g["prompt_ids"] + self.g["greedy_ids"][:20]])
        with torch.no_grad():
            got, _, _ = U.compose(self.m, self.cfg, ids)
            self.assertLess(U.max_rel_diff(got, self.m(ids)), 1e-5)

    def test_tokenizer_json(self):
        tok = json.loads(self.files["tokenizer.json"])
        model = tok["model"]
        self.assertEqual((model["type"], model["byte_fallback"], model["unk_token"]), ("BPE", True, "<unk>"))
        self.assertIsNone(tok["pre_tokenizer"])
        self.assertEqual([n["type"] for n in tok["normalizer"]["normalizers"]], ["Prepend", "Replace"])
        self.assertEqual([(a["id"], a["content"]) for a in tok["added_tokens"]], [(0, "<unk>"), (1, "<s>"), (2, "</s>")])
        v = model["vocab"]
        self.assertEqual(len(v), 512)
        self.assertEqual((v["<0x00>"], v["<0xFF>"], v["\u2581t"], v["he"]), (3, 258, 259, 260))
        self.assertEqual(model["merges"][:3], ["\u2581 t", "h e", "\u2581 a"])  # ids 259, 260, 261
        # the reference encoder over these vocab/merges gives the golden prompt ids
        self.assertEqual([1] + U.spm_bpe_encode(tok, "Once upon a time"), self.g["prompt_ids"])

    def test_spm_encoder_matches_real_hf_tokenizer_json(self):
        # the same reference encoder on TinyStories-656K's real tokenizer.json (checks the checker)
        with open(U.shared("models", "tinystories-656k", "tokenizer.json"), encoding="utf-8") as f:
            tok = json.load(f)
        self.assertEqual(U.spm_bpe_encode(tok, "Once upon a time,"), [80, 147, 201, 282, 57, 8])

    def test_truncated_checkpoint_is_rejected(self):
        bad = os.path.join(self.tmp, "trunc.bin")
        with open(os.path.join(MODEL, "stories260K.bin"), "rb") as f:
            data = f.read()
        with open(bad, "wb") as f:
            f.write(data[:len(data) // 2])
        out = os.path.join(self.tmp, "trunc-out")
        rc, _, err = U.run_main(convert_llama2c.main, bad, os.path.join(MODEL, "tok512.bin"), out)
        self.assertEqual(rc, 1)
        self.assertIn("trunc.bin", err)
        self.assertIn("truncated llama2.c checkpoint", err)
        self.assertIn("needs 1056540", err)
        self.assertFalse(os.path.exists(out))

    def test_tokenizer_vocab_size_mismatch_is_rejected(self):
        bad = os.path.join(self.tmp, "v1024.bin")
        with open(os.path.join(MODEL, "stories260K.bin"), "rb") as f:
            data = bytearray(f.read())
        # vocab 1024 would need more embedding rows: make the sizes consistent but the tokenizer short
        hdr = list(struct.unpack("<7i", data[:28]))
        self.assertEqual(hdr, [64, 172, 5, 8, 4, 512, 512])
        hdr[6] = 256  # seq_len 256: shorter RoPE tables -> file longer than the header implies
        data[:28] = struct.pack("<7i", *hdr)
        with open(bad, "wb") as f:
            f.write(data)
        rc, _, err = U.run_main(convert_llama2c.main, bad, os.path.join(MODEL, "tok512.bin"),
                                os.path.join(self.tmp, "v-out"))
        self.assertEqual(rc, 1)
        self.assertIn("seq_len=256", err)
        self.assertIn("not a version-0 llama2.c checkpoint", err)


if __name__ == "__main__":
    unittest.main()
