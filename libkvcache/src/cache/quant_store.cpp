// SPDX-License-Identifier: Apache-2.0
#include "cache/quant_store.h"

#include "kvcache/error.h"

namespace kvcache::cache {
namespace {

at::Tensor index_tensor(const std::vector<int64_t>& idx) {
  auto t = at::empty({static_cast<int64_t>(idx.size())}, at::kLong);
  std::copy(idx.begin(), idx.end(), t.data_ptr<int64_t>());
  return t;
}

}  // namespace

StoreLayout probe_layout(const Quantizer& q, int64_t head_dim, int64_t token_group) {
  StoreLayout out;
  out.token_group = std::max<int64_t>(1, token_group);
  if (q.group_axis() != GroupAxis::kPerToken) return out;
  auto make = [head_dim](int64_t t) {
    return at::sin(at::arange(2 * t * head_dim, at::kFloat).view({1, 2, t, head_dim}) * 0.37f) * 3.0f;
  };
  try {
    const QuantizedTensor q5 = q.quantize(make(5));
    const QuantizedTensor q3 = q.quantize(make(3));
    if (!q5.side.empty() || !q5.codes.defined()) return out;
    auto token_major = [](const at::Tensor& a, const at::Tensor& b) {
      if (!a.defined()) return !b.defined();
      if (!b.defined() || a.dim() < 3 || a.dim() != b.dim() || a.scalar_type() != b.scalar_type()) {
        return false;
      }
      if (a.size(0) != 1 || a.size(1) != 2 || a.size(2) != 5 || b.size(2) != 3) return false;
      for (int64_t i = 3; i < a.dim(); ++i) {
        if (a.size(i) != b.size(i)) return false;
      }
      return true;
    };
    if (!token_major(q5.codes, q3.codes) || !token_major(q5.scales, q3.scales) ||
        !token_major(q5.zeros, q3.zeros)) {
      return out;
    }
    // Head 1, tokens 1..3 assembled from slices must dequantize like the full tensor's slice.
    auto cut = [](const at::Tensor& t) {
      return t.defined() ? t.narrow(1, 1, 1).narrow(2, 1, 3).contiguous() : t;
    };
    QuantizedTensor s;
    s.format = q5.format;
    s.shape = {1, 1, 3, head_dim};
    s.dtype = q5.dtype;
    s.codes = cut(q5.codes);
    s.scales = cut(q5.scales);
    s.zeros = cut(q5.zeros);
    auto part = q.dequantize(s);
    auto whole = q.dequantize(q5).narrow(1, 1, 1).narrow(2, 1, 3);
    out.gatherable = at::equal(part, whole);
  } catch (const Error&) {
    out.gatherable = false;
  }
  return out;
}

// ---------------------------------------------------------------- GatherStore
void GatherStore::append(QuantizedTensor q) {
  KV_INTERNAL_ASSERT(q.shape.size() == 4 && q.shape[1] == 1, "GatherStore wants one head");
  if (shape_.empty()) {
    format_ = q.format;
    shape_ = q.shape;
    dtype_ = q.dtype;
    has_codes_ = q.codes.defined();
    has_scales_ = q.scales.defined();
    has_zeros_ = q.zeros.defined();
  }
  KV_INTERNAL_ASSERT(q.format == format_ && q.shape[0] == shape_[0] && q.shape[3] == shape_[3],
                     "GatherStore: mismatched block");
  // Metadata may be promoted per quantize call (int quantizers store fp32 scales/zeros when
  // fp16 would overflow): keep the wider type for the whole store, converting exactly.
  auto put = [](TokenBuffer& buf, const at::Tensor& t) {
    if (buf.initialized() && buf.dtype() != t.scalar_type() &&
        at::elementSize(t.scalar_type()) > at::elementSize(buf.dtype())) {
      buf.set_dtype(t.scalar_type());
    }
    buf.append(t);
  };
  if (has_codes_) put(codes_, q.codes);
  if (has_scales_) put(scales_, q.scales);
  if (has_zeros_) put(zeros_, q.zeros);
  size_ += q.shape[2];
}

int64_t GatherStore::nbytes() const { return codes_.nbytes() + scales_.nbytes() + zeros_.nbytes(); }

QuantizedTensor GatherStore::as_tensor() const {
  QuantizedTensor t;
  t.format = format_;
  t.shape = {shape_[0], 1, size_, shape_[3]};
  t.dtype = dtype_;
  if (has_codes_) t.codes = codes_.view();
  if (has_scales_) t.scales = scales_.view();
  if (has_zeros_) t.zeros = zeros_.view();
  return t;
}

int64_t GatherStore::measure_nbytes() const { return shape_.empty() ? 0 : as_tensor().nbytes(); }

std::vector<ViewUpdate> GatherStore::drop(const std::vector<int64_t>& drops) {
  const auto nd = static_cast<int64_t>(drops.size());
  KV_INTERNAL_ASSERT(nd <= size_, "GatherStore::drop");
  if (nd == 0) return {};
  const std::vector<std::vector<int64_t>> one{drops};
  if (has_codes_) codes_.drop(one);
  if (has_scales_) scales_.drop(one);
  if (has_zeros_) zeros_.drop(one);
  size_ -= nd;
  return {};
}

at::Tensor GatherStore::dequantize_all() const {
  KV_INTERNAL_ASSERT(!shape_.empty(), "GatherStore::dequantize_all before any append");
  if (size_ == 0) return at::empty({shape_[0], 1, 0, shape_[3]}, at::kFloat);
  return q_.dequantize(as_tensor()).to(at::kFloat);
}

// ---------------------------------------------------------------- GroupStore
int64_t GroupStore::Block::bytes() const {
  return quantized ? q.nbytes() : fp.numel() * static_cast<int64_t>(fp.element_size());
}

void GroupStore::append(QuantizedTensor q) {
  KV_INTERNAL_ASSERT(q.shape.size() == 4 && q.shape[1] == 1, "GroupStore wants one head");
  Block b;
  const int64_t n = q.shape[2];
  b.q = std::move(q);
  b.alive.assign(static_cast<size_t>(n), 1);
  b.n_alive = n;
  bytes_ += b.bytes();
  size_ += n;
  blocks_.push_back(std::move(b));
}

at::Tensor GroupStore::live_values(const Block& b) const {
  if (!b.quantized) return b.fp.to(at::kFloat);
  auto deq = q_.dequantize(b.q).to(at::kFloat);
  if (b.n_alive == static_cast<int64_t>(b.alive.size())) return deq;
  std::vector<int64_t> slots;
  for (size_t i = 0; i < b.alive.size(); ++i) {
    if (b.alive[i]) slots.push_back(static_cast<int64_t>(i));
  }
  return deq.index_select(2, index_tensor(slots));
}

std::vector<ViewUpdate> GroupStore::drop(const std::vector<int64_t>& drops) {
  const auto nd = static_cast<int64_t>(drops.size());
  KV_INTERNAL_ASSERT(nd <= size_, "GroupStore::drop");
  std::vector<ViewUpdate> updates;
  if (nd == 0) return updates;
  std::vector<Block> out;
  out.reserve(blocks_.size());
  int64_t off = 0;      // pre-removal live index of the block's first live token
  int64_t new_off = 0;  // post-removal
  int64_t di = 0;       // cursor into drops
  for (auto& b : blocks_) {
    std::vector<int64_t> dropped_local;  // live positions within the block
    while (di < nd && drops[static_cast<size_t>(di)] < off + b.n_alive) {
      dropped_local.push_back(drops[static_cast<size_t>(di)] - off);
      ++di;
    }
    off += b.n_alive;
    if (dropped_local.empty()) {
      new_off += b.n_alive;
      out.push_back(std::move(b));
      continue;
    }
    const int64_t n_kept = b.n_alive - static_cast<int64_t>(dropped_local.size());
    bytes_ -= b.bytes();
    if (n_kept == 0) continue;  // whole block evicted: freed
    if (b.quantized) {
      // Mark dead the slots holding the dropped live positions.
      size_t dp = 0;
      int64_t live_pos = 0;
      for (size_t s = 0; s < b.alive.size() && dp < dropped_local.size(); ++s) {
        if (!b.alive[s]) continue;
        if (dropped_local[dp] == live_pos) {
          b.alive[s] = 0;
          ++dp;
        }
        ++live_pos;
      }
      b.n_alive = n_kept;
      const int64_t fp_bytes = b.q.shape[0] * n_kept * b.q.shape[3] *
                               static_cast<int64_t>(at::elementSize(fp_dtype_));
      if (fp_bytes <= b.q.nbytes()) {
        // Survivors take no more room in full precision: convert once, free the group.
        b.fp = live_values(b).to(fp_dtype_).contiguous();
        b.quantized = false;
        b.q = QuantizedTensor();
        b.alive.clear();
        updates.push_back({new_off, b.fp.to(at::kFloat)});
      }
    } else {
      std::vector<int64_t> kept_local;
      size_t dp = 0;
      for (int64_t i = 0; i < b.n_alive; ++i) {
        if (dp < dropped_local.size() && dropped_local[dp] == i) {
          ++dp;
        } else {
          kept_local.push_back(i);
        }
      }
      b.fp = b.fp.index_select(2, index_tensor(kept_local)).contiguous();
      b.n_alive = n_kept;
    }
    bytes_ += b.bytes();
    new_off += n_kept;
    out.push_back(std::move(b));
  }
  KV_INTERNAL_ASSERT(di == nd && new_off == size_ - nd, "GroupStore::drop consumed ", di, " of ", nd);
  blocks_ = std::move(out);
  size_ -= nd;
  return updates;
}

at::Tensor GroupStore::dequantize_all() const {
  std::vector<at::Tensor> parts;
  parts.reserve(blocks_.size());
  for (const auto& b : blocks_) parts.push_back(live_values(b));
  KV_INTERNAL_ASSERT(!parts.empty(), "GroupStore::dequantize_all on an empty store");
  return at::cat(parts, 2);
}

int64_t GroupStore::measure_nbytes() const {
  int64_t n = 0;
  for (const auto& b : blocks_) n += b.bytes();
  return n;
}

int64_t GroupStore::num_blocks() const {
  int64_t n = 0;
  for (const auto& b : blocks_) n += b.quantized ? 1 : 0;
  return n;
}

int64_t GroupStore::dead_slots() const {
  int64_t n = 0;
  for (const auto& b : blocks_) {
    if (b.quantized) n += static_cast<int64_t>(b.alive.size()) - b.n_alive;
  }
  return n;
}

}  // namespace kvcache::cache
