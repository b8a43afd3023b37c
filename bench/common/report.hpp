// SPDX-License-Identifier: MIT
// Small formatting helpers for the benchmarks' tables.
#pragma once

#include <cstdint>
#include <ctime>
#include <string>

namespace weft::bench {

/// Today's date in UTC, "YYYY-MM-DD" (tables and JSON are dated).
inline std::string utc_date() {
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    gmtime_r(&t, &tm);
    char buf[32];
    std::strftime(buf, sizeof(buf), "%Y-%m-%d", &tm);
    return buf;
}

/// A byte count in the largest unit that divides it: 4096 -> "4K", 3 << 20 -> "3M", 1000 -> "1000B".
inline std::string format_bytes(uint64_t b) {
    const char* units[] = {"B", "K", "M", "G"};
    int u = 0;
    while (u < 3 && b >= 1024 && b % 1024 == 0) {
        b /= 1024;
        ++u;
    }
    return std::to_string(b) + units[u];
}

}  // namespace weft::bench
