// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file snapshot.h
/// Snapshots: one sequence's cache written to a file in the form the cache holds it — its
/// blocks as stored (codes, scales, zeros, full-precision residual, positions, eviction holes),
/// its counters and the state its eviction policy needs to continue — and read back into a
/// cache of the same configuration (CacheManager::save / load, kvcache/cache_manager.h). The
/// byte layout, its versioning and the checks of a load are in docs/snapshot-format.md; the
/// refusals are listed in docs/errors.md ("Snapshots").
///
/// Like llama.cpp's slot save/restore (`--slot-save-path`), LMCache's disk chunks and SGLang's
/// HiCache file tier, but the low-bit form is written exactly as stored: a 4-bit cache is a
/// 4-bit file, and loading it decodes nothing.

#include <cstdint>
#include <string>
#include <vector>

#include "kvcache/error.h"

namespace kvcache {

/// The snapshot format version this build writes (and the newest it reads).
inline constexpr uint32_t kSnapshotFormatVersion = 1;

/// A snapshot was refused (load) or could not be written (save). An InvalidArgument: the file
/// or path the caller gave is at fault. reason() says which check failed; the message names
/// the file, the section and the values found against those expected.
class SnapshotError : public InvalidArgument {
 public:
  enum class Reason {
    kNotSnapshot,    ///< the bytes do not start with the snapshot magic
    kFutureVersion,  ///< written by a newer format version than this build reads
    kTruncated,      ///< the file ends before its last section
    kChecksum,       ///< a section's xxHash does not match its bytes (a flipped byte)
    kOtherModel,     ///< the model fingerprint differs from the caller's
    kOtherConfig,    ///< scheme, policy, block_tokens or shape differ from the cache's
    kInconsistent,   ///< checksums hold but the content breaks the cache's invariants
    kIo,             ///< the file could not be opened, read or written (permissions, full disk)
  };
  SnapshotError(Reason reason, const std::string& what) : InvalidArgument(what), reason_(reason) {}
  Reason reason() const { return reason_; }

 private:
  Reason reason_;
};

/// "not-a-snapshot", "future-version", … (the names docs/errors.md uses).
const char* snapshot_reason_name(SnapshotError::Reason reason);

/// The state of an eviction policy in a snapshot (EvictionPolicy::persist): one method both
/// writes and reads it, so the two directions cannot disagree. Little-endian, fixed-width
/// fields; a vector is its element count (uint64) followed by its elements.
class PolicyStateIO {
 public:
  /// A writer appending to `*out`.
  explicit PolicyStateIO(std::string* out) : out_(out) {}
  /// A reader of `data[0, size)` (not owned). Reads past the end, or counts larger than the
  /// bytes left, throw SnapshotError(kInconsistent).
  PolicyStateIO(const uint8_t* data, size_t size) : in_(data), size_(size) {}

  bool reading() const { return out_ == nullptr; }
  void io(bool& x);
  void io(int64_t& x);
  void io(uint64_t& x);
  void io(float& x);
  void io(double& x);
  void io(std::vector<bool>& x);
  template <class T>
  void io(std::vector<T>& x) {
    uint64_t n = x.size();
    io(n);
    if (reading()) {
      expect(n <= size_ - pos_, "a vector of " + std::to_string(n) + " elements in " +
                                    std::to_string(size_ - pos_) + " bytes");
      x.assign(static_cast<size_t>(n), T{});
    }
    for (auto& e : x) io(e);
  }
  /// Reading: throws SnapshotError(kInconsistent) "policy state: <what>" unless `ok`.
  /// Writing: nothing.
  void expect(bool ok, const std::string& what) const;
  /// Reading: throws unless every byte was read.
  void finish() const;

 private:
  void raw(void* p, size_t n);
  std::string* out_ = nullptr;
  const uint8_t* in_ = nullptr;
  size_t size_ = 0, pos_ = 0;
};

}  // namespace kvcache
