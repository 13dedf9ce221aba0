// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/quant_error.h"

#include <cmath>
#include <cstdio>
#include <sstream>

#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/quantizer.h"

namespace kvcache::study {
namespace {

/// Squared-error accumulator of one stream (K or V) over samples.
struct Pooled {
  double err2 = 0;
  double ref2 = 0;
  double max_abs = 0;
  void add(const Quantizer& q, at::Tensor x) {
    const int64_t g = q.stored_layout(x.size(3)).group_tokens;
    if (g > 1) {
      // Groups run along tokens: keep a whole number of groups.
      const int64_t keep = x.size(2) / g * g;
      KV_CHECK_ARG(keep > 0, "quantizer '", q.spec(), "' groups ", g, " tokens per channel but the sample has only ",
                   x.size(2), " tokens");
      x = x.narrow(2, 0, keep);
    }
    const auto e = reconstruction_error(q, x);
    const double n2 = std::pow(x.to(at::kDouble).norm().item<double>(), 2);
    err2 += e.rel_fro * e.rel_fro * n2;
    ref2 += n2;
    max_abs = std::max(max_abs, e.max_abs);
  }
  double rel() const { return ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2); }
};

std::string f(double v, const char* fmt) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

}  // namespace

ReconstructionResult measure_reconstruction(const std::string& quant, const std::vector<QkvSample>& samples,
                                            int64_t num_layers) {
  KV_CHECK_ARG(!samples.empty(), "measure_reconstruction('", quant, "'): no K/V samples");
  // Resolved as the CacheManager resolves CacheConfig::scheme, per sample layer (KIVI:
  // int<k>:g<G>:chan keys, int<v>:g<G> values; had(...): the rotated quantizers).
  const int64_t d = samples[0].k.size(3);
  const auto scheme = make_cache_scheme(quant);
  int64_t layers = 1;
  for (const auto& s : samples) layers = std::max(layers, s.layer + 1);
  KV_CHECK_ARG(num_layers == 0 || num_layers >= layers, "measure_reconstruction('", quant, "'): a sample of layer ",
               layers - 1, " in a model of ", num_layers, " layers");
  if (num_layers > 0) layers = num_layers;
  const CacheGeometry geometry{layers, samples[0].k.size(1), d};
  Pooled k;
  Pooled v;
  double bits = 0;
  // A scheme that stores keys before RoPE (KVQuant) quantizes the pre-RoPE keys.
  const bool pre_rope = scheme->required_key_storage() == KeyStorage::kPreRoPE;
  for (const auto& s : samples) {
    KV_CHECK_ARG(!pre_rope || s.k_pre.defined(), "measure_reconstruction('", quant,
                 "'): the scheme stores pre-RoPE keys, and these samples hold none (capture them from a model)");
    const LayerStreams st = scheme->streams(geometry, s.layer, 0);
    k.add(*st.key.quantizer, pre_rope ? s.k_pre : s.k);
    v.add(*st.value.quantizer, s.v);
    bits += 0.5 * (st.key.quantizer->bits_per_value(d) + st.value.quantizer->bits_per_value(d));
  }
  ReconstructionResult r;
  r.bits_per_value = bits / static_cast<double>(samples.size());
  r.key_rel_err = k.rel();
  r.value_rel_err = v.rel();
  r.key_max_abs = k.max_abs;
  r.value_max_abs = v.max_abs;
  return r;
}

std::vector<std::string> default_quant_error_specs() {
  std::vector<std::string> specs;
  for (const auto& t : registered_quantizers()) specs.push_back(t.head);
  for (const char* s : {"fp8:e5m2", "int4:g32", "int3:g32", "int2:g32", "int4:g32:chan", "int3:g32:chan",
                        "int2:g32:chan", "had(int4)", "had(int2)", "kivi:k4:v4:g32:r128", "kivi:k3:v3:g32:r128",
                        "kivi:k2:v2:g32:r128"}) {
    specs.push_back(s);
  }
  return specs;
}

std::string reconstruction_table_markdown(const std::vector<std::string>& specs, const std::vector<QkvSample>& samples,
                                          std::vector<std::string>* skipped) {
  std::ostringstream os;
  os << "| quantizer | bits/value | key rel. error | value rel. error | key max abs | value max abs |\n";
  os << "|---|---:|---:|---:|---:|---:|\n";
  for (const auto& spec : specs) {
    ReconstructionResult r;
    try {
      r = measure_reconstruction(spec, samples);
    } catch (const InvalidArgument& e) {
      if (skipped == nullptr) throw;
      skipped->push_back(spec + ": " + e.what());
      continue;
    } catch (const UnsupportedError& e) {
      if (skipped == nullptr) throw;
      skipped->push_back(spec + ": " + e.what());
      continue;
    }
    os << "| " << spec << " | " << f(r.bits_per_value, "%.2f") << " | " << f(r.key_rel_err, "%.4f") << " | "
       << f(r.value_rel_err, "%.4f") << " | " << f(r.key_max_abs, "%.4f") << " | " << f(r.value_max_abs, "%.4f") << " |\n";
  }
  return os.str();
}

std::string attention_table_markdown(const std::vector<QkvSample>& samples, const std::vector<int>& bits, int64_t group) {
  std::ostringstream os;
  os << "| scheme |";
  for (int b : bits) os << " " << b << "-bit output | " << b << "-bit probs |";
  os << "\n|---|";
  for (size_t i = 0; i < bits.size(); ++i) os << "---:|---:|";
  os << "\n";
  for (auto g : all_granularities()) {
    os << "| " << describe(g) << " |";
    for (int b : bits) {
      const auto e = scheme_attention_error(samples, g, b, group);
      os << " " << f(e.out_rel_fro, "%.4f") << " | " << f(e.prob_rel_fro, "%.4f") << " |";
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace kvcache::study
