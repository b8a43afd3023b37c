// SPDX-License-Identifier: MIT
// Unit tests for descriptor passing over abstract Unix sockets (ranks as threads, memfds as payload).
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <thread>

#include "weft/detail/fd_passing.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/in_process_store.hpp"

namespace weft::detail {
namespace {

using namespace std::chrono_literals;

std::string unique_job_id() {
    static int counter = 0;
    return "t" + std::to_string(::getpid()) + "x" + std::to_string(counter++);
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
                                  std::chrono::milliseconds timeout, int late_rank = -1) {
    InProcessStore store;
    std::vector<Outcome> out(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
            if (r == late_rank) std::this_thread::sleep_for(200ms);
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

TEST(RuntimeFdPassing, UnreachablePeerIsNamed) {
    // Rank 0 expects to exchange with rank 1, which (wrongly) expects no peer, so it neither listens nor sends.
    auto out = run_exchange(
        2, unique_job_id(), [](int r) { return r == 0 ? std::vector<int>{1} : std::vector<int>{}; }, 300ms);
    EXPECT_NE(out[0].error.find("rank 0 could not reach rank 1's heap socket"), std::string::npos) << out[0].error;
    EXPECT_NE(out[1].error, "");  // rank 1 then waits for rank 0 at the final barrier, and gives up too
}

TEST(RuntimeFdPassing, MissingSenderIsNamed) {
    // Rank 1 expects ranks 0 and 2, but rank 0 (which expects only rank 2) sends nothing to it; rank 1's
    // unexpected descriptor to rank 0 is dropped there.
    auto out = run_exchange(
        3, unique_job_id(),
        [](int r) {
            if (r == 0) return std::vector<int>{2};
            if (r == 1) return std::vector<int>{0, 2};
            return std::vector<int>{0, 1};
        },
        300ms);
    EXPECT_NE(out[1].error.find("rank 1 did not receive the symmetric heap handles of rank 0"), std::string::npos)
        << out[1].error;
}

}  // namespace
}  // namespace weft::detail
