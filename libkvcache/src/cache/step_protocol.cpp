// SPDX-License-Identifier: Apache-2.0
// StepProtocol (step_protocol.h): the checks and the order of a sequence's forward steps over
// its SequenceStore. Every public mutator validates everything before it changes anything.
#include "cache/step_protocol.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "common/log.h"
#include "common/view_ops.h"
#include "kvcache/error.h"
#include "kvcache/spec.h"

namespace kvcache::cache {
namespace {

/// Largest magnitude every stored format holds finitely (fp16's): below it, no group of any
/// format falls back to fp32, so BlockList::append_bound is exact.
constexpr float kFp16Max = 65504.0f;

/// Throws naming the first NaN/Inf of `x` (rank 4) as `name`[b, h, t, d].
void check_finite(const TensorView& x, const char* fn, const char* name) {
  const std::vector<int64_t> i = detail::first_nonfinite(x);
  if (i.empty()) return;
  const double v = detail::value_at(x, i);
  throw InvalidArgument(detail::str_cat(fn, ": ", name, " contains ", std::isnan(v) ? "NaN" : (v > 0 ? "+Inf" : "-Inf"),
                                        " at [b, h, t, d] = ", detail::index_str(i),
                                        "; the cache stores finite keys and values only"));
}

/// Throws naming the first NaN/Inf of float32 rows `[H, n, D]` (after RoPE) as `name`[0, h, t, d].
void check_finite_rows(const std::vector<float>& x, int64_t heads, int64_t n, int64_t d, const char* fn,
                       const char* name) {
  check_finite(TensorView(x.data(), DType::kFloat32, {1, heads, n, d}), fn, name);
}

/// Throws unless every value of `probs` `[1, H_q, T_q, T]` is a probability in [0, 1] and no
/// row's mass exceeds 1 (softmax rows over the resident keys sum to 1; 1e-3 of slack for
/// rounding), naming the first bad index.
void check_probabilities(const TensorView& p, const char* fn) {
  const auto* base = static_cast<const float*>(p.data);
  const int64_t hq = p.size(1), tq = p.size(2), t = p.size(3);
  for (int64_t h = 0; h < hq; ++h) {
    for (int64_t r = 0; r < tq; ++r) {
      double sum = 0;
      for (int64_t j = 0; j < t; ++j) {
        const float x = base[h * p.strides[1] + r * p.strides[2] + j * p.strides[3]];
        KV_CHECK_ARG(std::isfinite(x) && x >= 0.0f && x <= 1.0f, fn, ": probs[0, ", h, ", ", r, ", ", j, "] = ", x,
                     " is not a probability (expected a finite value in [0, 1])");
        sum += x;
      }
      KV_CHECK_ARG(sum <= 1.0 + 1e-3, fn, ": probs[0, ", h, ", ", r, ", :] sums to ", sum,
                   " > 1 (expected attention probabilities over the resident keys)");
    }
  }
}

/// A float32 `[1, H, T, D]` view's rows `[H, T, D]` as a contiguous copy.
std::vector<float> rows_f32(const TensorView& x) { return detail::to_float32(x); }

/// Warns (once per policy spec) when the policy's budget holds the whole request: it evicts
/// nothing, which a study arm rarely means.
void warn_if_evicts_nothing(const EvictionPolicy& policy, int64_t context_length) {
  if (context_length <= 0 || policy.budget().kind == Budget::Kind::kNone) return;
  const int64_t budget = policy.token_budget();
  if (budget < context_length) return;
  log::warn_once("evicts-nothing:" + policy.spec(),
                 detail::str_cat("eviction policy '", policy.spec(), "' evicts nothing from a request of ",
                                 context_length, " tokens: its budget of ", budget,
                                 " tokens per KV head holds the whole prompt and every new token"));
}

/// "[B=1, H_kv=2, T_new, D=8]"-style shape checks: rank 4, batch 1, the given heads and dim,
/// a float dtype.
bool fits_4d(const TensorView& t, int64_t heads, int64_t d) {
  return t.defined() && t.rank == 4 && t.size(0) == 1 && t.size(1) == heads && t.size(3) == d && is_kv_dtype(t.dtype);
}

bool fits_positions(const TensorView& p, int64_t n) {
  return p.defined() && p.rank == 1 && p.size(0) == n && p.dtype == DType::kInt64;
}

/// True if the byte ranges of two views overlap.
bool overlap(const TensorView& a, const TensorView& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  auto range = [](const TensorView& v) {
    int64_t last = 0;
    for (int i = 0; i < v.rank; ++i) last += (v.shape[i] - 1) * v.strides[i];
    const auto* p = static_cast<const char*>(v.data);
    return std::pair<const char*, const char*>{p, p + (last + 1) * dtype_size(v.dtype)};
  };
  const auto ra = range(a), rb = range(b);
  return ra.first < rb.second && rb.first < ra.second;
}

}  // namespace

std::string rope_table_reason(const CacheConfig& c, const EvictionPolicy& policy) {
  if (c.key_storage == KeyStorage::kPreRoPE) return "key_storage=kPreRoPE rotates keys on read and needs it";
  if (policy.query_need().pre_rope) {
    return "eviction policy '" + policy.spec() + "' reads pre-RoPE queries and the mean RoPE rotation and needs it";
  }
  return "";
}

StepProtocol::StepProtocol(CacheConfig config, std::shared_ptr<PoolSet> pools, StepHooks* hooks)
    : cfg_(std::move(config)), hooks_(hooks) {
  cfg_.validate();
  const bool shared = pools != nullptr;
  if (!pools) pools = std::make_shared<PoolSet>();
  store_ = std::make_unique<SequenceStore>(cfg_, std::move(pools), shared);
  policy_ = make_eviction_policy(cfg_.policy);
  policy_->reset(cfg_.context_length, CacheShape{cfg_.num_layers, cfg_.num_q_heads, cfg_.num_kv_heads});
  warn_if_evicts_nothing(*policy_, cfg_.context_length);
  const std::string why = rope_table_reason(cfg_, *policy_);
  if (!why.empty()) rope_table_ = common::RopeTable(cfg_.rope, cfg_.head_dim, why);
  steps_.resize(static_cast<size_t>(cfg_.num_layers));
}

void StepProtocol::check_layer(int64_t layer, const char* fn) const {
  KV_CHECK_ARG(layer >= 0 && layer < cfg_.num_layers, fn, ": layer ", layer, " out of range [0, ", cfg_.num_layers,
               ")");
}

int64_t StepProtocol::next_position(int64_t layer) const {
  check_layer(layer, "CacheManager::next_position");
  const auto& l = store_->layer(layer);
  return cfg_.position_mode == PositionMode::kRerotate ? l.store->max_resident() : l.last_pos + 1;
}

void StepProtocol::reset(int64_t context_length) {
  KV_CHECK_ARG(context_length >= 0 && context_length <= kMaxTokens,
               "CacheManager::reset: context_length must be in [0, ", kMaxTokens, "] tokens, got ", context_length);
  const CacheShape shape{cfg_.num_layers, cfg_.num_q_heads, cfg_.num_kv_heads};
  // A budget that does not fit this context throws from the policy's reset, which may have
  // changed the policy by then: try a fresh one first, so that a rejected reset changes nothing.
  make_eviction_policy(cfg_.policy)->reset(context_length, shape);
  policy_->reset(context_length, shape);
  cfg_.context_length = context_length;
  replaying_ = false;
  replay_.clear();
  store_->clear();
  for (auto& s : steps_) s = LayerStep{};
  warn_if_evicts_nothing(*policy_, context_length);
}

void StepProtocol::rotate_keys(std::vector<float>& k, const int64_t* pos, int64_t n, const char* fn) const {
  cfg_.rope(k.data(), cfg_.num_kv_heads, n, cfg_.head_dim, pos);
  check_finite_rows(k, cfg_.num_kv_heads, n, cfg_.head_dim, fn, "rope(k)");
}

void StepProtocol::check_rotated_finite(const std::vector<float>& k, const int64_t* pos, int64_t n,
                                        const char* fn) const {
  const int64_t hkv = cfg_.num_kv_heads, d = cfg_.head_dim;
  std::vector<float> row(static_cast<size_t>(d));
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t t = 0; t < n; ++t) {
      const float* kp = k.data() + (h * n + t) * d;
      std::copy_n(kp, d, row.begin());
      rope_table_.rotate(row.data(), pos[t]);
      for (int64_t i = 0; i < d; ++i) {
        const float y = row[static_cast<size_t>(i)];
        KV_CHECK_ARG(std::isfinite(y), fn, ": rope(k) contains ", std::isnan(y) ? "NaN" : (y > 0 ? "+Inf" : "-Inf"),
                     " at [b, h, t, d] = [0, ", h, ", ", t, ", ", i, "] (k = ", kp[i], " rotated to position ", pos[t],
                     "); the cache stores finite keys and values only, and keys stored pre-RoPE are rotated on read");
      }
    }
  }
}

void StepProtocol::append(int64_t layer, const TensorView& k, const TensorView& v, const TensorView& positions) {
  static constexpr const char* fn = "CacheManager::append";
  check_layer(layer, fn);
  const int64_t hkv = cfg_.num_kv_heads, d = cfg_.head_dim;
  const bool replay = replaying_;
  const char* where = replay ? "CacheManager::append (replay step)" : fn;
  for (const auto& [t, name] : {std::pair<const TensorView*, const char*>{&k, "k"}, {&v, "v"}}) {
    KV_CHECK_ARG(fits_4d(*t, hkv, d) && (!replay || t->size(2) >= 1), where, ": ", name,
                 " must be a CPU float32/float16/bfloat16 tensor [B=1, H_kv=", hkv, replay ? ", T_new >= 1" : ", T_new",
                 ", D=", d, "] (the cache holds one sequence), got ", shape_str(*t));
  }
  KV_CHECK_ARG(k.sizes() == v.sizes(), where, ": k ", shape_str(k.sizes()), " and v ", shape_str(v.sizes()), " differ");
  const int64_t n = k.size(2);
  KV_CHECK_ARG(fits_positions(positions, n), where, ": positions must be a CPU int64 tensor [T_new=", n, "], got ",
               shape_str(positions));
  const std::vector<int64_t> pp = detail::to_int64(positions);
  if (replay) {
    replay_append(layer, k, v, pp);
    return;
  }
  const auto& ls = store_->layer(layer);
  const LayerStep& st = steps_[static_cast<size_t>(layer)];
  KV_CHECK_ARG(!(st.observed || st.queried || st.attended) || n == 0, fn, ": the attention of layer ", layer,
               " was already observed in this step (by attend(), observe_attention or observe_queries); append the "
               "step's tokens first, then attend, then end_step()");
  const bool rerotate = cfg_.position_mode == PositionMode::kRerotate;
  const int64_t first = next_position(layer);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = pp[static_cast<size_t>(i)];
    if (rerotate) {
      KV_CHECK_ARG(p == first + i, fn, " (rerotate mode): positions must continue the cache contiguously from "
                   "next_position(", layer, ") = ", first, "; got ", p, " at index ", i);
    } else {
      KV_CHECK_ARG(i == 0 ? p >= first : p > pp[static_cast<size_t>(i - 1)], fn,
                   ": positions must increase and follow the layer's last position ", ls.last_pos, "; got ", p,
                   " at index ", i);
    }
  }
  if (n == 0) return;
  KV_CHECK_ARG(n >= ls.min_step, fn, ": layer ", layer, " continues a reused prefix of ", ls.written,
               " tokens; its first step must append at least ", ls.min_step,
               " tokens (the scheme's sliding residual), got ", n,
               " (Sequence::prefix().min_first_step; Runner::generate does this)");
  const int64_t last = pp[static_cast<size_t>(n - 1)];
  KV_CHECK_ARG(last < std::numeric_limits<int64_t>::max(), fn, ": position ", last,
               " leaves no next position (positions must be < 2^63 - 1)");
  KV_CHECK_ARG(!rope_table_.enabled() || last < kMaxPreRopePosition, fn, ": position ", last, " is beyond the ",
               kMaxPreRopePosition, " positions the RoPE table records (",
               pre_rope() ? "key_storage=kPreRoPE" : "policy '" + policy_->spec() + "'", ")");
  check_finite(k, fn, "k");
  check_finite(v, fn, "v");
  std::vector<float> kr = rows_f32(k);
  const std::vector<float> vr = rows_f32(v);
  rope_table_.extend(pp.data(), n);  // no-op unless the table is in use
  if (!pre_rope()) {
    rotate_keys(kr, pp.data(), n, fn);
  } else {
    check_rotated_finite(kr, pp.data(), n, fn);  // the rotation every read applies: the range of post-RoPE
  }
  if (hooks_ != nullptr) {
    // The pool's capacity: what this append allocates, checked before anything changes. A
    // value beyond fp16's range may go to an fp32 fallback block: bound those steps loosely.
    // (A Hadamard-rotated stream (`had`) stores H_D·x, whose entries reach up to √D·max|x|.)
    const float limit = kFp16Max / std::sqrt(static_cast<float>(d));
    float amax = 0.0f;
    for (float x : kr) amax = std::max(amax, std::abs(x));
    for (float x : vr) amax = std::max(amax, std::abs(x));
    hooks_->before_append(store_->write_bound(layer, n, amax > limit));
  }
  // --- nothing below throws for valid input ---
  store_->write(layer, kr.data(), vr.data(), pp.data(), n);
  steps_[static_cast<size_t>(layer)].step_new += n;
}

// ---------------------------------------------------------------- replay steps
void StepProtocol::begin_replay() {
  static constexpr const char* fn = "CacheManager::begin_replay";
  KV_CHECK_ARG(!replaying_, fn, ": a replay step is already open; end it with end_step(kReplay or kReplayEnd)");
  for (size_t i = 0; i < steps_.size(); ++i) {
    const auto& s = steps_[i];
    KV_CHECK_ARG(s.step_new == 0 && !s.observed && !s.queried && !s.attended, fn, ": layer ", i,
                 " is inside a step (tokens appended or attention observed); call begin_replay() after end_step()");
  }
  replaying_ = true;
  replay_plans_ = policy_->replay_need().any();
  replay_.assign(steps_.size(), ReplayLayer{});
}

void StepProtocol::replay_append(int64_t layer, const TensorView& k, const TensorView& v,
                                 const std::vector<int64_t>& pp) {
  static constexpr const char* fn = "CacheManager::append (replay step)";
  auto& r = replay_[static_cast<size_t>(layer)];
  KV_CHECK_ARG(r.pos.empty(), fn, ": layer ", layer, " already appended its replay tokens in this step");
  const int64_t n = k.size(2);
  const int64_t first = next_position(layer);
  for (int64_t i = 0; i < n; ++i) {
    KV_CHECK_ARG(pp[static_cast<size_t>(i)] == first + i, fn, ": replay positions continue the context: next_position(",
                 layer, ") + i = ", first + i, " expected, got ", pp[static_cast<size_t>(i)], " at index ", i);
  }
  check_finite(k, fn, "k");
  check_finite(v, fn, "v");
  std::vector<float> kr = rows_f32(k);
  rotate_keys(kr, pp.data(), n, fn);  // the replay's keys are attended post-RoPE whatever the storage
  r.k = std::move(kr);
  r.v = rows_f32(v);
  r.pos = pp;
}

// ---------------------------------------------------------------- attend
void StepProtocol::prepare_attend(int64_t layer, const TensorView& q, const TensorView& q_positions,
                                  const MutableTensorView& out, Pending& p) const {
  static constexpr const char* fn = "CacheManager::attend";
  check_layer(layer, fn);
  const int64_t hq = cfg_.num_q_heads, d = cfg_.head_dim;
  const LayerStep& st = steps_[static_cast<size_t>(layer)];
  p = Pending{};
  p.layer = layer;
  p.replay = replaying_;
  if (p.replay) {
    static constexpr const char* rfn = "CacheManager::attend (replay step)";
    const auto& r = replay_[static_cast<size_t>(layer)];
    const auto n = static_cast<int64_t>(r.pos.size());
    KV_CHECK_ARG(n > 0, rfn, ": layer ", layer, " appended no replay tokens in this step (append, then attend)");
    KV_CHECK_ARG(!r.attended, rfn, ": layer ", layer, " already attended in this replay step");
    KV_CHECK_ARG(fits_4d(q, hq, d) && q.size(2) == n, rfn, ": q must be a float tensor [B=1, H_q=", hq, ", T_q=", n,
                 " (the replay tokens), D=", d, "], got ", shape_str(q));
    KV_CHECK_ARG(fits_positions(q_positions, n), rfn, ": q_positions must be a CPU int64 tensor [T_q=", n, "], got ",
                 shape_str(q_positions));
    p.q_pos = detail::to_int64(q_positions);
    for (int64_t i = 0; i < n; ++i) {
      KV_CHECK_ARG(p.q_pos[static_cast<size_t>(i)] == r.pos[static_cast<size_t>(i)], rfn,
                   ": q_positions must be the replay tokens' positions; expected ", r.pos[static_cast<size_t>(i)],
                   " at index ", i, ", got ", p.q_pos[static_cast<size_t>(i)]);
    }
    check_finite(q, rfn, "q");
    p.need = policy_->replay_need().attention;
  } else {
    KV_CHECK_ARG(fits_4d(q, hq, d), fn, ": q must be a CPU float32/float16/bfloat16 tensor [B=1, H_q=", hq, ", T_q, D=", d,
                 "], got ", shape_str(q));
    const int64_t tq = q.size(2);
    KV_CHECK_ARG(fits_positions(q_positions, tq), fn, ": q_positions must be a CPU int64 tensor [T_q=", tq, "], got ",
                 shape_str(q_positions));
    check_finite(q, fn, "q");
    p.q_pos = detail::to_int64(q_positions);
    p.need = st.observed ? AttentionNeed{} : policy_->attention_need();
    p.qneed = st.queried ? QueryNeed{} : policy_->query_need();
  }
  const int64_t tq = q.size(2);
  KV_CHECK_ARG(out.defined() && out.rank == 4 && out.size(0) == 1 && out.size(1) == hq && out.size(2) == tq &&
                   out.size(3) == d && out.dtype == DType::kFloat32,
               fn, ": out must be a float32 tensor [1, H_q=", hq, ", T_q=", tq, ", D=", d, "], got ",
               shape_str(TensorView(out)));
  KV_CHECK_ARG(!overlap(q, out), fn, ": out overlaps q (attention reads every query row before it writes)");
  p.t_q = tq;
  p.target = out;
  const float* qp = nullptr;
  if (q.dtype == DType::kFloat32 && q.is_contiguous()) {
    qp = static_cast<const float*>(q.data);
  } else {
    p.q = rows_f32(q);
    qp = p.q.data();
  }
  float* op = nullptr;
  if (out.is_contiguous()) {
    op = static_cast<float*>(out.data);
  } else {
    p.out.resize(static_cast<size_t>(hq * tq * d));
    op = p.out.data();
  }
  AttendArgs& a = p.args;
  a.layer = &store_->store(layer);
  a.q = qp;
  a.q_pos = p.q_pos.data();
  a.t_q = tq;
  a.num_q_heads = hq;
  a.rope = pre_rope() ? &rope_table_ : nullptr;
  a.need = p.need;
  a.out = op;
  a.mass = &p.mass;
  a.fused = cfg_.fused_attention;
  if (p.replay) {
    const auto& r = replay_[static_cast<size_t>(layer)];
    a.tail_k = r.k.data();
    a.tail_v = r.v.data();
    a.tail_pos = r.pos.data();
    a.tail_n = static_cast<int64_t>(r.pos.size());
  }
}

void StepProtocol::finish_attend(Pending& p) {
  if (!p.out.empty()) detail::write_float32(p.out.data(), p.target);
  if (p.replay) {
    replay_[static_cast<size_t>(p.layer)].attended = true;
    if (p.need.any()) policy_->observe(p.layer, p.mass);
    return;
  }
  LayerStep& st = steps_[static_cast<size_t>(p.layer)];
  if (p.t_q > 0) st.attended = true;
  if (p.need.any() && p.t_q > 0) {
    policy_->observe(p.layer, p.mass);
    st.observed = true;
  }
  if (p.qneed.any() && p.t_q > 0) hand_queries(p.layer, p.args.q, p.q_pos.data(), p.t_q, p.qneed);
}

void StepProtocol::attend(int64_t layer, const TensorView& q, const TensorView& q_positions,
                          const MutableTensorView& out) {
  Pending p;
  prepare_attend(layer, q, q_positions, out, p);
  if (p.t_q > 0) attend_generic(p.args);
  finish_attend(p);
}

BlockLayerView StepProtocol::view(int64_t layer) const {
  return BlockLayerView(&store_->store(layer), pre_rope() ? &rope_table_ : nullptr,
                        rope_table_.enabled() ? &rope_table_ : nullptr, next_position(layer));
}

void StepProtocol::hand_queries(int64_t layer, const float* q, const int64_t* q_pos, int64_t tq,
                                const QueryNeed& need) {
  const int64_t hq = cfg_.num_q_heads, d = cfg_.head_dim;
  const int64_t n = need.selected(tq);
  QueryRows rows;
  rows.num_q_heads = hq;
  rows.head_dim = d;
  rows.positions.assign(q_pos + tq - n, q_pos + tq);
  rows.post_rope.resize(static_cast<size_t>(hq * n * d));
  for (int64_t h = 0; h < hq; ++h) {
    std::copy_n(q + (h * tq + tq - n) * d, n * d, rows.post_rope.data() + h * n * d);
  }
  if (need.pre_rope) {
    KV_INTERNAL_ASSERT(rope_table_.enabled(), "pre-RoPE queries without a RoPE table");
    for (int64_t p : rows.positions) {
      KV_CHECK_ARG(p >= 0 && p < kMaxPreRopePosition, "CacheManager::attend: query position ", p, " is outside [0, ",
                   kMaxPreRopePosition, ") the RoPE table records");
    }
    rope_table_.extend(rows.positions.data(), n);
    rows.pre_rope = rows.post_rope;
    for (int64_t h = 0; h < hq; ++h) {
      for (int64_t t = 0; t < n; ++t) {
        rope_table_.unrotate(rows.pre_rope.data() + (h * n + t) * d, rows.positions[static_cast<size_t>(t)]);
      }
    }
  }
  const BlockLayerView layer_view = view(layer);
  policy_->observe_queries(layer, rows, layer_view);
  steps_[static_cast<size_t>(layer)].queried = true;
}

void StepProtocol::observe_queries(int64_t layer, const TensorView& q, const TensorView& q_positions) {
  static constexpr const char* fn = "CacheManager::observe_queries";
  check_layer(layer, fn);
  KV_CHECK_ARG(!replaying_, fn, ": a replay step hands the policy no query rows; end it first");
  const int64_t hq = cfg_.num_q_heads, d = cfg_.head_dim;
  KV_CHECK_ARG(fits_4d(q, hq, d) && q.size(2) >= 1, fn, ": q must be a CPU float32/float16/bfloat16 tensor [B=1, H_q=", hq,
               ", T_q >= 1, D=", d, "] (post-RoPE), got ", shape_str(q));
  KV_CHECK_ARG(fits_positions(q_positions, q.size(2)), fn, ": q_positions must be a CPU int64 tensor [T_q=", q.size(2),
               "], got ", shape_str(q_positions));
  KV_CHECK_ARG(!steps_[static_cast<size_t>(layer)].queried, fn, ": the queries of layer ", layer,
               " were already observed in this step");
  check_finite(q, fn, "q");
  steps_[static_cast<size_t>(layer)].attended = true;
  const QueryNeed need = policy_->query_need();
  if (!need.any()) return;
  const std::vector<float> qf = rows_f32(q);
  const std::vector<int64_t> qp = detail::to_int64(q_positions);
  hand_queries(layer, qf.data(), qp.data(), q.size(2), need);
}

void StepProtocol::observe_attention(int64_t layer, const TensorView& probs) {
  static constexpr const char* fn = "CacheManager::observe_attention";
  check_layer(layer, fn);
  KV_CHECK_ARG(!replaying_, fn, ": a replay step computes its attention in attend(); end it first");
  const LayerStore& s = store_->store(layer);
  const int64_t t = s.max_resident();
  for (int64_t h = 0; h < cfg_.num_kv_heads; ++h) {
    KV_CHECK_ARG(s.resident(h) == t, fn, ": KV head ", h, " of layer ", layer, " holds ", s.resident(h),
                 " tokens but head 0 holds ", s.resident(0),
                 "; probabilities [B, H_q, T_q, T_res] need heads of equal length (use attend())");
  }
  KV_CHECK_ARG(probs.defined() && probs.rank == 4 && probs.dtype == DType::kFloat32 && probs.size(0) == 1 &&
                   probs.size(1) == cfg_.num_q_heads && probs.size(2) >= 1 && probs.size(3) == t,
               fn, ": probs must be a CPU float32 tensor [B=1, H_q=", cfg_.num_q_heads, ", T_q >= 1, T_res=", t,
               "] for layer ", layer, ", got ", shape_str(probs));
  KV_CHECK_ARG(!steps_[static_cast<size_t>(layer)].observed, fn, ": the attention of layer ", layer,
               " was already observed in this step (by attend() or observe_attention)");
  check_probabilities(probs, fn);
  steps_[static_cast<size_t>(layer)].attended = true;
  const AttentionNeed need = policy_->attention_need();
  if (!need.any()) return;
  const AttentionMass mass = reduce_attention(probs, cfg_.num_kv_heads, need);
  policy_->observe(layer, mass);
  steps_[static_cast<size_t>(layer)].observed = true;
}

// ---------------------------------------------------------------- end_step
void StepProtocol::check_plan(int64_t layer, const EvictionPlan& plan) const {
  if (plan.evict.empty()) return;
  const LayerStore& st = store_->store(layer);
  KV_INTERNAL_ASSERT(static_cast<int64_t>(plan.evict.size()) == cfg_.num_kv_heads, "policy '", policy_->spec(),
                     "' planned ", plan.evict.size(), " heads for layer ", layer);
  for (int64_t h = 0; h < cfg_.num_kv_heads; ++h) {
    const auto& e = plan.evict[static_cast<size_t>(h)];
    const int64_t t = st.resident(h);
    for (size_t i = 0; i < e.size(); ++i) {
      KV_INTERNAL_ASSERT(e[i] >= 0 && e[i] < t - 1 && (i == 0 || e[i] > e[i - 1]), "policy '", policy_->spec(),
                         "' plan for layer ", layer, " head ", h, " is not strictly increasing in [0, ", t - 1,
                         ") at ", i, " (the newest token is never evicted)");
    }
  }
}

void StepProtocol::end_step(StepKind step) {
  const bool replay_kind = step == StepKind::kReplay || step == StepKind::kReplayEnd;
  KV_CHECK_ARG(replay_kind || step == StepKind::kPrefill || step == StepKind::kPrefillEnd || step == StepKind::kDecode,
               "CacheManager::end_step: step kind ", static_cast<int>(step),
               " is none of kPrefill, kPrefillEnd, kDecode, kReplay, kReplayEnd");
  KV_CHECK_ARG(replay_kind == replaying_, "CacheManager::end_step: ",
               replaying_ ? "a replay step (begin_replay()) must end with kReplay or kReplayEnd"
                          : "kReplay / kReplayEnd ends a replay step; call begin_replay() before its appends");
  if (replaying_) {
    for (size_t i = 0; i < replay_.size(); ++i) {
      KV_CHECK_ARG(replay_[i].pos.size() == replay_[0].pos.size() && replay_[i].attended, "CacheManager::end_step: ",
                   "layer ", i, " appended ", replay_[i].pos.size(), " replay tokens",
                   replay_[i].attended ? "" : " and did not attend", " but layer 0 appended ", replay_[0].pos.size(),
                   " (every layer must append and attend the replay step's tokens)");
    }
    if (!replay_plans_) {
      // A replay the policy did not ask for only computed attention: nothing to plan.
      replaying_ = false;
      replay_.clear();
      return;
    }
  }
  const int64_t n0 = steps_[0].step_new;
  for (int64_t i = 1; i < cfg_.num_layers; ++i) {
    KV_CHECK_ARG(steps_[static_cast<size_t>(i)].step_new == n0, "CacheManager::end_step: layer ", i, " appended ",
                 steps_[static_cast<size_t>(i)].step_new, " tokens this step but layer 0 appended ", n0,
                 " (every layer must append the step's tokens)");
  }
  // Plan every layer first (plan() is const): a plan that throws leaves every layer and the
  // policy as they were.
  std::vector<EvictionPlan> plans(static_cast<size_t>(cfg_.num_layers));
  std::vector<EvictionContext> contexts(static_cast<size_t>(cfg_.num_layers));
  for (int64_t i = 0; i < cfg_.num_layers; ++i) {
    const BlockLayerView layer_view = view(i);
    const LayerStore& s = store_->store(i);
    EvictionContext& ctx = contexts[static_cast<size_t>(i)];
    ctx.view = &layer_view;
    ctx.layer = i;
    ctx.step = step;
    ctx.new_tokens = steps_[static_cast<size_t>(i)].step_new;
    ctx.logical_length = store_->layer(i).written;
    ctx.resident.resize(static_cast<size_t>(cfg_.num_kv_heads));
    for (int64_t h = 0; h < cfg_.num_kv_heads; ++h) ctx.resident[static_cast<size_t>(h)] = s.resident(h);
    plans[static_cast<size_t>(i)] = policy_->plan(ctx);
    check_plan(i, plans[static_cast<size_t>(i)]);
    ctx.view = nullptr;  // on_step_end sees the context without a view (the layer changes first)
  }
  if (hooks_ != nullptr) {
    int64_t bytes = 0;
    for (int64_t i = 0; i < cfg_.num_layers; ++i) {
      const auto& plan = plans[static_cast<size_t>(i)];
      if (!plan.empty()) bytes += store_->evict_bound(i, plan.evict);
    }
    hooks_->before_evict(bytes);
  }
  for (int64_t i = 0; i < cfg_.num_layers; ++i) {
    const auto& plan = plans[static_cast<size_t>(i)];
    if (!plan.empty()) {
      store_->evict(i, plan.evict, cfg_.position_mode == PositionMode::kRerotate);
      policy_->on_evicted(i, plan);
    }
    policy_->on_step_end(contexts[static_cast<size_t>(i)]);
    steps_[static_cast<size_t>(i)] = LayerStep{};
  }
  if (replaying_) {
    replaying_ = false;  // the replay's tokens are dropped: nothing of them was stored
    replay_.clear();
  }
}

// ---------------------------------------------------------------- reads
LayerTokens StepProtocol::tokens(int64_t layer) const {
  check_layer(layer, "CacheManager::tokens");
  const auto& l = store_->layer(layer);
  LayerTokens t;
  t.written = l.written;
  t.next_position = next_position(layer);
  for (int64_t h = 0; h < cfg_.num_kv_heads; ++h) t.positions.push_back(l.store->k(h).positions());
  t.stats = l.stats;
  t.stats.tokens_written = l.written;
  return t;
}

LayerKV StepProtocol::get(int64_t layer) const {
  check_layer(layer, "CacheManager::get");
  const LayerStore& s = store_->store(layer);
  const int64_t hkv = cfg_.num_kv_heads, d = cfg_.head_dim;
  const int64_t t = s.max_resident();
  for (int64_t h = 0; h < hkv; ++h) {
    KV_CHECK(s.resident(h) == t, UnsupportedError, "CacheManager::get: KV head ", h, " of layer ", layer, " holds ",
             s.resident(h), " tokens but another holds ", t, "; use tokens() for ragged heads");
  }
  LayerKV out;
  out.k = Buffer(DType::kFloat32, {1, hkv, t, d});
  out.v = Buffer(DType::kFloat32, {1, hkv, t, d});
  out.positions = Buffer(DType::kInt64, {hkv, t});
  for (int64_t h = 0; h < hkv; ++h) {
    std::vector<float> kr, vr;
    const std::vector<int64_t> pos = store_->decode_head(layer, h, kr, vr);
    if (pre_rope()) {
      for (size_t j = 0; j < pos.size(); ++j) rope_table_.rotate(kr.data() + static_cast<int64_t>(j) * d, pos[j]);
    }
    std::copy(kr.begin(), kr.end(), out.k.data_as<float>() + h * t * d);
    std::copy(vr.begin(), vr.end(), out.v.data_as<float>() + h * t * d);
    std::copy(pos.begin(), pos.end(), out.positions.data_as<int64_t>() + h * t);
  }
  return out;
}

void StepProtocol::check_invariants() const { store_->check(cfg_.position_mode == PositionMode::kRerotate); }

// ---------------------------------------------------------------- prefix reuse
std::string StepProtocol::replay_blocker(int64_t tokens, bool allow_attention) const {
  const EvictionPolicy& policy = *policy_;
  if (policy.needs_attention() && !allow_attention) {
    return detail::str_cat("policy '", policy.spec(),
                           "' reads the prompt's attention during prefill, which a reused prefix skips");
  }
  for (int64_t i = 0; i < cfg_.num_layers; ++i) {
    if (policy.needs_attention()) {
      // Its plan needs the skipped attention: test the budget alone.
      const int64_t b = policy.layer_budget(i);
      if (tokens > b) {
        return detail::str_cat("policy '", policy.spec(), "' keeps ", b, " tokens in layer ", i,
                               ", fewer than the prefix of ", tokens);
      }
      continue;
    }
    EvictionContext ctx;
    ctx.layer = i;
    ctx.step = StepKind::kPrefill;
    ctx.new_tokens = tokens;
    ctx.logical_length = tokens;
    ctx.resident.assign(static_cast<size_t>(cfg_.num_kv_heads), tokens);
    try {
      if (!policy.plan(ctx).empty()) {
        return detail::str_cat("policy '", policy.spec(), "' would evict in layer ", i, " during a prefill of ", tokens,
                               " tokens (budget ", policy.layer_budget(i), ")");
      }
    } catch (const Error& e) {
      return e.what();
    }
  }
  return "";
}

void StepProtocol::adopt(const AdoptedPrefix& prefix) {
  for (const auto& s : steps_) KV_INTERNAL_ASSERT(s.step_new == 0, "adopt into a manager inside a step");
  store_->adopt(prefix);
  const int64_t n = prefix.tokens;
  if (pre_rope()) {
    std::vector<int64_t> pos(static_cast<size_t>(n));
    std::iota(pos.begin(), pos.end(), int64_t{0});
    rope_table_.extend(pos.data(), n);
  }
  // The policy sees the end of the step that would have appended the prefix (it planned nothing).
  for (int64_t i = 0; i < cfg_.num_layers; ++i) {
    EvictionContext ctx;
    ctx.layer = i;
    ctx.step = StepKind::kPrefill;
    ctx.new_tokens = n;
    ctx.logical_length = n;
    ctx.resident.assign(static_cast<size_t>(cfg_.num_kv_heads), n);
    policy_->on_step_end(ctx);
  }
}

}  // namespace kvcache::cache
