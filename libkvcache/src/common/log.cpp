// SPDX-License-Identifier: Apache-2.0
#include "common/log.h"

#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <memory>
#include <mutex>
#include <set>

#include "kvcache/error.h"
#include "kvcache/log.h"

namespace kvcache {
namespace {

constexpr const char* kNames[] = {"trace", "debug", "info", "warn", "error", "off"};

LogLevel from_spdlog(spdlog::level::level_enum l) {
  switch (l) {
    case spdlog::level::trace:
      return LogLevel::kTrace;
    case spdlog::level::debug:
      return LogLevel::kDebug;
    case spdlog::level::info:
      return LogLevel::kInfo;
    case spdlog::level::warn:
      return LogLevel::kWarn;
    case spdlog::level::err:
    case spdlog::level::critical:
      return LogLevel::kError;
    default:
      return LogLevel::kOff;
  }
}

spdlog::level::level_enum to_spdlog(LogLevel l) {
  switch (l) {
    case LogLevel::kTrace:
      return spdlog::level::trace;
    case LogLevel::kDebug:
      return spdlog::level::debug;
    case LogLevel::kInfo:
      return spdlog::level::info;
    case LogLevel::kWarn:
      return spdlog::level::warn;
    case LogLevel::kError:
      return spdlog::level::err;
    case LogLevel::kOff:
      break;
  }
  return spdlog::level::off;
}

/// stderr as "kvcache: warning: <message>", or the user's LogSink.
class Sink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  void set(LogSink sink) {
    std::lock_guard<std::mutex> lock(mutex_);
    user_ = std::move(sink);
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    const std::string text(msg.payload.data(), msg.payload.size());
    if (user_) {
      user_(from_spdlog(msg.level), text);
      return;
    }
    const LogLevel l = from_spdlog(msg.level);
    const char* what = l == LogLevel::kWarn ? "warning" : l == LogLevel::kError ? "error" : kNames[static_cast<int>(l)];
    std::fprintf(stderr, "kvcache: %s: %s\n", what, text.c_str());
  }
  void flush_() override { std::fflush(stderr); }

 private:
  LogSink user_;
};

struct State {
  std::shared_ptr<Sink> sink = std::make_shared<Sink>();
  std::shared_ptr<spdlog::logger> logger;
  std::mutex once_mutex;
  std::set<std::string> warned;
  State() : logger(std::make_shared<spdlog::logger>("kvcache", sink)) {
    logger->set_level(spdlog::level::warn);
    logger->flush_on(spdlog::level::warn);
    try {
      spdlog::register_logger(logger);  // reachable as spdlog::get("kvcache")
    } catch (const spdlog::spdlog_ex&) {
      // The name is taken (an engine's own logger): ours stays unregistered.
    }
  }
};

State& state() {
  static State s;
  return s;
}

}  // namespace

namespace log {

spdlog::logger& logger() { return *state().logger; }

void warn_once(const std::string& key, const std::string& message) {
  State& s = state();
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(s.once_mutex);
    first = s.warned.insert(key).second;
  }
  if (first) {
    s.logger->warn("{}", message);
  } else {
    s.logger->debug("{}", message);
  }
}

}  // namespace log

void set_log_level(LogLevel level) { state().logger->set_level(to_spdlog(level)); }

LogLevel log_level() { return from_spdlog(state().logger->level()); }

LogLevel parse_log_level(const std::string& name) {
  for (int i = 0; i < 6; ++i) {
    if (name == kNames[i]) return static_cast<LogLevel>(i);
  }
  throw InvalidArgument("log level '" + name + "' is not one of trace, debug, info, warn, error, off");
}

std::string to_string(LogLevel level) { return kNames[static_cast<int>(level)]; }

void set_log_sink(LogSink sink) { state().sink->set(std::move(sink)); }

}  // namespace kvcache
