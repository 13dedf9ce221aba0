// SPDX-License-Identifier: Apache-2.0
// The models the Runner tests run (tests/runner_test.cpp, tests/runner_batch_test.cpp): built once
// per process from ../shared/data through the project's tools (tool outputs are cached across
// processes), and the small helpers both files use.
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/model/causal_lm.h"
#include "kvcache/model/runner.h"
#include "kvcache/torch.h"
#include "model_test_util.h"

namespace kvcache::runner_testing {

using ::testing::HasSubstr;
namespace t = kvcache::testing;

// ----------------------------------------------------------------------------------------
// Models, built once per process (tool outputs are cached across processes).

struct Golden {
  std::vector<int64_t> prompt_ids, greedy_ids;
  nlohmann::json logits, kv;
};

struct TestModel {
  std::string skip;   ///< why the model is unavailable ("" = available)
  std::string error;  ///< a tool failed
  std::unique_ptr<CausalLM> lm;
  std::vector<int64_t> prompt;  ///< a prompt for the generic tests
};

inline Golden read_golden(const std::string& model_dir) {
  const auto j = t::read_json(model_dir + "/golden_once_upon_a_time.json");
  return Golden{j.at("prompt_ids").get<std::vector<int64_t>>(),
                j.at("greedy_ids").get<std::vector<int64_t>>(), j.at("logits"),
                j.at("kv_cache_prompt")};
}

inline TestModel make_model(const std::function<std::string(std::string*)>& export_fn,
                     std::vector<int64_t> prompt) {
  TestModel m;
  if (!t::have_shared_data()) {
    m.skip = "../shared/data is absent";
    return m;
  }
  const std::string pt = export_fn(&m.skip);
  if (!m.skip.empty() || pt.empty()) {
    if (m.skip.rfind("SKIP:", 0) != 0) m.error = m.skip, m.skip.clear();
    return m;
  }
  // One thread: tests are not about speed, and two OpenMP threads on a loaded 2-core machine
  // stall at every barrier (60 tokens of a 260K model: 0.1 s on 1 thread, up to 14 s on 2).
  m.lm = std::make_unique<CausalLM>(CausalLM::load(pt, LoadOptions{1}));
  m.prompt = std::move(prompt);
  return m;
}

inline std::string tinystories_dir() { return t::shared_data() + "/models/tinystories-656k"; }
inline std::string stories260k_dir() { return t::shared_data() + "/models/stories260K"; }

inline const TestModel& tinystories() {
  static const TestModel m = make_model(
      [](std::string* err) -> std::string {
        if (!t::have_tool("export_torchscript.py"))
          return *err = "SKIP: tools/export_torchscript.py absent", "";
        return t::export_hf(tinystories_dir(), "ts656k.pt", err);
      },
      {1, 80, 147, 201, 282, 57, 8, 1137, 117, 1513, 101, 87, 1076, 1005, 361, 1377, 436});
  return m;
}

inline const TestModel& stories260k() {
  static const TestModel m = make_model(
      [](std::string* err) -> std::string {
        if (!t::have_tool("convert_llama2c.py") || !t::have_tool("export_torchscript.py"))
          return *err = "SKIP: tools/convert_llama2c.py or export_torchscript.py absent", "";
        const std::string src = stories260k_dir();
        const std::string hf = t::cached_artifact(
            "stories260K-hf", t::tool_key("convert_llama2c.py", src),
            [&](const std::string& out) {
              return t::run_tool("convert_llama2c.py",
                                 t::quote(src + "/stories260K.bin") + " " +
                                     t::quote(src + "/tok512.bin") + " " + t::quote(out),
                                 out + ".log");
            },
            err);
        if (hf.empty()) return "";
        return t::export_hf(hf, "stories260K.pt", err);
      },
      {1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338});
  return m;
}

/// Random-weight checkpoint of Qwen2.5-0.5B-Instruct's exact config with fewer layers
/// (`layers`), exported.
inline const TestModel& qwen_random(int layers) {
  static std::map<int, std::unique_ptr<TestModel>> models;
  auto& slot = models[layers];
  if (!slot) {
    slot = std::make_unique<TestModel>(make_model(
        [layers](std::string* err) -> std::string {
          if (!t::have_tool("make_random_checkpoint.py") || !t::have_tool("export_torchscript.py"))
            return *err = "SKIP: tools/make_random_checkpoint.py or export_torchscript.py absent",
                   "";
          const std::string args =
              "--config " +
              t::quote(t::shared_data() + "/models/qwen2.5-0.5b-instruct/config.json") +
              " --tokenizer-dir " + t::quote(t::shared_data() + "/tokenizers/qwen2") +
              " --seed 0 --dtype bf16 --num-layers " + std::to_string(layers);
          const std::string ck = t::cached_artifact(
              "qwen-random-l" + std::to_string(layers),
              t::tool_key("make_random_checkpoint.py", args),
              [&](const std::string& out) {
                return t::run_tool("make_random_checkpoint.py", t::quote(out) + " " + args,
                                   out + ".log");
              },
              err);
          if (ck.empty()) return "";
          return t::export_hf(ck, "qwen-random-l" + std::to_string(layers) + ".pt", err);
        },
        // Arbitrary ids inside the Qwen2 vocabulary (no tokenizer needed here).
        {151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 151645, 198}));
  }
  return *slot;
}

#define REQUIRE_MODEL(m)                             \
  do {                                               \
    if (!(m).skip.empty()) GTEST_SKIP() << (m).skip; \
    ASSERT_EQ((m).error, "");                        \
    ASSERT_TRUE((m).lm != nullptr);                  \
  } while (0)

inline at::Tensor to_tensor(const nlohmann::json& j) {
  return at::tensor(j.get<std::vector<float>>(), at::kFloat);
}

inline double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

inline std::vector<int64_t> concat(std::vector<int64_t> a, const std::vector<int64_t>& b, size_t n) {
  a.insert(a.end(), b.begin(), b.begin() + static_cast<std::ptrdiff_t>(std::min(n, b.size())));
  return a;
}

inline at::Tensor ids_tensor(const int64_t* ids, int64_t n) {
  return at::tensor(at::ArrayRef<int64_t>(ids, static_cast<size_t>(n)), at::kLong).view({1, n});
}

inline TorchCache fp32_full_cache(const CausalLM& lm) {
  CacheConfig c = lm.cache_config();
  c.scheme = "fp32";
  c.policy = "full";
  return TorchCache(std::move(c));
}

inline GenerationOptions greedy(int64_t n, int64_t chunk = 0) {
  GenerationOptions o;
  o.max_new_tokens = n;
  o.prefill_chunk = chunk;
  o.keep_logits = true;
  return o;
}


struct ModelParam {
  const char* name;
  const TestModel& (*get)();
};

inline void PrintTo(const ModelParam& p, std::ostream* os) { *os << p.name; }

inline const TestModel& qwen_random_2l() { return qwen_random(2); }

inline void expect_control_arm(const TestModel& m) {
  // fp32 cache + `full` policy: 64 greedy tokens through the managed cache equal greedy
  // decoding with the unmanaged `forward`. Checked by teacher forcing: one forward over
  // prompt + the 64 managed tokens; the managed token i must be the argmax of the forward's
  // logits at position P - 1 + i (by induction, the unmanaged greedy loop then produces the
  // same 64 tokens), and the managed logits must agree within 1e-4.
  GenerationOptions o = greedy(64);
  o.stop_at_eos = false;
  TorchCache cache = fp32_full_cache(*m.lm);
  const GenerationResult r = Runner(*m.lm).generate(m.prompt, o, cache);
  ASSERT_EQ(r.tokens.size(), 64u);
  const auto P = static_cast<int64_t>(m.prompt.size());
  const std::vector<int64_t> seq = concat(m.prompt, r.tokens, 63);
  const at::Tensor ref =
      m.lm->forward(ids_tensor(seq.data(), static_cast<int64_t>(seq.size())))[0];
  const at::Tensor ref_rows = ref.slice(0, P - 1, P + 63);
  EXPECT_LT(max_abs_diff(r.logits, ref_rows), 1e-4);
  const at::Tensor ref_ids = ref_rows.argmax(-1);
  for (int64_t i = 0; i < 64; ++i) {
    ASSERT_EQ(r.tokens[static_cast<size_t>(i)], ref_ids[i].item<int64_t>()) << "token " << i;
  }
}

class RunnerModels : public ::testing::TestWithParam<ModelParam> {};

}  // namespace kvcache::runner_testing
