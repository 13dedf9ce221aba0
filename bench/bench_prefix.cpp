// SPDX-License-Identifier: Apache-2.0
// Many requests over one MultiSequenceCache, with and without prefix sharing, at Qwen2.5-0.5B
// shapes (24 layers, H_q 14, H_kv 2, D 64): N concurrent requests whose prompts are one
// 2048-token prefix plus 256 tokens of their own. One iteration = the whole workload: each
// request in turn begins (begin_request: the prefix index lookup), stores the K/V of the
// prompt tokens it computes in one prefill step per layer (append + end_step; with sharing,
// every request after the first computes only its 256), then all N run one decode step (append
// one token + attend one query over its 2305 tokens + end_step, every layer). The model's
// forward is not run: the time is the cache's own work, and `prefill_tokens` is the forward
// work sharing saves on top (tokens the requests compute). One thread.
//
//   pool_MiB        peak pool bytes (blocks of every request and of the prefix index), MiB
//   MiB_per_req     pool_MiB / N
//   prefill_tokens  Σ prompt tokens the requests computed (Σ prompt tokens without sharing)
//   hit_rate        prompt tokens reused / prompt tokens queried
//   sharing_ratio   Σ logical tokens / unique resident tokens, after the decode step
//
//   ./build/bench/bench_prefix --benchmark_counters_tabular=true
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <memory>
#include <string>
#include <vector>

#include "kvcache/multi_sequence_cache.h"
#include "kvcache/torch/cache.h"
#include "kvcache/torch.h"

namespace {

constexpr int64_t kLayers = 24, kHq = 14, kHkv = 2, kD = 64;
constexpr int64_t kPrefix = 2048, kOwn = 256, kPrompt = kPrefix + kOwn;

/// Qwen2 RoPE (theta 1e6), computed per call (keys are stored post-RoPE; a runner would use a table).
at::Tensor rope(const at::Tensor& x, const at::Tensor& positions) {
  const int64_t half = kD / 2;
  const auto inv_freq = at::pow(1000000.0, -at::arange(0, half, at::kDouble) * 2.0 / static_cast<double>(kD));
  const auto ang = (positions.to(at::kDouble).unsqueeze(1) * inv_freq.unsqueeze(0)).to(at::kFloat);
  const auto cos = at::cat({ang.cos(), ang.cos()}, 1), sin = at::cat({ang.sin(), ang.sin()}, 1);
  auto x1 = x.narrow(3, 0, half), x2 = x.narrow(3, half, half);
  return x * cos + at::cat({-x2, x1}, 3) * sin;
}

/// K and V rows of the workload, made once: the shared prefix per layer, one request's own
/// tokens (every request stores the same values under its own token ids: the cache never
/// looks at values), and one decode token.
struct Data {
  std::vector<at::Tensor> k, v;  ///< [1, H_kv, kPrompt, D] per layer
  at::Tensor k1, v1, q1;
  Data() {
    at::manual_seed(0);
    for (int64_t l = 0; l < kLayers; ++l) {
      k.push_back(at::randn({1, kHkv, kPrompt, kD}));
      v.push_back(at::randn({1, kHkv, kPrompt, kD}));
    }
    k1 = at::randn({1, kHkv, 1, kD});
    v1 = at::randn({1, kHkv, 1, kD});
    q1 = at::randn({1, kHq, 1, kD});
  }
};

const Data& data() {
  static const Data d;
  return d;
}

void BM_SharedPrefix(benchmark::State& state, const std::string& quant, bool sharing) {
  at::set_num_threads(1);
  const int64_t n = state.range(0);
  const Data& d = data();
  kvcache::MultiSequenceConfig cfg;
  cfg.model.num_layers = kLayers;
  cfg.model.num_q_heads = kHq;
  cfg.model.num_kv_heads = kHkv;
  cfg.model.head_dim = kD;
  cfg.model.scheme = quant;
  cfg.model.policy = "full";
  cfg.model.rope = kvcache::rope_from(rope);
  cfg.capacity_bytes = int64_t{16} << 30;
  cfg.prefix_sharing = sharing;
  std::vector<std::vector<int64_t>> prompts(static_cast<size_t>(n));
  for (int64_t r = 0; r < n; ++r) {
    auto& p = prompts[static_cast<size_t>(r)];
    for (int64_t i = 0; i < kPrefix; ++i) p.push_back(i);
    for (int64_t i = 0; i < kOwn; ++i) p.push_back(100000 + r * kOwn + i);
  }
  kvcache::PoolStats st;
  kvcache::PrefixCounters ct;
  int64_t computed = 0;
  for (auto _ : state) {
    kvcache::MultiSequenceCache cache(cfg);
    std::vector<kvcache::Sequence*> seqs;
    computed = 0;
    for (int64_t r = 0; r < n; ++r) {
      kvcache::Sequence& s = cache.add_sequence();
      const kvcache::PrefixReuse reuse = s.begin_request(prompts[static_cast<size_t>(r)], kPrompt + 1);
      const int64_t from = reuse.cached_tokens, t = kPrompt - from;
      const at::Tensor pos = at::arange(from, kPrompt, at::kLong);
      for (int64_t l = 0; l < kLayers; ++l) {
        s.append(l, d.k[static_cast<size_t>(l)].narrow(2, from, t), d.v[static_cast<size_t>(l)].narrow(2, from, t), pos);
      }
      s.end_step(kvcache::StepKind::kPrefillEnd);
      computed += t;
      seqs.push_back(&s);
    }
    const at::Tensor p1 = at::full({1}, kPrompt, at::kLong);
    for (kvcache::Sequence* s : seqs) {
      for (int64_t l = 0; l < kLayers; ++l) {
        s->append(l, d.k1, d.v1, p1);
        benchmark::DoNotOptimize(kvcache::TorchCache(*s).attend(l, d.q1, p1).data_ptr());
      }
      s->end_step(kvcache::StepKind::kDecode);
    }
    state.PauseTiming();
    st = cache.stats();
    ct = cache.counters();
    state.ResumeTiming();
  }
  const double mib = static_cast<double>(st.bytes_in_use_peak) / (1024.0 * 1024.0);
  state.counters["pool_MiB"] = mib;
  state.counters["MiB_per_req"] = mib / static_cast<double>(n);
  state.counters["prefill_tokens"] = static_cast<double>(computed);
  state.counters["hit_rate"] = ct.hit_rate();
  state.counters["sharing_ratio"] = st.sharing_ratio;
}

void register_all() {
  const std::vector<std::string> quants = {"fp32", "fp16", "int8", "int4", "kivi:k2:v2:g32:r128"};
  for (const auto& q : quants) {
    for (bool sharing : {false, true}) {
      benchmark::RegisterBenchmark(("BM_SharedPrefix/" + q + (sharing ? "/shared" : "/private")).c_str(),
                                   [q, sharing](benchmark::State& s) { BM_SharedPrefix(s, q, sharing); })
          ->Arg(1)
          ->Arg(4)
          ->Arg(16)
          ->Iterations(1)
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
