// SPDX-License-Identifier: Apache-2.0
#include "cache/cache_scheme.h"

#include <algorithm>

#include "kvcache/error.h"
#include "kvcache/quantizer.h"

namespace kvcache::cache {
namespace {

const ParamTable& kivi_table() {
  static const ParamTable t{
      "kivi",
      "KIVI (arXiv 2402.02750): keys per-channel in groups of g tokens, values per-token in "
      "groups of g channels, fp16 residual of the r most recent tokens",
      {{"k", "key bits: 2, 4 or 8", ParamDef::Kind::kInt, 2, 2, 8, {}},
       {"v", "value bits: 2, 4 or 8", ParamDef::Kind::kInt, 2, 2, 8, {}},
       {"g", "group size (tokens for keys, channels for values)", ParamDef::Kind::kInt, 32, 1,
        4096, {}},
       {"r", "full-precision residual tokens (a positive multiple of g)", ParamDef::Kind::kInt, 128, 1,
        static_cast<double>(kMaxTokens), {}}}};
  return t;
}

struct KiviParams {
  int64_t k, v, g, r;
  std::string canonical() const {
    // Canonical form keeps every field (the KIVI configs in papers name all four).
    return "kivi:k" + std::to_string(k) + ":v" + std::to_string(v) + ":g" + std::to_string(g) + ":r" +
           std::to_string(r);
  }
  std::string key_quantizer() const { return "int" + std::to_string(k) + ":g" + std::to_string(g) + ":chan"; }
  std::string value_quantizer() const { return "int" + std::to_string(v) + ":g" + std::to_string(g); }
};

/// Builds a stream's quantizer (and, with head_dim > 0, its layout), reporting a failure in the
/// words of the scheme spec the user wrote.
void check_stream_quantizer(const std::string& text, const char* stream, const std::string& spec, int64_t head_dim) {
  try {
    const auto q = make_quantizer(spec);
    if (head_dim > 0) (void)q->stored_layout(head_dim);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(detail::str_cat("cache scheme '", text, "': its ", stream, " are stored as '", spec,
                                          "', which fails: ", e.what()));
  }
}

KiviParams parse_kivi(const std::string& text) {
  auto p = ParsedSpec::parse(text, kivi_table());
  const KiviParams kp{p.integer("k"), p.integer("v"), p.integer("g"), p.integer("r")};
  for (const auto& [bits, which] : {std::pair<int64_t, const char*>{kp.k, "k"}, {kp.v, "v"}}) {
    KV_CHECK_ARG(bits == 2 || bits == 4 || bits == 8, "cache scheme '", text, "': ", which, "=", bits,
                 " bits is not a registered integer width (expected 2, 4 or 8)");
  }
  // Keys are quantized per channel in whole groups of g tokens, which wait in the residual
  // until a group is complete: the residual holds at least g tokens.
  KV_CHECK_ARG(kp.r >= kp.g && kp.r % kp.g == 0, "cache scheme '", text, "': residual r=", kp.r,
               " must be a positive multiple of the group size g=", kp.g,
               " (keys are quantized in whole groups of g tokens, which wait in the residual)");
  check_stream_quantizer(text, "keys", kp.key_quantizer(), 0);
  check_stream_quantizer(text, "values", kp.value_quantizer(), 0);
  return kp;
}

CacheScheme make_kivi(const std::string& text, int64_t residual_length, int64_t head_dim) {
  const KiviParams kp = parse_kivi(text);
  const int64_t g = kp.g, r = kp.r;
  KV_CHECK_ARG(head_dim % g == 0, "cache scheme '", text,
               "': values are grouped along head_dim, which must be divisible by g=", g,
               ", got head_dim=", head_dim);
  KV_CHECK_ARG(residual_length == 0 || residual_length == r, "cache scheme '", text,
               "' sets its own residual (r=", r, "); CacheConfig::residual_length must be 0 or ", r,
               ", got ", residual_length);
  check_stream_quantizer(text, "keys", kp.key_quantizer(), head_dim);
  check_stream_quantizer(text, "values", kp.value_quantizer(), head_dim);
  CacheScheme s;
  s.canonical = kp.canonical();
  s.key = {kp.key_quantizer(), r, ResidualFlush::kBlock, at::kHalf};
  s.value = {kp.value_quantizer(), r, ResidualFlush::kSliding, at::kHalf};
  return s;
}

}  // namespace

CacheScheme parse_cache_scheme(const std::string& quant, int64_t residual_length, int64_t head_dim) {
  KV_CHECK_ARG(!quant.empty(), "CacheConfig::quant is empty (expected e.g. 'fp32', 'int4:g64', "
               "'kivi:k2:v2:g32:r128')");
  KV_CHECK_ARG(residual_length >= 0 && residual_length <= kMaxTokens, "CacheConfig::residual_length must be in [0, ",
               kMaxTokens, "], got ", residual_length);
  KV_CHECK_ARG(head_dim >= 1, "parse_cache_scheme: head_dim must be >= 1, got ", head_dim);
  const std::string head = split_spec(quant)[0];
  if (head == "kivi") return make_kivi(quant, residual_length, head_dim);
  const auto q = make_quantizer(quant);
  CacheScheme s;
  s.canonical = q->spec();
  const at::ScalarType rdt = head == "fp32" ? at::kFloat : at::kHalf;
  const int64_t g = q->stored_layout(head_dim).group_tokens;
  if (g > 1) {
    // Groups span g tokens: tokens wait in the residual until whole groups can be quantized.
    const int64_t r = std::max<int64_t>(g, (residual_length + g - 1) / g * g);
    s.key = {s.canonical, r, ResidualFlush::kBlock, rdt};
  } else {
    s.key = {s.canonical, residual_length, ResidualFlush::kSliding, rdt};
  }
  s.value = s.key;
  return s;
}

std::string canonical_cache_spec(const std::string& quant) {
  KV_CHECK_ARG(!quant.empty(), "CacheConfig::quant is empty (expected e.g. 'fp32', 'int4:g64', "
               "'kivi:k2:v2:g32:r128')");
  if (split_spec(quant)[0] == "kivi") return parse_kivi(quant).canonical();
  return make_quantizer(quant)->spec();
}

std::vector<ParamTable> registered_cache_schemes() { return {kivi_table()}; }

}  // namespace kvcache::cache
