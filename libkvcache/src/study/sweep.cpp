// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/sweep.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "kvcache/error.h"
#include "kvcache/study/progress.h"
#include "kvcache/study/schema.h"

namespace kvcache::study {
namespace {

const char* kind_name(ItemKind k) {
  switch (k) {
    case ItemKind::kAttention:
      return "attn";
    case ItemKind::kReconstruction:
      return "recon";
    case ItemKind::kTask:
      return "task";
    case ItemKind::kText:
      return "text";
  }
  return "?";
}

/// Every CacheStats counter the schema maps to a row metric (schema.cpp), by that table.
void put_cache_stats(const CacheStats& c, ResultRow& row) {
  for (const auto& m : row_metrics()) {
    if (m.cache_field != nullptr) row.set(m.key, static_cast<double>(c.*m.cache_field));
  }
}

/// The sweep's lazily computed shared inputs.
struct Shared {
  std::optional<std::vector<QkvSample>> qkv;
  std::optional<TextEval> control_text;
};

void execute(ArmEvaluator& ev, const WorkItem& item, const SweepOptions& opt, const std::vector<Task>& tasks,
             const Arm& control, Shared& shared, ResultRow& row) {
  switch (item.kind) {
    case ItemKind::kAttention: {
      if (!shared.qkv) shared.qkv = ev.capture_qkv();
      const auto e = scheme_attention_error(*shared.qkv, item.granularity, item.bits, opt.attention_group);
      row.set("out_rel_err", e.out_rel_fro);
      row.set("prob_rel_err", e.prob_rel_fro);
      row.set("bits", item.bits);
      row.set("group", static_cast<double>(opt.attention_group));
      break;
    }
    case ItemKind::kReconstruction: {
      const auto r = ev.reconstruction(item.quant);
      row.set("bits_per_value", r.bits_per_value);
      row.set("key_rel_err", r.key_rel_err);
      row.set("value_rel_err", r.value_rel_err);
      row.set("key_max_abs", r.key_max_abs);
      row.set("value_max_abs", r.value_max_abs);
      if (std::isfinite(r.attn_out_rel_err)) {
        row.set("attn_out_rel_err", r.attn_out_rel_err);
        row.set("attn_prob_rel_err", r.attn_prob_rel_err);
      }
      break;
    }
    case ItemKind::kTask: {
      const Task& task = tasks[static_cast<size_t>(item.task_index)];
      const Generation g = ev.run_task(item.arm, task, item.mode);
      row.output = g.output;
      row.passed = score_output(task.rule, g.output);
      row.set("prompt_tokens", static_cast<double>(g.prompt_tokens));
      row.set("generated_tokens", static_cast<double>(g.generated_tokens));
      row.set("prefill_s", g.prefill_seconds);
      row.set("decode_s", g.decode_seconds);
      if (g.prefill_seconds > 0) row.set("prefill_tok_s", static_cast<double>(g.prompt_tokens) / g.prefill_seconds);
      if (g.generated_tokens > 0) row.set("decode_ms_per_token", 1000.0 * g.decode_seconds / static_cast<double>(g.generated_tokens));
      row.set("replay_s", g.replay_seconds);
      row.set("replay_tokens", static_cast<double>(g.replay_tokens));
      if (g.span_resident >= 0) row.set("span_resident", g.span_resident);
      if (g.rss_growth_peak >= 0) row.set("rss_growth_peak_bytes", static_cast<double>(g.rss_growth_peak));
      if (item.mode == QueryMode::kAgnostic) row.set("question_tokens", static_cast<double>(g.question_tokens));
      put_cache_stats(g.cache, row);
      break;
    }
    case ItemKind::kText: {
      TextEval te = ev.eval_text(item.arm);
      NllAccumulator single;
      single.add(te.single_logprobs);
      NllAccumulator stream;
      stream.add(te.stream_logprobs);
      row.set("ppl_single", single.perplexity());
      row.set("ppl_stream", stream.perplexity());
      row.set("scored_tokens", static_cast<double>(stream.tokens()));
      put_cache_stats(te.cache, row);
      if (!shared.control_text) {
        shared.control_text = item.arm == control ? te : ev.eval_text(control);
      }
      const auto cmp = compare_logits(shared.control_text->stream_logits, te.stream_logits);
      row.set("kld_mean", cmp.kld_mean);
      row.set("kld_max", cmp.kld_max);
      row.set("kld_median", cmp.kld_median);
      row.set("kld_p99", cmp.kld_p99);
      row.set("kld_p999", cmp.kld_p999);
      row.set("top1", cmp.top1_agreement);
      break;
    }
  }
}

/// The modes of `modes` in run order (aware first).
std::vector<QueryMode> modes_in_order(const std::vector<QueryMode>& modes) {
  std::vector<QueryMode> out;
  for (QueryMode m : {QueryMode::kAware, QueryMode::kAgnostic}) {
    if (std::find(modes.begin(), modes.end(), m) != modes.end()) out.push_back(m);
  }
  return out;
}

}  // namespace

std::string to_string(QueryMode mode) { return mode == QueryMode::kAgnostic ? "agnostic" : "aware"; }

std::vector<QueryMode> parse_query_modes(const std::string& text) {
  if (text == "aware") return {QueryMode::kAware};
  if (text == "agnostic") return {QueryMode::kAgnostic};
  if (text == "both") return {QueryMode::kAware, QueryMode::kAgnostic};
  throw InvalidArgument("query mode '" + text + "' is none of aware, agnostic, both");
}

std::vector<WorkItem> plan_sweep(const std::vector<Arm>& arms, const std::vector<Task>& tasks,
                                 const SweepOptions& options) {
  std::vector<WorkItem> plan;
  auto add = [&](WorkItem w) {
    w.order = static_cast<int64_t>(plan.size());
    plan.push_back(std::move(w));
  };
  if (options.attention) {
    for (auto g : all_granularities()) {
      for (int bits : options.attention_bits) {
        WorkItem w;
        w.kind = ItemKind::kAttention;
        w.granularity = g;
        w.bits = bits;
        w.row_task = "attn:" + key(g) + ":b" + std::to_string(bits);
        add(w);
      }
    }
  }
  if (options.reconstruction) {
    std::set<std::string> seen;
    for (const auto& a : arms) {
      if (!seen.insert(a.scheme).second) continue;
      WorkItem w;
      w.kind = ItemKind::kReconstruction;
      w.quant = a.scheme;
      w.row_arm = a.scheme;
      w.row_task = "recon";
      add(w);
    }
  }
  const std::vector<QueryMode> modes = modes_in_order(options.query_modes);
  for (const auto& a : arms) {
    for (QueryMode mode : modes) {
      for (size_t i = 0; i < tasks.size(); ++i) {
        WorkItem w;
        w.kind = ItemKind::kTask;
        w.arm = a;
        w.task_index = static_cast<int64_t>(i);
        w.mode = mode;
        w.row_arm = a.spec();
        w.row_task = tasks[i].id;
        add(w);
      }
    }
    if (options.text) {
      WorkItem w;
      w.kind = ItemKind::kText;
      w.arm = a;
      w.row_arm = a.spec();
      w.row_task = "text";
      add(w);
    }
  }
  return plan;
}

namespace {

/// The sweep's inputs checked and canonicalized.
struct Prepared {
  std::vector<Arm> arms;  ///< canonical, de-duplicated
  Arm control;
  /// Arms the model cannot run (UnsupportedError from canonicalize, e.g. a group size that
  /// does not divide its head_dim): kept in the plan under their spec as given; their rows
  /// carry the reason.
  std::map<std::string, std::string> unsupported;
};

Prepared prepare(const ArmEvaluator& ev, const SweepOptions& opt) {
  KV_CHECK_ARG(!opt.arms.empty(), "the sweep has no arm");
  KV_CHECK_ARG(!opt.tasks.empty(), "the sweep has no task (an empty task file or suite)");
  KV_CHECK_ARG(!opt.query_modes.empty(), "the sweep has no query mode (aware, agnostic or both)");
  KV_CHECK_ARG(modes_in_order(opt.query_modes).size() == opt.query_modes.size(), "a query mode appears twice in ",
               "the sweep's modes (use 'both' for aware and agnostic)");
  Prepared p;
  // Malformed specs (InvalidArgument) stop the sweep before anything runs.
  for (const auto& a : opt.arms) {
    try {
      p.arms.push_back(ev.canonicalize(a));
    } catch (const UnsupportedError& e) {
      p.arms.push_back(a);
      p.unsupported.emplace(a.spec(), e.what());
    }
  }
  p.arms = dedupe(p.arms);
  p.control = ev.canonicalize(opt.control);
  std::set<std::string> ids;
  for (const auto& t : opt.tasks) {
    KV_CHECK_ARG(ids.insert(t.id).second, "task id '", t.id, "' appears twice in the task list");
  }
  if (opt.attention) {
    for (int b : opt.attention_bits) {
      KV_CHECK_ARG(b >= 1 && b <= 16, "attention-error bit width ", b, " is out of range [1, 16]");
    }
    KV_CHECK_ARG(opt.attention_group >= 1 && opt.attention_group <= 65536, "attention-error group ",
                 opt.attention_group, " is out of range [1, 65536]");
  }
  KV_CHECK_ARG(opt.shard.count >= 1 && opt.shard.count <= kMaxShards && opt.shard.index >= 0 &&
                   opt.shard.index < opt.shard.count,
               "shard ", opt.shard.to_string(), " is not i/n with 0 <= i < n <= ", kMaxShards);
  return p;
}

}  // namespace

void validate_sweep(const ArmEvaluator& ev, const SweepOptions& opt) { (void)prepare(ev, opt); }

SweepStats run_sweep(ArmEvaluator& ev, const SweepOptions& opt, ResultsStore& store, Progress* progress) {
  const Prepared prepared = prepare(ev, opt);
  const std::vector<Arm>& arms = prepared.arms;
  const Arm& control = prepared.control;
  const auto& unsupported = prepared.unsupported;
  const std::string model = ev.model_id();
  const auto plan = plan_sweep(arms, opt.tasks, opt);

  SweepStats st;
  st.planned = static_cast<int64_t>(plan.size());
  std::vector<const WorkItem*> pending;
  for (const auto& w : plan) {
    if (!opt.shard.owns(w.order)) continue;
    ++st.owned;
    ResultRow probe;
    probe.arm = w.row_arm;
    probe.task = w.row_task;
    probe.model = model;
    if (w.mode == QueryMode::kAgnostic) probe.query_mode = to_string(w.mode);
    if (store.contains(probe.key())) {
      ++st.skipped;
    } else {
      pending.push_back(&w);
    }
  }
  if (progress != nullptr) {
    progress->set_total(st.owned);
    progress->skipped(st.skipped);
  }

  Shared shared;
  for (const WorkItem* w : pending) {
    ResultRow row;
    row.order = w->order;
    row.kind = kind_name(w->kind);
    row.arm = w->row_arm;
    row.task = w->row_task;
    row.model = model;
    if (w->kind == ItemKind::kAttention) row.granularity = key(w->granularity);
    if (w->kind == ItemKind::kTask) {
      const Task& t = opt.tasks[static_cast<size_t>(w->task_index)];
      row.family = to_string(t.family);
      row.depth_pct = t.depth_pct;
      row.context_target = t.context_target;
      if (w->mode == QueryMode::kAgnostic) row.query_mode = to_string(w->mode);
    }
    const auto skip = unsupported.find(w->arm.spec());
    try {
      if ((w->kind == ItemKind::kTask || w->kind == ItemKind::kText) && skip != unsupported.end()) {
        throw UnsupportedError("arm " + skip->first + " cannot run on this model: " + skip->second);
      }
      execute(ev, *w, opt, opt.tasks, control, shared, row);
    } catch (const InvalidArgument& e) {
      row.error = e.what();
    } catch (const CapacityError& e) {
      row.error = e.what();
    } catch (const UnsupportedError& e) {
      row.error = e.what();
    }
    if (!row.error.empty()) {
      row.passed = false;
      ++st.errors;
    }
    store.append(row);
    ++st.executed;
    if (progress != nullptr) {
      progress->done((row.arm.empty() ? row.task : row.arm + " " + row.task) +
                     (row.query_mode.empty() ? "" : " (" + row.query_mode + ")"));
    }
  }
  if (progress != nullptr) progress->finish();
  return st;
}

}  // namespace kvcache::study
