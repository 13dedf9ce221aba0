// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file sweep.h
/// The sweep driver of `kv_study run` and the ArmEvaluator interface behind which all
/// model-dependent work sits (the integrator implements it over CausalLM + CacheManager;
/// tests use a fake).
///
/// Plan (fixed order; `ResultRow::order` is the index in it):
///   1. "attn" rows: every KvGranularity × attention_bits (deep-dive table), on Q/K/V from
///      ArmEvaluator::capture_qkv();
///   2. "recon" rows: every distinct quant spec of the arms, in arm order;
///   3. per arm, in arm order: per query mode of SweepOptions::query_modes (aware before
///      agnostic) one "task" row per task (task order), then one "text" row (perplexity
///      single-pass and streaming; KLD and top-1 agreement vs the control arm). With the default
///      modes {aware} the plan is the one of a sweep before query modes existed.
/// `--shard i/n` keeps items with order % n == i. Items already in the results file are skipped.

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvcache/cache_manager.h"
#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/study/arm.h"
#include "kvcache/study/metrics.h"
#include "kvcache/study/quant_error.h"
#include "kvcache/study/results.h"
#include "kvcache/study/task.h"

namespace kvcache::study {

class Progress;

/// When the cache is compressed relative to the question (docs/study.md, "Query modes").
///  - kAware: the whole prompt, question included, is prefilled; SnapKV-like policies score at
///    the prompt's end, where the question is in their observation window (today's behaviour).
///  - kAgnostic: the context (the prompt before Task::question) is prefilled and compressed at
///    its end, as a cache compressed once and reused for any later question (KVzip, the kvpress
///    leaderboard's query-agnostic list); the question is then fed one token per decode step,
///    which never re-runs the prompt-end compression. A task without a question runs as kAware.
enum class QueryMode { kAware, kAgnostic };

/// "aware", "agnostic".
std::string to_string(QueryMode mode);
/// `--query-mode`: "aware", "agnostic" or "both" (= aware, agnostic).
/// @throws InvalidArgument naming `text` and the valid values.
std::vector<QueryMode> parse_query_modes(const std::string& text);

/// What one greedy generation under one arm produced.
struct Generation {
  std::string output;            ///< decoded reply, special tokens removed, stopped at end-of-turn
  int64_t prompt_tokens = 0;     ///< tokens of the chat-template-rendered prompt
  int64_t generated_tokens = 0;  ///< new tokens (incl. the end-of-turn token if produced)
  CacheStats cache;              ///< CacheManager::stats() at the end of the request
  /// Peak growth of the process's resident set during the request, bytes (PeakRssProbe: the
  /// cache, and whatever else the request allocated); < 0 if not measured.
  int64_t rss_growth_peak = -1;
  double prefill_seconds = 0;
  double decode_seconds = 0;
  /// The context replay of a policy that asks for one (KVzip): its wall time (not in
  /// prefill_seconds) and the tokens it fed; 0 without one.
  double replay_seconds = 0;
  int64_t replay_tokens = 0;
  /// Fraction of the task's load-bearing span tokens (Task::span mapped through the chat
  /// template and tokenizer) still resident in the cache after prefill, averaged over layers and
  /// KV heads; < 0 if not measured.
  double span_resident = -1;
  /// QueryMode::kAgnostic: prompt tokens fed as decode steps after the context's prefill (the
  /// question); 0 when the prompt was prefilled whole (aware mode, or a task without a question).
  int64_t question_tokens = 0;
  /// ModelEvaluatorOptions::load_cache: prompt tokens restored from the snapshot (their prefill
  /// skipped) and the wall time of reading and checking it; 0 without one.
  int64_t restored_tokens = 0;
  double restore_seconds = 0;
};

/// Scoring of the evaluation passage under one arm (same token ids for every arm).
struct TextEval {
  /// `[N]` log p(x_t | x_<t) of the N scored tokens from one forward pass over the passage
  /// (the cache quantizes but eviction cannot act inside one pass: the seed's perplexity).
  at::Tensor single_logprobs;
  /// `[N]` the same tokens streamed through the managed cache in chunks (eviction and
  /// quantization act between chunks).
  at::Tensor stream_logprobs;
  /// `[N, V]` float32 next-token logits of the streaming pass (KLD / top-1 vs the control).
  at::Tensor stream_logits;
  CacheStats cache;  ///< stats at the end of the streaming pass
};

/// The model-dependent half of the study. One instance serves one model; calls come from one
/// thread, in plan order. Errors: throw kvcache::InvalidArgument / CapacityError /
/// UnsupportedError for a problem of this item (recorded in its row, the sweep goes on);
/// anything else aborts the sweep (finished rows stay in the results file).
class ArmEvaluator {
 public:
  virtual ~ArmEvaluator() = default;

  /// Identifies the model in every row's key, e.g. "kvstudy-default.pt@1a2b3c4d".
  virtual std::string model_id() const = 0;

  /// The arm with canonical specs (Quantizer::spec() / the policy's canonical spec with its
  /// budget), e.g. {"fp8", "h2o@50%"} -> {"fp8:e4m3", "h2o@50%"}.
  /// @throws InvalidArgument if a spec does not parse (the sweep stops before anything runs);
  ///         UnsupportedError if it parses but this model cannot run it (e.g. KIVI g32 with
  ///         head_dim 16): the sweep keeps the arm and records the reason in its rows.
  virtual Arm canonicalize(const Arm& arm) const = 0;

  /// Renders `task.messages` with the model's chat template (generation prompt added), resets a
  /// CacheManager configured with the arm for prompt + task.max_new_tokens tokens, prefills,
  /// and decodes greedily (no penalties) up to task.max_new_tokens or end-of-turn. In
  /// QueryMode::kAgnostic the prefill stops at the start of task.question (compression acts
  /// there) and the question's tokens follow as decode steps (Generation::question_tokens).
  virtual Generation run_task(const Arm& arm, const Task& task, QueryMode mode) = 0;

  /// Scores the evaluation passage (fixed by the evaluator) under the arm.
  virtual TextEval eval_text(const Arm& arm) = 0;

  /// Reconstruction error of quantizer/scheme `quant` on the model's captured K/V.
  virtual ReconstructionResult reconstruction(const std::string& quant) = 0;

  /// Q and post-RoPE K/V of some layers on the evaluation passage (fp32, no cache compression),
  /// for the attention-error table. May return synthetic data for a model-free run.
  virtual std::vector<QkvSample> capture_qkv() = 0;

  /// The model's cache geometry (layers, KV heads, head_dim), for what builds per-layer
  /// schemes (kv_study layers). @throws UnsupportedError unless the evaluator overrides it.
  virtual CacheGeometry geometry() const {
    throw UnsupportedError("this evaluator does not report its model's cache geometry (layers, KV heads, head_dim)");
  }
};

enum class ItemKind { kAttention, kReconstruction, kTask, kText };

/// One unit of work of the plan.
struct WorkItem {
  int64_t order = 0;
  ItemKind kind = ItemKind::kTask;
  Arm arm;                 ///< kTask, kText
  std::string quant;       ///< kReconstruction
  int64_t task_index = -1; ///< kTask: index into the task list
  KvGranularity granularity = KvGranularity::kPerTokenKV;  ///< kAttention
  int bits = 0;            ///< kAttention
  QueryMode mode = QueryMode::kAware;  ///< kTask
  /// Row identity (without the model): ResultRow::arm and ResultRow::task.
  std::string row_arm;
  std::string row_task;
};

struct SweepOptions {
  std::vector<Arm> arms = default_arms();  ///< canonicalized and de-duplicated by run_sweep
  std::vector<Task> tasks;
  /// The query modes of the task rows (distinct; run aware before agnostic whatever the order).
  std::vector<QueryMode> query_modes = {QueryMode::kAware};
  Arm control = control_arm();             ///< canonicalized by run_sweep
  Shard shard;
  bool attention = true;        ///< "attn" rows
  bool reconstruction = true;   ///< "recon" rows
  bool text = true;             ///< "text" rows
  std::vector<int> attention_bits = {2, 4};
  int64_t attention_group = 32;
};

/// The full plan for already-canonical, de-duplicated arms (shard-independent).
std::vector<WorkItem> plan_sweep(const std::vector<Arm>& arms, const std::vector<Task>& tasks,
                                 const SweepOptions& options);

struct SweepStats {
  int64_t planned = 0;   ///< items in the full plan
  int64_t owned = 0;     ///< items of this shard
  int64_t skipped = 0;   ///< already in the results file
  int64_t executed = 0;  ///< run now
  int64_t errors = 0;    ///< executed items whose row carries an error
};

/// Checks everything run_sweep() checks before it runs an item: every arm and the control
/// canonicalize (a malformed spec throws; one this model cannot run is kept, its rows will
/// say why), the arm and task lists are not empty, task ids are unique, the query modes are
/// not empty and distinct, the attention-table
/// settings are in range. Call it before creating output files, so that bad inputs leave
/// nothing behind. @throws InvalidArgument naming the bad input.
void validate_sweep(const ArmEvaluator& evaluator, const SweepOptions& options);

/// Runs the owned, unfinished items of the plan in order and appends one row per item.
/// `progress` (optional) gets its total set to the shard's item count.
/// @throws InvalidArgument as validate_sweep() (before any row is written); rethrows
///         non-user errors of the evaluator (rows written so far stay).
SweepStats run_sweep(ArmEvaluator& evaluator, const SweepOptions& options, ResultsStore& store,
                     Progress* progress = nullptr);

}  // namespace kvcache::study
