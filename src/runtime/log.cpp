// SPDX-License-Identifier: MIT
// The host log (WEFT_LOG): levels per subsystem, the stderr writer and the host program's sink.
#include "weft/runtime/log.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <mutex>
#include <optional>

#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"

namespace weft {

namespace {

constexpr std::array<std::string_view, 5> kLevelNames = {"error", "warn", "notice", "info", "debug"};
constexpr std::array<std::string_view, kNumLogSubsystems> kSubsystemNames = {"runtime", "jit",   "ops",
                                                                             "ep",      "bench", "tools"};

thread_local int t_log_rank = -1;
thread_local bool t_in_sink = false;
std::mutex g_log_mutex;
LogSink g_sink;  // guarded by g_log_mutex

std::string lower(std::string_view text) {
    std::string out(text);
    std::transform(out.begin(), out.end(), out.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return out;
}

std::string_view trim(std::string_view s) {
    const size_t b = s.find_first_not_of(" \t");
    if (b == std::string_view::npos) return {};
    return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

std::string joined(const auto& names) {
    std::string out;
    for (std::string_view n : names) out += (out.empty() ? "" : ", ") + std::string(n);
    return out;
}

LogLevel parse_level(std::string_view word, std::string_view entry, std::string_view text) {
    const std::string w = lower(word);
    for (size_t i = 0; i < kLevelNames.size(); ++i) {
        if (w == kLevelNames[i]) return static_cast<LogLevel>(i);
    }
    if (w == "warning") return LogLevel::kWarn;
    WEFT_FAIL("WEFT_LOG: unknown level '" << word << "' in entry '" << entry << "' of '" << text
                                          << "'; levels: " << joined(kLevelNames));
}

// WEFT_LOG as read once, on first use: its levels, or the defaults and why the value was refused. A log statement
// never throws (it runs in threads, destructors and catch blocks): a bad value is reported once on stderr here, and
// as an error by check_log_env (every World's constructor calls it).
struct EnvLevels {
    LogLevels levels;
    std::exception_ptr error;  // null when WEFT_LOG was good or unset
};

const EnvLevels& env_levels() {
    static const EnvLevels* parsed = [] {
        auto* e = new EnvLevels{default_log_levels(), {}};
        try {
            const auto value = env::get("WEFT_LOG");
            e->levels = parse_log_levels(value ? *value : std::string());
        } catch (const std::exception& ex) {
            e->error = std::current_exception();
            std::fprintf(stderr, "[weft] %s; the default levels apply\n", ex.what());
        }
        return e;
    }();
    return *parsed;
}

std::array<std::atomic<int>, kNumLogSubsystems>& thresholds() {
    static std::array<std::atomic<int>, kNumLogSubsystems>* table = [] {
        const LogLevels& levels = env_levels().levels;
        auto* t = new std::array<std::atomic<int>, kNumLogSubsystems>();
        for (size_t i = 0; i < t->size(); ++i) (*t)[i].store(static_cast<int>(levels.level[i]));
        return t;
    }();
    return *table;
}

void write_stderr(LogSubsystem subsystem, LogLevel level, std::string_view message) {
    // Debug lines carry the seconds since the process's first line on stderr (any level): they are read to order
    // what ranks did.
    static const auto t0 = std::chrono::steady_clock::now();
    char when[32] = "";
    if (level == LogLevel::kDebug) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::snprintf(when, sizeof(when), " +%.6fs", s);
    }
    const std::string_view sub = log_subsystem_name(subsystem), lvl = log_level_name(level);
    const int msg_len = static_cast<int>(std::min<size_t>(message.size(), 1u << 30));
    if (t_log_rank >= 0) {
        std::fprintf(stderr, "[weft rank %d %.*s %.*s%s] %.*s\n", t_log_rank, static_cast<int>(sub.size()), sub.data(),
                     static_cast<int>(lvl.size()), lvl.data(), when, msg_len, message.data());
    } else {
        std::fprintf(stderr, "[weft %.*s %.*s%s] %.*s\n", static_cast<int>(sub.size()), sub.data(),
                     static_cast<int>(lvl.size()), lvl.data(), when, msg_len, message.data());
    }
}

}  // namespace

std::string_view log_level_name(LogLevel level) {
    const auto i = static_cast<size_t>(level);
    return i < kLevelNames.size() ? kLevelNames[i] : std::string_view("?");
}

std::string_view log_subsystem_name(LogSubsystem subsystem) {
    const auto i = static_cast<size_t>(subsystem);
    return i < kSubsystemNames.size() ? kSubsystemNames[i] : std::string_view("?");
}

LogLevels default_log_levels() {
    LogLevels levels;
    levels.level.fill(LogLevel::kNotice);
    return levels;
}

LogLevels parse_log_levels(std::string_view text) {
    LogLevels levels = default_log_levels();
    if (trim(text).empty()) return levels;
    std::optional<LogLevel> fallback;
    std::array<bool, kNumLogSubsystems> named{};
    size_t begin = 0;
    while (true) {
        const size_t comma = text.find(',', begin);
        const size_t length = comma == std::string_view::npos ? text.npos : comma - begin;
        const std::string_view entry = trim(text.substr(begin, length));
        WEFT_CHECK(!entry.empty(), "WEFT_LOG: empty entry in '" << text << "'; expected LEVEL or SUBSYSTEM=LEVEL "
                                                                << "entries separated by commas, e.g. warn,jit=info");
        const size_t eq = entry.find('=');
        if (eq == std::string_view::npos) {
            WEFT_CHECK(!fallback, "WEFT_LOG: the default level is given twice in '" << text
                                                                                   << "' (entries without SUBSYSTEM=)");
            fallback = parse_level(entry, entry, text);
        } else {
            const std::string name = lower(trim(entry.substr(0, eq)));
            const auto it = std::find(kSubsystemNames.begin(), kSubsystemNames.end(), name);
            WEFT_CHECK(it != kSubsystemNames.end(), "WEFT_LOG: unknown subsystem '"
                                                        << trim(entry.substr(0, eq)) << "' in entry '" << entry
                                                        << "' of '" << text << "'; subsystems: "
                                                        << joined(kSubsystemNames));
            const auto idx = static_cast<size_t>(it - kSubsystemNames.begin());
            WEFT_CHECK(!named[idx], "WEFT_LOG: subsystem '" << name << "' is given twice in '" << text << "'");
            named[idx] = true;
            levels.level[idx] = parse_level(trim(entry.substr(eq + 1)), entry, text);
        }
        if (comma == std::string_view::npos) break;
        begin = comma + 1;
    }
    if (fallback) {
        for (size_t i = 0; i < levels.level.size(); ++i) {
            if (!named[i]) levels.level[i] = *fallback;
        }
    }
    return levels;
}

namespace detail {
const std::array<std::atomic<int>, kNumLogSubsystems>& log_thresholds() { return thresholds(); }
}  // namespace detail

void check_log_env() {
    if (env_levels().error) std::rethrow_exception(env_levels().error);
}

LogLevel log_level(LogSubsystem subsystem) {
    return static_cast<LogLevel>(thresholds()[static_cast<size_t>(subsystem)].load(std::memory_order_relaxed));
}

void set_log_levels(const LogLevels& levels) {
    auto& t = thresholds();
    for (size_t i = 0; i < t.size(); ++i) t[i].store(static_cast<int>(levels.level[i]), std::memory_order_relaxed);
}

void set_log_rank(int rank) { t_log_rank = rank; }
int log_rank() { return t_log_rank; }

// A sink replaced from inside itself (its own thread holds g_log_mutex, and the sink runs): installed when it returns.
thread_local std::optional<LogSink> t_sink_replacement;

void set_log_sink(LogSink sink) {
    if (t_in_sink) {
        t_sink_replacement = std::move(sink);
        return;
    }
    std::lock_guard<std::mutex> lock(g_log_mutex);
    g_sink = std::move(sink);
}

void log_line(LogSubsystem subsystem, LogLevel level, std::string_view message) {
    if (t_in_sink) {  // the sink logs through weft: stderr, outside the lock the sink's caller holds
        write_stderr(subsystem, level, message);
        return;
    }
    std::lock_guard<std::mutex> lock(g_log_mutex);
    if (!g_sink) {
        write_stderr(subsystem, level, message);
        return;
    }
    t_in_sink = true;
    try {
        g_sink(level, log_subsystem_name(subsystem), message);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "[weft] the log sink threw (%s); the line was: %.*s\n", e.what(),
                     static_cast<int>(message.size()), message.data());
    } catch (...) {
        std::fprintf(stderr, "[weft] the log sink threw; the line was: %.*s\n", static_cast<int>(message.size()),
                     message.data());
    }
    t_in_sink = false;
    if (t_sink_replacement) {
        g_sink = std::move(*t_sink_replacement);
        t_sink_replacement.reset();
    }
}

}  // namespace weft
