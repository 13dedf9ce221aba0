// SPDX-License-Identifier: Apache-2.0
// bench_quant: quantize/dequantize throughput of every registered quantizer spec, plus
// the LibTorch-ops reference of each integer quantizer, on a synthetic KV tensor.
//
// Throughput is bytes of fp32 input per second (quantize) or of fp32 output per second
// (dequantize): SetBytesProcessed(numel · 4). Counters: bits_per_value (effective, from
// the quantizer) and rel_err (‖x − x̂‖_F / ‖x‖_F on the benchmarked tensor).
//
// Synthetic KV tensor (seed 0): x[b, h, t, d] = σ_d · n + μ_d with n ~ N(0, 1), where
// every 16th channel (d % 16 == 3) is an outlier channel with σ = 8, μ = 4 (the
// persistent large-magnitude key channels KIVI, arXiv 2402.02750, and KVQuant,
// arXiv 2401.18079, report) and the other channels have σ = 1, μ = 0.
//
// All figures are single-threaded (at::set_num_threads(1)); the quantize/dequantize API
// benchmarks include allocating the output tensors, the *_into ones reuse the caller's.
//
// Run: build/bench/bench_quant [--benchmark_filter=<regex>]
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "kvcache/quantizer.h"
#include "kvcache/torch.h"
#include "quant/int_kernels.h"
#include "torch/quant_reference.h"

namespace {

using kvcache::GroupAxis;

at::Tensor synthetic_kv(const std::vector<int64_t>& shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  at::Tensor x = at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat));
  const int64_t d = shape[3];
  at::Tensor sigma = at::ones({d});
  at::Tensor mu = at::zeros({d});
  for (int64_t c = 3; c < d; c += 16) {
    sigma[c] = 8.0;
    mu[c] = 4.0;
  }
  return x * sigma + mu;
}

/// One tensor per shape, built once and shared by all benchmarks.
const at::Tensor& tensor_for(const std::vector<int64_t>& shape) {
  static std::map<std::vector<int64_t>, at::Tensor> cache;
  auto it = cache.find(shape);
  if (it == cache.end()) it = cache.emplace(shape, synthetic_kv(shape)).first;
  return it->second;
}

std::string shape_name(const std::vector<int64_t>& s) {
  std::string n;
  for (size_t i = 0; i < s.size(); ++i) n += (i ? "x" : "") + std::to_string(s[i]);
  return n;
}

void set_counters(benchmark::State& state, const at::Tensor& x, double bpv, double rel_err) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * x.numel() * 4);
  state.counters["bits_per_value"] = bpv;
  state.counters["rel_err"] = rel_err;
}

void bench_quantize(benchmark::State& state, std::string spec, std::vector<int64_t> shape) {
  const at::Tensor& x = tensor_for(shape);
  auto q = kvcache::make_quantizer(spec);
  for (auto _ : state) {
    kvcache::QuantizedTensor qt = q->quantize(x);
    benchmark::DoNotOptimize(qt.codes.data());
  }
  set_counters(state, x, q->bits_per_value(shape[3]), kvcache::reconstruction_error(*q, x).rel_fro);
}

void bench_dequantize(benchmark::State& state, std::string spec, std::vector<int64_t> shape) {
  const at::Tensor& x = tensor_for(shape);
  auto q = kvcache::make_quantizer(spec);
  const kvcache::QuantizedTensor qt = q->quantize(x);
  for (auto _ : state) {
    at::Tensor y = kvcache::dequantize(*q, qt);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  set_counters(state, x, q->bits_per_value(shape[3]), kvcache::reconstruction_error(*q, x).rel_fro);
}

/// quantize_into(): the public API writing into the caller's QuantizedTensor, reused from
/// the previous iteration (no allocation, no fresh pages after the first call).
void bench_quantize_into(benchmark::State& state, std::string spec, std::vector<int64_t> shape) {
  const at::Tensor& x = tensor_for(shape);
  auto q = kvcache::make_quantizer(spec);
  kvcache::QuantizedTensor qt;
  q->quantize_into(x, qt);
  for (auto _ : state) {
    q->quantize_into(x, qt);
    benchmark::DoNotOptimize(qt.codes.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, x, q->bits_per_value(shape[3]), kvcache::reconstruction_error(*q, x).rel_fro);
}

/// dequantize_into(): the public API writing into a reused float32 output.
void bench_dequantize_into(benchmark::State& state, std::string spec, std::vector<int64_t> shape) {
  const at::Tensor& x = tensor_for(shape);
  auto q = kvcache::make_quantizer(spec);
  const kvcache::QuantizedTensor qt = q->quantize(x);
  at::Tensor y;
  kvcache::dequantize_into(*q, qt, y);
  for (auto _ : state) {
    kvcache::dequantize_into(*q, qt, y);
    benchmark::DoNotOptimize(y.data_ptr());
    benchmark::ClobberMemory();
  }
  set_counters(state, x, q->bits_per_value(shape[3]), kvcache::reconstruction_error(*q, x).rel_fro);
}

/// The per-token kernel alone, writing into preallocated buffers (as ggml's quantize_row_*
/// benchmarks do): separates the kernel from the API's output allocation (page faults on
/// fresh memory dominate at 512 MB).
void bench_kernel(benchmark::State& state, int bits, int64_t g, bool dequant, std::vector<int64_t> shape) {
  const at::Tensor& x = tensor_for(shape);
  const int64_t n = x.numel();
  std::vector<uint8_t> codes(static_cast<size_t>(n * bits / 8));
  std::vector<c10::Half> scales(static_cast<size_t>(n / g)), zeros(static_cast<size_t>(n / g));
  // 64-byte aligned, like an at::empty output (the dequantize kernel streams its stores to an
  // aligned output far larger than the caches).
  at::Tensor out_t = at::empty({dequant ? n : 0}, at::kFloat);
  float* out = out_t.data_ptr<float>();
  const auto quant = [&] {
    return kvcache::quant::quantize_per_token(bits, x.data_ptr<float>(), n / g, g, codes.data(), scales.data(),
                                              zeros.data(), kvcache::quant::MetaType::kHalf);
  };
  quant();  // touch all pages once
  if (dequant) std::fill(out, out + n, 0.0f);
  for (auto _ : state) {
    if (dequant) {
      kvcache::quant::dequantize_per_token(bits, codes.data(), scales.data(), zeros.data(),
                                           kvcache::quant::MetaType::kHalf, n / g, g, out);
      benchmark::DoNotOptimize(out);
    } else {
      benchmark::DoNotOptimize(quant());
    }
    benchmark::ClobberMemory();
  }
  auto q = kvcache::make_quantizer("int" + std::to_string(bits) + ":g" + std::to_string(g));
  set_counters(state, x, q->bits_per_value(shape[3]), kvcache::reconstruction_error(*q, x).rel_fro);
}

/// Calibration under the current machine load: std::memcpy of the fp32 tensor into a
/// preallocated buffer (STREAM-copy-like; bytes = fp32 input, as for the quantizers).
void bench_memcpy(benchmark::State& state, std::vector<int64_t> shape) {
  const at::Tensor& x = tensor_for(shape);
  std::vector<float> out(static_cast<size_t>(x.numel()), 0.0f);
  for (auto _ : state) {
    std::memcpy(out.data(), x.data_ptr<float>(), out.size() * sizeof(float));
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, x, 32.0, 0.0);
}

struct RefCase {
  int bits;
  int64_t g;  // 0 = head_dim
  GroupAxis axis;
};

void bench_ref_quantize(benchmark::State& state, RefCase c, std::vector<int64_t> shape) {
  const at::Tensor& x = tensor_for(shape);
  const int64_t g = c.g == 0 ? shape[3] : c.g;
  for (auto _ : state) {
    auto r = kvcache::quant::ref::quantize_int(x, c.bits, g, c.axis);
    benchmark::DoNotOptimize(r.packed.data_ptr());
  }
  auto r = kvcache::quant::ref::quantize_int(x, c.bits, g, c.axis);
  const at::Tensor y = kvcache::quant::ref::dequantize_int(r.codes, r.scales, r.zeros, g, c.axis);
  set_counters(state, x, c.bits + 32.0 / static_cast<double>(g), kvcache::reconstruction_error(x, y).rel_fro);
}

void bench_ref_dequantize(benchmark::State& state, RefCase c, std::vector<int64_t> shape) {
  const at::Tensor& x = tensor_for(shape);
  const int64_t g = c.g == 0 ? shape[3] : c.g;
  auto r = kvcache::quant::ref::quantize_int(x, c.bits, g, c.axis);
  for (auto _ : state) {
    // The reference stores packed codes too: unpack, then scale and shift.
    at::Tensor codes = kvcache::quant::ref::unpack_codes(r.packed, c.bits, g, c.axis, x.sizes());
    at::Tensor y = kvcache::quant::ref::dequantize_int(codes, r.scales, r.zeros, g, c.axis);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  const at::Tensor y = kvcache::quant::ref::dequantize_int(r.codes, r.scales, r.zeros, g, c.axis);
  set_counters(state, x, c.bits + 32.0 / static_cast<double>(g), kvcache::reconstruction_error(x, y).rel_fro);
}

std::string ref_spec(const RefCase& c) {
  std::string s = "int" + std::to_string(c.bits);
  if (c.g != 0) s += ":g" + std::to_string(c.g);
  if (c.axis == GroupAxis::kPerChannel) s += ":chan";
  return s;
}

void register_all() {
  // Qwen2.5-0.5B layer, a long Qwen cache, a Llama-3-8B layer.
  const std::vector<std::vector<int64_t>> shapes = {{1, 2, 256, 64}, {1, 2, 32768, 64}, {1, 8, 4096, 128}};
  // Sizes of the ggml comparison figures in the issue: 4 MB and 512 MB of fp32.
  const std::vector<std::vector<int64_t>> target_shapes = {{1, 8, 1024, 128}, {1, 32, 32768, 128}};
  const std::vector<std::string> specs = {"fp32",     "fp16",          "bf16",          "fp8:e4m3",
                                          "fp8:e5m2", "fp8:e4m3:scaled", "int8",        "int4",
                                          "int2",     "int4:g32",      "int2:g32",      "int8:g32:chan",
                                          "int4:g32:chan", "int2:g32:chan", "int3",          "int3:g32",
                                          "int3:g32:chan", "had(int4)",    "had(int3:g32)", "tq:b4",
                                          "tq:b3:prod", "polar"};
  const std::vector<RefCase> refs = {{8, 0, GroupAxis::kPerToken},
                                     {4, 0, GroupAxis::kPerToken},
                                     {3, 0, GroupAxis::kPerToken},
                                     {2, 0, GroupAxis::kPerToken},
                                     {4, 32, GroupAxis::kPerToken},
                                     {4, 32, GroupAxis::kPerChannel},
                                     {2, 32, GroupAxis::kPerChannel},
                                     {3, 32, GroupAxis::kPerChannel}};
  for (const auto& shape : shapes) {
    for (const auto& s : specs) {
      benchmark::RegisterBenchmark(("quantize/" + s + "/" + shape_name(shape)).c_str(), bench_quantize, s, shape)
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("dequantize/" + s + "/" + shape_name(shape)).c_str(), bench_dequantize, s,
                                   shape)
          ->Unit(benchmark::kMicrosecond);
    }
    for (const auto& c : refs) {
      benchmark::RegisterBenchmark(("ref_quantize/" + ref_spec(c) + "/" + shape_name(shape)).c_str(),
                                   bench_ref_quantize, c, shape)
          ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("ref_dequantize/" + ref_spec(c) + "/" + shape_name(shape)).c_str(),
                                   bench_ref_dequantize, c, shape)
          ->Unit(benchmark::kMicrosecond);
    }
  }
  for (const auto& shape : target_shapes) {
    benchmark::RegisterBenchmark(("memcpy/fp32/" + shape_name(shape)).c_str(), bench_memcpy, shape)
        ->Unit(benchmark::kMillisecond);
    for (const std::string s : {"int8:g32", "int4:g32", "int8", "int4", "int2", "int4:g32:chan", "fp8:e4m3",
                                "fp8:e5m2", "fp8:e4m3:scaled", "fp16", "bf16"}) {
      benchmark::RegisterBenchmark(("quantize/" + s + "/" + shape_name(shape)).c_str(), bench_quantize, s, shape)
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("dequantize/" + s + "/" + shape_name(shape)).c_str(), bench_dequantize, s,
                                   shape)
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("quantize_into/" + s + "/" + shape_name(shape)).c_str(), bench_quantize_into, s,
                                   shape)
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("dequantize_into/" + s + "/" + shape_name(shape)).c_str(), bench_dequantize_into,
                                   s, shape)
          ->Unit(benchmark::kMillisecond);
    }
    for (int bits : {8, 4, 3}) {
      const std::string s = "int" + std::to_string(bits) + ":g32";
      benchmark::RegisterBenchmark(("kernel_quantize/" + s + "/" + shape_name(shape)).c_str(), bench_kernel, bits,
                                   int64_t{32}, false, shape)
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("kernel_dequantize/" + s + "/" + shape_name(shape)).c_str(), bench_kernel, bits,
                                   int64_t{32}, true, shape)
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
