// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/quant_error.h"

#include <cmath>
#include <cstdio>
#include <sstream>

#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch/quantizer.h"

namespace kvcache::study {
namespace {

/// `x` cut to a whole number of the quantizer's token groups (per-channel groups run along tokens).
at::Tensor whole_groups(const Quantizer& q, const at::Tensor& x) {
  const int64_t g = q.stored_layout(x.size(3)).group_tokens;
  if (g <= 1) return x;
  const int64_t keep = x.size(2) / g * g;
  KV_CHECK_ARG(keep > 0, "quantizer '", q.spec(), "' groups ", g, " tokens per channel but the sample has only ",
               x.size(2), " tokens");
  return x.narrow(2, 0, keep);
}

/// Squared-error accumulator of one stream (K or V) over samples.
struct Pooled {
  double err2 = 0;
  double ref2 = 0;
  double max_abs = 0;
  void add(const Quantizer& q, at::Tensor x) {
    x = whole_groups(q, x);
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
                                            int64_t num_layers, const KeyRope& rope) {
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
  bool attn_ok = !pre_rope || static_cast<bool>(rope);
  AttentionError attn_sum;
  for (const auto& s : samples) {
    KV_CHECK_ARG(!pre_rope || s.k_pre.defined(), "measure_reconstruction('", quant,
                 "'): the scheme stores pre-RoPE keys, and these samples hold none (capture them from a model)");
    const LayerStreams st = scheme->streams(geometry, s.layer, 0);
    const at::Tensor& k_in = pre_rope ? s.k_pre : s.k;
    k.add(*st.key.quantizer, k_in);
    v.add(*st.value.quantizer, s.v);
    bits += 0.5 * (st.key.quantizer->bits_per_value(d) + st.value.quantizer->bits_per_value(d));
    // The scheme's attention error: the tokens both streams can encode (whole token groups),
    // one query per token, causal.
    attn_ok = attn_ok && s.q.defined() && s.q.size(2) == s.k.size(2);
    if (!attn_ok) continue;
    const int64_t t = std::min(whole_groups(*st.key.quantizer, k_in).size(2), whole_groups(*st.value.quantizer, s.v).size(2));
    const at::Tensor kt = k_in.narrow(2, 0, t).contiguous();
    const at::Tensor vt = s.v.narrow(2, 0, t).contiguous();
    at::Tensor k_hat = dequantize(*st.key.quantizer, st.key.quantizer->quantize(kt));
    const at::Tensor v_hat = dequantize(*st.value.quantizer, st.value.quantizer->quantize(vt));
    if (pre_rope) k_hat = rope(k_hat).to(at::kFloat);
    const auto e = attention_error(s.q.narrow(2, 0, t), s.k.narrow(2, 0, t), vt, k_hat, v_hat, /*causal=*/true);
    attn_sum.out_rel_fro += e.out_rel_fro;
    attn_sum.prob_rel_fro += e.prob_rel_fro;
  }
  ReconstructionResult r;
  if (attn_ok) {
    r.attn_out_rel_err = attn_sum.out_rel_fro / static_cast<double>(samples.size());
    r.attn_prob_rel_err = attn_sum.prob_rel_fro / static_cast<double>(samples.size());
  }
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
