// SPDX-License-Identifier: Apache-2.0
// A RoPE over tensors as the core's hook (kvcache/torch/rope.h).
#include "kvcache/torch/rope.h"

#include <cstring>
#include <utility>

#include "kvcache/error.h"
#include "kvcache/view.h"

namespace kvcache {

RopeFn rope_from(TensorRopeFn fn) {
  if (!fn) return {};
  return [fn = std::move(fn)](float* x, int64_t heads, int64_t tokens, int64_t head_dim, const int64_t* positions) {
    const at::Tensor xt = at::from_blob(x, {1, heads, tokens, head_dim}, at::kFloat);
    const at::Tensor pt = at::from_blob(const_cast<int64_t*>(positions), {tokens}, at::kLong);
    const at::Tensor y = fn(xt, pt);
    KV_CHECK_ARG(y.defined() && y.sizes() == xt.sizes(), "CacheConfig.rope returned ",
                 y.defined() ? shape_str(y.sizes().vec()) : std::string("undefined"), " for input ",
                 shape_str(xt.sizes().vec()), " (expected the same shape)");
    const at::Tensor yc = y.to(at::kFloat).contiguous();
    if (yc.data_ptr<float>() != x) std::memcpy(x, yc.data_ptr<float>(), static_cast<size_t>(yc.numel()) * sizeof(float));
  };
}

}  // namespace kvcache
