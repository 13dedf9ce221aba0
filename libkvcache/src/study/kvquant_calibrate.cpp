// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/kvquant_calibrate.h"

#include <algorithm>
#include <vector>

#include "common/file_io.h"
#include "kvcache/torch/attention.h"
#include "kvcache/torch/kvquant.h"
#include "kvcache/error.h"
#include "kvcache/model/causal_lm.h"
#include "kvcache/model/tokenizer.h"
#include "kvcache/spec.h"
#include "kvcache/study/task.h"
#include "kvcache/study/task_suite.h"

namespace kvcache::study {
std::string read_calibration_text(const std::string& path) {
  std::string text = io::read_regular_file(path, "calibration text", kMaxCalibrationTextBytes);
  KV_CHECK_ARG(!text.empty(), "calibration text '", path, "' is empty");
  return text;
}

std::vector<std::string> split_sentences(const std::string& text) {
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

std::set<std::string> evaluation_sentences(uint64_t eval_seed) {
  std::set<std::string> out;
  for (const auto& s : split_sentences(filler_passage(eval_seed, 256))) out.insert(s);
  for (const auto& name : suite_names()) {
    for (const auto& t : generate_suite(name, eval_seed)) {
      for (const auto& m : t.messages) {
        for (const auto& s : split_sentences(m.content)) out.insert(s);
      }
      for (const auto& s : split_sentences(t.answer)) out.insert(s);
    }
  }
  return out;
}

std::vector<std::vector<ChatMessage>> calibration_conversations(uint64_t seed, int64_t count,
                                                                const std::set<std::string>& exclude) {
  std::vector<std::vector<ChatMessage>> out;
  for (const Task& t : generate_training_tasks(seed, count)) {
    std::vector<ChatMessage> conv;
    std::vector<Message> msgs = t.messages;
    msgs.push_back(Message{"assistant", t.answer});
    for (const auto& m : msgs) {
      std::string kept;
      for (const auto& s : split_sentences(m.content)) {
        if (exclude.count(s) == 0) kept += (kept.empty() ? "" : " ") + s;
      }
      if (!kept.empty()) conv.push_back(ChatMessage{m.role, kept});
    }
    if (!conv.empty()) out.push_back(std::move(conv));
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
  const auto& c = model.config();
  int64_t seqlen = o.seqlen;
  if (c.max_position_embeddings > 0) seqlen = std::min<int64_t>(seqlen, c.max_position_embeddings);
  // The token sequences to run: the --text file in windows of seqlen, or one conversation each.
  std::vector<std::vector<int64_t>> seqs;
  int64_t total = 0;
  auto add = [&](const std::vector<int64_t>& ids) {
    for (size_t s0 = 0; s0 + 1 < ids.size(); s0 += static_cast<size_t>(seqlen)) {
      const size_t t = std::min(ids.size() - s0, static_cast<size_t>(seqlen));
      if (t < 2) break;
      seqs.emplace_back(ids.begin() + static_cast<std::ptrdiff_t>(s0), ids.begin() + static_cast<std::ptrdiff_t>(s0 + t));
      total += static_cast<int64_t>(t);
    }
  };
  if (!o.text.empty()) {
    add(tok.encode(o.text, SpecialTokens::kIgnore, PostProcess::kApply));
  } else {
    const ChatTemplate chat = ChatTemplate::detect(c.model_type, model.extra_file("tokenizer_config.json"));
    const std::set<std::string> exclude = evaluation_sentences(o.eval_seed);
    // Conversations average a few hundred tokens: draw in batches until there are enough.
    for (int64_t batch = 0; total < o.tokens && batch < 64; ++batch) {
      const auto convs = calibration_conversations(o.seed + static_cast<uint64_t>(batch) * 7919u, 16, exclude);
      for (const auto& conv : convs) {
        add(tok.encode(chat.render(conv, /*add_generation_prompt=*/false), SpecialTokens::kParse, PostProcess::kApply));
        if (total >= o.tokens) break;
      }
    }
  }
  KV_CHECK_ARG(total >= 2, "calibrate: the calibration text has ", total, " tokens (at least 2 needed)");
  std::vector<std::vector<at::Tensor>> ks(static_cast<size_t>(c.num_hidden_layers)),
      vs(static_cast<size_t>(c.num_hidden_layers));
  for (const auto& ids : seqs) {
    const int64_t t = static_cast<int64_t>(ids.size());
    const auto x = at::tensor(ids, at::kLong).unsqueeze(0);
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
  std::string source =
      o.model_path + (o.text.empty() ? " on training-task conversations, seed " + std::to_string(o.seed)
                                     : std::string(" on --text"));
  if (o.weights.empty()) return fit_kvquant_calibration(K, V, o.fit, source);
  const KvquantWeights w = load_kvquant_weights(o.weights, c.num_hidden_layers, K[0].size(0), K[0].size(1),
                                                K[0].size(2));
  return fit_kvquant_calibration(K, V, o.fit, source + ", weighted by " + o.weights, &w);
}

}  // namespace kvcache::study
