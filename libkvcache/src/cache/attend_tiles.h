// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file attend_tiles.h (internal)
/// The tile kernels of the generic read path (attend.h): for one tile of up to a few hundred
/// keys and a block of query rows — the scores q·k (SIMD dot products, a fixed reduction tree),
/// the position mask, the online-softmax step (running max and sum per row, the accumulator
/// rescaled), p·v accumulated in registers, and the attention mass of the selected rows (the
/// group mean summed, or the max). One source built for three vector widths — 16 lanes with
/// AVX-512, 8 with AVX2 + FMA, 4 for baseline x86-64 — each with that ISA enabled; the widest
/// the CPU runs is picked once (docs/cache-manager.md, "The read seam").
/// Layouts: `s` scores/probabilities row-major `[nr, ld]`, `acc` `[nr, d]`, rows of keys and
/// values by pointer (krows[j], vrows[j]: D floats each).

#include <cstdint>

namespace kvcache::cache {

/// s[r·ld + j] = (q_r · k_j) · scale for r < nr, j < n; q `[nr, d]` contiguous.
void tile_scores(const float* q, int64_t nr, const float* const* krows, int64_t n, int64_t d, float scale, float* s,
                 int64_t ld);
/// Hides key j from row r (s = −inf) when kpos[j] > rpos[r].
void tile_mask(float* s, int64_t ld, int64_t nr, int64_t n, const int64_t* kpos, const int64_t* rpos);
/// Online-softmax step of rows r < nr over a tile's scores (masked: −inf): s becomes
/// p = exp(s − m_new) in place; the row's accumulator and sum are rescaled by exp(m_old − m_new).
void tile_softmax(float* s, int64_t ld, int64_t nr, int64_t n, int64_t d, float* m, float* l, float* acc);
/// acc_r += Σ_j p[r·ld + j] · v_j for rows r < nr.
void tile_pv(const float* p, int64_t ld, int64_t nr, int64_t n, const float* const* vrows, int64_t d, float* acc);
/// mass_rows[r][j] += w · exp(s − m_r) / l_r for rows r < nr, keys j < n.
void tile_mass(const float* s, int64_t ld, int64_t nr, int64_t n, const float* m, const float* l, float w,
               float* const* mass_rows);
/// mass_rows[r][j] = max(mass_rows[r][j], exp(s − m_r) / l_r) (AttentionNeed::Reduce::kMax).
void tile_mass_max(const float* s, int64_t ld, int64_t nr, int64_t n, const float* m, const float* l,
                   float* const* mass_rows);

/// Lanes of the float32 vectors the generic path's tile kernels (q·k over rows, the online
/// softmax, p·v) use on this CPU: 16 (AVX-512), 8 (AVX2 + FMA) or 4 (baseline). Each width is
/// its own build of the same source with that ISA enabled, chosen once for the running CPU.
int tile_lanes();

/// Makes the tile kernels of `lanes` lanes the ones used (tests and benchmarks: each width is
/// held to the same reference); 0 picks the widest again. Not thread-safe: call while no
/// attention runs. Returns false (and changes nothing) if this CPU cannot run that width.
/// @throws InvalidArgument if lanes is not 0, 4, 8 or 16.
bool use_tile_lanes(int lanes);

}  // namespace kvcache::cache
