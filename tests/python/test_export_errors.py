"""Bad input to tools/export_torchscript.py (and the other tools) gives a clear error naming the
file and the field, exit status 1, no traceback, and leaves no output or temp file behind.
Each case mutates a copy of the real TinyStories-656K checkpoint."""
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

import export_torchscript  # noqa: E402
import make_random_checkpoint  # noqa: E402
from kvcache_tools.errors import ToolError  # noqa: E402
from kvcache_tools.export import load_export  # noqa: E402
from kvcache_tools.safetensors_io import SafetensorsFile, write_safetensors  # noqa: E402

MODEL = U.shared("models", "tinystories-656k")
WEIGHTS = "model.safetensors"


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

    def assert_export_fails(self, *needles, args=()):
        rc, _, err = U.run_main(export_torchscript.main, self.ckpt, self.out, *args)
        self.assertEqual(rc, 1, err)
        self.assertTrue(err.startswith("error: "), err)
        self.assertNotIn("Traceback", err)
        for n in needles:
            self.assertIn(n, err)
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

    def test_make_random_checkpoint_bad_tokenizer_dir(self):
        rc, _, err = U.run_main(make_random_checkpoint.main, os.path.join(self.tmp, "r"), "--config",
                                self.path("config.json"), "--tokenizer-dir", os.path.join(self.tmp, "nope"))
        self.assertEqual(rc, 1)
        self.assertIn("tokenizer directory not found", err)


if __name__ == "__main__":
    unittest.main()
