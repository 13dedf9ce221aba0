// SPDX-License-Identifier: Apache-2.0
#include "quant/turboquant_outlier.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "common/parallel.h"
#include "kvcache/error.h"
#include "quant/bit_stream.h"
#include "quant/cast_kernels.h"
#include "quant/checks.h"
#include "quant/lloyd_max.h"
#include "quant/seeded_random.h"

namespace kvcache::quant {
namespace {

constexpr float kFltMax = std::numeric_limits<float>::max();
constexpr uint64_t kStream[2] = {0x7a0, 0x7a1};  // outlier part, the rest

float saturate(double v) {
  if (std::isnan(v)) return static_cast<float>(v);
  return static_cast<float>(std::min<double>(std::max<double>(v, -kFltMax), kFltMax));
}

using bit_stream::get_bits;
using bit_stream::put_bits;

/// The channels of a stored mask: outliers (set bits below d, ascending) and the rest. False
/// when the mask does not hold exactly n channels.
bool channels_of_mask(const uint8_t* mask, int64_t d, int64_t n, std::vector<int64_t>& out_idx,
                      std::vector<int64_t>& in_idx) {
  out_idx.clear();
  in_idx.clear();
  for (int64_t c = 0; c < d; ++c) ((mask[c / 8] >> (c % 8)) & 1u ? out_idx : in_idx).push_back(c);
  return static_cast<int64_t>(out_idx.size()) == n;
}

/// One part's codebook as the coder uses it: thresholds in N(0, 1) units and decode levels
/// level/√d_p (float32).
struct PartCodebook {
  const GaussianCodebook* cb = nullptr;
  std::vector<float> levels;
  double sqrt_size = 0;
  int bits = 0;
};

PartCodebook part_codebook(int bits, int64_t size) {
  PartCodebook p;
  p.cb = &gaussian_lloyd_max(bits);
  p.bits = bits;
  p.sqrt_size = std::sqrt(static_cast<double>(size));
  for (double v : p.cb->levels) p.levels.push_back(static_cast<float>(v / p.sqrt_size));
  return p;
}

}  // namespace

TurboOutlierQuantizer::TurboOutlierQuantizer(double bits, TurboMode mode, int64_t outliers, int64_t group,
                                             bool norm_correction, int64_t seed)
    : bits_(static_cast<int>(std::lround(bits))), n_(outliers), g_(group), nc_(norm_correction), seed_(seed) {
  KV_CHECK_ARG(outliers >= 1, "tq:b", bits, ": o<n> needs n >= 1 outlier channels, got o = ", outliers,
               " (g<G> sets the token group over which o<n> outliers are chosen and needs o)");
  KV_CHECK_ARG(mode == TurboMode::kMse, "tq:b", bits, ":o", outliers,
               ":prod: prod is not supported with outlier channels (o<n> splits TurboQuant-MSE only); drop prod or o");
  KV_CHECK_ARG(bits == bits_ && bits_ >= 1 && bits_ <= 3, "tq:b", bits, ":o", outliers,
               ": with outlier channels b must be an integer 1, 2 or 3 (outliers get b + 1 bits, the rest b), got b = ",
               bits, " (fractional b without o gives the extra bit to half the rotated coordinates)");
  KV_CHECK_ARG(group >= 1, "tq:b", bits, ":o", outliers, ": the outlier group g must be >= 1 token, got g = ", group);
  KV_CHECK_ARG(seed >= 0 && seed <= 2147483647, "tq: seed must be in [0, 2147483647], got ", seed);
}

std::string TurboOutlierQuantizer::spec() const {
  return canonical_spec(TurboQuantizer::table(),
                        {{"b", static_cast<double>(bits_)},
                         {"o", static_cast<double>(n_)},
                         {"g", static_cast<double>(g_)},
                         {"seed", static_cast<double>(seed_)}},
                        {{"mode", "mse"}, {"norm", nc_ ? "nc" : "nonc"}});
}

void TurboOutlierQuantizer::check_head_dim(int64_t d, const std::string& where) const {
  KV_CHECK_ARG(d > n_, where, ": o = ", n_, " outlier channels need head_dim D > ", n_, " (both parts non-empty), got D = ",
               d);
}

int64_t TurboOutlierQuantizer::code_bytes(int64_t d) const { return mask_bytes(d) + g_ * token_bytes(d); }

double TurboOutlierQuantizer::bits_per_value(int64_t head_dim) const {
  check_head_dim(head_dim, "bits_per_value(head_dim) [" + spec() + "]");
  return static_cast<double>(8 * code_bytes(head_dim) + 32 * g_) / static_cast<double>(g_ * head_dim);
}

std::shared_ptr<const std::vector<float>> TurboOutlierQuantizer::rotation(int part, int64_t size) const {
  KV_INTERNAL_ASSERT((part == 0 || part == 1) && size >= 1, "TurboOutlierQuantizer::rotation(", part, ", ", size, ")");
  std::lock_guard<std::mutex> lock(mu_);
  auto it = rotations_.find({part, size});
  if (it != rotations_.end()) return it->second;
  std::vector<double> s(static_cast<size_t>(size * size));
  for (int64_t k = 0; k < size * size; ++k) {
    s[static_cast<size_t>(k)] = seeded::normal(seed_, kStream[part], static_cast<uint64_t>(k));
  }
  // Modified Gram–Schmidt over the rows (a QR's Q, row-wise).
  for (int64_t i = 0; i < size; ++i) {
    double* ri = s.data() + i * size;
    for (int64_t j = 0; j < i; ++j) {
      const double* rj = s.data() + j * size;
      double dot = 0;
      for (int64_t c = 0; c < size; ++c) dot += ri[c] * rj[c];
      for (int64_t c = 0; c < size; ++c) ri[c] -= dot * rj[c];
    }
    double nn = 0;
    for (int64_t c = 0; c < size; ++c) nn += ri[c] * ri[c];
    const double inv = 1.0 / std::sqrt(nn);  // Gaussian rows are independent almost surely
    for (int64_t c = 0; c < size; ++c) ri[c] *= inv;
  }
  auto out = std::make_shared<std::vector<float>>(s.size());
  for (size_t k = 0; k < s.size(); ++k) (*out)[k] = static_cast<float>(s[k]);
  rotations_.emplace(std::make_pair(part, size), out);
  return out;
}

std::vector<int64_t> TurboOutlierQuantizer::select_outliers(const float* x, int64_t rows, int64_t d, int64_t n) {
  std::vector<double> energy(static_cast<size_t>(d), 0.0);
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t c = 0; c < d; ++c) energy[static_cast<size_t>(c)] += static_cast<double>(x[t * d + c]) * x[t * d + c];
  }
  std::vector<int64_t> order(static_cast<size_t>(d));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return energy[static_cast<size_t>(a)] > energy[static_cast<size_t>(b)]; });
  std::vector<int64_t> out(order.begin(), order.begin() + std::min(n, d));
  std::sort(out.begin(), out.end());
  return out;
}

void TurboOutlierQuantizer::encode_groups(const float* x, int64_t groups, int64_t d, uint8_t* codes, float* meta) const {
  const int64_t n = n_, g = g_, cb = code_bytes(d), tb = token_bytes(d), mb = mask_bytes(d);
  const int64_t sizes[2] = {n, d - n};
  const int part_bits[2] = {bits_ + 1, bits_};
  const std::shared_ptr<const std::vector<float>> rot[2] = {rotation(0, sizes[0]), rotation(1, sizes[1])};
  const PartCodebook books[2] = {part_codebook(part_bits[0], sizes[0]), part_codebook(part_bits[1], sizes[1])};
  detail::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<int64_t> idx[2];
    std::vector<double> u(static_cast<size_t>(d)), v(static_cast<size_t>(d));
    for (int64_t gi = g0; gi < g1; ++gi) {
      const float* xg = x + gi * g * d;
      uint8_t* cg = codes + gi * cb;
      const std::vector<int64_t> outl = select_outliers(xg, g, d, n);
      std::fill(cg, cg + cb, uint8_t{0});
      for (int64_t c : outl) cg[c / 8] = static_cast<uint8_t>(cg[c / 8] | (1u << (c % 8)));
      (void)channels_of_mask(cg, d, n, idx[0], idx[1]);
      for (int64_t t = 0; t < g; ++t) {
        const float* xr = xg + t * d;
        uint8_t* stream = cg + mb + t * tb;
        int64_t bit = 0;
        for (int p = 0; p < 2; ++p) {
          const int64_t m = sizes[p];
          const std::vector<int64_t>& ch = idx[p];
          double ss = 0;
          for (int64_t i = 0; i < m; ++i) {
            const double xv = xr[ch[static_cast<size_t>(i)]];
            ss += xv * xv;
          }
          const double norm = std::sqrt(ss);
          for (int64_t i = 0; i < m; ++i) {
            u[static_cast<size_t>(i)] = norm > 0 ? static_cast<double>(xr[ch[static_cast<size_t>(i)]]) / norm : 0.0;
          }
          // v = √d_p · Q·u, then the level whose cell holds each v_i.
          const float* q = rot[p]->data();
          for (int64_t i = 0; i < m; ++i) {
            const float* qi = q + i * m;
            double acc = 0;
            for (int64_t j = 0; j < m; ++j) acc += static_cast<double>(qi[j]) * u[static_cast<size_t>(j)];
            v[static_cast<size_t>(i)] = acc * books[p].sqrt_size;
          }
          const std::vector<double>& thr = books[p].cb->boundaries;
          for (int64_t i = 0; i < m; ++i) {
            // #{t_j < v_i}: the first threshold not below v_i.
            const auto code = static_cast<uint32_t>(std::lower_bound(thr.begin(), thr.end(), v[static_cast<size_t>(i)]) - thr.begin());
            put_bits(stream, bit, code, part_bits[p]);
            bit += part_bits[p];
          }
          meta[(gi * g + t) * 2 + p] = norm > kFltMax ? std::numeric_limits<float>::infinity() : static_cast<float>(norm);
        }
      }
    }
  });
}

void TurboOutlierQuantizer::decode_groups(const uint8_t* codes, const float* meta, int64_t groups, int64_t d,
                                          float* out) const {
  const int64_t n = n_, g = g_, cb = code_bytes(d), tb = token_bytes(d), mb = mask_bytes(d);
  const int64_t sizes[2] = {n, d - n};
  const int part_bits[2] = {bits_ + 1, bits_};
  const std::shared_ptr<const std::vector<float>> rot[2] = {rotation(0, sizes[0]), rotation(1, sizes[1])};
  const PartCodebook books[2] = {part_codebook(part_bits[0], sizes[0]), part_codebook(part_bits[1], sizes[1])};
  detail::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<int64_t> idx[2];
    std::vector<double> c(static_cast<size_t>(d)), r(static_cast<size_t>(d));
    for (int64_t gi = g0; gi < g1; ++gi) {
      const uint8_t* cg = codes + gi * cb;
      float* og = out + gi * g * d;
      if (!channels_of_mask(cg, d, n, idx[0], idx[1])) {
        std::fill(og, og + g * d, 0.0f);  // a hand-built mask; dequantize() refuses it first
        continue;
      }
      for (int64_t t = 0; t < g; ++t) {
        const uint8_t* stream = cg + mb + t * tb;
        float* o = og + t * d;
        int64_t bit = 0;
        for (int p = 0; p < 2; ++p) {
          const int64_t m = sizes[p];
          for (int64_t i = 0; i < m; ++i) {
            c[static_cast<size_t>(i)] = books[p].levels[get_bits(stream, bit, part_bits[p])];
            bit += part_bits[p];
          }
          if (nc_) {
            double cc = 0;
            for (int64_t i = 0; i < m; ++i) cc += c[static_cast<size_t>(i)] * c[static_cast<size_t>(i)];
            const double inv = 1.0 / std::sqrt(cc);  // cc > 0: no level is 0
            for (int64_t i = 0; i < m; ++i) c[static_cast<size_t>(i)] *= inv;
          }
          // r = Qᵀ·c.
          std::fill(r.begin(), r.begin() + m, 0.0);
          const float* q = rot[p]->data();
          for (int64_t i = 0; i < m; ++i) {
            const float* qi = q + i * m;
            const double ci = c[static_cast<size_t>(i)];
            for (int64_t j = 0; j < m; ++j) r[static_cast<size_t>(j)] += ci * static_cast<double>(qi[j]);
          }
          const double norm = meta[(gi * g + t) * 2 + p];
          const std::vector<int64_t>& ch = idx[p];
          for (int64_t i = 0; i < m; ++i) o[ch[static_cast<size_t>(i)]] = saturate(norm * r[static_cast<size_t>(i)]);
        }
      }
    }
  });
}

void TurboOutlierQuantizer::check_input(const TensorView& x) const {
  const std::string where = "quantize(x) [" + spec() + "]";
  check_head_dim(x.size(3), where);
  KV_CHECK_ARG(x.size(2) % g_ == 0, where, ": seq_len T = ", x.size(2), " of x ", shape_str(x.sizes()),
               " is not divisible by the outlier group size g = ", g_, " tokens");
}

void TurboOutlierQuantizer::do_quantize_into(const Input& in, QuantizedTensor& q) const {
  const TensorView& x = in.x;
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3), g = g_;
  const int64_t groups = b * h * (t / g);
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
      float amax = 0;
      for (int64_t c = 0; c < d; ++c) amax = std::max(amax, std::abs(xf[r * d + c]));
      throw InvalidArgument(detail::str_cat(
          where, ": row [b, h, t] = [", r / (t * h), ", ", (r / t) % h, ", ", r % t, "] (max |x| = ", amax, ") has ",
          i % 2 == 0 ? "an outlier" : "an inlier", " part norm beyond float32 (", kFltMax,
          "); rows with every |x| <= FLT_MAX/sqrt(D) = ", kFltMax / std::sqrt(static_cast<float>(d)),
          " always fit (docs/quantizers.md, \"TurboQuant\")"));
    }
    fp16_fits = fp16_fits && meta[i] < 65504.0f + 16.0f;  // rounds to at most 65504
  }
  if (fp16_fits) {
    q.scales.ensure(DType::kFloat16, {b, h, t / g, 2 * g}, in.avoid_begin, in.avoid_end);
    if (!meta.empty()) (void)cast_to_fp16(meta.data(), static_cast<int64_t>(meta.size()), q.scales.data_as<uint16_t>());
  } else {
    q.scales.ensure(DType::kFloat32, {b, h, t / g, 2 * g}, in.avoid_begin, in.avoid_end);
    std::copy(meta.begin(), meta.end(), q.scales.data_as<float>());
  }
}

void TurboOutlierQuantizer::do_dequantize_into(const QuantizedTensor& q, float* out) const {
  const std::string where = "dequantize_into(q, out) [" + spec() + "]";
  const int64_t b = q.shape[0], h = q.shape[1], t = q.shape[2], d = q.shape[3], g = g_;
  check_head_dim(d, where);
  KV_CHECK_ARG(t % g == 0, where, ": q.shape ", shape_str(q.shape), " has seq_len T = ", t,
               ", expected a multiple of the outlier group size g = ", g, " tokens");
  const std::vector<int64_t> code_shape{b, h, t / g, code_bytes(d)}, meta_shape{b, h, t / g, 2 * g};
  check_codes_and_metadata(q, code_shape, meta_shape, where, "the norms");
  const int64_t groups = b * h * (t / g);
  if (groups == 0) return;
  const auto* codes = q.codes.data_as<uint8_t>();
  std::vector<int64_t> oi, ii;
  for (int64_t gi = 0; gi < groups; ++gi) {
    if (!channels_of_mask(codes + gi * code_bytes(d), d, n_, oi, ii)) {
      throw InvalidArgument(detail::str_cat(where, ": group [b, h, group] = [", gi / ((t / g) * h), ", ",
                                            (gi / (t / g)) % h, ", ", gi % (t / g), "] has a channel mask of ",
                                            oi.size(), " channels, expected o = ", n_));
    }
  }
  const std::vector<float> meta = metadata_to_fp32(q.scales.data(), q.scales.dtype() == DType::kFloat16, groups * 2 * g);
  decode_groups(codes, meta.data(), groups, d, out);
}

StoredLayout TurboOutlierQuantizer::do_stored_layout(int64_t head_dim) const {
  check_head_dim(head_dim, "stored_layout(head_dim) [" + spec() + "]");
  StoredLayout l;
  l.axis = GroupAxis::kPerChannel;
  l.group_tokens = g_;
  l.code_bytes = code_bytes(head_dim);
  l.meta_count = 2 * g_;
  l.has_zeros = false;
  l.meta_dtype = DType::kFloat16;
  l.kernel = KernelKind::kNone;  // the generic path decodes it (no fused kernel reads the split)
  return l;
}

EncodeStatus TurboOutlierQuantizer::do_encode(const float* x, int64_t groups, int64_t head_dim, float /*tensor_scale*/,
                                              GroupBuffers out) const {
  EncodeStatus s;
  const int64_t n = groups * g_ * head_dim;
  s.nonfinite = any_nonfinite(x, n);
  if (s.nonfinite || groups == 0) return s;
  std::vector<float> meta(static_cast<size_t>(groups * 2 * g_));
  encode_groups(x, groups, head_dim, out.codes, meta.data());
  const CastStatus cs = cast_to_fp16(meta.data(), static_cast<int64_t>(meta.size()), static_cast<uint16_t*>(out.scales));
  s.overflow = cs.overflow || cs.nonfinite;
  return s;
}

void TurboOutlierQuantizer::do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float /*tensor_scale*/,
                                      float* out) const {
  if (groups == 0) return;
  std::vector<float> meta(static_cast<size_t>(groups * 2 * g_));
  fp16_to_fp32(static_cast<const uint16_t*>(in.scales), static_cast<int64_t>(meta.size()), meta.data());
  decode_groups(in.codes, meta.data(), groups, head_dim, out);
}

}  // namespace kvcache::quant
