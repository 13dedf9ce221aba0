// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file lloyd_max.h (internal)
/// The Lloyd–Max scalar quantizer of the standard normal N(0, 1): the fixed codebooks of
/// TurboQuant (arXiv 2504.19874), whose randomly rotated unit vectors have coordinates
/// ≈ N(0, 1/D) (the codebook scaled by 1/√D; turboquant_quantizer.h).
///
/// Procedure (solved once per bit width, at first use, in double precision): start from the
/// 2^b levels at the quantiles Φ⁻¹((i + ½)/2^b) (approximated by bisection on Φ); then Lloyd
/// iterations on the Gaussian density, each setting the boundaries t_i = (c_i + c_{i+1})/2
/// (t_0 = −∞, t_L = +∞) and every level to its cell's conditional mean
/// c_i = (φ(t_i) − φ(t_{i+1})) / (Φ(t_{i+1}) − Φ(t_i)), until no level moves by more than
/// 1e-14 (or 100000 iterations). The mean squared error per coordinate, in units of the
/// variance, is then 1 − Σ_i P_i c_i² (each level a conditional mean), P_i = Φ(t_{i+1}) − Φ(t_i):
/// 0.3634 / 0.1175 / 0.03454 / 0.009497 for b = 1..4 (the classical values; tests hold them).

#include <vector>

namespace kvcache::quant {

struct GaussianCodebook {
  int bits = 0;
  std::vector<double> levels;      ///< 2^b centroids, ascending, symmetric about 0 (N(0, 1) units)
  std::vector<double> boundaries;  ///< 2^b − 1 decision thresholds, ascending (midpoints)
  double mse = 0;                  ///< E[(x − Q(x))²] for x ~ N(0, 1)
  int iterations = 0;              ///< Lloyd iterations run
};

/// The codebook of `bits` ∈ [1, 8] bits (computed once, thread-safe; a reference to static
/// storage). @throws InvalidArgument naming `bits` outside [1, 8].
const GaussianCodebook& gaussian_lloyd_max(int bits);

}  // namespace kvcache::quant
