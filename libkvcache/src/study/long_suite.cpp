// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/long_suite.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>

#include "kvcache/error.h"
#include "kvcache/study/task_suite.h"
#include "rng.h"
#include "suite_grammar.h"

namespace kvcache::study {
namespace {
using namespace grammar;

// ---- the long suite's own banks: no word of them is in the filler grammar or another bank ----
/// Keys of the keyed families (multikey, multivalue).
const std::vector<std::string> kKeys = {"granary", "castle", "harbour", "library", "lighthouse", "museum",
                                        "palace", "station", "theatre", "tower",   "bridge",     "chapel",
                                        "cabin",  "mill",    "stable",  "garage"};
const std::vector<std::string> kOrdinals = {"first", "second", "third", "fourth"};
/// Variable names of the vartrack family.
const std::vector<std::string> kVars = {"alpha", "beta",   "gamma",  "delta", "epsilon", "zeta",
                                        "theta", "iota",   "kappa",  "lambda", "sigma",  "omega"};
/// Lamp colours of the aggregation family (none is in kColours, the summary family's bank).
const std::vector<std::string> kLampColours = {"amber", "coral", "ivory", "jade", "olive",
                                               "pearl", "ruby",  "slate", "teal", "violet"};

constexpr int kCodeDigits = 5;
constexpr int64_t kMinLength = 512;
constexpr int64_t kMaxLength = 131072;

const char* kReadIntro = "Read the text and answer the question.";

/// A sentence placed into the filler at a fraction `depth` (0..1) of the filler's tokens.
struct Insert {
  std::string text;
  double depth = 0;
};

/// The document body: `intro`, then the filler pool's first k sentences with the inserts placed
/// at the sentence boundaries closest to their depths (in depth order, ties in list order), then
/// the question. `insert_at[i]` receives the byte offset of insert i in the user message.
struct DocBody {
  Body body;
  std::vector<int64_t> insert_at;
};

DocBody build_document(const std::string& system, const std::string& intro, const std::vector<Insert>& inserts,
                       const std::string& question, const std::vector<std::string>& pool, size_t k) {
  std::vector<int64_t> cum(k + 1, 0);
  for (size_t i = 0; i < k; ++i) cum[i + 1] = cum[i] + approx_tokens(pool[i]);
  // Boundary index (0..k) of each insert, then a stable order by boundary.
  std::vector<std::pair<size_t, size_t>> at;  // (boundary, insert index)
  for (size_t i = 0; i < inserts.size(); ++i) {
    const double want = inserts[i].depth * static_cast<double>(cum[k]);
    const auto it = std::lower_bound(cum.begin(), cum.end(), static_cast<int64_t>(std::llround(want)));
    size_t b = static_cast<size_t>(it - cum.begin());
    if (b > k) b = k;
    if (b > 0 && std::abs(static_cast<double>(cum[b - 1]) - want) <= std::abs(static_cast<double>(cum[b]) - want)) --b;
    at.emplace_back(b, i);
  }
  std::stable_sort(at.begin(), at.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  DocBody d;
  d.insert_at.assign(inserts.size(), -1);
  std::string text = intro + "\n\n";
  bool first = true;
  auto put = [&](const std::string& s) -> int64_t {
    if (!first) text += " ";
    first = false;
    const int64_t off = static_cast<int64_t>(text.size());
    text += s;
    return off;
  };
  size_t next = 0;
  for (size_t b = 0; b <= k; ++b) {
    while (next < at.size() && at[next].first == b) {
      d.insert_at[at[next].second] = put(inserts[at[next].second].text);
      ++next;
    }
    if (b < k) put(pool[b]);
  }
  text += "\n\n";
  d.body.question = {1, static_cast<int64_t>(text.size()), static_cast<int64_t>(text.size() + question.size())};
  text += question;
  d.body.messages = {{"system", system}, {"user", text}};
  return d;
}

/// Fills a document task to its target: the largest k (filler sentences) whose prompt the
/// counter puts at or below the target.
DocBody fill_document(const std::string& system, const std::string& intro, const std::vector<Insert>& inserts,
                      const std::string& question, const std::vector<std::string>& pool, int64_t target,
                      const PromptTokenCounter& counter) {
  size_t k = 0;
  (void)fill_to([&](size_t n) { return build_document(system, intro, inserts, question, pool, n).body; }, pool.size(),
                target, counter, &k);
  return build_document(system, intro, inserts, question, pool, k);
}

/// `n` depths, uniform in [0, 1], sorted.
std::vector<double> sorted_depths(Rng& r, size_t n) {
  std::vector<double> d(n);
  for (auto& x : d) x = static_cast<double>(r.below(10001)) / 10000.0;
  std::sort(d.begin(), d.end());
  return d;
}

/// `n` distinct items of `bank`, in draw order.
std::vector<std::string> distinct(Rng& r, const std::vector<std::string>& bank, size_t n) {
  KV_INTERNAL_ASSERT(n <= bank.size(), "bank too small");
  std::vector<std::string> pool = bank;
  std::vector<std::string> out;
  for (size_t i = 0; i < n; ++i) {
    const size_t j = i + static_cast<size_t>(r.below(pool.size() - i));
    std::swap(pool[i], pool[j]);
    out.push_back(pool[i]);
  }
  return out;
}

/// `n` distinct codes of kCodeDigits digits.
std::vector<std::string> distinct_codes(Rng& r, size_t n) {
  std::set<std::string> seen;
  std::vector<std::string> out;
  while (out.size() < n) {
    std::string c = random_code(r, kCodeDigits);
    if (seen.insert(c).second) out.push_back(c);
  }
  return out;
}

/// Evidence: reply bytes [rb, rb + len) copy the prompt bytes at (message, sb, sb + len), byte by
/// byte for a code (one entry per digit: each digit's query has its own source), whole for a word.
void copy_evidence(Task& t, int64_t rb, int64_t message, int64_t sb, int64_t len, bool per_byte) {
  if (per_byte) {
    for (int64_t i = 0; i < len; ++i) t.evidence.push_back({rb + i, rb + i + 1, {{message, sb + i, sb + i + 1}}});
  } else {
    t.evidence.push_back({rb, rb + len, {{message, sb, sb + len}}});
  }
}

int64_t find_in(const std::string& s, const std::string& what, int64_t from = 0) {
  const size_t p = s.find(what, static_cast<size_t>(from));
  KV_INTERNAL_ASSERT(p != std::string::npos, "'", what, "' not found");
  return static_cast<int64_t>(p);
}

Task base_task(TaskFamily family, int64_t target, const DocBody& d) {
  Task t;
  t.family = family;
  t.context_target = target;
  t.messages = d.body.messages;
  t.question = d.body.question;
  return t;
}

// ---- family builders ----

Task long_needle(Rng& r, int depth_pct, int64_t target, const PromptTokenCounter& counter) {
  const std::string code = random_code(r, kCodeDigits);
  const auto pool = filler_pool(r, static_cast<size_t>(target / 4 + 8));
  const std::vector<Insert> ins = {{"The access code is " + code + ".", depth_pct / 100.0}};
  const DocBody d = fill_document(kSystem, kReadIntro, ins, "Question: What is the access code?", pool, target, counter);
  Task t = base_task(TaskFamily::kNeedle, target, d);
  t.depth_pct = depth_pct;
  t.span = {1, d.insert_at[0], d.insert_at[0] + static_cast<int64_t>(ins[0].text.size())};
  t.answer = code;
  t.rule = {RuleKind::kExact, code};
  copy_evidence(t, 0, 1, d.insert_at[0] + 19, kCodeDigits, true);
  return t;
}

Task long_multikey(Rng& r, size_t n_keys, int64_t target, const PromptTokenCounter& counter) {
  const auto keys = distinct(r, kKeys, n_keys);
  const auto codes = distinct_codes(r, n_keys);
  const auto depths = sorted_depths(r, n_keys);
  const size_t asked = static_cast<size_t>(r.below(n_keys));
  std::vector<Insert> ins;
  // Keys in random order along the document (depths are sorted; keys were drawn at random).
  for (size_t i = 0; i < n_keys; ++i) ins.push_back({"The access code for the " + keys[i] + " is " + codes[i] + ".", depths[i]});
  const auto pool = filler_pool(r, static_cast<size_t>(target / 4 + 8));
  const DocBody d = fill_document(kSystem, kReadIntro, ins, "Question: What is the access code for the " + keys[asked] + "?",
                                  pool, target, counter);
  Task t = base_task(TaskFamily::kMultiKey, target, d);
  t.span = {1, d.insert_at[asked], d.insert_at[asked] + static_cast<int64_t>(ins[asked].text.size())};
  t.answer = codes[asked];
  t.rule = {RuleKind::kExact, codes[asked]};
  const int64_t code_at = d.insert_at[asked] + static_cast<int64_t>(ins[asked].text.size()) - 1 - kCodeDigits;
  copy_evidence(t, 0, 1, code_at, kCodeDigits, true);
  return t;
}

Task long_multivalue(Rng& r, size_t n_values, size_t n_distractors, int64_t target, const PromptTokenCounter& counter) {
  const auto keys = distinct(r, kKeys, 2);
  const auto codes = distinct_codes(r, n_values + n_distractors);
  // The asked key's values in text order; the distractor key's values numbered likewise.
  const auto dv = sorted_depths(r, n_values);
  const auto dd = sorted_depths(r, n_distractors);
  std::vector<Insert> ins;
  for (size_t i = 0; i < n_values; ++i) {
    ins.push_back({"The " + kOrdinals[i] + " access code for the " + keys[0] + " is " + codes[i] + ".", dv[i]});
  }
  for (size_t i = 0; i < n_distractors; ++i) {
    ins.push_back({"The " + kOrdinals[i] + " access code for the " + keys[1] + " is " + codes[n_values + i] + ".", dd[i]});
  }
  const auto pool = filler_pool(r, static_cast<size_t>(target / 4 + 8));
  const DocBody d = fill_document(kSystem, kReadIntro, ins, "Question: What are the access codes for the " + keys[0] + "?",
                                  pool, target, counter);
  Task t = base_task(TaskFamily::kMultiValue, target, d);
  t.span = {1, d.insert_at[0], d.insert_at[n_values - 1] + static_cast<int64_t>(ins[n_values - 1].text.size())};
  std::string regex = "^\\D*";
  for (size_t i = 0; i < n_values; ++i) {
    if (i > 0) {
      t.answer += ", ";
      regex += "\\D+";
    }
    t.answer += kOrdinals[i] + " ";
    const int64_t rb = static_cast<int64_t>(t.answer.size());
    t.answer += codes[i];
    regex += codes[i];
    const int64_t code_at = d.insert_at[i] + static_cast<int64_t>(ins[i].text.size()) - 1 - kCodeDigits;
    copy_evidence(t, rb, 1, code_at, kCodeDigits, true);
  }
  t.answer += ".";
  regex += "\\D*$";
  t.rule = {RuleKind::kRegex, regex};
  return t;
}

Task long_vartrack(Rng& r, int hops, int distractor_hops, int64_t target, const PromptTokenCounter& counter) {
  const auto names = distinct(r, kVars, static_cast<size_t>(hops + 1 + (distractor_hops > 0 ? distractor_hops + 1 : 0)));
  const auto codes = distinct_codes(r, 2);
  // Chain A: names[0] = code0, names[i] = names[i-1] (i = 1..hops); chain B likewise after it.
  std::vector<Insert> ins;
  const auto da = sorted_depths(r, static_cast<size_t>(hops + 1));
  for (int i = 0; i <= hops; ++i) {
    const std::string rhs = i == 0 ? codes[0] : names[static_cast<size_t>(i - 1)];
    ins.push_back({"Let " + names[static_cast<size_t>(i)] + " be " + rhs + ".", da[static_cast<size_t>(i)]});
  }
  if (distractor_hops > 0) {
    const auto db = sorted_depths(r, static_cast<size_t>(distractor_hops + 1));
    const size_t o = static_cast<size_t>(hops + 1);
    for (int i = 0; i <= distractor_hops; ++i) {
      const std::string rhs = i == 0 ? codes[1] : names[o + static_cast<size_t>(i - 1)];
      ins.push_back({"Let " + names[o + static_cast<size_t>(i)] + " be " + rhs + ".", db[static_cast<size_t>(i)]});
    }
  }
  const auto pool = filler_pool(r, static_cast<size_t>(target / 4 + 8));
  const std::string& last = names[static_cast<size_t>(hops)];
  const DocBody d = fill_document(kSystem, kReadIntro, ins, "Question: What is the value of " + last + "?", pool,
                                  target, counter);
  Task t = base_task(TaskFamily::kVarTrack, target, d);
  t.span = {1, d.insert_at[0], d.insert_at[static_cast<size_t>(hops)] + static_cast<int64_t>(ins[static_cast<size_t>(hops)].text.size())};
  // Walk back: "delta is gamma, gamma is beta, ..., alpha is 48213."
  for (int i = hops; i >= 0; --i) {
    const std::string& lhs = names[static_cast<size_t>(i)];
    if (i != hops) t.answer += ", ";
    t.answer += lhs + " is ";
    const std::string rhs = i == 0 ? codes[0] : names[static_cast<size_t>(i - 1)];
    const int64_t rb = static_cast<int64_t>(t.answer.size());
    t.answer += rhs;
    // The right-hand side is copied from "Let <lhs> be <rhs>.": its bytes after "Let <lhs> be ".
    const int64_t src = d.insert_at[static_cast<size_t>(i)] + 4 + static_cast<int64_t>(lhs.size()) + 4;
    copy_evidence(t, rb, 1, src, static_cast<int64_t>(rhs.size()), /*per_byte=*/i == 0);
  }
  t.answer += ".";
  t.rule = {RuleKind::kEndsWith, codes[0]};
  return t;
}

Task long_aggregation(Rng& r, size_t n_colours, int64_t target, const PromptTokenCounter& counter) {
  const auto colours = distinct(r, kLampColours, n_colours);
  const int64_t n = std::max<int64_t>(8, target / 128);
  // The first colour is the most frequent: ceil(0.3 n) mentions; the rest share the others as
  // evenly as possible (each at most ceil((n - top) / (colours - 1)) < top).
  const int64_t top = (3 * n + 9) / 10;
  std::vector<int64_t> count(n_colours, 0);
  count[0] = top;
  for (int64_t i = 0; i < n - top; ++i) count[1 + static_cast<size_t>(i) % (n_colours - 1)]++;
  std::vector<std::string> mentions;
  for (size_t c = 0; c < n_colours; ++c) {
    for (int64_t i = 0; i < count[c]; ++i) mentions.push_back(colours[c]);
  }
  for (size_t i = mentions.size() - 1; i > 0; --i) std::swap(mentions[i], mentions[r.below(i + 1)]);
  const auto depths = sorted_depths(r, mentions.size());
  std::vector<Insert> ins;
  for (size_t i = 0; i < mentions.size(); ++i) ins.push_back({"A lamp glowed " + mentions[i] + ".", depths[i]});
  const auto pool = filler_pool(r, static_cast<size_t>(target / 4 + 8));
  const DocBody d = fill_document(kSystem, kReadIntro, ins, "Question: Which colour did the lamps glow most often?",
                                  pool, target, counter);
  Task t = base_task(TaskFamily::kAggregation, target, d);
  int64_t first = INT64_MAX, last = 0;
  // The reply names the colour after a space, as the document does: the token a copy of the
  // mentions reads is the token the reply writes.
  const std::string lead = "The lamps glowed ";
  Evidence e{static_cast<int64_t>(lead.size()), static_cast<int64_t>(lead.size() + colours[0].size()), {}};
  for (size_t i = 0; i < ins.size(); ++i) {
    first = std::min(first, d.insert_at[i]);
    last = std::max(last, d.insert_at[i] + static_cast<int64_t>(ins[i].text.size()));
    const int64_t w = d.insert_at[i] + 14;  // after "A lamp glowed "
    e.sources.push_back({1, w, w + static_cast<int64_t>(mentions[i].size())});
  }
  std::sort(e.sources.begin(), e.sources.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  t.span = {1, first, last};
  t.answer = lead + colours[0] + " most often.";
  t.rule = {RuleKind::kExact, t.answer};
  t.evidence.push_back(std::move(e));
  return t;
}

/// Evidence of a styled reply (instruction, multiturn): the rule word, where the reply spells it,
/// comes from its place in the rule; an uppercase reply is decided by the word "uppercase".
void style_evidence(Task& t) {
  const Message& m = t.messages[static_cast<size_t>(t.span.message)];
  const std::string rule = m.content.substr(static_cast<size_t>(t.span.begin), static_cast<size_t>(t.span.end - t.span.begin));
  if (t.rule.kind == RuleKind::kUppercase) {
    const int64_t at = t.span.begin + find_in(rule, "uppercase");
    t.evidence.push_back({0, static_cast<int64_t>(t.answer.size()), {{t.span.message, at, at + 9}}});
    return;
  }
  const std::string& w = t.rule.arg;
  const int64_t at = t.span.begin + find_in(rule, "word " + w) + 5;
  const int64_t len = static_cast<int64_t>(w.size());
  const int64_t rb = t.rule.kind == RuleKind::kStartsWith ? 0 : static_cast<int64_t>(t.answer.size()) - 1 - len;
  copy_evidence(t, rb, t.span.message, at, len, false);
}

Task long_instruction(Rng& r, Style style, int64_t target, const PromptTokenCounter& counter) {
  Task t = make_instruction(r, style, target, counter);
  style_evidence(t);
  return t;
}

Task long_multiturn(Rng& r, Style style, int turns, int64_t target, const PromptTokenCounter& counter) {
  Task t = make_multiturn(r, style, turns, target, counter);
  style_evidence(t);
  return t;
}

/// Sets the long suite's decode budget and checks the length against the counter.
Task finish_long(Task t, const PromptTokenCounter& counter, bool check_length) {
  t = finish(std::move(t));
  KV_INTERNAL_ASSERT(t.max_new_tokens <= kLongNewTokens, "task ", t.id, "'s reply needs ", t.max_new_tokens,
                     " new tokens, more than the long suite's ", kLongNewTokens);
  t.max_new_tokens = kLongNewTokens;
  if (check_length) {
    const int64_t n = counter ? counter(t.messages) : approx_prompt_tokens(t.messages);
    // Within 1% below the target (a filler sentence is ~8 tokens: 16 tokens below 1,600).
    const int64_t lo = t.context_target - std::max<int64_t>(t.context_target / 100, 16);
    KV_CHECK_ARG(n <= t.context_target && n >= lo, "long suite task ", t.id, ": its prompt is ", n,
                 " tokens, not within 1% below its target of ", t.context_target,
                 " (this tokenizer splits the suite's sentences into far more tokens than the grammar's words)");
  }
  return t;
}

std::string long_id(uint64_t seed, TaskFamily f, int64_t len, int rep) {
  return "s" + std::to_string(seed) + "-long-" + to_string(f) + "-L" + length_label(len) + "-r" + std::to_string(rep);
}

}  // namespace

int64_t approx_prompt_tokens(const std::vector<Message>& messages) {
  return approx_tokens(render_chatml(messages, /*add_generation_prompt=*/true));
}

std::vector<int64_t> long_suite_lengths() { return {4096, 8192, 16384, 32768}; }
std::vector<int64_t> default_long_lengths() { return {4096, 8192, 16384}; }

std::vector<int64_t> parse_lengths(const std::string& text) {
  std::vector<int64_t> out;
  size_t i = 0;
  while (i <= text.size()) {
    size_t j = text.find(',', i);
    if (j == std::string::npos) j = text.size();
    std::string item = text.substr(i, j - i);
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.front()))) item.erase(item.begin());
    while (!item.empty() && std::isspace(static_cast<unsigned char>(item.back()))) item.pop_back();
    const auto bad = [&](const std::string& why) {
      return InvalidArgument("length '" + item + "' in '" + text + "' " + why +
                             " (expected tokens, e.g. 4096, or with a k suffix, e.g. 4k,8k,16k)");
    };
    if (item.empty()) throw bad("is empty");
    int64_t mult = 1;
    std::string digits = item;
    if (digits.back() == 'k' || digits.back() == 'K') {
      mult = 1024;
      digits.pop_back();
    }
    if (digits.empty() || digits.size() > 9 ||
        !std::all_of(digits.begin(), digits.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); })) {
      throw bad("is not a whole number of tokens");
    }
    const int64_t v = std::stoll(digits) * mult;
    if (v < kMinLength || v > kMaxLength) {
      throw bad("is outside [" + std::to_string(kMinLength) + ", " + std::to_string(kMaxLength) + "] tokens");
    }
    if (std::find(out.begin(), out.end(), v) != out.end()) throw bad("is given twice");
    out.push_back(v);
    i = j + 1;
  }
  return out;
}

std::string length_label(int64_t tokens) {
  return tokens % 1024 == 0 ? std::to_string(tokens / 1024) + "k" : std::to_string(tokens);
}

std::vector<TaskFamily> long_families() {
  return {TaskFamily::kNeedle,      TaskFamily::kMultiKey,    TaskFamily::kMultiValue, TaskFamily::kVarTrack,
          TaskFamily::kAggregation, TaskFamily::kInstruction, TaskFamily::kMultiTurn};
}

std::vector<int> long_needle_depths() { return {0, 14, 29, 43, 57, 71, 86, 100}; }

std::vector<Task> generate_long_suite(uint64_t seed, const LongSuiteOptions& options) {
  KV_CHECK_ARG(!options.lengths.empty(), "the long suite needs at least one length");
  for (size_t i = 0; i < options.lengths.size(); ++i) {
    const int64_t v = options.lengths[i];
    KV_CHECK_ARG(v >= kMinLength && v <= kMaxLength, "long suite length ", v, " is outside [", kMinLength, ", ",
                 kMaxLength, "] tokens");
    for (size_t j = 0; j < i; ++j) KV_CHECK_ARG(options.lengths[j] != v, "long suite length ", v, " is given twice");
  }
  KV_CHECK_ARG(options.reps >= 1 && options.reps <= kMaxLongReps, "long suite repetitions ", options.reps,
               " are outside [1, ", kMaxLongReps, "]");
  const PromptTokenCounter& counter = options.counter;
  std::vector<Task> out;
  for (int rep = 0; rep < options.reps; ++rep) {
    for (size_t li = 0; li < options.lengths.size(); ++li) {
      const int64_t len = options.lengths[li];
      const uint64_t cell = static_cast<uint64_t>(len);
      const auto rng = [&](TaskFamily f, uint64_t i) {
        return Rng(mix_seed(seed, "long", static_cast<uint64_t>(f), cell, static_cast<uint64_t>(rep), i));
      };
      for (int depth : long_needle_depths()) {
        Rng r = rng(TaskFamily::kNeedle, static_cast<uint64_t>(depth));
        Task t = long_needle(r, depth, len, counter);
        t.id = long_id(seed, TaskFamily::kNeedle, len, rep);
        t.id.insert(t.id.rfind("-r"), "-d" + std::to_string(depth));
        t.evidence.clear();  // evaluation tasks carry no training alignments
        out.push_back(finish_long(std::move(t), counter, true));
      }
      for (TaskFamily f : long_families()) {
        if (f == TaskFamily::kNeedle) continue;
        for (int i = 0; i < 2; ++i) {
          Rng r = rng(f, static_cast<uint64_t>(i));
          const int variant = (rep * 2 + i + static_cast<int>(li)) % 3;  // styles rotate over reps and lengths
          Task t;
          switch (f) {
            case TaskFamily::kMultiKey:
              t = long_multikey(r, 6, len, counter);
              break;
            case TaskFamily::kMultiValue:
              t = long_multivalue(r, 4, 3, len, counter);
              break;
            case TaskFamily::kVarTrack:
              t = long_vartrack(r, 4, 4, len, counter);
              break;
            case TaskFamily::kAggregation:
              t = long_aggregation(r, 6, len, counter);
              break;
            case TaskFamily::kInstruction:
              t = long_instruction(r, static_cast<Style>(variant), len, counter);
              break;
            case TaskFamily::kMultiTurn:
              t = long_multiturn(r, static_cast<Style>(variant), 6, len, counter);
              break;
            default:
              KV_INTERNAL_ASSERT(false, "not a long family: ", to_string(f));
          }
          t.id = long_id(seed, f, len, rep) + "-" + std::to_string(i);
          t.evidence.clear();  // evaluation tasks carry no training alignments
          out.push_back(finish_long(std::move(t), counter, true));
        }
      }
    }
  }
  return out;
}

std::vector<Task> generate_long_training_tasks(uint64_t seed, int64_t count, const LongTrainingOptions& options) {
  const std::vector<TaskFamily> families = grammar::check_training_request(
      count, options.min_context, options.max_context, options.families, long_families(),
      "is not a long-suite family (expected needle, multikey, multivalue, vartrack, aggregation, instruction or "
      "multiturn)");
  std::vector<Task> out;
  out.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    Rng r(mix_seed(seed, "long-train", static_cast<uint64_t>(i)));
    const TaskFamily fam = r.pick(families);
    const int64_t target = r.range(options.min_context, options.max_context);
    Task t;
    switch (fam) {
      case TaskFamily::kNeedle:
        t = long_needle(r, static_cast<int>(r.range(0, 100)), target, {});
        break;
      case TaskFamily::kMultiKey:
        t = long_multikey(r, static_cast<size_t>(r.range(2, 6)), target, {});
        break;
      case TaskFamily::kMultiValue:
        t = long_multivalue(r, static_cast<size_t>(r.range(2, 4)), static_cast<size_t>(r.range(0, 3)), target, {});
        break;
      case TaskFamily::kVarTrack:
        t = long_vartrack(r, static_cast<int>(r.range(1, 4)), static_cast<int>(r.range(0, 4)), target, {});
        break;
      case TaskFamily::kAggregation:
        t = long_aggregation(r, static_cast<size_t>(r.range(3, 6)), target, {});
        break;
      case TaskFamily::kInstruction:
        t = long_instruction(r, static_cast<Style>(r.below(3)), target, {});
        break;
      case TaskFamily::kMultiTurn:
        t = long_multiturn(r, static_cast<Style>(r.below(3)), static_cast<int>(r.range(1, 8)), target, {});
        break;
      default:
        KV_INTERNAL_ASSERT(false, "not a long family: ", to_string(fam));
    }
    t.id = "longtrain-s" + std::to_string(seed) + "-" + std::to_string(i);
    out.push_back(finish_long(std::move(t), {}, false));
  }
  return out;
}

}  // namespace kvcache::study
