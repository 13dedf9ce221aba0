/* SPDX-License-Identifier: Apache-2.0 */
#ifndef KVCACHE_C_API_H
#define KVCACHE_C_API_H
/**
 * @file c_api.h
 * The C API of kvcache::core (libkvcache_core): a KV cache of one sequence per handle, for
 * an engine in C or any language with a C FFI. Shapes, units and rules are those of the C++
 * core (kvcache/sequence_cache.h, docs/engine-api.md); this header restates what a C caller
 * needs.
 *
 * - Handles are opaque (kvc_cache). Create one from a kvc_config, destroy it with
 *   kvc_cache_destroy. A handle serves one thread at a time; different handles may be used
 *   from different threads at once (kvc_attend_batch parallelises inside one call).
 * - No exception crosses this interface: every call that can fail returns a kvc_status, and
 *   kvc_last_error() gives the message of the last failed call on the calling thread, which
 *   names the bad value and what was expected (as the C++ errors do).
 * - All-or-nothing: a call that fails changes nothing (the cache, its counters and its
 *   eviction policy are as before the call).
 * - The library keeps no pointer the caller passes beyond the call that received it: every
 *   array is read (or written) during the call only.
 * - Arrays are contiguous, row-major, of the element type `dtype` names; their sizes follow
 *   from the config and the token counts passed (the library cannot check a buffer's length:
 *   passing a shorter one is undefined behaviour, as for memcpy).
 *
 * Letters: L layers, H_q query heads, H_kv KV heads (H_q a multiple of H_kv; query head h
 * reads KV head h / (H_q / H_kv)), D head_dim, T tokens of a call.
 */

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** What a call did. */
typedef enum kvc_status {
  KVC_OK = 0,
  /** A value is malformed or out of range: a spec, a size, a layer, a position, NaN/Inf, a
   *  call out of order (the message names it). */
  KVC_INVALID_ARGUMENT = 1,
  /** Well-formed but does not fit: an eviction budget below what the policy must keep. */
  KVC_CAPACITY = 2,
  /** The library could not allocate memory; the cache is valid (possibly with part of an
   *  append written: reset it). */
  KVC_OUT_OF_MEMORY = 3,
  /** A broken invariant of the library (a bug, never the caller's input). */
  KVC_INTERNAL = 4
} kvc_status;

/** Element type of K, V and queries. */
typedef enum kvc_dtype { KVC_FLOAT32 = 0, KVC_FLOAT16 = 1, KVC_BFLOAT16 = 2 } kvc_dtype;

/** What a forward step just ran (kvc_end_step). */
typedef enum kvc_step {
  KVC_STEP_PREFILL = 0,     /**< a prompt chunk that is not the last one */
  KVC_STEP_PREFILL_END = 1, /**< the prompt's last chunk (SnapKV-like policies compress here) */
  KVC_STEP_DECODE = 2       /**< one generated token */
} kvc_step;

/** How a cache stores and evicts (kvc_config_init sets the defaults). */
typedef struct kvc_config {
  /** Cache scheme spec: "fp32" (default), "fp16", "bf16", "fp8:e4m3", "int8", "int4",
   *  "int2:g32:chan", "kivi:k2:v2:g32:r128", ... (docs/quantizers.md, docs/cache-manager.md).
   *  NULL: "fp32". Copied at creation. */
  const char* scheme;
  /** Eviction policy spec: "full" (default), "window:w256", "sink:s4@50%", "h2o@512", ...
   *  (docs/policies.md). NULL: "full". Copied at creation. */
  const char* policy;
  int64_t num_layers;   /**< L >= 1 */
  int64_t num_q_heads;  /**< H_q, a positive multiple of H_kv */
  int64_t num_kv_heads; /**< H_kv >= 1 */
  int64_t head_dim;     /**< D >= 1 */
  /** Tokens of the request (prompt + max new tokens): resolves "@P%" budgets; >= 0 (0:
   *  unknown, then a fractional budget fails at the first end_step). kvc_reset sets it anew. */
  int64_t context_length;
  /** Full-precision residual of the newest tokens (0: none), for schemes that take one. */
  int64_t residual_length;
  /** Tokens per storage block; 0 (default): 64, raised to the scheme's per-channel group. */
  int64_t block_tokens;
  /** RoPE: > 1 — kvc_append takes keys BEFORE RoPE and the cache rotates them (rotate-half
   *  RoPE of HF Llama/Qwen with this base); 0 (default) — the caller rotates its keys itself
   *  and appends them rotated (then a policy or storage that needs the RoPE, e.g.
   *  "expected@50%", is refused at creation). Queries are always passed rotated. */
  double rope_theta;
} kvc_config;

/** Counters of a cache, measured from what it stores (all layers together). */
typedef struct kvc_stats {
  int64_t tokens_written;       /**< tokens ever appended, summed over layers */
  int64_t tokens_resident;      /**< tokens stored now, summed over layers */
  int64_t tokens_resident_peak; /**< its maximum */
  int64_t bytes_resident;       /**< bytes of the live tokens' stored form */
  int64_t bytes_resident_peak;  /**< its maximum */
  int64_t bytes_reserved;       /**< bytes of the blocks held (what the cache occupies) */
  int64_t bytes_reserved_peak;  /**< its maximum */
} kvc_stats;

/** A cache of one sequence (opaque). */
typedef struct kvc_cache kvc_cache;

/** The library's version, "MAJOR.MINOR.PATCH" (static storage; never NULL). */
const char* kvc_version(void);

/** The message of the last call on this thread that did not return KVC_OK ("" before any).
 *  Valid until the next failing call on this thread. Never NULL. */
const char* kvc_last_error(void);

/** Fills `config` with the defaults: scheme "fp32", policy "full", every size 0, rope_theta 0.
 *  Does nothing for NULL. */
void kvc_config_init(kvc_config* config);

/** Creates a cache of `config` into `*out` (on failure *out is set to NULL).
 *  KVC_INVALID_ARGUMENT: NULL config or out, a size out of range, a spec that does not parse
 *  or cannot run on this geometry (naming it). KVC_CAPACITY: a budget below the policy's
 *  protected tokens for config->context_length. */
kvc_status kvc_cache_create(const kvc_config* config, kvc_cache** out);

/** Destroys a cache and frees its memory. NULL is allowed (nothing happens). */
void kvc_cache_destroy(kvc_cache* cache);

/** Starts a new request of `context_length` tokens: every layer, counter and block cleared.
 *  KVC_INVALID_ARGUMENT: NULL cache, context_length outside [0, 1e9] tokens. KVC_CAPACITY: the
 *  policy's budget does not fit this context (e.g. "sink@1%" of 100 tokens keeps no window). */
kvc_status kvc_reset(kvc_cache* cache, int64_t context_length);

/** Position to give the next token appended to `layer`, into `*out`.
 *  KVC_INVALID_ARGUMENT: NULL cache or out, layer out of range. */
kvc_status kvc_next_position(const kvc_cache* cache, int64_t layer, int64_t* out);

/** Appends `tokens` tokens to `layer`: `k` and `v` [H_kv, tokens, D] of `dtype` (keys before
 *  RoPE when rope_theta > 1, else rotated), `positions` int64 [tokens], increasing, after the
 *  layer's last position. tokens = 0 appends nothing (the arrays may be NULL then).
 *  KVC_INVALID_ARGUMENT: NULL cache or array, layer out of range, tokens < 0, an unknown dtype,
 *  NaN/Inf in k or v (naming the index), positions that do not continue the layer, an append
 *  after the layer attended in this step. */
kvc_status kvc_append(kvc_cache* cache, int64_t layer, const void* k, const void* v, kvc_dtype dtype, int64_t tokens,
                      const int64_t* positions);

/** Attention of `tokens` query tokens over what `layer` holds (the step's own tokens
 *  included; causal by position): `q` [H_q, tokens, D] of `dtype` (rotated), `positions`
 *  int64 [tokens], result into `out` float32 [H_q, tokens, D] (which must not overlap q).
 *  Feeds the eviction policy the statistics it reads (h2o, snapkv, ...).
 *  KVC_INVALID_ARGUMENT: NULL cache or array, layer out of range, tokens < 0, an unknown dtype,
 *  NaN/Inf in q, a second attention of the layer in one step while the policy reads attention. */
kvc_status kvc_attend(kvc_cache* cache, int64_t layer, const void* q, kvc_dtype dtype, int64_t tokens,
                      const int64_t* positions, float* out);

/** kvc_attend of `count` caches in one call (a batched decode step: one call per layer):
 *  cache i attends q[i] ([H_q, tokens[i], D] of `dtype`) at positions[i] into out[i]; the
 *  caches may hold different numbers of tokens and differ in scheme and policy. Bit for bit
 *  the results of `count` kvc_attend calls, with the work spread over the threads together.
 *  All-or-nothing: every request is checked before any is attended. count 0 does nothing (the
 *  arrays may then be NULL).
 *  KVC_INVALID_ARGUMENT: NULL arrays, a NULL or repeated cache (naming the index), or anything
 *  kvc_attend refuses (naming the index). */
kvc_status kvc_attend_batch(int64_t layer, kvc_cache* const* caches, size_t count, const void* const* q,
                            kvc_dtype dtype, const int64_t* tokens, const int64_t* const* positions, float* const* out);

/** Ends a forward step: every layer must have appended the same number of tokens; the
 *  policy plans every layer, then the cache evicts.
 *  KVC_INVALID_ARGUMENT: NULL cache, an unknown step, layers that appended different counts.
 *  KVC_CAPACITY: the budget cannot hold the policy's protected tokens. */
kvc_status kvc_end_step(kvc_cache* cache, kvc_step step);

/** The cache's counters into `*out`. KVC_INVALID_ARGUMENT: NULL cache or out. */
kvc_status kvc_stats_get(const kvc_cache* cache, kvc_stats* out);

#ifdef __cplusplus
}
#endif

#endif /* KVCACHE_C_API_H */
