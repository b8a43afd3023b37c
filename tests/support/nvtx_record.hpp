// SPDX-License-Identifier: MIT
// Checking weft's NVTX ranges without a profiler: run a test in a child process with the NVTX recorder
// (tests/tools/nvtx_recorder) injected, then read what it recorded.
#pragma once

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

namespace weft::testing {

/// One line of a record: `thread` numbers the child's threads in the order of their first NVTX event.
struct NvtxEvent {
    int thread = 0;
    std::string kind;     ///< "push", "pop" or "mark"
    std::string domain;   ///< "(default)" for the calls without a domain
    std::string message;  ///< empty for "pop"
};

/// The events of a record file, in the order they happened; throws std::runtime_error on a line that is not one.
std::vector<NvtxEvent> read_nvtx_record(const std::filesystem::path& path);

/// A range or mark of one domain, with the ranges of that domain open around it on its thread.
struct NvtxSeen {
    int thread = 0;
    std::string kind;  ///< "push" or "mark"
    std::string path;  ///< the enclosing ranges' messages and its own, joined by " > ": "ag_gemm > setup"
};

/// The ranges and marks of `domain` in `events`. `problem` is empty when on every thread each pop of the domain
/// closes a range the thread opened and no range is left open; otherwise it names the first thread that does not.
struct NvtxRanges {
    std::vector<NvtxSeen> seen;
    std::string problem;
    bool has(int thread, const std::string& kind, const std::string& path) const;
    int count(int thread, const std::string& kind, const std::string& path) const;
};
NvtxRanges nvtx_ranges(const std::vector<NvtxEvent>& events, const std::string& domain);

/// Where the build put the recorder library.
const char* nvtx_recorder_path();

struct ChildRun {
    bool exited_ok = false;  ///< exited with status 0 within the limit
    std::string output;      ///< stdout and stderr, with how it ended
};

/// Runs this test binary again with --gtest_filter=`test_name`, NVTX_INJECTION64_PATH naming the recorder,
/// WEFT_NVTX_RECORD=`record` and `child_flag`=1 in its environment (the child test skips itself without the
/// flag); kills it after `limit`.
ChildRun run_self_under_nvtx_recorder(const std::string& test_name, const std::filesystem::path& record,
                                      const std::string& child_flag, std::chrono::milliseconds limit);

}  // namespace weft::testing
