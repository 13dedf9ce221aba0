// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file prefix_workload.h
/// Workloads with shared prefixes for kv_study (`kv_study prefix`, docs/study.md, "Prefix
/// sharing"): many requests over one MultiSequenceCache (kvcache/multi_sequence_cache.h), each
/// run with prefix sharing on and off, scored with the suite's rules (task.h), measured in pool
/// bytes, prefill tokens computed, time and the prefix cache's counters.
///
/// Families, built from the tasks of the "default" suite (task_suite.h) so the default model
/// knows their format:
///   - system_prompt: one instruction task's system prompt (the instruction, "Always reply in
///     uppercase.") and its note, shared by `requests` requests that each ask the question of
///     another instruction task of the same length class (the user turn is "Here is a note.
///     \n\n<note>\n\nQuestion: <question>"; only the question differs). Every reply is scored
///     by the shared instruction's rule, so a prefix reused from the cache must still carry the
///     instruction. The requests run concurrently: one sequence each, decoded as one batch
///     (Runner::generate_batch), the first request's prompt published before the others begin.
///   - multiturn: one multiturn task as a session that re-sends its history: request k is the
///     conversation up to the k-th user turn (with the reference assistant replies), so request
///     k's prompt is a prefix of request k+1's. Only the last request (the "Goodbye!" turn whose
///     reply the rule set in turn 1 constrains) is scored, by the task's rule. The requests run
///     one after another on one sequence.
///   - fewshot: one instruction task's system prompt, then a worked example as earlier turns —
///     another instruction task's question alone (user "Question: <question>", without its
///     note) and its reference answer in the instruction's style (instruction_reply,
///     task_suite.h) —, shared by `requests` requests whose last user turn is a third
///     instruction task's whole user turn (its note and question). Every reply is scored by the
///     shared instruction's rule: the example shows it applied to another question. Concurrent,
///     as system_prompt. The shared prefix is short (the system prompt and one question and
///     reply: 3 blocks of 16 of a ~530-token prompt), so sharing saves little here; what the
///     family adds is a prompt whose earlier turns the reply follows.
/// Worked examples of the needle and summary tasks, of the instruction task with their notes,
/// or two or three question-only examples are not used: the control on the default model
/// follows them less (fp32+full passes 1/24 to 23/24; one question-only example: 24/24, on 7
/// workloads 69/77; docs/study.md, "Prefix sharing").
///
/// Beside accuracy, same_as_baseline says how many scored replies equal the baseline arm's
/// (exact reuse reads them all; a lossy arm shows its drift).

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvcache/multi_sequence_cache.h"
#include "kvcache/study/arm.h"
#include "kvcache/study/task.h"

namespace kvcache::study {

enum class PrefixFamily {
  kSystemPrompt,  ///< "system_prompt"
  kMultiTurn,     ///< "multiturn"
  kFewShot,       ///< "fewshot"
};

/// "system_prompt", "multiturn", "fewshot".
std::string to_string(PrefixFamily family);

/// One request of a workload: the task's messages, rule and max_new_tokens are what runs;
/// `scored` false for a request whose reply is not scored (a session's earlier turns).
struct PrefixRequest {
  Task task;
  bool scored = true;
};

/// Requests that share prefixes, run against one MultiSequenceCache.
struct PrefixWorkload {
  std::string id;  ///< "<family>-<source task id>"
  PrefixFamily family = PrefixFamily::kSystemPrompt;
  /// true: all requests at once, one sequence each, batched decode; false: one after another
  /// on one sequence.
  bool concurrent = true;
  std::vector<PrefixRequest> requests;
};

/// The workloads for suite seed `seed`, in this order (existing indices stay put):
///   1. `count` system_prompt workloads of `requests` requests each (instruction tasks of the
///      512 length class: workload w shares task w's system prompt and note, request i asks the
///      question of task (w + i) mod 14; reference: instruction_reply(task (w + i), task w));
///   2. `count` multiturn workloads (the multiturn tasks of the 512 length class with 2 chatter
///      turns, then 6: 4 and 8 requests);
///   3. `count` fewshot workloads of `requests` requests each (the same 14 instruction tasks:
///      workload w has task w's system prompt, the worked example of task (w + 1) mod 14 (its
///      question, then instruction_reply(task w + 1, task w)), and request i the user turn of
///      task (w + 2 + i) mod 14 — past 12 requests these wrap around to task w's and the
///      example's —, its reference instruction_reply(that task, task w); one max_new_tokens for
///      all, the largest reference's approx_tokens + 8).
/// Deterministic.
/// @throws InvalidArgument if count is outside [1, 7] or requests outside [1, 14].
std::vector<PrefixWorkload> generate_prefix_workloads(uint64_t seed, int64_t count, int64_t requests);

/// PrefixRunOptions::block_tokens = 0 starts from this many tokens per block.
constexpr int64_t kAutoBlockTokens = 16;

/// Options of PrefixWorkloadRunner.
struct PrefixRunOptions {
  std::string model_path;     ///< exported model (.pt, model ABI v1) with its tokenizer
  int threads = 0;            ///< intra-op threads for LibTorch (0: leave as is)
  /// Tokens per block of the pool, the granularity of sharing. 0 (the default): per arm,
  /// kAutoBlockTokens rounded up to a multiple of the arm's groups along the tokens
  /// (CacheConfig::block_tokens_multiple: 16 for per-token schemes, 32 for KIVI's g32). A
  /// positive value is used as given and must be such a multiple.
  int64_t block_tokens = 0;
  int64_t prefill_chunk = 64; ///< prompt tokens per prefill step
  /// Reuse prefixes for policies that read attention during prefill (h2o, tova, snapkv,
  /// pyramid): MultiSequenceConfig::allow_inexact_reuse. Such a request does not compute what
  /// it computes alone (the policy never sees the skipped prefix's attention).
  bool allow_inexact_reuse = true;
  /// The pool's capacity in bytes (MultiSequenceConfig::capacity_bytes), ≥ 1. The default, 1 GiB,
  /// holds every workload; a smaller one shows the pool-full path (when_full).
  int64_t pool_bytes = int64_t{1} << 30;
  /// What a call that does not fit does (MultiSequenceConfig::when_full). A request that meets
  /// a full pool ends early — refused, or preempted for an older one — and is scored as failed
  /// (its reply is what it generated before); PrefixRunResult counts them.
  PoolFullRule when_full = PoolFullRule::kPreemptNewest;
  /// A disk tier under each sharing run's pool (MultiSequenceConfig::disk_tier_dir, ""
  /// off; disk_tier_bytes ≥ 1 with it). With one, a sharing run is followed by a second pass
  /// in the same pool: every request ended, every cached page reclaimed — spilled to the tier —
  /// then the workload's requests run again, their prefixes restored from disk
  /// (PrefixRunResult::disk_pass).
  std::string disk_tier_dir;
  int64_t disk_tier_bytes = 0;
};

/// The second pass of a sharing run over a disk tier (PrefixRunOptions::disk_tier_dir).
struct DiskPass {
  PrefixCounters counters;       ///< the pool's counters of this pass alone (hits by tier, disk traffic)
  PrefixCounters first_pass;     ///< the disk counters of the first pass (pages spilled while it ran)
  int64_t pages_spilled = 0;     ///< pages the reclaim between the passes wrote to the tier
  int64_t computed_tokens = 0;   ///< Σ prompt tokens this pass computed
  double prefill_seconds = 0;    ///< Σ GenerationResult::prefill_seconds of this pass (restores included)
  /// Σ prefill_seconds / Σ computed prompt tokens of the first pass: what recomputing a token costs.
  double recompute_seconds_per_token = 0;
  /// counters.disk_read_seconds / counters.prompt_tokens_hit_disk: what restoring one costs (0 if none).
  double restore_seconds_per_token = 0;
  int64_t same_outputs = 0;      ///< requests whose reply equals the first pass's (exact restores: all)
};

/// One workload under one arm, with sharing on or off.
struct PrefixRunResult {
  std::string workload;  ///< PrefixWorkload::id
  PrefixFamily family = PrefixFamily::kSystemPrompt;
  std::string arm;       ///< canonical "scheme+policy"
  bool sharing = false;
  int64_t requests = 0;
  int64_t block_tokens = 0;  ///< tokens per pool block this run used (PrefixRunOptions::block_tokens resolved)
  int64_t scored = 0;    ///< requests scored
  int64_t passed = 0;    ///< scored requests whose reply satisfies the rule
  int64_t prompt_tokens = 0;    ///< Σ prompt tokens
  int64_t computed_tokens = 0;  ///< Σ prompt tokens the requests' prefill computed (GenerationResult::computed_prompt_tokens)
  int64_t generated_tokens = 0; ///< Σ new tokens
  int64_t peak_pool_bytes = 0;  ///< PoolStats::bytes_in_use_peak over the workload
  /// Highest PoolStats::sharing_ratio sampled while requests held their blocks (after each
  /// batch / request, before the next begins).
  double sharing_ratio = 0;
  double seconds = 0;           ///< wall time of the workload's requests (prefill + decode)
  PrefixCounters counters;      ///< the pool's counters after the workload
  /// Requests that ended early for want of room (GenerationStatus::kPreempted / kRefused; a
  /// session runs each request as a batch of one). Their replies are scored as failed;
  /// computed_tokens counts the prefill steps they completed.
  int64_t preempted = 0, refused = 0;
  std::vector<std::string> outputs;  ///< each request's reply, in order
  std::vector<bool> request_scored;  ///< each request's PrefixRequest::scored, in order (as outputs)
  /// Each request ended normally (GenerationStatus::kOk: not preempted, not refused), in order.
  std::vector<bool> request_completed;
  /// The second pass from the disk tier (sharing runs with PrefixRunOptions::disk_tier_dir).
  std::optional<DiskPass> disk_pass;
};

/// Runs prefix workloads on one exported model (the model and tokenizer load once).
class PrefixWorkloadRunner {
 public:
  /// @throws InvalidArgument if the model cannot be loaded or holds no tokenizer.
  explicit PrefixWorkloadRunner(const PrefixRunOptions& options);
  ~PrefixWorkloadRunner();
  PrefixWorkloadRunner(const PrefixWorkloadRunner&) = delete;
  PrefixWorkloadRunner& operator=(const PrefixWorkloadRunner&) = delete;

  /// The arm with canonical specs. @throws InvalidArgument (a spec that does not parse) or
  /// UnsupportedError (one this model cannot run, e.g. a group that does not divide head_dim).
  Arm canonicalize(const Arm& arm) const;
  /// The prompt token ids of a request (its messages rendered by the model's chat template with
  /// the generation prompt, special tokens parsed).
  std::vector<int64_t> encode(const Task& task) const;
  /// Runs `workload` under `arm` in a fresh MultiSequenceCache (capacity: pool_bytes; blocks of
  /// block_tokens; prefix_sharing = `sharing`; when_full): greedy replies stopped at the model's
  /// EOS ids; a request that meets a full pool ends early and is counted (preempted, refused);
  /// then the pool's invariants (MultiSequenceCache::check_invariants).
  /// @throws as Runner::generate_batch (PoolFullError is counted, not thrown);
  ///         InternalError if the pool is inconsistent.
  PrefixRunResult run(const PrefixWorkload& workload, const Arm& arm, bool sharing) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// One run's agreement with its baseline run (same_as_baseline).
struct BaselineAgreement {
  int64_t compared = 0;  ///< scored requests that ended normally in both runs
  int64_t same = 0;      ///< of those, the requests whose reply equals the baseline's
};

/// Agreement with the baseline's replies, per result: of its scored requests that ended
/// normally (request_completed) in it and in its baseline run, how many replied exactly what
/// the same request (same index) replied in the baseline run — the run of the same workload
/// under the family's baseline arm (the arm of the family's first result in `results` with
/// sharing off, as the composition table's baseline) with sharing off. A request that ended
/// early in either run (its reply cut short) is left out of both counts. std::nullopt where
/// that baseline run is not in `results`. The baseline run reads same = compared; fp32 with
/// sharing on should too (exact reuse); a lossy arm shows its drift — where the model's
/// accuracy is low this still says what the cache changed.
/// @throws InvalidArgument naming the workload and arm if a result's outputs, request_scored
///         and request_completed differ in length, or its outputs from its baseline's.
std::vector<std::optional<BaselineAgreement>> same_as_baseline(const std::vector<PrefixRunResult>& results);

/// The report table (markdown): one row per (family, arm, sharing) in first-seen order, summed
/// over workloads — accuracy (passed / scored), same reply as baseline (same_as_baseline's same /
/// compared summed over the row's runs that have a baseline run: "24/24 (100.0%)"; "n/a" when
/// none has), peak pool KiB (the mean over workloads of each
/// workload's peak), prompt and computed prefill tokens, seconds, prompt tokens queried/hit,
/// hit rate, blocks shared / copied on write / reclaimed, the highest sharing ratio, requests
/// preempted / refused for want of room — then, per
/// (family, arm), what sharing saves: peak pool bytes and prefill tokens with / without, and the
/// same reply-as-baseline column. With disk passes, a third table: per (family, arm) the
/// second pass's prompt tokens hit in memory and from disk, computed, pages spilled / read /
/// evicted / failed, restore and recompute time per token and their ratio, replies equal to
/// the first pass's.
std::string prefix_report_markdown(const std::vector<PrefixRunResult>& results);

/// The results as a JSON array (one object per PrefixRunResult, outputs included;
/// "same_as_baseline" and "compared_with_baseline": same_as_baseline's same and compared, or
/// null where the baseline run is missing; "disk_pass": DiskPass's fields, or null).
std::string prefix_results_json(const std::vector<PrefixRunResult>& results);

/// Writes DIR/prefix.md (prefix_report_markdown) and DIR/prefix.json (prefix_results_json),
/// each atomically (io::write_file_atomic). @throws InvalidArgument naming a path that cannot be
/// written.
void write_prefix_files(const std::string& dir, const std::vector<PrefixRunResult>& results);

}  // namespace kvcache::study
