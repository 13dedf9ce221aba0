// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file attend_fused.h (internal)
/// Fused attention kernels: q·k and p·v computed from the stored codes of a block, with no
/// float32 copy of K or V (not even of one block). The generic path (attend.cpp) orchestrates —
/// tiles, masks, the online softmax, the attention mass — and calls these for the two products
/// when the CPU and every block format of the layer are supported; otherwise it decodes each
/// block into scratch and runs its own tile kernels (the reference twin these are held to).
///
/// As llama.cpp's CPU flash attention does, keys in an integer format are dotted in the integer
/// domain with AVX-512 VNNI (u8 codes × s8 query, int32 sums, 16 keys at a time), then scaled
/// by the key group's scale, plus zero × Σq. Unlike llama.cpp, which rounds q to int8 (q8_0),
/// the query is split into two int8 terms per 32-dim chunk, q' = qs·(qh + ql/254) (QueryView),
/// two VNNI products per key: |q − q'| ≤ 1.6e-5·max|q|, so the fused path computes what the
/// generic path computes to float accuracy and a study's results do not depend on whether the
/// CPU has VNNI. (A single int8 term moved greedy outcomes: int2 on the default suite scored
/// 111/222 with it, 113/222 on the generic path.) Float formats (fp16, bf16, fp8) are converted
/// in registers and multiplied in float32. Values are dequantized one row at a time in
/// registers inside p·v. Per-channel keys (KIVI) fold the channel scales into the query
/// (w = q ⊙ s) per block and split w the same way.
///
/// Error against the generic path (float32 q·k over dequantized keys): integer keys see the
/// two-term query q' (or w'), a score change of |Σ_d (q_d − q'_d) k̂_d| ≤ 1.6e-5·Σ_chunks
/// max|q|·Σ_d |k̂_d|; float formats and every p·v agree to float32 rounding (different
/// summation order). tests/attend_fused_test.cpp checks fused(q) against generic(q') to float
/// rounding, per-channel scores against the exact formula, and fused(q) against generic(q)
/// with the bound that δ implies.
///
/// The 2025 rotation-and-codebook formats (issue 38), computed from their codes in the query's
/// domain, with no float copy of K or V:
///   - TurboQuant keys (`tq`, KernelKind::kTurboQuant): x̂ = ‖x‖·f·diag(s)·H·c (f = 1/‖c‖ with
///     `nc`, else 1) and diag(s)·H is orthogonal, so q·x̂ = ‖x‖·f·⟨H·diag(s)·q, c⟩: the query is
///     rotated once per step and KV head (rotate_queries: QueryView::qrot) and each key costs a
///     centroid lookup per coordinate (AVX-512: 16 codes unpacked with vpmultishiftqb and looked
///     up with one vpermps of the 16-entry codebook; AVX2: 8 codes with vpsrlvd, two vpermps and
///     a blend for 16 levels), then the same transposed FMAs as float keys; ‖c‖² accumulates on
///     the way for `nc`. Prod keys add √(π/2)/D·γ·⟨S q, z⟩, S q once per step (QueryView::qsketch)
///     and the sign bits as ±1 lanes.
///   - TurboQuant values: acc_rot += Σ_j p_j·‖v_j‖·f_j·c_j in the rotated domain (accumulate()
///     writes the accumulator it is given: for these segments the orchestration's second,
///     rotated one, which the online softmax rescales with the first), rotated back once per
///     query row at the end (add_rotated_back: diag(s)·H·acc_rot). Exact algebra; the float
///     rounding differs from the generic path's per-token inverse rotation (≤ 2e-5 on unit-scale
///     outputs, measured ≤ 5e-6: tests/attend_fused_test.cpp). Prod values (not the paper's
///     split) take the generic path.
///   - QJL keys (kQjl): S·q once per step; per group of g tokens u = S q − Σ_{c∈out} q_c S[:, c]
///     and u_o = Σ_{c∈out} q_c S_o[:, c] (the group's o outlier columns); per key
///     √(π/2)/m·‖k_in‖·⟨u, z⟩ + √(π/2)/m_o·‖k_out‖·⟨u_o, z_o⟩ from the stored bits (±1 lanes).
///     Its int values and fp16 window take the int / fp16 kernels.
///   - PolarQuant (`polar`, kPolar): its preconditioning is TurboQuant's rotation, so keys are
///     scored against the same rotated query and values go to the rotated accumulator; each
///     16-value block is rebuilt in registers from its radius ρ and four lane permutes of the
///     levels' cos/sin tables (value i = ρ·Π_ℓ cos or sin of level ℓ's angle over i).
/// A layer whose key (or value) formats rotate or sketch differently takes the generic path
/// (same_rotation()), as do head dims the kernels do not read (TurboQuant, PolarQuant at D = 16).
///
/// The kernels are compiled for x86-64 with AVX-512 F/BW/VL/DQ, VNNI, VBMI and F16C
/// (attend_avx512.cpp) and used only where the running CPU has them (available()).
///
/// AVX2 build (attend_avx2.cpp, AVX2 + FMA + F16C + BMI/BMI2): for CPUs without AVX-512 VNNI/VBMI
/// (AMD EPYC before Zen 4). Float-domain arithmetic: codes are converted to float32 in
/// registers and multiplied with the float query (no VNNI, and vpmaddubsw saturates for 8-bit
/// codes); integer keys are factored per group, s_g·(q_g·c_g) + z_g·Σ_{d∈g} q_d. So it computes
/// generic(q) to float32 rounding for every format (not generic(q') of the two-term query).
/// The int8 query (kInt8 below) is the exception: 4- and 2-bit keys (kInt8QueryAvx2Bits) are
/// then dotted in the integer domain with the one-term query, vpmaddubsw (u8 code × s8 term,
/// int16 pair sums that cannot saturate for codes ≤ 15: qk_int_q8) and vpmaddwd, with the
/// AVX-512 path's terms, scales and zero sums: its scores, per-token bit for bit, per-channel to
/// float rounding.
/// The ISA is picked once (AVX-512 where the CPU has what the AVX-512 kernels need, else AVX2,
/// else none); kvcache::set_attention_kernels() (set_isa) and use_fused_isa() override it.

#include <cstdint>
#include <string>
#include <vector>

#include "cache/block_list.h"
#include "cache/fused_abi.h"

namespace kvcache::cache::fused {

/// The kernel format of `f`: what its StoredLayout says (StoredLayout::kernel), or Kind::kNone
/// if the fused kernels cannot read it — KernelKind::kNone formats (int3, rotated `had(...)`,
/// GEAR, KVQuant), QJL sketches above kMaxQjlSketch bits, integer groups whose 32-dim chunks do not lie in one packed code stream,
/// head dims that are not a multiple of 32 or above 256: then the generic path runs for the
/// whole layer.
KernelFormat classify(const BlockFormat& f);

/// The fused kernels' instruction sets.
enum class FusedIsa : uint8_t { kNone, kAvx2, kAvx512 };

/// The best kernel ISA this CPU runs (checked once; kNone where no kernels are built).
FusedIsa best_isa();

/// The kernel ISA in use: best_isa() unless set_isa() or use_fused_isa() chose another.
FusedIsa current_isa();

/// The ISA named `value` ("avx512", "avx2" or "none"; empty: best_isa()), as KVCACHE_FUSED_ISA
/// spells it. Throws InvalidArgument "<source>=<value>: expected avx512, avx2 or none ..." for
/// another value, or naming an ISA this CPU (or build) cannot run.
FusedIsa isa_from_name(const std::string& value, const std::string& source);

/// Runs `isa` from now on, the generic path's tile kernels at 8 lanes under kAvx2 (the AVX2-only
/// CPU's summation order) and at the widest the CPU runs otherwise: kvcache::set_attention_kernels.
void set_isa(FusedIsa isa);

/// Test and benchmark hook: run the `isa` kernels from now on (kNone: the generic path).
/// False, and no change, if this CPU cannot run them (or they are not built). Not for use
/// while another thread attends.
bool use_fused_isa(FusedIsa isa);

/// "avx512", "avx2" or "none".
const char* isa_name(FusedIsa isa);

/// True if some fused kernel runs here (current_isa() is not kNone).
bool available();

/// How the kernels round the query for integer keys (issue 37, decision 2).
///   kTwoTerm (default): q' = qs·(qh + ql/254) per 32 dims, float accuracy (above);
///   kInt8: q ≈ qs·qh, one int8 term (llama.cpp's q8 choice, round to nearest), one VNNI product
///     per 4 dims instead of two — for the integer key formats whose attention error stays within
///     the bound (kInt8QueryTokenBits / kInt8QueryChannelBits: the formats
///     tests/attend_fused_test.cpp, AttendFused.Int8QueryWithinTheErrorBound, holds to ‖attend − ref(k̂, v̂)‖ ≤ 0.1·‖ref(k̂, v̂) − ref(k, v)‖);
///     the others keep the two-term query;
///   kInt8Everywhere: the int8 query for every integer key format (tests: to measure the bound
///     for the formats that fail it).
/// The AVX2 kernels take kTwoTerm as their float query (above) and the int8 query, with the
/// AVX-512 kernels' arithmetic, for the 4- and 2-bit key formats among those asked
/// (kInt8QueryAvx2Bits: without VNNI, vpmaddubsw's int16 sums would saturate for 8-bit codes, so
/// 8-bit keys keep the float query even under kInt8Everywhere). The generic path ignores it.
enum class QueryRounding : uint8_t { kTwoTerm, kInt8, kInt8Everywhere };
/// Bit b set: b-bit per-token (per-channel) integer keys take the int8 query under kInt8.
/// Measured (AttendFused.Int8QueryWithinTheErrorBound*, the ratio ‖attend − ref(k̂, v̂)‖ /
/// ‖ref(k̂, v̂) − ref(k, v)‖ against the bound 0.1, on the default model's captured K/V and on
/// synthetic ones): per-token int4 0.025-0.034 and int2 0.011-0.012 pass, int8 0.41-0.61 fails;
/// per-channel 2-bit (KIVI-2) 0.031-0.067 passes, 4-bit (int4:chan, KIVI-4) 0.13-0.30 fails —
/// the channel scales folded into the query (w = q ⊙ s) let the outlier channels set each
/// chunk's int8 step.
inline constexpr uint32_t kInt8QueryTokenBits = (1u << 4) | (1u << 2);
inline constexpr uint32_t kInt8QueryChannelBits = 1u << 2;
QueryRounding query_rounding();
/// Process-wide, as set_isa; call while no attention runs (kvcache::set_attention_query).
void set_query_rounding(QueryRounding r);

/// The step's query rows of one KV head, prepared once (owning QueryView).
struct Queries {
  std::vector<float> qf, qs, qsum, qfsum, qsum1, qrot, qsketch;
  std::vector<int8_t> qt;
  QueryView view;
};

/// `q` rows `[rows, d]` float32 → Queries; d must be a multiple of 32 and ≤ 256.
void prepare(const float* q, int64_t rows, int64_t d, float scale, Queries& out);

/// True if two TurboQuant formats rotate alike (same signs, and same sketch where both are
/// Prod), or two QJL formats sketch alike: the fused path rotates (sketches) the query once per
/// layer and step, so a layer whose key (or value) formats differ there takes the generic path.
bool same_rotation(const KernelFormat& a, const KernelFormat& b);

/// TurboQuant keys `kf`: q.qrot = H·diag(s)·qf per row (the rotated query; diag(s)·H is
/// orthogonal, so qf·x̂ = ‖x‖·f·(qrot·c)) and for Prod keys q.qsketch = S·qf; QJL keys:
/// q.qsketch = S·qf (qjl_m per row, as Σ_c qf_c·Sᵀ[c, :] from the quantizer's Sᵀ) and
/// q.view.sketch_t = kf.sketch_t (no copy). Sets q.view.qrot/qsketch. Call after prepare(),
/// once per step and KV head.
void rotate_queries(const KernelFormat& kf, Queries& q);

/// TurboQuant values: acc[r] += diag(signs)·H·rot[r] for r < rows (rot, `[rows, d]`, the
/// rotated-domain accumulator, is overwritten): the inverse rotation, once per query row.
void add_rotated_back(const float* signs, float* rot, int64_t rows, int64_t d, float* acc);

/// s[r·ld + j] = q_{r0+r} · k_j / √D for r < nr, j < n (the keys of `k`).
void scores(const Queries& q, int64_t r0, int64_t nr, const RawTokens& k, int64_t n, float* s, int64_t ld);

/// acc[r·d + :] += Σ_j p[r·ld + j] · v_j for r < nr, j < n (the values of `v`).
void accumulate(const float* p, int64_t ld, int64_t nr, const RawTokens& v, int64_t n, int64_t d, float* acc);

}  // namespace kvcache::cache::fused
