// SPDX-License-Identifier: Apache-2.0
// Snapshots of one sequence (docs/snapshot-format.md): StepProtocol::snapshot writes what the
// sequence holds exactly as stored — block bytes, slots, holes, positions, counters, the
// policy's state — and StepProtocol::from_snapshot reads it into a new protocol, checking every
// byte (preamble, per-section xxHash XXH3-64, header against the cache's configuration, block
// metadata against the stream formats, then the store's own invariants and the policy state's
// shapes) before the caller swaps it in. Nothing here touches the caller's cache.
#include <xxhash.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <ostream>

#include "cache/snapshot_io.h"
#include "cache/step_protocol.h"
#include "common/file_io.h"
#include "kvcache/error.h"
#include "kvcache/snapshot.h"

#ifndef KVCACHE_VERSION_STRING
#error "KVCACHE_VERSION_STRING must be defined by the build (libkvcache/CMakeLists.txt)"
#endif

namespace kvcache {

const char* snapshot_reason_name(SnapshotError::Reason reason) {
  switch (reason) {
    case SnapshotError::Reason::kNotSnapshot: return "not-a-snapshot";
    case SnapshotError::Reason::kFutureVersion: return "future-version";
    case SnapshotError::Reason::kTruncated: return "truncated";
    case SnapshotError::Reason::kChecksum: return "checksum";
    case SnapshotError::Reason::kOtherModel: return "other-model";
    case SnapshotError::Reason::kOtherConfig: return "other-config";
    case SnapshotError::Reason::kInconsistent: return "inconsistent";
    case SnapshotError::Reason::kIo: return "io";
  }
  return "unknown";
}

namespace cache {
namespace snapio {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "snapshots are little-endian: a big-endian build must swap");

// File magics (snapshot_io.h): a non-ASCII first byte (as PNG's) so a text file is never taken for one.
constexpr size_t kPreambleBytes = 24;       ///< magic, version u32, section count u32, xxh3 u64
constexpr size_t kSectionHeaderBytes = 24;  ///< tag u32, index u32, payload bytes u64, xxh3 u64

uint32_t tag_of(const char (&t)[5]) {
  uint32_t v = 0;
  std::memcpy(&v, t, 4);
  return v;
}
std::string tag_name(uint32_t tag) {
  std::string s(4, ' ');
  std::memcpy(&s[0], &tag, 4);
  for (char& c : s) {
    if (c < 32 || c > 126) c = '?';
  }
  return s;
}

uint64_t xxh3(const void* p, size_t n) { return XXH3_64bits(p, n); }

[[noreturn]] void fail(Reason r, const std::string& source, const std::string& what) {
  throw SnapshotError(r, "snapshot '" + source + "': " + what + " (" + snapshot_reason_name(r) + ")");
}

}  // namespace snapio

namespace {
using namespace snapio;

void put_stats(Out& o, const CacheStats& s) {
  for (int64_t v : {s.tokens_written, s.tokens_resident, s.tokens_resident_peak, s.bytes_resident,
                    s.bytes_resident_peak, s.bytes_reserved, s.bytes_reserved_peak}) {
    o.put<int64_t>(v);
  }
}
CacheStats get_stats(In& in) {
  CacheStats s;
  for (int64_t* v : {&s.tokens_written, &s.tokens_resident, &s.tokens_resident_peak, &s.bytes_resident,
                     &s.bytes_resident_peak, &s.bytes_reserved, &s.bytes_reserved_peak}) {
    *v = in.get<int64_t>();
  }
  return s;
}

/// The regions of a block that hold its filled slots' bytes: codes, then scales, then zeros of
/// the first ceil(filled / group_tokens) groups (the unfilled rest is never written or read).
struct Regions {
  int64_t codes = 0, meta = 0;
  bool zeros = false;
};
Regions regions(const BlockFormat& F, int64_t filled) {
  const int64_t groups = (filled + F.layout.group_tokens - 1) / F.layout.group_tokens;
  Regions r;
  r.codes = groups * F.layout.code_bytes;
  r.meta = F.layout.meta_count > 0 ? groups * F.layout.meta_count * dtype_size(F.layout.meta_dtype) : 0;
  r.zeros = F.layout.has_zeros && r.meta > 0;
  return r;
}

/// Unsigned LEB128 of a zigzag-coded signed value: a block's start position against the one the
/// previous block's end implies (0, one byte, for blocks that follow on).
void put_varint(Out& o, int64_t v) {
  uint64_t z = (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63);
  while (z >= 0x80) {
    o.put<uint8_t>(static_cast<uint8_t>(z | 0x80));
    z >>= 7;
  }
  o.put<uint8_t>(static_cast<uint8_t>(z));
}
int64_t get_varint(In& in, const std::string& where, const std::string& source) {
  uint64_t z = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    const auto byte = in.get<uint8_t>();
    z |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) return static_cast<int64_t>(z >> 1) ^ -static_cast<int64_t>(z & 1);
  }
  fail(Reason::kInconsistent, source, where + ": a position delta longer than 10 bytes");
}

/// The position after block `b`'s last filled slot (what the next block's pos0 is measured from).
/// (A dead last slot's entry may be anything, e.g. −1 after a renumbering: then 0.)
int64_t next_pos0(const Block& b) {
  const int64_t p = b.position(b.filled - 1);
  return p >= 0 && p < std::numeric_limits<int64_t>::max() ? p + 1 : 0;
}

}  // namespace

namespace snapio {

/// Block record: u8 format | holes << 4 | explicit positions << 5; u16 filled slots; varint
/// pos0 − (previous block's last position + 1); [holes: ceil(capacity / 64) u64 words];
/// [positions: capacity i64]; the filled groups' codes, scales, zeros. `live` is derived.
void put_block(Out& o, const BlockFormat& F, const Block& b, const uint8_t* mem, int64_t& expect_pos0) {
  o.put<uint8_t>(static_cast<uint8_t>(b.format | (b.dead.empty() ? 0 : 0x10) | (b.pos.empty() ? 0 : 0x20)));
  o.put<uint16_t>(static_cast<uint16_t>(b.filled));
  put_varint(o, b.pos0 - expect_pos0);
  expect_pos0 = next_pos0(b);
  if (!b.dead.empty()) o.bytes(b.dead.data(), b.dead.size() * sizeof(uint64_t));
  if (!b.pos.empty()) o.bytes(b.pos.data(), b.pos.size() * sizeof(int64_t));
  const Regions r = regions(F, b.filled);
  o.bytes(mem, static_cast<size_t>(r.codes));
  o.bytes(mem + F.scales_offset, static_cast<size_t>(r.meta));
  if (r.zeros) o.bytes(mem + F.zeros_offset, static_cast<size_t>(r.meta));
}

void get_block(In& in, BlockList& list, const StreamFormats& fmts, int64_t& expect_pos0, const std::string& where,
               const std::string& source) {
  Block b;
  const auto head = in.get<uint8_t>();
  b.format = head & 0x0f;
  b.filled = in.get<uint16_t>();
  const int64_t delta = get_varint(in, where, source);
  if ((head & 0xc0) != 0 || b.format >= StreamFormats::kCount || fmts.f[b.format].quantizer == nullptr) {
    fail(Reason::kInconsistent, source, where + ": block format " + std::to_string(head & 0x0f) + " (flags " +
                                            std::to_string(head >> 4) + "), not one of the stream's formats");
  }
  const BlockFormat& F = fmts.f[b.format];
  if (b.filled < 1 || b.filled > F.capacity) {
    fail(Reason::kInconsistent, source, where + ": block of " + std::to_string(b.filled) +
                                            " filled slots, expected 1 .. " + std::to_string(F.capacity));
  }
  // pos0 in [0, INT64_MAX − capacity]: slot positions pos0 + s never overflow.
  const int64_t hi = std::numeric_limits<int64_t>::max() - F.capacity;
  if ((delta > 0 && expect_pos0 > hi - delta) || (delta <= 0 && expect_pos0 + delta < 0)) {
    fail(Reason::kInconsistent, source, where + ": block start " + std::to_string(expect_pos0) + " + " +
                                            std::to_string(delta) + " out of range");
  }
  b.pos0 = expect_pos0 + delta;
  int64_t dead = 0;
  if (head & 0x10) {
    b.dead.resize(static_cast<size_t>((F.capacity + 63) / 64));
    std::memcpy(b.dead.data(), in.take(b.dead.size() * sizeof(uint64_t)), b.dead.size() * sizeof(uint64_t));
    for (uint64_t w : b.dead) dead += __builtin_popcountll(w);
  }
  if (head & 0x20) {
    b.pos.resize(static_cast<size_t>(F.capacity));
    std::memcpy(b.pos.data(), in.take(b.pos.size() * sizeof(int64_t)), b.pos.size() * sizeof(int64_t));
    for (int64_t s = 0; s < b.filled; ++s) {  // dead and unfilled slots' entries are never read
      const int64_t p = b.pos[static_cast<size_t>(s)];
      if (b.alive(s) && (p < 0 || p > hi)) {
        fail(Reason::kInconsistent, source, where + ": slot position " + std::to_string(p));
      }
    }
  }
  b.live = static_cast<int32_t>(b.filled - dead);  // dead bits beyond the filled slots: check() refuses them
  if (b.live < 1) {
    fail(Reason::kInconsistent, source, where + ": a block of " + std::to_string(b.filled) + " slots, " +
                                            std::to_string(dead) + " of them evicted, holds no live token");
  }
  expect_pos0 = next_pos0(b);
  const Regions r = regions(F, b.filled);
  const uint8_t* codes = in.take(static_cast<size_t>(r.codes));
  const uint8_t* scales = in.take(static_cast<size_t>(r.meta));
  const uint8_t* zeros = r.zeros ? in.take(static_cast<size_t>(r.meta)) : nullptr;
  list.restore(std::move(b), [&](uint8_t* mem) {
    std::memcpy(mem, codes, static_cast<size_t>(r.codes));
    std::memcpy(mem + F.scales_offset, scales, static_cast<size_t>(r.meta));
    if (zeros != nullptr) std::memcpy(mem + F.zeros_offset, zeros, static_cast<size_t>(r.meta));
  });
}

std::string preamble(const char (&magic)[8], uint32_t sections) {
  std::string file(magic, sizeof magic);
  Out o(file);
  o.put<uint32_t>(kSnapshotFormatVersion);
  o.put<uint32_t>(sections);
  o.put<uint64_t>(xxh3(file.data(), 16));
  return file;
}

/// One section: header (tag, index, payload size, header xxh3), payload, payload xxh3.
void put_section(std::string& file, const char (&tag)[5], uint32_t index, const std::string& payload) {
  std::string h;
  Out o(h);
  o.put<uint32_t>(tag_of(tag));
  o.put<uint32_t>(index);
  o.put<uint64_t>(payload.size());
  o.put<uint64_t>(xxh3(h.data(), 16));
  file += h;
  file += payload;
  Out f(file);
  f.put<uint64_t>(xxh3(payload.data(), payload.size()));
}

}  // namespace snapio

namespace {

/// The header fields a snapshot must share with the cache it is read into.
struct Header {
  std::string library, fingerprint, scheme, policy;
  int64_t block_tokens = 0, layers = 0, q_heads = 0, kv_heads = 0, head_dim = 0, residual = 0;
  uint8_t key_storage = 0, position_mode = 0;
  int64_t context_length = 0;
  std::vector<int64_t> tokens;  ///< the caller's token ids of what the sequence holds (may be empty)
};

void put_header(Out& o, const Header& h) {
  o.str(h.library);
  o.str(h.fingerprint);
  o.str(h.scheme);
  o.str(h.policy);
  for (int64_t v : {h.block_tokens, h.layers, h.q_heads, h.kv_heads, h.head_dim, h.residual}) o.put<int64_t>(v);
  o.put<uint8_t>(h.key_storage);
  o.put<uint8_t>(h.position_mode);
  o.put<int64_t>(h.context_length);
  o.put<uint64_t>(h.tokens.size());
  if (!h.tokens.empty()) o.bytes(h.tokens.data(), h.tokens.size() * sizeof(int64_t));
}

Header get_header(In& in) {
  Header h;
  h.library = in.str();
  h.fingerprint = in.str();
  h.scheme = in.str();
  h.policy = in.str();
  for (int64_t* v : {&h.block_tokens, &h.layers, &h.q_heads, &h.kv_heads, &h.head_dim, &h.residual}) {
    *v = in.get<int64_t>();
  }
  h.key_storage = in.get<uint8_t>();
  h.position_mode = in.get<uint8_t>();
  h.context_length = in.get<int64_t>();
  const auto n = in.get<uint64_t>();
  in.need(n);  // n <= bytes left: n * 8 cannot overflow
  const uint8_t* ids = in.take(static_cast<size_t>(n) * sizeof(int64_t));
  h.tokens.resize(static_cast<size_t>(n));
  if (n > 0) std::memcpy(h.tokens.data(), ids, static_cast<size_t>(n) * sizeof(int64_t));
  in.done();
  return h;
}

Header header_of(const CacheConfig& cfg, const std::string& scheme, const std::string& policy,
                 int64_t block_tokens, const std::string& fingerprint) {
  Header h;
  h.library = KVCACHE_VERSION_STRING;
  h.fingerprint = fingerprint;
  h.scheme = scheme;
  h.policy = policy;
  h.block_tokens = block_tokens;
  h.layers = cfg.num_layers;
  h.q_heads = cfg.num_q_heads;
  h.kv_heads = cfg.num_kv_heads;
  h.head_dim = cfg.head_dim;
  h.residual = cfg.residual_length;
  h.key_storage = static_cast<uint8_t>(cfg.key_storage);
  h.position_mode = static_cast<uint8_t>(cfg.position_mode);
  h.context_length = cfg.context_length;
  return h;
}

}  // namespace

namespace snapio {

std::vector<Section> frame(const std::string& bytes, const std::string& source, const char (&magic)[8],
                           const char* magic_name) {
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  const size_t n = bytes.size();
  if (n == 0 || std::memcmp(p, magic, std::min(n, sizeof magic)) != 0) {
    fail(Reason::kNotSnapshot, source, std::string("does not start with the ") + magic_name + " (" +
                                           std::to_string(n) + " bytes)");
  }
  if (n < kPreambleBytes) {
    fail(Reason::kTruncated, source, "ends after " + std::to_string(n) + " bytes, inside the " +
                                         std::to_string(kPreambleBytes) + "-byte preamble");
  }
  uint32_t version = 0, count = 0;
  uint64_t sum = 0;
  std::memcpy(&version, p + 8, 4);
  std::memcpy(&count, p + 12, 4);
  std::memcpy(&sum, p + 16, 8);
  if (sum != xxh3(p, 16)) fail(Reason::kChecksum, source, "the preamble's checksum does not match its bytes");
  if (version > kSnapshotFormatVersion) {
    fail(Reason::kFutureVersion, source, "format version " + std::to_string(version) + ", newer than the version " +
                                             std::to_string(kSnapshotFormatVersion) + " this library (" +
                                             KVCACHE_VERSION_STRING + ") reads");
  }
  if (version == 0) fail(Reason::kInconsistent, source, "format version 0 (versions start at 1)");
  std::vector<Section> out;
  size_t at = kPreambleBytes;
  for (uint32_t i = 0; i < count; ++i) {
    const std::string which = "section " + std::to_string(i) + " of " + std::to_string(count);
    if (n - at < kSectionHeaderBytes) {
      fail(Reason::kTruncated, source, "ends after " + std::to_string(n) + " bytes, in the header of " + which);
    }
    uint32_t tag = 0, index = 0;
    uint64_t size = 0, hsum = 0;
    std::memcpy(&tag, p + at, 4);
    std::memcpy(&index, p + at + 4, 4);
    std::memcpy(&size, p + at + 8, 8);
    std::memcpy(&hsum, p + at + 16, 8);
    if (hsum != xxh3(p + at, 16)) {
      fail(Reason::kChecksum, source, "the header checksum of " + which + " (at byte " + std::to_string(at) +
                                          ") does not match its bytes");
    }
    if (index != i) fail(Reason::kInconsistent, source, which + " is numbered " + std::to_string(index));
    at += kSectionHeaderBytes;
    if (size > n - at || n - at - size < 8) {
      fail(Reason::kTruncated, source, "ends after " + std::to_string(n) + " bytes, inside " + which + " ('" +
                                           tag_name(tag) + "', " + std::to_string(size) + " bytes from byte " +
                                           std::to_string(at) + ")");
    }
    uint64_t psum = 0;
    std::memcpy(&psum, p + at + size, 8);
    if (psum != xxh3(p + at, static_cast<size_t>(size))) {
      fail(Reason::kChecksum, source, "the checksum of " + which + " ('" + tag_name(tag) + "', bytes " +
                                          std::to_string(at) + " .. " + std::to_string(at + size) +
                                          ") does not match its bytes");
    }
    out.push_back({tag, p + at, static_cast<size_t>(size)});
    at += static_cast<size_t>(size) + 8;
  }
  if (at != n) {
    fail(Reason::kInconsistent, source, std::to_string(n - at) + " bytes after the last of " + std::to_string(count) +
                                            " sections");
  }
  return out;
}

}  // namespace snapio

namespace {
using namespace snapio;

void compare(const std::string& field, const std::string& file, const std::string& cache, const std::string& source) {
  if (file != cache) {
    fail(Reason::kOtherConfig, source, field + " is '" + file + "' in the file, '" + cache + "' in the cache");
  }
}

}  // namespace

void write_snapshot(const std::string& path, const std::string& bytes, const char* fn) {
  try {
    io::write_file_atomic(path, bytes);
  } catch (const InvalidArgument& e) {
    throw SnapshotError(Reason::kIo,
                        detail::str_cat(fn, ": ", e.what(), "; the file at that path is unchanged (io)"));
  }
}

void write_snapshot(std::ostream& out, const std::string& bytes, const char* fn) {
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.flush();
  if (!out.good()) {
    throw SnapshotError(Reason::kIo, detail::str_cat(fn, ": the stream failed writing ", bytes.size(),
                                                     " snapshot bytes (io)"));
  }
}

std::string StepProtocol::snapshot(const std::string& model_fingerprint, const std::vector<int64_t>& tokens) const {
  KV_CHECK_ARG(!replaying_, "CacheManager::save: a replay step is open (call end_step first)");
  for (size_t l = 0; l < steps_.size(); ++l) {
    const LayerStep& s = steps_[l];
    KV_CHECK_ARG(s.step_new == 0 && !s.attended && !s.observed && !s.queried, "CacheManager::save: layer ", l,
                 " is inside a step (append/attend ran; call end_step first): a snapshot is taken between steps");
  }
  const SequenceStore& st = *store_;
  const int64_t L = cfg_.num_layers;
  const auto count = static_cast<uint32_t>(L + 3);
  std::string file = preamble(kSnapshotMagic, count);
  uint32_t index = 0;
  std::string payload;
  {
    Out o(payload);
    Header h = header_of(cfg_, st.scheme().spec(), policy_->spec(), st.block_tokens(), model_fingerprint);
    h.tokens = tokens;
    put_header(o, h);
    put_section(file, "HEAD", index++, payload);
  }
  for (int64_t l = 0; l < L; ++l) {
    payload.clear();
    Out o(payload);
    const SequenceStore::Layer& layer = st.layer(l);
    const LayerStore& ls = *layer.store;
    o.put<int64_t>(l);
    o.put<int64_t>(layer.written);
    o.put<int64_t>(layer.last_pos);
    o.put<int64_t>(layer.min_step);
    put_stats(o, layer.stats);
    o.put<float>(ls.k_scale());
    o.put<float>(ls.v_scale());
    o.put<uint8_t>(ls.scales_set() ? 1 : 0);
    for (int64_t h = 0; h < ls.num_heads(); ++h) {
      for (const HeadStream* s : {&ls.k(h), &ls.v(h)}) {
        o.put<int64_t>(s->written);
        for (const BlockList* list : {&s->quant, &s->resid}) {
          o.put<uint64_t>(list->blocks().size());
          int64_t expect_pos0 = 0;
          for (const Block& b : list->blocks()) put_block(o, list->format(b), b, list->format(b).pool->data(b.id), expect_pos0);
        }
      }
    }
    put_section(file, "LAYR", index++, payload);
  }
  {
    payload.clear();
    Out o(payload);
    o.str(policy_->spec());
    o.put<int64_t>(policy_->context_length());
    PolicyStateIO io(&payload);
    policy_->persist(io);
    put_section(file, "PLCY", index++, payload);
  }
  {
    payload.clear();
    Out o(payload);
    put_stats(o, st.total());
    put_section(file, "TOTL", index++, payload);
  }
  KV_INTERNAL_ASSERT(index == count, "snapshot sections ", index, " != ", count);
  return file;
}

std::unique_ptr<StepProtocol> StepProtocol::from_snapshot(const CacheConfig& config, const std::string& bytes,
                                                          const std::string& model_fingerprint,
                                                          const std::string& source, std::vector<int64_t>* tokens,
                                                          std::shared_ptr<PoolSet> pools, StepHooks* hooks) {
  const std::vector<Section> sections = frame(bytes, source, kSnapshotMagic, "snapshot magic \\x89KVSNAP\\n");
  auto expect_tag = [&](size_t i, const char (&tag)[5]) {
    if (i >= sections.size()) {
      fail(Reason::kInconsistent, source, "holds " + std::to_string(sections.size()) + " sections, no '" +
                                              std::string(tag) + "' section at " + std::to_string(i));
    }
    if (sections[i].tag != tag_of(tag)) {
      fail(Reason::kInconsistent, source, "section " + std::to_string(i) + " is '" + tag_name(sections[i].tag) +
                                              "', expected '" + tag + "'");
    }
    return sections[i];
  };
  // The header against the caller's model and cache.
  const Section hs = expect_tag(0, "HEAD");
  In hin(hs.data, hs.size, "section 0 (HEAD)", source);
  const Header file = get_header(hin);
  if (file.fingerprint != model_fingerprint) {
    fail(Reason::kOtherModel, source, "written for model '" + file.fingerprint + "', the caller's model is '" +
                                          model_fingerprint + "'");
  }
  {
    // The cache's canonical specs (a spec parses the same into the same canonical form).
    const std::unique_ptr<CacheScheme> scheme = make_cache_scheme(config.scheme);
    const std::unique_ptr<EvictionPolicy> policy = make_eviction_policy(config.policy);
    const Header cache = header_of(config, scheme->spec(), policy->spec(), config.resolved_block_tokens(), "");
    compare("scheme", file.scheme, cache.scheme, source);
    compare("policy", file.policy, cache.policy, source);
    compare("block_tokens", std::to_string(file.block_tokens), std::to_string(cache.block_tokens), source);
    auto shape = [](const Header& h) {
      return detail::str_cat("[layers=", h.layers, ", H_q=", h.q_heads, ", H_kv=", h.kv_heads, ", D=", h.head_dim,
                             "]");
    };
    compare("shape", shape(file), shape(cache), source);
    compare("residual_length", std::to_string(file.residual), std::to_string(cache.residual), source);
    compare("key_storage", std::to_string(file.key_storage), std::to_string(cache.key_storage), source);
    compare("position_mode", std::to_string(file.position_mode), std::to_string(cache.position_mode), source);
  }
  if (file.context_length < 0 || file.context_length > kMaxTokens) {
    fail(Reason::kInconsistent, source,
         "context length " + std::to_string(file.context_length) + " (expected 0 to " +
             std::to_string(kMaxTokens) + ")");
  }
  if (sections.size() != static_cast<size_t>(file.layers + 3)) {
    fail(Reason::kInconsistent, source, "holds " + std::to_string(sections.size()) + " sections, expected " +
                                            std::to_string(file.layers + 3) + " for " + std::to_string(file.layers) +
                                            " layers");
  }
  // A fresh protocol of the cache's configuration for the saved request.
  CacheConfig cfg = config;
  cfg.context_length = file.context_length;
  std::unique_ptr<StepProtocol> sp;
  try {
    sp = std::make_unique<StepProtocol>(std::move(cfg), std::move(pools), hooks);
  } catch (const CapacityError& e) {
    fail(Reason::kInconsistent, source, std::string("the saved context length does not fit the policy: ") + e.what());
  }
  SequenceStore& st = *sp->store_;
  for (int64_t l = 0; l < file.layers; ++l) {
    const size_t si = static_cast<size_t>(l) + 1;
    const Section ls = expect_tag(si, "LAYR");
    In in(ls.data, ls.size, "section " + std::to_string(si) + " (layer " + std::to_string(l) + ")", source);
    if (in.get<int64_t>() != l) fail(Reason::kInconsistent, source, in.where() + " names another layer");
    SequenceStore::Layer& layer = st.layer(l);
    layer.written = in.get<int64_t>();
    layer.last_pos = in.get<int64_t>();
    layer.min_step = in.get<int64_t>();
    layer.stats = get_stats(in);
    const auto ks = in.get<float>(), vs = in.get<float>();
    const auto set = in.get<uint8_t>();
    if (!(std::isfinite(ks) && ks > 0 && std::isfinite(vs) && vs > 0) || set > 1 || layer.written < 0 ||
        layer.last_pos < -1 || layer.last_pos == std::numeric_limits<int64_t>::max() || layer.min_step < 0 ||
        layer.stats.tokens_written != layer.written ||
        (sp->rope_table_.enabled() && layer.last_pos >= kMaxPreRopePosition)) {
      fail(Reason::kInconsistent, source, detail::str_cat(in.where(), ": written ", layer.written, ", last position ",
                                                          layer.last_pos, ", scales ", ks, "/", vs));
    }
    LayerStore& store = *layer.store;
    store.restore_scales(ks, vs, set == 1);
    for (int64_t h = 0; h < store.num_heads(); ++h) {
      for (const bool key : {true, false}) {
        HeadStream& s = store.restore_stream(h, key);
        const StreamFormats& fmts = *(key ? store.key_setup() : store.value_setup()).formats_for(h);
        const std::string where = detail::str_cat(in.where(), " head ", h, key ? " K" : " V");
        s.written = in.get<int64_t>();
        for (BlockList* list : {&s.quant, &s.resid}) {
          const auto blocks = in.get<uint64_t>();
          in.need(blocks);  // every block takes bytes: a count beyond the section is refused here
          int64_t expect_pos0 = 0;
          for (uint64_t b = 0; b < blocks; ++b) get_block(in, *list, fmts, expect_pos0, where, source);
        }
      }
    }
    in.done();
  }
  {
    const size_t si = static_cast<size_t>(file.layers) + 1;
    const Section ps = expect_tag(si, "PLCY");
    In in(ps.data, ps.size, "section " + std::to_string(si) + " (policy)", source);
    const std::string spec = in.str();
    const auto ctx = in.get<int64_t>();
    if (spec != file.policy || ctx != file.context_length) {
      fail(Reason::kInconsistent, source, "the policy section names '" + spec + "' at context " + std::to_string(ctx) +
                                              ", the header '" + file.policy + "' at " +
                                              std::to_string(file.context_length));
    }
    PolicyStateIO io(in.here(), in.left());
    try {
      sp->policy_->persist(io);
      io.finish();
    } catch (const SnapshotError& e) {
      fail(Reason::kInconsistent, source, e.what());
    }
  }
  {
    const size_t si = static_cast<size_t>(file.layers) + 2;
    const Section ts = expect_tag(si, "TOTL");
    In in(ts.data, ts.size, "section " + std::to_string(si) + " (totals)", source);
    st.restore_totals(get_stats(in));
    in.done();
  }
  // The store's own invariants: blocks, holes, positions, counters against recounts, totals.
  try {
    sp->check_invariants();
  } catch (const InternalError& e) {
    fail(Reason::kInconsistent, source, e.what());
  }
  if (tokens != nullptr) *tokens = file.tokens;
  // Positions are non-negative (check() bounds them by each layer's last position above).
  for (int64_t l = 0; l < file.layers; ++l) {
    for (int64_t h = 0; h < file.kv_heads; ++h) {
      const std::vector<int64_t> pos = st.store(l).k(h).positions();
      if (!pos.empty() && pos.front() < 0) {
        fail(Reason::kInconsistent, source, detail::str_cat("layer ", l, " head ", h, " holds position ", pos.front()));
      }
      sp->rope_table_.extend(pos.data(), static_cast<int64_t>(pos.size()));  // no-op unless in use
    }
  }
  return sp;
}

}  // namespace cache
}  // namespace kvcache
