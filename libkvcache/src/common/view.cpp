// SPDX-License-Identifier: Apache-2.0
// Views (kvcache/view.h), the core's Buffer (kvcache/buffer.h) and what the core does with
// views (common/view_ops.h).
#include "kvcache/view.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>

#include "common/view_ops.h"
#include "kvcache/buffer.h"
#include "kvcache/error.h"
#include "quant/cast_kernels.h"
#include "quant/simd.h"

namespace kvcache {
namespace {

template <class View>
void set_contiguous(View& v, const int64_t* shape, size_t rank) {
  KV_CHECK_ARG(rank <= static_cast<size_t>(kMaxViewRank), "a view has at most ", kMaxViewRank, " dimensions, got ",
               rank);
  v.rank = static_cast<int>(rank);
  int64_t stride = 1;
  for (int i = v.rank - 1; i >= 0; --i) {
    KV_CHECK_ARG(shape[i] >= 0, "a view's sizes must be >= 0, got ", shape_str(std::vector<int64_t>(shape, shape + rank)));
    v.shape[i] = shape[i];
    v.strides[i] = stride;
    stride *= shape[i];
  }
}

int64_t numel_of(int rank, const int64_t* shape) {
  if (rank < 0) return 0;
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

bool contiguous_of(int rank, const int64_t* shape, const int64_t* strides) {
  int64_t expect = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expect) return false;
    expect *= shape[i];
  }
  return true;
}

}  // namespace

int64_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat64: return 8;
    case DType::kUInt8: return 1;
    case DType::kInt8: return 1;
    case DType::kInt16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kBool: return 1;
  }
  return 1;
}

const char* to_string(DType t) {
  switch (t) {
    case DType::kFloat32: return "Float";
    case DType::kFloat16: return "Half";
    case DType::kBFloat16: return "BFloat16";
    case DType::kFloat64: return "Double";
    case DType::kUInt8: return "Byte";
    case DType::kInt8: return "Char";
    case DType::kInt16: return "Short";
    case DType::kInt32: return "Int";
    case DType::kInt64: return "Long";
    case DType::kBool: return "Bool";
  }
  return "unknown";
}

TensorView::TensorView(const void* p, DType t, std::initializer_list<int64_t> shape_in) : data(p), dtype(t) {
  set_contiguous(*this, shape_in.begin(), shape_in.size());
}
TensorView::TensorView(const void* p, DType t, const std::vector<int64_t>& shape_in) : data(p), dtype(t) {
  set_contiguous(*this, shape_in.data(), shape_in.size());
}
int64_t TensorView::numel() const { return numel_of(rank, shape); }
bool TensorView::is_contiguous() const { return rank >= 0 && contiguous_of(rank, shape, strides); }
const void* TensorView::element(const int64_t* index) const {
  int64_t off = 0;
  for (int i = 0; i < rank; ++i) off += index[i] * strides[i];
  return static_cast<const char*>(data) + off * dtype_size(dtype);
}

MutableTensorView::MutableTensorView(void* p, DType t, std::initializer_list<int64_t> shape_in) : data(p), dtype(t) {
  set_contiguous(*this, shape_in.begin(), shape_in.size());
}
MutableTensorView::MutableTensorView(void* p, DType t, const std::vector<int64_t>& shape_in) : data(p), dtype(t) {
  set_contiguous(*this, shape_in.data(), shape_in.size());
}
MutableTensorView::operator TensorView() const {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.rank = rank;
  for (int i = 0; i < kMaxViewRank; ++i) {
    v.shape[i] = shape[i];
    v.strides[i] = strides[i];
  }
  return v;
}
int64_t MutableTensorView::numel() const { return numel_of(rank, shape); }
bool MutableTensorView::is_contiguous() const { return rank >= 0 && contiguous_of(rank, shape, strides); }

std::string shape_str(const std::vector<int64_t>& shape) { return detail::index_str(shape); }

std::string shape_str(const TensorView& v) {
  if (!v.defined()) return "undefined";
  return shape_str(v.sizes()) + " " + to_string(v.dtype);
}

// ---------------------------------------------------------------- Buffer

void Buffer::Free::operator()(void* p) const { std::free(p); }

Buffer::Buffer(DType dtype, std::vector<int64_t> shape) { ensure(dtype, shape); }

Buffer Buffer::zeros(DType dtype, std::vector<int64_t> shape) {
  Buffer b(dtype, std::move(shape));
  if (b.nbytes() > 0) std::memset(b.data(), 0, static_cast<size_t>(b.nbytes()));
  return b;
}

Buffer::Buffer(const Buffer& other) {
  if (!other.defined_) return;
  ensure(other.dtype_, other.shape_);
  if (nbytes() > 0) std::memcpy(data(), other.data(), static_cast<size_t>(nbytes()));
}

Buffer& Buffer::operator=(const Buffer& other) {
  if (this == &other) return *this;
  if (!other.defined_) {
    reset();
    return *this;
  }
  ensure(other.dtype_, other.shape_);
  if (nbytes() > 0) std::memcpy(data(), other.data(), static_cast<size_t>(nbytes()));
  return *this;
}

int64_t Buffer::numel() const {
  if (!defined_) return 0;
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

int64_t Buffer::nbytes() const { return numel() * dtype_size(dtype_); }

TensorView Buffer::view() const {
  if (!defined_) return {};
  return TensorView(data(), dtype_, shape_);
}

MutableTensorView Buffer::mutable_view() {
  if (!defined_) return {};
  return MutableTensorView(data(), dtype_, shape_);
}

bool Buffer::ensure(DType dtype, const std::vector<int64_t>& shape, const void* avoid_begin, const void* avoid_end) {
  int64_t n = 1;
  for (int64_t s : shape) {
    KV_CHECK_ARG(s >= 0, "Buffer: sizes must be >= 0, got ", shape_str(shape));
    n *= s;
  }
  const int64_t bytes = n * dtype_size(dtype);
  const auto* lo = static_cast<const char*>(data_.get());
  const bool overlaps = lo != nullptr && avoid_begin != nullptr && static_cast<const char*>(avoid_begin) < lo + capacity_ &&
                        lo < static_cast<const char*>(avoid_end);
  if (defined_ && dtype_ == dtype && shape_ == shape && !overlaps) return true;
  if (bytes > capacity_ || overlaps) {
    // 64-byte aligned (a cache line; the AVX-512 kernels' non-temporal stores), at least 64 bytes.
    const size_t size = static_cast<size_t>((bytes + 63) / 64 * 64 + (bytes == 0 ? 64 : 0));
    void* p = std::aligned_alloc(64, size);
    if (p == nullptr) throw std::bad_alloc();
    if (overlaps) retired_ = std::move(data_);  // the caller's input views it: freed later
    data_.reset(p);
    capacity_ = static_cast<int64_t>(size);
  }
  defined_ = true;
  dtype_ = dtype;
  shape_ = shape;
  return false;
}

void Buffer::reset() {
  defined_ = false;
  shape_.clear();
  data_.reset();
  retired_.reset();
  capacity_ = 0;
}

bool operator==(const Buffer& a, const Buffer& b) {
  if (a.defined_ != b.defined_) return false;
  if (!a.defined_) return true;
  if (a.dtype_ != b.dtype_ || a.shape_ != b.shape_) return false;
  return a.nbytes() == 0 || std::memcmp(a.data(), b.data(), static_cast<size_t>(a.nbytes())) == 0;
}

// ---------------------------------------------------------------- view ops
namespace detail {
namespace {

float load_float(const void* p, DType t) {
  switch (t) {
    case DType::kFloat32: {
      float v;
      std::memcpy(&v, p, sizeof v);
      return v;
    }
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p, sizeof h);
      return quant::fp16_to_float(h);
    }
    case DType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, p, sizeof h);
      return quant::bf16_to_float(h);
    }
    default: break;
  }
  KV_INTERNAL_ASSERT(false, "load_float: dtype ", to_string(t));
  return 0.0f;
}

}  // namespace

std::string index_str(const std::vector<int64_t>& index) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < index.size(); ++i) os << (i ? ", " : "") << index[i];
  os << "]";
  return os.str();
}

void read_float32(const TensorView& v, Float32Rows& out) {
  KV_INTERNAL_ASSERT(v.defined() && is_kv_dtype(v.dtype), "read_float32 of ", shape_str(v));
  out.numel = v.numel();
  if (v.dtype == DType::kFloat32 && v.is_contiguous()) {
    out.data = static_cast<const float*>(v.data);
    out.owned.clear();
    return;
  }
  out.owned.resize(static_cast<size_t>(out.numel));
  float* dst = out.owned.data();
  const auto* base = static_cast<const char*>(v.data);
  const int64_t es = dtype_size(v.dtype);
  if (v.is_contiguous() && v.dtype == DType::kFloat16) {
    quant::fp16_to_fp32(static_cast<const uint16_t*>(v.data), out.numel, dst);
  } else if (v.is_contiguous() && v.dtype == DType::kBFloat16) {
    quant::bf16_to_fp32(static_cast<const uint16_t*>(v.data), out.numel, dst);
  } else {
    for_each_element(v.rank, v.shape, v.strides,
                     [&](int64_t off, int64_t i) { dst[i] = load_float(base + off * es, v.dtype); });
  }
  out.data = dst;
}

std::vector<float> to_float32(const TensorView& v) {
  Float32Rows r;
  read_float32(v, r);
  if (!r.owned.empty() || r.numel == 0) return std::move(r.owned);
  return std::vector<float>(r.data, r.data + r.numel);
}

std::vector<int64_t> to_int64(const TensorView& v) {
  KV_INTERNAL_ASSERT(v.defined() && v.dtype == DType::kInt64, "to_int64 of ", shape_str(v));
  std::vector<int64_t> out(static_cast<size_t>(v.numel()));
  const auto* base = static_cast<const int64_t*>(v.data);
  for_each_element(v.rank, v.shape, v.strides, [&](int64_t off, int64_t i) { out[static_cast<size_t>(i)] = base[off]; });
  return out;
}

std::vector<int64_t> first_nonfinite(const TensorView& v) {
  KV_INTERNAL_ASSERT(v.defined() && is_kv_dtype(v.dtype), "first_nonfinite of ", shape_str(v));
  const auto* base = static_cast<const char*>(v.data);
  const int64_t es = dtype_size(v.dtype);
  int64_t bad = -1;
  if (v.dtype == DType::kFloat32 && v.is_contiguous()) {
    // The common case: one vectorizable scan, then the index of the first hit.
    const auto* x = static_cast<const float*>(v.data);
    const int64_t n = v.numel();
    uint32_t any = 0;
    for (int64_t i = 0; i < n; ++i) any |= quant::nonfinite_bit(x[i]);
    if (any == 0) return {};
    for (int64_t i = 0; i < n && bad < 0; ++i) {
      if (!std::isfinite(x[i])) bad = i;
    }
  } else {
    for_each_element(v.rank, v.shape, v.strides, [&](int64_t off, int64_t i) {
      if (bad < 0 && !std::isfinite(load_float(base + off * es, v.dtype))) bad = i;
    });
  }
  if (bad < 0) return {};
  std::vector<int64_t> idx(static_cast<size_t>(v.rank));
  for (int i = v.rank - 1; i >= 0; --i) {
    idx[static_cast<size_t>(i)] = bad % v.shape[i];
    bad /= v.shape[i];
  }
  return idx;
}

double value_at(const TensorView& v, const std::vector<int64_t>& index) {
  const void* p = v.element(index.data());
  switch (v.dtype) {
    case DType::kFloat64: {
      double d;
      std::memcpy(&d, p, sizeof d);
      return d;
    }
    case DType::kInt64: {
      int64_t i;
      std::memcpy(&i, p, sizeof i);
      return static_cast<double>(i);
    }
    default: return load_float(p, v.dtype);
  }
}

void write_float32(const float* src, const MutableTensorView& out) {
  KV_INTERNAL_ASSERT(out.defined() && is_kv_dtype(out.dtype), "write_float32 into ", shape_str(TensorView(out)));
  const int64_t n = out.numel();
  if (out.is_contiguous()) {
    switch (out.dtype) {
      case DType::kFloat32:
        if (static_cast<const void*>(src) != out.data) std::memcpy(out.data, src, static_cast<size_t>(n) * sizeof(float));
        return;
      case DType::kFloat16: quant::cast_to_fp16_saturating(src, n, static_cast<uint16_t*>(out.data)); return;
      default: (void)quant::cast_to_bf16(src, n, static_cast<uint16_t*>(out.data)); return;
    }
  }
  auto* base = static_cast<char*>(out.data);
  const int64_t es = dtype_size(out.dtype);
  for_each_element(out.rank, out.shape, out.strides, [&](int64_t off, int64_t i) {
    char* p = base + off * es;
    if (out.dtype == DType::kFloat32) {
      std::memcpy(p, src + i, sizeof(float));
    } else {
      const uint16_t h = out.dtype == DType::kFloat16 ? quant::fp16_bits_saturating(src[i])
                                                       : quant::bf16_bits_saturating(src[i]);
      std::memcpy(p, &h, sizeof h);
    }
  });
}

}  // namespace detail
}  // namespace kvcache
