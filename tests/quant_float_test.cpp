// SPDX-License-Identifier: Apache-2.0
// fp32 / fp16 / bf16 storage quantizers.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch.h"
#include "quant/cast_kernels.h"
#include "quant/simd.h"
#include "quant_test_util.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;

TEST(FloatQuantizers, Fp32IsIdentity) {
  at::Tensor x = testing::outlier_kv({1, 2, 16, 64}, 1);
  auto q = make_quantizer("fp32");
  QuantizedTensor qt = q->quantize(x);
  EXPECT_EQ(as_tensor(qt.codes).scalar_type(), at::kFloat);
  EXPECT_EQ(qt.nbytes(), x.numel() * 4);
  EXPECT_TRUE(at::equal(kvcache::dequantize(*q, qt), x));
  EXPECT_NE(qt.codes.data(), x.data_ptr());
}

// Every binary16 bit pattern (zeros, subnormals, normals, ±Inf, NaNs) widens to the float32
// ATen's c10::Half gives, bit for bit, through the vectorized kernel (fp16_to_fp32, each ISA
// build of it) and the scalar helper. The kernel's loop must vectorize for this to be fast, and
// a change made for that (the normal/subnormal choice) must keep every value.
TEST(FloatQuantizers, Fp16WidensEveryBitPatternExactly) {
  std::vector<uint16_t> h(65536);
  for (uint32_t i = 0; i < 65536; ++i) h[i] = static_cast<uint16_t>(i);
  std::vector<float> out(65536, -1.0f);
  quant::fp16_to_fp32(h.data(), 65536, out.data());
  int64_t wrong = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    c10::Half half;
    half.x = h[i];
    const float want = static_cast<float>(half);
    uint32_t a, b, c;
    const float scalar = quant::fp16_to_float(h[i]);
    std::memcpy(&a, &out[i], 4);
    std::memcpy(&b, &want, 4);
    std::memcpy(&c, &scalar, 4);
    wrong += (a != b) + (c != b);
    if (a != b || c != b) ADD_FAILURE() << "fp16 bits 0x" << std::hex << i << ": kernel 0x" << a << ", scalar 0x" << c << ", ATen 0x" << b;
    if (wrong > 10) break;
  }
  EXPECT_EQ(wrong, 0);
}

TEST(FloatQuantizers, Fp16AndBf16AreRoundToNearestEvenCasts) {
  at::Tensor x = testing::outlier_kv({1, 2, 16, 64}, 2);
  for (auto [spec, dtype] : {std::pair{"fp16", at::kHalf}, std::pair{"bf16", at::kBFloat16}}) {
    auto q = make_quantizer(spec);
    QuantizedTensor qt = q->quantize(x);
    EXPECT_EQ(as_tensor(qt.codes).scalar_type(), dtype);
    EXPECT_EQ(qt.nbytes(), x.numel() * 2);
    EXPECT_TRUE(at::equal(kvcache::dequantize(*q, qt), x.to(dtype).to(at::kFloat))) << spec;
  }
  // 1 + 2^-11 is a tie between 1 and 1 + 2^-10 in fp16 → even (1).
  at::Tensor t = at::tensor({1.0f + 0.00048828125f, 1.0f + 3 * 0.00048828125f}).reshape({1, 1, 1, 2});
  at::Tensor y = kvcache::dequantize(*make_quantizer("fp16"), make_quantizer("fp16")->quantize(t));
  EXPECT_EQ(y[0][0][0][0].item<float>(), 1.0f);
  EXPECT_EQ(y[0][0][0][1].item<float>(), 1.0f + 2 * 0.0009765625f);
}

TEST(FloatQuantizers, Fp16RejectsValuesBeyondItsRange) {
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    at::Tensor x = at::zeros({1, 2, 4, 8}).to(dtype);
    x[0][1][2][3] = -1e5;
    try {
      make_quantizer("fp16")->quantize(x);
      FAIL() << "expected InvalidArgument";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("[0, 1, 2, 3]"));
      EXPECT_THAT(e.what(), HasSubstr("fp16's range ±65504"));
    }
    // bf16 holds it.
    EXPECT_NO_THROW(make_quantizer("bf16")->quantize(x));
  }
  EXPECT_NO_THROW(make_quantizer("fp16")->quantize(at::full({1, 1, 1, 2}, 65504.0f)));
}

TEST(FloatQuantizers, HalfInputToBf16AndBack) {
  at::Tensor x = testing::randn_kv({1, 2, 8, 64}, 3).to(at::kHalf);
  auto q = make_quantizer("bf16");
  at::Tensor y = kvcache::dequantize(*q, q->quantize(x));
  EXPECT_EQ(y.scalar_type(), at::kHalf);
  EXPECT_TRUE(at::equal(y, x.to(at::kBFloat16).to(at::kHalf)));
}

}  // namespace
}  // namespace kvcache
