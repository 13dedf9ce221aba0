// SPDX-License-Identifier: Apache-2.0
// Cost of one decode step of the CacheManager for one layer of Qwen2.5-0.5B shapes (H_q 14,
// H_kv 2, D 64, batch 1) at a steady state of T resident tokens: the budget is `@T`, so
// every step writes one token and evicts one (`full` and `snapkv` grow instead: SnapKV
// compresses at prefill only). The 2024–2026 scorers run in their every-step modes so that
// each step evicts one token: knorm/keydiff/expected `:stream`, adakv over expected:stream,
// duo with f0.5 (one of the two KV heads streams, the other keeps everything), and decode
// (every 512 decoded tokens back to T; run for exactly 1024 steps, so its end_step is the
// compression amortized over the interval). One step = append (RoPE through a cached cos/sin
// table, quantize, store) + attend (one query over the stored blocks; for h2o/tova it also
// hands the policy the step's attention mass, for expected the query rows) + end_step (plan,
// evict; the key/value scorers decode the layer's blocks through the LayerView here). Each
// part is timed on the thread's CPU clock; `evict_pct` = end_step / attend, the eviction cost
// against the attention it serves. Multiply by 24 layers for the whole model. One thread.
// BM_DecodeStep runs the step through the ATen face (TorchCache: at::Tensors in, a new output
// tensor per attend); BM_DecodeStepCore runs the same step through the core API
// (CacheManager::append/attend over views of the caller's buffers, one output buffer), on the
// same shapes in the same run: the cost of the face.
//
//   ./build/bench/bench_cache --benchmark_min_time=0.3
//   ./build/bench/bench_cache --benchmark_filter='h2o|tova|random' --benchmark_counters_tabular=true
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <ctime>
#include <cmath>
#include <string>
#include <vector>

#include "kvcache/cache_manager.h"
#include "kvcache/torch/cache.h"
#include "kvcache/torch.h"

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

double thread_cpu_us() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e6 + static_cast<double>(ts.tv_nsec) * 1e-3;
}

std::string policy_spec(const std::string& head, int64_t t) {
  const std::string b = "@" + std::to_string(t);
  if (head == "full") return "full";
  if (head == "random") return "random:seed1" + b;
  if (head == "snapkv") return "snapkv@" + std::to_string(4 * t);  // = context: no eviction
  if (head == "knorm" || head == "keydiff" || head == "expected") return head + ":stream" + b;
  if (head == "adakv") return "adakv:expected:stream" + b;
  if (head == "duo") return "duo:f0.5";  // a fraction of streaming heads, no budget
  if (head == "decode") return "decode:expected" + b;
  if (head == "perlayer") return "perlayer(h2o" + b + ")";  // one run over the one layer: h2o's cost + delegation
  return head + b;
}

/// One layer of Qwen2.5-0.5B shapes holding T resident tokens, for a context of 4T.
kvcache::CacheConfig one_layer_config(const std::string& quant, const std::string& policy, int64_t t) {
  kvcache::CacheConfig c;
  c.num_layers = 1;
  c.num_q_heads = kHq;
  c.num_kv_heads = kHkv;
  c.head_dim = kD;
  c.scheme = quant;
  c.policy = policy;
  c.rope = kvcache::rope_from(rope);
  c.context_length = 4 * t;
  return c;
}

void BM_DecodeStep(benchmark::State& state, const std::string& quant, const std::string& policy, bool core) {
  at::set_num_threads(1);
  const int64_t t = state.range(0);
  kvcache::TorchCache m(one_layer_config(quant, policy_spec(policy, t), t));
  // Prefill exactly T tokens (no eviction), observing one query row per chunk.
  const int64_t chunk = 4096;
  for (int64_t p = 0; p < t; p += chunk) {
    const int64_t n = std::min(chunk, t - p);
    m.append(0, at::randn({1, kHkv, n, kD}), at::randn({1, kHkv, n, kD}), at::arange(p, p + n, at::kLong));
    if (m.policy().needs_attention()) m.observe_attention(0, at::softmax(at::randn({1, kHq, 1, p + n}), -1));
    if (m.policy().query_need().any()) m.observe_queries(0, at::randn({1, kHq, n, kD}), at::arange(p, p + n, at::kLong));
    m.end_step(p + n >= t ? kvcache::StepKind::kPrefillEnd : kvcache::StepKind::kPrefill);
  }
  auto k1 = at::randn({1, kHkv, 1, kD}), v1 = at::randn({1, kHkv, 1, kD}), q1 = at::randn({1, kHq, 1, kD});
  // The core API's arguments: the caller's own buffers, viewed.
  std::vector<float> kb(k1.data_ptr<float>(), k1.data_ptr<float>() + kHkv * kD);
  std::vector<float> vb(v1.data_ptr<float>(), v1.data_ptr<float>() + kHkv * kD);
  std::vector<float> qb(q1.data_ptr<float>(), q1.data_ptr<float>() + kHq * kD), out(kHq * kD);
  int64_t pos = t, core_pos = 0;
  const kvcache::TensorView kv(kb.data(), {1, kHkv, 1, kD}), vv(vb.data(), {1, kHkv, 1, kD}),
      qv(qb.data(), {1, kHq, 1, kD}), pv(&core_pos, {1});
  const kvcache::MutableTensorView ov(out.data(), {1, kHq, 1, kD});
  double append_us = 0, attend_us = 0, end_us = 0;
  for (auto _ : state) {
    double t0 = 0, t1 = 0, t2 = 0;
    if (core) {
      core_pos = pos++;
      t0 = thread_cpu_us();
      m.core().append(0, kv, vv, pv);
      t1 = thread_cpu_us();
      m.core().attend(0, qv, pv, ov);
      benchmark::DoNotOptimize(out.data());
      t2 = thread_cpu_us();
    } else {
      const auto p = at::full({1}, pos++, at::kLong);
      t0 = thread_cpu_us();
      m.append(0, k1, v1, p);
      t1 = thread_cpu_us();
      benchmark::DoNotOptimize(m.attend(0, q1, p).data_ptr());
      t2 = thread_cpu_us();
    }
    m.end_step(kvcache::StepKind::kDecode);
    const double t3 = thread_cpu_us();
    append_us += t1 - t0;
    attend_us += t2 - t1;
    end_us += t3 - t2;
  }
  const double n = static_cast<double>(state.iterations());
  const auto s = m.stats();
  const double resident = static_cast<double>(m.tokens(0).max_resident());
  state.counters["resident"] = resident;
  state.counters["append_us"] = append_us / n;
  state.counters["attend_us"] = attend_us / n;
  state.counters["end_step_us"] = end_us / n;
  state.counters["evict_pct"] = 100.0 * end_us / attend_us;
  state.counters["B_per_token"] = static_cast<double>(s.bytes_resident) / resident;
  state.counters["reserved_per_token"] = static_cast<double>(s.bytes_reserved) / resident;
}

// KVzip's context replay (docs/policies.md): its cost is not per decode step (kvzip decodes as
// `full` does, so it has no BM_DecodeStep row) but one extra prefill per request. One replay step
// of 512 tokens over T resident tokens of one layer: begin_replay + append (held aside) + attend
// (plain per-head softmax over the decoded blocks and the chunk, the max-reduced mass to the
// policy) + end_step(kReplay) (drops the chunk). `us_per_replay_token` = the step / 512.
void BM_ReplayStep(benchmark::State& state, const std::string& quant) {
  at::set_num_threads(1);
  const int64_t t = state.range(0), chunk = 512;
  // Budget = the context: the replay scores, nothing is evicted.
  kvcache::TorchCache m(one_layer_config(quant, "kvzip@" + std::to_string(4 * t), t));
  m.append(0, at::randn({1, kHkv, t, kD}), at::randn({1, kHkv, t, kD}), at::arange(0, t, at::kLong));
  m.end_step(kvcache::StepKind::kPrefillEnd);
  const auto k = at::randn({1, kHkv, chunk, kD}), v = at::randn({1, kHkv, chunk, kD});
  const auto q = at::randn({1, kHq, chunk, kD});
  const auto pos = at::arange(t, t + chunk, at::kLong);
  double us = 0;
  for (auto _ : state) {
    const double t0 = thread_cpu_us();
    m.begin_replay();
    m.append(0, k, v, pos);
    benchmark::DoNotOptimize(m.attend(0, q, pos).data_ptr());
    m.end_step(kvcache::StepKind::kReplay);
    us += thread_cpu_us() - t0;
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["resident"] = static_cast<double>(m.tokens(0).max_resident());
  state.counters["replay_step_us"] = us / n;
  state.counters["us_per_replay_token"] = us / n / static_cast<double>(chunk);
}

void register_all() {
  const std::vector<std::string> quants = {"fp16", "int8", "int4", "kivi:k2:v2:g32:r128"};
  const std::vector<std::string> policies = {"full",  "window",  "sink",     "h2o", "random", "snapkv", "tova",
                                               "knorm", "keydiff", "expected", "adakv", "duo",   "decode",
                                               "perlayer"};
  for (const auto& q : quants) {
    for (const auto& p : policies) {
      for (const bool core : {false, true}) {
        // The core API beside the face for the policies whose step is mostly attention.
        if (core && p != "full" && p != "window" && p != "h2o") continue;
        auto* b = benchmark::RegisterBenchmark(((core ? "BM_DecodeStepCore/" : "BM_DecodeStep/") + q + "/" + p).c_str(),
                                               [q, p, core](benchmark::State& s) { BM_DecodeStep(s, q, p, core); })
                      ->Arg(4096)
                      ->Arg(32768)
                      ->Unit(benchmark::kMicrosecond);
        // decode compresses every 512 steps: exactly two compressions, amortized over the interval.
        if (p == "decode") b->Iterations(1024);
      }
    }
  }
  for (const std::string q : {"fp16", "int8"}) {
    benchmark::RegisterBenchmark(("BM_ReplayStep/" + q + "/kvzip").c_str(),
                                 [q](benchmark::State& s) { BM_ReplayStep(s, q); })
        ->Arg(4096)
        ->Arg(32768)
        ->Unit(benchmark::kMillisecond);
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
