// SPDX-License-Identifier: Apache-2.0
// The quantizer registry: one ParamTable per spec head, registered in one place, in the
// order `registered_quantizers()` lists them.
#include <functional>
#include <sstream>

#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "quant/float_quantizer.h"
#include "quant/fp8_quantizer.h"
#include "quant/int_quantizer.h"

namespace kvcache {
namespace {

using Factory = std::function<std::unique_ptr<Quantizer>(const ParsedSpec&)>;

struct Entry {
  ParamTable table;
  Factory make;
};

ParamDef group_param() {
  ParamDef g;
  g.key = "g";
  g.help = "group size: values sharing one fp16 scale and zero; 0 = head_dim (per-token only)";
  g.kind = ParamDef::Kind::kInt;
  g.default_value = 0;
  g.min_value = 0;
  g.max_value = 65536;
  return g;
}

ParamDef axis_param() {
  ParamDef a;
  a.key = "axis";
  a.help = "tok: groups along head_dim of one token; chan: groups of g tokens of one channel (KIVI keys)";
  a.kind = ParamDef::Kind::kChoice;
  a.choices = {"tok", "chan"};
  return a;
}

Entry int_entry(int bits, const std::string& help) {
  Entry e;
  e.table.head = "int" + std::to_string(bits);
  e.table.help = help;
  e.table.params = {group_param(), axis_param()};
  e.make = [bits](const ParsedSpec& p) -> std::unique_ptr<Quantizer> {
    const GroupAxis axis = p.choice("axis") == "chan" ? GroupAxis::kPerChannel : GroupAxis::kPerToken;
    return std::make_unique<quant::IntQuantizer>(bits, p.integer("g"), axis);
  };
  return e;
}

Entry float_entry(const std::string& head, at::ScalarType storage, const std::string& help) {
  Entry e;
  e.table.head = head;
  e.table.help = help;
  e.make = [head, storage](const ParsedSpec&) -> std::unique_ptr<Quantizer> {
    return std::make_unique<quant::FloatCastQuantizer>(storage, head);
  };
  return e;
}

Entry fp8_entry() {
  Entry e;
  e.table.head = "fp8";
  e.table.help =
      "8-bit float (OCP FP8: e4m3 max ±448, e5m2 max ±57344), round-to-nearest-even, saturating; "
      "as vLLM's fp8 KV cache";
  ParamDef fmt;
  fmt.key = "format";
  fmt.help = "e4m3: 4 exponent + 3 mantissa bits; e5m2: 5 + 2";
  fmt.kind = ParamDef::Kind::kChoice;
  fmt.choices = {"e4m3", "e5m2"};
  ParamDef scale;
  scale.key = "scale";
  scale.help = "unscaled: encode x as is; scaled: one fp32 per-tensor scale amax/max_finite, encode x/scale";
  scale.kind = ParamDef::Kind::kChoice;
  scale.choices = {"unscaled", "scaled"};
  e.table.params = {fmt, scale};
  e.make = [](const ParsedSpec& p) -> std::unique_ptr<Quantizer> {
    const auto format = p.choice("format") == "e5m2" ? quant::Fp8Format::kE5M2 : quant::Fp8Format::kE4M3;
    return std::make_unique<quant::Fp8Quantizer>(format, p.choice("scale") == "scaled");
  };
  return e;
}

const std::vector<Entry>& registry() {
  static const std::vector<Entry> entries = [] {
    std::vector<Entry> v;
    v.push_back(float_entry("fp32", at::kFloat, "float32, stored as is (identity; the unquantized baseline)"));
    v.push_back(float_entry("fp16", at::kHalf, "float16 cast (round-to-nearest-even); rejects |x| > 65504"));
    v.push_back(float_entry("bf16", at::kBFloat16, "bfloat16 cast (round-to-nearest-even)"));
    v.push_back(fp8_entry());
    v.push_back(int_entry(8, "8-bit asymmetric min-max group quantization, fp16 scale+zero per group"));
    v.push_back(int_entry(4, "4-bit asymmetric min-max group quantization, fp16 scale+zero per group, 2 codes/byte"
                             " (KIVI arXiv 2402.02750, HF quantized cache)"));
    v.push_back(int_entry(2, "2-bit asymmetric min-max group quantization, fp16 scale+zero per group, 4 codes/byte"
                             " (KIVI arXiv 2402.02750)"));
    return v;
  }();
  return entries;
}

}  // namespace

std::unique_ptr<Quantizer> make_quantizer(const std::string& spec) {
  const auto parts = split_spec(spec);
  for (const auto& e : registry()) {
    if (e.table.head == parts[0]) return e.make(ParsedSpec::parse(spec, e.table));
  }
  std::ostringstream heads;
  for (const auto& e : registry()) heads << (heads.tellp() > 0 ? ", " : "") << e.table.head;
  throw InvalidArgument(detail::str_cat("make_quantizer(spec): unknown quantizer '", parts[0], "' in spec '",
                                        spec, "'; registered: ", heads.str()));
}

std::vector<ParamTable> registered_quantizers() {
  std::vector<ParamTable> out;
  for (const auto& e : registry()) out.push_back(e.table);
  return out;
}

}  // namespace kvcache
