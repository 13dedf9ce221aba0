// SPDX-License-Identifier: Apache-2.0
// CacheManager: orchestrates the block store (LayerStore per layer), the generic read path
// (attend_generic) and the eviction policy. Every public mutator validates everything
// before it changes anything.
#include "kvcache/cache_manager.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>
#include <tuple>
#include <utility>

#include "cache/attend.h"
#include "cache/block_layer_view.h"
#include "cache/block_pool.h"
#include "cache/cache_manager_access.h"
#include "cache/layer_store.h"
#include "cache/pool_set.h"
#include "cache/rope_table.h"
#include "cache/sequence_seam.h"
#include "common/log.h"
#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/spec.h"

namespace kvcache {
namespace {

constexpr int64_t kMaxBlockTokens = 4096;
/// Query rows of a replay step attended at a time (bounds its [G, rows, T] probabilities).
constexpr int64_t kReplayRows = 128;
/// Largest position kPreRoPE storage records cos/sin for (a table of D floats per position).
constexpr int64_t kMaxPreRopePosition = int64_t{1} << 22;

std::string shape_str(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream os;
  os << t.sizes() << " " << at::toString(t.scalar_type());
  return os.str();
}

bool is_float_input(const at::Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16;
}

/// The scheme of `cfg` resolved for every layer (validating it on the config's geometry).
std::vector<LayerStreams> resolve_streams(const CacheScheme& scheme, const CacheConfig& cfg) {
  const CacheGeometry g{cfg.num_layers, cfg.num_kv_heads, cfg.head_dim};
  std::vector<LayerStreams> out;
  out.reserve(static_cast<size_t>(cfg.num_layers));
  for (int64_t l = 0; l < cfg.num_layers; ++l) out.push_back(scheme.streams(g, l, cfg.residual_length));
  return out;
}

/// Tokens the stream's quantizer encodes together for head_dim d (1: per token).
int64_t group_tokens(const StreamSpec& s, int64_t d) { return s.quantizer->stored_layout(d).group_tokens; }

/// The lcm of every stream's group size (block_tokens must be a multiple of it).
int64_t group_lcm(const std::vector<LayerStreams>& streams, int64_t d) {
  int64_t g = 1;
  for (const auto& l : streams) g = std::lcm(g, std::lcm(group_tokens(l.key, d), group_tokens(l.value, d)));
  return g;
}

/// Throws naming the first NaN/Inf of `x` `[1, H, T, D]` as `name`[0, h, t, d].
void check_finite(const at::Tensor& x, const char* fn, const char* name) {
  if (at::isfinite(x).all().item<bool>()) return;
  const auto bad = at::logical_not(at::isfinite(x)).nonzero();
  const auto i = bad[0];
  const float v = x.index({i[0], i[1], i[2], i[3]}).to(at::kFloat).item<float>();
  throw InvalidArgument(detail::str_cat(fn, ": ", name, " contains ", std::isnan(v) ? "NaN" : (v > 0 ? "+Inf" : "-Inf"),
                                        " at [b, h, t, d] = [", i[0].item<int64_t>(), ", ", i[1].item<int64_t>(), ", ",
                                        i[2].item<int64_t>(), ", ", i[3].item<int64_t>(),
                                        "]; the cache stores finite keys and values only"));
}

/// Throws unless every value of `probs` `[1, H_q, T_q, T]` is a probability in [0, 1] and no
/// row's mass exceeds 1 (softmax rows over the resident keys sum to 1; 1e-3 of slack for
/// rounding), naming the first bad index.
void check_probabilities(const at::Tensor& probs, const char* fn) {
  const at::Tensor p = probs.contiguous();
  const float* x = p.data_ptr<float>();
  const int64_t hq = p.size(1), tq = p.size(2), t = p.size(3);
  for (int64_t h = 0; h < hq; ++h) {
    for (int64_t r = 0; r < tq; ++r) {
      const float* row = x + (h * tq + r) * t;
      double sum = 0;
      for (int64_t j = 0; j < t; ++j) {
        KV_CHECK_ARG(std::isfinite(row[j]) && row[j] >= 0.0f && row[j] <= 1.0f, fn, ": probs[0, ", h, ", ", r, ", ",
                     j, "] = ", row[j], " is not a probability (expected a finite value in [0, 1])");
        sum += row[j];
      }
      KV_CHECK_ARG(sum <= 1.0 + 1e-3, fn, ": probs[0, ", h, ", ", r, ", :] sums to ", sum,
                   " > 1 (expected attention probabilities over the resident keys)");
    }
  }
}

/// Why a config needs the RoPE table beyond pre-RoPE keys ("" if it does not): a policy that
/// takes pre-RoPE queries (Expected Attention un-rotates them and averages future rotations).
std::string rope_table_reason(const CacheConfig& c, const EvictionPolicy& policy) {
  if (c.key_storage == KeyStorage::kPreRoPE) return "key_storage=kPreRoPE rotates keys on read and needs it";
  if (policy.query_need().pre_rope) {
    return "eviction policy '" + policy.spec() + "' reads pre-RoPE queries and the mean RoPE rotation and needs it";
  }
  return "";
}

/// Warns (once per policy spec) when the policy's budget holds the whole request: it evicts
/// nothing, which a study arm rarely means.
void warn_if_evicts_nothing(const EvictionPolicy& policy, int64_t context_length) {
  if (context_length <= 0 || policy.budget().kind == Budget::Kind::kNone) return;
  const int64_t budget = policy.token_budget();
  if (budget < context_length) return;
  log::warn_once("evicts-nothing:" + policy.spec(),
                 detail::str_cat("eviction policy '", policy.spec(), "' evicts nothing from a request of ",
                                 context_length, " tokens: its budget of ", budget,
                                 " tokens per KV head holds the whole prompt and every new token"));
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
  KV_CHECK_ARG(context_length >= 0, "CacheConfig.context_length must be >= 0, got ", context_length);
  KV_CHECK_ARG(static_cast<bool>(rope),
               "CacheConfig.rope is required (the model's rotary embedding: x [B, H, T, D], "
               "positions int64 [T] -> rotated x)");
  KV_CHECK_ARG(!(position_mode == PositionMode::kRerotate && key_storage == KeyStorage::kPostRoPE),
               "CacheConfig: position_mode=kRerotate re-rotates kept keys to contiguous positions "
               "and needs key_storage=kPreRoPE (got kPostRoPE)");
  KV_CHECK_ARG(key_storage == KeyStorage::kPostRoPE || head_dim % 2 == 0,
               "CacheConfig: key_storage=kPreRoPE rotates keys on read and needs an even head_dim, got ", head_dim);
  const auto sch = make_cache_scheme(scheme);
  const auto streams = resolve_streams(*sch, *this);
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
  const std::string why = rope_table_reason(*this, *p);
  if (!why.empty()) (void)cache::RopeTable(rope, head_dim, why);
}

int64_t CacheConfig::resolved_block_tokens() const {
  if (block_tokens > 0) return block_tokens;
  const int64_t g = block_tokens_multiple();
  return (kDefaultBlockTokens + g - 1) / g * g;
}

int64_t CacheConfig::block_tokens_multiple() const {
  return group_lcm(resolve_streams(*make_cache_scheme(scheme), *this), head_dim);
}

int64_t LayerTokens::max_resident() const {
  int64_t m = 0;
  for (const auto& p : positions) m = std::max<int64_t>(m, static_cast<int64_t>(p.size()));
  return m;
}

namespace {

struct LayerState {
  std::unique_ptr<cache::LayerStore> store;
  int64_t written = 0;
  int64_t step_new = 0;
  int64_t last_pos = -1;
  bool observed = false;  ///< the policy got this step's attention for the layer
  int64_t min_step = 0;   ///< after an adopted prefix: tokens the next append must carry at least
  bool queried = false;   ///< the policy got this step's query rows for the layer
  /// attend(), observe_attention or observe_queries ran on the layer in this step (whether or
  /// not the policy uses attention): the step's appends are over — one rule for every policy.
  bool attended = false;
  CacheStats stats;
};

/// Largest magnitude every stored format holds finitely (fp16's): below it, no group of any
/// format falls back to fp32, so BlockList::append_bound is exact.
constexpr float kFp16Max = 65504.0f;

}  // namespace

struct CacheManager::Impl {
  CacheConfig cfg;
  std::unique_ptr<CacheScheme> scheme;
  int64_t block_tokens = 0;
  std::unique_ptr<Quantizer> f16, f32;  ///< residual / converted rows and the fp32 fallback
  std::shared_ptr<cache::PoolSet> pools = std::make_shared<cache::PoolSet>();  ///< by block bytes
  bool shared_pools = false;          ///< pools shared with other holders (MultiSequenceCache)
  cache::StepHooks* hooks = nullptr;  ///< called before allocating (shared pools only)
  std::vector<cache::StreamSetup> ksets, vsets;  ///< per layer (built once; the stores point into them)
  std::unique_ptr<EvictionPolicy> policy;
  cache::RopeTable rope_table;  ///< kPreRoPE: rotation on read; policies: pre-RoPE queries, mean rotation
  std::vector<LayerState> layers;
  CacheStats total;
  /// A replay step (begin_replay() .. end_step(kReplay / kReplayEnd)): per layer, the step's
  /// tokens held aside, never stored.
  struct ReplayLayer {
    at::Tensor k, v;            ///< `[H_kv, n, D]` float32, k post-RoPE
    std::vector<int64_t> pos;   ///< their positions (next_position(layer) + i)
    bool attended = false;
  };
  bool replaying = false;
  bool replay_plans = false;  ///< the policy asked for the replay (else its end plans nothing)
  std::vector<ReplayLayer> replay;

  bool pre_rope() const { return cfg.key_storage == KeyStorage::kPreRoPE; }
  /// KV head h of `l` decoded into float32 rows [t, D]: its live keys (rotated when stored
  /// pre-RoPE) into kr, values into vr (quantized blocks, then the residual); returns the
  /// tokens' positions. The float copy get() and the replay's plain attention read.
  std::vector<int64_t> decode_head(const LayerState& l, int64_t h, std::vector<float>& kr,
                                   std::vector<float>& vr) const {
    const auto& ks = l.store->k(h);
    const auto& vs = l.store->v(h);
    ks.quant.live_rows(kr, l.store->k_scale());
    ks.resid.live_rows(kr, 1.0f);
    vs.quant.live_rows(vr, l.store->v_scale());
    vs.resid.live_rows(vr, 1.0f);
    std::vector<int64_t> pos = ks.positions();
    if (pre_rope()) {
      const int64_t d = cfg.head_dim;
      for (size_t j = 0; j < pos.size(); ++j) rope_table.rotate(kr.data() + static_cast<int64_t>(j) * d, pos[j]);
    }
    return pos;
  }
  static int64_t store_fallback_bytes(const cache::StreamSetup& st) {
    return st.formats.f[cache::StreamFormats::kFallback].block_bytes;
  }

  cache::BlockPool* pool_for(int64_t bytes) { return pools->get(bytes); }

  cache::BlockFormat format(const Quantizer& q, int64_t capacity) {
    return cache::BlockFormat(q, cfg.head_dim, capacity,
                              pool_for(cache::BlockFormat::bytes_for(q, cfg.head_dim, capacity)));
  }

  cache::StreamFormats stream_formats(const Quantizer& main, const StreamSpec& spec) {
    using F = cache::StreamFormats;
    cache::StreamFormats out;
    const Quantizer& residual = spec.residual_dtype == at::kFloat ? *f32 : *f16;
    const StoredLayout ml = main.stored_layout(cfg.head_dim);
    out.f[F::kMain] = format(main, ml.token_readable() ? block_tokens : ml.group_tokens);
    out.f[F::kResidual] = format(residual, block_tokens);
    out.f[F::kFallback] = format(*f32, block_tokens);
    if (!ml.token_readable()) {
      // Survivors of a per-channel group move to small blocks no larger than the group.
      const int64_t cap = ml.group_bytes() / residual.stored_layout(cfg.head_dim).group_bytes();
      if (cap >= 1) out.f[F::kConverted] = format(residual, cap);
    }
    return out;
  }

  void setup_stream(cache::StreamSetup& st, const StreamSpec& spec) {
    st.spec = spec;
    st.formats = stream_formats(*spec.quantizer, spec);
    st.head_formats.clear();
    if (spec.prefill_quantizer) {
      const StoredLayout a = spec.quantizer->stored_layout(cfg.head_dim);
      const StoredLayout b = spec.prefill_quantizer->stored_layout(cfg.head_dim);
      KV_INTERNAL_ASSERT(spec.head_quantizers.empty() && a.group_tokens == b.group_tokens &&
                             a.code_bytes == b.code_bytes && a.meta_count == b.meta_count &&
                             a.has_zeros == b.has_zeros && a.meta_dtype == b.meta_dtype &&
                             a.tensor_scale == b.tensor_scale,
                         "cache scheme '", cfg.scheme, "': the prefill encoder '", spec.prefill_quantizer->spec(),
                         "' does not share the stored layout of '", spec.quantizer->spec(), "'");
    }
    if (!spec.head_quantizers.empty()) {
      KV_INTERNAL_ASSERT(static_cast<int64_t>(spec.head_quantizers.size()) == cfg.num_kv_heads, "cache scheme '",
                         cfg.scheme, "' gave ", spec.head_quantizers.size(), " head quantizers for ",
                         cfg.num_kv_heads, " KV heads");
      for (const auto& q : spec.head_quantizers) st.head_formats.push_back(stream_formats(*q, spec));
    }
  }

  void build() {
    scheme = make_cache_scheme(cfg.scheme);
    block_tokens = cfg.resolved_block_tokens();
    f16 = make_quantizer("fp16");
    f32 = make_quantizer("fp32");
    const auto streams = resolve_streams(*scheme, cfg);
    ksets.resize(streams.size());
    vsets.resize(streams.size());
    for (size_t l = 0; l < streams.size(); ++l) {
      setup_stream(ksets[l], streams[l].key);
      setup_stream(vsets[l], streams[l].value);
    }
    policy = make_eviction_policy(cfg.policy);
    policy->reset(cfg.context_length, CacheShape{cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads});
    warn_if_evicts_nothing(*policy, cfg.context_length);
    const std::string why = rope_table_reason(cfg, *policy);
    if (!why.empty()) rope_table = cache::RopeTable(cfg.rope, cfg.head_dim, why);
    layers.resize(static_cast<size_t>(cfg.num_layers));
    make_stores();
  }

  void make_stores() {
    for (size_t i = 0; i < layers.size(); ++i) {
      layers[i].store = std::make_unique<cache::LayerStore>(&ksets[i], &vsets[i], cfg.num_kv_heads, cfg.head_dim);
    }
  }

  LayerState& layer_at(int64_t layer, const char* fn) {
    KV_CHECK_ARG(layer >= 0 && layer < cfg.num_layers, fn, ": layer ", layer, " out of range [0, ", cfg.num_layers,
                 ")");
    return layers[static_cast<size_t>(layer)];
  }
  const LayerState& layer_at(int64_t layer, const char* fn) const {
    return const_cast<Impl*>(this)->layer_at(layer, fn);
  }

  /// Samples bytes/tokens of `l` after a mutation and updates totals and peaks.
  void sample(LayerState& l) {
    CacheStats& s = l.stats;
    const int64_t bytes = l.store->bytes_resident(), reserved = l.store->bytes_reserved();
    const int64_t tokens = l.store->max_resident();
    total.bytes_resident += bytes - s.bytes_resident;
    total.bytes_reserved += reserved - s.bytes_reserved;
    total.tokens_resident += tokens - s.tokens_resident;
    s.bytes_resident = bytes;
    s.bytes_reserved = reserved;
    s.tokens_resident = tokens;
    s.tokens_written = l.written;
    s.bytes_resident_peak = std::max(s.bytes_resident_peak, bytes);
    s.bytes_reserved_peak = std::max(s.bytes_reserved_peak, reserved);
    s.tokens_resident_peak = std::max(s.tokens_resident_peak, tokens);
    total.bytes_resident_peak = std::max(total.bytes_resident_peak, total.bytes_resident);
    total.bytes_reserved_peak = std::max(total.bytes_reserved_peak, total.bytes_reserved);
    total.tokens_resident_peak = std::max(total.tokens_resident_peak, total.tokens_resident);
  }

  int64_t next_position(const LayerState& l) const {
    return cfg.position_mode == PositionMode::kRerotate ? l.store->max_resident() : l.last_pos + 1;
  }

  /// Pre-RoPE keys: throws as check_finite(rope(k)) does when a key `k` `[1, H_kv, n, D]`
  /// float32 (contiguous) rotated by the RoPE table at its position — what get() and attend()
  /// read — is not finite, so that both key storages accept the same keys.
  void check_rotated_finite(const at::Tensor& k, const int64_t* pp, const char* fn) const {
    const int64_t hkv = cfg.num_kv_heads, d = cfg.head_dim, n = k.size(2);
    const float* kp = k.data_ptr<float>();
    std::vector<float> row(static_cast<size_t>(d));
    for (int64_t h = 0; h < hkv; ++h) {
      for (int64_t t = 0; t < n; ++t) {
        std::copy_n(kp + (h * n + t) * d, d, row.begin());
        rope_table.rotate(row.data(), pp[t]);
        for (int64_t i = 0; i < d; ++i) {
          const float y = row[static_cast<size_t>(i)];
          KV_CHECK_ARG(std::isfinite(y), fn, ": rope(k) contains ", std::isnan(y) ? "NaN" : (y > 0 ? "+Inf" : "-Inf"),
                       " at [b, h, t, d] = [0, ", h, ", ", t, ", ", i, "] (k = ", kp[(h * n + t) * d + i],
                       " rotated to position ", pp[t],
                       "); the cache stores finite keys and values only, and keys stored pre-RoPE are rotated on read");
        }
      }
    }
  }

  at::Tensor rope(const at::Tensor& x, const at::Tensor& positions) const {
    auto y = cfg.rope(x, positions);
    KV_CHECK_ARG(y.defined() && y.sizes() == x.sizes(), "CacheConfig.rope returned ", shape_str(y), " for input ",
                 shape_str(x), " (expected the same shape)");
    return y.to(at::kFloat).contiguous();
  }

  void append(int64_t layer, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& positions) {
    static constexpr const char* fn = "CacheManager::append";
    auto& l = layer_at(layer, fn);
    const int64_t hkv = cfg.num_kv_heads, d = cfg.head_dim;
    if (replaying) {
      replay_append(layer, k_in, v_in, positions);
      return;
    }
    auto check_kv = [&](const at::Tensor& t, const char* name) {
      KV_CHECK_ARG(t.defined() && t.dim() == 4 && t.size(0) == 1 && t.size(1) == hkv && t.size(3) == d &&
                       is_float_input(t) && t.device().is_cpu(),
                   fn, ": ", name, " must be a CPU float32/float16/bfloat16 tensor [B=1, H_kv=", hkv,
                   ", T_new, D=", d, "] (the cache holds one sequence), got ", shape_str(t));
    };
    check_kv(k_in, "k");
    check_kv(v_in, "v");
    KV_CHECK_ARG(k_in.sizes() == v_in.sizes(), fn, ": k ", k_in.sizes(), " and v ", v_in.sizes(), " differ");
    const int64_t n = k_in.size(2);
    KV_CHECK_ARG(positions.defined() && positions.dim() == 1 && positions.size(0) == n &&
                     positions.scalar_type() == at::kLong && positions.device().is_cpu(),
                 fn, ": positions must be a CPU int64 tensor [T_new=", n, "], got ", shape_str(positions));
    KV_CHECK_ARG(!(l.observed || l.queried || l.attended) || n == 0, fn, ": the attention of layer ", layer,
                 " was already observed in this step (by attend(), observe_attention or observe_queries); append the step's "
                 "tokens first, then attend, then end_step()");
    const at::Tensor pos = positions.contiguous();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const bool rerotate = cfg.position_mode == PositionMode::kRerotate;
    const int64_t first = next_position(l);
    for (int64_t i = 0; i < n; ++i) {
      if (rerotate) {
        KV_CHECK_ARG(pp[i] == first + i, fn, " (rerotate mode): positions must continue the cache contiguously from "
                     "next_position(", layer, ") = ", first, "; got ", pp[i], " at index ", i);
      } else {
        KV_CHECK_ARG(pp[i] >= (i == 0 ? first : pp[i - 1] + 1), fn,
                     ": positions must increase and follow the layer's last position ", l.last_pos, "; got ", pp[i],
                     " at index ", i);
      }
    }
    if (n == 0) return;
    KV_CHECK_ARG(n >= l.min_step, fn, ": layer ", layer, " continues a reused prefix of ", l.written,
                 " tokens; its first step must append at least ", l.min_step,
                 " tokens (the scheme's sliding residual), got ", n,
                 " (Sequence::prefix().min_first_step; Runner::generate does this)");
    KV_CHECK_ARG(pp[n - 1] < std::numeric_limits<int64_t>::max(), fn, ": position ", pp[n - 1],
                 " leaves no next position (positions must be < 2^63 - 1)");
    KV_CHECK_ARG(!rope_table.enabled() || pp[n - 1] < kMaxPreRopePosition, fn, ": position ", pp[n - 1],
                 " is beyond the ", kMaxPreRopePosition, " positions the RoPE table records (",
                 pre_rope() ? "key_storage=kPreRoPE" : "policy '" + policy->spec() + "'", ")");
    check_finite(k_in, fn, "k");
    check_finite(v_in, fn, "v");
    at::Tensor k = k_in.to(at::kFloat).contiguous();
    const at::Tensor v = v_in.to(at::kFloat).contiguous();
    rope_table.extend(pp, n);  // no-op unless the table is in use
    if (!pre_rope()) {
      k = rope(k, pos);
      check_finite(k, fn, "rope(k)");
    } else {
      check_rotated_finite(k, pp, fn);  // the rotation every read applies: the same range as post-RoPE
    }
    if (hooks != nullptr) {
      // The pool's capacity: what this append allocates, checked before anything changes. A
      // value beyond fp16's range may go to an fp32 fallback block: bound those steps loosely.
      // (A Hadamard-rotated stream (`had`) stores H_D·x, whose entries reach up to √D·max|x|.)
      const float limit = kFp16Max / std::sqrt(static_cast<float>(cfg.head_dim));
      const bool wide = k.abs().max().item<float>() > limit || v.abs().max().item<float>() > limit;
      int64_t bytes = l.store->write_bound(n);
      // (at most two blocks per token and stream: a fallback block and the fresh block after it)
      if (wide) {
        bytes += 2 * hkv * (n + 1) *
                 (store_fallback_bytes(l.store->key_setup()) + store_fallback_bytes(l.store->value_setup()));
      }
      hooks->before_append(bytes);
    }
    // --- nothing below throws for valid input ---
    auto& store = *l.store;
    if (!store.scales_set()) {
      store.set_scales(store.key_setup().spec.quantizer->fit_tensor_scale(k),
                       store.value_setup().spec.quantizer->fit_tensor_scale(v));
    }
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    for (int64_t h = 0; h < hkv; ++h) store.write(h, kp + h * n * d, vp + h * n * d, pp, n);
    l.written += n;
    total.tokens_written += n;
    l.step_new += n;
    l.last_pos = pp[n - 1];
    l.min_step = 0;
    sample(l);
  }

  // ---------------------------------------------------------------- replay steps
  void begin_replay() {
    static constexpr const char* fn = "CacheManager::begin_replay";
    KV_CHECK_ARG(!replaying, fn, ": a replay step is already open; end it with end_step(kReplay or kReplayEnd)");
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& l = layers[i];
      KV_CHECK_ARG(l.step_new == 0 && !l.observed && !l.queried && !l.attended, fn, ": layer ", i,
                   " is inside a step (tokens appended or attention observed); call begin_replay() after end_step()");
    }
    replaying = true;
    replay_plans = policy->replay_need().any();
    replay.assign(layers.size(), ReplayLayer{});
  }

  /// append() in a replay step: checked as append() checks, then held aside (post-RoPE).
  void replay_append(int64_t layer, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& positions) {
    static constexpr const char* fn = "CacheManager::append (replay step)";
    const auto& l = layers[static_cast<size_t>(layer)];
    auto& r = replay[static_cast<size_t>(layer)];
    const int64_t hkv = cfg.num_kv_heads, d = cfg.head_dim;
    for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&k_in, "k"}, {&v_in, "v"}}) {
      KV_CHECK_ARG(t->defined() && t->dim() == 4 && t->size(0) == 1 && t->size(1) == hkv && t->size(2) >= 1 &&
                       t->size(3) == d && is_float_input(*t) && t->device().is_cpu(),
                   fn, ": ", name, " must be a CPU float32/float16/bfloat16 tensor [B=1, H_kv=", hkv,
                   ", T_new >= 1, D=", d, "], got ", shape_str(*t));
    }
    KV_CHECK_ARG(k_in.sizes() == v_in.sizes(), fn, ": k ", k_in.sizes(), " and v ", v_in.sizes(), " differ");
    KV_CHECK_ARG(r.pos.empty(), fn, ": layer ", layer, " already appended its replay tokens in this step");
    const int64_t n = k_in.size(2);
    KV_CHECK_ARG(positions.defined() && positions.dim() == 1 && positions.size(0) == n &&
                     positions.scalar_type() == at::kLong && positions.device().is_cpu(),
                 fn, ": positions must be a CPU int64 tensor [T_new=", n, "], got ", shape_str(positions));
    const at::Tensor pos = positions.contiguous();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const int64_t first = next_position(l);
    for (int64_t i = 0; i < n; ++i) {
      KV_CHECK_ARG(pp[i] == first + i, fn, ": replay positions continue the context: next_position(", layer,
                   ") + i = ", first + i, " expected, got ", pp[i], " at index ", i);
    }
    check_finite(k_in, fn, "k");
    check_finite(v_in, fn, "v");
    at::Tensor k = rope(k_in.to(at::kFloat).contiguous(), pos);
    check_finite(k, fn, "rope(k)");
    r.k = k[0].contiguous();
    r.v = v_in.to(at::kFloat)[0].contiguous();
    r.pos.assign(pp, pp + n);
  }

  /// attend() in a replay step: per KV head, the plain softmax attention of the step's queries
  /// over [resident keys (decoded, post-RoPE), the step's own keys (causal)]; the policy gets
  /// the probabilities over the resident keys reduced as its ReplayNeed::attention says.
  at::Tensor replay_attend(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions) {
    static constexpr const char* fn = "CacheManager::attend (replay step)";
    const auto& l = layers[static_cast<size_t>(layer)];
    auto& r = replay[static_cast<size_t>(layer)];
    const int64_t hq = cfg.num_q_heads, hkv = cfg.num_kv_heads, d = cfg.head_dim, g = hq / hkv;
    const int64_t n = static_cast<int64_t>(r.pos.size());
    KV_CHECK_ARG(n > 0, fn, ": layer ", layer, " appended no replay tokens in this step (append, then attend)");
    KV_CHECK_ARG(!r.attended, fn, ": layer ", layer, " already attended in this replay step");
    KV_CHECK_ARG(q.defined() && q.dim() == 4 && q.size(0) == 1 && q.size(1) == hq && q.size(2) == n &&
                     q.size(3) == d && is_float_input(q) && q.device().is_cpu(),
                 fn, ": q must be a CPU float tensor [B=1, H_q=", hq, ", T_q=", n, " (the replay tokens), D=", d,
                 "], got ", shape_str(q));
    KV_CHECK_ARG(q_positions.defined() && q_positions.dim() == 1 && q_positions.size(0) == n &&
                     q_positions.scalar_type() == at::kLong && q_positions.device().is_cpu(),
                 fn, ": q_positions must be a CPU int64 tensor [T_q=", n, "], got ", shape_str(q_positions));
    const at::Tensor qp = q_positions.contiguous();
    for (int64_t i = 0; i < n; ++i) {
      KV_CHECK_ARG(qp.data_ptr<int64_t>()[i] == r.pos[static_cast<size_t>(i)], fn,
                   ": q_positions must be the replay tokens' positions; expected ", r.pos[static_cast<size_t>(i)],
                   " at index ", i, ", got ", qp.data_ptr<int64_t>()[i]);
    }
    check_finite(q, fn, "q");
    const at::Tensor qf = q.to(at::kFloat).contiguous();
    const AttentionNeed need = policy->replay_need().attention;
    const int64_t rows = need.any() ? need.selected(n) : 0;
    AttentionMass mass;
    if (need.any()) {
      mass.rows = need.per_row ? rows : 1;
      mass.heads.resize(static_cast<size_t>(hkv));
    }
    at::Tensor out = at::empty({1, hq, n, d}, at::kFloat);
    const at::Tensor qpos = at::tensor(r.pos, at::kLong);
    for (int64_t h = 0; h < hkv; ++h) {
      std::vector<float> kr, vr;
      const std::vector<int64_t> kpos = decode_head(l, h, kr, vr);
      const auto t = static_cast<int64_t>(kpos.size());
      const at::Tensor kres = at::from_blob(kr.data(), {t, d}, at::kFloat);
      const at::Tensor vres = at::from_blob(vr.data(), {t, d}, at::kFloat);
      const at::Tensor kall = at::cat({kres, r.k[h]}, 0);  // [t + n, D]
      const at::Tensor vall = at::cat({vres, r.v[h]}, 0);
      const at::Tensor kp = at::cat({at::tensor(kpos, at::kLong), qpos}, 0);
      const at::Tensor kt = kall.t();
      // Query rows in tiles of kReplayRows: the probabilities are [G, tile, t + n] at a time.
      std::vector<at::Tensor> parts;  // the tiles' reduced mass over the resident keys
      for (int64_t r0 = 0; r0 < n; r0 += kReplayRows) {
        const int64_t m = std::min(kReplayRows, n - r0);
        const at::Tensor qg = qf[0].narrow(0, h * g, g).narrow(1, r0, m);  // [G, m, D]
        at::Tensor sc = at::matmul(qg, kt).mul_(1.0 / std::sqrt(static_cast<double>(d)));  // [G, m, t + n]
        sc.masked_fill_(kp.view({1, 1, t + n}).gt(qpos.narrow(0, r0, m).view({1, m, 1})),
                        -std::numeric_limits<float>::infinity());
        const at::Tensor p = at::softmax(sc, -1);
        out[0].narrow(0, h * g, g).narrow(1, r0, m).copy_(at::matmul(p, vall));
        // Selected rows (the last `rows` of the step) within this tile.
        const int64_t lo = std::max(r0, n - rows), hi = r0 + m;
        if (!need.any() || t == 0 || lo >= hi) continue;
        at::Tensor pr = p.narrow(1, lo - r0, hi - lo).narrow(2, 0, t);  // [G, rows in tile, t]
        if (need.reduce == AttentionNeed::Reduce::kMax) {
          pr = std::get<0>(pr.max(0));
          if (!need.per_row) pr = std::get<0>(pr.max(0, /*keepdim=*/true));
        } else {
          pr = pr.mean(0);
          if (!need.per_row) pr = pr.sum(0, /*keepdim=*/true);
        }
        parts.push_back(pr);
      }
      if (!need.any() || t == 0) continue;
      at::Tensor red = at::cat(parts, 0);  // [rows, t] (per_row) or [tiles, t]
      if (!need.per_row) {
        red = need.reduce == AttentionNeed::Reduce::kMax ? std::get<0>(red.max(0, /*keepdim=*/true))
                                                         : red.sum(0, /*keepdim=*/true);
      }
      red = red.contiguous();
      mass.heads[static_cast<size_t>(h)].assign(red.data_ptr<float>(), red.data_ptr<float>() + red.numel());
    }
    r.attended = true;
    if (need.any()) policy->observe(layer, mass);
    return out;
  }

  at::Tensor attend(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions) {
    auto& l = layer_at(layer, "CacheManager::attend");
    if (replaying) return replay_attend(layer, q, q_positions);
    const AttentionNeed need = l.observed ? AttentionNeed{} : policy->attention_need();
    const QueryNeed qneed = l.queried ? QueryNeed{} : policy->query_need();
    AttentionMass mass;
    at::Tensor out = attend_layer(layer, q, q_positions, need, &mass, cfg.fused_attention);
    if (q.size(2) > 0) l.attended = true;
    if (need.any() && q.size(2) > 0) {
      policy->observe(layer, mass);
      l.observed = true;
    }
    if (qneed.any() && q.size(2) > 0) hand_queries(layer, q, q_positions, qneed);
    return out;
  }

  /// The LayerView of `l` for the policy.
  cache::BlockLayerView view_of(const LayerState& l) const {
    return cache::BlockLayerView(l.store.get(), pre_rope() ? &rope_table : nullptr,
                                 rope_table.enabled() ? &rope_table : nullptr, next_position(l));
  }

  /// Hands the policy the selected query rows of a checked q `[1, H_q, T_q, D]` (un-rotated
  /// through the RoPE table when the need asks for pre-RoPE rows).
  void hand_queries(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions, const QueryNeed& need) {
    auto& l = layers[static_cast<size_t>(layer)];
    const int64_t hq = cfg.num_q_heads, d = cfg.head_dim, tq = q.size(2);
    const int64_t n = need.selected(tq);
    const at::Tensor qf = q.to(at::kFloat).narrow(2, tq - n, n).contiguous();
    const at::Tensor qp = q_positions.narrow(0, tq - n, n).contiguous();
    QueryRows rows;
    rows.num_q_heads = hq;
    rows.head_dim = d;
    rows.positions.assign(qp.data_ptr<int64_t>(), qp.data_ptr<int64_t>() + n);
    rows.post_rope.assign(qf.data_ptr<float>(), qf.data_ptr<float>() + hq * n * d);
    if (need.pre_rope) {
      KV_INTERNAL_ASSERT(rope_table.enabled(), "pre-RoPE queries without a RoPE table");
      for (int64_t p : rows.positions) {
        KV_CHECK_ARG(p >= 0 && p < kMaxPreRopePosition, "CacheManager::attend: query position ", p,
                     " is outside [0, ", kMaxPreRopePosition, ") the RoPE table records");
      }
      rope_table.extend(rows.positions.data(), n);
      rows.pre_rope = rows.post_rope;
      for (int64_t h = 0; h < hq; ++h) {
        for (int64_t t = 0; t < n; ++t) rope_table.unrotate(rows.pre_rope.data() + (h * n + t) * d, rows.positions[static_cast<size_t>(t)]);
      }
    }
    const cache::BlockLayerView view = view_of(l);
    policy->observe_queries(layer, rows, view);
    l.queried = true;
  }

  void observe_queries(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions) {
    static constexpr const char* fn = "CacheManager::observe_queries";
    auto& l = layer_at(layer, fn);
    KV_CHECK_ARG(!replaying, fn, ": a replay step hands the policy no query rows; end it first");
    const int64_t hq = cfg.num_q_heads, d = cfg.head_dim;
    KV_CHECK_ARG(q.defined() && q.dim() == 4 && q.size(0) == 1 && q.size(1) == hq && q.size(2) >= 1 &&
                     q.size(3) == d && is_float_input(q) && q.device().is_cpu(),
                 fn, ": q must be a CPU float32/float16/bfloat16 tensor [B=1, H_q=", hq, ", T_q >= 1, D=", d,
                 "] (post-RoPE), got ", shape_str(q));
    KV_CHECK_ARG(q_positions.defined() && q_positions.dim() == 1 && q_positions.size(0) == q.size(2) &&
                     q_positions.scalar_type() == at::kLong && q_positions.device().is_cpu(),
                 fn, ": q_positions must be a CPU int64 tensor [T_q=", q.size(2), "], got ", shape_str(q_positions));
    KV_CHECK_ARG(!l.queried, fn, ": the queries of layer ", layer, " were already observed in this step");
    check_finite(q, fn, "q");
    l.attended = true;
    const QueryNeed need = policy->query_need();
    if (!need.any()) return;
    hand_queries(layer, q, q_positions, need);
  }

  /// The read path of attend() (validation included), without touching the policy.
  at::Tensor attend_layer(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions, const AttentionNeed& need,
                          AttentionMass* mass, bool fused) const {
    static constexpr const char* fn = "CacheManager::attend";
    const auto& l = layer_at(layer, fn);
    const int64_t hq = cfg.num_q_heads, d = cfg.head_dim;
    KV_CHECK_ARG(q.defined() && q.dim() == 4 && q.size(0) == 1 && q.size(1) == hq && q.size(3) == d &&
                     is_float_input(q) && q.device().is_cpu(),
                 fn, ": q must be a CPU float32/float16/bfloat16 tensor [B=1, H_q=", hq, ", T_q, D=", d, "], got ",
                 shape_str(q));
    const int64_t tq = q.size(2);
    KV_CHECK_ARG(q_positions.defined() && q_positions.dim() == 1 && q_positions.size(0) == tq &&
                     q_positions.scalar_type() == at::kLong && q_positions.device().is_cpu(),
                 fn, ": q_positions must be a CPU int64 tensor [T_q=", tq, "], got ", shape_str(q_positions));
    check_finite(q, fn, "q");
    const at::Tensor qf = q.to(at::kFloat).contiguous();
    const at::Tensor qp = q_positions.contiguous();
    at::Tensor out = at::empty({1, hq, tq, d}, at::kFloat);
    if (tq == 0) return out;
    cache::AttendArgs a;
    a.layer = l.store.get();
    a.q = qf.data_ptr<float>();
    a.q_pos = qp.data_ptr<int64_t>();
    a.t_q = tq;
    a.num_q_heads = hq;
    a.rope = pre_rope() ? &rope_table : nullptr;
    a.need = need;
    a.out = out.data_ptr<float>();
    a.mass = mass;
    a.fused = fused;
    cache::attend_generic(a);
    return out;
  }

  void observe_attention(int64_t layer, const at::Tensor& probs) {
    static constexpr const char* fn = "CacheManager::observe_attention";
    auto& l = layer_at(layer, fn);
    KV_CHECK_ARG(!replaying, fn, ": a replay step computes its attention in attend(); end it first");
    const int64_t t = l.store->max_resident();
    for (int64_t h = 0; h < cfg.num_kv_heads; ++h) {
      KV_CHECK_ARG(l.store->resident(h) == t, fn, ": KV head ", h, " of layer ", layer, " holds ", l.store->resident(h),
                   " tokens but head 0 holds ", l.store->resident(0),
                   "; probabilities [B, H_q, T_q, T_res] need heads of equal length (use attend())");
    }
    KV_CHECK_ARG(probs.defined() && probs.dim() == 4 && probs.scalar_type() == at::kFloat && probs.size(0) == 1 &&
                     probs.size(1) == cfg.num_q_heads && probs.size(2) >= 1 && probs.size(3) == t &&
                     probs.device().is_cpu(),
                 fn, ": probs must be a CPU float32 tensor [B=1, H_q=", cfg.num_q_heads, ", T_q >= 1, T_res=", t,
                 "] for layer ", layer, ", got ", shape_str(probs));
    KV_CHECK_ARG(!l.observed, fn, ": the attention of layer ", layer,
                 " was already observed in this step (by attend() or observe_attention)");
    check_probabilities(probs, fn);
    l.attended = true;
    const AttentionNeed need = policy->attention_need();
    if (!need.any()) return;
    const AttentionMass mass = reduce_attention(probs, cfg.num_kv_heads, need);
    policy->observe(layer, mass);
    l.observed = true;
  }

  /// Validates a plan for `layer` (policy bugs are internal errors).
  void check_plan(int64_t layer, const EvictionPlan& plan) const {
    if (plan.evict.empty()) return;
    const auto& st = *layers[static_cast<size_t>(layer)].store;
    KV_INTERNAL_ASSERT(static_cast<int64_t>(plan.evict.size()) == cfg.num_kv_heads, "policy '", policy->spec(),
                       "' planned ", plan.evict.size(), " heads for layer ", layer);
    for (int64_t h = 0; h < cfg.num_kv_heads; ++h) {
      const auto& e = plan.evict[static_cast<size_t>(h)];
      const int64_t t = st.resident(h);
      for (size_t i = 0; i < e.size(); ++i) {
        KV_INTERNAL_ASSERT(e[i] >= 0 && e[i] < t - 1 && (i == 0 || e[i] > e[i - 1]), "policy '", policy->spec(),
                           "' plan for layer ", layer, " head ", h, " is not strictly increasing in [0, ", t - 1,
                           ") at ", i, " (the newest token is never evicted)");
      }
    }
  }

  void end_step(StepKind step) {
    const bool replay_kind = step == StepKind::kReplay || step == StepKind::kReplayEnd;
    KV_CHECK_ARG(replay_kind || step == StepKind::kPrefill || step == StepKind::kPrefillEnd ||
                     step == StepKind::kDecode,
                 "CacheManager::end_step: step kind ", static_cast<int>(step),
                 " is none of kPrefill, kPrefillEnd, kDecode, kReplay, kReplayEnd");
    KV_CHECK_ARG(replay_kind == replaying, "CacheManager::end_step: ",
                 replaying ? "a replay step (begin_replay()) must end with kReplay or kReplayEnd"
                           : "kReplay / kReplayEnd ends a replay step; call begin_replay() before its appends");
    if (replaying) {
      for (size_t i = 0; i < replay.size(); ++i) {
        KV_CHECK_ARG(replay[i].pos.size() == replay[0].pos.size() && replay[i].attended, "CacheManager::end_step: ",
                     "layer ", i, " appended ", replay[i].pos.size(), " replay tokens",
                     replay[i].attended ? "" : " and did not attend", " but layer 0 appended ", replay[0].pos.size(),
                     " (every layer must append and attend the replay step's tokens)");
      }
      if (!replay_plans) {
        // A replay the policy did not ask for only computed attention: nothing to plan.
        replaying = false;
        replay.clear();
        return;
      }
    }
    const int64_t n0 = layers[0].step_new;
    for (int64_t i = 1; i < cfg.num_layers; ++i) {
      KV_CHECK_ARG(layers[static_cast<size_t>(i)].step_new == n0, "CacheManager::end_step: layer ", i, " appended ",
                   layers[static_cast<size_t>(i)].step_new, " tokens this step but layer 0 appended ", n0,
                   " (every layer must append the step's tokens)");
    }
    // Plan every layer first (plan() is const): a plan that throws leaves every layer and the
    // policy as they were.
    std::vector<EvictionPlan> plans(static_cast<size_t>(cfg.num_layers));
    std::vector<EvictionContext> contexts(static_cast<size_t>(cfg.num_layers));
    for (int64_t i = 0; i < cfg.num_layers; ++i) {
      auto& l = layers[static_cast<size_t>(i)];
      const cache::BlockLayerView view = view_of(l);
      EvictionContext& ctx = contexts[static_cast<size_t>(i)];
      ctx.view = &view;
      ctx.layer = i;
      ctx.step = step;
      ctx.new_tokens = l.step_new;
      ctx.logical_length = l.written;
      ctx.resident.resize(static_cast<size_t>(cfg.num_kv_heads));
      for (int64_t h = 0; h < cfg.num_kv_heads; ++h) ctx.resident[static_cast<size_t>(h)] = l.store->resident(h);
      plans[static_cast<size_t>(i)] = policy->plan(ctx);
      check_plan(i, plans[static_cast<size_t>(i)]);
      ctx.view = nullptr;  // on_step_end sees the context without a view (the layer changes first)
    }
    if (hooks != nullptr) {
      int64_t bytes = 0;
      for (int64_t i = 0; i < cfg.num_layers; ++i) {
        const auto& plan = plans[static_cast<size_t>(i)];
        if (plan.empty()) continue;
        for (int64_t h = 0; h < cfg.num_kv_heads; ++h) {
          bytes += layers[static_cast<size_t>(i)].store->evict_bound(h, plan.evict[static_cast<size_t>(h)]);
        }
      }
      hooks->before_evict(bytes);
    }
    for (int64_t i = 0; i < cfg.num_layers; ++i) {
      auto& l = layers[static_cast<size_t>(i)];
      const auto& plan = plans[static_cast<size_t>(i)];
      if (!plan.empty()) {
        for (int64_t h = 0; h < cfg.num_kv_heads; ++h) l.store->evict(h, plan.evict[static_cast<size_t>(h)]);
        policy->on_evicted(i, plan);
        if (cfg.position_mode == PositionMode::kRerotate) l.store->renumber_positions();
        sample(l);
      }
      policy->on_step_end(contexts[static_cast<size_t>(i)]);
      l.step_new = 0;
      l.observed = false;
      l.queried = false;
      l.attended = false;
    }
    if (replaying) {
      replaying = false;  // the replay's tokens are dropped: nothing of them was stored
      replay.clear();
    }
  }

  void check_layer(int64_t i) const {
    const auto& l = layers[static_cast<size_t>(i)];
    auto fail = [&](const std::string& what) {
      throw InternalError("CacheManager invariant violated at layer " + std::to_string(i) + ": " + what);
    };
    l.store->check(i);
    for (int64_t h = 0; h < cfg.num_kv_heads; ++h) {
      const auto pos = l.store->k(h).positions();
      const auto t = static_cast<int64_t>(pos.size());
      if (t > l.written) fail("head " + std::to_string(h) + " holds " + std::to_string(t) + " > written " + std::to_string(l.written));
      if (t > 0 && pos.back() > l.last_pos) fail("position beyond the last written one");
      if (cfg.position_mode == PositionMode::kRerotate) {
        // Contiguous, ending just before the layer's next position (the longest head's count).
        const int64_t first = l.store->max_resident() - t;
        for (int64_t j = 0; j < t; ++j) {
          if (pos[static_cast<size_t>(j)] != first + j) {
            fail("rerotate positions of head " + std::to_string(h) + " are not " + std::to_string(first) + " .. " +
                 std::to_string(first + t - 1));
          }
        }
      }
    }
    const CacheStats& s = l.stats;
    if (s.bytes_resident != l.store->bytes_resident() || s.bytes_reserved != l.store->bytes_reserved() ||
        s.tokens_resident != l.store->max_resident()) {
      fail("counters (bytes " + std::to_string(s.bytes_resident) + ", reserved " + std::to_string(s.bytes_reserved) +
           ") != recounts (" + std::to_string(l.store->bytes_resident()) + ", " +
           std::to_string(l.store->bytes_reserved()) + ")");
    }
    if (s.bytes_resident > s.bytes_reserved) fail("bytes resident > bytes reserved");
    if (s.bytes_resident_peak < s.bytes_resident || s.bytes_reserved_peak < s.bytes_reserved ||
        s.tokens_resident_peak < s.tokens_resident) {
      fail("peak below current");
    }
  }

  void check_all() const {
    CacheStats sum;
    for (int64_t i = 0; i < cfg.num_layers; ++i) {
      check_layer(i);
      const auto& s = layers[static_cast<size_t>(i)].stats;
      sum.bytes_resident += s.bytes_resident;
      sum.bytes_reserved += s.bytes_reserved;
      sum.tokens_resident += s.tokens_resident;
      sum.tokens_written += layers[static_cast<size_t>(i)].written;
    }
    KV_CHECK(sum.bytes_resident == total.bytes_resident && sum.bytes_reserved == total.bytes_reserved &&
                 sum.tokens_resident == total.tokens_resident && sum.tokens_written == total.tokens_written &&
                 total.bytes_resident_peak >= total.bytes_resident && total.bytes_reserved_peak >= total.bytes_reserved &&
                 total.tokens_resident_peak >= total.tokens_resident,
             InternalError, "CacheManager invariant violated: totals (bytes ", total.bytes_resident, " vs layers ",
             sum.bytes_resident, ", reserved ", total.bytes_reserved, " vs ", sum.bytes_reserved, ", tokens ",
             total.tokens_resident, " vs ", sum.tokens_resident, ")");
    if (shared_pools) return;  // other holders' blocks are in the pools too (MultiSequenceCache checks)
    const int64_t pool_bytes = pools->bytes_in_use();
    KV_CHECK(pool_bytes == total.bytes_reserved, InternalError, "CacheManager invariant violated: pools hold ",
             pool_bytes, " B of blocks in use but the layers reserve ", total.bytes_reserved, " B");
  }
};

CacheManager::CacheManager(CacheConfig config) : impl_(std::make_unique<Impl>()) {
  config.validate();
  impl_->cfg = std::move(config);
  impl_->build();
}

CacheManager::CacheManager(CacheConfig config, std::shared_ptr<cache::PoolSet> pools, cache::StepHooks* hooks)
    : impl_(std::make_unique<Impl>()) {
  config.validate();
  impl_->cfg = std::move(config);
  impl_->pools = std::move(pools);
  impl_->shared_pools = true;
  impl_->hooks = hooks;
  impl_->build();
}

CacheManager::~CacheManager() = default;
CacheManager::CacheManager(CacheManager&&) noexcept = default;
CacheManager& CacheManager::operator=(CacheManager&&) noexcept = default;

const CacheConfig& CacheManager::config() const { return impl_->cfg; }
const EvictionPolicy& CacheManager::policy() const { return *impl_->policy; }

void CacheManager::reset(int64_t context_length) {
  KV_CHECK_ARG(context_length >= 0, "CacheManager::reset: context_length must be >= 0, got ", context_length);
  auto& im = *impl_;
  const CacheShape shape{im.cfg.num_layers, im.cfg.num_q_heads, im.cfg.num_kv_heads};
  // A budget that does not fit this context throws from the policy's reset, which may have
  // changed the policy by then: try a fresh one first, so that a rejected reset changes nothing.
  make_eviction_policy(im.cfg.policy)->reset(context_length, shape);
  im.policy->reset(context_length, shape);
  im.cfg.context_length = context_length;
  im.replaying = false;
  im.replay.clear();
  for (auto& l : im.layers) {
    l.store->clear();
    l.written = l.step_new = 0;
    l.last_pos = -1;
    l.observed = false;
    l.min_step = 0;
    l.queried = false;
    l.attended = false;
    l.stats = CacheStats{};
  }
  if (!im.shared_pools) im.pools->clear();  // give the memory back
  im.total = CacheStats{};
  warn_if_evicts_nothing(*im.policy, context_length);
}

void CacheManager::append(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions) {
  impl_->append(layer, k, v, positions);
}

at::Tensor CacheManager::attend(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions) {
  return impl_->attend(layer, q, q_positions);
}

void CacheManager::observe_attention(int64_t layer, const at::Tensor& probs) { impl_->observe_attention(layer, probs); }

void CacheManager::observe_queries(int64_t layer, const at::Tensor& q, const at::Tensor& q_positions) {
  impl_->observe_queries(layer, q, q_positions);
}

void CacheManager::end_step(StepKind step) { impl_->end_step(step); }

ReplayNeed CacheManager::replay_need() const { return impl_->policy->replay_need(); }

void CacheManager::begin_replay() { impl_->begin_replay(); }

int64_t CacheManager::next_position(int64_t layer) const {
  return impl_->next_position(impl_->layer_at(layer, "CacheManager::next_position"));
}

LayerTokens CacheManager::tokens(int64_t layer) const {
  const auto& l = impl_->layer_at(layer, "CacheManager::tokens");
  LayerTokens t;
  t.written = l.written;
  t.next_position = impl_->next_position(l);
  for (int64_t h = 0; h < impl_->cfg.num_kv_heads; ++h) t.positions.push_back(l.store->k(h).positions());
  t.stats = l.stats;
  t.stats.tokens_written = l.written;
  return t;
}

CacheStats CacheManager::stats() const { return impl_->total; }

LayerKV CacheManager::get(int64_t layer) const {
  const auto& im = *impl_;
  const auto& l = im.layer_at(layer, "CacheManager::get");
  const int64_t hkv = im.cfg.num_kv_heads, d = im.cfg.head_dim;
  const int64_t t = l.store->max_resident();
  for (int64_t h = 0; h < hkv; ++h) {
    KV_CHECK(l.store->resident(h) == t, UnsupportedError, "CacheManager::get: KV head ", h, " of layer ", layer,
             " holds ", l.store->resident(h), " tokens but another holds ", t,
             "; use tokens() for ragged heads");
  }
  LayerKV out;
  out.k = at::empty({1, hkv, t, d}, at::kFloat);
  out.v = at::empty({1, hkv, t, d}, at::kFloat);
  out.positions = at::empty({hkv, t}, at::kLong);
  for (int64_t h = 0; h < hkv; ++h) {
    std::vector<float> kr, vr;
    const std::vector<int64_t> pos = im.decode_head(l, h, kr, vr);
    std::copy(kr.begin(), kr.end(), out.k.data_ptr<float>() + h * t * d);
    std::copy(vr.begin(), vr.end(), out.v.data_ptr<float>() + h * t * d);
    std::copy(pos.begin(), pos.end(), out.positions.data_ptr<int64_t>() + h * t);
  }
  return out;
}

void CacheManager::check_invariants() const { impl_->check_all(); }

// ---------------------------------------------------------------- introspection
namespace cache {

StreamDebug CacheManagerAccess::stream(const CacheManager& m, int64_t layer, bool key) {
  const auto& im = *m.impl_;
  const auto& l = im.layer_at(layer, "CacheManagerAccess::stream");
  StreamDebug d;
  const StreamSetup& st = key ? l.store->key_setup() : l.store->value_setup();
  for (int64_t h = 0; h < im.cfg.num_kv_heads; ++h) {
    const HeadStream& s = key ? l.store->k(h) : l.store->v(h);
    const float scale = key ? l.store->k_scale() : l.store->v_scale();
    int64_t quantized = 0, groups = 0, dead = 0, converted = 0, blocks = 0;
    for (const BlockList* list : {&s.quant, &s.resid}) {
      for (const auto& b : list->blocks()) {
        ++blocks;
        dead += b.filled - b.live;
        if (b.format == StreamFormats::kMain) {
          quantized += b.live;
          if (!st.formats.f[StreamFormats::kMain].token_readable()) ++groups;
        } else if (b.format == StreamFormats::kConverted) {
          converted += b.live;
        }
      }
    }
    d.quantized_tokens.push_back(quantized);
    d.residual_tokens.push_back(s.resid.live());
    d.converted_tokens.push_back(converted);
    d.quantized_groups.push_back(groups);
    d.dead_slots.push_back(dead);
    d.blocks.push_back(blocks);
    std::vector<float> rows;
    s.resid.live_rows(rows, 1.0f);
    const int64_t r = s.resid.live();
    d.residual.push_back(at::from_blob(rows.data(), {1, 1, r, im.cfg.head_dim}, at::kFloat).clone());
    std::vector<float> all;
    s.quant.live_rows(all, scale);
    s.resid.live_rows(all, 1.0f);
    d.stored.push_back(at::from_blob(all.data(), {1, 1, s.live(), im.cfg.head_dim}, at::kFloat).clone());
  }
  d.token_readable = st.formats.f[StreamFormats::kMain].token_readable();
  d.residual_length = st.spec.residual;
  d.quantizer = st.spec.quantizer->spec();
  d.block_tokens = im.block_tokens;
  return d;
}

std::string CacheManagerAccess::scheme(const CacheManager& m) { return m.impl_->scheme->spec(); }

BlockLayerView CacheManagerAccess::view(const CacheManager& m, int64_t layer) {
  return m.impl_->view_of(m.impl_->layer_at(layer, "CacheManagerAccess::view"));
}

const LayerStore& CacheManagerAccess::layer(const CacheManager& m, int64_t layer) {
  return *m.impl_->layer_at(layer, "CacheManagerAccess::layer").store;
}

at::Tensor CacheManagerAccess::attend(const CacheManager& m, int64_t layer, const at::Tensor& q,
                                      const at::Tensor& q_positions, bool fused) {
  return m.impl_->attend_layer(layer, q, q_positions, AttentionNeed{}, nullptr, fused);
}

// ---------------------------------------------------------------- sequences (sequence_seam.h)
CacheManager SequenceSeam::make(CacheConfig config, std::shared_ptr<PoolSet> pools, StepHooks* hooks) {
  return CacheManager(std::move(config), std::move(pools), hooks);
}

std::string SequenceSeam::replay_blocker(const CacheManager& m, int64_t tokens, bool allow_attention) {
  const auto& im = *m.impl_;
  const EvictionPolicy& policy = *im.policy;
  if (policy.needs_attention() && !allow_attention) {
    return detail::str_cat("policy '", policy.spec(),
                           "' reads the prompt's attention during prefill, which a reused prefix skips");
  }
  for (int64_t i = 0; i < im.cfg.num_layers; ++i) {
    if (policy.needs_attention()) {
      // Its plan needs the skipped attention: test the budget alone.
      const int64_t b = policy.layer_budget(i);
      if (tokens > b) {
        return detail::str_cat("policy '", policy.spec(), "' keeps ", b, " tokens in layer ", i,
                               ", fewer than the prefix of ", tokens);
      }
      continue;
    }
    EvictionContext ctx;
    ctx.layer = i;
    ctx.step = StepKind::kPrefill;
    ctx.new_tokens = tokens;
    ctx.logical_length = tokens;
    ctx.resident.assign(static_cast<size_t>(im.cfg.num_kv_heads), tokens);
    try {
      if (!policy.plan(ctx).empty()) {
        return detail::str_cat("policy '", policy.spec(), "' would evict in layer ", i, " during a prefill of ", tokens,
                               " tokens (budget ", policy.layer_budget(i), ")");
      }
    } catch (const Error& e) {
      return e.what();
    }
  }
  return "";
}

void SequenceSeam::adopt(CacheManager& m, const AdoptedPrefix& prefix) {
  auto& im = *m.impl_;
  const int64_t n = prefix.tokens;
  const auto num_layers = static_cast<size_t>(im.cfg.num_layers);
  KV_INTERNAL_ASSERT(n >= 1 && prefix.k.size() == num_layers && prefix.v.size() == num_layers, "adopt of ", n,
                     " tokens over ", prefix.k.size(), " layers");
  for (const auto& l : im.layers) KV_INTERNAL_ASSERT(l.written == 0 && l.step_new == 0, "adopt into a used manager");
  for (size_t i = 0; i < num_layers; ++i) {
    auto& l = im.layers[i];
    for (int64_t h = 0; h < im.cfg.num_kv_heads; ++h) {
      l.store->adopt(h, prefix.k[i][static_cast<size_t>(h)], prefix.v[i][static_cast<size_t>(h)]);
      KV_INTERNAL_ASSERT(l.store->resident(h) == n, "adopted ", l.store->resident(h), " of ", n, " tokens");
    }
    l.written = n;
    l.last_pos = n - 1;
    l.min_step = prefix.min_next_step;
    im.total.tokens_written += n;
    im.sample(l);
  }
  if (im.pre_rope()) {
    std::vector<int64_t> pos(static_cast<size_t>(n));
    std::iota(pos.begin(), pos.end(), int64_t{0});
    im.rope_table.extend(pos.data(), n);
  }
  // The policy sees the end of the step that would have appended the prefix (it planned nothing).
  for (int64_t i = 0; i < im.cfg.num_layers; ++i) {
    EvictionContext ctx;
    ctx.layer = i;
    ctx.step = StepKind::kPrefill;
    ctx.new_tokens = n;
    ctx.logical_length = n;
    ctx.resident.assign(static_cast<size_t>(im.cfg.num_kv_heads), n);
    im.policy->on_step_end(ctx);
  }
}

const LayerStore& SequenceSeam::layer(const CacheManager& m, int64_t layer) {
  return *m.impl_->layer_at(layer, "SequenceSeam::layer").store;
}

const CacheScheme& SequenceSeam::scheme(const CacheManager& m) { return *m.impl_->scheme; }
const StreamSetup& SequenceSeam::key_setup(const CacheManager& m, int64_t layer) {
  return m.impl_->layer_at(layer, "SequenceSeam::key_setup").store->key_setup();
}
const StreamSetup& SequenceSeam::value_setup(const CacheManager& m, int64_t layer) {
  return m.impl_->layer_at(layer, "SequenceSeam::value_setup").store->value_setup();
}
int64_t SequenceSeam::block_tokens(const CacheManager& m) { return m.impl_->block_tokens; }

int64_t SequenceSeam::cow_copies(const CacheManager& m) {
  int64_t n = 0;
  for (const auto& l : m.impl_->layers) n += l.store->cow_copies();
  return n;
}

}  // namespace cache

}  // namespace kvcache
