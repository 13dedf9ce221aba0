// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file runner.h
/// Runner: the managed forward pass. It runs a CausalLM export with a KV cache behind the
/// KVCache interface (a CacheManager, or an engine's own): prefill in chunks, greedy
/// decoding, and streaming scoring (log-probs for perplexity). The export computes the
/// projections and the MLP; attention is the cache's:
///
///   per step (a prefill chunk of T tokens or one decode token), per layer l, with positions
///   p = cache.next_position(l) .. +T (the same for every layer unless kRerotate with
///   layer-dependent budgets):
///     (q, k, v) = model.qkv(l, h, p); cache.append(l, k, v, p);
///     h = model.finish(l, h, cache.attend(l, q, p));
///   then cache.end_step(kind) once (StepKind::kPrefill / kPrefillEnd / kDecode).
///   When the cache's policy needs a context replay (KVCache::replay_need(), KVzip), generate()
///   runs it right after the context's kPrefillEnd step: per chunk of ≤ ReplayNeed::chunk
///   context tokens, cache.begin_replay(), one step of (replay_prefix + chunk) at positions
///   continuing the context, end_step(kReplay, or kReplayEnd for the last chunk).
///
/// generate() and score() run one sequence (batch 1); generate_batch() decodes several
/// sequences together, one forward per step for the batch. Greedy decoding is deterministic.

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/kv_cache.h"
#include "kvcache/model/causal_lm.h"

namespace kvcache {

/// Options of Runner::generate().
struct GenerationOptions {
  /// Most new tokens to produce, in [1, kMaxTokens] (spec.h).
  int64_t max_new_tokens = 64;
  /// Prompt tokens per prefill step; 0 = the whole prompt in one step.
  int64_t prefill_chunk = 0;
  /// Stop after producing an end-of-sequence id (the EOS id is kept in `tokens`).
  bool stop_at_eos = true;
  /// End-of-sequence ids; empty = ModelConfig::eos_token_ids.
  std::vector<int64_t> eos_token_ids;
  /// Keep the logits that chose each new token in GenerationResult::logits.
  bool keep_logits = false;
  /// Query-agnostic generation (docs/study.md, "Query modes"): when > 0, only the prompt's first
  /// `question_start` tokens (the context) are prefilled, the last step ending with
  /// StepKind::kPrefillEnd (where SnapKV-like policies compress); the other prompt tokens (the
  /// question) are then fed one per StepKind::kDecode step, so the prompt-end compression never
  /// sees them, and greedy decoding starts from the last question token's logits. 0: the whole
  /// prompt is prefilled (query-aware). Must be < the prompt's length when > 0.
  int64_t question_start = 0;
  /// Token ids fed before every chunk of a context replay (KVzip, KVCache::replay_need()):
  /// normally ReplayNeed::instruction encoded by the caller's tokenizer (raw ids, no BOS);
  /// empty: the runner encodes it with the model's tokenizer (CausalLM::tokenizer_files()).
  std::vector<int64_t> replay_prefix;
  /// generate_batch()'s decode steps: sequences of one MultiSequenceCache that share prefix
  /// blocks read each shared block once per step for all their queries (shared-prefix,
  /// "cascade", attention: kvcache::attend_batch), where their policies take no attention
  /// mass. Each such sequence's attention then differs from its attend() by float32 rounding
  /// (the merge of partial softmax states; |Δ| ≤ 1e-5 · max|v| in tests/attend_cascade_test.cpp),
  /// as the batch's GEMMs already differ from one sequence's GEMV. false: every sequence's
  /// attention is bit for bit its attend() (still one attend_batch call per layer, spread over
  /// the threads). generate() (one sequence) ignores it.
  bool cascade_attention = true;
  /// When not null, generate_batch() adds the AttendBatchStats of every attend_batch call of its
  /// decode steps (one per layer and step) to *attention_stats (not reset first): shared
  /// passes, shared tokens and the bytes of K/V blocks read.
  AttendBatchStats* attention_stats = nullptr;
};

/// How a request of Runner::generate_batch() ended.
enum class GenerationStatus {
  kOk,        ///< ran to max_new_tokens or its EOS id
  /// Its cache refused a call for want of room (PoolFullError, preempted() false: a
  /// MultiSequenceCache under PoolFullRule::kRefuse, or the newest request under
  /// kPreemptNewest): it left the batch there.
  kRefused,
  /// An older request's call took its blocks (PoolFullRule::kPreemptNewest; PoolFullError,
  /// preempted() true): it left the batch at its next call.
  kPreempted,
};

/// "ok", "refused", "preempted".
const char* to_string(GenerationStatus status);

/// What Runner::generate() returns.
struct GenerationResult {
  /// New token ids in order (greedy argmax), at most max_new_tokens.
  std::vector<int64_t> tokens;
  /// `[N, V]` float32, row i = the logits that chose tokens[i] (row 0 comes from the last
  /// prompt position). Undefined unless GenerationOptions::keep_logits.
  at::Tensor logits;
  /// True if generation ended on an EOS id.
  bool stopped_at_eos = false;
  int64_t prompt_tokens = 0;  ///< tokens of the prompt
  /// Prompt tokens the cache already held (KVCache::begin_request, prefix caching): their
  /// prefill was skipped; prefill computed prompt_tokens − cached_prompt_tokens tokens.
  int64_t cached_prompt_tokens = 0;
  /// Prompt tokens whose forward steps completed (the question's decode steps included):
  /// prompt_tokens − cached_prompt_tokens, fewer for a request that left a batch during its
  /// prefill (GenerationStatus::kRefused).
  int64_t computed_prompt_tokens = 0;
  int64_t decode_steps = 0;   ///< single-token forwards of the reply (= N - 1)
  /// Prompt tokens fed as decode steps after the context (GenerationOptions::question_start):
  /// prompt_tokens − question_start, or 0.
  int64_t question_tokens = 0;
  /// Wall time of the prompt: the prefill, plus the question's decode steps if any; without
  /// the context replay (replay_seconds).
  double prefill_seconds = 0.0;
  /// The context replay the cache's policy asked for (KVzip; docs/model-runner.md "Context
  /// replay"): replay steps run, tokens they fed (instruction + context, summed over the
  /// steps), and their wall time (incl. the compression at the last step). 0 without a replay.
  int64_t replay_steps = 0;
  int64_t replay_tokens = 0;
  double replay_seconds = 0.0;
  /// Wall time of the decode_steps forwards (incl. argmax). In generate_batch(): of the batched
  /// steps this sequence took part in (shared with the others of the step).
  double decode_seconds = 0.0;
  /// kOk, or (generate_batch() only) why the request left the batch early. Then `tokens` holds
  /// what it generated before (empty if it left during its prefill; the last one was never fed
  /// back), `logits` their rows, and its cache's request was ended (KVCache::finish).
  GenerationStatus status = GenerationStatus::kOk;
  /// The PoolFullError's message when status != kOk: who needed how many bytes, the bytes free,
  /// in use and the pool's capacity_bytes. Empty for kOk.
  std::string error;
};

/// What Runner::score() returns.
struct ScoreResult {
  /// `[N - 1]` float32: entry t = log p(ids[t + 1] | ids[0..t]) under the managed cache.
  at::Tensor logprobs;
  double seconds = 0.0;
  /// exp(−mean(logprobs)).
  double perplexity() const;
};

/// Runs a CausalLM against a KVCache. Holds only the model handle; all request state lives in
/// the cache, so one Runner serves any number of caches (not concurrently on the same cache).
class Runner {
 public:
  explicit Runner(CausalLM model);

  const CausalLM& model() const;

  /// Ingests `ids` at positions cache.next_position(layer) onward, in steps of `chunk_size`
  /// tokens (0 = one step), ending the last step with StepKind::kPrefillEnd.
  /// Does not reset the cache.
  /// @return logits `[V]` float32 of the last token of `ids`.
  /// @throws InvalidArgument if ids is empty, an id is outside [0, V), chunk_size < 0, or
  ///         the cache's layer/head/head_dim counts differ from the model's; and, here as in
  ///         every method that runs the model (decode_step, generate, score, the batch forms),
  ///         when the model itself computes NaN/Inf keys, values or queries from valid ids (a
  ///         corrupt export), naming the model file and the layer: "model 'm.pt': layer 1
  ///         computed NaN in its keys at [b, h, t, d] = …" (not the cache's "k contains NaN").
  at::Tensor prefill(const std::vector<int64_t>& ids, KVCache& cache,
                     int64_t chunk_size = 0) const;

  /// One decode step: `token` at position cache.next_position(layer), then
  /// end_step(StepKind::kDecode).
  /// @return logits `[V]` float32.
  /// @throws InvalidArgument as prefill().
  at::Tensor decode_step(int64_t token, KVCache& cache) const;

  /// One decode step of several sequences together: tokens[b] at position
  /// caches[b]->next_position(layer), one forward for the batch (the dense layers see ids
  /// `[B, 1]`; each cache appends and attends its own sequence), then end_step(kDecode) on
  /// each cache. The caches may hold different lengths.
  /// @return logits `[B, V]` float32, row b for caches[b].
  /// @throws InvalidArgument if tokens.size() != caches.size(), the batch is empty, a cache is
  ///         null or given twice, a token id is outside [0, V), or a cache does not fit the model.
  /// `cascade_attention` and `attention_stats` as GenerationOptions' (generate_batch).
  at::Tensor decode_step_batch(const std::vector<int64_t>& tokens, const std::vector<KVCache*>& caches,
                               bool cascade_attention = true, AttendBatchStats* attention_stats = nullptr) const;

  /// Greedy generation: cache.begin_request(prompt, prompt + max_new_tokens) (reset() for a
  /// cache without prefix caching), prefill of the prompt tokens the cache does not hold yet —
  /// the first step at least PrefixReuse::min_first_step tokens, then steps of prefill_chunk —
  /// then one token per step until max_new_tokens or an EOS id. The last new token is not fed
  /// back. A reused prefix gives the same tokens as computing it (docs/model-runner.md,
  /// "Prefix caching"). Logs a warning (kvcache/log.h) when prompt + max_new_tokens may pass
  /// the model's max_position_embeddings. With options.question_start > 0, the prefill ends at
  /// that token and the rest of the prompt follows as decode steps (GenerationOptions).
  /// @throws InvalidArgument on an empty prompt, ids out of range, max_new_tokens outside
  ///         [1, kMaxTokens], prefill_chunk < 0, question_start outside [0, prompt length), a
  ///         cache that does not fit the model, or one whose begin_request() claims the whole
  ///         prompt (no logits would be computed) or, with question_start > 0, the whole context;
  ///         PoolFullError (a CapacityError) from a MultiSequenceCache without room: the request
  ///         stops mid-step (Sequence::finish() it, or begin another).
  GenerationResult generate(const std::vector<int64_t>& prompt, const GenerationOptions& options,
                            KVCache& cache) const;

  /// Batched greedy generation: sequence i generates prompts[i] in caches[i] (one KVCache per
  /// sequence, all distinct; typically Sequences of one MultiSequenceCache, or CacheManagers).
  /// Prefill: each prompt in turn, exactly as generate() does (begin_request, the prefix the
  /// cache already holds skipped, steps of prefill_chunk), so prompts of any lengths mix and a
  /// later prompt reuses the blocks an earlier one published. Decode: one forward per step for
  /// every sequence still running — the export's dense layers (embed, qkv, finish, head) see
  /// ids `[B, 1]`, and each sequence appends its K/V and attends over its own cache at its own
  /// position (ragged lengths without padding: attention is the cache's, per sequence). Caches
  /// with a core cache (KVCache::core_cache(): TorchCache) attend together, one attend_batch call
  /// per layer, with shared-prefix attention unless options.cascade_attention is false. A
  /// sequence leaves the batch at max_new_tokens or its EOS id; the others go on.
  ///
  /// Pool full (the rule; docs/model-runner.md, "Batched decode"): when a sequence's cache
  /// throws PoolFullError — its call refused (MultiSequenceCache, PoolFullRule::kRefuse, or
  /// the newest request under kPreemptNewest), or the sequence preempted by an older one's call
  /// (kPreemptNewest) — that sequence leaves the batch where it stands: in its prefill, or in a
  /// decode step (the step's other rows go on; its own row is dropped). Its request is ended at
  /// once (KVCache::finish: its blocks go back to the pool, so the others can use them), and its
  /// result says so (GenerationResult::status kRefused / kPreempted, `error` the message with
  /// the pool's numbers, `tokens` those generated before). It is not recomputed: resubmit it
  /// (a later generate_batch / generate) when the pool has room. Nothing is dropped silently,
  /// and the sequences that stay generate what they generate without the pressure (their
  /// caches receive the same calls). Other exceptions still stop the batch.
  ///
  /// A sequence generates in a batch what it generates alone: its cache receives the same
  /// appends at the same positions and steps. The greedy tokens are identical (tested for fp32
  /// and deterministic quantizers); the decode logits agree to float rounding only (fp32:
  /// within 1e-5 × the logit scale, tests/runner_test.cpp
  /// RaggedBatchGeneratesWhatEachSequenceGeneratesAlone), because the export's dense layers
  /// multiply one row with a GEMV and B rows with a GEMM, which round differently
  /// (docs/model-abi.md, "Numerics"); a batch of one is bit-identical to generate().
  /// @return one GenerationResult per prompt, in order.
  /// @throws InvalidArgument if prompts.size() != caches.size(), the batch is empty, a cache
  ///         is null or given twice, or as generate() for prompt i (the message names it);
  ///         any error of a cache other than PoolFullError (e.g. CapacityError for a budget that
  ///         does not fit the context): the batch stops there, its caches mid-step; begin new
  ///         requests on them.
  std::vector<GenerationResult> generate_batch(const std::vector<std::vector<int64_t>>& prompts,
                                               const GenerationOptions& options,
                                               const std::vector<KVCache*>& caches) const;

  /// Streaming scoring: cache.reset(N), then ingests `ids` in steps of `chunk_size` tokens
  /// (0 = one step; 1 = token by token, each query seeing only what the cache kept) and
  /// returns the log-prob of every next token. Memory per step: chunk × V float32 logits.
  /// @throws InvalidArgument if ids has fewer than 2 tokens, or as prefill().
  ScoreResult score(const std::vector<int64_t>& ids, KVCache& cache,
                    int64_t chunk_size = 0) const;

 private:
  /// Ingests ids[start:] at positions cache.next_position(layer) onward: the first step at
  /// least `first_min` tokens, then steps of `chunk_size` (0 = the rest in one step); adds each
  /// completed step's tokens to *computed (when not null).
  at::Tensor prefill_from(const std::vector<int64_t>& ids, int64_t start, KVCache& cache, int64_t chunk_size,
                          int64_t first_min, int64_t* computed = nullptr) const;

  /// The batch's caches: one per `item` ("prompt", "token"; `n` of them), none null, none
  /// twice, each fitting the model.
  void check_batch(size_t n, const char* item, const std::vector<KVCache*>& caches, const char* fn) const;
  /// generate()'s argument checks; messages start with `fn`.
  void check_request(const std::vector<int64_t>& prompt, const GenerationOptions& options, const KVCache& cache,
                     const std::string& fn) const;
  /// begin_request + prefill of what the cache does not hold; fills prompt_tokens,
  /// cached_prompt_tokens, prefill_seconds of `r`. @return logits `[V]` of the last prompt token.
  at::Tensor begin_and_prefill(const std::vector<int64_t>& prompt, const GenerationOptions& options, KVCache& cache,
                               const std::string& fn, GenerationResult& r) const;
  /// The context replay of `context` if cache.replay_need() asks for one; fills replay_* of `r`.
  void replay_context(const std::vector<int64_t>& context, const GenerationOptions& options, KVCache& cache,
                      GenerationResult& r) const;

  /// The replay instruction's token ids (ReplayNeed::instruction), encoded once per text with
  /// the model's tokenizer: building a Tokenizer parses its vocabulary and merges. Shared by
  /// copies of the Runner (same model); guarded for concurrent generate() calls.
  struct ReplayIds;
  std::shared_ptr<ReplayIds> replay_ids_;
  const std::vector<int64_t>& replay_instruction_ids(const std::string& instruction) const;

  CausalLM model_;
};

}  // namespace kvcache
