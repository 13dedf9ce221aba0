// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file attention.h
/// Attention over the KV cache: the semantics CacheManager::attend() implements and the choice
/// of the kernels that compute it. The attention statistics it hands to an eviction policy
/// (AttentionNeed, AttentionMass) are in kvcache/eviction_inputs.h, beside the policies'
/// interface; the plain at::-ops reference every attention path of the project is held to
/// (reference_attention) is in kvcache/torch/attention.h.
///
/// Semantics (one layer, letters of types.h). Query rows q `[B, H_q, T_q, D]` (post-RoPE)
/// and the cached keys/values of each KV head; query head h reads KV head h / G,
/// G = H_q / H_kv (GQA: K/V are never copied per query head). For query row (h, t) at
/// position p_t and resident key j of KV head h / G at position k_j:
///   s_j = (q_t · k_j) / √D in float32, visible iff k_j ≤ p_t (causal by stored positions,
///         so holes left by eviction and ragged heads need no mask of their own);
///   out = Σ_j softmax(s)_j · v_j, computed with an online softmax over the stored blocks
///         (flash-attention style: running max and sum, rescaled per block).
/// Every query row sees at least one key in a cache that holds the step's own tokens; a row
/// that sees none gets zeros.

#include <string>

#include "kvcache/eviction_inputs.h"

namespace kvcache {

/// The instruction set of the fused kernels through which CacheManager::attend() reads the
/// stored blocks (docs/cache-manager.md, "Fused kernels"): "avx512" (AVX-512 VNNI/VBMI: integer
/// keys dotted with a two-term int8 rounding of the query), "avx2" (AVX2 + FMA + F16C: float32
/// arithmetic, as the generic path; the int8 query of set_attention_query() in the integer
/// domain) or "none" (the generic per-block path). The CPU's best unless
/// set_attention_kernels() chose another.
std::string attention_kernels();

/// Selects the fused kernels' instruction set, so that one machine can reproduce another's
/// attention arithmetic: "avx512", "avx2" (also the generic path's tile kernels at 8 lanes, the
/// summation order of an AVX2-only CPU) or "none" (the generic path everywhere); "" = the CPU's
/// best. The library reads no environment variable: the apps, benchmarks and tests pass
/// KVCACHE_FUSED_ISA here, with source "KVCACHE_FUSED_ISA". Process-wide; call it while no
/// attention runs.
/// @throws InvalidArgument "<source>=<isa>: expected avx512, avx2 or none ..." for another value,
///         or naming an ISA this CPU (or build) cannot run.
void set_attention_kernels(const std::string& isa, const std::string& source = "attention kernels");

/// How the fused kernels round the query for integer keys: "exact" (the default) or "int8".
std::string attention_query();

/// Selects the query arithmetic of integer keys in the fused kernels (docs/cache-manager.md,
/// "Fused kernels"):
///   "exact" (default; "" too): the query split into two int8 terms per 32 dims, q' = qs·(qh +
///     ql/254), |q − q'| ≤ 1.6e-5·max|q|: float accuracy, two VNNI products per 4 dims;
///   "int8": one int8 term per 32 dims, q ≈ qs·round(q/qs), qs = max|q|/127 (llama.cpp's q8_0
///     rounding), one VNNI product per 4 dims — only for the integer key formats whose extra
///     attention error stays within 10 % of the error the format itself introduces,
///     ‖attend − ref(k̂, v̂)‖ ≤ 0.1·‖ref(k̂, v̂) − ref(k, v)‖ (ref: float64 attention; measured per
///     format by tests/attend_fused_test.cpp on the default model's captured K/V and on
///     synthetic K/V with outlier key channels, figures in docs/performance.md): per-token 4- and 2-bit keys (int4, int2) and per-channel 2-bit
///     keys (KIVI-2, int2:chan). int8 keys and per-channel 4-bit keys (int4:chan, KIVI-4) fail the
///     bound and keep the exact query.
/// The AVX-512 kernels dot the int8 query with VNNI; the AVX2 kernels (for CPUs without AVX-512
/// VNNI/VBMI: Zen 3 and earlier) with vpmaddubsw/vpmaddwd, the same int8 terms, scales and zero
/// sums, so their scores equal the AVX-512 kernels' (per-token keys bit for bit, per-channel to
/// float rounding). Their "exact" query is the float query (float32 arithmetic, as the generic
/// path), which the generic path computes whatever is set. Process-wide; call it while no
/// attention runs. The default arithmetic is what the README's study tables used.
/// @throws InvalidArgument "<source>=<mode>: expected exact ... or int8 ..." for another value.
void set_attention_query(const std::string& mode, const std::string& source = "attention query");

}  // namespace kvcache
