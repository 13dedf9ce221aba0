// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file view.h
/// Views: how the core API (kvcache::core) sees a caller's tensors, with no framework type.
/// As FlashInfer's kernels and ggml do, a view is a pointer, a shape and strides in elements,
/// and an element type; it never owns memory and is valid as long as the caller's memory is.
/// Every tensor argument of the core takes one (K/V, queries, positions, outputs); the core
/// reads and writes through it in place (no copy of a contiguous float32 argument is made).
///
/// Letters and layouts as in kvcache/types.h: K/V `[B, H_kv, T, D]`, queries `[B, H_q, T_q, D]`,
/// positions int64 `[T]`. A view of rank r uses shape[0..r) and strides[0..r); a default view
/// (rank −1) stands for "no tensor" (an undefined at::Tensor) and is rejected where a tensor is
/// required, naming the argument.
///
/// A framework's tensor type converts implicitly where ViewTraits<T> is specialised for it:
/// kvcache/torch/tensor_view.h does so for at::Tensor, so the core's calls take at::Tensors
/// unchanged in a program that includes it. Such a view of a temporary tensor lives until the
/// end of the full expression: do not keep it.

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace kvcache {

/// Element types a view (and a core Buffer) may hold. K/V and queries take kFloat32,
/// kFloat16 or kBFloat16; positions kInt64; stored codes kUInt8. The others exist so that a
/// wrong argument is named in the error rather than unrepresentable.
enum class DType : uint8_t { kFloat32, kFloat16, kBFloat16, kFloat64, kUInt8, kInt8, kInt16, kInt32, kInt64, kBool };

/// Bytes per element (4, 2, 2, 8, 1, 1, 2, 4, 8, 1).
int64_t dtype_size(DType t);
/// The name error messages give a dtype — the one PyTorch prints, so that a message reads the
/// same through the core and the at::Tensor face: "Float" (float32), "Half" (float16),
/// "BFloat16", "Double" (float64), "Byte" (uint8), "Char" (int8), "Short" (int16), "Int"
/// (int32), "Long" (int64), "Bool".
const char* to_string(DType t);
/// True for the three dtypes K, V and queries may have: float32, float16, bfloat16.
inline bool is_kv_dtype(DType t) { return t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16; }

/// Largest rank a view holds (K/V are 4-D).
inline constexpr int kMaxViewRank = 4;

/// How a framework's tensor type `T` becomes a view: a specialisation with
///   static TensorView view(const T&)            (read-only arguments) and
///   static MutableTensorView mutable_view(T&)   (outputs written in place).
/// The primary template is empty: types without a specialisation do not convert.
template <class T>
struct ViewTraits {};

struct MutableTensorView;

/// A read-only view: `data` points at element [0, ..., 0]; element [i0, i1, ...] lies at
/// `data + Σ i_k · strides[k] · dtype_size(dtype)` bytes. Strides may be any non-negative
/// values (a broadcast stride of 0 is allowed for inputs).
struct TensorView {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  int rank = -1;  ///< −1: no tensor
  int64_t shape[kMaxViewRank] = {0, 0, 0, 0};
  int64_t strides[kMaxViewRank] = {0, 0, 0, 0};  ///< in elements

  TensorView() = default;
  /// A contiguous (row-major) view of `shape` (at most kMaxViewRank entries, each >= 0).
  TensorView(const void* p, DType t, std::initializer_list<int64_t> shape_in);
  TensorView(const void* p, DType t, const std::vector<int64_t>& shape_in);
  TensorView(const float* p, std::initializer_list<int64_t> shape_in) : TensorView(p, DType::kFloat32, shape_in) {}
  TensorView(const int64_t* p, std::initializer_list<int64_t> shape_in) : TensorView(p, DType::kInt64, shape_in) {}
  /// A framework tensor (ViewTraits<T>::view).
  template <class T, class = decltype(ViewTraits<std::decay_t<T>>::view(std::declval<const std::decay_t<T>&>()))>
  TensorView(const T& t) : TensorView(ViewTraits<std::decay_t<T>>::view(t)) {}  // NOLINT: implicit by design

  bool defined() const { return rank >= 0; }
  /// Size of dimension i (0 <= i < rank).
  int64_t size(int i) const { return shape[i]; }
  int64_t numel() const;
  /// True if the strides are the row-major strides of the shape (size-1 dims' strides ignored).
  bool is_contiguous() const;
  /// Byte address of the element at `index` (rank entries).
  const void* element(const int64_t* index) const;
  /// The shape as a vector (empty for a 0-D or undefined view).
  std::vector<int64_t> sizes() const { return std::vector<int64_t>(shape, shape + (rank > 0 ? rank : 0)); }
};

/// A view the core writes into (an output): as TensorView, over writable memory.
struct MutableTensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int rank = -1;
  int64_t shape[kMaxViewRank] = {0, 0, 0, 0};
  int64_t strides[kMaxViewRank] = {0, 0, 0, 0};

  MutableTensorView() = default;
  MutableTensorView(void* p, DType t, std::initializer_list<int64_t> shape_in);
  MutableTensorView(void* p, DType t, const std::vector<int64_t>& shape_in);
  MutableTensorView(float* p, std::initializer_list<int64_t> shape_in) : MutableTensorView(p, DType::kFloat32, shape_in) {}
  /// A framework tensor written in place (ViewTraits<T>::mutable_view).
  template <class T, class = decltype(ViewTraits<std::decay_t<T>>::mutable_view(std::declval<std::decay_t<T>&>()))>
  MutableTensorView(T& t) : MutableTensorView(ViewTraits<std::decay_t<T>>::mutable_view(t)) {}  // NOLINT

  operator TensorView() const;  // NOLINT: an output may be read
  bool defined() const { return rank >= 0; }
  int64_t size(int i) const { return shape[i]; }
  int64_t numel() const;
  bool is_contiguous() const;
  std::vector<int64_t> sizes() const { return std::vector<int64_t>(shape, shape + (rank > 0 ? rank : 0)); }
};

/// "[1, 2, 256, 64]": the one formatter of shapes in messages.
std::string shape_str(const std::vector<int64_t>& shape);
/// "[1, 2, 256, 64] float32" (or "undefined" for a view that is no tensor).
std::string shape_str(const TensorView& v);

}  // namespace kvcache
