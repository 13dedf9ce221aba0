// SPDX-License-Identifier: Apache-2.0
#include "quant/polar_quantizer.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/parallel.h"
#include "kvcache/error.h"
#include "quant/bit_stream.h"
#include "quant/cast_kernels.h"
#include "quant/checks.h"
#include "quant/hadamard.h"
#include "quant/seeded_random.h"

namespace kvcache::quant {
namespace {

constexpr double kPi = 3.14159265358979323846;
constexpr float kFltMax = std::numeric_limits<float>::max();
constexpr int kBits[5] = {0, 4, 2, 2, 2};  ///< code bits of an angle by level

float saturate(double v) {
  if (std::isnan(v)) return static_cast<float>(v);
  return static_cast<float>(std::min<double>(std::max<double>(v, -kFltMax), kFltMax));
}

/// The orthonormal Walsh–Hadamard transform of d doubles in place (hadamard.h's H_d, in double:
/// no intermediate can overflow for finite float input).
void fwht(double* x, int64_t d) {
  for (int64_t h = 1; h < d; h *= 2) {
    for (int64_t i = 0; i < d; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        const double u = x[j], v = x[j + h];
        x[j] = u + v;
        x[j + h] = u - v;
      }
    }
  }
  const double s = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t j = 0; j < d; ++j) x[j] *= s;
}

/// 4-level Lloyd–Max quantizer of the density ∝ (sin ψ cos ψ)^(n−1) on [0, π/2], on a grid of
/// 200000 midpoints, Lloyd iterations from the uniform grid until no level moves by 1e-12.
PolarCodebook solve_angle(int n) {
  const int grid = 200000, k = 4;
  std::vector<double> psi(grid), w(grid);
  double total = 0;
  for (int i = 0; i < grid; ++i) {
    psi[static_cast<size_t>(i)] = (i + 0.5) * (kPi / 2) / grid;
    w[static_cast<size_t>(i)] = std::pow(std::sin(psi[static_cast<size_t>(i)]) * std::cos(psi[static_cast<size_t>(i)]), n - 1);
    total += w[static_cast<size_t>(i)];
  }
  PolarCodebook cb;
  for (int j = 0; j < k; ++j) cb.levels.push_back((j + 0.5) * (kPi / 2) / k);
  cb.thresholds.resize(k - 1);
  for (int it = 0; it < 10000; ++it) {
    for (int j = 0; j + 1 < k; ++j) cb.thresholds[static_cast<size_t>(j)] = 0.5 * (cb.levels[static_cast<size_t>(j)] + cb.levels[static_cast<size_t>(j) + 1]);
    std::vector<double> num(k, 0.0), den(k, 0.0);
    for (int i = 0; i < grid; ++i) {
      const auto c = static_cast<size_t>(std::lower_bound(cb.thresholds.begin(), cb.thresholds.end(), psi[static_cast<size_t>(i)]) - cb.thresholds.begin());
      num[c] += w[static_cast<size_t>(i)] * psi[static_cast<size_t>(i)];
      den[c] += w[static_cast<size_t>(i)];
    }
    double moved = 0;
    for (int j = 0; j < k; ++j) {
      const double c = den[static_cast<size_t>(j)] > 0 ? num[static_cast<size_t>(j)] / den[static_cast<size_t>(j)] : cb.levels[static_cast<size_t>(j)];
      moved = std::max(moved, std::abs(c - cb.levels[static_cast<size_t>(j)]));
      cb.levels[static_cast<size_t>(j)] = c;
    }
    if (moved < 1e-12) break;
  }
  for (int j = 0; j + 1 < k; ++j) cb.thresholds[static_cast<size_t>(j)] = 0.5 * (cb.levels[static_cast<size_t>(j)] + cb.levels[static_cast<size_t>(j) + 1]);
  double se = 0;
  for (int i = 0; i < grid; ++i) {
    const auto c = static_cast<size_t>(std::lower_bound(cb.thresholds.begin(), cb.thresholds.end(), psi[static_cast<size_t>(i)]) - cb.thresholds.begin());
    se += w[static_cast<size_t>(i)] * (psi[static_cast<size_t>(i)] - cb.levels[c]) * (psi[static_cast<size_t>(i)] - cb.levels[c]);
  }
  cb.mse = se / total;
  return cb;
}

PolarCodebook uniform_circle() {
  PolarCodebook cb;
  const double step = 2 * kPi / 16;
  for (int j = 0; j < 16; ++j) cb.levels.push_back(-kPi + (j + 0.5) * step);
  for (int j = 1; j < 16; ++j) cb.thresholds.push_back(-kPi + j * step);
  cb.mse = step * step / 12;
  return cb;
}

using bit_stream::get_bits;
using bit_stream::put_bits;

void check_head_dim(int64_t d, const std::string& where) {
  KV_CHECK_ARG(d >= 16 && is_power_of_two(d), where,
               ": PolarQuant needs head_dim D a power of two >= 16 (blocks of 16 values, 4 polar levels; the "
               "randomized Hadamard preconditioning), got D = ",
               d, " (no padding is done)");
}

}  // namespace

const PolarCodebook& polar_codebook(int level) {
  KV_CHECK_ARG(level >= 1 && level <= 4, "polar_codebook(level): level must be in [1, 4], got ", level);
  static const PolarCodebook l1 = uniform_circle();
  static const PolarCodebook l2 = solve_angle(2), l3 = solve_angle(4), l4 = solve_angle(8);
  switch (level) {
    case 1: return l1;
    case 2: return l2;
    case 3: return l3;
    default: return l4;
  }
}

const ParamTable& PolarQuantizer::table() {
  static const ParamTable t{"polar",
                            "PolarQuant (arXiv 2502.02617): randomized-Hadamard preconditioning, then per block of 16 "
                            "values a 4-level polar transform, angles quantized by fixed codebooks at 4/2/2/2 bits, one "
                            "fp16 radius per block (3.875 bits/value, no scales or zeros)",
                            {{"seed", "preconditioning seed (as tq's)", ParamDef::Kind::kInt, 42, 0, 2147483647.0, {}}}};
  return t;
}

PolarQuantizer::PolarQuantizer(int64_t seed) : seed_(seed) {
  KV_CHECK_ARG(seed >= 0 && seed <= 2147483647, "polar: seed must be in [0, 2147483647], got ", seed);
}

std::string PolarQuantizer::spec() const { return canonical_spec(table(), {{"seed", static_cast<double>(seed_)}}, {}); }

double PolarQuantizer::bits_per_value(int64_t head_dim) const {
  KV_CHECK_ARG(head_dim > 0, "bits_per_value(head_dim) [", spec(), "]: head_dim must be > 0, got ", head_dim);
  return static_cast<double>(8 * code_bytes(head_dim) + 16 * (head_dim / 16)) / static_cast<double>(head_dim);
}

std::shared_ptr<const std::vector<double>> PolarQuantizer::signs(int64_t d) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = signs_.find(d);
  if (it != signs_.end()) return it->second;
  auto s = std::make_shared<std::vector<double>>(static_cast<size_t>(d));
  for (int64_t i = 0; i < d; ++i) {
    const uint64_t word = seeded::draw(seed_, 0x5157, static_cast<uint64_t>(i / 64));
    (*s)[static_cast<size_t>(i)] = ((word >> (i % 64)) & 1u) ? -1.0 : 1.0;
  }
  signs_.emplace(d, s);
  return s;
}

std::shared_ptr<const PolarQuantizer::KernelTables> PolarQuantizer::kernel_tables(int64_t d) const {
  const auto sg = signs(d);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = kernel_tables_.find(d);
  if (it != kernel_tables_.end()) return it->second;
  auto t = std::make_shared<KernelTables>();
  for (double v : *sg) t->signs.push_back(static_cast<float>(v));
  t->angles.assign(80, 0.0f);
  const std::vector<double>& l1 = polar_codebook(1).levels;
  for (size_t i = 0; i < 16; ++i) {
    t->angles[i] = static_cast<float>(std::cos(l1[i]));
    t->angles[16 + i] = static_cast<float>(std::sin(l1[i]));
  }
  for (int level = 2; level <= 4; ++level) {
    const std::vector<double>& l = polar_codebook(level).levels;
    float* out = t->angles.data() + 32 + 16 * (level - 2);
    for (size_t i = 0; i < 4; ++i) {
      out[i] = static_cast<float>(std::cos(l[i]));
      out[4 + i] = static_cast<float>(std::sin(l[i]));
    }
  }
  kernel_tables_.emplace(d, t);
  return t;
}

void PolarQuantizer::encode_rows(const float* x, int64_t rows, int64_t d, uint8_t* codes, float* radii) const {
  const auto sg = signs(d);
  const PolarCodebook* cb[5] = {nullptr, &polar_codebook(1), &polar_codebook(2), &polar_codebook(3), &polar_codebook(4)};
  const int64_t cbytes = code_bytes(d), blocks = d / 16;
  detail::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    std::vector<double> y(static_cast<size_t>(d));
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t i = 0; i < d; ++i) y[static_cast<size_t>(i)] = static_cast<double>(x[r * d + i]) * (*sg)[static_cast<size_t>(i)];
      fwht(y.data(), d);
      uint8_t* out = codes + r * cbytes;
      std::fill(out, out + cbytes, uint8_t{0});
      int64_t bit = 0;
      for (int64_t b = 0; b < blocks; ++b) {
        double rad[8];
        const double* v = y.data() + b * 16;
        for (int i = 0; i < 8; ++i) {
          rad[i] = std::hypot(v[2 * i], v[2 * i + 1]);
          const double theta = std::atan2(v[2 * i + 1], v[2 * i]);
          const auto& t = cb[1]->thresholds;
          put_bits(out, bit, static_cast<uint32_t>(std::lower_bound(t.begin(), t.end(), theta) - t.begin()), 4);
          bit += 4;
        }
        for (int level = 2, n = 8; level <= 4; ++level, n /= 2) {
          for (int i = 0; i < n / 2; ++i) {
            const double psi = std::atan2(rad[2 * i + 1], rad[2 * i]);
            rad[i] = std::hypot(rad[2 * i], rad[2 * i + 1]);
            const auto& t = cb[level]->thresholds;
            put_bits(out, bit, static_cast<uint32_t>(std::lower_bound(t.begin(), t.end(), psi) - t.begin()), 2);
            bit += 2;
          }
        }
        radii[r * blocks + b] = rad[0] > kFltMax ? std::numeric_limits<float>::infinity() : static_cast<float>(rad[0]);
      }
    }
  });
}

void PolarQuantizer::decode_rows(const uint8_t* codes, const float* radii, int64_t rows, int64_t d, float* out) const {
  const auto sg = signs(d);
  const PolarCodebook* cb[5] = {nullptr, &polar_codebook(1), &polar_codebook(2), &polar_codebook(3), &polar_codebook(4)};
  const int64_t cbytes = code_bytes(d), blocks = d / 16;
  detail::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    std::vector<double> y(static_cast<size_t>(d));
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* in = codes + r * cbytes;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t base = b * 46;
        // Levels' code offsets in the block: level 1 at 0 (8 × 4), level 2 at 32 (4 × 2), 3 at 40, 4 at 44.
        double rad[8];
        rad[0] = radii[r * blocks + b];
        const int64_t offset[5] = {0, 0, 32, 40, 44};
        for (int level = 4, n = 1; level >= 2; --level, n *= 2) {
          // n radii at this level's output → 2n radii below.
          for (int i = n - 1; i >= 0; --i) {
            const double psi = cb[level]->levels[get_bits(in, base + offset[level] + 2 * i, kBits[level])];
            const double rr = rad[i];
            rad[2 * i] = rr * std::cos(psi);
            rad[2 * i + 1] = rr * std::sin(psi);
          }
        }
        double* v = y.data() + b * 16;
        for (int i = 0; i < 8; ++i) {
          const double theta = cb[1]->levels[get_bits(in, base + 4 * i, 4)];
          v[2 * i] = rad[i] * std::cos(theta);
          v[2 * i + 1] = rad[i] * std::sin(theta);
        }
      }
      fwht(y.data(), d);
      for (int64_t i = 0; i < d; ++i) out[r * d + i] = saturate(y[static_cast<size_t>(i)] * (*sg)[static_cast<size_t>(i)]);
    }
  });
}

void PolarQuantizer::check_input(const TensorView& x) const { check_head_dim(x.size(3), "quantize(x) [" + spec() + "]"); }

void PolarQuantizer::do_quantize_into(const Input& in, QuantizedTensor& q) const {
  const TensorView& x = in.x;
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  const int64_t rows = b * h * t, blocks = d / 16;
  const std::string where = "quantize(x) [" + spec() + "]";
  q.format = spec();
  q.side.clear();
  q.shape = x.sizes();
  q.dtype = in.dtype;
  q.zeros.reset();
  q.codes.ensure(DType::kUInt8, {b, h, t, code_bytes(d)}, in.avoid_begin, in.avoid_end);
  std::vector<float> radii(static_cast<size_t>(rows * blocks));
  if (rows > 0) encode_rows(static_cast<const float*>(x.data), rows, d, q.codes.data_as<uint8_t>(), radii.data());
  bool fp16_fits = true;
  for (size_t i = 0; i < radii.size(); ++i) {
    if (std::isinf(radii[i])) {
      const int64_t r = static_cast<int64_t>(i) / blocks;
      throw InvalidArgument(detail::str_cat(where, ": row [b, h, t] = [", r / (t * h), ", ", (r / t) % h, ", ", r % t,
                                            "] has a block radius beyond float32 (", kFltMax,
                                            "); rows with every |x| <= FLT_MAX/sqrt(D) always fit"));
    }
    fp16_fits = fp16_fits && radii[i] < 65520.0f;
  }
  if (fp16_fits) {
    q.scales.ensure(DType::kFloat16, {b, h, t, blocks}, in.avoid_begin, in.avoid_end);
    if (!radii.empty()) (void)cast_to_fp16(radii.data(), static_cast<int64_t>(radii.size()), q.scales.data_as<uint16_t>());
  } else {
    q.scales.ensure(DType::kFloat32, {b, h, t, blocks}, in.avoid_begin, in.avoid_end);
    std::copy(radii.begin(), radii.end(), q.scales.data_as<float>());
  }
}

void PolarQuantizer::do_dequantize_into(const QuantizedTensor& q, float* out) const {
  const std::string where = "dequantize_into(q, out) [" + spec() + "]";
  const int64_t b = q.shape[0], h = q.shape[1], t = q.shape[2], d = q.shape[3];
  check_head_dim(d, where);
  const int64_t blocks = d / 16;
  const std::vector<int64_t> code_shape{b, h, t, code_bytes(d)}, meta_shape{b, h, t, blocks};
  check_codes_and_metadata(q, code_shape, meta_shape, where, "the radii");
  const int64_t rows = b * h * t;
  if (rows == 0) return;
  const std::vector<float> radii = metadata_to_fp32(q.scales.data(), q.scales.dtype() == DType::kFloat16, rows * blocks);
  decode_rows(q.codes.data_as<uint8_t>(), radii.data(), rows, d, out);
}

StoredLayout PolarQuantizer::do_stored_layout(int64_t head_dim) const {
  check_head_dim(head_dim, "stored_layout(head_dim) [" + spec() + "]");
  StoredLayout l;
  l.group_tokens = 1;
  l.code_bytes = code_bytes(head_dim);
  l.meta_count = head_dim / 16;
  l.has_zeros = false;
  l.meta_dtype = DType::kFloat16;
  l.kernel = KernelKind::kPolar;
  return l;
}

EncodeStatus PolarQuantizer::do_encode(const float* x, int64_t groups, int64_t head_dim, float /*tensor_scale*/,
                                       GroupBuffers out) const {
  EncodeStatus s;
  const int64_t n = groups * head_dim;
  s.nonfinite = any_nonfinite(x, n);
  if (s.nonfinite || groups == 0) return s;
  std::vector<float> radii(static_cast<size_t>(groups * (head_dim / 16)));
  encode_rows(x, groups, head_dim, out.codes, radii.data());
  const CastStatus cs = cast_to_fp16(radii.data(), static_cast<int64_t>(radii.size()), static_cast<uint16_t*>(out.scales));
  s.overflow = cs.overflow || cs.nonfinite;
  return s;
}

void PolarQuantizer::do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float /*tensor_scale*/,
                               float* out) const {
  if (groups == 0) return;
  std::vector<float> radii(static_cast<size_t>(groups * (head_dim / 16)));
  fp16_to_fp32(static_cast<const uint16_t*>(in.scales), static_cast<int64_t>(radii.size()), radii.data());
  decode_rows(in.codes, radii.data(), groups, head_dim, out);
}

}  // namespace kvcache::quant
