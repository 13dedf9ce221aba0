// SPDX-License-Identifier: Apache-2.0
// Quantizer and cache-scheme spec strings (CacheConfig::quant): make_quantizer,
// canonical_cache_spec, parse_cache_scheme. An accepted spec's canonical form must be accepted
// and canonical again; its layout and bits per value must be computable (or rejected) for any
// head_dim.
#include <memory>
#include <string>

#include "cache/cache_scheme.h"
#include "fuzz_util.h"
#include "kvcache/quantizer.h"

using namespace kvcache;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 256) return 0;
  const std::string spec(reinterpret_cast<const char*>(data), size);

  std::unique_ptr<Quantizer> q;
  if (fuzz::accepts("make_quantizer", [&] { q = make_quantizer(spec); })) {
    const std::string canon = q->spec();
    std::unique_ptr<Quantizer> again;
    KV_FUZZ_CHECK(fuzz::accepts("make_quantizer(canonical)", [&] { again = make_quantizer(canon); }),
                  "make_quantizer", "canonical spec '", canon, "' of '", spec, "' rejected");
    KV_FUZZ_CHECK(again->spec() == canon, "make_quantizer", "'", canon, "' -> '", again->spec(), "'");
    for (int64_t d : {int64_t{1}, int64_t{2}, int64_t{16}, int64_t{64}, int64_t{96}, int64_t{128},
                      int64_t{1} << 20}) {
      fuzz::accepts("bits_per_value", [&] { (void)q->bits_per_value(d); });
      fuzz::accepts("stored_layout", [&] {
        const StoredLayout l = q->stored_layout(d);
        KV_FUZZ_CHECK(l.group_tokens >= 1 && l.code_bytes >= 0 && l.meta_count >= 0 && l.group_bytes() >= l.code_bytes,
                      "stored_layout", q->spec(), " head_dim ", d);
      });
    }
  }

  std::string canon_cache;
  if (fuzz::accepts("canonical_cache_spec", [&] { canon_cache = cache::canonical_cache_spec(spec); })) {
    std::string again;
    KV_FUZZ_CHECK(fuzz::accepts("canonical_cache_spec(canonical)", [&] { again = cache::canonical_cache_spec(canon_cache); }),
                  "canonical_cache_spec", "canonical '", canon_cache, "' of '", spec, "' rejected");
    KV_FUZZ_CHECK(again == canon_cache, "canonical_cache_spec", "'", canon_cache, "' -> '", again, "'");
    for (int64_t d : {int64_t{1}, int64_t{16}, int64_t{64}, int64_t{128}}) {
      for (int64_t residual : {int64_t{0}, int64_t{1}, int64_t{128}}) {
        fuzz::accepts("parse_cache_scheme", [&] { (void)cache::parse_cache_scheme(spec, residual, d); });
      }
    }
  }
  return 0;
}
