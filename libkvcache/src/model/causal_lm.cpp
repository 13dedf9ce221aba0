// SPDX-License-Identifier: Apache-2.0
#include "kvcache/model/causal_lm.h"

#include <ATen/Parallel.h>
#include <torch/script.h>
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "kvcache/error.h"
#include "kvcache/torch/rope.h"

namespace kvcache {

namespace {

using json = nlohmann::json;

constexpr const char* kExportFile = "libkvcache_export.json";
constexpr const char* kConfigFile = "config.json";
constexpr const char* kGenerationFile = "generation_config.json";
constexpr const char* kExportFormat = "libkvcache-torchscript";
constexpr int64_t kAbiVersion = 1;

/// Extra files looked up in the archive (absent ones are simply not reported).
const char* const kExtraNames[] = {kExportFile,    kConfigFile,  "tokenizer.json",
                                   "vocab.json",   "merges.txt", "tokenizer_config.json",
                                   kGenerationFile};

/// Method name and its argument count without `self`, as ABI v1 defines them.
const std::pair<const char*, size_t> kAbiMethods[] = {{"embed", 1},  {"qkv", 3},  {"rope", 2},
                                                      {"finish", 3}, {"head", 1}, {"forward", 1}};

/// First line of a c10::Error message (LibTorch appends a long C++ backtrace).
std::string first_line(const std::string& s) {
  const auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

json parse_json(const std::string& path, const char* name, const std::string& text) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw InvalidArgument(
        detail::str_cat("'", path, "': extra file ", name, " is not valid JSON: ", e.what()));
  }
}

/// Reads a required integer/number field of config.json.
template <typename T>
T required(const json& j, const std::string& path, const char* field) {
  KV_CHECK_ARG(j.contains(field) && !j.at(field).is_null(), "'", path, "': ", kConfigFile,
               ": missing field '", field, "'");
  const json& v = j.at(field);
  if constexpr (std::is_same_v<T, std::string>) {
    KV_CHECK_ARG(v.is_string(), "'", path, "': ", kConfigFile, ": field '", field,
                 "' must be a string, got ", v.dump());
  } else if constexpr (std::is_same_v<T, bool>) {
    KV_CHECK_ARG(v.is_boolean(), "'", path, "': ", kConfigFile, ": field '", field,
                 "' must be a boolean, got ", v.dump());
  } else if constexpr (std::is_integral_v<T>) {
    KV_CHECK_ARG(v.is_number_integer(), "'", path, "': ", kConfigFile, ": field '", field,
                 "' must be an integer, got ", v.dump());
  } else {
    KV_CHECK_ARG(v.is_number(), "'", path, "': ", kConfigFile, ": field '", field,
                 "' must be a number, got ", v.dump());
  }
  return v.get<T>();
}

template <typename T>
T optional_field(const json& j, const std::string& path, const char* field, T fallback) {
  if (!j.contains(field) || j.at(field).is_null()) return fallback;
  return required<T>(j, path, field);
}

/// A token-id field that may be null/absent, an int, or a list of ints.
std::vector<int64_t> id_list(const json& j, const std::string& path, const char* file,
                             const char* field) {
  std::vector<int64_t> ids;
  if (!j.contains(field) || j.at(field).is_null()) return ids;
  const json& e = j.at(field);
  const bool ok =
      e.is_number_integer() || (e.is_array() && std::all_of(e.begin(), e.end(), [](const json& x) {
                                  return x.is_number_integer();
                                }));
  KV_CHECK_ARG(ok, "'", path, "': ", file, ": field '", field,
               "' must be an integer or a list of integers, got ", e.dump());
  if (e.is_number_integer()) {
    ids.push_back(e.get<int64_t>());
  } else {
    for (const json& x : e) ids.push_back(x.get<int64_t>());
  }
  return ids;
}

ModelConfig parse_config(const std::string& path, const std::string& text) {
  const json j = parse_json(path, kConfigFile, text);
  KV_CHECK_ARG(j.is_object(), "'", path, "': ", kConfigFile, " must be a JSON object");
  ModelConfig c;
  c.model_type = required<std::string>(j, path, "model_type");
  c.hidden_size = required<int64_t>(j, path, "hidden_size");
  c.num_hidden_layers = required<int64_t>(j, path, "num_hidden_layers");
  c.num_attention_heads = required<int64_t>(j, path, "num_attention_heads");
  c.num_key_value_heads = required<int64_t>(j, path, "num_key_value_heads");
  c.head_dim = required<int64_t>(j, path, "head_dim");
  c.intermediate_size = required<int64_t>(j, path, "intermediate_size");
  c.rope_theta = required<double>(j, path, "rope_theta");
  c.rms_norm_eps = required<double>(j, path, "rms_norm_eps");
  c.vocab_size = required<int64_t>(j, path, "vocab_size");
  c.tie_word_embeddings = optional_field<bool>(j, path, "tie_word_embeddings", false);
  c.attention_bias = optional_field<bool>(j, path, "attention_bias", false);
  c.max_position_embeddings = optional_field<int64_t>(j, path, "max_position_embeddings", 0);
  const std::vector<int64_t> bos = id_list(j, path, kConfigFile, "bos_token_id");
  c.bos_token_id = bos.empty() ? -1 : bos.front();
  c.eos_token_ids = id_list(j, path, kConfigFile, "eos_token_id");
  const auto positive = [&](int64_t v, const char* field) {
    KV_CHECK_ARG(v > 0, "'", path, "': ", kConfigFile, ": field '", field, "' must be > 0, got ",
                 v);
  };
  positive(c.hidden_size, "hidden_size");
  positive(c.num_hidden_layers, "num_hidden_layers");
  positive(c.num_attention_heads, "num_attention_heads");
  positive(c.num_key_value_heads, "num_key_value_heads");
  positive(c.head_dim, "head_dim");
  positive(c.intermediate_size, "intermediate_size");
  positive(c.vocab_size, "vocab_size");
  KV_CHECK_ARG(c.num_attention_heads % c.num_key_value_heads == 0, "'", path, "': ", kConfigFile,
               ": num_attention_heads (", c.num_attention_heads,
               ") must be a multiple of num_key_value_heads (", c.num_key_value_heads, ")");
  KV_CHECK_ARG(c.rope_theta > 0.0, "'", path, "': ", kConfigFile,
               ": field 'rope_theta' must be > 0, got ", c.rope_theta);
  return c;
}

void check_export_header(const std::string& path, const std::string& text) {
  const json j = parse_json(path, kExportFile, text);
  KV_CHECK_ARG(j.is_object() && j.contains("format") && j.at("format").is_string() &&
                   j.at("format").get<std::string>() == kExportFormat,
               "'", path, "': ", kExportFile, ": field 'format' must be \"", kExportFormat,
               "\", got ", j.is_object() && j.contains("format") ? j.at("format").dump() : "none");
  KV_CHECK_ARG(j.contains("abi_version") && j.at("abi_version").is_number_integer(), "'", path,
               "': ", kExportFile, ": missing integer field 'abi_version'");
  const auto abi = j.at("abi_version").get<int64_t>();
  KV_CHECK_ARG(abi == kAbiVersion, "'", path, "': ", kExportFile, ": abi_version ", abi,
               " is not supported; this libkvcache reads abi_version ", kAbiVersion,
               " (re-export the model with this version's tools/export_torchscript.py)");
}

}  // namespace

struct CausalLM::Impl {
  std::string path;
  ModelConfig config;
  std::map<std::string, std::string> extra;
  torch::jit::Module module;
  // Methods are looked up once; calling a Method mutates only the interpreter stack.
  mutable std::optional<torch::jit::Method> m_embed, m_qkv, m_rope, m_finish, m_head, m_forward;
  mutable std::once_flag fingerprint_once;
  mutable std::string fingerprint;  ///< fingerprint(), computed once
};

CausalLM::CausalLM(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

CausalLM CausalLM::load(const std::string& path, const LoadOptions& options) {
  KV_CHECK_ARG(options.num_threads >= 0, "LoadOptions::num_threads must be >= 0, got ",
               options.num_threads);
  std::error_code ec;
  KV_CHECK_ARG(std::filesystem::is_regular_file(path, ec), "model file '", path,
               "' does not exist or is not a regular file");
  const int threads = options.num_threads > 0
                          ? options.num_threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  at::set_num_threads(threads);

  auto impl = std::make_shared<Impl>();
  impl->path = path;
  torch::jit::ExtraFilesMap files;
  for (const char* name : kExtraNames) files[name] = "";
  try {
    impl->module = torch::jit::load(path, torch::kCPU, files);
  } catch (const c10::Error& e) {
    throw InvalidArgument(detail::str_cat("cannot load '", path,
                                          "' as a TorchScript archive (missing, truncated or "
                                          "not a torch.jit.save file): ",
                                          first_line(e.what_without_backtrace())));
  }
  for (auto& [name, text] : files) {
    if (!text.empty()) impl->extra.emplace(name, std::move(text));
  }
  KV_CHECK_ARG(impl->extra.count(kExportFile) == 1, "'", path,
               "' is not a libkvcache export: extra file ", kExportFile,
               " is missing (export the model with tools/export_torchscript.py)");
  check_export_header(path, impl->extra.at(kExportFile));
  KV_CHECK_ARG(impl->extra.count(kConfigFile) == 1, "'", path, "': extra file ", kConfigFile,
               " is missing");
  impl->config = parse_config(path, impl->extra.at(kConfigFile));
  // Stop on the union of config.json's and generation_config.json's eos ids (model-abi.md):
  // Qwen2.5-Instruct lists <|im_end|> in one and <|endoftext|> too in the other.
  if (impl->extra.count(kGenerationFile) == 1) {
    const json g = parse_json(path, kGenerationFile, impl->extra.at(kGenerationFile));
    if (g.is_object()) {
      for (int64_t e : id_list(g, path, kGenerationFile, "eos_token_id")) {
        auto& eos = impl->config.eos_token_ids;
        if (std::find(eos.begin(), eos.end(), e) == eos.end()) eos.push_back(e);
      }
    }
  }
  for (int64_t e : impl->config.eos_token_ids) {
    KV_CHECK_ARG(e >= 0 && e < impl->config.vocab_size, "'", path, "': eos_token_id ", e,
                 " is outside the vocabulary [0, ", impl->config.vocab_size, ")");
  }

  for (const auto& [name, nargs] : kAbiMethods) {
    auto m = impl->module.find_method(name);
    KV_CHECK_ARG(m.has_value(), "'", path, "': method '", name,
                 "' of model ABI v1 is missing (see docs/model-abi.md)");
    // The schema counts `self` as the first argument.
    const size_t got = m->function().getSchema().arguments().size() - 1;
    KV_CHECK_ARG(got == nargs, "'", path, "': method '", name, "' takes ", got,
                 " arguments, ABI v1 expects ", nargs, " (see docs/model-abi.md)");
  }
  impl->module.eval();
  impl->m_embed = impl->module.get_method("embed");
  impl->m_qkv = impl->module.get_method("qkv");
  impl->m_rope = impl->module.get_method("rope");
  impl->m_finish = impl->module.get_method("finish");
  impl->m_head = impl->module.get_method("head");
  impl->m_forward = impl->module.get_method("forward");
  return CausalLM(std::move(impl));
}

const ModelConfig& CausalLM::config() const { return impl_->config; }
const std::string& CausalLM::path() const { return impl_->path; }
const std::map<std::string, std::string>& CausalLM::extra_files() const { return impl_->extra; }

std::string CausalLM::extra_file(const std::string& name) const {
  const auto it = impl_->extra.find(name);
  return it == impl_->extra.end() ? std::string() : it->second;
}

TokenizerFiles CausalLM::tokenizer_files() const {
  TokenizerFiles f;
  f.tokenizer_json = extra_file("tokenizer.json");
  f.vocab_json = extra_file("vocab.json");
  f.merges_txt = extra_file("merges.txt");
  f.tokenizer_config_json = extra_file("tokenizer_config.json");
  KV_CHECK_ARG(!f.tokenizer_json.empty() || (!f.vocab_json.empty() && !f.merges_txt.empty()), "'",
               impl_->path,
               "' holds no tokenizer: extra file tokenizer.json (or vocab.json + "
               "merges.txt) is missing (export from a checkpoint directory that has one)");
  return f;
}

const std::string& CausalLM::fingerprint() const {
  std::call_once(impl_->fingerprint_once, [this] {
    std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> st(XXH3_createState(), &XXH3_freeState);
    KV_INTERNAL_ASSERT(st != nullptr && XXH3_64bits_reset(st.get()) == XXH_OK, "XXH3 state");
    std::set<const void*> seen;
    for (const auto& attr : impl_->module.named_attributes(/*recurse=*/true)) {
      if (!attr.value.isTensor()) continue;
      const at::Tensor t = attr.value.toTensor();
      if (!t.defined() || !t.has_storage() || !seen.insert(t.storage().data()).second) continue;
      XXH3_64bits_update(st.get(), attr.name.data(), attr.name.size());
      XXH3_64bits_update(st.get(), t.storage().data(), t.storage().nbytes());
    }
    const std::string config = extra_file(kConfigFile);
    char text[64];
    std::snprintf(text, sizeof text, ":config=%016llx:weights=%016llx",
                  static_cast<unsigned long long>(XXH3_64bits(config.data(), config.size())),
                  static_cast<unsigned long long>(XXH3_64bits_digest(st.get())));
    impl_->fingerprint = impl_->config.model_type + text;
  });
  return impl_->fingerprint;
}

int64_t CausalLM::weight_bytes() const {
  std::set<const void*> seen;
  int64_t total = 0;
  for (const auto& attr : impl_->module.named_attributes(/*recurse=*/true)) {
    if (!attr.value.isTensor()) continue;
    const at::Tensor t = attr.value.toTensor();
    if (!t.defined() || !t.has_storage()) continue;
    if (seen.insert(t.storage().data()).second) total += static_cast<int64_t>(t.storage().nbytes());
  }
  return total;
}

at::Tensor CausalLM::embed(const at::Tensor& ids) const {
  torch::NoGradGuard no_grad;
  return (*impl_->m_embed)({ids}).toTensor();
}

QKV CausalLM::qkv(int64_t layer, const at::Tensor& h, const at::Tensor& positions) const {
  KV_CHECK_ARG(layer >= 0 && layer < impl_->config.num_hidden_layers, "CausalLM::qkv: layer ",
               layer, " out of range [0, ", impl_->config.num_hidden_layers, ")");
  torch::NoGradGuard no_grad;
  const auto out = (*impl_->m_qkv)({layer, h, positions}).toTuple();
  const auto& el = out->elements();
  KV_CHECK_ARG(el.size() == 3, "'", impl_->path, "': method 'qkv' returned ", el.size(),
               " values, ABI v1 expects (q, k, v)");
  return QKV{el[0].toTensor(), el[1].toTensor(), el[2].toTensor()};
}

at::Tensor CausalLM::rope(const at::Tensor& x, const at::Tensor& positions) const {
  torch::NoGradGuard no_grad;
  return (*impl_->m_rope)({x, positions}).toTensor();
}

at::Tensor CausalLM::finish(int64_t layer, const at::Tensor& h, const at::Tensor& attn_out) const {
  KV_CHECK_ARG(layer >= 0 && layer < impl_->config.num_hidden_layers, "CausalLM::finish: layer ",
               layer, " out of range [0, ", impl_->config.num_hidden_layers, ")");
  torch::NoGradGuard no_grad;
  return (*impl_->m_finish)({layer, h, attn_out}).toTensor();
}

at::Tensor CausalLM::head(const at::Tensor& h) const {
  torch::NoGradGuard no_grad;
  return (*impl_->m_head)({h}).toTensor();
}

at::Tensor CausalLM::forward(const at::Tensor& ids) const {
  torch::NoGradGuard no_grad;
  return (*impl_->m_forward)({ids}).toTensor();
}

CacheConfig CausalLM::cache_config() const {
  CacheConfig c;
  c.num_layers = impl_->config.num_hidden_layers;
  c.num_q_heads = impl_->config.num_attention_heads;
  c.num_kv_heads = impl_->config.num_key_value_heads;
  c.head_dim = impl_->config.head_dim;
  // The hook owns a copy of the model handle, so the cache may outlive this object.
  CausalLM self(impl_);
  c.rope = rope_from([self](const at::Tensor& x, const at::Tensor& positions) { return self.rope(x, positions); });
  return c;
}

}  // namespace kvcache
