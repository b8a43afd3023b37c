// SPDX-License-Identifier: MIT
// Unit tests for the host log: WEFT_LOG's per-subsystem syntax and errors, the level filter, the host program's sink.
#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "support/log_capture.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"

namespace weft {

namespace {

using testing::Captured;
using testing::LogCapture;

std::string error_of(std::string_view spec) {
    try {
        (void)parse_log_levels(spec);
    } catch (const Error& e) {
        return e.what();
    }
    return "(no error)";
}

}  // namespace

// Log statements from the namespaces that select each subsystem.
namespace jit {
inline void log_test_line(int* evaluated) { WEFT_LOG_DEBUG("jit debug " << ++*evaluated); }
}  // namespace jit
namespace ops {
inline void log_test_line(int* evaluated) { WEFT_LOG_WARN("ops warn " << ++*evaluated); }
inline void log_test_error() { WEFT_LOG_ERROR("ops error"); }
namespace ep {
inline void log_test_line() { WEFT_LOG_NOTICE("ep notice"); }
}  // namespace ep
}  // namespace ops
namespace detail {
inline void log_test_line() { WEFT_LOG_INFO("runtime info"); }
}  // namespace detail

namespace {

TEST(LogLevels, DefaultIsNoticeEverywhere) {
    for (std::string_view spec : {"", "  "}) {
        const LogLevels l = parse_log_levels(spec);
        for (LogLevel level : l.level) EXPECT_EQ(level, LogLevel::kNotice) << "'" << spec << "'";
    }
}

TEST(LogLevels, ParsesADefaultAndPerSubsystemLevels) {
    const LogLevels l = parse_log_levels("warn,jit=info,runtime=debug");
    EXPECT_EQ(l[LogSubsystem::kJit], LogLevel::kInfo);
    EXPECT_EQ(l[LogSubsystem::kRuntime], LogLevel::kDebug);
    for (LogSubsystem s : {LogSubsystem::kOps, LogSubsystem::kEp, LogSubsystem::kBench, LogSubsystem::kTools}) {
        EXPECT_EQ(l[s], LogLevel::kWarn) << log_subsystem_name(s);
    }
    // The default applies to the subsystems not named, wherever it stands; no default keeps notice for them.
    const LogLevels late = parse_log_levels("ep=debug, ERROR");
    EXPECT_EQ(late[LogSubsystem::kEp], LogLevel::kDebug);
    EXPECT_EQ(late[LogSubsystem::kJit], LogLevel::kError);
    const LogLevels only = parse_log_levels(" Ops = Info ");
    EXPECT_EQ(only[LogSubsystem::kOps], LogLevel::kInfo);
    EXPECT_EQ(only[LogSubsystem::kJit], LogLevel::kNotice);
    EXPECT_EQ(parse_log_levels("warning")[LogSubsystem::kBench], LogLevel::kWarn);
    EXPECT_EQ(parse_log_levels("notice,tools=error")[LogSubsystem::kTools], LogLevel::kError);
}

TEST(LogLevels, BadSpecsNameTheEntryAndWhatIsAllowed) {
    const std::string unknown_level = error_of("warn,jit=loud");
    EXPECT_NE(unknown_level.find("unknown level 'loud'"), std::string::npos) << unknown_level;
    EXPECT_NE(unknown_level.find("jit=loud"), std::string::npos) << unknown_level;
    EXPECT_NE(unknown_level.find("error, warn, notice, info, debug"), std::string::npos) << unknown_level;

    const std::string unknown_subsystem = error_of("jitt=info");
    EXPECT_NE(unknown_subsystem.find("unknown subsystem 'jitt'"), std::string::npos) << unknown_subsystem;
    EXPECT_NE(unknown_subsystem.find("runtime, jit, ops, ep, bench, tools"), std::string::npos) << unknown_subsystem;

    EXPECT_NE(error_of("warn,,jit=info").find("empty entry"), std::string::npos);
    EXPECT_NE(error_of("warn,").find("empty entry"), std::string::npos);
    EXPECT_NE(error_of("warn,error").find("default level is given twice"), std::string::npos);
    EXPECT_NE(error_of("jit=info,JIT=debug").find("'jit' is given twice"), std::string::npos);
    EXPECT_NE(error_of("jit=").find("unknown level ''"), std::string::npos);
    EXPECT_NE(error_of("=info").find("unknown subsystem ''"), std::string::npos);
    EXPECT_NE(error_of("verbose").find("unknown level 'verbose'"), std::string::npos);
}

TEST(LogLevels, ApplyPerSubsystemAndPickTheSubsystemByNamespace) {
    int evaluated = 0;
    {
        LogCapture capture("error,jit=debug,ep=notice");
        EXPECT_EQ(log_level(LogSubsystem::kJit), LogLevel::kDebug);
        EXPECT_TRUE(log_enabled(LogSubsystem::kJit, LogLevel::kDebug));
        EXPECT_FALSE(log_enabled(LogSubsystem::kOps, LogLevel::kWarn));
        set_log_rank(5);
        jit::log_test_line(&evaluated);  // passes: jit=debug
        ops::log_test_line(&evaluated);  // filtered: ops=error; its message is never built
        ops::log_test_error();           // passes
        ops::ep::log_test_line();        // passes: ep=notice
        detail::log_test_line();         // filtered: runtime=error
        set_log_rank(-1);
        ASSERT_EQ(capture.lines.size(), 3u);
        EXPECT_EQ(capture.lines[0].subsystem, "jit");
        EXPECT_EQ(capture.lines[0].level, LogLevel::kDebug);
        EXPECT_EQ(capture.lines[0].line, "jit debug 1");
        EXPECT_EQ(capture.lines[0].rank, 5);
        EXPECT_EQ(capture.lines[1].subsystem, "ops");
        EXPECT_EQ(capture.lines[1].line, "ops error");
        EXPECT_EQ(capture.lines[2].subsystem, "ep");
        EXPECT_EQ(capture.lines[2].level, LogLevel::kNotice);
    }
    EXPECT_EQ(evaluated, 1);
    {
        LogCapture capture("debug");
        detail::log_test_line();
        WEFT_LOG_INFO("outside weft");  // this test's own scope is namespace weft: runtime
        WEFT_LOG_AT(LogSubsystem::kBench, LogLevel::kInfo, "explicit");
        ASSERT_EQ(capture.lines.size(), 3u);
        EXPECT_EQ(capture.lines[0].subsystem, "runtime");
        EXPECT_EQ(capture.lines[1].subsystem, "runtime");
        EXPECT_EQ(capture.lines[2].subsystem, "bench");
    }
}

TEST(LogSink, ASinkThatLogsOrThrowsNeitherDeadlocksNorThrows) {
    LogCapture capture("info");
    int calls = 0;
    set_log_sink([&](LogLevel, std::string_view, std::string_view line) {
        ++calls;
        if (line == "recurse") WEFT_LOG_INFO("from inside the sink (to stderr)");
        if (line == "throw") throw std::runtime_error("sink failure");
    });
    EXPECT_NO_THROW(WEFT_LOG_INFO("recurse"));
    EXPECT_NO_THROW(WEFT_LOG_INFO("throw"));
    EXPECT_NO_THROW(WEFT_LOG_INFO("plain"));
    EXPECT_EQ(calls, 3);  // the line logged inside the sink went to stderr, not to the sink
}

TEST(LogSink, ASinkReplacingItselfTakesEffectWhenItReturns) {
    LogCapture capture("info");
    std::vector<std::string> first, second;
    set_log_sink([&](LogLevel, std::string_view, std::string_view line) {
        first.emplace_back(line);
        if (line == "hand over") {
            set_log_sink([&](LogLevel, std::string_view, std::string_view l) { second.emplace_back(l); });
            first.emplace_back("still running");  // this sink's state lives on until it returns
        }
    });
    WEFT_LOG_INFO("hand over");
    WEFT_LOG_INFO("after");
    EXPECT_EQ(first, (std::vector<std::string>{"hand over", "still running"}));
    EXPECT_EQ(second, std::vector<std::string>{"after"});
}

// A bad WEFT_LOG (read once, on first use) never makes a log statement throw, on any thread: it is written once to
// stderr, the default levels apply, and check_log_env (a World's constructor) throws it. In a fresh process: the
// levels are read once per process.
TEST(LogEnvDeathTest, ABadWeftLogIsReportedOnceAndIsAnErrorForAWorldNotForALogStatement) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    EXPECT_EXIT(
        {
            ::setenv("WEFT_LOG", "warn,", 1);
            std::thread t([] { WEFT_LOG_WARN("from a thread"); });  // a throw here would terminate the process
            t.join();
            WEFT_LOG_WARN("and again");
            int code = 4;
            try {
                check_log_env();
            } catch (const Error& e) {
                const std::string what = e.what();  // the parse's own error, once (not wrapped in another)
                code = what.find("WEFT_LOG: empty entry") != std::string::npos &&
                               what.find("weft: weft:") == std::string::npos
                           ? 3
                           : 5;
            }
            std::_Exit(log_level(LogSubsystem::kJit) == LogLevel::kNotice ? code : 6);
        },
        ::testing::ExitedWithCode(3), "WEFT_LOG: empty entry in 'warn,'; .* the default levels apply");
}

}  // namespace
}  // namespace weft
