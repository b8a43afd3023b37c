// SPDX-License-Identifier: MIT
// The host log (WEFT_LOG).
#include "weft/runtime/log.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>

#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"

namespace weft {

namespace {
thread_local int t_log_rank = -1;
std::mutex g_log_mutex;

LogLevel read_level() {
    auto value = env::get("WEFT_LOG");
    if (!value || value->empty()) return LogLevel::kWarn;
    std::string v = *value;
    std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    if (v == "error") return LogLevel::kError;
    if (v == "warn" || v == "warning") return LogLevel::kWarn;
    if (v == "info") return LogLevel::kInfo;
    if (v == "debug") return LogLevel::kDebug;
    WEFT_FAIL("WEFT_LOG must be one of error, warn, info, debug; got '" << *value << "'");
}

const char* level_name(LogLevel level) {
    switch (level) {
        case LogLevel::kError: return "error";
        case LogLevel::kWarn: return "warn";
        case LogLevel::kInfo: return "info";
        case LogLevel::kDebug: return "debug";
    }
    return "?";
}
}  // namespace

LogLevel log_level() {
    static const LogLevel level = read_level();
    return level;
}

void set_log_rank(int rank) { t_log_rank = rank; }

void log_line(LogLevel level, const std::string& message) {
    // Debug lines carry the seconds since the first line: they are read to order what ranks did.
    static const auto t0 = std::chrono::steady_clock::now();
    char when[32] = "";
    if (level == LogLevel::kDebug) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::snprintf(when, sizeof(when), " +%.6fs", s);
    }
    std::lock_guard<std::mutex> lock(g_log_mutex);
    if (t_log_rank >= 0) {
        std::fprintf(stderr, "[weft rank %d %s%s] %s\n", t_log_rank, level_name(level), when, message.c_str());
    } else {
        std::fprintf(stderr, "[weft %s%s] %s\n", level_name(level), when, message.c_str());
    }
}

}  // namespace weft
