// SPDX-License-Identifier: Apache-2.0
#pragma once
// Shared fixtures of the quantizer tests: synthetic KV tensors and specs.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <string>
#include <vector>

namespace kvcache::testing {

/// Every spec the contract suite covers; every registered head must appear at least once.
inline std::vector<std::string> contract_specs() {
  return {"fp32",          "fp16",          "bf16",           "fp8:e4m3",       "fp8:e5m2",
          "fp8:e4m3:scaled", "fp8:e5m2:scaled", "int8",       "int4",           "int2",
          "int8:g32",      "int4:g32",      "int2:g16",       "int8:g32:chan",  "int4:g32:chan",
          "int2:g32:chan", "int4:g64:chan", "int3",         "int3:g32",      "int3:g32:chan",
          "had(fp32)",     "had(int4)",     "had(int3:g32)",  "had(int2:g32:chan)", "had(fp8:e4m3)",
          "tq:b4",         "tq:b1",         "tq:b3:nc",       "tq:b3:prod",     "tq:b2.5",        "tq:b2:o16",
          "polar"};
}

/// The contract specs whose elementwise error bound tests/quant_property_test.cpp states: every
/// one but the rotated had(...) specs, whose error is the inner format's in the rotated domain
/// (a row-norm bound, not an elementwise one; the rotation of values near FLT_MAX can exceed
/// float32, which quantize() rejects), and TurboQuant's tq:... and PolarQuant's polar, whose
/// errors are row-norm ones too (tests/quant_turboquant_test.cpp, tests/quant_polar_test.cpp). tests/scheme_test.cpp holds had(q) to q of H·x exactly.
inline std::vector<std::string> property_specs() {
  std::vector<std::string> v;
  for (const auto& s : contract_specs()) {
    if (s.rfind("had(", 0) != 0 && s.rfind("tq:", 0) != 0 && s != "polar") v.push_back(s);
  }
  return v;
}

/// Standard normal [B, H, T, D] float32 with a fixed seed.
inline at::Tensor randn_kv(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat));
}

/// Outlier-heavy KV-like tensor: N(0,1) plus a few channels scaled ×20 with an offset
/// (the key outlier channels KIVI/KVQuant describe), sparse ±200 spikes, and one
/// constant channel.
inline at::Tensor outlier_kv(std::vector<int64_t> shape, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor x = at::randn(shape, gen, at::TensorOptions().dtype(at::kFloat));
  const int64_t d = shape[3];
  at::Tensor chan_scale = at::ones({d});
  at::Tensor chan_shift = at::zeros({d});
  for (int64_t c = 3; c < d; c += 17) {
    chan_scale[c] = 20.0;
    chan_shift[c] = 5.0;
  }
  x = x * chan_scale + chan_shift;
  at::Tensor spikes = at::rand(shape, gen) < 0.002;
  x = at::where(spikes, at::sign(x) * 200.0, x);
  x.select(3, d - 1).fill_(0.75);
  return x;
}

}  // namespace kvcache::testing
