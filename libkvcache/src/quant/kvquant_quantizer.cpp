// SPDX-License-Identifier: Apache-2.0
#include "quant/kvquant_quantizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kvcache/error.h"
#include "kvcache/kvquant.h"
#include "quant/simd.h"

namespace kvcache::quant {
namespace {

constexpr uint16_t kUnused = 0xFFFF;
constexpr float kHalfLimit = 65520.0f;  // |x| >= this rounds to ±Inf in fp16

uint16_t half_bits(float x) { return fp16_bits(x); }  // round to nearest even (as c10::Half)
float from_half(uint16_t b) { return fp16_to_float(b); }

int nearest(const std::vector<float>& c, float y) {
  int lo = 0;
  int hi = static_cast<int>(c.size()) - 1;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (y <= 0.5f * (c[static_cast<size_t>(mid)] + c[static_cast<size_t>(mid) + 1])) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

void put_code(uint8_t* p, int64_t j, int bits, uint32_t code) {
  const int64_t bit = j * bits;
  for (int i = 0; i < bits; ++i) {
    const int64_t b = bit + i;
    if ((code >> i) & 1u) p[b >> 3] = static_cast<uint8_t>(p[b >> 3] | (1u << (b & 7)));
  }
}

uint32_t get_code(const uint8_t* p, int64_t j, int bits) {
  const int64_t bit = j * bits;
  uint32_t c = 0;
  for (int i = 0; i < bits; ++i) {
    const int64_t b = bit + i;
    c |= static_cast<uint32_t>((p[b >> 3] >> (b & 7)) & 1u) << i;
  }
  return c;
}

void put_slot(uint8_t* slot, uint16_t idx, uint16_t value) {
  slot[0] = static_cast<uint8_t>(idx & 0xFF);
  slot[1] = static_cast<uint8_t>(idx >> 8);
  slot[2] = static_cast<uint8_t>(value & 0xFF);
  slot[3] = static_cast<uint8_t>(value >> 8);
}

}  // namespace

KvquantQuantizer::KvquantQuantizer(std::shared_ptr<const KvquantStream> stream, int64_t head)
    : s_(std::move(stream)), head_(head) {
  KV_INTERNAL_ASSERT(s_ && s_->lut.size() == (size_t{1} << s_->bits) && s_->dec.size() == s_->lut.size() &&
                         s_->head_dim >= 2 && s_->head_dim < 65535,
                     "bad KVQuant stream");
  KV_INTERNAL_ASSERT(head_ >= 0 && head_ < s_->num_heads, "KVQuant head ", head_, " of ", s_->num_heads);
  const double p = s_->sparsity;
  const int64_t d = s_->head_dim;
  if (s_->keys) {
    KV_INTERNAL_ASSERT(s_->lower.size() == static_cast<size_t>(s_->num_heads * d) && s_->upper.size() == s_->lower.size(),
                       "KVQuant key thresholds");
    tail_ = 0;
    capacity_ = p >= 1.0                ? 0
                : s_->key_slots >= 0 ? s_->key_slots
                                     : std::max<int64_t>(2, static_cast<int64_t>(std::ceil(4.0 * d * (1.0 - p) - 1e-9)));
    capacity_ = std::min<int64_t>(capacity_, d);
  } else {
    tail_ = kvquant_tail_count(d, p);
    capacity_ = 2 * tail_;
  }
}

std::string KvquantQuantizer::spec() const {
  return s_->name + "{" + (s_->keys ? "keys" : "values") + ", head " + std::to_string(head_) + "}";
}

double KvquantQuantizer::bits_per_value(int64_t head_dim) const {
  const double bytes = static_cast<double>((head_dim * s_->bits + 7) / 8 + 4 * capacity_) + (s_->keys ? 0.0 : 4.0);
  return bytes * 8.0 / static_cast<double>(head_dim);
}

void KvquantQuantizer::check_input(const TensorView& x) const {
  KV_CHECK_ARG(x.size(3) == s_->head_dim && (x.size(1) == s_->num_heads || x.size(1) == 1), "'", spec(),
               "': calibrated for [B, H_kv=", s_->num_heads, " (or 1), T, D=", s_->head_dim, "], got ",
               shape_str(x.sizes()));
}

StoredLayout KvquantQuantizer::do_stored_layout(int64_t head_dim) const {
  KV_CHECK_ARG(head_dim == s_->head_dim, "'", spec(), "': calibrated for head_dim ", s_->head_dim, ", got ", head_dim);
  StoredLayout l;
  l.axis = GroupAxis::kPerToken;
  l.group_tokens = 1;
  l.code_bytes = packed_bytes() + 4 * capacity_;
  l.meta_count = s_->keys ? 0 : 1;
  l.has_zeros = !s_->keys;
  l.meta_dtype = DType::kFloat16;
  return l;
}

bool KvquantQuantizer::encode_row(const float* x, int64_t h, uint8_t* codes, uint16_t* scale, uint16_t* zero) const {
  const int64_t d = s_->head_dim;
  const int bits = s_->bits;
  const int64_t pb = packed_bytes();
  std::memset(codes, 0, static_cast<size_t>(pb + 4 * capacity_));
  bool overflow = false;
  std::vector<int64_t> kept;  // outlier channels stored exactly
  if (s_->keys) {
    const float* lo = s_->lower.data() + h * d;
    const float* hi = s_->upper.data() + h * d;
    std::vector<std::pair<float, int64_t>> cand;  // (distance outside, channel)
    for (int64_t j = 0; j < d; ++j) {
      if (x[j] > hi[j]) cand.emplace_back(x[j] - hi[j], j);
      if (x[j] < lo[j]) cand.emplace_back(lo[j] - x[j], j);  // strict compares: exact thresholds stay dense
    }
    if (static_cast<int64_t>(cand.size()) > capacity_) {
      std::stable_sort(cand.begin(), cand.end(), [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
        return a.first > b.first;  // stable: ties keep the lower channel first
      });
      cand.resize(static_cast<size_t>(capacity_));
    }
    for (const auto& c : cand) kept.push_back(c.second);
    for (int64_t j = 0; j < d; ++j) {
      const float off = 0.5f * (hi[j] + lo[j]), rng = 0.5f * (hi[j] - lo[j]);
      const float y = rng > 0 ? std::min(1.0f, std::max(-1.0f, (x[j] - off) / rng)) : 0.0f;
      put_code(codes, j, bits, static_cast<uint32_t>(nearest(s_->lut, y)));
    }
  } else {
    kept = select_tails(x, d, 1, tail_);
    std::vector<char> out(static_cast<size_t>(d), 0);
    for (int64_t j : kept) out[static_cast<size_t>(j)] = 1;
    float mn = INFINITY, mx = -INFINITY;
    for (int64_t j = 0; j < d; ++j) {
      if (out[static_cast<size_t>(j)]) continue;
      mn = std::min(mn, x[j]);
      mx = std::max(mx, x[j]);
    }
    if (mn > mx) mn = mx = 0.0f;  // every entry an outlier (D = 2k): no dense range
    const float off_f = 0.5f * (mx + mn), rng_f = 0.5f * (mx - mn);
    overflow = overflow || !(std::fabs(off_f) < kHalfLimit) || !(std::fabs(rng_f) < kHalfLimit);
    *zero = half_bits(off_f);
    *scale = half_bits(rng_f);
    const float off = from_half(*zero), rng = from_half(*scale);
    for (int64_t j = 0; j < d; ++j) {
      const float y = rng > 0 ? std::min(1.0f, std::max(-1.0f, (x[j] - off) / rng)) : 0.0f;
      put_code(codes, j, bits, static_cast<uint32_t>(nearest(s_->lut, y)));
    }
  }
  std::sort(kept.begin(), kept.end());
  uint8_t* slots = codes + pb;
  for (int64_t i = 0; i < capacity_; ++i) {
    if (i < static_cast<int64_t>(kept.size())) {
      const float v = x[kept[static_cast<size_t>(i)]];
      overflow = overflow || !(std::fabs(v) < kHalfLimit);
      put_slot(slots + 4 * i, static_cast<uint16_t>(kept[static_cast<size_t>(i)]), half_bits(v));
    } else {
      put_slot(slots + 4 * i, kUnused, 0);
    }
  }
  return overflow;
}

void KvquantQuantizer::decode_row(const uint8_t* codes, int64_t h, const uint16_t* scale, const uint16_t* zero,
                                  float* out) const {
  const int64_t d = s_->head_dim;
  if (s_->keys) {
    const float* lo = s_->lower.data() + h * d;
    const float* hi = s_->upper.data() + h * d;
    for (int64_t j = 0; j < d; ++j) {
      const float off = 0.5f * (hi[j] + lo[j]), rng = 0.5f * (hi[j] - lo[j]);
      out[j] = s_->dec[get_code(codes, j, s_->bits)] * rng + off;
    }
  } else {
    const float off = from_half(*zero), rng = from_half(*scale);
    for (int64_t j = 0; j < d; ++j) out[j] = s_->dec[get_code(codes, j, s_->bits)] * rng + off;
  }
  const uint8_t* slots = codes + packed_bytes();
  for (int64_t i = 0; i < capacity_; ++i) {
    const uint8_t* sl = slots + 4 * i;
    const uint16_t idx = static_cast<uint16_t>(sl[0] | (sl[1] << 8));
    if (idx == kUnused) continue;
    out[idx] = from_half(static_cast<uint16_t>(sl[2] | (sl[3] << 8)));
  }
}

EncodeStatus KvquantQuantizer::do_encode(const float* x, int64_t groups, int64_t head_dim, float tensor_scale,
                                         GroupBuffers out) const {
  (void)tensor_scale;
  const int64_t cb = packed_bytes() + 4 * capacity_;
  EncodeStatus st;
  auto* sc = static_cast<uint16_t*>(out.scales);
  auto* zr = static_cast<uint16_t*>(out.zeros);
  for (int64_t g = 0; g < groups; ++g) {
    uint16_t s = 0, z = 0;
    st.overflow = encode_row(x + g * head_dim, head_, out.codes + g * cb, &s, &z) || st.overflow;
    if (!s_->keys) {
      sc[g] = s;
      zr[g] = z;
    }
  }
  return st;
}

void KvquantQuantizer::do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float tensor_scale,
                                 float* out) const {
  (void)tensor_scale;
  const int64_t cb = packed_bytes() + 4 * capacity_;
  const auto* sc = static_cast<const uint16_t*>(in.scales);
  const auto* zr = static_cast<const uint16_t*>(in.zeros);
  for (int64_t g = 0; g < groups; ++g) {
    decode_row(in.codes + g * cb, head_, s_->keys ? nullptr : sc + g, s_->keys ? nullptr : zr + g, out + g * head_dim);
  }
}

void KvquantQuantizer::do_quantize_into(const Input& in, QuantizedTensor& q) const {
  const TensorView& x = in.x;
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  const int64_t cb = packed_bytes() + 4 * capacity_;
  q.format = spec();
  q.shape = {B, H, T, D};
  q.dtype = in.dtype;
  q.side.clear();
  const int64_t n = B * H * T;
  q.codes = Buffer::zeros(DType::kUInt8, {n, cb});
  if (!s_->keys) {
    q.scales = Buffer::zeros(DType::kFloat16, {n, 1});
    q.zeros = Buffer::zeros(DType::kFloat16, {n, 1});
  } else {
    q.scales.reset();
    q.zeros.reset();
  }
  const auto* xp = static_cast<const float*>(x.data);
  uint8_t* cp = q.codes.data_as<uint8_t>();
  auto* sp = s_->keys ? nullptr : q.scales.data_as<uint16_t>();
  auto* zp = s_->keys ? nullptr : q.zeros.data_as<uint16_t>();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t h = H == 1 ? head_ : (r / T) % H;
    uint16_t s = 0, z = 0;
    const bool of = encode_row(xp + r * D, h, cp + r * cb, &s, &z);
    KV_CHECK_ARG(!of, "'", spec(), "': row ", r, " does not fit fp16 (an outlier or range of magnitude >= 65520)");
    if (sp != nullptr) {
      sp[r] = s;
      zp[r] = z;
    }
  }
}

void KvquantQuantizer::do_dequantize_into(const QuantizedTensor& q, float* op) const {
  const int64_t B = q.shape[0], H = q.shape[1], T = q.shape[2], D = q.shape[3];
  const int64_t cb = packed_bytes() + 4 * capacity_;
  const int64_t n = B * H * T;
  KV_CHECK_ARG(D == s_->head_dim && q.codes.numel() == n * cb && q.codes.dtype() == DType::kUInt8 &&
                   (s_->keys || (q.scales.numel() == n && q.zeros.numel() == n &&
                                 q.scales.dtype() == DType::kFloat16 && q.zeros.dtype() == DType::kFloat16)),
               "dequantize_into(q, out) [", spec(), "]: q's buffers do not hold ", n, " rows of ", cb,
               " code bytes (and fp16 scales/zeros) for shape ", shape_str(q.shape));
  const uint8_t* cp = q.codes.data_as<uint8_t>();
  const auto* sp = s_->keys ? nullptr : q.scales.data_as<uint16_t>();
  const auto* zp = s_->keys ? nullptr : q.zeros.data_as<uint16_t>();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t h = H == 1 ? head_ : (r / T) % H;
    decode_row(cp + r * cb, h, sp ? sp + r : nullptr, zp ? zp + r : nullptr, op + r * D);
  }
}

}  // namespace kvcache::quant
