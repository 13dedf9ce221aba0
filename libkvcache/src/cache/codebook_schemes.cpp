// SPDX-License-Identifier: Apache-2.0
// The rotation-and-codebook cache schemes (codebook_schemes.h).
#include "cache/codebook_schemes.h"

#include <algorithm>
#include <string>

#include "kvcache/error.h"
#include "quant/hadamard.h"
#include "quant/int_kernels.h"
#include "quant/qjl_quantizer.h"
#include "quant/turboquant_quantizer.h"

namespace kvcache::registry {
namespace {

const ParamTable& turboquant_table() {
  static const ParamTable t = [] {
    const std::vector<double> widths = {1, 1.5, 2, 2.5, 3, 3.5, 4};
    ParamTable tt{"turboquant",
                  "TurboQuant (arXiv 2504.19874) as the paper stores a cache: keys tq:b<k>:prod (kmse: tq:b<k>, "
                  "vLLM's choice), values tq:b<v>; layer l seeded with seed + 1337*l (vLLM: 42 + 1337*layer)",
                  {{"k", "key bits per coordinate (1..4 in steps of 0.5; prod needs >= 2)", ParamDef::Kind::kFloat, 3,
                    1, 4, {}, widths},
                   {"v", "value bits per coordinate (1..4 in steps of 0.5)", ParamDef::Kind::kFloat, 3, 1, 4, {},
                    widths},
                   {"keys", "kprod: keys TurboQuant-Prod (unbiased q.k, the paper); kmse: keys TurboQuant-MSE",
                    ParamDef::Kind::kChoice, 0, 0, 0, {"kprod", "kmse"}},
                   {"norm", "nonc | nc: vLLM's norm correction of the MSE stages", ParamDef::Kind::kChoice, 0, 0, 0,
                    {"nonc", "nc"}},
                   {"seed", "seed of layer 0; layer l uses seed + 1337*l", ParamDef::Kind::kInt, 42, 0, 1000000000.0,
                    {}}}};
    tt.params[0].shown = true;
    tt.params[1].shown = true;
    return tt;
  }();
  return t;
}

class TurboQuantScheme final : public CacheScheme {
 public:
  explicit TurboQuantScheme(const ParsedSpec& p)
      : k_(p.num("k")), v_(p.num("v")), kprod_(p.choice("keys") == "kprod"), nc_(p.choice("norm") == "nc"),
        seed_(p.integer("seed")), spec_(p.canonical()) {
    KV_CHECK_ARG(!kprod_ || k_ >= 2, "cache scheme '", p.text(), "': keys in TurboQuant-Prod need k >= 2 (k - 1 bits of "
                 "codebook + 1 of sketch), got k = ", k_, "; write 'kmse' for MSE keys");
  }

  std::string spec() const override { return spec_; }

  LayerStreams streams(const CacheGeometry& g, int64_t layer, int64_t residual_length) const override {
    KV_CHECK_ARG(g.num_layers >= 1 && layer >= 0 && layer < g.num_layers, "cache scheme '", spec_, "': layer ", layer,
                 " out of range [0, ", g.num_layers, ")");
    KV_CHECK_ARG(residual_length >= 0 && residual_length <= kMaxTokens, "CacheConfig::residual_length must be in [0, ",
                 kMaxTokens, "], got ", residual_length);
    KV_CHECK_ARG(quant::is_power_of_two(g.head_dim), "cache scheme '", spec_,
                 "': TurboQuant's randomized Hadamard rotation needs head_dim a power of two, got head_dim=", g.head_dim);
    const int64_t seed = (seed_ + 1337 * layer) % 2147483648LL;
    LayerStreams s;
    s.key.quantizer = std::make_shared<quant::TurboQuantizer>(
        k_, kprod_ ? quant::TurboMode::kProd : quant::TurboMode::kMse, nc_, seed);
    s.value.quantizer = std::make_shared<quant::TurboQuantizer>(v_, quant::TurboMode::kMse, nc_, seed);
    s.key.residual = s.value.residual = residual_length;
    s.key.flush = s.value.flush = ResidualFlush::kSliding;
    s.key.residual_dtype = s.value.residual_dtype = DType::kFloat16;
    return s;
  }

 private:
  double k_, v_;
  bool kprod_, nc_;
  int64_t seed_;
  std::string spec_;
};

const ParamTable& qjl_table() {
  static const ParamTable t = [] {
    std::vector<double> widths;
    for (int b : quant::kIntBits) widths.push_back(b);
    std::sort(widths.begin(), widths.end());
    ParamTable tt{"qjl",
                  "QJL (arXiv 2406.03482): keys as 1-bit JL sketches sign(S k) of m bits + ||k|| fp16, o outlier "
                  "channels per group of g tokens sketched apart (mo bits); values int<v> per token in groups of vg "
                  "channels; an fp16 window of the r newest tokens",
                  {{"m", "key sketch bits per token (a multiple of 8)", ParamDef::Kind::kInt, 256, 8, 8192, {}},
                   {"o", "outlier channels per group of g tokens", ParamDef::Kind::kInt, 8, 0, 255, {}},
                   {"g", "tokens per key group (outliers chosen per group)", ParamDef::Kind::kInt, 32, 1, 4096, {}},
                   {"v", "value bits (the registered int<b> widths)", ParamDef::Kind::kInt, 2, widths.front(),
                    widths.back(), {}, widths},
                   {"r", "fp16 window of the newest tokens (a positive multiple of g)", ParamDef::Kind::kInt, 128, 1,
                    static_cast<double>(kMaxTokens), {}},
                   {"mo", "outlier sketch bits per token (a multiple of 8, <= m; 0 only with o0)",
                    ParamDef::Kind::kInt, 64, 0, 8192, {}},
                   {"vg", "value group size in channels", ParamDef::Kind::kInt, 32, 1, 4096, {}},
                   {"seed", "sketch seed of layer 0; layer l uses seed + 1337*l", ParamDef::Kind::kInt, 42, 0,
                    1000000000.0, {}}}};
    for (size_t i = 0; i < 5; ++i) tt.params[i].shown = true;
    return tt;
  }();
  return t;
}

class QjlScheme final : public CacheScheme {
 public:
  explicit QjlScheme(const ParsedSpec& p) : spec_(p.canonical()), text_(p.text()) {
    params_.sketch = p.integer("m");
    params_.outliers = p.integer("o");
    params_.group = p.integer("g");
    params_.outlier_sketch = p.integer("mo");
    params_.seed = p.integer("seed");
    v_ = p.integer("v");
    vg_ = p.integer("vg");
    r_ = p.integer("r");
    KV_CHECK_ARG(r_ >= params_.group && r_ % params_.group == 0, "cache scheme '", text_, "': window r=", r_,
                 " must be a positive multiple of the key group size g=", params_.group,
                 " (keys are sketched in whole groups of g tokens, which wait in the window)");
    // Validates m, mo, o (the layer-0 quantizer; every layer's has the same fields).
    (void)key_quantizer(0);
  }

  std::string spec() const override { return spec_; }

  LayerStreams streams(const CacheGeometry& g, int64_t layer, int64_t residual_length) const override {
    KV_CHECK_ARG(g.num_layers >= 1 && layer >= 0 && layer < g.num_layers, "cache scheme '", spec_, "': layer ", layer,
                 " out of range [0, ", g.num_layers, ")");
    KV_CHECK_ARG(residual_length == 0 || residual_length == r_, "cache scheme '", spec_, "' sets its own window (r=", r_,
                 "); CacheConfig::residual_length must be 0 or ", r_, ", got ", residual_length);
    KV_CHECK_ARG(g.head_dim % vg_ == 0, "cache scheme '", spec_,
                 "': values are grouped along head_dim, which must be divisible by vg=", vg_, ", got head_dim=",
                 g.head_dim);
    auto key = key_quantizer(layer);
    try {
      (void)key->stored_layout(g.head_dim);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat("cache scheme '", spec_, "': ", e.what()));
    }
    LayerStreams s;
    s.key = {key, r_, ResidualFlush::kBlock, DType::kFloat16, {}, 0, nullptr, false};
    s.value = {make_quantizer("int" + std::to_string(v_) + ":g" + std::to_string(vg_)), r_, ResidualFlush::kSliding,
               DType::kFloat16, {}, 0, nullptr, false};
    return s;
  }

 private:
  std::shared_ptr<const Quantizer> key_quantizer(int64_t layer) const {
    quant::QjlParams p = params_;
    p.seed = (params_.seed + 1337 * layer) % 2147483648LL;
    try {
      return std::make_shared<quant::QjlKeyQuantizer>(p, spec_ + " keys" + (layer ? " layer " + std::to_string(layer) : ""));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat("cache scheme '", text_, "': ", e.what()));
    }
  }

  quant::QjlParams params_;
  int64_t v_ = 2, vg_ = 32, r_ = 128;
  std::string spec_, text_;
};

}  // namespace

Entry qjl_entry() {
  Entry e;
  e.kind = SpecKind::kCacheScheme;
  e.table = &qjl_table();
  e.scheme = [](const ParsedSpec& p, const std::string&) -> std::unique_ptr<CacheScheme> {
    return std::make_unique<QjlScheme>(p);
  };
  return e;
}

Entry turboquant_entry() {
  Entry e;
  e.kind = SpecKind::kCacheScheme;
  e.table = &turboquant_table();
  e.scheme = [](const ParsedSpec& p, const std::string&) -> std::unique_ptr<CacheScheme> {
    return std::make_unique<TurboQuantScheme>(p);
  };
  return e;
}

}  // namespace kvcache::registry
