// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file task.h
/// One evaluation task of the kv_study suite: chat messages, the reference reply, a
/// programmatic scoring rule and the load-bearing span.
///
/// Text is ASCII; every offset is a byte offset. Tasks serialize to one JSON object per line
/// (the suite file and the training data of the default model share this format):
///
///   {"id":"s1234-needle-L512-d35-r0","family":"needle","depth_pct":35,"context_target":512,
///    "approx_tokens":497,"messages":[{"role":"system","content":"..."},{"role":"user",...}],
///    "answer":"48213","rule":{"kind":"word","arg":"48213"},
///    "span":{"message":1,"begin":220,"end":246},"max_new_tokens":13,
///    "question":{"message":1,"begin":1890,"end":1915}}
///
/// "question" is written only for tasks that have one (Task::question), "evidence" only for
/// tasks that carry it (the long suite's training data):
///   "evidence":[{"reply":[begin,end],"src":[[message,begin,end],...]},...]

#include <cstdint>
#include <string>
#include <vector>

namespace kvcache::study {

/// The task families: the default suite's four, then the long suite's own (long_suite.h).
enum class TaskFamily {
  kNeedle,       ///< an access code buried in filler at a given depth ("needle")
  kMultiTurn,    ///< a rule set in turn 1 that must hold for the final reply ("multiturn")
  kInstruction,  ///< a system-prompt instruction at position 0 ("instruction")
  kSummary,      ///< an early detail that a faithful summary must keep ("summary")
  kMultiKey,     ///< one of several keyed codes of the same form ("multikey"; long suite)
  kMultiValue,   ///< every code stored under one key, in order ("multivalue"; long suite)
  kVarTrack,     ///< the value at the end of a chain of assignments ("vartrack"; long suite)
  kAggregation,  ///< the most frequent of many mentioned colours ("aggregation"; long suite)
};

/// "needle", "multiturn", "instruction", "summary", "multikey", "multivalue", "vartrack",
/// "aggregation".
std::string to_string(TaskFamily family);
/// Inverse of to_string. @throws InvalidArgument listing the valid names.
TaskFamily parse_family(const std::string& name);
/// Every family: the default suite's four in suite order, then the long suite's own.
std::vector<TaskFamily> all_families();
/// The default suite's four families (needle, multiturn, instruction, summary).
std::vector<TaskFamily> default_families();

/// One chat message. `role` is "system", "user" or "assistant".
struct Message {
  std::string role;
  std::string content;
};

/// Byte range [begin, end) inside `messages[message].content`.
struct Span {
  int64_t message = -1;
  int64_t begin = 0;
  int64_t end = 0;
};

/// How an output is scored. Every rule first normalizes the output (normalize_output).
enum class RuleKind {
  kExact,       ///< output == arg
  kContains,    ///< arg is a substring of output, case-insensitive
  kWord,        ///< arg occurs as a whole word (bounded by non-alphanumerics), case-insensitive
  kRegex,       ///< ECMAScript regex `arg` matches somewhere in output (std::regex_search)
  kUppercase,   ///< output has at least one letter and no lowercase ASCII letter (arg unused)
  kStartsWith,  ///< the first word (alphanumeric run) equals arg, case-insensitive
  kEndsWith,    ///< the last word (alphanumeric run) equals arg, case-insensitive
};

/// "exact", "contains", "word", "regex", "uppercase", "starts_with", "ends_with".
std::string to_string(RuleKind kind);
/// Inverse of to_string. @throws InvalidArgument listing the valid names.
RuleKind parse_rule_kind(const std::string& name);

struct ScoringRule {
  RuleKind kind = RuleKind::kExact;
  std::string arg;
};

/// What a span of the reference reply copies from, or is decided by, in the prompt: the
/// reply's bytes [reply_begin, reply_end) and the prompt spans they come from (e.g. a digit of
/// a code and the same digit in the needle; a rule word and its place in the system prompt;
/// a most-frequent colour and every colour mention). Written by the long suite's training mode
/// for the trainer's attention supervision (tools/train_long_model.py); empty elsewhere.
struct Evidence {
  int64_t reply_begin = 0;
  int64_t reply_end = 0;
  std::vector<Span> sources;
};

/// Cuts the output at the first "<|im_end|>" or "<|endoftext|>" (if a runner left one in)
/// and trims ASCII whitespace at both ends.
std::string normalize_output(const std::string& output);

/// True if `output` satisfies `rule`.
/// @throws InvalidArgument if a regex rule's pattern does not compile.
bool score_output(const ScoringRule& rule, const std::string& output);

/// One task. The prompt is `messages` (it ends with a user turn); a perfect model replies
/// `answer`, which satisfies `rule` (the generator checks this).
struct Task {
  std::string id;                  ///< unique within a suite; part of a result row's key
  TaskFamily family = TaskFamily::kNeedle;
  int depth_pct = -1;              ///< needle depth in percent of the filler (-1: not a needle task)
  int64_t context_target = 0;      ///< nominal prompt length class in approximate tokens
  int64_t approx_tokens = 0;       ///< approx_tokens() of the ChatML-rendered prompt
  std::vector<Message> messages;   ///< system/user/assistant turns, last one "user"
  std::string answer;              ///< reference assistant reply
  ScoringRule rule;
  Span span;                       ///< the load-bearing sentence (needle, rule, instruction, detail)
  int64_t max_new_tokens = 16;     ///< generation limit for this task
  /// The question: the text at the end of the prompt that asks for the answer, after the
  /// context ([begin, end) of messages[message].content; everything of the prompt from `begin`
  /// on is the question, incl. any later message and the generation prompt). The query-agnostic
  /// study mode (QueryMode, sweep.h) compresses the cache at the end of the context, before
  /// `begin`. message = -1: no question follows the context (the summary family puts its
  /// instruction before the story); such a task runs the same in both modes.
  Span question;
  /// Reply-to-prompt alignments (training data of the long model); serialized as "evidence"
  /// only when not empty.
  std::vector<Evidence> evidence;
};

/// The task as one JSON object (no newline). Keys in a fixed order.
std::string task_to_json(const Task& task);
/// Parses task_to_json's output. @throws InvalidArgument naming the missing/bad field.
Task task_from_json(const std::string& line);

/// Writes one task per line, atomically (as write_results). @throws InvalidArgument if the file
/// cannot be written.
void write_tasks_jsonl(const std::string& path, const std::vector<Task>& tasks);
/// The largest task file read_tasks_jsonl() reads, and its longest line.
inline constexpr int64_t kMaxTaskFileBytes = int64_t{1} << 30;
inline constexpr int64_t kMaxTaskLineBytes = int64_t{16} << 20;

/// Reads a file written by write_tasks_jsonl (blank lines ignored).
/// @throws InvalidArgument if `path` does not exist, is not a regular file (a directory, a
///         device, a FIFO), is larger than kMaxTaskFileBytes (1 GiB) or has a line longer than
///         kMaxTaskLineBytes (16 MiB), or naming the file and line of a bad entry.
std::vector<Task> read_tasks_jsonl(const std::string& path);

/// Renders messages in ChatML (`<|im_start|>role\ncontent<|im_end|>\n` per message, then
/// `<|im_start|>assistant\n` if `add_generation_prompt`). If `content_offsets` is given it
/// receives, per message, the byte offset of its content in the result (to map a Span).
std::string render_chatml(const std::vector<Message>& messages, bool add_generation_prompt,
                          std::vector<int64_t>* content_offsets = nullptr);

/// A tokenizer-free length estimate: each run of letters is one token, each digit one token,
/// each other non-space character one token, each run of newlines one token, and each ChatML
/// special marker (`<|im_start|>`, `<|im_end|>`) one token. Close to a byte-level BPE trained on
/// the suite's small vocabulary; the runner records the true count.
int64_t approx_tokens(const std::string& text);

}  // namespace kvcache::study
