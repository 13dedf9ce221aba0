// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file kv_stream.h
/// KVStream: the stored form of one stream (keys or values) of one layer, all KV heads.
/// Per head: quantized storage (QuantStore) followed by a full-precision residual of the most
/// recent tokens (TokenBuffer), oldest first. Heads may hold different tokens after
/// eviction, and therefore different quantized/residual splits; the total is the same.

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cache/cache_scheme.h"
#include "cache/quant_store.h"
#include "cache/token_buffer.h"
#include "kvcache/quantizer.h"

namespace kvcache::cache {

class KVStream {
 public:
  KVStream(StreamSpec spec, const Quantizer& quantizer, StoreLayout layout, int64_t num_heads,
           int64_t head_dim);

  struct PushResult {
    /// Stored form of the new tokens right after they were written (residual rounding or
    /// dequantized codes): `[B, H, n, D]` float32.
    at::Tensor new_values;
    /// Per head: earlier rows whose stored form changed (flushed from the residual).
    std::vector<std::vector<ViewUpdate>> updates;
  };
  /// Writes `x` `[B, H, n, D]` float32 and applies the residual flush rule.
  PushResult push(const at::Tensor& x);

  /// Removes `drops[h]` (sorted indices into head h's tokens; the same count per head).
  /// Returns per head the rows whose stored values changed (post-removal indices).
  std::vector<std::vector<ViewUpdate>> drop(const std::vector<std::vector<int64_t>>& drops);

  int64_t size() const;  ///< tokens per head
  int64_t quantized_tokens(int64_t h) const { return stores_[static_cast<size_t>(h)]->size(); }
  int64_t residual_tokens(int64_t h) const { return residual_[static_cast<size_t>(h)].size(); }
  /// Residual rows of head h: `[B, 1, r, D]` in the residual dtype.
  at::Tensor residual(int64_t h) const { return residual_[static_cast<size_t>(h)].view(); }
  const QuantStore& store(int64_t h) const { return *stores_[static_cast<size_t>(h)]; }
  const StreamSpec& spec() const { return spec_; }
  const StoreLayout& layout() const { return layout_; }

  /// Bytes held now (counters).
  int64_t nbytes() const;
  /// Bytes recomputed from the stored tensors.
  int64_t measure_nbytes() const;
  /// Stored tokens of head h dequantized: `[B, 1, size(), D]` float32.
  at::Tensor dequantize_head(int64_t h) const;
  /// Checks the residual rule (block: r < R, sliding: r <= R). @throws InternalError.
  void check_residual_rule() const;

 private:
  /// Quantizes per-head row blocks `rows[h]` `[B, 1, m_h, D]` float32 and appends them;
  /// returns the dequantized values.
  /// `all`: the same rows as one `[B, H, m, D]` tensor when every head flushes m rows at
  /// once (may be undefined).
  struct Quantized {
    std::vector<at::Tensor> per_head;  ///< `[B, 1, m_h, D]` float32 (undefined: nothing)
    at::Tensor all;                    ///< `[B, H, m, D]` when quantized in one call
  };
  Quantized quantize_into_stores(const std::vector<at::Tensor>& rows,
                                 const at::Tensor& all = at::Tensor());
  /// Number of oldest residual tokens the flush rule moves out of a residual of `r` tokens.
  int64_t flush_count(int64_t r) const;

  StreamSpec spec_;
  const Quantizer& q_;
  StoreLayout layout_;
  int64_t num_heads_, head_dim_;
  int64_t batch_ = -1;
  std::vector<std::unique_ptr<QuantStore>> stores_;
  std::vector<TokenBuffer> residual_;
};

}  // namespace kvcache::cache
