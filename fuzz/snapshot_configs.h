// SPDX-License-Identifier: Apache-2.0
#pragma once
// The caches fuzz_snapshot.cpp loads snapshots into, and that tests/snapshot_test.cpp
// (SnapshotFuzzSeeds) writes the seed corpus fuzz/corpus/snapshot/ from: one seed per entry.
// A seed is [config index u8][flags u8: bit 0 = recompute the checksums before loading]
// [snapshot bytes].
#include <cstddef>
#include <cstdint>

#include "kvcache/cache_config.h"

namespace kvcache::fuzz {

struct SnapshotCase {
  const char* scheme;
  const char* policy;
  KeyStorage keys;
};

/// Schemes and policies whose snapshots differ in shape: plain, per-channel, scaled, residual,
/// rotated, holes and merges, explicit positions (rerotate), policy state of every kind.
inline constexpr SnapshotCase kSnapshotCases[] = {
    {"fp32", "full", KeyStorage::kPostRoPE},
    {"int4:g4", "h2o@6", KeyStorage::kPostRoPE},
    {"kivi:k2:v4:g4:r8", "snapkv:w2@60%", KeyStorage::kPostRoPE},
    {"fp8:e4m3:scaled", "random:seed1@6", KeyStorage::kPostRoPE},
    {"int2:g8:chan", "adakv:h2o@6", KeyStorage::kPostRoPE},
    {"had(int4)", "duo:s1:r2:w2@8", KeyStorage::kPostRoPE},
    {"fp16", "expected:s1:stream@6", KeyStorage::kPreRoPE},
    {"int8", "sink:s1@6", KeyStorage::kPreRoPE},
};
inline constexpr size_t kSnapshotCaseCount = sizeof(kSnapshotCases) / sizeof(kSnapshotCases[0]);
/// The model fingerprint of every seed.
inline constexpr const char* kSnapshotFingerprint = "fuzz-model";

/// 2 layers, H_q 4, H_kv 2, D 8, a request of 24 tokens; the last case re-rotates positions.
inline CacheConfig snapshot_case_config(size_t i) {
  const SnapshotCase& c = kSnapshotCases[i % kSnapshotCaseCount];
  CacheConfig cfg;
  cfg.num_layers = 2;
  cfg.num_q_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 8;
  cfg.scheme = c.scheme;
  cfg.policy = c.policy;
  cfg.key_storage = c.keys;
  if (i % kSnapshotCaseCount == kSnapshotCaseCount - 1) cfg.position_mode = PositionMode::kRerotate;
  cfg.context_length = 24;
  cfg.rope = rotate_half_rope(10000.0);
  return cfg;
}

}  // namespace kvcache::fuzz
