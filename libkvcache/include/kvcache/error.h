// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file error.h
/// Exception hierarchy and check macros of libkvcache.
///
/// User errors (bad spec strings, wrong shapes/dtypes, NaN input, missing files,
/// budgets out of range) throw one of the classes below with a message that names
/// the bad value and what was expected. Internal bugs use KV_INTERNAL_ASSERT.
/// The library never aborts on user input.

#include <sstream>
#include <stdexcept>
#include <string>

namespace kvcache {

/// Base class of every exception thrown by libkvcache.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A caller-supplied value is malformed or out of range (spec string, shape, dtype,
/// budget, NaN/Inf in a tensor, missing or corrupt file).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

/// The request is well-formed but not supported by this build/implementation.
class UnsupportedError : public Error {
 public:
  using Error::Error;
};

/// A capacity limit would be exceeded (e.g. a token budget too small for the
/// protected tokens of a policy).
class CapacityError : public Error {
 public:
  using Error::Error;
};

/// A MultiSequenceCache's pool has no room (kvcache/multi_sequence_cache.h, PoolFullRule):
/// the call was refused (preempted() false: nothing changed, the message gives the bytes
/// needed, free, in use and the capacity), or the sequence was preempted earlier to make room
/// for an older request (preempted() true: its blocks went back to the pool; the message names
/// who needed how many bytes). Runner::generate_batch catches it per sequence: that sequence
/// leaves the batch with GenerationResult::status set, the others go on.
class PoolFullError : public CapacityError {
 public:
  PoolFullError(const std::string& what, bool preempted) : CapacityError(what), preempted_(preempted) {}
  /// true: the sequence was preempted (PoolFullRule::kPreemptNewest); false: this call was refused.
  bool preempted() const { return preempted_; }

 private:
  bool preempted_ = false;
};

/// Violated internal invariant: a bug in libkvcache, not a user error.
class InternalError : public Error {
 public:
  using Error::Error;
};

namespace detail {
inline void append_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void append_all(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append_all(os, rest...);
}
/// Concatenates all arguments with operator<< into one string.
template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  append_all(os, args...);
  return os.str();
}
}  // namespace detail

}  // namespace kvcache

/// Throws `ExcType` (a kvcache::Error subclass) with the concatenated message when
/// `cond` is false. Usage: KV_CHECK(g > 0, InvalidArgument, "group size must be > 0, got ", g);
#define KV_CHECK(cond, ExcType, ...)                                  \
  do {                                                                \
    if (!(cond)) {                                                    \
      throw ::kvcache::ExcType(::kvcache::detail::str_cat(__VA_ARGS__)); \
    }                                                                 \
  } while (0)

/// Shorthand for KV_CHECK(cond, InvalidArgument, ...): a user error.
#define KV_CHECK_ARG(cond, ...) KV_CHECK(cond, InvalidArgument, __VA_ARGS__)

/// Internal invariant; throws InternalError naming file and line (never user input).
#define KV_INTERNAL_ASSERT(cond, ...)                                              \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      throw ::kvcache::InternalError(::kvcache::detail::str_cat(                   \
          "internal error at ", __FILE__, ":", __LINE__, ": ", #cond, " ", ##__VA_ARGS__)); \
    }                                                                              \
  } while (0)
