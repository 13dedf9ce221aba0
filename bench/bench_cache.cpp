// SPDX-License-Identifier: Apache-2.0
// Cost of one decode step of the CacheManager (append + get + observe_attention when the
// policy needs it + end_step) for one layer of Qwen2.5-0.5B shapes (H_q 14, H_kv 2, D 64)
// at a steady state of T resident tokens (the budget is T, so every step writes one token
// and evicts one), beside the attention that step serves (q·Kᵀ, softmax, ·V with at:: ops).
// Multiply by 24 layers for the whole model. Single-threaded (at::set_num_threads(1)).
//
//   ./build/bench/bench_cache --benchmark_min_time=0.3
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <ctime>
#include <cmath>
#include <string>
#include <vector>

#include "kvcache/cache_manager.h"

namespace {

constexpr int64_t kHq = 14, kHkv = 2, kD = 64;

/// Qwen2 RoPE (theta 1e6) with cos/sin tables precomputed once, as a model runner has them.
at::Tensor rope(const at::Tensor& x, const at::Tensor& positions) {
  static const auto tables = [] {
    const int64_t half = kD / 2, max_pos = 1 << 17;
    auto inv_freq = at::pow(1000000.0, -at::arange(0, half, at::kDouble) * 2.0 / static_cast<double>(kD));
    auto ang = at::arange(max_pos, at::kDouble).unsqueeze(1) * inv_freq.unsqueeze(0);
    return std::make_pair(at::cat({ang.cos(), ang.cos()}, 1).to(at::kFloat),
                          at::cat({ang.sin(), ang.sin()}, 1).to(at::kFloat));
  }();
  auto cos = tables.first.index_select(0, positions), sin = tables.second.index_select(0, positions);
  const int64_t half = kD / 2;
  auto x1 = x.narrow(3, 0, half), x2 = x.narrow(3, half, half);
  return x * cos + at::cat({-x2, x1}, 3) * sin;
}

/// The attention one decode step computes over T keys: q [1, H_kv, G, D] against
/// K, V [1, H_kv, T, D] (GQA without copying K/V).
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  auto logits = at::matmul(q, k.transpose(2, 3)) / std::sqrt(static_cast<double>(kD));
  return at::matmul(at::softmax(logits, -1), v);
}

double attention_us(int64_t t) {
  auto q = at::randn({1, kHkv, kHq / kHkv, kD});
  auto k = at::randn({1, kHkv, t, kD}), v = at::randn({1, kHkv, t, kD});
  for (int i = 0; i < 3; ++i) benchmark::DoNotOptimize(attention(q, k, v).data_ptr());
  // Process CPU time (one thread), comparable to the benchmark's CPU column on a shared box.
  const int reps = 20;
  const std::clock_t t0 = std::clock();
  for (int i = 0; i < reps; ++i) benchmark::DoNotOptimize(attention(q, k, v).data_ptr());
  const std::clock_t t1 = std::clock();
  return 1e6 * static_cast<double>(t1 - t0) / CLOCKS_PER_SEC / reps;
}

std::string policy_spec(const std::string& head, int64_t t) {
  const std::string b = "@" + std::to_string(t);
  if (head == "full") return "full";
  if (head == "random") return "random:seed1" + b;
  if (head == "snapkv") return "snapkv@" + std::to_string(4 * t);  // = context: no eviction
  return head + b;
}

void BM_Attention(benchmark::State& state) {
  at::set_num_threads(1);
  const int64_t t = state.range(0);
  auto q = at::randn({1, kHkv, kHq / kHkv, kD});
  auto k = at::randn({1, kHkv, t, kD}), v = at::randn({1, kHkv, t, kD});
  for (auto _ : state) benchmark::DoNotOptimize(attention(q, k, v).data_ptr());
  state.counters["resident"] = static_cast<double>(t);
}

void BM_DecodeStep(benchmark::State& state, const std::string& quant, const std::string& policy) {
  at::set_num_threads(1);
  const int64_t t = state.range(0);
  kvcache::CacheConfig c;
  c.num_layers = 1;
  c.num_q_heads = kHq;
  c.num_kv_heads = kHkv;
  c.head_dim = kD;
  c.quant = quant;
  c.policy = policy_spec(policy, t);
  c.rope = rope;
  c.context_length = 4 * t;
  kvcache::CacheManager m(c);
  // Prefill exactly T tokens (no eviction), observing one query row per chunk.
  const int64_t chunk = 4096;
  for (int64_t p = 0; p < t; p += chunk) {
    const int64_t n = std::min(chunk, t - p);
    m.append(0, at::randn({1, kHkv, n, kD}), at::randn({1, kHkv, n, kD}), at::arange(p, p + n, at::kLong));
    if (m.needs_attention()) m.observe_attention(0, at::softmax(at::randn({1, kHq, 1, p + n}), -1));
    m.end_step(p + n >= t);
  }
  const bool grows = policy == "full" || policy == "snapkv";
  auto probs = at::softmax(at::randn({1, kHq, 1, t + 1}), -1);
  auto k1 = at::randn({1, kHkv, 1, kD}), v1 = at::randn({1, kHkv, 1, kD});
  int64_t pos = t;
  for (auto _ : state) {
    m.append(0, k1, v1, at::full({1}, pos++, at::kLong));
    auto kv = m.get(0);
    benchmark::DoNotOptimize(kv.k.data_ptr());
    if (m.needs_attention()) m.observe_attention(0, grows ? at::softmax(at::randn({1, kHq, 1, kv.k.size(2)}), -1) : probs);
    m.end_step();
  }
  state.counters["resident"] = static_cast<double>(m.physical_length(0));
  state.counters["attn_us"] = attention_us(t);
  state.counters["bytes_per_token"] =
      static_cast<double>(m.stats().bytes_resident) / static_cast<double>(m.physical_length(0));
}

void register_all() {
  benchmark::RegisterBenchmark("BM_Attention", BM_Attention)->Arg(4096)->Arg(32768)->Unit(benchmark::kMicrosecond);
  const std::vector<std::string> quants = {"fp16", "int8", "int4", "kivi:k2:v2:g32:r128"};
  const std::vector<std::string> policies = {"full", "window", "sink", "h2o", "random", "snapkv", "tova"};
  for (const auto& q : quants) {
    for (const auto& p : policies) {
      benchmark::RegisterBenchmark(("BM_DecodeStep/" + q + "/" + p).c_str(),
                                   [q, p](benchmark::State& s) { BM_DecodeStep(s, q, p); })
          ->Arg(4096)
          ->Arg(32768)
          ->Unit(benchmark::kMicrosecond);
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
