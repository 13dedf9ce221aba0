// SPDX-License-Identifier: Apache-2.0
#pragma once
// A deterministic ArmEvaluator for sweep tests: outputs, cache stats, timings, log-probs and
// logits are pure functions of (arm, task), so reruns reproduce rows byte for byte.
#include <stdexcept>
#include <string>

#include "kvcache/error.h"
#include "kvcache/study/sweep.h"

namespace kvcache::study::testing {

/// Thrown by FakeEvaluator to simulate the process being killed (not a kvcache::Error, so the
/// sweep does not record it and stops).
struct Killed : std::runtime_error {
  Killed() : std::runtime_error("killed") {}
};

inline uint64_t fnv(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

class FakeEvaluator : public ArmEvaluator {
 public:
  int64_t kill_after = -1;  ///< throw Killed once this many items have been served
  int64_t served = 0;
  int64_t text_calls = 0;
  std::string capacity_error_quant;  ///< run_task throws CapacityError for arms with this quant

  std::string model_id() const override { return "fake-model@0001"; }

  Arm canonicalize(const Arm& arm) const override {
    KV_CHECK_ARG(arm.scheme != "bogus", "unknown quantizer 'bogus'");
    KV_CHECK(arm.scheme != "kivi:k2:v2:g64:r128", UnsupportedError, "g64 does not divide head_dim 32");
    Arm a = arm;
    if (a.scheme == "fp8:e4m3") a.scheme = "fp8";
    return a;
  }

  Generation run_task(const Arm& arm, const Task& task, QueryMode mode) override {
    tick();
    if (!capacity_error_quant.empty() && arm.scheme == capacity_error_quant) {
      throw CapacityError("budget too small for " + task.id);
    }
    // Query-agnostic rows hash differently (so the two modes' rows differ); aware rows hash as
    // before query modes existed.
    const bool agnostic = mode == QueryMode::kAgnostic && task.question.message >= 0;
    const uint64_t h = fnv(arm.spec() + "|" + task.id + (agnostic ? "|agnostic" : ""));
    Generation g;
    const bool pass = arm.spec() == "fp32+full" || h % 4 != 0;
    g.output = pass ? task.answer : "I do not know.";
    g.prompt_tokens = task.approx_tokens;
    g.generated_tokens = 5;
    const int64_t bytes_per_token = arm.scheme == "int4" ? 64 : 256;
    const bool evicting = arm.policy != "full";
    g.cache.tokens_written = g.prompt_tokens + 5;
    g.cache.tokens_resident = evicting ? g.cache.tokens_written / 2 : g.cache.tokens_written;
    g.cache.bytes_resident = g.cache.tokens_resident * bytes_per_token;
    g.cache.bytes_resident_peak = g.cache.bytes_resident + 10;
    g.prefill_seconds = 0.001 * static_cast<double>(h % 7 + 1);
    g.decode_seconds = 0.002 * static_cast<double>(h % 5 + 1);
    g.span_resident = evicting ? 0.5 : 1.0;
    g.question_tokens = agnostic ? 3 : 0;
    return g;
  }

  TextEval eval_text(const Arm& arm) override {
    ++text_calls;
    tick();
    TextEval t;
    const double shift = arm.spec() == "fp32+full" ? 0.0 : static_cast<double>(fnv(arm.spec()) % 100) / 1000.0;
    t.single_logprobs = at::full({20}, -2.0 - shift, at::kDouble);
    t.stream_logprobs = at::full({20}, -2.1 - 2 * shift, at::kDouble);
    t.stream_logits = at::arange(20 * 6, at::kFloat).reshape({20, 6}).remainder(7.0) * (1.0 + shift);
    t.cache.bytes_resident_peak = 1000;
    return t;
  }

  ReconstructionResult reconstruction(const std::string& quant) override {
    tick();
    ReconstructionResult r;
    r.bits_per_value = quant == "int4" ? 4.5 : quant == "fp8" ? 8.0 : 32.0;
    r.key_rel_err = quant == "int4" ? 0.1 : 0.0;
    r.value_rel_err = quant == "int4" ? 0.05 : 0.0;
    return r;
  }

  std::vector<QkvSample> capture_qkv() override { return {synthetic_qkv(1, 2, 1, 16, 8)}; }

 private:
  void tick() {
    if (kill_after >= 0 && served >= kill_after) throw Killed();
    ++served;
  }
};

}  // namespace kvcache::study::testing
