// SPDX-License-Identifier: Apache-2.0
// The cache schemes (kvcache/cache_scheme.h): the trivial scheme of a quantizer spec, KIVI and
// the Hadamard rotation wrapper; their registration list and make_cache_scheme.
#include "kvcache/cache_scheme.h"

#include <algorithm>
#include <map>

#include "cache/codebook_schemes.h"
#include "cache/kvquant_scheme.h"
#include "registry/registry.h"
#include "kvcache/error.h"
#include "quant/gear_quantizer.h"
#include "quant/hadamard.h"
#include "quant/int_kernels.h"
#include "quant/rotated_quantizer.h"

namespace kvcache {
namespace {

void check_geometry(const std::string& spec, const CacheGeometry& g, int64_t layer, int64_t residual_length) {
  KV_CHECK_ARG(g.num_layers >= 1 && g.num_kv_heads >= 1 && g.head_dim >= 1, "cache scheme '", spec,
               "': geometry needs layers, KV heads and head_dim >= 1, got ", g.num_layers, ", ", g.num_kv_heads, ", ",
               g.head_dim);
  KV_CHECK_ARG(layer >= 0 && layer < g.num_layers, "cache scheme '", spec, "': layer ", layer, " out of range [0, ",
               g.num_layers, ")");
  KV_CHECK_ARG(residual_length >= 0 && residual_length <= kMaxTokens, "CacheConfig::residual_length must be in [0, ",
               kMaxTokens, "], got ", residual_length);
}

/// The stored layout of `q` for head_dim `d`, a failure reported in the words of scheme `spec`.
StoredLayout layout_in(const std::string& spec, const char* stream, const Quantizer& q, int64_t d) {
  try {
    return q.stored_layout(d);
  } catch (const InvalidArgument& e) {
    if (spec == q.spec()) throw;
    throw InvalidArgument(detail::str_cat("cache scheme '", spec, "': its ", stream, " are stored as '", q.spec(),
                                          "', which fails: ", e.what()));
  }
}

// ---------------------------------------------------------------- trivial
/// A quantizer spec as a scheme: the same quantizer for K and V.
class TrivialScheme final : public CacheScheme {
 public:
  explicit TrivialScheme(std::shared_ptr<const Quantizer> q) : q_(std::move(q)) {}
  std::string spec() const override { return q_->spec(); }

  LayerStreams streams(const CacheGeometry& g, int64_t layer, int64_t residual_length) const override {
    check_geometry(spec(), g, layer, residual_length);
    const StoredLayout l = q_->stored_layout(g.head_dim);
    StreamSpec s;
    s.quantizer = q_;
    // A quantizer that stores float32 rows (fp32, had(fp32)) keeps a float32 residual: a
    // float16 one would be lossier than the format itself.
    const bool f32_rows = l.meta_count == 0 && !l.tensor_scale && l.code_bytes == 4 * g.head_dim * l.group_tokens;
    s.residual_dtype = f32_rows ? DType::kFloat32 : DType::kFloat16;
    const int64_t gt = l.group_tokens;
    if (gt > 1) {
      // Groups span gt tokens: tokens wait in the residual until whole groups can be quantized.
      s.residual = std::max<int64_t>(gt, (residual_length + gt - 1) / gt * gt);
      s.flush = ResidualFlush::kBlock;
    } else {
      s.residual = residual_length;
      s.flush = ResidualFlush::kSliding;
    }
    return {s, s};
  }

 private:
  std::shared_ptr<const Quantizer> q_;
};

// ---------------------------------------------------------------- KIVI
const ParamTable& kivi_table() {
  static const ParamTable t = [] {
    std::vector<double> widths;
    for (int b : quant::kIntBits) widths.push_back(b);
    std::sort(widths.begin(), widths.end());
    ParamTable tt{"kivi",
                  "KIVI (arXiv 2402.02750): keys per-channel in groups of g tokens, values per-token in "
                  "groups of g channels, fp16 residual of the r most recent tokens",
                  {{"k", "key bits (the registered int<b> widths)", ParamDef::Kind::kInt, 2, widths.front(), widths.back(), {}},
                   {"v", "value bits (the registered int<b> widths)", ParamDef::Kind::kInt, 2, widths.front(), widths.back(),
                    {}},
                   {"g", "group size (tokens for keys, channels for values)", ParamDef::Kind::kInt, 32, 1, 4096, {}},
                   {"r", "full-precision residual tokens (a positive multiple of g)", ParamDef::Kind::kInt, 128, 1,
                    static_cast<double>(kMaxTokens), {}}}};
    // The canonical form keeps every field: the KIVI configs in papers name all four.
    for (auto& p : tt.params) p.shown = true;
    tt.params[0].allowed = widths;
    tt.params[1].allowed = widths;
    return tt;
  }();
  return t;
}

class KiviScheme final : public CacheScheme {
 public:
  explicit KiviScheme(const ParsedSpec& p)
      : k_(p.integer("k")), v_(p.integer("v")), g_(p.integer("g")), r_(p.integer("r")), spec_(p.canonical()),
        text_(p.text()) {
    // Keys are quantized per channel in whole groups of g tokens, which wait in the residual
    // until a group is complete: the residual holds at least g tokens.
    KV_CHECK_ARG(r_ >= g_ && r_ % g_ == 0, "cache scheme '", text_, "': residual r=", r_,
                 " must be a positive multiple of the group size g=", g_,
                 " (keys are quantized in whole groups of g tokens, which wait in the residual)");
    key_ = stream_quantizer("keys", "int" + std::to_string(k_) + ":g" + std::to_string(g_) + ":chan");
    value_ = stream_quantizer("values", "int" + std::to_string(v_) + ":g" + std::to_string(g_));
  }

  std::string spec() const override { return spec_; }

  LayerStreams streams(const CacheGeometry& g, int64_t layer, int64_t residual_length) const override {
    check_geometry(spec_, g, layer, residual_length);
    KV_CHECK_ARG(g.head_dim % g_ == 0, "cache scheme '", spec_,
                 "': values are grouped along head_dim, which must be divisible by g=", g_, ", got head_dim=", g.head_dim);
    KV_CHECK_ARG(residual_length == 0 || residual_length == r_, "cache scheme '", spec_, "' sets its own residual (r=", r_,
                 "); CacheConfig::residual_length must be 0 or ", r_, ", got ", residual_length);
    (void)layout_in(spec_, "keys", *key_, g.head_dim);
    (void)layout_in(spec_, "values", *value_, g.head_dim);
    LayerStreams s;
    s.key = {key_, r_, ResidualFlush::kBlock, DType::kFloat16, {}, 0, nullptr, false};
    s.value = {value_, r_, ResidualFlush::kSliding, DType::kFloat16, {}, 0, nullptr, false};
    return s;
  }

 private:
  /// A stream's quantizer, a failure reported in the words of the scheme spec the user wrote.
  std::shared_ptr<const Quantizer> stream_quantizer(const char* stream, const std::string& q) const {
    try {
      return make_quantizer(q);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat("cache scheme '", text_, "': its ", stream, " are stored as '", q,
                                            "', which fails: ", e.what()));
    }
  }

  int64_t k_, v_, g_, r_;
  std::string spec_;
  std::string text_;  ///< as written (construction errors)
  std::shared_ptr<const Quantizer> key_, value_;
};

// ---------------------------------------------------------------- GEAR
const ParamTable& gear_table() {
  static const ParamTable t = [] {
    std::vector<double> widths;
    for (int b : quant::kIntBits) widths.push_back(b);
    std::sort(widths.begin(), widths.end());
    ParamTable tt{"gear",
                  "GEAR (arXiv 2403.05527): each block of nb tokens per KV head stored as a KIVI-style base "
                  "quantization (keys per channel in groups of g tokens, values per token in groups of g channels) "
                  "+ fp16 outliers (ratio s) + a rank-r fp16 factorization of the residual (power iteration, loop "
                  "iterations); the newest < nb tokens stay fp16",
                  {{"b", "base quantizer bits (the registered int<b> widths)", ParamDef::Kind::kInt, 2, widths.front(),
                    widths.back(), {}},
                   {"g", "group size (tokens for keys, channels for values)", ParamDef::Kind::kInt, 64, 1, 4096, {}},
                   {"s", "outlier ratio: floor(s*len/2) largest and smallest per key channel of a block / per value "
                         "token",
                    ParamDef::Kind::kFloat, 0.02, 0, 0.5, {}},
                   {"r", "rank of the low-rank residual per block (0: none)", ParamDef::Kind::kInt, 2, 0, 4096, {}},
                   {"loop", "power-iteration loops", ParamDef::Kind::kInt, 3, 1, 100, {}},
                   {"nb", "streaming buffer: tokens per compressed block (a multiple of g)", ParamDef::Kind::kInt, 64,
                    1, 65536, {}},
                   {"rp", "prefill rank: blocks compressed by an append of more than one token (the prompt) use rp, "
                          "blocks compressed in decode steps r; every block reserves max(r, rp) factor columns "
                          "(counted); -1: r",
                    ParamDef::Kind::kInt, -1, -1, 4096, {}},
                   {"mode", "streaming mode: newest (compress each full buffer of nb tokens once) or whole (also "
                            "decode and re-encode every compressed block each time a decode step compresses a "
                            "buffer, every nb steps: the reference scripts' re-compression of the whole cache)",
                    ParamDef::Kind::kChoice, 0, 0, 0, {"newest", "whole"}}}};
    for (size_t i = 0; i < 6; ++i) tt.params[i].shown = true;
    tt.params[0].allowed = widths;
    return tt;
  }();
  return t;
}

/// GEAR's canonical spec: rp equal to r is the default (printed only when it differs).
std::string gear_canonical(const ParsedSpec& p) {
  std::map<std::string, double> nums;
  for (const char* k : {"b", "g", "s", "r", "loop", "nb"}) nums[k] = p.num(k);
  nums["rp"] = p.num("rp") == p.num("r") ? -1 : p.num("rp");
  return canonical_spec(gear_table(), nums, {{"mode", p.choice("mode")}});
}

/// GEAR's two streams, compressing the newest nb tokens whenever the fp16 buffer holds nb;
/// blocks compressed by a multi-token append (the prompt) encoded with rank rp, those of decode
/// steps with r; `whole`: each decode-step compression also re-encodes every older block.
class GearScheme final : public CacheScheme {
 public:
  explicit GearScheme(const ParsedSpec& p) : spec_(gear_canonical(p)) {
    quant::GearParams g;
    g.bits = static_cast<int>(p.integer("b"));
    g.group = p.integer("g");
    g.sparsity = p.num("s");
    g.rank = p.integer("r");
    g.loop = p.integer("loop");
    g.block = p.integer("nb");
    const int64_t rp = p.integer("rp") < 0 ? g.rank : p.integer("rp");
    g.stored_rank = std::max(g.rank, rp);
    key_ = std::make_shared<quant::GearQuantizer>(g, quant::GearStream::kKey, spec_, p.text());
    value_ = std::make_shared<quant::GearQuantizer>(g, quant::GearStream::kValue, spec_, p.text());
    if (rp != g.rank) {
      quant::GearParams gp = g;
      gp.rank = rp;
      key_prefill_ = std::make_shared<quant::GearQuantizer>(gp, quant::GearStream::kKey, spec_, p.text(), " (prefill)");
      value_prefill_ =
          std::make_shared<quant::GearQuantizer>(gp, quant::GearStream::kValue, spec_, p.text(), " (prefill)");
    }
    whole_ = p.choice("mode") == "whole";
    block_ = g.block;
    group_ = g.group;
  }

  std::string spec() const override { return spec_; }

  LayerStreams streams(const CacheGeometry& g, int64_t layer, int64_t residual_length) const override {
    check_geometry(spec_, g, layer, residual_length);
    KV_CHECK_ARG(g.head_dim % group_ == 0, "cache scheme '", spec_,
                 "': values are grouped along head_dim (per KV head), which must be divisible by g=", group_,
                 ", got head_dim=", g.head_dim);
    KV_CHECK_ARG(residual_length == 0 || residual_length == block_, "cache scheme '", spec_,
                 "' sets its own residual (the streaming buffer nb=", block_,
                 "); CacheConfig::residual_length must be 0 or ", block_, ", got ", residual_length);
    (void)layout_in(spec_, "keys", *key_, g.head_dim);
    (void)layout_in(spec_, "values", *value_, g.head_dim);
    LayerStreams s;
    s.key = {key_, block_, ResidualFlush::kBlock, DType::kFloat16, {}, 0, nullptr, false};
    s.value = {value_, block_, ResidualFlush::kBlock, DType::kFloat16, {}, 0, nullptr, false};
    s.key.prefill_quantizer = key_prefill_;
    s.value.prefill_quantizer = value_prefill_;
    s.key.recompress = s.value.recompress = whole_;
    return s;
  }

 private:
  std::string spec_;
  int64_t block_ = 0, group_ = 0;
  bool whole_ = false;
  std::shared_ptr<const Quantizer> key_, value_, key_prefill_, value_prefill_;
};

// ---------------------------------------------------------------- Hadamard rotation
class RotationScheme final : public CacheScheme {
 public:
  RotationScheme(bool values, std::unique_ptr<CacheScheme> inner) : values_(values), inner_(std::move(inner)) {}

  std::string spec() const override {
    return canonical_spec(quant::RotatedQuantizer::table(), {}, {{"streams", values_ ? "kv" : "k"}}) + "(" +
           inner_->spec() + ")";
  }

  LayerStreams streams(const CacheGeometry& g, int64_t layer, int64_t residual_length) const override {
    KV_CHECK_ARG(quant::is_power_of_two(g.head_dim), "cache scheme '", spec(),
                 "': the Hadamard rotation needs head_dim a power of two, got head_dim=", g.head_dim,
                 " (H_D is built by Sylvester's doubling)");
    LayerStreams s = inner_->streams(g, layer, residual_length);
    // Per-head quantizers (KVQuant) carry ranges calibrated on the unrotated channels: rotating
    // their input would quantize other numbers than the calibration saw.
    KV_CHECK_ARG(s.key.head_quantizers.empty() && s.value.head_quantizers.empty(), "cache scheme '", spec(),
                 "': the Hadamard rotation cannot wrap '", inner_->spec(),
                 "', whose per-channel ranges are calibrated on the unrotated channels");
    s.key.quantizer = rotated(s.key.quantizer);
    if (s.key.prefill_quantizer) s.key.prefill_quantizer = rotated(s.key.prefill_quantizer);
    if (values_) {
      s.value.quantizer = rotated(s.value.quantizer);
      if (s.value.prefill_quantizer) s.value.prefill_quantizer = rotated(s.value.prefill_quantizer);
    }
    return s;
  }

  std::optional<KeyStorage> required_key_storage() const override { return inner_->required_key_storage(); }

 private:
  std::shared_ptr<const Quantizer> rotated(std::shared_ptr<const Quantizer> q) const {
    try {
      return std::make_shared<quant::RotatedQuantizer>(std::move(q));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat("cache scheme '", spec(), "': ", e.what()));
    }
  }

  bool values_;
  std::unique_ptr<CacheScheme> inner_;
};

}  // namespace

namespace registry {

std::vector<Entry> scheme_entries() {
  std::vector<Entry> v;
  Entry kivi;
  kivi.kind = SpecKind::kCacheScheme;
  kivi.table = &kivi_table();
  kivi.scheme = [](const ParsedSpec& p, const std::string&) -> std::unique_ptr<CacheScheme> {
    return std::make_unique<KiviScheme>(p);
  };
  v.push_back(std::move(kivi));
  v.push_back(kvquant_entry());

  Entry had;
  had.kind = SpecKind::kCacheScheme;
  had.table = &quant::RotatedQuantizer::table();
  had.wrapper = true;
  had.scheme = [](const ParsedSpec& p, const std::string& inner) -> std::unique_ptr<CacheScheme> {
    KV_CHECK_ARG(spec_head(inner) != "had", "cache scheme '", p.canonical(), "(", inner, ")': '", inner,
                 "' is already rotated (H_D · H_D = I: a second rotation undoes the first)");
    return std::make_unique<RotationScheme>(p.choice("streams") == "kv", make_cache_scheme(inner));
  };
  // had(<quantizer>) is a quantizer too (kv_study quant, bench_quant); had:k needs a scheme.
  had.quantizer = [](const ParsedSpec& p, const std::string& inner) -> std::unique_ptr<Quantizer> {
    KV_CHECK_ARG(p.choice("streams") == "kv", "spec '", p.canonical(), "(", inner, ")': '", p.canonical(),
                 "' rotates only the keys of a cache scheme; a quantizer has no keys and values (as a quantizer "
                 "write 'had(", inner, ")')");
    std::shared_ptr<const Quantizer> q;
    try {
      q = make_quantizer(inner);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat("spec 'had(", inner, ")': ", e.what()));
    }
    return std::make_unique<quant::RotatedQuantizer>(std::move(q));
  };
  v.push_back(std::move(had));

  Entry gear;
  gear.kind = SpecKind::kCacheScheme;
  gear.table = &gear_table();
  gear.scheme = [](const ParsedSpec& p, const std::string&) -> std::unique_ptr<CacheScheme> {
    return std::make_unique<GearScheme>(p);
  };
  v.push_back(std::move(gear));
  v.push_back(turboquant_entry());
  v.push_back(qjl_entry());
  v.push_back(layer_scheme_entry());
  return v;
}

}  // namespace registry

std::unique_ptr<CacheScheme> make_cache_scheme(const std::string& spec) {
  KV_CHECK_ARG(!spec.empty(), "cache scheme spec is empty (expected e.g. 'fp32', 'int4:g64', 'kivi:k2:v2:g32:r128')");
  const registry::Parsed p =
      registry::parse(spec, SpecKind::kCacheScheme, {SpecKind::kQuantizer, SpecKind::kCacheScheme});
  if (p.entry->kind == SpecKind::kQuantizer) {
    return std::make_unique<TrivialScheme>(p.entry->quantizer(p.fields, p.inner));
  }
  return p.entry->scheme(p.fields, p.inner);
}

std::vector<ParamTable> registered_cache_schemes() {
  std::vector<ParamTable> out;
  for (const auto& e : registry::entries()) {
    if (e.kind == SpecKind::kCacheScheme) out.push_back(*e.table);
  }
  return out;
}

}  // namespace kvcache
