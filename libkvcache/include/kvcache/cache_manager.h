// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cache_manager.h
/// CacheManager: the KV cache that sits inside the forward pass. It quantizes on write,
/// applies an eviction policy under a token budget during prefill and decode, and measures
/// the bytes it really stores.
///
/// Protocol per forward step (a prefill chunk or one decode token), for each layer l:
///   1. `append(l, k_pre_rope, v, positions)`  — new tokens (keys are PRE-RoPE; the manager
///      rotates them through `CacheConfig::rope` when storing post-RoPE keys);
///   2. `get(l)`                               — K (post-RoPE), V and positions to attend over,
///      including the tokens just appended;
///   3. `observe_attention(l, probs)`          — only if `needs_attention()`;
/// then once per step `end_step()`, which runs the eviction plan and compacts.
///
/// Storage (docs/cache-manager.md): per layer, per stream (K, V) and per KV head, quantized
/// storage followed by a full-precision residual of the most recent tokens. Bytes are
/// measured from what is stored. get() reads a float32 compute view kept equal to the
/// dequantized stored form and updated incrementally (the analogue of a dequant-on-the-fly
/// attention kernel); it is not counted as resident memory.

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/eviction_policy.h"
#include "kvcache/types.h"

namespace kvcache {

namespace cache {
struct CacheManagerAccess;  // test/debug introspection (src/cache/cache_manager_access.h)
}  // namespace cache

/// Rotary embedding hook: x `[B, H, T, D]` float32, positions int64 `[T]` → rotated x.
using RopeFn = std::function<at::Tensor(const at::Tensor& x, const at::Tensor& positions)>;

/// Configuration of a CacheManager. Call validate() (the constructor does).
struct CacheConfig {
  int64_t num_layers = 0;
  int64_t num_q_heads = 0;   ///< H_q; must be a multiple of num_kv_heads
  int64_t num_kv_heads = 0;  ///< H_kv
  int64_t head_dim = 0;      ///< D
  /// Cache quantization: a quantizer spec used for both K and V ("fp32", "int4:g64",
  /// "fp8:e4m3"), or a cache scheme spec ("kivi:k2:v2:g32:r128") that sets per-K/V
  /// quantizers and the residual window.
  std::string quant = "fp32";
  /// Eviction policy spec with optional budget: "full", "window:w256", "sink:s4@50%",
  /// "h2o@50%", "random:seed7@50%", "snapkv@50%", "tova@50%".
  std::string policy = "full";
  /// Full-precision residual window of the most recent tokens (0 = none). Schemes such as
  /// KIVI set it themselves.
  int64_t residual_length = 0;
  KeyStorage key_storage = KeyStorage::kPostRoPE;
  PositionMode position_mode = PositionMode::kOriginal;
  /// Full context length of the current request (prompt + max new tokens), used to
  /// resolve fractional budgets ("@50%"). Set per request via CacheManager::reset().
  int64_t context_length = 0;
  /// Rotary embedding of the model (required). Must be deterministic.
  RopeFn rope;

  /// @throws InvalidArgument naming the bad field.
  void validate() const;
};

/// What `get(layer)` hands to attention.
struct LayerKV {
  at::Tensor k;          ///< `[B, H_kv, T_res, D]` float32, post-RoPE
  at::Tensor v;          ///< `[B, H_kv, T_res, D]` float32
  at::Tensor positions;  ///< `[H_kv, T_res]` int64: the position each key carries (for masks)
};

/// Memory and token counters. Bytes are measured from stored tensors (nbytes()).
/// Per layer, token counts are per KV head; totals (CacheManager::stats()) sum the layers
/// (token-layers). Bytes count every stored K/V tensor (codes, scales, zeros, side tensors,
/// full-precision residual) as numel × element size; they exclude the dequantized float32
/// compute view that get() returns and host bookkeeping (positions, liveness masks).
struct CacheStats {
  int64_t tokens_written = 0;       ///< tokens ever appended (per layer: per KV head)
  int64_t tokens_resident = 0;      ///< tokens stored now (per KV head)
  int64_t tokens_resident_peak = 0; ///< max of tokens_resident sampled after every append/eviction
  int64_t bytes_resident = 0;       ///< bytes stored now: codes + metadata + residual
  int64_t bytes_resident_peak = 0;  ///< max of bytes_resident sampled after every append/eviction
};

class CacheManager {
 public:
  /// @throws InvalidArgument if `config.validate()` fails or a spec does not parse.
  explicit CacheManager(CacheConfig config);
  ~CacheManager();
  CacheManager(CacheManager&&) noexcept;
  CacheManager& operator=(CacheManager&&) noexcept;

  const CacheConfig& config() const;

  /// Clears all layers and counters (incl. peak) for a new request of
  /// `context_length` tokens (prompt + max new tokens; resolves "@P%" budgets).
  void reset(int64_t context_length);

  /// Appends new tokens to layer `layer`.
  /// @param k  `[B, H_kv, T_new, D]` float32 PRE-RoPE keys
  /// @param v  `[B, H_kv, T_new, D]` float32 values
  /// @param positions int64 `[T_new]` absolute positions of the new tokens
  /// @throws InvalidArgument on wrong shape/dtype/layer (message names expected vs got)
  void append(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions);

  /// K/V/positions of everything resident in `layer` (dequantized, float32, post-RoPE),
  /// oldest first, including the tokens appended in the current step, in their stored form.
  /// The tensors are VIEWS into the manager's buffers (possibly non-contiguous): valid until
  /// the next append/end_step/reset; clone() to keep them. O(1).
  LayerKV get(int64_t layer) const;

  /// True if the policy consumes attention probabilities now (h2o, tova: always; snapkv:
  /// until the end of prefill). Query it every step.
  bool needs_attention() const;

  /// Attention probabilities of the current step's queries over `get(layer)`'s keys:
  /// `[B, H_q, T_q, T_res]` float32. Any number of query rows T_q (TOVA uses the last,
  /// SnapKV the last w over the prompt, H2O sums them all).
  /// @throws InvalidArgument if the shape does not match the layer's resident tokens.
  void observe_attention(int64_t layer, const at::Tensor& probs);

  /// Ends a forward step (a prefill chunk or a decode token): runs the eviction plan on
  /// every layer and compacts. `is_prefill_end` marks the last chunk of the prompt
  /// (SnapKV compresses there).
  /// @throws InvalidArgument if layers appended different token counts in this step, or a
  ///         policy lacks the attention it needs; CapacityError if a budget cannot hold the
  ///         policy's protected tokens.
  void end_step(bool is_prefill_end = false);

  /// Logical length: tokens seen by `layer` (== tokens_written per KV head).
  int64_t logical_length(int64_t layer) const;
  /// Physical length: tokens stored by `layer` now (per KV head).
  int64_t physical_length(int64_t layer) const;
  /// Position to give the next appended token of layer 0: the last written position + 1
  /// (= the logical length when positions start at 0 without gaps), or the physical length
  /// in PositionMode::kRerotate.
  int64_t next_position() const;
  /// Same for `layer` (layers differ only in kRerotate mode with layer-dependent budgets).
  int64_t next_position(int64_t layer) const;

  /// The eviction policy (budget, spec).
  const EvictionPolicy& policy() const;

  /// Totals over all layers (token counts summed over layers; peaks are peaks of the totals).
  CacheStats stats() const;
  /// Per-layer counters.
  CacheStats layer_stats(int64_t layer) const;

  /// Verifies internal invariants (lengths, sorted positions, residual rules, byte counters
  /// == nbytes() of the stored tensors, compute views == dequantized stored form). O(T·D):
  /// for tests and debugging. @throws InternalError describing the first violation.
  void check_invariants() const;

 private:
  friend struct cache::CacheManagerAccess;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvcache
