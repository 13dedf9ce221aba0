// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file buffer.h
/// Buffer: memory the core owns — a shape, an element type (kvcache/view.h) and that many
/// bytes, 64-byte aligned, contiguous (row-major). A QuantizedTensor (kvcache/quantizer.h)
/// holds its codes, scales, zeros and side data in Buffers, so what it stores is what it
/// reports (nbytes()). The ATen face (kvcache/torch/) views a Buffer as an at::Tensor without
/// copying (kvcache::as_tensor).

#include <cstdint>
#include <memory>
#include <vector>

#include "kvcache/view.h"

namespace kvcache {

class Buffer {
 public:
  /// No tensor (defined() false): what an absent scales/zeros is.
  Buffer() = default;
  /// `shape` of `dtype`, uninitialised. @throws InvalidArgument on a negative size.
  Buffer(DType dtype, std::vector<int64_t> shape);
  /// The same, every byte zero.
  static Buffer zeros(DType dtype, std::vector<int64_t> shape);

  Buffer(const Buffer& other);
  Buffer& operator=(const Buffer& other);
  Buffer(Buffer&&) noexcept = default;
  Buffer& operator=(Buffer&&) noexcept = default;

  bool defined() const { return defined_; }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const;
  /// Bytes held (numel · dtype_size; 0 when undefined).
  int64_t nbytes() const;
  void* data() { return data_.get(); }
  const void* data() const { return data_.get(); }
  template <class T>
  T* data_as() { return static_cast<T*>(data()); }
  template <class T>
  const T* data_as() const { return static_cast<const T*>(data()); }
  /// Views of the whole buffer (undefined views when the buffer is).
  TensorView view() const;
  MutableTensorView mutable_view();

  /// Makes this buffer hold `shape` of `dtype`: kept as it is (contents too) when it already
  /// is exactly that and does not overlap [avoid_begin, avoid_end) (the caller's input, which
  /// must not be overwritten), else reallocated (uninitialised). Memory the input overlapped is
  /// not freed by this call (the input may still be read): it is kept until the buffer is
  /// reset, reallocated for another overlap, or destroyed. Returns true when reused.
  bool ensure(DType dtype, const std::vector<int64_t>& shape, const void* avoid_begin = nullptr,
              const void* avoid_end = nullptr);
  /// Back to "no tensor", memory freed.
  void reset();

  /// Same dtype, shape and bytes (two undefined buffers are equal).
  friend bool operator==(const Buffer& a, const Buffer& b);
  friend bool operator!=(const Buffer& a, const Buffer& b) { return !(a == b); }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  bool defined_ = false;
  DType dtype_ = DType::kUInt8;
  std::vector<int64_t> shape_;
  std::unique_ptr<void, Free> data_;
  std::unique_ptr<void, Free> retired_;  ///< the memory an overlapping input still views
  int64_t capacity_ = 0;  ///< bytes allocated
};

}  // namespace kvcache
