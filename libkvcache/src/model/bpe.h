// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file bpe.h
/// Byte-pair-encoding model (the `model` part of a HF tokenizer.json of type "BPE").
/// Private to libkvcache.

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvcache::tok {

struct BpeOptions {
  std::optional<std::string> unk_token;  ///< used for symbols missing from the vocab
  bool byte_fallback = false;  ///< missing symbols become <0xNN> byte tokens when those exist
  bool fuse_unk = false;       ///< consecutive unknown symbols give one unk id
  bool ignore_merges = false;  ///< a whole word found in the vocab is emitted as is
};

/// Vocabulary + ranked merges. Encoding one word (a pre-token) starts from its code points
/// and repeatedly merges the adjacent pair of lowest merge rank (leftmost on ties), exactly
/// as HF tokenizers' BPE::merge_word, in O(n log n) with a heap over a linked symbol list.
/// Results for words up to kMaxCachedWordBytes are cached (thread-safe).
class BpeModel {
 public:
  /// @param vocab  token string -> id (ids need not be contiguous).
  /// @param merges pairs in rank order (rank = index).
  /// @throws InvalidArgument when a merge names a token (or a result) missing from `vocab`;
  ///         `where` names the source (file/field) in the message.
  BpeModel(std::unordered_map<std::string, int32_t> vocab,
           const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options,
           const std::string& where);

  /// Appends the ids of `word` to `out`. `word` must be valid UTF-8.
  void encode_word(std::string_view word, std::vector<int64_t>& out) const;

  const std::unordered_map<std::string, int32_t>& vocab() const { return vocab_; }
  size_t num_merges() const { return merges_.size(); }

  static constexpr size_t kMaxCachedWordBytes = 256;
  static constexpr size_t kMaxCacheEntries = 1 << 15;

 private:
  struct MergeInfo {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<uint64_t, MergeInfo> merges_;
  BpeOptions options_;
  std::optional<int32_t> unk_id_;
  int32_t byte_ids_[256];  // id of "<0xNN>", -1 when absent

  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace kvcache::tok
