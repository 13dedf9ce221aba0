// SPDX-License-Identifier: Apache-2.0
// CausalLM: loading a TorchScript export (ABI v1), its config and extra files, the method
// wrappers' shapes, and clear errors for files that are not libkvcache exports.

#include "kvcache/model/causal_lm.h"

#include <ATen/Parallel.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <memory>

#include "kvcache/error.h"
#include "kvcache/torch.h"
#include "model_test_util.h"

namespace kvcache {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
namespace t = kvcache::testing;

/// Python that writes the malformed modules of the bad-input tests into directory `out`.
extern const char* kBadModules;

/// One export of TinyStories-656K and one set of malformed modules, shared by the tests.
class CausalLMTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!t::have_shared_data() || !t::have_tool("export_torchscript.py")) return;
    pt_ = t::export_hf(t::shared_data() + "/models/tinystories-656k", "ts656k.pt", &error_);
    if (!error_.empty()) return;
    bad_ = t::cached_artifact(
        "bad_modules", kBadModules,
        [](const std::string& out) {
          std::filesystem::create_directories(out);
          return t::run_python("OUT = '" + out + "'\n" + kBadModules, out + "/make.py");
        },
        &error_);
  }
  void SetUp() override {
    if (!t::have_shared_data()) GTEST_SKIP() << "../shared/data is absent";
    if (!t::have_tool("export_torchscript.py"))
      GTEST_SKIP() << "tools/export_torchscript.py absent";
    ASSERT_EQ(error_, "");
    dir_ = std::make_unique<t::TempDir>();
  }
  void TearDown() override { dir_.reset(); }
  static std::string bad(const std::string& name) { return bad_ + "/" + name; }

  std::unique_ptr<t::TempDir> dir_;
  static std::string pt_, bad_, error_;
};

std::string CausalLMTest::pt_, CausalLMTest::bad_, CausalLMTest::error_;

const char* kBadModules = R"(
import torch, json, copy
from typing import Tuple
class Plain(torch.nn.Module):
    def forward(self, x):
        return x + 1
class Abi(torch.nn.Module):
    @torch.jit.export
    def embed(self, ids):
        return ids.float()
    @torch.jit.export
    def qkv(self, layer: int, h, positions) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return h, h, h
    @torch.jit.export
    def rope(self, x, positions):
        return x
    @torch.jit.export
    def finish(self, layer: int, h, attn_out):
        return h
    @torch.jit.export
    def head(self, h):
        return h
    def forward(self, ids):
        return ids.float()
class NoQkv(torch.nn.Module):
    @torch.jit.export
    def embed(self, ids):
        return ids.float()
    def forward(self, ids):
        return self.embed(ids)
CFG = dict(model_type='llama', hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
           num_key_value_heads=1, head_dim=4, intermediate_size=16, rope_theta=10000.0,
           rms_norm_eps=1e-5, vocab_size=10, eos_token_id=[3, 4])
HDR = dict(format='libkvcache-torchscript', abi_version=1, model_type='llama')
def save(name, module, hdr=HDR, cfg=CFG, drop=()):
    extra = {'libkvcache_export.json': json.dumps(hdr), 'config.json': json.dumps(cfg)}
    for d in drop:
        del extra[d]
    torch.jit.save(torch.jit.script(module), OUT + '/' + name, _extra_files=extra)
torch.jit.save(torch.jit.script(Plain()), OUT + '/plain.pt')
save('abi_ok.pt', Abi())
save('abi2.pt', Abi(), hdr=dict(HDR, abi_version=2))
save('format.pt', Abi(), hdr=dict(HDR, format='something-else'))
save('nohd.pt', Abi(), cfg={k: v for k, v in CFG.items() if k != 'head_dim'})
save('ratio.pt', Abi(), cfg=dict(CFG, num_key_value_heads=3))
save('strdim.pt', Abi(), cfg=dict(CFG, hidden_size='8'))
save('nocfg.pt', Abi(), drop=('config.json',))
save('noqkv.pt', NoQkv())
)";

TEST_F(CausalLMTest, LoadsTinyStoriesConfigAndExtraFiles) {
  const CausalLM m = CausalLM::load(pt_, LoadOptions{2});
  EXPECT_EQ(at::get_num_threads(), 2);
  const ModelConfig& c = m.config();
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.num_attention_heads, 8);
  EXPECT_EQ(c.num_key_value_heads, 4);
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.intermediate_size, 384);
  EXPECT_EQ(c.vocab_size, 2048);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, std::vector<int64_t>{2});
  EXPECT_EQ(c.max_position_embeddings, 512);
  EXPECT_EQ(m.path(), pt_);
  EXPECT_THAT(m.extra_file("tokenizer.json"), HasSubstr("\"model\""));
  EXPECT_THAT(m.extra_file("libkvcache_export.json"), HasSubstr("libkvcache-torchscript"));
  EXPECT_EQ(m.extra_files().count("config.json"), 1u);
  EXPECT_EQ(m.extra_file("vocab.json"), "");  // not exported for this model

  // 656,000 parameters (README), widened to fp32 by the export; plus any small RoPE tables.
  EXPECT_GE(m.weight_bytes(), 656000 * 4);
  EXPECT_LT(m.weight_bytes(), 656000 * 4 + 64 * 1024);

  const CacheConfig cc = m.cache_config();
  EXPECT_EQ(cc.num_layers, 2);
  EXPECT_EQ(cc.num_q_heads, 8);
  EXPECT_EQ(cc.num_kv_heads, 4);
  EXPECT_EQ(cc.head_dim, 16);
  ASSERT_TRUE(cc.rope != nullptr);
}

TEST_F(CausalLMTest, MethodShapesFollowAbi) {
  const CausalLM m = CausalLM::load(pt_, LoadOptions{1});
  const at::Tensor ids = at::tensor({1, 80, 147}, at::kLong).view({1, 3});
  const at::Tensor pos = at::arange(3, at::kLong);
  const at::Tensor h = m.embed(ids);
  EXPECT_EQ(h.sizes(), (std::vector<int64_t>{1, 3, 128}));
  EXPECT_EQ(h.scalar_type(), at::kFloat);
  const QKV x = m.qkv(0, h, pos);
  EXPECT_EQ(x.q.sizes(), (std::vector<int64_t>{1, 8, 3, 16}));
  EXPECT_EQ(x.k.sizes(), (std::vector<int64_t>{1, 4, 3, 16}));
  EXPECT_EQ(x.v.sizes(), (std::vector<int64_t>{1, 4, 3, 16}));
  // Position 0 is the identity rotation, so pre- and post-RoPE keys agree there only.
  const at::Tensor kr = m.rope(x.k, pos);
  EXPECT_TRUE(at::allclose(kr.select(2, 0), x.k.select(2, 0)));
  EXPECT_FALSE(at::allclose(kr.select(2, 2), x.k.select(2, 2)));
  // RoPE is a rotation: norms per (head, token) are kept.
  EXPECT_TRUE(at::allclose(kr.norm(2, -1), x.k.norm(2, -1), 1e-5, 1e-5));
  const at::Tensor h2 = m.finish(0, h, at::zeros({1, 8, 3, 16}));
  EXPECT_EQ(h2.sizes(), h.sizes());
  const at::Tensor logits = m.head(h2);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{1, 3, 2048}));
  EXPECT_EQ(logits.scalar_type(), at::kFloat);
  const at::Tensor full = m.forward(ids);
  EXPECT_EQ(full.sizes(), (std::vector<int64_t>{1, 3, 2048}));
  EXPECT_THROW(m.qkv(2, h, pos), InvalidArgument);
  EXPECT_THROW(m.finish(-1, h, at::zeros({1, 8, 3, 16})), InvalidArgument);
}

TEST_F(CausalLMTest, MissingFileNamesThePath) {
  const std::string p = *dir_ / "no_such_model.pt";
  try {
    CausalLM::load(p);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr(p), HasSubstr("does not exist")));
  }
}

TEST_F(CausalLMTest, TruncatedFileIsAClearError) {
  const std::string p = *dir_ / "truncated.pt";
  {
    std::ifstream in(pt_, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream(p, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  }
  try {
    CausalLM::load(p);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr(p), HasSubstr("truncated")));
  }
}

TEST_F(CausalLMTest, NonArchiveFileIsAClearError) {
  const std::string p = *dir_ / "text.pt";
  std::ofstream(p) << "this is not a model\n";
  EXPECT_THROW(CausalLM::load(p), InvalidArgument);
}

TEST_F(CausalLMTest, PlainTorchScriptModuleIsNotALibkvcacheExport) {
  const std::string p = bad("plain.pt");
  try {
    CausalLM::load(p);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr(p), HasSubstr("not a libkvcache export"),
                                HasSubstr("libkvcache_export.json")));
  }
}

TEST_F(CausalLMTest, WrongAbiVersionNamesTheField) {
  const std::string p = bad("abi2.pt");
  try {
    CausalLM::load(p);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr(p), HasSubstr("abi_version 2"),
                                HasSubstr("libkvcache_export.json")));
  }
}

TEST_F(CausalLMTest, WrongFormatNamesTheField) {
  const std::string p = bad("format.pt");
  try {
    CausalLM::load(p);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("'format'"), HasSubstr("something-else")));
  }
}

TEST_F(CausalLMTest, ConfigMissingFieldIsNamed) {
  const std::string p = bad("nohd.pt");
  try {
    CausalLM::load(p);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr(p), HasSubstr("config.json"), HasSubstr("'head_dim'")));
  }
}

TEST_F(CausalLMTest, ConfigBadHeadRatioIsNamed) {
  const std::string p = bad("ratio.pt");
  try {
    CausalLM::load(p);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("num_attention_heads (2)"), HasSubstr("num_key_value_heads (3)")));
  }
}

TEST_F(CausalLMTest, ConfigWrongTypeIsNamed) {
  const std::string p = bad("strdim.pt");
  try {
    CausalLM::load(p);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(),
                AllOf(HasSubstr("'hidden_size'"), HasSubstr("integer"), HasSubstr("\"8\"")));
  }
}

TEST_F(CausalLMTest, MissingConfigIsNamed) {
  const std::string p = bad("nocfg.pt");
  try {
    CausalLM::load(p);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr(p), HasSubstr("config.json"), HasSubstr("missing")));
  }
}

TEST_F(CausalLMTest, AbiModuleWithListEosLoads) {
  const std::string p = bad("abi_ok.pt");
  const CausalLM m = CausalLM::load(p, LoadOptions{1});
  EXPECT_EQ(m.config().eos_token_ids, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(m.config().bos_token_id, -1);
  EXPECT_EQ(m.config().max_position_embeddings, 0);
}

TEST_F(CausalLMTest, TokenizerFilesRoundTripTheGoldenPrompt) {
  const CausalLM m = CausalLM::load(pt_, LoadOptions{1});
  const Tokenizer tok = Tokenizer::from_texts(m.tokenizer_files());
  // golden_once_upon_a_time.json: "Once upon a time," -> [1, 80, 147, 201, 282, 57, 8].
  const std::vector<int64_t> ids = tok.encode("Once upon a time,");
  EXPECT_EQ(ids, (std::vector<int64_t>{1, 80, 147, 201, 282, 57, 8}));
  EXPECT_EQ(tok.decode(ids, /*skip_special=*/true), "Once upon a time,");
}

TEST_F(CausalLMTest, ExportWithoutTokenizerSaysSo) {
  const CausalLM m = CausalLM::load(bad("abi_ok.pt"), LoadOptions{1});
  try {
    m.tokenizer_files();
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("abi_ok.pt"), HasSubstr("tokenizer.json")));
  }
}

TEST_F(CausalLMTest, MissingMethodIsNamed) {
  const std::string p = bad("noqkv.pt");
  try {
    CausalLM::load(p);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr(p), HasSubstr("method 'qkv'"), HasSubstr("missing")));
  }
}

}  // namespace
}  // namespace kvcache
