// SPDX-License-Identifier: Apache-2.0
// GEAR (arXiv 2403.05527): base quantizer + sparse outliers + low-rank residual per block of
// n_b tokens of one KV head (gear_quantizer.h has the semantics and the stored layout).
#include "quant/gear_quantizer.h"

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "kvcache/error.h"
#include "quant/cast_kernels.h"
#include "quant/checks.h"
#include "quant/int_quantizer.h"

namespace kvcache::quant {

namespace gear {

int64_t outliers_per_side(double sparsity, int64_t len) {
  return static_cast<int64_t>(std::floor(sparsity * static_cast<double>(len) / 2.0 + 1e-9));
}

void select_outliers(const float* x, int64_t n, int64_t stride, int64_t k, int64_t* idx) {
  KV_INTERNAL_ASSERT(k >= 0 && 2 * k <= n, "select_outliers: 2k = ", 2 * k, " > n = ", n);
  if (k == 0) return;
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  auto at = [&](int64_t i) { return x[i * stride]; };
  // The k largest: value descending, ties lowest index first.
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    return at(a) > at(b) || (at(a) == at(b) && a < b);
  });
  std::copy(order.begin(), order.begin() + k, idx);
  // The k smallest of the others: value ascending, ties lowest index first.
  std::partial_sort(order.begin() + k, order.begin() + 2 * k, order.end(), [&](int64_t a, int64_t b) {
    return at(a) < at(b) || (at(a) == at(b) && a < b);
  });
  std::copy(order.begin() + k, order.begin() + 2 * k, idx + k);
}

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

using MatF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic>;
using RowMatF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// The first `r` columns of Q of the Householder QR of `a` [rows, r].
MatF thin_q(const MatF& a) {
  Eigen::HouseholderQR<MatF> qr(a);
  return qr.householderQ() * MatF::Identity(a.rows(), a.cols());
}

}  // namespace

void low_rank(const float* e, int64_t m, int64_t n, int64_t r, int64_t loop, float* u, float* p) {
  KV_INTERNAL_ASSERT(r >= 1 && r <= std::min(m, n) && loop >= 1, "low_rank: r = ", r, " for [", m, ", ", n,
                     "], loop = ", loop);
  const Eigen::Map<const RowMatF> E(e, m, n);
  MatF P(n, r);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < r; ++j) {
      const uint64_t bits = splitmix64(0x6ea4ULL ^ static_cast<uint64_t>(i * r + j));
      P(i, j) = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);  // uniform [0, 1), 24 bits
    }
  }
  MatF U(m, r);
  for (int64_t it = 0; it < loop; ++it) {
    const bool last = it == loop - 1;
    if (last) P = thin_q(P);
    U.noalias() = E * P;
    if (last) U = thin_q(U);
    P.noalias() = E.transpose() * U;
  }
  Eigen::Map<RowMatF>(u, m, r) = U;
  Eigen::Map<RowMatF>(p, n, r) = P;
}

}  // namespace gear

namespace {

const char* stream_name(GearStream s) { return s == GearStream::kKey ? "keys" : "values"; }

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

/// fp16 bits `n` from `src` (float32) to the unaligned bytes `dst`; true on overflow.
bool store_fp16(const float* src, int64_t n, uint8_t* dst) {
  if (n == 0) return false;
  std::vector<uint16_t> h(static_cast<size_t>(n));
  const CastStatus s = cast_to_fp16(src, n, h.data());
  std::memcpy(dst, h.data(), static_cast<size_t>(n) * sizeof(uint16_t));
  return s.overflow;
}

void load_fp16(const uint8_t* src, int64_t n, float* dst) {
  if (n == 0) return;
  std::vector<uint16_t> h(static_cast<size_t>(n));
  std::memcpy(h.data(), src, static_cast<size_t>(n) * sizeof(uint16_t));
  fp16_to_fp32(h.data(), n, dst);
}

}  // namespace

GearQuantizer::GearQuantizer(const GearParams& p, GearStream stream, std::string scheme_spec,
                             const std::string& written, std::string role)
    : p_(p), stream_(stream), scheme_spec_(std::move(scheme_spec)), role_(std::move(role)) {
  const std::string& text = written.empty() ? scheme_spec_ : written;
  KV_CHECK_ARG(p_.block >= p_.group && p_.block % p_.group == 0, "cache scheme '", text,
               "': the block nb=", p_.block, " must be a positive multiple of the group size g=", p_.group,
               " (keys are quantized per channel in whole groups of g tokens of a block)");
  KV_CHECK_ARG(p_.rank >= 0 && p_.rank <= p_.block, "cache scheme '", text, "': rank r=", p_.rank,
               " exceeds the block's nb=", p_.block, " tokens");
  KV_CHECK_ARG(p_.stored() >= p_.rank && p_.stored() <= p_.block, "cache scheme '", text, "': prefill rank rp=",
               p_.stored(), " exceeds the block's nb=", p_.block, " tokens");
  KV_CHECK_ARG(p_.loop >= 1, "cache scheme '", text, "': loop=", p_.loop, " must be >= 1");
  KV_CHECK_ARG(p_.sparsity >= 0 && p_.sparsity < 1, "cache scheme '", text, "': s=", p_.sparsity,
               " must be in [0, 1)");
  KV_CHECK_ARG(p_.block <= 65536, "cache scheme '", text, "': nb=", p_.block,
               " exceeds 65536 (outlier token indices are uint16)");
  const GroupAxis axis = stream_ == GearStream::kKey ? GroupAxis::kPerChannel : GroupAxis::kPerToken;
  try {
    base_ = std::make_shared<IntQuantizer>(p_.bits, p_.group, axis);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(detail::str_cat("cache scheme '", text, "': its ", stream_name(stream_),
                                          " base quantizer fails: ", e.what()));
  }
}

std::string GearQuantizer::spec() const { return scheme_spec_ + " " + stream_name(stream_) + role_; }

int64_t GearQuantizer::per_side(int64_t head_dim) const {
  return gear::outliers_per_side(p_.sparsity, stream_ == GearStream::kKey ? p_.block : head_dim);
}

int64_t GearQuantizer::outliers_per_block(int64_t head_dim) const {
  return 2 * per_side(head_dim) * (stream_ == GearStream::kKey ? head_dim : p_.block);
}

GearQuantizer::Offsets GearQuantizer::offsets(int64_t d) const {
  const StoredLayout bl = base_->stored_layout(d);
  Offsets o;
  o.base_groups = p_.block / bl.group_tokens;
  o.base_meta = o.base_groups * bl.meta_count;
  o.per_side = per_side(d);
  o.n_out = outliers_per_block(d);
  o.rank = p_.rank;
  o.stored_rank = p_.stored();
  o.base_code = 0;
  o.out_vals = o.base_groups * bl.code_bytes;
  o.out_idx = o.out_vals + 2 * o.n_out;
  o.u = o.out_idx + 2 * o.n_out;
  o.p = o.u + 2 * p_.block * o.stored_rank;
  o.total = o.p + 2 * d * o.stored_rank;
  return o;
}

StoredLayout GearQuantizer::do_stored_layout(int64_t head_dim) const {
  const std::string where = "stored_layout(head_dim) [" + spec() + "]";
  StoredLayout bl;
  try {
    bl = base_->stored_layout(head_dim);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(where + ": the base quantizer '" + base_->spec() + "' fails: " + e.what());
  }
  KV_CHECK_ARG(p_.stored() <= head_dim, where, ": ", p_.stored() == p_.rank ? "rank r=" : "prefill rank rp=",
               p_.stored(), " exceeds head_dim D=", head_dim);
  KV_CHECK_ARG(head_dim <= 65536, where, ": head_dim D=", head_dim, " exceeds 65536 (outlier channel indices are uint16)");
  const Offsets o = offsets(head_dim);
  StoredLayout l;
  l.axis = GroupAxis::kPerChannel;  // a group spans n_b tokens
  l.group_tokens = p_.block;
  l.code_bytes = o.total;
  l.meta_count = o.base_meta;
  l.has_zeros = bl.has_zeros;
  l.meta_dtype = bl.meta_dtype;
  return l;
}

double GearQuantizer::bits_per_value(int64_t head_dim) const {
  const StoredLayout l = stored_layout(head_dim);
  return static_cast<double>(l.group_bytes()) * 8.0 / static_cast<double>(p_.block * head_dim);
}

EncodeStatus GearQuantizer::encode_block(const float* x, int64_t d, const Offsets& o, GroupBuffers out) const {
  const int64_t nb = p_.block;
  const int64_t n = nb * d;
  const bool keys = stream_ == GearStream::kKey;
  std::vector<float> filtered(x, x + n);
  // 1. Outliers: per key channel (nb values, stride d) or per value token (d values, stride 1).
  const int64_t k = o.per_side;
  const int64_t rows = keys ? d : nb;
  const int64_t len = keys ? nb : d;
  const int64_t stride = keys ? d : 1;
  std::vector<float> out_vals(static_cast<size_t>(o.n_out));
  std::vector<int64_t> out_pos(static_cast<size_t>(o.n_out));  // flat index in [nb, d]
  std::vector<uint16_t> out_idx(static_cast<size_t>(o.n_out));
  if (k > 0) {
    std::vector<int64_t> sel(static_cast<size_t>(2 * k));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t start = keys ? r : r * d;
      const float* row = x + start;
      double sum = 0;
      for (int64_t i = 0; i < len; ++i) sum += row[i * stride];
      const auto mean = static_cast<float>(sum / static_cast<double>(len));
      gear::select_outliers(row, len, stride, k, sel.data());
      for (int64_t j = 0; j < 2 * k; ++j) {
        const size_t e = static_cast<size_t>(r * 2 * k + j);
        const int64_t flat = start + sel[static_cast<size_t>(j)] * stride;
        out_vals[e] = x[flat];
        out_pos[e] = flat;
        out_idx[e] = static_cast<uint16_t>(sel[static_cast<size_t>(j)]);
        filtered[static_cast<size_t>(flat)] = mean;
      }
    }
  }
  // 2. The base quantizer on the filtered block.
  EncodeStatus s = base_->encode(filtered.data(), o.base_groups, d, 1.0f, out);
  bool overflow = store_fp16(out_vals.data(), o.n_out, out.codes + o.out_vals);
  if (o.n_out > 0) std::memcpy(out.codes + o.out_idx, out_idx.data(), static_cast<size_t>(o.n_out) * 2);
  // 3. The residual E = X − (Q + S) and its rank-r approximation (zero columns up to R).
  if (o.stored_rank > o.rank) {
    std::memset(out.codes + o.u, 0, static_cast<size_t>(2 * nb * o.stored_rank));
    std::memset(out.codes + o.p, 0, static_cast<size_t>(2 * d * o.stored_rank));
  }
  if (o.rank > 0) {
    std::vector<float> rec(static_cast<size_t>(n));
    base_->decode(ConstGroupBuffers{out.codes, out.scales, out.zeros}, o.base_groups, d, 1.0f, rec.data());
    std::vector<float> restored(static_cast<size_t>(o.n_out));
    load_fp16(out.codes + o.out_vals, o.n_out, restored.data());
    for (int64_t e = 0; e < o.n_out; ++e) rec[static_cast<size_t>(out_pos[static_cast<size_t>(e)])] = restored[static_cast<size_t>(e)];
    for (int64_t i = 0; i < n; ++i) rec[static_cast<size_t>(i)] = x[i] - rec[static_cast<size_t>(i)];
    std::vector<float> u(static_cast<size_t>(nb * o.rank)), p(static_cast<size_t>(d * o.rank));
    gear::low_rank(rec.data(), nb, d, o.rank, p_.loop, u.data(), p.data());
    const int64_t R = o.stored_rank;
    std::vector<float> us(static_cast<size_t>(nb * R), 0.0f), ps(static_cast<size_t>(d * R), 0.0f);
    for (int64_t i = 0; i < nb; ++i) {
      for (int64_t j = 0; j < o.rank; ++j) us[static_cast<size_t>(i * R + j)] = u[static_cast<size_t>(i * o.rank + j)];
    }
    for (int64_t i = 0; i < d; ++i) {
      for (int64_t j = 0; j < o.rank; ++j) ps[static_cast<size_t>(i * R + j)] = p[static_cast<size_t>(i * o.rank + j)];
    }
    overflow = store_fp16(us.data(), nb * R, out.codes + o.u) || overflow;
    overflow = store_fp16(ps.data(), d * R, out.codes + o.p) || overflow;
  }
  s.overflow = s.overflow || overflow;
  return s;
}

void GearQuantizer::decode_block(ConstGroupBuffers in, int64_t d, const Offsets& o, float* out) const {
  const int64_t nb = p_.block;
  const bool keys = stream_ == GearStream::kKey;
  base_->decode(in, o.base_groups, d, 1.0f, out);
  const int64_t k = o.per_side;
  if (k > 0) {
    std::vector<float> vals(static_cast<size_t>(o.n_out));
    load_fp16(in.codes + o.out_vals, o.n_out, vals.data());
    for (int64_t e = 0; e < o.n_out; ++e) {
      const int64_t r = e / (2 * k);
      const int64_t i = load_u16(in.codes + o.out_idx + 2 * e);
      const int64_t flat = keys ? i * d + r : r * d + i;
      out[flat] = vals[static_cast<size_t>(e)];
    }
  }
  if (o.stored_rank > 0) {
    // Every stored column: a block encoded with a lower rank holds zeros past it (+0, so the
    // sums are those of its own rank).
    const int64_t r = o.stored_rank;
    std::vector<float> u(static_cast<size_t>(nb * r)), p(static_cast<size_t>(d * r));
    load_fp16(in.codes + o.u, nb * r, u.data());
    load_fp16(in.codes + o.p, d * r, p.data());
    for (int64_t t = 0; t < nb; ++t) {
      const float* ut = u.data() + t * r;
      float* row = out + t * d;
      for (int64_t c = 0; c < d; ++c) {
        const float* pc = p.data() + c * r;
        float acc = 0;
        for (int64_t j = 0; j < r; ++j) acc += ut[j] * pc[j];
        row[c] += acc;
      }
    }
  }
}

EncodeStatus GearQuantizer::do_encode(const float* x, int64_t groups, int64_t head_dim, float tensor_scale,
                                      GroupBuffers out) const {
  (void)tensor_scale;
  const StoredLayout l = stored_layout(head_dim);
  const Offsets o = offsets(head_dim);
  const int64_t meta_bytes = l.meta_count * dtype_size(l.meta_dtype);
  EncodeStatus s;
  for (int64_t g = 0; g < groups; ++g) {
    GroupBuffers b;
    b.codes = out.codes + g * l.code_bytes;
    b.scales = out.scales == nullptr ? nullptr : static_cast<uint8_t*>(out.scales) + g * meta_bytes;
    b.zeros = out.zeros == nullptr ? nullptr : static_cast<uint8_t*>(out.zeros) + g * meta_bytes;
    const EncodeStatus e = encode_block(x + g * p_.block * head_dim, head_dim, o, b);
    s.overflow = s.overflow || e.overflow;
    s.nonfinite = s.nonfinite || e.nonfinite;
  }
  return s;
}

void GearQuantizer::do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float tensor_scale,
                              float* out) const {
  (void)tensor_scale;
  const StoredLayout l = stored_layout(head_dim);
  const Offsets o = offsets(head_dim);
  const int64_t meta_bytes = l.meta_count * dtype_size(l.meta_dtype);
  for (int64_t g = 0; g < groups; ++g) {
    ConstGroupBuffers b;
    b.codes = in.codes + g * l.code_bytes;
    b.scales = in.scales == nullptr ? nullptr : static_cast<const uint8_t*>(in.scales) + g * meta_bytes;
    b.zeros = in.zeros == nullptr ? nullptr : static_cast<const uint8_t*>(in.zeros) + g * meta_bytes;
    decode_block(b, head_dim, o, out + g * p_.block * head_dim);
  }
}

void GearQuantizer::check_input(const TensorView& x) const {
  const std::string where = "quantize(x) [" + spec() + "]";
  KV_CHECK_ARG(x.size(2) % p_.block == 0, where, ": T=", x.size(2), " is not a multiple of the block nb=", p_.block,
               " (GEAR compresses whole blocks of nb tokens; the cache keeps the rest in its residual)");
  (void)stored_layout(x.size(3));
}

void GearQuantizer::do_quantize_into(const Input& in, QuantizedTensor& q) const {
  const std::string where = "quantize(x) [" + spec() + "]";
  const TensorView& xf = in.x;
  const int64_t b = xf.size(0), h = xf.size(1), t = xf.size(2), d = xf.size(3);
  const StoredLayout l = stored_layout(d);
  const int64_t blocks = t / p_.block;
  q.format = spec();
  q.shape = {b, h, t, d};
  q.dtype = in.dtype;
  q.side.clear();
  q.codes.ensure(DType::kUInt8, {b, h, blocks, l.code_bytes}, in.avoid_begin, in.avoid_end);
  q.scales.ensure(l.meta_dtype, {b, h, blocks, l.meta_count}, in.avoid_begin, in.avoid_end);
  if (l.has_zeros) {
    q.zeros.ensure(l.meta_dtype, {b, h, blocks, l.meta_count}, in.avoid_begin, in.avoid_end);
  } else {
    q.zeros.reset();
  }
  const int64_t meta_bytes = l.meta_count * dtype_size(l.meta_dtype);
  const auto* x = static_cast<const float*>(xf.data);
  for (int64_t i = 0; i < b * h; ++i) {
    GroupBuffers out;
    out.codes = q.codes.data_as<uint8_t>() + i * blocks * l.code_bytes;
    out.scales = q.scales.data_as<uint8_t>() + i * blocks * meta_bytes;
    out.zeros = l.has_zeros ? q.zeros.data_as<uint8_t>() + i * blocks * meta_bytes : nullptr;
    const EncodeStatus s = encode(x + i * t * d, blocks, d, 1.0f, out);
    KV_CHECK_ARG(!s.overflow, where, ": KV head ", i % h, " of batch ", i / h,
                 " has values whose stored fp16 form overflows (|x| or its quantization metadata, outliers or "
                 "low-rank factors >= 65520)");
  }
}

void GearQuantizer::do_dequantize_into(const QuantizedTensor& q, float* out) const {
  const std::string where = "dequantize_into(q, out) [" + spec() + "]";
  const int64_t b = q.shape[0], h = q.shape[1], t = q.shape[2], d = q.shape[3];
  const StoredLayout l = stored_layout(d);
  KV_CHECK_ARG(t % p_.block == 0, where, ": T=", t, " is not a multiple of nb=", p_.block);
  const int64_t blocks = t / p_.block;
  KV_CHECK_ARG(q.codes.numel() == b * h * blocks * l.code_bytes && q.codes.dtype() == DType::kUInt8, where,
               ": q.codes holds ", q.codes.numel(), " values of ", to_string(q.codes.dtype()), ", expected ",
               b * h * blocks * l.code_bytes, " bytes");
  KV_CHECK_ARG(q.scales.defined() && q.scales.numel() == b * h * blocks * l.meta_count &&
                   q.scales.dtype() == l.meta_dtype &&
                   (!l.has_zeros || (q.zeros.defined() && q.zeros.numel() == q.scales.numel() &&
                                     q.zeros.dtype() == l.meta_dtype)),
               where, ": q.scales/q.zeros do not hold ", b * h * blocks * l.meta_count, " fp16 values each");
  const int64_t meta_bytes = l.meta_count * dtype_size(l.meta_dtype);
  for (int64_t i = 0; i < b * h; ++i) {
    ConstGroupBuffers in;
    in.codes = q.codes.data_as<uint8_t>() + i * blocks * l.code_bytes;
    in.scales = q.scales.data_as<uint8_t>() + i * blocks * meta_bytes;
    in.zeros = l.has_zeros ? q.zeros.data_as<uint8_t>() + i * blocks * meta_bytes : nullptr;
    decode(in, blocks, d, 1.0f, out + i * t * d);
  }
}

}  // namespace kvcache::quant
