// SPDX-License-Identifier: MIT
// Descriptor passing between the processes of one host (see fd_passing.hpp).
#include "weft/detail/fd_passing.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <set>
#include <thread>

#include "runtime_internal.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/store.hpp"

namespace weft::detail {

std::string heap_socket_name(const std::string& job_id, int rank) {
    return "weft-" + job_id + "-heap-" + std::to_string(rank);
}

void UniqueFd::reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
}

namespace {

constexpr char kMagic[8] = {'W', 'E', 'F', 'T', 'F', 'D', '0', '1'};
constexpr size_t kJobIdBytes = 32;

// The fixed message that travels with each descriptor.
struct Message {
    char magic[8];
    char job_id[kJobIdBytes];  // zero padded
    int32_t rank;
    int32_t reserved;
    uint64_t heap_bytes;
};

// Abstract-namespace address (leading NUL): no file to clean up, and it vanishes with the process.
sockaddr_un socket_address(const std::string& name, socklen_t* length) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    WEFT_CHECK(name.size() + 1 <= sizeof(addr.sun_path), "socket name '" << name << "' is too long");
    addr.sun_path[0] = '\0';
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    *length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    return addr;
}

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

UniqueFd listen_on(const std::string& name) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    WEFT_CHECK(fd.get() >= 0, "socket(AF_UNIX) failed: " << errno_text(errno));
    socklen_t length = 0;
    sockaddr_un addr = socket_address(name, &length);
    WEFT_CHECK(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), length) == 0,
               "could not bind the abstract socket '@" << name << "': " << errno_text(errno));
    WEFT_CHECK(::listen(fd.get(), SOMAXCONN) == 0, "listen on '@" << name << "' failed: " << errno_text(errno));
    return fd;
}

UniqueFd connect_to(const std::string& name, std::chrono::steady_clock::time_point deadline) {
    socklen_t length = 0;
    sockaddr_un addr = socket_address(name, &length);
    for (int attempt = 0;; ++attempt) {
        UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
        WEFT_CHECK(fd.get() >= 0, "socket(AF_UNIX) failed: " << errno_text(errno));
        if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), length) == 0) return fd;
        const int err = errno;
        // The peer listens before the barrier that precedes this call, so a refusal is unexpected but retried
        // (a full backlog also refuses) until the deadline.
        if ((err != ECONNREFUSED && err != EAGAIN && err != EINTR) || std::chrono::steady_clock::now() > deadline) {
            WEFT_FAIL("could not connect to '@" << name << "': " << errno_text(err));
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50, 1 << std::min(attempt, 5))));
    }
}

void send_with_fd(int sock, const Message& message, int fd) {
    iovec iov{};
    iov.iov_base = const_cast<Message*>(&message);
    iov.iov_len = sizeof(message);
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
    for (;;) {
        ssize_t sent = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
        if (sent == static_cast<ssize_t>(sizeof(message))) return;
        if (sent < 0 && errno == EINTR) continue;
        WEFT_FAIL("sendmsg of a heap descriptor failed: " << (sent < 0 ? errno_text(errno) : "short write"));
    }
}

bool wait_readable(int fd, std::chrono::steady_clock::time_point deadline) {
    for (;;) {
        pollfd p{fd, POLLIN, 0};
        const int rc = ::poll(&p, 1, static_cast<int>(remaining_ms(deadline).count()));
        if (rc > 0) return true;
        if (rc < 0 && errno != EINTR) WEFT_FAIL("poll failed: " << errno_text(errno));
        if (rc == 0 && std::chrono::steady_clock::now() >= deadline) return false;
    }
}

// Receives one message and the descriptors that came with it. Returns false (and closes any descriptor)
// when the message is malformed; a valid message leaves its descriptor in *fd.
bool receive_message(int sock, std::chrono::steady_clock::time_point deadline, Message* message, UniqueFd* fd,
                     std::string* why) {
    if (!wait_readable(sock, deadline)) {
        *why = "no message before the deadline";
        return false;
    }
    iovec iov{};
    iov.iov_base = message;
    iov.iov_len = sizeof(*message);
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t got = 0;
    do {
        got = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
    } while (got < 0 && errno == EINTR);
    // Take ownership of every descriptor that arrived before judging the message, so none leaks.
    int fds[4] = {-1, -1, -1, -1};
    size_t num_fds = 0;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count && num_fds < 4; ++i) {
            std::memcpy(&fds[num_fds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        }
    }
    const bool ok_size = got == static_cast<ssize_t>(sizeof(*message));
    const bool ok_fds = (msg.msg_flags & MSG_CTRUNC) == 0 && num_fds == 1;
    if (ok_size && ok_fds) {
        fd->reset(fds[0]);
        return true;
    }
    if (!ok_size) {
        *why = got < 0 ? "recvmsg failed: " + errno_text(errno) : "message of " + std::to_string(got) + " bytes";
    } else {
        *why = "expected exactly one descriptor, got " + std::to_string(num_fds);
    }
    for (size_t i = 0; i < num_fds; ++i) ::close(fds[i]);
    return false;
}

}  // namespace

std::map<int, UniqueFd> exchange_fds(const FdExchange& ex, int own_fd) {
    WEFT_CHECK(ex.store != nullptr, "exchange_fds needs a store");
    WEFT_CHECK(ex.job_id.size() < kJobIdBytes, "job id '" << ex.job_id << "' is too long");
    const auto deadline = std::chrono::steady_clock::now() + ex.timeout;
    const std::string prefix = "weft/heap/fd/" + ex.job_id;
    std::map<int, UniqueFd> received;

    UniqueFd listener;
    if (!ex.local_peers.empty()) listener = listen_on(heap_socket_name(ex.job_id, ex.rank));
    ex.store->barrier(prefix + "/listening", ex.rank, ex.num_ranks, remaining_ms(deadline));

    Message out{};
    std::memcpy(out.magic, kMagic, sizeof(kMagic));
    std::memcpy(out.job_id, ex.job_id.data(), ex.job_id.size());
    out.rank = ex.rank;
    out.heap_bytes = ex.heap_bytes;
    // Sends never wait for the receiver (the message and descriptor queue in the socket), so every rank can
    // send to all its peers first and receive afterwards without a deadlock.
    std::vector<UniqueFd> outgoing;
    for (int peer : ex.local_peers) {
        try {
            outgoing.push_back(connect_to(heap_socket_name(ex.job_id, peer), deadline));
        } catch (const Error& e) {
            WEFT_FAIL("rank " << ex.rank << " could not reach rank " << peer
                              << "'s heap socket (is it still running?): " << e.what());
        }
        send_with_fd(outgoing.back().get(), out, own_fd);
    }

    std::set<int> expected(ex.local_peers.begin(), ex.local_peers.end());
    const uid_t my_uid = ::getuid();
    while (!expected.empty()) {
        if (!wait_readable(listener.get(), deadline)) {
            WEFT_FAIL("rank " << ex.rank << " did not receive the symmetric heap handles of "
                              << format_rank_list(std::vector<int>(expected.begin(), expected.end())) << " within "
                              << ex.timeout.count() << " ms");
        }
        UniqueFd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (conn.get() < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
            WEFT_FAIL("accept on the heap socket failed: " << errno_text(errno));
        }
        ucred cred{};
        socklen_t cred_length = sizeof(cred);
        if (::getsockopt(conn.get(), SOL_SOCKET, SO_PEERCRED, &cred, &cred_length) != 0 || cred.uid != my_uid) {
            WEFT_LOG_WARN("dropped a connection to the heap socket from another user (uid " << cred.uid << ", pid "
                                                                                            << cred.pid << ")");
            continue;
        }
        Message in{};
        UniqueFd fd;
        std::string why;
        // A peer sends as soon as it connects: a silent connection must not hold up the others for long.
        const auto message_deadline = std::min(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(2));
        if (!receive_message(conn.get(), message_deadline, &in, &fd, &why)) {
            WEFT_LOG_WARN("dropped a malformed message on the heap socket from pid " << cred.pid << ": " << why);
            continue;
        }
        const bool same_job =
            std::memcmp(in.magic, kMagic, sizeof(kMagic)) == 0 && std::memcmp(in.job_id, out.job_id, kJobIdBytes) == 0;
        if (!same_job || expected.count(in.rank) == 0) {
            WEFT_LOG_WARN("dropped a heap descriptor from pid " << cred.pid << " (" << (same_job ? "" : "another job, ")
                                                                << "claimed rank " << in.rank << ")");
            continue;
        }
        WEFT_CHECK(in.heap_bytes == ex.heap_bytes, "rank " << in.rank << " sent a heap of " << in.heap_bytes
                                                           << " bytes; this rank's heap is " << ex.heap_bytes);
        expected.erase(in.rank);
        received.emplace(in.rank, std::move(fd));
    }
    // Every descriptor has arrived everywhere before any sending socket closes.
    ex.store->barrier(prefix + "/received", ex.rank, ex.num_ranks, remaining_ms(deadline));
    return received;
}

}  // namespace weft::detail
