// SPDX-License-Identifier: Apache-2.0
#include "kvcache/model/runner.h"

#include <cmath>
#include <utility>

#include "model/runner_core.h"

namespace kvcache {

double ScoreResult::perplexity() const {
  KV_CHECK_ARG(logprobs.defined() && logprobs.numel() > 0, "ScoreResult::perplexity: no log-probs");
  return std::exp(-logprobs.to(at::kDouble).mean().item<double>());
}

Runner::Runner(CausalLM model) : model_(std::move(model)) {}

const CausalLM& Runner::model() const { return model_; }

at::Tensor Runner::prefill(const std::vector<int64_t>& ids, CacheManager& cache,
                           int64_t chunk_size) const {
  return detail::prefill_with(model_, ids, cache, chunk_size);
}

at::Tensor Runner::decode_step(int64_t token, CacheManager& cache) const {
  detail::check_cache_fits(cache.config(), model_.config(), "Runner::decode_step");
  return detail::decode_step_with(model_, token, cache);
}

GenerationResult Runner::generate(const std::vector<int64_t>& prompt,
                                  const GenerationOptions& options, CacheManager& cache) const {
  return detail::generate_with(model_, prompt, options, cache);
}

ScoreResult Runner::score(const std::vector<int64_t>& ids, CacheManager& cache,
                          int64_t chunk_size) const {
  return detail::score_with(model_, ids, cache, chunk_size);
}

}  // namespace kvcache
