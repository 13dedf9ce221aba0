// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file cache_scheme.h
/// Cache schemes: how a KV cache stores keys and values (CacheConfig::scheme). A scheme
/// names, per layer and per stream (K, V), the quantizer of the stored tokens, the
/// full-precision residual window of the most recent tokens and how that residual is
/// flushed into quantized storage (docs/cache-manager.md, "Cache schemes").
///
/// Registered schemes (make_cache_scheme, spec grammar in spec.h):
///   - every quantizer spec (`fp32`, `int4:g32`, `int2:g32:chan`, `had(int4)`, ...): the
///     trivial scheme, the same quantizer for K and V; residual = CacheConfig::residual_length
///     tokens flushed sliding, or in whole groups (block flush, R raised to a multiple of g,
///     at least g) when the quantizer's groups span g tokens (`:chan`); residual dtype
///     float32 when the quantizer stores float32 rows (`fp32`, `had(fp32)`), float16 otherwise.
///   - `kivi:k<b>:v<b>:g<G>:r<R>` (KIVI, arXiv 2402.02750): keys `int<k>:g<G>:chan` with an
///     R-token residual flushed in blocks of R, values `int<v>:g<G>` with a sliding R-token
///     residual; b ∈ {2, 3, 4, 8}, R a positive multiple of G, head_dim divisible by G.
///   - `kvquant:b<b>[:o<percent>][:c<slots>][:f<N>][:qnorm]:cal=<file>` (KVQuant, arXiv 2401.18079;
///     kvcache/kvquant.h): pre-RoPE keys (required_key_storage() = kPreRoPE) per channel with
///     the calibrated static ranges of each layer and head, values per token with dynamic
///     ranges; b ∈ {2, 3, 4} bits through the layer's k-means codebooks (`qnorm`: with Q-Norm);
///     `o` percent outliers (1 = sparsity 0.99) kept in fp16 with their indices (keys: `c`
///     slots per token, default max(2, ceil(4 · D · (1 − p)))); the first N
///     tokens kept in fp16 (`f`); no residual window (residual_length must be 0). The
///     calibration must be of the cache's geometry (L, H_kv, D), else InvalidArgument naming both.
///   - `had(<scheme>)` / `had:k(<scheme>)` (Hadamard rotation: QuaRot, arXiv 2404.00456;
///     llama.cpp's rotated KV cache): the wrapped scheme with the quantized K and V (or K
///     only) stored as `had(<quantizer>)`: each token's row of D values multiplied by the
///     orthonormal Hadamard matrix H_D before quantization and by H_D again on read
///     (H_D · H_D = I, so q·k and p·v are those of the unrotated values up to quantization).
///     head_dim must be a power of two; the residual stays unrotated.
///   - `gear:b<b>:g<G>:s<s>:r<r>:loop<n>:nb<N>[:rp<n>][:whole]` (GEAR, arXiv 2403.05527; defaults b2 g64 s0.02
///     r2 loop3 nb64, printed with all six fields): every block of N tokens of a KV head is
///     stored as a KIVI-style b-bit base quantization (keys per channel in groups of G tokens,
///     values per token in groups of G channels of the head) + fp16 outliers (floor(s·len/2)
///     largest and smallest per key channel of the block / per value token, with uint16
///     indices) + a rank-r fp16 factorization U·Pᵀ of the residual (power iteration with QR,
///     `loop` iterations), all in the block's StoredLayout and counted in its bytes; both
///     streams keep an fp16 residual of the newest < N tokens, flushed in blocks of N (the
///     reference's "compress only the newest n_b tokens" mode). Two optional fields, printed
///     only when set: `rp<n>`, the prefill rank (blocks flushed by an append of more than one
///     token use rank rp, blocks flushed in decode steps rank r; every block reserves
///     max(r, rp) columns of U and P, zero past its own rank, and they are counted in the
///     bytes; default rp = r), and `whole` (mode; default `newest`): every time a decode step
///     flushes a block, every older block is decoded and re-encoded with rank r (the
///     reference scripts' re-compression of the whole, already lossy cache every n_b steps,
///     per block instead of one whole-sequence low rank; StreamSpec::recompress).
///     N a multiple of G, head_dim divisible by G, max(r, rp) <= min(N, head_dim).
///   - `turboquant:k<b>:v<b>[:kmse][:nc][:seed<s>]` (TurboQuant, arXiv 2504.19874; defaults k3 v3,
///     keys Prod, seed 42): keys `tq:b<k>:prod` (`kmse`: `tq:b<k>`), values `tq:b<v>` (b in 1..4
///     by halves; docs/quantizers.md, "TurboQuant"), layer l seeded with s + 1337·l; residual as
///     the trivial scheme's (CacheConfig::residual_length, sliding, fp16). head_dim a power of two.
///   - `qjl:m<m>:o<o>:g<g>:v<b>:r<r>[:mo<m_o>][:vg<G>][:seed<s>]` (QJL, arXiv 2406.03482; defaults
///     m256 o8 g32 v2 r128 mo64 vg32 seed42): keys as 1-bit sketches sign(S k) (m bits, S
///     orthogonalised in blocks, rows of norm √D) + fp16 norms, the o largest channels of each
///     group of g tokens sketched apart (m_o bits); values int<v>:g<G>; an r-token fp16 window
///     (keys flushed in blocks of r, values sliding); layer l seeded s + 1337·l. head_dim ≤ 256,
///     divisible by G; CacheConfig::residual_length 0 or r.
///   - `layers(<scheme>*<n>;<scheme>*<n>;...)` (per-layer mixed precision, KVTuner, arXiv
///     2502.04420): consecutive runs of layers, the first n layers stored by the first scheme,
///     the next by the next (`*1` may be left out), e.g. K8V4 in the first 4 layers and K4V2
///     in the other 20 of a 24-layer model: `layers(kivi:k8:v4:g32:r128*4;kivi:k4:v2:g32:r128*20)`.
///     Each run is any scheme above (not `layers` itself); canonical: the runs' canonical specs,
///     consecutive equal runs merged, `*1` dropped. streams() throws InvalidArgument, naming
///     the spec as written, the counts and the model's layer count, unless the counts sum to
///     CacheGeometry::num_layers. Each layer's bytes are its own scheme's (CacheStats counts
///     the blocks each layer's format stores).
///
/// What a scheme can express (and KVQuant / GEAR will use): per-layer quantizers that the
/// scheme builds itself (e.g. with calibrated codebooks and thresholds), different quantizers
/// for K and V, side data stored with each token or group inside the quantizer's StoredLayout
/// (outliers, low-rank factors: bytes the cache counts because it stores them), a required key
/// storage (pre-RoPE keys), and the residual rules above.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvcache/quantizer.h"
#include "kvcache/spec.h"
#include "kvcache/types.h"

namespace kvcache {

/// How a stream's full-precision residual moves into quantized storage.
enum class ResidualFlush {
  /// Keep exactly the last R tokens in full precision; older ones are quantized as soon as
  /// they leave the window (KIVI values: one token at a time in decode). R = 0: no residual,
  /// tokens are quantized as they are written.
  kSliding,
  /// Accumulate; whenever the residual holds >= R tokens, quantize the oldest floor(n/R)·R
  /// (KIVI keys: whole R-token blocks; the residual oscillates in [0, R−1]).
  kBlock,
};

/// How one stream (K or V) of one layer is stored.
struct StreamSpec {
  /// The stored form of the stream's quantized tokens: its StoredLayout(head_dim) is what the
  /// cache's blocks hold, encode()/decode() what they are written and read with.
  std::shared_ptr<const Quantizer> quantizer;
  int64_t residual = 0;  ///< R: full-precision recent tokens, in [0, kMaxTokens]
  ResidualFlush flush = ResidualFlush::kSliding;
  DType residual_dtype = DType::kFloat16;  ///< float16 or float32: residual (and converted) rows
  /// Optional: one quantizer per KV head (size H_kv), each with `quantizer`'s StoredLayout,
  /// for formats whose static side data differs by head (KVQuant's calibrated per-channel key
  /// ranges: each head's channels have their own). Empty: `quantizer` stores every head.
  std::vector<std::shared_ptr<const Quantizer>> head_quantizers;
  /// Attention-sink tokens: the first `sink_tokens` tokens written to the stream are stored in
  /// `residual_dtype` for good (never quantized, outside the residual window), in [0,
  /// kMaxTokens]. 0: none (KVQuant's first-few fp16 option sets it).
  int64_t sink_tokens = 0;
  /// Optional: the encoder of the blocks the residual flushes during an append of more than
  /// one token (a prompt or prefill chunk), with exactly `quantizer`'s StoredLayout; the
  /// blocks are decoded by `quantizer` like every other (GEAR's prefill rank rp: both encoders
  /// reserve max(r, rp) factor columns). Null: `quantizer` encodes every block. Not combined
  /// with head_quantizers.
  std::shared_ptr<const Quantizer> prefill_quantizer;
  /// Re-compression (GEAR's `whole` mode): whenever a one-token append (a decode step) makes
  /// the residual flush, every block of the stream already in `quantizer`'s format is first
  /// decoded and re-encoded in place by `quantizer` (same bytes; the error compounds, as the
  /// reference re-compresses its already lossy cache). Blocks in other formats (fp32
  /// fallback, converted survivors, sinks) are left as they are. False: blocks are encoded once.
  bool recompress = false;
};

/// Both streams of one layer.
struct LayerStreams {
  StreamSpec key, value;
};

/// The model dimensions a scheme is resolved for.
struct CacheGeometry {
  int64_t num_layers = 1;    ///< L
  int64_t num_kv_heads = 1;  ///< H_kv
  int64_t head_dim = 0;      ///< D
};

/// A cache scheme, built from its spec by make_cache_scheme(). Immutable; one instance may
/// serve any number of caches.
class CacheScheme {
 public:
  virtual ~CacheScheme() = default;

  /// Canonical spec (the rule of spec.h): make_cache_scheme(spec()) builds an equivalent
  /// scheme. A plain quantizer spec's scheme prints the quantizer's spec.
  virtual std::string spec() const = 0;

  /// How layer `layer` (in [0, L)) of a cache of `geometry` stores K and V, with
  /// CacheConfig::residual_length = `residual_length` tokens (schemes with their own residual
  /// accept 0 or theirs).
  /// @throws InvalidArgument naming the spec when the scheme cannot run on this geometry
  ///         (head_dim not divisible by a group size, not a power of two for `had`, a
  ///         residual_length it does not take).
  virtual LayerStreams streams(const CacheGeometry& geometry, int64_t layer, int64_t residual_length) const = 0;

  /// The key storage the scheme needs (KVQuant quantizes pre-RoPE keys), or std::nullopt
  /// when either works. CacheConfig::validate() checks it.
  virtual std::optional<KeyStorage> required_key_storage() const { return std::nullopt; }
};

/// Builds a scheme from its spec: any quantizer spec (the trivial scheme) or a registered
/// scheme (`kivi:k2:v2:g32:r128`, `had(int4)`, `had:k(kivi:k4:v4:g32:r128)`).
/// @throws InvalidArgument for unknown heads (listing the registered quantizers and
///         schemes), bad fields (listing the allowed ones), a policy spec (naming it), or
///         numbers that do not fit together (KIVI's r not a multiple of g).
std::unique_ptr<CacheScheme> make_cache_scheme(const std::string& spec);

/// The canonical `layers(...)` spec storing layer l with scheme `per_layer[l]` (runs of equal
/// canonical specs merged), e.g. {"int8", "int8", "int4"} -> "layers(int8*2;int4)".
/// @throws InvalidArgument if `per_layer` is empty or an entry is no cache scheme (naming it).
std::string layers_scheme_spec(const std::vector<std::string>& per_layer);

/// Parameter tables of the registered cache schemes (besides the quantizers), in
/// registration order (for --list).
std::vector<ParamTable> registered_cache_schemes();

}  // namespace kvcache
