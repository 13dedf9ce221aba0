// SPDX-License-Identifier: Apache-2.0
// Long-context decode attention from the stored blocks, against the float32 path, and the
// memory a cache really takes. Qwen2.5-0.5B shapes: 24 layers, 14 query heads, 2 KV heads,
// head_dim 64; one decode query per step; the step cycles through a ring of layers' caches so
// no layer stays in the CPU caches (the data comes from memory, as in a real decode step): at
// least the model's 24 layers, and as many more as it takes for the ring to hold
// --ring_bytes (default: twice the last-level cache; a 4-bit cache of 24 layers is 113 MB at
// 32k tokens and 14 MB at 4k, which a 480 MiB or a 32 MiB L3 would serve from the cache). The
// counter `ring_layers` says how many a case cycled through. The cases of one spec and T run
// next to each other (threads 1, then 2) so that each ring is filled once.
//
//   BM_Attend/<spec>/<T>/<threads>  attend() over T resident tokens per layer through the ATen
//                                   face (TorchCache::attend: at::Tensor q in, a new at::Tensor out;
//                                   the fused kernels where the CPU has them)
//   BM_AttendCore/<spec>/<T>/<threads>  the same call through the core API (CacheManager::attend:
//                                   views of the caller's q and output buffer, no allocation),
//                                   run next to BM_Attend on the same cache: the cost of the face
//   BM_AttendGeneric/<spec>/<T>/<threads>  the same cache through the generic per-block path
//                                   (the fused kernels' reference twin)
//   BM_AttendQ8/<spec>/<T>/<threads>  BM_AttendCore's call with the int8 query
//                                   (kvcache::set_attention_query("int8"): one VNNI product per
//                                   4 dims of integer keys instead of two, for the formats within
//                                   its error bound — with --fused_isa=avx2, one vpmaddubsw per
//                                   4 dims of 8 keys instead of 4 float conversions and FMAs; the
//                                   others, int8 here, keep the exact query, so their row shows
//                                   no change), on the same cache
//   BM_AttendKV1/<spec>/<T>/<threads>  BM_AttendCore's call on a cache of ONE KV head (7 query
//                                   heads): on 2 threads its keys are split across the threads
//                                   and the partial softmax states merged (attend_split, issue
//                                   37); 1 thread ÷ 2 threads is the split's speed-up (with two
//                                   KV heads, BM_Attend's 2-thread case runs a head per thread)
//   BM_AttendBaseline/<T>/<threads> the old path: float32 K/V tensors (what get() handed out)
//                                   + at:: matmul/softmax/matmul (kvcache::reference_attention)
//   BM_Copy                         memcpy of N = max(256 MiB, 2 × last-level cache):
//                                   STREAM-style copy bandwidth (2·N/t), the denominator of
//                                   every `floor_ms` (bytes a step must read / copy bandwidth),
//                                   measured in the same run
//   BM_Read                         a sum over N bytes (N/t): what one thread can read, the
//                                   denominator of `read_floor_ms` (a decode step only reads)
//   BM_Scaling/<mac|copy|fork>/<threads>  what a second thread is worth here, through the
//                                   library's parallel_for: the multiply-add loop on every
//                                   thread (`mac_per_ns`), the copy cut into a part per thread
//                                   (`copy_GBps`), an empty region (its time: the fork/join)
//   (start-up)                      the multiply-add rate: 12 independent chains of 512-bit
//                                   FMA and VNNI instructions (256-bit FMAs for the AVX2
//                                   kernels), timed on one thread; `mac_floor_ms` = the
//                                   multiply-add instructions a step's kernels must issue / that
//                                   rate: the arithmetic floor, next to the bandwidth floor
//   BM_Cascade/<spec>/<how>/<threads>  16 sequences of one MultiSequenceCache sharing a 16,384-
//                                   token prompt prefix (reused from the prefix index), 512
//                                   tokens of their own each: one decode query per sequence
//                                   attends one layer per iteration, <how> = cascade
//                                   (attend_batch, shared-prefix passes), batch (attend_batch
//                                   without the cascade) or one_by_one (each sequence's
//                                   attend() in turn). MB_per_step: the blocks the call reads
//                                   (AttendBatchStats::bytes_read; one_by_one reads what batch
//                                   reads), so floor_ms is the bandwidth floor of each way
//   BM_Memory/<spec>                24 layers × T = 32,768 tokens appended to a fresh cache: the
//                                   process's resident-set growth against bytes_reserved and
//                                   bytes_resident (MB)
//
//   build/bench/bench_attention --benchmark_counters_tabular=true
//   build/bench/bench_attention --benchmark_filter='Copy|/32768/1' --benchmark_repetitions=3
//   build/bench/bench_attention --block_tokens=128 --benchmark_filter=/4096/1   # other block sizes
//   build/bench/bench_attention --fused_isa=avx2 --benchmark_filter=BM_Attend/   # the AVX2 kernels
//                                   (avx512, avx2 or none as KVCACHE_FUSED_ISA, which is read
//                                   when the flag is absent; default: the CPU's best; refused
//                                   if the CPU cannot run them)
//   build/bench/bench_attention --ring_bytes=268435456 ...   # another ring size (bytes; 1: one layer)
//   build/bench/bench_attention --benchmark_filter=BM_Cascade/int4 --benchmark_counters_tabular=true
//
//   build/bench/bench_attention --mmap_threshold=131072 ...   # pin glibc's mmap threshold from the start
//
// Slabs of the block pools are 256 KiB; BM_Memory (registered last, so it runs after every timed
// case) pins glibc's mmap threshold at 128 KiB (mallopt) so that every slab is its own mapping
// and memory freed between cases goes back to the system — otherwise a later case would reuse
// pages an earlier one touched and its resident-set growth would read low. The timed cases run
// under glibc's default, adaptive threshold, as an engine does: pinned from the start (as before
// 2026-12-04, or with --mmap_threshold), every temporary of 128 KiB or more is a fresh mapping
// and its pages fault in on every step: the at:: baseline at 32k (its scores and probabilities,
// 1.8 MB each) took 17.8-19.9 ms a step so, against 6.2-6.3 ms in a default process, on a
// Zen 5 microVM on 2026-12-04 (the fused path, which allocates no such temporaries, was
// unaffected: docs/performance.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cache/attend_fused.h"
#include "cache/cache_manager_access.h"
#include "cache/layer_store.h"
#include "common/parallel.h"
#include "cache/attend.h"
#include "kvcache/attention.h"
#include "kvcache/cache_manager.h"
#include "kvcache/error.h"
#include "kvcache/multi_sequence_cache.h"
#include "kvcache/torch/attention.h"
#include "kvcache/torch/cache.h"
#include "kvcache/torch.h"

namespace {

constexpr int64_t kLayers = 24, kHq = 14, kHkv = 2, kD = 64;
constexpr int64_t kGroup = kHq / kHkv;  ///< query heads per KV head (BM_AttendKV1 keeps it)
double g_copy_gbps = 0;        ///< measured at start-up
double g_read_gbps = 0;        ///< measured at start-up
double g_mac512_per_ns = 0;    ///< 512-bit FMA/VNNI instructions per ns, one thread (start-up; 0: not measured)
double g_mac256_per_ns = 0;    ///< 256-bit FMA instructions per ns, one thread (start-up; 0: not measured)
int64_t g_block_tokens = 0;    ///< --block_tokens=N (0: the default)
int64_t g_ring_bytes = 0;      ///< --ring_bytes=N (0: ring_bytes()'s default)

/// The last-level cache's size in bytes (sysfs, else sysconf; 0 if neither says). sysfs first:
/// glibc's sysconf(_SC_LEVEL3_CACHE_SIZE) said 320 MiB on a Zen 4 EPYC whose L3 is 32 MiB
/// (sysfs and lscpu), which sized the ring and the copy buffers ten times too large.
int64_t llc_bytes() {
  for (const char* index : {"index4", "index3", "index2"}) {
    std::ifstream f(std::string("/sys/devices/system/cpu/cpu0/cache/") + index + "/size");
    int64_t v = 0;
    std::string unit;
    if (f >> v && v > 0) {
      f >> unit;
      return v * (unit == "K" ? 1024 : unit == "M" ? 1024 * 1024 : 1);
    }
  }
  for (int name : {_SC_LEVEL4_CACHE_SIZE, _SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
    const long v = sysconf(name);
    if (v > 0) return v;
  }
  return 0;
}

/// Bytes the ring of layers must hold: twice the last-level cache (256 MiB if unknown).
int64_t ring_bytes() {
  if (g_ring_bytes > 0) return g_ring_bytes;
  const int64_t llc = llc_bytes();
  return llc > 0 ? 2 * llc : int64_t{256} << 20;
}

/// Layers to cycle through when one holds `layer_bytes`: enough to hold ring_bytes(), and at
/// least the model's 24 unless --ring_bytes was given (--ring_bytes=1: one layer, read from the
/// CPU caches when it fits there).
int64_t ring_layers(double layer_bytes) {
  const auto need = static_cast<int64_t>(std::ceil(static_cast<double>(ring_bytes()) / layer_bytes));
  return std::max<int64_t>(g_ring_bytes > 0 ? 1 : kLayers, need);
}

/// The copy and read buffers' size: 256 MiB or twice the last-level cache.
size_t stream_bytes() { return static_cast<size_t>(std::max<int64_t>(int64_t{256} << 20, 2 * llc_bytes())); }

at::Tensor rope(const at::Tensor& x, const at::Tensor& positions) {
  const int64_t half = kD / 2;
  auto inv_freq = at::pow(1000000.0, -at::arange(0, half, at::kDouble) * 2.0 / static_cast<double>(kD));
  auto ang = positions.to(at::kDouble).unsqueeze(1) * inv_freq.unsqueeze(0);
  auto cos = at::cat({ang.cos(), ang.cos()}, 1).to(at::kFloat), sin = at::cat({ang.sin(), ang.sin()}, 1).to(at::kFloat);
  auto x1 = x.narrow(3, 0, half), x2 = x.narrow(3, half, half);
  return x * cos + at::cat({-x2, x1}, 3) * sin;
}

int64_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

kvcache::CacheConfig config(const std::string& spec, int64_t layers = kLayers, int64_t hkv = kHkv) {
  kvcache::CacheConfig c;
  c.num_layers = layers;
  c.num_q_heads = kGroup * hkv;
  c.num_kv_heads = hkv;
  c.head_dim = kD;
  c.scheme = spec;
  c.policy = "full";
  c.rope = kvcache::rope_from(rope);
  c.block_tokens = g_block_tokens;
  return c;
}

/// T tokens appended to every layer of `m` (the same random K/V in each: only the bytes read
/// matter here).
void fill(kvcache::TorchCache& m, int64_t layers, int64_t t) {
  at::manual_seed(0);
  const int64_t chunk = 4096, hkv = m.config().num_kv_heads;
  for (int64_t p = 0; p < t; p += chunk) {
    const int64_t n = std::min(chunk, t - p);
    const auto k = at::randn({1, hkv, n, kD}), v = at::randn({1, hkv, n, kD});
    const auto pos = at::arange(p, p + n, at::kLong);
    for (int64_t l = 0; l < layers; ++l) m.append(l, k, v, pos);
    m.end_step(p + n >= t ? kvcache::StepKind::kPrefillEnd : kvcache::StepKind::kPrefill);
  }
}

/// The ring of layers (ring_layers()) of T tokens each, built on first use and kept until
/// another is asked for. One layer is built first to learn what a layer holds.
kvcache::TorchCache& filled_cache(const std::string& spec, int64_t t, int64_t hkv = kHkv) {
  static std::unique_ptr<kvcache::TorchCache> cache;
  static std::string key;
  const std::string want = spec + "/" + std::to_string(t) + "/" + std::to_string(hkv);
  if (cache && key == want) return *cache;
  cache.reset();
  double layer_bytes = 0;
  {
    kvcache::TorchCache probe(config(spec, 1, hkv));
    fill(probe, 1, t);
    layer_bytes = static_cast<double>(probe.stats().bytes_resident);
  }
  const int64_t layers = ring_layers(layer_bytes);
  cache = std::make_unique<kvcache::TorchCache>(config(spec, layers, hkv));
  key = want;
  fill(*cache, layers, t);
  return *cache;
}

void floor_counters(benchmark::State& state, double bytes_per_step) {
  state.counters["MB_per_step"] = bytes_per_step / 1e6;
  state.counters["GB_per_s"] = benchmark::Counter(bytes_per_step * static_cast<double>(state.iterations()) / 1e9,
                                                  benchmark::Counter::kIsRate);
  if (g_copy_gbps > 0) state.counters["floor_ms"] = bytes_per_step / (g_copy_gbps * 1e9) * 1e3;
  if (g_read_gbps > 0) state.counters["read_floor_ms"] = bytes_per_step / (g_read_gbps * 1e9) * 1e3;
}

/// One pass summing n bytes as 64-bit words (integer adds: the compiler vectorises them), four
/// accumulators so the adds never bound the loop.
uint64_t read_sum(const std::vector<uint64_t>& a) {
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (size_t i = 0; i + 4 <= a.size(); i += 4) {
    s0 += a[i];
    s1 += a[i + 1];
    s2 += a[i + 2];
    s3 += a[i + 3];
  }
  return s0 + s1 + s2 + s3;
}

void BM_Read(benchmark::State& state) {
  at::set_num_threads(1);
  std::vector<uint64_t> a(stream_bytes() / sizeof(uint64_t), 1);
  for (auto _ : state) benchmark::DoNotOptimize(read_sum(a));
  state.counters["read_GBps"] = benchmark::Counter(static_cast<double>(a.size() * sizeof(uint64_t)) *
                                                       static_cast<double>(state.iterations()) / 1e9,
                                                   benchmark::Counter::kIsRate);
}

/// GB/s of `pass` (which moves `bytes` bytes), timed with a wall clock at start-up: one warm-up
/// pass, then the best of 5 (the counters of BM_Read/BM_Copy are not readable from other
/// benchmarks).
template <class Pass>
double best_gbps(double bytes, Pass&& pass) {
  pass();
  double best = 0;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pass();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, bytes / s / 1e9);
  }
  return best;
}

/// BM_Read's rate: N bytes per pass.
double measure_read_gbps() {
  std::vector<uint64_t> a(stream_bytes() / sizeof(uint64_t), 1);
  return best_gbps(static_cast<double>(a.size() * sizeof(uint64_t)), [&] { benchmark::DoNotOptimize(read_sum(a)); });
}

void BM_Copy(benchmark::State& state) {
  at::set_num_threads(1);
  const size_t n = stream_bytes();
  std::vector<char> a(n, 1), b(n, 2);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), n);
    benchmark::DoNotOptimize(b.data());
    benchmark::ClobberMemory();
  }
  state.counters["copy_GBps"] = benchmark::Counter(2.0 * static_cast<double>(n) * static_cast<double>(state.iterations()) / 1e9,
                                                   benchmark::Counter::kIsRate);
}

/// BM_Copy's rate: STREAM copy convention, 2·N bytes per memcpy of N.
double measure_copy_gbps() {
  const size_t n = stream_bytes();
  std::vector<char> a(n, 1), b(n, 2);
  return best_gbps(2.0 * static_cast<double>(n), [&] {
    std::memcpy(b.data(), a.data(), n);
    benchmark::DoNotOptimize(b.data());
  });
}

#if defined(__x86_64__)
// The multiply-add rate loops: `iters` × 12 instructions, each into its own register (12
// independent chains, more than latency × throughput on current cores); mac_loop_512 alternates
// 512-bit FMA and VNNI, mac_loop_256 issues 256-bit FMAs. One inline-assembly block holds the
// whole loop, so that the compiler can neither fold, spill nor reuse the registers between
// iterations, and it sets its registers first: the multiplicands to 1.0f and the chains to 0,
// so that every FMA adds 1 to a small float. (Before, the registers held whatever the program
// left there: denormal or NaN operands, which cost Intel cores a microcode assist per
// instruction, made the probe read 0.04-0.05 per ns on the Xeon, issue 37.)
// KV_MAC_12(A, B, R) is "A %R14, %R15, %R0; B %R14, %R15, %R1; ...": A into the even registers
// R0..R10, B into the odd ones R1..R11 (R: zmm or ymm).
#define KV_MAC_PAIR(A, B, R, E, O) A " %%" R "14, %%" R "15, %%" R #E "\n\t" B " %%" R "14, %%" R "15, %%" R #O "\n\t"
#define KV_MAC_12(A, B, R)                                                                                   \
  KV_MAC_PAIR(A, B, R, 0, 1) KV_MAC_PAIR(A, B, R, 2, 3) KV_MAC_PAIR(A, B, R, 4, 5) KV_MAC_PAIR(A, B, R, 6, 7) \
  KV_MAC_PAIR(A, B, R, 8, 9) KV_MAC_PAIR(A, B, R, 10, 11)
#define KV_ZERO_PAIR(Z, R, E, O) Z " %%" R #E ", %%" R #E ", %%" R #E "\n\t" Z " %%" R #O ", %%" R #O ", %%" R #O "\n\t"
#define KV_ZERO_12(Z, R)                                                                                           \
  KV_ZERO_PAIR(Z, R, 0, 1) KV_ZERO_PAIR(Z, R, 2, 3) KV_ZERO_PAIR(Z, R, 4, 5) KV_ZERO_PAIR(Z, R, 6, 7) \
  KV_ZERO_PAIR(Z, R, 8, 9) KV_ZERO_PAIR(Z, R, 10, 11)
// The whole loop: multiplicands R14, R15 = 1.0f, chains zeroed with Z (vpxord, the EVEX form,
// reaches a whole zmm register), then `n` rounds of KV_MAC_12.
#define KV_MAC_LOOP(A, B, R, Z)                                                                          \
  "vbroadcastss %[one], %%" R "14\n\tvbroadcastss %[one], %%" R "15\n\t" KV_ZERO_12(Z, R) "1:\n\t" \
      KV_MAC_12(A, B, R) "dec %[n]\n\tjnz 1b\n\tvzeroupper"
#define KV_MAC_CLOBBERS \
  "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm14", "xmm15", "cc"
constexpr float kMacOne = 1.0f;
__attribute__((target("avx512f,avx512vnni"))) void mac_loop_512(int64_t iters) {
  if (iters <= 0) return;
  asm volatile(KV_MAC_LOOP("vfmadd231ps", "vpdpbusd", "zmm", "vpxord") : [n] "+r"(iters) : [one] "m"(kMacOne) : KV_MAC_CLOBBERS);
}
__attribute__((target("avx2,fma"))) void mac_loop_256(int64_t iters) {
  if (iters <= 0) return;
  asm volatile(KV_MAC_LOOP("vfmadd231ps", "vfmadd231ps", "ymm", "vpxor") : [n] "+r"(iters) : [one] "m"(kMacOne) : KV_MAC_CLOBBERS);
}
#undef KV_MAC_CLOBBERS
#undef KV_MAC_LOOP
#undef KV_ZERO_12
#undef KV_ZERO_PAIR
#undef KV_MAC_12
#undef KV_MAC_PAIR
/// Instructions per ns of a rate loop on one thread: best of 5 wall-clock runs after a warm-up.
template <class Loop>
double mac_per_ns(Loop&& loop) {
  constexpr int64_t kIters = 4'000'000;
  loop(kIters);
  double best = 0;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    loop(kIters);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 12.0 * static_cast<double>(kIters) / s / 1e9);
  }
  return best;
}
void measure_mac_rates() {
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni")) g_mac512_per_ns = mac_per_ns(mac_loop_512);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) g_mac256_per_ns = mac_per_ns(mac_loop_256);
}
#else
void measure_mac_rates() {}
#endif

/// What a second thread is worth on this machine, through the library's own parallel_for (the
/// OpenMP region a split attend() forks): BM_Scaling/<probe>/<threads>, probe = `mac` (the
/// multiply-add loop above, kIters rounds on each thread: a perfect machine doubles
/// `mac_per_ns` on 2 threads), `copy` (BM_Copy's memcpy cut into one part per thread:
/// `copy_GBps`), `fork` (an empty region: the wall time per call is the fork/join a split step
/// pays once per call). The attention thread ratio (1 thread ÷ 2 threads) is bounded by what
/// `mac` and `copy` scale by here, not by 2.
enum class ScalingProbe { kMac, kCopy, kFork };
void BM_Scaling(benchmark::State& state, ScalingProbe probe) {
  const int64_t threads = state.range(0);
  at::set_num_threads(static_cast<int>(threads));
  using kvcache::detail::parallel_for;
  if (probe == ScalingProbe::kMac) {
#if defined(__x86_64__)
    constexpr int64_t kIters = 1'000'000;
    const bool z = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni");
    if (!z && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
      state.SkipWithError("no AVX2/FMA");
      return;
    }
    for (auto _ : state) {
      parallel_for(0, threads, 0, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) z ? mac_loop_512(kIters) : mac_loop_256(kIters);
      });
    }
    state.counters["mac_per_ns"] = benchmark::Counter(12.0 * kIters * static_cast<double>(threads) *
                                                          static_cast<double>(state.iterations()) / 1e9,
                                                      benchmark::Counter::kIsRate);
#else
    state.SkipWithError("x86-64 only");
#endif
  } else if (probe == ScalingProbe::kCopy) {
    const size_t n = stream_bytes();
    std::vector<char> a(n, 1), b(n, 2);
    const size_t part = (n + static_cast<size_t>(threads) - 1) / static_cast<size_t>(threads);
    for (auto _ : state) {
      parallel_for(0, threads, 0, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          const size_t off = static_cast<size_t>(i) * part, len = std::min(part, n - off);
          std::memcpy(b.data() + off, a.data() + off, len);
        }
      });
      benchmark::DoNotOptimize(b.data());
      benchmark::ClobberMemory();
    }
    state.counters["copy_GBps"] = benchmark::Counter(2.0 * static_cast<double>(n) * static_cast<double>(state.iterations()) / 1e9,
                                                     benchmark::Counter::kIsRate);
  } else {
    for (auto _ : state) {
      parallel_for(0, threads, 0, [](int64_t b, int64_t e) {
        int64_t x = b + e;
        benchmark::DoNotOptimize(x);
      });
    }
  }
}

/// The arithmetic floor of one decode step over `t` tokens (ms): the multiply-add instructions
/// the read path must issue, at the rate measured at start-up, on `cores` cores (the threads
/// that have work: min(threads, KV heads × the runs each head's keys are split into)).
/// Per key and KV head, G = 14/2 = 7 query rows × D = 64 dims are multiplied twice (q·k, p·v):
/// the AVX-512 fused kernels take q·k of integer keys (int*, KIVI's quantized keys) with two
/// VNNI products per 64 multiplies (the query's two int8 terms; one with `one_term`, the int8
/// query where the format takes it) and everything else with one
/// 16-lane FMA per 16; the AVX2 kernels one 8-lane FMA per 8, and with `one_term` q·k of
/// integer keys with one vpmaddubsw per 32 (counted at the measured 256-bit FMA rate: an
/// approximation, the probe does not time vpmaddubsw); the generic path (decoded to
/// float32) one tile-width FMA per lane count. `int_keys`: the cache's main key format is one
/// the fused kernels read as integer codes (fused::classify, as attend() does); KIVI's
/// full-precision residual (≤ 128 tokens) is counted as integer keys. Instruction issue only: loads, code unpacking, conversions,
/// transposes and the softmax come on top, so no kernel of this form runs below it.
/// `qk_factor`: q·k's multiplies per key over D's: 2 for TurboQuant-Prod keys (the codebook part
/// against the rotated query, the sign sketch against S·q), (m + m_o)/D for QJL keys (the two
/// sign sketches against S·q), 1 otherwise.
double mac_floor_ms(bool int_keys, int64_t t, int64_t cores, bool fused, int64_t hkv = kHkv, bool one_term = false,
                    double qk_factor = 1.0) {
  namespace fused_ns = kvcache::cache::fused;
  const double g = static_cast<double>(kGroup), macs = g * static_cast<double>(kD);  // per product, key, head
  double instr = 0, rate = 0;  // per key and KV head; per ns
  const fused_ns::FusedIsa isa = fused ? fused_ns::current_isa() : fused_ns::FusedIsa::kNone;
  const double qk = qk_factor;
  if (isa == fused_ns::FusedIsa::kAvx512) {
    instr = (int_keys ? (one_term ? 1 : 2) * macs / 64 : qk * macs / 16) + macs / 16;
    rate = g_mac512_per_ns;
  } else if (isa == fused_ns::FusedIsa::kAvx2) {
    instr = (int_keys && one_term ? macs / 32 : qk * macs / 8) + macs / 8;  // the AVX2 kernels
    rate = g_mac256_per_ns;
  } else if (kvcache::cache::tile_lanes() == 8) {
    instr = 2 * macs / 8;  // the generic path's 8-lane tile kernels
    rate = g_mac256_per_ns;
  } else {
    instr = 2 * macs / 16;  // the generic path's 16-lane tile kernels
    rate = g_mac512_per_ns;
  }
  if (rate <= 0) return 0;
  return instr * static_cast<double>(t * hkv) / (rate * static_cast<double>(std::max<int64_t>(cores, 1))) / 1e6;
}

/// Which call a BM_Attend case times.
enum class Path {
  kFace,     ///< TorchCache::attend: at::Tensors in, a new output tensor (the ATen face)
  kCore,     ///< CacheManager::attend: views of q and of one output buffer (the core API)
  kGeneric,  ///< the generic per-block path (CacheManagerAccess::attend, fused = false)
  kCoreQ8,   ///< kCore with the int8 query (kvcache::set_attention_query("int8")) during the loop
};

void BM_Attend(benchmark::State& state, const std::string& spec, Path path, int64_t hkv = kHkv) {
  const int64_t t = state.range(0), hq = kGroup * hkv;
  at::set_num_threads(static_cast<int>(state.range(1)));
  auto& m = filled_cache(spec, t, hkv);
  const int64_t layers = m.config().num_layers;
  const auto q = at::randn({1, hq, 1, kD});
  const auto pos = at::full({1}, t, at::kLong);
  // The core API's arguments: the caller's buffers, viewed (as an engine holds them).
  std::vector<float> qbuf(q.data_ptr<float>(), q.data_ptr<float>() + hq * kD), out(static_cast<size_t>(hq * kD));
  const int64_t qpos = t;
  const kvcache::TensorView qv(qbuf.data(), {1, hq, 1, kD}), pv(&qpos, {1});
  const kvcache::MutableTensorView ov(out.data(), {1, hq, 1, kD});
  int64_t l = 0;
  if (path == Path::kCoreQ8) kvcache::set_attention_query("int8");
  for (auto _ : state) {
    switch (path) {
      case Path::kFace: benchmark::DoNotOptimize(m.attend(l, q, pos).data_ptr()); break;
      case Path::kCore:
      case Path::kCoreQ8:
        m.core().attend(l, qv, pv, ov);
        benchmark::DoNotOptimize(out.data());
        break;
      case Path::kGeneric:
        kvcache::cache::CacheManagerAccess::attend(m.core(), l, qv, pv, false, ov);
        benchmark::DoNotOptimize(out.data());
        break;
    }
    l = (l + 1) % layers;
  }
  kvcache::set_attention_query("exact");
  floor_counters(state, static_cast<double>(m.stats().bytes_resident) / static_cast<double>(layers));
  state.counters["ring_layers"] = static_cast<double>(layers);
  using Kind = kvcache::cache::fused::KernelFormat::Kind;
  const auto& layer0 = kvcache::cache::CacheManagerAccess::layer(m.core(), 0);
  const auto key_main = kvcache::cache::fused::classify(layer0.key_setup().formats.f[kvcache::cache::StreamFormats::kMain]);
  const Kind key_kind = key_main.kind;
  const bool int_keys = key_kind == Kind::kIntToken || key_kind == Kind::kIntChannel;
  // The threads with work: each KV head's keys split into `parts` runs (attend_split) when the
  // thread count asks for it, as attend() decides (split_parts) for this cache and query.
  kvcache::cache::AttendArgs probe;
  probe.layer = &kvcache::cache::CacheManagerAccess::layer(m.core(), 0);
  probe.num_q_heads = hq;
  probe.t_q = 1;
  const int64_t parts = kvcache::cache::split_parts(probe, state.range(1));
  const int64_t cores = std::min<int64_t>(state.range(1), hkv * parts);
  state.counters["split_parts"] = static_cast<double>(parts);
  // The int8 query where the kernels take it for this key format (fused::kInt8Query*Bits).
  namespace fns = kvcache::cache::fused;
  const uint32_t q8_bits = key_kind == Kind::kIntChannel ? fns::kInt8QueryChannelBits : fns::kInt8QueryTokenBits;
  const bool isa_takes_it = fns::current_isa() == fns::FusedIsa::kAvx512 ||
                            (fns::current_isa() == fns::FusedIsa::kAvx2 && ((fns::kInt8QueryAvx2Bits >> key_main.bits) & 1u) != 0);
  const bool one_term = path == Path::kCoreQ8 && int_keys && isa_takes_it && ((q8_bits >> key_main.bits) & 1u) != 0;
  state.counters["one_term_query"] = one_term ? 1 : 0;
  // fused_read: 1 if the fused kernels read this cache as stored (every format of the layer is
  // one they read, as attend() decides; TurboQuant-Prod values are not), 0 if even BM_Attend
  // takes the generic per-block path (int3, had(...), GEAR, KVQuant, TurboQuant-Prod values, ...).
  bool fused_read = path != Path::kGeneric && kvcache::cache::fused::available();
  for (const auto* st : {&layer0.key_setup(), &layer0.value_setup()}) {
    for (const auto& f : st->formats.f) {
      if (f.quantizer == nullptr) continue;
      const auto k = kvcache::cache::fused::classify(f);
      if (k.kind == Kind::kNone || (st == &layer0.value_setup() && k.tq_prod)) fused_read = false;
    }
  }
  state.counters["fused_read"] = fused_read ? 1 : 0;
  const double qk_factor = key_main.tq_prod           ? 2.0
                           : key_kind == Kind::kQjl ? static_cast<double>(key_main.qjl_m + key_main.qjl_mo) / kD
                                                    : 1.0;
  if (const double f = mac_floor_ms(int_keys, t, cores, fused_read, hkv, one_term, qk_factor); f > 0) {
    state.counters["mac_floor_ms"] = f;
  }
  state.counters["bits_per_value"] =
      static_cast<double>(m.stats().bytes_resident) * 8 / static_cast<double>(layers * 2 * hkv * t * kD);
}

void BM_AttendBaseline(benchmark::State& state) {
  const int64_t t = state.range(0);
  at::set_num_threads(static_cast<int>(state.range(1)));
  at::manual_seed(0);
  const int64_t layers = ring_layers(2.0 * static_cast<double>(kHkv * t * kD) * 4.0);
  std::vector<at::Tensor> k, v;
  for (int64_t l = 0; l < layers; ++l) {
    k.push_back(at::randn({1, kHkv, t, kD}));
    v.push_back(at::randn({1, kHkv, t, kD}));
  }
  const auto kpos = at::arange(t, at::kLong).unsqueeze(0).expand({kHkv, t}).contiguous();
  const auto q = at::randn({1, kHq, 1, kD});
  const auto pos = at::full({1}, t, at::kLong);
  int64_t l = 0;
  for (auto _ : state) {
    benchmark::DoNotOptimize(kvcache::reference_attention(q, k[static_cast<size_t>(l)], v[static_cast<size_t>(l)], kpos, pos).data_ptr());
    l = (l + 1) % layers;
  }
  floor_counters(state, 2.0 * static_cast<double>(kHkv * t * kD) * 4.0);
  state.counters["ring_layers"] = static_cast<double>(layers);
}

// ---------------------------------------------------------------- shared prefix (cascade)
constexpr int64_t kCascadeSeqs = 16, kCascadePrefix = 16384, kCascadeOwn = 512;

/// How BM_Cascade attends the 16 sequences.
enum class Cascade { kCascade, kBatch, kOneByOne };

/// kCascadeSeqs sequences over one MultiSequenceCache of `layers` layers: the first computes the
/// shared prefix and its own tokens; each other one reuses the prefix from the index and
/// computes its own. Random K/V (the same in every layer: only the bytes read matter).
struct CascadeSet {
  std::unique_ptr<kvcache::MultiSequenceCache> cache;
  std::vector<kvcache::Sequence*> seqs;

  CascadeSet(const std::string& spec, int64_t layers) {
    kvcache::MultiSequenceConfig c;
    c.model = config(spec, layers);
    c.capacity_bytes = int64_t{1} << 40;
    cache = std::make_unique<kvcache::MultiSequenceCache>(std::move(c));
    at::manual_seed(0);
    std::vector<int64_t> prefix(static_cast<size_t>(kCascadePrefix));
    for (int64_t i = 0; i < kCascadePrefix; ++i) prefix[static_cast<size_t>(i)] = i % 1000;
    for (int64_t s = 0; s < kCascadeSeqs; ++s) {
      std::vector<int64_t> prompt = prefix;
      for (int64_t i = 0; i < kCascadeOwn; ++i) prompt.push_back(100000 + s * 1000 + i);
      kvcache::Sequence& seq = cache->add_sequence();
      kvcache::TorchCache tc(seq);
      const int64_t n = static_cast<int64_t>(prompt.size());
      const int64_t cached = seq.begin_request(prompt, n + 16).cached_tokens;
      const int64_t chunk = 4096;
      for (int64_t p = cached; p < n; p += chunk) {
        const int64_t m = std::min(chunk, n - p);
        const auto k = at::randn({1, kHkv, m, kD}), v = at::randn({1, kHkv, m, kD});
        const auto pos = at::arange(p, p + m, at::kLong);
        for (int64_t l = 0; l < layers; ++l) tc.append(l, k, v, pos);
        tc.end_step(p + m >= n ? kvcache::StepKind::kPrefillEnd : kvcache::StepKind::kPrefill);
      }
      seqs.push_back(&seq);
    }
  }
};

/// The set for `spec`, built on first use and kept until another is asked for; its layers are
/// a ring as BM_Attend's (one layer built first to learn what a layer holds).
CascadeSet& cascade_set(const std::string& spec) {
  static std::unique_ptr<CascadeSet> set;
  static std::string key;
  if (set && key == spec) return *set;
  set.reset();
  double layer_bytes = 0;
  {
    CascadeSet probe(spec, 1);
    layer_bytes = static_cast<double>(probe.cache->stats().bytes_in_use);
  }
  set = std::make_unique<CascadeSet>(spec, ring_layers(layer_bytes));
  key = spec;
  return *set;
}

void BM_Cascade(benchmark::State& state, const std::string& spec, Cascade how) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  CascadeSet& set = cascade_set(spec);
  const int64_t layers = set.cache->config().model.num_layers;
  const auto n = static_cast<size_t>(kCascadeSeqs);
  // Every sequence's decode query (random), its position, its output: the caller's buffers.
  std::vector<std::vector<float>> q(n), out(n, std::vector<float>(static_cast<size_t>(kHq * kD)));
  std::vector<int64_t> pos(n);
  std::vector<kvcache::AttendRequest> reqs(n);
  for (size_t i = 0; i < n; ++i) {
    const auto qt = at::randn({1, kHq, 1, kD});
    q[i].assign(qt.data_ptr<float>(), qt.data_ptr<float>() + kHq * kD);
    pos[i] = set.seqs[i]->next_position(0);
    reqs[i] = {set.seqs[i], kvcache::TensorView(q[i].data(), {1, kHq, 1, kD}), kvcache::TensorView(&pos[i], {1}),
               kvcache::MutableTensorView(out[i].data(), {1, kHq, 1, kD})};
  }
  kvcache::AttendBatchOptions opt;
  opt.cascade = how == Cascade::kCascade;
  kvcache::AttendBatchStats stats;
  {
    kvcache::AttendBatchOptions probe = opt;
    probe.stats = &stats;
    kvcache::attend_batch(0, reqs, probe);
  }
  int64_t l = 0;
  for (auto _ : state) {
    if (how == Cascade::kOneByOne) {
      for (size_t i = 0; i < n; ++i) set.seqs[i]->attend(l, reqs[i].q, reqs[i].q_positions, reqs[i].out);
    } else {
      kvcache::attend_batch(l, reqs, opt);
    }
    benchmark::DoNotOptimize(out[0].data());
    l = (l + 1) % layers;
  }
  floor_counters(state, static_cast<double>(stats.bytes_read));
  state.counters["ring_layers"] = static_cast<double>(layers);
  state.counters["shared_passes"] = static_cast<double>(stats.shared_passes);
  // The arithmetic floor is the same for every way: each sequence's 7 query rows per KV head
  // still multiply every key they see, shared or not (the cascade saves reads, not products).
  using Kind = kvcache::cache::fused::KernelFormat::Kind;
  const auto& key_main = kvcache::cache::CacheManagerAccess::layer(*set.seqs[0], 0)
                             .key_setup()
                             .formats.f[kvcache::cache::StreamFormats::kMain];
  const Kind kind = kvcache::cache::fused::classify(key_main).kind;
  if (const double f = mac_floor_ms(kind == Kind::kIntToken || kind == Kind::kIntChannel,
                                    kCascadePrefix + kCascadeOwn, std::min<int64_t>(state.range(0), kHkv), true);
      f > 0) {
    state.counters["mac_floor_ms"] = f * static_cast<double>(kCascadeSeqs);
  }
}

void BM_Memory(benchmark::State& state, const std::string& spec) {
  mallopt(M_MMAP_THRESHOLD, 128 * 1024);  // see the file comment
  const int64_t t = 32768;
  for (auto _ : state) {
    malloc_trim(0);
    const int64_t before = rss_bytes();
    double grown = 0, reserved = 0, resident = 0;
    {
      kvcache::TorchCache m(config(spec));
      at::manual_seed(0);
      // Random K/V are generated per chunk and freed: they are not part of the growth
      // measured after the loop.
      const int64_t chunk = 1024;
      for (int64_t p = 0; p < t; p += chunk) {
        for (int64_t l = 0; l < kLayers; ++l) {
          m.append(l, at::randn({1, kHkv, chunk, kD}), at::randn({1, kHkv, chunk, kD}), at::arange(p, p + chunk, at::kLong));
        }
        m.end_step(p + chunk >= t ? kvcache::StepKind::kPrefillEnd : kvcache::StepKind::kPrefill);
      }
      malloc_trim(0);
      grown = static_cast<double>(rss_bytes() - before);
      reserved = static_cast<double>(m.stats().bytes_reserved);
      resident = static_cast<double>(m.stats().bytes_resident);
    }
    state.counters["rss_growth_MB"] = grown / 1e6;
    state.counters["reserved_MB"] = reserved / 1e6;
    state.counters["resident_MB"] = resident / 1e6;
    state.counters["rss_over_reserved"] = grown / reserved;
    state.counters["reserved_over_resident"] = reserved / resident;
  }
}

const std::vector<std::string>& specs() {
  static const std::vector<std::string> s = {"fp32",      "fp16", "bf16", "fp8:e4m3", "fp8:e5m2", "fp8:e4m3:scaled",
                                             "int8",      "int4", "int2",
                                             // int4 in groups of 32: two scales and zeros per token
                                             // at D 64 (as int4 at D 128), read by the kernels'
                                             // contiguous-slot paths (meta16, meta8)
                                             "int4:g32", "int4:g32:chan", "kivi:k2:v2:g32:r128",
                                             "kivi:k4:v4:g32:r128",
                                             // TurboQuant (fused: keys from their codes against the
                                             // rotated query, values rotated back once per row);
                                             // turboquant:k3:v3 = Prod keys at 3 bits, MSE values
                                             // at 3, with its fp16 window; QJL keys from their
                                             // sign bits against S·q, PolarQuant's blocks rebuilt
                                             // from cos/sin tables (all fused_read = 1).
                                             "tq:b4", "tq:b3:nc", "tq:b2.5", "turboquant:k3:v3", "qjl", "polar"};
  return s;
}

void register_all() {
  benchmark::RegisterBenchmark("BM_Copy", BM_Copy)->Unit(benchmark::kMillisecond)->UseRealTime();
  benchmark::RegisterBenchmark("BM_Read", BM_Read)->Unit(benchmark::kMillisecond)->UseRealTime();
  for (const auto& [name, probe] : {std::pair{"mac", ScalingProbe::kMac}, std::pair{"copy", ScalingProbe::kCopy},
                                    std::pair{"fork", ScalingProbe::kFork}}) {
    for (int64_t threads : {1, 2}) {
      benchmark::RegisterBenchmark((std::string("BM_Scaling/") + name).c_str(),
                                   [probe = probe](benchmark::State& st) { BM_Scaling(st, probe); })
          ->Arg(threads)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
  }
  for (int64_t t : {4096, 32768}) {
    for (int64_t threads : {1, 2}) {
      benchmark::RegisterBenchmark("BM_AttendBaseline", BM_AttendBaseline)
          ->Args({t, threads})
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
    for (const auto& s : specs()) {
      for (int64_t threads : {1, 2}) {
        benchmark::RegisterBenchmark(("BM_Attend/" + s).c_str(), [s](benchmark::State& st) { BM_Attend(st, s, Path::kFace); })
            ->Args({t, threads})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
        benchmark::RegisterBenchmark(("BM_AttendCore/" + s).c_str(),
                                     [s](benchmark::State& st) { BM_Attend(st, s, Path::kCore); })
            ->Args({t, threads})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
        // The int8 query next to the exact one on the same cache (int8 keeps the exact query:
        // a control).
        if (s == "int8" || s == "int4" || s == "int2" || s == "kivi:k2:v2:g32:r128") {
          benchmark::RegisterBenchmark(("BM_AttendQ8/" + s).c_str(),
                                       [s](benchmark::State& st) { BM_Attend(st, s, Path::kCoreQ8); })
              ->Args({t, threads})
              ->Unit(benchmark::kMicrosecond)
              ->UseRealTime();
        }
        benchmark::RegisterBenchmark(("BM_AttendGeneric/" + s).c_str(),
                                     [s](benchmark::State& st) { BM_Attend(st, s, Path::kGeneric); })
            ->Args({t, threads})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
      }
    }
  }
  // One KV head: the split of its keys across the threads (1 then 2 threads on one cache).
  for (int64_t t : {4096, 32768}) {
    for (const std::string s : {"fp32", "fp16", "int8", "int4", "kivi:k2:v2:g32:r128"}) {
      for (int64_t threads : {1, 2}) {
        benchmark::RegisterBenchmark(("BM_AttendKV1/" + s).c_str(),
                                     [s](benchmark::State& st) { BM_Attend(st, s, Path::kCore, 1); })
            ->Args({t, threads})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
      }
    }
  }
  // Shared prefix: the three ways side by side per spec and thread count (one set per spec).
  for (const std::string s : {"int4", "fp16"}) {
    for (int64_t threads : {1, 2}) {
      for (const auto& [name, how] : {std::pair<const char*, Cascade>{"cascade", Cascade::kCascade},
                                      {"one_by_one", Cascade::kOneByOne},
                                      {"batch", Cascade::kBatch}}) {
        benchmark::RegisterBenchmark(("BM_Cascade/" + s + "/" + name).c_str(),
                                     [s, how = how](benchmark::State& st) { BM_Cascade(st, s, how); })
            ->Args({threads})
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime();
      }
    }
  }
  for (const auto& s : {"fp32", "fp16", "int8", "int4", "int2", "kivi:k2:v2:g32:r128"}) {
    const std::string spec = s;
    benchmark::RegisterBenchmark(("BM_Memory/" + spec).c_str(), [spec](benchmark::State& st) { BM_Memory(st, spec); })
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args;
  bool isa_flag = false;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--mmap_threshold=", 17) == 0) {
      const long long v = std::atoll(argv[i] + 17);
      if (v <= 0 || mallopt(M_MMAP_THRESHOLD, static_cast<int>(std::min<long long>(v, 1LL << 30))) != 1) {
        std::fprintf(stderr, "bench_attention: --mmap_threshold=%s: expected a positive number of bytes (at most 32 MiB on 64-bit glibc)\n",
                     argv[i] + 17);
        return 2;
      }
    } else if (std::strncmp(argv[i], "--block_tokens=", 15) == 0) {
      g_block_tokens = std::atoll(argv[i] + 15);
    } else if (std::strncmp(argv[i], "--fused_isa=", 12) == 0) {
      // The library's own setter (KVCACHE_FUSED_ISA's vocabulary and checks; tile width too).
      isa_flag = true;
      try {
        kvcache::set_attention_kernels(argv[i] + 12, "--fused_isa");
      } catch (const kvcache::InvalidArgument& e) {
        std::fprintf(stderr, "bench_attention: %s\n", e.what());
        return 2;
      }
    } else if (std::strncmp(argv[i], "--ring_bytes=", 13) == 0) {
      g_ring_bytes = std::atoll(argv[i] + 13);
      if (g_ring_bytes <= 0) {
        std::fprintf(stderr, "bench_attention: --ring_bytes=%s: expected a positive number of bytes\n", argv[i] + 13);
        return 2;
      }
    } else {
      args.push_back(argv[i]);
    }
  }
  argc = static_cast<int>(args.size());
  argv = args.data();
  if (const char* isa = std::getenv("KVCACHE_FUSED_ISA"); isa != nullptr && !isa_flag) {
    try {
      kvcache::set_attention_kernels(isa, "KVCACHE_FUSED_ISA");
    } catch (const kvcache::InvalidArgument& e) {
      std::fprintf(stderr, "bench_attention: %s\n", e.what());
      return 2;
    }
  }
  g_copy_gbps = measure_copy_gbps();
  g_read_gbps = measure_read_gbps();
  measure_mac_rates();
  std::fprintf(stderr,
               "copy bandwidth (STREAM convention, 1 thread, %zu MiB): %.1f GB/s; read bandwidth (1 thread): %.1f GB/s; "
               "last-level cache %lld MiB; a ring of layers holds >= %lld MiB\n",
               stream_bytes() >> 20, g_copy_gbps, g_read_gbps, static_cast<long long>(llc_bytes() >> 20),
               static_cast<long long>(ring_bytes() >> 20));
  // A rate of 0 was not measured (the CPU lacks those instructions): said so, not printed as 0.00.
  const auto rate = [](double r) {
    if (r <= 0) return std::string("not measured (the CPU lacks them)");
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.2f per ns", r);
    return std::string(buf);
  };
  std::fprintf(stderr, "multiply-add rate (1 thread, 12 independent chains): 512-bit FMA/VNNI %s, 256-bit FMA %s\n",
               rate(g_mac512_per_ns).c_str(), rate(g_mac256_per_ns).c_str());
  std::fprintf(stderr, "fused kernels: %s (CPU's best: %s)\n", kvcache::cache::fused::isa_name(kvcache::cache::fused::current_isa()),
               kvcache::cache::fused::isa_name(kvcache::cache::fused::best_isa()));
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
