// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/rope.h
/// A model's RoPE over at::Tensors as the core's hook (kvcache::torch target).

#include <ATen/ATen.h>

#include <functional>

#include "kvcache/cache_config.h"

namespace kvcache {

/// Rotary embedding over tensors: x `[B, H, T, D]` float32, positions int64 `[T]` → rotated x
/// (a model's RoPE: CausalLM::rope, or a test's).
using TensorRopeFn = std::function<at::Tensor(const at::Tensor& x, const at::Tensor& positions)>;

/// The core's RopeFn calling `fn` on the rows as a `[1, H, T, D]` float32 tensor and positions
/// `[T]`, and copying its result back (converted to float32). Null for a null `fn`.
/// The hook throws InvalidArgument when `fn` returns another shape (naming both).
RopeFn rope_from(TensorRopeFn fn);

}  // namespace kvcache
