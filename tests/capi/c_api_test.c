/* SPDX-License-Identifier: Apache-2.0 */
/* The C API (kvcache/c_api.h) from a C program: every call, each error path a call can take,
 * and the values it computes against a plain C reference (attention of fp32 + full within
 * 1e-5; an int8 cache's bytes by the format's arithmetic; a window policy's resident count).
 * Compiled as C11 (tests/CMakeLists.txt). Exits 0 when every check holds, else 1 after
 * printing each failure. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kvcache/c_api.h"

static int g_failures = 0;

#define CHECK(cond)                                                     \
  do {                                                                  \
    if (!(cond)) {                                                      \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                     \
    }                                                                   \
  } while (0)

/* The call returned `status` and its message contains `text`. */
#define CHECK_ERROR(call, status, text)                                                         \
  do {                                                                                          \
    const kvc_status s_ = (call);                                                               \
    if (s_ != (status) || strstr(kvc_last_error(), (text)) == NULL) {                           \
      fprintf(stderr, "%s:%d: %s returned %d (expected %d), message '%s' (expected to contain '%s')\n", \
              __FILE__, __LINE__, #call, (int)s_, (int)(status), kvc_last_error(), (text));     \
      ++g_failures;                                                                             \
    }                                                                                           \
  } while (0)

enum { L = 2, HQ = 4, HKV = 2, D = 8, T = 5 };

/* Deterministic values in [-1, 1). */
static float value(int i) { return (float)((i * 7919 + 13) % 2000) / 1000.0f - 1.0f; }

/* Plain softmax attention of q [HQ, nq, D] at positions qpos over keys/values [HKV, nk, D] at
 * positions kpos (causal by position), in double. */
static void reference(const float* q, int nq, const int64_t* qpos, const float* k, const float* v, int nk,
                      const int64_t* kpos, double* out) {
  int h, t, j, i;
  for (h = 0; h < HQ; ++h) {
    const int kv = h / (HQ / HKV);
    for (t = 0; t < nq; ++t) {
      double s[64], m = -1e300, sum = 0;
      for (j = 0; j < nk; ++j) {
        double dot = 0;
        for (i = 0; i < D; ++i) dot += (double)q[(h * nq + t) * D + i] * (double)k[(kv * nk + j) * D + i];
        s[j] = kpos[j] <= qpos[t] ? dot / sqrt((double)D) : -1e300;
        if (s[j] > m) m = s[j];
      }
      for (j = 0; j < nk; ++j) {
        s[j] = s[j] <= -1e299 ? 0.0 : exp(s[j] - m);
        sum += s[j];
      }
      for (i = 0; i < D; ++i) {
        double acc = 0;
        for (j = 0; j < nk; ++j) acc += s[j] / sum * (double)v[(kv * nk + j) * D + i];
        out[(h * nq + t) * D + i] = acc;
      }
    }
  }
}

static kvc_config config_of(const char* scheme, const char* policy, int64_t context) {
  kvc_config c;
  kvc_config_init(&c);
  c.scheme = scheme;
  c.policy = policy;
  c.num_layers = L;
  c.num_q_heads = HQ;
  c.num_kv_heads = HKV;
  c.head_dim = D;
  c.context_length = context;
  return c;
}

static void test_version_and_config(void) {
  kvc_config c;
  const char* v = kvc_version();
  CHECK(v != NULL && strchr(v, '.') != NULL);
  CHECK(kvc_last_error() != NULL);
  kvc_config_init(NULL); /* allowed: nothing happens */
  memset(&c, 0x7f, sizeof c);
  kvc_config_init(&c);
  CHECK(strcmp(c.scheme, "fp32") == 0 && strcmp(c.policy, "full") == 0);
  CHECK(c.num_layers == 0 && c.head_dim == 0 && c.context_length == 0 && c.rope_theta == 0.0);
}

static void test_create_errors(void) {
  kvc_cache* cache = (kvc_cache*)&cache; /* any non-NULL value: a failed create sets it to NULL */
  kvc_config c = config_of("fp32", "full", 0);
  CHECK_ERROR(kvc_cache_create(NULL, &cache), KVC_INVALID_ARGUMENT, "config is NULL");
  CHECK(cache == NULL);
  CHECK_ERROR(kvc_cache_create(&c, NULL), KVC_INVALID_ARGUMENT, "out is NULL");
  c.num_layers = 0;
  CHECK_ERROR(kvc_cache_create(&c, &cache), KVC_INVALID_ARGUMENT, "num_layers must be >= 1, got 0");
  c = config_of("int5", "full", 0);
  CHECK_ERROR(kvc_cache_create(&c, &cache), KVC_INVALID_ARGUMENT, "'int5'");
  c = config_of("fp32", "full", 0);
  c.num_q_heads = 3;
  CHECK_ERROR(kvc_cache_create(&c, &cache), KVC_INVALID_ARGUMENT, "multiple of num_kv_heads=2, got 3");
  c = config_of("fp32", "full", 0);
  c.rope_theta = 0.5;
  CHECK_ERROR(kvc_cache_create(&c, &cache), KVC_INVALID_ARGUMENT, "rope_theta = 0.5");
  /* A policy that reads pre-RoPE queries needs the cache's RoPE (rope_theta > 1). */
  c = config_of("fp32", "expected@50%", 40);
  CHECK_ERROR(kvc_cache_create(&c, &cache), KVC_INVALID_ARGUMENT, "rotates nothing");
  c.rope_theta = 10000.0;
  CHECK(kvc_cache_create(&c, &cache) == KVC_OK && cache != NULL);
  kvc_cache_destroy(cache);
  /* A budget below the policy's protected tokens: sink@1% of 100 tokens keeps one, no window. */
  c = config_of("fp32", "sink@1%", 100);
  CHECK_ERROR(kvc_cache_create(&c, &cache), KVC_CAPACITY, "");
  CHECK(cache == NULL);
  kvc_cache_destroy(NULL); /* allowed */
}

/* fp32 + full: attention equals the plain reference over every appended token; stats count
 * what fp32 stores; every error path of append / attend / end_step / reset / next_position /
 * stats. */
static void test_fp32_full(void) {
  kvc_cache* cache = NULL;
  kvc_config c = config_of("fp32", "full", 16);
  float k[HKV * T * D], v[HKV * T * D], q[HQ * T * D], out[HQ * T * D];
  double want[HQ * T * D];
  int64_t pos[T], next = -1;
  int i, l;
  kvc_stats st;
  for (i = 0; i < HKV * T * D; ++i) {
    k[i] = value(i);
    v[i] = value(i + 1000);
  }
  for (i = 0; i < HQ * T * D; ++i) q[i] = value(i + 5000);
  for (i = 0; i < T; ++i) pos[i] = i;
  CHECK(kvc_cache_create(&c, &cache) == KVC_OK);
  CHECK(kvc_next_position(cache, 0, &next) == KVC_OK && next == 0);
  CHECK_ERROR(kvc_next_position(cache, 7, &next), KVC_INVALID_ARGUMENT, "layer 7 out of range [0, 2)");
  CHECK_ERROR(kvc_next_position(NULL, 0, &next), KVC_INVALID_ARGUMENT, "cache is NULL");
  CHECK_ERROR(kvc_next_position(cache, 0, NULL), KVC_INVALID_ARGUMENT, "out is NULL");

  /* append errors: nothing changes */
  CHECK_ERROR(kvc_append(NULL, 0, k, v, KVC_FLOAT32, T, pos), KVC_INVALID_ARGUMENT, "cache is NULL");
  CHECK_ERROR(kvc_append(cache, 2, k, v, KVC_FLOAT32, T, pos), KVC_INVALID_ARGUMENT, "layer 2 out of range");
  CHECK_ERROR(kvc_append(cache, 0, NULL, v, KVC_FLOAT32, T, pos), KVC_INVALID_ARGUMENT, "k is NULL");
  CHECK_ERROR(kvc_append(cache, 0, k, NULL, KVC_FLOAT32, T, pos), KVC_INVALID_ARGUMENT, "v is NULL");
  CHECK_ERROR(kvc_append(cache, 0, k, v, KVC_FLOAT32, T, NULL), KVC_INVALID_ARGUMENT, "positions is NULL");
  CHECK_ERROR(kvc_append(cache, 0, k, v, KVC_FLOAT32, -1, pos), KVC_INVALID_ARGUMENT, "tokens = -1");
  CHECK_ERROR(kvc_append(cache, 0, k, v, (kvc_dtype)9, T, pos), KVC_INVALID_ARGUMENT, "dtype 9 is none of");
  k[3] = NAN;
  CHECK_ERROR(kvc_append(cache, 0, k, v, KVC_FLOAT32, T, pos), KVC_INVALID_ARGUMENT, "k contains NaN at");
  k[3] = value(3);
  pos[2] = 1;
  CHECK_ERROR(kvc_append(cache, 0, k, v, KVC_FLOAT32, T, pos), KVC_INVALID_ARGUMENT, "positions must increase");
  pos[2] = 2;
  CHECK(kvc_stats_get(cache, &st) == KVC_OK && st.tokens_written == 0 && st.bytes_reserved == 0);
  CHECK(kvc_append(cache, 0, NULL, NULL, KVC_FLOAT32, 0, NULL) == KVC_OK); /* nothing */

  for (l = 0; l < L; ++l) CHECK(kvc_append(cache, l, k, v, KVC_FLOAT32, T, pos) == KVC_OK);
  CHECK(kvc_next_position(cache, 1, &next) == KVC_OK && next == T);
  CHECK(kvc_attend(cache, 0, q, KVC_FLOAT32, T, pos, out) == KVC_OK);
  reference(q, T, pos, k, v, T, pos, want);
  for (i = 0; i < HQ * T * D; ++i) CHECK(fabs(out[i] - want[i]) <= 1e-5);

  /* attend errors */
  CHECK_ERROR(kvc_attend(NULL, 1, q, KVC_FLOAT32, T, pos, out), KVC_INVALID_ARGUMENT, "cache is NULL");
  CHECK_ERROR(kvc_attend(cache, 5, q, KVC_FLOAT32, T, pos, out), KVC_INVALID_ARGUMENT, "layer 5 out of range");
  CHECK_ERROR(kvc_attend(cache, 1, NULL, KVC_FLOAT32, T, pos, out), KVC_INVALID_ARGUMENT, "q is NULL");
  CHECK_ERROR(kvc_attend(cache, 1, q, KVC_FLOAT32, T, NULL, out), KVC_INVALID_ARGUMENT, "positions is NULL");
  CHECK_ERROR(kvc_attend(cache, 1, q, KVC_FLOAT32, T, pos, NULL), KVC_INVALID_ARGUMENT, "out is NULL");
  CHECK_ERROR(kvc_attend(cache, 1, q, (kvc_dtype)-1, T, pos, out), KVC_INVALID_ARGUMENT, "dtype -1 is none of");
  CHECK_ERROR(kvc_attend(cache, 1, q, KVC_FLOAT32, -2, pos, out), KVC_INVALID_ARGUMENT, "tokens = -2");
  q[5] = INFINITY;
  CHECK_ERROR(kvc_attend(cache, 1, q, KVC_FLOAT32, T, pos, out), KVC_INVALID_ARGUMENT, "q contains +Inf at");
  q[5] = value(5005);
  CHECK_ERROR(kvc_attend(cache, 1, q, KVC_FLOAT32, T, pos, (float*)q), KVC_INVALID_ARGUMENT, "out overlaps q");

  /* end_step errors, then the step */
  CHECK_ERROR(kvc_end_step(NULL, KVC_STEP_PREFILL_END), KVC_INVALID_ARGUMENT, "cache is NULL");
  CHECK_ERROR(kvc_end_step(cache, (kvc_step)7), KVC_INVALID_ARGUMENT, "step 7 is none of");
  CHECK(kvc_end_step(cache, KVC_STEP_PREFILL_END) == KVC_OK);
  /* a step in which layer 1 appended nothing */
  pos[0] = T;
  CHECK(kvc_append(cache, 0, k, v, KVC_FLOAT32, 1, pos) == KVC_OK);
  CHECK_ERROR(kvc_end_step(cache, KVC_STEP_DECODE), KVC_INVALID_ARGUMENT,
              "layer 1 appended 0 tokens this step but layer 0 appended 1");
  CHECK(kvc_append(cache, 1, k, v, KVC_FLOAT32, 1, pos) == KVC_OK);
  CHECK(kvc_end_step(cache, KVC_STEP_DECODE) == KVC_OK);

  /* stats: fp32 stores 2 streams x HKV heads x D floats per token and layer */
  CHECK(kvc_stats_get(cache, &st) == KVC_OK);
  CHECK(st.tokens_written == L * (T + 1) && st.tokens_resident == L * (T + 1));
  CHECK(st.bytes_resident == (int64_t)L * (T + 1) * 2 * HKV * D * 4);
  CHECK(st.bytes_reserved >= st.bytes_resident && st.bytes_reserved_peak >= st.bytes_reserved);
  CHECK_ERROR(kvc_stats_get(NULL, &st), KVC_INVALID_ARGUMENT, "cache is NULL");
  CHECK_ERROR(kvc_stats_get(cache, NULL), KVC_INVALID_ARGUMENT, "out is NULL");

  /* reset */
  CHECK_ERROR(kvc_reset(NULL, 4), KVC_INVALID_ARGUMENT, "cache is NULL");
  CHECK_ERROR(kvc_reset(cache, -1), KVC_INVALID_ARGUMENT, "context_length must be in [0, 1000000000] tokens, got -1");
  CHECK_ERROR(kvc_reset(cache, 1000000001), KVC_INVALID_ARGUMENT, "got 1000000001");
  CHECK(kvc_reset(cache, 32) == KVC_OK);
  CHECK(kvc_stats_get(cache, &st) == KVC_OK && st.tokens_written == 0 && st.bytes_reserved == 0);
  kvc_cache_destroy(cache);
}

/* int8 with fp16 input: 8 code bytes + 2 + 2 B of fp16 scale/zero per token row of D = 8;
 * a window policy keeps its budget; reset's CapacityError. */
static void test_int8_window(void) {
  kvc_cache* cache = NULL;
  kvc_config c = config_of("int8", "window@4", 32);
  uint16_t k[HKV * T * D], v[HKV * T * D];
  int64_t pos[T];
  int i, l;
  kvc_stats st;
  for (i = 0; i < HKV * T * D; ++i) {
    k[i] = (uint16_t)(0x3c00 + (i % 64)); /* fp16 values near 1.0 */
    v[i] = (uint16_t)(0xbc00 + (i % 32)); /* near -1.0 */
  }
  for (i = 0; i < T; ++i) pos[i] = i;
  c.rope_theta = 10000.0; /* keys appended before RoPE: the cache rotates them */
  CHECK(kvc_cache_create(&c, &cache) == KVC_OK);
  for (l = 0; l < L; ++l) CHECK(kvc_append(cache, l, k, v, KVC_FLOAT16, T, pos) == KVC_OK);
  CHECK(kvc_end_step(cache, KVC_STEP_PREFILL_END) == KVC_OK);
  CHECK(kvc_stats_get(cache, &st) == KVC_OK);
  CHECK(st.tokens_resident == L * 4); /* the window of 4 per layer */
  CHECK(st.bytes_resident == (int64_t)L * 4 * 2 * HKV * (D + 2 + 2));
  /* sink@1% of 100 tokens keeps one token and no window: refused, the cache unchanged */
  kvc_cache_destroy(cache);
  c = config_of("fp32", "sink@1%", 1000);
  CHECK(kvc_cache_create(&c, &cache) == KVC_OK);
  CHECK_ERROR(kvc_reset(cache, 100), KVC_CAPACITY, "");
  kvc_cache_destroy(cache);
}

/* Two caches of ragged lengths in one batched call: the same bits as two single calls. */
static void test_batch(void) {
  kvc_cache* a = NULL;
  kvc_cache* b = NULL;
  kvc_config c = config_of("int4", "full", 64);
  float k[HKV * 9 * D], v[HKV * 9 * D], q[2][HQ * D], out[2][HQ * D], single[2][HQ * D];
  int64_t pos[9], qpos[2], tokens[2] = {1, 1};
  int i, l;
  for (i = 0; i < HKV * 9 * D; ++i) {
    k[i] = value(i + 7);
    v[i] = value(i + 77);
  }
  for (i = 0; i < HQ * D; ++i) {
    q[0][i] = value(i + 300);
    q[1][i] = value(i + 600);
  }
  for (i = 0; i < 9; ++i) pos[i] = i;
  CHECK(kvc_cache_create(&c, &a) == KVC_OK);
  CHECK(kvc_cache_create(&c, &b) == KVC_OK);
  for (l = 0; l < L; ++l) {
    CHECK(kvc_append(a, l, k, v, KVC_FLOAT32, 9, pos) == KVC_OK); /* 9 tokens */
    CHECK(kvc_append(b, l, k, v, KVC_FLOAT32, 3, pos) == KVC_OK); /* 3 tokens of other rows */
  }
  qpos[0] = 8;
  qpos[1] = 2;
  {
    kvc_cache* caches[2];
    const void* qs[2];
    const int64_t* ps[2];
    float* outs[2];
    kvc_cache* same[2];
    caches[0] = a;
    caches[1] = b;
    qs[0] = q[0];
    qs[1] = q[1];
    ps[0] = &qpos[0];
    ps[1] = &qpos[1];
    outs[0] = out[0];
    outs[1] = out[1];
    CHECK(kvc_attend_batch(0, caches, 2, qs, KVC_FLOAT32, tokens, ps, outs) == KVC_OK);
    CHECK(kvc_attend(a, 1, q[0], KVC_FLOAT32, 1, &qpos[0], single[0]) == KVC_OK);
    CHECK(kvc_attend(b, 1, q[1], KVC_FLOAT32, 1, &qpos[1], single[1]) == KVC_OK);
    CHECK(memcmp(out, single, sizeof out) == 0); /* layers 0 and 1 hold the same K/V */
    /* errors: nothing attended, nothing fed */
    CHECK_ERROR(kvc_attend_batch(1, NULL, 2, qs, KVC_FLOAT32, tokens, ps, outs), KVC_INVALID_ARGUMENT, "caches is NULL");
    CHECK_ERROR(kvc_attend_batch(1, caches, 2, NULL, KVC_FLOAT32, tokens, ps, outs), KVC_INVALID_ARGUMENT, "q is NULL");
    CHECK_ERROR(kvc_attend_batch(1, caches, 2, qs, KVC_FLOAT32, NULL, ps, outs), KVC_INVALID_ARGUMENT,
                "tokens is NULL");
    CHECK_ERROR(kvc_attend_batch(1, caches, 2, qs, KVC_FLOAT32, tokens, NULL, outs), KVC_INVALID_ARGUMENT,
                "positions is NULL");
    CHECK_ERROR(kvc_attend_batch(1, caches, 2, qs, KVC_FLOAT32, tokens, ps, NULL), KVC_INVALID_ARGUMENT,
                "out is NULL");
    CHECK_ERROR(kvc_attend_batch(1, caches, 2, qs, (kvc_dtype)3, tokens, ps, outs), KVC_INVALID_ARGUMENT,
                "dtype 3 is none of");
    same[0] = a;
    same[1] = a;
    CHECK_ERROR(kvc_attend_batch(1, same, 2, qs, KVC_FLOAT32, tokens, ps, outs), KVC_INVALID_ARGUMENT,
                "request 1 names a cache an earlier request names");
    same[1] = NULL;
    CHECK_ERROR(kvc_attend_batch(1, same, 2, qs, KVC_FLOAT32, tokens, ps, outs), KVC_INVALID_ARGUMENT,
                "request 1: cache is NULL");
    tokens[1] = -1;
    CHECK_ERROR(kvc_attend_batch(1, caches, 2, qs, KVC_FLOAT32, tokens, ps, outs), KVC_INVALID_ARGUMENT,
                "request 1: tokens = -1");
    tokens[1] = 1;
    caches[1] = b;
    CHECK_ERROR(kvc_attend_batch(7, caches, 2, qs, KVC_FLOAT32, tokens, ps, outs), KVC_INVALID_ARGUMENT,
                "request 0: CacheManager::attend: layer 7 out of range");
    CHECK(kvc_attend_batch(1, caches, 0, NULL, KVC_FLOAT32, NULL, NULL, NULL) == KVC_OK); /* count 0: nothing */
  }
  kvc_cache_destroy(a);
  kvc_cache_destroy(b);
}

int main(void) {
  test_version_and_config();
  test_create_errors();
  test_fp32_full();
  test_int8_window();
  test_batch();
  if (g_failures != 0) {
    fprintf(stderr, "c_api_test: %d check(s) failed\n", g_failures);
    return 1;
  }
  printf("c_api_test: every check passed (kvcache %s)\n", kvc_version());
  return 0;
}
