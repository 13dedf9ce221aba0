// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file causal_lm.h
/// CausalLM: a decoder-only model exported to TorchScript by tools/export_torchscript.py
/// (ABI v1, docs/model-abi.md). The export splits the forward pass so that C++ owns
/// attention and the KV cache:
///
///   h = embed(ids); for each layer l: (q, k, v) = qkv(l, h, pos); <attention in C++>;
///   h = finish(l, h, attn_out); logits = head(h).
///
/// Shapes use the letters of types.h: B batch, T tokens, d hidden size, H_q query heads,
/// H_kv KV heads, D head_dim, V vocab size.

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/cache_config.h"
#include "kvcache/model/tokenizer.h"

namespace kvcache {

/// The normalised model configuration stored as `config.json` inside the export.
struct ModelConfig {
  std::string model_type;            ///< "llama" or "qwen2"
  int64_t hidden_size = 0;           ///< d
  int64_t num_hidden_layers = 0;     ///< L
  int64_t num_attention_heads = 0;   ///< H_q
  int64_t num_key_value_heads = 0;   ///< H_kv (divides H_q)
  int64_t head_dim = 0;              ///< D
  int64_t intermediate_size = 0;     ///< MLP width
  double rope_theta = 0.0;           ///< RoPE base
  double rms_norm_eps = 0.0;         ///< RMSNorm epsilon
  bool tie_word_embeddings = false;  ///< lm_head shares the embedding matrix
  bool attention_bias = false;       ///< q/k/v projections carry biases (Qwen2)
  int64_t vocab_size = 0;            ///< V
  int64_t bos_token_id = -1;         ///< -1 when the config has none (first id if a list)
  /// Every id that ends generation: config.json's eos_token_id (int or list) united with
  /// generation_config.json's when the export holds one. May be empty.
  std::vector<int64_t> eos_token_ids;
  int64_t max_position_embeddings = 0;  ///< 0 when the config has none
};

/// Options of CausalLM::load().
struct LoadOptions {
  /// Intra-op threads set with at::set_num_threads() (a process-wide LibTorch setting).
  /// 0 = std::thread::hardware_concurrency().
  int num_threads = 0;
};

/// The three projections of one layer returned by CausalLM::qkv().
struct QKV {
  at::Tensor q;  ///< `[B, H_q, T, D]`, post-RoPE
  at::Tensor k;  ///< `[B, H_kv, T, D]`, PRE-RoPE
  at::Tensor v;  ///< `[B, H_kv, T, D]`
};

/// A loaded TorchScript export. Cheap to copy (shares the module). Every tensor method runs
/// without autograd and on CPU; ids and positions are int64.
class CausalLM {
 public:
  /// Loads `path` (a `.pt` written by tools/export_torchscript.py) with its extra files and
  /// validates ABI v1: `libkvcache_export.json` present with format "libkvcache-torchscript"
  /// and abi_version 1; `config.json` with the fields of ModelConfig; the methods embed, qkv,
  /// rope, finish, head and forward with their argument counts. Sets the LibTorch thread count.
  /// @throws InvalidArgument naming the path (missing file, not a zip/TorchScript archive,
  ///         truncated file) or the path, extra file and field (not a libkvcache export,
  ///         wrong ABI version, bad config field, missing method).
  static CausalLM load(const std::string& path, const LoadOptions& options = {});

  const ModelConfig& config() const;
  /// The path the model was loaded from.
  const std::string& path() const;
  /// Raw texts of the extra files present in the export, by name: "libkvcache_export.json",
  /// "config.json", and when exported "tokenizer.json", "vocab.json", "merges.txt",
  /// "tokenizer_config.json", "generation_config.json".
  const std::map<std::string, std::string>& extra_files() const;
  /// Text of one extra file, or "" if the export does not hold it.
  std::string extra_file(const std::string& name) const;
  /// The tokenizer files of the export, for Tokenizer::from_texts().
  /// @throws InvalidArgument naming the path when the export holds neither tokenizer.json
  ///         nor vocab.json + merges.txt.
  TokenizerFiles tokenizer_files() const;

  /// Names this model for cache snapshots (CacheManager::save/load, docs/snapshot-format.md):
  /// "<model_type>:config=<16 hex>:weights=<16 hex>", XXH3-64 of config.json's text and of every
  /// tensor the module holds (name and storage bytes, in the module's order, each storage once).
  /// Two exports of the same weights and config give the same text; any changed weight byte
  /// gives another. Computed on first call (one pass over the weights), then kept.
  const std::string& fingerprint() const;

  /// Bytes of every tensor the module holds (parameters, buffers, tensor attributes), each
  /// storage counted once (tied embeddings count once). Measured, not computed from the config.
  int64_t weight_bytes() const;

  /// ids int64 `[B, T]` → h `[B, T, d]` (the export's dtype, float32 by default).
  at::Tensor embed(const at::Tensor& ids) const;
  /// Layer `layer` of h `[B, T, d]` at positions int64 `[T]` → q (post-RoPE), k (pre-RoPE), v.
  QKV qkv(int64_t layer, const at::Tensor& h, const at::Tensor& positions) const;
  /// Rotary embedding: x `[B, H, T, D]`, positions int64 `[T]` → x rotated (same shape).
  at::Tensor rope(const at::Tensor& x, const at::Tensor& positions) const;
  /// Rest of layer `layer`: o_proj, residual, norm, MLP, residual. h `[B, T, d]`,
  /// attn_out `[B, H_q, T, D]` → h `[B, T, d]`.
  at::Tensor finish(int64_t layer, const at::Tensor& h, const at::Tensor& attn_out) const;
  /// Final norm and lm_head: h `[B, T, d]` → logits `[B, T, V]` float32.
  at::Tensor head(const at::Tensor& h) const;
  /// Full causal forward without a cache (the unmanaged reference): ids `[B, T]` → logits
  /// `[B, T, V]` float32.
  at::Tensor forward(const at::Tensor& ids) const;

  /// A CacheConfig with the model's layer/head/head_dim counts and its `rope` hook filled in;
  /// quant/policy/etc. keep their defaults ("fp32", "full"). The hook keeps the model alive.
  CacheConfig cache_config() const;

 private:
  struct Impl;
  explicit CausalLM(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

}  // namespace kvcache
