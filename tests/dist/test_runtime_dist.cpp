// SPDX-License-Identifier: MIT
// The runtime with one process per rank: World::from_env (while rank 0 holds MASTER_PORT, as torch.distributed
// would), peer heaps through file descriptors, collective allocation checks, teams and stream writes across
// processes.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dist/dist_world.hpp"
#include "support/runtime_checks.hpp"
#include "weft/runtime/launch_env.hpp"
#include "weft/weft.hpp"

extern char** environ;

namespace weft {

namespace test {
namespace {
std::unique_ptr<World> g_world;
}  // namespace
World& dist_world() { return *g_world; }
}  // namespace test

namespace {

World& world() { return test::dist_world(); }

TEST(DistRuntime, WorldFromTheLauncherEnvironment) {
    auto launch = detect_launch_env();
    ASSERT_TRUE(launch.has_value());
    World& w = world();
    EXPECT_EQ(w.rank(), launch->rank);
    EXPECT_EQ(w.num_ranks(), launch->num_ranks);
    EXPECT_EQ(w.local_rank(), launch->local_rank);
    EXPECT_EQ(w.node_team().num_ranks(), w.num_ranks()) << "weftrun starts every rank on this host";
    int devices = 0;
    ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
    EXPECT_EQ(w.device(), w.local_rank() % devices);
    int sharing = 0;
    for (int r = 0; r < w.num_ranks(); ++r) sharing += (r % devices == w.device()) ? 1 : 0;
    EXPECT_EQ(w.num_ranks_on_device(), sharing);
    const auto& bases = w.heap().peer_bases();
    for (int r = 0; r < w.num_ranks(); ++r) {
        EXPECT_NE(bases[static_cast<size_t>(r)], nullptr) << "rank " << r << "'s heap is not mapped here";
    }
    DeviceCtx ctx = w.device_ctx();
    std::vector<uint8_t*> table(static_cast<size_t>(w.num_ranks()));
    ASSERT_EQ(cudaMemcpy(table.data(), ctx.peer_bases, table.size() * sizeof(uint8_t*), cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(table, bases);
    EXPECT_EQ(ctx.heap_base, w.heap().base());
}

TEST(DistRuntime, BarrierWaitsForEveryRank) {
    World& w = world();
    // Ranks arrive staggered; none may leave before the last one arrived.
    std::this_thread::sleep_for(std::chrono::milliseconds(40 * w.rank()));
    w.store().add("dist/arrived", 1);
    w.barrier();
    std::string value;
    const Bytes raw = w.store().get("dist/arrived", w.timeout());
    value.assign(raw.begin(), raw.end());
    EXPECT_GE(std::stoll(value), w.num_ranks());
    w.barrier();
}

TEST(DistRuntime, PatternExchangeThroughSymmAt) {
    EXPECT_NO_THROW(test::check_exchange_through_symm_at(world(), 1000 + 37));
    EXPECT_NO_THROW(test::check_exchange_through_symm_at(world(), (1 << 18) + 3));
}

TEST(DistRuntime, RepeatedAllocFreeGivesIdenticalOffsets) {
    EXPECT_NO_THROW(test::check_alloc_free_cycles(world(), 300));
}

TEST(DistRuntime, MismatchedAllocationIsAnErrorOnEveryRank) {
    if (world().num_ranks() < 2) GTEST_SKIP() << "needs 2 ranks";
    try {
        test::check_mismatch_errors(world());
    } catch (const std::exception& e) {
        FAIL() << e.what();
    }
}

TEST(DistRuntime, AllocSignalsAreZeroed) {
    try {
        test::check_alloc_signals_zeroed(world());
    } catch (const std::exception& e) {
        FAIL() << e.what();
    }
}

TEST(DistRuntime, StreamWritesReachPeers) {
    try {
        test::check_stream_writes_to_peers(world());
    } catch (const std::exception& e) {
        FAIL() << e.what();
    }
}

TEST(DistRuntime, TeamsAcrossProcesses) {
    World& w = world();
    Team parity = w.team().split_color(w.rank() % 2, w.rank());
    std::vector<int> expected;
    for (int r = w.rank() % 2; r < w.num_ranks(); r += 2) expected.push_back(r);
    EXPECT_EQ(parity.members(), expected);
    EXPECT_EQ(parity.world_rank(parity.rank()), w.rank());
    DeviceCtx ctx = parity.device_ctx();
    std::vector<int32_t> ranks(expected.size());
    ASSERT_EQ(cudaMemcpy(ranks.data(), ctx.team_to_world, ranks.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(std::vector<int>(ranks.begin(), ranks.end()), expected);
    w.barrier();
}

// Run without a launcher: start weftrun with this binary for 2, 3 and 4 ranks.
std::string find_weftrun(const char* self) {
    if (auto env = env::get("WEFT_WEFTRUN")) return *env;
    char exe[PATH_MAX] = {};
    const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    std::string dir = n > 0 ? std::string(exe, static_cast<size_t>(n)) : std::string(self);
    dir = dir.substr(0, dir.find_last_of('/') + 1);
    for (const std::string& candidate : {dir + WEFT_WEFTRUN_RELATIVE, std::string(WEFT_WEFTRUN_PATH)}) {
        if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    }
    return "";
}

int drive(int argc, char** argv) {
    const std::string weftrun = find_weftrun(argv[0]);
    if (weftrun.empty()) {
        std::fprintf(stderr, "weft_dist_tests: weftrun not found (set WEFT_WEFTRUN to its path)\n");
        return 2;
    }
    int failures = 0;
    for (int n : {2, 3, 4}) {
        std::vector<std::string> args{weftrun, "-n", std::to_string(n), "--timeout", "300", "--", argv[0]};
        for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
        std::vector<char*> c_args;
        for (auto& a : args) c_args.push_back(a.data());
        c_args.push_back(nullptr);
        std::printf("weft_dist_tests: %d ranks through %s\n", n, weftrun.c_str());
        std::fflush(stdout);
        pid_t pid = 0;
        int status = 0;
        if (::posix_spawn(&pid, weftrun.c_str(), nullptr, nullptr, c_args.data(), environ) != 0 ||
            ::waitpid(pid, &status, 0) != pid) {
            std::fprintf(stderr, "weft_dist_tests: could not run %s\n", weftrun.c_str());
            return 2;
        }
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        std::printf("weft_dist_tests: %d ranks: %s\n", n, ok ? "PASSED" : "FAILED");
        failures += ok ? 0 : 1;
    }
    std::printf("weft_dist_tests: %s\n", failures == 0 ? "all world sizes passed" : "FAILED TEST");
    return failures == 0 ? 0 : 1;
}

/// Rank 0 listens on MASTER_PORT for the process's life, as torch.distributed's rank 0 does when the same
/// program also starts a process group (under torchrun its agent holds the port already, and this bind fails,
/// which is just as well): World::from_env must not need that port. Returns the socket, or -1.
int hold_master_port(const std::optional<LaunchEnv>& launch) {
    if (!launch || launch->rank != 0 || launch->master_port == 0) return -1;
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(launch->master_port));
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 4) != 0) {
        if (fd >= 0) ::close(fd);
        std::printf("weft_dist_tests: MASTER_PORT %d is held by another process (the launcher's store)\n",
                    launch->master_port);
        return -1;
    }
    std::printf("weft_dist_tests: rank 0 holds MASTER_PORT %d, as torch.distributed would\n", launch->master_port);
    return fd;
}

}  // namespace
}  // namespace weft

int main(int argc, char** argv) {
    weft::ensure_eager_module_loading();
    if (weft::test::is_dist_child(argc, argv)) return weft::test::run_dist_child(argc, argv);
    if (std::any_of(argv + 1, argv + argc, [](const char* a) { return std::strcmp(a, "--gtest_list_tests") == 0; })) {
        ::testing::InitGoogleTest(&argc, argv);  // listing runs no test: no ranks, no World
        return RUN_ALL_TESTS();
    }
    const std::optional<weft::LaunchEnv> launch = weft::detect_launch_env();
    if (!launch) return weft::drive(argc, argv);
    ::testing::InitGoogleTest(&argc, argv);
    const int master_port_fd = weft::hold_master_port(launch);
    try {
        weft::WorldOptions options = weft::test::test_options();
        // WEFT_TIMEOUT_MS, where set, bounds this World's waits (the fault tests' jobs set it short).
        if (weft::env::get("WEFT_TIMEOUT_MS")) options.timeout = std::chrono::milliseconds(0);
        weft::test::g_world = weft::World::from_env(options);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "weft_dist_tests: World::from_env failed: %s\n", e.what());
        return 1;
    }
    const int rc = RUN_ALL_TESTS();
    weft::test::g_world.reset();  // collective shutdown
    if (master_port_fd >= 0) ::close(master_port_fd);
    return rc;
}
