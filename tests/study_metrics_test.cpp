// SPDX-License-Identifier: Apache-2.0
// Perplexity (per-token averaging over strided windows), KL/top-1, min-max fake quantization
// (methods b.1 worked vectors), attention error.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kvcache/error.h"
#include "kvcache/study/metrics.h"
#include "kvcache/torch.h"

using namespace kvcache;
using namespace kvcache::study;

TEST(StudyPerplexity, WholeSequence) {
  EXPECT_NEAR(perplexity(std::vector<double>{std::log(0.5), std::log(0.5)}), 2.0, 1e-12);
  EXPECT_NEAR(perplexity(std::vector<double>{std::log(0.25), std::log(1.0)}), 2.0, 1e-12);
  EXPECT_NEAR(perplexity(at::tensor({std::log(0.1f)})), 10.0, 1e-5);
  EXPECT_THROW(perplexity(std::vector<double>{}), InvalidArgument);
  EXPECT_THROW(perplexity(std::vector<double>{0.5}), InvalidArgument);
  EXPECT_THROW(perplexity(std::vector<double>{NAN}), InvalidArgument);
}

TEST(StudyPerplexity, StridedWindowsScoreEveryTokenOnce) {
  auto w = strided_windows(10, 4, 2);
  ASSERT_EQ(w.size(), 4u);
  EXPECT_EQ(w[0].begin, 0); EXPECT_EQ(w[0].end, 4); EXPECT_EQ(w[0].score_begin, 1);
  EXPECT_EQ(w[1].begin, 2); EXPECT_EQ(w[1].end, 6); EXPECT_EQ(w[1].score_begin, 4);
  EXPECT_EQ(w[2].begin, 4); EXPECT_EQ(w[2].end, 8); EXPECT_EQ(w[2].score_begin, 6);
  EXPECT_EQ(w[3].begin, 6); EXPECT_EQ(w[3].end, 10); EXPECT_EQ(w[3].score_begin, 8);
  for (int64_t n : {2, 3, 17, 100, 513}) {
    for (int64_t len : {2, 5, 64}) {
      for (int64_t stride : {int64_t{1}, len / 2, len - 1}) {
        if (stride < 1) continue;
        std::vector<int> hits(static_cast<size_t>(n), 0);
        for (const auto& x : strided_windows(n, len, stride)) {
          EXPECT_LE(x.end - x.begin, len);
          EXPECT_GT(x.score_begin, x.begin);  // every target has context in its window
          for (int64_t t = x.score_begin; t < x.end; ++t) hits[static_cast<size_t>(t)]++;
        }
        EXPECT_EQ(hits[0], 0);
        for (int64_t t = 1; t < n; ++t) EXPECT_EQ(hits[static_cast<size_t>(t)], 1) << n << "/" << len << "/" << stride << " t=" << t;
      }
    }
  }
  EXPECT_THROW(strided_windows(10, 4, 4), InvalidArgument);
  EXPECT_THROW(strided_windows(1, 4, 2), InvalidArgument);
}

TEST(StudyPerplexity, StridedAveragesPerTokenNotPerWindow) {
  // log p(target t) = -0.01 t: the per-token mean NLL over t = 1..9 is 0.05.
  auto scorer = [](const EvalWindow& w) {
    auto t = at::arange(w.score_begin, w.end, at::kDouble);
    return -0.01 * t;
  };
  EXPECT_NEAR(strided_perplexity(10, 4, 2, scorer), std::exp(0.05), 1e-12);
  // Averaging window means instead ((2 + 4.5 + 6.5 + 8.5) / 4 * 0.01) would give exp(0.05375).
  EXPECT_GT(std::abs(strided_perplexity(10, 4, 2, scorer) - std::exp(0.05375)), 1e-4);
  auto bad = [](const EvalWindow&) { return at::zeros({1}, at::kDouble); };
  EXPECT_THROW(strided_perplexity(10, 4, 2, bad), InvalidArgument);
}

TEST(StudyDistributions, KlAndTop1HandChecked) {
  auto ref = at::tensor({0.0, 0.0, 0.0, 2.0, 1.0, 0.0, 0.0, 5.0, 0.0}, at::kDouble);
  // rows of 3 classes: use [N=3, V=3]
  ref = ref.reshape({3, 3});
  auto test = ref.clone();
  test[0][0] = std::log(2.0);  // row 0: ref uniform, test [0.5, 0.25, 0.25]
  test[2][1] = 0.0;            // row 2: ref argmax 1, test uniform -> argmax 0 (first max)
  auto c = compare_logits(ref, test);
  const double kl0 = std::log(1.0 / 3 / 0.5) / 3 + 2 * std::log(1.0 / 3 / 0.25) / 3;
  const double z = 2 + std::exp(5.0);
  const double kl2 = (1 / z) * std::log((1 / z) / (1.0 / 3)) * 2 + (std::exp(5.0) / z) * std::log((std::exp(5.0) / z) / (1.0 / 3));
  EXPECT_EQ(c.positions, 3);
  EXPECT_NEAR(c.kld_mean, (kl0 + 0 + kl2) / 3, 1e-12);
  EXPECT_NEAR(c.kld_max, kl2, 1e-12);
  // Sorted KLs [0, kl0, kl2] (kl0 < kl2): median the middle one, p99 at rank 1.98 and p99.9 at
  // rank 1.998 interpolated between kl0 and kl2.
  ASSERT_LT(kl0, kl2);
  EXPECT_NEAR(c.kld_median, kl0, 1e-12);
  EXPECT_NEAR(c.kld_p99, kl0 + 0.98 * (kl2 - kl0), 1e-12);
  EXPECT_NEAR(c.kld_p999, kl0 + 0.998 * (kl2 - kl0), 1e-12);
  EXPECT_NEAR(c.top1_agreement, 2.0 / 3, 1e-12);
  auto same = compare_logits(ref, ref);
  EXPECT_EQ(same.kld_mean, 0);
  EXPECT_EQ(same.top1_agreement, 1);
  EXPECT_THROW(compare_logits(ref, ref.narrow(0, 0, 2)), InvalidArgument);
}

TEST(StudyFakeQuant, MatchesMethodsB1WorkedExample) {
  auto x = at::tensor({0.10f, -0.50f, 0.32f, 1.20f, -0.05f, 0.77f, -0.31f, 0.48f}).reshape({1, 1, 1, 8});
  auto q4 = fake_quantize_minmax(x, 4, 8, GroupAxis::kPerToken).reshape({-1});
  const std::vector<double> want4 = {0.0667, -0.5000, 0.2933, 1.2000, -0.0467, 0.7467, -0.2733, 0.5200};
  const std::vector<double> want2 = {0.0667, -0.5, 0.0667, 1.2, 0.0667, 0.6333, -0.5, 0.6333};
  auto q2 = fake_quantize_minmax(x, 2, 8, GroupAxis::kPerToken).reshape({-1});
  // The same values laid out along tokens, grouped per channel.
  auto q4c = fake_quantize_minmax(x.reshape({1, 1, 8, 1}), 4, 8, GroupAxis::kPerChannel).reshape({-1});
  for (int i = 0; i < 8; ++i) {
    EXPECT_NEAR(q4[i].item<double>(), want4[static_cast<size_t>(i)], 1e-4) << i;
    EXPECT_NEAR(q2[i].item<double>(), want2[static_cast<size_t>(i)], 1e-4) << i;
    EXPECT_NEAR(q4c[i].item<double>(), want4[static_cast<size_t>(i)], 1e-4) << i;
    EXPECT_LE(std::abs(q4[i].item<double>() - x.reshape({-1})[i].item<double>()), 1.7 / 15 / 2 + 1e-6);
  }
}

TEST(StudyFakeQuant, GroupsShortLastGroupAndConstantGroups) {
  // Two groups of 4 along D: each group's own min/max reconstruct exactly.
  auto x = at::tensor({0.f, 1.f, 2.f, 3.f, 10.f, 10.f, 10.f, 10.f, 5.f, -5.f}).reshape({1, 1, 1, 10});
  auto y = fake_quantize_minmax(x, 1, 4, GroupAxis::kPerToken).reshape({-1});
  EXPECT_FLOAT_EQ(y[0].item<float>(), 0.f);
  EXPECT_FLOAT_EQ(y[3].item<float>(), 3.f);
  EXPECT_FLOAT_EQ(y[1].item<float>(), 0.f);   // 1/3 -> code 0
  EXPECT_FLOAT_EQ(y[2].item<float>(), 3.f);   // 2/3 -> code 1
  for (int i = 4; i < 8; ++i) EXPECT_FLOAT_EQ(y[i].item<float>(), 10.f);  // constant group, no NaN
  EXPECT_FLOAT_EQ(y[8].item<float>(), 5.f);   // short last group {5, -5}
  EXPECT_FLOAT_EQ(y[9].item<float>(), -5.f);
  EXPECT_THROW(fake_quantize_minmax(x, 0, 4, GroupAxis::kPerToken), InvalidArgument);
  EXPECT_THROW(fake_quantize_minmax(x.reshape({10}), 4, 4, GroupAxis::kPerToken), InvalidArgument);
}

TEST(StudyAttentionError, HandChecked) {
  // One query, two keys, D = 1: scores [0, 0] -> P = [0.5, 0.5]; O = mean(v).
  auto q = at::ones({1, 1, 1, 1});
  auto k = at::zeros({1, 1, 2, 1});
  auto v = at::tensor({1.f, 3.f}).reshape({1, 1, 2, 1});
  auto v_hat = at::tensor({1.f, 5.f}).reshape({1, 1, 2, 1});
  auto e = attention_error(q, k, v, k, v_hat, /*causal=*/true);
  EXPECT_NEAR(e.out_rel_fro, 0.5, 1e-12);  // O = 2 -> 3
  EXPECT_NEAR(e.prob_rel_fro, 0.0, 1e-12);
  auto k_hat = at::tensor({0.f, static_cast<float>(std::log(3.0))}).reshape({1, 1, 2, 1});
  auto e2 = attention_error(q, k, v, k_hat, v, true);  // P_hat = [0.25, 0.75]
  EXPECT_NEAR(e2.prob_rel_fro, 0.5, 1e-6);
  EXPECT_NEAR(e2.out_rel_fro, 0.25, 1e-6);  // O_hat = 2.5
  auto zero = attention_error(q, k, v, k, v, true);
  EXPECT_EQ(zero.out_rel_fro, 0);
  EXPECT_EQ(zero.prob_rel_fro, 0);
}

TEST(StudyAttentionError, CausalMaskAndGqa) {
  // T_q = T = 2: query 0 must not see key 1, so changing key/value 1 leaves row 0 intact.
  auto s = synthetic_qkv(3, 4, 2, 2, 8, 0);
  auto k2 = s.k.clone();
  auto v2 = s.v.clone();
  k2.select(2, 1).add_(3.0);
  v2.select(2, 1).add_(3.0);
  auto row0 = [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& k_hat) {
    return attention_error(q.narrow(2, 0, 1), k.narrow(2, 0, 1), k.narrow(2, 0, 1), k_hat.narrow(2, 0, 1),
                           k_hat.narrow(2, 0, 1), true);
  };
  EXPECT_EQ(row0(s.q, s.k, k2).out_rel_fro, 0);
  auto full = attention_error(s.q, s.k, s.v, k2, v2, true);
  EXPECT_GT(full.out_rel_fro, 0.01);
  // GQA: 4 query heads over 2 KV heads equals explicit head repetition.
  auto rep = [](const at::Tensor& x) { return x.repeat_interleave(2, 1); };
  auto a = attention_error(s.q, s.k, s.v, k2, v2, true);
  auto b = attention_error(s.q, rep(s.k), rep(s.v), rep(k2), rep(v2), true);
  EXPECT_NEAR(a.out_rel_fro, b.out_rel_fro, 1e-12);
  EXPECT_NEAR(a.prob_rel_fro, b.prob_rel_fro, 1e-12);
  EXPECT_THROW(attention_error(s.q, s.k, s.v, k2.narrow(2, 0, 1), v2, true), InvalidArgument);
}

TEST(StudyAttentionError, KiviBeatsPerTokenKeysOnOutlierChannels) {
  std::vector<QkvSample> samples = {synthetic_qkv(1, 4, 2, 128, 64, 4, 8.0),
                                    synthetic_qkv(2, 4, 2, 128, 64, 4, 8.0)};
  for (int bits : {2, 4}) {
    auto tok = scheme_attention_error(samples, KvGranularity::kPerTokenKV, bits, 32);
    auto kivi = scheme_attention_error(samples, KvGranularity::kPerChannelKPerTokenV, bits, 32);
    EXPECT_LT(kivi.out_rel_fro, tok.out_rel_fro) << bits << " bits";
    EXPECT_LT(kivi.prob_rel_fro, tok.prob_rel_fro) << bits << " bits";
  }
  for (auto g : all_granularities()) {
    auto e2 = scheme_attention_error(samples, g, 2, 32);
    auto e4 = scheme_attention_error(samples, g, 4, 32);
    EXPECT_LT(e4.out_rel_fro, e2.out_rel_fro) << describe(g);
    EXPECT_GT(e4.out_rel_fro, 0) << describe(g);
    EXPECT_EQ(parse_granularity(key(g)), g);
  }
}

TEST(StudySynthetic, DeterministicWithOutlierChannels) {
  auto a = synthetic_qkv(5, 2, 1, 64, 16, 2, 10.0);
  auto b = synthetic_qkv(5, 2, 1, 64, 16, 2, 10.0);
  EXPECT_TRUE(at::equal(a.k, b.k));
  EXPECT_TRUE(at::equal(a.q, b.q));
  auto absmean = a.k.abs().mean({0, 1, 2});
  EXPECT_GT(absmean[3].item<float>(), 5.0f);   // channel 3 = 7*0+3
  EXPECT_GT(absmean[10].item<float>(), 5.0f);  // channel 10 = 7*1+3
  EXPECT_LT(absmean[0].item<float>(), 1.5f);
  EXPECT_THROW(synthetic_qkv(1, 3, 2, 8, 8), InvalidArgument);
}
