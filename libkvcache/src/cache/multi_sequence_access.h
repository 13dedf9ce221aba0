// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file multi_sequence_access.h
/// Read-only introspection of a MultiSequenceCache, for tests and debugging: a sequence's
/// steps (its store, via StepProtocol::store()) and the memory of every block the prefix index
/// holds. Not part of the public API.

#include <cstdint>
#include <string>
#include <vector>

#include "cache/step_protocol.h"
#include "kvcache/multi_sequence_cache.h"

namespace kvcache::cache {

struct MultiSequenceAccess {
  /// The steps behind `seq` (its blocks via StepProtocol::store()).
  static const StepProtocol& steps(const Sequence& seq);
  /// Every block the index holds: its memory and size in bytes (as many entries as holdings).
  struct BlockBytes {
    const uint8_t* data = nullptr;
    int64_t bytes = 0;
  };
  static std::vector<BlockBytes> cached_blocks(const MultiSequenceCache& c);
  /// The prefix index namespace of `seq`'s configuration (its storage key; "" if never shared).
  static std::string storage_key(const Sequence& seq);
};

}  // namespace kvcache::cache
