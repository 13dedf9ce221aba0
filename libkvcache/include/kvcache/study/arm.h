// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file arm.h
/// An arm of the study: a cache scheme spec (kvcache/cache_scheme.h; a quantizer spec is the
/// trivial scheme) × an eviction policy spec, written "scheme+policy" (e.g. "int4+h2o@50%",
/// "kivi:k2:v2:g32:r128+full", "had(int4)+full").

#include <string>
#include <vector>

#include "kvcache/spec.h"

namespace kvcache::study {

struct Arm {
  std::string scheme = "fp32";  ///< cache scheme or quantizer spec (CacheConfig::scheme)
  std::string policy = "full";  ///< eviction policy spec with optional @budget (CacheConfig::policy)

  /// "scheme+policy".
  std::string spec() const { return scheme + "+" + policy; }
  bool operator==(const Arm& o) const { return scheme == o.scheme && policy == o.policy; }
  bool operator!=(const Arm& o) const { return !(*this == o); }
};

/// The control arm, "fp32+full": every Δ, KLD and memory ratio is relative to it.
Arm control_arm();

/// Parses "scheme+policy". A text without '+' is a policy if it has an '@budget' or its head is
/// a registered eviction policy (spec_kind(), kvcache/registry.h; then scheme = "fp32"),
/// otherwise a scheme (then policy = "full"). Surrounding whitespace is ignored.
/// Specs are not validated here (the evaluator canonicalizes them through the factories).
/// @throws InvalidArgument on an empty part or more than one '+'.
Arm parse_arm(const std::string& text);

/// The default sweep, in this order: the study seed's 12 (fp32, fp16, fp8:e4m3, int8, int4, int2
/// with full; fp32 with window@50%, sink@50%, h2o@50%, random@50%; int8+sink@50%;
/// int4+h2o@50%), then bf16, fp8:e5m2, kivi:k2:v2:g32:r128, kivi:k4:v4:g32:r128 (full),
/// fp32+snapkv@50%, fp32+tova@50%.
std::vector<Arm> default_arms();

/// A named, documented list of arms: `kv_study run --configs NAME`.
struct ArmSet {
  std::string name;
  std::string description;
  std::vector<Arm> arms;
};

/// The named arm sets, in `kv_study list` order:
///   - "default": default_arms();
///   - "evict2026": fp32+full, snapkv/h2o/tova@50% (the baselines), then at 50%: knorm, knorm:stream,
///     keydiff, keydiff:stream, expected, expected:stream, adakv:expected (kvpress's default
///     press), adakv:snapkv, adakv:h2o, adakv:knorm, duo:s16:r48, decode:i8:b4:expected and
///     decode:i8:b4:prefill:expected (docs/study.md says why these fields);
///   - "deepdive": the quantization deep-dive, all with full: fp32, int8, fp8:e4m3,
///     kivi:k4:v4:g32:r128, kivi:k2:v2:g32:r128, gear:b2:g32:s0.02:r2:loop3:nb64, int4, had(int4),
///     int2, had(int2), int3 (KVQuant's arms join after the kvquant branch merges).
std::vector<ArmSet> arm_sets();

/// `--configs`: if `text` names a readable file, one arm per line ('#' starts a comment, blank
/// lines ignored); else the arms of the arm set it names (arm_sets()); otherwise a
/// comma-separated list.
/// @throws InvalidArgument naming the entry (and file line) that does not parse, or if empty.
std::vector<Arm> parse_arm_list(const std::string& text);

/// `--budget B` ("256" tokens or "25%"): replaces the budget of every arm whose policy is not
/// "full" (adding one where the policy had none); a `perlayer(...)` policy keeps its runs' own
/// budgets. @throws InvalidArgument for a bad budget.
std::vector<Arm> with_budget(std::vector<Arm> arms, const std::string& budget);

/// `--budgets B1,B2,...` (the ratio sweep, e.g. "25%,50%,75%,87.5%"; each item as --budget):
/// every arm whose policy is not "full" once per budget, in the given budget order, each
/// arm's budgets together; arms with policy "full" once.
/// @throws InvalidArgument naming `budgets` and the item as written if an item is empty, is not
///         a budget, or appears twice (as text or as the same budget, "50%" and "50.0%").
std::vector<Arm> with_budgets(const std::vector<Arm>& arms, const std::string& budgets);

/// Removes later duplicates (same spec), keeping the first occurrence's position.
std::vector<Arm> dedupe(const std::vector<Arm>& arms);

}  // namespace kvcache::study
