// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file quant_store.h
/// Quantized storage of ONE KV head of one stream (K or V) of one layer, oldest token first.
/// Two layouts, chosen by probing the quantizer once (probe_layout):
///
/// - GatherStore: the QuantizedTensor's codes/scales/zeros all carry the token axis at dim 2
///   (per-token formats: intN:gM, fp16, fp8 with per-group scales, ...). Tokens are appended
///   and evicted exactly, row by row, without requantization.
/// - GroupStore: anything else (per-channel groups that span tokens, e.g. KIVI keys
///   `intN:gG:chan`; formats with side tensors or packed layouts). Tokens are stored in
///   blocks quantized together (G tokens for per-channel formats). Evicting a token marks its
///   slot dead (the block's bytes stay: a group cannot be partially freed). A block whose
///   slots are all dead is freed; a block whose live tokens would take no more bytes in full
///   precision than the whole quantized block is converted to a full-precision block
///   (dequantized once, never requantized), so eviction never increases memory and
///   quantization error never compounds.

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "cache/token_buffer.h"
#include "kvcache/quantizer.h"

namespace kvcache::cache {

/// Rows `[start, start + n)` of a head whose stored (dequantized) values changed.
struct ViewUpdate {
  int64_t start = 0;
  at::Tensor values;  ///< `[B, 1, n, D]` float32
};

/// What probe_layout found out about a quantizer's QuantizedTensor layout.
struct StoreLayout {
  bool gatherable = false;  ///< token axis at dim 2 of codes/scales/zeros, heads at dim 1
  int64_t token_group = 1;  ///< GroupStore: tokens per block must be a multiple of this
};

/// Probes `q` with small tensors of head_dim `head_dim`. `token_group` = g for per-channel
/// formats (1 otherwise).
StoreLayout probe_layout(const Quantizer& q, int64_t head_dim, int64_t token_group);

class QuantStore {
 public:
  virtual ~QuantStore() = default;
  /// Live tokens.
  virtual int64_t size() const = 0;
  /// Bytes held (maintained counter).
  virtual int64_t nbytes() const = 0;
  /// Bytes recomputed from the stored tensors (QuantizedTensor::nbytes()), for invariants.
  virtual int64_t measure_nbytes() const = 0;
  /// Appends tokens quantized together; `q.shape` = `[B, 1, n, D]`.
  virtual void append(QuantizedTensor q) = 0;
  /// Removes live tokens `drops` (strictly increasing local indices). Returns rows whose
  /// stored values changed (GroupStore conversions to full precision), in post-removal indices.
  virtual std::vector<ViewUpdate> drop(const std::vector<int64_t>& drops) = 0;
  /// Everything live, dequantized: `[B, 1, size(), D]` float32.
  virtual at::Tensor dequantize_all() const = 0;
  /// Number of quantized blocks (GroupStore) or 0.
  virtual int64_t num_blocks() const { return 0; }
  /// Number of dead slots still held in quantized blocks.
  virtual int64_t dead_slots() const { return 0; }
};

/// Exact per-token storage in TokenBuffers.
class GatherStore final : public QuantStore {
 public:
  explicit GatherStore(const Quantizer& q) : q_(q) {}
  int64_t size() const override { return size_; }
  int64_t nbytes() const override;
  int64_t measure_nbytes() const override;
  void append(QuantizedTensor q) override;
  std::vector<ViewUpdate> drop(const std::vector<int64_t>& drops) override;
  at::Tensor dequantize_all() const override;

 private:
  QuantizedTensor as_tensor() const;
  const Quantizer& q_;
  std::string format_;
  std::vector<int64_t> shape_;  ///< [B, 1, ·, D]
  at::ScalarType dtype_ = at::kFloat;
  TokenBuffer codes_, scales_, zeros_;
  bool has_codes_ = false, has_scales_ = false, has_zeros_ = false;
  int64_t size_ = 0;
};

/// Block storage with dead slots (see file comment).
class GroupStore final : public QuantStore {
 public:
  GroupStore(const Quantizer& q, at::ScalarType fp_dtype) : q_(q), fp_dtype_(fp_dtype) {}
  int64_t size() const override { return size_; }
  int64_t nbytes() const override { return bytes_; }
  int64_t measure_nbytes() const override;
  void append(QuantizedTensor q) override;
  std::vector<ViewUpdate> drop(const std::vector<int64_t>& drops) override;
  at::Tensor dequantize_all() const override;
  int64_t num_blocks() const override;
  int64_t dead_slots() const override;

 private:
  struct Block {
    bool quantized = true;
    QuantizedTensor q;            ///< quantized block (all its slots)
    std::vector<uint8_t> alive;   ///< quantized: liveness per slot
    int64_t n_alive = 0;
    at::Tensor fp;                ///< full-precision block `[B, 1, n_alive, D]` (fp_dtype)
    int64_t bytes() const;
  };
  at::Tensor live_values(const Block& b) const;  ///< `[B, 1, n_alive, D]` float32
  const Quantizer& q_;
  at::ScalarType fp_dtype_;
  std::vector<Block> blocks_;
  int64_t size_ = 0;
  int64_t bytes_ = 0;
};

}  // namespace kvcache::cache
