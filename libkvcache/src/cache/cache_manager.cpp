// SPDX-License-Identifier: Apache-2.0
// The public faces of a sequence's cache over the step protocol (step_protocol.h):
// SequenceCache, CacheManager, ExternalAttention, CacheDebug and attend_batch.
#include "kvcache/cache_manager.h"

#include <algorithm>
#include <iterator>
#include <istream>
#include <ostream>
#include <set>

#include "cache/attend_cascade.h"
#include "cache/cache_manager_access.h"
#include "cache/step_protocol.h"
#include "common/file_io.h"
#include "common/parallel.h"
#include "common/view_ops.h"
#include "kvcache/cache_debug.h"
#include "kvcache/error.h"
#include "kvcache/external_attention.h"

namespace kvcache {
namespace {
/// The largest snapshot load() reads (64 GiB: far above any cache this library holds).
constexpr int64_t kMaxSnapshotBytes = int64_t{64} << 30;
}  // namespace

int64_t LayerTokens::max_resident() const {
  int64_t m = 0;
  for (const auto& p : positions) m = std::max<int64_t>(m, static_cast<int64_t>(p.size()));
  return m;
}

// ---------------------------------------------------------------- SequenceCache
SequenceCache::SequenceCache(std::unique_ptr<cache::StepProtocol> steps) : steps_(std::move(steps)) {}
SequenceCache::~SequenceCache() = default;
SequenceCache::SequenceCache(SequenceCache&&) noexcept = default;
SequenceCache& SequenceCache::operator=(SequenceCache&&) noexcept = default;

std::unique_ptr<cache::StepProtocol> SequenceCache::replace_steps(std::unique_ptr<cache::StepProtocol> steps) {
  steps_.swap(steps);
  return steps;
}
const CacheConfig& SequenceCache::config() const { return steps_->config(); }
const EvictionPolicy& SequenceCache::policy() const { return steps_->policy(); }
void SequenceCache::reset(int64_t context_length) { steps_->reset(context_length); }
void SequenceCache::append(int64_t layer, const TensorView& k, const TensorView& v, const TensorView& positions) {
  steps_->append(layer, k, v, positions);
}
void SequenceCache::attend(int64_t layer, const TensorView& q, const TensorView& q_positions,
                           const MutableTensorView& out) {
  steps_->attend(layer, q, q_positions, out);
}
void SequenceCache::end_step(StepKind step) { steps_->end_step(step); }
void SequenceCache::begin_replay() { steps_->begin_replay(); }
int64_t SequenceCache::next_position(int64_t layer) const { return steps_->next_position(layer); }
LayerTokens SequenceCache::tokens(int64_t layer) const { return steps_->tokens(layer); }
CacheStats SequenceCache::stats() const { return steps_->stats(); }

// ---------------------------------------------------------------- CacheManager
CacheManager::CacheManager(CacheConfig config)
    : SequenceCache(std::make_unique<cache::StepProtocol>(std::move(config), nullptr, nullptr)) {}
CacheManager::CacheManager(std::unique_ptr<cache::StepProtocol> steps) : SequenceCache(std::move(steps)) {}
CacheManager::~CacheManager() = default;
CacheManager::CacheManager(CacheManager&&) noexcept = default;
CacheManager& CacheManager::operator=(CacheManager&&) noexcept = default;

void CacheManager::save(const std::string& path, const std::string& model_fingerprint,
                        const std::vector<int64_t>& tokens) const {
  cache::write_snapshot(path, steps().snapshot(model_fingerprint, tokens), "CacheManager::save");
}

void CacheManager::save(std::ostream& out, const std::string& model_fingerprint,
                        const std::vector<int64_t>& tokens) const {
  cache::write_snapshot(out, steps().snapshot(model_fingerprint, tokens), "CacheManager::save");
}

std::vector<int64_t> CacheManager::load(const std::string& path, const std::string& model_fingerprint) {
  std::string bytes;
  try {
    bytes = io::read_regular_file(path, "snapshot", kMaxSnapshotBytes);
  } catch (const InvalidArgument& e) {
    throw SnapshotError(SnapshotError::Reason::kIo, detail::str_cat("CacheManager::load: ", e.what(), " (io)"));
  }
  std::vector<int64_t> tokens;
  *this = CacheManager(cache::StepProtocol::from_snapshot(config(), bytes, model_fingerprint, path, &tokens));
  return tokens;
}

std::vector<int64_t> CacheManager::load(std::istream& in, const std::string& model_fingerprint) {
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) {
    throw SnapshotError(SnapshotError::Reason::kIo,
                        detail::str_cat("CacheManager::load: the stream failed after ", bytes.size(), " bytes (io)"));
  }
  std::vector<int64_t> tokens;
  *this = CacheManager(cache::StepProtocol::from_snapshot(config(), bytes, model_fingerprint, "<stream>", &tokens));
  return tokens;
}

// ---------------------------------------------------------------- adapters
void ExternalAttention::observe_attention(int64_t layer, const TensorView& probs) {
  cache_->steps_->observe_attention(layer, probs);
}

void ExternalAttention::observe_queries(int64_t layer, const TensorView& q, const TensorView& q_positions) {
  cache_->steps_->observe_queries(layer, q, q_positions);
}

LayerKV CacheDebug::get(const SequenceCache& cache, int64_t layer) { return cache.steps_->get(layer); }

void CacheDebug::check_invariants(const SequenceCache& cache) { cache.steps_->check_invariants(); }

// ---------------------------------------------------------------- attend_batch
struct AttendBatch {
  static cache::StepProtocol& steps(SequenceCache& c) { return *c.steps_; }
};

void attend_batch(int64_t layer, const std::vector<AttendRequest>& requests, const AttendBatchOptions& options) {
  // Every request checked (and its heads prepared) before any is attended or any policy fed.
  std::vector<cache::StepProtocol::Pending> pending(requests.size());
  std::set<const SequenceCache*> seen;
  for (size_t i = 0; i < requests.size(); ++i) {
    const AttendRequest& r = requests[i];
    KV_CHECK_ARG(r.cache != nullptr, "attend_batch: request ", i, " has no cache");
    KV_CHECK_ARG(seen.insert(r.cache).second, "attend_batch: request ", i,
                 " names a cache an earlier request names (each sequence attends once per call)");
    try {
      AttendBatch::steps(*r.cache).prepare_attend(layer, r.q, r.q_positions, r.out, pending[i]);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(detail::str_cat("attend_batch: request ", i, ": ", e.what()));
    }
  }
  // One pass over every (request, KV head) — and over every shared prefix once (cascade).
  std::vector<cache::BatchItem> items;
  for (auto& p : pending) {
    if (p.t_q == 0) continue;
    items.push_back({&p.args, !p.need.any() && !p.replay && p.args.tail_n == 0});
  }
  cache::attend_items(items, options.cascade, options.stats);
  for (size_t i = 0; i < requests.size(); ++i) AttendBatch::steps(*requests[i].cache).finish_attend(pending[i]);
}

}  // namespace kvcache

// ---------------------------------------------------------------- introspection
namespace kvcache::cache {

const StepProtocol& CacheManagerAccess::steps(const SequenceCache& m) { return *m.steps_; }

StreamDebug CacheManagerAccess::stream(const SequenceCache& m, int64_t layer, bool key) {
  const StepProtocol& sp = *m.steps_;
  KV_CHECK_ARG(layer >= 0 && layer < sp.config().num_layers, "CacheManagerAccess::stream: layer ", layer);
  const LayerStore& store = sp.store().store(layer);
  const int64_t d = sp.config().head_dim;
  StreamDebug dbg;
  const StreamSetup& st = key ? store.key_setup() : store.value_setup();
  for (int64_t h = 0; h < sp.config().num_kv_heads; ++h) {
    const HeadStream& s = key ? store.k(h) : store.v(h);
    const float scale = key ? store.k_scale() : store.v_scale();
    int64_t quantized = 0, groups = 0, dead = 0, converted = 0, blocks = 0;
    for (const BlockList* list : {&s.quant, &s.resid}) {
      for (const auto& b : list->blocks()) {
        ++blocks;
        dead += b.filled - b.live;
        if (b.format == StreamFormats::kMain) {
          quantized += b.live;
          if (!st.formats.f[StreamFormats::kMain].token_readable()) ++groups;
        } else if (b.format == StreamFormats::kConverted) {
          converted += b.live;
        }
      }
    }
    dbg.quantized_tokens.push_back(quantized);
    dbg.residual_tokens.push_back(s.resid.live());
    dbg.converted_tokens.push_back(converted);
    dbg.quantized_groups.push_back(groups);
    dbg.dead_slots.push_back(dead);
    dbg.blocks.push_back(blocks);
    std::vector<float> rows;
    s.resid.live_rows(rows, 1.0f);
    Buffer r(DType::kFloat32, {1, 1, s.resid.live(), d});
    std::copy(rows.begin(), rows.end(), r.data_as<float>());
    dbg.residual.push_back(std::move(r));
    std::vector<float> all;
    s.quant.live_rows(all, scale);
    s.resid.live_rows(all, 1.0f);
    Buffer a(DType::kFloat32, {1, 1, s.live(), d});
    std::copy(all.begin(), all.end(), a.data_as<float>());
    dbg.stored.push_back(std::move(a));
  }
  dbg.token_readable = st.formats.f[StreamFormats::kMain].token_readable();
  dbg.residual_length = st.spec.residual;
  dbg.quantizer = st.spec.quantizer->spec();
  dbg.block_tokens = sp.store().block_tokens();
  return dbg;
}

std::string CacheManagerAccess::scheme(const SequenceCache& m) { return m.steps_->store().scheme().spec(); }

BlockLayerView CacheManagerAccess::view(const SequenceCache& m, int64_t layer) {
  const StepProtocol& sp = *m.steps_;
  KV_CHECK_ARG(layer >= 0 && layer < sp.config().num_layers, "CacheManagerAccess::view: layer ", layer);
  return sp.view(layer);
}

const LayerStore& CacheManagerAccess::layer(const SequenceCache& m, int64_t layer) {
  KV_CHECK_ARG(layer >= 0 && layer < m.steps_->config().num_layers, "CacheManagerAccess::layer: layer ", layer);
  return m.steps_->store().store(layer);
}

void CacheManagerAccess::attend(const SequenceCache& m, int64_t layer, const TensorView& q,
                                const TensorView& q_positions, bool fused, const MutableTensorView& out) {
  StepProtocol::Pending p;
  m.steps_->prepare_attend(layer, q, q_positions, out, p);
  p.args.need = AttentionNeed{};
  p.args.fused = fused;
  if (p.t_q > 0) attend_generic(p.args);
  if (!p.out.empty()) detail::write_float32(p.out.data(), p.target);
}

}  // namespace kvcache::cache
