// SPDX-License-Identifier: Apache-2.0
#include "cache/kv_stream.h"

#include <algorithm>

#include "kvcache/error.h"

namespace kvcache::cache {

KVStream::KVStream(StreamSpec spec, const Quantizer& quantizer, StoreLayout layout,
                   int64_t num_heads, int64_t head_dim)
    : spec_(std::move(spec)), q_(quantizer), layout_(layout), num_heads_(num_heads),
      head_dim_(head_dim) {
  for (int64_t h = 0; h < num_heads_; ++h) {
    if (layout_.gatherable) {
      stores_.push_back(std::make_unique<GatherStore>(q_));
    } else {
      stores_.push_back(std::make_unique<GroupStore>(q_, spec_.residual_dtype));
    }
    residual_.emplace_back();
  }
}

int64_t KVStream::flush_count(int64_t r) const {
  const int64_t big_r = spec_.residual;
  if (spec_.flush == ResidualFlush::kSliding) return std::max<int64_t>(0, r - big_r);
  if (big_r <= 0) return r;
  return r / big_r * big_r;
}

KVStream::Quantized KVStream::quantize_into_stores(const std::vector<at::Tensor>& rows,
                                                  const at::Tensor& all_rows) {
  Quantized out;
  auto& deq = out.per_head;
  deq.resize(static_cast<size_t>(num_heads_));
  const int64_t m0 = rows[0].defined() ? rows[0].size(2) : 0;
  bool same = true;
  for (const auto& r : rows) same = same && (r.defined() ? r.size(2) : 0) == m0;
  if (layout_.gatherable && same && m0 > 0 && num_heads_ > 1) {
    // One quantizer call for all heads, then split by head (token-major layout).
    auto all = all_rows.defined() ? all_rows : at::cat(rows, 1);
    QuantizedTensor qt = q_.quantize(all);
    auto full = q_.dequantize(qt).to(at::kFloat);
    for (int64_t h = 0; h < num_heads_; ++h) {
      QuantizedTensor part;
      part.format = qt.format;
      part.shape = {qt.shape[0], 1, qt.shape[2], qt.shape[3]};
      part.dtype = qt.dtype;
      if (qt.codes.defined()) part.codes = qt.codes.narrow(1, h, 1);
      if (qt.scales.defined()) part.scales = qt.scales.narrow(1, h, 1);
      if (qt.zeros.defined()) part.zeros = qt.zeros.narrow(1, h, 1);
      stores_[static_cast<size_t>(h)]->append(std::move(part));
      deq[static_cast<size_t>(h)] = full.narrow(1, h, 1);
    }
    out.all = full;
    return out;
  }
  for (int64_t h = 0; h < num_heads_; ++h) {
    const auto& r = rows[static_cast<size_t>(h)];
    if (!r.defined() || r.size(2) == 0) continue;
    const int64_t m = r.size(2);
    // Gatherable: one block. Group stores: blocks of token_group tokens (a per-channel group
    // each) so that eviction can free whole groups.
    const int64_t chunk = layout_.gatherable ? m : (layout_.token_group > 1 ? layout_.token_group : m);
    KV_INTERNAL_ASSERT(m % chunk == 0, "flush of ", m, " tokens is not a multiple of ", chunk);
    std::vector<at::Tensor> parts;
    for (int64_t s = 0; s < m; s += chunk) {
      QuantizedTensor qt = q_.quantize(r.narrow(2, s, chunk));
      parts.push_back(q_.dequantize(qt).to(at::kFloat));
      stores_[static_cast<size_t>(h)]->append(std::move(qt));
    }
    deq[static_cast<size_t>(h)] = parts.size() == 1 ? parts[0] : at::cat(parts, 2);
  }
  return out;
}

KVStream::PushResult KVStream::push(const at::Tensor& x) {
  KV_INTERNAL_ASSERT(x.dim() == 4 && x.size(1) == num_heads_ && x.size(3) == head_dim_ &&
                         x.scalar_type() == at::kFloat,
                     "KVStream::push got ", x.sizes());
  if (batch_ < 0) batch_ = x.size(0);
  KV_INTERNAL_ASSERT(x.size(0) == batch_, "batch changed");
  PushResult res;
  res.updates.resize(static_cast<size_t>(num_heads_));
  const int64_t n = x.size(2);
  std::vector<at::Tensor> rows(static_cast<size_t>(num_heads_));
  if (spec_.residual == 0 && spec_.flush == ResidualFlush::kSliding) {
    // No residual: new tokens go straight to quantized storage.
    if (layout_.gatherable && num_heads_ > 1 && n > 0) {
      // One quantizer call over all heads (the rows are x itself).
      for (int64_t h = 0; h < num_heads_; ++h) rows[static_cast<size_t>(h)] = x;  // shape only
      res.new_values = quantize_into_stores(rows, x).all;
      return res;
    }
    for (int64_t h = 0; h < num_heads_; ++h) rows[static_cast<size_t>(h)] = x.narrow(1, h, 1);
    if (n == 0) {
      res.new_values = x.clone();
      return res;
    }
    auto deq = quantize_into_stores(rows, x);
    res.new_values = deq.all.defined() ? deq.all : at::cat(deq.per_head, 1);
    return res;
  }
  auto xr = x.to(spec_.residual_dtype);
  res.new_values = xr.to(at::kFloat);
  std::vector<int64_t> q_old(static_cast<size_t>(num_heads_));
  for (int64_t h = 0; h < num_heads_; ++h) {
    auto& buf = residual_[static_cast<size_t>(h)];
    buf.append(xr.narrow(1, h, 1));
    const int64_t m = flush_count(buf.size());
    q_old[static_cast<size_t>(h)] = stores_[static_cast<size_t>(h)]->size();
    if (m > 0) rows[static_cast<size_t>(h)] = buf.rows(0, 0, m).to(at::kFloat);
  }
  auto deq = quantize_into_stores(rows).per_head;
  for (int64_t h = 0; h < num_heads_; ++h) {
    const auto& r = rows[static_cast<size_t>(h)];
    if (!r.defined()) continue;
    residual_[static_cast<size_t>(h)].drop_front(r.size(2));
    res.updates[static_cast<size_t>(h)].push_back({q_old[static_cast<size_t>(h)], deq[static_cast<size_t>(h)]});
  }
  return res;
}

std::vector<std::vector<ViewUpdate>> KVStream::drop(const std::vector<std::vector<int64_t>>& drops) {
  KV_INTERNAL_ASSERT(static_cast<int64_t>(drops.size()) == num_heads_, "KVStream::drop");
  std::vector<std::vector<ViewUpdate>> updates(static_cast<size_t>(num_heads_));
  for (int64_t h = 0; h < num_heads_; ++h) {
    const auto& d = drops[static_cast<size_t>(h)];
    auto& store = *stores_[static_cast<size_t>(h)];
    const int64_t q = store.size();
    const auto split = std::lower_bound(d.begin(), d.end(), q);
    updates[static_cast<size_t>(h)] = store.drop(std::vector<int64_t>(d.begin(), split));
    std::vector<int64_t> local(split, d.end());
    if (local.empty()) continue;
    for (auto& i : local) i -= q;
    residual_[static_cast<size_t>(h)].drop({local});
  }
  return updates;
}

int64_t KVStream::size() const {
  return stores_.empty() ? 0 : stores_[0]->size() + residual_[0].size();
}

int64_t KVStream::nbytes() const {
  int64_t n = 0;
  for (int64_t h = 0; h < num_heads_; ++h) {
    n += stores_[static_cast<size_t>(h)]->nbytes() + residual_[static_cast<size_t>(h)].nbytes();
  }
  return n;
}

int64_t KVStream::measure_nbytes() const {
  int64_t n = 0;
  for (int64_t h = 0; h < num_heads_; ++h) {
    const auto& buf = residual_[static_cast<size_t>(h)];
    n += stores_[static_cast<size_t>(h)]->measure_nbytes();
    if (buf.initialized()) {
      auto v = buf.view();
      n += v.numel() * static_cast<int64_t>(v.element_size());
    }
  }
  return n;
}

at::Tensor KVStream::dequantize_head(int64_t h) const {
  std::vector<at::Tensor> parts;
  const auto& store = *stores_[static_cast<size_t>(h)];
  if (store.size() > 0) parts.push_back(store.dequantize_all());
  const auto& buf = residual_[static_cast<size_t>(h)];
  if (buf.initialized() && buf.size() > 0) parts.push_back(buf.view().to(at::kFloat));
  if (parts.empty()) return at::empty({std::max<int64_t>(batch_, 1), 1, 0, head_dim_}, at::kFloat);
  return parts.size() == 1 ? parts[0] : at::cat(parts, 2);
}

void KVStream::check_residual_rule() const {
  for (int64_t h = 0; h < num_heads_; ++h) {
    const int64_t r = residual_[static_cast<size_t>(h)].size();
    if (spec_.flush == ResidualFlush::kBlock && spec_.residual > 0) {
      KV_INTERNAL_ASSERT(r < spec_.residual, "head ", h, ": block-flushed residual holds ", r,
                         " tokens, expected < ", spec_.residual);
    } else {
      KV_INTERNAL_ASSERT(r <= spec_.residual, "head ", h, ": residual holds ", r,
                         " tokens, expected <= ", spec_.residual);
    }
  }
}

}  // namespace kvcache::cache
