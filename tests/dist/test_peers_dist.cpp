// SPDX-License-Identifier: MIT
// Late and dead peers with one process per rank. The test process (rank 0 of the weftrun job, in the 2-rank job)
// starts its own child processes of this binary (--weft-dist-child=...), which meet at a store child 0 hosts
// (World::from_store): weftrun is not their parent, so a child that dies takes nothing else down.
//  - A peer killed mid-op (SIGKILL, while every rank's kernel waits for it): each survivor's sync_and_check throws
//    within the bound, naming the dead rank and the signal it waited on, under a ten-minute device timeout; and the
//    survivors' World destructors return.
//  - A peer that leaves on an exception (its World destroyed while it propagates) while the other's kernel waits for
//    it: the waiting rank's error names it within the bound, under a ten-minute device timeout.
//  - A peer 15 s late, with the default timeouts: the collective (a signal its kernel raises, which the other's
//    kernel waits for) succeeds.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dist/dist_world.hpp"
#include "support/runtime_checks.hpp"
#include "weft/jit/compiler.hpp"
#include "weft/runtime/rendezvous.hpp"
#include "weft/weft.hpp"

extern char** environ;

namespace weft {
namespace test {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr const char* kChildFlag = "--weft-dist-child=";
constexpr int kVictim = 2;             // the rank that dies (never child 0, which hosts the store)
constexpr double kDeathBoundS = 30.0;  // a survivor's error, and its World's destruction, come within this
constexpr int kLateS = 15;
constexpr const char* kUnwindError = "rank 1's own bad argument";

constexpr const char* kKernels = R"(
using namespace weft;
using namespace weft::device;
extern "C" __global__ void weft_dist_wait(DeviceCtx ctx, const uint64_t* sig, uint64_t value) {
    shmem::signal_wait_until(Block{}, ctx, sig, Cmp::kGe, value);
}
extern "C" __global__ void weft_dist_notify(DeviceCtx ctx, uint64_t* sig, int pe) {
    if (threadIdx.x == 0) shmem::signal_op(Thread{}, ctx, sig, 1, SignalOp::kAdd, pe);
}
)";

jit::Kernel& kernel(const char* name) {
    jit::KernelSpec spec;
    spec.header = "weft/device.cuh";
    spec.extra_code = kKernels;
    spec.instantiation = name;
    return jit::compiler().get_kernel(spec);
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

std::string hex(const void* p) {
    char text[32];
    std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)));
    return text;
}

// sync_and_check's error on `stream` ("" when it returned), and in *seconds how long it took to come.
std::string sync_error(World& world, cudaStream_t stream, double* seconds) {
    const auto start = Clock::now();
    std::string message;
    try {
        world.sync_and_check(stream);
    } catch (const std::exception& e) {
        message = e.what();
    }
    *seconds = seconds_since(start);
    return message;
}

// One child: "<scenario>:<rank>:<num_ranks>:<socket>". Returns the process's exit code (0: its checks passed).
int child_main(const std::string& spec) {
    char scenario[32] = {};
    char socket_name[128] = {};
    int rank = -1, num_ranks = 0;
    if (std::sscanf(spec.c_str(), "%31[a-z]:%d:%d:%127s", scenario, &rank, &num_ranks, socket_name) != 4) {
        std::fprintf(stderr, "child: malformed spec '%s'\n", spec.c_str());
        return 2;
    }
    const std::string what = scenario;
    std::unique_ptr<TcpStoreServer> server;
    RendezvousOptions o;
    o.unix_socket = socket_name;
    o.rank = rank;
    o.num_ranks = num_ranks;
    o.timeout = milliseconds(120000);
    if (rank == 0) server = std::make_unique<TcpStoreServer>(o);
    std::shared_ptr<Store> store = connect_tcp_store(o);
    const auto fail = [&](const std::string& why) {
        std::fprintf(stderr, "child %s rank %d: FAIL: %s\n", scenario, rank, why.c_str());
        return 1;
    };
    int rc = 0;
    double error_s = 0, destroy_s = 0;
    try {
        WorldMembership m;
        m.rank = rank;
        m.num_ranks = num_ranks;
        m.key_prefix = "peers-" + what;
        WorldOptions options;  // the default timeouts: ten minutes for a late peer, seconds for a dead one
        options.heap_bytes = 32ull << 20;
        auto world = World::from_store(store, m, options);
        cudaStream_t stream = nullptr;
        WEFT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        uint64_t* sigs = world->heap().alloc_signals(static_cast<uint64_t>(num_ranks));
        jit::Kernel& wait = kernel("weft_dist_wait");
        jit::Kernel& notify = kernel("weft_dist_notify");
        world->barrier();
        const jit::LaunchParams one_block{.grid = dim3(1), .block = dim3(64), .stream = stream};
        if (what == "death") {
            // Every rank waits for the victim's signal; the victim waits too, then dies mid-op.
            wait.launch(one_block, world->device_ctx(), static_cast<const uint64_t*>(sigs + kVictim), uint64_t{1});
            WEFT_CUDA_CHECK(cudaGetLastError());
            if (rank == kVictim) {
                for (int r = 0; r < num_ranks; ++r) {
                    if (r != kVictim) store->get("peers/launched/" + std::to_string(r), milliseconds(60000));
                }
                std::this_thread::sleep_for(milliseconds(500));  // the survivors' kernels are spinning
                std::fprintf(stderr, "child death rank %d: killing itself mid-op\n", rank);
                std::fflush(stderr);
                ::raise(SIGKILL);
            }
            store->set("peers/launched/" + std::to_string(rank), Bytes{1});
            const std::string message = sync_error(*world, stream, &error_s);
            std::fprintf(stderr, "child death rank %d: error after %.3f s: %s\n", rank, error_s, message.c_str());
            if (message.empty()) rc = fail("sync_and_check returned although rank 2 died");
            if (message.find("rank 2 is gone") == std::string::npos) rc = fail("the error does not name rank 2");
            if (message.find(hex(sigs + kVictim)) == std::string::npos) rc = fail("the error does not name the signal");
            if (error_s > kDeathBoundS) rc = fail("the error took longer than the bound");
            if (cudaGetLastError() != cudaSuccess) rc = fail("the CUDA context is not usable");
        } else if (what == "unwind") {
            // Rank 0's kernel waits for rank 1, which leaves on an exception of its own: its World, destroyed while
            // the exception propagates, aborts, so rank 0's wait stops long before its ten-minute bound.
            if (rank == 1) {
                store->get("peers/launched/0", milliseconds(60000));
                std::this_thread::sleep_for(milliseconds(500));  // rank 0's kernel is spinning
                throw std::runtime_error(kUnwindError);
            }
            wait.launch(one_block, world->device_ctx(), static_cast<const uint64_t*>(sigs + 1), uint64_t{1});
            WEFT_CUDA_CHECK(cudaGetLastError());
            store->set("peers/launched/0", Bytes{1});
            const std::string message = sync_error(*world, stream, &error_s);
            std::fprintf(stderr, "child unwind rank 0: error after %.3f s: %s\n", error_s, message.c_str());
            if (message.find("rank 1 called World::abort: its World was destroyed while an exception propagated") ==
                std::string::npos) {
                rc = fail("the error does not name rank 1 leaving on an exception");
            }
            if (error_s > kDeathBoundS) rc = fail("the error took longer than the bound");
        } else {
            // Rank 1 is late; rank 0's kernel waits for it with the default timeout.
            const auto start = Clock::now();
            if (rank == 1) {
                std::this_thread::sleep_for(std::chrono::seconds(kLateS));
                notify.launch(one_block, world->device_ctx(), sigs + 1, 0);
            } else {
                wait.launch(one_block, world->device_ctx(), static_cast<const uint64_t*>(sigs + 1), uint64_t{1});
            }
            WEFT_CUDA_CHECK(cudaGetLastError());
            world->sync_and_check(stream);
            const double waited = seconds_since(start);
            std::fprintf(stderr, "child late rank %d: the collective completed after %.3f s\n", rank, waited);
            if (rank == 0 && waited < kLateS - 1) rc = fail("rank 0 did not wait for the late peer");
            world->barrier();
        }
        WEFT_CUDA_CHECK(cudaStreamDestroy(stream));
        const auto destroy = Clock::now();
        world.reset();
        destroy_s = seconds_since(destroy);
        std::fprintf(stderr, "child %s rank %d: World destroyed in %.3f s\n", scenario, rank, destroy_s);
        if (destroy_s > kDeathBoundS) rc = fail("the World's destructor took longer than the bound");
    } catch (const std::exception& e) {
        if (what != "unwind" || rank != 1 || std::string(e.what()) != kUnwindError) rc = fail(e.what());
    }
    // Child 0 hosts the store: it stays until every other survivor is done with it.
    try {
        store->set("peers/done/" + std::to_string(rank), Bytes{1});
        if (rank == 0) {
            for (int r = 1; r < num_ranks; ++r) {
                if (what == "death" && r == kVictim) continue;
                store->get("peers/done/" + std::to_string(r), milliseconds(120000));
            }
        }
    } catch (const std::exception& e) {
        rc = fail(std::string("the final handshake failed: ") + e.what());
    }
    store.reset();
    server.reset();
    return rc;
}

struct Child {
    pid_t pid = 0;
    int status = 0;
    bool done = false;
};

// Starts `num_ranks` children for `scenario` (without the weft timeout variables, so that the defaults apply) and
// reaps them as they end (a killed child must not stay a zombie: the survivors' watchdogs look at /proc), within
// `bound`. Returns the children, each with its wait status.
std::vector<Child> run_children(const std::string& scenario, int num_ranks, std::chrono::seconds bound) {
    const std::string socket_name = "weft-dist-peers-" + std::to_string(::getpid()) + "-" + scenario;
    std::vector<std::string> env_text;
    for (char** e = environ; *e != nullptr; ++e) {
        const std::string kv = *e;
        if (kv.rfind("WEFT_TIMEOUT_MS=", 0) == 0 || kv.rfind("WEFT_HEARTBEAT_MS=", 0) == 0 ||
            kv.rfind("WEFT_DEAD_PEER_MS=", 0) == 0) {
            continue;
        }
        env_text.push_back(kv);
    }
    std::vector<char*> envp;
    for (auto& kv : env_text) envp.push_back(kv.data());
    envp.push_back(nullptr);
    char exe[4096] = {};
    const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    EXPECT_GT(n, 0);
    std::vector<Child> children(static_cast<size_t>(num_ranks));
    for (int r = 0; r < num_ranks; ++r) {
        std::string arg = std::string(kChildFlag) + scenario + ":" + std::to_string(r) + ":" +
                          std::to_string(num_ranks) + ":" + socket_name;
        char* argv[] = {exe, arg.data(), nullptr};
        EXPECT_EQ(::posix_spawn(&children[static_cast<size_t>(r)].pid, exe, nullptr, nullptr, argv, envp.data()), 0);
    }
    const auto deadline = Clock::now() + bound;
    size_t left = children.size();
    while (left > 0 && Clock::now() < deadline) {
        for (Child& c : children) {
            if (c.done) continue;
            if (::waitpid(c.pid, &c.status, WNOHANG) == c.pid) {
                c.done = true;
                --left;
            }
        }
        std::this_thread::sleep_for(milliseconds(10));
    }
    for (Child& c : children) {
        if (c.done) continue;
        ADD_FAILURE() << "child " << (&c - children.data()) << " of '" << scenario << "' did not end within "
                      << bound.count() << " s: killed";
        ::kill(c.pid, SIGKILL);
        ::waitpid(c.pid, &c.status, 0);
        c.done = true;
    }
    return children;
}

// Every child exited 0 (its checks passed).
void expect_every_child_passed(const std::vector<Child>& children) {
    for (size_t r = 0; r < children.size(); ++r) {
        const int status = children[r].status;
        EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
            << "child " << r << " failed its checks (its stderr says why)";
    }
}

// Runs `body` on rank 0 of the 2-rank weftrun job; the other rank waits for it (the children share the GPU).
void on_rank_zero_of_two(const char* name, const std::function<void()>& body) {
    World& w = dist_world();
    if (w.num_ranks() != 2) GTEST_SKIP() << "runs in the 2-rank job only";
    const std::string done = std::string("dist/peers/") + name;
    if (w.rank() == 0) {
        body();
        w.store().set(done, Bytes{1});
    } else {
        w.store().get(done, milliseconds(300000));
    }
    w.barrier();
}

}  // namespace

bool is_dist_child(int argc, char** argv) { return argc >= 2 && std::string(argv[1]).rfind(kChildFlag, 0) == 0; }

int run_dist_child(int /*argc*/, char** argv) { return child_main(std::string(argv[1]).substr(std::strlen(kChildFlag))); }

namespace {

TEST(DistPeers, AKilledPeerIsNamedByEverySurvivorWithinTheBound) {
    on_rank_zero_of_two("death", [] {
        const auto start = Clock::now();
        const auto children = run_children("death", 3, std::chrono::seconds(240));
        std::printf("[ PEERS    ] the killed-peer scenario took %.1f s\n", seconds_since(start));
        for (int r = 0; r < 3; ++r) {
            const int status = children[static_cast<size_t>(r)].status;
            if (r == kVictim) {
                EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "the victim was not SIGKILLed";
            } else {
                EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
                    << "survivor " << r << " failed its checks (its stderr says why)";
            }
        }
    });
}

TEST(DistPeers, APeerLeavingOnAnExceptionAbortsItsWorldSoThePeersStopAtOnce) {
    on_rank_zero_of_two("unwind",
                        [] { expect_every_child_passed(run_children("unwind", 2, std::chrono::seconds(120))); });
}

TEST(DistPeers, APeerFifteenSecondsLateIsWaitedForWithTheDefaultTimeouts) {
    on_rank_zero_of_two("late", [] { expect_every_child_passed(run_children("late", 2, std::chrono::seconds(240))); });
}

}  // namespace
}  // namespace test
}  // namespace weft
