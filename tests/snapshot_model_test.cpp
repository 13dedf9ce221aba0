// SPDX-License-Identifier: Apache-2.0
// Snapshots on the default model (models/kvstudy-default.pt, docs/snapshot-format.md): a
// sequence saved to disk and restored into a fresh cache continues with bit-identical logits to
// the same sequence that never left memory, for fp32 and every deterministic scheme; the model
// fingerprint the runner supplies tells models apart.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "kvcache/model/causal_lm.h"
#include "kvcache/model/runner.h"
#include "kvcache/model/tokenizer.h"
#include "kvcache/snapshot.h"
#include "kvcache/torch.h"
#include "model_test_util.h"

namespace kvcache {
namespace {

namespace t = kvcache::testing;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;

std::string model_file(const char* name) {
  const std::string p = t::source_dir() + "/models/" + name;
  return std::filesystem::is_regular_file(p) ? p : "";
}

int64_t greedy(const at::Tensor& logits) { return logits.argmax().item<int64_t>(); }

TEST(SnapshotModel, RestoredSequenceContinuesWithBitIdenticalLogits) {
  const std::string pt = model_file("kvstudy-default.pt");
  if (pt.empty()) GTEST_SKIP() << "models/kvstudy-default.pt is not in this checkout";
  const CausalLM lm = CausalLM::load(pt, LoadOptions{1});
  const Runner runner(lm);
  const Tokenizer tok = Tokenizer::from_texts(lm.tokenizer_files());
  const std::vector<int64_t> prompt =
      tok.encode("Once upon a time there was a little cat who lived in a big house with a red door.");
  const auto n = static_cast<int64_t>(prompt.size());
  ASSERT_GT(n, 12);
  const std::string path = ::testing::TempDir() + "snapshot_model_test_" + std::to_string(::getpid()) + ".kvsnap";
  // fp32 and the deterministic schemes (head_dim 32), with eviction that keeps state (h2o) and
  // that compresses at the prompt's end (snapkv), over fused and generic attention alike.
  for (const std::string scheme : {"fp32", "fp16", "bf16", "fp8:e4m3", "int8", "int4", "int2:g32:chan",
                                   "kivi:k2:v2:g16:r16", "had(int4)"}) {
    for (const std::string policy : {"full", "h2o@60%", "snapkv:w4@60%"}) {
      const std::string where = scheme + " + " + policy;
      auto cfg = lm.cache_config();
      cfg.scheme = scheme;
      cfg.policy = policy;
      CacheManager a(cfg);
      TorchCache ta(a);
      ta.reset(n + 24);
      at::Tensor logits = runner.prefill(prompt, ta, 8);
      std::vector<int64_t> fed;
      for (int i = 0; i < 4; ++i) {
        fed.push_back(greedy(logits));
        logits = runner.decode_step(fed.back(), ta);
      }
      a.save(path, lm.fingerprint());
      CacheManager b(cfg);  // context length 0: the snapshot's replaces it
      b.load(path, lm.fingerprint());
      TorchCache tb(b);
      EXPECT_EQ(tb.stats().bytes_resident, ta.stats().bytes_resident) << where;
      at::Tensor la = logits, lb = logits;
      for (int i = 0; i < 16; ++i) {
        const int64_t next = greedy(la);
        la = runner.decode_step(next, ta);
        lb = runner.decode_step(next, tb);
        ASSERT_TRUE(at::equal(la, lb)) << where << " decode step " << i << ": max |diff| "
                                       << (la - lb).abs().max().item<float>();
      }
      EXPECT_EQ(tb.stats().tokens_resident, ta.stats().tokens_resident) << where;
    }
  }
  std::remove(path.c_str());
}

TEST(SnapshotModel, FingerprintNamesConfigAndWeights) {
  const std::string pt = model_file("kvstudy-default.pt");
  const std::string other = model_file("kvstudy-long.pt");
  if (pt.empty() || other.empty()) GTEST_SKIP() << "models/kvstudy-default.pt or kvstudy-long.pt is absent";
  const CausalLM a = CausalLM::load(pt, LoadOptions{1});
  const CausalLM again = CausalLM::load(pt, LoadOptions{1});
  const CausalLM b = CausalLM::load(other, LoadOptions{1});
  EXPECT_THAT(a.fingerprint(), MatchesRegex("qwen2:config=[0-9a-f]{16}:weights=[0-9a-f]{16}"));
  EXPECT_EQ(a.fingerprint(), again.fingerprint());
  EXPECT_NE(a.fingerprint(), b.fingerprint());
  // A snapshot of one model is refused by a cache that names the other.
  auto cfg = a.cache_config();
  cfg.scheme = "int4";
  CacheManager m(cfg);
  std::ostringstream os;
  m.save(os, a.fingerprint());
  std::istringstream is(os.str());
  try {
    (void)m.load(is, b.fingerprint());
    ADD_FAILURE() << "loaded another model's snapshot";
  } catch (const SnapshotError& e) {
    EXPECT_EQ(e.reason(), SnapshotError::Reason::kOtherModel);
    EXPECT_THAT(e.what(), HasSubstr("written for model '" + a.fingerprint() + "'"));
  }
}

}  // namespace
}  // namespace kvcache
