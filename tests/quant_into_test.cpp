// SPDX-License-Identifier: Apache-2.0
// Quantizer::quantize_into / dequantize_into: bit-identical to quantize()/dequantize() for
// every contract spec and input dtype, writing into the caller's tensors when they fit
// (same data pointers on a repeated call), never into memory shared with the input, and
// reallocating what does not fit.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstring>
#include <functional>
#include <limits>
#include <string>

#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch.h"
#include "quant_test_util.h"

namespace {

using kvcache::make_quantizer;
using kvcache::QuantizedTensor;

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), static_cast<size_t>(ca.numel() * ca.element_size())) == 0;
}

void expect_same(const QuantizedTensor& a, const QuantizedTensor& b, const std::string& what) {
  EXPECT_EQ(a.format, b.format) << what;
  EXPECT_EQ(a.shape, b.shape) << what;
  EXPECT_EQ(a.dtype, b.dtype) << what;
  EXPECT_TRUE(same_bytes(as_tensor(a.codes), as_tensor(b.codes))) << what << ": codes";
  EXPECT_TRUE(same_bytes(as_tensor(a.scales), as_tensor(b.scales))) << what << ": scales";
  EXPECT_TRUE(same_bytes(as_tensor(a.zeros), as_tensor(b.zeros))) << what << ": zeros";
  EXPECT_EQ(a.side.size(), b.side.size()) << what;
}

TEST(QuantizeInto, BitIdenticalAndReusesTheCallersTensors) {
  for (const std::string& spec : kvcache::testing::contract_specs()) {
    auto q = make_quantizer(spec);
    for (const at::ScalarType dt : {at::kFloat, at::kHalf, at::kBFloat16}) {
      const at::Tensor x1 = kvcache::testing::outlier_kv({1, 2, 64, 64}, 1).to(dt);
      const at::Tensor x2 = kvcache::testing::outlier_kv({1, 2, 64, 64}, 2).to(dt);
      const std::string what = spec + " " + std::string(c10::toString(dt));
      QuantizedTensor out;
      q->quantize_into(x1, out);
      expect_same(out, q->quantize(x1), what + " first call");
      const void* codes = out.codes.data();
      const void* scales = as_tensor(out.scales).defined() ? out.scales.data() : nullptr;
      q->quantize_into(x2, out);
      expect_same(out, q->quantize(x2), what + " second call");
      EXPECT_EQ(out.codes.data(), codes) << what << ": codes reallocated";
      if (scales != nullptr) {
        EXPECT_EQ(out.scales.data(), scales) << what << ": scales reallocated";
      }

      at::Tensor y;
      kvcache::dequantize_into(*q, out, y);
      const at::Tensor want = kvcache::dequantize(*q, out);
      EXPECT_TRUE(same_bytes(y, want)) << what << ": dequantize_into";
      const void* yp = y.data_ptr();
      kvcache::dequantize_into(*q, out, y);
      EXPECT_TRUE(same_bytes(y, want)) << what << ": dequantize_into again";
      if (dt == at::kFloat) {
        EXPECT_EQ(y.data_ptr(), yp) << what << ": output reallocated";
      }
    }
  }
}

TEST(QuantizeInto, ShapeChangeReallocatesAndStaysCorrect) {
  for (const std::string spec : {"int4:g32", "int2:g32:chan", "fp8:e4m3:scaled", "fp16"}) {
    auto q = make_quantizer(spec);
    QuantizedTensor out;
    q->quantize_into(kvcache::testing::randn_kv({1, 2, 64, 64}, 3), out);
    const at::Tensor bigger = kvcache::testing::randn_kv({1, 2, 128, 64}, 4);
    q->quantize_into(bigger, out);
    expect_same(out, q->quantize(bigger), spec);
    at::Tensor y = at::zeros({3});  // wrong shape: replaced
    kvcache::dequantize_into(*q, out, y);
    EXPECT_TRUE(same_bytes(y, kvcache::dequantize(*q, out))) << spec;
  }
}

TEST(QuantizeInto, FallsBackToFp32MetadataAndBackToFp16) {
  // A group past fp16's range keeps its metadata in fp32 (as quantize() does); the next call
  // with ordinary values is fp16 again, both identical to quantize().
  auto q = make_quantizer("int4:g32");
  at::Tensor big = kvcache::testing::randn_kv({1, 1, 4, 64}, 5);
  big[0][0][1][7] = 1e6f;
  QuantizedTensor out;
  q->quantize_into(big, out);
  EXPECT_EQ(as_tensor(out.scales).scalar_type(), at::kFloat);
  expect_same(out, q->quantize(big), "fp32 metadata");
  const at::Tensor small = kvcache::testing::randn_kv({1, 1, 4, 64}, 6);
  q->quantize_into(small, out);
  EXPECT_EQ(as_tensor(out.scales).scalar_type(), at::kHalf);
  expect_same(out, q->quantize(small), "fp16 metadata");
}

TEST(QuantizeInto, NeverWritesIntoTheInput) {
  // fp32 codes of the same shape as x: handing the output's own codes as x must not make the
  // cache write into the caller's input (the codes are reallocated, the input read intact).
  auto q = make_quantizer("fp32");
  QuantizedTensor out;
  q->quantize_into(kvcache::testing::randn_kv({1, 2, 8, 64}, 7), out);
  const at::Tensor x = as_tensor(out.codes);  // the input is the output's memory
  const at::Tensor keep = x.clone();
  const void* codes = out.codes.data();
  q->quantize_into(x, out);
  EXPECT_NE(out.codes.data(), codes);
  EXPECT_TRUE(same_bytes(x, keep));  // the input stays valid and unchanged until the next call
  EXPECT_TRUE(same_bytes(as_tensor(out.codes), keep));
  at::Tensor y = as_tensor(out.codes);  // the output may not be the codes it decodes either
  kvcache::dequantize_into(*q, out, y);
  EXPECT_NE(y.data_ptr(), out.codes.data());
  EXPECT_TRUE(same_bytes(y, keep));
}

TEST(QuantizeInto, SameErrorsAsQuantize) {
  auto q = make_quantizer("int8:g32");
  QuantizedTensor out;
  at::Tensor x = kvcache::testing::randn_kv({1, 1, 2, 64}, 8);
  x[0][0][1][5] = std::numeric_limits<float>::quiet_NaN();
  try {
    q->quantize_into(x, out);
    FAIL() << "NaN accepted";
  } catch (const kvcache::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("[int8:g32]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[0, 0, 1, 5]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(q->quantize_into(at::zeros({2, 64}), out), kvcache::InvalidArgument);
  QuantizedTensor other = make_quantizer("int4")->quantize(kvcache::testing::randn_kv({1, 1, 2, 64}, 9));
  at::Tensor y;
  EXPECT_THROW(kvcache::dequantize_into(*q, other, y), kvcache::InvalidArgument);
}

/// The message of a rejected *_into call names that call, as the user wrote it, wherever the
/// check runs (the shared validation, a quantizer's own input check, or its kernel's NaN scan).
std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const kvcache::InvalidArgument& e) {
    return e.what();
  }
  return "(nothing thrown)";
}

TEST(QuantizeInto, ErrorsNameTheCallMade) {
  QuantizedTensor out;
  at::Tensor y;
  for (const std::string spec : {"int8:g32", "int4", "fp8:e4m3", "fp8:e4m3:scaled", "fp16"}) {
    const auto q = make_quantizer(spec);
    at::Tensor x = kvcache::testing::randn_kv({1, 1, 2, 64}, 8);
    x[0][0][1][5] = std::numeric_limits<float>::quiet_NaN();
    const std::string into = "quantize_into(x, out) [" + spec + "]: ";
    EXPECT_EQ(message_of([&] { q->quantize_into(x, out); }).rfind(into, 0), 0u)
        << message_of([&] { q->quantize_into(x, out); });
    EXPECT_EQ(message_of([&] { (void)q->quantize(x); }).rfind("quantize(x) [" + spec + "]: ", 0), 0u)
        << message_of([&] { (void)q->quantize(x); });
    EXPECT_EQ(message_of([&] { q->quantize_into(at::zeros({2, 64}), out); }).rfind(into, 0), 0u);
    const QuantizedTensor other = make_quantizer("int2")->quantize(kvcache::testing::randn_kv({1, 1, 2, 64}, 9));
    EXPECT_EQ(message_of([&] { kvcache::dequantize_into(*q, other, y); }).rfind("dequantize_into(q, out) [" + spec + "]: ", 0),
              0u)
        << message_of([&] { kvcache::dequantize_into(*q, other, y); });
  }
  // A quantizer's own input check: head_dim 48 is not a multiple of int4:g32's group.
  const auto q = make_quantizer("int4:g32");
  const std::string msg = message_of([&] { q->quantize_into(at::zeros({1, 1, 2, 48}), out); });
  EXPECT_EQ(msg.rfind("quantize_into(x, out) [int4:g32]: head_dim D = 48", 0), 0u) << msg;
}

}  // namespace
