// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file sequence_store.h (internal)
/// SequenceStore: what one sequence holds, apart from the step protocol that drives it
/// (step_protocol.h) — the scheme resolved per layer (stream setups and block formats), the
/// layer stores (LayerStore: block lists per KV head and stream), the pools the blocks come
/// from, each layer's logical length and last position, the byte and token counters with their
/// peaks, the adoption of a shared prefix, and the invariant checks. Writes take rows already
/// validated and rotated; nothing here knows of policies, steps or views.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache/layer_store.h"
#include "cache/pool_set.h"
#include "kvcache/cache_config.h"
#include "kvcache/cache_scheme.h"
#include "kvcache/quantizer.h"

namespace kvcache::cache {

/// A cached prefix a sequence takes over: blocks per layer, per KV head, oldest first.
struct AdoptedPrefix {
  int64_t tokens = 0;                               ///< positions 0 .. tokens − 1
  std::vector<std::vector<std::vector<Block>>> k;   ///< [layer][head] → K blocks
  std::vector<std::vector<std::vector<Block>>> v;   ///< [layer][head] → V blocks
  /// The first append of each layer after the prefix must carry at least this many tokens
  /// (a stream with a sliding residual of R tokens: R), or the sequence would not hold what it
  /// holds when it computes the prefix itself.
  int64_t min_next_step = 0;
};

class SequenceStore {
 public:
  /// One layer's storage and counters.
  struct Layer {
    std::unique_ptr<LayerStore> store;
    int64_t written = 0;   ///< tokens ever written (or adopted)
    int64_t last_pos = -1;
    int64_t min_step = 0;  ///< after an adopted prefix: tokens the next append must carry at least
    CacheStats stats;
  };

  /// The scheme of `cfg` (validated) resolved for every layer, blocks from `pools` (shared with
  /// other holders when `shared_pools`).
  SequenceStore(const CacheConfig& cfg, std::shared_ptr<PoolSet> pools, bool shared_pools);
  SequenceStore(const SequenceStore&) = delete;
  SequenceStore& operator=(const SequenceStore&) = delete;

  const CacheScheme& scheme() const { return *scheme_; }
  int64_t block_tokens() const { return block_tokens_; }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t num_kv_heads() const { return num_kv_heads_; }
  int64_t head_dim() const { return head_dim_; }
  Layer& layer(int64_t l) { return layers_[static_cast<size_t>(l)]; }
  const Layer& layer(int64_t l) const { return layers_[static_cast<size_t>(l)]; }
  const LayerStore& store(int64_t l) const { return *layer(l).store; }
  const StreamSetup& key_setup(int64_t l) const { return store(l).key_setup(); }
  const StreamSetup& value_setup(int64_t l) const { return store(l).value_setup(); }
  const CacheStats& total() const { return total_; }
  bool shared_pools() const { return shared_pools_; }

  /// Stores `n` tokens of layer `l`: `k` and `v` float32 `[H_kv, n, D]` (keys as stored:
  /// post-RoPE unless pre-RoPE storage), positions `[n]` already checked. Fixes the stream
  /// scales at the layer's first write. Updates the counters. Nothing throws for valid input
  /// (allocation aside).
  void write(int64_t l, const float* k, const float* v, const int64_t* pos, int64_t n);
  /// Evicts plan rows (per head: strictly increasing resident indices) of layer `l`, then
  /// re-numbers positions when `renumber`, and samples the counters.
  void evict(int64_t l, const std::vector<std::vector<int64_t>>& plan, bool renumber);
  /// Bytes of new blocks write(l, …, n) may allocate; `wide` when some value may exceed what
  /// fp16 holds (then every token may take a float32 fallback block and a fresh block after it).
  int64_t write_bound(int64_t l, int64_t n, bool wide) const;
  /// Bytes of new blocks evict() of `plan` may allocate (copies on write).
  int64_t evict_bound(int64_t l, const std::vector<std::vector<int64_t>>& plan) const;
  /// Takes over `prefix` in an empty store: its blocks become every layer's oldest tokens and
  /// the counters are what writing them in one step gives.
  void adopt(const AdoptedPrefix& prefix);
  /// A snapshot being read (snapshot.cpp): the totals as saved (check() compares them with the
  /// layers').
  void restore_totals(const CacheStats& totals) { total_ = totals; }
  /// Empties every layer and counter (peaks too); gives the pools' memory back unless shared.
  void clear();

  /// KV head h of layer l decoded into float32 rows `[t, D]`: its live keys as stored (still
  /// pre-RoPE under pre-RoPE storage) into kr, values into vr (appended); returns positions.
  std::vector<int64_t> decode_head(int64_t l, int64_t h, std::vector<float>& kr, std::vector<float>& vr) const;
  /// Blocks copied on write over every layer (cumulative since construction).
  int64_t cow_copies() const;

  /// Every layer's invariants (`rerotate`: positions must be 0..n−1), totals against the
  /// layers, and — pools not shared — the pools' blocks in use against the bytes reserved.
  /// @throws InternalError describing the first violation.
  void check(bool rerotate) const;

 private:
  BlockFormat format(const Quantizer& q, int64_t capacity);
  StreamFormats stream_formats(const Quantizer& main, const StreamSpec& spec);
  void setup_stream(StreamSetup& st, const StreamSpec& spec, const std::string& scheme_spec);
  void sample(int64_t l);

  std::unique_ptr<CacheScheme> scheme_;
  int64_t block_tokens_ = 0;
  int64_t num_kv_heads_ = 0;
  int64_t head_dim_ = 0;
  std::unique_ptr<Quantizer> f16_, f32_;  ///< residual / converted rows and the fp32 fallback
  std::shared_ptr<PoolSet> pools_;
  bool shared_pools_ = false;
  std::vector<StreamSetup> ksets_, vsets_;  ///< per layer (built once; the stores point into them)
  std::vector<Layer> layers_;
  CacheStats total_;
};

/// The scheme of `cfg` resolved for every layer (validating it on the config's geometry).
std::vector<LayerStreams> resolve_streams(const CacheScheme& scheme, const CacheConfig& cfg);

}  // namespace kvcache::cache
