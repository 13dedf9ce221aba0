// SPDX-License-Identifier: Apache-2.0
// examples/llama2c_engine — the project's own engine, built by the ctest fixture
// install.llama2c_engine against the installed core alone and keeping its KV cache in
// libkvcache through the C API — generates, for fp32 + full, exactly the greedy tokens the
// TorchScript runner generates for the same model and prompt (the llama2.c checkpoint
// converted by tools/convert_llama2c.py and exported by tools/export_torchscript.py), over
// several prompts and both llama2.c models of ../shared/data; and its tokenizer (run.c's)
// encodes the golden prompt as the golden file says.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "kvcache/model/causal_lm.h"
#include "kvcache/model/runner.h"
#include "kvcache/torch.h"
#include "model_test_util.h"

namespace {

namespace t = kvcache::testing;
namespace fs = std::filesystem;
using kvcache::CacheConfig;
using kvcache::CausalLM;
using kvcache::GenerationOptions;
using kvcache::Runner;
using kvcache::TorchCache;

#ifndef KVCACHE_ENGINE_DIR
#error "KVCACHE_ENGINE_DIR: where the install.llama2c_engine fixture builds the engine (tests/CMakeLists.txt)"
#endif

std::string engine_path() { return std::string(KVCACHE_ENGINE_DIR) + "/build/llama2c_engine"; }

struct Model {
  std::string name, bin, tok;
  std::string skip, error;
  std::unique_ptr<CausalLM> lm;
};

/// The llama2.c checkpoint `dir/bin` + `dir/tok` converted and exported (cached across tests).
Model load(const std::string& name, const std::string& bin, const std::string& tok) {
  Model m;
  m.name = name;
  const std::string dir = t::shared_data() + "/models/" + name;
  m.bin = dir + "/" + bin;
  m.tok = dir + "/" + tok;
  if (!fs::is_regular_file(m.bin)) {
    m.skip = m.bin + " is absent";
    return m;
  }
  if (!fs::is_regular_file(engine_path())) {
    m.error = engine_path() + " was not built (the install.llama2c_engine fixture failed?)";
    return m;
  }
  std::string err;
  const std::string hf = t::cached_artifact(
      name + "-hf", t::tool_key("convert_llama2c.py", m.bin + m.tok),
      [&](const std::string& out) {
        return t::run_tool("convert_llama2c.py", t::quote(m.bin) + " " + t::quote(m.tok) + " " + t::quote(out),
                           out + ".log");
      },
      &err);
  if (hf.empty()) {
    m.error = err;
    return m;
  }
  const std::string pt = t::export_hf(hf, name + ".pt", &err);
  if (pt.empty()) {
    m.error = err;
    return m;
  }
  m.lm = std::make_unique<CausalLM>(CausalLM::load(pt, kvcache::LoadOptions{1}));
  return m;
}

/// The engine's `ids fp32 <prompt> | <generated>` line for `args`.
std::pair<std::vector<int64_t>, std::vector<int64_t>> engine_ids(const Model& m, const std::string& args) {
  const std::string cmd = t::quote(engine_path()) + " " + t::quote(m.bin) + " " + t::quote(m.tok) + " " + args +
                          " --schemes fp32 --policy full --print-ids 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> p(popen(cmd.c_str(), "r"), pclose);
  std::string out;
  char buf[4096];
  while (p && fgets(buf, sizeof buf, p.get()) != nullptr) out += buf;
  const size_t at = out.find("ids fp32 ");
  if (at == std::string::npos) {
    ADD_FAILURE() << cmd << "\n" << out;
    return {};
  }
  std::istringstream line(out.substr(at + 9, out.find('\n', at) - at - 9));
  std::string prompt, bar, gen;
  line >> prompt >> bar >> gen;
  auto parse = [](const std::string& s) {
    std::vector<int64_t> v;
    std::istringstream ss(s);
    for (std::string x; std::getline(ss, x, ',');) v.push_back(std::stoll(x));
    return v;
  };
  return {parse(prompt), parse(gen)};
}

std::vector<int64_t> runner_ids(const CausalLM& lm, const std::vector<int64_t>& prompt, int64_t n) {
  CacheConfig c = lm.cache_config();
  c.scheme = "fp32";
  c.policy = "full";
  TorchCache cache(std::move(c));
  GenerationOptions o;
  o.max_new_tokens = n;
  return Runner(lm).generate(prompt, o, cache).tokens;
}

TEST(EngineParity, Stories260KGreedyTokensEqualTheRunners) {
  static const Model m = load("stories260K", "stories260K.bin", "tok512.bin");
  if (!m.skip.empty()) GTEST_SKIP() << m.skip;
  ASSERT_EQ(m.error, "");
  // The golden prompt through the engine's own tokenizer: the golden ids, then the runner's tokens.
  const auto j = t::read_json(t::shared_data() + "/models/stories260K/golden_once_upon_a_time.json");
  const auto [prompt, gen] = engine_ids(m, "--prompt 'Once upon a time' --steps 60");
  EXPECT_EQ(prompt, j.at("prompt_ids").get<std::vector<int64_t>>());
  EXPECT_EQ(gen, runner_ids(*m.lm, prompt, 60));
  EXPECT_EQ(gen, j.at("greedy_ids").get<std::vector<int64_t>>());
  for (const std::string text : {"Lily and Ben went to the park", "The little dog", "One day, a big red ball"}) {
    const auto [p, g] = engine_ids(m, "--prompt " + t::quote(text) + " --steps 48");
    ASSERT_FALSE(p.empty()) << text;
    EXPECT_EQ(g, runner_ids(*m.lm, p, 48)) << text;
  }
}

TEST(EngineParity, BabyLlamaGreedyTokensEqualTheRunners) {
  static const Model m = load("babyllama-tok105", "model5000.bin", "tok105.bin");
  if (!m.skip.empty()) GTEST_SKIP() << m.skip;
  ASSERT_EQ(m.error, "");
  for (const std::string text : {"Once upon a time", "The sun was"}) {
    const auto [p, g] = engine_ids(m, "--prompt " + t::quote(text) + " --steps 100");
    ASSERT_FALSE(p.empty()) << text;
    EXPECT_EQ(g, runner_ids(*m.lm, p, 100)) << text;
  }
}

}  // namespace
