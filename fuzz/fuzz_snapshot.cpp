// SPDX-License-Identifier: Apache-2.0
// The snapshot reader (CacheManager::load, docs/snapshot-format.md) on hostile bytes. Input: a
// config index, a flags byte (bit 0: recompute every checksum first, so that mutations reach the
// checks behind them), then the file (fuzz/snapshot_configs.h). Properties:
//   - a refused load throws a user error (SnapshotError is an InvalidArgument) and leaves the
//     cache as it was (it saves the same bytes as before);
//   - an accepted load gives a cache whose invariants hold, that saves bytes which load again to
//     the same bytes, and that runs a decode step (append, attend, end_step) refusing at most
//     with a user error.
#include <xxhash.h>

#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "kvcache/cache_debug.h"
#include "kvcache/cache_manager.h"
#include "snapshot_configs.h"

using namespace kvcache;

namespace {

std::string save(const CacheManager& m) {
  std::ostringstream os;
  m.save(os, fuzz::kSnapshotFingerprint);
  return os.str();
}

void load(CacheManager& m, const std::string& bytes) {
  std::istringstream is(bytes);
  (void)m.load(is, fuzz::kSnapshotFingerprint);
}

/// Recomputes the preamble's and every whole section's checksums (as far as the framing reads).
void reseal(std::string& f) {
  if (f.size() < 24) return;
  auto* p = reinterpret_cast<uint8_t*>(&f[0]);
  uint64_t h = XXH3_64bits(p, 16);
  std::memcpy(p + 16, &h, 8);
  uint32_t count = 0;
  std::memcpy(&count, p + 12, 4);
  size_t at = 24;
  for (uint32_t i = 0; i < count && f.size() - at >= 24; ++i) {
    h = XXH3_64bits(p + at, 16);
    std::memcpy(p + at + 16, &h, 8);
    uint64_t size = 0;
    std::memcpy(&size, p + at + 8, 8);
    at += 24;
    if (size > f.size() - at || f.size() - at - size < 8) return;
    h = XXH3_64bits(p + at, static_cast<size_t>(size));
    std::memcpy(p + at + size, &h, 8);
    at += static_cast<size_t>(size) + 8;
  }
}

/// One decode step on every layer: a token of ones (scaled per layer) at the next position.
void decode_step(CacheManager& m) {
  const CacheConfig& c = m.config();
  std::vector<float> k(static_cast<size_t>(c.num_kv_heads * c.head_dim), 0.5f), v(k.size(), -0.25f);
  std::vector<float> q(static_cast<size_t>(c.num_q_heads * c.head_dim), 0.125f), out(q.size());
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const int64_t pos = m.next_position(l);
    m.append(l, TensorView(k.data(), {1, c.num_kv_heads, 1, c.head_dim}),
             TensorView(v.data(), {1, c.num_kv_heads, 1, c.head_dim}), TensorView(&pos, {1}));
    m.attend(l, TensorView(q.data(), {1, c.num_q_heads, 1, c.head_dim}), TensorView(&pos, {1}),
             MutableTensorView(out.data(), DType::kFloat32, {1, c.num_q_heads, 1, c.head_dim}));
  }
  m.end_step(StepKind::kDecode);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  CacheManager m(fuzz::snapshot_case_config(data[0]));
  std::string file(reinterpret_cast<const char*>(data) + 2, size - 2);
  if (data[1] & 1) reseal(file);
  const std::string before = save(m);
  if (!fuzz::accepts("CacheManager::load", [&] { load(m, file); })) {
    KV_FUZZ_CHECK(save(m) == before, "CacheManager::load", "a refused load changed the cache");
    return 0;
  }
  (void)fuzz::accepts("check_invariants", [&] { CacheDebug::check_invariants(m); });
  const std::string again = save(m);
  CacheManager twin(fuzz::snapshot_case_config(data[0]));
  KV_FUZZ_CHECK(fuzz::accepts("load of a re-saved snapshot", [&] { load(twin, again); }), "re-load",
                "the bytes an accepted snapshot saves back are refused");
  KV_FUZZ_CHECK(save(twin) == again, "re-load", "a re-saved snapshot loads to other bytes");
  if (fuzz::accepts("decode step after a load", [&] { decode_step(m); })) {
    (void)fuzz::accepts("check_invariants after a step", [&] { CacheDebug::check_invariants(m); });
  }
  return 0;
}
