// SPDX-License-Identifier: MIT
// weft's NVTX ranges reach a tool, without a GPU or a profiler: a child process runs WEFT_NVTX_RANGE, nvtx_mark,
// an autotuning session and a JIT compile with the NVTX recorder injected; the record must hold each of them in the
// "weft" domain, nested as called, every push closed by a pop on its own thread.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

#include "support/jit_testing.hpp"
#include "support/nvtx_record.hpp"
#include "weft/jit/aot.hpp"
#include "weft/jit/autotune.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/runtime/nvtx.hpp"

namespace weft {
namespace {

constexpr const char* kChildFlag = "WEFT_TEST_NVTX_CHILD";

jit::KernelSpec saxpy() {
    jit::KernelSpec spec = jit::jit_selftest_saxpy_spec(1, 1);
    spec.arch = "sm_90a";
    return spec;
}

// Runs only in the child NvtxRanges.ReachAToolInTheWeftDomain starts (with the recorder injected).
TEST(NvtxRangesChild, OpenWeftRanges) {
    if (std::getenv(kChildFlag) == nullptr) {
        GTEST_SKIP() << "runs only as the child of NvtxRanges.ReachAToolInTheWeftDomain";
    }
    {
        WEFT_NVTX_RANGE("outer");
        WEFT_NVTX_RANGE("inner");
        nvtx_mark("decision");
    }
    std::thread([] { WEFT_NVTX_RANGE("on another thread"); }).join();

    // An autotuning session on the CPU (fake timings; each measurement a range of its own).
    jit::Autotuner tuner(
        jit::AutotuneConfig{},
        [](const jit::TuneCandidate& c, const jit::TuneOptions&) {
            WEFT_NVTX_RANGE(("measure " + c.name).c_str());
            return c.name == "b" ? 1.0 : 2.0;
        },
        [](cudaStream_t) {});
    const jit::TuneResult tuned =
        tuner.tune(jit::TuneKey{"gemm", "m=1", 0, "sm_90a"}, {{"a", [](cudaStream_t) {}}, {"b", [](cudaStream_t) {}}});
    EXPECT_EQ(tuned.name, "b");

    // A JIT compile (NVRTC, no GPU) into a fresh cache: a miss, so it compiles.
    testing::TempDir cache("weft_nvtx_jit");
    jit::Compiler compiler(testing::isolated_compiler_config(cache.path()));
    EXPECT_EQ(compiler.compile(saxpy()).origin, jit::CompileResult::Origin::kCompiled);
}

TEST(NvtxRanges, ReachAToolInTheWeftDomain) {
    testing::TempDir dir("weft_nvtx");
    const auto record = dir / "record.txt";
    const testing::ChildRun child = testing::run_self_under_nvtx_recorder(
        "NvtxRangesChild.OpenWeftRanges", record, kChildFlag, std::chrono::milliseconds(240000));
    ASSERT_TRUE(child.exited_ok) << child.output;
    ASSERT_TRUE(std::filesystem::exists(record))
        << "no record: no weft NVTX call reached NVTX, or NVTX did not load " << testing::nvtx_recorder_path() << "\n"
        << child.output;
    const auto events = testing::read_nvtx_record(record);
    for (const testing::NvtxEvent& e : events) {
        EXPECT_EQ(e.domain, "weft") << e.thread << " " << e.kind << " " << e.message;
    }
    const testing::NvtxRanges r = testing::nvtx_ranges(events, "weft");
    std::string seen;
    for (const testing::NvtxSeen& s : r.seen) seen += std::to_string(s.thread) + " " + s.kind + " " + s.path + "\n";
    SCOPED_TRACE("recorded in the weft domain:\n" + seen);
    EXPECT_EQ(r.problem, "");
    ASSERT_FALSE(r.seen.empty()) << child.output;

    // The child's first event is the test's own: its thread is 0; the helper thread came next.
    EXPECT_TRUE(r.has(0, "push", "outer"));
    EXPECT_TRUE(r.has(0, "push", "outer > inner"));
    EXPECT_TRUE(r.has(0, "mark", "outer > inner > decision"));
    EXPECT_TRUE(r.has(1, "push", "on another thread"));
    EXPECT_EQ(r.count(0, "push", "autotune gemm"), 1);
    EXPECT_EQ(r.count(0, "push", "autotune gemm > measure a"), 1);
    EXPECT_EQ(r.count(0, "push", "autotune gemm > measure b"), 1);
    EXPECT_EQ(r.count(0, "push", "jit compile " + saxpy().describe()), 1);
}

// The check itself: unbalanced or foreign events are seen.
TEST(NvtxRanges, TheCheckFindsUnclosedAndUnopenedRanges) {
    using testing::NvtxEvent;
    const std::vector<NvtxEvent> balanced = {{0, "push", "weft", "a"},  {1, "push", "weft", "b"},
                                             {0, "push", "other", "x"}, {0, "pop", "weft", ""},
                                             {1, "pop", "weft", ""},    {0, "pop", "other", ""}};
    const testing::NvtxRanges ok = testing::nvtx_ranges(balanced, "weft");
    EXPECT_EQ(ok.problem, "");
    EXPECT_EQ(ok.seen.size(), 2u);
    EXPECT_TRUE(ok.has(1, "push", "b"));

    const testing::NvtxRanges unclosed =
        testing::nvtx_ranges({{0, "push", "weft", "a"}, {0, "push", "weft", "b"}, {0, "pop", "weft", ""}}, "weft");
    EXPECT_EQ(unclosed.problem, "thread 0 leaves weft range 'a' open");
    // A pop on another thread than the push closes nothing.
    const testing::NvtxRanges crossed =
        testing::nvtx_ranges({{0, "push", "weft", "a"}, {1, "pop", "weft", ""}}, "weft");
    EXPECT_EQ(crossed.problem, "thread 1 pops a weft range it never pushed");

    testing::TempDir dir("weft_nvtx_parse");
    testing::write_text_file(dir / "good.txt", "0 push weft jit compile saxpy<4>\n0 mark weft \n0 pop weft\n");
    const auto events = testing::read_nvtx_record(dir / "good.txt");
    ASSERT_EQ(events.size(), 3u);
    EXPECT_EQ(events[0].message, "jit compile saxpy<4>");
    EXPECT_EQ(events[1].message, "");
    EXPECT_EQ(events[2].kind, "pop");
    testing::write_text_file(dir / "bad.txt", "0 pop weft extra\n");
    EXPECT_THROW(testing::read_nvtx_record(dir / "bad.txt"), std::runtime_error);
    testing::write_text_file(dir / "bad2.txt", "0 begin weft x\n");
    EXPECT_THROW(testing::read_nvtx_record(dir / "bad2.txt"), std::runtime_error);
}

}  // namespace
}  // namespace weft
