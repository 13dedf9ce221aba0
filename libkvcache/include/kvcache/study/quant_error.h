// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file quant_error.h
/// The study seed's quantizer reconstruction-error table (bits/value, key and value relative
/// error) and the deep-dive's attention-error table, on K/V captured from a model or on a
/// synthetic layer with outlier key channels (`kv_study quant`).

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "kvcache/study/metrics.h"

namespace kvcache::study {

/// Reconstruction error of one quantizer spec on K and V.
struct ReconstructionResult {
  double bits_per_value = 0;  ///< Quantizer::bits_per_value(head_dim) (KIVI: mean of K and V)
  double key_rel_err = 0;     ///< ||K - K_hat||_F / ||K||_F pooled over all samples
  double value_rel_err = 0;
  double key_max_abs = 0;     ///< max |K - K_hat|
  double value_max_abs = 0;
  /// Attention error of the scheme itself (the deep-dive's "attention error" per arm): causal
  /// attention of each sample's queries over (K_hat, V_hat) against (K, V), relative Frobenius
  /// errors of the output and of the probabilities, the mean over samples (as
  /// scheme_attention_error). Keys a scheme stores before RoPE are rotated by `rope` first; NaN
  /// when no `rope` was given for such a scheme, or a sample's queries are not one per token.
  double attn_out_rel_err = std::nan("");
  double attn_prob_rel_err = std::nan("");
};

/// Applies the model's RoPE to pre-RoPE keys `[B, H_kv, T, D]` at positions 0 .. T-1.
using KeyRope = std::function<at::Tensor(const at::Tensor& k_pre)>;

/// Quantize-dequantize every sample's K and V with `quant` and measure the error (through
/// quantizer.h's reconstruction_error). `quant` is any CacheConfig::scheme value, resolved as the
/// CacheManager does: a quantizer spec for K and V, or a scheme such as kivi:k2:v2:g32:r128
/// (keys int<k>:g<G>:chan, values int<v>:g<G>; the residual window is not part of the
/// reconstruction error). Per-channel
/// quantizers see each sample's tokens cut to a multiple of their group size. `num_layers`: the
/// model's layer count the scheme is resolved for (a per-layer scheme `layers(...)` must cover
/// it); 0: one more than the highest sample layer.
/// @throws InvalidArgument for a bad spec, no samples, or samples shorter than one group.
ReconstructionResult measure_reconstruction(const std::string& quant, const std::vector<QkvSample>& samples,
                                            int64_t num_layers = 0, const KeyRope& rope = {});

/// The specs `kv_study quant` tabulates: every registered quantizer with default fields, then
/// int4/int2 with g32 per token and per channel, then KIVI-2 and KIVI-4 (g32, r128).
std::vector<std::string> default_quant_error_specs();

/// Markdown table "| quantizer | bits/value | key rel. error | value rel. error | key max abs | value max abs |"
/// of `specs` on `samples`. A spec that cannot be measured (malformed, or a layout that does
/// not fit the samples' head_dim or token count) throws — unless `skipped` is given: then it
/// is left out of the table and "<spec>: <reason>" appended to `*skipped`.
/// @throws InvalidArgument (or UnsupportedError) naming the first spec that fails, when
///         `skipped` is null.
std::string reconstruction_table_markdown(const std::vector<std::string>& specs, const std::vector<QkvSample>& samples,
                                          std::vector<std::string>* skipped = nullptr);

/// Markdown table of scheme_attention_error for the four granularities at `bits`.
std::string attention_table_markdown(const std::vector<QkvSample>& samples, const std::vector<int>& bits, int64_t group);

}  // namespace kvcache::study
