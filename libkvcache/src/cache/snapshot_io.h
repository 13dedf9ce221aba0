// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file snapshot_io.h (internal)
/// The byte level of snapshot files (docs/snapshot-format.md), shared by the one-sequence
/// snapshot (snapshot.cpp) and the prefix index directory (multi_sequence_persist.cpp): the
/// framing — an 8-byte magic, a preamble, then sections each with its own XXH3-64 — and the
/// block record, so that every file the library writes stores a block the same way.
/// Little-endian, fixed-width fields; a string is its byte count (u64) then its bytes.

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cache/block_list.h"
#include "kvcache/snapshot.h"

namespace kvcache::cache::snapio {

using Reason = SnapshotError::Reason;

/// The magic of a one-sequence snapshot (CacheManager::save).
inline constexpr char kSnapshotMagic[8] = {'\x89', 'K', 'V', 'S', 'N', 'A', 'P', '\n'};
/// The magic of a prefix index's pages file and of its manifest (save_prefix_index).
inline constexpr char kIndexMagic[8] = {'\x89', 'K', 'V', 'I', 'N', 'D', 'X', '\n'};
inline constexpr char kManifestMagic[8] = {'\x89', 'K', 'V', 'M', 'A', 'N', 'I', '\n'};

/// Throws SnapshotError(r) "snapshot '<source>': <what> (<reason name>)".
[[noreturn]] void fail(Reason r, const std::string& source, const std::string& what);
uint64_t xxh3(const void* p, size_t n);
uint32_t tag_of(const char (&t)[5]);
std::string tag_name(uint32_t tag);

/// Appends fixed-width little-endian fields to a string.
class Out {
 public:
  explicit Out(std::string& s) : s_(s) {}
  template <class T>
  void put(T v) {
    s_.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  void str(const std::string& v) {
    put<uint64_t>(v.size());
    s_.append(v);
  }
  void bytes(const void* p, size_t n) { s_.append(static_cast<const char*>(p), n); }

 private:
  std::string& s_;
};

/// Reads a section's payload; every read past its end throws SnapshotError(kInconsistent)
/// naming `where`.
class In {
 public:
  In(const uint8_t* p, size_t n, std::string where, const std::string& source)
      : p_(p), n_(n), where_(std::move(where)), source_(source) {}
  template <class T>
  T get() {
    T v;
    std::memcpy(&v, take(sizeof v), sizeof v);
    return v;
  }
  std::string str() {
    const auto n = get<uint64_t>();
    need(n);
    return std::string(reinterpret_cast<const char*>(take(static_cast<size_t>(n))), static_cast<size_t>(n));
  }
  const uint8_t* take(size_t n) {
    need(n);
    const uint8_t* p = p_ + i_;
    i_ += n;
    return p;
  }
  void need(uint64_t n) const {
    if (n > n_ - i_) {
      fail(Reason::kInconsistent, source_, where_ + " needs " + std::to_string(n) + " more bytes, " +
                                               std::to_string(n_ - i_) + " left in the section");
    }
  }
  size_t left() const { return n_ - i_; }
  const uint8_t* here() const { return p_ + i_; }
  void done() const {
    if (i_ != n_) fail(Reason::kInconsistent, source_, where_ + ": " + std::to_string(n_ - i_) + " bytes left over");
  }
  const std::string& where() const { return where_; }

 private:
  const uint8_t* p_;
  size_t n_, i_ = 0;
  std::string where_;
  const std::string& source_;
};

/// The 24-byte preamble of a file of `sections` sections: magic, format version, count, xxh3.
std::string preamble(const char (&magic)[8], uint32_t sections);
/// Appends one section: header (tag, index, payload size, header xxh3), payload, payload xxh3.
void put_section(std::string& file, const char (&tag)[5], uint32_t index, const std::string& payload);

/// A section found by frame(): its tag and payload (pointing into the file's bytes).
struct Section {
  uint32_t tag = 0;
  const uint8_t* data = nullptr;
  size_t size = 0;
};
/// The framing pass: magic (kNotSnapshot naming `magic_name`), preamble checksum, version
/// (kFutureVersion), then every section's header checksum, size (kTruncated) and payload
/// checksum (kChecksum), in order. Nothing is interpreted yet.
std::vector<Section> frame(const std::string& bytes, const std::string& source, const char (&magic)[8],
                           const char* magic_name);

/// Block record (docs/snapshot-format.md, "Block record"): `b` of format `F`, whose memory is
/// `mem`; `expect_pos0` is the position the previous block's end implies (advanced).
void put_block(Out& o, const BlockFormat& F, const Block& b, const uint8_t* mem, int64_t& expect_pos0);
/// Reads one block record into `list` (a new block from its format's pool), checking its
/// format against `fmts`, its slots, holes and positions; `where` names it in messages.
void get_block(In& in, BlockList& list, const StreamFormats& fmts, int64_t& expect_pos0, const std::string& where,
               const std::string& source);

}  // namespace kvcache::cache::snapio
