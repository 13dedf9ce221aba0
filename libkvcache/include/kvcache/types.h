// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file types.h
/// The tensor convention of libkvcache, stated once.
///
/// - K/V tensors: `[B, H_kv, T, D]` = [batch, num_kv_heads, seq_len, head_dim], like
///   Hugging Face `past_key_values`. Input dtypes float32/float16/bfloat16.
/// - Queries: `[B, H_q, T_q, D]`; query head `h` reads KV head `h / (H_q / H_kv)`.
/// - Attention probabilities: `[B, H_q, T_q, T_kv]`, float32, rows sum to 1.
/// - Positions: int64. Absolute token positions in the request.
/// - Memory is in bytes (`int64_t`), lengths in tokens, precision in bits/value.

#include <cstdint>

namespace kvcache {

/// Which axis a group of quantized values runs along.
enum class GroupAxis {
  kPerToken,    ///< groups of g consecutive values along head_dim (one token, one head)
  kPerChannel,  ///< groups of g consecutive tokens along seq_len (one channel, one head)
};

/// Whether cached keys are stored after or before the rotary embedding.
enum class KeyStorage {
  kPostRoPE,  ///< as serving engines do: keys rotated once at write time
  kPreRoPE,   ///< keys stored un-rotated and rotated on read (KVQuant, StreamingLLM re-rotation)
};

/// Which positions kept tokens carry after eviction.
enum class PositionMode {
  kOriginal,  ///< kept tokens keep their absolute positions (H2O, kvpress default)
  /// Kept tokens re-assigned contiguous cache positions (StreamingLLM); needs kPreRoPE. Each KV
  /// head's tokens end just before the layer's next position n (the longest head's count): a
  /// head of n_h tokens (head-wise budgets: adakv, duo) holds n − n_h .. n − 1, so the query at
  /// n sees its keys at the distances it would numbered alone (docs/cache-manager.md).
  kRerotate,
};

/// What a forward step just ran: it tells the cache (and its eviction policy) where the
/// request is. Passed to CacheManager::end_step().
enum class StepKind {
  kPrefill,     ///< a prompt chunk that is not the last one
  kPrefillEnd,  ///< the last chunk of the prompt (SnapKV / PyramidKV compress here)
  kDecode,      ///< one generated token
  /// A context-replay chunk (KVzip, arXiv 2505.23416): extra query tokens run over the cached
  /// context without being stored (CacheManager::begin_replay(), docs/cache-manager.md); not
  /// the last chunk of the replay.
  kReplay,
  kReplayEnd,  ///< the last chunk of a context replay (KVzip compresses here)
};

}  // namespace kvcache
