// SPDX-License-Identifier: Apache-2.0
// The sentence grammar and task builders both suites share (suite_grammar.h).
#include "suite_grammar.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "kvcache/error.h"
#include "kvcache/study/task_suite.h"

namespace kvcache::study::grammar {

// ---- word banks (small, fixed vocabulary; no digits, no colours or names in the filler) ----
const std::vector<std::string> kAdj = {"small", "big",  "old",   "young", "quiet",
                                       "happy", "busy", "tired", "brave", "kind"};
const std::vector<std::string> kNoun = {"cat",   "dog",     "bird", "farmer", "baker",
                                        "child", "teacher", "fox",  "horse",  "duck"};
const std::vector<std::string> kVerb = {"walks", "runs",  "sleeps", "sings", "waits",
                                        "plays", "reads", "rests",  "looks", "sits"};
const std::vector<std::string> kPrep = {"near", "by", "in", "behind", "beside"};
const std::vector<std::string> kPlace = {"park",   "garden", "house",  "river", "hill",
                                         "market", "school", "forest", "field", "village"};
const std::vector<std::string> kWeather = {"sunny", "windy", "cold", "warm", "rainy", "calm", "cloudy"};
const std::vector<std::string> kThing = {"bread", "music", "rain",  "snow", "soup",
                                         "flowers", "games", "books", "tea", "stars"};
// Rule words: none is the first or last word of any reference reply below.
const std::vector<std::string> kRuleWords = {"apple",  "banana", "rocket", "pepper",
                                             "tiger",  "violin", "magnet", "candle",
                                             "pillow", "turnip", "walrus", "mango"};
const std::vector<std::string> kNames = {"Lena", "Omar", "Mira", "Tomas", "Anya",  "Felix",
                                         "Rosa", "Ivan", "Nora", "Hugo",  "Zara", "Pablo"};
const std::vector<std::string> kRoles = {"sailor", "painter", "doctor", "tailor",
                                         "miner",  "pilot",   "singer", "hunter"};
const std::vector<std::string> kColours = {"red",    "blue",  "green", "yellow", "purple",
                                           "orange", "white", "black", "pink",   "brown"};
const std::vector<std::string> kAnimals = {"cats",    "goats", "hens",  "ducks",
                                           "rabbits", "sheep", "geese", "pigs"};
const std::vector<QA> kQuestions = {
    {"What colour is the sky?", "The sky is blue."},
    {"How many legs does a dog have?", "A dog has four legs."},
    {"What do cows drink?", "Cows drink water."},
    {"Where do fish live?", "Fish live in water."},
    {"What is two plus two?", "Two plus two is four."},
    {"What day comes after Monday?", "The day after Monday is Tuesday."},
    {"What do bees make?", "Bees make honey."},
    {"Is the sun hot or cold?", "The sun is hot."},
    {"What do we use to write?", "We use a pen to write."},
    {"What season comes after winter?", "Spring comes after winter."},
    {"How many days are in a week?", "A week has seven days."},
    {"What animal says moo?", "A cow says moo."},
};

const char* kSystem = "You are a helpful assistant.";
const char* kNeedleIntro = "Read the text and answer the question.";
const char* kNeedleQuestion = "Question: What is the access code?";
const char* kGoodbye = "Goodbye!";
const char* kGoodbyeReply = "Goodbye, see you soon.";
const char* kRuleAck = "OK, I will follow the rule.";
const char* kNoteIntro = "Here is a note.";
const char* kStoryIntro = "Read the story and write a one-sentence summary.";


std::string upper(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}
std::string capitalize(std::string s) {
  if (!s.empty()) s[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[0])));
  return s;
}
std::string decapitalize(std::string s) {
  if (!s.empty()) s[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(s[0])));
  return s;
}

/// Applies a reply style to a plain reply that ends with '.'.
std::string styled(const std::string& reply, Style style, const std::string& word) {
  switch (style) {
    case Style::kUppercase:
      return upper(reply);
    case Style::kEndsWith:
      return reply.substr(0, reply.size() - 1) + ", " + word + ".";
    case Style::kStartsWith:
      return capitalize(word) + ", " + decapitalize(reply);
  }
  return reply;
}

ScoringRule style_rule(Style style, const std::string& word) {
  switch (style) {
    case Style::kUppercase:
      return {RuleKind::kUppercase, ""};
    case Style::kEndsWith:
      return {RuleKind::kEndsWith, word};
    case Style::kStartsWith:
      return {RuleKind::kStartsWith, word};
  }
  return {};
}

std::string filler_sentence(Rng& r) {
  switch (r.below(3)) {
    case 0:
      return "The " + r.pick(kAdj) + " " + r.pick(kNoun) + " " + r.pick(kVerb) + " " +
             r.pick(kPrep) + " the " + r.pick(kPlace) + ".";
    case 1:
      return "It is a " + r.pick(kWeather) + " day in the " + r.pick(kPlace) + ".";
    default:
      return "The " + r.pick(kNoun) + " likes " + r.pick(kThing) + ".";
  }
}

std::vector<std::string> filler_pool(Rng& r, size_t n) {
  std::vector<std::string> pool;
  pool.reserve(n);
  for (size_t i = 0; i < n; ++i) pool.push_back(filler_sentence(r));
  return pool;
}

std::string join(const std::vector<std::string>& parts, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; ++i) {
    if (i > begin) out += " ";
    out += parts[i];
  }
  return out;
}



/// Largest number of filler sentences k (0..max_k) with prompt_tokens(build(k)) <= target
/// (k = 0 if even the empty body is over target).
Body fill_to(const std::function<Body(size_t)>& build, size_t max_k, int64_t target,
             const PromptTokenCounter& counter, size_t* chosen) {
  const auto prompt_tokens = [&](const std::vector<Message>& m) { return counter ? counter(m) : approx_prompt_tokens(m); };
  // prompt_tokens(build(k)) grows with k: binary search for the last k that fits.
  size_t lo = 0;
  size_t hi = max_k;
  while (lo < hi) {
    const size_t mid = lo + (hi - lo + 1) / 2;
    if (prompt_tokens(build(mid).messages) <= target) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  if (chosen != nullptr) *chosen = lo;
  return build(lo);
}

std::string random_code(Rng& r, int digits) {
  std::string code(1, static_cast<char>('1' + r.below(9)));
  for (int i = 1; i < digits; ++i) code.push_back(static_cast<char>('0' + r.below(10)));
  return code;
}

Task finish(Task t) {
  t.approx_tokens = approx_prompt_tokens(t.messages);
  t.max_new_tokens = approx_tokens(t.answer) + 8;
  KV_INTERNAL_ASSERT(score_output(t.rule, t.answer), "reference reply of ", t.id,
                     " fails its own rule: ", t.answer);
  KV_INTERNAL_ASSERT(t.span.message >= 0 && t.span.end > t.span.begin, "task ", t.id, " has no span");
  KV_INTERNAL_ASSERT(t.question.message < 0 ||
                         (t.question.message < static_cast<int64_t>(t.messages.size()) &&
                          t.question.end > t.question.begin &&
                          t.question.end <= static_cast<int64_t>(t.messages[static_cast<size_t>(t.question.message)].content.size())),
                     "task ", t.id, " has a question outside its messages");
  return t;
}

// ---- family builders ----

Task make_needle(Rng& r, int depth_pct, int64_t target, int code_digits, const PromptTokenCounter& counter) {
  const std::string code = random_code(r, code_digits);
  const std::string needle = "The access code is " + code + ".";
  auto pool = filler_pool(r, static_cast<size_t>(target / 4 + 8));
  auto build = [&](size_t k) {
    // Insert the needle at the sentence boundary closest to depth% of the filler tokens.
    std::vector<int64_t> cum(k + 1, 0);
    for (size_t i = 0; i < k; ++i) cum[i + 1] = cum[i] + approx_tokens(pool[i]);
    const double want = depth_pct / 100.0 * static_cast<double>(cum[k]);
    size_t at = 0;
    for (size_t i = 1; i <= k; ++i) {
      if (std::abs(static_cast<double>(cum[i]) - want) < std::abs(static_cast<double>(cum[at]) - want)) at = i;
    }
    std::string before = join(pool, 0, at);
    std::string after = join(pool, at, k);
    std::string text = std::string(kNeedleIntro) + "\n\n" + before + (before.empty() ? "" : " ");
    Body b;
    b.span = {1, static_cast<int64_t>(text.size()), static_cast<int64_t>(text.size() + needle.size())};
    text += needle + (after.empty() ? "" : " ") + after + "\n\n";
    b.question = {1, static_cast<int64_t>(text.size()), static_cast<int64_t>(text.size() + std::string(kNeedleQuestion).size())};
    text += kNeedleQuestion;
    b.messages = {{"system", kSystem}, {"user", text}};
    return b;
  };
  Body b = fill_to(build, pool.size(), target, counter);
  Task t;
  t.family = TaskFamily::kNeedle;
  t.depth_pct = depth_pct;
  t.context_target = target;
  t.messages = std::move(b.messages);
  t.span = b.span;
  t.question = b.question;
  t.answer = code;
  t.rule = {RuleKind::kWord, code};
  return t;
}

Task make_multiturn(Rng& r, Style style, int turns, int64_t target, const PromptTokenCounter& counter) {
  const auto prompt_tokens = [&](const std::vector<Message>& m) { return counter ? counter(m) : approx_prompt_tokens(m); };
  const std::string word = r.pick(kRuleWords);
  std::string rule_text;
  switch (style) {
    case Style::kUppercase:
      rule_text = "When I say goodbye, reply in uppercase.";
      break;
    case Style::kEndsWith:
      rule_text = "When I say goodbye, end your reply with the word " + word + ".";
      break;
    case Style::kStartsWith:
      rule_text = "When I say goodbye, start your reply with the word " + word + ".";
      break;
  }
  std::vector<size_t> order(kQuestions.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  for (size_t i = order.size() - 1; i > 0; --i) std::swap(order[i], order[r.below(i + 1)]);
  auto pool = filler_pool(r, static_cast<size_t>(target / 4 + 8));
  auto build_with = [&](int n_turns, size_t k) {
    Body b;
    const std::string first = std::string("Hello! ") + rule_text;
    b.messages = {{"system", kSystem}, {"user", first}, {"assistant", kRuleAck}};
    b.span = {1, 7, static_cast<int64_t>(first.size())};
    for (int j = 0; j < n_turns; ++j) {
      std::string chatter;
      for (size_t i = static_cast<size_t>(j); i < k; i += static_cast<size_t>(n_turns)) {
        chatter += pool[i] + " ";
      }
      const QA& qa = kQuestions[order[static_cast<size_t>(j) % order.size()]];
      b.messages.push_back({"user", chatter + qa.q});
      b.messages.push_back({"assistant", qa.a});
    }
    b.messages.push_back({"user", kGoodbye});
    b.question = {static_cast<int64_t>(b.messages.size()) - 1, 0, static_cast<int64_t>(std::string(kGoodbye).size())};
    return b;
  };
  while (turns > 1 && prompt_tokens(build_with(turns, 0).messages) > target) --turns;
  Body b = fill_to([&](size_t k) { return build_with(turns, k); }, pool.size(), target, counter);
  Task t;
  t.family = TaskFamily::kMultiTurn;
  t.context_target = target;
  t.messages = std::move(b.messages);
  t.span = b.span;
  t.question = b.question;
  t.answer = styled(kGoodbyeReply, style, word);
  t.rule = style_rule(style, word);
  return t;
}

Task make_instruction(Rng& r, Style style, int64_t target, const PromptTokenCounter& counter) {
  const std::string word = r.pick(kRuleWords);
  std::string instr;
  switch (style) {
    case Style::kUppercase:
      instr = "Always reply in uppercase.";
      break;
    case Style::kEndsWith:
      instr = "Always end your reply with the word " + word + ".";
      break;
    case Style::kStartsWith:
      instr = "Always start your reply with the word " + word + ".";
      break;
  }
  const QA& qa = r.pick(kQuestions);
  auto pool = filler_pool(r, static_cast<size_t>(target / 4 + 8));
  const std::string system = std::string(kSystem) + " " + instr;
  auto build = [&](size_t k) {
    Body b;
    std::string user = k == 0 ? std::string() : std::string(kNoteIntro) + "\n\n" + join(pool, 0, k) + "\n\n";
    b.question = {1, static_cast<int64_t>(user.size()), static_cast<int64_t>(user.size() + 10 + std::string(qa.q).size())};
    user += std::string("Question: ") + qa.q;
    b.messages = {{"system", system}, {"user", user}};
    b.span = {0, static_cast<int64_t>(std::string(kSystem).size() + 1), static_cast<int64_t>(system.size())};
    return b;
  };
  Body b = fill_to(build, pool.size(), target, counter);
  Task t;
  t.family = TaskFamily::kInstruction;
  t.context_target = target;
  t.messages = std::move(b.messages);
  t.span = b.span;
  t.question = b.question;
  t.answer = styled(qa.a, style, word);
  t.rule = style_rule(style, word);
  return t;
}

Task make_summary(Rng& r, int detail, int64_t target, const PromptTokenCounter& counter) {
  const std::string name = r.pick(kNames);
  const std::string role = r.pick(kRoles);
  const std::string colour = r.pick(kColours);
  const std::string count = std::to_string(r.range(2, 12));
  const std::string animals = r.pick(kAnimals);
  const std::string first = "Once upon a time, a " + role + " named " + name + " lived in a " +
                            colour + " house with " + count + " " + animals + ".";
  auto pool = filler_pool(r, static_cast<size_t>(target / 4 + 8));
  auto build = [&](size_t k) {
    Body b;
    std::string user = std::string(kStoryIntro) + "\n\n";
    b.span = {1, static_cast<int64_t>(user.size()), static_cast<int64_t>(user.size() + first.size())};
    user += first + " " + join(pool, 0, k) + (k ? " " : "") + "The end.";
    b.messages = {{"system", kSystem}, {"user", user}};
    return b;
  };
  Body b = fill_to(build, pool.size(), target, counter);
  Task t;
  t.family = TaskFamily::kSummary;
  t.context_target = target;
  t.messages = std::move(b.messages);
  t.span = b.span;
  t.question = b.question;
  t.answer = name + " the " + role + " lived in a " + colour + " house with " + count + " " + animals + ".";
  const std::string key = detail == 0 ? name : detail == 1 ? colour : count;
  t.rule = {RuleKind::kWord, key};
  return t;
}

std::vector<TaskFamily> check_training_request(int64_t count, int64_t min_context, int64_t max_context,
                                               const std::vector<TaskFamily>& requested,
                                               const std::vector<TaskFamily>& allowed, const std::string& not_allowed) {
  KV_CHECK_ARG(count >= 0 && count <= kMaxTrainingTasks, "training task count ", count, " is out of range [0, ",
               kMaxTrainingTasks, "]");
  KV_CHECK_ARG(min_context >= 48 && min_context <= kMaxTrainingContext, "min_context ", min_context,
               " is out of range [48, ", kMaxTrainingContext, "] approximate tokens");
  KV_CHECK_ARG(max_context >= min_context && max_context <= kMaxTrainingContext, "max_context ", max_context,
               " is out of range [min_context = ", min_context, ", ", kMaxTrainingContext, "] approximate tokens");
  for (TaskFamily f : requested) {
    KV_CHECK_ARG(std::find(allowed.begin(), allowed.end(), f) != allowed.end(), "training family '", to_string(f),
                 "' ", not_allowed);
  }
  return requested.empty() ? allowed : requested;
}

}  // namespace kvcache::study::grammar
