// SPDX-License-Identifier: Apache-2.0
// kv_study: measures how KV-cache compression (quantization, eviction) trades quality for
// memory. Thin CLI over kvcache::study (see docs/study.md).
#include <c10/util/Exception.h>

#include <iostream>
#include <new>

#include "commands.h"
#include "kvcache/error.h"
#include "kvcache/log.h"

int main(int argc, char** argv) {
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
