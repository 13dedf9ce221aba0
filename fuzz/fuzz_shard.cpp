// SPDX-License-Identifier: Apache-2.0
// `--shard i/n`: Shard::parse, to_string / parse round trip, owns() over plan indices.
#include <string>

#include "fuzz_util.h"
#include "kvcache/study/results.h"

using namespace kvcache;
using kvcache::study::Shard;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 64) return 0;
  const std::string text(reinterpret_cast<const char*>(data), size);
  Shard s;
  if (!fuzz::accepts("Shard::parse", [&] { s = Shard::parse(text); })) return 0;
  KV_FUZZ_CHECK(s.count >= 1 && s.index >= 0 && s.index < s.count, "Shard::parse", "'", text, "' -> ", s.index, "/",
                s.count);
  Shard again;
  KV_FUZZ_CHECK(fuzz::accepts("Shard::parse(to_string)", [&] { again = Shard::parse(s.to_string()); }),
                "Shard::to_string", "'", s.to_string(), "' rejected");
  KV_FUZZ_CHECK(again.index == s.index && again.count == s.count, "Shard round trip", "'", text, "'");
  int64_t owned = 0;
  for (int64_t order = 0; order < 64; ++order) owned += s.owns(order) ? 1 : 0;
  const int64_t expected = s.index >= 64 ? 0 : (63 - s.index) / s.count + 1;
  KV_FUZZ_CHECK(owned == expected, "Shard::owns", "'", text, "' owns ", owned, " of 64");
  return 0;
}
