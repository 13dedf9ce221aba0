// SPDX-License-Identifier: Apache-2.0
// Model runner speed: prefill and decode tokens/s of an exported model (the random
// Qwen2.5-0.5B-shape checkpoint in docs/performance.md) through the managed CacheManager
// (--quant, default fp32; `full`) and through a bare concatenating cache (float32 K/V, at::
// attention) on the same runner; plus the GEMV
// shapes of single-token decode (linear vs matmul) that explain the decode figure.
//
//   bench_model --model=PATH.pt [--quant=fp32] [--threads=2] [--context=512] [--prefill=128] [--stream-gbps=21]
//               [benchmark flags]
//
// CPU times are process CPU times (all threads). Timings depend on the machine's load: on a
// shared 2-core machine, two OpenMP threads stall at every barrier when other processes run.
//
// Decode runs against a cache pre-filled with `context - 64` tokens of random K/V (decode cost
// does not depend on the cached values, and prefilling 448 real tokens of a 0.5B model would
// take minutes on 2 cores), then 64 single-token steps grow it to `context`.

#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "bench_flags.h"
#include "kvcache/cache_manager.h"
#include "kvcache/error.h"
#include "kvcache/model/causal_lm.h"
#include "kvcache/model/runner.h"
#include "kvcache/torch/cache.h"
#include "kvcache/torch.h"
#include "concat_kv_cache.h"

namespace {

using kvcache::TorchCache;
using kvcache::CausalLM;
using kvcache::KVCache;
using kvcache::StepKind;
using kvcache::bench::ConcatKVCache;

struct Settings {
  std::string model;
  std::string quant = "fp32";  ///< the managed cache's quantizer / scheme (--quant)
  int threads = 2;
  int64_t context = 512;
  int64_t prefill = 128;
  int64_t decode_steps = 64;
  double stream_gbps = 21.0;  ///< STREAM copy bandwidth of the machine (2 threads: 21 GB/s)
};
Settings g_settings;
std::unique_ptr<CausalLM> g_model;
std::unique_ptr<kvcache::Runner> g_runner;

double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) * 1024.0;  // ru_maxrss is in KiB on Linux
}

std::vector<int64_t> prompt_ids(int64_t n) {
  std::vector<int64_t> ids(static_cast<size_t>(n));
  const int64_t V = g_model->config().vocab_size;
  for (int64_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = (1009 * i + 17) % V;
  return ids;
}

enum class Kind { kManaged, kBare };

std::unique_ptr<KVCache> make_cache(Kind kind) {
  kvcache::CacheConfig c = g_model->cache_config();
  if (kind == Kind::kBare) return std::make_unique<ConcatKVCache>(std::move(c));
  c.scheme = g_settings.quant;
  c.policy = "full";
  return std::make_unique<TorchCache>(std::move(c));
}

/// Fills every layer with `n` tokens of random pre-RoPE K and V in one step.
void fill_random(KVCache& cache, int64_t n) {
  const auto& c = g_model->config();
  at::manual_seed(0);
  const at::Tensor pos = at::arange(n, at::kLong);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    cache.append(l, at::randn({1, c.num_key_value_heads, n, c.head_dim}),
                 at::randn({1, c.num_key_value_heads, n, c.head_dim}), pos);
  }
  cache.end_step(StepKind::kPrefillEnd);
}

void common_counters(benchmark::State& state) {
  state.counters["weight_MB"] = static_cast<double>(g_model->weight_bytes()) / 1e6;
  state.counters["peak_rss_MB"] = peak_rss_bytes() / 1e6;
  state.counters["threads"] = at::get_num_threads();
}

void BM_Prefill(benchmark::State& state, Kind kind) {
  const std::vector<int64_t> ids = prompt_ids(g_settings.prefill);
  auto cache = make_cache(kind);
  for (auto _ : state) {
    cache->reset(g_settings.context);
    at::Tensor logits = g_runner->prefill(ids, *cache, /*chunk_size=*/0);
    benchmark::DoNotOptimize(logits.data_ptr());
  }
  state.SetItemsProcessed(state.iterations() * g_settings.prefill);
  state.counters["tokens"] = static_cast<double>(g_settings.prefill);
  common_counters(state);
}

void BM_Decode(benchmark::State& state, Kind kind) {
  auto cache = make_cache(kind);
  const int64_t start = g_settings.context - g_settings.decode_steps;
  cache->reset(g_settings.context);
  fill_random(*cache, start);
  int64_t token = 1;
  // Warm-up: TorchScript's profiling executor specialises the methods on first calls.
  for (int i = 0; i < 2; ++i) token = g_runner->decode_step(token, *cache).argmax().item<int64_t>();
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) token = g_runner->decode_step(token, *cache).argmax().item<int64_t>();
  const double wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  state.SetItemsProcessed(state.iterations());
  state.counters["context_end"] = static_cast<double>(start + 2 + state.iterations());
  state.counters["ms_per_token"] = wall_ms / static_cast<double>(state.iterations());
  // Weight-bandwidth bound of one token at --stream-gbps (STREAM copy bandwidth).
  state.counters["bound_ms"] =
      static_cast<double>(g_model->weight_bytes()) / (g_settings.stream_gbps * 1e9) * 1e3;
  state.counters["x_bound"] = state.counters["ms_per_token"] / state.counters["bound_ms"];
  // Weight bytes streamed per token over the wall time of one token.
  state.counters["weight_GB_per_s"] = benchmark::Counter(
      static_cast<double>(g_model->weight_bytes()) * static_cast<double>(state.iterations()) / 1e9,
      benchmark::Counter::kIsRate);
  common_counters(state);
}

/// The cache's share of one decode step, without the model: per layer append one token
/// (which rotates its key through the export's `rope`) and attend one query; then end_step().
void BM_CacheStep(benchmark::State& state, Kind kind) {
  const auto& c = g_model->config();
  auto cache = make_cache(kind);
  const int64_t start = g_settings.context - g_settings.decode_steps;
  cache->reset(g_settings.context);
  fill_random(*cache, start);
  const at::Tensor k = at::randn({1, c.num_key_value_heads, 1, c.head_dim});
  const at::Tensor v = at::randn({1, c.num_key_value_heads, 1, c.head_dim});
  const at::Tensor q = at::randn({1, c.num_attention_heads, 1, c.head_dim});
  int64_t p = start;
  for (auto _ : state) {
    const at::Tensor pos = at::full({1}, p++, at::kLong);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      cache->append(l, k, v, pos);
      benchmark::DoNotOptimize(cache->attend(l, q, pos).data_ptr());
    }
    cache->end_step(StepKind::kDecode);
  }
  state.SetItemsProcessed(state.iterations());
}

/// One decode-shaped product y = W x with W [N, K] as at::linear(x[1, K], W) (what
/// nn.functional.linear runs for a single token) and as at::mv(W, x) (a true GEMV).
void BM_Gemv(benchmark::State& state, bool use_linear) {
  const int64_t N = state.range(0), K = state.range(1);
  const at::Tensor W = at::randn({N, K});
  const at::Tensor x = at::randn({K});
  for (auto _ : state) {
    at::Tensor y = use_linear ? at::linear(x.view({1, K}), W) : at::mv(W, x);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.counters["GB_per_s"] = benchmark::Counter(
      static_cast<double>(W.nbytes()) * static_cast<double>(state.iterations()) / 1e9,
      benchmark::Counter::kIsRate);
}

void register_all() {
  const int64_t steps = g_settings.decode_steps - 2;  // two warm-up steps
  const std::string managed = "managed_" + g_settings.quant;
  struct Row {
    const char* name;
    void (*fn)(benchmark::State&, Kind);
    benchmark::TimeUnit unit;
    int64_t iterations;
  };
  const Row rows[] = {{"Prefill", BM_Prefill, benchmark::kMillisecond, 2},
                      {"Decode", BM_Decode, benchmark::kMillisecond, steps},
                      {"CacheStep", BM_CacheStep, benchmark::kMicrosecond, g_settings.decode_steps}};
  for (const auto& r : rows) {
    for (Kind kind : {Kind::kManaged, Kind::kBare}) {
      const std::string name = std::string(r.name) + "/" + (kind == Kind::kManaged ? managed : "bare_concat");
      auto fn = r.fn;
      benchmark::RegisterBenchmark(name.c_str(), [fn, kind](benchmark::State& s) { fn(s, kind); })
          ->Unit(r.unit)
          ->Iterations(r.iterations)
          ->UseRealTime()
          ->MeasureProcessCPUTime();
    }
  }
  const auto& c = g_model->config();
  // The decode GEMVs of one layer and the lm_head of this model.
  for (bool lin : {true, false}) {
    auto* b = benchmark::RegisterBenchmark(lin ? "Gemv/linear_x1K_W" : "Gemv/mv_W_x",
                                           [lin](benchmark::State& s) { BM_Gemv(s, lin); });
    b->Args({c.intermediate_size, c.hidden_size})
        ->Args({c.hidden_size, c.intermediate_size})
        ->Args({c.num_attention_heads * c.head_dim, c.hidden_size})
        ->Args({c.vocab_size, c.hidden_size})
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->MeasureProcessCPUTime();
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
      g_settings.quant = v;
    } else if (take_flag(argv[i], "--threads", &v)) {
      g_settings.threads = std::stoi(v);
    } else if (take_flag(argv[i], "--context", &v)) {
      g_settings.context = std::stoll(v);
    } else if (take_flag(argv[i], "--stream-gbps", &v)) {
      g_settings.stream_gbps = std::stod(v);
    } else if (take_flag(argv[i], "--prefill", &v)) {
      g_settings.prefill = std::stoll(v);
    } else {
      rest.push_back(argv[i]);
    }
  }
  if (g_settings.model.empty()) {
    std::fprintf(stderr,
                 "usage: %s --model=PATH.pt [--threads=2] [--context=512] [--prefill=128] "
                 "[--stream-gbps=21] [benchmark flags]\n(see docs/performance.md, \"Model "
                 "runner\", for producing "
                 "the random Qwen2.5-0.5B-shape export)\n",
                 argv[0]);
    return 2;
  }
  if (g_settings.context <= g_settings.decode_steps + 2 || g_settings.prefill < 1) {
    std::fprintf(stderr, "--context must be > %lld and --prefill >= 1\n",
                 static_cast<long long>(g_settings.decode_steps + 2));
    return 2;
  }
  try {
    g_model = std::make_unique<CausalLM>(
        CausalLM::load(g_settings.model, kvcache::LoadOptions{g_settings.threads}));
  } catch (const kvcache::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  g_runner = std::make_unique<kvcache::Runner>(*g_model);
  // Warm-up: TorchScript's profiling executor profiles and optimises each method on its first
  // calls (per input shape), so the first benchmark would otherwise pay for it.
  {
    auto warm = make_cache(Kind::kBare);
    warm->reset(g_settings.context);
    int64_t token = g_runner->prefill(prompt_ids(g_settings.prefill), *warm, 0).argmax().item<int64_t>();
    for (int i = 0; i < 3; ++i) token = g_runner->decode_step(token, *warm).argmax().item<int64_t>();
  }
  register_all();
  int n = static_cast<int>(rest.size());
  benchmark::Initialize(&n, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::printf("peak RSS: %.1f MB; weights: %.1f MB\n", peak_rss_bytes() / 1e6,
              static_cast<double>(g_model->weight_bytes()) / 1e6);
  return 0;
}
