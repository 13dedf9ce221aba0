// SPDX-License-Identifier: Apache-2.0
// Quantizer and cache-scheme spec strings (CacheConfig::scheme): make_quantizer,
// make_cache_scheme and CacheScheme::streams. An accepted spec's canonical form must be
// accepted and canonical again; its layout and bits per value must be computable (or
// rejected) for any head_dim.
#include <memory>
#include <string>

#include "fuzz_util.h"
#include "kvcache/cache_scheme.h"
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

  std::unique_ptr<CacheScheme> scheme;
  if (fuzz::accepts("make_cache_scheme", [&] { scheme = make_cache_scheme(spec); })) {
    const std::string canon_cache = scheme->spec();
    std::string again;
    KV_FUZZ_CHECK(fuzz::accepts("make_cache_scheme(canonical)", [&] { again = make_cache_scheme(canon_cache)->spec(); }),
                  "make_cache_scheme", "canonical '", canon_cache, "' of '", spec, "' rejected");
    KV_FUZZ_CHECK(again == canon_cache, "make_cache_scheme", "'", canon_cache, "' -> '", again, "'");
    for (int64_t d : {int64_t{1}, int64_t{16}, int64_t{64}, int64_t{96}, int64_t{128}}) {
      for (int64_t residual : {int64_t{0}, int64_t{1}, int64_t{128}}) {
        fuzz::accepts("streams", [&] { (void)scheme->streams(CacheGeometry{2, 2, d}, 1, residual); });
      }
    }
  }
  return 0;
}
