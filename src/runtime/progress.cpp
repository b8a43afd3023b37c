// SPDX-License-Identifier: MIT
// Progress text and the terminal/log progress reporter.
#include "weft/runtime/progress.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>

namespace weft {

std::string format_duration(double seconds) {
    char buf[32];
    if (!(seconds >= 0)) seconds = 0;
    if (seconds < 1.0) {
        std::snprintf(buf, sizeof(buf), "%dms", static_cast<int>(std::lround(seconds * 1e3)));
    } else if (seconds < 60.0) {
        std::snprintf(buf, sizeof(buf), "%.1fs", seconds);
    } else if (seconds < 3600.0) {
        const long s = std::lround(seconds);
        std::snprintf(buf, sizeof(buf), "%ldm%02lds", s / 60, s % 60);
    } else {
        const long m = std::lround(seconds / 60.0);
        std::snprintf(buf, sizeof(buf), "%ldh%02ldm", m / 60, m % 60);
    }
    return buf;
}

namespace {
int percent(size_t done, size_t total) {
    return total == 0 ? 100 : static_cast<int>(std::min<size_t>(done, total) * 100 / total);
}
std::optional<double> remaining_s(size_t done, size_t total, double elapsed_s) {
    if (done == 0 || done >= total) return std::nullopt;
    return elapsed_s / static_cast<double>(done) * static_cast<double>(total - done);
}
}  // namespace

std::string progress_line_text(size_t done, size_t total, double elapsed_s) {
    std::string out = std::to_string(done) + "/" + std::to_string(total) + " (" + std::to_string(percent(done, total)) +
                      "%), " + format_duration(elapsed_s) + " elapsed";
    if (const auto left = remaining_s(done, total, elapsed_s)) out += ", about " + format_duration(*left) + " left";
    return out;
}

std::string progress_bar_text(size_t done, size_t total, double elapsed_s, std::string_view label, int width) {
    constexpr int kBarCells = 24;
    std::string bar = "[";
    const int filled = total == 0 ? kBarCells : static_cast<int>(std::min<size_t>(done, total) * kBarCells / total);
    bar.append(static_cast<size_t>(filled), '#');
    bar.append(static_cast<size_t>(kBarCells - filled), '.');
    bar += "] " + std::to_string(done) + "/" + std::to_string(total) + " " + std::to_string(percent(done, total)) + "%";
    if (const auto left = remaining_s(done, total, elapsed_s)) bar += " ~" + format_duration(*left) + " left";
    if (!label.empty()) bar += "  " + std::string(label);
    if (width > 0 && bar.size() > static_cast<size_t>(width)) bar.resize(static_cast<size_t>(width));
    return bar;
}

ProgressReporter::ProgressReporter(std::string prefix, size_t total, std::FILE* out, std::optional<bool> terminal,
                                   int width)
    : prefix_(std::move(prefix)),
      total_(total),
      out_(out),
      terminal_(terminal ? *terminal : (out != nullptr && isatty(fileno(out)) != 0)),
      width_(width) {
    next_line_at_ = std::max<size_t>(1, total_ / 10);
}

ProgressReporter::~ProgressReporter() { finish(); }

void ProgressReporter::advance(std::string_view label) {
    if (finished_ || out_ == nullptr) return;
    ++done_;
    const auto now = Clock::now();
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    if (terminal_) {
        const bool last = done_ >= total_;
        if (!last && drawn_ && now - last_output_ < std::chrono::milliseconds(100)) return;
        const std::string text = prefix_ + ": " + progress_bar_text(done_, total_, elapsed, label, width_ - 2 -
                                                                    static_cast<int>(prefix_.size()));
        std::fprintf(out_, "\r\033[K%s", text.c_str());
        std::fflush(out_);
        drawn_ = true;
        last_output_ = now;
        return;
    }
    if (done_ < next_line_at_ && done_ < total_ && now - last_output_ < std::chrono::seconds(10)) return;
    while (next_line_at_ <= done_) next_line_at_ += std::max<size_t>(1, total_ / 10);
    std::fprintf(out_, "%s: %s\n", prefix_.c_str(), progress_line_text(done_, total_, elapsed).c_str());
    std::fflush(out_);
    last_output_ = now;
}

void ProgressReporter::clear() {
    if (!terminal_ || !drawn_ || out_ == nullptr) return;
    std::fprintf(out_, "\r\033[K");
    std::fflush(out_);
    drawn_ = false;
}

void ProgressReporter::finish() {
    if (finished_) return;
    clear();
    finished_ = true;
}

}  // namespace weft
