// SPDX-License-Identifier: Apache-2.0
// Contract suite: every registered quantizer spec must honour the Quantizer interface.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>

#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/torch.h"
#include "quant_test_util.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;

/// Relative Frobenius error bound on N(0, 1) data, by spec family.
double error_bound(const std::string& spec) {
  // had(q): an orthonormal rotation keeps Frobenius norms, so the inner bound holds (N(0, 1)
  // rows stay N(0, 1) after H_D); fp32 inside picks up float rounding of the transform.
  if (spec == "had(fp32)") return 1e-6;
  if (spec.rfind("had(", 0) == 0) return error_bound(spec.substr(4, spec.size() - 5));
  if (spec == "fp32") return 0.0;
  if (spec == "fp16") return 1e-3;          // 2^-11 relative step
  if (spec == "bf16") return 5e-3;          // 2^-8
  if (spec.rfind("fp8:e4m3", 0) == 0) return 0.05;   // 2^-4 relative step / 2
  if (spec.rfind("fp8:e5m2", 0) == 0) return 0.10;   // 2^-3
  if (spec.rfind("int8", 0) == 0) return 0.012;       // range/255/√12 ≈ 0.006
  if (spec.rfind("int4", 0) == 0) return 0.17;        // range/15/√12 ≈ 0.1
  if (spec.rfind("int3", 0) == 0) return 0.35;        // range/7/√12 ≈ 0.21
  if (spec.rfind("int2", 0) == 0) return 0.70;        // range/3/√12 ≈ 0.45
  // TurboQuant: √(Lloyd–Max MSE per unit variance) of the rotated unit vector: b4 0.097, b3
  // 0.186, b1 0.603; prod at b3: √((π/2)·0.1175) ≈ 0.43 (the sketch's variance;
  // tests/quant_turboquant_test.cpp).
  if (spec == "tq:b4") return 0.12;
  if (spec == "tq:b3:nc") return 0.22;
  if (spec == "tq:b1") return 0.66;
  if (spec == "tq:b3:prod") return 0.48;
  if (spec == "tq:b2.5") return 0.3;  // √((0.1175 + 0.0345)/2) ≈ 0.28
  // 16 outlier channels at 3 bits, 48 at 2: √((16·0.0345 + 48·0.1175)/64) ≈ 0.31 without the gain of
  // choosing the group's highest-energy channels (measured ≈ 0.29 at D = 64).
  if (spec == "tq:b2:o16") return 0.35;
  if (spec == "polar") return 0.25;   // measured ≈ 0.18 at D = 64
  ADD_FAILURE() << "no bound for " << spec;
  return 0.0;
}

class QuantizerContract : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<Quantizer> q_ = make_quantizer(GetParam());
};

TEST_P(QuantizerContract, SpecRoundTripsThroughFactory) {
  EXPECT_EQ(q_->spec(), GetParam());  // the listed specs are canonical
  auto again = make_quantizer(q_->spec());
  EXPECT_EQ(again->spec(), q_->spec());
  EXPECT_EQ(again->bits_per_value(64), q_->bits_per_value(64));
  EXPECT_EQ(again->group_axis(), q_->group_axis());
  // A tensor quantized by one instance decodes with the other.
  at::Tensor x = testing::randn_kv({1, 2, 64, 64}, 1);
  EXPECT_TRUE(at::equal(kvcache::dequantize(*again, q_->quantize(x)), kvcache::dequantize(*q_, q_->quantize(x))));
}

TEST_P(QuantizerContract, ShapeAndDtypePreserved) {
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    at::Tensor x = testing::randn_kv({2, 3, 64, 64}, 2).to(dtype);
    QuantizedTensor qt = q_->quantize(x);
    EXPECT_EQ(qt.shape, (std::vector<int64_t>{2, 3, 64, 64}));
    EXPECT_EQ(qt.dtype, kvcache::dtype_of(dtype));
    EXPECT_EQ(qt.format, q_->spec());
    EXPECT_EQ(qt.numel(), 2 * 3 * 64 * 64);
    at::Tensor y = kvcache::dequantize(*q_, qt);
    EXPECT_EQ(y.sizes(), x.sizes()) << c10::toString(dtype);
    EXPECT_EQ(y.scalar_type(), dtype);
    EXPECT_TRUE(at::isfinite(y).all().item<bool>());
  }
  // Any strides: a transposed view quantizes like its contiguous copy.
  at::Tensor x = testing::randn_kv({1, 64, 2, 64}, 3).transpose(1, 2);  // [1, 2, 64, 64], strided
  ASSERT_FALSE(x.is_contiguous());
  EXPECT_TRUE(at::equal(kvcache::dequantize(*q_, q_->quantize(x)), kvcache::dequantize(*q_, q_->quantize(x.contiguous()))));
}


TEST_P(QuantizerContract, ErrorUnderBitWidthBound) {
  at::Tensor x = testing::randn_kv({2, 2, 128, 64}, 4);
  ReconstructionError e = reconstruction_error(*q_, x);
  EXPECT_LE(e.rel_fro, error_bound(GetParam())) << GetParam();
  if (GetParam() == "fp32") {
    EXPECT_EQ(e.max_abs, 0.0);
  } else {
    EXPECT_GT(e.rel_fro, 0.0);  // a lossy format that is not lossless here is a bug
  }
  // An all-zero tensor is exact in every format.
  ReconstructionError zero = reconstruction_error(*q_, at::zeros({1, 2, 64, 64}));
  EXPECT_EQ(zero.max_abs, 0.0);
  EXPECT_EQ(zero.rel_fro, 0.0);
}

TEST_P(QuantizerContract, NbytesAgreesWithBitsPerValue) {
  for (int64_t d : {64, 128}) {
    at::Tensor x = testing::randn_kv({1, 2, 64, d}, 5);
    QuantizedTensor qt = q_->quantize(x);
    const double expected = static_cast<double>(x.numel()) * q_->bits_per_value(d) / 8.0;
    // Per-tensor metadata (the fp32 fp8 scale) is excluded from bits_per_value.
    const double per_tensor = GetParam().find("scaled") != std::string::npos ? 4.0 : 0.0;
    EXPECT_EQ(static_cast<double>(qt.nbytes()), expected + per_tensor) << GetParam() << " D=" << d;
    // nbytes() is measured from the tensors held.
    int64_t held = as_tensor(qt.codes).numel() * static_cast<int64_t>(as_tensor(qt.codes).element_size());
    if (as_tensor(qt.scales).defined()) held += as_tensor(qt.scales).numel() * static_cast<int64_t>(as_tensor(qt.scales).element_size());
    if (as_tensor(qt.zeros).defined()) held += as_tensor(qt.zeros).numel() * static_cast<int64_t>(as_tensor(qt.zeros).element_size());
    EXPECT_EQ(qt.nbytes(), held);
  }
}

TEST_P(QuantizerContract, RejectsWrongRankAndDtype) {
  at::Tensor x = at::zeros({2, 64, 64});
  try {
    q_->quantize(x);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("x must be 4-D"));
    EXPECT_THAT(e.what(), HasSubstr("[2, 64, 64]"));
  }
  try {
    q_->quantize(at::zeros({1, 2, 64, 64}, at::kInt));
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("x has dtype Int"));
    EXPECT_THAT(e.what(), HasSubstr("float32"));
  }
  EXPECT_THROW(q_->quantize(at::zeros({1, 2, 64, 64}, at::kDouble)), InvalidArgument);
  EXPECT_THROW(q_->quantize(at::Tensor()), InvalidArgument);
}

TEST_P(QuantizerContract, RejectsNaNAndInfNamingFirstIndex) {
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    at::Tensor x = testing::randn_kv({2, 2, 64, 64}, 6).to(dtype);
    x[1][0][37][5] = std::numeric_limits<float>::quiet_NaN();
    x[1][1][2][3] = std::numeric_limits<float>::quiet_NaN();  // later in memory order
    try {
      q_->quantize(x);
      FAIL() << "expected InvalidArgument";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("NaN at [b, h, t, d] = [1, 0, 37, 5]")) << e.what();
    }
    at::Tensor y = testing::randn_kv({2, 2, 64, 64}, 7).to(dtype);
    y[0][1][63][63] = -std::numeric_limits<float>::infinity();
    try {
      q_->quantize(y);
      FAIL() << "expected InvalidArgument";
    } catch (const InvalidArgument& e) {
      EXPECT_THAT(e.what(), HasSubstr("-Inf at [b, h, t, d] = [0, 1, 63, 63]")) << e.what();
    }
  }
}

TEST_P(QuantizerContract, RejectsForeignFormat) {
  at::Tensor x = testing::randn_kv({1, 2, 64, 64}, 8);
  const std::string other = GetParam() == "int4" ? "int2" : "int4";
  QuantizedTensor foreign = make_quantizer(other)->quantize(x);
  try {
    kvcache::dequantize(*q_, foreign);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("q.format is '" + other + "'"));
  }
}


// A hand-built QuantizedTensor whose shape is not one quantize() makes — head_dim 0, a
// negative size, a shape its tensors do not have — is refused by dequantize() with an
// InvalidArgument (or, where the shape is consistent, decoded to that shape), never a crash
// (issue 39, fault 4: head_dim 0 divided by a zero group size in int's dequantize: SIGFPE).
TEST_P(QuantizerContract, HandBuiltShapesAreCheckedBeforeDecoding) {
  const QuantizedTensor valid = q_->quantize(testing::randn_kv({1, 2, 64, 64}, 10));
  const std::vector<std::vector<int64_t>> shapes = {
      {1, 2, 64, 0}, {1, 2, 0, 0}, {0, 0, 0, 0}, {1, 2, -64, 64}, {1, -2, 64, 64}, {1, 2, 64, 32}};
  for (const auto& shape : shapes) {
    for (const bool empty_tensors : {false, true}) {
      QuantizedTensor q = valid;
      q.shape = shape;
      if (empty_tensors) {  // tensors of no elements, as a zero-size shape would hold
        q.codes = Buffer(DType::kUInt8, {1, 2, 0, 0});
        if (q.scales.defined()) q.scales = Buffer(q.scales.dtype(), {0});
        if (q.zeros.defined()) q.zeros = Buffer(q.zeros.dtype(), {0});
      }
      const std::string what = GetParam() + " shape " + ::testing::PrintToString(shape) +
                               (empty_tensors ? " (empty tensors)" : "");
      for (const bool into : {false, true}) {
        try {
          at::Tensor y;
          if (into) {
            kvcache::dequantize_into(*q_, q, y);
          } else {
            y = kvcache::dequantize(*q_, q);
          }
          EXPECT_EQ(y.sizes().vec(), shape) << what << ": accepted, so it must decode to its shape";
        } catch (const InvalidArgument& e) {
          EXPECT_THAT(e.what(), HasSubstr(into ? "dequantize_into(q, out) [" : "dequantize(q) [")) << what;
          if (shape[3] == 0 && GetParam().rfind("int", 0) == 0 && GetParam().find(":g") == std::string::npos) {
            EXPECT_THAT(e.what(), HasSubstr("head_dim D = 0")) << what;
          }
        } catch (const std::exception& e) {
          ADD_FAILURE() << what << ": not an InvalidArgument: " << e.what();
        }
      }
    }
  }
}

TEST_P(QuantizerContract, DoesNotAliasInput) {
  at::Tensor x = testing::randn_kv({1, 2, 64, 64}, 9);
  QuantizedTensor qt = q_->quantize(x);
  at::Tensor before = kvcache::dequantize(*q_, qt);
  x.fill_(3.0);
  EXPECT_TRUE(at::equal(kvcache::dequantize(*q_, qt), before));
}

INSTANTIATE_TEST_SUITE_P(AllSpecs, QuantizerContract, ::testing::ValuesIn(testing::contract_specs()),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           std::string n;
                           for (char c : p.param) n += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
                           return n;
                         });

TEST(QuantizerRegistry, EveryRegisteredHeadIsInTheContractSuite) {
  std::set<std::string> heads;
  for (const auto& s : testing::contract_specs()) heads.insert(spec_head(s));
  const auto tables = registered_quantizers();
  ASSERT_GE(tables.size(), 7u);
  for (const auto& t : tables) EXPECT_TRUE(heads.count(t.head)) << t.head << " not covered";
}

TEST(QuantizerRegistry, RegistrationOrderAndHelp) {
  std::vector<std::string> heads;
  for (const auto& t : registered_quantizers()) {
    heads.push_back(t.head);
    EXPECT_FALSE(t.help.empty()) << t.head;
  }
  EXPECT_EQ(heads, (std::vector<std::string>{"fp32", "fp16", "bf16", "fp8", "int8", "int4", "int3", "int2", "tq", "polar"}));
}

TEST(QuantizerRegistry, UnknownHeadListsRegistered) {
  try {
    make_quantizer("int5:g64");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("unknown quantizer 'int5'"));
    EXPECT_THAT(e.what(), HasSubstr("fp32, fp16, bf16, fp8, int8, int4, int3, int2, tq, polar"));
  }
}

TEST(QuantizerRegistry, CanonicalForms) {
  EXPECT_EQ(make_quantizer("int4:g0")->spec(), "int4");
  EXPECT_EQ(make_quantizer("int4:tok:g32")->spec(), "int4:g32");
  EXPECT_EQ(make_quantizer("int2:chan:g32")->spec(), "int2:g32:chan");
  EXPECT_EQ(make_quantizer("fp8")->spec(), "fp8:e4m3");
  EXPECT_EQ(make_quantizer("fp8:scaled:e5m2")->spec(), "fp8:e5m2:scaled");
  EXPECT_EQ(make_quantizer("fp8:unscaled")->spec(), "fp8:e4m3");
}

TEST(QuantizerRegistry, BadFieldsAreRejected) {
  EXPECT_THROW(make_quantizer("fp16:g32"), InvalidArgument);
  EXPECT_THROW(make_quantizer("int4:g-4"), InvalidArgument);
  EXPECT_THROW(make_quantizer("int4:g7"), InvalidArgument);   // odd group cannot pair nibbles
  EXPECT_THROW(make_quantizer("int2:g6"), InvalidArgument);   // not a multiple of 4
  EXPECT_THROW(make_quantizer("int4:chan"), InvalidArgument); // per-channel needs g
  EXPECT_THROW(make_quantizer("fp8:e3m4"), InvalidArgument);
  EXPECT_THROW(make_quantizer("int4:g64@50%"), InvalidArgument);
  try {
    make_quantizer("int4:chan");
  } catch (const InvalidArgument& e) {
    EXPECT_THAT(e.what(), HasSubstr("int4:g32:chan"));
  }
}

TEST(QuantizerBitsPerValue, StudySeedFiguresAtHeadDim64) {
  EXPECT_EQ(make_quantizer("fp32")->bits_per_value(64), 32.0);
  EXPECT_EQ(make_quantizer("fp16")->bits_per_value(64), 16.0);
  EXPECT_EQ(make_quantizer("bf16")->bits_per_value(64), 16.0);
  EXPECT_EQ(make_quantizer("fp8:e4m3")->bits_per_value(64), 8.0);
  EXPECT_EQ(make_quantizer("fp8:e5m2:scaled")->bits_per_value(64), 8.0);
  EXPECT_EQ(make_quantizer("int8")->bits_per_value(64), 8.5);
  EXPECT_EQ(make_quantizer("int4")->bits_per_value(64), 4.5);
  EXPECT_EQ(make_quantizer("int2")->bits_per_value(64), 2.5);
  EXPECT_EQ(make_quantizer("int4:g32")->bits_per_value(64), 5.0);   // KIVI-4
  EXPECT_EQ(make_quantizer("int2:g32:chan")->bits_per_value(64), 3.0);  // KIVI-2 keys
  EXPECT_EQ(make_quantizer("int4")->bits_per_value(128), 4.25);
}

// Later formats (KVQuant outliers, GEAR low-rank factors) ride in `side`; memory stays measured.
TEST(QuantizedTensorApi, NbytesCountsEveryHeldTensorIncludingSide) {
  QuantizedTensor q;
  q.shape = {1, 2, 8, 64};
  EXPECT_EQ(q.numel(), 1024);
  EXPECT_EQ(q.nbytes(), 0);
  using kvcache::Buffer;
  using kvcache::DType;
  q.codes = Buffer::zeros(DType::kUInt8, {1, 2, 8, 32});                // 512
  q.scales = Buffer::zeros(DType::kFloat16, {1, 2, 8, 1});              // 32
  q.zeros = Buffer::zeros(DType::kFloat16, {1, 2, 8, 1});               // 32
  q.side["outlier_values"] = Buffer::zeros(DType::kFloat16, {10});      // 20
  q.side["outlier_index"] = Buffer::zeros(DType::kInt32, {10});         // 40
  q.side["lowrank_a"] = Buffer::zeros(DType::kFloat32, {1, 2, 8, 4});   // 256
  EXPECT_EQ(q.nbytes(), 512 + 32 + 32 + 20 + 40 + 256);
}

TEST(ReconstructionErrorApi, HandCheckedValues) {
  at::Tensor x = at::tensor({3.0f, 4.0f}).reshape({1, 1, 1, 2});
  ReconstructionError e = reconstruction_error(x, at::zeros_like(x));
  EXPECT_DOUBLE_EQ(e.rel_fro, 1.0);
  EXPECT_DOUBLE_EQ(e.max_abs, 4.0);
  e = reconstruction_error(x, at::tensor({3.0f, 3.0f}).reshape({1, 1, 1, 2}));
  EXPECT_DOUBLE_EQ(e.rel_fro, 0.2);
  EXPECT_DOUBLE_EQ(e.max_abs, 1.0);
  e = reconstruction_error(at::zeros({1, 1, 1, 2}), at::zeros({1, 1, 1, 2}));
  EXPECT_EQ(e.rel_fro, 0.0);
  e = reconstruction_error(at::zeros({1, 1, 1, 2}), at::ones({1, 1, 1, 2}));
  EXPECT_TRUE(std::isinf(e.rel_fro));
  EXPECT_THROW(reconstruction_error(x, at::zeros({1, 1, 2, 1})), InvalidArgument);
}

}  // namespace
}  // namespace kvcache
