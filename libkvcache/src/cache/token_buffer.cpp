// SPDX-License-Identifier: Apache-2.0
#include "cache/token_buffer.h"

#include <algorithm>
#include <cstring>

#include "kvcache/error.h"

namespace kvcache::cache {

TokenBuffer::TokenBuffer(at::ScalarType dtype, std::vector<int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)) {
  KV_INTERNAL_ASSERT(shape_.size() >= 3, "TokenBuffer needs [B, H, T, ...]");
  row_elems_ = 1;
  for (size_t i = 3; i < shape_.size(); ++i) row_elems_ *= shape_[i];
  shape_[2] = 0;
}

uint8_t* TokenBuffer::row_ptr(int64_t b, int64_t h, int64_t idx) const {
  const int64_t cap = shape_[2];
  auto* base = static_cast<uint8_t*>(data_.data_ptr());
  return base + ((b * shape_[1] + h) * cap + idx) * row_bytes();
}

void TokenBuffer::ensure_capacity(int64_t extra) {
  const int64_t len = size();
  const int64_t cap = data_.defined() ? shape_[2] : 0;
  if (data_.defined() && end_ + extra <= cap) return;
  if (data_.defined() && len + extra <= cap - cap / 4 && begin_ > 0) {
    // Re-centre: move live rows to the front (amortized: begin_ grew by >= cap/4 since the
    // last move or reallocation).
    for (int64_t b = 0; b < shape_[0]; ++b) {
      for (int64_t h = 0; h < shape_[1]; ++h) {
        std::memmove(row_ptr(b, h, 0), row_ptr(b, h, begin_), static_cast<size_t>(len * row_bytes()));
      }
    }
    begin_ = 0;
    end_ = len;
    return;
  }
  const int64_t new_cap = std::max<int64_t>(16, 2 * (len + extra));
  std::vector<int64_t> s(shape_);
  s[2] = new_cap;
  auto fresh = at::empty(s, at::TensorOptions().dtype(dtype_));
  if (data_.defined() && len > 0) {
    fresh.narrow(2, 0, len).copy_(data_.narrow(2, begin_, len));
  }
  data_ = fresh;
  shape_[2] = new_cap;
  begin_ = 0;
  end_ = len;
}

void TokenBuffer::append(const at::Tensor& x) {
  KV_INTERNAL_ASSERT(x.dim() >= 3, "TokenBuffer::append: rank ", x.dim());
  if (shape_.empty()) {
    dtype_ = x.scalar_type();
    shape_ = x.sizes().vec();
    shape_[2] = 0;
    row_elems_ = 1;
    for (size_t i = 3; i < shape_.size(); ++i) row_elems_ *= shape_[i];
  }
  KV_INTERNAL_ASSERT(static_cast<size_t>(x.dim()) == shape_.size() && x.size(0) == shape_[0] &&
                         x.size(1) == shape_[1],
                     "TokenBuffer::append: got ", x.sizes(), " for buffer shape ", at::IntArrayRef(shape_));
  for (size_t i = 3; i < shape_.size(); ++i) {
    KV_INTERNAL_ASSERT(x.size(static_cast<int64_t>(i)) == shape_[i], "TokenBuffer::append: dim ", i);
  }
  const int64_t n = x.size(2);
  if (n == 0) {
    if (!data_.defined()) ensure_capacity(0);
    return;
  }
  ensure_capacity(n);
  if (x.is_contiguous() && x.scalar_type() == dtype_) {
    // Plain memcpy per (batch, head): avoids two dispatcher round trips per decode token.
    const auto* src = static_cast<const uint8_t*>(x.data_ptr());
    const int64_t chunk = n * row_bytes();
    for (int64_t b = 0; b < shape_[0]; ++b) {
      for (int64_t h = 0; h < shape_[1]; ++h) {
        std::memcpy(row_ptr(b, h, end_), src + (b * shape_[1] + h) * chunk, static_cast<size_t>(chunk));
      }
    }
  } else {
    data_.narrow(2, end_, n).copy_(x);
  }
  end_ += n;
}

void TokenBuffer::append_to_all_heads(const at::Tensor& x) {
  KV_INTERNAL_ASSERT(initialized() && x.is_contiguous() && x.scalar_type() == dtype_ &&
                         x.dim() == static_cast<int64_t>(shape_.size()) && x.size(0) == shape_[0] &&
                         x.size(1) == 1,
                     "append_to_all_heads: got ", x.sizes());
  const int64_t n = x.size(2);
  if (n == 0) return;
  ensure_capacity(n);
  const auto* src = static_cast<const uint8_t*>(x.data_ptr());
  const int64_t chunk = n * row_bytes();
  for (int64_t b = 0; b < shape_[0]; ++b) {
    for (int64_t h = 0; h < shape_[1]; ++h) {
      std::memcpy(row_ptr(b, h, end_), src + b * chunk, static_cast<size_t>(chunk));
    }
  }
  end_ += n;
}

at::Tensor TokenBuffer::view() const {
  if (!data_.defined()) {
    std::vector<int64_t> s(shape_);
    if (s.empty()) return at::Tensor();
    s[2] = 0;
    return at::empty(s, at::TensorOptions().dtype(dtype_));
  }
  return data_.narrow(2, begin_, size());
}

at::Tensor TokenBuffer::rows(int64_t h, int64_t start, int64_t n) const {
  KV_INTERNAL_ASSERT(start >= 0 && n >= 0 && start + n <= size(), "rows out of range");
  return view().narrow(1, h, 1).narrow(2, start, n);
}

void TokenBuffer::write(int64_t h, int64_t start, const at::Tensor& x) {
  if (x.size(2) == 0) return;
  rows(h, start, x.size(2)).copy_(x);
}

void TokenBuffer::write_all(int64_t start, const at::Tensor& x) {
  if (x.size(2) == 0) return;
  KV_INTERNAL_ASSERT(start >= 0 && start + x.size(2) <= size(), "write_all out of range");
  view().narrow(2, start, x.size(2)).copy_(x);
}

void TokenBuffer::drop(const std::vector<std::vector<int64_t>>& drops) {
  const int64_t len = size();
  KV_INTERNAL_ASSERT(static_cast<int64_t>(drops.size()) == shape_[1], "drop: ", drops.size(),
                     " lists for ", shape_[1], " heads");
  const auto nd = static_cast<int64_t>(drops[0].size());
  if (nd == 0) return;
  KV_INTERNAL_ASSERT(nd <= len, "drop: ", nd, " of ", len);
  // Rows that move: compacting towards the front moves every kept row after the first drop;
  // towards the back, every kept row before the last drop.
  int64_t left_cost = 0, right_cost = 0;
  for (const auto& d : drops) {
    KV_INTERNAL_ASSERT(static_cast<int64_t>(d.size()) == nd, "drop: heads drop different counts");
    left_cost += (len - d.front()) - nd;
    right_cost += (d.back() + 1) - nd;
  }
  const bool move_left = left_cost <= right_cost;
  const int64_t rb = row_bytes();
  for (int64_t h = 0; h < shape_[1]; ++h) {
    const auto& d = drops[static_cast<size_t>(h)];
    for (int64_t b = 0; b < shape_[0]; ++b) {
      if (move_left) {
        // Kept run between drop i and drop i+1 (or the end) shifts left by i+1.
        for (int64_t i = 0; i < nd; ++i) {
          const int64_t src = d[static_cast<size_t>(i)] + 1;
          const int64_t stop = i + 1 < nd ? d[static_cast<size_t>(i + 1)] : len;
          if (stop > src) {
            std::memmove(row_ptr(b, h, begin_ + src - (i + 1)), row_ptr(b, h, begin_ + src),
                         static_cast<size_t>((stop - src) * rb));
          }
        }
      } else {
        // Kept run between drop i−1 (or the start) and drop i shifts right by nd − i.
        for (int64_t i = nd - 1; i >= 0; --i) {
          const int64_t stop = d[static_cast<size_t>(i)];
          const int64_t src = i > 0 ? d[static_cast<size_t>(i - 1)] + 1 : 0;
          if (stop > src) {
            std::memmove(row_ptr(b, h, begin_ + src + (nd - i)), row_ptr(b, h, begin_ + src),
                         static_cast<size_t>((stop - src) * rb));
          }
        }
      }
    }
  }
  if (move_left) {
    end_ -= nd;
  } else {
    begin_ += nd;
  }
}

void TokenBuffer::drop_front(int64_t n) {
  KV_INTERNAL_ASSERT(n >= 0 && n <= size(), "drop_front ", n, " of ", size());
  begin_ += n;
}

int64_t TokenBuffer::nbytes() const {
  if (shape_.empty()) return 0;
  return shape_[0] * shape_[1] * size() * row_bytes();
}

void TokenBuffer::set_dtype(at::ScalarType dtype) {
  if (dtype == dtype_) return;
  dtype_ = dtype;
  if (data_.defined()) data_ = data_.to(dtype);
}

void TokenBuffer::clear() {
  begin_ = end_ = 0;
}

}  // namespace kvcache::cache
