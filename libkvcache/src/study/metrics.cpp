// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/metrics.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>

#include "kvcache/error.h"
#include "kvcache/torch/attention.h"
#include "kvcache/view.h"

namespace kvcache::study {
namespace {

double rel_fro(const at::Tensor& ref, const at::Tensor& approx) {
  const double num = (ref - approx).norm().item<double>();
  const double den = ref.norm().item<double>();
  if (den == 0) return num == 0 ? 0.0 : INFINITY;
  return num / den;
}

}  // namespace

// ---------------------------------------------------------------- perplexity

void NllAccumulator::add_one(double lp) {
  KV_CHECK_ARG(!std::isnan(lp), "log-probability is NaN (token ", tokens_, ")");
  KV_CHECK_ARG(lp <= 1e-6, "log-probability must be <= 0, got ", lp, " (token ", tokens_, ")");
  total_nll_ -= lp;
  ++tokens_;
}

void NllAccumulator::add(const at::Tensor& logprobs) {
  KV_CHECK_ARG(logprobs.defined(), "NllAccumulator::add: undefined tensor");
  KV_CHECK_ARG(at::isFloatingType(logprobs.scalar_type()),
               "NllAccumulator::add: expected floating log-probabilities, got ", logprobs.scalar_type());
  auto lp = logprobs.detach().to(at::kDouble).contiguous().reshape({-1});
  const double* p = lp.data_ptr<double>();
  for (int64_t i = 0; i < lp.numel(); ++i) add_one(p[i]);
}

void NllAccumulator::add(const std::vector<double>& logprobs) {
  for (double lp : logprobs) add_one(lp);
}

double NllAccumulator::mean_nll() const {
  KV_CHECK_ARG(tokens_ > 0, "perplexity of zero scored tokens is undefined");
  return total_nll_ / static_cast<double>(tokens_);
}

double NllAccumulator::perplexity() const { return std::exp(mean_nll()); }

double perplexity(const std::vector<double>& logprobs) {
  NllAccumulator acc;
  acc.add(logprobs);
  return acc.perplexity();
}

double perplexity(const at::Tensor& logprobs) {
  NllAccumulator acc;
  acc.add(logprobs);
  return acc.perplexity();
}

std::vector<EvalWindow> strided_windows(int64_t n_tokens, int64_t max_length, int64_t stride) {
  KV_CHECK_ARG(n_tokens >= 2, "strided_windows: need at least 2 tokens, got ", n_tokens);
  KV_CHECK_ARG(max_length >= 2, "strided_windows: max_length must be >= 2, got ", max_length);
  KV_CHECK_ARG(stride >= 1 && stride < max_length, "strided_windows: stride must be in [1, max_length=",
               max_length, ") so that every window has context for its first target, got ", stride);
  std::vector<EvalWindow> out;
  int64_t scored_end = 1;  // token 0 is never a target
  for (int64_t begin = 0; scored_end < n_tokens; begin += stride) {
    const int64_t end = std::min(begin + max_length, n_tokens);
    if (end <= scored_end) continue;
    out.push_back({begin, end, std::max(scored_end, begin + 1)});
    scored_end = end;
  }
  return out;
}

double strided_perplexity(int64_t n_tokens, int64_t max_length, int64_t stride,
                          const WindowScorer& scorer) {
  NllAccumulator acc;
  for (const auto& w : strided_windows(n_tokens, max_length, stride)) {
    at::Tensor lp = scorer(w);
    KV_CHECK_ARG(lp.defined() && lp.numel() == w.end - w.score_begin, "window [", w.begin, ", ", w.end,
                 ") scores targets [", w.score_begin, ", ", w.end, "): expected ", w.end - w.score_begin,
                 " log-probabilities, got ", lp.defined() ? lp.numel() : 0);
    acc.add(lp);
  }
  return acc.perplexity();
}

// ---------------------------------------------------------------- distributions

DistributionComparison compare_logits(const at::Tensor& ref, const at::Tensor& test) {
  KV_CHECK_ARG(ref.defined() && test.defined(), "compare_logits: undefined logits");
  KV_CHECK_ARG(ref.sizes() == test.sizes(), "compare_logits: shapes differ: reference ", shape_str(ref.sizes().vec()),
               " vs test ", shape_str(test.sizes().vec()));
  KV_CHECK_ARG(ref.dim() == 1 || ref.dim() == 2, "compare_logits: expected [N, V] or [V], got ",
               shape_str(ref.sizes().vec()));
  auto r = ref.to(at::kDouble).reshape({-1, ref.size(-1)});
  auto t = test.to(at::kDouble).reshape({-1, test.size(-1)});
  KV_CHECK_ARG(r.size(0) > 0 && r.size(1) > 0, "compare_logits: no positions (shape ", shape_str(ref.sizes().vec()), ")");
  auto lr = at::log_softmax(r, -1);
  auto lt = at::log_softmax(t, -1);
  auto kl = (lr.exp() * (lr - lt)).sum(-1).clamp_min(0.0);  // >= 0 up to rounding
  DistributionComparison c;
  c.positions = r.size(0);
  c.kld_mean = kl.mean().item<double>();
  c.kld_max = kl.max().item<double>();
  {
    const at::Tensor sorted = std::get<0>(kl.contiguous().sort());
    const double* v = sorted.data_ptr<double>();
    const int64_t n = sorted.numel();
    auto quantile = [&](double p) {
      const double rank = p * static_cast<double>(n - 1);
      const auto lo = static_cast<int64_t>(std::floor(rank));
      const int64_t hi = std::min(lo + 1, n - 1);
      return v[lo] + (rank - static_cast<double>(lo)) * (v[hi] - v[lo]);
    };
    c.kld_median = quantile(0.5);
    c.kld_p99 = quantile(0.99);
    c.kld_p999 = quantile(0.999);
  }
  c.top1_agreement = (r.argmax(-1) == t.argmax(-1)).to(at::kDouble).mean().item<double>();
  return c;
}

// ---------------------------------------------------------------- attention error

at::Tensor fake_quantize_minmax(const at::Tensor& x, int bits, int64_t group, GroupAxis axis) {
  KV_CHECK_ARG(x.defined() && x.dim() == 4, "fake_quantize_minmax: expected [B, H, T, D], got ",
               x.defined() ? shape_str(x.sizes().vec()) : "undefined");
  KV_CHECK_ARG(at::isFloatingType(x.scalar_type()), "fake_quantize_minmax: expected a floating tensor, got ",
               x.scalar_type());
  KV_CHECK_ARG(bits >= 1 && bits <= 16, "fake_quantize_minmax: bits must be in [1, 16], got ", bits);
  KV_CHECK_ARG(group >= 1 && group <= 65536, "fake_quantize_minmax: group ", group, " is out of range [1, 65536]");
  at::Tensor y = x.to(at::kFloat);
  if (axis == GroupAxis::kPerChannel) y = y.transpose(2, 3);  // groups along tokens
  y = y.contiguous();
  const int64_t len = y.size(3);
  const int64_t pad = (group - len % group) % group;
  if (pad > 0 && len > 0) {
    // Repeat the last value: min/max of the short last group are unchanged.
    y = at::cat({y, y.narrow(3, len - 1, 1).expand({y.size(0), y.size(1), y.size(2), pad})}, 3);
  }
  auto g = y.reshape({y.size(0), y.size(1), y.size(2), -1, group});
  auto mn = std::get<0>(g.min(-1, /*keepdim=*/true));
  auto mx = std::get<0>(g.max(-1, /*keepdim=*/true));
  const double qmax = std::ldexp(1.0, bits) - 1.0;
  auto s = (mx - mn) / qmax;
  auto safe = at::where(s > 0, s, at::ones_like(s));
  auto code = at::where(s > 0, ((g - mn) / safe).clamp(0.0, qmax).round(), at::zeros_like(g));
  auto out = (code * s + mn).reshape(y.sizes()).narrow(3, 0, len);
  if (axis == GroupAxis::kPerChannel) out = out.transpose(2, 3);
  return out.contiguous();
}

std::vector<KvGranularity> all_granularities() {
  return {KvGranularity::kPerTokenKV, KvGranularity::kPerChannelKV, KvGranularity::kPerChannelKPerTokenV,
          KvGranularity::kPerTokenKPerChannelV};
}

std::string describe(KvGranularity g) {
  switch (g) {
    case KvGranularity::kPerTokenKV:
      return "per-token K&V";
    case KvGranularity::kPerChannelKV:
      return "per-channel K&V";
    case KvGranularity::kPerChannelKPerTokenV:
      return "per-channel K + per-token V (KIVI)";
    case KvGranularity::kPerTokenKPerChannelV:
      return "per-token K + per-channel V";
  }
  return "?";
}

std::string key(KvGranularity g) {
  switch (g) {
    case KvGranularity::kPerTokenKV:
      return "tok-kv";
    case KvGranularity::kPerChannelKV:
      return "chan-kv";
    case KvGranularity::kPerChannelKPerTokenV:
      return "kivi";
    case KvGranularity::kPerTokenKPerChannelV:
      return "tok-k-chan-v";
  }
  return "?";
}

KvGranularity parse_granularity(const std::string& k) {
  for (auto g : all_granularities()) {
    if (key(g) == k) return g;
  }
  throw InvalidArgument("unknown K/V granularity '" + k + "' (expected tok-kv, chan-kv, kivi or tok-k-chan-v)");
}

AttentionError attention_error(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& k_hat, const at::Tensor& v_hat, bool causal) {
  KV_CHECK_ARG(q.defined() && q.dim() == 4, "attention_error: q must be [B, H_q, T_q, D], got ",
               q.defined() ? shape_str(q.sizes().vec()) : "undefined");
  KV_CHECK_ARG(k.defined() && k.dim() == 4 && k.size(0) == q.size(0) && k.size(3) == q.size(3),
               "attention_error: k must be [B=", q.size(0), ", H_kv, T, D=", q.size(3), "], got ",
               k.defined() ? shape_str(k.sizes().vec()) : "undefined");
  for (const at::Tensor* t : {&v, &k_hat, &v_hat}) {
    KV_CHECK_ARG(t->defined() && t->sizes() == k.sizes(), "attention_error: v, k_hat, v_hat must match k ",
                 shape_str(k.sizes().vec()), ", got ", t->defined() ? shape_str(t->sizes().vec()) : "undefined");
  }
  const int64_t hq = q.size(1);
  const int64_t hkv = k.size(1);
  KV_CHECK_ARG(hkv > 0 && hq % hkv == 0, "attention_error: H_q=", hq, " is not a multiple of H_kv=", hkv);
  const int64_t tq = q.size(2);
  const int64_t t = k.size(2);
  KV_CHECK_ARG(!causal || tq <= t, "attention_error: causal with T_q=", tq, " > T=", t);
  // The project's reference attention in float64; keys at positions 0..T−1, queries at the
  // last T_q positions (causal) or all after every key (not causal).
  const auto k_pos = at::arange(t, at::kLong).unsqueeze(0).expand({hkv, t});
  const auto q_pos = causal ? at::arange(t - tq, t, at::kLong) : at::full({tq}, t, at::kLong);
  const auto qd = q.to(at::kDouble);
  at::Tensor p, p_hat;
  const auto o = reference_attention(qd, k.to(at::kDouble), v.to(at::kDouble), k_pos, q_pos, &p);
  const auto o_hat = reference_attention(qd, k_hat.to(at::kDouble), v_hat.to(at::kDouble), k_pos, q_pos, &p_hat);
  return {rel_fro(o, o_hat), rel_fro(p, p_hat)};
}

AttentionError scheme_attention_error(const std::vector<QkvSample>& samples, KvGranularity g, int bits,
                                      int64_t group) {
  KV_CHECK_ARG(!samples.empty(), "scheme_attention_error: no Q/K/V samples");
  const GroupAxis k_axis = (g == KvGranularity::kPerChannelKV || g == KvGranularity::kPerChannelKPerTokenV)
                               ? GroupAxis::kPerChannel
                               : GroupAxis::kPerToken;
  const GroupAxis v_axis = (g == KvGranularity::kPerChannelKV || g == KvGranularity::kPerTokenKPerChannelV)
                               ? GroupAxis::kPerChannel
                               : GroupAxis::kPerToken;
  AttentionError sum;
  for (const auto& s : samples) {
    auto e = attention_error(s.q, s.k, s.v, fake_quantize_minmax(s.k, bits, group, k_axis),
                             fake_quantize_minmax(s.v, bits, group, v_axis), /*causal=*/true);
    sum.out_rel_fro += e.out_rel_fro;
    sum.prob_rel_fro += e.prob_rel_fro;
  }
  const double n = static_cast<double>(samples.size());
  return {sum.out_rel_fro / n, sum.prob_rel_fro / n};
}

QkvSample synthetic_qkv(uint64_t seed, int64_t h_q, int64_t h_kv, int64_t tokens, int64_t head_dim,
                        int64_t outlier_channels, double outlier_scale) {
  KV_CHECK_ARG(h_q > 0 && h_kv > 0 && tokens > 0 && head_dim > 0,
               "synthetic_qkv: sizes must be positive, got H_q=", h_q, " H_kv=", h_kv, " T=", tokens,
               " D=", head_dim);
  KV_CHECK_ARG(h_q % h_kv == 0, "synthetic_qkv: H_q=", h_q, " is not a multiple of H_kv=", h_kv);
  // One sample of at most 2^24 floats (64 MiB) per tensor: the attention table is O(H_q T^2 D).
  KV_CHECK_ARG(h_q <= 4096 && tokens <= 1048576 && head_dim <= 65536 &&
                   static_cast<double>(h_q) * static_cast<double>(tokens) * static_cast<double>(head_dim) <=
                       static_cast<double>(int64_t{1} << 24),
               "synthetic_qkv: H_q=", h_q, " x T=", tokens, " x D=", head_dim,
               " values exceed the 2^24 a synthetic sample may hold");
  KV_CHECK_ARG(outlier_channels >= 0 && outlier_channels <= head_dim,
               "synthetic_qkv: outlier_channels must be in [0, D=", head_dim, "], got ", outlier_channels);
  KV_CHECK_ARG(std::isfinite(outlier_scale) && std::fabs(outlier_scale) <= 10000.0,
               "synthetic_qkv: outlier_scale ", outlier_scale, " is out of range [-10000, 10000]");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto opts = at::TensorOptions().dtype(at::kFloat);
  QkvSample s;
  s.q = at::randn({1, h_q, tokens, head_dim}, gen, opts);
  s.k = at::randn({1, h_kv, tokens, head_dim}, gen, opts);
  s.v = at::randn({1, h_kv, tokens, head_dim}, gen, opts);
  for (int64_t i = 0; i < outlier_channels; ++i) {
    const int64_t c = (i * 7 + 3) % head_dim;
    auto ch = s.k.select(3, c);
    ch.mul_(outlier_scale).add_(outlier_scale);
  }
  return s;
}

}  // namespace kvcache::study
