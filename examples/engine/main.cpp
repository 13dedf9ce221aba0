// An engine that stores its KV cache through libkvcache: quantize a K tensor on write,
// measure what it stores, and read it back.
#include <kvcache/error.h>
#include <kvcache/quantizer.h>

#include <cstdio>

int main() {
  try {
    // [B, H_kv, T, D] as in Qwen2.5-0.5B: 2 KV heads, head_dim 64.
    at::manual_seed(0);
    at::Tensor k = at::randn({1, 2, 128, 64});
    for (const char* spec : {"fp16", "int8", "int4:g32", "int2"}) {
      auto q = kvcache::make_quantizer(spec);
      kvcache::QuantizedTensor stored = q->quantize(k);
      auto err = kvcache::reconstruction_error(k, q->dequantize(stored));
      std::printf("%-10s %6.2f bits/value  %7lld bytes stored (fp32: %lld)  rel_err %.4f\n",
                  q->spec().c_str(), q->bits_per_value(64), static_cast<long long>(stored.nbytes()),
                  static_cast<long long>(k.numel() * 4), err.rel_fro);
    }
    return 0;
  } catch (const kvcache::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
