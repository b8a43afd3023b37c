// SPDX-License-Identifier: MIT
// A log sink for tests: captures every line weft logs, at the levels a WEFT_LOG-style spec gives, for one scope.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "weft/runtime/log.hpp"

namespace weft::testing {

/// One captured line, with the level, the subsystem and the logging thread's rank.
struct Captured {
    LogLevel level;
    std::string subsystem;
    std::string line;
    int rank;
};

/// Installs a capturing sink and given levels for one scope; restores stderr and the previous levels after.
class LogCapture {
public:
    explicit LogCapture(std::string_view spec) {
        for (size_t i = 0; i < saved_.level.size(); ++i) saved_.level[i] = log_level(static_cast<LogSubsystem>(i));
        set_log_levels(parse_log_levels(spec));
        set_log_sink([this](LogLevel level, std::string_view subsystem, std::string_view line) {
            lines.push_back({level, std::string(subsystem), std::string(line), log_rank()});
        });
    }
    ~LogCapture() {
        set_log_sink({});
        set_log_levels(saved_);
    }
    LogCapture(const LogCapture&) = delete;
    LogCapture& operator=(const LogCapture&) = delete;

    /// The texts of the captured lines `keep` selects, in order.
    std::vector<std::string> texts(const std::function<bool(const Captured&)>& keep) const {
        std::vector<std::string> out;
        for (const Captured& c : lines) {
            if (keep(c)) out.push_back(c.line);
        }
        return out;
    }

    std::vector<Captured> lines;

private:
    LogLevels saved_{};
};

}  // namespace weft::testing
