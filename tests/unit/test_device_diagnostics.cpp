// SPDX-License-Identifier: MIT
// Unit tests for how the host words the device layer's records: unreachable peers (SpinKind::kUnreachablePeer), and
// waits that timed out or stopped because the World was aborted.
#include <gtest/gtest.h>

#include <string>

#include "weft/common/diagnostics.hpp"
#include "weft/runtime/diagnostics.hpp"

namespace weft {
namespace {

Diagnostic unreachable_record() {
    Diagnostic d{};
    d.claimed = 2;
    d.kind = SpinKind::kUnreachablePeer;
    d.cmp = Cmp::kEq;
    d.rank = 0;
    d.block_x = 2;
    d.thread_x = 5;
    d.signal_addr = 0x7f0012345600ull;
    d.expected = 3;      // the rank asked for
    d.observed = 0x400;  // heap offset
    d.peer = 3;
    d.line = 42;
    return d;
}

TEST(DeviceDiagnostics, UnreachablePeerNamesRankAndAddress) {
    EXPECT_EQ(format_diagnostic(unreachable_record()),
              "rank 0 block (2,0,0) thread 5: a put/get/signal to rank 3 on symmetric address 0x7f0012345600 "
              "failed: rank 3 is not load/store reachable from here (heap offset 1024; only the load/store "
              "transport exists) (source line 42)");
    EXPECT_STREQ(spin_kind_name(SpinKind::kUnreachablePeer), "unreachable_peer");
}

TEST(DeviceDiagnostics, UnreachablePeerOfATeamNamesTheWorldAndTeamRank) {
    Diagnostic d = unreachable_record();
    d.peer = 6;  // team rank 3 is world rank 6
    EXPECT_EQ(format_diagnostic(d),
              "rank 0 block (2,0,0) thread 5: a put/get/signal to rank 6 (team rank 3) on symmetric address "
              "0x7f0012345600 failed: rank 6 (team rank 3) is not load/store reachable from here (heap offset 1024; "
              "only the load/store transport exists) (source line 42)");
}

TEST(DeviceDiagnostics, UnreachablePeerOtherCauses) {
    Diagnostic d = unreachable_record();
    d.observed = ~0ull;
    EXPECT_NE(format_diagnostic(d).find("not inside this rank's symmetric heap"), std::string::npos);
    d.observed = 0x400;
    d.peer = -1;
    d.expected = static_cast<uint64_t>(int64_t{-1});
    const std::string text = format_diagnostic(d);
    EXPECT_NE(text.find("rank -1"), std::string::npos) << text;
    EXPECT_NE(text.find("no such rank"), std::string::npos) << text;
}

TEST(DeviceDiagnostics, APutPastTheHeapsEndNamesItsSizeAndOffset) {
    Diagnostic d = unreachable_record();
    d.cmp = Cmp::kLe;    // symm_range_at_or_trap
    d.waited_ns = 4096;  // the put's bytes
    EXPECT_EQ(format_diagnostic(d),
              "rank 0 block (2,0,0) thread 5: a put/get/signal to rank 3 on symmetric address 0x7f0012345600 "
              "failed: its 4096 bytes from heap offset 1024 run past the end of this rank's symmetric heap (a size "
              "larger than the buffer) (source line 42)");
}

TEST(DeviceDiagnostics, AWaitThatTheAbortStoppedSaysSoInsteadOfTimedOut) {
    Diagnostic d{};
    d.claimed = 2;
    d.kind = SpinKind::kSignalWait;
    d.cmp = Cmp::kGe;
    d.rank = 1;
    d.signal_addr = 0x7f00aa000008ull;
    d.expected = 1;
    d.observed = 0;
    d.waited_ns = 2'400'000'000ull;
    d.peer = 2;
    EXPECT_EQ(format_diagnostic(d), "rank 1 block (0,0,0) thread 0 timed out after 2400 ms in signal_wait (GE) on "
                                    "signal 0x7f00aa000008 owned by rank 2: expected >= 1, observed 0");
    d.aborted = 1;
    EXPECT_EQ(format_diagnostic(d), "rank 1 block (0,0,0) thread 0 stopped (the World was aborted) after 2400 ms in "
                                    "signal_wait (GE) on signal 0x7f00aa000008 owned by rank 2: expected >= 1, "
                                    "observed 0");
}

// The device layer's argument refusals (SpinKind::kBadArgument; waited_ns says which) name what was expected.
TEST(DeviceDiagnostics, ABadDeviceArgumentSaysWhatWasExpected) {
    Diagnostic d{};
    d.claimed = 2;
    d.kind = SpinKind::kBadArgument;
    d.rank = 1;
    d.block_x = 3;
    d.thread_x = 40;
    d.peer = -1;
    d.line = 12;
    d.expected = 32;
    d.observed = 48;
    d.waited_ns = kBadGroupSize;
    EXPECT_EQ(format_diagnostic(d),
              "rank 1 block (3,0,0) thread 40: a device call refused its arguments: a Warp "
              "group needs a block of whole warps (a thread count that is a multiple of 32), "
              "this block has 48 threads (the missing lanes' share of a copy would not be "
              "done) (source line 12)");
    d.expected = 128;
    d.observed = 192;
    EXPECT_NE(format_diagnostic(d).find("a Warpgroup group needs a block of whole warpgroups (a thread count that is "
                                        "a multiple of 128), this block has 192 threads"),
              std::string::npos);
    d.waited_ns = kBadBarrierId;
    d.observed = 0;
    EXPECT_NE(format_diagnostic(d).find("Warpgroup{0}: the named barrier id must be 1..15"), std::string::npos);
    d.waited_ns = kBadWaitCount;
    d.observed = static_cast<uint64_t>(int64_t{-3});
    EXPECT_NE(format_diagnostic(d).find("tile::wait of -3 signals: the count must be >= 0"), std::string::npos);
    EXPECT_STREQ(spin_kind_name(SpinKind::kBadArgument), "bad_argument");
}

}  // namespace
}  // namespace weft
