// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file kvquant.h
/// KVQuant's calibration (KVQuant: Hooper et al., arXiv 2401.18079): per-layer, per-channel
/// pre-RoPE key ranges and per-layer non-uniform codebooks (k-means over the normalised
/// calibration values, unweighted: the reference code's path without Fisher information, or
/// weighted by one weight per calibration value from a file: KvquantWeights),
/// their versioned file format (docs/quantizers.md, "KVQuant calibration file") and the fit.
/// The `kvquant` cache scheme (cache_scheme.h) reads such a file; `kv_study calibrate` writes
/// one from a model (study/kvquant_calibrate.h).
///
/// Conventions:
///   - sparsity p in (0.9, 1]: the fraction of values kept dense; 0.99 is the paper's "1%
///     outliers" (0.5% per tail); p = 1 means none (min–max ranges). t = 1 − (1 − p)/2.
///   - keys are normalised per channel with static ranges: offset = (upper + lower)/2,
///     range = (upper − lower)/2, y = (x − offset)/range in [−1, 1]; values the same per
///     token with the token's own (dynamic) range.
///   - codebooks hold 2^b centroids in normalised units, ascending.

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/buffer.h"
#include "kvcache/view.h"

namespace kvcache {

/// The calibration file format version written (and read, with version 1). Version 2 is
/// version 1's layout with its checksum computed as documented (FNV-1a 64, offset basis
/// 14695981039346656037); version 1 files were written with a mistaken basis and are read with
/// either (docs/quantizers.md, "KVQuant calibration file").
inline constexpr uint32_t kKvquantCalibrationVersion = 2;

/// One codebook: 2^bits centroids, ascending, float32, normalised units.
struct KvquantCodebook {
  int bits = 0;
  std::vector<float> centroids;
  /// Q-Norm (the paper's 2-bit normalisation): centroid' = qnorm_scale · centroid +
  /// qnorm_shift makes the dequantised calibration values' mean and standard deviation those
  /// of the normalised values (qnorm_scale > 0, so the order is kept).
  float qnorm_scale = 1.0f;
  float qnorm_shift = 0.0f;
};

/// One layer of one sparsity level.
struct KvquantLayerCalibration {
  /// Per-channel key thresholds, float32 `[H_kv · D]` (head-major: index h · D + d), pre-RoPE
  /// key units: the t-th and (1 − t)-th quantiles of the channel's calibration keys (linear
  /// interpolation, as torch.quantile); p = 1: the channel's max and min. upper >= lower.
  std::vector<float> key_lower, key_upper;
  /// Codebooks of keys and values, one per KvquantCalibration::bits entry, in that order.
  std::vector<KvquantCodebook> key_codebooks, value_codebooks;
};

/// Everything fitted at one sparsity level.
struct KvquantLevel {
  double sparsity = 1.0;  ///< p
  std::vector<KvquantLayerCalibration> layers;  ///< L entries
};

/// A KVQuant calibration of one model.
struct KvquantCalibration {
  int64_t num_layers = 0;    ///< L
  int64_t num_kv_heads = 0;  ///< H_kv
  int64_t head_dim = 0;      ///< D
  int64_t tokens = 0;        ///< calibration tokens the fit saw (informational)
  std::string source;        ///< what was calibrated (model path, text), informational
  std::vector<int> bits;     ///< codebook widths, ascending, each in {2, 3, 4}
  std::vector<KvquantLevel> levels;  ///< one per sparsity, ascending sparsity

  /// The level of sparsity `p` (exact match). @throws InvalidArgument listing those held.
  const KvquantLevel& level(double p) const;
  /// Index of `bits` in `bits`. @throws InvalidArgument listing those held.
  size_t bits_index(int bits) const;
  /// @throws InvalidArgument naming `what` when a field is inconsistent (sizes, order, ranges).
  void check(const std::string& what) const;
};

/// Options of fit_kvquant_calibration().
/// The calibration path `kvquant:...:cal=auto` names: not a file but a request to `kv_study run`,
/// which fits the model's calibration into its run directory and substitutes the path
/// (docs/study.md, "KVQuant arms"); a scheme built from it elsewhere is refused saying so.
inline constexpr const char* kKvquantAutoCalibration = "auto";

struct KvquantFitOptions {
  std::vector<int> bits = {2, 3, 4};           ///< codebook widths
  std::vector<double> sparsities = {0.99, 1.0};  ///< levels
  int max_iter = 50;                            ///< Lloyd iterations per codebook (sklearn's max_iter)
  /// Values pooled per codebook at most: a larger pool is subsampled with a fixed stride
  /// (deterministic). 0: no limit.
  int64_t max_samples = 1 << 20;
};

/// Optional weights of a fit (the weighted k-means of KVQuant's Fisher-information path, arXiv
/// 2401.18079 §3.2; the reference code's unweighted path is the default): one finite,
/// non-negative weight per captured value, `keys[l]`, `values[l]` float32 `[N, H_kv, D]`, the
/// shapes of the activations they weight. A value's weight travels with it into its layer's
/// pool; outliers (and their weights) stay out of it, as in the unweighted fit.
struct KvquantWeights {
  std::vector<Buffer> keys, values;
};

/// The weights file format version written and accepted.
inline constexpr uint32_t kKvquantWeightsVersion = 1;

/// Reads a weights file (docs/quantizers.md, "KVQuant weights file": little-endian; magic
/// `KVQW`, u32 version, u32 L, u32 H_kv, u32 D, u64 N, then per layer the keys' and then the
/// values' N · H_kv · D float32 weights, token-major `[N, H_kv, D]`) for a calibration that
/// captured `tokens` tokens of a model of `layers` layers, `heads` KV heads, `head_dim`.
/// @throws InvalidArgument naming the path: missing or unreadable, not a regular file or above
///         4 GiB, no magic, another version, a header of another shape (naming the expected
///         [L, N, H_kv, D] and the one found), a size other than the header's (naming both), a
///         negative or non-finite weight (naming its layer, stream and index), a layer whose
///         keys' or values' weights are all 0 (no information to weigh by; naming it).
KvquantWeights load_kvquant_weights(const std::string& path, int64_t layers, int64_t tokens, int64_t heads,
                                    int64_t head_dim);

/// Fits a calibration from captured activations: `keys[l]`, `values[l]` float32 `[N, H_kv, D]`
/// (N calibration tokens of layer l; keys pre-RoPE). Per level p: key thresholds per channel
/// (quantiles t, 1 − t); keys normalised with them, the non-outliers (lower <= x <= upper)
/// pooled over the layer's heads and tokens; values: per token and head, the
/// kvquant_tail_count(D, p) largest and smallest are outliers (select_tails()), the rest
/// normalised by their own min/max and pooled; one k-means codebook (kmeans_1d) per layer,
/// stream and width, with its Q-Norm correction. `weights` (optional): the k-means is
/// kmeans_1d_weighted() and Q-Norm matches the weighted mean and standard deviation; the
/// thresholds (quantiles) and outlier choices stay unweighted.
/// @throws InvalidArgument on empty input, mismatched shapes, non-finite values, bad options,
///         weights of another shape than the activations or negative / non-finite weights, or
///         a codebook whose pooled (non-outlier) values all weigh 0 (naming layer, level, stream).
/// (Views of any float dtype and strides; kvcache/torch/kvquant.h takes at::Tensors.)
KvquantCalibration fit_kvquant_calibration(const std::vector<TensorView>& keys, const std::vector<TensorView>& values,
                                           const KvquantFitOptions& options, const std::string& source,
                                           const KvquantWeights* weights = nullptr);

/// Writes `c` to `path` atomically (io::write_file_atomic) in the versioned binary format of
/// docs/quantizers.md. @throws InvalidArgument if `c` is inconsistent or the write fails.
void save_kvquant_calibration(const KvquantCalibration& c, const std::string& path);

/// Reads a calibration file of format version 2 or 1. @throws InvalidArgument naming the path:
/// missing or unreadable, not a regular file or above 1 GiB, not a calibration file (magic),
/// another version (naming it and the versions read), truncated or with trailing bytes (naming
/// the sizes), a checksum mismatch, inconsistent contents.
KvquantCalibration load_kvquant_calibration(const std::string& path);

// ---- the math, exposed for tests and tools ----------------------------------------------

/// Outliers per tail of an n-value vector at sparsity p: n − ceil(t · (n − 1)) (t = 1 − (1 −
/// p)/2), the count torch.quantile's inclusive compare selects from n distinct values; 0 for
/// p = 1. E.g. n = 4096, p = 0.99: 21 (the reference code's top-21); n = 32: 1.
int64_t kvquant_tail_count(int64_t n, double p);

/// Exactly k largest and then exactly k smallest of the other values of x[i · stride], i in
/// [0, n), ties broken by the lower index: indices, the k upper ones first (each tail in rank
/// order). 2k <= n. A constant vector gives indices 0..k−1 (upper) and k..2k−1 (lower).
std::vector<int64_t> select_tails(const float* x, int64_t n, int64_t stride, int64_t k);

/// The q-quantile (q in [0, 1]) of `sorted` (ascending, non-empty) with linear interpolation
/// between the two nearest ranks (torch.quantile's default).
float quantile_sorted(const std::vector<float>& sorted, double q);

/// 1-D k-means (Lloyd), k centroids over x[0, n) (finite; n >= 1): quantile initialisation
/// (centroid j starts at the (j + 0.5)/k quantile of x: deterministic, no seed), then
/// assignment to the nearest centroid (a value at an exact midpoint goes to the lower one) and
/// centroid = mean of its members, until no assignment changes or `max_iter` iterations; an
/// empty cluster keeps its centroid. Returns k centroids, ascending (equal ones possible when x
/// has fewer than k distinct values).
std::vector<float> kmeans_1d(const float* x, int64_t n, int k, int max_iter);

/// Weighted 1-D k-means (Lloyd) over x[0, n) with weights w[0, n) (finite, >= 0, some > 0):
/// centroids start at the (j + 0.5)/k quantiles (as kmeans_1d) of the values of positive
/// weight; assignment as kmeans_1d; centroid = Σ w·x / Σ w of its members (float64 sums in
/// ascending x); a cluster of zero total weight keeps its centroid. Same stop rule, ascending.
/// E.g. x = {0, 1, 10, 11}, w = {1, 3, 1, 1}, k = 2: {0.75, 10.5} (unweighted: {0.5, 10.5}).
/// @throws InvalidArgument if no weight is positive or a weight is negative or not finite.
std::vector<float> kmeans_1d_weighted(const float* x, const float* w, int64_t n, int k, int max_iter);

}  // namespace kvcache
