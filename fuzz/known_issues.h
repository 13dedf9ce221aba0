// SPDX-License-Identifier: Apache-2.0
#pragma once
// Faults the fuzzers found in code that is being reworked elsewhere (issue 16), so that CI stays
// green until each lands: a target skips the inputs that reach one. Each has a reproducer in
// fuzz/known/<target>/ and a ctest, fuzz.known.<target>.<file>, that runs it with the skips off
// (KVCACHE_FUZZ_KNOWN=1) and passes while the fault still reproduces. When a fix lands, that
// test fails: delete the skip here, move the reproducer into fuzz/corpus/<target>/ and drop its
// entry from fuzz/known/README.md.
#include <cstdlib>
#include <string>

#include "kvcache/spec.h"

namespace kvcache::fuzz {

/// KVCACHE_FUZZ_KNOWN=1: no skips (the known faults reproduce).
inline bool known_faults_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("KVCACHE_FUZZ_KNOWN");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

/// Issue 16, "Numbers out of range", budgets. True for a budget text ("1e300", "sink@1e300",
/// "window@7e-324%", ...) that reaches one of:
///  - K1: a token budget is accepted as any integer >= 1 and Budget::resolve casts it to int64
///    unchecked: for >= 2^63 tokens UBSan reports float-cast-overflow in spec.cpp, and
///    `kv_study generate --arm 'fp32+random@1e300'` dies with SIGSEGV.
///    Reproducers: fuzz/known/{budget,policy_spec,arm}/budget-past-int64*.
///  - K2: a percentage > 0 whose fraction (p / 100) underflows to 0 (e.g. '7e-324%') is accepted,
///    and the policy's canonical spec then prints it as '@0%', which the parser rejects: the spec
///    does not round-trip. Reproducer: fuzz/known/policy_spec/budget-percent-underflow.
inline bool skip_known_budget_fault(const std::string& text) {
  if (known_faults_enabled()) return false;
  try {
    const auto at = text.find('@');
    const Budget b = Budget::parse(at == std::string::npos ? text : text.substr(at + 1));
    if (b.kind == Budget::Kind::kTokens && !(b.value < 9223372036854775808.0)) return true;  // K1
    if (b.kind == Budget::Kind::kFraction && b.value == 0) return true;                        // K2
  } catch (const std::exception&) {
  }
  return false;
}

/// Issue 16, "Numbers out of range", arms. K3: a token budget of 1e15 or more prints in exponent
/// form with a '+' (Budget::to_string: "@1e+15"), so an arm carrying it — e.g. `--budget 1e19`
/// through with_budget(), or the canonical arm of a row — reads "fp32+h2o@1e+19", which
/// parse_arm rejects (more than one '+'): the arm does not round-trip. True for a policy spec
/// whose budget prints with a '+', and for K1 budgets. Reproducer:
/// fuzz/known/arm/budget-exponent-plus.
inline bool skip_known_arm_fault(const std::string& policy) {
  if (known_faults_enabled()) return false;
  if (skip_known_budget_fault(policy)) return true;
  try {
    return split_budget(policy).second.to_string().find('+') != std::string::npos;  // K3
  } catch (const std::exception&) {
    return false;
  }
}

/// Issue 16, "A configuration that validates must work". K4: a KIVI scheme with residual r=0
/// (`kivi:k2:v2:g32:r0`) passes validation, and the first append then throws InternalError
/// (block_list.cpp: "n % gt == 0 append of 16 tokens to format int2:g32:chan"): keys are
/// flushed per token although a per-channel group spans g tokens. True for a canonical cache
/// spec (make_cache_scheme(...)->spec()) of that form. Reproducer: fuzz/known/arm/kivi-r0.
inline bool skip_known_cache_fault(const std::string& canonical_quant) {
  if (known_faults_enabled()) return false;
  return canonical_quant.rfind("kivi:", 0) == 0 && canonical_quant.size() > 3 &&
         canonical_quant.compare(canonical_quant.size() - 3, 3, ":r0") == 0;  // K4
}

}  // namespace kvcache::fuzz
