// SPDX-License-Identifier: Apache-2.0
// Batched decode: decode tokens/s of N concurrent sequences (N = 1, 4, 16) of an exported model
// (the random Qwen2.5-0.5B-shape checkpoint of docs/performance.md, "Model runner") over one
// MultiSequenceCache, decoded together (Runner::decode_step_batch: one forward per step for
// the batch) and one at a time (Runner::decode_step per sequence per step), per quantizer.
//
//   bench_batch --model=PATH.pt [--quant=fp32,int4] [--threads=2] [--context=512] [--steps=16]
//               [benchmark flags]
//
//   bench_batch ... --shared=P   the N sequences share their first P tokens (prefix caching):
//               the first computes them, the others reuse its blocks; then also
//               Decode/<q>/batched_nocascade (attention per sequence, bit for bit attend()) beside
//               Decode/<q>/batched (shared-prefix "cascade" attention, the runner's default)
//
// Each sequence is pre-filled with `context - steps` tokens of random pre-RoPE K/V (decode
// cost does not depend on the cached values; a real prefill of N prompts would take minutes on
// 2 cores), its own values at its own length (sequence i holds context - steps - i tokens, so
// the batch is ragged). Then `steps` greedy decode steps per sequence; time = wall time of all
// of them, after one warm-up step. Counters:
//
//   tok_per_s      decoded tokens (N × steps) / wall seconds
//   tok_per_cpu_s  decoded tokens / process CPU seconds (all threads): the figure least
//                  disturbed by other processes on a shared machine
//   ms_per_step    wall ms of one step of the whole batch (one at a time: N single steps)
//   pool_MiB       peak pool bytes of the N sequences
//   attn_MiB_per_step  (batched) MiB of K/V blocks one step's attention reads, all layers
//                  (AttendBatchStats::bytes_read: a model of the reads, not a counter)
//
// CPU times are process CPU times (all threads). On a shared 2-core machine, two OpenMP threads
// stall at every barrier when other processes run: see docs/performance.md for the caveats.

#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_flags.h"
#include "kvcache/error.h"
#include "kvcache/model/causal_lm.h"
#include "kvcache/model/runner.h"
#include "kvcache/multi_sequence_cache.h"
#include "kvcache/torch/cache.h"
#include "kvcache/torch.h"

namespace {

using kvcache::CausalLM;
using kvcache::KVCache;
using kvcache::StepKind;

struct Settings {
  std::string model;
  std::vector<std::string> quants = {"fp32", "int4"};
  int threads = 2;
  int64_t context = 512;
  int64_t steps = 16;
  int64_t shared = 0;
};
Settings g_settings;
std::unique_ptr<CausalLM> g_model;
std::unique_ptr<kvcache::Runner> g_runner;

/// Fills every layer of `cache` with tokens [from, n) of random pre-RoPE K and V in one step.
void fill_random(KVCache& cache, int64_t from, int64_t n, uint64_t seed) {
  const auto& c = g_model->config();
  at::manual_seed(seed);
  const at::Tensor pos = at::arange(from, n, at::kLong);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    cache.append(l, at::randn({1, c.num_key_value_heads, n - from, c.head_dim}),
                 at::randn({1, c.num_key_value_heads, n - from, c.head_dim}), pos);
  }
  cache.end_step(StepKind::kPrefillEnd);
}

enum class Mode { kOneAtATime, kBatched, kBatchedNoCascade };

void BM_Decode(benchmark::State& state, const std::string& quant, Mode mode) {
  const bool batched = mode != Mode::kOneAtATime;
  const auto n = static_cast<size_t>(state.range(0));
  kvcache::MultiSequenceConfig mc;
  mc.model = g_model->cache_config();
  mc.model.scheme = quant;
  mc.model.policy = "full";
  mc.capacity_bytes = int64_t{32} << 30;
  mc.prefix_sharing = g_settings.shared > 0;
  kvcache::MultiSequenceCache pool(mc);
  std::vector<kvcache::TorchCache> faces;  // each sequence through its at::Tensor face (the runner's)
  faces.reserve(n);
  std::vector<KVCache*> seqs;
  const int64_t start = g_settings.context - g_settings.steps - 1;
  for (size_t i = 0; i < n; ++i) {
    faces.emplace_back(pool.add_sequence());
    kvcache::TorchCache& s = faces.back();
    const int64_t len = start - static_cast<int64_t>(i);
    int64_t cached = 0;
    if (g_settings.shared > 0) {
      // Token ids only key the prefix index here: the first `shared` are common, the rest the
      // sequence's own.
      std::vector<int64_t> prompt(static_cast<size_t>(len));
      for (int64_t t = 0; t < len; ++t) {
        prompt[static_cast<size_t>(t)] = t < g_settings.shared ? t : (int64_t{1} << 40) + static_cast<int64_t>(i) * len + t;
      }
      cached = s.begin_request(prompt, g_settings.context).cached_tokens;
    } else {
      s.reset(g_settings.context);
    }
    fill_random(s, cached, len, 1 + i);
    seqs.push_back(&s);
  }
  std::vector<int64_t> tokens(n, 1);
  kvcache::AttendBatchStats attn;
  int64_t batched_steps = 0;
  const auto step = [&]() {
    if (batched) {
      const at::Tensor next =
          g_runner->decode_step_batch(tokens, seqs, mode == Mode::kBatched, &attn).argmax(-1).contiguous();
      ++batched_steps;
      for (size_t i = 0; i < n; ++i) tokens[i] = next.data_ptr<int64_t>()[i];
    } else {
      for (size_t i = 0; i < n; ++i) tokens[i] = g_runner->decode_step(tokens[i], *seqs[i]).argmax().item<int64_t>();
    }
  };
  step();  // warm-up: TorchScript specialises the methods for the batch shape on first calls
  const auto t0 = std::chrono::steady_clock::now();
  const std::clock_t c0 = std::clock();
  for (auto _ : state) step();
  const double cpu = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto iters = static_cast<double>(state.iterations());
  state.counters["seqs"] = static_cast<double>(n);
  state.counters["tok_per_s"] = static_cast<double>(n) * iters / wall;
  state.counters["tok_per_cpu_s"] = static_cast<double>(n) * iters / cpu;
  state.counters["ms_per_step"] = wall * 1e3 / iters;
  state.counters["pool_MiB"] = static_cast<double>(pool.stats().bytes_in_use_peak) / (1024.0 * 1024.0);
  state.counters["threads"] = at::get_num_threads();
  if (batched_steps > 0) {
    state.counters["attn_MiB_per_step"] =
        static_cast<double>(attn.bytes_read) / static_cast<double>(batched_steps) / (1024.0 * 1024.0);
  }
}

void register_all() {
  for (const auto& q : g_settings.quants) {
    std::vector<std::pair<Mode, const char*>> modes = {{Mode::kBatched, "batched"}, {Mode::kOneAtATime, "one_at_a_time"}};
    if (g_settings.shared > 0) modes.insert(modes.begin() + 1, {Mode::kBatchedNoCascade, "batched_nocascade"});
    for (const auto& [mode, label] : modes) {
      const std::string name = "Decode/" + q + "/" + label;
      const Mode m = mode;
      benchmark::RegisterBenchmark(name.c_str(), [q, m](benchmark::State& s) { BM_Decode(s, q, m); })
          ->Arg(1)
          ->Arg(4)
          ->Arg(16)
          ->Iterations(g_settings.steps)
          ->UseRealTime()
          ->MeasureProcessCPUTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
}

using kvcache_bench::take_flag;

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    std::string v;
    if (take_flag(argv[i], "--model", &v)) {
      g_settings.model = v;
    } else if (take_flag(argv[i], "--quant", &v)) {
      g_settings.quants.clear();
      std::stringstream ss(v);
      for (std::string q; std::getline(ss, q, ',');) g_settings.quants.push_back(q);
    } else if (take_flag(argv[i], "--threads", &v)) {
      g_settings.threads = std::stoi(v);
    } else if (take_flag(argv[i], "--context", &v)) {
      g_settings.context = std::stoll(v);
    } else if (take_flag(argv[i], "--steps", &v)) {
      g_settings.steps = std::stoll(v);
    } else if (take_flag(argv[i], "--shared", &v)) {
      g_settings.shared = std::stoll(v);
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (g_settings.model.empty() || g_settings.quants.empty()) {
    std::fprintf(stderr,
                 "usage: %s --model=PATH.pt [--quant=fp32,int4] [--threads=2] [--context=512] [--steps=16] "
                 "[--shared=0] [benchmark flags]\n(see docs/performance.md, \"Model runner\", for producing the random "
                 "Qwen2.5-0.5B-shape export)\n",
                 argv[0]);
    return 2;
  }
  if (g_settings.steps < 1 || g_settings.context < g_settings.steps + 32) {
    std::fprintf(stderr, "--steps must be >= 1 and --context >= steps + 32\n");
    return 2;
  }
  if (g_settings.shared < 0 || g_settings.shared > g_settings.context - g_settings.steps - 32) {
    std::fprintf(stderr, "--shared=%lld: expected 0 (no shared prefix) to context - steps - 32 = %lld tokens\n",
                 static_cast<long long>(g_settings.shared),
                 static_cast<long long>(g_settings.context - g_settings.steps - 32));
    return 2;
  }
  try {
    g_model = std::make_unique<CausalLM>(CausalLM::load(g_settings.model, kvcache::LoadOptions{g_settings.threads}));
  } catch (const kvcache::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  g_runner = std::make_unique<kvcache::Runner>(*g_model);
  register_all();
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
