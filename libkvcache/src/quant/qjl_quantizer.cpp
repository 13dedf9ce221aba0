// SPDX-License-Identifier: Apache-2.0
#include "quant/qjl_quantizer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "common/parallel.h"
#include "kvcache/error.h"
#include "quant/cast_kernels.h"
#include "quant/checks.h"
#include "quant/seeded_random.h"

namespace kvcache::quant {
namespace {

constexpr float kFltMax = std::numeric_limits<float>::max();

float saturate(double v) {
  if (std::isnan(v)) return static_cast<float>(v);
  return static_cast<float>(std::min<double>(std::max<double>(v, -kFltMax), kFltMax));
}

}  // namespace

QjlKeyQuantizer::QjlKeyQuantizer(const QjlParams& p, std::string name) : p_(p), name_(std::move(name)) {
  KV_CHECK_ARG(p.sketch >= 8 && p.sketch % 8 == 0, "'", name_, "': sketch size m must be a positive multiple of 8, got ",
               p.sketch);
  KV_CHECK_ARG(p.outliers >= 0, "'", name_, "': outlier count o must be >= 0, got ", p.outliers);
  KV_CHECK_ARG(p.outlier_sketch % 8 == 0 && p.outlier_sketch <= p.sketch && (p.outlier_sketch > 0 || p.outliers == 0),
               "'", name_, "': outlier sketch size mo must be a multiple of 8 in [8, m = ", p.sketch,
               "] (0 only without outliers), got ", p.outlier_sketch);
  KV_CHECK_ARG(p.group >= 1, "'", name_, "': group size g must be >= 1, got ", p.group);
}

int64_t QjlKeyQuantizer::code_bytes(int64_t /*d*/) const {
  return p_.outliers + p_.group * (p_.sketch + p_.outlier_sketch) / 8;
}

double QjlKeyQuantizer::bits_per_value(int64_t head_dim) const {
  KV_CHECK_ARG(head_dim > 0, "bits_per_value(head_dim) [", spec(), "]: head_dim must be > 0, got ", head_dim);
  return static_cast<double>(8 * code_bytes(head_dim) + 32 * p_.group) / static_cast<double>(p_.group * head_dim);
}

void QjlKeyQuantizer::check_head_dim(int64_t d, const std::string& where) const {
  KV_CHECK_ARG(d >= 1 && d <= 256, where, ": QJL stores outlier channel indices in one byte: head_dim D must be in [1, 256], got ",
               d);
  KV_CHECK_ARG(p_.outliers < d, where, ": o = ", p_.outliers, " outlier channels need head_dim D > o, got D = ", d);
}

std::shared_ptr<const std::vector<float>> QjlKeyQuantizer::sketch(int64_t d) const {
  std::shared_ptr<const Sketch> t = sketch_tables(d);
  return {t, &t->s};  // aliasing: keeps the tables alive
}

std::shared_ptr<const QjlKeyQuantizer::Sketch> QjlKeyQuantizer::sketch_tables(int64_t d) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sketches_.find(d);
  if (it != sketches_.end()) return it->second;
  const int64_t m = p_.sketch;
  std::vector<double> s(static_cast<size_t>(m * d));
  for (int64_t k = 0; k < m * d; ++k) s[static_cast<size_t>(k)] = seeded::normal(p_.seed, 0x9a1, static_cast<uint64_t>(k));
  // Blocks of D rows: modified Gram–Schmidt (a QR's Q, row-wise), rows scaled to norm √D.
  const double sqrt_d = std::sqrt(static_cast<double>(d));
  for (int64_t b0 = 0; b0 < m; b0 += d) {
    const int64_t b1 = std::min(m, b0 + d);
    for (int64_t i = b0; i < b1; ++i) {
      double* ri = s.data() + i * d;
      for (int64_t j = b0; j < i; ++j) {
        const double* rj = s.data() + j * d;
        double dot = 0;
        for (int64_t c = 0; c < d; ++c) dot += ri[c] * rj[c];
        for (int64_t c = 0; c < d; ++c) ri[c] -= dot * rj[c];
      }
      double nn = 0;
      for (int64_t c = 0; c < d; ++c) nn += ri[c] * ri[c];
      const double inv = 1.0 / std::sqrt(nn);  // Gaussian rows are independent almost surely
      for (int64_t c = 0; c < d; ++c) ri[c] *= inv;
    }
  }
  auto out = std::make_shared<Sketch>();
  out->s.resize(s.size());
  for (size_t k = 0; k < s.size(); ++k) out->s[k] = static_cast<float>(s[k] * sqrt_d);
  out->s_t.resize(s.size());
  for (int64_t j = 0; j < m; ++j) {
    for (int64_t c = 0; c < d; ++c) out->s_t[static_cast<size_t>(c * m + j)] = out->s[static_cast<size_t>(j * d + c)];
  }
  sketches_.emplace(d, out);
  return out;
}

void QjlKeyQuantizer::encode_groups(const float* x, int64_t groups, int64_t d, uint8_t* codes, float* meta) const {
  const auto sk = sketch(d);
  const int64_t g = p_.group, m = p_.sketch, mo = p_.outlier_sketch, o = p_.outliers;
  const int64_t cb = code_bytes(d), tok_bytes = (m + mo) / 8;
  detail::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    std::vector<double> energy(static_cast<size_t>(d));
    std::vector<int64_t> order(static_cast<size_t>(d));
    std::vector<uint8_t> is_out(static_cast<size_t>(d));
    std::vector<double> kin(static_cast<size_t>(d)), kout(static_cast<size_t>(d));
    for (int64_t gi = g0; gi < g1; ++gi) {
      const float* xg = x + gi * g * d;
      uint8_t* cg = codes + gi * cb;
      std::fill(energy.begin(), energy.end(), 0.0);
      for (int64_t t = 0; t < g; ++t) {
        for (int64_t c = 0; c < d; ++c) energy[static_cast<size_t>(c)] += static_cast<double>(xg[t * d + c]) * xg[t * d + c];
      }
      std::iota(order.begin(), order.end(), int64_t{0});
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return energy[static_cast<size_t>(a)] > energy[static_cast<size_t>(b)]; });
      std::fill(is_out.begin(), is_out.end(), uint8_t{0});
      std::vector<int64_t> outl(order.begin(), order.begin() + o);
      std::sort(outl.begin(), outl.end());
      for (int64_t j = 0; j < o; ++j) {
        cg[j] = static_cast<uint8_t>(outl[static_cast<size_t>(j)]);
        is_out[static_cast<size_t>(outl[static_cast<size_t>(j)])] = 1;
      }
      for (int64_t t = 0; t < g; ++t) {
        const float* k = xg + t * d;
        double nin = 0, nout = 0;
        for (int64_t c = 0; c < d; ++c) {
          const double v = k[c];
          kin[static_cast<size_t>(c)] = is_out[static_cast<size_t>(c)] ? 0.0 : v;
          kout[static_cast<size_t>(c)] = is_out[static_cast<size_t>(c)] ? v : 0.0;
          (is_out[static_cast<size_t>(c)] ? nout : nin) += v * v;
        }
        uint8_t* bits = cg + o + t * tok_bytes;
        std::fill(bits, bits + tok_bytes, uint8_t{0});
        for (int64_t j = 0; j < m; ++j) {
          const float* sj = sk->data() + j * d;
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(sj[c]) * kin[static_cast<size_t>(c)];
          if (dot >= 0) bits[j / 8] = static_cast<uint8_t>(bits[j / 8] | (1u << (j % 8)));
        }
        for (int64_t j = 0; j < mo; ++j) {
          const float* sj = sk->data() + j * d;
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(sj[c]) * kout[static_cast<size_t>(c)];
          if (dot >= 0) bits[(m + j) / 8] = static_cast<uint8_t>(bits[(m + j) / 8] | (1u << ((m + j) % 8)));
        }
        const double a = std::sqrt(nin), b = std::sqrt(nout);
        meta[(gi * g + t) * 2] = a > kFltMax ? std::numeric_limits<float>::infinity() : static_cast<float>(a);
        meta[(gi * g + t) * 2 + 1] = b > kFltMax ? std::numeric_limits<float>::infinity() : static_cast<float>(b);
      }
    }
  });
}

void QjlKeyQuantizer::decode_groups(const uint8_t* codes, const float* meta, int64_t groups, int64_t d,
                                    float* out) const {
  const auto sk = sketch(d);
  const int64_t g = p_.group, m = p_.sketch, mo = p_.outlier_sketch, o = p_.outliers;
  const int64_t cb = code_bytes(d), tok_bytes = (m + mo) / 8;
  const double c_in = std::sqrt(3.14159265358979323846 / 2.0) / static_cast<double>(m);
  const double c_out = mo > 0 ? std::sqrt(3.14159265358979323846 / 2.0) / static_cast<double>(mo) : 0.0;
  detail::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> is_out(static_cast<size_t>(d));
    std::vector<double> tin(static_cast<size_t>(d)), tout(static_cast<size_t>(d));
    for (int64_t gi = g0; gi < g1; ++gi) {
      const uint8_t* cg = codes + gi * cb;
      std::fill(is_out.begin(), is_out.end(), uint8_t{0});
      // An index past D (a hand-built buffer) marks nothing.
      for (int64_t j = 0; j < o; ++j) {
        if (cg[j] < d) is_out[cg[j]] = 1;
      }
      for (int64_t t = 0; t < g; ++t) {
        const uint8_t* bits = cg + o + t * tok_bytes;
        std::fill(tin.begin(), tin.end(), 0.0);
        std::fill(tout.begin(), tout.end(), 0.0);
        for (int64_t j = 0; j < m; ++j) {
          const double z = ((bits[j / 8] >> (j % 8)) & 1u) ? 1.0 : -1.0;
          const float* sj = sk->data() + j * d;
          for (int64_t c = 0; c < d; ++c) tin[static_cast<size_t>(c)] += z * sj[c];
        }
        for (int64_t j = 0; j < mo; ++j) {
          const double z = ((bits[(m + j) / 8] >> ((m + j) % 8)) & 1u) ? 1.0 : -1.0;
          const float* sj = sk->data() + j * d;
          for (int64_t c = 0; c < d; ++c) tout[static_cast<size_t>(c)] += z * sj[c];
        }
        const double a = c_in * meta[(gi * g + t) * 2], b = c_out * meta[(gi * g + t) * 2 + 1];
        float* o_row = out + (gi * g + t) * d;
        for (int64_t c = 0; c < d; ++c) {
          o_row[c] = saturate(is_out[static_cast<size_t>(c)] ? b * tout[static_cast<size_t>(c)] : a * tin[static_cast<size_t>(c)]);
        }
      }
    }
  });
}

void QjlKeyQuantizer::check_input(const TensorView& x) const {
  const std::string where = "quantize(x) [" + spec() + "]";
  check_head_dim(x.size(3), where);
  KV_CHECK_ARG(x.size(2) % p_.group == 0, where, ": seq_len T = ", x.size(2), " of x ", shape_str(x.sizes()),
               " is not divisible by the group size g = ", p_.group, " tokens");
}

void QjlKeyQuantizer::do_quantize_into(const Input& in, QuantizedTensor& q) const {
  const TensorView& x = in.x;
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  const int64_t groups = b * h * (t / p_.group), g = p_.group;
  const std::string where = "quantize(x) [" + spec() + "]";
  q.format = spec();
  q.side.clear();
  q.shape = x.sizes();
  q.dtype = in.dtype;
  q.zeros.reset();
  q.codes.ensure(DType::kUInt8, {b, h, t / g, code_bytes(d)}, in.avoid_begin, in.avoid_end);
  std::vector<float> meta(static_cast<size_t>(groups * 2 * g));
  const auto* xf = static_cast<const float*>(x.data);
  if (groups > 0) encode_groups(xf, groups, d, q.codes.data_as<uint8_t>(), meta.data());
  bool fp16_fits = true;
  for (size_t i = 0; i < meta.size(); ++i) {
    if (std::isinf(meta[i])) {
      const int64_t r = static_cast<int64_t>(i / 2);
      throw InvalidArgument(detail::str_cat(where, ": row [b, h, t] = [", r / (t * h), ", ", (r / t) % h, ", ", r % t,
                                            "] has a norm beyond float32 (", kFltMax,
                                            "); rows with every |x| <= FLT_MAX/sqrt(D) always fit"));
    }
    fp16_fits = fp16_fits && meta[i] < 65520.0f;
  }
  if (fp16_fits) {
    q.scales.ensure(DType::kFloat16, {b, h, t / g, 2 * g}, in.avoid_begin, in.avoid_end);
    if (!meta.empty()) (void)cast_to_fp16(meta.data(), static_cast<int64_t>(meta.size()), q.scales.data_as<uint16_t>());
  } else {
    q.scales.ensure(DType::kFloat32, {b, h, t / g, 2 * g}, in.avoid_begin, in.avoid_end);
    std::copy(meta.begin(), meta.end(), q.scales.data_as<float>());
  }
}

void QjlKeyQuantizer::do_dequantize_into(const QuantizedTensor& q, float* out) const {
  const std::string where = "dequantize_into(q, out) [" + spec() + "]";
  const int64_t b = q.shape[0], h = q.shape[1], t = q.shape[2], d = q.shape[3], g = p_.group;
  check_head_dim(d, where);
  KV_CHECK_ARG(t % g == 0, where, ": q.shape ", shape_str(q.shape), " has seq_len T = ", t,
               ", expected a multiple of the group size g = ", g, " tokens");
  const std::vector<int64_t> code_shape{b, h, t / g, code_bytes(d)}, meta_shape{b, h, t / g, 2 * g};
  check_codes_and_metadata(q, code_shape, meta_shape, where, "the norms");
  const int64_t groups = b * h * (t / g);
  if (groups == 0) return;
  const std::vector<float> meta = metadata_to_fp32(q.scales.data(), q.scales.dtype() == DType::kFloat16, groups * 2 * g);
  decode_groups(q.codes.data_as<uint8_t>(), meta.data(), groups, d, out);
}

StoredLayout QjlKeyQuantizer::do_stored_layout(int64_t head_dim) const {
  check_head_dim(head_dim, "stored_layout(head_dim) [" + spec() + "]");
  StoredLayout l;
  l.axis = GroupAxis::kPerChannel;
  l.group_tokens = p_.group;
  l.code_bytes = code_bytes(head_dim);
  l.meta_count = 2 * p_.group;
  l.has_zeros = false;
  l.meta_dtype = DType::kFloat16;
  l.kernel = KernelKind::kQjl;
  return l;
}

EncodeStatus QjlKeyQuantizer::do_encode(const float* x, int64_t groups, int64_t head_dim, float /*tensor_scale*/,
                                        GroupBuffers out) const {
  EncodeStatus s;
  const int64_t n = groups * p_.group * head_dim;
  s.nonfinite = any_nonfinite(x, n);
  if (s.nonfinite || groups == 0) return s;
  std::vector<float> meta(static_cast<size_t>(groups * 2 * p_.group));
  encode_groups(x, groups, head_dim, out.codes, meta.data());
  const CastStatus cs = cast_to_fp16(meta.data(), static_cast<int64_t>(meta.size()), static_cast<uint16_t*>(out.scales));
  s.overflow = cs.overflow || cs.nonfinite;
  return s;
}

void QjlKeyQuantizer::do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float /*tensor_scale*/,
                                float* out) const {
  if (groups == 0) return;
  std::vector<float> meta(static_cast<size_t>(groups * 2 * p_.group));
  fp16_to_fp32(static_cast<const uint16_t*>(in.scales), static_cast<int64_t>(meta.size()), meta.data());
  decode_groups(in.codes, meta.data(), groups, head_dim, out);
}

}  // namespace kvcache::quant
