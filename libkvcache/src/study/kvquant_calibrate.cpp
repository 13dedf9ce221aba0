// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/kvquant_calibrate.h"

#include <algorithm>
#include <vector>

#include "kvcache/attention.h"
#include "kvcache/error.h"
#include "kvcache/model/causal_lm.h"
#include "kvcache/model/tokenizer.h"
#include "kvcache/spec.h"
#include "kvcache/study/task_suite.h"

namespace kvcache::study {
namespace {

/// '.'-terminated sentences of `text`, trimmed (a trailing fragment counts as one).
std::vector<std::string> sentences(const std::string& text) {
  std::vector<std::string> out;
  std::string cur;
  auto flush = [&] {
    const auto b = cur.find_first_not_of(" \n\t");
    if (b != std::string::npos) out.push_back(cur.substr(b, cur.find_last_not_of(" \n\t") - b + 1));
    cur.clear();
  };
  for (char c : text) {
    cur.push_back(c);
    if (c == '.' || c == '\n') flush();
  }
  flush();
  return out;
}

}  // namespace

std::set<std::string> evaluation_sentences(uint64_t eval_seed) {
  std::set<std::string> out;
  for (const auto& s : sentences(filler_passage(eval_seed, 256))) out.insert(s);
  for (const auto& name : suite_names()) {
    for (const auto& t : generate_suite(name, eval_seed)) {
      for (const auto& m : t.messages) {
        for (const auto& s : sentences(m.content)) out.insert(s);
      }
    }
  }
  return out;
}

std::string calibration_passage(uint64_t seed, int64_t approx_tokens, const std::set<std::string>& exclude) {
  KV_CHECK_ARG(approx_tokens >= 1, "calibration_passage: approx_tokens must be >= 1, got ", approx_tokens);
  std::string out;
  int64_t have = 0;
  // Filler in slices of fresh seeds until enough sentences survive the exclusion.
  for (uint64_t i = 0; have < approx_tokens && i < 1000; ++i) {
    const std::string part = filler_passage(seed * 1000003ull + i, std::min<int64_t>(approx_tokens, 4096));
    for (const auto& s : sentences(part)) {
      if (exclude.count(s) != 0) continue;
      out += (out.empty() ? "" : " ") + s;
      have += static_cast<int64_t>(std::count(s.begin(), s.end(), ' ')) + 2;
      if (have >= approx_tokens) break;
    }
  }
  return out;
}

KvquantCalibration calibrate_kvquant(const KvquantCalibrateOptions& o) {
  KV_CHECK_ARG(o.tokens >= 2 && o.tokens <= kMaxTokens, "calibrate: --tokens must be in [2, ", kMaxTokens, "], got ",
               o.tokens);
  KV_CHECK_ARG(o.seqlen >= 2 && o.seqlen <= 1 << 20, "calibrate: --seqlen must be in [2, 1048576], got ", o.seqlen);
  KV_CHECK_ARG(o.seed != o.eval_seed, "calibrate: --seed ", o.seed,
               " is the evaluation seed: the calibration text must come from another seed");
  const CausalLM model = CausalLM::load(o.model_path, LoadOptions{o.threads});
  const Tokenizer tok = Tokenizer::from_texts(model.tokenizer_files());
  const std::string text = o.text.empty() ? calibration_passage(o.seed, o.tokens, evaluation_sentences(o.eval_seed)) : o.text;
  const std::vector<int64_t> ids = tok.encode(text, SpecialTokens::kIgnore, PostProcess::kApply);
  KV_CHECK_ARG(ids.size() >= 2, "calibrate: the calibration text has ", ids.size(), " tokens (at least 2 needed)");
  const auto& c = model.config();
  int64_t seqlen = o.seqlen;
  if (c.max_position_embeddings > 0) seqlen = std::min<int64_t>(seqlen, c.max_position_embeddings);
  std::vector<std::vector<at::Tensor>> ks(static_cast<size_t>(c.num_hidden_layers)),
      vs(static_cast<size_t>(c.num_hidden_layers));
  const int64_t n = static_cast<int64_t>(ids.size());
  for (int64_t s0 = 0; s0 < n; s0 += seqlen) {
    const int64_t t = std::min<int64_t>(seqlen, n - s0);
    if (t < 2) break;
    const auto x = at::tensor(std::vector<int64_t>(ids.begin() + s0, ids.begin() + s0 + t), at::kLong).unsqueeze(0);
    const auto pos = at::arange(t, at::kLong);
    at::Tensor h = model.embed(x);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const QKV y = model.qkv(l, h, pos);
      const at::Tensor k = y.k.to(at::kFloat);  // pre-RoPE [1, H_kv, T, D]
      const at::Tensor v = y.v.to(at::kFloat);
      ks[static_cast<size_t>(l)].push_back(k[0].permute({1, 0, 2}).contiguous());
      vs[static_cast<size_t>(l)].push_back(v[0].permute({1, 0, 2}).contiguous());
      const at::Tensor kr = model.rope(y.k, pos).to(at::kFloat);
      const at::Tensor k_pos = pos.unsqueeze(0).expand({c.num_key_value_heads, t});
      h = model.finish(l, h, reference_attention(y.q.to(at::kFloat), kr, v, k_pos, pos).to(h.scalar_type()));
    }
  }
  std::vector<at::Tensor> K, V;
  for (size_t l = 0; l < ks.size(); ++l) {
    K.push_back(at::cat(ks[l], 0));
    V.push_back(at::cat(vs[l], 0));
  }
  return fit_kvquant_calibration(K, V, o.fit,
                                 o.model_path + (o.text.empty() ? " on calibration filler seed " + std::to_string(o.seed)
                                                                : std::string(" on --text")));
}

}  // namespace kvcache::study
