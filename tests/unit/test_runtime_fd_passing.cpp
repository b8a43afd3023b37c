// SPDX-License-Identifier: MIT
// Unit tests for descriptor passing over abstract Unix sockets (ranks as threads, memfds as payload).
#include <gtest/gtest.h>

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "weft/detail/fd_passing.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/in_process_store.hpp"

namespace weft::detail {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string unique_job_id() {
    static int counter = 0;
    std::string id = "t";  // appended: GCC 12 warns falsely about `"literal" + std::string` under -O3
    id.append(std::to_string(::getpid())).append("x").append(std::to_string(counter++));
    return id;
}

/// The abstract address of `name` (as the runtime binds it).
sockaddr_un abstract_address(const std::string& name, socklen_t* length) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    *length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    return addr;
}

// A memfd holding `text`.
UniqueFd memfd_with(const std::string& text) {
    UniqueFd fd(::memfd_create("weft-test", MFD_CLOEXEC));
    EXPECT_GE(fd.get(), 0);
    EXPECT_EQ(::write(fd.get(), text.data(), text.size()), static_cast<ssize_t>(text.size()));
    return fd;
}

std::string read_all(int fd) {
    char buf[256] = {};
    ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

struct Outcome {
    std::map<int, std::string> received;  // peer -> content of its descriptor
    std::string error;
};

std::vector<Outcome> run_exchange(int n, const std::string& job, const std::function<std::vector<int>(int)>& peers_of,
                                  std::chrono::milliseconds timeout, int late_rank = -1,
                                  std::vector<double>* seconds = nullptr,
                                  const std::function<std::optional<std::string>()>& stop_reason = {}) {
    InProcessStore store;
    std::vector<Outcome> out(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    if (seconds != nullptr) seconds->assign(static_cast<size_t>(n), 0.0);
    for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
            if (r == late_rank) std::this_thread::sleep_for(200ms);
            const auto start = Clock::now();
            struct Timer {
                std::function<void()> done;
                ~Timer() { done(); }
            } timer{[&] {
                if (seconds != nullptr) {
                    (*seconds)[static_cast<size_t>(r)] = std::chrono::duration<double>(Clock::now() - start).count();
                }
            }};
            try {
                UniqueFd mine = memfd_with("payload of rank " + std::to_string(r));
                FdExchange ex;
                ex.job_id = job;
                ex.rank = r;
                ex.num_ranks = n;
                ex.local_peers = peers_of(r);
                ex.heap_bytes = 1 << 21;
                ex.store = &store;
                ex.timeout = timeout;
                ex.stop_reason = stop_reason;
                auto fds = exchange_fds(ex, mine.get());
                for (auto& [peer, fd] : fds) out[static_cast<size_t>(r)].received[peer] = read_all(fd.get());
            } catch (const std::exception& e) {
                out[static_cast<size_t>(r)].error = e.what();
            }
        });
    }
    for (auto& t : threads) t.join();
    return out;
}

TEST(RuntimeFdPassing, EveryRankReceivesEveryPeersDescriptor) {
    for (int n : {1, 2, 3, 5}) {
        const std::string job = unique_job_id();
        auto out = run_exchange(
            n, job,
            [n](int r) {
                std::vector<int> peers;
                for (int p = 0; p < n; ++p)
                    if (p != r) peers.push_back(p);
                return peers;
            },
            10000ms);
        for (int r = 0; r < n; ++r) {
            const Outcome& o = out[static_cast<size_t>(r)];
            ASSERT_EQ(o.error, "") << "n=" << n << " rank " << r;
            ASSERT_EQ(o.received.size(), static_cast<size_t>(n - 1));
            for (const auto& [peer, text] : o.received) EXPECT_EQ(text, "payload of rank " + std::to_string(peer));
        }
    }
}

TEST(RuntimeFdPassing, TwoHostsExchangeOnlyWithinAHost) {
    // Ranks 0, 2 on one "host", 1, 3 on another.
    auto out = run_exchange(
        4, unique_job_id(), [](int r) { return std::vector<int>{(r + 2) % 4}; }, 10000ms);
    for (int r = 0; r < 4; ++r) {
        ASSERT_EQ(out[static_cast<size_t>(r)].error, "");
        ASSERT_EQ(out[static_cast<size_t>(r)].received.size(), 1u);
        EXPECT_EQ(out[static_cast<size_t>(r)].received.at((r + 2) % 4),
                  "payload of rank " + std::to_string((r + 2) % 4));
    }
}

TEST(RuntimeFdPassing, ForeignConnectionsAreDropped) {
    const std::string job = unique_job_id();
    std::atomic<bool> stop{false};
    // A stranger keeps connecting to rank 0's socket and sending garbage (no descriptor).
    std::thread stranger([&] {
        const std::string name = heap_socket_name(job, 0);
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::memcpy(addr.sun_path + 1, name.data(), name.size());
        const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
        while (!stop) {
            int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
            if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), length) == 0) {
                const char garbage[] = "GET / HTTP/1.0\r\n\r\n";
                (void)::write(fd, garbage, sizeof(garbage));
            }
            ::close(fd);
            std::this_thread::sleep_for(1ms);
        }
    });
    // Rank 2 comes late, so rank 0 listens for a while before the real descriptors arrive.
    testing::internal::CaptureStderr();
    auto out = run_exchange(
        3, job,
        [](int r) {
            std::vector<int> peers;
            for (int p = 0; p < 3; ++p)
                if (p != r) peers.push_back(p);
            return peers;
        },
        10000ms, /*late_rank=*/2);
    stop = true;
    stranger.join();
    const std::string log = testing::internal::GetCapturedStderr();
    EXPECT_NE(log.find("dropped a malformed message on the heap socket"), std::string::npos) << log;
    for (int r = 0; r < 3; ++r) {
        ASSERT_EQ(out[static_cast<size_t>(r)].error, "") << "rank " << r;
        EXPECT_EQ(out[static_cast<size_t>(r)].received.size(), 2u);
    }
}

// Rank 0 expects to exchange with rank 1, which (wrongly) expects no peer, so it neither listens nor sends.
std::vector<int> unreachable_peer_peers(int r) { return r == 0 ? std::vector<int>{1} : std::vector<int>{}; }

// Rank 1 expects ranks 0 and 2, but rank 0 (which expects only rank 2) sends nothing to it.
std::vector<int> missing_sender_peers(int r) {
    if (r == 0) return {2};
    if (r == 1) return {0, 2};
    return {0, 1};
}

TEST(RuntimeFdPassing, UnreachablePeerIsNamed) {
    // Rank 0 expects to exchange with rank 1, which (wrongly) expects no peer, so it neither listens nor sends.
    std::vector<double> seconds;
    auto out = run_exchange(2, unique_job_id(), unreachable_peer_peers, 300ms, -1, &seconds);
    for (double s : seconds) EXPECT_LT(s, 5.0);  // the 300 ms timeout, with room for a loaded machine
    EXPECT_NE(out[0].error.find("rank 0 could not reach rank 1's heap socket"), std::string::npos) << out[0].error;
    EXPECT_NE(out[1].error, "");  // rank 1 then waits for rank 0 at the final barrier, and gives up too
}

TEST(RuntimeFdPassing, MissingSenderIsNamed) {
    // Rank 1 expects ranks 0 and 2, but rank 0 (which expects only rank 2) sends nothing to it; rank 1's
    // unexpected descriptor to rank 0 is dropped there.
    std::vector<double> seconds;
    auto out = run_exchange(3, unique_job_id(), missing_sender_peers, 300ms, -1, &seconds);
    EXPECT_NE(out[1].error.find("rank 1 did not receive the symmetric heap handles of rank 0"), std::string::npos)
        << out[1].error;
    for (double s : seconds) EXPECT_LT(s, 5.0);
}

// A peer that failed while starting (its failure recorded where the World's start-up waits look: stop_reason) ends
// the exchange's socket waits at once, naming it, instead of at the timeout: the wait for a descriptor that will
// not come, and the connection attempts to a socket nobody listens on.
TEST(RuntimeFdPassing, APeersStartUpFailureEndsTheWaitsOnSocketsNamingIt) {
    const auto failed_at = Clock::now() + 300ms;
    const auto stop = [failed_at]() -> std::optional<std::string> {
        if (Clock::now() < failed_at) return std::nullopt;
        return std::string("rank 0 failed while starting the World (its own error says why)");
    };
    std::vector<double> seconds;
    // Rank 1 waits for rank 0's descriptor, which never comes (as in MissingSenderIsNamed).
    auto out = run_exchange(3, unique_job_id(), missing_sender_peers, 6000ms, -1, &seconds, stop);
    EXPECT_NE(out[1].error.find("rank 1 stopped waiting for the symmetric heap handles of rank 0: rank 0 failed "
                                "while starting the World"),
              std::string::npos)
        << out[1].error;
    EXPECT_LT(seconds[1], 4.0) << "rank 1 waited for the timeout";
    // Rank 0 connects to rank 1's socket, on which nobody listens (as in UnreachablePeerIsNamed).
    out = run_exchange(2, unique_job_id(), unreachable_peer_peers, 6000ms, -1, &seconds, stop);
    EXPECT_NE(out[0].error.find("rank 0 stopped connecting to"), std::string::npos) << out[0].error;
    EXPECT_NE(out[0].error.find("rank 0 failed while starting the World"), std::string::npos) << out[0].error;
    EXPECT_LT(seconds[0], 4.0) << "rank 0 tried to connect until the timeout";
}

/// Connects to `name` (retrying until it listens, at most 10 s), sends one byte, then holds the connection
/// without another byte until `release` is set or 20 s pass: a sender that stalls mid-message.
void stall_on(const std::string& name, const std::atomic<bool>& release) {
    socklen_t length = 0;
    sockaddr_un addr = abstract_address(name, &length);
    int fd = -1;
    for (auto deadline = Clock::now() + 10s; Clock::now() < deadline && !release.load();) {
        fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), length) == 0) break;
        ::close(fd);
        fd = -1;
        std::this_thread::sleep_for(1ms);
    }
    if (fd < 0) return;
    const char one = 'W';
    (void)::send(fd, &one, 1, MSG_NOSIGNAL);
    for (auto deadline = Clock::now() + 20s; Clock::now() < deadline && !release.load();) {
        std::this_thread::sleep_for(5ms);
    }
    ::close(fd);
}

TEST(RuntimeFdPassing, StalledSenderHoldsUpNobody) {
    // A connection that sends one byte and stalls reaches rank 0 before rank 1's real message (rank 1 is late).
    const std::string job = unique_job_id();
    std::atomic<bool> release{false};
    std::thread staller([&] { stall_on(heap_socket_name(job, 0), release); });
    std::vector<double> seconds;
    auto out = run_exchange(
        2, job, [](int r) { return std::vector<int>{1 - r}; }, 10000ms, /*late_rank=*/1, &seconds);
    release = true;
    staller.join();
    for (int r = 0; r < 2; ++r) {
        EXPECT_EQ(out[static_cast<size_t>(r)].error, "") << "rank " << r;
        EXPECT_EQ(out[static_cast<size_t>(r)].received.size(), 1u) << "rank " << r;
        // Well under the 20 s the staller holds its connection, and under the 10 s timeout.
        EXPECT_LT(seconds[static_cast<size_t>(r)], 8.0) << "rank " << r;
    }
}

TEST(RuntimeFdPassing, StalledSenderIsBoundedByTheTimeout) {
    // Rank 1 expects a descriptor from rank 0, which sends none (as in MissingSenderIsNamed); a connection that
    // stalls mid-message is all rank 1 gets besides rank 2's. It must give up at its 1 s timeout, naming rank 0,
    // not when the staller lets go (20 s).
    const std::string job = unique_job_id();
    std::atomic<bool> release{false};
    std::thread staller([&] { stall_on(heap_socket_name(job, 1), release); });
    std::vector<double> seconds;
    auto out = run_exchange(3, job, missing_sender_peers, 1000ms, -1, &seconds);
    release = true;
    staller.join();
    EXPECT_NE(out[1].error.find("rank 1 did not receive the symmetric heap handles of rank 0"), std::string::npos)
        << out[1].error;
    EXPECT_GE(seconds[1], 0.9);
    EXPECT_LT(seconds[1], 6.0);
}

/// Runs rank 0 of a two-rank exchange whose rank 1 listens nowhere, while a child process squats rank 1's heap
/// socket: as user `uid` (-1: this user) . Returns rank 0's error; `*child_got` is what the squatter saw:
/// 'F' a descriptor, 'N' a connection without one, 'T' no connection.
std::string exchange_with_squatter(long uid, char* child_got, pid_t* squatter) {
    const std::string job = unique_job_id();
    const std::string name = heap_socket_name(job, 1);
    socklen_t length = 0;
    const sockaddr_un addr = abstract_address(name, &length);
    int pipe_fds[2];
    if (::pipe(pipe_fds) != 0) return "pipe failed";
    const pid_t child = ::fork();
    if (child < 0) return "fork failed";
    if (child == 0) {
        // System calls only from here on (the parent has other threads).
        ::close(pipe_fds[0]);
        auto report = [&](char c) {
            (void)::write(pipe_fds[1], &c, 1);
            ::_exit(0);
        };
        if (uid >= 0 &&
            (::syscall(SYS_setresgid, uid, uid, uid) != 0 || ::syscall(SYS_setresuid, uid, uid, uid) != 0)) {
            report('U');
        }
        int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
        if (fd < 0 || ::bind(fd, reinterpret_cast<const sockaddr*>(&addr), length) != 0 || ::listen(fd, 8) != 0) {
            report('B');
        }
        const char listening = 'L';
        (void)::write(pipe_fds[1], &listening, 1);
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, 10000) <= 0) report('T');
        int conn = ::accept(fd, nullptr, nullptr);
        p = {conn, POLLIN, 0};
        if (conn < 0 || ::poll(&p, 1, 10000) <= 0) report('T');
        char data[256];
        iovec iov{data, sizeof(data)};
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
        msghdr msg{};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control;
        msg.msg_controllen = sizeof(control);
        (void)::recvmsg(conn, &msg, 0);
        report(CMSG_FIRSTHDR(&msg) != nullptr ? 'F' : 'N');
    }
    ::close(pipe_fds[1]);
    *squatter = child;
    char ready = 0;
    if (::read(pipe_fds[0], &ready, 1) != 1 || ready != 'L') {
        ::close(pipe_fds[0]);
        ::waitpid(child, nullptr, 0);
        return std::string("the squatter could not start: ") + ready;
    }
    InProcessStore store;
    std::string error;
    std::thread rank1([&] {
        try {
            FdExchange ex;  // listens nowhere (no local peers), but takes part in the barriers
            ex.job_id = job;
            ex.rank = 1;
            ex.num_ranks = 2;
            ex.heap_bytes = 1 << 21;
            ex.store = &store;
            ex.timeout = 2000ms;
            exchange_fds(ex, -1);
        } catch (const std::exception&) {
            // It waits for rank 0 at the last barrier in vain.
        }
    });
    try {
        UniqueFd mine = memfd_with("secret heap");
        FdExchange ex;
        ex.job_id = job;
        ex.rank = 0;
        ex.num_ranks = 2;
        ex.local_peers = {1};
        ex.heap_bytes = 1 << 21;
        ex.store = &store;
        ex.timeout = 2000ms;
        exchange_fds(ex, mine.get());
        error = "(no error)";
    } catch (const std::exception& e) {
        error = e.what();
    }
    rank1.join();
    *child_got = 0;
    (void)::read(pipe_fds[0], child_got, 1);
    ::close(pipe_fds[0]);
    ::waitpid(child, nullptr, 0);
    return error;
}

TEST(RuntimeFdPassing, SenderRefusesForeignListener) {
    // Another process of this user squats rank 1's socket: its pid is not the one rank 1 published.
    char child_got = 0;
    pid_t squatter = 0;
    std::string e = exchange_with_squatter(-1, &child_got, &squatter);
    EXPECT_NE(e.find("rank 0 refuses to send its symmetric heap handle to rank 1"), std::string::npos) << e;
    EXPECT_NE(e.find("(pid " + std::to_string(squatter) + ")"), std::string::npos) << e;
    EXPECT_NE(e.find("pid " + std::to_string(::getpid()) + " (published by rank 1"), std::string::npos) << e;
    EXPECT_NE(child_got, 'F') << "the squatter received the heap descriptor";
    // Another user squats it (CI runs as root, which can become nobody): refused by uid.
    if (::geteuid() != 0) GTEST_SKIP() << "the other-user case needs root";
    e = exchange_with_squatter(65534, &child_got, &squatter);
    if (e.find("could not start: U") != std::string::npos) GTEST_SKIP() << "uid 65534 is not available here";
    EXPECT_NE(e.find("runs as uid 65534"), std::string::npos) << e;
    EXPECT_NE(e.find("expected uid 0 (this user)"), std::string::npos) << e;
    EXPECT_NE(child_got, 'F') << "the squatter received the heap descriptor";
}

}  // namespace
}  // namespace weft::detail
