// SPDX-License-Identifier: Apache-2.0
#include "kvcache/study/memory.h"

#include <ATen/CPUGeneratorImpl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kvcache/cache_scheme.h"
#include "kvcache/error.h"
#include "kvcache/quantizer.h"
#include "kvcache/spec.h"
#include "kvcache/torch/tensor_view.h"
#include "common/file_io.h"

namespace kvcache::study {
namespace {

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

/// The largest model config read (a Hugging Face config.json is a few KiB).
constexpr int64_t kMaxConfigBytes = int64_t{1} << 20;

/// A config.json field in [1, kMaxShapeField] (no model comes near; products of three such
/// fields stay far inside int64).
int64_t get_int(const nlohmann::json& j, const char* key, const std::string& path) {
  KV_CHECK_ARG(j.contains(key) && j[key].is_number(), "config '", path, "': missing integer field '", key, "'");
  const nlohmann::json& v = j[key];
  // nlohmann keeps integers beyond uint64 as floats: every number is checked as a double.
  const double d = v.is_number_unsigned() ? static_cast<double>(v.get<uint64_t>())
                   : v.is_number_integer() ? static_cast<double>(v.get<int64_t>())
                                           : v.get<double>();
  KV_CHECK_ARG(d == std::floor(d), "config '", path, "': ", key, " = ", v.dump(), " is not an integer");
  KV_CHECK_ARG(d >= 1 && d <= static_cast<double>(kMaxShapeField), "config '", path, "': ", key, " = ", v.dump(),
               " is out of range [1, ", kMaxShapeField, "]");
  return static_cast<int64_t>(d);
}

}  // namespace

std::vector<std::string> model_shape_presets() { return {"qwen2.5-0.5b", "qwen2.5-7b", "llama-3-8b"}; }

ModelShape model_shape_preset(const std::string& name) {
  if (name == "qwen2.5-0.5b") return {name, 24, 14, 2, 64};
  if (name == "qwen2.5-7b") return {name, 28, 28, 4, 128};
  if (name == "llama-3-8b") return {name, 32, 32, 8, 128};
  throw InvalidArgument("unknown model preset '" + name +
                        "' (expected qwen2.5-0.5b, qwen2.5-7b, llama-3-8b, or a config.json path)");
}

ModelShape model_shape_from_config(const std::string& path) {
  // A Hugging Face config.json is a few KiB: a FIFO, a device or a huge file is refused before
  // anything is read.
  const std::string text = io::read_regular_file(path, "model config", kMaxConfigBytes);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(detail::str_cat("model config '", path, "' is not valid JSON: ", e.what()));
  }
  ModelShape s;
  s.name = j.value("model_type", std::string("model")) + " (" + path + ")";
  s.num_layers = get_int(j, "num_hidden_layers", path);
  s.num_q_heads = get_int(j, "num_attention_heads", path);
  s.num_kv_heads = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                       ? get_int(j, "num_key_value_heads", path)
                       : s.num_q_heads;
  if (j.contains("head_dim") && !j["head_dim"].is_null()) {
    s.head_dim = get_int(j, "head_dim", path);
  } else {
    const int64_t hidden = get_int(j, "hidden_size", path);
    KV_CHECK_ARG(s.num_q_heads > 0 && hidden % s.num_q_heads == 0, "config '", path, "': hidden_size ",
                 hidden, " is not divisible by num_attention_heads ", s.num_q_heads);
    s.head_dim = hidden / s.num_q_heads;
  }
  KV_CHECK_ARG(s.num_layers > 0 && s.num_kv_heads > 0 && s.head_dim > 0, "config '", path,
               "': layers, KV heads and head_dim must be positive");
  return s;
}

ModelShape resolve_model_shape(const std::string& name_or_path) {
  for (const auto& p : model_shape_presets()) {
    if (p == name_or_path) return model_shape_preset(p);
  }
  if (is_dir(name_or_path)) return model_shape_from_config(name_or_path + "/config.json");
  struct stat st {};
  if (::stat(name_or_path.c_str(), &st) == 0) return model_shape_from_config(name_or_path);  // any file: checked there
  return model_shape_preset(name_or_path);  // throws, listing the presets
}

namespace {

struct StreamBits {
  double raw = 0;
  double effective = 0;
  int64_t per_tensor_bytes = 0;
};

/// Measures one stream's quantizer on a sample of 256 tokens (a multiple of g per channel).
StreamBits measure_stream(const Quantizer* q, int64_t head_dim) {
  int64_t tokens = 256;
  const int64_t g = q->stored_layout(head_dim).group_tokens;  // tokens encoded together
  tokens = g * ((tokens + g - 1) / g);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  const at::Tensor x = at::randn({1, 1, tokens, head_dim}, gen, at::TensorOptions().dtype(at::kFloat));
  const QuantizedTensor qt = q->quantize(x);
  const double values = static_cast<double>(qt.numel());
  StreamBits b;
  b.raw = static_cast<double>(qt.codes.nbytes()) * 8.0 / values;
  b.effective = q->bits_per_value(head_dim);
  const double extra = static_cast<double>(qt.nbytes()) - b.effective * values / 8.0;
  b.per_tensor_bytes = extra > 0.5 ? static_cast<int64_t>(std::llround(extra)) : 0;
  return b;
}

}  // namespace

KvFormat kv_format(const std::string& spec, int64_t head_dim, int64_t num_layers) {
  KV_CHECK_ARG(head_dim > 0, "kv_format: head_dim must be > 0, got ", head_dim);
  KV_CHECK_ARG(num_layers >= 1 && num_layers <= kMaxShapeField, "kv_format: num_layers must be in [1, ", kMaxShapeField,
               "], got ", num_layers);
  const auto scheme = make_cache_scheme(spec);
  KvFormat f;
  f.spec = scheme->spec();
  f.key_raw_bits = f.value_raw_bits = f.key_bits = f.value_bits = 0;
  // One KV head of each of the num_layers layers, averaged (a scheme whose layers differ:
  // layers(...), calibrated ones).
  const int64_t measured = num_layers;
  std::map<std::string, StreamBits> seen;  // quantizer spec -> its bits (measured once)
  auto bits_of = [&](const Quantizer* q) {
    auto it = seen.find(q->spec());
    if (it == seen.end()) it = seen.emplace(q->spec(), measure_stream(q, head_dim)).first;
    return it->second;
  };
  for (int64_t l = 0; l < measured; ++l) {
    const LayerStreams streams = scheme->streams(CacheGeometry{num_layers, 1, head_dim}, l, 0);
    const StreamBits k = bits_of(streams.key.quantizer.get());
    const StreamBits v = bits_of(streams.value.quantizer.get());
    if (l == 0) {
      f.key_residual_tokens = streams.key.residual;
      f.value_residual_tokens = streams.value.residual;
      f.residual_bits = 8.0 * static_cast<double>(dtype_size(streams.key.residual_dtype));
    }
    KV_CHECK_ARG(streams.key.residual == f.key_residual_tokens && streams.value.residual == f.value_residual_tokens &&
                     8.0 * static_cast<double>(dtype_size(streams.key.residual_dtype)) == f.residual_bits,
                 "kv_format('", spec, "'): layer ", l, " keeps a residual of ", streams.key.residual, "/",
                 streams.value.residual, " K/V tokens, layer 0 ", f.key_residual_tokens, "/", f.value_residual_tokens,
                 " (the memory table assumes one residual for every layer)");
    f.key_raw_bits += k.raw;
    f.value_raw_bits += v.raw;
    f.key_bits += k.effective;
    f.value_bits += v.effective;
    f.per_tensor_bytes = std::max({f.per_tensor_bytes, k.per_tensor_bytes, v.per_tensor_bytes});
  }
  const double n = static_cast<double>(measured);  // sums then one division: exact for equal layers
  f.key_raw_bits /= n;
  f.value_raw_bits /= n;
  f.key_bits /= n;
  f.value_bits /= n;
  return f;
}

MemoryEstimate estimate_kv_memory(const ModelShape& s, const KvFormat& f, int64_t tokens, int64_t batch) {
  KV_CHECK_ARG(s.num_layers > 0 && s.num_kv_heads > 0 && s.head_dim > 0, "model shape '", s.name,
               "' needs positive layers/KV heads/head_dim, got ", s.num_layers, "/", s.num_kv_heads, "/",
               s.head_dim);
  KV_CHECK_ARG(s.num_layers <= kMaxShapeField && s.num_kv_heads <= kMaxShapeField && s.head_dim <= kMaxShapeField,
               "model shape '", s.name, "': layers/KV heads/head_dim must be <= ", kMaxShapeField, ", got ",
               s.num_layers, "/", s.num_kv_heads, "/", s.head_dim);
  KV_CHECK_ARG(tokens >= 0 && tokens <= kMaxTokens, "context length ", tokens, " tokens is out of range [0, ",
               kMaxTokens, "]");
  KV_CHECK_ARG(batch >= 1 && batch <= kMaxBatch, "batch ", batch, " is out of range [1, ", kMaxBatch, "]");
  const double per_token_values = static_cast<double>(s.num_layers) * static_cast<double>(s.num_kv_heads) *
                                  static_cast<double>(s.head_dim);  // per K or V
  const double t = static_cast<double>(tokens);
  const double b = static_cast<double>(batch);
  const double res_k = static_cast<double>(std::min<int64_t>(tokens, f.key_residual_tokens));
  const double res_v = static_cast<double>(std::min<int64_t>(tokens, f.value_residual_tokens));
  MemoryEstimate m;
  m.tokens = tokens;
  m.batch = batch;
  m.raw_bytes = b * per_token_values * t * (f.key_raw_bits + f.value_raw_bits) / 8.0;
  m.effective_bytes = b * per_token_values *
                          ((t - res_k) * f.key_bits + (t - res_v) * f.value_bits + (res_k + res_v) * f.residual_bits) / 8.0 +
                      (tokens > 0 ? b * static_cast<double>(s.num_layers) * 2.0 * static_cast<double>(f.per_tensor_bytes) : 0.0);
  const double values = b * per_token_values * t * 2.0;
  m.raw_bits_per_value = values > 0 ? m.raw_bytes * 8.0 / values : 0.0;
  m.effective_bits_per_value = values > 0 ? m.effective_bytes * 8.0 / values : 0.0;
  return m;
}

std::string format_gb(double bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f GB", bytes / 1e9);
  return buf;
}

std::string format_mib(double bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1024.0 * 1024.0));
  return buf;
}

std::string memory_table_markdown(const ModelShape& shape, const std::vector<KvFormat>& formats,
                                  const std::vector<int64_t>& contexts, int64_t batch) {
  std::ostringstream os;
  const double fp16_per_token = 2.0 * 2.0 * static_cast<double>(shape.num_layers) *
                                static_cast<double>(shape.num_kv_heads) * static_cast<double>(shape.head_dim);
  os << "KV cache of " << shape.name << ": " << shape.num_layers << " layers x " << shape.num_kv_heads
     << " KV heads x head_dim " << shape.head_dim << ", batch " << batch << "; fp16 "
     << static_cast<int64_t>(fp16_per_token) << " B/token (" << fp16_per_token / 1024.0 << " KiB)\n\n";
  os << "| format | tokens | raw B/token | raw | raw MiB | effective | effective MiB | eff. bits/value | x vs fp16 (eff.) |\n";
  os << "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& f : formats) {
    for (int64_t ctx : contexts) {
      const auto m = estimate_kv_memory(shape, f, ctx, batch);
      char line[512];
      const double per_token = ctx > 0 ? m.raw_bytes / static_cast<double>(ctx) / static_cast<double>(batch) : 0;
      const double ratio = m.effective_bytes > 0
                               ? fp16_per_token * static_cast<double>(ctx) * static_cast<double>(batch) / m.effective_bytes
                               : 0;
      std::snprintf(line, sizeof line, "| %s | %lld | %.0f | %s | %s | %s | %s | %.3f | %.2fx |\n", f.spec.c_str(),
                    static_cast<long long>(ctx), per_token, format_gb(m.raw_bytes).c_str(),
                    format_mib(m.raw_bytes).c_str(), format_gb(m.effective_bytes).c_str(),
                    format_mib(m.effective_bytes).c_str(), m.effective_bits_per_value, ratio);
      os << line;
    }
  }
  return os.str();
}

}  // namespace kvcache::study
