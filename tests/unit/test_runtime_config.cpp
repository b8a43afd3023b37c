// SPDX-License-Identifier: MIT
// Unit tests for the runtime's settings (heap size, timeout, SM budget) and diagnostic messages.
#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "support/error_text.hpp"
#include "weft/common/diagnostics.hpp"
#include "weft/detail/runtime_config.hpp"
#include "weft/runtime/diagnostics.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/module_loading.hpp"

namespace weft::detail {
namespace {

using namespace std::chrono_literals;
constexpr uint64_t kTwoMiB = 2ull << 20;

using testing::error_of;

TEST(RuntimeConfig, HeapBytesPrecedenceAndRounding) {
    EXPECT_EQ(resolve_heap_bytes(0, std::nullopt, kTwoMiB), 1ull << 30);                    // default
    EXPECT_EQ(resolve_heap_bytes(0, std::string("512M"), kTwoMiB), 512ull << 20);           // environment
    EXPECT_EQ(resolve_heap_bytes(64ull << 20, std::string("512M"), kTwoMiB), 64ull << 20);  // option wins
    EXPECT_EQ(resolve_heap_bytes(1, std::nullopt, kTwoMiB), kTwoMiB);                       // rounded up
    EXPECT_EQ(resolve_heap_bytes(0, std::string("3000001"), kTwoMiB), 2 * kTwoMiB);
    EXPECT_EQ(resolve_heap_bytes(0, std::string("4194304"), kTwoMiB), 4194304u);  // already a multiple
    EXPECT_EQ(resolve_heap_bytes(0, std::string("1000"), 3), 1002u);              // any granularity
}

TEST(RuntimeConfig, HeapBytesErrorsNameTheVariable) {
    for (const char* bad : {"", "lots", "-1", "1.5G", "0"}) {
        std::string e = error_of([&] { resolve_heap_bytes(0, std::string(bad), kTwoMiB); });
        EXPECT_NE(e.find("WEFT_SYMMETRIC_HEAP_BYTES"), std::string::npos) << "'" << bad << "': " << e;
    }
    EXPECT_NE(error_of([] { resolve_heap_bytes(0, std::string("16383P"), kTwoMiB); }), "");
    EXPECT_NE(error_of([] { resolve_heap_bytes(UINT64_MAX, std::nullopt, kTwoMiB); }), "");  // rounding overflow
}

TEST(RuntimeConfig, Timeout) {
    EXPECT_EQ(resolve_timeout(0ms, std::nullopt), 600000ms);
    EXPECT_EQ(resolve_timeout(0ms, std::string("2500")), 2500ms);
    EXPECT_EQ(resolve_timeout(300ms, std::string("2500")), 300ms);
    // "Forever" as a huge count is refused (deadlines are steady-clock nanoseconds); 30 days is the most.
    for (const char* bad : {"0", "-5", "ten", "1s", "9999999999999"}) {
        EXPECT_NE(error_of([&] { resolve_timeout(0ms, std::string(bad)); }).find("WEFT_TIMEOUT_MS"), std::string::npos)
            << bad;
    }
    EXPECT_EQ(resolve_timeout(0ms, std::string("2592000000")), 2592000000ms);
    EXPECT_NE(error_of([] { resolve_timeout(0ms, std::string("2592000001")); }).find("at most 30 days"),
              std::string::npos);
    EXPECT_NE(error_of([] { resolve_timeout(-1ms, std::nullopt); }), "");
    EXPECT_NE(error_of([] { resolve_timeout(std::chrono::milliseconds(INT64_MAX), std::nullopt); }).find("30 days"),
              std::string::npos);
}

TEST(RuntimeConfig, SmBudget) {
    EXPECT_EQ(resolve_sm_budget(0, std::nullopt, 132, 1), 132);
    EXPECT_EQ(resolve_sm_budget(0, std::nullopt, 132, 3), 44);
    EXPECT_EQ(resolve_sm_budget(0, std::nullopt, 132, 8), 16);
    EXPECT_EQ(resolve_sm_budget(0, std::nullopt, 4, 8), 1);  // never zero
    EXPECT_EQ(resolve_sm_budget(0, std::string("20"), 132, 8), 20);
    EXPECT_EQ(resolve_sm_budget(7, std::string("20"), 132, 8), 7);
    EXPECT_NE(error_of([] { resolve_sm_budget(0, std::string("0"), 132, 1); }).find("WEFT_SM_BUDGET"),
              std::string::npos);
    EXPECT_NE(error_of([] { resolve_sm_budget(0, std::string("133"), 132, 1); }).find("[1, 132]"), std::string::npos);
    EXPECT_NE(error_of([] { resolve_sm_budget(200, std::nullopt, 132, 1); }).find("sm_budget"), std::string::npos);
}

TEST(RuntimeConfig, FormatBytes) {
    EXPECT_EQ(format_bytes(0), "0 bytes");
    EXPECT_EQ(format_bytes(1023), "1023 bytes");
    EXPECT_EQ(format_bytes(4096), "4 KiB");
    EXPECT_EQ(format_bytes(1ull << 30), "1 GiB");
    EXPECT_EQ(format_bytes(3ull << 40), "3 TiB");
    EXPECT_EQ(format_bytes(1536ull << 20), "1.50 GiB (1610612736 bytes)");
}

Diagnostic sample_record() {
    Diagnostic d{};
    d.claimed = 2;
    d.kind = SpinKind::kSignalWait;
    d.cmp = Cmp::kGe;
    d.rank = 1;
    d.block_x = 3;
    d.block_y = 0;
    d.block_z = 0;
    d.thread_x = 0;
    d.signal_addr = 0x7f00deadbee0ull;
    d.expected = 5;
    d.observed = 4;
    d.waited_ns = 10000000000ull + 123456;  // 10 s and a bit
    d.peer = 2;
    d.line = 0;
    return d;
}

TEST(RuntimeDiagnostics, FormatsTheRecord) {
    EXPECT_EQ(format_diagnostic(sample_record()),
              "rank 1 block (3,0,0) thread 0 timed out after 10000 ms in signal_wait (GE) on signal 0x7f00deadbee0 "
              "owned by rank 2: expected >= 5, observed 4");
}

TEST(RuntimeDiagnostics, OptionalPartsAndOtherKinds) {
    Diagnostic d = sample_record();
    d.kind = SpinKind::kBarrier;
    d.cmp = Cmp::kEq;
    d.peer = -1;
    d.line = 321;
    d.block_x = 7;
    d.block_y = 1;
    d.block_z = 2;
    d.thread_x = 96;
    d.waited_ns = 1499999;
    EXPECT_EQ(format_diagnostic(d),
              "rank 1 block (7,1,2) thread 96 timed out after 1 ms in barrier (EQ) on signal 0x7f00deadbee0: "
              "expected == 5, observed 4 (source line 321)");
    for (Cmp c : {Cmp::kNe, Cmp::kGt, Cmp::kLt, Cmp::kLe}) {
        d.cmp = c;
        const std::string text = format_diagnostic(d);
        EXPECT_NE(text.find(std::string("(") + cmp_name(c) + ")"), std::string::npos) << text;
        EXPECT_NE(text.find(std::string("expected ") + cmp_symbol(c) + " 5"), std::string::npos) << text;
    }
    d.claimed = 1;
    EXPECT_NE(format_diagnostic(d).find("incomplete"), std::string::npos);
}

TEST(RuntimeModuleLoading, EagerUnlessTheUserChose) {
    // This test binary makes no CUDA call before this point, and nothing else reads the variable.
    const char* before = std::getenv("CUDA_MODULE_LOADING");
    const bool set_by_weft = ensure_eager_module_loading();
    const char* after = std::getenv("CUDA_MODULE_LOADING");
    ASSERT_NE(after, nullptr);
    if (before == nullptr) {
        EXPECT_TRUE(set_by_weft);
        EXPECT_STREQ(after, "EAGER");
    } else {
        EXPECT_FALSE(set_by_weft);
        EXPECT_STREQ(after, before);
    }
    EXPECT_EQ(ensure_eager_module_loading(), set_by_weft);  // idempotent
}

TEST(RuntimeModuleLoading, ThirtyTwoHardwareQueuesUnlessTheUserChose) {
    const char* before = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    const bool set_by_weft = ensure_device_connections();
    const char* after = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    ASSERT_NE(after, nullptr);
    if (before == nullptr) {
        EXPECT_TRUE(set_by_weft);
        EXPECT_STREQ(after, "32");
    } else {
        EXPECT_FALSE(set_by_weft);
        EXPECT_STREQ(after, before);
    }
    EXPECT_EQ(ensure_device_connections(), set_by_weft);  // idempotent
}

TEST(RuntimeSharedGpu, ProcessesOnOneOfSeveralVisibleGpusAreWarnedAbout) {
    // Nine processes on an eight-GPU host: local rank 8 wrapped onto device 0, whose first rank says so, naming the
    // fix.
    const std::string w = shared_gpu_warning(false, false, true, 0, 0, 1, 8);
    EXPECT_NE(w.find("local rank 0 shares CUDA device 0 with 1 rank(s) of other processes"), std::string::npos) << w;
    EXPECT_NE(w.find("sees 8 GPUs"), std::string::npos) << w;
    EXPECT_NE(w.find("LOCAL_RANK"), std::string::npos) << w;
    // Once per GPU: the other ranks on it stay quiet.
    EXPECT_EQ(shared_gpu_warning(false, false, false, 8, 0, 1, 8), "");
    // By design: threads of one process, a device the program chose, processes on a machine with one GPU (weftrun -n 4
    // there, or a task per GPU with one visible), a GPU of its own.
    EXPECT_EQ(shared_gpu_warning(true, false, true, 1, 0, 3, 8), "");
    EXPECT_EQ(shared_gpu_warning(false, true, true, 1, 0, 3, 8), "");
    EXPECT_EQ(shared_gpu_warning(false, false, true, 3, 0, 3, 1), "");
    EXPECT_EQ(shared_gpu_warning(false, false, true, 3, 3, 0, 8), "");
}

TEST(RuntimeArchitecture, HopperPassesEverythingElseGetsASentence) {
    EXPECT_EQ(unsupported_device_message(0, 0, "NVIDIA H200", 9, 0), "");
    EXPECT_EQ(unsupported_device_message(3, 1, "NVIDIA H100 80GB HBM3", 9, 0), "");

    const std::string a100 = unsupported_device_message(1, 0, "NVIDIA A100-SXM4-80GB", 8, 0);
    EXPECT_EQ(a100.rfind("weft needs an NVIDIA Hopper GPU (compute capability 9.0, sm_90a", 0), 0u) << a100;
    EXPECT_NE(a100.find("rank 1 found NVIDIA A100-SXM4-80GB (compute capability 8.0) as CUDA device 0"),
              std::string::npos)
        << a100;
    EXPECT_NE(a100.find("older GPU"), std::string::npos) << a100;
    EXPECT_EQ(a100.find("NVRTC"), std::string::npos) << a100;  // plain words, no compiler log

    // Later architectures do not run sm_90a code either; the message says so rather than "older".
    const std::string b200 = unsupported_device_message(6, 2, "NVIDIA B200", 10, 0);
    EXPECT_NE(b200.find("rank 6 found NVIDIA B200 (compute capability 10.0) as CUDA device 2"), std::string::npos)
        << b200;
    EXPECT_NE(b200.find("later GPUs"), std::string::npos) << b200;
    EXPECT_EQ(b200.find("older"), std::string::npos) << b200;

    // Every capability but 9.0 is refused, including other minors and a nameless device.
    for (auto [major, minor] : {std::pair{7, 0}, {7, 5}, {8, 6}, {8, 9}, {9, 1}, {12, 0}}) {
        const std::string m = unsupported_device_message(0, 0, "", major, minor);
        EXPECT_NE(m.find("compute capability " + std::to_string(major) + "." + std::to_string(minor) + ")"),
                  std::string::npos)
            << m;
        EXPECT_NE(m.find("a GPU without a name"), std::string::npos) << m;
    }
}

}  // namespace
}  // namespace weft::detail
