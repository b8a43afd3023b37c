// SPDX-License-Identifier: MIT
// Unit tests for how a launched job finds its store (World::from_env's rendezvous) on real sockets: ranks as
// threads and as processes, while the launcher (torchrun's agent) or torch.distributed holds MASTER_PORT.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support/error_text.hpp"
#include "weft/detail/launch_store.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/launch_env.hpp"
#include "weft/runtime/rendezvous.hpp"

extern char** environ;  // NOLINT: POSIX

namespace weft {
namespace {

using Clock = std::chrono::steady_clock;
using Vars = std::map<std::string, std::string>;
using std::chrono::milliseconds;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

using testing::error_of;

Bytes to_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }

/// A run id no other test (nor another run of this binary) uses.
std::string unique_run_id(const char* what) {
    static std::atomic<int> counter{0};
    std::string id = "unit-";
    id.append(what).append("-").append(std::to_string(::getpid())).append("-").append(std::to_string(counter++));
    return id;
}

/// A TCP listener on 127.0.0.1 at `port` (0: one the kernel picks): what torchrun's agent (its store) or
/// torch.distributed's rank 0 holds at MASTER_PORT while the job runs.
class PortHolder {
public:
    explicit PortHolder(int port = 0) {
        fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        addr.sin_port = htons(static_cast<uint16_t>(port));
        socklen_t len = sizeof(addr);
        if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd_, 16) != 0 ||
            ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
            throw std::runtime_error("cannot listen on 127.0.0.1");
        }
        port_ = ntohs(addr.sin_port);
    }
    ~PortHolder() { ::close(fd_); }
    PortHolder(const PortHolder&) = delete;
    PortHolder& operator=(const PortHolder&) = delete;
    int port() const { return port_; }

private:
    int fd_ = -1;
    int port_ = 0;
};

/// What torchrun gives the workers of one host.
Vars torchrun_vars(int rank, int num_ranks, const std::string& run_id, int master_port) {
    return {{"RANK", std::to_string(rank)},
            {"WORLD_SIZE", std::to_string(num_ranks)},
            {"LOCAL_RANK", std::to_string(rank)},
            {"LOCAL_WORLD_SIZE", std::to_string(num_ranks)},
            {"MASTER_ADDR", "127.0.0.1"},
            {"MASTER_PORT", std::to_string(master_port)},
            {"TORCHELASTIC_RUN_ID", run_id},
            {"TORCHELASTIC_RESTART_COUNT", "0"},
            {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
}

/// The checks every rank of a test job makes through its store: a barrier, an all-gather of rank-specific
/// blobs, and the leave protocol of a store hosted by rank 0 (the World's shutdown does the same).
void exchange(Store& store, int rank, int num_ranks, const std::string& tag) {
    const milliseconds timeout(20000);
    store.barrier(tag + "/b", rank, num_ranks, timeout);
    auto all = store.all_gather(tag + "/g", rank, num_ranks, to_bytes(tag + " from " + std::to_string(rank)), timeout);
    for (int r = 0; r < num_ranks; ++r) {
        WEFT_CHECK(all.at(static_cast<size_t>(r)) == to_bytes(tag + " from " + std::to_string(r)),
                   "rank " << rank << " got a wrong blob from rank " << r);
    }
    if (rank != 0) {
        if (store.add(tag + "/left", 1) == num_ranks - 1) store.set(tag + "/all_left", {});
    } else {
        store.get(tag + "/all_left", timeout);
    }
}

/// Runs fn(rank) on one thread per rank; returns each rank's error ("" when it succeeded).
std::vector<std::string> on_threads(int num_ranks, const std::function<void(int)>& fn) {
    std::vector<std::string> errors(static_cast<size_t>(num_ranks));
    std::vector<std::thread> threads;
    for (int r = 0; r < num_ranks; ++r) {
        threads.emplace_back([&, r] { errors[static_cast<size_t>(r)] = error_of([&] { fn(r); }); });
    }
    for (auto& t : threads) t.join();
    return errors;
}

// ---- where the store is -------------------------------------------------------------------------------

TEST(LaunchStore, OneHostMeetsOnAUnixSocketNamedByUserJobAndWorld) {
    LaunchEnv env = *parse_launch_env(torchrun_vars(1, 4, "run-a", 29500));
    const detail::LaunchStoreAddress a = detail::launch_store_address(env, 1000, 0);
    EXPECT_EQ(a.unix_socket.rfind("weft-store-", 0), 0u) << a.unix_socket;
    EXPECT_EQ(a.unix_socket.size(), 11u + 16u);
    EXPECT_EQ(a.port, 0);
    EXPECT_TRUE(a.host.empty());
    EXPECT_TRUE(contains(a.world_id, env.job_id)) << a.world_id;
    // Every rank of the job computes the same address; the name shows neither the job nor the user.
    LaunchEnv rank0 = *parse_launch_env(torchrun_vars(0, 4, "run-a", 29500));
    EXPECT_EQ(detail::launch_store_address(rank0, 1000, 0).unix_socket, a.unix_socket);
    EXPECT_EQ(detail::launch_store_address(rank0, 1000, 0).world_id, a.world_id);
    EXPECT_FALSE(contains(a.unix_socket, "run-a"));
    // Another user, another World of the process, another job, another restart: another name.
    std::set<std::string> names{a.unix_socket};
    names.insert(detail::launch_store_address(env, 1001, 0).unix_socket);
    names.insert(detail::launch_store_address(env, 1000, 1).unix_socket);
    auto name_of = [](const Vars& v) {
        return detail::launch_store_address(*parse_launch_env(v), 1000, 0).unix_socket;
    };
    names.insert(name_of(torchrun_vars(1, 4, "run-b", 29500)));
    names.insert(name_of(torchrun_vars(1, 4, "run-a", 29501)));
    Vars restarted = torchrun_vars(1, 4, "run-a", 29500);
    restarted["TORCHELASTIC_RESTART_COUNT"] = "1";
    names.insert(name_of(restarted));
    EXPECT_EQ(names.size(), 6u);
    // A job of one rank needs no store, and a job without an id cannot name one.
    const LaunchEnv single = *parse_launch_env(torchrun_vars(0, 1, "x", 1));
    EXPECT_TRUE(contains(error_of([&] { detail::launch_store_address(single, 0, 0); }), "needs no store"));
    LaunchEnv nameless = env;
    nameless.job_id.clear();
    EXPECT_TRUE(contains(error_of([&] { detail::launch_store_address(nameless, 0, 0); }), "job_id"));
}

TEST(LaunchStore, SeveralHostsMeetOverTcpNeverOnMasterPort) {
    // 16 ranks, 8 per host; rank 0's host from MASTER_ADDR.
    Vars v = torchrun_vars(9, 16, "multi", 29500);
    v["LOCAL_RANK"] = "1";
    v["LOCAL_WORLD_SIZE"] = "8";
    v["MASTER_ADDR"] = "node-a";
    LaunchEnv env = *parse_launch_env(v);
    const detail::LaunchStoreAddress a = detail::launch_store_address(env, 1000, 0);
    EXPECT_TRUE(a.unix_socket.empty());
    EXPECT_EQ(a.host, "node-a");
    EXPECT_GE(a.port, 20000);
    EXPECT_LE(a.port, 32767);
    EXPECT_NE(a.port, 29500);
    // The same on every rank (not the uid: the hosts' users need not share ids), another for the next World.
    EXPECT_EQ(detail::launch_store_address(env, 2000, 0).port, a.port);
    EXPECT_NE(detail::launch_store_address(env, 1000, 1).port, a.port);
    // The derived port is never MASTER_PORT, whatever the job id.
    for (int i = 0; i < 3000; ++i) {
        LaunchEnv e = env;
        e.job_id = "job " + std::to_string(i);
        const int derived = detail::launch_store_address(e, 0, 0).port;
        e.master_port = derived;  // as if the launcher had chosen that very port
        const int port = detail::launch_store_address(e, 0, 0).port;
        ASSERT_NE(port, derived) << e.job_id;
        ASSERT_TRUE(port >= 20000 && port <= 32767) << port;
    }
    // Without the job's secret every rank refuses at once (rank 0 could not listen; the others would wait for it).
    for (int rank : {0, 9}) {
        LaunchEnv e = env;
        e.rank = rank;
        e.job_token.clear();
        EXPECT_TRUE(contains(error_of([&] { detail::make_launch_store(e, 0, milliseconds(100)); }), "WEFT_JOB_TOKEN"))
            << rank;
    }
    // WEFT_STORE_PORT, when set, is the port of every World made while no other is open (port slot 0), whatever its
    // index; a World open beside others takes the slot above theirs, past MASTER_PORT.
    v["WEFT_STORE_PORT"] = "31999";
    EXPECT_EQ(detail::launch_store_address(*parse_launch_env(v), 1000, 0).port, 31999);
    EXPECT_EQ(detail::launch_store_address(*parse_launch_env(v), 1000, 5).port, 31999);
    EXPECT_EQ(detail::launch_store_address(*parse_launch_env(v), 1000, 5, 1).port, 32000);
    v["WEFT_STORE_PORT"] = "29498";
    EXPECT_EQ(detail::launch_store_address(*parse_launch_env(v), 1000, 1, 1).port, 29499);
    EXPECT_EQ(detail::launch_store_address(*parse_launch_env(v), 1000, 2, 2).port, 29501) << "MASTER_PORT is skipped";
    v["WEFT_STORE_PORT"] = "65535";
    const std::string past = error_of([&] { detail::launch_store_address(*parse_launch_env(v), 1000, 1, 1); });
    EXPECT_TRUE(contains(past, "2 Worlds open at once would need port 65536, past 65535")) << past;
    // Slots: the lowest free one, held until released.
    {
        auto first = detail::take_store_port_slot();
        auto second = detail::take_store_port_slot();
        EXPECT_EQ(*first, 0u);
        EXPECT_EQ(*second, 1u);
        first.reset();
        auto third = detail::take_store_port_slot();
        EXPECT_EQ(*third, 0u) << "a World made after the first closed reuses its port";
    }
    EXPECT_EQ(*detail::take_store_port_slot(), 0u);
    // Never MASTER_PORT, where the launcher's or torch.distributed's store listens.
    v["WEFT_STORE_PORT"] = "29500";
    const std::string e = error_of([&] { detail::launch_store_address(*parse_launch_env(v), 1000, 0); });
    EXPECT_TRUE(contains(e, "WEFT_STORE_PORT (29500) must differ from MASTER_PORT")) << e;
}

// ---- ranks as threads ---------------------------------------------------------------------------------

TEST(LaunchStore, TorchrunRanksMeetWhileTheAgentHoldsMasterPort) {
    // torchrun's agent listens on MASTER_PORT for the whole job, so a store of weft's own cannot start there
    // (rank 0 would fail with "cannot bind localhost:38083"): the ranks must meet elsewhere.
    PortHolder agent;
    const std::string run_id = unique_run_id("agent");
    LaunchEnv rank0 = *parse_launch_env(torchrun_vars(0, 2, run_id, agent.port()));
    RendezvousOptions on_master_port;
    on_master_port.host = rank0.master_addr;
    on_master_port.port = rank0.master_port;
    on_master_port.num_ranks = 2;
    EXPECT_TRUE(contains(error_of([&] { make_tcp_store(on_master_port); }), "cannot bind")) << "MASTER_PORT is free?";

    for (int n : {2, 4}) {
        const std::string id = unique_run_id("agent");
        auto errors = on_threads(n, [&](int r) {
            if (r == 0) std::this_thread::sleep_for(milliseconds(150));  // the others are there first and retry
            LaunchEnv env = *parse_launch_env(torchrun_vars(r, n, id, agent.port()));
            auto store = detail::make_launch_store(env, 0, milliseconds(20000));
            exchange(*store, r, n, "torchrun");
        });
        for (int r = 0; r < n; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "n=" << n << " rank " << r;
    }
}

TEST(LaunchStore, SeveralHostsShapeOverLoopbackWhileMasterPortIsHeld) {
    // Two "hosts" of two ranks each, all on loopback: TCP on the derived port, with MASTER_PORT held.
    PortHolder agent;
    const std::string id = unique_run_id("hosts");
    auto errors = on_threads(4, [&](int r) {
        Vars v = torchrun_vars(r, 4, id, agent.port());
        v["LOCAL_RANK"] = std::to_string(r % 2);
        v["LOCAL_WORLD_SIZE"] = "2";
        LaunchEnv env = *parse_launch_env(v);
        EXPECT_TRUE(detail::launch_store_address(env, 0, 0).unix_socket.empty());
        auto store = detail::make_launch_store(env, 0, milliseconds(20000));
        exchange(*store, r, 4, "hosts");
    });
    for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

TEST(LaunchStore, AcrossHostsRankZeroListensOnEveryInterface) {
    // MASTER_ADDR names this host (here its name, which /etc/hosts may map to a loopback address): rank 0 listens on
    // every interface, so ranks of other hosts reach it whatever the name resolves to on rank 0's own host. Two
    // "hosts" of two ranks each meet over TCP; then, where this host has an IPv4 address other than loopback, a
    // connection to that address reaches the store too (a listener bound to MASTER_ADDR's address alone would refuse).
    char name[HOST_NAME_MAX + 1] = {};
    ASSERT_EQ(::gethostname(name, sizeof(name)), 0);
    PortHolder agent;
    const std::string id = unique_run_id("wildcard");
    int store_port = 0;
    auto errors = on_threads(4, [&](int r) {
        Vars v = torchrun_vars(r, 4, id, agent.port());
        v["LOCAL_RANK"] = std::to_string(r % 2);
        v["LOCAL_WORLD_SIZE"] = "2";
        v["MASTER_ADDR"] = name;
        v["WEFT_JOB_TOKEN"] = "wildcard-test-token";
        LaunchEnv env = *parse_launch_env(v);
        const detail::LaunchStoreAddress where = detail::launch_store_address(env, 0, 0);
        if (r == 0) store_port = where.port;
        auto store = detail::make_launch_store(env, 0, milliseconds(20000));
        store->barrier("wildcard/up", r, 4, milliseconds(20000));
        if (r == 0) {
            // Loopback too: a listener bound to the NIC address the name resolves to (a container's /etc/hosts)
            // would refuse it.
            sockaddr_in lo{};
            lo.sin_family = AF_INET;
            lo.sin_port = htons(static_cast<uint16_t>(store_port));
            lo.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            const int lo_fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
            const int lo_rc = ::connect(lo_fd, reinterpret_cast<const sockaddr*>(&lo), sizeof(lo));
            const int lo_err = errno;
            ::close(lo_fd);
            WEFT_CHECK(lo_rc == 0, "the store on port " << store_port << " refused a connection to 127.0.0.1: "
                                                        << std::strerror(lo_err));
            ifaddrs* list = nullptr;
            if (::getifaddrs(&list) == 0) {
                for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
                    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
                    sockaddr_in in = *reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
                    if ((ntohl(in.sin_addr.s_addr) >> 24) == 127) continue;
                    in.sin_port = htons(static_cast<uint16_t>(store_port));
                    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
                    const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&in), sizeof(in));
                    const int err = errno;
                    ::close(fd);
                    char text[INET_ADDRSTRLEN] = {};
                    ::inet_ntop(AF_INET, &in.sin_addr, text, sizeof(text));
                    WEFT_CHECK(rc == 0, "the store on port " << store_port << " refused a connection to " << text
                                                             << ": " << std::strerror(err));
                }
                ::freeifaddrs(list);
            }
        }
        exchange(*store, r, 4, "wildcard");
    });
    for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

TEST(LaunchStore, ConcurrentJobsOnOneHostMeetOnlyTheirOwnRanks) {
    // Two jobs of three ranks at once, with the same MASTER_PORT (a hand-made environment could do that under
    // different users or run ids): each job's exchange sees only its own blobs.
    PortHolder agent;
    const std::string a = unique_run_id("job"), b = unique_run_id("job");
    auto errors = on_threads(6, [&](int t) {
        const std::string& id = t < 3 ? a : b;
        const int r = t % 3;
        LaunchEnv env = *parse_launch_env(torchrun_vars(r, 3, id, agent.port()));
        auto store = detail::make_launch_store(env, 0, milliseconds(20000));
        exchange(*store, r, 3, t < 3 ? "job a" : "job b");
    });
    for (int t = 0; t < 6; ++t) EXPECT_EQ(errors[static_cast<size_t>(t)], "") << "thread " << t;
}

TEST(LaunchStore, ConsecutiveWorldsOfOneJobMeetTheirOwnStore) {
    // Each process's second World::from_env meets at the second World's store, even while rank 0 still holds the
    // first one open, late (on one host: another socket name; across hosts with a fixed WEFT_STORE_PORT: the same
    // port, where a rank that reaches the first World's store sees another World id and waits); a third World open
    // beside the second meets at its own (across hosts: the next port).
    PortHolder agent;
    for (bool fixed_port : {false, true}) {
        const std::string id = unique_run_id("worlds");
        const int store_port = fixed_port ? PortHolder().port() : 0;  // free again once the holder is gone
        auto errors = on_threads(3, [&](int r) {
            Vars v = torchrun_vars(r, 3, id, agent.port());
            if (fixed_port) {
                v["LOCAL_RANK"] = "0";  // three hosts of one rank each
                v["LOCAL_WORLD_SIZE"] = "1";
                v["WEFT_STORE_PORT"] = std::to_string(store_port);
                v["WEFT_JOB_TOKEN"] = "t";  // not needed on loopback; the token path of a multi-host job
            }
            LaunchEnv env = *parse_launch_env(v);
            {
                auto first = detail::make_launch_store(env, 0, milliseconds(20000));
                exchange(*first, r, 3, "world 0");
                // Rank 0 closes its store late: the others look for the second World's store meanwhile.
                if (r == 0) std::this_thread::sleep_for(milliseconds(300));
            }
            auto second = detail::make_launch_store(env, 1, milliseconds(20000));
            exchange(*second, r, 3, "world 1");
            // Beside the second (the threads stand for processes: the slot a process would take is passed).
            auto third = detail::make_launch_store(env, 2, milliseconds(20000), milliseconds(0), 1);
            exchange(*third, r, 3, "world 2");
        });
        for (int r = 0; r < 3; ++r) {
            EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "fixed port " << fixed_port << ", rank " << r;
        }
    }
}

TEST(LaunchStore, AMissingRankZeroIsNamedWithTheJob) {
    PortHolder agent;
    const std::string id = unique_run_id("alone");
    LaunchEnv env = *parse_launch_env(torchrun_vars(1, 2, id, agent.port()));
    const auto start = Clock::now();
    const std::string e = error_of([&] { detail::make_launch_store(env, 0, milliseconds(300)); });
    EXPECT_LT(Clock::now() - start, milliseconds(5000));
    EXPECT_TRUE(contains(e, "World::from_env (torchrun job 'torchrun " + id) && contains(e, "rank 1 of 2") &&
                contains(e, "World 0 of this process") && contains(e, "@weft-store-") &&
                contains(e, "could not connect"))
        << e;
}

// ---- ranks as processes -------------------------------------------------------------------------------

constexpr const char* kChildFlag = "WEFT_TEST_LAUNCH_STORE_CHILD";

// Runs only as a rank started by LaunchStore.ProcessesOfATorchrunOrSrunJob (it re-runs this binary with the
// launcher's environment): World::from_env's way to the store, from the process's own environment.
TEST(LaunchStoreChild, Rank) {
    const char* flag = std::getenv(kChildFlag);
    if (flag == nullptr) GTEST_SKIP() << "runs only as a rank of LaunchStore.ProcessesOfATorchrunOrSrunJob";
    auto env = detect_launch_env();
    ASSERT_TRUE(env.has_value());
    std::unique_ptr<PortHolder> torch_store;
    if (std::string(flag) == "hold-master-port" && env->rank == 0) {
        // A torch.distributed process group in this very process: its rank 0 serves torch's store on MASTER_PORT
        // (free when the parent chose it) for the rank's whole life. Should another process have taken the port
        // meanwhile, it is held all the same.
        ASSERT_NE(env->master_port, 0);
        try {
            torch_store = std::make_unique<PortHolder>(env->master_port);
        } catch (const std::exception&) {
        }
    }
    auto store = detail::make_launch_store(*env, detail::next_launch_world_index(), milliseconds(20000));
    exchange(*store, env->rank, env->num_ranks, env->launcher);
    std::printf("rank %d of %d (%s): store ok\n", env->rank, env->num_ranks, env->launcher.c_str());
}

std::string self_path() {
    char buf[PATH_MAX];
    ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

/// Starts this binary's LaunchStoreChild.Rank with `vars` added to the environment (and none of the launcher
/// variables this process may have), its output going to `output_fd`; returns its pid.
pid_t spawn_rank(const Vars& vars, const std::string& flag, int output_fd) {
    static const std::set<std::string> kLauncherNames = {
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "WEFT_JOB_TOKEN",
        "WEFT_RUN_ID", "WEFT_STORE_PORT"};
    std::vector<std::string> env_s;
    for (char** p = environ; *p != nullptr; ++p) {
        std::string e(*p);
        const std::string name = e.substr(0, e.find('='));
        if (kLauncherNames.count(name) || name.rfind("TORCHELASTIC_", 0) == 0 || name.rfind("SLURM_", 0) == 0 ||
            name.rfind("OMPI_", 0) == 0) {
            continue;
        }
        env_s.push_back(e);
    }
    for (const auto& [k, v] : vars) env_s.push_back(k + "=" + v);
    env_s.push_back(std::string(kChildFlag) + "=" + flag);
    const std::string self = self_path();
    std::vector<std::string> args = {self, "--gtest_filter=LaunchStoreChild.Rank"};
    std::vector<char*> argv, envp;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env_s) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, output_fd, 1);
    posix_spawn_file_actions_adddup2(&actions, output_fd, 2);
    pid_t pid = -1;
    const int rc = ::posix_spawn(&pid, self.c_str(), &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    return rc == 0 ? pid : -1;
}

/// Everything written to `fd` (a temporary file) so far.
std::string read_all(int fd) {
    std::string text;
    char buf[4096];
    for (off_t at = 0;;) {
        const ssize_t n = ::pread(fd, buf, sizeof(buf), at);
        if (n <= 0) break;
        text.append(buf, static_cast<size_t>(n));
        at += n;
    }
    return text;
}

/// Waits for every pid (bounded); kills those still running at the deadline. Returns the exit statuses.
std::vector<int> wait_all(const std::vector<pid_t>& pids, milliseconds limit) {
    std::vector<int> statuses(pids.size(), -1);
    std::vector<bool> done(pids.size(), false);
    const auto deadline = Clock::now() + limit;
    size_t remaining = pids.size();
    while (remaining > 0) {
        for (size_t i = 0; i < pids.size(); ++i) {
            if (done[i]) continue;
            int status = 0;
            if (::waitpid(pids[i], &status, WNOHANG) == pids[i]) {
                statuses[i] = status;
                done[i] = true;
                --remaining;
            }
        }
        if (remaining == 0) break;
        if (Clock::now() > deadline) {
            for (size_t i = 0; i < pids.size(); ++i) {
                if (done[i]) continue;
                ::kill(pids[i], SIGKILL);
                ::waitpid(pids[i], &statuses[i], 0);
                statuses[i] = -1;
            }
            break;
        }
        std::this_thread::sleep_for(milliseconds(10));
    }
    return statuses;
}

TEST(LaunchStore, ProcessesOfATorchrunOrSrunJob) {
    const std::string self = self_path();
    ASSERT_FALSE(self.empty());
    // torchrun: the agent (this test) holds MASTER_PORT. srun with torch.distributed in the same processes: the
    // user set MASTER_PORT for torch, whose rank 0 serves it. srun alone: no MASTER_PORT at all.
    struct Case {
        const char* name;
        int num_ranks;
    };
    for (const Case& c : {Case{"torchrun", 3}, Case{"srun+torch", 3}, Case{"srun", 2}}) {
        const std::string kind = c.name;
        auto agent = std::make_unique<PortHolder>();
        const int master_port = agent->port();
        if (kind != "torchrun") agent.reset();  // srun has no agent: the port is free again (for torch's rank 0)
        const std::string job = unique_run_id("proc");
        std::vector<pid_t> pids;
        std::vector<int> outputs;
        for (int r = 0; r < c.num_ranks; ++r) {
            Vars v;
            if (kind == "torchrun") {
                v = torchrun_vars(r, c.num_ranks, job, master_port);
            } else {
                v = {{"SLURM_PROCID", std::to_string(r)}, {"SLURM_NTASKS", std::to_string(c.num_ranks)},
                     {"SLURM_LOCALID", std::to_string(r)}, {"SLURM_NNODES", "1"},
                     {"SLURM_JOB_ID", job}, {"SLURM_STEP_ID", "0"}};
                if (kind == "srun+torch") {
                    v["MASTER_ADDR"] = "127.0.0.1";
                    v["MASTER_PORT"] = std::to_string(master_port);
                }
            }
            char path[] = "/tmp/weft-launch-store-XXXXXX";
            const int out = ::mkstemp(path);
            ASSERT_GE(out, 0);
            ::unlink(path);
            outputs.push_back(out);
            const pid_t pid = spawn_rank(v, kind == "srun+torch" ? "hold-master-port" : "plain", out);
            ASSERT_GT(pid, 0);
            pids.push_back(pid);
        }
        const std::vector<int> statuses = wait_all(pids, milliseconds(60000));
        for (int r = 0; r < c.num_ranks; ++r) {
            const int st = statuses[static_cast<size_t>(r)];
            const std::string output = read_all(outputs[static_cast<size_t>(r)]);
            ::close(outputs[static_cast<size_t>(r)]);
            EXPECT_TRUE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0)
                << kind << ": rank " << r << " status " << st << ", output:\n" << output;
            EXPECT_TRUE(contains(output, "rank " + std::to_string(r) + " of " + std::to_string(c.num_ranks)) &&
                        contains(output, "store ok"))
                << kind << ": rank " << r << " output:\n" << output;
        }
    }
}

TEST(LaunchStore, RankZeroMakesRoomForTwoConnectionsPerRank) {
    // A soft limit on open files below what 400 ranks' connections need (2 x 400 + 256) is raised toward the hard
    // limit; the server's connection cap follows the World's size.
    rlimit before{};
    ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &before), 0);
    if (before.rlim_max != RLIM_INFINITY && before.rlim_max < 1056) GTEST_SKIP() << "hard limit " << before.rlim_max;
    rlimit low = before;
    low.rlim_cur = 512;
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
    RendezvousOptions options;
    detail::make_room_for_connections(options, 400);
    rlimit after{};
    ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &after), 0);
    EXPECT_GE(after.rlim_cur, 1056u);
    EXPECT_EQ(options.max_connections, 4096) << "4096 already holds 400 ranks";
    detail::make_room_for_connections(options, 3000);
    EXPECT_EQ(options.max_connections, 6064);
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &before), 0);
}

}  // namespace
}  // namespace weft
