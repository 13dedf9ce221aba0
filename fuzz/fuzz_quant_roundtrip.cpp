// SPDX-License-Identifier: Apache-2.0
// quantize -> dequantize on arbitrary bytes, and the raw per-head codec (encode/decode into
// buffers of exactly the stored layout's size, so that AddressSanitizer sees any overrun).
//
// Input: byte 0 picks the spec (kSpecs), byte 1 the dtype (float32/float16/bfloat16/float64),
// byte 2 the layout (bit 0: a transposed view, bit 1: every other token, i.e. non-contiguous
// strides), then B, H_kv, T and D (2 bytes each, small ranges; D from kHeadDims or any in
// [1, 160]), then the tensor's raw element bytes (cycled, or zeros, when short).
// Asserted: no crash, sanitizer report or leak; quantize() rejects only with a user error;
// dequantize(quantize(x)) has x's shape and dtype. (Finite output for finite input is
// asserted by the quantizer property tests, not here yet.)
#include <ATen/ATen.h>

#include <cstring>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch.h"

using namespace kvcache;

namespace {

const char* const kSpecs[] = {
    "fp32",        "fp16",          "bf16",          "fp8:e4m3",       "fp8:e5m2",        "fp8:e4m3:scaled",
    "fp8:e5m2:scaled", "int8",      "int4",          "int2",           "int8:g4",         "int4:g32",
    "int2:g32",    "int4:g16",      "int8:g32:chan", "int4:g32:chan",  "int2:g32:chan",   "int2:g4:chan",
    "int4:g64",    "int8:g1",       "int4:g128",     "int2:g8",        "int8:g2:chan",    "int4:g8:chan",
    // The 3-bit packing and the rotation-and-codebook formats (TurboQuant, PolarQuant): their
    // head-dim rules (a power of two; polar: a multiple of 16) are exercised by the free D.
    "int3",        "int3:g8:chan",  "tq:b4",         "tq:b3:nc",       "tq:b2.5",         "tq:b3:prod",
    "tq:b1",       "tq:b3.5:nc",    "tq:b2:prod:nc", "polar",
};
constexpr size_t kNumSpecs = sizeof(kSpecs) / sizeof(kSpecs[0]);
const int64_t kHeadDims[] = {1, 2, 4, 8, 16, 32, 64, 128};
const at::ScalarType kDtypes[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble};

/// Fills a contiguous tensor with the input's bytes (cycled), or zeros if there are none.
void fill(at::Tensor& t, const uint8_t* bytes, size_t n) {
  auto* dst = static_cast<uint8_t*>(t.data_ptr());
  const size_t total = static_cast<size_t>(t.numel()) * t.element_size();
  if (total == 0) return;
  if (n == 0) {
    std::memset(dst, 0, total);
    return;
  }
  for (size_t off = 0; off < total; off += n) std::memcpy(dst + off, bytes, std::min(n, total - off));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Bytes in(data, size);
  const std::string spec = kSpecs[in.u8() % kNumSpecs];
  const at::ScalarType dtype = kDtypes[in.u8() % 4];
  const uint8_t layout = in.u8();
  const int64_t b = in.range(1, 2), h = in.range(1, 3), t = in.range(0, 80);
  const uint16_t dsel = in.u16();
  const int64_t d = (dsel & 1) ? kHeadDims[(dsel >> 1) % 8] : 1 + (dsel >> 1) % 160;

  const auto q = make_quantizer(spec);  // a fixed, valid spec
  // The physical tensor, then the view quantize() gets.
  const bool transposed = layout & 1, strided = layout & 2;
  const int64_t t_phys = strided ? 2 * t : t;
  at::Tensor phys = transposed ? at::empty({b, h, d, t_phys}, at::TensorOptions().dtype(dtype))
                               : at::empty({b, h, t_phys, d}, at::TensorOptions().dtype(dtype));
  fill(phys, in.data(), in.remaining());
  at::Tensor x = transposed ? phys.transpose(2, 3) : phys;
  if (strided) x = x.slice(2, 0, t_phys, 2);

  QuantizedTensor qt;
  if (fuzz::accepts("quantize", [&] { qt = q->quantize(x); })) {
    KV_FUZZ_CHECK(qt.format == q->spec(), "quantize", spec, ": format '", qt.format, "'");
    KV_FUZZ_CHECK(qt.numel() == x.numel() && qt.nbytes() >= 0, "quantize", spec, ": numel ", qt.numel(), " of ",
                  x.numel(), ", nbytes ", qt.nbytes());
    at::Tensor y;
    KV_FUZZ_CHECK(fuzz::accepts("dequantize", [&] { y = kvcache::dequantize(*q, qt); }), "dequantize", spec,
                  " rejected what quantize() produced for ", x.sizes());
    KV_FUZZ_CHECK(y.sizes() == x.sizes() && y.scalar_type() == x.scalar_type(), "dequantize", spec, ": ",
                  y.sizes(), " ", y.scalar_type(), " for ", x.sizes(), " ", x.scalar_type());
  }

  // The raw codec on head (0, 0) as float32 (encode() never throws for finite input).
  if (t == 0) return 0;
  const at::Tensor head = x.select(0, 0).select(0, 0).to(at::kFloat).contiguous();  // [T, D]
  if (!head.isfinite().all().item<bool>()) return 0;  // encode() takes finite float32 only
  StoredLayout lay;
  if (!fuzz::accepts("stored_layout", [&] { lay = q->stored_layout(d); })) return 0;
  if (t % lay.group_tokens != 0) return 0;
  const int64_t groups = t / lay.group_tokens;
  std::vector<uint8_t> codes(static_cast<size_t>(groups * lay.code_bytes));
  const size_t meta = static_cast<size_t>(groups * lay.meta_count) * static_cast<size_t>(kvcache::dtype_size(lay.meta_dtype));
  std::vector<uint8_t> scales(meta), zeros(lay.has_zeros ? meta : 0);
  const float tensor_scale = q->fit_tensor_scale(head);
  GroupBuffers out{codes.data(), meta ? scales.data() : nullptr, lay.has_zeros && meta ? zeros.data() : nullptr};
  (void)q->encode(head.data_ptr<float>(), groups, d, tensor_scale, out);
  std::vector<float> decoded(static_cast<size_t>(t * d));
  q->decode(ConstGroupBuffers{out.codes, out.scales, out.zeros}, groups, d, tensor_scale, decoded.data());
  return 0;
}
