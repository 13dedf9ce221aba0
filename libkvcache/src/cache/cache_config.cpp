// SPDX-License-Identifier: Apache-2.0
// CacheConfig::validate and the block size it resolves (kvcache/cache_config.h).
#include <numeric>
#include <utility>

#include "cache/sequence_store.h"
#include "cache/step_protocol.h"
#include "common/rope_table.h"
#include "kvcache/cache_config.h"
#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/eviction_policy.h"

namespace kvcache {
namespace {

constexpr int64_t kMaxBlockTokens = 4096;

/// Tokens the stream's quantizer encodes together for head_dim d (1: per token).
int64_t group_tokens(const StreamSpec& s, int64_t d) { return s.quantizer->stored_layout(d).group_tokens; }

/// The lcm of every stream's group size (block_tokens must be a multiple of it).
int64_t group_lcm(const std::vector<LayerStreams>& streams, int64_t d) {
  int64_t g = 1;
  for (const auto& l : streams) g = std::lcm(g, std::lcm(group_tokens(l.key, d), group_tokens(l.value, d)));
  return g;
}

}  // namespace

void CacheConfig::validate() const {
  KV_CHECK_ARG(num_layers >= 1, "CacheConfig.num_layers must be >= 1, got ", num_layers);
  KV_CHECK_ARG(num_kv_heads >= 1, "CacheConfig.num_kv_heads must be >= 1, got ", num_kv_heads);
  KV_CHECK_ARG(num_q_heads >= 1 && num_q_heads % num_kv_heads == 0,
               "CacheConfig.num_q_heads must be a positive multiple of num_kv_heads=", num_kv_heads,
               ", got ", num_q_heads);
  KV_CHECK_ARG(head_dim >= 1, "CacheConfig.head_dim must be >= 1, got ", head_dim);
  KV_CHECK_ARG(residual_length >= 0 && residual_length <= kMaxTokens, "CacheConfig.residual_length must be in [0, ",
               kMaxTokens, "], got ", residual_length);
  KV_CHECK_ARG(context_length >= 0 && context_length <= kMaxTokens, "CacheConfig.context_length must be in [0, ",
               kMaxTokens, "] tokens, got ", context_length);
  KV_CHECK_ARG(static_cast<bool>(rope),
               "CacheConfig.rope is required (the model's rotary embedding: rotates x [H, T, D] in place by "
               "positions [T]; rotate_half_rope(theta), or keys_already_rotated() for an engine that rotates "
               "keys itself)");
  KV_CHECK_ARG(!(position_mode == PositionMode::kRerotate && key_storage == KeyStorage::kPostRoPE),
               "CacheConfig: position_mode=kRerotate re-rotates kept keys to contiguous positions "
               "and needs key_storage=kPreRoPE (got kPostRoPE)");
  KV_CHECK_ARG(key_storage == KeyStorage::kPostRoPE || head_dim % 2 == 0,
               "CacheConfig: key_storage=kPreRoPE rotates keys on read and needs an even head_dim, got ", head_dim);
  const auto sch = make_cache_scheme(scheme);
  const auto streams = cache::resolve_streams(*sch, *this);
  const auto needs = sch->required_key_storage();
  KV_CHECK_ARG(!needs || *needs == key_storage, "CacheConfig: cache scheme '", scheme, "' requires key_storage=",
               needs && *needs == KeyStorage::kPreRoPE ? "kPreRoPE" : "kPostRoPE");
  KV_CHECK_ARG(block_tokens >= 0 && block_tokens <= kMaxBlockTokens, "CacheConfig.block_tokens must be in [0, ",
               kMaxBlockTokens, "] (0 = default ", kDefaultBlockTokens, "), got ", block_tokens);
  if (block_tokens > 0) {
    for (const auto& l : streams) {
      for (const auto& [st, which] : {std::pair<const StreamSpec*, const char*>{&l.key, "key"}, {&l.value, "value"}}) {
        const int64_t g = group_tokens(*st, head_dim);
        KV_CHECK_ARG(block_tokens % g == 0, "CacheConfig.block_tokens = ", block_tokens, " must be a multiple of the ",
                     which, " quantizer's group of ", g, " tokens ('", scheme, "'; or 0 for the default)");
      }
    }
  }
  const auto p = make_eviction_policy(policy);
  // Reset as the CacheManager resets it: what depends on the cache's shape (perlayer(...)'s layer
  // count) is checked here too.
  p->reset(context_length, CacheShape{num_layers, num_q_heads, num_kv_heads});
  // The RoPE table probes the hook and checks its form: a config that validates builds.
  const std::string why = cache::rope_table_reason(*this, *p);
  if (!why.empty()) {
    KV_CHECK_ARG(!common::RopeTable(rope, head_dim, why).identity(),
                 "CacheConfig.rope rotates nothing (keys_already_rotated(): keys arrive rotated by the engine), but ",
                 why, "; give the cache the model's RoPE (rotate_half_rope(theta))");
  }
}

int64_t CacheConfig::resolved_block_tokens() const {
  if (block_tokens > 0) return block_tokens;
  const int64_t g = block_tokens_multiple();
  return (kDefaultBlockTokens + g - 1) / g * g;
}

int64_t CacheConfig::block_tokens_multiple() const {
  return group_lcm(cache::resolve_streams(*make_cache_scheme(scheme), *this), head_dim);
}

}  // namespace kvcache
