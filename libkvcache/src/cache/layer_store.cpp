// SPDX-License-Identifier: Apache-2.0
#include "cache/layer_store.h"

#include <algorithm>

#include "kvcache/error.h"

namespace kvcache::cache {

int64_t StreamSetup::flush_count(int64_t r) const {
  const int64_t big_r = spec.residual;
  if (spec.flush == ResidualFlush::kSliding) return std::max<int64_t>(0, r - big_r);
  if (big_r <= 0) return r;
  return r / big_r * big_r;
}

std::vector<int64_t> HeadStream::positions() const {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(live()));
  quant.live_positions(out);
  resid.live_positions(out);
  return out;
}

LayerStore::LayerStore(const StreamSetup* key, const StreamSetup* value, int64_t num_heads, int64_t head_dim)
    : ks_(key), vs_(value), head_dim_(head_dim) {
  for (int64_t h = 0; h < num_heads; ++h) {
    k_.push_back(HeadStream{BlockList(ks_->formats_for(h)), BlockList(ks_->formats_for(h))});
    v_.push_back(HeadStream{BlockList(vs_->formats_for(h)), BlockList(vs_->formats_for(h))});
  }
}

void LayerStore::set_scales(float k, float v) {
  k_scale_ = k;
  v_scale_ = v;
  scales_set_ = true;
}

void LayerStore::write_stream(HeadStream& s, const StreamSetup& st, float scale, const float* x, const int64_t* pos,
                              int64_t n) {
  // Attention sinks: the stream's first sink_tokens tokens go to the quantized list in the
  // residual dtype and stay there (older than every other token, so the order holds).
  const int64_t ns = std::min<int64_t>(n, std::max<int64_t>(0, st.spec.sink_tokens - s.written));
  s.written += n;
  // A multi-token append (a prompt or prefill chunk) encodes with the prefill encoder; a
  // one-token append (a decode step) that flushes re-compresses the older blocks first.
  const Quantizer* enc = n > 1 ? st.spec.prefill_quantizer.get() : nullptr;
  const bool recompress = n == 1 && st.spec.recompress;
  if (ns > 0) {
    s.quant.append(StreamFormats::kResidual, x, pos, ns, 1.0f);
    x += ns * head_dim_;
    pos += ns;
    n -= ns;
    if (n == 0) return;
  }
  if (st.direct()) {
    if (recompress) s.quant.reencode(StreamFormats::kMain, scale);
    s.quant.append(StreamFormats::kMain, x, pos, n, scale, enc);
    return;
  }
  // Through the residual: new tokens are stored in the residual dtype first; the flush rule
  // quantizes the oldest ones from that stored form (KIVI: keys in blocks of R, values one
  // by one as they leave the window).
  s.resid.append(StreamFormats::kResidual, x, pos, n, 1.0f);
  const int64_t m = st.flush_count(s.resid.live());
  if (m == 0) return;
  std::vector<float> rows(static_cast<size_t>(m * head_dim_));
  std::vector<int64_t> p(static_cast<size_t>(m));
  s.resid.pop_front(m, rows.data(), p.data(), 1.0f);
  if (recompress) s.quant.reencode(StreamFormats::kMain, scale);
  s.quant.append(StreamFormats::kMain, rows.data(), p.data(), m, scale, enc);
}

void LayerStore::write(int64_t h, const float* k, const float* v, const int64_t* pos, int64_t n) {
  write_stream(k_[static_cast<size_t>(h)], *ks_, k_scale_, k, pos, n);
  write_stream(v_[static_cast<size_t>(h)], *vs_, v_scale_, v, pos, n);
}

void LayerStore::evict(int64_t h, const std::vector<int64_t>& idx) {
  if (idx.empty()) return;
  auto split = [&](HeadStream& s, float scale) {
    const int64_t q = s.quant.live();
    const auto mid = std::lower_bound(idx.begin(), idx.end(), q);
    const int64_t nq = mid - idx.begin();
    s.quant.evict(idx.data(), nq, scale);
    std::vector<int64_t> r(mid, idx.end());
    for (auto& i : r) i -= q;
    s.resid.evict(r.data(), static_cast<int64_t>(r.size()), 1.0f);
  };
  split(k_[static_cast<size_t>(h)], k_scale_);
  split(v_[static_cast<size_t>(h)], v_scale_);
}

void LayerStore::adopt(int64_t h, const std::vector<Block>& k, const std::vector<Block>& v) {
  HeadStream& ks = k_[static_cast<size_t>(h)];
  HeadStream& vs = v_[static_cast<size_t>(h)];
  KV_INTERNAL_ASSERT(ks.live() == 0 && vs.live() == 0, "adopt into a non-empty head ", h);
  for (const Block& b : k) ks.quant.adopt(b);
  for (const Block& b : v) vs.quant.adopt(b);
  ks.written = ks.live();
  vs.written = vs.live();
}

int64_t LayerStore::write_bound(int64_t n) const {
  if (n <= 0) return 0;
  auto stream = [&](const HeadStream& s, const StreamSetup& st) {
    const int64_t ns = std::min<int64_t>(n, std::max<int64_t>(0, st.spec.sink_tokens - s.written));
    const int64_t sinks = s.quant.append_bound(StreamFormats::kResidual, ns);
    const int64_t m = n - ns;
    // Re-compression copies the shared blocks it re-encodes.
    const bool recompress = n == 1 && st.spec.recompress;
    if (st.direct()) {
      return sinks + s.quant.append_bound(StreamFormats::kMain, m) +
             (recompress && m > 0 ? s.quant.reencode_bound(StreamFormats::kMain) : 0);
    }
    const int64_t r = s.resid.live() + m;
    const int64_t flushed = st.flush_count(r);
    return sinks + s.resid.append_bound(StreamFormats::kResidual, m) +
           s.quant.append_bound(StreamFormats::kMain, flushed) +
           (recompress && flushed > 0 ? s.quant.reencode_bound(StreamFormats::kMain) : 0);
  };
  int64_t bytes = 0;
  for (size_t h = 0; h < k_.size(); ++h) bytes += stream(k_[h], *ks_) + stream(v_[h], *vs_);
  return bytes;
}

int64_t LayerStore::evict_bound(int64_t h, const std::vector<int64_t>& idx) const {
  if (idx.empty()) return 0;
  auto split = [&](const HeadStream& s) {
    const int64_t q = s.quant.live();
    const auto mid = std::lower_bound(idx.begin(), idx.end(), q);
    std::vector<int64_t> r(mid, idx.end());
    for (auto& i : r) i -= q;
    return s.quant.evict_bound(idx.data(), mid - idx.begin()) +
           s.resid.evict_bound(r.data(), static_cast<int64_t>(r.size()));
  };
  return split(k_[static_cast<size_t>(h)]) + split(v_[static_cast<size_t>(h)]);
}

int64_t LayerStore::cow_copies() const {
  int64_t n = 0;
  for (size_t h = 0; h < k_.size(); ++h) {
    n += k_[h].quant.cow_copies() + k_[h].resid.cow_copies() + v_[h].quant.cow_copies() + v_[h].resid.cow_copies();
  }
  return n;
}

void LayerStore::renumber_positions() {
  // Each head's survivors end just before the layer's next position (its longest head's
  // count): a head of n_h tokens takes n − n_h .. n − 1, so the query at n sees its keys at the
  // distances 1 .. n_h that numbering the head alone gives (heads of equal length: 0 .. n − 1).
  const int64_t n = max_resident();
  for (size_t h = 0; h < k_.size(); ++h) {
    for (HeadStream* s : {&k_[h], &v_[h]}) {
      int64_t next = n - s->live();
      s->quant.renumber_positions(next);
      s->resid.renumber_positions(next);
    }
  }
}

int64_t LayerStore::max_resident() const {
  int64_t m = 0;
  for (const auto& s : k_) m = std::max(m, s.live());
  return m;
}

int64_t LayerStore::bytes_resident() const {
  int64_t n = 0;
  for (size_t h = 0; h < k_.size(); ++h) n += k_[h].bytes_resident() + v_[h].bytes_resident();
  return n;
}

int64_t LayerStore::bytes_reserved() const {
  int64_t n = 0;
  for (size_t h = 0; h < k_.size(); ++h) n += k_[h].bytes_reserved() + v_[h].bytes_reserved();
  return n;
}

void LayerStore::clear() {
  for (size_t h = 0; h < k_.size(); ++h) {
    for (HeadStream* s : {&k_[h], &v_[h]}) {
      s->quant.clear();
      s->resid.clear();
      s->written = 0;
    }
  }
  k_scale_ = v_scale_ = 1.0f;
  scales_set_ = false;
}

void LayerStore::check(int64_t layer) const {
  for (size_t h = 0; h < k_.size(); ++h) {
    const std::string where = "layer " + std::to_string(layer) + " head " + std::to_string(h);
    const StreamSetup* setups[2] = {ks_, vs_};
    const HeadStream* streams[2] = {&k_[h], &v_[h]};
    for (int i = 0; i < 2; ++i) {
      const std::string w = where + (i == 0 ? " K" : " V");
      streams[i]->quant.check(w + " quantized");
      streams[i]->resid.check(w + " residual");
      const StreamSpec& sp = setups[i]->spec;
      const int64_t r = streams[i]->resid.live();
      const bool ok = setups[i]->direct() ? r == 0
                      : sp.flush == ResidualFlush::kBlock && sp.residual > 0 ? r < sp.residual
                                                                             : r <= sp.residual;
      KV_CHECK(ok, InternalError, w, ": residual holds ", r, " tokens, against R = ", sp.residual,
               sp.flush == ResidualFlush::kBlock ? " (block flush: < R)" : " (sliding: <= R)");
      for (const auto& b : streams[i]->resid.blocks()) {
        KV_CHECK(b.format == StreamFormats::kResidual || b.format == StreamFormats::kFallback, InternalError, w,
                 ": a residual block in format ", static_cast<int>(b.format));
      }
      if (!streams[i]->quant.blocks().empty() && !streams[i]->resid.blocks().empty()) {
        // Quantized tokens precede residual ones.
        std::vector<int64_t> qp, rp;
        streams[i]->quant.live_positions(qp);
        streams[i]->resid.live_positions(rp);
        KV_CHECK(qp.back() < rp.front(), InternalError, w, ": quantized position ", qp.back(),
                 " is not older than the residual's first ", rp.front());
      }
    }
    KV_CHECK(k_[h].positions() == v_[h].positions(), InternalError, where,
             ": K and V streams hold different tokens (", k_[h].live(), " vs ", v_[h].live(), ")");
  }
}

}  // namespace kvcache::cache
