// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file memory.h
/// The KV-cache memory calculator of `kv_study memory` (methods b.0).
///
/// bytes = batch x layers x H_kv x head_dim x (bits_K + bits_V) / 8 per token, in two flavours:
///   - raw: code bits only, every token at the nominal width, no scales/zeros/residual — the
///     quantization deep-dive's convention (Llama-3-8B, 131,072 tokens: fp16 17.18 GB, 2-bit 2.15 GB);
///   - effective: what a cache stores: codes + per-group metadata (fp16 scale and zero per group of
///     g: + 32/g bits/value), the full-precision residual window (KIVI's R most recent tokens) and
///     per-tensor scales (fp8: one fp32 per layer for K and for V).
/// GB are decimal (1e9 bytes), MiB binary (2^20 bytes).

#include <cstdint>
#include <string>
#include <vector>

namespace kvcache::study {

/// The largest layer count, KV head count or head_dim the calculator accepts (10^6).
inline constexpr int64_t kMaxShapeField = 1000000;
/// The largest batch the calculator accepts (10^6 sequences).
inline constexpr int64_t kMaxBatch = 1000000;

/// The cache-relevant shape of a decoder.
struct ModelShape {
  std::string name;
  int64_t num_layers = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
};

/// "qwen2.5-0.5b", "qwen2.5-7b", "llama-3-8b".
std::vector<std::string> model_shape_presets();
/// @throws InvalidArgument listing the presets.
ModelShape model_shape_preset(const std::string& name);
/// Reads a Hugging Face config.json (num_hidden_layers, num_attention_heads,
/// num_key_value_heads (default: num_attention_heads), head_dim (default: hidden_size /
/// num_attention_heads)), each in [1, kMaxShapeField].
/// @throws InvalidArgument naming the file and the missing or out-of-range field.
ModelShape model_shape_from_config(const std::string& config_json_path);
/// A preset name, a config.json path, or a directory holding config.json.
ModelShape resolve_model_shape(const std::string& name_or_path);

/// Storage format of cached K and V, in bits per value.
struct KvFormat {
  std::string spec;
  double key_raw_bits = 16;    ///< code bits per key value (no metadata)
  double value_raw_bits = 16;  ///< code bits per value-cache value
  double key_bits = 16;        ///< effective bits per key value incl. per-group metadata
  double value_bits = 16;      ///< effective bits per value-cache value incl. metadata
  int64_t key_residual_tokens = 0;    ///< most recent keys kept in full precision (KIVI's R)
  int64_t value_residual_tokens = 0;  ///< most recent values kept in full precision
  double residual_bits = 16;   ///< bits per value of residual tokens (fp16)
  int64_t per_tensor_bytes = 0;  ///< per layer, for K and for V each (fp8: 4, one fp32 scale)
};

/// The storage format of `spec` (a CacheConfig::scheme value) for heads of `head_dim` values.
/// The spec is resolved as the CacheManager does (make_cache_scheme, kvcache/cache_scheme.h: a
/// quantizer spec for both K and V, or a scheme such as kivi:k2:v2:g32:r128 with per-stream
/// quantizers and fp16 residual windows; per-channel quantizers keep up to g recent tokens in
/// the residual; every layer's streams, see num_layers below),
/// then each stream's quantizer is measured: a sample tensor is quantized, raw bits = code
/// bytes x 8 / values, effective bits = Quantizer::bits_per_value(head_dim), per-tensor bytes =
/// whatever nbytes() holds beyond that (fp8:scaled's fp32 scale). The residual counts R tokens
/// for K and for V (methods b.0's approximation; KIVI's key residual really oscillates in [0, R)).
/// `num_layers`: the model's layers the scheme is resolved for (one KV head each); the bits
/// are the mean over those layers of each stream's raw and effective bits (a per-layer scheme
/// `layers(...)` must cover exactly num_layers), and every layer must keep the same residual.
/// @throws InvalidArgument for an unknown head or bad field (listing what is allowed), or a
///         per-layer scheme whose layers keep different residuals (naming the layers).
KvFormat kv_format(const std::string& spec, int64_t head_dim, int64_t num_layers = 1);

/// One memory figure.
struct MemoryEstimate {
  int64_t tokens = 0;
  int64_t batch = 0;
  double raw_bytes = 0;
  double effective_bytes = 0;
  double raw_bits_per_value = 0;        ///< mean over K and V, all tokens
  double effective_bits_per_value = 0;  ///< effective_bytes * 8 / values (incl. residual, per-tensor)
};

/// Memory of `tokens` cached tokens x `batch` sequences of `shape` in `format` (computed in
/// double: no overflow at any accepted size).
/// @throws InvalidArgument on shape fields outside [1, kMaxShapeField], tokens outside
///         [0, kMaxTokens] (spec.h) or batch outside [1, kMaxBatch].
MemoryEstimate estimate_kv_memory(const ModelShape& shape, const KvFormat& format, int64_t tokens,
                                  int64_t batch = 1);

/// "17.18 GB" (decimal, 2 decimals).
std::string format_gb(double bytes);
/// "16384.0 MiB" (binary, 1 decimal).
std::string format_mib(double bytes);

/// The `kv_study memory` table as Markdown: one row per (format, context) with bytes/token,
/// raw and effective GB and MiB, bits/value and the ratio to fp16.
std::string memory_table_markdown(const ModelShape& shape, const std::vector<KvFormat>& formats,
                                  const std::vector<int64_t>& contexts, int64_t batch);

}  // namespace kvcache::study
