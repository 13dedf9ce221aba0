// SPDX-License-Identifier: Apache-2.0
// Workloads with shared prefixes (prefix_workload.h): built from the default suite's tasks,
// run over one MultiSequenceCache with sharing on and off, scored with the suite's rules.
#include "common/file_io.h"
#include "kvcache/study/prefix_workload.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/model/causal_lm.h"
#include "kvcache/model/chat_template.h"
#include "kvcache/model/runner.h"
#include "kvcache/model/tokenizer.h"
#include "kvcache/study/task_suite.h"
#include "kvcache/torch/cache.h"

namespace kvcache::study {
namespace {

constexpr const char* kQuestionMark = "\n\nQuestion: ";
constexpr int64_t kLengthClass = 512;

std::vector<Task> tasks_of(const std::vector<Task>& suite, TaskFamily family, const std::string& id_part) {
  std::vector<Task> out;
  for (const Task& t : suite) {
    if (t.family == family && t.context_target == kLengthClass && t.id.find(id_part) != std::string::npos)
      out.push_back(t);
  }
  return out;
}

/// An instruction task's user turn split before its question: (note part, question).
std::pair<std::string, std::string> split_question(const Task& t) {
  const std::string& user = t.messages.back().content;
  const size_t at = user.rfind(kQuestionMark);
  KV_CHECK(at != std::string::npos, InternalError, "instruction task ", t.id, " has no '\\n\\nQuestion: ' in its user turn");
  return {user.substr(0, at + std::char_traits<char>::length(kQuestionMark)),
          user.substr(at + std::char_traits<char>::length(kQuestionMark))};
}

/// Worked examples before each few-shot request. Each is an instruction task's question alone
/// ("Question: <q>", without its note) and its answer in the base task's style: the variant the
/// control follows on the default model (docs/study.md, "Prefix sharing": with the examples'
/// notes, or with 2 or 3 examples, fp32+full fails more requests).
constexpr int64_t kFewShotExamples = 1;

}  // namespace

std::string to_string(PrefixFamily family) {
  switch (family) {
    case PrefixFamily::kSystemPrompt:
      return "system_prompt";
    case PrefixFamily::kMultiTurn:
      return "multiturn";
    case PrefixFamily::kFewShot:
      return "fewshot";
  }
  return "unknown";
}

namespace {

/// A workload of `family` built on task `base`, no requests yet: id "<family>-<base id>".
PrefixWorkload open_workload(PrefixFamily family, const Task& base, bool concurrent) {
  PrefixWorkload wl;
  wl.id = to_string(family) + "-" + base.id;
  wl.family = family;
  wl.concurrent = concurrent;
  return wl;
}

}  // namespace

std::vector<PrefixWorkload> generate_prefix_workloads(uint64_t seed, int64_t count, int64_t requests) {
  KV_CHECK_ARG(count >= 1 && count <= 7, "generate_prefix_workloads: count must be in [1, 7], got ", count);
  KV_CHECK_ARG(requests >= 1 && requests <= 14, "generate_prefix_workloads: requests must be in [1, 14], got ",
               requests);
  const std::vector<Task> suite = generate_suite("default", seed);
  const std::vector<Task> instr = tasks_of(suite, TaskFamily::kInstruction, "-instruction-");
  KV_CHECK(instr.size() == 14, InternalError, "the default suite has ", instr.size(), " instruction tasks of length ", kLengthClass,
           ", expected 14");
  std::vector<PrefixWorkload> out;
  for (int64_t w = 0; w < count; ++w) {
    const Task& base = instr[static_cast<size_t>(w)];
    PrefixWorkload wl = open_workload(PrefixFamily::kSystemPrompt, base, /*concurrent=*/true);
    const std::string note = split_question(base).first;
    for (int64_t i = 0; i < requests; ++i) {
      const Task& other = instr[static_cast<size_t>((w + i) % 14)];
      PrefixRequest r;
      r.task = base;
      r.task.id = wl.id + "-q" + std::to_string(i);
      r.task.messages.back().content = note + split_question(other).second;
      // The reply the rule wants: the other task's answer under this task's instruction.
      r.task.answer = instruction_reply(other, base);
      wl.requests.push_back(std::move(r));
    }
    // One limit for the batch (generate_batch takes one): the largest of the questions'.
    int64_t limit = 1;
    for (int64_t i = 0; i < requests; ++i) limit = std::max(limit, instr[static_cast<size_t>((w + i) % 14)].max_new_tokens);
    for (PrefixRequest& r : wl.requests) r.task.max_new_tokens = limit;
    out.push_back(std::move(wl));
  }
  std::vector<Task> sessions = tasks_of(suite, TaskFamily::kMultiTurn, "-t2-");
  const std::vector<Task> six = tasks_of(suite, TaskFamily::kMultiTurn, "-t6-");
  sessions.insert(sessions.end(), six.begin(), six.end());
  for (int64_t w = 0; w < count; ++w) {
    const Task& base = sessions[static_cast<size_t>(w % static_cast<int64_t>(sessions.size()))];
    PrefixWorkload wl = open_workload(PrefixFamily::kMultiTurn, base, /*concurrent=*/false);
    for (size_t m = 0; m < base.messages.size(); ++m) {
      if (base.messages[m].role != "user") continue;
      PrefixRequest r;
      r.task = base;
      r.task.messages.assign(base.messages.begin(), base.messages.begin() + static_cast<std::ptrdiff_t>(m) + 1);
      r.scored = m + 1 == base.messages.size();
      r.task.id = wl.id + "-turn" + std::to_string(wl.requests.size());
      if (!r.scored) {
        r.task.answer = base.messages[m + 1].content;  // the reference reply the next request re-sends
        r.task.rule = {RuleKind::kExact, r.task.answer};
      }
      wl.requests.push_back(std::move(r));
    }
    out.push_back(std::move(wl));
  }
  for (int64_t w = 0; w < count; ++w) {
    const Task& base = instr[static_cast<size_t>(w)];
    PrefixWorkload wl = open_workload(PrefixFamily::kFewShot, base, /*concurrent=*/true);
    std::vector<Message> shared = {base.messages.front()};  // the instruction
    for (int64_t e = 1; e <= kFewShotExamples; ++e) {
      const Task& ex = instr[static_cast<size_t>((w + e) % 14)];
      shared.push_back({"user", "Question: " + split_question(ex).second});
      shared.push_back({"assistant", instruction_reply(ex, base)});
    }
    int64_t limit = 1;
    for (int64_t i = 0; i < requests; ++i) {
      const Task& other = instr[static_cast<size_t>((w + kFewShotExamples + 1 + i) % 14)];
      PrefixRequest r;
      r.task = base;
      r.task.id = wl.id + "-q" + std::to_string(i);
      r.task.messages = shared;
      r.task.messages.push_back({"user", other.messages.back().content});
      r.task.answer = instruction_reply(other, base);
      r.task.approx_tokens = approx_tokens(render_chatml(r.task.messages, /*add_generation_prompt=*/true));
      // The spans keep pointing at the instruction (message 0) and at the question, now in the
      // last message.
      r.task.question = other.question;
      r.task.question.message = static_cast<int64_t>(r.task.messages.size()) - 1;
      limit = std::max(limit, approx_tokens(r.task.answer) + 8);
      wl.requests.push_back(std::move(r));
    }
    // One limit for the batch, as system_prompt: the largest of the references' (+ 8).
    for (PrefixRequest& r : wl.requests) r.task.max_new_tokens = limit;
    out.push_back(std::move(wl));
  }
  return out;
}

struct PrefixWorkloadRunner::Impl {
  PrefixRunOptions opt;
  CausalLM model;
  Runner runner;
  Tokenizer tokenizer;
  ChatTemplate chat;
  std::vector<int64_t> eos;

  explicit Impl(const PrefixRunOptions& o)
      : opt(o),
        model(CausalLM::load(o.model_path, LoadOptions{o.threads})),
        runner(model),
        tokenizer(Tokenizer::from_texts(model.tokenizer_files())),
        chat(ChatTemplate::detect(model.config().model_type, model.extra_file("tokenizer_config.json"))) {
    KV_CHECK_ARG(o.block_tokens >= 0, "PrefixRunOptions: block_tokens must be >= 0 (0: automatic), got ",
                 o.block_tokens);
    KV_CHECK_ARG(o.prefill_chunk >= 0, "PrefixRunOptions: prefill_chunk must be >= 0, got ", o.prefill_chunk);
    KV_CHECK_ARG(o.pool_bytes >= 1, "PrefixRunOptions: pool_bytes must be >= 1, got ", o.pool_bytes);
    eos = model.config().eos_token_ids;
    if (auto im_end = tokenizer.find_added_token("<|im_end|>")) {
      if (std::find(eos.begin(), eos.end(), im_end->id) == eos.end()) eos.push_back(im_end->id);
    }
    if (auto e = tokenizer.eos_id()) {
      if (std::find(eos.begin(), eos.end(), *e) == eos.end()) eos.push_back(*e);
    }
  }

  CacheConfig config_for(const Arm& arm) const {
    CacheConfig cfg = model.cache_config();
    cfg.scheme = arm.scheme;
    cfg.policy = arm.policy;
    cfg.block_tokens = opt.block_tokens;
    const int64_t g = cfg.block_tokens_multiple();
    if (cfg.block_tokens == 0) {
      cfg.block_tokens = (kAutoBlockTokens + g - 1) / g * g;
    } else {
      KV_CHECK_ARG(cfg.block_tokens % g == 0, "block tokens (--block-tokens) = ", cfg.block_tokens,
                   " is not a multiple of arm '", arm.scheme, "+", arm.policy, "''s quantizer group of ", g,
                   " tokens: pass a multiple of ", g, ", or 0 to choose per arm");
    }
    return cfg;
  }
};

PrefixWorkloadRunner::PrefixWorkloadRunner(const PrefixRunOptions& options)
    : impl_(std::make_unique<Impl>(options)) {}
PrefixWorkloadRunner::~PrefixWorkloadRunner() = default;

Arm PrefixWorkloadRunner::canonicalize(const Arm& arm) const {
  Arm a;
  a.scheme = make_cache_scheme(arm.scheme)->spec();
  a.policy = make_eviction_policy(arm.policy)->spec();
  try {
    CacheManager probe(impl_->config_for(a));
    (void)probe;
  } catch (const InvalidArgument& e) {
    throw UnsupportedError(e.what());
  }
  return a;
}

std::vector<int64_t> PrefixWorkloadRunner::encode(const Task& task) const {
  std::vector<ChatMessage> msgs;
  for (const auto& m : task.messages) msgs.push_back({m.role, m.content});
  return impl_->tokenizer.encode(impl_->chat.render(msgs, /*add_generation_prompt=*/true), SpecialTokens::kParse,
                                 PostProcess::kApply);
}

PrefixRunResult PrefixWorkloadRunner::run(const PrefixWorkload& workload, const Arm& arm, bool sharing) const {
  KV_CHECK_ARG(!workload.requests.empty(), "PrefixWorkloadRunner::run: workload '", workload.id, "' has no requests");
  MultiSequenceConfig mc;
  mc.model = impl_->config_for(arm);
  mc.capacity_bytes = impl_->opt.pool_bytes;
  mc.prefix_sharing = sharing;
  mc.when_full = impl_->opt.when_full;
  mc.allow_inexact_reuse = impl_->opt.allow_inexact_reuse;
  const bool disk_pass = sharing && !impl_->opt.disk_tier_dir.empty();
  if (disk_pass) {
    mc.disk_tier_dir = impl_->opt.disk_tier_dir;
    mc.disk_tier_bytes = impl_->opt.disk_tier_bytes;
  }
  MultiSequenceCache pool(mc);

  PrefixRunResult res;
  res.workload = workload.id;
  res.family = workload.family;
  res.arm = arm.spec();
  res.sharing = sharing;
  res.requests = static_cast<int64_t>(workload.requests.size());
  res.block_tokens = mc.model.block_tokens;
  std::vector<std::vector<int64_t>> prompts;
  int64_t max_new = 1;
  for (const PrefixRequest& r : workload.requests) {
    prompts.push_back(encode(r.task));
    max_new = std::max(max_new, r.task.max_new_tokens);
  }
  // The workload's requests, in `pool` (run twice with a disk pass).
  const auto run_requests = [&](std::vector<GenerationResult>& gens) {
    if (workload.concurrent) {
      // One batch: every request's own max_new_tokens cannot differ inside generate_batch, so the
      // batch runs to the largest and each reply is cut to its request's limit below.
      GenerationOptions go;
      go.max_new_tokens = max_new;
      go.prefill_chunk = impl_->opt.prefill_chunk;
      go.eos_token_ids = impl_->eos;
      std::vector<TorchCache> faces;  // the runner drives each sequence through its at::Tensor face
      faces.reserve(prompts.size());
      for (size_t i = 0; i < prompts.size(); ++i) faces.emplace_back(pool.add_sequence());
      std::vector<KVCache*> seqs;
      for (auto& f : faces) seqs.push_back(&f);
      gens = impl_->runner.generate_batch(prompts, go, seqs);
      res.sharing_ratio = pool.stats().sharing_ratio;
    } else {
      TorchCache seq(pool.add_sequence());
      for (size_t i = 0; i < prompts.size(); ++i) {
        GenerationOptions go;
        go.max_new_tokens = workload.requests[i].task.max_new_tokens;
        go.prefill_chunk = impl_->opt.prefill_chunk;
        go.eos_token_ids = impl_->eos;
        // A batch of one: bit-identical to generate(), and a request that meets a full pool ends
        // with its result marked (refused: one sequence has no newer request to preempt) while
        // the session goes on with the next.
        gens.push_back(impl_->runner.generate_batch({prompts[i]}, go, {&seq}).front());
        res.sharing_ratio = std::max(res.sharing_ratio, pool.stats().sharing_ratio);
      }
    }
  };
  std::vector<GenerationResult> gens;
  const auto t0 = std::chrono::steady_clock::now();
  run_requests(gens);
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t i = 0; i < gens.size(); ++i) {
    const PrefixRequest& req = workload.requests[i];
    std::vector<int64_t> toks = gens[i].tokens;
    if (static_cast<int64_t>(toks.size()) > req.task.max_new_tokens)
      toks.resize(static_cast<size_t>(req.task.max_new_tokens));
    const std::string out = impl_->tokenizer.decode_lenient(toks, /*skip_special=*/true);
    res.outputs.push_back(out);
    res.request_scored.push_back(req.scored);
    res.request_completed.push_back(gens[i].status == GenerationStatus::kOk);
    res.prompt_tokens += gens[i].prompt_tokens;
    res.computed_tokens += gens[i].computed_prompt_tokens;
    res.generated_tokens += static_cast<int64_t>(toks.size());
    res.preempted += gens[i].status == GenerationStatus::kPreempted;
    res.refused += gens[i].status == GenerationStatus::kRefused;
    if (req.scored) {
      ++res.scored;
      if (gens[i].status == GenerationStatus::kOk && score_output(req.task.rule, out)) ++res.passed;
    }
  }
  res.peak_pool_bytes = pool.stats().bytes_in_use_peak;
  res.counters = pool.counters();
  pool.check_invariants();  // reference counts = holders, shared blocks untouched, bytes ≤ capacity
  if (disk_pass) {
    DiskPass d;
    d.first_pass = res.counters;
    double prefill = 0;
    int64_t computed = 0;
    for (const GenerationResult& g : gens) {
      prefill += g.prefill_seconds;
      computed += g.computed_prompt_tokens;
    }
    d.recompute_seconds_per_token = computed > 0 ? prefill / static_cast<double>(computed) : 0;
    for (int64_t id = 0; id < pool.num_sequences(); ++id) pool.sequence(id).finish();
    (void)pool.reclaim(std::numeric_limits<int64_t>::max());  // every cached page to the disk tier
    const PrefixCounters before = pool.counters();
    d.pages_spilled = before.disk_pages_written - res.counters.disk_pages_written;
    std::vector<GenerationResult> again;
    const double ratio = res.sharing_ratio;  // the first pass's
    run_requests(again);
    res.sharing_ratio = ratio;
    d.counters = pool.counters() - before;
    for (size_t i = 0; i < again.size(); ++i) {
      d.computed_tokens += again[i].computed_prompt_tokens;
      d.prefill_seconds += again[i].prefill_seconds;
      std::vector<int64_t> a = gens[i].tokens, b = again[i].tokens;
      const auto cap = static_cast<size_t>(workload.requests[i].task.max_new_tokens);
      if (a.size() > cap) a.resize(cap);
      if (b.size() > cap) b.resize(cap);
      d.same_outputs += a == b && again[i].status == gens[i].status;
    }
    d.restore_seconds_per_token =
        d.counters.prompt_tokens_hit_disk > 0
            ? d.counters.disk_read_seconds / static_cast<double>(d.counters.prompt_tokens_hit_disk)
            : 0;
    pool.check_invariants();
    res.disk_pass = d;
  }
  return res;
}

std::vector<std::optional<BaselineAgreement>> same_as_baseline(const std::vector<PrefixRunResult>& results) {
  for (const PrefixRunResult& r : results) {  // every run first: a baseline may come after the runs it serves
    KV_CHECK_ARG(r.outputs.size() == r.request_scored.size() && r.outputs.size() == r.request_completed.size(),
                 "same_as_baseline: run of workload '", r.workload, "' under '", r.arm, "' has ", r.outputs.size(),
                 " outputs but ", r.request_scored.size(), " request_scored and ", r.request_completed.size(),
                 " request_completed flags, expected as many");
  }
  std::vector<std::optional<BaselineAgreement>> out;
  for (const PrefixRunResult& r : results) {
    const PrefixRunResult* first = nullptr;  // the family's first run without sharing: its arm is the baseline
    for (const PrefixRunResult& b : results) {
      if (b.family == r.family && !b.sharing) {
        first = &b;
        break;
      }
    }
    const PrefixRunResult* base = nullptr;
    for (const PrefixRunResult& b : results) {
      if (first != nullptr && b.family == r.family && !b.sharing && b.arm == first->arm && b.workload == r.workload) {
        base = &b;
        break;
      }
    }
    if (base == nullptr) {
      out.emplace_back(std::nullopt);
      continue;
    }
    KV_CHECK_ARG(base->outputs.size() == r.outputs.size(), "same_as_baseline: run of workload '", r.workload,
                 "' under '", r.arm, "' has ", r.outputs.size(), " outputs, its baseline under '", base->arm,
                 "' has ", base->outputs.size(), ", expected as many");
    BaselineAgreement a;
    for (size_t i = 0; i < r.outputs.size(); ++i) {
      if (!r.request_scored[i] || !r.request_completed[i] || !base->request_completed[i]) continue;
      ++a.compared;
      a.same += r.outputs[i] == base->outputs[i];
    }
    out.emplace_back(a);
  }
  return out;
}

namespace {

struct Agg {
  PrefixFamily family = PrefixFamily::kSystemPrompt;
  std::string arm;
  bool sharing = false;
  int64_t workloads = 0, requests = 0, scored = 0, passed = 0, prompt = 0, computed = 0, preempted = 0, refused = 0;
  int64_t same = 0, compared = 0;  ///< Σ BaselineAgreement over the runs with a baseline run
  double peak_sum = 0, seconds = 0, ratio = 0;
  PrefixCounters c;
  double mean_peak_kib() const { return workloads == 0 ? 0 : peak_sum / static_cast<double>(workloads) / 1024.0; }
  double accuracy() const { return scored == 0 ? 0 : 100.0 * static_cast<double>(passed) / static_cast<double>(scored); }
  bool has_baseline = false;
};

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

/// "same/compared (pct)", e.g. "24/24 (100.0%)", or "n/a" when no run of the row has a baseline run.
std::string same_cell(const Agg& a) {
  if (!a.has_baseline) return "n/a";
  const double pct = a.compared == 0 ? 0 : 100.0 * static_cast<double>(a.same) / static_cast<double>(a.compared);
  return std::to_string(a.same) + "/" + std::to_string(a.compared) + " (" + fmt("%.1f%%", pct) + ")";
}

}  // namespace

std::string prefix_report_markdown(const std::vector<PrefixRunResult>& results) {
  const std::vector<std::optional<BaselineAgreement>> same = same_as_baseline(results);
  std::vector<Agg> rows;
  auto find = [&rows](PrefixFamily f, const std::string& arm, bool sharing) -> Agg* {
    for (Agg& a : rows) {
      if (a.family == f && a.arm == arm && a.sharing == sharing) return &a;
    }
    return nullptr;
  };
  for (size_t k = 0; k < results.size(); ++k) {
    const PrefixRunResult& r = results[k];
    Agg* a = find(r.family, r.arm, r.sharing);
    if (a == nullptr) {
      rows.emplace_back();
      a = &rows.back();
      a->family = r.family;
      a->arm = r.arm;
      a->sharing = r.sharing;
    }
    ++a->workloads;
    a->requests += r.requests;
    a->scored += r.scored;
    a->passed += r.passed;
    if (same[k].has_value()) {
      a->has_baseline = true;
      a->same += same[k]->same;
      a->compared += same[k]->compared;
    }
    a->prompt += r.prompt_tokens;
    a->computed += r.computed_tokens;
    a->preempted += r.preempted;
    a->refused += r.refused;
    a->peak_sum += static_cast<double>(r.peak_pool_bytes);
    a->seconds += r.seconds;
    a->ratio = std::max(a->ratio, r.sharing_ratio);
    a->c.requests += r.counters.requests;
    a->c.prompt_tokens_queried += r.counters.prompt_tokens_queried;
    a->c.prompt_tokens_hit += r.counters.prompt_tokens_hit;
    a->c.blocks_shared += r.counters.blocks_shared;
    a->c.blocks_copied += r.counters.blocks_copied;
    a->c.blocks_reclaimed += r.counters.blocks_reclaimed;
  }
  std::ostringstream md;
  md << "## Prefix sharing\n\n"
     << "Per family, arm and sharing, summed over the workloads (peak pool KiB: the mean of each workload's "
        "peak; sharing ratio: the highest sampled).\n\n"
     << "| family | arm | sharing | workloads | requests | accuracy | same reply as baseline | peak pool KiB | prompt "
        "tokens | prefill computed | seconds | queried | hit | hit rate | blocks shared | copied on write | reclaimed | "
        "sharing ratio | preempted | refused |\n"
     << "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const Agg& a : rows) {
    md << "| " << to_string(a.family) << " | " << a.arm << " | " << (a.sharing ? "on" : "off") << " | "
       << a.workloads << " | " << a.requests << " | " << fmt("%.1f%%", a.accuracy()) << " (" << a.passed << "/"
       << a.scored << ") | " << same_cell(a) << " | " << fmt("%.1f", a.mean_peak_kib()) << " | " << a.prompt << " | "
       << a.computed << " | "
       << fmt("%.2f", a.seconds) << " | " << a.c.prompt_tokens_queried << " | " << a.c.prompt_tokens_hit << " | "
       << fmt("%.3f", a.c.hit_rate()) << " | " << a.c.blocks_shared << " | " << a.c.blocks_copied << " | "
       << a.c.blocks_reclaimed << " | " << fmt("%.2f", a.ratio) << " | " << a.preempted << " | " << a.refused
       << " |\n";
  }
  // Composition: every (arm, sharing) against the first arm without sharing, per family.
  md << "\n### What each lever saves, alone and together\n\n"
     << "Peak pool bytes and prefill tokens computed relative to the family's first arm without sharing "
        "(measured, not multiplied out); same reply as baseline: scored requests whose reply equals that of the "
        "same request of the same workload under the baseline.\n\n"
     << "| family | arm | sharing | accuracy | same reply as baseline | peak pool KiB | × peak of the baseline | "
        "prefill computed | × prefill of the baseline | copied on write | preempted / refused |\n"
     << "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const Agg& a : rows) {
    const Agg* base = nullptr;
    for (const Agg& b : rows) {
      if (b.family == a.family && !b.sharing) {
        base = &b;
        break;
      }
    }
    const double peak_x = base != nullptr && base->mean_peak_kib() > 0 ? a.mean_peak_kib() / base->mean_peak_kib() : 0;
    const double pre_x =
        base != nullptr && base->computed > 0 ? static_cast<double>(a.computed) / static_cast<double>(base->computed) : 0;
    md << "| " << to_string(a.family) << " | " << a.arm << " | " << (a.sharing ? "on" : "off") << " | "
       << fmt("%.1f%%", a.accuracy()) << " | " << same_cell(a) << " | " << fmt("%.1f", a.mean_peak_kib()) << " | "
       << fmt("%.3f", peak_x)
       << " | " << a.computed << " | " << fmt("%.3f", pre_x) << " | " << a.c.blocks_copied << " | " << a.preempted
       << " / " << a.refused << " |\n";
  }
  bool any_disk = false;
  for (const PrefixRunResult& r : results) any_disk = any_disk || r.disk_pass.has_value();
  if (any_disk) {
    md << "\n### Disk tier: a second pass restored from disk\n\n"
       << "Each sharing run again in the same pool after every cached page was reclaimed to the disk tier "
          "(summed over workloads): prompt tokens hit in memory and from disk, computed; pages spilled (the "
          "reclaim between the passes), read back, evicted from the tier, failed; restore time per token "
          "(reading, verifying and adopting spilled pages) against recompute time per token (the first "
          "pass's prefill), and replies equal to the first pass's.\n\n"
       << "| family | arm | requests | hit memory | hit disk | computed | pages spilled | read | evicted | failed | "
          "restore ms/token | recompute ms/token | × faster | replies equal |\n"
       << "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    std::vector<std::pair<PrefixFamily, std::string>> keys;
    for (const PrefixRunResult& r : results) {
      if (r.disk_pass && std::find(keys.begin(), keys.end(), std::make_pair(r.family, r.arm)) == keys.end()) {
        keys.emplace_back(r.family, r.arm);
      }
    }
    for (const auto& [family, arm] : keys) {
      int64_t requests = 0, mem = 0, disk = 0, computed = 0, spilled = 0, read = 0, evicted = 0, failed = 0, equal = 0;
      double restore = 0, recompute = 0, recompute_tokens = 0;
      for (const PrefixRunResult& r : results) {
        if (!r.disk_pass || r.family != family || r.arm != arm) continue;
        const DiskPass& d = *r.disk_pass;
        requests += r.requests;
        mem += d.counters.prompt_tokens_hit_memory;
        disk += d.counters.prompt_tokens_hit_disk;
        computed += d.computed_tokens;
        spilled += d.pages_spilled;
        read += d.counters.disk_pages_read;
        evicted += d.counters.disk_evictions;
        failed += d.counters.disk_failures;
        equal += d.same_outputs;
        restore += d.counters.disk_read_seconds;
        recompute += d.recompute_seconds_per_token * static_cast<double>(r.computed_tokens);
        recompute_tokens += static_cast<double>(r.computed_tokens);
      }
      const double restore_ms = disk > 0 ? 1e3 * restore / static_cast<double>(disk) : 0;
      const double recompute_ms = recompute_tokens > 0 ? 1e3 * recompute / recompute_tokens : 0;
      md << "| " << to_string(family) << " | " << arm << " | " << requests << " | " << mem << " | " << disk << " | "
         << computed << " | " << spilled << " | " << read << " | " << evicted << " | " << failed << " | "
         << fmt("%.4f", restore_ms) << " | " << fmt("%.4f", recompute_ms) << " | "
         << (restore_ms > 0 ? fmt("%.1f", recompute_ms / restore_ms) : std::string("n/a")) << " | " << equal << "/"
         << requests << " |\n";
    }
  }
  return md.str();
}

std::string prefix_results_json(const std::vector<PrefixRunResult>& results) {
  const std::vector<std::optional<BaselineAgreement>> same = same_as_baseline(results);
  nlohmann::json arr = nlohmann::json::array();
  for (size_t k = 0; k < results.size(); ++k) {
    const PrefixRunResult& r = results[k];
    nlohmann::json j;
    j["workload"] = r.workload;
    j["family"] = to_string(r.family);
    j["arm"] = r.arm;
    j["sharing"] = r.sharing;
    j["requests"] = r.requests;
    j["block_tokens"] = r.block_tokens;
    j["scored"] = r.scored;
    j["passed"] = r.passed;
    j["same_as_baseline"] = same[k].has_value() ? nlohmann::json(same[k]->same) : nlohmann::json(nullptr);
    j["compared_with_baseline"] = same[k].has_value() ? nlohmann::json(same[k]->compared) : nlohmann::json(nullptr);
    j["prompt_tokens"] = r.prompt_tokens;
    j["computed_tokens"] = r.computed_tokens;
    j["generated_tokens"] = r.generated_tokens;
    j["peak_pool_bytes"] = r.peak_pool_bytes;
    j["sharing_ratio"] = r.sharing_ratio;
    j["seconds"] = r.seconds;
    j["prompt_tokens_queried"] = r.counters.prompt_tokens_queried;
    j["prompt_tokens_hit"] = r.counters.prompt_tokens_hit;
    j["hit_rate"] = r.counters.hit_rate();
    j["blocks_shared"] = r.counters.blocks_shared;
    j["blocks_copied"] = r.counters.blocks_copied;
    j["blocks_reclaimed"] = r.counters.blocks_reclaimed;
    j["preempted"] = r.preempted;
    j["refused"] = r.refused;
    j["pool_preemptions"] = r.counters.preemptions;
    j["pool_refusals"] = r.counters.refusals;
    j["outputs"] = r.outputs;
    if (r.disk_pass) {
      const DiskPass& d = *r.disk_pass;
      nlohmann::json dj;
      dj["prompt_tokens_hit_memory"] = d.counters.prompt_tokens_hit_memory;
      dj["prompt_tokens_hit_disk"] = d.counters.prompt_tokens_hit_disk;
      dj["computed_tokens"] = d.computed_tokens;
      dj["pages_spilled"] = d.pages_spilled;
      dj["first_pass_pages_written"] = d.first_pass.disk_pages_written;
      dj["disk_pages_written"] = d.counters.disk_pages_written;
      dj["disk_bytes_written"] = d.counters.disk_bytes_written;
      dj["disk_pages_read"] = d.counters.disk_pages_read;
      dj["disk_bytes_read"] = d.counters.disk_bytes_read;
      dj["disk_evictions"] = d.counters.disk_evictions;
      dj["disk_failures"] = d.counters.disk_failures;
      dj["disk_read_seconds"] = d.counters.disk_read_seconds;
      dj["prefill_seconds"] = d.prefill_seconds;
      dj["restore_seconds_per_token"] = d.restore_seconds_per_token;
      dj["recompute_seconds_per_token"] = d.recompute_seconds_per_token;
      dj["same_outputs"] = d.same_outputs;
      j["disk_pass"] = std::move(dj);
    } else {
      j["disk_pass"] = nullptr;
    }
    arr.push_back(std::move(j));
  }
  return arr.dump(1);
}

void write_prefix_files(const std::string& dir, const std::vector<PrefixRunResult>& results) {
  io::write_file_atomic(dir + "/prefix.md", prefix_report_markdown(results));
  io::write_file_atomic(dir + "/prefix.json", prefix_results_json(results) + "\n");
}

}  // namespace kvcache::study
