"""Bad input to tools/export_torchscript.py (and the other tools) gives a clear error naming the
file and the field, exit status 1, one line on stderr, no traceback, and leaves no output or temp
file behind. Each case mutates a copy of the real TinyStories-656K checkpoint."""
import json
import math
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import unittest
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvtest_util as U  # noqa: E402

import convert_llama2c  # noqa: E402
import export_torchscript  # noqa: E402
import make_random_checkpoint  # noqa: E402
from kvcache_tools.errors import ToolError  # noqa: E402
from kvcache_tools.export import load_export  # noqa: E402
from kvcache_tools.safetensors_io import SafetensorsFile, write_safetensors  # noqa: E402

MODEL = U.shared("models", "tinystories-656k")
STORIES260K = U.shared("models", "stories260K")
WEIGHTS = "model.safetensors"
ABOUT_A_DOUBLE = "is out of range (JSON numbers must be within +-1.798e+308, a double)"
# the export's memory bound (machine-dependent size)
BUDGET = (r"[\d.]+ [kMGTPE]?B the export may use \(half this machine's RAM: it holds every weight, then the "
          r"serialised file, in memory\)\n$")
NOT_JSON_NUMBER = "is not a JSON number (NaN and Infinity are not JSON; the C++ loader rejects them)"


def read_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    return header, data


def write_raw(path, header, data):
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


class ExportErrors(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        U.require_shared_data(cls)

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="kvcache_err_")
        self.ckpt = os.path.join(self.tmp, "ckpt")
        shutil.copytree(MODEL, self.ckpt)
        self.out_dir = os.path.join(self.tmp, "out")
        os.makedirs(self.out_dir)
        self.out = os.path.join(self.out_dir, "model.pt")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.ckpt, name)

    def edit_config(self, **changes):
        with open(self.path("config.json")) as f:
            cfg = json.load(f)
        cfg.update(changes)
        with open(self.path("config.json"), "w") as f:
            json.dump(cfg, f)

    def edit_config_text(self, old, new):
        """Edits config.json as text (for what json.dump cannot write: NaN literals, 1e9, huge ints)."""
        with open(self.path("config.json")) as f:
            text = f.read()
        self.assertIn(old, text)
        with open(self.path("config.json"), "w") as f:
            f.write(text.replace(old, new, 1))

    def edit_json(self, name, edit):
        with open(self.path(name), encoding="utf-8") as f:
            doc = json.load(f)
        edit(doc)
        with open(self.path(name), "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False)

    def edit_weights(self, name, edit, dtype=torch.bfloat16):
        st = SafetensorsFile(self.path(WEIGHTS))
        tensors = {n: st.get(n, dtype) for n in st.keys()}
        edit(tensors[name])
        write_safetensors(self.path(WEIGHTS), list(tensors.items()))

    def assert_one_line_error(self, rc, err, want_rc=1):
        self.assertEqual(rc, want_rc, err)
        self.assertTrue(err.startswith("error: "), err)
        self.assertNotIn("Traceback", err)
        self.assertEqual(err.count("\n"), 1, f"one line on stderr: {err!r}")
        self.assertTrue(err.endswith("\n"), err)

    def assert_export_fails(self, *needles, args=(), exact=None):
        rc, _, err = U.run_main(export_torchscript.main, self.ckpt, self.out, *args)
        self.assert_one_line_error(rc, err)
        for n in needles:
            self.assertIn(n, err)
        if exact is not None:
            self.assertEqual(err, f"error: {exact}\n")
        self.assertEqual(os.listdir(self.out_dir), [], "no output or temp file may be left")
        return err

    # ---- weight files ----
    def test_missing_weight_file(self):
        os.remove(self.path(WEIGHTS))
        self.assert_export_fails(WEIGHTS, "weight file not found", "model.safetensors.index.json")

    def test_truncated_weight_file(self):
        with open(self.path(WEIGHTS), "rb") as f:
            data = f.read()
        with open(self.path(WEIGHTS), "wb") as f:
            f.write(data[:len(data) - 1000])
        self.assert_export_fails(WEIGHTS, "truncated safetensors file", "data section has only")

    def test_truncated_header(self):
        with open(self.path(WEIGHTS), "rb") as f:
            data = f.read(100)
        with open(self.path(WEIGHTS), "wb") as f:
            f.write(data)
        self.assert_export_fails(WEIGHTS, "truncated safetensors file", "header length field says")

    def test_header_not_json(self):
        header, data = read_header(self.path(WEIGHTS))
        with open(self.path(WEIGHTS), "wb") as f:
            f.write(struct.pack("<Q", 5) + b"{nope" + data)
        self.assert_export_fails(WEIGHTS, "header is not valid JSON")

    def test_header_shape_mismatch(self):
        header, data = read_header(self.path(WEIGHTS))
        header["model.norm.weight"]["shape"] = [129]  # 129 bf16 values != the 256 bytes it spans
        write_raw(self.path(WEIGHTS), header, data)
        self.assert_export_fails(WEIGHTS, "'model.norm.weight'", "header/shape mismatch", "[129]", "span 256")

    def test_unsupported_dtype(self):
        header, data = read_header(self.path(WEIGHTS))
        header["model.norm.weight"]["dtype"] = "I16"  # same size, so only the dtype is wrong
        write_raw(self.path(WEIGHTS), header, data)
        self.assert_export_fails(WEIGHTS, "'model.norm.weight'", "unsupported dtype 'I16'", "(supported: F32, F16, BF16)")

    def test_header_entry_without_field(self):
        header, data = read_header(self.path(WEIGHTS))
        del header["model.norm.weight"]["data_offsets"]
        write_raw(self.path(WEIGHTS), header, data)
        self.assert_export_fails(WEIGHTS, "'model.norm.weight'", "lacks field 'data_offsets'")

    def test_missing_shard(self):
        st = SafetensorsFile(self.path(WEIGHTS))
        names = st.keys()
        write_safetensors(self.path("model-00001-of-00002.safetensors"), [(n, st.get(n)) for n in names[:5]])
        wm = {n: ("model-00001-of-00002.safetensors" if i < 5 else "model-00002-of-00002.safetensors")
              for i, n in enumerate(names)}
        with open(self.path("model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": wm}, f)
        os.remove(self.path(WEIGHTS))
        self.assert_export_fails("model-00002-of-00002.safetensors", "weight shard listed in",
                                 "'weight_map' not found")

    # ---- config ----
    def test_missing_config(self):
        os.remove(self.path("config.json"))
        self.assert_export_fails("config.json", "model config not found")

    def test_unknown_model_type(self):
        self.edit_config(model_type="gpt2")
        self.assert_export_fails("config.json", "unsupported model_type 'gpt2'", "llama, qwen2")

    def test_missing_required_field(self):
        with open(self.path("config.json")) as f:
            cfg = json.load(f)
        del cfg["intermediate_size"]
        with open(self.path("config.json"), "w") as f:
            json.dump(cfg, f)
        self.assert_export_fails("config.json", "required field 'intermediate_size' is missing")

    def test_unsupported_rope_scaling(self):
        self.edit_config(rope_scaling={"rope_type": "llama3", "factor": 8.0})
        self.assert_export_fails("config.json", "unsupported rope_scaling", "llama3")

    # ---- config and weights disagree ----
    def test_config_has_more_layers_than_weights(self):
        self.edit_config(num_hidden_layers=3)
        self.assert_export_fails(WEIGHTS, "tensor 'model.layers.2.input_layernorm.weight' is missing",
                                 "num_hidden_layers=3")

    def test_config_has_fewer_layers_than_weights(self):
        self.edit_config(num_hidden_layers=1)
        self.assert_export_fails(WEIGHTS, "unexpected tensor 'model.layers.1.", "num_hidden_layers=1")

    def test_wrong_shape_vs_config(self):
        self.edit_config(intermediate_size=256)
        self.assert_export_fails(WEIGHTS, "'model.layers.0.mlp.gate_proj.weight'", "has shape [384, 128]",
                                 "implies [256, 128]", "intermediate_size")

    def test_kv_heads_disagree(self):
        self.edit_config(num_key_value_heads=2)
        self.assert_export_fails(WEIGHTS, "'model.layers.0.self_attn.k_proj.weight'", "has shape [64, 128]",
                                 "implies [32, 128]", "num_key_value_heads")

    def test_untied_config_without_lm_head(self):
        self.edit_config(tie_word_embeddings=False)
        self.assert_export_fails(WEIGHTS, "tensor 'lm_head.weight' is missing", "tie_word_embeddings=false")

    def test_bias_expected_but_absent(self):
        self.edit_config(attention_bias=True)
        self.assert_export_fails(WEIGHTS, "'model.layers.0.self_attn.q_proj.bias' is missing", "attention_bias=true")

    # ---- tokenizer / misc ----
    def test_missing_tokenizer(self):
        os.remove(self.path("tokenizer.json"))
        self.assert_export_fails("tokenizer.json", "tokenizer file not found", "vocab.json + merges.txt")

    def test_vocab_without_merges(self):
        os.remove(self.path("tokenizer.json"))
        with open(self.path("vocab.json"), "w") as f:
            json.dump({"a": 0}, f)
        self.assert_export_fails("merges.txt", "tokenizer file not found")

    def test_missing_checkpoint_dir(self):
        shutil.rmtree(self.ckpt)
        self.assert_export_fails("checkpoint directory not found")

    def test_bad_dtype_argument(self):
        rc, _, err = U.run_main(export_torchscript.main, self.ckpt, self.out, "--dtype", "int8")
        self.assertEqual(rc, 2)  # argparse usage error
        self.assertIn("--dtype", err)
        self.assertIn("invalid choice: 'int8'", err)
        self.assertEqual(os.listdir(self.out_dir), [])

    def test_cli_process_exit_status_and_message(self):
        self.edit_config(model_type="mistral")
        rc, out, err = U.run_tool("export_torchscript.py", self.ckpt, self.out)
        self.assertEqual(rc, 1)
        self.assertEqual(err.strip(), f"error: {self.path('config.json')}: unsupported model_type 'mistral' "
                                      f"(supported: llama, qwen2)")
        self.assertEqual(os.listdir(self.out_dir), [])

    def test_pt_that_is_not_a_libkvcache_export(self):
        pt = os.path.join(self.out_dir, "plain.pt")
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), pt)
        with self.assertRaisesRegex(ToolError, "not a libkvcache export.*libkvcache_export.json"):
            load_export(pt)

    # ---- config values: type, finiteness, bounds, consistency (config.py) ----
    def test_config_value_errors(self):
        cfg = self.path("config.json")
        cases = [
            ('"intermediate_size": 384', '"intermediate_size": 1e9',
             f"{cfg}: field 'intermediate_size' = 1e9 is not an integer"),
            ('"intermediate_size": 384', '"intermediate_size": 384.0',
             f"{cfg}: field 'intermediate_size' = 384.0 is not an integer"),
            ('"hidden_size": 128', '"hidden_size": true', f"{cfg}: field 'hidden_size' = true is not an integer"),
            ('"hidden_size": 128', '"hidden_size": 0', f"{cfg}: field 'hidden_size' = 0 must be > 0"),
            ('"num_hidden_layers": 2', '"num_hidden_layers": -2', f"{cfg}: field 'num_hidden_layers' = -2 must be > 0"),
            ('"num_hidden_layers": 2', '"num_hidden_layers": 9223372036854775808',
             f"{cfg}: field 'num_hidden_layers' = 9223372036854775808 exceeds the limit 9223372036854775807 "
             f"(the C++ loader reads it as a 64-bit integer)"),
            ('"vocab_size": 2048', '"vocab_size": 67108865',
             f"{cfg}: field 'vocab_size' = 67108865 exceeds the limit 67108864 "
             f"(the C++ tokenizer loader accepts token ids below 2^26)"),
            ('"num_key_value_heads": 4', '"num_key_value_heads": 3',
             f"{cfg}: num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
            ('"num_attention_heads": 8', '"num_attention_heads": 3',
             f"{cfg}: num_attention_heads=3 is not a multiple of num_key_value_heads=4"),
            ('"hidden_size": 128', '"hidden_size": 128, "head_dim": 15', f"{cfg}: head_dim=15 must be even for RoPE"),
            ('"rms_norm_eps": 1e-06', '"rms_norm_eps": 0', f"{cfg}: field 'rms_norm_eps' = 0 must be > 0"),
            ('"rms_norm_eps": 1e-06', '"rms_norm_eps": 2.5',
             f"{cfg}: field 'rms_norm_eps' = 2.5 exceeds the limit 1 (an RMSNorm epsilon is a small positive number)"),
            ('"rope_theta": 10000.0', '"rope_theta": "10000"', f"{cfg}: field 'rope_theta' = \"10000\" is not a number"),
            ('"rope_theta": 10000.0', '"rope_theta": 1e39',
             f"{cfg}: field 'rope_theta' = 1e39 exceeds the limit 3.40282e+38 (RoPE frequencies are computed in float32)"),
            ('"tie_word_embeddings": true', '"tie_word_embeddings": "yes"',
             f"{cfg}: field 'tie_word_embeddings' = \"yes\" is not true or false"),
            ('"hidden_act": "silu"', '"hidden_act": "gelu\\nx"', f"{cfg}: unsupported hidden_act \"gelu\\nx\" (supported: silu)"),
        ]
        for old, new, want in cases:
            with self.subTest(new=new):
                shutil.copyfile(os.path.join(MODEL, "config.json"), cfg)
                self.edit_config_text(old, new)
                self.assert_export_fails(exact=want)

    def test_non_standard_json_literals(self):
        # rope_theta: Infinity was written into the export as non-standard JSON the loader rejects;
        # a NaN in a field the exporter does not read is still embedded, so it is rejected too
        cfg = self.path("config.json")
        self.edit_config_text('"rope_theta": 10000.0', '"rope_theta": Infinity')
        self.assert_export_fails(exact=f"{cfg}: field 'rope_theta' = Infinity {NOT_JSON_NUMBER}")
        shutil.copyfile(os.path.join(MODEL, "config.json"), cfg)
        self.edit_config_text('"initializer_range": 0.02', '"initializer_range": {"x": [1, -Infinity]}')
        self.assert_export_fails(exact=f"{cfg}: field 'initializer_range.x[1]' = -Infinity {NOT_JSON_NUMBER}")
        shutil.copyfile(os.path.join(MODEL, "config.json"), cfg)
        self.edit_config_text('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e400')
        self.assert_export_fails(exact=f"{cfg}: field 'rms_norm_eps' = 1e400 {ABOUT_A_DOUBLE}")

    def test_huge_integer(self):
        # Python's json raised ValueError (int conversion limit) on this
        self.edit_config_text('"max_position_embeddings": 512', '"max_position_embeddings": ' + "9" * 5000)
        self.assert_export_fails(exact=f"{self.path('config.json')}: field 'max_position_embeddings' = "
                                       f"999999999999...(5000 digits) {ABOUT_A_DOUBLE}")

    def test_deeply_nested_json(self):
        # Python's json raised RecursionError on this
        self.edit_config_text('"use_cache": true', '"use_cache": ' + "[" * 100000 + "]" * 100000)
        self.assert_export_fails(exact=f"{self.path('config.json')}: model config is JSON nested 100001 levels "
                                       f"deep, more than the limit of 100")

    def test_unpaired_surrogate_escape(self):
        self.edit_config_text('"torch_dtype": "bfloat16"', '"torch_dtype": "bf\\ud800"')
        self.assert_export_fails(exact=f"{self.path('config.json')}: field 'torch_dtype' has an unpaired UTF-16 "
                                       f"surrogate escape (not valid Unicode)")

    def test_huge_size_rejected_before_any_allocation(self):
        # intermediate_size 1e9 used to allocate [2, 1e9, 128] before the first shape check
        self.edit_config(intermediate_size=1_000_000_000)
        with mock.patch.object(SafetensorsFile, "get", side_effect=AssertionError("tensor data was read")), \
                mock.patch.object(torch, "empty", side_effect=AssertionError("a buffer was allocated")):
            err = self.assert_export_fails()
        self.assertRegex(err, "^" + re.escape(
            f"error: {self.path('config.json')}: field 'intermediate_size' = 1000000000 is too large: tensor "
            f"'model.layers.0.mlp.gate_proj.weight' would be 1000000000 x 128 x 4 B = 512 GB (float32), "
            f"more than the ") + BUDGET)
        # too many layers: 2,000,000 x 787,456 B per layer + 1,049,088 B embedding and final norm
        self.edit_config(intermediate_size=384, num_hidden_layers=2_000_000)
        err = self.assert_export_fails()
        self.assertRegex(err, "^" + re.escape(
            f"error: {self.path('config.json')}: field 'num_hidden_layers' = 2000000 makes the model too large: "
            f"2000000 layers x 787 kB + 1.0 MB embeddings and norm = 1.6 TB of float32 weights, more than the ")
            + BUDGET)

    def test_shapes_checked_before_data_is_read(self):
        self.edit_config(num_key_value_heads=2)
        with mock.patch.object(SafetensorsFile, "get", side_effect=AssertionError("tensor data was read")):
            self.assert_export_fails(exact=f"{self.path(WEIGHTS)}: tensor 'model.layers.0.self_attn.k_proj.weight' "
                                           f"has shape [64, 128] but {self.path('config.json')} implies [32, 128] "
                                           f"[num_key_value_heads*head_dim, hidden_size]")

    # ---- token ids outside the vocabulary ----
    def test_eos_and_bos_outside_vocab(self):
        cfg, gen = self.path("config.json"), self.path("generation_config.json")
        self.edit_config(eos_token_id=2048)
        self.assert_export_fails(exact=f"{cfg}: field 'eos_token_id' = 2048 is outside the vocabulary [0, 2048) "
                                       f"(config.json vocab_size)")
        self.edit_config(eos_token_id=[2, -1])
        self.assert_export_fails(exact=f"{cfg}: field 'eos_token_id' = [2, -1] (id -1) is outside the vocabulary "
                                       f"[0, 2048) (config.json vocab_size)")
        self.edit_config(eos_token_id=2, bos_token_id=99999)
        self.assert_export_fails(exact=f"{cfg}: field 'bos_token_id' = 99999 is outside the vocabulary [0, 2048) "
                                       f"(config.json vocab_size)")
        # the loader stops on the union of both files' eos ids: generation_config.json is checked too
        self.edit_config(bos_token_id=1)
        self.edit_json("generation_config.json", lambda g: g.update(eos_token_id=[2, 4096]))
        self.assert_export_fails(exact=f"{gen}: field 'eos_token_id' = [2, 4096] (id 4096) is outside the "
                                       f"vocabulary [0, 2048) (config.json vocab_size)")

    # ---- NaN / Inf weights ----
    def test_nan_and_inf_weights(self):
        def poison(t):
            t[3, 5] = float("nan")
            t[7, 1] = float("inf")
        self.edit_weights("model.layers.1.mlp.up_proj.weight", poison)
        self.assert_export_fails(exact=f"{self.path(WEIGHTS)}: tensor 'model.layers.1.mlp.up_proj.weight' has 1 NaN, "
                                       f"1 infinite values (first at index [3, 5]); the export would compute NaN logits")

    def test_weight_overflowing_fp16(self):
        self.edit_weights("model.norm.weight", lambda t: t.__setitem__(4, 1e6))  # fine in bf16, inf in fp16
        self.assert_export_fails(args=("--dtype", "fp16"),
                                 exact=f"{self.path(WEIGHTS)}: tensor 'model.norm.weight' has 1 infinite value after "
                                       f"conversion to float16 (out of its range) (first at index [4]); the export "
                                       f"would compute NaN logits")

    def test_safetensors_header_huge_integer(self):
        header, data = read_header(self.path(WEIGHTS))
        header["model.norm.weight"]["shape"] = [123456789]
        raw = json.dumps(header).replace("123456789", "9" * 5000).encode()
        with open(self.path(WEIGHTS), "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw + data)
        self.assert_export_fails(exact=f"{self.path(WEIGHTS)}: field 'model.norm.weight.shape[0]' = "
                                       f"999999999999...(5000 digits) {ABOUT_A_DOUBLE}")

    def test_index_with_invalid_shard_name(self):
        st = SafetensorsFile(self.path(WEIGHTS))
        wm = {n: WEIGHTS for n in st.keys()}
        wm["model.norm.weight"] = ["a", "b"]  # unhashable: raised TypeError in sorted(set(...))
        with open(self.path("model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": wm}, f)
        os.remove(self.path(WEIGHTS))
        self.assert_export_fails(exact=f"{self.path('model.safetensors.index.json')}: field "
                                       f"'weight_map.model.norm.weight' names an invalid shard file [\"a\", \"b\"]")

    # ---- tokenizer files checked as the C++ tokenizer loader reads them ----
    def test_tokenizer_errors(self):
        tj, tc = self.path("tokenizer.json"), self.path("tokenizer_config.json")
        cases = [
            ("tokenizer.json", lambda t: t.clear(), f"{tj}: field 'model' is missing"),
            ("tokenizer.json", lambda t: t["model"].update(type="WordPiece"),
             f"{tj}: field 'model.type' = \"WordPiece\" is not supported (supported: BPE)"),
            ("tokenizer.json", lambda t: t["model"]["vocab"].update({"<unk>": "0"}),
             f"{tj}: field 'model.vocab.<unk>' = \"0\" is not an integer token id"),
            ("tokenizer.json", lambda t: t["model"]["merges"].insert(5, "zq qz"),
             f"{tj}: field 'model.merges[5]' = \"zq qz\" uses \"zq\", which is not in the vocab"),
            ("tokenizer.json", lambda t: t["model"]["merges"].insert(0, "a  b"),
             f"{tj}: field 'model.merges[0]' = \"a  b\" is not a merge \"left right\""),
            ("tokenizer.json", lambda t: t["model"].update(unk_token="<nope>"),
             f"{tj}: field 'model.unk_token' = \"<nope>\" is not in the vocab"),
            ("tokenizer.json", lambda t: t["added_tokens"].append({"id": 4096, "content": "<x>"}),
             f"{tj}: field 'added_tokens[3].id' = 4096 is outside the model's vocabulary [0, 2048) "
             f"(config.json vocab_size)"),
            ("tokenizer.json", lambda t: t["added_tokens"].append({"id": 1, "content": "<y>"}),
             f"{tj}: field 'added_tokens[3].id' = 1: two added tokens have this id (\"<|start_story|>\", \"<y>\")"),
            ("tokenizer.json", lambda t: t["added_tokens"][1].update(content=""),
             f"{tj}: field 'added_tokens[1].content' is an empty added token"),
            ("tokenizer.json", lambda t: t.update(pre_tokenizer={"type": "BertPreTokenizer"}),
             f"{tj}: field 'pre_tokenizer.type' = \"BertPreTokenizer\" is not supported (supported: Split, "
             f"ByteLevel, Metaspace, Digits, Whitespace, WhitespaceSplit, Sequence)"),
            ("tokenizer.json", lambda t: t["normalizer"]["normalizers"][1].update(pattern={"String": ""}),
             f"{tj}: field 'normalizer.normalizers[1].pattern.String' is an empty pattern"),
            ("tokenizer.json", lambda t: t["decoder"]["decoders"][3].update(start=-1),
             f"{tj}: field 'decoder.decoders[3].start' = -1 must be >= 0"),
            ("tokenizer.json", lambda t: t["post_processor"]["special_tokens"].clear(),
             f"{tj}: field 'post_processor.special_tokens' has no entry for \"<|start_story|>\""),
            ("tokenizer_config.json", lambda c: c.update(eos_token="<|nope|>"),
             f"{tc}: field 'eos_token' = \"<|nope|>\": the token is not in the vocabulary"),
            ("tokenizer_config.json", lambda c: c.update(bos_token=None, add_bos_token=True),
             f"{tc}: field 'add_bos_token' is true but no bos_token is defined"),
        ]
        for name, edit, want in cases:
            with self.subTest(want=want):
                for n in ("tokenizer.json", "tokenizer_config.json"):
                    shutil.copyfile(os.path.join(MODEL, n), self.path(n))
                if name == "tokenizer_config.json":  # bos comes from the post-processor unless removed too
                    self.edit_json("tokenizer.json", lambda t: t.update(post_processor=None))
                self.edit_json(name, edit)
                self.assert_export_fails(exact=want)

    def test_empty_tokenizer_json(self):
        open(self.path("tokenizer.json"), "w").close()
        self.assert_export_fails(exact=f"{self.path('tokenizer.json')}: tokenizer.json is empty")
        with open(self.path("tokenizer.json"), "w") as f:
            f.write(" \n")
        self.assert_export_fails(exact=f"{self.path('tokenizer.json')}: tokenizer.json is empty")

    def test_merges_txt_checked_against_vocab(self):
        os.remove(self.path("tokenizer.json"))
        with open(self.path("vocab.json"), "w") as f:
            json.dump({"a": 0, "b": 1, "ab": 2}, f)
        with open(self.path("merges.txt"), "w") as f:
            f.write("#version: 0.2\na b\nab c\n")
        self.assert_export_fails(exact=f"{self.path('merges.txt')}: line 3 \"ab c\" uses \"c\", which is not in the vocab")

    # ---- the output: nothing half-written is ever left ----
    def test_output_path_is_a_directory(self):
        os.makedirs(self.out)
        rc, _, err = U.run_main(export_torchscript.main, self.ckpt, self.out)
        self.assert_one_line_error(rc, err)
        self.assertEqual(err, f"error: {self.out}: output path is a directory (give a file name)\n")
        self.assertEqual(os.listdir(self.out_dir), ["model.pt"])
        self.assertEqual(os.listdir(self.out), [])

    def test_output_directory_missing(self):
        out = os.path.join(self.tmp, "nope", "model.pt")
        rc, _, err = U.run_main(export_torchscript.main, self.ckpt, out)
        self.assert_one_line_error(rc, err)
        self.assertEqual(err, f"error: {out}: output directory {os.path.dirname(out)} does not exist\n")
        self.assertFalse(os.path.exists(os.path.dirname(out)))

    def _make_unwritable(self, d):
        """chmod 555; as root (which chmod does not stop) chattr +i. Returns the undo function."""
        os.chmod(d, 0o555)
        undo = [lambda: os.chmod(d, 0o755)]

        def writable():
            try:
                open(os.path.join(d, ".probe"), "w").close()
                os.remove(os.path.join(d, ".probe"))
                return True
            except OSError:
                return False
        if writable():
            if subprocess.run(["chattr", "+i", d], capture_output=True).returncode == 0:
                undo.insert(0, lambda: subprocess.run(["chattr", "-i", d], capture_output=True))
        if writable():
            for u in undo:
                u()
            self.skipTest("cannot make a directory unwritable here (root without chattr)")
        return lambda: [u() for u in undo]

    def test_unwritable_output_directory(self):
        undo = self._make_unwritable(self.out_dir)
        try:
            with mock.patch.object(SafetensorsFile, "get", side_effect=AssertionError("weights were read")):
                rc, _, err = U.run_main(export_torchscript.main, self.ckpt, self.out)  # fails before the build
        finally:
            undo()
        self.assert_one_line_error(rc, err)
        self.assertRegex(err, rf"^error: {self.out}: cannot write to the output directory {self.out_dir}: "
                              rf"(Permission denied|Operation not permitted)\n$")
        self.assertEqual(os.listdir(self.out_dir), [])

    def test_disk_error_while_writing(self):
        # a 100 kB file size limit (EFBIG, like a full disk) hits the 2.7 MB export mid-write;
        # LibTorch's own file writer aborted the process here, leaving the temp file behind
        def limit():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        p = subprocess.run([sys.executable, os.path.join(U.TOOLS, "export_torchscript.py"), self.ckpt, self.out],
                           capture_output=True, text=True, preexec_fn=limit,
                           env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
        self.assert_one_line_error(p.returncode, p.stderr)
        self.assertEqual(p.stderr, f"error: {self.out}: cannot write: File too large\n")
        self.assertEqual(os.listdir(self.out_dir), [])

    def test_keyboard_interrupt_removes_temp_file(self):
        seen = []

        def interrupt(*args, **kwargs):
            seen.extend(os.listdir(self.out_dir))  # the temp file exists while the weights load
            raise KeyboardInterrupt
        with mock.patch("kvcache_tools.export.load_weights", side_effect=interrupt):
            rc, out, err = U.run_main(export_torchscript.main, self.ckpt, self.out)
        self.assert_one_line_error(rc, err, want_rc=130)
        self.assertEqual(err, "error: interrupted (no half-written file left behind)\n")
        self.assertEqual(len(seen), 1)
        self.assertTrue(seen[0].startswith(".model.pt.tmp-"), seen)
        self.assertEqual(os.listdir(self.out_dir), [])
        self.assertEqual(out, "")

    def test_successful_export_replaces_atomically(self):
        with open(self.out, "w") as f:
            f.write("old")
        rc, out, err = U.run_main(export_torchscript.main, self.ckpt, self.out)
        self.assertEqual(rc, 0, err)
        self.assertEqual(os.listdir(self.out_dir), ["model.pt"])
        self.assertEqual(os.stat(self.out).st_mode & 0o777, 0o666 & ~_umask())
        _, files, cfg, _ = load_export(self.out)
        self.assertEqual(cfg["intermediate_size"], 384)
        self.assertIn("tokenizer.json", files)

    # ---- hostile inputs of issue 39 (fault 7) ----
    def run_export_bounded(self):
        """The exporter in a fresh interpreter with 3 GiB of data and 120 s at most: before the fix
        a config.json that was /dev/zero was read until MemoryError and a FIFO blocked forever."""
        def limit():
            resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30))
        try:
            return subprocess.run([sys.executable, os.path.join(U.TOOLS, "export_torchscript.py"), self.ckpt,
                                   self.out], capture_output=True, text=True, preexec_fn=limit, timeout=120,
                                  env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
        except subprocess.TimeoutExpired:
            self.fail("the exporter was still running after 120 s (blocked on a FIFO?)")

    def test_input_files_that_are_not_regular_are_refused_before_reading(self):
        for name, what in (("config.json", "model config"), ("tokenizer.json", "tokenizer.json")):
            for kind, shown_kind in (("device", "a character device"), ("fifo", "a FIFO (named pipe)")):
                path = self.path(name)
                saved = path + ".saved"
                os.replace(path, saved)
                try:
                    if kind == "device":
                        os.symlink("/dev/zero", path)
                    else:
                        os.mkfifo(path)
                    p = self.run_export_bounded()
                finally:
                    os.remove(path)
                    os.replace(saved, path)
                self.assert_one_line_error(p.returncode, p.stderr)
                self.assertEqual(p.stderr, f"error: {path}: {what} is {shown_kind}, not a regular file\n",
                                 (name, kind))
                self.assertEqual(os.listdir(self.out_dir), [])

    def test_input_files_larger_than_the_limit_are_refused_before_reading(self):
        with open(self.path("tokenizer.json"), "r+b") as f:
            f.truncate(128 * 1024 * 1024 + 1)  # sparse: nothing is written
        self.assert_export_fails(exact=f"{self.path('tokenizer.json')}: tokenizer.json is 134217729 bytes, more than "
                                       f"the limit of 134217728 bytes (128 MiB) for a tokenizer.json")

    def test_max_position_embeddings_beyond_the_library_limit(self):
        self.edit_config(max_position_embeddings=10 ** 15)
        self.assert_export_fails(exact=f"{self.path('config.json')}: field 'max_position_embeddings' = "
                                       f"1000000000000000 exceeds the limit 1000000000 (the library runs at most "
                                       f"10^9 tokens per request (kMaxTokens, kvcache/spec.h))")
        self.edit_config(max_position_embeddings=10 ** 9)
        rc, _, err = U.run_main(export_torchscript.main, self.ckpt, self.out)
        self.assertEqual(rc, 0, err)

    def test_tensors_whose_data_offsets_alias_are_refused(self):
        header, data = read_header(self.path(WEIGHTS))
        a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"
        header[b]["data_offsets"] = list(header[a]["data_offsets"])
        write_raw(self.path(WEIGHTS), header, data)
        lo, hi = header[a]["data_offsets"]
        self.assert_export_fails(exact=f"{self.path(WEIGHTS)}: tensors '{a}' and '{b}' overlap: data_offsets "
                                       f"[{lo}, {hi}] and [{lo}, {hi}] share bytes (each tensor must have its own "
                                       f"bytes in the data section)")
        header[b]["data_offsets"] = [lo + 2, hi + 2]  # a partial overlap, the same size
        write_raw(self.path(WEIGHTS), header, data)
        self.assert_export_fails("overlap", f"[{lo}, {hi}] and [{lo + 2}, {hi + 2}]")

    def test_bf16_data_labelled_f16_is_refused(self):
        header, data = read_header(self.path(WEIGHTS))
        for name, e in header.items():
            if name != "__metadata__":
                self.assertEqual(e["dtype"], "BF16")
                e["dtype"] = "F16"  # the bits stay BF16
        write_raw(self.path(WEIGHTS), header, data)
        self.assert_export_fails(f"{self.path(WEIGHTS)}: tensor 'model.layers.0.self_attn.q_proj.weight' is labelled F16 "
                                 f"but holds BF16 data: 16384 of its 16384 nonzero values have magnitude in [0.25, 4)",
                                 "fix its dtype in the header to BF16")
        # The same weights really converted to F16 export (50-70 % of them lie in that band).
        shutil.copy(os.path.join(MODEL, WEIGHTS), self.path(WEIGHTS))
        st = SafetensorsFile(self.path(WEIGHTS))
        write_safetensors(self.path(WEIGHTS), [(n, st.get(n, torch.float16)) for n in st.keys()])
        rc, _, err = U.run_main(export_torchscript.main, self.ckpt, self.out)
        self.assertEqual(rc, 0, err)

    def test_a_shape_of_true_is_refused(self):
        header, data = read_header(self.path(WEIGHTS))
        for bad in ([True], [1.0], [-1], ["1"], [None], [[128]], True):
            header["model.norm.weight"]["shape"] = bad
            write_raw(self.path(WEIGHTS), header, data)
            self.assert_export_fails(f"{self.path(WEIGHTS)}: tensor 'model.norm.weight': field 'shape' must be a list "
                                     f"of non-negative ints, got {bad!r}")

    # ---- sibling tools ----
    def test_make_random_checkpoint_too_large_before_writing(self):
        self.edit_config(intermediate_size=10 ** 12)
        out = os.path.join(self.tmp, "r")
        rc, _, err = U.run_main(make_random_checkpoint.main, out, "--config", self.path("config.json"),
                                "--tokenizer-dir", self.ckpt)
        self.assert_one_line_error(rc, err)
        self.assertTrue(err.startswith(f"error: {self.path('config.json')}: field 'intermediate_size' = 1000000000000 "
                                       f"is too large: tensor 'model.layers.0.mlp.gate_proj.weight' would be "
                                       f"1000000000000 x 128 x 2 B = 256 TB (bfloat16), more than the "), err)
        self.assertFalse(os.path.exists(out))

    def test_make_random_checkpoint_bad_tokenizer_before_writing(self):
        self.edit_json("tokenizer.json", lambda t: t["added_tokens"].append({"id": 4096, "content": "<x>"}))
        out = os.path.join(self.tmp, "r")
        rc, _, err = U.run_main(make_random_checkpoint.main, out, "--config", self.path("config.json"),
                                "--tokenizer-dir", self.ckpt)
        self.assert_one_line_error(rc, err)
        self.assertEqual(err, f"error: {self.path('tokenizer.json')}: field 'added_tokens[3].id' = 4096 is outside "
                              f"the model's vocabulary [0, 2048) (config.json vocab_size)\n")
        self.assertFalse(os.path.exists(out))

    def test_make_random_checkpoint_bad_max_window_layers(self):
        self.edit_config(max_window_layers="all")  # min("all", 1) raised TypeError
        out = os.path.join(self.tmp, "r")
        rc, _, err = U.run_main(make_random_checkpoint.main, out, "--config", self.path("config.json"),
                                "--tokenizer-dir", self.ckpt, "--num-layers", "1")
        self.assertEqual(rc, 0, err)
        with open(os.path.join(out, "config.json")) as f:
            self.assertEqual(json.load(f)["max_window_layers"], "all")

    def test_convert_llama2c_nan_weight(self):
        with open(os.path.join(STORIES260K, "stories260K.bin"), "rb") as f:
            data = bytearray(f.read())
        data[28 + 4 * 70:28 + 4 * 71] = struct.pack("<f", math.nan)  # tok_embeddings [1, 6] (dim 64)
        bad = os.path.join(self.tmp, "nan.bin")
        with open(bad, "wb") as f:
            f.write(data)
        out = os.path.join(self.tmp, "hf")
        rc, _, err = U.run_main(convert_llama2c.main, bad, os.path.join(STORIES260K, "tok512.bin"), out)
        self.assert_one_line_error(rc, err)
        self.assertEqual(err, f"error: {bad}: tensor 'tok_embeddings' has 1 NaN value (first at index [1, 6]); "
                              f"the export would compute NaN logits\n")
        self.assertFalse(os.path.exists(out))

    def test_convert_llama2c_output_is_a_file(self):
        out = os.path.join(self.tmp, "hf")
        open(out, "w").close()
        rc, _, err = U.run_main(convert_llama2c.main, os.path.join(STORIES260K, "stories260K.bin"),
                                os.path.join(STORIES260K, "tok512.bin"), out)
        self.assert_one_line_error(rc, err)
        self.assertEqual(err, f"error: {out}: output directory is an existing file\n")

    def test_make_random_checkpoint_bad_tokenizer_dir(self):
        rc, _, err = U.run_main(make_random_checkpoint.main, os.path.join(self.tmp, "r"), "--config",
                                self.path("config.json"), "--tokenizer-dir", os.path.join(self.tmp, "nope"))
        self.assertEqual(rc, 1)
        self.assertIn("tokenizer directory not found", err)


if __name__ == "__main__":
    unittest.main()
