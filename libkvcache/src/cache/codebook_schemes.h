// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file codebook_schemes.h (internal)
/// The rotation-and-codebook cache schemes of 2025 (methods.md b.15), registered in
/// cache_scheme.cpp's list:
///   - `turboquant:k<b>:v<b>[:kmse][:nc][:seed<s>]` (TurboQuant, arXiv 2504.19874): keys
///     `tq:b<k>:prod` (or `tq:b<k>` with `kmse`, as vLLM ships it), values `tq:b<v>`, layer l
///     seeded with s + 1337·l (vLLM's 42 + 1337·layer by default); `nc` applies to both MSE
///     stages; the residual window is CacheConfig::residual_length, sliding, fp16.
///   - `qjl:m<m>:o<o>:g<g>:v<b>:r<r>[:mo<m_o>][:vg<G>][:seed<s>]` (QJL, arXiv 2406.03482;
///     defaults m256 o8 g32 v2 r128 mo64 vg32 seed42, the README's settings at D = 128): keys the
///     1-bit sketches of quant/qjl_quantizer.h in groups of g tokens (o outlier channels per group
///     sketched apart with m_o bits), flushed from an r-token fp16 window in blocks of r (KIVI's
///     key residual); values `int<b>:g<G>` per token with a sliding r-token fp16 window; layer l
///     seeded with s + 1337·l. r a positive multiple of g; head_dim divisible by G, at most 256.
#include "registry/registry.h"

namespace kvcache::registry {

Entry turboquant_entry();
Entry qjl_entry();

}  // namespace kvcache::registry
