// SPDX-License-Identifier: Apache-2.0
// Compiled without FMA contraction (the project default, -std=c++17): the rotation is the
// export's x·cos + rot·sin, two products and a sum, bit for bit.
#include "common/rope_table.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kvcache/error.h"

namespace kvcache::common {

RopeTable::RopeTable(RopeFn rope, int64_t head_dim, const std::string& needed_by)
    : rope_(std::move(rope)), head_dim_(head_dim) {
  KV_CHECK_ARG(head_dim % 2 == 0, "the rotate-half RoPE needs an even head_dim, got ", head_dim, "; ", needed_by);
  // Check the form on a few positions: rope(e_first_half) = [cos | sin], rope(e_second_half)
  // = [−sin | cos], and rope of a random row equals the table's rotation of it.
  const int64_t half = head_dim / 2;
  const std::vector<int64_t> pos = {0, 1, 7, 1000};
  const int64_t n = static_cast<int64_t>(pos.size());
  const auto size = static_cast<size_t>(n * head_dim);
  std::vector<float> r1(size, 0.0f), r2(size, 0.0f), x(size), rx(size);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      r1[static_cast<size_t>(t * head_dim + i)] = 1.0f;
      r2[static_cast<size_t>(t * head_dim + half + i)] = 1.0f;
    }
  }
  for (size_t i = 0; i < size; ++i) x[i] = std::sin(static_cast<float>(i) * 0.731f) * 2.0f;
  rx = x;
  rope_(r1.data(), 1, n, head_dim, pos.data());
  rope_(r2.data(), 1, n, head_dim, pos.data());
  rope_(rx.data(), 1, n, head_dim, pos.data());
  const float* a = r1.data();
  const float* b = r2.data();
  bool ok = true;
  identity_ = true;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      identity_ = identity_ && a[t * head_dim + i] == 1.0f && a[t * head_dim + half + i] == 0.0f;
    }
  }
  for (int64_t t = 0; t < n && ok; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float c = a[t * head_dim + i], s = a[t * head_dim + half + i];
      ok = ok && -b[t * head_dim + i] == s && b[t * head_dim + half + i] == c && std::abs(c * c + s * s - 1.0f) < 1e-3f;
    }
  }
  if (ok) {
    std::vector<float> row(static_cast<size_t>(head_dim));
    for (int64_t t = 0; t < n && ok; ++t) {
      std::copy_n(x.data() + t * head_dim, head_dim, row.begin());
      const float* c = a + t * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = row[static_cast<size_t>(i)], x2 = row[static_cast<size_t>(i + half)];
        row[static_cast<size_t>(i)] = x1 * c[i] + (-x2) * c[half + i];
        row[static_cast<size_t>(i + half)] = x2 * c[i] + x1 * c[half + i];
      }
      for (int64_t i = 0; i < head_dim; ++i) {
        ok = ok && std::abs(row[static_cast<size_t>(i)] - rx[static_cast<size_t>(t * head_dim + i)]) <= 1e-5f;
      }
    }
  }
  KV_CHECK_ARG(ok, "CacheConfig.rope is not the rotate-half RoPE of HF Llama/Qwen (x·cos + rotate_half(x)·sin "
               "with cos/sin repeated over both halves); ", needed_by);
}

void RopeTable::probe(int64_t first, int64_t n, float* cos_out, float* sin_out) const {
  const int64_t half = head_dim_ / 2;
  std::vector<float> e(static_cast<size_t>(n * head_dim_), 0.0f);
  std::vector<int64_t> pos(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    pos[static_cast<size_t>(t)] = first + t;
    std::fill_n(e.begin() + t * head_dim_, half, 1.0f);
  }
  rope_(e.data(), 1, n, head_dim_, pos.data());
  const float* p = e.data();
  for (int64_t t = 0; t < n; ++t) {
    std::copy_n(p + t * head_dim_, half, cos_out + t * head_dim_);
    std::copy_n(p + t * head_dim_ + half, half, sin_out + t * head_dim_);
  }
}

void RopeTable::extend(const int64_t* pos, int64_t n) {
  if (!enabled() || n == 0) return;
  const int64_t hi = *std::max_element(pos, pos + n) + 1;
  if (hi <= size_) return;
  cs_.resize(static_cast<size_t>(hi * head_dim_));
  // Layout per position: D/2 cos then D/2 sin (probe writes cos at +0 and sin at +half).
  float* base = cs_.data() + size_ * head_dim_;
  probe(size_, hi - size_, base, base + head_dim_ / 2);
  size_ = hi;
}

void RopeTable::rotate(float* x, int64_t p) const {
  KV_INTERNAL_ASSERT(p >= 0 && p < size_, "RopeTable: position ", p, " not recorded (", size_, ")");
  const int64_t half = head_dim_ / 2;
  const float* c = cs_.data() + p * head_dim_;
  const float* s = c + half;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c[i] + (-x2) * s[i];
    x[i + half] = x2 * c[i] + x1 * s[i];
  }
}

void RopeTable::unrotate(float* x, int64_t p) const {
  KV_INTERNAL_ASSERT(p >= 0 && p < size_, "RopeTable: position ", p, " not recorded (", size_, ")");
  const int64_t half = head_dim_ / 2;
  const float* c = cs_.data() + p * head_dim_;
  const float* s = c + half;
  for (int64_t i = 0; i < half; ++i) {
    const float y1 = x[i], y2 = x[i + half];
    x[i] = y1 * c[i] + y2 * s[i];
    x[i + half] = y2 * c[i] + (-y1) * s[i];
  }
}

void RopeTable::mean_cos_sin(int64_t first, int64_t n, float* cos_out, float* sin_out) const {
  KV_INTERNAL_ASSERT(enabled() && first >= 0 && n >= 1, "RopeTable::mean_cos_sin(", first, ", ", n, ")");
  const int64_t half = head_dim_ / 2;
  std::vector<float> cs(static_cast<size_t>(n * head_dim_));
  probe(first, n, cs.data(), cs.data() + half);
  for (int64_t i = 0; i < half; ++i) {
    double c = 0, s = 0;
    for (int64_t t = 0; t < n; ++t) {
      c += cs[static_cast<size_t>(t * head_dim_ + i)];
      s += cs[static_cast<size_t>(t * head_dim_ + half + i)];
    }
    cos_out[i] = static_cast<float>(c / static_cast<double>(n));
    sin_out[i] = static_cast<float>(s / static_cast<double>(n));
  }
}

}  // namespace kvcache::common
