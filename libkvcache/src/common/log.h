// SPDX-License-Identifier: Apache-2.0
#pragma once
// The library's spdlog logger (kvcache/log.h). Internal: public headers stay free of spdlog.
#include <spdlog/logger.h>

#include <string>

namespace kvcache::log {

/// The "kvcache" logger. Use its level-checked calls with "{}" placeholders:
/// `log::logger().warn("prompt of {} tokens ...", n)`.
spdlog::logger& logger();

/// Logs `message` at warn level the first time `key` is seen in this process, at debug level
/// after that: one warning per distinct cause, not one per request of a sweep.
void warn_once(const std::string& key, const std::string& message);

}  // namespace kvcache::log
