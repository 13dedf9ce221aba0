// SPDX-License-Identifier: Apache-2.0
// Model-free subcommands: memory, suite, quant (synthetic), list.
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "commands.h"
#include "kvcache/error.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/quantizer.h"
#include "kvcache/registry.h"
#include "kvcache/spec.h"
#include "kvcache/study/arm.h"
#include "kvcache/study/memory.h"
#include "kvcache/study/model_evaluator.h"
#include "kvcache/study/quant_error.h"
#include "kvcache/study/long_suite.h"
#include "kvcache/study/task_suite.h"

namespace kv_study {

using namespace kvcache::study;

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto b = item.find_first_not_of(" \t");
    if (b == std::string::npos) continue;
    out.push_back(item.substr(b, item.find_last_not_of(" \t") - b + 1));
  }
  return out;
}

CLI::Validator IntRange(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) {
        try {
          (void)kvcache::parse_integer(text, "", lo, hi);
        } catch (const kvcache::InvalidArgument& e) {
          return std::string(e.what());
        }
        return std::string();
      },
      "INT in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", "IntRange");
}

CLI::Validator NumberRange(double lo, double hi) {
  std::ostringstream desc;
  desc << "NUMBER in [" << lo << ", " << hi << "]";
  return CLI::Validator(
      [lo, hi](std::string& text) {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        const bool number = !text.empty() && end == text.c_str() + text.size() &&
                            text.find_first_not_of("0123456789.-+eE") == std::string::npos;
        std::ostringstream os;
        if (!number) {
          os << "'" << text << "' is not a number (expected one in [" << lo << ", " << hi << "])";
        } else if (!(std::isfinite(v) && v >= lo && v <= hi)) {
          os << text << " is out of range [" << lo << ", " << hi << "]";
        }
        return os.str();
      },
      desc.str(), "NumberRange");
}

std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what, int64_t lo, int64_t hi) {
  std::vector<int64_t> out;
  for (const auto& item : split_list(text)) out.push_back(kvcache::parse_integer(item, what, lo, hi));
  return out;
}

namespace {

std::string format_number(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

}  // namespace

void add_memory_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "memory",
      "KV-cache memory calculator: raw bits (no scales/zeros, the quantization deep-dive's convention) and\n"
      "effective bytes (codes + per-group metadata + residual window), decimal GB and binary MiB.\n"
      "Example: kv_study memory --model llama-3-8b --context 131072 --quant fp16,int2");
  auto model = std::make_shared<std::string>("llama-3-8b");
  auto contexts = std::make_shared<std::string>("4096,32768,131072");
  auto quants = std::make_shared<std::string>("fp16,fp8,int8,int4,int2,kivi:k2:v2:g32:r128,kivi:k4:v4:g32:r128");
  auto batch = std::make_shared<int64_t>(1);
  cmd->add_option("--model", *model,
                  "preset (qwen2.5-0.5b, qwen2.5-7b, llama-3-8b), a Hugging Face config.json, or a directory holding one")
      ->capture_default_str();
  cmd->add_option("--context", *contexts, "context length(s) in tokens, comma-separated")->capture_default_str();
  cmd->add_option("--quant", *quants,
                  "cache scheme spec(s), comma-separated: any quantizer spec, or a scheme (kivi:k<b>:v<b>:g<G>:r<R>, "
                  "had(<spec>), layers(<scheme>*<n>;...); kv_study list)")
      ->capture_default_str();
  cmd->add_option("--batch", *batch, "sequences in the batch")->capture_default_str()->check(IntRange(1, kMaxBatch));
  cmd->callback([=] {
    const std::vector<int64_t> ctx = parse_int_list(*contexts, "--context", 0, kvcache::kMaxTokens);
    const ModelShape shape = resolve_model_shape(*model);
    std::vector<KvFormat> formats;
    for (const auto& q : split_list(*quants)) formats.push_back(kv_format(q, shape.head_dim, shape.num_layers));
    KV_CHECK_ARG(!formats.empty() && !ctx.empty(), "--quant and --context need at least one value each");
    std::cout << memory_table_markdown(shape, formats, ctx, *batch);
    std::cout << "\nraw: code bits only (deep-dive convention); effective: + fp16 scale/zero per group, "
                 "fp16 residual tokens, per-tensor scales. GB = 1e9 B, MiB = 2^20 B.\n";
  });
}

void add_suite_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "suite",
      "Write tasks as JSONL (one task per line: id, family, depth, context target, messages, answer, scoring rule,\n"
      "load-bearing span). Evaluation suites: --suite default|small (short tasks), --suite long (4k-32k tokens of the\n"
      "model's tokenizer: --model, --lengths, --reps). Training data: --count N (use seeds disjoint from the\n"
      "evaluation seed); with --suite long, the long families with their reply-to-prompt evidence.\n"
      "Examples: kv_study suite --suite small --out small.jsonl\n"
      "          kv_study suite --suite long --lengths 4k,8k --out long.jsonl\n"
      "          kv_study suite --seed 7 --count 50000 --min-context 64 --max-context 800 --out train.jsonl");
  auto suite = std::make_shared<std::string>("default");
  auto seed = std::make_shared<uint64_t>(kDefaultSuiteSeed);
  auto count = std::make_shared<int64_t>(-1);
  auto out = std::make_shared<std::string>();
  auto min_ctx = std::make_shared<int64_t>(-1);
  auto max_ctx = std::make_shared<int64_t>(-1);
  auto families = std::make_shared<std::string>();
  auto model = std::make_shared<std::string>();
  auto lengths = std::make_shared<std::string>("4k,8k,16k,32k");
  auto reps = std::make_shared<int64_t>(1);
  auto approx = std::make_shared<bool>(false);
  cmd->add_option("--suite", *suite, "task suite: default (222 tasks), small (20) or long (20 tasks per length and --reps)")
      ->capture_default_str()
      ->check(CLI::IsMember({"default", "small", "long"}));
  cmd->add_option("--seed", *seed, "generator seed")->capture_default_str()->check(IntRange(0, INT64_MAX));
  cmd->add_option("--model", *model,
                  "long suite: count tokens with this model's tokenizer and chat template (default " +
                      std::string(kDefaultLongModel) + "; approximate counts when it is absent and --model is not given)");
  cmd->add_flag("--approx-tokens", *approx,
                "long suite: fill prompts by the tokenizer-free estimate (approx_tokens) instead of a model's tokenizer");
  cmd->add_option("--lengths", *lengths, "long suite: prompt lengths in tokens, e.g. 4k,8k,16k")->capture_default_str();
  cmd->add_option("--reps", *reps, "long suite: repetitions (each: 8 needle depths + 2 tasks of each other family per length)")
      ->capture_default_str()
      ->check(IntRange(1, kMaxLongReps));
  auto* count_opt = cmd->add_option("--count", *count, "training-data mode: number of tasks (random lengths/depths/families)")
                        ->check(IntRange(0, kMaxTrainingTasks));
  cmd->add_option("--min-context", *min_ctx, "training mode: smallest context target, approx. tokens (default 64; long: 128)")
      ->check(IntRange(48, kMaxTrainingContext));
  cmd->add_option("--max-context", *max_ctx, "training mode: largest context target, approx. tokens (default 800; long: 1024)")
      ->check(IntRange(48, kMaxTrainingContext));
  cmd->add_option("--families", *families,
                  "training mode: comma list of families (default: all of the suite's; default suite: needle,multiturn,"
                  "instruction,summary; long: needle,multikey,multivalue,vartrack,aggregation,instruction,multiturn)");
  cmd->add_option("--out", *out, "output JSONL file ('-' for stdout)")->required();
  cmd->callback([=] {
    std::vector<kvcache::study::Task> tasks;
    const bool is_long = *suite == "long";
    if (count_opt->count() > 0) {
      std::vector<TaskFamily> fams;
      for (const auto& f : split_list(*families)) fams.push_back(parse_family(f));
      if (is_long) {
        LongTrainingOptions opt;
        if (*min_ctx >= 0) opt.min_context = *min_ctx;
        if (*max_ctx >= 0) opt.max_context = *max_ctx;
        opt.families = fams;
        tasks = generate_long_training_tasks(*seed, *count, opt);
      } else {
        TrainingOptions opt;
        if (*min_ctx >= 0) opt.min_context = *min_ctx;
        if (*max_ctx >= 0) opt.max_context = *max_ctx;
        opt.families = fams;
        tasks = generate_training_tasks(*seed, *count, opt);
      }
    } else if (is_long) {
      LongSuiteOptions opt;
      opt.lengths = parse_lengths(*lengths);
      opt.reps = static_cast<int>(*reps);
      const std::string m = model->empty() ? std::string(kDefaultLongModel) : *model;
      KV_CHECK_ARG(!(*approx && !model->empty()), "--approx-tokens and --model exclude each other");
      if (*approx) {
        // approx_prompt_tokens (LongSuiteOptions::counter left empty)
      } else if (!model->empty() || file_exists(m)) {
        const ModelPromptInfo info = model_prompt_info(m);
        check_lengths_fit(opt.lengths, 0, info.max_position_embeddings, m);
        opt.counter = info.counter;
      } else {
        std::cerr << "kv_study suite: " << m << " not found: lengths are approximate token counts "
                  << "(pass --model to count with a model's tokenizer)\n";
      }
      tasks = generate_long_suite(*seed, opt);
    } else {
      tasks = generate_suite(*suite, *seed);
    }
    if (*out == "-") {
      for (const auto& t : tasks) std::cout << task_to_json(t) << "\n";
    } else {
      write_tasks_jsonl(*out, tasks);
      std::cerr << "kv_study suite: wrote " << tasks.size() << " tasks to " << *out << "\n";
    }
  });
}

void add_quant_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "quant",
      "Quantizer tables without a sweep: reconstruction error (bits/value, key/value relative error) of every\n"
      "registered quantizer, and the attention error of the four K/V granularity schemes. On a synthetic attention\n"
      "layer with outlier key channels by default; on Q/K/V captured from a model with --model.");
  auto specs = std::make_shared<std::string>();
  auto model = std::make_shared<std::string>();
  auto tokens = std::make_shared<int64_t>(256);
  auto head_dim = std::make_shared<int64_t>(64);
  auto kv_heads = std::make_shared<int64_t>(2);
  auto q_heads = std::make_shared<int64_t>(14);
  auto outliers = std::make_shared<int64_t>(4);
  auto outlier_scale = std::make_shared<double>(8.0);
  auto seed = std::make_shared<uint64_t>(0);
  auto bits = std::make_shared<std::string>("2,4");
  auto group = std::make_shared<int64_t>(32);
  auto threads = std::make_shared<int>(0);
  cmd->add_option("--specs", *specs, "comma list of quantizer/scheme specs (default: every registered quantizer + variants)");
  cmd->add_option("--model", *model, "capture Q/K/V from this exported model instead of synthetic data");
  cmd->add_option("--threads", *threads, "LibTorch threads with --model (0: default)")->check(IntRange(0, kMaxThreads));
  cmd->add_option("--tokens", *tokens, "synthetic: tokens")->capture_default_str()->check(IntRange(1, 65536));
  cmd->add_option("--head-dim", *head_dim, "synthetic: head_dim")->capture_default_str()->check(IntRange(1, 4096));
  cmd->add_option("--kv-heads", *kv_heads, "synthetic: KV heads")->capture_default_str()->check(IntRange(1, 256));
  cmd->add_option("--q-heads", *q_heads, "synthetic: query heads (multiple of --kv-heads)")
      ->capture_default_str()
      ->check(IntRange(1, 1024));
  cmd->add_option("--outliers", *outliers, "synthetic: outlier key channels (at most --head-dim)")
      ->capture_default_str()
      ->check(IntRange(0, 4096));
  cmd->add_option("--outlier-scale", *outlier_scale, "synthetic: scale and offset of outlier channels")
      ->capture_default_str()
      ->check(NumberRange(-10000, 10000));
  cmd->add_option("--seed", *seed, "synthetic: seed")->capture_default_str()->check(IntRange(0, INT64_MAX));
  cmd->add_option("--bits", *bits, "attention-error bit widths in [1, 16], comma list")->capture_default_str();
  cmd->add_option("--group", *group, "attention-error min-max group size")
      ->capture_default_str()
      ->check(IntRange(1, 65536));
  cmd->callback([=] {
    // Every input is checked before anything is computed or printed.
    std::vector<int> b;
    for (int64_t x : parse_int_list(*bits, "--bits", 1, 16)) b.push_back(static_cast<int>(x));
    KV_CHECK_ARG(!b.empty(), "--bits needs at least one bit width");
    const bool explicit_specs = !specs->empty();
    const auto list = explicit_specs ? split_list(*specs) : default_quant_error_specs();
    KV_CHECK_ARG(!list.empty(), "--specs '", *specs, "' lists no spec");
    std::vector<QkvSample> samples;
    std::string source;
    if (!model->empty()) {
      ModelEvaluatorOptions opt;
      opt.model_path = *model;
      opt.threads = *threads;
      samples = make_model_evaluator(opt)->capture_qkv();
      source = "Q/K/V captured from " + *model + " (" + std::to_string(samples.size()) + " layers)";
    } else {
      samples = {synthetic_qkv(*seed, *q_heads, *kv_heads, *tokens, *head_dim, *outliers, *outlier_scale)};
      source = "synthetic layer: " + std::to_string(*q_heads) + " query / " + std::to_string(*kv_heads) +
               " KV heads, " + std::to_string(*tokens) + " tokens, head_dim " + std::to_string(*head_dim) + ", " +
               std::to_string(*outliers) + " outlier key channels (scale and offset " + format_number(*outlier_scale) + ")";
    }
    // A spec the user names must be measurable (else an error, exit 1); a default one that
    // does not fit these samples is left out with a note.
    std::vector<std::string> skipped;
    const std::string recon = reconstruction_table_markdown(list, samples, explicit_specs ? nullptr : &skipped);
    const std::string attn = attention_table_markdown(samples, b, *group);
    std::cout << "# Quantizer reconstruction error\n\n" << source << "\n\n" << recon;
    if (!skipped.empty()) std::cout << "\nLeft out (not measurable on these samples):\n";
    for (const auto& s : skipped) std::cout << "- " << s << "\n";
    std::cout << "\n# Attention error by K/V granularity (relative Frobenius error of softmax(qK^T/sqrt(d))V and of the "
                 "probabilities; asymmetric min-max groups of "
              << *group << ")\n\n"
              << attn;
  });
}

void add_list_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("list", "List registered quantizers, eviction policies, cache schemes, the default arms and the arm sets.");
  cmd->callback([] {
    // One registry (kvcache/registry.h), printed kind by kind in registration order.
    const auto specs = kvcache::registered_specs();
    auto print = [&](kvcache::SpecKind kind, const char* title) {
      std::cout << title << "\n\n";
      for (const auto& s : specs) {
        if (s.kind == kind) std::cout << kvcache::describe(s.table) << "\n";
      }
    };
    print(kvcache::SpecKind::kQuantizer,
          "# Quantizers (spec: head(:field)*; each is also a cache scheme: the same quantizer for K and V)");
    print(kvcache::SpecKind::kCacheScheme,
          "# Cache schemes (CacheConfig::scheme, the part of an arm before '+'; a wrapper is head(:field)*(spec))");
    print(kvcache::SpecKind::kPolicy,
          "# Eviction policies (spec: head(:field)*[@budget]; budget @N tokens or @P% of prompt + max new tokens)");
    std::cout << "# Default arms of kv_study run (scheme+policy)\n\n";
    for (const auto& a : default_arms()) std::cout << "  " << a.spec() << "\n";
    std::cout << "\n# Arm sets (kv_study run --configs NAME)\n";
    for (const auto& set : arm_sets()) {
      std::cout << "\n" << set.name << " — " << set.description << "\n";
      if (set.name == "default") {
        std::cout << "  (the default arms above)\n";
        continue;
      }
      for (const auto& a : set.arms) std::cout << "  " << a.spec() << "\n";
    }
    std::cout << "\n# Task families\n\n";
    for (auto f : all_families()) std::cout << "  " << to_string(f) << "\n";
  });
}

}  // namespace kv_study
