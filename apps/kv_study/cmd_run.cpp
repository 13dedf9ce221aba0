// SPDX-License-Identifier: Apache-2.0
// Sweep subcommands: run, merge, report, generate.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>

#include "commands.h"
#include "kvcache/attention.h"
#include "kvcache/error.h"
#include "kvcache/spec.h"
#include "kvcache/kvquant.h"
#include "kvcache/study/kvquant_calibrate.h"
#include "kvcache/study/model_evaluator.h"
#include "kvcache/study/progress.h"
#include "kvcache/study/report.h"
#include "kvcache/study/sweep.h"
#include "kvcache/study/long_suite.h"
#include "kvcache/study/task_suite.h"

namespace kv_study {

using namespace kvcache::study;

/// The evaluator for `path`, with a pointer to what to do when the default model is asked for
/// and this checkout has none (it is trained by tools/train_default_model.py, issue 6).
std::unique_ptr<ArmEvaluator> load_evaluator(const std::string& path, int threads, int64_t text_tokens) {
  ModelEvaluatorOptions mopt;
  mopt.model_path = path;
  mopt.threads = threads;
  if (text_tokens > 0) mopt.text_tokens = text_tokens;
  return load_evaluator(mopt);
}

std::unique_ptr<ArmEvaluator> load_evaluator(const ModelEvaluatorOptions& mopt) {
  const std::string& path = mopt.model_path;
  struct stat st {};
  if (path == kDefaultModel && ::stat(path.c_str(), &st) != 0) {
    throw kvcache::InvalidArgument(
        std::string("the default model '") + kDefaultModel +
        "' is not in this checkout (docs/default-model.md); pass --model M.pt (tools/export_torchscript.py exports a "
        "Hugging Face checkpoint), or run tools/main_job.sh, which studies TinyStories-656K from ../shared instead");
  }
  if (path == kDefaultLongModel && ::stat(path.c_str(), &st) != 0) {
    throw kvcache::InvalidArgument(std::string("the long-context default model '") + kDefaultLongModel +
                                   "' is not in this checkout (docs/long-model.md: tools/train_long_model.py trains "
                                   "it); pass --model M.pt");
  }
  return make_model_evaluator(mopt);
}

namespace {

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

void make_dirs(const std::string& dir) {
  std::string cur;
  for (size_t i = 0; i <= dir.size(); ++i) {
    if (i == dir.size() || dir[i] == '/') {
      if (!cur.empty() && !is_dir(cur)) {
        KV_CHECK_ARG(::mkdir(cur.c_str(), 0755) == 0 || is_dir(cur), "cannot create directory '", cur, "'");
      }
    }
    if (i < dir.size()) cur.push_back(dir[i]);
  }
}

namespace {

std::string dirname_of(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

}  // namespace

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

void check_lengths_fit(const std::vector<int64_t>& lengths, int64_t new_tokens, int64_t max_positions,
                       const std::string& model) {
  if (max_positions <= 0) return;
  for (int64_t len : lengths) {
    KV_CHECK_ARG(len + new_tokens <= max_positions, "length ", kvcache::study::length_label(len), " (", len,
                 " tokens", new_tokens > 0 ? " + " + std::to_string(new_tokens) + " new" : std::string(),
                 ") is beyond the positions of ", model, ": its max_position_embeddings is ", max_positions);
  }
}

void check_long_memory(const ModelPromptInfo& m, const std::string& path, const std::vector<int64_t>& lengths,
                       int64_t new_tokens, int64_t text_tokens) {
  const int64_t tokens = *std::max_element(lengths.begin(), lengths.end()) + new_tokens;
  // The fp32 cache of the longest request (the control: every other arm stores less), with the
  // blocks' slack; the prefill's attention scores (one chunk of 64 queries x H_q heads over every
  // key, probabilities and scores); the text rows' [N, V] logits of the control and of the arm;
  // LibTorch's activations of a prefill chunk are small beside these.
  const double cache = 2.0 * static_cast<double>(m.layers * m.kv_heads * m.head_dim) * 4.0 * static_cast<double>(tokens) * 1.1;
  const double scores = 2.0 * 64.0 * static_cast<double>(m.heads) * static_cast<double>(tokens) * 4.0;
  const double logits = 2.0 * static_cast<double>(text_tokens) * static_cast<double>(m.vocab) * 4.0;
  const double weights = static_cast<double>(m.weight_bytes);
  const double base = 300.0 * 1024 * 1024;  // the process: LibTorch and the library loaded, measured ~250 MiB
  const double total = cache + scores + logits + weights + base;
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGE_SIZE);
  const double machine = pages > 0 && page > 0 ? static_cast<double>(pages) * static_cast<double>(page) : 0.0;
  if (machine > 0 && total > machine) {
    const auto mib = [](double b) { return std::to_string(static_cast<int64_t>(b / (1024.0 * 1024.0))) + " MiB"; };
    throw kvcache::InvalidArgument(
        "the run's estimated peak memory, " + mib(total) + ", exceeds this machine's " + mib(machine) + " (" + path +
        " at " + std::to_string(tokens) + " tokens: fp32 cache " + mib(cache) + ", prefill scores " + mib(scores) +
        ", text-row logits " + mib(logits) + ", weights " + mib(weights) + ", process " + mib(base) +
        "); choose shorter --lengths or --text-tokens");
  }
}

std::string stem(const std::string& path) {
  std::string base = path.substr(path.rfind('/') == std::string::npos ? 0 : path.rfind('/') + 1);
  const auto dot = base.rfind('.');
  return dot == std::string::npos ? base : base.substr(0, dot);
}

namespace {

/// The results file of a run in `dir`: results.jsonl, or one per shard.
std::string results_path(const std::string& dir, const Shard& shard) {
  if (shard.count == 1) return dir + "/results.jsonl";
  return dir + "/results.shard" + std::to_string(shard.index) + "of" + std::to_string(shard.count) + ".jsonl";
}

void report_to(const std::string& results, const std::string& dir, const std::string& model_id,
               const std::string& control, bool print) {
  int64_t partial = 0;
  const auto rows = read_results(results, &partial);
  const Summary s = summarize(rows, model_id, control);
  write_summary_files(s, dir);
  if (print) std::cout << summary_markdown(s);
  std::cerr << "kv_study: wrote " << dir << "/summary.md, summary.json, summary.csv (" << rows.size() << " rows"
            << (partial ? ", 1 trailing partial line skipped" : "") << ")\n";
}

}  // namespace

/// Where the scheme `s` asks for `cal=auto` (the field, not a path that starts with "auto"):
/// the offsets of its "cal=auto" texts.
std::vector<size_t> auto_calibration_at(const std::string& s) {
  const std::string token = "cal=" + std::string(kvcache::kKvquantAutoCalibration);
  std::vector<size_t> at;
  for (size_t i = s.find(token); i != std::string::npos; i = s.find(token, i + 1)) {
    const size_t e = i + token.size();
    if (e == s.size() || s[e] == ':' || s[e] == ')' || s[e] == ';') at.push_back(i);
  }
  return at;
}

/// `cal=auto` in an arm's scheme (the KVQuant arms of `--configs deepdive`): the model's own
/// KVQuant calibration, fitted once per run directory with `kv_study calibrate`'s defaults
/// (2/3/4-bit codebooks, sparsity 0.99 and 1, the default calibration text disjoint from the
/// evaluation) into DIR/calibration/<model stem>.kvqcal (written atomically; a later run of
/// the same directory reuses it) and named in the arm by that path, so the rows record which
/// file their arm read. Call only when some arm asks for it.
void resolve_auto_calibration(std::vector<Arm>& arms, const std::string& dir, const std::string& model, int threads) {
  const std::string path = dir + "/calibration/" + stem(model) + ".kvqcal";
  if (!is_file(path)) {
    make_dirs(dir + "/calibration");
    std::cerr << "kv_study run: a KVQuant arm asks for cal=auto: calibrating " << model << " -> " << path << "\n";
    kvcache::study::KvquantCalibrateOptions o;
    o.model_path = model;
    o.threads = threads;
    kvcache::save_kvquant_calibration(kvcache::study::calibrate_kvquant(o), path);
  }
  const size_t token = std::string("cal=").size() + std::string(kvcache::kKvquantAutoCalibration).size();
  for (auto& a : arms) {
    const auto at = auto_calibration_at(a.scheme);
    for (auto i = at.rbegin(); i != at.rend(); ++i) a.scheme.replace(*i, token, "cal=" + path);  // back to front
  }
}

void add_run_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "run",
      "Run the sweep: every arm (scheme+policy) x every task, plus per-arm perplexity (single-pass and streaming),\n"
      "KLD and top-1 agreement vs the control, per-quantizer reconstruction error and the attention-error table.\n"
      "Each finished item is appended and fsync'd to OUT/results.jsonl; rerunning the same command resumes.\n"
      "Writes OUT/summary.md/json/csv and prints the tables (unsharded runs; after --shard use merge + report).\n"
      "Example: kv_study run --suite small --configs fp32+full,int4+h2o@50% --out runs/small");
  auto model = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto suite = std::make_shared<std::string>("default");
  auto lengths = std::make_shared<std::string>("4k,8k,16k");
  auto reps = std::make_shared<int64_t>(1);
  auto text_tokens = std::make_shared<int64_t>(0);
  auto tasks_file = std::make_shared<std::string>();
  auto seed = std::make_shared<uint64_t>(kDefaultSuiteSeed);
  auto configs = std::make_shared<std::string>();
  auto budget = std::make_shared<std::string>();
  auto budgets = std::make_shared<std::string>();
  auto shard = std::make_shared<std::string>("0/1");
  auto query_mode = std::make_shared<std::string>("aware");
  auto threads = std::make_shared<int>(2);
  auto no_text = std::make_shared<bool>(false);
  auto no_recon = std::make_shared<bool>(false);
  auto no_attn = std::make_shared<bool>(false);
  auto quiet = std::make_shared<bool>(false);
  cmd->add_option("--model", *model,
                  std::string("exported model (.pt); default ") + kDefaultModel + ", with --suite long " +
                      kDefaultLongModel);
  cmd->add_option("--out", *out, "output directory (default runs/<model stem>-<suite>)");
  cmd->add_option("--suite", *suite,
                  "task suite: default (222 tasks), small (20) or long (RULER-style families at --lengths: 20 tasks "
                  "per length and --reps; docs/study.md)")
      ->capture_default_str()
      ->check(CLI::IsMember({"default", "small", "long"}));
  cmd->add_option("--lengths", *lengths,
                  "long suite: prompt lengths in tokens of the model's tokenizer (4k, 8k, 16k, 32k; each within 1% "
                  "below its target)")
      ->capture_default_str();
  cmd->add_option("--reps", *reps, "long suite: repetitions (each: 8 needle depths + 2 of each other family per length)")
      ->capture_default_str()
      ->check(IntRange(1, kMaxLongReps));
  cmd->add_option("--text-tokens", *text_tokens,
                  "tokens of the perplexity/KLD passage (default 256; with --suite long 4096)")
      ->check(IntRange(2, kvcache::kMaxTokens));
  cmd->add_option("--seed", *seed, "suite seed")->capture_default_str()->check(IntRange(0, INT64_MAX));
  cmd->add_option("--tasks", *tasks_file, "read tasks from this JSONL file instead of --suite/--seed");
  cmd->add_option("--configs", *configs,
                  "arms: comma list, a file with one per line, or an arm set's name (default, evict2026, deepdive, long, rotation2025), "
                  "'scheme+policy' (e.g. int4+h2o@50%); default: the default arm set (kv_study list)");
  cmd->add_option("--budget", *budget, "override the budget of every evicting arm: tokens (256) or percent (25%)");
  cmd->add_option("--budgets", *budgets,
                  "ratio sweep: run every evicting arm at each of these budgets (e.g. 25%,50%,75%,87.5%; arms "
                  "with policy full run once); the report adds accuracy-vs-budget curves");
  cmd->add_option("--query-mode", *query_mode,
                  "aware: the question is in the prompt when SnapKV-like methods compress (the default); agnostic: "
                  "the context is compressed before the question is appended (the question follows as decode steps; "
                  "tasks without a question run as aware); both: each task row in both modes (docs/study.md)")
      ->capture_default_str();
  cmd->add_option("--shard", *shard, "run slice i of n (0-based): items with plan index % n == i")->capture_default_str();
  cmd->add_option("--threads", *threads, "LibTorch intra-op threads")
      ->capture_default_str()
      ->check(IntRange(1, kMaxThreads));
  cmd->add_flag("--no-text", *no_text, "skip the perplexity/KLD rows");
  cmd->add_flag("--no-recon", *no_recon, "skip the reconstruction-error rows");
  cmd->add_flag("--no-attn", *no_attn, "skip the attention-error rows");
  cmd->add_flag("--quiet", *quiet, "do not print the tables at the end");
  cmd->callback([=] {
    SweepOptions opt;
    const bool is_long = *suite == "long";
    const std::string model_path = !model->empty() ? *model : is_long ? kDefaultLongModel : kDefaultModel;
    opt.arms = configs->empty() ? (is_long ? parse_arm_list("long") : default_arms()) : parse_arm_list(*configs);
    if (!budget->empty() && !budgets->empty()) {
      throw kvcache::InvalidArgument("--budget '" + *budget + "' and --budgets '" + *budgets +
                                     "' exclude each other (one budget for every arm, or a sweep over several)");
    }
    if (!budget->empty()) opt.arms = with_budget(opt.arms, *budget);
    if (!budgets->empty()) opt.arms = with_budgets(opt.arms, *budgets);
    if (is_long && tasks_file->empty()) {
      // Refused before any work: a length the model has no positions for, a run the machine has no
      // memory for.
      LongSuiteOptions lo;
      lo.lengths = parse_lengths(*lengths);
      lo.reps = static_cast<int>(*reps);
      const std::string& m = model_path;
      if (m == kDefaultLongModel && !file_exists(m)) (void)load_evaluator(m, *threads, 0);  // the pointed error
      const ModelPromptInfo info = model_prompt_info(m);
      check_lengths_fit(lo.lengths, kLongMaxNewTokens, info.max_position_embeddings, m);
      lo.counter = info.counter;
      check_long_memory(info, m, lo.lengths, kLongMaxNewTokens, *text_tokens > 0 ? *text_tokens : kLongTextTokens);
      opt.tasks = generate_long_suite(*seed, lo);
    } else {
      opt.tasks = tasks_file->empty() ? generate_suite(*suite, *seed) : read_tasks_jsonl(*tasks_file);
    }
    opt.shard = Shard::parse(*shard);
    try {
      opt.query_modes = parse_query_modes(*query_mode);
    } catch (const kvcache::InvalidArgument& e) {
      throw kvcache::InvalidArgument(std::string("--query-mode: ") + e.what());
    }
    opt.text = !*no_text;
    opt.reconstruction = !*no_recon;
    opt.attention = !*no_attn;
    const std::string dir =
        out->empty() ? "runs/" + stem(model_path) + "-" + (tasks_file->empty() ? *suite : stem(*tasks_file)) : *out;
    // Every input is checked before the output directory or results file exists: a bad model,
    // arm or task list leaves nothing behind.
    auto evaluator = load_evaluator(model_path, *threads, *text_tokens > 0 ? *text_tokens : is_long ? kLongTextTokens : 0);
    SweepOptions pre = opt;  // the arms that need no calibration
    pre.arms.clear();
    for (const auto& a : opt.arms) {
      if (auto_calibration_at(a.scheme).empty()) pre.arms.push_back(a);
    }
    if (pre.arms.size() < opt.arms.size()) {
      // Those are checked first: a bad one leaves nothing behind, not even a calibration.
      if (pre.arms.empty()) pre.arms.push_back(control_arm());
      validate_sweep(*evaluator, pre);
      resolve_auto_calibration(opt.arms, dir, model_path, *threads);
    }
    validate_sweep(*evaluator, opt);
    make_dirs(dir);
    const std::string path = results_path(dir, opt.shard);
    ResultsStore store(path);
    if (store.repaired_bytes() > 0) {
      std::cerr << "kv_study: removed a partial last line (" << store.repaired_bytes() << " bytes) from " << path
                << " (interrupted write)\n";
    }
    const int64_t planned_arms = static_cast<int64_t>(opt.arms.size());
    std::cerr << "kv_study run: model " << evaluator->model_id() << ", " << planned_arms << " arms x " << opt.tasks.size()
              << " tasks" << (*query_mode == "aware" ? "" : " (query mode " + *query_mode + ")") << ", shard "
              << opt.shard.to_string() << ", attention kernels " << kvcache::attention_kernels() << " (query "
              << kvcache::attention_query() << ") -> " << path
              << "\n";
    Progress progress(std::cerr, ::isatty(::fileno(stderr)) != 0, /*total: set by run_sweep*/ 0);
    const auto st = run_sweep(*evaluator, opt, store, &progress);
    std::cerr << "kv_study run: " << st.executed << " items run, " << st.skipped << " already done, " << st.errors
              << " with errors; " << store.rows().size() << " rows in " << path << "\n";
    if (opt.shard.count == 1) {
      report_to(path, dir, evaluator->model_id(), evaluator->canonicalize(opt.control).spec(), !*quiet);
    } else {
      std::cerr << "kv_study run: shard done; combine with: kv_study merge " << dir << "/results.shard*of"
                << opt.shard.count << ".jsonl --out " << dir << "/results.jsonl && kv_study report " << dir << "\n";
    }
  });
}

void add_merge_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "merge",
      "Combine results files (e.g. shards) into one: one row per (arm, task, model), first occurrence wins,\n"
      "rows in plan order (the order of an unsharded run). Trailing partial lines are skipped.\n"
      "Example: kv_study merge runs/x/results.shard*of8.jsonl --out runs/x/results.jsonl");
  auto inputs = std::make_shared<std::vector<std::string>>();
  auto out = std::make_shared<std::string>();
  cmd->add_option("inputs", *inputs, "results files to merge")->required()->check(CLI::ExistingFile);
  cmd->add_option("--out", *out, "merged results file")->required();
  cmd->callback([=] {
    const auto st = merge_result_files(*inputs, *out);
    std::cerr << "kv_study merge: " << st.rows_in << " rows in, " << st.rows_out << " out, " << st.duplicates
              << " duplicates dropped, " << st.conflicts << " conflicting duplicates (first kept), " << st.partial_lines
              << " partial lines skipped -> " << *out << "\n";
  });
}

void add_report_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "report",
      "Regenerate summary.md/json/csv from a results file (or a run directory holding results.jsonl) and print the tables.");
  auto input = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto model_id = std::make_shared<std::string>();
  auto control = std::make_shared<std::string>("fp32+full");
  auto quiet = std::make_shared<bool>(false);
  cmd->add_option("input", *input, "results.jsonl or a run directory")->required();
  cmd->add_option("--out", *out, "directory for the summaries (default: next to the results)");
  cmd->add_option("--model-id", *model_id, "model to summarize when the results hold several");
  cmd->add_option("--control", *control, "control arm (canonical spec)")->capture_default_str();
  cmd->add_flag("--quiet", *quiet, "do not print the tables");
  cmd->callback([=] {
    const std::string results = is_dir(*input) ? *input + "/results.jsonl" : *input;
    const std::string dir = out->empty() ? dirname_of(results) : *out;
    make_dirs(dir);
    report_to(results, dir, *model_id, *control, !*quiet);
  });
}

void add_generate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "generate",
      "One arm, one prompt: greedy reply through the managed cache, then the cache statistics.\n"
      "Example: kv_study generate --arm int4+h2o@50% --prompt 'What is two plus two?'\n"
      "Query-agnostic: kv_study generate --arm snapkv@50% --prompt '<document>' --question 'Who wrote it?' "
      "--query-mode agnostic");
  auto model = std::make_shared<std::string>(kDefaultModel);
  auto arm = std::make_shared<std::string>("fp32+full");
  auto prompt = std::make_shared<std::string>();
  auto system = std::make_shared<std::string>("You are a helpful assistant.");
  auto max_new = std::make_shared<int64_t>(64);
  auto threads = std::make_shared<int>(2);
  auto question = std::make_shared<std::string>();
  auto query_mode = std::make_shared<std::string>("aware");
  cmd->add_option("--model", *model, "exported model (.pt)")->capture_default_str();
  cmd->add_option("--arm", *arm, "scheme+policy")->capture_default_str();
  cmd->add_option("--prompt", *prompt, "user message (with --question: the context it asks about)")->required();
  cmd->add_option("--question", *question,
                  "question appended to the user message after a blank line (the part --query-mode agnostic "
                  "feeds after the cache is compressed)");
  cmd->add_option("--query-mode", *query_mode,
                  "aware: the question is in the prompt when the policy compresses; agnostic: the context is "
                  "prefilled and compressed first, then the question (needs --question)")
      ->capture_default_str();
  cmd->add_option("--system", *system, "system message ('' for none)")->capture_default_str();
  cmd->add_option("--max-new-tokens", *max_new, "generation limit")
      ->capture_default_str()
      ->check(IntRange(1, kvcache::kMaxTokens));
  cmd->add_option("--threads", *threads, "LibTorch intra-op threads")
      ->capture_default_str()
      ->check(IntRange(1, kMaxThreads));
  auto save_cache = std::make_shared<std::string>();
  auto load_cache = std::make_shared<std::string>();
  cmd->add_option("--save-cache", *save_cache,
                  "write the cache to FILE as a snapshot (docs/snapshot-format.md): the prompt but its last token is "
                  "prefilled in one step and saved there, in the arm's stored form, with the model's fingerprint; "
                  "then the reply is generated as usual. The write is atomic (a temporary in FILE's directory, "
                  "renamed over FILE)")
      ->type_name("FILE");
  cmd->add_option("--load-cache", *load_cache,
                  "restore the snapshot FILE (written by --save-cache for this model and --arm) instead of "
                  "prefilling the prompt tokens it holds: the prompt must start with them; the rest is prefilled "
                  "and the reply generated. The same prompt and arm generate exactly the reply the saving run did")
      ->type_name("FILE");
  cmd->callback([=] {
    if (!save_cache->empty() && !load_cache->empty()) {
      throw kvcache::InvalidArgument("--save-cache '" + *save_cache + "' and --load-cache '" + *load_cache +
                                     "': give one of them (a run either saves its prompt's cache or restores one)");
    }
    if (!save_cache->empty()) {
      // Before the model runs: a directory that cannot take the file is an error now, not after the prefill.
      const auto slash = save_cache->rfind('/');
      const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : save_cache->substr(0, slash);
      if (is_dir(*save_cache)) {
        throw kvcache::InvalidArgument("--save-cache '" + *save_cache + "' is a directory; expected a file path");
      }
      if (!is_dir(dir)) {
        throw kvcache::InvalidArgument("--save-cache '" + *save_cache + "': directory '" + dir +
                                       "' does not exist; expected a file path in an existing directory");
      }
      if (::access(dir.c_str(), W_OK) != 0) {
        throw kvcache::InvalidArgument("--save-cache '" + *save_cache + "': directory '" + dir +
                                       "' is not writable (" + std::strerror(errno) + ")");
      }
    }
    if (!load_cache->empty() && !is_file(*load_cache)) {
      throw kvcache::InvalidArgument("--load-cache '" + *load_cache + "': " +
                                     (is_dir(*load_cache) ? "is a directory" : "no such file") +
                                     "; expected a snapshot written by --save-cache");
    }
    std::vector<QueryMode> modes;
    try {
      modes = parse_query_modes(*query_mode);
    } catch (const kvcache::InvalidArgument& e) {
      throw kvcache::InvalidArgument(std::string("--query-mode: ") + e.what());
    }
    if (modes.size() != 1) {
      throw kvcache::InvalidArgument("--query-mode: generate runs one mode, aware or agnostic (got '" + *query_mode +
                                     "'; 'both' is for kv_study run)");
    }
    if (modes[0] == QueryMode::kAgnostic && question->empty()) {
      throw kvcache::InvalidArgument(
          "--query-mode agnostic needs --question: the text asked after the context (--prompt) is compressed");
    }
    ModelEvaluatorOptions mopt;
    mopt.model_path = *model;
    mopt.threads = *threads;
    mopt.save_cache = *save_cache;
    mopt.load_cache = *load_cache;
    auto ev = load_evaluator(mopt);
    const Arm a = ev->canonicalize(parse_arm(*arm));
    kvcache::study::Task t;
    t.id = "generate";
    if (!system->empty()) t.messages.push_back({"system", *system});
    std::string user = *prompt;
    if (!question->empty()) {
      user += "\n\n";
      t.question.message = static_cast<int64_t>(t.messages.size());
      t.question.begin = static_cast<int64_t>(user.size());
      user += *question;
      t.question.end = static_cast<int64_t>(user.size());
    }
    t.messages.push_back({"user", user});
    t.max_new_tokens = *max_new;
    const Generation g = ev->run_task(a, t, modes[0]);
    std::cout << g.output << "\n";
    std::cerr << "arm " << a.spec() << " | prompt " << g.prompt_tokens << " tokens, generated " << g.generated_tokens
              << " | tokens written " << g.cache.tokens_written << ", resident " << g.cache.tokens_resident
              << " | KV bytes resident " << g.cache.bytes_resident << ", peak " << g.cache.bytes_resident_peak
              << " | prefill " << g.prefill_seconds << " s, decode " << g.decode_seconds << " s";
    if (modes[0] == QueryMode::kAgnostic) {
      std::cerr << " | query-agnostic: " << g.question_tokens << " question tokens fed after the compression";
    }
    if (!save_cache->empty()) std::cerr << " | cache of " << g.prompt_tokens - 1 << " prompt tokens saved to " << *save_cache;
    if (!load_cache->empty()) {
      std::cerr << " | restored " << g.restored_tokens << " prompt tokens from " << *load_cache << " in "
                << g.restore_seconds << " s, prefilled " << g.prompt_tokens - g.restored_tokens;
    }
    std::cerr << "\n";
  });
}

}  // namespace kv_study
