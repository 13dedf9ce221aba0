// SPDX-License-Identifier: Apache-2.0
// The rotation-and-codebook cache schemes (codebook_schemes.h).
#include "cache/codebook_schemes.h"

#include <string>

#include "kvcache/error.h"
#include "quant/hadamard.h"
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

}  // namespace

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
