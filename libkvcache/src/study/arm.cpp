// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/arm.h"

#include <algorithm>
#include <fstream>
#include <set>
#include <sys/stat.h>

#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/registry.h"
#include "kvcache/spec.h"

namespace kvcache::study {
namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

bool is_policy_head(const std::string& spec) { return spec_kind(spec) == SpecKind::kPolicy; }

bool is_regular_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

Arm control_arm() { return Arm{"fp32", "full"}; }

Arm parse_arm(const std::string& text) {
  const std::string t = trim(text);
  KV_CHECK_ARG(!t.empty(), "empty arm spec (expected scheme+policy, e.g. 'int4+h2o@50%')");
  const auto plus = t.find('+');
  if (plus == std::string::npos) {
    if (t.find('@') != std::string::npos || is_policy_head(t)) return Arm{"fp32", t};
    return Arm{t, "full"};
  }
  KV_CHECK_ARG(t.find('+', plus + 1) == std::string::npos, "arm '", t,
               "' has more than one '+' (expected scheme+policy, e.g. 'int4+h2o@50%')");
  Arm a{trim(t.substr(0, plus)), trim(t.substr(plus + 1))};
  KV_CHECK_ARG(!a.scheme.empty() && !a.policy.empty(), "arm '", t,
               "' has an empty side (expected scheme+policy, e.g. 'int4+h2o@50%')");
  return a;
}

std::vector<Arm> default_arms() {
  return {
      {"fp32", "full"},           {"fp16", "full"},          {"fp8:e4m3", "full"},
      {"int8", "full"},           {"int4", "full"},          {"int2", "full"},
      {"fp32", "window@50%"},     {"fp32", "sink@50%"},      {"fp32", "h2o@50%"},
      {"fp32", "random@50%"},     {"int8", "sink@50%"},      {"int4", "h2o@50%"},
      {"bf16", "full"},           {"fp8:e5m2", "full"},      {"kivi:k2:v2:g32:r128", "full"},
      {"kivi:k4:v4:g32:r128", "full"}, {"fp32", "snapkv@50%"}, {"fp32", "tova@50%"},
      // The 2024-2026 eviction methods (docs/policies.md), at the same 50% budget on fp32.
      {"fp32", "keydiff@50%"},    {"fp32", "knorm@50%"},     {"fp32", "expected@50%"},
      {"fp32", "adakv:expected@50%"}, {"fp32", "adakv:snapkv@50%"}, {"fp32", "duo:s16:r48@50%"},
      {"fp32", "decode:i8:b4:expected@50%"}, {"fp32", "kvzip@50%"},
  };
}

std::vector<ArmSet> arm_sets() {
  return {
      {"default", "the 26 default arms of the study (README's table)", default_arms()},
      {"evict2026",
       "the 2024-2026 eviction methods at a 50% budget beside the control and SnapKV/H2O/TOVA: Knorm, KeyDiff and "
       "Expected Attention once at the prompt's end and streaming, AdaKV head-wise budgets over Expected Attention / "
       "SnapKV / H2O / Knorm, DuoAttention (heads identified on the fly), decode-time compression, KVzip (context replay; its extra prefill in "
       "'replay prefill s') (docs/policies.md)",
       {
           {"fp32", "full"},
           {"fp32", "snapkv@50%"},
           {"fp32", "h2o@50%"},
           {"fp32", "tova@50%"},
           {"fp32", "knorm@50%"},
           {"fp32", "knorm:stream@50%"},
           {"fp32", "keydiff@50%"},
           {"fp32", "keydiff:stream@50%"},
           {"fp32", "expected@50%"},
           {"fp32", "expected:stream@50%"},
           {"fp32", "adakv:expected@50%"},
           {"fp32", "adakv:snapkv@50%"},
           {"fp32", "adakv:h2o@50%"},
           {"fp32", "adakv:knorm@50%"},
           {"fp32", "duo:s16:r48@50%"},
           {"fp32", "decode:i8:b4:expected@50%"},
           {"fp32", "decode:i8:b4:prefill:expected@50%"},
           {"fp32", "kvzip@50%"},
       }},
      {"deepdive",
       "the quantization deep-dive, all with full: the control, int8 and fp8 (e4m3), KIVI-2/4, GEAR-2 (the "
       "published settings, groups of 32 for head_dim 32), int4/int2 per token with and without the Hadamard "
       "rotation, int3, KVQuant-4/3/2 without and with 1% outliers calibrated on the run's model (cal=auto; docs/study.md)",
       {
           {"fp32", "full"},
           {"int8", "full"},
           {"fp8:e4m3", "full"},
           {"kivi:k4:v4:g32:r128", "full"},
           {"kivi:k2:v2:g32:r128", "full"},
           {"gear:b2:g32:s0.02:r2:loop3:nb64", "full"},
           {"int4", "full"},
           {"had(int4)", "full"},
           {"int2", "full"},
           {"had(int2)", "full"},
           {"int3", "full"},
           // KVQuant-4/3/2 without and with 1% outliers (4 key outlier slots per token; Q-Norm at
           // 2 bits, as the paper runs it), calibrated on the run's own model: kv_study run
           // replaces cal=auto by DIR/calibration/<model>.kvqcal, fitted once per directory.
           {"kvquant:b4:cal=auto", "full"},
           {"kvquant:b4:o1:c4:cal=auto", "full"},
           {"kvquant:b3:cal=auto", "full"},
           {"kvquant:b3:o1:c4:cal=auto", "full"},
           {"kvquant:b2:qnorm:cal=auto", "full"},
           {"kvquant:b2:o1:c4:qnorm:cal=auto", "full"},
       }},
      {"long",
       "the long suite's default arms (kv_study run --suite long), 15: the control; fp8, int8, int4, int2, KIVI-2/4 "
       "and had(int2) with full; a fixed budget of 2048 tokens (what engines configure; 50% of a 4k prompt, 12.5% of 16k) "
       "for window, StreamingLLM sinks, H2O, SnapKV and KeyDiff; SnapKV at 25%; int4 with SnapKV at 2048 (composition) "
       "(docs/study.md, \"The long suite\")",
       {
           {"fp32", "full"},
           {"fp8:e4m3", "full"},
           {"int8", "full"},
           {"int4", "full"},
           {"int2", "full"},
           {"kivi:k4:v4:g32:r128", "full"},
           {"kivi:k2:v2:g32:r128", "full"},
           {"had(int2)", "full"},
           {"fp32", "window@2048"},
           {"fp32", "sink@2048"},
           {"fp32", "h2o@2048"},
           {"fp32", "snapkv@2048"},
           {"fp32", "keydiff@2048"},
           {"fp32", "snapkv@25%"},
           {"int4", "snapkv@2048"},
       }},
      {"rotation2025",
       "the 2025 rotation-and-codebook quantizers beside KIVI, KVQuant (cal=auto), per-channel int and had(int), all "
       "with full, by nominal bits 4 / 3.5 / 3 / 2.5: TurboQuant-MSE (tq, with and without vLLM's nc), TurboQuant "
       "with Prod keys (turboquant), PolarQuant (3.875), QJL (keys m64 / m32 bits at head_dim 32, outliers o2, "
       "values int2, window r32) (docs/study.md, \"The 2025 rotation-and-codebook quantizers\")",
       {
           {"fp32", "full"},
           {"tq:b4", "full"},
           {"tq:b4:nc", "full"},
           {"turboquant:k4:v4", "full"},
           {"kivi:k4:v4:g32:r128", "full"},
           {"int4:g32:chan", "full"},
           {"had(int4)", "full"},
           {"kvquant:b4:cal=auto", "full"},
           {"tq:b3.5", "full"},
           {"tq:b3.5:nc", "full"},
           {"turboquant:k3.5:v3.5", "full"},
           {"polar", "full"},
           {"tq:b3", "full"},
           {"tq:b3:nc", "full"},
           {"turboquant:k3:v3", "full"},
           {"kivi:k3:v3:g32:r128", "full"},
           {"int3:g32:chan", "full"},
           {"had(int3)", "full"},
           {"kvquant:b3:cal=auto", "full"},
           {"qjl:m64:o2:g32:v2:r32:mo8", "full"},
           {"tq:b2.5", "full"},
           {"tq:b2.5:nc", "full"},
           {"turboquant:k2.5:v2.5", "full"},
           {"qjl:m32:o2:g32:v2:r32:mo8", "full"},
           {"kivi:k2:v2:g32:r128", "full"},
           {"int2:g32:chan", "full"},
           {"had(int2)", "full"},
           {"kvquant:b2:qnorm:cal=auto", "full"},
       }},
  };
}

std::vector<Arm> parse_arm_list(const std::string& text) {
  std::vector<Arm> arms;
  if (!is_regular_file(text)) {
    for (const auto& set : arm_sets()) {
      if (set.name == trim(text)) return set.arms;
    }
  }
  if (is_regular_file(text)) {
    std::ifstream in(text);
    KV_CHECK_ARG(in.good(), "cannot read configs file '", text, "'");
    std::string line;
    int lineno = 0;
    while (std::getline(in, line)) {
      ++lineno;
      const auto hash = line.find('#');
      if (hash != std::string::npos) line.resize(hash);
      if (trim(line).empty()) continue;
      try {
        arms.push_back(parse_arm(line));
      } catch (const InvalidArgument& e) {
        throw InvalidArgument(detail::str_cat(text, ":", lineno, ": ", e.what()));
      }
    }
  } else {
    size_t start = 0;
    while (start <= text.size()) {
      const auto comma = text.find(',', start);
      const std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (!trim(item).empty()) arms.push_back(parse_arm(item));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  KV_CHECK_ARG(!arms.empty(), "--configs '", text, "' lists no arm (expected e.g. 'fp32+full,int4+h2o@50%' or a file)");
  // One bare word that is no known scheme is more likely a mistyped arm set or file name than
  // an arm: say so now, naming the sets (the sweep would later reject it as a scheme only).
  if (arms.size() == 1 && text.find_first_of(",+") == std::string::npos && arms[0].scheme == trim(text)) {
    try {
      (void)make_cache_scheme(arms[0].scheme);
    } catch (const InvalidArgument& e) {
      std::string sets;
      for (const auto& set : arm_sets()) sets += (sets.empty() ? "" : ", ") + set.name;
      throw InvalidArgument(detail::str_cat("--configs '", text, "' is not an arm set (", sets,
                                            "), a file, nor an arm 'scheme+policy': ", e.what()));
    }
  }
  return arms;
}

std::vector<Arm> with_budget(std::vector<Arm> arms, const std::string& budget) {
  std::string b = trim(budget);
  if (!b.empty() && b[0] == '@') b = b.substr(1);
  const Budget parsed = Budget::parse(b);  // validates
  for (auto& a : arms) {
    if (spec_head(a.policy) == "perlayer") continue;  // its runs carry their own budgets
    auto [head, old] = split_budget(a.policy);
    (void)old;
    if (head == "full") continue;
    a.policy = head + parsed.to_string();
  }
  return arms;
}

std::vector<Arm> with_budgets(const std::vector<Arm>& arms, const std::string& budgets) {
  std::vector<std::string> items;  // canonical "@50%"
  size_t start = 0;
  while (start <= budgets.size()) {
    const auto comma = budgets.find(',', start);
    const std::string raw = budgets.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    std::string b = trim(raw);
    KV_CHECK_ARG(!b.empty(), "--budgets '", budgets, "': empty item (expected a comma list such as 25%,50%,75%)");
    if (b[0] == '@') b = b.substr(1);
    std::string canonical;
    try {
      canonical = Budget::parse(b).to_string();
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat("--budgets '", budgets, "': item '", raw, "' is not a budget: ", e.what()));
    }
    KV_CHECK_ARG(std::find(items.begin(), items.end(), canonical) == items.end(), "--budgets '", budgets,
                 "': budget '", raw, "' appears twice");
    items.push_back(canonical);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  std::vector<Arm> out;
  for (const auto& a : arms) {
    const std::string head = split_budget(a.policy).first;
    if (head == "full") {
      out.push_back(a);
      continue;
    }
    for (const auto& b : items) out.push_back({a.scheme, head + b});
  }
  return out;
}

std::vector<Arm> dedupe(const std::vector<Arm>& arms) {
  std::vector<Arm> out;
  std::set<std::string> seen;
  for (const auto& a : arms) {
    if (seen.insert(a.spec()).second) out.push_back(a);
  }
  return out;
}

}  // namespace kvcache::study
