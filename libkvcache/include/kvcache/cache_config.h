// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cache_config.h
/// The configuration of a KV cache (CacheConfig) and what it measures (CacheStats).

#include <cstdint>
#include <functional>
#include <string>

#include "kvcache/types.h"

namespace kvcache {

/// Rotary embedding hook: rotates `x` in place — float32, row-major `[H, T, D]` (rows of H
/// heads at the same T tokens) — by `positions` int64 `[T]` (token t of every head by
/// positions[t]). Must be deterministic. A model's RoPE over at::Tensors becomes one through
/// kvcache::rope_from (kvcache/torch/rope.h); an engine without a framework uses
/// rotate_half_rope() or keys_already_rotated().
using RopeFn = std::function<void(float* x, int64_t heads, int64_t tokens, int64_t head_dim, const int64_t* positions)>;

/// The rotate-half RoPE of HF Llama/Qwen (and of model ABI v1) with base `theta`: for i < D/2,
/// inv_freq_i = 1 / theta^(2i/D) and angle = position · inv_freq_i in float32 (the steps of
/// HF's LlamaRotaryEmbedding; cos/sin are the C library's, which may differ from a
/// framework's vectorized ones in the last bit), then y_i = x_i·cos − x_{i+D/2}·sin,
/// y_{i+D/2} = x_{i+D/2}·cos + x_i·sin. D must be even (checked when called: InvalidArgument).
/// @throws InvalidArgument if theta is not finite and > 1.
RopeFn rotate_half_rope(double theta);

/// The hook of an engine that appends keys it has already rotated itself: leaves x as it is.
/// Valid with post-RoPE storage and policies that read no pre-RoPE queries (a configuration
/// that needs the RoPE table — kPreRoPE, kRerotate, Expected Attention — is then rejected by
/// validate(), since this hook is not a rotate-half RoPE).
RopeFn keys_already_rotated();

/// Default tokens per block (CacheConfig::block_tokens = 0). Measured in bench_attention /
/// bench_cache (docs/performance.md, "Block size"): 64 keeps the per-block work of the read
/// path small against its data, a decoded block in L1, and fragmentation under scattered
/// eviction low.
inline constexpr int64_t kDefaultBlockTokens = 64;

/// Configuration of a CacheManager. Call validate() (the constructor does).
struct CacheConfig {
  int64_t num_layers = 0;
  int64_t num_q_heads = 0;   ///< H_q; must be a multiple of num_kv_heads
  int64_t num_kv_heads = 0;  ///< H_kv
  int64_t head_dim = 0;      ///< D
  /// How K and V are stored: a cache scheme spec (kvcache/cache_scheme.h, make_cache_scheme).
  /// A quantizer spec ("fp32", "int4:g64", "fp8:e4m3", "had(int4)") is the trivial scheme:
  /// the same quantizer for K and V; registered schemes ("kivi:k2:v2:g32:r128",
  /// "had:k(kivi:k2:v2:g32:r128)") set per-K/V quantizers, rotations and residual windows.
  std::string scheme = "fp32";
  /// Which tokens are kept: an eviction policy spec with optional budget
  /// (kvcache/eviction_policy.h): "full", "window:w256", "sink:s4@50%", "h2o@50%",
  /// "random:seed7@50%", "snapkv@50%", "tova@50%", "pyramid@50%".
  std::string policy = "full";
  /// Full-precision residual window of the most recent tokens (0 = none), in [0, kMaxTokens]
  /// (spec.h), for schemes that take one (a plain quantizer spec); schemes with their own
  /// residual (KIVI) accept 0 or theirs.
  int64_t residual_length = 0;
  /// Tokens per storage block (per layer, stream and KV head), in [1, 4096]; 0 = the default:
  /// kDefaultBlockTokens raised to a multiple of the scheme's per-channel group size. An
  /// explicit value must be a multiple of every per-channel group size g (a per-channel
  /// group — KIVI keys, `:chan` — is stored as one block of g tokens).
  int64_t block_tokens = 0;
  /// Let attend() use the fused kernels (docs/performance.md, "Fused kernels"): one pass over
  /// each block as stored, on x86-64 CPUs with AVX-512 F/BW/VL/DQ, VNNI and VBMI, for fp16,
  /// bf16, fp8 and int8/4/2 blocks with post-RoPE keys. For integer keys they take q·k with q
  /// rounded to two int8 terms per 32 dims (one with kvcache::set_attention_query("int8"), as
  /// llama.cpp does), which moves scores by at most max|(q − q')·k̂|; false reads every block
  /// through the generic per-block path (q in float32).
  bool fused_attention = true;
  KeyStorage key_storage = KeyStorage::kPostRoPE;
  PositionMode position_mode = PositionMode::kOriginal;
  /// Full context length of the current request (prompt + max new tokens), used to
  /// resolve fractional budgets ("@50%"), in [0, kMaxTokens] (spec.h; 0 = unknown). Set per
  /// request via CacheManager::reset().
  int64_t context_length = 0;
  /// Rotary embedding of the model (required). Must be deterministic. With
  /// KeyStorage::kPreRoPE it must be the rotate-half RoPE of HF Llama/Qwen (checked).
  RopeFn rope;

  /// Builds the scheme (for every layer) and the policy and checks their layouts against
  /// head_dim and block_tokens: a config that validates runs.
  /// @throws InvalidArgument naming the bad field (and spec, in the words written).
  void validate() const;
  /// block_tokens resolved (0 → the default for this config's scheme).
  int64_t resolved_block_tokens() const;
  /// What block_tokens must be a multiple of: the lcm, in tokens, of the groups the scheme's
  /// key and value quantizers encode together along the tokens (1 when every stream is per
  /// token; 32 for `kivi:…:g32`, whose keys are per channel over groups of 32 tokens).
  /// @throws InvalidArgument if the scheme spec is unknown or does not fit head_dim.
  int64_t block_tokens_multiple() const;
};

/// Memory and token counters, measured from what is stored.
///
/// Per layer (CacheManager::tokens(l).stats) token counts are per KV head — the largest
/// head's when heads hold different numbers (head-wise budgets); totals (stats()) sum the
/// layers (token-layers); peaks are peaks of the totals.
///   - bytes_resident: the stored bytes of the live tokens — codes, scales, zeros and side
///     data of each live token (a per-channel group with any live token counts whole: a
///     group cannot be partially freed), full-precision residual and converted rows.
///   - bytes_reserved: the bytes of every block the cache holds (partly filled blocks and
///     the dead slots eviction leaves count whole): what the cache really occupies.
/// Host bookkeeping (block tables, explicit positions after a merge, liveness bits) is
/// excluded from both.
struct CacheStats {
  int64_t tokens_written = 0;        ///< tokens ever appended
  /// Tokens stored now, per layer the longest KV head's count (heads hold equal counts unless a
  /// head-wise policy, adakv or duo, makes them ragged: then bytes_resident is the measure of
  /// what they hold; a total is the sum over layers).
  int64_t tokens_resident = 0;
  int64_t tokens_resident_peak = 0;  ///< max of tokens_resident, sampled after every append/eviction
  int64_t bytes_resident = 0;        ///< live tokens' stored bytes now
  int64_t bytes_resident_peak = 0;   ///< max of bytes_resident, sampled likewise
  int64_t bytes_reserved = 0;        ///< bytes of the blocks held now
  int64_t bytes_reserved_peak = 0;   ///< max of bytes_reserved, sampled likewise
};

}  // namespace kvcache
