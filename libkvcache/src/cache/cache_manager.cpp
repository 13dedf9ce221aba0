// SPDX-License-Identifier: Apache-2.0
// CacheManager: stored form per layer (KVStream for K and V) + float32 compute views.
#include "kvcache/cache_manager.h"

#include <algorithm>
#include <limits>
#include <sstream>

#include "cache/cache_manager_access.h"
#include "cache/cache_scheme.h"
#include "cache/kv_stream.h"
#include "cache/token_buffer.h"
#include "kvcache/error.h"
#include "kvcache/quantizer.h"

namespace kvcache {

void CacheConfig::validate() const {
  KV_CHECK_ARG(num_layers >= 1, "CacheConfig.num_layers must be >= 1, got ", num_layers);
  KV_CHECK_ARG(num_kv_heads >= 1, "CacheConfig.num_kv_heads must be >= 1, got ", num_kv_heads);
  KV_CHECK_ARG(num_q_heads >= 1 && num_q_heads % num_kv_heads == 0,
               "CacheConfig.num_q_heads must be a positive multiple of num_kv_heads=", num_kv_heads,
               ", got ", num_q_heads);
  KV_CHECK_ARG(head_dim >= 1, "CacheConfig.head_dim must be >= 1, got ", head_dim);
  KV_CHECK_ARG(residual_length >= 0, "CacheConfig.residual_length must be >= 0, got ",
               residual_length);
  KV_CHECK_ARG(context_length >= 0, "CacheConfig.context_length must be >= 0, got ",
               context_length);
  KV_CHECK_ARG(static_cast<bool>(rope),
               "CacheConfig.rope is required (the model's rotary embedding: x [B, H, T, D], "
               "positions int64 [T] -> rotated x)");
  KV_CHECK_ARG(!(position_mode == PositionMode::kRerotate && key_storage == KeyStorage::kPostRoPE),
               "CacheConfig: position_mode=kRerotate re-rotates kept keys to contiguous positions "
               "and needs key_storage=kPreRoPE (got kPostRoPE)");
  auto scheme = cache::parse_cache_scheme(quant, residual_length, head_dim);
  KV_CHECK_ARG(!scheme.required_key_storage || *scheme.required_key_storage == key_storage,
               "CacheConfig: cache scheme '", quant, "' requires key_storage=",
               *scheme.required_key_storage == KeyStorage::kPreRoPE ? "kPreRoPE" : "kPostRoPE");
  (void)make_eviction_policy(policy);
}

namespace {

struct LayerState {
  std::unique_ptr<cache::KVStream> k, v;
  cache::TokenBuffer k_view, v_view, k_pre_view, pos;
  int64_t written = 0;
  int64_t step_new = 0;
  int64_t last_pos = -1;
  int64_t bytes = 0, bytes_peak = 0;
  int64_t tokens = 0, tokens_peak = 0;
  int64_t batch = -1;
};

std::string shape_str(const at::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream os;
  os << t.sizes() << " " << at::toString(t.scalar_type());
  return os.str();
}

at::Tensor positions_of(const cache::TokenBuffer& pos, int64_t h, int64_t start, int64_t n) {
  return pos.rows(h, start, n).reshape({n}).contiguous();
}

}  // namespace

struct CacheManager::Impl {
  CacheConfig cfg;
  cache::CacheScheme scheme;
  std::unique_ptr<Quantizer> kq, vq;
  cache::StoreLayout klayout, vlayout;
  std::unique_ptr<EvictionPolicy> policy;
  std::vector<LayerState> layers;
  int64_t total_bytes = 0, total_bytes_peak = 0;
  int64_t total_tokens = 0, total_tokens_peak = 0;
  int64_t total_written = 0;

  bool pre_rope() const { return cfg.key_storage == KeyStorage::kPreRoPE; }

  void init_layers() {
    layers.clear();
    layers.resize(static_cast<size_t>(cfg.num_layers));
    for (auto& l : layers) {
      l.k = std::make_unique<cache::KVStream>(scheme.key, *kq, klayout, cfg.num_kv_heads, cfg.head_dim);
      l.v = std::make_unique<cache::KVStream>(scheme.value, *vq, vlayout, cfg.num_kv_heads,
                                              cfg.head_dim);
    }
    total_bytes = total_bytes_peak = total_tokens = total_tokens_peak = total_written = 0;
  }

  LayerState& layer_at(int64_t layer, const char* fn) {
    KV_CHECK_ARG(layer >= 0 && layer < cfg.num_layers, fn, ": layer ", layer, " out of range [0, ",
                 cfg.num_layers, ")");
    return layers[static_cast<size_t>(layer)];
  }
  const LayerState& layer_at(int64_t layer, const char* fn) const {
    return const_cast<Impl*>(this)->layer_at(layer, fn);
  }

  /// Samples bytes/tokens after a mutation of `l`.
  void sample(LayerState& l) {
    const int64_t bytes = l.k->nbytes() + l.v->nbytes();
    const int64_t tokens = l.v_view.size();
    total_bytes += bytes - l.bytes;
    total_tokens += tokens - l.tokens;
    l.bytes = bytes;
    l.tokens = tokens;
    l.bytes_peak = std::max(l.bytes_peak, bytes);
    l.tokens_peak = std::max(l.tokens_peak, tokens);
    total_bytes_peak = std::max(total_bytes_peak, total_bytes);
    total_tokens_peak = std::max(total_tokens_peak, total_tokens);
  }

  at::Tensor rope(const at::Tensor& x, const at::Tensor& positions) const {
    auto y = cfg.rope(x, positions);
    KV_CHECK_ARG(y.defined() && y.sizes() == x.sizes(), "CacheConfig.rope returned ", shape_str(y),
                 " for input ", shape_str(x), " (expected the same shape)");
    return y.to(at::kFloat);
  }

  /// Applies stored-value changes of one stream to its compute view (and the rotated key
  /// view when keys are stored pre-RoPE).
  void apply_updates(LayerState& l, bool is_key, const std::vector<std::vector<cache::ViewUpdate>>& ups) {
    for (int64_t h = 0; h < cfg.num_kv_heads; ++h) {
      for (const auto& u : ups[static_cast<size_t>(h)]) {
        const int64_t n = u.values.size(2);
        if (n == 0) continue;
        if (!is_key) {
          l.v_view.write(h, u.start, u.values);
        } else if (!pre_rope()) {
          l.k_view.write(h, u.start, u.values);
        } else {
          l.k_pre_view.write(h, u.start, u.values);
          l.k_view.write(h, u.start, rope(u.values, positions_of(l.pos, h, u.start, n)));
        }
      }
    }
  }

  void append(int64_t layer, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& positions) {
    auto& l = layer_at(layer, "CacheManager::append");
    const int64_t hkv = cfg.num_kv_heads, d = cfg.head_dim;
    auto check_kv = [&](const at::Tensor& t, const char* name) {
      KV_CHECK_ARG(t.defined() && t.dim() == 4 && t.size(1) == hkv && t.size(3) == d &&
                       at::isFloatingType(t.scalar_type()) && t.device().is_cpu(),
                   "CacheManager::append: ", name, " must be a CPU floating tensor [B, H_kv=", hkv,
                   ", T_new, D=", d, "], got ", shape_str(t));
    };
    check_kv(k_in, "k");
    check_kv(v_in, "v");
    KV_CHECK_ARG(k_in.sizes() == v_in.sizes(), "CacheManager::append: k ", k_in.sizes(), " and v ",
                 v_in.sizes(), " differ");
    const int64_t b = k_in.size(0), n = k_in.size(2);
    KV_CHECK_ARG(l.batch < 0 || l.batch == b, "CacheManager::append: batch ", b,
                 " differs from the layer's batch ", l.batch, " (reset() between requests)");
    KV_CHECK_ARG(positions.defined() && positions.dim() == 1 && positions.size(0) == n &&
                     positions.scalar_type() == at::kLong,
                 "CacheManager::append: positions must be int64 [T_new=", n, "], got ",
                 shape_str(positions));
    auto pos = positions.contiguous();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const int64_t first_expected =
        cfg.position_mode == PositionMode::kRerotate ? l.v_view.size() : l.last_pos + 1;
    for (int64_t i = 0; i < n; ++i) {
      if (cfg.position_mode == PositionMode::kRerotate) {
        KV_CHECK_ARG(pp[i] == first_expected + i, "CacheManager::append (rerotate mode): positions "
                     "must continue the cache contiguously from next_position(", layer, ") = ",
                     first_expected, "; got ", pp[i], " at index ", i);
      } else {
        KV_CHECK_ARG(pp[i] >= (i == 0 ? first_expected : pp[i - 1] + 1),
                     "CacheManager::append: positions must increase and follow the layer's last "
                     "position ", l.last_pos, "; got ", pp[i], " at index ", i);
      }
    }
    if (n == 0) return;
    l.batch = b;
    auto k = k_in.to(at::kFloat);
    auto v = v_in.to(at::kFloat);
    at::Tensor k_post;
    if (!pre_rope()) k_post = rope(k, pos);

    auto vres = l.v->push(v);
    l.v_view.append(vres.new_values);
    auto kres = l.k->push(pre_rope() ? k : k_post);
    if (!l.pos.initialized()) {
      l.pos = cache::TokenBuffer(at::kLong, {1, cfg.num_kv_heads, 0, 1});
      l.pos.append(at::empty({1, cfg.num_kv_heads, 0, 1}, at::kLong));
    }
    l.pos.append_to_all_heads(pos.view({1, 1, n, 1}));
    if (pre_rope()) {
      l.k_pre_view.append(kres.new_values);
      l.k_view.append(rope(kres.new_values, pos));
    } else {
      l.k_view.append(kres.new_values);
    }
    apply_updates(l, false, vres.updates);
    apply_updates(l, true, kres.updates);
    l.written += n;
    total_written += n;
    l.step_new += n;
    l.last_pos = pp[n - 1];
    sample(l);
  }

  /// Validates a plan and turns it into the dropped indices of every head (one pass).
  std::vector<std::vector<int64_t>> plan_to_drops(int64_t layer, const at::Tensor& keep, int64_t t) const {
    KV_INTERNAL_ASSERT(keep.defined() && keep.dim() == 2 && keep.size(0) == cfg.num_kv_heads &&
                           keep.scalar_type() == at::kLong && keep.size(1) >= 1 && keep.size(1) <= t,
                       "policy '", policy->spec(), "' returned a plan ", shape_str(keep),
                       " for layer ", layer, " with ", t, " resident tokens");
    const int64_t m = keep.size(1);
    const int64_t* p = keep.data_ptr<int64_t>();
    std::vector<std::vector<int64_t>> drops(static_cast<size_t>(cfg.num_kv_heads));
    for (int64_t h = 0; h < cfg.num_kv_heads; ++h) {
      const int64_t* r = p + h * m;
      KV_INTERNAL_ASSERT(r[m - 1] == t - 1, "policy '", policy->spec(), "' evicts the newest token",
                         " of layer ", layer, " head ", h);
      auto& d = drops[static_cast<size_t>(h)];
      d.reserve(static_cast<size_t>(t - m));
      int64_t next = 0;  // first index not yet accounted for
      for (int64_t j = 0; j < m; ++j) {
        KV_INTERNAL_ASSERT(r[j] >= next && r[j] < t, "policy '", policy->spec(), "' plan for layer ",
                           layer, " head ", h, " is not strictly increasing in [0, ", t, ") at ", j);
        for (int64_t i = next; i < r[j]; ++i) d.push_back(i);
        next = r[j] + 1;
      }
    }
    return drops;
  }

  void evict_layer(int64_t layer, bool is_prefill_end) {
    auto& l = layers[static_cast<size_t>(layer)];
    const int64_t t = l.v_view.size();
    EvictionContext ctx;
    ctx.layer = layer;
    ctx.resident = t;
    ctx.new_tokens = l.step_new;
    ctx.logical_length = l.written;
    ctx.is_prefill_end = is_prefill_end;
    if (t > 0) ctx.positions = l.pos.view().select(0, 0).select(-1, 0);
    KeepPlan plan = policy->plan_keep(ctx);
    if (plan.keeps_all()) return;
    auto keep = plan.keep.contiguous();
    const auto drops = plan_to_drops(layer, keep, t);
    const int64_t m = keep.size(1);
    if (m == t) return;
    auto vups = l.v->drop(drops);
    auto kups = l.k->drop(drops);
    l.v_view.drop(drops);
    l.k_view.drop(drops);
    if (pre_rope()) l.k_pre_view.drop(drops);
    l.pos.drop(drops);
    apply_updates(l, false, vups);
    apply_updates(l, true, kups);
    if (cfg.position_mode == PositionMode::kRerotate) {
      // Positions shift from the first dropped index on: re-rotate from there (StreamingLLM).
      int64_t i0 = m;
      for (const auto& d : drops) i0 = std::min(i0, d.front());
      if (i0 < m) {
        auto new_pos = at::arange(i0, m, at::kLong);
        l.pos.write_all(i0, new_pos.view({1, 1, m - i0, 1}).expand({1, cfg.num_kv_heads, m - i0, 1}));
        l.k_view.write_all(i0, rope(l.k_pre_view.view().narrow(2, i0, m - i0), new_pos));
      }
    }
    policy->on_compacted(layer, keep);
    sample(l);
  }

  void end_step(bool is_prefill_end) {
    const int64_t n0 = layers[0].step_new;
    for (int64_t i = 1; i < cfg.num_layers; ++i) {
      KV_CHECK_ARG(layers[static_cast<size_t>(i)].step_new == n0, "CacheManager::end_step: layer ",
                   i, " appended ", layers[static_cast<size_t>(i)].step_new,
                   " tokens this step but layer 0 appended ", n0,
                   " (every layer must append the step's tokens)");
    }
    for (int64_t i = 0; i < cfg.num_layers; ++i) evict_layer(i, is_prefill_end);
    for (auto& l : layers) l.step_new = 0;
  }

  void check_layer(int64_t i) const {
    const auto& l = layers[static_cast<size_t>(i)];
    const int64_t t = l.v_view.size();
    auto fail = [&](const std::string& what) {
      throw InternalError("CacheManager invariant violated at layer " + std::to_string(i) + ": " + what);
    };
    if (l.k_view.size() != t || l.pos.size() != t || (pre_rope() && l.k_pre_view.size() != t)) {
      fail("view lengths differ: k " + std::to_string(l.k_view.size()) + ", v " + std::to_string(t) +
           ", positions " + std::to_string(l.pos.size()));
    }
    if (l.k->size() != t || l.v->size() != t) {
      fail("stored lengths k " + std::to_string(l.k->size()) + ", v " + std::to_string(l.v->size()) +
           " != resident " + std::to_string(t));
    }
    for (int64_t h = 0; h < cfg.num_kv_heads; ++h) {
      if (l.k->quantized_tokens(h) + l.k->residual_tokens(h) != t ||
          l.v->quantized_tokens(h) + l.v->residual_tokens(h) != t) {
        fail("head " + std::to_string(h) + ": quantized + residual != resident");
      }
    }
    l.k->check_residual_rule();
    l.v->check_residual_rule();
    if (t > l.written) fail("resident " + std::to_string(t) + " > written " + std::to_string(l.written));
    if (t == 0) {
      if (l.bytes != 0) fail("bytes of an empty layer");
      return;
    }
    auto pos = l.pos.view().select(0, 0).select(-1, 0).contiguous();  // [H, T]
    for (int64_t h = 0; h < cfg.num_kv_heads; ++h) {
      const int64_t* p = pos[h].data_ptr<int64_t>();
      for (int64_t j = 0; j < t; ++j) {
        if (j > 0 && p[j] <= p[j - 1]) fail("positions not increasing at head " + std::to_string(h));
        if (cfg.position_mode == PositionMode::kRerotate && p[j] != j) {
          fail("rerotate positions not contiguous at head " + std::to_string(h));
        }
      }
      if (p[t - 1] > l.last_pos) fail("position beyond the last written one");
    }
    const int64_t measured = l.k->measure_nbytes() + l.v->measure_nbytes();
    if (measured != l.bytes) {
      fail("bytes counter " + std::to_string(l.bytes) + " != measured " + std::to_string(measured));
    }
    if (l.bytes_peak < l.bytes || l.tokens_peak < t) fail("peak below current");
    // Compute views == dequantized stored form.
    for (int64_t h = 0; h < cfg.num_kv_heads; ++h) {
      auto vs = l.v->dequantize_head(h);
      if (!at::equal(vs, l.v_view.view().narrow(1, h, 1))) fail("value view != stored values, head " + std::to_string(h));
      auto ks = l.k->dequantize_head(h);
      if (!pre_rope()) {
        if (!at::equal(ks, l.k_view.view().narrow(1, h, 1))) fail("key view != stored keys, head " + std::to_string(h));
      } else {
        if (!at::equal(ks, l.k_pre_view.view().narrow(1, h, 1))) fail("pre-RoPE key view != stored keys");
        auto rot = rope(ks, pos[h]);
        if (!at::allclose(rot, l.k_view.view().narrow(1, h, 1), 1e-5, 1e-5)) {
          fail("rotated key view != rope(stored keys, positions), head " + std::to_string(h));
        }
      }
    }
  }
};

CacheManager::CacheManager(CacheConfig config) : impl_(std::make_unique<Impl>()) {
  config.validate();
  auto& im = *impl_;
  im.cfg = std::move(config);
  im.scheme = cache::parse_cache_scheme(im.cfg.quant, im.cfg.residual_length, im.cfg.head_dim);
  im.kq = make_quantizer(im.scheme.key.quantizer);
  im.vq = make_quantizer(im.scheme.value.quantizer);
  auto tg = [](const std::string& spec) {
    return cache::spec_is_per_channel(spec) ? cache::spec_group_size(spec) : 1;
  };
  im.klayout = cache::probe_layout(*im.kq, im.cfg.head_dim, tg(im.scheme.key.quantizer));
  im.vlayout = cache::probe_layout(*im.vq, im.cfg.head_dim, tg(im.scheme.value.quantizer));
  im.policy = make_eviction_policy(im.cfg.policy);
  im.policy->reset(im.cfg.context_length,
                   CacheShape{im.cfg.num_layers, im.cfg.num_q_heads, im.cfg.num_kv_heads});
  im.init_layers();
}

CacheManager::~CacheManager() = default;
CacheManager::CacheManager(CacheManager&&) noexcept = default;
CacheManager& CacheManager::operator=(CacheManager&&) noexcept = default;

const CacheConfig& CacheManager::config() const { return impl_->cfg; }
const EvictionPolicy& CacheManager::policy() const { return *impl_->policy; }

void CacheManager::reset(int64_t context_length) {
  KV_CHECK_ARG(context_length >= 0, "CacheManager::reset: context_length must be >= 0, got ",
               context_length);
  auto& im = *impl_;
  im.policy->reset(context_length,
                   CacheShape{im.cfg.num_layers, im.cfg.num_q_heads, im.cfg.num_kv_heads});
  im.cfg.context_length = context_length;
  im.init_layers();
}

void CacheManager::append(int64_t layer, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& positions) {
  impl_->append(layer, k, v, positions);
}

LayerKV CacheManager::get(int64_t layer) const {
  const auto& l = impl_->layer_at(layer, "CacheManager::get");
  LayerKV out;
  if (!l.v_view.initialized()) {
    const auto& c = impl_->cfg;
    out.k = at::empty({1, c.num_kv_heads, 0, c.head_dim}, at::kFloat);
    out.v = at::empty({1, c.num_kv_heads, 0, c.head_dim}, at::kFloat);
    out.positions = at::empty({c.num_kv_heads, 0}, at::kLong);
    return out;
  }
  out.k = l.k_view.view();
  out.v = l.v_view.view();
  out.positions = l.pos.view().select(0, 0).select(-1, 0);
  return out;
}

bool CacheManager::needs_attention() const { return impl_->policy->needs_attention(); }

void CacheManager::observe_attention(int64_t layer, const at::Tensor& probs) {
  const auto& l = impl_->layer_at(layer, "CacheManager::observe_attention");
  const auto& c = impl_->cfg;
  KV_CHECK_ARG(probs.defined() && probs.dim() == 4 && probs.scalar_type() == at::kFloat &&
                   probs.size(1) == c.num_q_heads && probs.size(3) == l.v_view.size() &&
                   (l.batch < 0 || probs.size(0) == l.batch),
               "CacheManager::observe_attention: probs must be float32 [B, H_q=", c.num_q_heads,
               ", T_q, T_res=", l.v_view.size(), "] for layer ", layer, ", got ", shape_str(probs));
  impl_->policy->observe(layer, probs);
}

void CacheManager::end_step(bool is_prefill_end) { impl_->end_step(is_prefill_end); }

int64_t CacheManager::logical_length(int64_t layer) const {
  return impl_->layer_at(layer, "CacheManager::logical_length").written;
}

int64_t CacheManager::physical_length(int64_t layer) const {
  return impl_->layer_at(layer, "CacheManager::physical_length").v_view.size();
}

int64_t CacheManager::next_position() const { return next_position(0); }

int64_t CacheManager::next_position(int64_t layer) const {
  const auto& l = impl_->layer_at(layer, "CacheManager::next_position");
  return impl_->cfg.position_mode == PositionMode::kRerotate ? l.v_view.size() : l.last_pos + 1;
}

CacheStats CacheManager::stats() const {
  const auto& im = *impl_;
  CacheStats s;
  s.tokens_written = im.total_written;
  s.tokens_resident = im.total_tokens;
  s.tokens_resident_peak = im.total_tokens_peak;
  s.bytes_resident = im.total_bytes;
  s.bytes_resident_peak = im.total_bytes_peak;
  return s;
}

CacheStats CacheManager::layer_stats(int64_t layer) const {
  const auto& l = impl_->layer_at(layer, "CacheManager::layer_stats");
  CacheStats s;
  s.tokens_written = l.written;
  s.tokens_resident = l.v_view.size();
  s.tokens_resident_peak = l.tokens_peak;
  s.bytes_resident = l.bytes;
  s.bytes_resident_peak = l.bytes_peak;
  return s;
}

void CacheManager::check_invariants() const {
  const auto& im = *impl_;
  int64_t bytes = 0, tokens = 0, written = 0;
  for (int64_t i = 0; i < im.cfg.num_layers; ++i) {
    im.check_layer(i);
    const auto& l = im.layers[static_cast<size_t>(i)];
    bytes += l.bytes;
    tokens += l.v_view.size();
    written += l.written;
  }
  KV_CHECK(bytes == im.total_bytes && tokens == im.total_tokens && written == im.total_written &&
               im.total_bytes_peak >= im.total_bytes && im.total_tokens_peak >= im.total_tokens,
           InternalError, "CacheManager invariant violated: totals (bytes ", im.total_bytes,
           " vs layers ", bytes, ", tokens ", im.total_tokens, " vs ", tokens, ", written ",
           im.total_written, " vs ", written, ")");
}

// ---------------------------------------------------------------- introspection
namespace cache {

StreamDebug CacheManagerAccess::stream(const CacheManager& m, int64_t layer, bool key) {
  const auto& l = m.impl_->layer_at(layer, "CacheManagerAccess::stream");
  const KVStream& s = key ? *l.k : *l.v;
  StreamDebug d;
  for (int64_t h = 0; h < m.impl_->cfg.num_kv_heads; ++h) {
    d.quantized_tokens.push_back(s.quantized_tokens(h));
    d.residual_tokens.push_back(s.residual_tokens(h));
    d.quantized_blocks.push_back(s.store(h).num_blocks());
    d.dead_slots.push_back(s.store(h).dead_slots());
    d.residual.push_back(s.residual_tokens(h) > 0 ? s.residual(h) : at::Tensor());
    d.stored.push_back(s.dequantize_head(h));
  }
  d.gatherable = s.layout().gatherable;
  d.residual_length = s.spec().residual;
  d.quantizer = s.spec().quantizer;
  return d;
}

std::string CacheManagerAccess::scheme(const CacheManager& m) { return m.impl_->scheme.canonical; }

}  // namespace cache

}  // namespace kvcache
