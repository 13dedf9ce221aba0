// SPDX-License-Identifier: Apache-2.0
#include "cache/cache_scheme.h"

#include <cctype>

#include "kvcache/error.h"

namespace kvcache::cache {
namespace {

const ParamTable& kivi_table() {
  static const ParamTable t{
      "kivi",
      "KIVI (arXiv 2402.02750): keys per-channel in groups of g tokens, values per-token in "
      "groups of g channels, fp16 residual of the r most recent tokens",
      {{"k", "key bits", ParamDef::Kind::kInt, 2, 1, 8, {}},
       {"v", "value bits", ParamDef::Kind::kInt, 2, 1, 8, {}},
       {"g", "group size (tokens for keys, channels for values)", ParamDef::Kind::kInt, 32, 1,
        4096, {}},
       {"r", "full-precision residual tokens (multiple of g)", ParamDef::Kind::kInt, 128, 0, 1e9,
        {}}}};
  return t;
}

CacheScheme make_kivi(const std::string& text, int64_t residual_length, int64_t head_dim) {
  auto p = ParsedSpec::parse(text, kivi_table());
  const int64_t k = p.integer("k"), v = p.integer("v"), g = p.integer("g"), r = p.integer("r");
  KV_CHECK_ARG(r % g == 0, "cache scheme '", text, "': residual r=", r,
               " must be a multiple of the group size g=", g,
               " (keys are flushed in whole groups)");
  KV_CHECK_ARG(head_dim <= 0 || head_dim % g == 0, "cache scheme '", text,
               "': values are grouped along head_dim, which must be divisible by g=", g,
               ", got head_dim=", head_dim);
  KV_CHECK_ARG(residual_length == 0 || residual_length == r, "cache scheme '", text,
               "' sets its own residual (r=", r, "); CacheConfig::residual_length must be 0 or ", r,
               ", got ", residual_length);
  CacheScheme s;
  // Canonical form keeps every field (the KIVI configs in papers name all four).
  s.canonical = "kivi:k" + std::to_string(k) + ":v" + std::to_string(v) + ":g" + std::to_string(g) +
                ":r" + std::to_string(r);
  s.key = {"int" + std::to_string(k) + ":g" + std::to_string(g) + ":chan", r, ResidualFlush::kBlock,
           at::kHalf};
  s.value = {"int" + std::to_string(v) + ":g" + std::to_string(g), r, ResidualFlush::kSliding,
             at::kHalf};
  return s;
}

}  // namespace

int64_t spec_group_size(const std::string& quantizer_spec) {
  auto parts = split_spec(split_budget(quantizer_spec).first);
  for (size_t i = 1; i < parts.size(); ++i) {
    const auto& f = parts[i];
    if (f.size() > 1 && f[0] == 'g' && std::isdigit(static_cast<unsigned char>(f[1]))) {
      return std::stoll(f.substr(1));
    }
  }
  return 0;
}

bool spec_is_per_channel(const std::string& quantizer_spec) {
  auto parts = split_spec(quantizer_spec);
  for (size_t i = 1; i < parts.size(); ++i) {
    if (parts[i] == "chan") return true;
  }
  return false;
}

CacheScheme parse_cache_scheme(const std::string& quant, int64_t residual_length, int64_t head_dim) {
  KV_CHECK_ARG(!quant.empty(), "CacheConfig::quant is empty (expected e.g. 'fp32', 'int4:g64', "
               "'kivi:k2:v2:g32:r128')");
  KV_CHECK_ARG(residual_length >= 0, "CacheConfig::residual_length must be >= 0, got ",
               residual_length);
  const std::string head = split_spec(quant)[0];
  if (head == "kivi") return make_kivi(quant, residual_length, head_dim);
  CacheScheme s;
  s.canonical = quant;
  const at::ScalarType rdt = head == "fp32" ? at::kFloat : at::kHalf;
  if (spec_is_per_channel(quant)) {
    const int64_t g = spec_group_size(quant);
    KV_CHECK_ARG(g > 0, "quantizer '", quant, "' is per-channel but names no group size g<N>");
    // Groups span g tokens: tokens wait in the residual until whole groups can be quantized.
    const int64_t r = std::max<int64_t>(g, (residual_length + g - 1) / g * g);
    s.key = {quant, r, ResidualFlush::kBlock, rdt};
  } else {
    s.key = {quant, residual_length, ResidualFlush::kSliding, rdt};
  }
  s.value = s.key;
  return s;
}

std::vector<ParamTable> registered_cache_schemes() { return {kivi_table()}; }

}  // namespace kvcache::cache
