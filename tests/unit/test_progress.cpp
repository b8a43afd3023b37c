// SPDX-License-Identifier: MIT
// Unit tests for progress reporting: the text of lines and bars, the reporter on a terminal and on a log, and the
// JIT's progress lines when it compiles a batch of kernels.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "support/jit_testing.hpp"
#include "support/log_capture.hpp"
#include "weft/jit/aot.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/progress.hpp"

namespace weft {
namespace {

std::string contents(std::FILE* f) {
    std::fflush(f);
    std::rewind(f);
    std::string out;
    char buf[4096];
    size_t n = 0;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
    return out;
}

size_t count(const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
}

TEST(Progress, DurationsReadLikePeopleWriteThem) {
    EXPECT_EQ(format_duration(0.35), "350ms");
    EXPECT_EQ(format_duration(4.21), "4.2s");
    EXPECT_EQ(format_duration(72.0), "1m12s");
    EXPECT_EQ(format_duration(7380.0), "2h03m");
    EXPECT_EQ(format_duration(-1.0), "0ms");
}

TEST(Progress, LineAndBarShowDoneTotalAndAnEstimate) {
    EXPECT_EQ(progress_line_text(0, 8, 0.0), "0/8 (0%), 0ms elapsed");
    EXPECT_EQ(progress_line_text(2, 8, 10.0), "2/8 (25%), 10.0s elapsed, about 30.0s left");
    EXPECT_EQ(progress_line_text(8, 8, 40.0), "8/8 (100%), 40.0s elapsed");
    const std::string bar = progress_bar_text(6, 24, 3.0, "ag_gemm 128x256x64", 200);
    EXPECT_EQ(bar, "[######..................] 6/24 25% ~9.0s left  ag_gemm 128x256x64");
    EXPECT_EQ(progress_bar_text(6, 24, 3.0, "ag_gemm 128x256x64", 30), bar.substr(0, 30));
    EXPECT_EQ(progress_bar_text(3, 3, 1.0, "", 200), "[########################] 3/3 100%");
}

TEST(Progress, OnALogALineAtEveryTenth) {
    std::FILE* f = std::tmpfile();
    ASSERT_NE(f, nullptr);
    {
        ProgressReporter p("weft-compile", 20, f, false);
        EXPECT_FALSE(p.terminal());
        for (int i = 0; i < 20; ++i) p.advance("spec");
        EXPECT_EQ(p.done(), 20u);
    }
    const std::string text = contents(f);
    std::fclose(f);
    EXPECT_EQ(count(text, "\n"), 10u) << text;
    EXPECT_EQ(count(text, "weft-compile: "), 10u) << text;
    EXPECT_NE(text.find("weft-compile: 2/20 (10%)"), std::string::npos) << text;
    EXPECT_NE(text.find("weft-compile: 20/20 (100%)"), std::string::npos) << text;
    EXPECT_EQ(text.find('\r'), std::string::npos) << "no terminal control on a log";
}

TEST(Progress, OnATerminalABarRedrawnInPlaceAndErasedAtTheEnd) {
    std::FILE* f = std::tmpfile();
    ASSERT_NE(f, nullptr);
    {
        ProgressReporter p("weft-compile", 3, f, true, 120);
        p.advance("first");  // drawn: the first
        p.clear();           // erased for other output
        p.advance("second");  // redrawn at once after a clear
        p.advance("third");   // the last step is always drawn
    }
    const std::string text = contents(f);
    std::fclose(f);
    EXPECT_EQ(text.find('\n'), std::string::npos) << "a bar never scrolls";
    EXPECT_NE(text.find("1/3"), std::string::npos);
    EXPECT_NE(text.find("2/3"), std::string::npos);
    EXPECT_NE(text.find("3/3 100%  third"), std::string::npos);
    EXPECT_GE(count(text, "\r\033[K"), 5u) << "three draws, one clear, one final erase";
    EXPECT_EQ(text.substr(text.size() - 4), "\r\033[K") << "erased when finished";
}

TEST(Progress, TheJitAnnouncesABatchOfCompilesOnceAndNotWhenCached) {
    testing::TempDir cache("weft_progress_cache");
    jit::Compiler compiler(testing::isolated_compiler_config(cache.path()));
    std::vector<jit::KernelSpec> specs = {jit::jit_selftest_saxpy_spec(3, 1), jit::jit_selftest_saxpy_spec(5, 1)};
    for (auto& s : specs) s.arch = "sm_90a";

    testing::LogCapture capture("notice");  // progress shows, the JIT's info lines do not
    const auto jit_notices = [&] {
        return capture.texts(
            [](const testing::Captured& c) { return c.level == LogLevel::kNotice && c.subsystem == "jit"; });
    };
    ASSERT_TRUE(compiler.compile(specs[0]).origin == jit::CompileResult::Origin::kCompiled);
    std::vector<std::string> lines = jit_notices();
    ASSERT_EQ(lines.size(), 1u) << "a single compile says so";
    EXPECT_NE(lines[0].find("compiling jit_selftest::saxpy"), std::string::npos) << lines[0];
    capture.lines.clear();

    EXPECT_EQ(compiler.warm(specs, "saxpy pair"), 1u);
    lines = jit_notices();
    ASSERT_EQ(lines.size(), 3u);
    EXPECT_NE(lines[0].find("compiling 1 of 2 kernels for saxpy pair (first use; cached afterwards)"),
              std::string::npos)
        << lines[0];
    EXPECT_NE(lines[1].find("[1/1] jit_selftest::saxpy {.items_per_thread = 5"), std::string::npos) << lines[1];
    EXPECT_NE(lines[2].find("1 kernels for saxpy pair ready in"), std::string::npos) << lines[2];
    capture.lines.clear();
    EXPECT_EQ(compiler.warm(specs, "saxpy pair"), 0u);
    EXPECT_TRUE(compiler.is_cached(specs[1]));
    EXPECT_TRUE(jit_notices().empty()) << "nothing to wait for, nothing said";
}

// Ranks warming one list start at their own place in it (rank r at kernel r modulo the list), so that they compile
// different kernels at once instead of queueing on the first one's lock.
TEST(Progress, RanksWarmingOneListStartAtDifferentKernels) {
    testing::TempDir cache("weft_progress_rotate");
    jit::Compiler compiler(testing::isolated_compiler_config(cache.path()));
    std::vector<jit::KernelSpec> specs = {jit::jit_selftest_saxpy_spec(3, 1), jit::jit_selftest_saxpy_spec(5, 1)};
    for (auto& s : specs) s.arch = "sm_90a";
    std::vector<std::string> lines;
    {
        testing::LogCapture capture("notice,jit=info");  // a rank other than 0 says its progress at info
        const int saved_rank = log_rank();
        set_log_rank(3);  // 3 % 2: the second kernel first
        EXPECT_EQ(compiler.warm(specs, "saxpy pair"), 2u);
        set_log_rank(saved_rank);
        lines = capture.texts([](const testing::Captured& c) {
            return c.subsystem == "jit" && c.line.find("/2] jit_selftest::saxpy") != std::string::npos;
        });
    }
    ASSERT_EQ(lines.size(), 2u);
    EXPECT_NE(lines[0].find("[1/2] jit_selftest::saxpy {.items_per_thread = 5"), std::string::npos) << lines[0];
    EXPECT_NE(lines[1].find("[2/2] jit_selftest::saxpy {.items_per_thread = 3"), std::string::npos) << lines[1];
}

}  // namespace
}  // namespace weft
