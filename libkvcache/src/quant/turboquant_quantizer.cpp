// SPDX-License-Identifier: Apache-2.0
#include "quant/turboquant_quantizer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "common/parallel.h"
#include "kvcache/error.h"
#include "quant/bit_stream.h"
#include "quant/cast_kernels.h"
#include "quant/checks.h"
#include "quant/hadamard.h"
#include "quant/lloyd_max.h"
#include "quant/seeded_random.h"

namespace kvcache::quant {
namespace {

constexpr float kFltMax = std::numeric_limits<float>::max();
constexpr double kPi = 3.14159265358979323846;

float round_to_fp16(float v) {
  uint16_t h = 0;
  (void)cast_to_fp16(&v, 1, &h);
  float back = 0;
  fp16_to_fp32(&h, 1, &back);
  return back;
}

float saturate(double v) {
  if (std::isnan(v)) return static_cast<float>(v);
  return static_cast<float>(std::min<double>(std::max<double>(v, -kFltMax), kFltMax));
}

void check_head_dim(int64_t d, const std::string& where) {
  KV_CHECK_ARG(is_power_of_two(d), where, ": TurboQuant's randomized Hadamard rotation needs head_dim D a power of two, got D = ",
               d, " (no padding is done; docs/quantizers.md, \"TurboQuant\")");
}

/// Bit offset of code i when the first `n_hi` codes have `hi` bits and the rest `lo`.
int64_t code_offset(int64_t i, int64_t n_hi, int hi, int lo) {
  return i < n_hi ? i * hi : n_hi * hi + (i - n_hi) * lo;
}

using bit_stream::get_bits;
using bit_stream::put_bits;

}  // namespace

const ParamTable& TurboQuantizer::table() {
  static const ParamTable t = [] {
    ParamTable tt{"tq",
                  "TurboQuant (arXiv 2504.19874): per token ||x|| in fp16 and the b-bit Lloyd-Max codes of the "
                  "seeded randomized-Hadamard-rotated unit vector (no scales or zeros); prod: b-1 bits + a 1-bit "
                  "Gaussian sketch of the residual and its norm (unbiased q.k); nc: vLLM's norm correction; o<n>: "
                  "the paper's outlier split, per group of g tokens the n highest-energy channels at b+1 bits and "
                  "the rest at b bits, two instances with their own norms and dense rotations",
                  {{"b", "bits per coordinate, 1..4 in steps of 0.5 (x.5: half the rotated coordinates get the "
                         "extra bit; prod: b-1 for the codebook + 1 for the sketch; with o: an integer 1..3)",
                    ParamDef::Kind::kFloat, 4, 1, 4, {}, {1, 1.5, 2, 2.5, 3, 3.5, 4}},
                   {"o", "outlier channels coded at b+1 bits (0 = none; with o, D-o channels at b bits, MSE only)",
                    ParamDef::Kind::kInt, 0, 0, 4096, {}},
                   {"g", "tokens per group over which the o outlier channels are chosen (needs o)",
                    ParamDef::Kind::kInt, 32, 1, 4096, {}},
                   {"mode", "mse: codebook only (TurboQuant-MSE); prod: codebook at b-1 bits + residual QJL sketch "
                            "(TurboQuant-Prod, keys)",
                    ParamDef::Kind::kChoice, 0, 0, 0, {"mse", "prod"}},
                   {"norm", "nonc: centroids as they are; nc: centroid vector re-normalised to unit norm before the "
                            "inverse rotation (vLLM's _nc presets)",
                    ParamDef::Kind::kChoice, 0, 0, 0, {"nonc", "nc"}},
                   {"seed", "rotation (and sketch) seed; vLLM uses 42 + 1337*layer", ParamDef::Kind::kInt, 42, 0,
                    2147483647.0, {}}}};
    tt.params[0].shown = true;
    return tt;
  }();
  return t;
}

TurboQuantizer::TurboQuantizer(double bits, TurboMode mode, bool norm_correction, int64_t seed)
    : half_bits_(static_cast<int>(std::lround(2 * bits))), mode_(mode), nc_(norm_correction), seed_(seed) {
  KV_CHECK_ARG(bits >= 1 && bits <= 4 && 2 * bits == half_bits_, "tq: bits b must be one of 1, 1.5, 2, 2.5, 3, 3.5, 4, got ",
               bits);
  KV_CHECK_ARG(mode != TurboMode::kProd || bits >= 2, "tq:b", bits,
               ":prod: prod needs b >= 2 (its codebook stage has b - 1 bits, the sketch 1), got b = ", bits);
  KV_CHECK_ARG(seed >= 0 && seed <= 2147483647, "tq: seed must be in [0, 2147483647], got ", seed);
}

std::string TurboQuantizer::spec() const {
  return canonical_spec(table(), {{"b", bits()}, {"seed", static_cast<double>(seed_)}},
                        {{"mode", mode_ == TurboMode::kProd ? "prod" : "mse"}, {"norm", nc_ ? "nc" : "nonc"}});
}

int64_t TurboQuantizer::mse_code_bytes(int64_t d) const {
  return (code_offset(d, hi_count(d), hi_bits(), lo_bits()) + 7) / 8;
}

int64_t TurboQuantizer::code_bytes(int64_t d) const {
  return mse_code_bytes(d) + (mode_ == TurboMode::kProd ? (d + 7) / 8 : 0);
}

double TurboQuantizer::bits_per_value(int64_t head_dim) const {
  KV_CHECK_ARG(head_dim > 0, "bits_per_value(head_dim) [", spec(), "]: head_dim must be > 0, got ", head_dim);
  return static_cast<double>(8 * code_bytes(head_dim) + 16 * meta_count()) / static_cast<double>(head_dim);
}

std::shared_ptr<const TurboQuantizer::Tables> TurboQuantizer::tables(int64_t d) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = tables_.find(d);
  if (it != tables_.end()) return it->second;
  auto t = std::make_shared<Tables>();
  t->signs.resize(static_cast<size_t>(d));
  for (int64_t i = 0; i < d; ++i) {
    const uint64_t word = seeded::draw(seed_, 0x5157, static_cast<uint64_t>(i / 64));
    t->signs[static_cast<size_t>(i)] = ((word >> (i % 64)) & 1u) ? -1.0f : 1.0f;
  }
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(d));
  for (const auto& [bits, out] : {std::pair{lo_bits(), &t->levels_lo}, std::pair{hi_bits(), &t->levels_hi}}) {
    out->assign(16, 0.0f);
    const std::vector<double>& lv = gaussian_lloyd_max(bits).levels;
    for (size_t i = 0; i < lv.size(); ++i) (*out)[i] = static_cast<float>(lv[i] * inv_sqrt_d);
  }
  if (mode_ == TurboMode::kProd) {
    t->sketch.resize(static_cast<size_t>(d * d));
    for (int64_t k = 0; k < d * d; ++k) {
      t->sketch[static_cast<size_t>(k)] = static_cast<float>(seeded::normal(seed_, 0x51e7, static_cast<uint64_t>(k)));
    }
  }
  tables_.emplace(d, t);
  return t;
}

void TurboQuantizer::encode_rows(const float* x, int64_t rows, int64_t d, uint8_t* codes, float* meta,
                                 bool meta_fp16) const {
  const std::shared_ptr<const Tables> tab = tables(d);
  const int lo = lo_bits(), hi = hi_bits();
  const int64_t n_hi = hi_count(d);
  const GaussianCodebook& cb_lo = gaussian_lloyd_max(lo);
  const GaussianCodebook& cb_hi = gaussian_lloyd_max(hi);
  const int64_t cbytes = code_bytes(d), mc = meta_count(), mse_bytes = mse_code_bytes(d);
  const double sqrt_d = std::sqrt(static_cast<double>(d));
  detail::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> u(static_cast<size_t>(d)), xm(static_cast<size_t>(d));
    std::vector<double> res(static_cast<size_t>(d)), v(static_cast<size_t>(d));
    std::vector<uint32_t> c(static_cast<size_t>(d));
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * d;
      uint8_t* out = codes + r * cbytes;
      double ss = 0;
      for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(xr[i]) * xr[i];
      const double norm = std::sqrt(ss);
      for (int64_t i = 0; i < d; ++i) {
        u[static_cast<size_t>(i)] =
            norm > 0 ? static_cast<float>(static_cast<double>(xr[i]) / norm) * tab->signs[static_cast<size_t>(i)] : 0.0f;
      }
      hadamard_rows(u.data(), 1, d);
      // The level whose cell holds v_i = √D·u_i: the number of thresholds below it, counted
      // threshold by threshold over all coordinates (vectorizes; a binary search per coordinate
      // spends its time in mispredicted branches).
      for (int64_t i = 0; i < d; ++i) v[static_cast<size_t>(i)] = static_cast<double>(u[static_cast<size_t>(i)]) * sqrt_d;
      std::fill(c.begin(), c.end(), uint32_t{0});
      auto count_below = [&](const std::vector<double>& t, int64_t i0, int64_t i1) {
        const double* __restrict vp = v.data();
        uint32_t* __restrict cp = c.data();
        for (double tj : t) {
          for (int64_t i = i0; i < i1; ++i) cp[i] += tj < vp[i] ? 1u : 0u;
        }
      };
      count_below(cb_hi.boundaries, 0, n_hi);
      count_below(cb_lo.boundaries, n_hi, d);
      std::fill(out, out + mse_bytes, uint8_t{0});
      for (int64_t i = 0; i < d; ++i) {
        put_bits(out, code_offset(i, n_hi, hi, lo), c[static_cast<size_t>(i)], i < n_hi ? hi : lo);
      }
      const float norm_f = norm > kFltMax ? std::numeric_limits<float>::infinity() : static_cast<float>(norm);
      meta[r * mc] = norm_f;
      if (mode_ != TurboMode::kProd) continue;
      // The residual of what will be decoded: the stored (rounded) norm.
      float stored[2] = {meta_fp16 ? round_to_fp16(norm_f) : norm_f, 0.0f};
      decode_rows(out, stored, 1, d, xm.data());
      double gg = 0;
      for (int64_t i = 0; i < d; ++i) {
        res[static_cast<size_t>(i)] = static_cast<double>(xr[i]) - xm[static_cast<size_t>(i)];
        gg += res[static_cast<size_t>(i)] * res[static_cast<size_t>(i)];
      }
      uint8_t* signs = out + mse_bytes;
      std::fill(signs, signs + (d + 7) / 8, uint8_t{0});
      for (int64_t j = 0; j < d; ++j) {
        const float* sj = tab->sketch.data() + j * d;
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += static_cast<double>(sj[i]) * res[static_cast<size_t>(i)];
        if (dot >= 0) signs[j / 8] = static_cast<uint8_t>(signs[j / 8] | (1u << (j % 8)));
      }
      const double gamma = std::sqrt(gg);
      // γ past float32 (a row near FLT_MAX decoded far off) is stored as FLT_MAX: finite, lossy.
      meta[r * mc + 1] = static_cast<float>(std::min<double>(gamma, kFltMax));
    }
  });
}

void TurboQuantizer::decode_rows(const uint8_t* codes, const float* meta, int64_t rows, int64_t d, float* out) const {
  const std::shared_ptr<const Tables> tab = tables(d);
  const int lo = lo_bits(), hi = hi_bits();
  const int64_t n_hi = hi_count(d);
  const int64_t cbytes = code_bytes(d), mc = meta_count(), mse_bytes = mse_code_bytes(d);
  const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<float> level_lo, level_hi;
  for (double v : gaussian_lloyd_max(lo).levels) level_lo.push_back(static_cast<float>(v * inv_sqrt_d));
  for (double v : gaussian_lloyd_max(hi).levels) level_hi.push_back(static_cast<float>(v * inv_sqrt_d));
  const double qjl = std::sqrt(kPi / 2.0) / static_cast<double>(d);
  detail::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    std::vector<float> c(static_cast<size_t>(d));
    std::vector<float> t(static_cast<size_t>(d));
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* in = codes + r * cbytes;
      float* o = out + r * d;
      for (int64_t i = 0; i < d; ++i) {
        const uint32_t code = get_bits(in, code_offset(i, n_hi, hi, lo), i < n_hi ? hi : lo);
        c[static_cast<size_t>(i)] = (i < n_hi ? level_hi : level_lo)[code];
      }
      if (nc_) {
        double cc = 0;
        for (int64_t i = 0; i < d; ++i) cc += static_cast<double>(c[static_cast<size_t>(i)]) * c[static_cast<size_t>(i)];
        const float inv = static_cast<float>(1.0 / std::sqrt(cc));  // cc > 0: no level is 0
        for (int64_t i = 0; i < d; ++i) c[static_cast<size_t>(i)] *= inv;
      }
      hadamard_rows(c.data(), 1, d);
      const double norm = meta[r * mc];
      for (int64_t i = 0; i < d; ++i) {
        o[i] = saturate(norm * tab->signs[static_cast<size_t>(i)] * c[static_cast<size_t>(i)]);
      }
      if (mode_ != TurboMode::kProd) continue;
      const double gamma = meta[r * mc + 1];
      if (gamma == 0) continue;
      // t = Sᵀ z, z_j = ±1.
      const uint8_t* signs = in + mse_bytes;
      std::fill(t.begin(), t.end(), 0.0f);
      for (int64_t j = 0; j < d; ++j) {
        const float zj = ((signs[j / 8] >> (j % 8)) & 1u) ? 1.0f : -1.0f;
        const float* sj = tab->sketch.data() + j * d;
        for (int64_t i = 0; i < d; ++i) t[static_cast<size_t>(i)] += zj * sj[i];
      }
      const double scale = qjl * gamma;
      for (int64_t i = 0; i < d; ++i) o[i] = saturate(static_cast<double>(o[i]) + scale * t[static_cast<size_t>(i)]);
    }
  });
}

void TurboQuantizer::check_input(const TensorView& x) const { check_head_dim(x.size(3), "quantize(x) [" + spec() + "]"); }

void TurboQuantizer::do_quantize_into(const Input& in, QuantizedTensor& q) const {
  const TensorView& x = in.x;
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  const int64_t rows = b * h * t, mc = meta_count();
  const std::string where = "quantize(x) [" + spec() + "]";
  q.format = spec();
  q.side.clear();
  q.shape = x.sizes();
  q.dtype = in.dtype;
  q.zeros.reset();
  q.codes.ensure(DType::kUInt8, {b, h, t, code_bytes(d)}, in.avoid_begin, in.avoid_end);
  std::vector<float> meta(static_cast<size_t>(rows * mc));
  const auto* xf = static_cast<const float*>(x.data);
  if (rows > 0) encode_rows(xf, rows, d, q.codes.data_as<uint8_t>(), meta.data(), /*meta_fp16=*/true);
  for (int64_t r = 0; r < rows; ++r) {
    if (std::isinf(meta[static_cast<size_t>(r * mc)])) {
      float amax = 0;
      for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::abs(xf[r * d + i]));
      throw InvalidArgument(detail::str_cat(
          where, ": row [b, h, t] = [", r / (t * h), ", ", (r / t) % h, ", ", r % t, "] (max |x| = ", amax,
          ") has a norm beyond float32 (", kFltMax, "); rows with every |x| <= FLT_MAX/sqrt(D) = ",
          kFltMax / std::sqrt(static_cast<float>(d)), " always fit (docs/quantizers.md, \"TurboQuant\")"));
    }
  }
  bool fp16_fits = true;
  for (float v : meta) fp16_fits = fp16_fits && v < 65504.0f + 16.0f;  // rounds to at most 65504
  if (fp16_fits) {
    q.scales.ensure(DType::kFloat16, {b, h, t, mc}, in.avoid_begin, in.avoid_end);
    if (!meta.empty()) (void)cast_to_fp16(meta.data(), static_cast<int64_t>(meta.size()), q.scales.data_as<uint16_t>());
    return;
  }
  // Rare (‖x‖ ≳ 65504): the whole tensor's metadata in fp32; the prod residual then against
  // the fp32 norm.
  if (mode_ == TurboMode::kProd && rows > 0) {
    encode_rows(xf, rows, d, q.codes.data_as<uint8_t>(), meta.data(), /*meta_fp16=*/false);
  }
  q.scales.ensure(DType::kFloat32, {b, h, t, mc}, in.avoid_begin, in.avoid_end);
  std::copy(meta.begin(), meta.end(), q.scales.data_as<float>());
}

void TurboQuantizer::do_dequantize_into(const QuantizedTensor& q, float* out) const {
  const std::string where = "dequantize_into(q, out) [" + spec() + "]";
  const int64_t b = q.shape[0], h = q.shape[1], t = q.shape[2], d = q.shape[3];
  KV_CHECK_ARG(d >= 1 && is_power_of_two(d), where, ": q.shape ", shape_str(q.shape),
               " has head_dim D = ", d, ", expected a power of two");
  const int64_t mc = meta_count();
  const std::vector<int64_t> code_shape{b, h, t, code_bytes(d)}, meta_shape{b, h, t, mc};
  check_codes_and_metadata(q, code_shape, meta_shape, where, "the norms");
  const int64_t rows = b * h * t;
  if (rows == 0) return;
  const std::vector<float> meta = metadata_to_fp32(q.scales.data(), q.scales.dtype() == DType::kFloat16, rows * mc);
  decode_rows(q.codes.data_as<uint8_t>(), meta.data(), rows, d, out);
}

StoredLayout TurboQuantizer::do_stored_layout(int64_t head_dim) const {
  check_head_dim(head_dim, "stored_layout(head_dim) [" + spec() + "]");
  StoredLayout l;
  l.axis = GroupAxis::kPerToken;
  l.group_tokens = 1;
  l.code_bytes = code_bytes(head_dim);
  l.meta_count = meta_count();
  l.has_zeros = false;
  l.meta_dtype = DType::kFloat16;
  l.kernel = KernelKind::kTurboQuant;
  return l;
}

EncodeStatus TurboQuantizer::do_encode(const float* x, int64_t groups, int64_t head_dim, float /*tensor_scale*/,
                                       GroupBuffers out) const {
  EncodeStatus s;
  const int64_t n = groups * head_dim;
  s.nonfinite = any_nonfinite(x, n);
  if (s.nonfinite || groups == 0) return s;
  const int64_t mc = meta_count();
  std::vector<float> meta(static_cast<size_t>(groups * mc));
  encode_rows(x, groups, head_dim, out.codes, meta.data(), /*meta_fp16=*/true);
  const CastStatus cs = cast_to_fp16(meta.data(), groups * mc, static_cast<uint16_t*>(out.scales));
  s.overflow = cs.overflow || cs.nonfinite;
  return s;
}

void TurboQuantizer::do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float /*tensor_scale*/,
                               float* out) const {
  if (groups == 0) return;
  const int64_t mc = meta_count();
  std::vector<float> meta(static_cast<size_t>(groups * mc));
  fp16_to_fp32(static_cast<const uint16_t*>(in.scales), groups * mc, meta.data());
  decode_rows(in.codes, meta.data(), groups, head_dim, out);
}

}  // namespace kvcache::quant
