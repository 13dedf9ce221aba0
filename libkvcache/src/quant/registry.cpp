// SPDX-License-Identifier: Apache-2.0
// The quantizers' registration list (order = `kv_study list` order) and the quantizer
// factory over the one registry (registry/registry.h).
#include "registry/registry.h"
#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "quant/float_quantizer.h"
#include "quant/fp8_quantizer.h"
#include "quant/int_kernels.h"
#include "quant/int_quantizer.h"
#include "quant/polar_quantizer.h"
#include "quant/turboquant_outlier.h"
#include "quant/turboquant_quantizer.h"

namespace kvcache {
namespace registry {
namespace {

Entry quantizer(const ParamTable& table, QuantizerFactory make) {
  Entry e;
  e.kind = SpecKind::kQuantizer;
  e.table = &table;
  e.quantizer = std::move(make);
  return e;
}

Entry float_entry(DType storage) {
  const ParamTable& t = quant::FloatCastQuantizer::table(storage);
  return quantizer(t, [storage, head = t.head](const ParsedSpec&, const std::string&) -> std::unique_ptr<Quantizer> {
    return std::make_unique<quant::FloatCastQuantizer>(storage, head);
  });
}

Entry int_entry(int bits) {
  return quantizer(quant::IntQuantizer::table(bits), [bits](const ParsedSpec& p, const std::string&) -> std::unique_ptr<Quantizer> {
    const GroupAxis axis = p.choice("axis") == "chan" ? GroupAxis::kPerChannel : GroupAxis::kPerToken;
    return std::make_unique<quant::IntQuantizer>(bits, p.integer("g"), axis);
  });
}

}  // namespace

std::vector<Entry> quantizer_entries() {
  std::vector<Entry> v;
  v.push_back(float_entry(DType::kFloat32));
  v.push_back(float_entry(DType::kFloat16));
  v.push_back(float_entry(DType::kBFloat16));
  v.push_back(quantizer(quant::Fp8Quantizer::table(), [](const ParsedSpec& p, const std::string&) -> std::unique_ptr<Quantizer> {
    const auto format = p.choice("format") == "e5m2" ? quant::Fp8Format::kE5M2 : quant::Fp8Format::kE4M3;
    return std::make_unique<quant::Fp8Quantizer>(format, p.choice("scale") == "scaled");
  }));
  for (int bits : quant::kIntBits) v.push_back(int_entry(bits));
  v.push_back(quantizer(quant::TurboQuantizer::table(), [](const ParsedSpec& p, const std::string&) -> std::unique_ptr<Quantizer> {
    const quant::TurboMode mode = p.choice("mode") == "prod" ? quant::TurboMode::kProd : quant::TurboMode::kMse;
    // o<n> (or a g<G> that needs it): the outlier-channel split, its own class; o0 and a g
    // without o are refused there.
    if (p.is_set("o") || p.is_set("g")) {
      return std::make_unique<quant::TurboOutlierQuantizer>(p.num("b"), mode, p.integer("o"), p.integer("g"),
                                                            p.choice("norm") == "nc", p.integer("seed"));
    }
    return std::make_unique<quant::TurboQuantizer>(p.num("b"), mode, p.choice("norm") == "nc", p.integer("seed"));
  }));
  v.push_back(quantizer(quant::PolarQuantizer::table(), [](const ParsedSpec& p, const std::string&) -> std::unique_ptr<Quantizer> {
    return std::make_unique<quant::PolarQuantizer>(p.integer("seed"));
  }));
  return v;
}

}  // namespace registry

std::unique_ptr<Quantizer> make_quantizer(const std::string& spec) {
  const registry::Parsed p = registry::parse(spec, SpecKind::kQuantizer, {SpecKind::kQuantizer});
  return p.entry->quantizer(p.fields, p.inner);
}

std::vector<ParamTable> registered_quantizers() {
  std::vector<ParamTable> out;
  for (const auto& e : registry::entries()) {
    if (e.kind == SpecKind::kQuantizer) out.push_back(*e.table);
  }
  return out;
}

}  // namespace kvcache
