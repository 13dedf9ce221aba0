// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file codebook_schemes.h (internal)
/// The rotation-and-codebook cache schemes of 2025 (methods.md b.15), registered in
/// cache_scheme.cpp's list:
///   - `turboquant:k<b>:v<b>[:kmse][:nc][:seed<s>]` (TurboQuant, arXiv 2504.19874): keys
///     `tq:b<k>:prod` (or `tq:b<k>` with `kmse`, as vLLM ships it), values `tq:b<v>`, layer l
///     seeded with s + 1337·l (vLLM's 42 + 1337·layer by default); `nc` applies to both MSE
///     stages; the residual window is CacheConfig::residual_length, sliding, fp16.
#include "registry/registry.h"

namespace kvcache::registry {

Entry turboquant_entry();

}  // namespace kvcache::registry
