// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file model_evaluator.h
/// The ArmEvaluator over a real exported model (CausalLM + Tokenizer/ChatTemplate +
/// CacheManager): what `kv_study run`, `generate` and `quant --model` use.

#include <cstdint>
#include <memory>
#include <string>

#include "kvcache/study/long_suite.h"
#include "kvcache/study/sweep.h"

namespace kvcache::study {

/// What the evaluator measures, exactly:
///  - run_task: the task's messages rendered by the model's chat template (ChatTemplate::detect),
///    encoded with special tokens parsed, greedy generation through a CacheManager built from
///    CausalLM::cache_config() with the arm's quant/policy (Runner::generate, prefill in
///    `prefill_chunk` steps), stopped at the model's EOS ids or `<|im_end|>`; the reply decoded
///    without special tokens. span_resident: the task span mapped to token positions (by encoding
///    the rendered text up to its ends), the fraction of those positions resident in every layer
///    and KV head at the end of the request.
///  - eval_text: the passage's ids; single pass = Runner::score in one step (quantization acts,
///    eviction cannot); streaming = token by token through Runner::decode_step (each position
///    sees only what the cache kept), which also yields the logits for KLD / top-1.
///  - capture_qkv: an unmanaged fp32 forward over the first `capture_tokens` passage tokens;
///    per layer q (post-RoPE), k (post-RoPE) and v.
struct ModelEvaluatorOptions {
  std::string model_path;        ///< exported model (.pt, model ABI v1) with its tokenizer
  int threads = 0;               ///< intra-op threads for LibTorch (0: leave as is)
  /// Evaluation passage of the perplexity/KLD rows; empty: filler_passage(passage_seed, text_tokens).
  std::string text;
  uint64_t passage_seed = 1234;
  int64_t text_tokens = 256;     ///< approximate length of the default passage (capped at the
                                 ///< model's max_position_embeddings)
  /// Prompt tokens per prefill step of run_task (0: the whole prompt in one step). Chunks let
  /// eviction act during a long prompt, so peak memory reflects the budget; SnapKV compresses at
  /// the end of the prompt whatever the chunk.
  int64_t prefill_chunk = 64;
  /// A cache snapshot run_task writes (kv_study generate --save-cache; docs/snapshot-format.md):
  /// the prompt but its last token is prefilled in one step (kPrefill), the cache is saved there
  /// with those token ids under CausalLM::fingerprint(), then the last prompt token ends the
  /// prompt (kPrefillEnd) and decoding goes on. Empty: no snapshot.
  std::string save_cache;
  /// A cache snapshot run_task restores instead of prefilling the tokens it holds (--load-cache):
  /// the prompt must start with them and be longer; the rest is prefilled in prefill_chunk
  /// steps. A run that restores the file --save-cache wrote for the same prompt and arm
  /// generates exactly what that run generated. Empty: none.
  /// run_task throws SnapshotError (kvcache/snapshot.h) when the file is refused (another model,
  /// arm, corrupt, …), InvalidArgument when the prompt does not start with its tokens.
  std::string load_cache;
  /// Tokens of the passage whose Q/K/V capture_qkv() returns.
  int64_t capture_tokens = 256;
  /// Layers whose Q/K/V capture_qkv() returns (empty: every layer).
  std::vector<int64_t> capture_layers;
};

/// Builds the evaluator for `options.model_path`.
/// @throws InvalidArgument if the model cannot be loaded; UnsupportedError where this build
///         lacks the model runner.
std::unique_ptr<ArmEvaluator> make_model_evaluator(const ModelEvaluatorOptions& options);

/// What the long suite needs of a model before any work: its position limit and a counter of
/// prompt tokens exactly as run_task renders and encodes a task.
struct ModelPromptInfo {
  int64_t max_position_embeddings = 0;  ///< 0 when the config has none
  PromptTokenCounter counter;
  /// For memory estimates: layers, query and KV heads, head_dim, vocabulary, and the bytes of
  /// every tensor the export holds (CausalLM::weight_bytes).
  int64_t layers = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0, weight_bytes = 0;
};

/// Loads `model_path` (its tokenizer and chat template) for ModelPromptInfo.
/// @throws InvalidArgument if the model cannot be loaded.
ModelPromptInfo model_prompt_info(const std::string& model_path);

}  // namespace kvcache::study
