// SPDX-License-Identifier: MIT
// Progress of work that takes seconds, for a terminal (a bar redrawn in place) or a log (a line now and then).
#pragma once

#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

namespace weft {

/// A duration for people: "350ms", "4.2s", "1m12s", "2h03m".
std::string format_duration(double seconds);

/// "37/120 (31%), 1m12s elapsed, about 2m36s left" (no estimate before the first step or after the last).
std::string progress_line_text(size_t done, size_t total, double elapsed_s);

/// "[#######.............] 37/120 31% ~2m36s left  label", cut to `width` columns (the label is cut first).
std::string progress_bar_text(size_t done, size_t total, double elapsed_s, std::string_view label, int width);

/// Reports a batch of `total` steps on `out`: with a terminal, a bar redrawn in place (at most ten times a second,
/// and at the last step); otherwise a line "<prefix>: <progress_line_text>" at every tenth of the steps and at
/// least every 10 s. Not thread-safe: callers that advance from several threads hold their own lock.
class ProgressReporter {
public:
    /// `terminal`: whether `out` is a terminal (default: isatty of its descriptor); `width`: the bar's columns.
    ProgressReporter(std::string prefix, size_t total, std::FILE* out = stderr, std::optional<bool> terminal = {},
                     int width = 100);
    ~ProgressReporter();
    ProgressReporter(const ProgressReporter&) = delete;
    ProgressReporter& operator=(const ProgressReporter&) = delete;

    /// One more step is done; `label` says which (shown on the bar).
    void advance(std::string_view label = {});
    /// Erases the bar (terminal only) so that other output can be written; the next advance() redraws it.
    void clear();
    /// Erases the bar for good (also done by the destructor).
    void finish();

    bool terminal() const { return terminal_; }
    size_t done() const { return done_; }

private:
    using Clock = std::chrono::steady_clock;
    std::string prefix_;
    size_t total_;
    std::FILE* out_;
    bool terminal_;
    int width_;
    size_t done_ = 0;
    size_t next_line_at_ = 0;  // not a terminal: the step count of the next line
    bool drawn_ = false;
    bool finished_ = false;
    Clock::time_point start_ = Clock::now();
    Clock::time_point last_output_ = start_;
};

}  // namespace weft
