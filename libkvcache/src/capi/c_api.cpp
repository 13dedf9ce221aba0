// SPDX-License-Identifier: Apache-2.0
// The C API (kvcache/c_api.h) over the core's CacheManager: every entry point runs inside
// guard(), which turns each exception into a status and the thread's last error message.
#include "kvcache/c_api.h"

#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "capi/guard.h"
#include "kvcache/cache_manager.h"
#include "kvcache/error.h"

#ifndef KVCACHE_VERSION_STRING
#error "KVCACHE_VERSION_STRING must be defined by the build (libkvcache/CMakeLists.txt)"
#endif

struct kvc_cache {
  explicit kvc_cache(kvcache::CacheConfig c) : manager(std::move(c)) {}
  kvcache::CacheManager manager;
};

namespace kvcache::capi {
namespace {

thread_local std::string g_last_error;

// The int a C caller passed for an enum parameter. A C enum is an int, and C lets a caller pass
// any int (the tests pass 9 and -1); in C++ an enum without a fixed underlying type holds only
// the values of its enumerators' bits, and loading another is undefined (UBSan's -fsanitize=enum
// reports it). So the checks read the parameter's bytes, never its value as the enum.
template <class E>
int raw_enum(const E& e) {
  static_assert(sizeof(E) == sizeof(int), "a C enum has the size of an int on every ABI this library supports");
  int v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

DType dtype_of(int t, const char* fn) {
  switch (t) {
    case KVC_FLOAT32: return DType::kFloat32;
    case KVC_FLOAT16: return DType::kFloat16;
    case KVC_BFLOAT16: return DType::kBFloat16;
    default: break;
  }
  throw InvalidArgument(detail::str_cat(fn, ": dtype ", t,
                                        " is none of KVC_FLOAT32 (0), KVC_FLOAT16 (1), KVC_BFLOAT16 (2)"));
}

template <class T>
T* not_null(T* p, const char* fn, const char* name) {
  KV_CHECK_ARG(p != nullptr, fn, ": ", name, " is NULL");
  return p;
}

}  // namespace

void set_last_error(const char* message) { g_last_error = message; }

kvc_status translate(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const CapacityError& x) {
    set_last_error(x.what());
    return KVC_CAPACITY;
  } catch (const InvalidArgument& x) {
    set_last_error(x.what());
    return KVC_INVALID_ARGUMENT;
  } catch (const UnsupportedError& x) {
    // Well-formed but not runnable here: for a C caller, an argument it cannot use.
    set_last_error(x.what());
    return KVC_INVALID_ARGUMENT;
  } catch (const std::bad_alloc&) {
    set_last_error("out of memory");
    return KVC_OUT_OF_MEMORY;
  } catch (const std::exception& x) {
    set_last_error(x.what());
    return KVC_INTERNAL;
  } catch (...) {
    set_last_error("unknown exception (a bug in libkvcache)");
    return KVC_INTERNAL;
  }
}

}  // namespace kvcache::capi

using kvcache::capi::guard;

extern "C" {

const char* kvc_version(void) { return KVCACHE_VERSION_STRING; }

const char* kvc_last_error(void) { return kvcache::capi::g_last_error.c_str(); }

void kvc_config_init(kvc_config* config) {
  if (config == nullptr) return;
  *config = kvc_config{};
  config->scheme = "fp32";
  config->policy = "full";
}

kvc_status kvc_cache_create(const kvc_config* config, kvc_cache** out) {
  if (out != nullptr) *out = nullptr;
  return guard([&] {
    using namespace kvcache;
    const char* fn = "kvc_cache_create";
    capi::not_null(config, fn, "config");
    capi::not_null(out, fn, "out");
    CacheConfig c;
    c.scheme = config->scheme != nullptr ? config->scheme : "fp32";
    c.policy = config->policy != nullptr ? config->policy : "full";
    c.num_layers = config->num_layers;
    c.num_q_heads = config->num_q_heads;
    c.num_kv_heads = config->num_kv_heads;
    c.head_dim = config->head_dim;
    c.context_length = config->context_length;
    c.residual_length = config->residual_length;
    c.block_tokens = config->block_tokens;
    KV_CHECK_ARG(config->rope_theta == 0.0 || config->rope_theta > 1.0, fn, ": rope_theta = ", config->rope_theta,
                 " must be 0 (keys appended already rotated) or a RoPE base > 1 (e.g. 10000)");
    c.rope = config->rope_theta > 1.0 ? rotate_half_rope(config->rope_theta) : keys_already_rotated();
    *out = new kvc_cache(std::move(c));
  });
}

void kvc_cache_destroy(kvc_cache* cache) { delete cache; }

kvc_status kvc_reset(kvc_cache* cache, int64_t context_length) {
  return guard([&] { kvcache::capi::not_null(cache, "kvc_reset", "cache")->manager.reset(context_length); });
}

kvc_status kvc_next_position(const kvc_cache* cache, int64_t layer, int64_t* out) {
  return guard([&] {
    const char* fn = "kvc_next_position";
    kvcache::capi::not_null(out, fn, "out");
    *out = kvcache::capi::not_null(cache, fn, "cache")->manager.next_position(layer);
  });
}

kvc_status kvc_append(kvc_cache* cache, int64_t layer, const void* k, const void* v, kvc_dtype dtype, int64_t tokens,
                      const int64_t* positions) {
  return guard([&] {
    using namespace kvcache;
    const char* fn = "kvc_append";
    CacheManager& m = capi::not_null(cache, fn, "cache")->manager;
    const DType t = capi::dtype_of(capi::raw_enum(dtype), fn);
    KV_CHECK_ARG(tokens >= 0, fn, ": tokens = ", tokens, " must be >= 0");
    if (tokens > 0) {
      capi::not_null(k, fn, "k");
      capi::not_null(v, fn, "v");
      capi::not_null(positions, fn, "positions");
    }
    const CacheConfig& c = m.config();
    const std::vector<int64_t> shape{1, c.num_kv_heads, tokens, c.head_dim};
    static const int64_t kNone = 0;
    m.append(layer, TensorView(tokens > 0 ? k : &kNone, t, shape), TensorView(tokens > 0 ? v : &kNone, t, shape),
             TensorView(tokens > 0 ? positions : &kNone, DType::kInt64, {tokens}));
  });
}

}  // extern "C"

namespace {

// kvc_attend and kvc_attend_batch: the dtype as the int the caller passed (raw_enum).
kvc_status attend_requests(int64_t layer, kvc_cache* const* caches, size_t count, const void* const* q, int dtype,
                        const int64_t* tokens, const int64_t* const* positions, float* const* out) {
  return guard([&] {
    using namespace kvcache;
    const char* fn = count == 1 ? "kvc_attend" : "kvc_attend_batch";
    if (count == 0) return;
    capi::not_null(caches, fn, "caches");
    capi::not_null(q, fn, "q");
    capi::not_null(tokens, fn, "tokens");
    capi::not_null(positions, fn, "positions");
    capi::not_null(out, fn, "out");
    const DType t = capi::dtype_of(dtype, fn);
    std::vector<AttendRequest> requests(count);
    static const int64_t kNone = 0;
    for (size_t i = 0; i < count; ++i) {
      const std::string what = count == 1 ? std::string(fn) : detail::str_cat(fn, ": request ", i);
      KV_CHECK_ARG(caches[i] != nullptr, what, ": cache is NULL");
      KV_CHECK_ARG(tokens[i] >= 0, what, ": tokens = ", tokens[i], " must be >= 0");
      if (tokens[i] > 0) {
        KV_CHECK_ARG(q[i] != nullptr, what, ": q is NULL");
        KV_CHECK_ARG(positions[i] != nullptr, what, ": positions is NULL");
        KV_CHECK_ARG(out[i] != nullptr, what, ": out is NULL");
      }
      const CacheConfig& c = caches[i]->manager.config();
      const std::vector<int64_t> shape{1, c.num_q_heads, tokens[i], c.head_dim};
      AttendRequest& r = requests[i];
      r.cache = &caches[i]->manager;
      r.q = TensorView(tokens[i] > 0 ? q[i] : &kNone, t, shape);
      r.q_positions = TensorView(tokens[i] > 0 ? positions[i] : &kNone, DType::kInt64, {tokens[i]});
      static float none_out = 0.0f;
      r.out = MutableTensorView(tokens[i] > 0 ? out[i] : &none_out, DType::kFloat32, shape);
    }
    if (count == 1) {
      requests[0].cache->attend(layer, requests[0].q, requests[0].q_positions, requests[0].out);
      return;
    }
    try {
      attend_batch(layer, requests);
    } catch (const InvalidArgument& e) {
      // attend_batch names the request; the C caller reads the C function's name first.
      throw InvalidArgument(detail::str_cat(fn, ": ", e.what()));
    }
  });
}

}  // namespace

extern "C" {

kvc_status kvc_attend(kvc_cache* cache, int64_t layer, const void* q, kvc_dtype dtype, int64_t tokens,
                      const int64_t* positions, float* out) {
  return attend_requests(layer, &cache, 1, &q, kvcache::capi::raw_enum(dtype), &tokens, &positions, &out);
}

kvc_status kvc_attend_batch(int64_t layer, kvc_cache* const* caches, size_t count, const void* const* q,
                            kvc_dtype dtype, const int64_t* tokens, const int64_t* const* positions,
                            float* const* out) {
  return attend_requests(layer, caches, count, q, kvcache::capi::raw_enum(dtype), tokens, positions, out);
}

kvc_status kvc_end_step(kvc_cache* cache, kvc_step step) {
  return guard([&] {
    using namespace kvcache;
    const char* fn = "kvc_end_step";
    CacheManager& m = capi::not_null(cache, fn, "cache")->manager;
    const int raw = capi::raw_enum(step);
    KV_CHECK_ARG(raw == KVC_STEP_PREFILL || raw == KVC_STEP_PREFILL_END || raw == KVC_STEP_DECODE, fn, ": step ", raw,
                 " is none of KVC_STEP_PREFILL (0), KVC_STEP_PREFILL_END (1), KVC_STEP_DECODE (2)");
    m.end_step(raw == KVC_STEP_PREFILL ? StepKind::kPrefill
               : raw == KVC_STEP_PREFILL_END ? StepKind::kPrefillEnd
                                             : StepKind::kDecode);
  });
}

kvc_status kvc_stats_get(const kvc_cache* cache, kvc_stats* out) {
  return guard([&] {
    const char* fn = "kvc_stats_get";
    kvcache::capi::not_null(out, fn, "out");
    const kvcache::CacheStats s = kvcache::capi::not_null(cache, fn, "cache")->manager.stats();
    out->tokens_written = s.tokens_written;
    out->tokens_resident = s.tokens_resident;
    out->tokens_resident_peak = s.tokens_resident_peak;
    out->bytes_resident = s.bytes_resident;
    out->bytes_resident_peak = s.bytes_resident_peak;
    out->bytes_reserved = s.bytes_reserved;
    out->bytes_reserved_peak = s.bytes_reserved_peak;
  });
}

}  // extern "C"
