// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file torch/attention.h
/// The at::Tensor face of attention (kvcache::torch target): the plain at::-ops reference that
/// every attention path of the project is held to, and the attention mass as a tensor.
/// Semantics: kvcache/attention.h.

#include <ATen/ATen.h>

#include "kvcache/attention.h"
#include "kvcache/torch/tensor_view.h"

namespace kvcache {

/// The reference attention: plain at:: ops (matmul, masked softmax, matmul), in float64
/// when q is float64, else float32.
/// @param q      `[B, H_q, T_q, D]` post-RoPE queries
/// @param k      `[B, H_kv, S, D]` post-RoPE keys
/// @param v      `[B, H_kv, S, D]` values
/// @param k_pos  int64 `[H_kv, S]` position of each key
/// @param q_pos  int64 `[T_q]` position of each query
/// @param probs  if not null, receives the probabilities `[B, H_q, T_q, S]`
/// @return `[B, H_q, T_q, D]` in the compute dtype. A key is visible iff k_pos ≤ q_pos.
/// @throws InvalidArgument naming the tensor whose shape or dtype does not fit.
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& k_pos, const at::Tensor& q_pos, at::Tensor* probs = nullptr);

/// `mass` as a `[H_kv, rows, T]` float32 tensor (a copy).
/// @throws InvalidArgument if it is empty or its heads hold different counts.
at::Tensor mass_tensor(const AttentionMass& mass);

}  // namespace kvcache
