// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file guard.h (internal)
/// The C API's exception barrier: guard(fn) runs fn and turns whatever it throws into a
/// kvc_status, setting the calling thread's last error message (kvc_last_error).
///   CapacityError (PoolFullError too)      → KVC_CAPACITY
///   InvalidArgument, UnsupportedError      → KVC_INVALID_ARGUMENT
///   std::bad_alloc                         → KVC_OUT_OF_MEMORY
///   anything else (InternalError, ...)     → KVC_INTERNAL

#include <exception>

#include "kvcache/c_api.h"

namespace kvcache::capi {

/// The status of the exception `e`; sets the thread's last error to its message.
kvc_status translate(const std::exception_ptr& e);
void set_last_error(const char* message);

template <class Fn>
kvc_status guard(Fn&& fn) noexcept {
  try {
    fn();
    return KVC_OK;
  } catch (...) {
    try {
      return translate(std::current_exception());
    } catch (...) {
      return KVC_OUT_OF_MEMORY;  // the message itself could not be stored
    }
  }
}

}  // namespace kvcache::capi
