// SPDX-License-Identifier: Apache-2.0
// The three summary writers: Markdown, JSON and CSV, each driven by the column table
// (report_columns.cpp) for the per-arm numbers.
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <sstream>
#include <tuple>

#include "common/file_io.h"
#include "kvcache/error.h"
#include "kvcache/study/report.h"
#include "kvcache/study/report_columns.h"
#include "study/report_format.h"

namespace kvcache::study {
namespace {

using report_format::fmt;
using report_format::kNaN;
using report_format::pct;

// ---- cells ---------------------------------------------------------------------------------

std::string md_value(const ArmColumn& c, double v) {
  switch (c.format) {
    case Format::kPercent:
      return pct(v);
    case Format::kInt:
      return fmt(v, "%.0f");
    case Format::kBool:
      return std::isfinite(v) ? (v != 0 ? "yes" : "no") : "–";
    case Format::kFixed: {
      char f[16];
      std::snprintf(f, sizeof f, "%%.%df", c.decimals);
      return fmt(v, f);
    }
    case Format::kText:
      break;
  }
  return "–";
}

/// `text` as literal Markdown inline text: the characters that would start emphasis or code,
/// or end a table cell, are backslash-escaped (a per-layer arm `layers(int8*2;int4*2)+full`
/// would otherwise print `int8` in italics). Arm names without them print unchanged.
std::string md_text(const std::string& text) {
  if (text.find_first_of("\\*_`|<[]") == std::string::npos) return text;
  std::string out;
  for (char ch : text) {
    if (ch != 0 && std::strchr("\\*_`|<[]", ch) != nullptr) out += '\\';
    out += ch;
  }
  return out;
}

std::string md_cell(const ArmColumn& c, const ArmSummary& a, const Summary& s) {
  if (c.format == Format::kText) return md_text(column_text(c, a));
  if (c.md_cell != nullptr) return c.md_cell(a, s);
  return md_value(c, column_value(c, a, s));
}

std::string csv_cell(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string csv_num(double v) {
  if (!std::isfinite(v)) return "";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

nlohmann::ordered_json jnum(double v) { return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(); }

// ---- Markdown tables of per-arm columns ---------------------------------------------------

struct MdColumn {
  const char* key;
  const char* header;  ///< nullptr: the column's md_header
};
struct MdTable {
  const char* title;
  const char* intro;  ///< paragraph under the title, or ""
  std::vector<MdColumn> columns;
};

/// The per-arm Markdown tables, before and after the per-family / per-depth ones.
const std::vector<MdTable>& md_tables_head() {
  static const std::vector<MdTable> t = {
      {"Accuracy and KV memory per arm", "",
       {{"arm", nullptr}, {"passed", nullptr}, {"accuracy", nullptr}, {"delta_pp", nullptr},
        {"peak_kib_mean", nullptr}, {"memory_ratio", nullptr}, {"tokens_written_mean", nullptr},
        {"tokens_resident_mean", nullptr}, {"errors", nullptr}}},
      {"KV memory: stored, reserved, real",
       "Mean over tasks of the peak stored bytes (bytes_resident_peak), the peak bytes of the blocks the cache "
       "held (bytes_reserved_peak), and the peak growth of the process's resident set during the task (the cache "
       "plus the request's other allocations).",
       {{"arm", nullptr}, {"peak_kib_mean", "stored peak KiB"}, {"reserved_kib_mean", nullptr},
        {"rss_growth_kib_mean", nullptr}, {"reserved_per_stored", nullptr}}},
  };
  return t;
}
const MdTable& md_table_text() {
  static const MdTable t = {"Perplexity and next-token agreement vs control", "",
                            {{"arm", nullptr}, {"accuracy", nullptr}, {"ppl_single", nullptr}, {"ppl_stream", nullptr},
                             {"kld_mean", nullptr}, {"kld_median", nullptr}, {"kld_p99", nullptr},
                             {"kld_p999", nullptr}, {"kld_max", nullptr}, {"top1", nullptr}}};
  return t;
}
const MdTable& md_table_speed() {
  static const MdTable t = {"Speed",
                            "replay prefill s: mean seconds per task of the context replay (KVzip's extra prefill, "
                            "0 for the other policies), not in prefill tok/s nor time.",
                            {{"arm", nullptr}, {"prefill_tps", nullptr}, {"decode_tps", nullptr},
                             {"replay_s_mean", nullptr}, {"total_seconds", nullptr}}};
  return t;
}

void write_md_table(std::ostream& os, const MdTable& t, const Summary& s, const std::string& prefix = "") {
  os << "\n## " << prefix << t.title << "\n\n";
  if (*t.intro) os << t.intro << "\n\n";
  std::vector<const ArmColumn*> cols;
  os << "|";
  for (const auto& mc : t.columns) {
    cols.push_back(&arm_column(mc.key));
    os << " " << (mc.header != nullptr ? mc.header : cols.back()->md_header) << " |";
  }
  os << "\n|";
  for (const ArmColumn* c : cols) os << (c->format == Format::kText ? "---|" : "---:|");
  os << "\n";
  for (const auto& a : s.arms) {
    os << "|";
    for (const ArmColumn* c : cols) os << " " << md_cell(*c, a, s) << " |";
    os << "\n";
  }
}

/// A table of one expanding column: one Markdown column per family / depth.
template <typename K>
void write_md_keyed(std::ostream& os, const char* title, const std::vector<K>& keys,
                    const std::map<K, double> ArmSummary::*values, std::string (*label)(const K&), const Summary& s,
                    const std::string& prefix = "") {
  os << "\n## " << prefix << title << "\n\n| arm |";
  for (const auto& k : keys) os << " " << label(k) << " |";
  os << "\n|---|";
  for (size_t i = 0; i < keys.size(); ++i) os << "---:|";
  os << "\n";
  for (const auto& a : s.arms) {
    os << "| " << md_text(a.arm) << " |";
    for (const auto& k : keys) {
      auto it = (a.*values).find(k);
      os << " " << (it == (a.*values).end() ? "–" : pct(it->second)) << " |";
    }
    os << "\n";
  }
}

/// The ratio sweep's tables: accuracy per method × budget, then per family and per depth.
void write_md_curves(std::ostream& os, const Summary& s, const std::string& prefix = "") {
  if (s.curves.empty()) return;
  // Every budget of any curve, percentages first, each kind ascending.
  std::vector<std::tuple<bool, double, std::string>> cols;
  for (const auto& c : s.curves) {
    for (size_t i = 0; i < c.budgets.size(); ++i) {
      const auto col = std::make_tuple(c.budgets[i].back() != '%', c.budget_values[i], c.budgets[i]);
      if (std::find(cols.begin(), cols.end(), col) == cols.end()) cols.push_back(col);
    }
  }
  std::sort(cols.begin(), cols.end());
  auto cells = [&](const BudgetCurve& c, const std::vector<double>& v) {
    std::string out;
    for (const auto& col : cols) {
      const auto it = std::find(c.budgets.begin(), c.budgets.end(), std::get<2>(col));
      out += " " + (it == c.budgets.end() ? std::string("–") : pct(v[static_cast<size_t>(it - c.budgets.begin())])) + " |";
    }
    return out;
  };
  auto head = [&](std::ostream& o, const char* first) {
    o << "| " << first << " |";
    for (const auto& col : cols) o << " " << std::get<2>(col).substr(1) << " |";
  };
  auto rule = [&](std::ostream& o, int text_cols) {
    o << "|";
    for (int i = 0; i < text_cols; ++i) o << "---|";
    for (size_t i = 0; i < cols.size(); ++i) o << "---:|";
  };
  os << "\n## " << prefix << "Accuracy vs budget (ratio sweep)\n\n"
        "Each method's accuracy at each swept budget (`--budgets`; a percentage is the share of the request's full "
        "context kept); the last column is its smallest budget within one task of the control.\n\n";
  head(os, "method");
  os << " smallest within one task |\n";
  rule(os, 1);
  os << "---|\n";
  for (const auto& c : s.curves) {
    const int i = c.smallest_within_one_task;
    os << "| " << md_text(c.method) << " |" << cells(c, c.accuracy) << " "
       << (i >= 0 ? c.budgets[static_cast<size_t>(i)].substr(1) : std::string("–")) << " |\n";
  }
  if (!s.families.empty()) {
    os << "\n## " << prefix << "Accuracy vs budget per family\n\n";
    os << "| method | family |";
    for (const auto& col : cols) os << " " << std::get<2>(col).substr(1) << " |";
    os << "\n";
    rule(os, 2);
    os << "\n";
    for (const auto& c : s.curves) {
      for (const auto& f : s.families) {
        os << "| " << md_text(c.method) << " | " << f << " |" << cells(c, c.family_accuracy.at(f)) << "\n";
      }
    }
  }
  if (!s.depths.empty()) {
    os << "\n## " << prefix << "Needle accuracy vs budget per depth\n\n";
    os << "| method | depth |";
    for (const auto& col : cols) os << " " << std::get<2>(col).substr(1) << " |";
    os << "\n";
    rule(os, 2);
    os << "\n";
    for (const auto& c : s.curves) {
      for (int d : s.depths) {
        os << "| " << md_text(c.method) << " | " << d << "% |" << cells(c, c.depth_accuracy.at(d)) << "\n";
      }
    }
  }
}

nlohmann::ordered_json jnums(const std::vector<double>& v) {
  auto out = nlohmann::ordered_json::array();
  for (double x : v) out.push_back(jnum(x));
  return out;
}

std::string family_label(const std::string& f) { return f; }
std::string depth_label(const int& d) { return std::to_string(d) + "%"; }

/// The query-agnostic section: its tables (titles prefixed), then each arm's accuracy in both
/// modes side by side.
void write_md_agnostic(std::ostream& os, const Summary& s) {
  if (!s.agnostic) return;
  const Summary& g = *s.agnostic;
  const std::string prefix = "Query-agnostic: ";
  os << "\n## Query-agnostic mode\n\n"
        "The tables above are query-aware (the question is in the prompt when the cache is compressed). Below, the "
        "query-agnostic rows (`kv_study run --query-mode agnostic|both`): the context is prefilled and compressed "
        "before the question is appended, and the question follows as decode steps that do not re-run the "
        "prompt-end compression (docs/study.md, \"Query modes\"). Tasks with no question after their context (the "
        "summary family) run as query-aware in this mode.\n";
  write_md_table(os, md_tables_head()[0], g, prefix);
  write_md_keyed<std::string>(os, "Accuracy per family", g.families, &ArmSummary::family_accuracy, family_label, g,
                              prefix);
  if (!g.depths.empty()) {
    write_md_keyed<int>(os, "Needle accuracy by depth", g.depths, &ArmSummary::depth_accuracy, depth_label, g, prefix);
  }
  write_md_curves(os, g, prefix);
  os << "\n## Query-aware vs query-agnostic accuracy\n\n| arm | aware | agnostic | agnostic − aware |\n|---|---:|---:|---:|\n";
  for (const auto& a : g.arms) {
    const ArmSummary* aware = nullptr;
    for (const auto& b : s.arms) {
      if (b.arm == a.arm) aware = &b;
    }
    const bool same_tasks = aware != nullptr && aware->tasks == a.tasks;
    os << "| " << md_text(a.arm) << " | " << (aware ? pct(aware->accuracy) : "–") << " | " << pct(a.accuracy) << " | "
       << (same_tasks ? fmt((a.accuracy - aware->accuracy) * 100.0, "%+.1f") + " pp (" +
                            fmt(static_cast<double>(a.passed - aware->passed), "%+.0f") + ")"
                      : std::string("–"))
       << " |\n";
  }
  if (!g.notes.empty()) {
    os << "\n## Query-agnostic: notes\n\n";
    for (const auto& n : g.notes) os << "- " << n << "\n";
  }
}

/// Accuracy, memory and speed per prompt length (the long suite's join of quality and cost), the
/// needle depth × length grid and each length's accuracy-vs-memory front. Only with two or more
/// lengths.
void write_md_lengths(std::ostream& os, const Summary& s) {
  if (s.lengths.size() < 2) return;
  const auto cell = [](const ArmSummary& a, int64_t len) -> const LengthSummary* {
    const auto it = a.by_length.find(len);
    return it == a.by_length.end() ? nullptr : &it->second;
  };
  os << "\n## Accuracy by prompt length\n\nPer arm and prompt length (tokens of the model's tokenizer): accuracy, "
        "and in brackets the peak KV memory against the control's at that length.\n\n| arm |";
  for (int64_t len : s.lengths) os << " " << len << " |";
  os << "\n|---|";
  for (size_t i = 0; i < s.lengths.size(); ++i) os << "---:|";
  os << "\n";
  for (const auto& a : s.arms) {
    os << "| " << md_text(a.arm) << " |";
    for (int64_t len : s.lengths) {
      const LengthSummary* l = cell(a, len);
      os << " " << (l == nullptr ? std::string("–")
                                 : pct(l->accuracy) + " (" + fmt(l->memory_ratio, "%.2f") + "×)")
         << " |";
    }
    os << "\n";
  }
  os << "\n## Memory and speed by prompt length\n\nMean per task: peak stored KV (KiB), peak reserved blocks (KiB), "
        "peak growth of the process's resident set (KiB), prefill tokens/s, decode ms/token.\n\n"
        "| arm | length | tasks | accuracy | peak KV KiB | reserved KiB | RSS growth KiB | prefill tok/s | decode ms/token |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& a : s.arms) {
    for (int64_t len : s.lengths) {
      const LengthSummary* l = cell(a, len);
      if (l == nullptr) continue;
      os << "| " << md_text(a.arm) << " | " << len << " | " << l->tasks << " | " << pct(l->accuracy) << " | "
         << fmt(l->peak_kib_mean, "%.0f") << " | " << fmt(l->reserved_kib_mean, "%.0f") << " | "
         << fmt(l->rss_growth_kib_mean, "%.0f") << " | " << fmt(l->prefill_tps, "%.0f") << " | "
         << fmt(l->decode_ms_per_token, "%.2f") << " |\n";
    }
  }
  if (!s.depths.empty()) {
    os << "\n## Needle accuracy by depth and length\n\n| arm | length |";
    for (int d : s.depths) os << " " << d << "% |";
    os << "\n|---|---:|";
    for (size_t i = 0; i < s.depths.size(); ++i) os << "---:|";
    os << "\n";
    for (const auto& a : s.arms) {
      for (int64_t len : s.lengths) {
        const LengthSummary* l = cell(a, len);
        if (l == nullptr || l->depth_accuracy.empty()) continue;
        os << "| " << md_text(a.arm) << " | " << len << " |";
        for (int d : s.depths) {
          const auto it = l->depth_accuracy.find(d);
          os << " " << (it == l->depth_accuracy.end() ? std::string("–") : pct(it->second)) << " |";
        }
        os << "\n";
      }
    }
  }
  os << "\n## Accuracy-vs-memory front by prompt length\n\nThe arms no other arm beats on both accuracy and peak KV "
        "memory at that length (ascending memory).\n\n| length | front |\n|---:|---|\n";
  for (int64_t len : s.lengths) {
    std::vector<std::pair<double, std::string>> front;
    for (const auto& a : s.arms) {
      const LengthSummary* l = cell(a, len);
      if (l != nullptr && l->pareto) {
        front.emplace_back(l->peak_kib_mean, "`" + a.arm + "` " + pct(l->accuracy) + " at " + fmt(l->memory_ratio, "%.2f") + "×");
      }
    }
    std::sort(front.begin(), front.end());
    std::string list;
    for (const auto& [m, t] : front) list += (list.empty() ? "" : ", ") + t;
    os << "| " << len << " | " << (list.empty() ? "–" : list) << " |\n";
  }
}

nlohmann::ordered_json lengths_json(const ArmSummary& a) {
  using oj = nlohmann::ordered_json;
  oj out = oj::object();
  for (const auto& [len, l] : a.by_length) {
    oj fam = oj::object();
    for (const auto& [f, v] : l.family_accuracy) fam[f] = jnum(v);
    oj dep = oj::object();
    for (const auto& [d, v] : l.depth_accuracy) dep[std::to_string(d)] = jnum(v);
    out[std::to_string(len)] = oj{{"tasks", l.tasks},
                                  {"passed", l.passed},
                                  {"accuracy", jnum(l.accuracy)},
                                  {"peak_kib_mean", jnum(l.peak_kib_mean)},
                                  {"memory_ratio", jnum(l.memory_ratio)},
                                  {"reserved_kib_mean", jnum(l.reserved_kib_mean)},
                                  {"rss_growth_kib_mean", jnum(l.rss_growth_kib_mean)},
                                  {"prefill_tps", jnum(l.prefill_tps)},
                                  {"decode_ms_per_token", jnum(l.decode_ms_per_token)},
                                  {"pareto", l.pareto},
                                  {"family_accuracy", fam},
                                  {"depth_accuracy", dep}};
  }
  return out;
}

nlohmann::ordered_json arm_json(const ArmSummary& a, const Summary& s) {
  using oj = nlohmann::ordered_json;
  oj x = oj::object();
  for (const auto& c : arm_columns()) {
    if (!c.in_files) continue;
    switch (c.aggregation) {
      case Aggregation::kPerFamily: {
        oj fam = oj::object();
        for (const auto& [f, v] : a.family_accuracy) fam[f] = v;
        x[c.key] = fam;
        continue;
      }
      case Aggregation::kPerDepth: {
        oj dep = oj::object();
        for (const auto& [d, v] : a.depth_accuracy) dep[std::to_string(d)] = v;
        x[c.key] = dep;
        continue;
      }
      default:
        break;
    }
    if (c.format == Format::kText) {
      x[c.key] = column_text(c, a);
      continue;
    }
    const double v = column_value(c, a, s);
    if (c.format == Format::kBool) {
      x[c.key] = std::isfinite(v) ? oj(v != 0) : oj();
    } else if (c.format == Format::kInt) {
      x[c.key] = std::isfinite(v) ? oj(static_cast<int64_t>(std::llround(v))) : oj();
    } else {
      x[c.key] = jnum(v);
    }
  }
  if (s.lengths.size() >= 2) x["by_length"] = lengths_json(a);
  return x;
}

nlohmann::ordered_json curves_json(const Summary& s) {
  using oj = nlohmann::ordered_json;
  oj curves = oj::array();
  for (const auto& c : s.curves) {
    oj fam = oj::object();
    for (const auto& [f, v] : c.family_accuracy) fam[f] = jnums(v);
    oj dep = oj::object();
    for (const auto& [d, v] : c.depth_accuracy) dep[std::to_string(d)] = jnums(v);
    const int i = c.smallest_within_one_task;
    curves.push_back(oj{{"method", c.method},
                        {"budgets", c.budgets},
                        {"budget_values", c.budget_values},
                        {"arms", c.arms},
                        {"accuracy", jnums(c.accuracy)},
                        {"family_accuracy", fam},
                        {"depth_accuracy", dep},
                        {"smallest_within_one_task", i >= 0 ? oj(c.budgets[static_cast<size_t>(i)]) : oj()}});
  }
  return curves;
}

}  // namespace

std::string summary_markdown(const Summary& s) {
  std::ostringstream os;
  os << "# kv_study summary\n\nModel: `" << s.model << "`. Control arm: `" << s.control << "`.";
  if (!s.arms.empty()) os << " Arms: " << s.arms.size() << ".";
  os << "\n";
  for (const auto& t : md_tables_head()) write_md_table(os, t, s);
  write_md_keyed<std::string>(os, "Accuracy per family", s.families, &ArmSummary::family_accuracy, family_label, s);
  if (!s.depths.empty()) {
    write_md_keyed<int>(os, "Needle accuracy by depth", s.depths, &ArmSummary::depth_accuracy, depth_label, s);
  }
  write_md_lengths(os, s);
  write_md_table(os, md_table_text(), s);
  write_md_curves(os, s);

  if (!s.reconstruction.empty()) {
    os << "\n## Quantizer reconstruction error (K/V captured from the model)\n\n";
    os << "Attention error: causal attention of the captured queries over the scheme's reconstructed K/V "
          "against the exact ones (relative Frobenius error of the output and of the probabilities).\n\n";
    os << "| quantizer | bits/value | key rel. error | value rel. error | attention output error | attention probs "
          "error |\n|---|---:|---:|---:|---:|---:|\n";
    for (const auto& q : s.reconstruction) {
      if (!q.error.empty()) {
        os << "| " << md_text(q.quant) << " | – | – | – | – | – (" << q.error << ") |\n";
      } else {
        os << "| " << md_text(q.quant) << " | " << fmt(q.bits_per_value, "%.2f") << " | " << fmt(q.key_rel_err, "%.4f")
           << " | " << fmt(q.value_rel_err, "%.4f") << " | " << fmt(q.attn_out_rel_err, "%.4f") << " | "
           << fmt(q.attn_prob_rel_err, "%.4f") << " |\n";
      }
    }
  }

  if (!s.attention.empty()) {
    os << "\n## Attention error by K/V quantization granularity (relative Frobenius error)\n\n| scheme |";
    for (int b : s.attention_bits) os << " " << b << "-bit output | " << b << "-bit probs |";
    os << "\n|---|";
    for (size_t i = 0; i < s.attention_bits.size(); ++i) os << "---:|---:|";
    os << "\n";
    for (const auto& a : s.attention) {
      os << "| " << a.description << " |";
      for (int b : s.attention_bits) {
        auto o = a.out_rel_err.find(b);
        auto p = a.prob_rel_err.find(b);
        os << " " << (o == a.out_rel_err.end() ? "–" : fmt(o->second, "%.4f")) << " | "
           << (p == a.prob_rel_err.end() ? "–" : fmt(p->second, "%.4f")) << " |";
      }
      os << "\n";
    }
  }

  write_md_table(os, md_table_speed(), s);
  write_md_agnostic(os, s);

  os << "\n## Recommendations\n\nGenerated from the rows above by fixed rules (docs/study.md); never edited by hand.\n\n";
  os << "| rule | arm | evidence |\n|---|---|---|\n";
  for (const auto& r : s.recommendations) {
    os << "| " << r.rule << " | " << (r.arm.empty() ? "–" : "`" + r.arm + "`") << " | " << r.evidence << " |\n";
  }
  if (!s.notes.empty()) {
    os << "\n## Notes\n\n";
    for (const auto& n : s.notes) os << "- " << n << "\n";
  }
  return os.str();
}

std::string summary_json(const Summary& s) {
  using oj = nlohmann::ordered_json;
  oj j;
  j["model"] = s.model;
  j["control"] = s.control;
  j["has_control"] = s.has_control;
  j["families"] = s.families;
  j["depths"] = s.depths;
  j["lengths"] = s.lengths;
  oj arms = oj::array();
  for (const auto& a : s.arms) arms.push_back(arm_json(a, s));
  j["arms"] = arms;
  oj rec = oj::array();
  for (const auto& q : s.reconstruction) {
    rec.push_back(oj{{"quant", q.quant}, {"bits_per_value", jnum(q.bits_per_value)}, {"key_rel_err", jnum(q.key_rel_err)},
                     {"value_rel_err", jnum(q.value_rel_err)}, {"attn_out_rel_err", jnum(q.attn_out_rel_err)},
                     {"attn_prob_rel_err", jnum(q.attn_prob_rel_err)}, {"error", q.error}});
  }
  j["reconstruction"] = rec;
  oj att = oj::array();
  for (const auto& a : s.attention) {
    oj bits = oj::object();
    for (const auto& [b, v] : a.out_rel_err) {
      auto p = a.prob_rel_err.find(b);
      bits[std::to_string(b)] = oj{{"out_rel_err", jnum(v)}, {"prob_rel_err", jnum(p == a.prob_rel_err.end() ? kNaN : p->second)}};
    }
    att.push_back(oj{{"scheme", a.scheme}, {"description", a.description}, {"bits", bits}});
  }
  j["attention"] = att;
  j["curves"] = curves_json(s);
  oj recs = oj::array();
  for (const auto& r : s.recommendations) {
    recs.push_back(oj{{"rule", r.rule}, {"arm", r.arm.empty() ? oj() : oj(r.arm)}, {"evidence", r.evidence}});
  }
  j["recommendations"] = recs;
  j["notes"] = s.notes;
  if (s.agnostic) {
    const Summary& g = *s.agnostic;
    oj ga = oj::array();
    for (const auto& a : g.arms) ga.push_back(arm_json(a, g));
    j["agnostic"] = oj{{"control", g.control}, {"has_control", g.has_control}, {"families", g.families},
                       {"depths", g.depths}, {"arms", ga}, {"curves", curves_json(g)}, {"notes", g.notes}};
  }
  return j.dump(2) + "\n";
}

std::string summary_csv(const Summary& s) {
  std::ostringstream os;
  bool first = true;
  for (const auto& c : arm_columns()) {
    if (!c.in_files) continue;
    if (c.aggregation == Aggregation::kPerFamily) {
      for (const auto& f : s.families) os << ",acc_" << f;
    } else if (c.aggregation == Aggregation::kPerDepth) {
      for (int d : s.depths) os << ",needle_d" << d;
    } else {
      os << (first ? "" : ",") << c.key;
    }
    first = false;
  }
  os << "\n";
  std::vector<std::pair<const ArmSummary*, const Summary*>> lines;
  for (const auto& a : s.arms) lines.emplace_back(&a, &s);
  if (s.agnostic) {
    for (const auto& a : s.agnostic->arms) lines.emplace_back(&a, s.agnostic.get());
  }
  for (const auto& [ap, sp] : lines) {
    const ArmSummary& a = *ap;
    const Summary& owner = *sp;
    first = true;
    for (const auto& c : arm_columns()) {
      if (!c.in_files) continue;
      if (c.aggregation == Aggregation::kPerFamily) {
        for (const auto& f : s.families) {
          auto it = a.family_accuracy.find(f);
          os << "," << (it == a.family_accuracy.end() ? "" : csv_num(it->second));
        }
      } else if (c.aggregation == Aggregation::kPerDepth) {
        for (int d : s.depths) {
          auto it = a.depth_accuracy.find(d);
          os << "," << (it == a.depth_accuracy.end() ? "" : csv_num(it->second));
        }
      } else {
        os << (first ? "" : ",")
           << (c.format == Format::kText ? csv_cell(column_text(c, a)) : csv_num(column_value(c, a, owner)));
      }
      first = false;
    }
    os << "\n";
  }
  return os.str();
}

void write_summary_files(const Summary& s, const std::string& dir) {
  ::mkdir(dir.c_str(), 0755);  // may exist
  struct stat st {};
  KV_CHECK_ARG(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "output directory '", dir, "' cannot be created");
  io::write_file_atomic(dir + "/summary.md", summary_markdown(s));
  io::write_file_atomic(dir + "/summary.json", summary_json(s));
  io::write_file_atomic(dir + "/summary.csv", summary_csv(s));
  if (s.lengths.size() >= 2) io::write_file_atomic(dir + "/summary_by_length.csv", summary_by_length_csv(s));
}

std::string summary_by_length_csv(const Summary& s) {
  std::ostringstream os;
  os << "arm,length,tasks,passed,accuracy,peak_kib_mean,memory_ratio,reserved_kib_mean,rss_growth_kib_mean,prefill_tps,"
        "decode_ms_per_token,pareto";
  for (const auto& f : s.families) os << ",acc_" << f;
  for (int d : s.depths) os << ",needle_d" << d;
  os << "\n";
  for (const auto& a : s.arms) {
    for (const auto& [len, l] : a.by_length) {
      os << csv_cell(a.arm) << "," << len << "," << l.tasks << "," << l.passed << "," << csv_num(l.accuracy) << ","
         << csv_num(l.peak_kib_mean) << "," << csv_num(l.memory_ratio) << "," << csv_num(l.reserved_kib_mean) << ","
         << csv_num(l.rss_growth_kib_mean) << "," << csv_num(l.prefill_tps) << "," << csv_num(l.decode_ms_per_token)
         << "," << (l.pareto ? 1 : 0);
      for (const auto& f : s.families) {
        const auto it = l.family_accuracy.find(f);
        os << "," << (it == l.family_accuracy.end() ? "" : csv_num(it->second));
      }
      for (int d : s.depths) {
        const auto it = l.depth_accuracy.find(d);
        os << "," << (it == l.depth_accuracy.end() ? "" : csv_num(it->second));
      }
      os << "\n";
    }
  }
  return os.str();
}

}  // namespace kvcache::study
