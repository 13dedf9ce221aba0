// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file kvquant_quantizer.h (internal)
/// The stored form of one KVQuant stream of one layer (KVQuant, arXiv 2401.18079; the
/// `kvquant` cache scheme builds these from a calibration, kvcache/kvquant.h):
///   - keys (pre-RoPE): per channel, static — every token's channel d of head h is
///     normalised with the calibrated thresholds, y = (x − offset)/range; an entry strictly
///     outside [lower, upper] is an outlier (decode-time screening against the calibration);
///   - values: per token, dynamic — the kvquant_tail_count(D, p) largest and smallest entries
///     of the token's row are outliers (ties: lower index first), the rest normalised by
///     their own min/max (offset and range stored in fp16).
/// Dense entries are coded as the nearest of the layer's 2^b codebook centroids (an exact
/// midpoint goes to the lower one) and decoded through a LUT (with Q-Norm: the centroids'
/// affine renormalisation); outliers are kept as fp16 values with their channel index.
///
/// StoredLayout (per token, group_tokens = 1, per KV head), all in `codes`:
///   - bytes [0, P), P = ceil(D · b / 8): the D codes as one LSB-first bit stream (code j
///     occupies bits [b·j, b·j + b));
///   - C outlier slots of 4 bytes: uint16 channel index (little-endian; 0xFFFF = unused
///     slot), then the value's fp16 bits; slots in ascending channel order.
///   Keys: C = max(2, ceil(4 · D · (1 − p))) slots (four times the expected count, at least
///   2; the spec's `c` overrides) and no metadata; when more than C entries of a token fall outside their thresholds, the C
///   farthest outside (distance to the violated threshold; ties: lower channel) are kept
///   exactly and the others are clamped to the range (y = ±1) and coded densely.
///   Values: C = 2 · kvquant_tail_count(D, p) (always all used), and meta_count 1 with zeros:
///   scales = fp16 range, zeros = fp16 offset.
///   p = 1: no slots at all.

#include <memory>
#include <string>
#include <vector>

#include "kvcache/quantizer.h"

namespace kvcache::quant {

/// One stream of one layer: shared by its head quantizers.
struct KvquantStream {
  bool keys = true;
  int bits = 4;
  double sparsity = 1.0;    ///< p
  std::vector<float> lut;   ///< 2^bits centroids, ascending, normalised units: encode (nearest)
  /// What code j decodes to: lut[j], or with Q-Norm qnorm_scale · lut[j] + qnorm_shift (the
  /// codes are chosen against the centroids; the dequantised values are renormalised).
  std::vector<float> dec;
  int64_t num_heads = 0;    ///< H_kv (keys: thresholds per head)
  int64_t head_dim = 0;     ///< D
  /// Keys: outlier slots per token; -1 = the default rule max(1, ceil(2 · D · (1 − p))).
  int64_t key_slots = -1;
  std::vector<float> lower, upper;  ///< keys: [H_kv · D] calibrated thresholds
  std::string name;         ///< the scheme spec and the stream, for spec()
};

class KvquantQuantizer final : public Quantizer {
 public:
  /// Head `head`'s stored form (keys: its thresholds; values do not depend on the head).
  KvquantQuantizer(std::shared_ptr<const KvquantStream> stream, int64_t head);

  /// `<scheme spec>{keys|values, layer l, head h}`: names the stored form; not a registered
  /// quantizer spec (make_quantizer does not build it: the calibration lives in the scheme).
  std::string spec() const override;
  double bits_per_value(int64_t head_dim) const override;

  /// Outlier slots per token.
  int64_t capacity() const { return capacity_; }
  int64_t packed_bytes() const { return (s_->head_dim * s_->bits + 7) / 8; }

 protected:
  /// x must have D = the calibrated head_dim and H_kv = the calibrated heads (head i then
  /// uses head i's thresholds) or 1 (this quantizer's head).
  void check_input(const TensorView& x) const override;
  void do_quantize_into(const Input& in, QuantizedTensor& out) const override;
  void do_dequantize_into(const QuantizedTensor& q, float* out) const override;
  StoredLayout do_stored_layout(int64_t head_dim) const override;
  EncodeStatus do_encode(const float* x, int64_t groups, int64_t head_dim, float tensor_scale,
                         GroupBuffers out) const override;
  void do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float tensor_scale,
                 float* out) const override;

 private:
  /// One token row of head `h`: codes (code_bytes), and for values its fp16 range/offset.
  bool encode_row(const float* x, int64_t h, uint8_t* codes, uint16_t* scale, uint16_t* zero) const;
  void decode_row(const uint8_t* codes, int64_t h, const uint16_t* scale, const uint16_t* zero, float* out) const;

  std::shared_ptr<const KvquantStream> s_;
  int64_t head_;
  int64_t capacity_;
  int64_t tail_;  ///< values: outliers per tail
};

}  // namespace kvcache::quant
