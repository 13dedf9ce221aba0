// SPDX-License-Identifier: Apache-2.0
// SequenceStore (sequence_store.h): layer stores, formats, pools, counters, adoption and
// invariant checks of one sequence.
#include "cache/sequence_store.h"

#include <algorithm>
#include <string>
#include <utility>

#include "kvcache/error.h"

namespace kvcache::cache {

std::vector<LayerStreams> resolve_streams(const CacheScheme& scheme, const CacheConfig& cfg) {
  const CacheGeometry g{cfg.num_layers, cfg.num_kv_heads, cfg.head_dim};
  std::vector<LayerStreams> out;
  out.reserve(static_cast<size_t>(cfg.num_layers));
  for (int64_t l = 0; l < cfg.num_layers; ++l) out.push_back(scheme.streams(g, l, cfg.residual_length));
  return out;
}

SequenceStore::SequenceStore(const CacheConfig& cfg, std::shared_ptr<PoolSet> pools, bool shared_pools)
    : scheme_(make_cache_scheme(cfg.scheme)),
      block_tokens_(cfg.resolved_block_tokens()),
      num_kv_heads_(cfg.num_kv_heads),
      head_dim_(cfg.head_dim),
      f16_(make_quantizer("fp16")),
      f32_(make_quantizer("fp32")),
      pools_(std::move(pools)),
      shared_pools_(shared_pools) {
  const auto streams = resolve_streams(*scheme_, cfg);
  ksets_.resize(streams.size());
  vsets_.resize(streams.size());
  for (size_t l = 0; l < streams.size(); ++l) {
    setup_stream(ksets_[l], streams[l].key, cfg.scheme);
    setup_stream(vsets_[l], streams[l].value, cfg.scheme);
  }
  layers_.resize(streams.size());
  for (size_t i = 0; i < layers_.size(); ++i) {
    layers_[i].store = std::make_unique<LayerStore>(&ksets_[i], &vsets_[i], num_kv_heads_, head_dim_);
  }
}

BlockFormat SequenceStore::format(const Quantizer& q, int64_t capacity) {
  return BlockFormat(q, head_dim_, capacity, pools_->get(BlockFormat::bytes_for(q, head_dim_, capacity)));
}

StreamFormats SequenceStore::stream_formats(const Quantizer& main, const StreamSpec& spec) {
  using F = StreamFormats;
  StreamFormats out;
  const Quantizer& residual = spec.residual_dtype == DType::kFloat32 ? *f32_ : *f16_;
  const StoredLayout ml = main.stored_layout(head_dim_);
  out.f[F::kMain] = format(main, ml.token_readable() ? block_tokens_ : ml.group_tokens);
  out.f[F::kResidual] = format(residual, block_tokens_);
  out.f[F::kFallback] = format(*f32_, block_tokens_);
  if (!ml.token_readable()) {
    // Survivors of a per-channel group move to small blocks no larger than the group.
    const int64_t cap = ml.group_bytes() / residual.stored_layout(head_dim_).group_bytes();
    if (cap >= 1) out.f[F::kConverted] = format(residual, cap);
  }
  return out;
}

void SequenceStore::setup_stream(StreamSetup& st, const StreamSpec& spec, const std::string& scheme_spec) {
  st.spec = spec;
  st.formats = stream_formats(*spec.quantizer, spec);
  st.head_formats.clear();
  if (spec.prefill_quantizer) {
    const StoredLayout a = spec.quantizer->stored_layout(head_dim_);
    const StoredLayout b = spec.prefill_quantizer->stored_layout(head_dim_);
    KV_INTERNAL_ASSERT(spec.head_quantizers.empty() && a.group_tokens == b.group_tokens &&
                           a.code_bytes == b.code_bytes && a.meta_count == b.meta_count &&
                           a.has_zeros == b.has_zeros && a.meta_dtype == b.meta_dtype &&
                           a.tensor_scale == b.tensor_scale,
                       "cache scheme '", scheme_spec, "': the prefill encoder '", spec.prefill_quantizer->spec(),
                       "' does not share the stored layout of '", spec.quantizer->spec(), "'");
  }
  if (!spec.head_quantizers.empty()) {
    KV_INTERNAL_ASSERT(static_cast<int64_t>(spec.head_quantizers.size()) == num_kv_heads_, "cache scheme '",
                       scheme_spec, "' gave ", spec.head_quantizers.size(), " head quantizers for ", num_kv_heads_,
                       " KV heads");
    for (const auto& q : spec.head_quantizers) st.head_formats.push_back(stream_formats(*q, spec));
  }
}

void SequenceStore::sample(int64_t li) {
  Layer& l = layer(li);
  CacheStats& s = l.stats;
  const int64_t bytes = l.store->bytes_resident(), reserved = l.store->bytes_reserved();
  const int64_t tokens = l.store->max_resident();
  total_.bytes_resident += bytes - s.bytes_resident;
  total_.bytes_reserved += reserved - s.bytes_reserved;
  total_.tokens_resident += tokens - s.tokens_resident;
  s.bytes_resident = bytes;
  s.bytes_reserved = reserved;
  s.tokens_resident = tokens;
  s.tokens_written = l.written;
  s.bytes_resident_peak = std::max(s.bytes_resident_peak, bytes);
  s.bytes_reserved_peak = std::max(s.bytes_reserved_peak, reserved);
  s.tokens_resident_peak = std::max(s.tokens_resident_peak, tokens);
  total_.bytes_resident_peak = std::max(total_.bytes_resident_peak, total_.bytes_resident);
  total_.bytes_reserved_peak = std::max(total_.bytes_reserved_peak, total_.bytes_reserved);
  total_.tokens_resident_peak = std::max(total_.tokens_resident_peak, total_.tokens_resident);
}

void SequenceStore::write(int64_t li, const float* k, const float* v, const int64_t* pos, int64_t n) {
  Layer& l = layer(li);
  LayerStore& store = *l.store;
  const int64_t d = head_dim_, hkv = num_kv_heads_;
  if (!store.scales_set()) {
    const TensorView kv(k, DType::kFloat32, {hkv, n, d}), vv(v, DType::kFloat32, {hkv, n, d});
    store.set_scales(store.key_setup().spec.quantizer->fit_tensor_scale(kv),
                     store.value_setup().spec.quantizer->fit_tensor_scale(vv));
  }
  for (int64_t h = 0; h < hkv; ++h) store.write(h, k + h * n * d, v + h * n * d, pos, n);
  l.written += n;
  total_.tokens_written += n;
  l.last_pos = pos[n - 1];
  l.min_step = 0;
  sample(li);
}

void SequenceStore::evict(int64_t li, const std::vector<std::vector<int64_t>>& plan, bool renumber) {
  Layer& l = layer(li);
  for (int64_t h = 0; h < num_kv_heads_; ++h) l.store->evict(h, plan[static_cast<size_t>(h)]);
  if (renumber) l.store->renumber_positions();
  sample(li);
}

int64_t SequenceStore::write_bound(int64_t li, int64_t n, bool wide) const {
  const LayerStore& s = store(li);
  int64_t bytes = s.write_bound(n);
  if (wide) {
    // at most two blocks per token and stream: a fallback block and the fresh block after it
    auto fallback = [](const StreamSetup& st) { return st.formats.f[StreamFormats::kFallback].block_bytes; };
    bytes += 2 * num_kv_heads_ * (n + 1) * (fallback(s.key_setup()) + fallback(s.value_setup()));
  }
  return bytes;
}

int64_t SequenceStore::evict_bound(int64_t li, const std::vector<std::vector<int64_t>>& plan) const {
  int64_t bytes = 0;
  for (int64_t h = 0; h < num_kv_heads_; ++h) bytes += store(li).evict_bound(h, plan[static_cast<size_t>(h)]);
  return bytes;
}

void SequenceStore::adopt(const AdoptedPrefix& prefix) {
  const int64_t n = prefix.tokens;
  const auto L = layers_.size();
  KV_INTERNAL_ASSERT(n >= 1 && prefix.k.size() == L && prefix.v.size() == L, "adopt of ", n, " tokens over ",
                     prefix.k.size(), " layers");
  for (const auto& l : layers_) KV_INTERNAL_ASSERT(l.written == 0, "adopt into a used store");
  for (size_t i = 0; i < L; ++i) {
    Layer& l = layers_[i];
    for (int64_t h = 0; h < num_kv_heads_; ++h) {
      l.store->adopt(h, prefix.k[i][static_cast<size_t>(h)], prefix.v[i][static_cast<size_t>(h)]);
      KV_INTERNAL_ASSERT(l.store->resident(h) == n, "adopted ", l.store->resident(h), " of ", n, " tokens");
    }
    l.written = n;
    l.last_pos = n - 1;
    l.min_step = prefix.min_next_step;
    total_.tokens_written += n;
    sample(static_cast<int64_t>(i));
  }
}

void SequenceStore::clear() {
  for (auto& l : layers_) {
    l.store->clear();
    l.written = 0;
    l.last_pos = -1;
    l.min_step = 0;
    l.stats = CacheStats{};
  }
  if (!shared_pools_) pools_->clear();  // give the memory back
  total_ = CacheStats{};
}

std::vector<int64_t> SequenceStore::decode_head(int64_t li, int64_t h, std::vector<float>& kr,
                                                std::vector<float>& vr) const {
  const LayerStore& s = store(li);
  const auto& ks = s.k(h);
  const auto& vs = s.v(h);
  ks.quant.live_rows(kr, s.k_scale());
  ks.resid.live_rows(kr, 1.0f);
  vs.quant.live_rows(vr, s.v_scale());
  vs.resid.live_rows(vr, 1.0f);
  return ks.positions();
}

int64_t SequenceStore::cow_copies() const {
  int64_t n = 0;
  for (const auto& l : layers_) n += l.store->cow_copies();
  return n;
}

void SequenceStore::check(bool rerotate) const {
  CacheStats sum;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    auto fail = [&](const std::string& what) {
      throw InternalError("CacheManager invariant violated at layer " + std::to_string(i) + ": " + what);
    };
    l.store->check(static_cast<int64_t>(i));
    for (int64_t h = 0; h < num_kv_heads_; ++h) {
      const auto pos = l.store->k(h).positions();
      const auto t = static_cast<int64_t>(pos.size());
      if (t > l.written) {
        fail("head " + std::to_string(h) + " holds " + std::to_string(t) + " > written " + std::to_string(l.written));
      }
      // Each stream counts the tokens written to it (or adopted: then the layer counts the
      // whole prefix, the stream its live tokens): between what it holds and the layer's count.
      const int64_t sw = l.store->k(h).written;
      if (sw < t || sw > l.written || l.store->v(h).written != sw) {
        fail("head " + std::to_string(h) + " streams count " + std::to_string(sw) + " (K) and " +
             std::to_string(l.store->v(h).written) + " (V) tokens written, expected equal and in [" +
             std::to_string(t) + ", " + std::to_string(l.written) + "]");
      }
      if (t > 0 && pos.back() > l.last_pos) fail("position beyond the last written one");
      if (rerotate) {
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
    sum.bytes_resident += s.bytes_resident;
    sum.bytes_reserved += s.bytes_reserved;
    sum.tokens_resident += s.tokens_resident;
    sum.tokens_written += l.written;
  }
  const CacheStats& t = total_;
  KV_CHECK(sum.bytes_resident == t.bytes_resident && sum.bytes_reserved == t.bytes_reserved &&
               sum.tokens_resident == t.tokens_resident && sum.tokens_written == t.tokens_written &&
               t.bytes_resident_peak >= t.bytes_resident && t.bytes_reserved_peak >= t.bytes_reserved &&
               t.tokens_resident_peak >= t.tokens_resident,
           InternalError, "CacheManager invariant violated: totals (bytes ", t.bytes_resident, " vs layers ",
           sum.bytes_resident, ", reserved ", t.bytes_reserved, " vs ", sum.bytes_reserved, ", tokens ",
           t.tokens_resident, " vs ", sum.tokens_resident, ")");
  if (shared_pools_) return;  // other holders' blocks are in the pools too (MultiSequenceCache checks)
  const int64_t pool_bytes = pools_->bytes_in_use();
  KV_CHECK(pool_bytes == t.bytes_reserved, InternalError, "CacheManager invariant violated: pools hold ", pool_bytes,
           " B of blocks in use but the layers reserve ", t.bytes_reserved, " B");
}

}  // namespace kvcache::cache
