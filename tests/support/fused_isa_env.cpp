// SPDX-License-Identifier: Apache-2.0
// Linked into every test executable: the library reads no environment variable, so the tests
// pass KVCACHE_FUSED_ISA and KVCACHE_ATTENTION_QUERY on themselves (as kv_study does), before main.
#include <cstdlib>

#include "kvcache/attention.h"

namespace {

const bool kFusedIsaFromEnvironment = [] {
  if (const char* isa = std::getenv("KVCACHE_FUSED_ISA")) kvcache::set_attention_kernels(isa, "KVCACHE_FUSED_ISA");
  if (const char* q = std::getenv("KVCACHE_ATTENTION_QUERY")) kvcache::set_attention_query(q, "KVCACHE_ATTENTION_QUERY");
  return true;
}();

}  // namespace
