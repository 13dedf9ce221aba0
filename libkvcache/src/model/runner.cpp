// SPDX-License-Identifier: Apache-2.0
// The managed forward pass over any KVCache (runner.h).
#include "kvcache/model/runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "common/log.h"
#include "kvcache/error.h"
#include "kvcache/multi_sequence_cache.h"
#include "kvcache/spec.h"
#include "kvcache/torch/tensor_view.h"

namespace kvcache {
namespace {

/// Warns (once per cause) when `tokens` positions (`new_tokens` of them generated) reach past
/// the model's max_position_embeddings: the model runs there, but was never trained there.
void warn_past_positions(const ModelConfig& m, const char* fn, int64_t prompt, int64_t new_tokens) {
  const int64_t max_pos = m.max_position_embeddings;
  if (max_pos <= 0 || prompt + new_tokens <= max_pos) return;
  if (prompt > max_pos) {
    log::warn_once(detail::str_cat("positions:prompt:", max_pos),
                   detail::str_cat(fn, ": the prompt of ", prompt, " tokens is longer than the model's ",
                                   "max_position_embeddings of ", max_pos,
                                   "; positions from there on were never trained (output quality is undefined)"));
  } else {
    log::warn_once(detail::str_cat("positions:request:", max_pos),
                   detail::str_cat(fn, ": the prompt of ", prompt, " tokens + up to ", new_tokens,
                                   " new tokens may pass the model's max_position_embeddings of ", max_pos,
                                   "; positions from there on were never trained"));
  }
}

/// Throws InvalidArgument naming `fn` if an id is outside [0, vocab).
void check_token_ids(const std::vector<int64_t>& ids, int64_t vocab, const char* fn) {
  for (size_t i = 0; i < ids.size(); ++i) {
    KV_CHECK_ARG(ids[i] >= 0 && ids[i] < vocab, fn, ": token id ", ids[i], " at index ", i,
                 " outside the vocabulary [0, ", vocab, ")");
  }
}

/// Throws InvalidArgument if the cache's layer/head/head_dim counts differ from the model's.
void check_cache_fits(const CacheConfig& c, const ModelConfig& m, const char* fn) {
  KV_CHECK_ARG(c.num_layers == m.num_hidden_layers && c.num_q_heads == m.num_attention_heads &&
                   c.num_kv_heads == m.num_key_value_heads && c.head_dim == m.head_dim,
               fn, ": cache config (layers=", c.num_layers, ", H_q=", c.num_q_heads, ", H_kv=", c.num_kv_heads,
               ", D=", c.head_dim, ") does not fit the model (layers=", m.num_hidden_layers,
               ", H_q=", m.num_attention_heads, ", H_kv=", m.num_key_value_heads, ", D=", m.head_dim,
               "); build it from CausalLM::cache_config()");
}

/// When the cache refused layer `layer`'s K/V/q (an InvalidArgument from append or attend) and
/// the model computed a non-finite value there, throws an InvalidArgument naming the model file,
/// the layer and the tensor: a corrupt model, not the caller's input. Otherwise returns (the
/// caller rethrows the cache's own error).
void throw_if_model_output_not_finite(const CausalLM& model, int64_t layer, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& q, const InvalidArgument& refused) {
  for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&k, "keys"}, {&v, "values"}, {&q, "queries"}}) {
    if (at::isfinite(*t).all().item<bool>()) continue;
    const at::Tensor i = at::logical_not(at::isfinite(*t)).nonzero()[0];
    const float x = t->index({i[0], i[1], i[2], i[3]}).to(at::kFloat).item<float>();
    throw InvalidArgument(detail::str_cat(
        "model '", model.path(), "': layer ", layer, " computed ", std::isnan(x) ? "NaN" : (x > 0 ? "+Inf" : "-Inf"),
        " in its ", name, " at [b, h, t, d] = [", i[0].item<int64_t>(), ", ", i[1].item<int64_t>(), ", ",
        i[2].item<int64_t>(), ", ", i[3].item<int64_t>(),
        "] from valid token ids: the model file is corrupt or its weights overflow its dtype (the cache refused it: ",
        refused.what(), ")"));
  }
}

/// Runs `fn` (a call on the cache with layer `layer`'s K/V/q); a refusal caused by the model's
/// own non-finite output names the model and the layer.
template <class Fn>
auto naming_model_faults(const CausalLM& model, int64_t layer, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& q, Fn&& fn) {
  try {
    return fn();
  } catch (const InvalidArgument& e) {
    throw_if_model_output_not_finite(model, layer, k, v, q, e);
    throw;
  }
}

/// append + attend of layer `layer` (KVCache's order).
at::Tensor append_attend(const CausalLM& model, int64_t layer, KVCache& cache, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& q, const at::Tensor& pos) {
  return naming_model_faults(model, layer, k, v, q, [&] {
    cache.append(layer, k, v, pos);
    return cache.attend(layer, q, pos);
  });
}

enum class LogitsFor { kLastToken, kAllTokens, kNone };

/// One forward step of `ids` `[1, T]` int64 through every layer with `cache`.
/// @return logits `[1, T, V]` (kAllTokens) or `[1, 1, V]` (kLastToken) float32; undefined (kNone).
at::Tensor forward_step(const CausalLM& model, const at::Tensor& ids, KVCache& cache, StepKind step,
                        LogitsFor which) {
  const int64_t T = ids.size(1);
  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor h = model.embed(ids);
  const int64_t L = model.config().num_hidden_layers;
  at::Tensor pos;
  int64_t pos_start = -1;
  for (int64_t l = 0; l < L; ++l) {
    // Positions per layer: in PositionMode::kRerotate with layer-dependent budgets, layers
    // hold different physical lengths and so give the new tokens different positions.
    const int64_t p0 = cache.next_position(l);
    if (p0 != pos_start) {
      pos = at::arange(p0, p0 + T, long_opts);
      pos_start = p0;
    }
    QKV x = model.qkv(l, h, pos);
    h = model.finish(l, h, append_attend(model, l, cache, x.k, x.v, x.q, pos).to(h.scalar_type()));
  }
  cache.end_step(step);
  if (which == LogitsFor::kNone) return {};
  if (which == LogitsFor::kLastToken && T > 1) h = h.slice(/*dim=*/1, T - 1, T);
  return model.head(h).to(at::kFloat);
}

/// A sequence that left a batch on PoolFullError (generate_batch).
struct Left {
  bool left = false;
  bool preempted = false;
  std::string what;
};

/// Runs `fn` (calls on `cache`). Without `left`, an exception passes through. With it, a
/// PoolFullError ends the cache's request where it stands (KVCache::finish: its blocks go back
/// to the pool) and is recorded in *left. @return whether `fn` completed.
template <class Fn>
bool guarded(Fn&& fn, KVCache& cache, Left* left) {
  if (left == nullptr) {
    fn();
    return true;
  }
  try {
    fn();
    return true;
  } catch (const PoolFullError& e) {
    left->left = true;
    left->preempted = e.preempted();
    left->what = e.what();
    cache.finish();
    return false;
  }
}

/// One decode step of B sequences together, sequence b in caches[b] (all distinct), ids
/// `[B, 1]` int64. The dense layers (embed, qkv, finish, head) run once for the batch; each
/// sequence appends its own K/V and attends over its own cache at its own position (ragged:
/// the caches may hold different lengths). The ABI's `positions` are one `[T]` vector shared
/// by the batch, so qkv runs at position 0 (RoPE at 0 is the identity: cos 1, sin 0, exact in
/// fp32) and q is rotated afterwards with each sequence's position in one `rope` call, the
/// batch laid out along the T axis (`[1, H_q, B, D]`): RoPE is elementwise in (position,
/// dimension), so every sequence's q is what qkv at its position gives. Per layer, every row
/// appends first, then the rows attend together (attend_batch; `cascade`: shared prefix blocks
/// read once for all the queries that share them): each cache still receives append, attend
/// in its own order.
///
/// `left` null: a cache's exception passes through (the batch stops mid-step). Otherwise
/// `left` has B entries: a row whose cache throws PoolFullError (refused, or preempted by
/// another row's call) is recorded there and its request ended; from then on its cache is not
/// called, its row of the dense layers carries zeros for attention, and its logits row means
/// nothing. The batch keeps its B rows through the step, so the other rows' dense layers run
/// the same GEMMs as without the failure.
/// @return logits `[B, V]` float32.
at::Tensor forward_decode_batch(const CausalLM& model, const at::Tensor& ids, const std::vector<KVCache*>& caches,
                                bool cascade, AttendBatchStats* stats, std::vector<Left>* left = nullptr) {
  const auto B = static_cast<int64_t>(caches.size());
  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor h = model.embed(ids);
  const int64_t L = model.config().num_hidden_layers;
  const at::Tensor zero = at::zeros({1}, long_opts);
  std::vector<int64_t> p(static_cast<size_t>(B));
  std::vector<at::Tensor> outs(static_cast<size_t>(B));
  auto left_of = [&left](int64_t b) -> Left* { return left == nullptr ? nullptr : &(*left)[static_cast<size_t>(b)]; };
  auto gone = [&left](int64_t b) { return left != nullptr && (*left)[static_cast<size_t>(b)].left; };
  at::Tensor no_attention;  // [1, H_q, 1, D] zeros for a row that left
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t b = 0; b < B; ++b) {
      KVCache& c = *caches[static_cast<size_t>(b)];
      auto& pb = p[static_cast<size_t>(b)];
      if (gone(b) || !guarded([&] { pb = c.next_position(l); }, c, left_of(b))) pb = 0;
    }
    const at::Tensor pos = at::tensor(at::ArrayRef<int64_t>(p), long_opts);
    QKV x = model.qkv(l, h, zero);
    // [B, H_q, 1, D] -> [1, H_q, B, D]: the batch on the token axis, one position per row.
    const at::Tensor q = model.rope(x.q.transpose(0, 2), pos).transpose(0, 2);
    // Every row appends its own K/V first; then the step's attention: one attend_batch call
    // over the rows' core caches (spread over the threads; shared prefix blocks read once for
    // every query that shares them, when `cascade`), per row for a cache without one or whose
    // request was preempted (its attend() throws the PoolFullError that makes it leave).
    std::vector<at::Tensor> kb(static_cast<size_t>(B)), vb(kb), qb(kb), pb(kb);
    for (int64_t b = 0; b < B; ++b) {
      const auto i = static_cast<size_t>(b);
      kb[i] = x.k.slice(0, b, b + 1);
      vb[i] = x.v.slice(0, b, b + 1);
      qb[i] = q.slice(0, b, b + 1).contiguous();
      pb[i] = pos.slice(0, b, b + 1);
      KVCache& c = *caches[i];
      if (gone(b)) continue;
      guarded([&] { naming_model_faults(model, l, kb[i], vb[i], qb[i], [&] { c.append(l, kb[i], vb[i], pb[i]); }); },
              c, left_of(b));
    }
    std::vector<AttendRequest> together;
    std::vector<int64_t> together_rows;
    for (int64_t b = 0; b < B; ++b) {
      const auto i = static_cast<size_t>(b);
      KVCache& c = *caches[i];
      if (gone(b)) continue;
      SequenceCache* core = c.core_cache();
      const auto* seq = dynamic_cast<const Sequence*>(core);
      if (core == nullptr || (seq != nullptr && seq->preempted())) {
        guarded([&] { outs[i] = naming_model_faults(model, l, kb[i], vb[i], qb[i], [&] { return c.attend(l, qb[i], pb[i]); }); },
                c, left_of(b));
        continue;
      }
      outs[i] = at::empty({1, qb[i].size(1), 1, qb[i].size(3)}, at::kFloat);
      together.push_back({core, view_of(qb[i]), view_of(pb[i]), mutable_view_of(outs[i])});
      together_rows.push_back(b);
    }
    if (!together.empty()) {
      AttendBatchStats layer_stats;
      AttendBatchOptions how;
      how.cascade = cascade;
      how.stats = stats != nullptr ? &layer_stats : nullptr;
      try {
        attend_batch(l, together, how);
      } catch (const InvalidArgument& e) {
        for (const int64_t b : together_rows) {
          const auto i = static_cast<size_t>(b);
          throw_if_model_output_not_finite(model, l, kb[i], vb[i], qb[i], e);
        }
        throw;
      }
      if (stats != nullptr) *stats += layer_stats;
    }
    for (int64_t b = 0; b < B; ++b) {
      if (!gone(b)) continue;
      if (!no_attention.defined()) no_attention = at::zeros({1, q.size(1), 1, q.size(3)}, at::kFloat);
      outs[static_cast<size_t>(b)] = no_attention;
    }
    h = model.finish(l, h, at::cat(outs, 0).to(h.scalar_type()));
  }
  for (int64_t b = 0; b < B; ++b) {
    KVCache& c = *caches[static_cast<size_t>(b)];
    if (!gone(b)) guarded([&] { c.end_step(StepKind::kDecode); }, c, left_of(b));
  }
  return model.head(h).to(at::kFloat).view({B, -1});
}

at::Tensor ids_tensor(const int64_t* ids, int64_t n) {
  return at::tensor(at::ArrayRef<int64_t>(ids, static_cast<size_t>(n)), at::TensorOptions().dtype(at::kLong))
      .view({1, n});
}

}  // namespace

const char* to_string(GenerationStatus status) {
  switch (status) {
    case GenerationStatus::kOk:
      return "ok";
    case GenerationStatus::kRefused:
      return "refused";
    case GenerationStatus::kPreempted:
      return "preempted";
  }
  return "?";
}

double ScoreResult::perplexity() const {
  KV_CHECK_ARG(logprobs.defined() && logprobs.numel() > 0, "ScoreResult::perplexity: no log-probs");
  return std::exp(-logprobs.to(at::kDouble).mean().item<double>());
}

struct Runner::ReplayIds {
  std::mutex mu;
  std::map<std::string, std::vector<int64_t>> ids;  ///< instruction text -> its token ids
};

Runner::Runner(CausalLM model) : replay_ids_(std::make_shared<ReplayIds>()), model_(std::move(model)) {}

const std::vector<int64_t>& Runner::replay_instruction_ids(const std::string& instruction) const {
  const std::lock_guard<std::mutex> lock(replay_ids_->mu);
  auto it = replay_ids_->ids.find(instruction);
  if (it == replay_ids_->ids.end()) {
    it = replay_ids_->ids
             .emplace(instruction, Tokenizer::from_texts(model_.tokenizer_files())
                                       .encode(instruction, SpecialTokens::kParse, PostProcess::kSkip))
             .first;
  }
  return it->second;  // std::map nodes never move
}

const CausalLM& Runner::model() const { return model_; }

at::Tensor Runner::prefill(const std::vector<int64_t>& ids, KVCache& cache, int64_t chunk_size) const {
  KV_CHECK_ARG(!ids.empty(), "Runner::prefill: ids must not be empty");
  KV_CHECK_ARG(chunk_size >= 0, "Runner::prefill: chunk_size must be >= 0 (0 = whole prompt), got ", chunk_size);
  check_token_ids(ids, model_.config().vocab_size, "Runner::prefill");
  check_cache_fits(cache.config(), model_.config(), "Runner::prefill");
  return prefill_from(ids, 0, cache, chunk_size, 0);
}

at::Tensor Runner::prefill_from(const std::vector<int64_t>& ids, int64_t start, KVCache& cache, int64_t chunk_size,
                                int64_t first_min, int64_t* computed) const {
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t c = chunk_size == 0 ? n : chunk_size;
  at::Tensor logits;
  for (int64_t s = start; s < n;) {
    const int64_t t = std::min(s == start ? std::max(c, first_min) : c, n - s);
    logits = forward_step(model_, ids_tensor(ids.data() + s, t), cache,
                          s + t == n ? StepKind::kPrefillEnd : StepKind::kPrefill, LogitsFor::kLastToken);
    s += t;
    if (computed != nullptr) *computed += t;
  }
  return logits.view({-1});
}

at::Tensor Runner::decode_step(int64_t token, KVCache& cache) const {
  check_cache_fits(cache.config(), model_.config(), "Runner::decode_step");
  const int64_t V = model_.config().vocab_size;
  KV_CHECK_ARG(token >= 0 && token < V, "Runner::decode_step: token id ", token, " outside the vocabulary [0, ", V,
               ")");
  return forward_step(model_, ids_tensor(&token, 1), cache, StepKind::kDecode, LogitsFor::kLastToken).view({-1});
}

void Runner::check_batch(size_t n, const char* item, const std::vector<KVCache*>& caches, const char* fn) const {
  KV_CHECK_ARG(n == caches.size(), fn, ": ", n, " ", item, "s but ", caches.size(),
               " caches; give one cache (sequence) per ", item);
  KV_CHECK_ARG(n > 0, fn, ": the batch must hold at least one ", item);
  for (size_t i = 0; i < caches.size(); ++i) {
    KV_CHECK_ARG(caches[i] != nullptr, fn, ": cache ", i, " is null");
    for (size_t j = 0; j < i; ++j) {
      KV_CHECK_ARG(caches[j] != caches[i], fn, ": caches ", j, " and ", i,
                   " are the same cache; each sequence of a batch needs its own (MultiSequenceCache::add_sequence)");
    }
    check_cache_fits(caches[i]->config(), model_.config(), detail::str_cat(fn, ": cache ", i).c_str());
  }
}

at::Tensor Runner::decode_step_batch(const std::vector<int64_t>& tokens, const std::vector<KVCache*>& caches,
                                     bool cascade_attention, AttendBatchStats* attention_stats) const {
  check_batch(tokens.size(), "token", caches, "Runner::decode_step_batch");
  check_token_ids(tokens, model_.config().vocab_size, "Runner::decode_step_batch");
  return forward_decode_batch(model_,
                              at::tensor(at::ArrayRef<int64_t>(tokens), at::TensorOptions().dtype(at::kLong))
                                  .view({static_cast<int64_t>(tokens.size()), 1}),
                              caches, cascade_attention, attention_stats);
}

void Runner::check_request(const std::vector<int64_t>& prompt, const GenerationOptions& opt, const KVCache& cache,
                           const std::string& fn) const {
  KV_CHECK_ARG(!prompt.empty(), fn, ": the prompt must not be empty");
  KV_CHECK_ARG(static_cast<int64_t>(prompt.size()) <= kMaxTokens, fn, ": the prompt has ", prompt.size(),
               " tokens, more than the ", kMaxTokens, " a request may hold");
  KV_CHECK_ARG(opt.max_new_tokens >= 1 && opt.max_new_tokens <= kMaxTokens, fn, ": max_new_tokens must be in [1, ",
               kMaxTokens, "], got ", opt.max_new_tokens);
  KV_CHECK_ARG(opt.prefill_chunk >= 0, fn, ": prefill_chunk must be >= 0 (0 = whole prompt), got ",
               opt.prefill_chunk);
  KV_CHECK_ARG(opt.question_start >= 0 && opt.question_start < static_cast<int64_t>(prompt.size()), fn,
               ": question_start must be in [0, ", prompt.size(),
               ") (0 = no question split; the question needs at least one token), got ", opt.question_start);
  check_token_ids(prompt, model_.config().vocab_size, fn.c_str());
  check_cache_fits(cache.config(), model_.config(), fn.c_str());
}

at::Tensor Runner::begin_and_prefill(const std::vector<int64_t>& prompt, const GenerationOptions& opt, KVCache& cache,
                                     const std::string& fn, GenerationResult& r) const {
  using clock = std::chrono::steady_clock;
  r.prompt_tokens = static_cast<int64_t>(prompt.size());
  r.tokens.reserve(static_cast<size_t>(std::min<int64_t>(opt.max_new_tokens, 4096)));
  const PrefixReuse reuse = cache.begin_request(prompt, r.prompt_tokens + opt.max_new_tokens);
  KV_CHECK_ARG(reuse.cached_tokens >= 0 && reuse.cached_tokens < r.prompt_tokens && reuse.min_first_step >= 0, fn,
               ": the cache's begin_request() reports ", reuse.cached_tokens, " of the ", r.prompt_tokens,
               " prompt tokens cached (min_first_step ", reuse.min_first_step,
               "); at least the last prompt token must be computed");
  KV_CHECK_ARG(opt.question_start == 0 || reuse.cached_tokens < opt.question_start, fn,
               ": the cache's begin_request() reports ", reuse.cached_tokens,
               " prompt tokens cached, not fewer than the context's ", opt.question_start,
               " (question_start): the context's last token must be prefilled for it to be compressed");
  r.cached_prompt_tokens = reuse.cached_tokens;
  warn_past_positions(model_.config(), "generate", r.prompt_tokens, opt.max_new_tokens);
  const auto t0 = clock::now();
  at::Tensor logits;
  if (opt.question_start > 0) {
    // Query-agnostic: the context alone is prefilled (compression acts at its end), then the
    // question token by token as decode steps.
    const std::vector<int64_t> context(prompt.begin(), prompt.begin() + opt.question_start);
    logits = prefill_from(context, reuse.cached_tokens, cache, opt.prefill_chunk, reuse.min_first_step,
                          &r.computed_prompt_tokens);
    replay_context(context, opt, cache, r);
    for (int64_t i = opt.question_start; i < r.prompt_tokens; ++i) {
      logits = forward_step(model_, ids_tensor(&prompt[static_cast<size_t>(i)], 1), cache, StepKind::kDecode,
                            LogitsFor::kLastToken)
                   .view({-1});
      ++r.computed_prompt_tokens;
    }
    r.question_tokens = r.prompt_tokens - opt.question_start;
  } else {
    logits = prefill_from(prompt, reuse.cached_tokens, cache, opt.prefill_chunk, reuse.min_first_step,
                          &r.computed_prompt_tokens);
    replay_context(prompt, opt, cache, r);
  }
  r.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count() - r.replay_seconds;
  return logits;
}

void Runner::replay_context(const std::vector<int64_t>& context, const GenerationOptions& opt, KVCache& cache,
                            GenerationResult& r) const {
  const ReplayNeed need = cache.replay_need();
  if (!need.any()) return;
  std::vector<int64_t> prefix = opt.replay_prefix;
  if (prefix.empty() && !need.instruction.empty()) {
    prefix = replay_instruction_ids(need.instruction);
  }
  check_token_ids(prefix, model_.config().vocab_size, "Runner::generate: replay_prefix");
  const auto t0 = std::chrono::steady_clock::now();
  const auto n = static_cast<int64_t>(context.size());
  std::vector<int64_t> ids;
  for (int64_t s = 0; s < n; s += need.chunk) {
    const int64_t t = std::min(need.chunk, n - s);
    ids.assign(prefix.begin(), prefix.end());
    ids.insert(ids.end(), context.begin() + s, context.begin() + s + t);
    cache.begin_replay();
    (void)forward_step(model_, ids_tensor(ids.data(), static_cast<int64_t>(ids.size())), cache,
                       s + t == n ? StepKind::kReplayEnd : StepKind::kReplay, LogitsFor::kNone);
    ++r.replay_steps;
    r.replay_tokens += static_cast<int64_t>(ids.size());
  }
  r.replay_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

GenerationResult Runner::generate(const std::vector<int64_t>& prompt, const GenerationOptions& opt,
                                  KVCache& cache) const {
  check_request(prompt, opt, cache, "Runner::generate");
  const std::vector<int64_t>& eos = opt.eos_token_ids.empty() ? model_.config().eos_token_ids : opt.eos_token_ids;
  using clock = std::chrono::steady_clock;

  GenerationResult r;
  std::vector<at::Tensor> kept;
  at::Tensor logits = begin_and_prefill(prompt, opt, cache, "Runner::generate", r);
  const auto t1 = clock::now();
  while (true) {
    const int64_t next = logits.argmax().item<int64_t>();  // the one host read per token
    r.tokens.push_back(next);
    if (opt.keep_logits) kept.push_back(logits);
    if (opt.stop_at_eos && std::find(eos.begin(), eos.end(), next) != eos.end()) {
      r.stopped_at_eos = true;
      break;
    }
    if (static_cast<int64_t>(r.tokens.size()) == opt.max_new_tokens) break;
    logits = forward_step(model_, ids_tensor(&next, 1), cache, StepKind::kDecode, LogitsFor::kLastToken).view({-1});
    ++r.decode_steps;
  }
  r.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  if (opt.keep_logits) r.logits = at::stack(kept);
  return r;
}

std::vector<GenerationResult> Runner::generate_batch(const std::vector<std::vector<int64_t>>& prompts,
                                                     const GenerationOptions& opt,
                                                     const std::vector<KVCache*>& caches) const {
  check_batch(prompts.size(), "prompt", caches, "Runner::generate_batch");
  for (size_t i = 0; i < caches.size(); ++i) {
    check_request(prompts[i], opt, *caches[i], detail::str_cat("Runner::generate_batch: prompt ", i));
  }
  const std::vector<int64_t>& eos = opt.eos_token_ids.empty() ? model_.config().eos_token_ids : opt.eos_token_ids;
  using clock = std::chrono::steady_clock;
  const size_t n = prompts.size();
  std::vector<GenerationResult> results(n);
  std::vector<std::vector<at::Tensor>> kept(n);
  std::vector<at::Tensor> last(n);  // [V] logits that choose each sequence's next token
  // A sequence that meets a full pool leaves the batch: its result says why, the others go on.
  auto leave = [&results](size_t i, const Left& why) {
    GenerationResult& r = results[i];
    r.status = why.preempted ? GenerationStatus::kPreempted : GenerationStatus::kRefused;
    r.error = why.what;
  };
  // Prefill: each prompt on its own (ragged lengths and cached prefixes), in order, so a later
  // prompt can reuse the blocks an earlier one of the batch published.
  std::vector<size_t> active;
  for (size_t i = 0; i < n; ++i) {
    Left why;
    const bool ok = guarded(
        [&] {
          last[i] = begin_and_prefill(prompts[i], opt, *caches[i],
                                      detail::str_cat("Runner::generate_batch: prompt ", i), results[i]);
        },
        *caches[i], &why);
    if (ok) {
      active.push_back(i);
    } else {
      leave(i, why);
    }
  }
  std::vector<int64_t> next(n);
  for (size_t i : active) next[i] = last[i].argmax().item<int64_t>();
  auto t1 = clock::now();
  while (true) {
    // Choose every active sequence's token; those that end leave the batch.
    std::vector<size_t> still;
    std::vector<int64_t> ids;
    std::vector<KVCache*> step_caches;
    for (size_t i : active) {
      GenerationResult& r = results[i];
      const int64_t tok = next[i];
      r.tokens.push_back(tok);
      if (opt.keep_logits) kept[i].push_back(last[i]);
      if (opt.stop_at_eos && std::find(eos.begin(), eos.end(), tok) != eos.end()) {
        r.stopped_at_eos = true;
        continue;
      }
      if (static_cast<int64_t>(r.tokens.size()) == opt.max_new_tokens) continue;
      still.push_back(i);
      ids.push_back(tok);
      step_caches.push_back(caches[i]);
    }
    active.swap(still);
    if (active.empty()) break;
    std::vector<Left> left(active.size());
    const at::Tensor logits = forward_decode_batch(
        model_,
        at::tensor(at::ArrayRef<int64_t>(ids), at::TensorOptions().dtype(at::kLong))
            .view({static_cast<int64_t>(ids.size()), 1}),
        step_caches, opt.cascade_attention, opt.attention_stats, &left);
    const at::Tensor chosen = logits.argmax(-1).contiguous();  // one host read per step for the batch
    const int64_t* chosen_ids = chosen.data_ptr<int64_t>();
    const auto t2 = clock::now();
    const double dt = std::chrono::duration<double>(t2 - t1).count();
    t1 = t2;
    still.clear();
    for (size_t b = 0; b < active.size(); ++b) {
      const size_t i = active[b];
      if (left[b].left) {
        leave(i, left[b]);  // its tokens so far stand; the last one was not fed back
        continue;
      }
      still.push_back(i);
      next[i] = chosen_ids[b];
      last[i] = logits[static_cast<int64_t>(b)];
      ++results[i].decode_steps;
      results[i].decode_seconds += dt;
    }
    active.swap(still);
    if (active.empty()) break;
  }
  for (size_t i = 0; i < n; ++i) {
    if (opt.keep_logits && !kept[i].empty()) results[i].logits = at::stack(kept[i]);
  }
  return results;
}

ScoreResult Runner::score(const std::vector<int64_t>& ids, KVCache& cache, int64_t chunk_size) const {
  KV_CHECK_ARG(ids.size() >= 2, "Runner::score: needs at least 2 tokens, got ", ids.size());
  KV_CHECK_ARG(chunk_size >= 0, "Runner::score: chunk_size must be >= 0 (0 = one step), got ", chunk_size);
  check_token_ids(ids, model_.config().vocab_size, "Runner::score");
  check_cache_fits(cache.config(), model_.config(), "Runner::score");
  const int64_t n = static_cast<int64_t>(ids.size());
  const int64_t c = chunk_size == 0 ? n : chunk_size;
  const auto t0 = std::chrono::steady_clock::now();
  cache.reset(n);
  warn_past_positions(model_.config(), "score", n, 0);
  const at::Tensor all = ids_tensor(ids.data(), n).view({-1});
  std::vector<at::Tensor> parts;
  for (int64_t s = 0; s < n; s += c) {
    const int64_t t = std::min(c, n - s);
    const at::Tensor logits = forward_step(model_, ids_tensor(ids.data() + s, t), cache,
                                           s + t == n ? StepKind::kPrefillEnd : StepKind::kPrefill,
                                           LogitsFor::kAllTokens);
    // Predict ids[s+1 .. s+t]; the last token of the sequence has no successor.
    const int64_t m = std::min(t, n - 1 - s);
    if (m <= 0) break;
    const at::Tensor lp = at::log_softmax(logits[0].slice(0, 0, m), -1);
    parts.push_back(lp.gather(1, all.slice(0, s + 1, s + 1 + m).unsqueeze(1)).squeeze(1));
  }
  ScoreResult r;
  r.logprobs = at::cat(parts);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace kvcache
