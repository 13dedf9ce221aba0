// SPDX-License-Identifier: Apache-2.0
// Placeholder until the model runner (CausalLM, Tokenizer, CacheManager) is merged: the
// integrator replaces this file with the evaluator over those pieces.
#include "kvcache/study/model_evaluator.h"

#include "kvcache/error.h"

namespace kvcache::study {

std::unique_ptr<ArmEvaluator> make_model_evaluator(const ModelEvaluatorOptions& options) {
  throw UnsupportedError("this build has no model runner yet (model '" + options.model_path +
                         "'); the model-free subcommands (memory, suite, quant, list, merge, report) work");
}

}  // namespace kvcache::study
