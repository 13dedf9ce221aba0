// SPDX-License-Identifier: Apache-2.0
#include "quant/int_quantizer.h"

#include "kvcache/error.h"
#include "quant/checks.h"
#include "quant/int_kernels.h"

namespace kvcache::quant {

const ParamTable& IntQuantizer::table(int bits) {
  auto make = [](int b, const char* help) {
    ParamDef g;
    g.key = "g";
    g.help = "group size: values sharing one fp16 scale and zero; 0 = head_dim (per-token only); a multiple of " +
             std::to_string(codes_per_unit(b));
    g.kind = ParamDef::Kind::kInt;
    g.default_value = 0;
    g.min_value = 0;
    g.max_value = 65536;
    ParamDef a;
    a.key = "axis";
    a.help = "tok: groups along head_dim of one token; chan: groups of g tokens of one channel (KIVI keys)";
    a.kind = ParamDef::Kind::kChoice;
    a.choices = {"tok", "chan"};
    return ParamTable{"int" + std::to_string(b), help, {g, a}};
  };
  static const ParamTable t8 = make(8, "8-bit asymmetric min-max group quantization, fp16 scale+zero per group");
  static const ParamTable t4 = make(4,
                                    "4-bit asymmetric min-max group quantization, fp16 scale+zero per group, 2 codes/byte"
                                    " (KIVI arXiv 2402.02750, HF quantized cache)");
  static const ParamTable t3 = make(3,
                                    "3-bit asymmetric min-max group quantization, fp16 scale+zero per group, 8 codes in 3"
                                    " bytes (KIVI and KVQuant ablations, arXiv 2402.02750 / 2401.18079)");
  static const ParamTable t2 = make(2,
                                    "2-bit asymmetric min-max group quantization, fp16 scale+zero per group, 4 codes/byte"
                                    " (KIVI arXiv 2402.02750)");
  switch (bits) {
    case 8: return t8;
    case 4: return t4;
    case 3: return t3;
    case 2: return t2;
    default: break;
  }
  throw InvalidArgument(detail::str_cat("int quantizer: bits must be one of 2, 3, 4, 8, got ", bits));
}

IntQuantizer::IntQuantizer(int bits, int64_t group, GroupAxis axis) : bits_(bits), group_(group), axis_(axis) {
  (void)table(bits);  // validates bits
  KV_CHECK_ARG(group >= 0, "int", bits, ": group size g must be >= 0, got ", group);
  const int unit = codes_per_unit(bits);
  KV_CHECK_ARG(group % unit == 0, "int", bits, ":g", group, ": group size must be a multiple of ", unit, " (", unit,
               bits == 3 ? " codes are packed in 3 bytes within a group)" : " codes are packed per byte within a group)");
  KV_CHECK_ARG(axis == GroupAxis::kPerToken || group > 0, "int", bits,
               ":chan needs an explicit group size of tokens, e.g. 'int", bits, ":g32:chan'");
}

std::string IntQuantizer::spec() const {
  return canonical_spec(table(bits_), {{"g", static_cast<double>(group_)}},
                        {{"axis", axis_ == GroupAxis::kPerChannel ? "chan" : "tok"}});
}

int64_t IntQuantizer::group_for(int64_t head_dim) const { return group_ == 0 ? head_dim : group_; }

double IntQuantizer::bits_per_value(int64_t head_dim) const {
  KV_CHECK_ARG(head_dim > 0, "bits_per_value(head_dim) [", spec(), "]: head_dim must be > 0, got ", head_dim);
  // One fp16 scale + one fp16 zero (32 bits) per group.
  return bits_ + 32.0 / static_cast<double>(group_for(head_dim));
}

void IntQuantizer::check_input(const TensorView& x) const {
  const std::string where = "quantize(x) [" + spec() + "]";
  const int64_t t = x.size(2);
  const int64_t d = x.size(3);
  const int64_t g = group_for(d);
  if (axis_ == GroupAxis::kPerToken) {
    KV_CHECK_ARG(g > 0 && d % g == 0, where, ": head_dim D = ", d, " of x ", shape_str(x.sizes()),
                 " is not divisible by the group size g = ", g);
    KV_CHECK_ARG(g % codes_per_unit(bits_) == 0, where, ": group size g = head_dim = ", g, " must be a multiple of ",
                 codes_per_unit(bits_), " for ", bits_, "-bit packing");
  } else {
    KV_CHECK_ARG(t % g == 0, where, ": seq_len T = ", t, " of x ", shape_str(x.sizes()),
                 " is not divisible by the per-channel group size g = ", g, " tokens");
  }
}

void IntQuantizer::do_quantize_into(const Input& in, QuantizedTensor& q) const {
  const TensorView& x = in.x;
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  const int64_t g = group_for(d);
  const auto* xf = static_cast<const float*>(x.data);
  q.format = spec();
  q.side.clear();
  q.shape = x.sizes();
  q.dtype = in.dtype;
  const bool per_token = axis_ == GroupAxis::kPerToken;
  const std::vector<int64_t> code_shape =
      per_token ? std::vector<int64_t>{b, h, t, d * bits_ / 8} : std::vector<int64_t>{b, h, t * bits_ / 8, d};
  const std::vector<int64_t> meta_shape =
      per_token ? std::vector<int64_t>{b, h, t, d / g} : std::vector<int64_t>{b, h, t / g, d};
  q.codes.ensure(DType::kUInt8, code_shape, in.avoid_begin, in.avoid_end);

  auto run = [&](MetaType mt) {
    const DType meta_dtype = mt == MetaType::kHalf ? DType::kFloat16 : DType::kFloat32;
    q.scales.ensure(meta_dtype, meta_shape, in.avoid_begin, in.avoid_end);
    q.zeros.ensure(meta_dtype, meta_shape, in.avoid_begin, in.avoid_end);
    if (x.numel() == 0) return KernelStatus{};
    if (per_token) {
      return quantize_per_token(bits_, xf, x.numel() / g, g, q.codes.data_as<uint8_t>(), q.scales.data(),
                                q.zeros.data(), mt);
    }
    return quantize_per_channel(bits_, xf, b * h * (t / g), g, d, q.codes.data_as<uint8_t>(), q.scales.data(),
                                q.zeros.data(), mt);
  };
  KernelStatus st = run(MetaType::kHalf);
  const std::string where = "quantize(x) [" + spec() + "]";
  if (st.nonfinite) throw_first_nonfinite(x, where);
  if (st.meta_overflow) st = run(MetaType::kFloat);  // rare: keep metadata in fp32 (never overflows)
}

void IntQuantizer::do_dequantize_into(const QuantizedTensor& q, float* out) const {
  const int64_t b = q.shape[0], h = q.shape[1], t = q.shape[2], d = q.shape[3];
  const int64_t g = group_for(d);
  const bool per_token = axis_ == GroupAxis::kPerToken;
  const std::string where = "dequantize_into(q, out) [" + spec() + "]";
  // The shape first: the sizes below divide by the group size (a hand-built q of head_dim 0
  // would divide by zero).
  if (per_token) {
    KV_CHECK_ARG(g > 0 && d % g == 0, where, ": q.shape ", shape_str(q.shape), " has head_dim D = ", d,
                 ", expected a positive multiple of the group size g = ", g, group_ == 0 ? " (= D)" : "");
  } else {
    KV_CHECK_ARG(t % g == 0, where, ": q.shape ", shape_str(q.shape), " has seq_len T = ", t,
                 ", expected a multiple of the per-channel group size g = ", g, " tokens");
  }
  const std::vector<int64_t> code_shape =
      per_token ? std::vector<int64_t>{b, h, t, d * bits_ / 8} : std::vector<int64_t>{b, h, t * bits_ / 8, d};
  const std::vector<int64_t> meta_shape =
      per_token ? std::vector<int64_t>{b, h, t, d / g} : std::vector<int64_t>{b, h, t / g, d};
  KV_CHECK_ARG(q.codes.dtype() == DType::kUInt8 && q.codes.shape() == code_shape, where,
               ": q.codes must be contiguous uint8 of shape ", shape_str(code_shape), ", got ",
               to_string(q.codes.dtype()), " ", shape_str(q.codes.shape()));
  KV_CHECK_ARG(q.scales.defined() && q.zeros.defined() && q.scales.shape() == meta_shape &&
                   q.zeros.shape() == meta_shape && q.scales.dtype() == q.zeros.dtype() &&
                   (q.scales.dtype() == DType::kFloat16 || q.scales.dtype() == DType::kFloat32),
               where, ": q.scales and q.zeros must be contiguous fp16 (or fp32) of shape ", shape_str(meta_shape));
  const MetaType mt = q.scales.dtype() == DType::kFloat16 ? MetaType::kHalf : MetaType::kFloat;
  const int64_t n = q.numel();
  if (n == 0) return;
  if (per_token) {
    dequantize_per_token(bits_, q.codes.data_as<uint8_t>(), q.scales.data(), q.zeros.data(), mt, n / g, g, out);
  } else {
    dequantize_per_channel(bits_, q.codes.data_as<uint8_t>(), q.scales.data(), q.zeros.data(), mt, b * h * (t / g), g,
                           d, out);
  }
}

StoredLayout IntQuantizer::do_stored_layout(int64_t head_dim) const {
  const std::string where = "stored_layout(head_dim) [" + spec() + "]";
  StoredLayout l;
  l.axis = axis_;
  l.has_zeros = true;
  l.meta_dtype = DType::kFloat16;
  if (axis_ == GroupAxis::kPerToken) {
    const int64_t g = group_for(head_dim);
    KV_CHECK_ARG(head_dim % g == 0, where, ": head_dim D = ", head_dim, " is not divisible by the group size g = ", g);
    KV_CHECK_ARG(g % codes_per_unit(bits_) == 0, where, ": group size g = head_dim = ", g, " must be a multiple of ",
                 codes_per_unit(bits_), " for ", bits_, "-bit packing");
    l.group_tokens = 1;
    l.code_bytes = head_dim * bits_ / 8;
    l.meta_count = head_dim / g;
    l.kernel = KernelKind::kIntToken;
    l.kernel_group = g;
  } else {
    l.group_tokens = group_;
    l.code_bytes = group_ * bits_ / 8 * head_dim;
    l.meta_count = head_dim;
    l.kernel = KernelKind::kIntChannel;
    l.kernel_group = group_;
  }
  l.kernel_bits = bits_;
  return l;
}

EncodeStatus IntQuantizer::do_encode(const float* x, int64_t groups, int64_t head_dim, float /*tensor_scale*/,
                                     GroupBuffers out) const {
  KernelStatus st;
  if (axis_ == GroupAxis::kPerToken) {
    const int64_t g = group_for(head_dim);
    st = quantize_per_token(bits_, x, groups * (head_dim / g), g, out.codes, out.scales, out.zeros, MetaType::kHalf);
  } else {
    st = quantize_per_channel(bits_, x, groups, group_, head_dim, out.codes, out.scales, out.zeros, MetaType::kHalf);
  }
  EncodeStatus s;
  s.nonfinite = st.nonfinite;
  s.overflow = st.meta_overflow;
  return s;
}

void IntQuantizer::do_decode(ConstGroupBuffers in, int64_t groups, int64_t head_dim, float /*tensor_scale*/,
                             float* out) const {
  if (axis_ == GroupAxis::kPerToken) {
    const int64_t g = group_for(head_dim);
    dequantize_per_token(bits_, in.codes, in.scales, in.zeros, MetaType::kHalf, groups * (head_dim / g), g, out);
  } else {
    dequantize_per_channel(bits_, in.codes, in.scales, in.zeros, MetaType::kHalf, groups, group_, head_dim, out);
  }
}

}  // namespace kvcache::quant
