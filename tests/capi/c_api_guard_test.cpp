// SPDX-License-Identifier: Apache-2.0
// The C API's exception barrier (src/capi/guard.h): every exception becomes a status and the
// thread's last error, including those no C call can provoke on purpose — an allocation
// failure, an internal error, a foreign exception. (tests/capi/c_api_test.c covers the calls.)
#include <gtest/gtest.h>

#include <new>
#include <stdexcept>
#include <string>
#include <thread>

#include "capi/guard.h"
#include "kvcache/error.h"

namespace {

using kvcache::capi::guard;

TEST(CApiGuard, EveryExceptionBecomesAStatusAndAMessage) {
  EXPECT_EQ(guard([] {}), KVC_OK);
  EXPECT_EQ(guard([] { throw kvcache::InvalidArgument("bad x = 3"); }), KVC_INVALID_ARGUMENT);
  EXPECT_STREQ(kvc_last_error(), "bad x = 3");
  EXPECT_EQ(guard([] { throw kvcache::UnsupportedError("no layout"); }), KVC_INVALID_ARGUMENT);
  EXPECT_STREQ(kvc_last_error(), "no layout");
  EXPECT_EQ(guard([] { throw kvcache::CapacityError("budget 1 < 4 sinks"); }), KVC_CAPACITY);
  EXPECT_EQ(guard([] { throw kvcache::PoolFullError("pool full", false); }), KVC_CAPACITY);
  EXPECT_STREQ(kvc_last_error(), "pool full");
  EXPECT_EQ(guard([] { throw std::bad_alloc(); }), KVC_OUT_OF_MEMORY);
  EXPECT_STREQ(kvc_last_error(), "out of memory");
  EXPECT_EQ(guard([] { throw kvcache::InternalError("invariant"); }), KVC_INTERNAL);
  EXPECT_STREQ(kvc_last_error(), "invariant");
  EXPECT_EQ(guard([] { throw std::runtime_error("foreign"); }), KVC_INTERNAL);
  EXPECT_EQ(guard([] { throw 42; }), KVC_INTERNAL);
  EXPECT_STREQ(kvc_last_error(), "unknown exception (a bug in libkvcache)");
  // A successful call leaves the last error as it was.
  EXPECT_EQ(guard([] {}), KVC_OK);
  EXPECT_STREQ(kvc_last_error(), "unknown exception (a bug in libkvcache)");
}

TEST(CApiGuard, TheLastErrorIsPerThread) {
  (void)guard([] { throw kvcache::InvalidArgument("main thread"); });
  std::string other;
  std::thread t([&] {
    other = kvc_last_error();
    (void)guard([] { throw kvcache::InvalidArgument("worker"); });
  });
  t.join();
  EXPECT_EQ(other, "");
  EXPECT_STREQ(kvc_last_error(), "main thread");
}

}  // namespace
