// SPDX-License-Identifier: Apache-2.0
// KVQuant calibration (kvcache/kvquant.h): the tail selection, quantiles, 1-D k-means (Eigen
// for the per-cluster sums), the fit over captured K/V and the versioned file format.
#include "kvcache/kvquant.h"

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numeric>
#include <sstream>

#include "common/file_io.h"
#include "common/log.h"
#include "common/view_ops.h"
#include "kvcache/error.h"

namespace kvcache {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'Q', 'C', 'A', 'L', 'I', 'B'};

std::string list_bits(const std::vector<int>& b) {
  std::string s;
  for (int v : b) s += (s.empty() ? "" : ", ") + std::to_string(v);
  return "{" + s + "}";
}

std::string list_levels(const std::vector<KvquantLevel>& l) {
  std::ostringstream os;
  os.precision(17);
  os << "{";
  for (size_t i = 0; i < l.size(); ++i) os << (i ? ", " : "") << l[i].sparsity;
  os << "}";
  return os.str();
}

void check_sparsity(double p, const std::string& what) {
  KV_CHECK_ARG(std::isfinite(p) && p > 0.9 && p <= 1.0, what, ": sparsity ", p,
               " must be in (0.9, 1] (0.99 = 1% outliers; 1 = none)");
}

/// Nearest centroid of `y` among ascending `c` (an exact midpoint goes to the lower one).
int nearest(const std::vector<float>& c, float y) {
  int lo = 0;
  int hi = static_cast<int>(c.size()) - 1;
  while (lo < hi) {  // first index whose upper midpoint is >= y
    const int mid = (lo + hi) / 2;
    const float m = 0.5f * (c[static_cast<size_t>(mid)] + c[static_cast<size_t>(mid) + 1]);
    if (y <= m) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

/// Q-Norm of codebook `c` over samples `y`: the affine map that gives the dequantised samples
/// the mean and standard deviation of `y`.
void fit_qnorm(KvquantCodebook& cb, const std::vector<float>& y, const std::vector<float>* w = nullptr) {
  double s = 0, s2 = 0, q = 0, q2 = 0, sw = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const float v = y[i];
    const double a = w == nullptr ? 1.0 : (*w)[i];
    const double r = cb.centroids[static_cast<size_t>(nearest(cb.centroids, v))];
    s += a * v;
    s2 += a * static_cast<double>(v) * v;
    q += a * r;
    q2 += a * r * r;
    sw += a;
  }
  const double n = w == nullptr ? static_cast<double>(y.size()) : sw;
  const double mu = s / n, mq = q / n;
  const double sd = std::sqrt(std::max(0.0, s2 / n - mu * mu));
  const double sq = std::sqrt(std::max(0.0, q2 / n - mq * mq));
  const double a = sq > 0 && sd > 0 ? sd / sq : 1.0;
  cb.qnorm_scale = static_cast<float>(a);
  cb.qnorm_shift = static_cast<float>(mu - a * mq);
}

/// Deterministic stride subsample of `y` to at most `cap` values (0: all).
std::vector<float> subsample(const std::vector<float>& y, int64_t cap) {
  const int64_t n = static_cast<int64_t>(y.size());
  if (cap <= 0 || n <= cap) return y;
  std::vector<float> out(static_cast<size_t>(cap));
  for (int64_t i = 0; i < cap; ++i) out[static_cast<size_t>(i)] = y[static_cast<size_t>(i * n / cap)];
  return out;
}

/// `what` names the pool in messages ("layer 0 keys at sparsity 0.99").
KvquantCodebook fit_codebook(const std::vector<float>& pool, int bits, const KvquantFitOptions& o,
                             const std::vector<float>* weights, const std::string& what) {
  KvquantCodebook cb;
  cb.bits = bits;
  // A weighted pool whose weights are all zero carries no information: refused, not fitted as
  // anything (it used to become a uniform grid silently).
  KV_CHECK_ARG(pool.empty() || weights == nullptr ||
                   std::any_of(weights->begin(), weights->end(), [](float a) { return a > 0; }),
               "fit_kvquant_calibration: ", what, ": every one of the ", pool.size(),
               " calibration values its codebook is fitted to (the non-outliers) has weight 0; a weighted "
               "k-means needs a positive weight there (check the weights, or fit without them)");
  if (pool.empty()) {
    // Every calibration value was an outlier (cannot happen for p > 0.9 and D >= 2): a
    // uniform grid keeps the codebook usable.
    const int k = 1 << bits;
    for (int j = 0; j < k; ++j) cb.centroids.push_back(-1.0f + (2.0f * static_cast<float>(j) + 1.0f) / static_cast<float>(k));
    return cb;
  }
  const std::vector<float> y = subsample(pool, o.max_samples);
  if (weights != nullptr) {
    const std::vector<float> w = subsample(*weights, o.max_samples);  // the same stride
    if (!std::any_of(w.begin(), w.end(), [](float a) { return a > 0; })) {
      // Only zero weights left after the subsample: the unweighted fit of those values, said.
      log::warn_once("kvquant-subsample-zero-weights:" + what,
                     "fit_kvquant_calibration: " + what + ": the subsample of " + std::to_string(y.size()) +
                         " of its " + std::to_string(pool.size()) +
                         " calibration values kept only values of weight 0; its codebook is fitted unweighted");
      cb.centroids = kmeans_1d(y.data(), static_cast<int64_t>(y.size()), 1 << bits, o.max_iter);
      fit_qnorm(cb, y);
      return cb;
    }
    cb.centroids = kmeans_1d_weighted(y.data(), w.data(), static_cast<int64_t>(y.size()), 1 << bits, o.max_iter);
    fit_qnorm(cb, y, &w);
    return cb;
  }
  cb.centroids = kmeans_1d(y.data(), static_cast<int64_t>(y.size()), 1 << bits, o.max_iter);
  fit_qnorm(cb, y);
  return cb;
}

// ---- binary file: little-endian -----------------------------------------------------------
class Writer {
 public:
  template <typename T>
  void put(T v) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out_.append(b, sizeof(T));
  }
  void floats(const std::vector<float>& v) {
    for (float f : v) put<float>(f);
  }
  void bytes(const char* p, size_t n) { out_.append(p, n); }
  std::string& str() { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  Reader(const std::string& data, const std::string& path) : d_(data), path_(path) {}
  template <typename T>
  T get(const char* what) {
    KV_CHECK_ARG(pos_ + sizeof(T) <= d_.size(), "KVQuant calibration '", path_, "' is truncated: it ends at byte ",
                 d_.size(), " inside ", what, " (at byte ", pos_, ")");
    T v;
    std::memcpy(&v, d_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::vector<float> floats(size_t n, const char* what) {
    std::vector<float> v(n);
    for (auto& f : v) f = get<float>(what);
    return v;
  }
  size_t pos() const { return pos_; }

 private:
  const std::string& d_;
  const std::string& path_;
  size_t pos_ = 0;
};

/// FNV-1a 64 (docs/quantizers.md, "KVQuant calibration file"): offset basis
/// 14695981039346656037 (0xcbf29ce484222325), prime 1099511628211.
constexpr uint64_t kFnvOffsetBasis = 14695981039346656037ull;
/// The offset basis builds before format version 2 wrote by mistake (a digit short of the
/// standard one): version 1 files carrying it are still read.
constexpr uint64_t kLegacyV1OffsetBasis = 1469598103934665603ull;

uint64_t fnv1a(const char* p, size_t n, uint64_t basis = kFnvOffsetBasis) {
  uint64_t h = basis;
  for (size_t i = 0; i < n; ++i) {
    h ^= static_cast<unsigned char>(p[i]);
    h *= 1099511628211ull;
  }
  return h;
}

bool little_endian() {
  const uint16_t x = 1;
  unsigned char b[2];
  std::memcpy(b, &x, 2);
  return b[0] == 1;
}

}  // namespace

// ---------------------------------------------------------------- math
int64_t kvquant_tail_count(int64_t n, double p) {
  KV_CHECK_ARG(n >= 1, "kvquant_tail_count: n must be >= 1, got ", n);
  check_sparsity(p, "kvquant_tail_count");
  if (p >= 1.0) return 0;
  const double t = 1.0 - (1.0 - p) / 2.0;
  // ceil of t·(n−1), robust to the rounding of t (0.995·(4096−1) = 4074.525 exactly in decimal).
  const double pos = t * static_cast<double>(n - 1);
  int64_t c = static_cast<int64_t>(std::ceil(pos - 1e-9));
  c = std::max<int64_t>(0, std::min<int64_t>(c, n - 1));
  return std::min<int64_t>(n - c, n / 2);
}

std::vector<int64_t> select_tails(const float* x, int64_t n, int64_t stride, int64_t k) {
  KV_CHECK_ARG(k >= 0 && 2 * k <= n, "select_tails: 2k = ", 2 * k, " outliers of ", n, " values");
  std::vector<int64_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  auto val = [&](int64_t i) { return x[i * stride]; };
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(2 * k));
  if (k == 0) return out;
  // Upper tail: largest first, ties to the lower index.
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int64_t a, int64_t b) {
    return val(a) > val(b) || (val(a) == val(b) && a < b);
  });
  out.assign(idx.begin(), idx.begin() + k);
  // Lower tail among the others: smallest first, ties to the lower index.
  std::partial_sort(idx.begin() + k, idx.begin() + 2 * k, idx.end(), [&](int64_t a, int64_t b) {
    return val(a) < val(b) || (val(a) == val(b) && a < b);
  });
  out.insert(out.end(), idx.begin() + k, idx.begin() + 2 * k);
  return out;
}

float quantile_sorted(const std::vector<float>& sorted, double q) {
  KV_CHECK_ARG(!sorted.empty(), "quantile_sorted: empty input");
  KV_CHECK_ARG(q >= 0.0 && q <= 1.0, "quantile_sorted: q = ", q, " must be in [0, 1]");
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  const double frac = pos - static_cast<double>(lo);
  return static_cast<float>(sorted[lo] + frac * (static_cast<double>(sorted[hi]) - sorted[lo]));
}

namespace {
/// Lloyd iterations over sorted values `xs` from the centroids `c`: assign each value to its
/// nearest centroid; stop when no assignment changes or after `max_iter` rounds; else each
/// non-empty cluster — a contiguous run [start, end) of the sorted values — gets
/// `mean(start, end, centroid)`, and the centroids are re-sorted.
template <typename Mean>
std::vector<float> lloyd_sorted(const std::vector<float>& xs, std::vector<float> c, int max_iter, Mean mean) {
  const auto n = static_cast<int64_t>(xs.size());
  const auto k = static_cast<int>(c.size());
  std::vector<int> assign(static_cast<size_t>(n), -1);
  for (int it = 0; it < max_iter; ++it) {
    bool changed = false;
    for (int64_t i = 0; i < n; ++i) {
      const int a = nearest(c, xs[static_cast<size_t>(i)]);
      changed = changed || a != assign[static_cast<size_t>(i)];
      assign[static_cast<size_t>(i)] = a;
    }
    if (!changed) break;
    int64_t start = 0;
    for (int j = 0; j < k; ++j) {
      int64_t end = start;
      while (end < n && assign[static_cast<size_t>(end)] == j) ++end;
      if (end > start) mean(start, end, c[static_cast<size_t>(j)]);
      start = end;
    }
    std::sort(c.begin(), c.end());
  }
  return c;
}
}  // namespace

std::vector<float> kmeans_1d(const float* x, int64_t n, int k, int max_iter) {
  KV_CHECK_ARG(n >= 1 && k >= 1 && max_iter >= 1, "kmeans_1d: needs n >= 1, k >= 1, max_iter >= 1, got ", n, ", ", k,
               ", ", max_iter);
  std::vector<float> sorted(x, x + n);
  std::sort(sorted.begin(), sorted.end());
  std::vector<float> c(static_cast<size_t>(k));
  for (int j = 0; j < k; ++j) c[static_cast<size_t>(j)] = quantile_sorted(sorted, (j + 0.5) / k);
  const Eigen::Map<const Eigen::ArrayXf> data(sorted.data(), static_cast<Eigen::Index>(n));
  // Each cluster's mean is one Eigen segment sum.
  return lloyd_sorted(sorted, std::move(c), max_iter, [&](int64_t start, int64_t end, float& centroid) {
    const double sum =
        data.segment(static_cast<Eigen::Index>(start), static_cast<Eigen::Index>(end - start)).cast<double>().sum();
    centroid = static_cast<float>(sum / static_cast<double>(end - start));
  });
}

std::vector<float> kmeans_1d_weighted(const float* x, const float* w, int64_t n, int k, int max_iter) {
  KV_CHECK_ARG(n >= 1 && k >= 1 && max_iter >= 1, "kmeans_1d_weighted: needs n >= 1, k >= 1, max_iter >= 1, got ",
               n, ", ", k, ", ", max_iter);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x[a] < x[b]; });
  std::vector<float> xs(static_cast<size_t>(n)), ws(static_cast<size_t>(n)), positive;
  for (int64_t i = 0; i < n; ++i) {
    const float a = w[order[static_cast<size_t>(i)]];
    KV_CHECK_ARG(std::isfinite(a) && a >= 0, "kmeans_1d_weighted: weight ", a, " at index ",
                 order[static_cast<size_t>(i)], " (expected finite and >= 0)");
    xs[static_cast<size_t>(i)] = x[order[static_cast<size_t>(i)]];
    ws[static_cast<size_t>(i)] = a;
    if (a > 0) positive.push_back(xs[static_cast<size_t>(i)]);
  }
  KV_CHECK_ARG(!positive.empty(), "kmeans_1d_weighted: every one of the ", n, " weights is 0");
  std::vector<float> c(static_cast<size_t>(k));
  for (int j = 0; j < k; ++j) c[static_cast<size_t>(j)] = quantile_sorted(positive, (j + 0.5) / k);
  // Each cluster's weighted mean; a cluster of zero weight keeps its centroid.
  return lloyd_sorted(xs, std::move(c), max_iter, [&](int64_t start, int64_t end, float& centroid) {
    double sw = 0, swx = 0;
    for (int64_t i = start; i < end; ++i) {
      sw += ws[static_cast<size_t>(i)];
      swx += static_cast<double>(ws[static_cast<size_t>(i)]) * xs[static_cast<size_t>(i)];
    }
    if (sw > 0) centroid = static_cast<float>(swx / sw);
  });
}

// ---------------------------------------------------------------- KvquantCalibration
const KvquantLevel& KvquantCalibration::level(double p) const {
  for (const auto& l : levels) {
    if (l.sparsity == p) return l;
  }
  KV_CHECK_ARG(false, "the KVQuant calibration holds no level of sparsity ", p, " (it holds ", list_levels(levels),
               "; kv_study calibrate --sparsity sets them)");
  return levels.front();  // unreachable
}

size_t KvquantCalibration::bits_index(int b) const {
  for (size_t i = 0; i < bits.size(); ++i) {
    if (bits[i] == b) return i;
  }
  KV_CHECK_ARG(false, "the KVQuant calibration holds no ", b, "-bit codebooks (it holds ", list_bits(bits),
               "; kv_study calibrate --bits sets them)");
  return 0;  // unreachable
}

void KvquantCalibration::check(const std::string& what) const {
  KV_CHECK_ARG(num_layers >= 1 && num_layers <= 4096 && num_kv_heads >= 1 && num_kv_heads <= 4096 && head_dim >= 2 &&
                   head_dim <= 4096,
               what, ": bad shape [L=", num_layers, ", H_kv=", num_kv_heads, ", D=", head_dim, "]");
  KV_CHECK_ARG(!bits.empty() && !levels.empty(), what, ": no codebook widths or no sparsity levels");
  for (size_t i = 0; i < bits.size(); ++i) {
    KV_CHECK_ARG(bits[i] >= 2 && bits[i] <= 4 && (i == 0 || bits[i] > bits[i - 1]), what, ": codebook widths ",
                 list_bits(bits), " must be ascending values of {2, 3, 4}");
  }
  const size_t hd = static_cast<size_t>(num_kv_heads * head_dim);
  for (size_t i = 0; i < levels.size(); ++i) {
    const KvquantLevel& lv = levels[i];
    check_sparsity(lv.sparsity, what);
    KV_CHECK_ARG(i == 0 || lv.sparsity > levels[i - 1].sparsity, what, ": sparsity levels ", list_levels(levels),
                 " must be ascending and distinct");
    KV_CHECK_ARG(static_cast<int64_t>(lv.layers.size()) == num_layers, what, ": level ", lv.sparsity, " holds ",
                 lv.layers.size(), " layers, expected ", num_layers);
    for (size_t l = 0; l < lv.layers.size(); ++l) {
      const auto& c = lv.layers[l];
      KV_CHECK_ARG(c.key_lower.size() == hd && c.key_upper.size() == hd, what, ": layer ", l, " holds ",
                   c.key_lower.size(), "/", c.key_upper.size(), " key thresholds, expected H_kv·D = ", hd);
      for (size_t j = 0; j < hd; ++j) {
        KV_CHECK_ARG(std::isfinite(c.key_lower[j]) && std::isfinite(c.key_upper[j]) && c.key_lower[j] <= c.key_upper[j],
                     what, ": layer ", l, " channel ", j, ": key thresholds [", c.key_lower[j], ", ", c.key_upper[j],
                     "] are not finite and ordered");
      }
      for (const auto* books : {&c.key_codebooks, &c.value_codebooks}) {
        KV_CHECK_ARG(books->size() == bits.size(), what, ": layer ", l, " holds ", books->size(),
                     " codebooks, expected ", bits.size());
        for (size_t b = 0; b < bits.size(); ++b) {
          const KvquantCodebook& cb = (*books)[b];
          KV_CHECK_ARG(cb.bits == bits[b] && cb.centroids.size() == (size_t{1} << bits[b]), what, ": layer ", l,
                       ": a ", bits[b], "-bit codebook holds ", cb.centroids.size(), " centroids");
          KV_CHECK_ARG(std::is_sorted(cb.centroids.begin(), cb.centroids.end()) &&
                           std::all_of(cb.centroids.begin(), cb.centroids.end(), [](float v) { return std::isfinite(v); }),
                       what, ": layer ", l, ": a ", bits[b], "-bit codebook is not finite and ascending");
          KV_CHECK_ARG(std::isfinite(cb.qnorm_scale) && cb.qnorm_scale > 0 && std::isfinite(cb.qnorm_shift), what,
                       ": layer ", l, ": bad Q-Norm scale ", cb.qnorm_scale, " / shift ", cb.qnorm_shift);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- fit
KvquantCalibration fit_kvquant_calibration(const std::vector<TensorView>& keys, const std::vector<TensorView>& values,
                                           const KvquantFitOptions& o, const std::string& source,
                                           const KvquantWeights* weights) {
  KV_CHECK_ARG(!keys.empty() && keys.size() == values.size(), "fit_kvquant_calibration: ", keys.size(),
               " key layers and ", values.size(), " value layers (expected the same number, >= 1)");
  KV_CHECK_ARG(o.max_iter >= 1 && o.max_samples >= 0, "fit_kvquant_calibration: max_iter must be >= 1 and "
               "max_samples >= 0");
  KvquantCalibration cal;
  cal.num_layers = static_cast<int64_t>(keys.size());
  cal.num_kv_heads = keys[0].rank == 3 ? keys[0].size(1) : 0;
  cal.head_dim = keys[0].rank == 3 ? keys[0].size(2) : 0;
  cal.tokens = keys[0].rank == 3 ? keys[0].size(0) : 0;
  cal.source = source;
  cal.bits = o.bits;
  std::sort(cal.bits.begin(), cal.bits.end());
  std::vector<double> ps = o.sparsities;
  std::sort(ps.begin(), ps.end());
  for (double p : ps) check_sparsity(p, "fit_kvquant_calibration");
  const int64_t H = cal.num_kv_heads, D = cal.head_dim;
  std::vector<std::vector<float>> K(keys.size()), V(values.size());
  for (size_t l = 0; l < keys.size(); ++l) {
    for (const auto* t : {&keys[l], &values[l]}) {
      KV_CHECK_ARG(t->defined() && t->rank == 3 && t->size(0) >= 1 && t->size(1) == H && t->size(2) == D &&
                       is_kv_dtype(t->dtype),
                   "fit_kvquant_calibration: layer ", l, ": expected float [N >= 1, H_kv=", H, ", D=", D, "], got ",
                   shape_str(*t));
      KV_CHECK_ARG(detail::first_nonfinite(*t).empty(), "fit_kvquant_calibration: layer ", l,
                   " holds non-finite activations");
    }
    K[l] = detail::to_float32(keys[l]);
    V[l] = detail::to_float32(values[l]);
  }
  std::vector<std::vector<float>> WK, WV;  // the weights, float32 contiguous (empty: unweighted)
  if (weights != nullptr) {
    KV_CHECK_ARG(weights->keys.size() == keys.size() && weights->values.size() == keys.size(),
                 "fit_kvquant_calibration: weights for ", weights->keys.size(), " key and ", weights->values.size(),
                 " value layers, the activations have ", keys.size());
    for (size_t l = 0; l < keys.size(); ++l) {
      const Buffer* ws[2] = {&weights->keys[l], &weights->values[l]};
      const TensorView* xs[2] = {&keys[l], &values[l]};
      for (int i = 0; i < 2; ++i) {
        KV_CHECK_ARG(ws[i]->defined() && ws[i]->shape() == xs[i]->sizes() && is_kv_dtype(ws[i]->dtype()),
                     "fit_kvquant_calibration: layer ", l, i == 0 ? " key" : " value", " weights: expected ",
                     shape_str(xs[i]->sizes()), ", got ", shape_str(ws[i]->view()));
        std::vector<float> wf = detail::to_float32(ws[i]->view());
        bool ok = true;
        for (float w : wf) ok = ok && std::isfinite(w) && w >= 0;
        KV_CHECK_ARG(ok, "fit_kvquant_calibration: layer ", l, i == 0 ? " key" : " value",
                     " weights must be finite and >= 0");
        (i == 0 ? WK : WV).push_back(std::move(wf));
      }
    }
  }
  const bool weighted = weights != nullptr;
  for (double p : ps) {
    KvquantLevel lv;
    lv.sparsity = p;
    const double t = 1.0 - (1.0 - p) / 2.0;
    for (size_t l = 0; l < keys.size(); ++l) {
      KvquantLayerCalibration lc;
      const int64_t N = keys[l].size(0);
      const float* kp = K[l].data();
      lc.key_lower.resize(static_cast<size_t>(H * D));
      lc.key_upper.resize(static_cast<size_t>(H * D));
      std::vector<float> kpool, kw;
      const float* kwp = weighted ? WK[l].data() : nullptr;
      for (int64_t c = 0; c < H * D; ++c) {
        std::vector<float> col(static_cast<size_t>(N));
        for (int64_t i = 0; i < N; ++i) col[static_cast<size_t>(i)] = kp[i * H * D + c];
        std::vector<float> s = col;
        std::sort(s.begin(), s.end());
        const float lo = quantile_sorted(s, 1.0 - t), hi = quantile_sorted(s, t);
        lc.key_lower[static_cast<size_t>(c)] = lo;
        lc.key_upper[static_cast<size_t>(c)] = hi;
        const float off = 0.5f * (hi + lo), rng = 0.5f * (hi - lo);
        for (int64_t i = 0; i < N; ++i) {
          const float x = col[static_cast<size_t>(i)];
          if (x < lo || x > hi) continue;  // an outlier: stored exactly, not in the codebook
          kpool.push_back(rng > 0 ? (x - off) / rng : 0.0f);
          if (weighted) kw.push_back(kwp[i * H * D + c]);
        }
      }
      const float* vp = V[l].data();
      const int64_t kt = kvquant_tail_count(D, p);
      std::vector<float> vpool, vw;
      const float* vwp = weighted ? WV[l].data() : nullptr;
      std::vector<char> out(static_cast<size_t>(D));
      for (int64_t r = 0; r < N * H; ++r) {
        const float* row = vp + r * D;
        std::fill(out.begin(), out.end(), 0);
        for (int64_t i : select_tails(row, D, 1, kt)) out[static_cast<size_t>(i)] = 1;
        float mn = INFINITY, mx = -INFINITY;
        for (int64_t d = 0; d < D; ++d) {
          if (out[static_cast<size_t>(d)]) continue;
          mn = std::min(mn, row[d]);
          mx = std::max(mx, row[d]);
        }
        if (mn > mx) continue;  // every entry an outlier: nothing dense to pool
        const float off = 0.5f * (mx + mn), rng = 0.5f * (mx - mn);
        for (int64_t d = 0; d < D; ++d) {
          if (out[static_cast<size_t>(d)]) continue;
          vpool.push_back(rng > 0 ? (row[d] - off) / rng : 0.0f);
          if (weighted) vw.push_back(vwp[r * D + d]);
        }
      }
      const std::string where = detail::str_cat("layer ", l, " at sparsity ", p);
      for (int b : cal.bits) {
        lc.key_codebooks.push_back(fit_codebook(kpool, b, o, weighted ? &kw : nullptr, where + ", keys"));
        lc.value_codebooks.push_back(fit_codebook(vpool, b, o, weighted ? &vw : nullptr, where + ", values"));
      }
      lv.layers.push_back(std::move(lc));
    }
    cal.levels.push_back(std::move(lv));
  }
  cal.check("fit_kvquant_calibration");
  return cal;
}

// ---------------------------------------------------------------- file
void save_kvquant_calibration(const KvquantCalibration& c, const std::string& path) {
  KV_CHECK(little_endian(), UnsupportedError, "KVQuant calibration files are little-endian; this host is not");
  c.check("KVQuant calibration for '" + path + "'");
  Writer w;
  w.bytes(kMagic, sizeof kMagic);
  w.put<uint32_t>(kKvquantCalibrationVersion);
  w.put<uint32_t>(static_cast<uint32_t>(c.num_layers));
  w.put<uint32_t>(static_cast<uint32_t>(c.num_kv_heads));
  w.put<uint32_t>(static_cast<uint32_t>(c.head_dim));
  w.put<uint32_t>(static_cast<uint32_t>(c.bits.size()));
  w.put<uint32_t>(static_cast<uint32_t>(c.levels.size()));
  w.put<uint64_t>(static_cast<uint64_t>(c.tokens));
  w.put<uint32_t>(static_cast<uint32_t>(c.source.size()));
  w.bytes(c.source.data(), c.source.size());
  for (int b : c.bits) w.put<uint32_t>(static_cast<uint32_t>(b));
  for (const auto& lv : c.levels) {
    w.put<double>(lv.sparsity);
    for (const auto& l : lv.layers) {
      w.floats(l.key_lower);
      w.floats(l.key_upper);
      for (const auto* books : {&l.key_codebooks, &l.value_codebooks}) {
        for (const auto& cb : *books) {
          w.floats(cb.centroids);
          w.put<float>(cb.qnorm_scale);
          w.put<float>(cb.qnorm_shift);
        }
      }
    }
  }
  const uint64_t h = fnv1a(w.str().data(), w.str().size());
  w.put<uint64_t>(h);
  io::write_file_atomic(path, w.str());
}

KvquantWeights load_kvquant_weights(const std::string& path, int64_t layers, int64_t tokens, int64_t heads,
                                    int64_t head_dim) {
  KV_CHECK(little_endian(), UnsupportedError, "KVQuant weights files are little-endian; this host is not");
  io::check_readable_file(path, "KVQuant weights");
  std::error_code ec;
  KV_CHECK_ARG(std::filesystem::is_regular_file(path, ec), "KVQuant weights '", path, "' is not a regular file");
  const uintmax_t size = std::filesystem::file_size(path, ec);
  KV_CHECK_ARG(!ec && size <= (uintmax_t{1} << 32), "KVQuant weights '", path, "': ", size,
               " bytes is larger than any weights file read here (at most 4 GiB)");
  std::ifstream in(path, std::ios::binary);
  KV_CHECK_ARG(in.good(), "cannot open KVQuant weights '", path, "'");
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  constexpr size_t kHeader = 4 + 4 * 4 + 8;
  KV_CHECK_ARG(data.size() >= 4 && std::memcmp(data.data(), "KVQW", 4) == 0, "'", path,
               "' is not a KVQuant weights file (no 'KVQW' magic; docs/quantizers.md, \"KVQuant weights file\")");
  KV_CHECK_ARG(data.size() >= kHeader, "KVQuant weights '", path, "' is truncated: ", data.size(),
               " bytes, shorter than its ", kHeader, "-byte header");
  uint32_t h32[4];
  uint64_t n64 = 0;
  std::memcpy(h32, data.data() + 4, sizeof h32);
  std::memcpy(&n64, data.data() + 20, sizeof n64);
  KV_CHECK_ARG(h32[0] == kKvquantWeightsVersion, "KVQuant weights '", path, "' has format version ", h32[0],
               "; this build reads version ", kKvquantWeightsVersion);
  KV_CHECK_ARG(h32[1] == layers && n64 == static_cast<uint64_t>(tokens) && h32[2] == heads && h32[3] == head_dim,
               "KVQuant weights '", path, "' are for [L=", h32[1], ", N=", n64, ", H_kv=", h32[2], ", D=", h32[3],
               "]; the calibration captured [L=", layers, ", N=", tokens, ", H_kv=", heads, ", D=", head_dim,
               "] (one weight per captured key and value)");
  const int64_t per = tokens * heads * head_dim;
  const uintmax_t want = kHeader + static_cast<uintmax_t>(layers) * 2u * static_cast<uintmax_t>(per) * 4u;
  KV_CHECK_ARG(data.size() == want, "KVQuant weights '", path, "' holds ", data.size(), " bytes; its header [L=",
               layers, ", N=", tokens, ", H_kv=", heads, ", D=", head_dim, "] needs exactly ", want,
               data.size() < want ? " (truncated)" : " (trailing bytes)");
  KvquantWeights w;
  const char* p = data.data() + kHeader;
  for (int64_t l = 0; l < layers; ++l) {
    for (int s = 0; s < 2; ++s) {
      Buffer t(DType::kFloat32, {tokens, heads, head_dim});
      std::memcpy(t.data(), p, static_cast<size_t>(per) * 4);
      p += per * 4;
      const float* f = t.data_as<float>();
      bool positive = false;
      for (int64_t i = 0; i < per; ++i) {
        KV_CHECK_ARG(std::isfinite(f[i]) && f[i] >= 0, "KVQuant weights '", path, "': layer ", l,
                     s == 0 ? " keys" : " values", " [", i / (heads * head_dim), ", ", i / head_dim % heads, ", ",
                     i % head_dim, "] is ", f[i], " (weights must be finite and >= 0)");
        positive = positive || f[i] > 0;
      }
      // All zero: no information to weigh by (a uniform codebook would come out, silently).
      KV_CHECK_ARG(positive, "KVQuant weights '", path, "': every weight of layer ", l, s == 0 ? " keys" : " values",
                   " is 0 (", per, " weights); a weighted k-means needs positive weights — check how the "
                   "weights were computed, or calibrate without --weights");
      (s == 0 ? w.keys : w.values).push_back(std::move(t));
    }
  }
  return w;
}

KvquantCalibration load_kvquant_calibration(const std::string& path) {
  KV_CHECK(little_endian(), UnsupportedError, "KVQuant calibration files are little-endian; this host is not");
  io::check_readable_file(path, "KVQuant calibration");
  // A regular file of bounded size (a spec names the path: a device or a pipe would be read
  // without end).
  std::error_code ec;
  KV_CHECK_ARG(std::filesystem::is_regular_file(path, ec), "KVQuant calibration '", path, "' is not a regular file");
  const uintmax_t size = std::filesystem::file_size(path, ec);
  KV_CHECK_ARG(!ec && size <= (uintmax_t{1} << 30), "KVQuant calibration '", path, "': ", size,
               " bytes is larger than any calibration (at most 1 GiB)");
  std::ifstream in(path, std::ios::binary);
  KV_CHECK_ARG(in.good(), "cannot open KVQuant calibration '", path, "'");
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  KV_CHECK_ARG(data.size() >= sizeof kMagic && std::memcmp(data.data(), kMagic, sizeof kMagic) == 0, "'", path,
               "' is not a KVQuant calibration file (no 'KVQCALIB' magic; write one with kv_study calibrate)");
  Reader r(data, path);
  for (size_t i = 0; i < sizeof kMagic; ++i) (void)r.get<char>("the magic");
  const uint32_t version = r.get<uint32_t>("the version");
  KV_CHECK_ARG(version == 1 || version == kKvquantCalibrationVersion, "KVQuant calibration '", path,
               "' has format version ", version, "; this build reads versions 1 and ", kKvquantCalibrationVersion,
               " (re-run kv_study calibrate)");
  KvquantCalibration c;
  c.num_layers = r.get<uint32_t>("the header");
  c.num_kv_heads = r.get<uint32_t>("the header");
  c.head_dim = r.get<uint32_t>("the header");
  const uint32_t nbits = r.get<uint32_t>("the header");
  const uint32_t nlevels = r.get<uint32_t>("the header");
  c.tokens = static_cast<int64_t>(r.get<uint64_t>("the header"));
  const uint32_t slen = r.get<uint32_t>("the header");
  KV_CHECK_ARG(c.num_layers >= 1 && c.num_layers <= 4096 && c.num_kv_heads >= 1 && c.num_kv_heads <= 4096 &&
                   c.head_dim >= 2 && c.head_dim <= 4096 && nbits >= 1 && nbits <= 3 && nlevels >= 1 &&
                   nlevels <= 64 && slen <= (1u << 20),
               "KVQuant calibration '", path, "': corrupt header (L=", c.num_layers, ", H_kv=", c.num_kv_heads,
               ", D=", c.head_dim, ", ", nbits, " widths, ", nlevels, " levels)");
  for (uint32_t i = 0; i < slen; ++i) c.source.push_back(r.get<char>("the source text"));
  for (uint32_t i = 0; i < nbits; ++i) {
    const uint32_t b = r.get<uint32_t>("the codebook widths");
    KV_CHECK_ARG(b >= 2 && b <= 4, "KVQuant calibration '", path, "': codebook width ", b, " is not one of {2, 3, 4}");
    c.bits.push_back(static_cast<int>(b));
  }
  // The size the header implies, so that a truncated file is named as such.
  size_t books = 0;
  for (int b : c.bits) books += (size_t{1} << b) + 2;
  const size_t hd = static_cast<size_t>(c.num_kv_heads * c.head_dim);
  const size_t expected = r.pos() + nlevels * (8 + static_cast<size_t>(c.num_layers) * 4 * (2 * hd + 2 * books)) + 8;
  KV_CHECK_ARG(data.size() >= expected, "KVQuant calibration '", path, "' is truncated: ", data.size(),
               " bytes, its header (L=", c.num_layers, ", H_kv=", c.num_kv_heads, ", D=", c.head_dim, ", widths ",
               list_bits(c.bits), ", ", nlevels, " levels) needs ", expected);
  KV_CHECK_ARG(data.size() == expected, "KVQuant calibration '", path, "': ", data.size() - expected,
               " unexpected bytes after the data (", expected, " expected)");
  for (uint32_t i = 0; i < nlevels; ++i) {
    KvquantLevel lv;
    lv.sparsity = r.get<double>("a level");
    for (int64_t l = 0; l < c.num_layers; ++l) {
      KvquantLayerCalibration lc;
      lc.key_lower = r.floats(hd, "key thresholds");
      lc.key_upper = r.floats(hd, "key thresholds");
      for (auto* bk : {&lc.key_codebooks, &lc.value_codebooks}) {
        for (int b : c.bits) {
          KvquantCodebook cb;
          cb.bits = b;
          cb.centroids = r.floats(size_t{1} << b, "a codebook");
          cb.qnorm_scale = r.get<float>("a codebook");
          cb.qnorm_shift = r.get<float>("a codebook");
          bk->push_back(std::move(cb));
        }
      }
      lv.layers.push_back(std::move(lc));
    }
    c.levels.push_back(std::move(lv));
  }
  const size_t body = r.pos();
  const uint64_t h = r.get<uint64_t>("the checksum");
  // Version 2: the documented FNV-1a. Version 1 (the layout is the same): the documented
  // checksum, or the one earlier builds wrote with their mistaken offset basis.
  const bool sum_ok = h == fnv1a(data.data(), body) ||
                      (version == 1 && h == fnv1a(data.data(), body, kLegacyV1OffsetBasis));
  KV_CHECK_ARG(sum_ok, "KVQuant calibration '", path,
               "': checksum mismatch (the last 8 bytes are not FNV-1a 64 of the ", body,
               " bytes before them; the file is corrupt: re-run kv_study calibrate)");
  c.check("KVQuant calibration '" + path + "'");
  return c;
}

}  // namespace kvcache
