// SPDX-License-Identifier: Apache-2.0
// kv_study: measures how KV-cache compression (quantization, eviction) trades quality for
// memory. Thin CLI over kvcache::study (see docs/study.md).
#include <c10/util/Exception.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <new>

#include "commands.h"
#include "kvcache/attention.h"
#include "kvcache/error.h"
#include "kvcache/log.h"

namespace {

/// OpenMP threads that wait for work by sleeping, not spinning, unless the user chose
/// (OMP_WAIT_POLICY set). The model's matmuls (OpenBLAS) and the library's kernels open many
/// short parallel regions per token; spinning waiters on a machine whose cores other jobs
/// also use turn each region into a wait for a time slice: the small suite's int4 and fp32
/// arms took 54 s with 2 threads spinning, 4.8 s sleeping, 3.8 s on 1 thread, on the loaded
/// 2-core build machine (docs/performance.md, "OpenMP threads"). libgomp reads the variable
/// when it loads, before main, so the process runs itself again once with it set.
void prefer_passive_openmp_wait(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  if (setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
  execv("/proc/self/exe", argv);  // returns only on failure: carry on with the default policy
}

}  // namespace

int main(int argc, char** argv) {
  prefer_passive_openmp_wait(argv);
  CLI::App app{
      "kv_study — the KV-cache compression study of libkvcache.\n"
      "Runs a deterministic task suite and text metrics under every (quantizer x eviction policy) arm,\n"
      "writes crash-safe results.jsonl and summary.md/json/csv. See docs/study.md."};
  app.require_subcommand(1);
  // --log-level may come before or after the subcommand.
  app.fallthrough(true);
  app.add_option_function<std::string>(
         "--log-level", [](const std::string& level) { kvcache::set_log_level(kvcache::parse_log_level(level)); },
         "diagnostics of the library on stderr (`kvcache: warning: ...`): trace, debug, info, warn, error or off "
         "(default warn)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "off"}));
  kv_study::add_memory_command(app);
  kv_study::add_suite_command(app);
  kv_study::add_quant_command(app);
  kv_study::add_list_command(app);
  kv_study::add_run_command(app);
  kv_study::add_merge_command(app);
  kv_study::add_report_command(app);
  kv_study::add_generate_command(app);
  kv_study::add_prefix_command(app);
  kv_study::add_layers_command(app);
  kv_study::add_calibrate_command(app);
  // KVCACHE_FUSED_ISA picks the attention kernels, KVCACHE_ATTENTION_QUERY (exact or int8) their
  // query arithmetic for integer keys (the library reads no environment: the app passes them
  // on). A bad value is refused once parsing is done, before any subcommand runs (not as an
  // error row per task); --help still prints.
  app.parse_complete_callback([] {
    if (const char* isa = std::getenv("KVCACHE_FUSED_ISA")) kvcache::set_attention_kernels(isa, "KVCACHE_FUSED_ISA");
    if (const char* q = std::getenv("KVCACHE_ATTENTION_QUERY")) kvcache::set_attention_query(q, "KVCACHE_ATTENTION_QUERY");
  });
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const kvcache::Error& e) {
    std::cerr << "kv_study: error: " << e.what() << "\n";
    return 1;
  } catch (const c10::Error& e) {
    // A LibTorch error the library did not turn into a message of its own (a bug): one line,
    // without LibTorch's backtrace.
    std::cerr << "kv_study: unexpected LibTorch error: " << e.what_without_backtrace() << "\n";
    return 2;
  } catch (const std::bad_alloc&) {
    std::cerr << "kv_study: out of memory\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "kv_study: unexpected error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
