// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/task.h"

#include <cctype>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <sstream>

#include "common/file_io.h"
#include "study/json_fields.h"
#include "kvcache/error.h"
#include "kvcache/spec.h"

namespace kvcache::study {
namespace {

using ojson = nlohmann::ordered_json;

bool is_alnum(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; }

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

/// Alphanumeric runs of `s`, in order.
std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (is_alnum(c)) {
      cur.push_back(c);
    } else if (!cur.empty()) {
      out.push_back(cur);
      cur.clear();
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

bool contains_word(const std::string& text, const std::string& word) {
  if (word.empty()) return false;
  const std::string t = lower(text);
  const std::string w = lower(word);
  for (size_t pos = t.find(w); pos != std::string::npos; pos = t.find(w, pos + 1)) {
    bool left_ok = pos == 0 || !is_alnum(t[pos - 1]);
    size_t end = pos + w.size();
    bool right_ok = end == t.size() || !is_alnum(t[end]);
    // A word boundary is only meaningful where the needle itself starts/ends alphanumeric.
    if (!is_alnum(w.front())) left_ok = true;
    if (!is_alnum(w.back())) right_ok = true;
    if (left_ok && right_ok) return true;
  }
  return false;
}

template <typename T>
T required(const ojson& j, const char* key, const std::string& where) {
  KV_CHECK_ARG(j.contains(key), where, ": missing field '", key, "'");
  try {
    return j.at(key).get<T>();
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(detail::str_cat(where, ": field '", key, "' has the wrong type (",
                                          e.what(), ")"));
  }
}

int64_t int_field(const ojson& j, const char* key, const std::string& where, int64_t lo, int64_t hi,
                  std::optional<int64_t> fallback = std::nullopt) {
  return json_fields::integer(j, key, where, lo, hi, fallback);
}

std::string optional_string(const ojson& j, const char* key, const std::string& where) {
  return json_fields::string(j, key, where, std::string());
}

}  // namespace

std::string to_string(TaskFamily family) {
  switch (family) {
    case TaskFamily::kNeedle:
      return "needle";
    case TaskFamily::kMultiTurn:
      return "multiturn";
    case TaskFamily::kInstruction:
      return "instruction";
    case TaskFamily::kSummary:
      return "summary";
    case TaskFamily::kMultiKey:
      return "multikey";
    case TaskFamily::kMultiValue:
      return "multivalue";
    case TaskFamily::kVarTrack:
      return "vartrack";
    case TaskFamily::kAggregation:
      return "aggregation";
  }
  return "?";
}

TaskFamily parse_family(const std::string& name) {
  for (auto f : all_families()) {
    if (to_string(f) == name) return f;
  }
  throw InvalidArgument("unknown task family '" + name +
                        "' (expected needle, multiturn, instruction, summary, multikey, multivalue, vartrack "
                        "or aggregation)");
}

std::vector<TaskFamily> all_families() {
  return {TaskFamily::kNeedle,   TaskFamily::kMultiTurn,  TaskFamily::kInstruction, TaskFamily::kSummary,
          TaskFamily::kMultiKey, TaskFamily::kMultiValue, TaskFamily::kVarTrack,    TaskFamily::kAggregation};
}

std::vector<TaskFamily> default_families() {
  return {TaskFamily::kNeedle, TaskFamily::kMultiTurn, TaskFamily::kInstruction, TaskFamily::kSummary};
}

std::string to_string(RuleKind kind) {
  switch (kind) {
    case RuleKind::kExact:
      return "exact";
    case RuleKind::kContains:
      return "contains";
    case RuleKind::kWord:
      return "word";
    case RuleKind::kRegex:
      return "regex";
    case RuleKind::kUppercase:
      return "uppercase";
    case RuleKind::kStartsWith:
      return "starts_with";
    case RuleKind::kEndsWith:
      return "ends_with";
  }
  return "?";
}

RuleKind parse_rule_kind(const std::string& name) {
  for (auto k : {RuleKind::kExact, RuleKind::kContains, RuleKind::kWord, RuleKind::kRegex,
                 RuleKind::kUppercase, RuleKind::kStartsWith, RuleKind::kEndsWith}) {
    if (to_string(k) == name) return k;
  }
  throw InvalidArgument("unknown scoring rule '" + name +
                        "' (expected exact, contains, word, regex, uppercase, starts_with or "
                        "ends_with)");
}

std::string normalize_output(const std::string& output) {
  std::string s = output;
  for (const char* marker : {"<|im_end|>", "<|endoftext|>"}) {
    auto pos = s.find(marker);
    if (pos != std::string::npos) s.resize(pos);
  }
  size_t b = 0;
  size_t e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

bool score_output(const ScoringRule& rule, const std::string& output) {
  const std::string out = normalize_output(output);
  switch (rule.kind) {
    case RuleKind::kExact:
      return out == rule.arg;
    case RuleKind::kContains:
      return !rule.arg.empty() && lower(out).find(lower(rule.arg)) != std::string::npos;
    case RuleKind::kWord:
      return contains_word(out, rule.arg);
    case RuleKind::kRegex: {
      std::regex re;
      try {
        re = std::regex(rule.arg, std::regex::ECMAScript);
      } catch (const std::regex_error& e) {
        throw InvalidArgument(detail::str_cat("scoring rule regex '", rule.arg,
                                              "' does not compile: ", e.what()));
      }
      return std::regex_search(out, re);
    }
    case RuleKind::kUppercase: {
      bool any_letter = false;
      for (char c : out) {
        if (std::islower(static_cast<unsigned char>(c))) return false;
        if (std::isupper(static_cast<unsigned char>(c))) any_letter = true;
      }
      return any_letter;
    }
    case RuleKind::kStartsWith: {
      auto w = words(out);
      return !w.empty() && lower(w.front()) == lower(rule.arg);
    }
    case RuleKind::kEndsWith: {
      auto w = words(out);
      return !w.empty() && lower(w.back()) == lower(rule.arg);
    }
  }
  return false;
}

std::string task_to_json(const Task& task) {
  ojson j;
  j["id"] = task.id;
  j["family"] = to_string(task.family);
  j["depth_pct"] = task.depth_pct;
  j["context_target"] = task.context_target;
  j["approx_tokens"] = task.approx_tokens;
  ojson msgs = ojson::array();
  for (const auto& m : task.messages) msgs.push_back(ojson{{"role", m.role}, {"content", m.content}});
  j["messages"] = msgs;
  j["answer"] = task.answer;
  j["rule"] = ojson{{"kind", to_string(task.rule.kind)}, {"arg", task.rule.arg}};
  j["span"] = ojson{{"message", task.span.message}, {"begin", task.span.begin}, {"end", task.span.end}};
  j["max_new_tokens"] = task.max_new_tokens;
  if (task.question.message >= 0) {
    j["question"] = ojson{{"message", task.question.message}, {"begin", task.question.begin}, {"end", task.question.end}};
  }
  if (!task.evidence.empty()) {
    ojson ev = ojson::array();
    for (const auto& e : task.evidence) {
      ojson src = ojson::array();
      for (const auto& sp : e.sources) src.push_back(ojson::array({sp.message, sp.begin, sp.end}));
      ev.push_back(ojson{{"reply", ojson::array({e.reply_begin, e.reply_end})}, {"src", src}});
    }
    j["evidence"] = ev;
  }
  return j.dump();
}

Task task_from_json(const std::string& line) {
  ojson j;
  try {
    j = ojson::parse(line);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(detail::str_cat("task line is not valid JSON: ", e.what()));
  }
  KV_CHECK_ARG(j.is_object(), "task line is not a JSON object");
  Task t;
  t.id = required<std::string>(j, "id", "task");
  const std::string where = "task '" + t.id + "'";
  t.family = parse_family(required<std::string>(j, "family", where));
  t.depth_pct = static_cast<int>(int_field(j, "depth_pct", where, -1, 100));
  t.context_target = int_field(j, "context_target", where, 0, kMaxTokens);
  t.approx_tokens = int_field(j, "approx_tokens", where, 0, kMaxTokens, 0);
  KV_CHECK_ARG(j.contains("messages") && j["messages"].is_array(), where,
               ": missing array field 'messages'");
  for (const auto& m : j["messages"]) {
    KV_CHECK_ARG(m.is_object(), where, ": a message is ", m.dump(), ", not an object {role, content}");
    t.messages.push_back(Message{required<std::string>(m, "role", where),
                                 required<std::string>(m, "content", where)});
  }
  KV_CHECK_ARG(!t.messages.empty(), where, ": 'messages' is empty");
  t.answer = required<std::string>(j, "answer", where);
  KV_CHECK_ARG(j.contains("rule") && j["rule"].is_object(), where, ": missing object field 'rule'");
  t.rule.kind = parse_rule_kind(required<std::string>(j["rule"], "kind", where));
  t.rule.arg = optional_string(j["rule"], "arg", where);
  if (t.rule.kind == RuleKind::kRegex) {
    try {
      (void)score_output(t.rule, "");  // compiles the pattern: a bad one fails at load, not per row
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat(where, ": ", e.what()));
    }
  }
  if (j.contains("span")) {
    KV_CHECK_ARG(j["span"].is_object(), where, ": field 'span' is not an object {message, begin, end}");
    t.span.message = int_field(j["span"], "message", where, -1, kMaxTokens);
    t.span.begin = int_field(j["span"], "begin", where, -1, INT64_MAX);
    t.span.end = int_field(j["span"], "end", where, -1, INT64_MAX);
    if (t.span.message >= 0) {
      KV_CHECK_ARG(t.span.message < static_cast<int64_t>(t.messages.size()) && t.span.begin >= 0 &&
                       t.span.begin <= t.span.end &&
                       t.span.end <= static_cast<int64_t>(t.messages[t.span.message].content.size()),
                   where, ": span [", t.span.begin, ", ", t.span.end, ") of message ", t.span.message,
                   " is outside the message");
    }
  }
  t.max_new_tokens = int_field(j, "max_new_tokens", where, 1, kMaxTokens, 16);
  if (j.contains("question")) {
    KV_CHECK_ARG(j["question"].is_object(), where, ": field 'question' is not an object {message, begin, end}");
    t.question.message = int_field(j["question"], "message", where, -1, kMaxTokens);
    t.question.begin = int_field(j["question"], "begin", where, 0, INT64_MAX);
    t.question.end = int_field(j["question"], "end", where, 0, INT64_MAX);
    if (t.question.message >= 0) {
      KV_CHECK_ARG(t.question.message < static_cast<int64_t>(t.messages.size()) &&
                       t.question.begin <= t.question.end &&
                       t.question.end <= static_cast<int64_t>(t.messages[t.question.message].content.size()),
                   where, ": question [", t.question.begin, ", ", t.question.end, ") of message ", t.question.message,
                   " is outside the message");
    }
  }
  if (j.contains("evidence")) {
    const ojson& ev = j["evidence"];
    KV_CHECK_ARG(ev.is_array(), where, ": field 'evidence' is not an array");
    const auto int_at = [&](const ojson& a, size_t i) -> int64_t {
      KV_CHECK_ARG(a.is_array() && i < a.size() && a[i].is_number_integer(), where, ": evidence entry ", a.dump(),
                   " is not of the form {\"reply\":[begin,end],\"src\":[[message,begin,end],...]}");
      return a[i].get<int64_t>();
    };
    for (const auto& e : ev) {
      KV_CHECK_ARG(e.is_object() && e.contains("reply") && e.contains("src") && e["src"].is_array(), where,
                   ": evidence entry ", e.dump(), " is not of the form {\"reply\":[begin,end],\"src\":[...]}");
      Evidence x;
      x.reply_begin = int_at(e["reply"], 0);
      x.reply_end = int_at(e["reply"], 1);
      KV_CHECK_ARG(0 <= x.reply_begin && x.reply_begin < x.reply_end &&
                       x.reply_end <= static_cast<int64_t>(t.answer.size()),
                   where, ": evidence reply range [", x.reply_begin, ", ", x.reply_end, ") is outside the answer (",
                   t.answer.size(), " bytes)");
      for (const auto& s : e["src"]) {
        Span sp{int_at(s, 0), int_at(s, 1), int_at(s, 2)};
        KV_CHECK_ARG(sp.message >= 0 && sp.message < static_cast<int64_t>(t.messages.size()) && sp.begin >= 0 &&
                         sp.begin < sp.end &&
                         sp.end <= static_cast<int64_t>(t.messages[static_cast<size_t>(sp.message)].content.size()),
                     where, ": evidence source [", sp.begin, ", ", sp.end, ") of message ", sp.message,
                     " is outside the messages");
        x.sources.push_back(sp);
      }
      t.evidence.push_back(std::move(x));
    }
  }
  return t;
}

void write_tasks_jsonl(const std::string& path, const std::vector<Task>& tasks) {
  std::string data;
  for (const auto& t : tasks) data += task_to_json(t) + '\n';
  io::write_file_atomic(path, data);
}

std::vector<Task> read_tasks_jsonl(const std::string& path) {
  io::check_readable_file(path, "task file");
  const std::string data = io::read_regular_file(path, "task file", kMaxTaskFileBytes);
  io::check_line_lengths(data, "task file", path, kMaxTaskLineBytes);
  std::istringstream in(data);
  std::vector<Task> tasks;
  std::string line;
  int64_t lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      tasks.push_back(task_from_json(line));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat(path, ":", lineno, ": ", e.what()));
    }
  }
  return tasks;
}

std::string render_chatml(const std::vector<Message>& messages, bool add_generation_prompt,
                          std::vector<int64_t>* content_offsets) {
  std::string out;
  if (content_offsets != nullptr) content_offsets->clear();
  for (const auto& m : messages) {
    out += "<|im_start|>" + m.role + "\n";
    if (content_offsets != nullptr) content_offsets->push_back(static_cast<int64_t>(out.size()));
    out += m.content + "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

int64_t approx_tokens(const std::string& text) {
  int64_t n = 0;
  size_t i = 0;
  static const std::string kMarkers[] = {"<|im_start|>", "<|im_end|>", "<|endoftext|>"};
  while (i < text.size()) {
    bool marker = false;
    for (const auto& m : kMarkers) {
      if (text.compare(i, m.size(), m) == 0) {
        ++n;
        i += m.size();
        marker = true;
        break;
      }
    }
    if (marker) continue;
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (std::isalpha(c)) {
      while (i < text.size() && std::isalpha(static_cast<unsigned char>(text[i]))) ++i;
      ++n;
    } else if (c == '\n') {
      while (i < text.size() && text[i] == '\n') ++i;
      ++n;
    } else if (std::isspace(c)) {
      ++i;
    } else {
      ++n;  // a digit or a punctuation mark
      ++i;
    }
  }
  return n;
}

}  // namespace kvcache::study
