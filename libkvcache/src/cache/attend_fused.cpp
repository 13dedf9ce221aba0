// SPDX-License-Identifier: Apache-2.0
// Format classification, CPU detection and query preparation of the fused kernels
// (attend_fused.h). Compiled with the project's default flags: nothing here may use the
// instructions the kernels need; attend_avx512.cpp and attend_avx2.cpp hold the kernels
// themselves.
#include "cache/attend_fused.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <cmath>
#include <string>
#if defined(KVCACHE_FUSED_AVX2)
#include <cpuid.h>
#endif

#include "cache/attend.h"
#include "kvcache/attention.h"
#include "kvcache/error.h"
#include "quant/hadamard.h"
#include "quant/polar_quantizer.h"
#include "quant/qjl_quantizer.h"
#include "quant/turboquant_quantizer.h"

namespace kvcache::cache::fused {

namespace {

bool int_chunks_fit(int bits, int64_t g) {
  // A 32-dim chunk must lie in one group and be a contiguous run of one packed code stream.
  if (g % 32 != 0) return false;
  switch (bits) {
    case 8: return true;
    case 4: return g == 32 || g % 64 == 0;
    case 2: return g == 32 || g == 64 || g % 128 == 0;
    default: return false;
  }
}

}  // namespace

KernelFormat classify(const BlockFormat& f) {
  KernelFormat k;
  const int64_t d = f.head_dim;
  if (f.quantizer == nullptr || d % 32 != 0 || d > 256) return k;
  const StoredLayout& l = f.layout;
  k.head_dim = d;
  k.code_bytes = l.code_bytes;
  k.meta_count = l.meta_count;
  k.scales_offset = f.scales_offset;
  k.zeros_offset = f.zeros_offset;
  switch (l.kernel) {
    case KernelKind::kNone: return KernelFormat{};
    case KernelKind::kFloat32: k.kind = KernelFormat::Kind::kF32; break;
    case KernelKind::kFloat16: k.kind = KernelFormat::Kind::kF16; break;
    case KernelKind::kBFloat16: k.kind = KernelFormat::Kind::kBF16; break;
    case KernelKind::kFp8E4M3:
    case KernelKind::kFp8E5M2:
      k.kind = l.kernel == KernelKind::kFp8E4M3 ? KernelFormat::Kind::kE4M3 : KernelFormat::Kind::kE5M2;
      k.scaled = l.tensor_scale;
      break;
    case KernelKind::kTurboQuant: {
      const auto* tq = dynamic_cast<const quant::TurboQuantizer*>(f.quantizer);
      KV_INTERNAL_ASSERT(tq != nullptr, "fused::classify: KernelKind::kTurboQuant from ", f.quantizer->spec());
      // The tables live as long as the quantizer (TurboQuantizer keeps them per head_dim).
      const std::shared_ptr<const quant::TurboQuantizer::Tables> t = tq->tables(d);
      k.kind = KernelFormat::Kind::kTurboQuant;
      k.tq_hi = tq->hi_bits();
      k.tq_lo = tq->lo_bits();
      k.tq_n_hi = tq->hi_count(d);
      k.tq_mse_bytes = tq->mse_code_bytes(d);
      k.tq_nc = tq->norm_correction();
      k.tq_prod = tq->mode() == quant::TurboMode::kProd;
      k.tq_levels_hi = t->levels_hi.data();
      k.tq_levels_lo = t->levels_lo.data();
      k.rot_signs = t->signs.data();
      k.sketch = k.tq_prod ? t->sketch.data() : nullptr;
      break;
    }
    case KernelKind::kPolar: {
      const auto* pq = dynamic_cast<const quant::PolarQuantizer*>(f.quantizer);
      KV_INTERNAL_ASSERT(pq != nullptr, "fused::classify: KernelKind::kPolar from ", f.quantizer->spec());
      const std::shared_ptr<const quant::PolarQuantizer::KernelTables> t = pq->kernel_tables(d);
      k.kind = KernelFormat::Kind::kPolar;
      k.rot_signs = t->signs.data();
      k.polar_angles = t->angles.data();
      break;
    }
    case KernelKind::kQjl: {
      const auto* qj = dynamic_cast<const quant::QjlKeyQuantizer*>(f.quantizer);
      KV_INTERNAL_ASSERT(qj != nullptr, "fused::classify: KernelKind::kQjl from ", f.quantizer->spec());
      const quant::QjlParams& p = qj->params();
      if (p.sketch > kMaxQjlSketch) return KernelFormat{};
      k.kind = KernelFormat::Kind::kQjl;
      k.group = p.group;
      k.qjl_m = p.sketch;
      k.qjl_mo = p.outlier_sketch;
      k.qjl_o = p.outliers;
      // S and Sᵀ live as long as the quantizer (QjlKeyQuantizer keeps them per head_dim).
      const std::shared_ptr<const quant::QjlKeyQuantizer::Sketch> t = qj->sketch_tables(d);
      k.sketch = t->s.data();
      k.sketch_t = t->s_t.data();
      break;
    }
    case KernelKind::kIntToken:
    case KernelKind::kIntChannel:
      k.bits = l.kernel_bits;
      k.group = l.kernel_group;
      // The kernels unpack power-of-two widths only; int3's two-plane codes take the generic path.
      if (k.bits != 8 && k.bits != 4 && k.bits != 2) return KernelFormat{};
      if (l.kernel == KernelKind::kIntToken) {
        if (!int_chunks_fit(k.bits, k.group)) return KernelFormat{};
        k.kind = KernelFormat::Kind::kIntToken;
      } else {
        k.kind = KernelFormat::Kind::kIntChannel;
      }
      break;
  }
  return k;
}

namespace {

bool cpu_runs(FusedIsa isa) {
  switch (isa) {
    case FusedIsa::kNone: return true;
    case FusedIsa::kAvx512: {
#if defined(KVCACHE_FUSED_AVX512)
      static const bool ok = [] {
        __builtin_cpu_init();
        // F16C is not asked for: every AVX-512F CPU has it (and clang's builtin does not know the
        // name).
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi") &&
               __builtin_cpu_supports("fma");
      }();
      return ok;
#else
      return false;
#endif
    }
    case FusedIsa::kAvx2: {
#if defined(KVCACHE_FUSED_AVX2)
      static const bool ok = [] {
        __builtin_cpu_init();
        // F16C from CPUID leaf 1 (ECX bit 29): clang's builtin does not know the name. The OS
        // saves the ymm state where __builtin_cpu_supports("avx2") says yes.
        unsigned a = 0, b = 0, c = 0, d = 0;
        const bool f16c = __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
        return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
      }();
      return ok;
#else
      return false;
#endif
    }
  }
  return false;
}

std::atomic<FusedIsa>& selected() {
  static std::atomic<FusedIsa> isa{best_isa()};
  return isa;
}

}  // namespace

FusedIsa isa_from_name(const std::string& v, const std::string& source) {
  if (v.empty()) return best_isa();
  FusedIsa isa = FusedIsa::kNone;
  bool known = false;
  for (const FusedIsa i : {FusedIsa::kAvx512, FusedIsa::kAvx2, FusedIsa::kNone}) {
    if (v == isa_name(i)) isa = i, known = true;
  }
  KV_CHECK_ARG(known, source, "=", v, ": expected avx512, avx2 or none (or empty: the best this CPU runs, here ",
               isa_name(best_isa()), ")");
  KV_CHECK_ARG(cpu_runs(isa), source, "=", v, ": this CPU (or build) cannot run the ", v,
               " attention kernels; the best it runs is ", isa_name(best_isa()));
  return isa;
}

FusedIsa best_isa() {
  static const FusedIsa best = cpu_runs(FusedIsa::kAvx512) ? FusedIsa::kAvx512
                               : cpu_runs(FusedIsa::kAvx2) ? FusedIsa::kAvx2
                                                           : FusedIsa::kNone;
  return best;
}

FusedIsa current_isa() { return selected().load(std::memory_order_relaxed); }

bool use_fused_isa(FusedIsa isa) {
  if (!cpu_runs(isa)) return false;
  selected().store(isa, std::memory_order_relaxed);
  return true;
}

void set_isa(FusedIsa isa) {
  KV_INTERNAL_ASSERT(use_fused_isa(isa), "set_isa: ", isa_name(isa), " does not run here");
  // The generic path's tile kernels sum as the chosen CPU's would (docs/cache-manager.md).
  (void)use_tile_lanes(isa == FusedIsa::kAvx2 ? 8 : 0);
}

const char* isa_name(FusedIsa isa) {
  switch (isa) {
    case FusedIsa::kAvx512: return "avx512";
    case FusedIsa::kAvx2: return "avx2";
    case FusedIsa::kNone: break;
  }
  return "none";
}

bool available() { return current_isa() != FusedIsa::kNone; }

void prepare(const float* q, int64_t rows, int64_t d, float scale, Queries& out) {
  KV_INTERNAL_ASSERT(d % 32 == 0 && d <= 256, "fused::prepare: head_dim ", d);
  const int64_t chunks = d / 32;
  out.qf.resize(static_cast<size_t>(rows * d));
  out.qt.resize(static_cast<size_t>(2 * rows * d));
  out.qs.resize(static_cast<size_t>(rows * chunks));
  out.qsum.resize(static_cast<size_t>(rows * chunks));
  out.qfsum.resize(static_cast<size_t>(rows * chunks));
  out.qsum1.resize(static_cast<size_t>(rows * chunks));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < chunks; ++c) {
      const float* src = q + r * d + c * 32;
      float* qf = out.qf.data() + r * d + c * 32;
      float amax = 0.0f, fsum = 0.0f;
      for (int i = 0; i < 32; ++i) {
        qf[i] = src[i] * scale;
        amax = std::max(amax, std::abs(qf[i]));
        fsum += qf[i];
      }
      out.qfsum[static_cast<size_t>(r * chunks + c)] = fsum;
      const float qs = amax > 0.0f ? amax / 127.0f : 1.0f;
      const float step = qs / kLowSteps;
      int8_t* qh = out.qt.data() + (c * rows + r) * 64;  // QueryView::qt: [chunk][row][hi, lo][32]
      int8_t* ql = qh + 32;
      float sum = 0.0f, sum1 = 0.0f;
      for (int i = 0; i < 32; ++i) {
        const float hi = std::clamp(std::nearbyint(qf[i] / qs), -127.0f, 127.0f);
        const float lo = std::clamp(std::nearbyint((qf[i] - qs * hi) / step), -127.0f, 127.0f);
        qh[i] = static_cast<int8_t>(hi);
        ql[i] = static_cast<int8_t>(lo);
        sum += qs * hi + step * lo;
        sum1 += qs * hi;
      }
      out.qsum1[static_cast<size_t>(r * chunks + c)] = sum1;
      out.qs[static_cast<size_t>(r * chunks + c)] = qs;
      // The zero point multiplies the ROUNDED query's sum, so that the integer path computes
      // exactly q'·k̂ for q' = qs·qh + step·ql: its only error is q's (tiny) rounding.
      out.qsum[static_cast<size_t>(r * chunks + c)] = sum;
    }
  }
  out.view = QueryView{rows, d, out.qf.data(), out.qt.data(), out.qs.data(), out.qsum.data(), out.qfsum.data()};
  out.view.qsum1 = out.qsum1.data();
  switch (query_rounding()) {
    case QueryRounding::kTwoTerm: break;
    case QueryRounding::kInt8:
      out.view.one_term_token = kInt8QueryTokenBits;
      out.view.one_term_channel = kInt8QueryChannelBits;
      break;
    case QueryRounding::kInt8Everywhere: out.view.one_term_token = out.view.one_term_channel = ~0u; break;
  }
}

namespace {
std::atomic<QueryRounding>& rounding() {
  static std::atomic<QueryRounding> r{QueryRounding::kTwoTerm};
  return r;
}
}  // namespace

QueryRounding query_rounding() { return rounding().load(std::memory_order_relaxed); }
void set_query_rounding(QueryRounding r) { rounding().store(r, std::memory_order_relaxed); }

bool same_rotation(const KernelFormat& a, const KernelFormat& b) {
  if (a.kind != b.kind) return false;
  if (a.kind == KernelFormat::Kind::kQjl) {
    if (a.sketch == b.sketch) return true;
    const auto n = static_cast<size_t>(a.qjl_m * a.head_dim);
    return a.head_dim == b.head_dim && a.qjl_m == b.qjl_m && std::equal(a.sketch, a.sketch + n, b.sketch);
  }
  if (a.rot_signs == b.rot_signs) return a.sketch == b.sketch || !a.tq_prod || !b.tq_prod;
  if (a.head_dim != b.head_dim) return false;
  const auto n = static_cast<size_t>(a.head_dim);
  if (!std::equal(a.rot_signs, a.rot_signs + n, b.rot_signs)) return false;
  return !a.tq_prod || !b.tq_prod || std::equal(a.sketch, a.sketch + n * n, b.sketch);
}

void rotate_queries(const KernelFormat& kf, Queries& q) {
  const int64_t rows = q.view.rows, d = q.view.d;
  // S·qf per row: m = D rows of S for TurboQuant-Prod, qjl_m for QJL.
  auto sketch_rows = [&](int64_t m) {
    q.qsketch.resize(static_cast<size_t>(rows * m));
    for (int64_t r = 0; r < rows; ++r) {
      const float* qf = q.qf.data() + r * d;
      for (int64_t j = 0; j < m; ++j) {
        const float* sj = kf.sketch + j * d;
        float acc = 0.0f;
        for (int64_t i = 0; i < d; ++i) acc += sj[i] * qf[i];
        q.qsketch[static_cast<size_t>(r * m + j)] = acc;
      }
    }
    q.view.qsketch = q.qsketch.data();
  };
  if (kf.kind == KernelFormat::Kind::kQjl) {
    // S·qf from the quantizer's Sᵀ: row r's m sums as Σ_c qf_c·Sᵀ[c, :] (each entry's products
    // added in the order of S's row, c ascending, as the row-major dot did), a contiguous
    // multiply-add over m per dim that the compiler vectorises; the kernels read Sᵀ itself.
    const int64_t m = kf.qjl_m;
    q.view.qrot = nullptr;
    q.qsketch.assign(static_cast<size_t>(rows * m), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      const float* qf = q.qf.data() + r * d;
      float* __restrict out = q.qsketch.data() + r * m;
      for (int64_t c = 0; c < d; ++c) {
        const float qc = qf[c];
        const float* __restrict st = kf.sketch_t + c * m;
        for (int64_t j = 0; j < m; ++j) out[j] += qc * st[j];
      }
    }
    q.view.qsketch = q.qsketch.data();
    q.view.sketch_t = kf.sketch_t;
    return;
  }
  KV_INTERNAL_ASSERT(kf.kind == KernelFormat::Kind::kTurboQuant || kf.kind == KernelFormat::Kind::kPolar,
                     "fused::rotate_queries: not a TurboQuant, PolarQuant or QJL format");
  q.qrot.resize(static_cast<size_t>(rows * d));
  for (int64_t i = 0; i < rows * d; ++i) q.qrot[static_cast<size_t>(i)] = q.qf[static_cast<size_t>(i)] * kf.rot_signs[i % d];
  quant::hadamard_rows(q.qrot.data(), rows, d);
  q.view.qrot = q.qrot.data();
  q.view.qsketch = nullptr;
  if (kf.tq_prod) sketch_rows(d);
}

void add_rotated_back(const float* signs, float* rot, int64_t rows, int64_t d, float* acc) {
  quant::hadamard_rows(rot, rows, d);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < d; ++i) acc[r * d + i] += signs[i] * rot[r * d + i];
  }
}

void scores(const Queries& q, int64_t r0, int64_t nr, const RawTokens& k, int64_t n, float* s, int64_t ld) {
  switch (current_isa()) {
#if defined(KVCACHE_FUSED_AVX512)
    case FusedIsa::kAvx512: return avx512::scores(q.view, r0, nr, k, n, s, ld);
#endif
#if defined(KVCACHE_FUSED_AVX2)
    case FusedIsa::kAvx2: return avx2::scores(q.view, r0, nr, k, n, s, ld);
#endif
    default: break;
  }
  (void)q, (void)r0, (void)nr, (void)k, (void)n, (void)s, (void)ld;
  KV_INTERNAL_ASSERT(false, "fused::scores: no fused kernels run here");
}

void accumulate(const float* p, int64_t ld, int64_t nr, const RawTokens& v, int64_t n, int64_t d, float* acc) {
  switch (current_isa()) {
#if defined(KVCACHE_FUSED_AVX512)
    case FusedIsa::kAvx512: return avx512::accumulate(p, ld, nr, v, n, d, acc);
#endif
#if defined(KVCACHE_FUSED_AVX2)
    case FusedIsa::kAvx2: return avx2::accumulate(p, ld, nr, v, n, d, acc);
#endif
    default: break;
  }
  (void)p, (void)ld, (void)nr, (void)v, (void)n, (void)d, (void)acc;
  KV_INTERNAL_ASSERT(false, "fused::accumulate: no fused kernels run here");
}

}  // namespace kvcache::cache::fused

namespace kvcache {

std::string attention_kernels() { return cache::fused::isa_name(cache::fused::current_isa()); }

void set_attention_kernels(const std::string& isa, const std::string& source) {
  cache::fused::set_isa(cache::fused::isa_from_name(isa, source));
}

std::string attention_query() {
  return cache::fused::query_rounding() == cache::fused::QueryRounding::kTwoTerm ? "exact" : "int8";
}

void set_attention_query(const std::string& mode, const std::string& source) {
  KV_CHECK_ARG(mode == "exact" || mode == "int8" || mode.empty(), source, "=", mode,
               ": expected exact (the two-term int8 query, float accuracy: the default) or int8 (one int8 term "
               "per 32 dims for the integer key formats within the error bound)");
  cache::fused::set_query_rounding(mode == "int8" ? cache::fused::QueryRounding::kInt8
                                                  : cache::fused::QueryRounding::kTwoTerm);
}

}  // namespace kvcache
