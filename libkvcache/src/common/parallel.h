// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file parallel.h (internal)
/// parallel_for over [begin, end): the one way the core's kernels use threads, without
/// LibTorch. It keeps at::parallel_for's contract (ATen 1.13, OpenMP backend), so that the
/// kernels split their work exactly as they did when they called it:
///   - serial when end − begin ≤ grain, when called inside a parallel region, when the OpenMP
///     runtime has one thread, or when the translation unit is built without OpenMP
///     (KVCACHE_OPENMP=OFF: the sanitizer build);
///   - else one OpenMP parallel region of min(threads, ⌈(end − begin)/grain⌉) threads, thread t
///     running f(begin + t·chunk, min(end, begin + (t+1)·chunk)), chunk = ⌈(end − begin)/threads⌉;
///   - the first exception thrown by any chunk is rethrown after the region.
/// The thread count is OpenMP's (omp_set_num_threads; at::set_num_threads sets the same runtime
/// in a program that links LibTorch, which shares libgomp).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace kvcache::detail {

template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
#if defined(_OPENMP)
  const int64_t n = end - begin;
  if (n > grain && n > 1 && !omp_in_parallel() && omp_get_max_threads() > 1) {
    std::atomic_flag failed = ATOMIC_FLAG_INIT;
    std::exception_ptr error;
#pragma omp parallel
    {
      int64_t threads = omp_get_num_threads();
      if (grain > 0) threads = std::min<int64_t>(threads, (n + grain - 1) / grain);
      const int64_t tid = omp_get_thread_num();
      const int64_t chunk = (n + threads - 1) / threads;
      const int64_t b = begin + tid * chunk;
      if (b < end) {
        try {
          f(b, std::min(end, b + chunk));
        } catch (...) {
          if (!failed.test_and_set()) error = std::current_exception();
        }
      }
    }
    if (error) std::rethrow_exception(error);
    return;
  }
#endif
  f(begin, end);
}

/// The threads parallel_for would run a large enough range on from here: OpenMP's thread count,
/// 1 inside a parallel region or without OpenMP. Kernels that choose how to split their work
/// (attend.cpp: a long head's keys across threads) ask this, so they split only where threads run.
inline int64_t max_threads() {
#if defined(_OPENMP)
  if (!omp_in_parallel()) return std::max(1, omp_get_max_threads());
#endif
  return 1;
}

}  // namespace kvcache::detail
