// SPDX-License-Identifier: MIT
// The host log: one line per event, prefixed with the rank, filtered per subsystem by WEFT_LOG, routed to stderr or
// to a sink the host program installs.
//
// WEFT_LOG is a comma-separated list of `LEVEL` (every subsystem not named) and `SUBSYSTEM=LEVEL` entries, e.g.
// `WEFT_LOG=warn,jit=info,runtime=debug`. Levels, from quiet to verbose: error, warn, notice (the default:
// warnings plus progress of work that takes seconds: JIT compiles, autotuning), info, debug. Subsystems: runtime,
// jit, ops, ep, bench, tools.
#pragma once

#include <array>
#include <atomic>
#include <functional>
#include <sstream>
#include <string>
#include <string_view>

namespace weft {

enum class LogLevel : int { kError = 0, kWarn = 1, kNotice = 2, kInfo = 3, kDebug = 4 };

/// Where a line comes from. The WEFT_LOG_* macros pick it by ordinary name lookup of `weft_log_subsystem` from the
/// calling scope: code in namespace weft (and weft::detail) logs as runtime, weft::jit as jit, weft::ops as ops,
/// weft::ops::ep as ep, weft::bench as bench, and code outside weft's namespaces (the tools) as tools.
enum class LogSubsystem : int { kRuntime = 0, kJit, kOps, kEp, kBench, kTools };
inline constexpr int kNumLogSubsystems = 6;

/// "error" ... "debug" / "runtime" ... "tools": the names WEFT_LOG uses.
std::string_view log_level_name(LogLevel level);
std::string_view log_subsystem_name(LogSubsystem subsystem);

/// A level per subsystem (what WEFT_LOG describes).
struct LogLevels {
    std::array<LogLevel, kNumLogSubsystems> level;
    LogLevel operator[](LogSubsystem s) const { return level[static_cast<size_t>(s)]; }
};

/// The default: notice for every subsystem.
LogLevels default_log_levels();
/// Parses WEFT_LOG's syntax (see the top of this file; case-insensitive, spaces around entries ignored; empty text:
/// the default). Throws weft::Error naming the bad entry and what is allowed: an empty entry, an unknown level or
/// subsystem, a subsystem or the default given twice.
LogLevels parse_log_levels(std::string_view text);

/// The level `subsystem` logs at: from WEFT_LOG on first use, then as set_log_levels left it. Logging never throws: a
/// bad WEFT_LOG is reported once on stderr and the default levels apply (check_log_env makes it an error).
LogLevel log_level(LogSubsystem subsystem);
/// Throws weft::Error naming the bad entry when WEFT_LOG (as read on first use) is malformed; a World's constructor
/// calls it, so a job with a bad WEFT_LOG fails at its start instead of logging at levels it did not ask for.
void check_log_env();
/// Replaces every subsystem's level (thread-safe; lines being written meanwhile use either the old or the new).
void set_log_levels(const LogLevels& levels);

/// Sets the calling thread's rank used as the line prefix (-1: no rank yet).
void set_log_rank(int rank);
/// The calling thread's rank as set_log_rank left it (-1: none): a sink may read it (it runs on the logging thread).
int log_rank();

/// Receives every line that passes its subsystem's level instead of stderr: `line` is the message alone (no prefix,
/// no newline). Calls are serialised (one at a time, on the logging thread): a sink need not be thread-safe, and every
/// thread that logs meanwhile waits for it, so a sink must not block on a lock that a thread calling weft may hold. A
/// line logged from inside the sink goes to stderr; an exception thrown by the sink is reported on stderr and dropped.
using LogSink = std::function<void(LogLevel level, std::string_view subsystem, std::string_view line)>;
/// Installs `sink` (an empty function: back to stderr). Thread-safe; called from inside the sink, it takes effect
/// when the sink returns.
void set_log_sink(LogSink sink);

/// Writes one line (to the sink, else to stderr as "[weft rank R subsystem level] message"), atomically with respect
/// to other threads of this process, whatever the level filter says (the WEFT_LOG_* macros filter first).
void log_line(LogSubsystem subsystem, LogLevel level, std::string_view message);

namespace detail {
/// The current threshold per subsystem (relaxed atomics; initialised from WEFT_LOG on first use).
const std::array<std::atomic<int>, kNumLogSubsystems>& log_thresholds();
}  // namespace detail

/// Whether a line of `level` from `subsystem` is written: one relaxed load.
inline bool log_enabled(LogSubsystem subsystem, LogLevel level) {
    return static_cast<int>(level) <=
           detail::log_thresholds()[static_cast<size_t>(subsystem)].load(std::memory_order_relaxed);
}

/// The subsystems by namespace (see LogSubsystem).
inline constexpr LogSubsystem weft_log_subsystem = LogSubsystem::kRuntime;
namespace jit {
inline constexpr LogSubsystem weft_log_subsystem = LogSubsystem::kJit;
}
namespace ops {
inline constexpr LogSubsystem weft_log_subsystem = LogSubsystem::kOps;
namespace ep {
inline constexpr LogSubsystem weft_log_subsystem = LogSubsystem::kEp;
}
}  // namespace ops
namespace bench {
inline constexpr LogSubsystem weft_log_subsystem = LogSubsystem::kBench;
}

}  // namespace weft

/// Code outside weft's namespaces logs as tools.
inline constexpr weft::LogSubsystem weft_log_subsystem = weft::LogSubsystem::kTools;

/// One line at `level` from `subsystem` (a weft::LogSubsystem); `msg` is streamed (`"x = " << x`) only when the
/// line passes the filter.
#define WEFT_LOG_AT(subsystem, level, msg)                                  \
    do {                                                                    \
        if (::weft::log_enabled(subsystem, level)) {                        \
            std::ostringstream weft_log_os_;                                \
            weft_log_os_ << msg;                                            \
            ::weft::log_line(subsystem, level, weft_log_os_.str());         \
        }                                                                   \
    } while (0)
#define WEFT_LOG(level, msg) WEFT_LOG_AT(weft_log_subsystem, level, msg)
#define WEFT_LOG_ERROR(msg) WEFT_LOG(::weft::LogLevel::kError, msg)
#define WEFT_LOG_WARN(msg) WEFT_LOG(::weft::LogLevel::kWarn, msg)
#define WEFT_LOG_NOTICE(msg) WEFT_LOG(::weft::LogLevel::kNotice, msg)
#define WEFT_LOG_INFO(msg) WEFT_LOG(::weft::LogLevel::kInfo, msg)
#define WEFT_LOG_DEBUG(msg) WEFT_LOG(::weft::LogLevel::kDebug, msg)
