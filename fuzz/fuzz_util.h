// SPDX-License-Identifier: Apache-2.0
#pragma once
// Shared helpers of the libFuzzer targets (fuzz/README.md).
//
// The oracle: the library may reject an input only with one of its user-error classes
// (InvalidArgument, CapacityError, UnsupportedError: error.h). Anything else that escapes —
// an InternalError (a violated invariant: a bug by definition), a std:: exception (e.g.
// std::out_of_range from stoll), a c10::Error from LibTorch — is a fault, and so is every
// crash, sanitizer report and leak. fuzz::accepts() turns the former into an abort() with
// the exception's type and message, which libFuzzer reports as a crash and saves the input.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <typeinfo>

#include "kvcache/error.h"

namespace kvcache::fuzz {

[[noreturn]] inline void die(const char* where, const char* what) {
  std::fprintf(stderr, "\n==fuzz== FAULT in %s: %s\n", where, what);
  std::fflush(stderr);
  std::abort();
}

[[noreturn]] inline void die_exception(const char* where, const char* type, const char* message) {
  std::string msg = std::string("uncaught ") + type + ": " + message;
  die(where, msg.c_str());
}

/// Runs `f()`. Returns true if it returned, false if it rejected the input with a user error;
/// aborts (a fault) on any other exception.
template <typename F>
bool accepts(const char* where, F&& f) {
  try {
    f();
    return true;
  } catch (const InvalidArgument&) {
    return false;
  } catch (const CapacityError&) {
    return false;
  } catch (const UnsupportedError&) {
    return false;
  } catch (const InternalError& e) {
    die_exception(where, "kvcache::InternalError", e.what());
  } catch (const std::exception& e) {
    die_exception(where, typeid(e).name(), e.what());
  } catch (...) {
    die(where, "uncaught non-std exception");
  }
}

/// A property of an accepted input that must hold; aborts naming it otherwise.
#define KV_FUZZ_CHECK(cond, where, ...)                                                      \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      ::kvcache::fuzz::die(where, ::kvcache::detail::str_cat(#cond, " ", ##__VA_ARGS__).c_str()); \
    }                                                                                       \
  } while (0)

/// Reads a fuzz input front to back; past its end every read returns 0 / empty.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : p_(data), n_(size) {}
  uint8_t u8() { return n_ > 0 ? (--n_, *p_++) : 0; }
  uint16_t u16() { return static_cast<uint16_t>(u8() | (u8() << 8)); }
  /// An integer in [lo, hi] (lo <= hi, hi - lo < 2^16).
  int64_t range(int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(u16() % static_cast<uint64_t>(hi - lo + 1)); }
  size_t remaining() const { return n_; }
  const uint8_t* data() const { return p_; }
  /// The rest of the input as a string, or up to the first '\n' (consumed) when `line`.
  std::string text(bool line = false) {
    size_t len = n_;
    if (line) {
      const void* nl = n_ > 0 ? std::memchr(p_, '\n', n_) : nullptr;
      if (nl != nullptr) len = static_cast<size_t>(static_cast<const uint8_t*>(nl) - p_);
    }
    std::string s(reinterpret_cast<const char*>(p_), len);
    p_ += len;
    n_ -= len;
    if (line && n_ > 0) u8();  // the '\n'
    return s;
  }

 private:
  const uint8_t* p_;
  size_t n_;
};

}  // namespace kvcache::fuzz
