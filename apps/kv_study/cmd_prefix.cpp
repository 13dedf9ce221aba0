// SPDX-License-Identifier: Apache-2.0
// `kv_study prefix`: the shared-prefix workloads (kvcache/study/prefix_workload.h), every arm
// with prefix sharing off and on, one table of what each lever saves alone and together.
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <memory>

#include "commands.h"
#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/study/arm.h"
#include "kvcache/study/prefix_workload.h"

namespace kv_study {

using namespace kvcache::study;


void add_prefix_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "prefix",
      "Shared-prefix workloads (system_prompt: one system prompt behind many concurrent requests; multiturn:\n"
      "sessions that re-send their history; fewshot: one instruction and a worked example behind many\n"
      "concurrent requests) over one block pool, every arm with prefix sharing off and on: accuracy, replies\n"
      "equal to the baseline arm's, peak pool bytes, prefill tokens computed, time and the prefix cache's\n"
      "counters (docs/study.md, \"Prefix sharing\").\n"
      "Example: kv_study prefix --configs fp32+full,int4+full,fp32+h2o@50%,int4+h2o@50% --out runs/prefix");
  auto model = std::make_shared<std::string>(kDefaultModel);
  auto configs = std::make_shared<std::string>("fp32+full,int4+full,fp32+h2o@50%,int4+h2o@50%");
  auto out = std::make_shared<std::string>();
  auto workloads = std::make_shared<int64_t>(3);
  auto requests = std::make_shared<int64_t>(8);
  auto block = std::make_shared<int64_t>(0);
  auto chunk = std::make_shared<int64_t>(64);
  auto seed = std::make_shared<int64_t>(static_cast<int64_t>(kDefaultSuiteSeed));
  auto threads = std::make_shared<int>(1);
  auto pool_mib = std::make_shared<double>(1024.0);
  auto when_full = std::make_shared<std::string>("preempt");
  auto disk_tier = std::make_shared<std::string>();
  auto disk_mib = std::make_shared<double>(0.0);
  cmd->add_option("--model", *model, "exported model (.pt)")->capture_default_str();
  cmd->add_option("--configs", *configs, "arms: a comma list, a file or an arm set (as `run`)")->capture_default_str();
  cmd->add_option("--out", *out, "directory for prefix.md and prefix.json (default: print only)");
  cmd->add_option("--workloads", *workloads, "workloads per family")->capture_default_str()->check(IntRange(1, 7));
  cmd->add_option("--requests", *requests, "requests behind each system prompt and each few-shot prefix")
      ->capture_default_str()
      ->check(IntRange(1, 14));
  cmd->add_option("--block-tokens", *block,
                  "tokens per pool block (the sharing granularity); 0: 16, rounded up per arm to a multiple of its "
                  "quantizer's token groups (32 for KIVI's g32)")
      ->capture_default_str()
      ->check(IntRange(0, 4096));
  cmd->add_option("--prefill-chunk", *chunk, "prompt tokens per prefill step (0: whole prompt)")
      ->capture_default_str()
      ->check(IntRange(0, kvcache::kMaxTokens));
  cmd->add_option("--seed", *seed, "suite seed the workloads are built from")
      ->capture_default_str()
      ->check(IntRange(0, INT64_MAX));
  cmd->add_option("--pool-mib", *pool_mib,
                  "capacity of each run's block pool in MiB (a small one shows the pool-full path: requests preempted "
                  "or refused, counted in the table)")
      ->capture_default_str()
      ->check(NumberRange(1.0 / 1024.0, 1024.0 * 1024.0));  // finite: NaN passes CLI::Range
  cmd->add_option("--when-full", *when_full,
                  "what a request that does not fit does: preempt (the newest request yields, vLLM's order) or "
                  "refuse (the request that needs room ends)")
      ->capture_default_str()
      ->check(CLI::IsMember({"preempt", "refuse"}));
  auto* disk_opt = cmd->add_option(
      "--disk-tier", *disk_tier,
      "directory for a disk tier under each sharing run's pool (created if missing): reclaimed prefix pages spill "
      "there, and each sharing run is followed by a second pass restored from it; the report's disk table shows "
      "hits by tier and restore against recompute time (docs/cache-manager.md, \"Disk tier\")");
  auto* disk_mib_opt =
      cmd->add_option("--disk-mib", *disk_mib, "bytes the disk tier's files may take, in MiB (with --disk-tier)")
          ->check(NumberRange(1.0 / 1024.0, 1024.0 * 1024.0));  // finite: NaN passes CLI::Range
  disk_opt->needs(disk_mib_opt);
  disk_mib_opt->needs(disk_opt);
  cmd->add_option("--threads", *threads, "LibTorch intra-op threads")
      ->capture_default_str()
      ->check(IntRange(1, kMaxThreads));
  cmd->callback([=] {
    struct stat st {};
    if (*model == kDefaultModel && ::stat(model->c_str(), &st) != 0) {
      throw kvcache::InvalidArgument(std::string("the default model '") + kDefaultModel +
                                     "' is not in this checkout (docs/default-model.md); pass --model M.pt");
    }
    const std::vector<Arm> arms = parse_arm_list(*configs);
    // The arms' specs (budgets included) are checked before the model loads; what depends on
    // the model (block sizes, head shapes) is checked by canonicalize() below.
    for (const Arm& a : arms) {
      (void)kvcache::make_cache_scheme(a.scheme);
      (void)kvcache::make_eviction_policy(a.policy);
    }
    PrefixRunOptions po;
    po.model_path = *model;
    po.threads = *threads;
    po.block_tokens = *block;
    po.prefill_chunk = *chunk;
    po.pool_bytes = static_cast<int64_t>(*pool_mib * 1024.0 * 1024.0);
    po.when_full = *when_full == "refuse" ? kvcache::PoolFullRule::kRefuse : kvcache::PoolFullRule::kPreemptNewest;
    if (!disk_tier->empty()) {
      po.disk_tier_dir = *disk_tier;
      po.disk_tier_bytes = std::max<int64_t>(1, static_cast<int64_t>(*disk_mib * 1024.0 * 1024.0));
    }
    const PrefixWorkloadRunner runner(po);
    std::vector<Arm> canon;
    for (const Arm& a : arms) canon.push_back(runner.canonicalize(a));
    const auto wls = generate_prefix_workloads(static_cast<uint64_t>(*seed), *workloads, *requests);
    // Every input is checked, and the output directory made, before the first run.
    if (!out->empty()) {
      KV_CHECK_ARG(::mkdir(out->c_str(), 0755) == 0 || (::stat(out->c_str(), &st) == 0 && S_ISDIR(st.st_mode)),
                   "cannot create directory '", *out, "'");
    }
    if (!disk_tier->empty()) {  // after --out: a tier inside it is fine
      KV_CHECK_ARG(::mkdir(disk_tier->c_str(), 0755) == 0 || (::stat(disk_tier->c_str(), &st) == 0 && S_ISDIR(st.st_mode)),
                   "--disk-tier: cannot create directory '", *disk_tier, "'");
    }
    std::vector<PrefixRunResult> results;
    for (const PrefixWorkload& w : wls) {
      for (const Arm& a : canon) {
        for (bool sharing : {false, true}) {
          results.push_back(runner.run(w, a, sharing));
          const PrefixRunResult& r = results.back();
          std::cerr << "kv_study prefix: " << w.id << " " << a.spec() << " sharing " << (sharing ? "on" : "off")
                    << ": " << r.passed << "/" << r.scored << " passed, computed " << r.computed_tokens << " of "
                    << r.prompt_tokens << " prompt tokens, peak pool " << r.peak_pool_bytes << " B, " << r.seconds
                    << " s";
          if (r.preempted + r.refused > 0) std::cerr << ", " << r.preempted << " preempted, " << r.refused << " refused";
          if (r.disk_pass) {
            std::cerr << "; from disk: " << r.disk_pass->counters.prompt_tokens_hit_disk << " tokens restored, "
                      << r.disk_pass->same_outputs << "/" << r.requests << " replies equal";
          }
          std::cerr << "\n";
        }
      }
    }
    const std::string md = prefix_report_markdown(results);
    std::cout << md;
    if (!out->empty()) {
      write_prefix_files(*out, results);
      std::cerr << "kv_study prefix: wrote " << *out << "/prefix.md and prefix.json\n";
    }
  });
}

}  // namespace kv_study
