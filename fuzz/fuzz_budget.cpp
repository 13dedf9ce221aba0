// SPDX-License-Identifier: Apache-2.0
// Token budgets: Budget::parse ("256", "50%"), to_string / parse round trip, resolve() for
// context lengths up to 2^62, and split_budget ("head:fields@budget").
#include <string>

#include "fuzz_util.h"
#include "known_issues.h"
#include "kvcache/spec.h"

using namespace kvcache;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 128) return 0;
  const std::string text(reinterpret_cast<const char*>(data), size);

  Budget b;
  if (!fuzz::skip_known_budget_fault(text) && fuzz::accepts("Budget::parse", [&] { b = Budget::parse(text); })) {
    KV_FUZZ_CHECK(b.kind != Budget::Kind::kNone, "Budget::parse", "'", text, "' parsed to no budget");
    const std::string printed = b.to_string();
    KV_FUZZ_CHECK(printed.size() > 1 && printed[0] == '@', "Budget::to_string", "'", printed, "'");
    Budget again;
    KV_FUZZ_CHECK(fuzz::accepts("Budget::parse(to_string)", [&] { again = Budget::parse(printed.substr(1)); }),
                  "Budget::parse", "'", printed, "' (printed from '", text, "') rejected");
    KV_FUZZ_CHECK(again.kind == b.kind && again.to_string() == printed, "Budget round trip", "'", text, "' -> '",
                  printed, "' -> '", again.to_string(), "'");
    for (int64_t context : {int64_t{0}, int64_t{1}, int64_t{3}, int64_t{1000}, int64_t{1} << 31, int64_t{1} << 62}) {
      fuzz::accepts("Budget::resolve", [&] {
        const int64_t t = b.resolve(context);
        KV_FUZZ_CHECK(t >= 1, "Budget::resolve", "'", text, "' for ", context, " tokens: ", t);
        if (b.kind == Budget::Kind::kFraction) {
          KV_FUZZ_CHECK(t <= context, "Budget::resolve", "'", text, "' for ", context, " tokens: ", t);
        }
      });
    }
  }

  fuzz::accepts("split_budget", [&] {
    const auto [head, budget] = split_budget(text);
    KV_FUZZ_CHECK(head.find('@') == std::string::npos, "split_budget", "'", text, "' -> head '", head, "'");
    (void)budget.to_string();
  });
  return 0;
}
