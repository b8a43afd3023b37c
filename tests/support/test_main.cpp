// SPDX-License-Identifier: MIT
// GoogleTest entry point shared by weft's test binaries; a crash prints the stack (binary+offset) before dying.
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

namespace {

// Async-signal-safe: write(2) and backtrace_symbols_fd only. Resolve the printed binary(+offset) lines with
// `addr2line -f -C -e <binary> <offset>` on the machine that built the binary.
void on_fatal_signal(int sig) {
    static const char kHeader[] = "\n*** weft tests: fatal signal; stack (binary(+offset)):\n";
    (void)!write(STDERR_FILENO, kHeader, sizeof(kHeader) - 1);
    void* frames[64];
    const int n = backtrace(frames, 64);
    backtrace_symbols_fd(frames, n, STDERR_FILENO);
    signal(sig, SIG_DFL);
    raise(sig);
}

}  // namespace

int main(int argc, char** argv) {
    void* warm[1];
    backtrace(warm, 1);  // loads libgcc's unwinder now, not inside the handler
    signal(SIGSEGV, on_fatal_signal);
    signal(SIGBUS, on_fatal_signal);
    signal(SIGFPE, on_fatal_signal);
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
}
