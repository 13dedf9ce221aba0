// SPDX-License-Identifier: Apache-2.0
// The library's diagnostics (kvcache/log.h): levels, the sink hook, warnings of the cache
// (a budget that evicts nothing), one warning per cause; spdlog's default logger untouched.
#include "kvcache/log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <string>
#include <utility>
#include <vector>

#include "cache_test_util.h"
#include "kvcache/cache_manager.h"
#include "kvcache/error.h"

namespace kvcache {
namespace {

using ::testing::HasSubstr;

/// Captures the library's messages for the lifetime of the object.
struct Capture {
  std::vector<std::pair<LogLevel, std::string>> messages;
  LogLevel old_level = log_level();
  Capture() {
    set_log_sink([this](LogLevel l, const std::string& m) { messages.emplace_back(l, m); });
  }
  ~Capture() {
    set_log_sink({});
    set_log_level(old_level);
  }
};

TEST(Log, LevelsParseAndPrintBack) {
  for (const char* name : {"trace", "debug", "info", "warn", "error", "off"}) {
    EXPECT_EQ(to_string(parse_log_level(name)), name);
  }
  EXPECT_EQ(parse_log_level("warn"), LogLevel::kWarn);
  try {
    (void)parse_log_level("verbose");
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_STREQ(e.what(), "log level 'verbose' is not one of trace, debug, info, warn, error, off");
  }
  EXPECT_EQ(log_level(), LogLevel::kWarn);  // the default
}

// A budget at least as large as the request evicts nothing: one warning naming the policy and
// the numbers, the first time only (a sweep repeats the request per task); nothing below the
// level, nothing for a budget that evicts, nothing for `full`.
TEST(Log, BudgetThatEvictsNothingWarnsOnce) {
  Capture cap;
  TorchCache m(testing::make_config(1, 2, 1, 8, "fp32", "window@64", 0));
  EXPECT_TRUE(cap.messages.empty());  // context unknown: nothing to say yet
  m.reset(40);
  ASSERT_EQ(cap.messages.size(), 1u);
  EXPECT_EQ(cap.messages[0].first, LogLevel::kWarn);
  EXPECT_EQ(cap.messages[0].second,
            "eviction policy 'window@64' evicts nothing from a request of 40 tokens: its budget of 64 tokens per KV "
            "head holds the whole prompt and every new token");
  m.reset(30);
  EXPECT_EQ(cap.messages.size(), 1u);  // once per policy spec (later ones at debug level)
  set_log_level(LogLevel::kDebug);
  m.reset(20);
  ASSERT_EQ(cap.messages.size(), 2u);
  EXPECT_EQ(cap.messages[1].first, LogLevel::kDebug);
  set_log_level(LogLevel::kError);
  TorchCache quiet(testing::make_config(1, 2, 1, 8, "fp32", "sink@100%", 10));
  EXPECT_EQ(cap.messages.size(), 2u);
  set_log_level(LogLevel::kWarn);
  TorchCache evicts(testing::make_config(1, 2, 1, 8, "fp32", "window@8", 10));
  TorchCache full(testing::make_config(1, 2, 1, 8, "fp32", "full", 10));
  EXPECT_EQ(cap.messages.size(), 2u);
  TorchCache all(testing::make_config(1, 2, 1, 8, "fp32", "h2o@100%", 10));
  ASSERT_EQ(cap.messages.size(), 3u);
  EXPECT_THAT(cap.messages[2].second, HasSubstr("'h2o@100%' evicts nothing from a request of 10 tokens"));
}

// The library's logger is its own: named "kvcache", not spdlog's default one.
TEST(Log, OwnNamedLoggerNotTheDefault) {
  Capture cap;
  TorchCache m(testing::make_config(1, 2, 1, 8, "fp32", "window@99", 5));  // logs once
  ASSERT_NE(spdlog::get("kvcache"), nullptr);
  EXPECT_NE(spdlog::default_logger_raw(), spdlog::get("kvcache").get());
  EXPECT_EQ(spdlog::default_logger_raw()->name(), "");
  EXPECT_EQ(cap.messages.size(), 1u);
}

}  // namespace
}  // namespace kvcache
