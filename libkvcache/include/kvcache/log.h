// SPDX-License-Identifier: Apache-2.0
#pragma once
/// @file log.h
/// Diagnostics of libkvcache: warnings about inputs that run but probably not as meant (a
/// prompt longer than the model's positions, an eviction budget that evicts nothing) and
/// debug traces. They go through the library's own spdlog logger, named "kvcache" (registered
/// in spdlog's registry when that name is free, so an engine that uses spdlog can reach it with
/// spdlog::get("kvcache")); the library never touches spdlog's default logger and reads no
/// environment variable. This header exposes no spdlog type.
///
/// By default messages at kWarn and above go to stderr as `kvcache: warning: <message>`.

#include <functional>
#include <string>

namespace kvcache {

/// Severity of a diagnostic, lowest first; kOff silences the logger.
enum class LogLevel { kTrace, kDebug, kInfo, kWarn, kError, kOff };

/// Messages below `level` are dropped (default kWarn).
void set_log_level(LogLevel level);
LogLevel log_level();

/// "trace", "debug", "info", "warn", "error" or "off". @throws InvalidArgument listing them.
LogLevel parse_log_level(const std::string& name);
/// The name parse_log_level() reads.
std::string to_string(LogLevel level);

/// Receives each message that passes the level: its level and text (no prefix, no newline).
/// Called on the logging thread, one message at a time.
using LogSink = std::function<void(LogLevel level, const std::string& message)>;
/// Routes messages to `sink` instead of stderr (an engine's own logging, a test); an empty
/// sink restores stderr.
void set_log_sink(LogSink sink);

}  // namespace kvcache
