// SPDX-License-Identifier: Apache-2.0
// A downstream program linking kvcache::kvcache: the at::Tensor face over the installed core.
// Prints the bits per value an int4:g32 cache stores for head_dim 64 (5.00: 4 + 2·16/32).
#include <kvcache/cache_manager.h>
#include <kvcache/torch.h>

#include <ATen/ATen.h>

#include <cstdio>

int main() {
  kvcache::CacheConfig c;
  c.num_layers = 2;
  c.num_q_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.scheme = "int4:g32";
  c.rope = kvcache::rotate_half_rope(10000.0);
  kvcache::TorchCache cache(c);
  const int64_t t = 96;
  for (int64_t l = 0; l < 2; ++l) {
    cache.append(l, at::randn({1, 2, t, 64}), at::randn({1, 2, t, 64}), at::arange(t, at::kLong));
    const at::Tensor out = cache.attend(l, at::randn({1, 4, 1, 64}), at::full({1}, t - 1, at::kLong));
    if (out.sizes() != at::IntArrayRef({1, 4, 1, 64})) return 1;
  }
  cache.end_step(kvcache::StepKind::kPrefillEnd);
  const auto s = cache.stats();
  std::printf("int4:g32 %.2f bits/value\n", 8.0 * static_cast<double>(s.bytes_resident) / (2.0 * t * 2 * 2 * 64));
  return 0;
}
