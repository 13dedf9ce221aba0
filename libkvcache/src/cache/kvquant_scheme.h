// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file kvquant_scheme.h (internal)
/// The `kvquant` cache scheme's registry entry (registered in cache_scheme.cpp's list).
#include "registry/registry.h"

namespace kvcache::registry {

/// `kvquant:b<2|3|4>[:o<percent>][:f<tokens>][:qnorm]:cal=<file>` (KVQuant, arXiv 2401.18079).
Entry kvquant_entry();

}  // namespace kvcache::registry
