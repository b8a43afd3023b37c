// SPDX-License-Identifier: MIT
// The host log: one line per event, prefixed with the rank, filtered by WEFT_LOG=error|warn|info|debug.
#pragma once

#include <sstream>
#include <string>

namespace weft {

enum class LogLevel : int { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

/// The level from WEFT_LOG (default warn); read once.
LogLevel log_level();
/// Sets the calling thread's rank used as the line prefix (-1: no rank yet).
void set_log_rank(int rank);
/// Writes one line to stderr, atomically with respect to other threads of this process.
void log_line(LogLevel level, const std::string& message);

}  // namespace weft

#define WEFT_LOG(level, msg)                                                      \
    do {                                                                          \
        if (static_cast<int>(level) <= static_cast<int>(::weft::log_level())) {   \
            std::ostringstream weft_log_os_;                                      \
            weft_log_os_ << msg;                                                  \
            ::weft::log_line(level, weft_log_os_.str());                          \
        }                                                                         \
    } while (0)
#define WEFT_LOG_ERROR(msg) WEFT_LOG(::weft::LogLevel::kError, msg)
#define WEFT_LOG_WARN(msg) WEFT_LOG(::weft::LogLevel::kWarn, msg)
#define WEFT_LOG_INFO(msg) WEFT_LOG(::weft::LogLevel::kInfo, msg)
#define WEFT_LOG_DEBUG(msg) WEFT_LOG(::weft::LogLevel::kDebug, msg)
