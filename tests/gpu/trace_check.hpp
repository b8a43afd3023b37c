// SPDX-License-Identifier: MIT
// The GPU trace tests' check: a Python script (the json module) reads a written trace and prints "ok ..." or the
// first violations.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "support/jit_testing.hpp"

namespace weft::test {

/// Writes `script` into `dir`, runs `python3 script args`, and fails the test unless the script printed a line
/// starting with "ok " (printed either way, after "[ TRACE    ] label: ").
inline void expect_trace_check_ok(const std::filesystem::path& dir, const char* script, const std::string& args,
                                  const std::string& label) {
    testing::write_text_file(dir / "check.py", script);
    const std::filesystem::path result = dir / ("result_" + label + ".txt");
    const std::string cmd = "python3 " + (dir / "check.py").string() + " " + args + " > " + result.string();
    ASSERT_EQ(std::system(cmd.c_str()), 0) << "python could not read the trace (" << args << ")";
    const std::string text = testing::read_text_file(result);
    EXPECT_EQ(text.rfind("ok ", 0), 0u) << label << ":\n" << text;
    std::printf("[ TRACE    ] %s: %s", label.c_str(), text.c_str());
}

}  // namespace weft::test
