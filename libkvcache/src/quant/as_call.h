// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file as_call.h (internal)
/// Messages in the words of the call the user made: the quantizers' checks name the
/// allocating form ("quantize(x) [int4]"); a caller of another form (quantize_into, the ATen
/// face's dequantize) reads its own call's name instead.

#include <string>
#include <utility>

#include "kvcache/error.h"

namespace kvcache::quant {

/// Runs fn; an InvalidArgument whose message starts with `from` is rethrown starting with `to`.
template <class Fn>
void as_call(const std::string& from, const std::string& to, Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    if (msg.rfind(from, 0) != 0) throw;
    throw InvalidArgument(to + msg.substr(from.size()));
  }
}

}  // namespace kvcache::quant
