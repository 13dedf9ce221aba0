// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file hadamard.h (internal)
/// The orthonormal Walsh–Hadamard transform of rows of D floats (D a power of two): the
/// rotation of QuaRot (arXiv 2404.00456) and of llama.cpp's rotated KV cache, applied per KV
/// head before quantization (rotated_quantizer.h).
///
/// H_D is the Sylvester ("natural"-ordered) Hadamard matrix scaled by 1/√D:
///   H_1 = [1],  H_2n = [[H_n, H_n], [H_n, −H_n]] / √2,  H_D[i][j] = (−1)^popcount(i & j) / √D.
/// It is symmetric and orthonormal, so H_D · H_D = I: the same transform rotates and rotates
/// back, and q·k = (H q)·(H k). The fast transform is log2(D) butterfly stages over the row
/// (x_j, x_{j+h}) → (x_j + x_{j+h}, x_j − x_{j+h}) for h = 1, 2, …, D/2, then one scaling by
/// 1/√D: O(D log D) per row. Its plain reference twin is the explicit matrix
/// (ref::hadamard_matrix, src/torch/quant_reference.h); tests hold them together.

#include <cstdint>

namespace kvcache::quant {

/// True if `d` ≥ 1 is a power of two (the head dims the rotation supports).
constexpr bool is_power_of_two(int64_t d) { return d >= 1 && (d & (d - 1)) == 0; }

/// x[r·d .. r·d + d) ← H_d · x[r·d .. r·d + d) for every r < rows, in place (float32;
/// rows contiguous). d must be a power of two (checked by the callers; asserted).
/// detail::parallel_for over rows when there are many. A row whose largest |x| is at least
/// 2^(127 − log2 d) runs its butterflies scaled down by 1/d (a power of two), so their sums
/// cannot overflow: an entry of the result is ±Inf only if its exact value exceeds float32
/// (possible only when some |x_j| > FLT_MAX/√d).
void hadamard_rows(float* x, int64_t rows, int64_t d);

}  // namespace kvcache::quant
