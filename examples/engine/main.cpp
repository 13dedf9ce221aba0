// An engine that keeps its KV cache in libkvcache: a decode loop over its own q/k/v (a toy
// 4-layer attention stack with random projections, Qwen2.5-0.5B head shapes — no model
// files), driven through the cache's three verbs per step: append / attend / end_step.
// For each cache format it prints what the cache stores and reserves, how much the
// process's resident set grew, the decode speed, and how far the final hidden state drifted
// from the fp32 cache's.
//
//   engine_example [prompt_tokens=2048] [new_tokens=128]
//
// The prompt is prefilled in chunks of 64 tokens, as engines do, so that the resident-set
// growth is the cache's and not the transient activations of one long prefill step.
#include <kvcache/cache_manager.h>
#include <kvcache/error.h>
#include <kvcache/study/process_memory.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

constexpr int64_t kLayers = 4, kHq = 14, kHkv = 2, kD = 64, kModel = 256;

/// Rotary embedding (rotate-half, theta 1e6) — the engine's own.
at::Tensor rope(const at::Tensor& x, const at::Tensor& positions) {
  const int64_t half = kD / 2;
  auto inv_freq = at::pow(1e6, -at::arange(0, half, at::kDouble) * 2.0 / static_cast<double>(kD));
  auto ang = positions.to(at::kDouble).unsqueeze(1) * inv_freq.unsqueeze(0);
  auto cos = at::cat({ang.cos(), ang.cos()}, 1).to(at::kFloat);
  auto sin = at::cat({ang.sin(), ang.sin()}, 1).to(at::kFloat);
  auto x1 = x.narrow(3, 0, half), x2 = x.narrow(3, half, half);
  return x * cos + at::cat({-x2, x1}, 3) * sin;
}

struct Layer {
  at::Tensor wq, wk, wv, wo;  // [kModel → heads·D], [heads·D → kModel]
};

/// [1, T, kModel] → [1, heads, T, D]
at::Tensor heads(const at::Tensor& h, const at::Tensor& w, int64_t n) {
  return at::matmul(h, w).view({1, h.size(1), n, kD}).transpose(1, 2).contiguous();
}

struct Result {
  kvcache::CacheStats stats;
  int64_t rss_growth = 0;
  double tokens_per_s = 0;
  at::Tensor last;
};

Result run(const std::string& quant, const std::vector<Layer>& layers, const at::Tensor& prompt, int64_t new_tokens) {
  kvcache::CacheConfig c;
  c.num_layers = kLayers;
  c.num_q_heads = kHq;
  c.num_kv_heads = kHkv;
  c.head_dim = kD;
  c.scheme = quant;
  c.policy = "full";
  c.rope = rope;
  kvcache::study::PeakRssProbe rss;
  rss.start();
  kvcache::CacheManager cache(c);
  const int64_t t0 = prompt.size(1);
  cache.reset(t0 + new_tokens);
  // One forward step of hidden states h [1, T, kModel] through every layer.
  auto step = [&](at::Tensor h, kvcache::StepKind kind) {
    const int64_t t = h.size(1), p0 = cache.next_position(0);
    const auto pos = at::arange(p0, p0 + t, at::kLong);
    for (int64_t l = 0; l < kLayers; ++l) {
      const Layer& w = layers[static_cast<size_t>(l)];
      const auto q = rope(heads(h, w.wq, kHq), pos);
      cache.append(l, heads(h, w.wk, kHkv), heads(h, w.wv, kHkv), pos);
      const auto o = cache.attend(l, q, pos);  // [1, H_q, T, D] from the stored blocks
      h = h + at::matmul(o.transpose(1, 2).reshape({1, t, kHq * kD}), w.wo);
      h = h / h.norm(2, -1, true) * std::sqrt(static_cast<double>(kModel));
    }
    cache.end_step(kind);
    return h.narrow(1, t - 1, 1);
  };
  at::Tensor h;
  for (int64_t p = 0; p < t0; p += 64) {
    const int64_t n = std::min<int64_t>(64, t0 - p);
    h = step(prompt.narrow(1, p, n), p + n == t0 ? kvcache::StepKind::kPrefillEnd : kvcache::StepKind::kPrefill);
  }
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < new_tokens; ++i) h = step(h, kvcache::StepKind::kDecode);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {cache.stats(), rss.peak_growth(), static_cast<double>(new_tokens) / secs, h};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const int64_t prompt_tokens = argc > 1 ? std::atoll(argv[1]) : 2048;
    const int64_t new_tokens = argc > 2 ? std::atoll(argv[2]) : 128;
    if (prompt_tokens < 1 || new_tokens < 1) {
      std::fprintf(stderr, "usage: %s [prompt_tokens >= 1] [new_tokens >= 1]\n", argv[0]);
      return 2;
    }
    at::set_num_threads(1);
    at::manual_seed(0);
    std::vector<Layer> layers;
    const double s = 1.0 / std::sqrt(static_cast<double>(kModel));
    for (int64_t l = 0; l < kLayers; ++l) {
      layers.push_back({at::randn({kModel, kHq * kD}) * s, at::randn({kModel, kHkv * kD}) * s,
                        at::randn({kModel, kHkv * kD}) * s, at::randn({kHq * kD, kModel}) * s * 0.3});
    }
    const at::Tensor prompt = at::randn({1, prompt_tokens, kModel});
    std::printf("%d layers, %lld query / %lld KV heads, head_dim %lld; %lld prompt + %lld new tokens\n",
                static_cast<int>(kLayers), static_cast<long long>(kHq), static_cast<long long>(kHkv),
                static_cast<long long>(kD), static_cast<long long>(prompt_tokens), static_cast<long long>(new_tokens));
    (void)run("fp32", layers, prompt, 1);  // warm-up: first-use allocations are not the cache's
    at::Tensor reference;
    for (const char* spec : {"fp32", "fp16", "int8", "int4:g32", "int2", "kivi:k2:v2:g32:r128"}) {
      const Result r = run(spec, layers, prompt, new_tokens);
      if (!reference.defined()) reference = r.last;
      const double values = static_cast<double>(r.stats.tokens_resident) * 2 * kHkv * kD;  // token-layers × K,V × heads × D
      const double drift = ((r.last - reference).norm() / reference.norm()).item<double>();
      std::printf("%-20s %6.2f bits/value  %9lld B stored  %9lld B reserved  RSS +%6.1f MB  %7.1f tok/s  "
                  "h drift vs fp32 %.4f\n",
                  spec, 8.0 * static_cast<double>(r.stats.bytes_resident) / values,
                  static_cast<long long>(r.stats.bytes_resident), static_cast<long long>(r.stats.bytes_reserved),
                  static_cast<double>(r.rss_growth) / 1e6, r.tokens_per_s, drift);
    }
    return 0;
  } catch (const kvcache::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
