// SPDX-License-Identifier: Apache-2.0
// The ArmEvaluator over an exported model: CausalLM + Tokenizer/ChatTemplate + Runner over a
// CacheManager per request.
#include "kvcache/study/model_evaluator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>

#include "common/log.h"
#include "kvcache/torch/attention.h"
#include "kvcache/torch/cache.h"
#include "kvcache/cache_manager.h"
#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/model/causal_lm.h"
#include "kvcache/model/chat_template.h"
#include "kvcache/model/runner.h"
#include "kvcache/model/tokenizer.h"
#include "kvcache/quantizer.h"
#include "kvcache/study/process_memory.h"
#include "kvcache/study/task_suite.h"

namespace kvcache::study {
namespace {

/// "<file stem>@<8 hex digits of FNV-1a over the file>" (files over 256 MiB: over the size and
/// the first and last 64 MiB).
std::string file_id(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  KV_CHECK_ARG(in.good(), "cannot read model file '", path, "'");
  const int64_t size = static_cast<int64_t>(in.tellg());
  uint64_t h = 1469598103934665603ULL;
  auto mix = [&](const char* p, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      h ^= static_cast<unsigned char>(p[i]);
      h *= 1099511628211ULL;
    }
  };
  std::vector<char> buf(1 << 20);
  auto hash_range = [&](int64_t begin, int64_t end) {
    in.seekg(begin);
    for (int64_t off = begin; off < end;) {
      const auto n = static_cast<std::streamsize>(std::min<int64_t>(end - off, static_cast<int64_t>(buf.size())));
      in.read(buf.data(), n);
      mix(buf.data(), static_cast<size_t>(n));
      off += n;
    }
  };
  const int64_t kWhole = int64_t{256} << 20;
  const int64_t kEdge = int64_t{64} << 20;
  if (size <= kWhole) {
    hash_range(0, size);
  } else {
    mix(reinterpret_cast<const char*>(&size), sizeof size);
    hash_range(0, kEdge);
    hash_range(size - kEdge, size);
  }
  std::string base = path.substr(path.rfind('/') == std::string::npos ? 0 : path.rfind('/') + 1);
  char hex[17];
  std::snprintf(hex, sizeof hex, "%08llx", static_cast<unsigned long long>(h & 0xffffffffULL));
  return base + "@" + hex;
}

/// The runner's cache for ModelEvaluatorOptions::save_cache / load_cache: a CacheManager that
/// saves itself once `save_at` prompt tokens are in (at the end of that step), or restores a
/// snapshot at begin_request() and reports its tokens as the prompt's cached prefix.
class SnapshotCache final : public KVCache {
 public:
  SnapshotCache(const CacheConfig& config, const std::string& fingerprint) : manager_(config), cache_(manager_), fp_(fingerprint) {}

  void save_when(int64_t tokens, std::vector<int64_t> ids, std::string path) {
    save_at_ = tokens;
    save_ids_ = std::move(ids);
    save_path_ = std::move(path);
  }
  void restore_from(std::string path) { load_path_ = std::move(path); }
  int64_t restored() const { return restored_; }
  double restore_seconds() const { return restore_seconds_; }
  TorchCache& torch() { return cache_; }

  const CacheConfig& config() const override { return cache_.config(); }
  void reset(int64_t context_length) override { cache_.reset(context_length); }
  PrefixReuse begin_request(const std::vector<int64_t>& prompt, int64_t context_length) override {
    if (load_path_.empty()) return cache_.begin_request(prompt, context_length);
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<int64_t> ids = manager_.load(load_path_, fp_);
    restore_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    size_t same = 0;
    while (same < ids.size() && same < prompt.size() && ids[same] == prompt[same]) ++same;
    KV_CHECK_ARG(!ids.empty() && same == ids.size() && ids.size() < prompt.size(), "cache snapshot '", load_path_,
                 "' holds ", ids.size(), " tokens, which the prompt of ", prompt.size(), " tokens ",
                 ids.empty()       ? std::string("cannot extend (the snapshot names no tokens)")
                 : same < ids.size() ? detail::str_cat("does not start with (first difference at token ", same, ")")
                                     : std::string("does not extend (the prompt must hold at least one token more)"),
                 "; expected a snapshot written by --save-cache for a prompt this one starts with");
    KV_CHECK_ARG(manager_.config().context_length >= context_length, "cache snapshot '", load_path_,
                 "' was saved for a request of ", manager_.config().context_length,
                 " tokens (prompt + max new tokens); this one needs ", context_length,
                 ": save it with at least as many --max-new-tokens");
    restored_ = static_cast<int64_t>(ids.size());
    return PrefixReuse{restored_, 0};
  }
  int64_t next_position(int64_t layer) const override { return cache_.next_position(layer); }
  void append(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) override {
    cache_.append(layer, k, v, positions);
  }
  at::Tensor attend(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions) override {
    return cache_.attend(layer, q, q_positions);
  }
  void end_step(StepKind step) override {
    cache_.end_step(step);
    if (save_at_ > 0 && cache_.tokens(0).written == save_at_) {
      manager_.save(save_path_, fp_, save_ids_);
      save_at_ = 0;
    }
  }
  void finish() override { cache_.finish(); }
  ReplayNeed replay_need() const override { return cache_.replay_need(); }
  void begin_replay() override { cache_.begin_replay(); }

 private:
  CacheManager manager_;
  TorchCache cache_;
  std::string fp_;
  int64_t save_at_ = 0;
  std::vector<int64_t> save_ids_;
  std::string save_path_, load_path_;
  int64_t restored_ = 0;
  double restore_seconds_ = 0;
};

class ModelArmEvaluator : public ArmEvaluator {
 public:
  explicit ModelArmEvaluator(const ModelEvaluatorOptions& opt)
      : opt_(opt),
        model_(CausalLM::load(opt.model_path, LoadOptions{opt.threads})),
        runner_(model_),
        tokenizer_(Tokenizer::from_texts(model_.tokenizer_files())),
        template_(ChatTemplate::detect(model_.config().model_type, model_.extra_file("tokenizer_config.json"))),
        model_id_(file_id(opt.model_path)) {
    eos_ = model_.config().eos_token_ids;
    if (auto im_end = tokenizer_.find_added_token("<|im_end|>")) {
      if (std::find(eos_.begin(), eos_.end(), im_end->id) == eos_.end()) eos_.push_back(im_end->id);
    }
    if (auto e = tokenizer_.eos_id()) {
      if (std::find(eos_.begin(), eos_.end(), *e) == eos_.end()) eos_.push_back(*e);
    }
    const std::string text = opt.text.empty() ? filler_passage(opt.passage_seed, opt.text_tokens) : opt.text;
    text_ids_ = tokenizer_.encode(text, SpecialTokens::kIgnore, PostProcess::kApply);
    const int64_t max_pos = model_.config().max_position_embeddings;
    if (max_pos > 0 && static_cast<int64_t>(text_ids_.size()) > max_pos) {
      log::logger().info("evaluation passage of {} tokens cut to the model's max_position_embeddings of {}",
                         text_ids_.size(), max_pos);
      text_ids_.resize(static_cast<size_t>(max_pos));
    }
    KV_CHECK_ARG(text_ids_.size() >= 2, "evaluation passage of '", opt.model_path, "' has fewer than 2 tokens");
  }

  std::string model_id() const override { return model_id_; }

  Arm canonicalize(const Arm& arm) const override {
    Arm a;
    // Well-formed at all? (InvalidArgument stops the sweep.)
    a.scheme = make_cache_scheme(arm.scheme)->spec();
    a.policy = make_eviction_policy(arm.policy)->spec();
    // Runnable on this model? (UnsupportedError: the arm's rows record why.)
    try {
      CacheManager probe(config_for(a));  // the core checks the configuration
      (void)probe;
    } catch (const InvalidArgument& e) {
      throw UnsupportedError(e.what());
    }
    return a;
  }

  Generation run_task(const Arm& arm, const Task& task, QueryMode mode) override {
    std::vector<ChatMessage> msgs;
    for (const auto& m : task.messages) msgs.push_back({m.role, m.content});
    const std::string rendered = template_.render(msgs, /*add_generation_prompt=*/true);
    const auto ids = tokenizer_.encode(rendered, SpecialTokens::kParse, PostProcess::kApply);
    const int64_t question_start = mode == QueryMode::kAgnostic ? context_tokens(task, msgs, rendered, ids) : 0;
    PeakRssProbe rss;
    rss.start();
    SnapshotCache snap(config_for(arm), opt_.save_cache.empty() && opt_.load_cache.empty() ? "" : model_.fingerprint());
    TorchCache& cache = snap.torch();
    GenerationOptions go;
    go.max_new_tokens = task.max_new_tokens;
    go.prefill_chunk = opt_.prefill_chunk;
    go.eos_token_ids = eos_;
    go.question_start = question_start;
    const ReplayNeed replay = cache.replay_need();
    if (replay.any()) go.replay_prefix = tokenizer_.encode(replay.instruction, SpecialTokens::kParse, PostProcess::kSkip);
    if (!opt_.save_cache.empty()) {
      // The prompt but its last token in one step, saved there; the last token ends the prompt.
      const auto keep = static_cast<int64_t>(ids.size()) - 1;
      KV_CHECK_ARG(keep >= 1, "--save-cache: the prompt has ", ids.size(), " token; a snapshot needs at least 2");
      KV_CHECK_ARG(question_start == 0, "--save-cache: a query-agnostic request (--question with --query-mode "
                                        "agnostic) is not saved; use --query-mode aware");
      go.prefill_chunk = keep;
      snap.save_when(keep, std::vector<int64_t>(ids.begin(), ids.end() - 1), opt_.save_cache);
    }
    if (!opt_.load_cache.empty()) snap.restore_from(opt_.load_cache);
    const GenerationResult r = runner_.generate(ids, go, snap);
    Generation g;
    g.output = tokenizer_.decode_lenient(r.tokens, /*skip_special=*/true);
    g.prompt_tokens = r.prompt_tokens;
    g.generated_tokens = static_cast<int64_t>(r.tokens.size());
    g.cache = cache.stats();
    g.rss_growth_peak = rss.peak_growth();
    g.prefill_seconds = r.prefill_seconds;
    g.decode_seconds = r.decode_seconds;
    g.replay_seconds = r.replay_seconds;
    g.replay_tokens = r.replay_tokens;
    g.span_resident = span_resident(task, msgs, rendered, cache);
    g.question_tokens = r.question_tokens;
    g.restored_tokens = snap.restored();
    g.restore_seconds = snap.restore_seconds();
    return g;
  }

  TextEval eval_text(const Arm& arm) override {
    TextEval te;
    const int64_t n = static_cast<int64_t>(text_ids_.size());
    {
      TorchCache single(config_for(arm));
      te.single_logprobs = runner_.score(text_ids_, single, /*chunk_size=*/0).logprobs;
    }
    TorchCache stream(config_for(arm));
    stream.reset(n);
    std::vector<at::Tensor> rows;
    rows.reserve(static_cast<size_t>(n - 1));
    for (int64_t t = 0; t + 1 < n; ++t) rows.push_back(runner_.decode_step(text_ids_[static_cast<size_t>(t)], stream));
    te.stream_logits = at::stack(rows).to(at::kFloat);  // [N-1, V]
    const auto targets = at::tensor(std::vector<int64_t>(text_ids_.begin() + 1, text_ids_.end()), at::kLong);
    te.stream_logprobs = at::log_softmax(te.stream_logits.to(at::kDouble), -1).gather(1, targets.unsqueeze(1)).squeeze(1);
    te.cache = stream.stats();
    return te;
  }

  ReconstructionResult reconstruction(const std::string& quant) override {
    // Keys a scheme stores before RoPE (KVQuant) are rotated as the cache rotates them on read.
    const KeyRope rope = [this](const at::Tensor& k_pre) {
      return model_.rope(k_pre.to(at::kFloat), at::arange(k_pre.size(2), at::kLong));
    };
    return measure_reconstruction(quant, capture_qkv(), model_.config().num_hidden_layers, rope);
  }

  CacheGeometry geometry() const override {
    const CacheConfig c = model_.cache_config();
    return CacheGeometry{c.num_layers, c.num_kv_heads, c.head_dim};
  }

  std::vector<QkvSample> capture_qkv() override {
    if (!captured_.empty()) return captured_;
    const int64_t t = std::min<int64_t>(opt_.capture_tokens, static_cast<int64_t>(text_ids_.size()));
    const auto ids = at::tensor(std::vector<int64_t>(text_ids_.begin(), text_ids_.begin() + t), at::kLong).unsqueeze(0);
    const auto pos = at::arange(t, at::kLong);
    const auto& c = model_.config();
    at::Tensor h = model_.embed(ids);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const QKV x = model_.qkv(l, h, pos);
      const at::Tensor k = model_.rope(x.k, pos).to(at::kFloat);
      const at::Tensor v = x.v.to(at::kFloat);
      const at::Tensor q = x.q.to(at::kFloat);
      const at::Tensor k_pos = pos.unsqueeze(0).expand({c.num_key_value_heads, t});
      h = model_.finish(l, h, reference_attention(q, k, v, k_pos, pos).to(h.scalar_type()));
      const bool wanted = opt_.capture_layers.empty() ||
                          std::find(opt_.capture_layers.begin(), opt_.capture_layers.end(), l) != opt_.capture_layers.end();
      if (wanted) captured_.push_back(QkvSample{l, q, k, v, x.k.to(at::kFloat)});
    }
    KV_CHECK_ARG(!captured_.empty(), "capture_layers selects no layer of the model (", c.num_hidden_layers, " layers)");
    return captured_;
  }

 private:
  CacheConfig config_for(const Arm& arm) const {
    CacheConfig cfg = model_.cache_config();
    cfg.scheme = arm.scheme;
    cfg.policy = arm.policy;
    // A scheme that needs a key storage (KVQuant: pre-RoPE keys) gets it.
    if (const auto ks = make_cache_scheme(arm.scheme)->required_key_storage()) cfg.key_storage = *ks;
    return cfg;
  }

  /// Byte offset in `rendered` of message `message`'s content (each message's content located in
  /// order), or npos.
  static size_t content_offset(const std::vector<ChatMessage>& msgs, const std::string& rendered, int64_t message) {
    size_t from = 0;
    size_t content_at = std::string::npos;
    for (int64_t i = 0; i <= message; ++i) {
      const auto at = rendered.find(msgs[static_cast<size_t>(i)].content, from);
      if (at == std::string::npos) return std::string::npos;
      content_at = at;
      from = at + msgs[static_cast<size_t>(i)].content.size();
    }
    return content_at;
  }

  /// The context of a query-agnostic run: the number of leading prompt tokens before the
  /// question, i.e. the longest common prefix of `ids` and the encoding of the rendered text up
  /// to the question's first byte (so both modes feed the same token sequence). 0 when the task
  /// has no question (or it cannot be located): the prompt is prefilled whole, as in aware mode.
  int64_t context_tokens(const Task& task, const std::vector<ChatMessage>& msgs, const std::string& rendered,
                         const std::vector<int64_t>& ids) const {
    if (task.question.message < 0 || task.question.message >= static_cast<int64_t>(msgs.size()) ||
        task.question.begin < 0 ||
        task.question.begin > static_cast<int64_t>(msgs[static_cast<size_t>(task.question.message)].content.size())) {
      return 0;
    }
    const size_t at = content_offset(msgs, rendered, task.question.message);
    if (at == std::string::npos) return 0;
    const auto before = tokenizer_.encode(rendered.substr(0, at + static_cast<size_t>(task.question.begin)),
                                          SpecialTokens::kParse, PostProcess::kApply);
    size_t n = 0;
    while (n < before.size() && n < ids.size() && before[n] == ids[n]) ++n;
    // At least one context token and one question token.
    return n >= 1 && n < ids.size() ? static_cast<int64_t>(n) : 0;
  }

  /// Fraction of the task span's token positions resident in every layer / KV head now.
  double span_resident(const Task& task, const std::vector<ChatMessage>& msgs, const std::string& rendered,
                       const TorchCache& cache) const {
    if (task.span.message < 0 || task.span.message >= static_cast<int64_t>(msgs.size())) return -1;
    const size_t content_at = content_offset(msgs, rendered, task.span.message);
    if (content_at == std::string::npos) return -1;
    std::string before = rendered.substr(0, content_at + static_cast<size_t>(task.span.begin));
    while (!before.empty() && (before.back() == ' ' || before.back() == '\n')) before.pop_back();
    const std::string through = rendered.substr(0, content_at + static_cast<size_t>(task.span.end));
    const auto a = static_cast<int64_t>(tokenizer_.encode(before, SpecialTokens::kParse, PostProcess::kApply).size());
    const auto b = static_cast<int64_t>(tokenizer_.encode(through, SpecialTokens::kParse, PostProcess::kApply).size());
    if (b <= a) return -1;
    double sum = 0;
    int64_t n = 0;
    for (int64_t l = 0; l < model_.config().num_hidden_layers; ++l) {
      for (const auto& head : cache.tokens(l).positions) {
        const auto in_span = std::count_if(head.begin(), head.end(), [&](int64_t p) { return p >= a && p < b; });
        sum += static_cast<double>(in_span) / static_cast<double>(b - a);
        ++n;
      }
    }
    return n > 0 ? sum / static_cast<double>(n) : -1;
  }

  ModelEvaluatorOptions opt_;
  CausalLM model_;
  Runner runner_;
  Tokenizer tokenizer_;
  ChatTemplate template_;
  std::string model_id_;
  std::vector<int64_t> eos_;
  std::vector<int64_t> text_ids_;
  std::vector<QkvSample> captured_;
};

}  // namespace

std::unique_ptr<ArmEvaluator> make_model_evaluator(const ModelEvaluatorOptions& options) {
  return std::make_unique<ModelArmEvaluator>(options);
}

ModelPromptInfo model_prompt_info(const std::string& model_path) {
  const CausalLM model = CausalLM::load(model_path);
  auto tokenizer = std::make_shared<Tokenizer>(Tokenizer::from_texts(model.tokenizer_files()));
  auto chat = std::make_shared<ChatTemplate>(
      ChatTemplate::detect(model.config().model_type, model.extra_file("tokenizer_config.json")));
  ModelPromptInfo info;
  const ModelConfig& c = model.config();
  info.max_position_embeddings = c.max_position_embeddings;
  info.layers = c.num_hidden_layers;
  info.heads = c.num_attention_heads;
  info.kv_heads = c.num_key_value_heads;
  info.head_dim = c.head_dim;
  info.vocab = c.vocab_size;
  info.weight_bytes = model.weight_bytes();
  // The same rendering and encoding as run_task.
  info.counter = [tokenizer, chat](const std::vector<Message>& messages) {
    std::vector<ChatMessage> msgs;
    msgs.reserve(messages.size());
    for (const auto& m : messages) msgs.push_back({m.role, m.content});
    const std::string rendered = chat->render(msgs, /*add_generation_prompt=*/true);
    return static_cast<int64_t>(tokenizer->encode(rendered, SpecialTokens::kParse, PostProcess::kApply).size());
  };
  return info;
}

}  // namespace kvcache::study
