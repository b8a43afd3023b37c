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

#include "rendezvous_socket.hpp"
#include "runtime_internal.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/store.hpp"

namespace weft::detail {

std::string heap_socket_name(const std::string& job_id, int rank) {
    return "weft-" + job_id + "-heap-" + std::to_string(rank);
}

namespace {

constexpr char kMagic[8] = {'W', 'E', 'F', 'T', 'F', 'D', '0', '1'};
constexpr size_t kJobIdBytes = 32;
// Connections that have sent part of a message at one time, beyond one per local peer (all of them may connect
// before this rank reads any); past that the oldest is dropped.
constexpr size_t kMaxIncoming = 64;

// The fixed message that travels with each descriptor.
struct Message {
    char magic[8];
    char job_id[kJobIdBytes];  // zero padded
    int32_t rank;
    int32_t reserved;
    uint64_t heap_bytes;
};

// Sockets in the abstract namespace (leading NUL): no file to clean up, and the name vanishes with the process.
using rendezvous::abstract_socket_address;
using rendezvous::errno_text;

UniqueFd listen_on(const std::string& name) {
    // Non-blocking: the receive loop accepts until EAGAIN.
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    WEFT_CHECK(fd.get() >= 0, "socket(AF_UNIX) failed: " << errno_text(errno));
    socklen_t length = 0;
    sockaddr_un addr = abstract_socket_address(name, &length);
    WEFT_CHECK(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), length) == 0,
               "could not bind the abstract socket '@" << name << "': " << errno_text(errno));
    WEFT_CHECK(::listen(fd.get(), SOMAXCONN) == 0, "listen on '@" << name << "' failed: " << errno_text(errno));
    return fd;
}

/// This process's pid namespace ("pid:[4026531836]"), or "" when /proc cannot say.
std::string pid_namespace() {
    char link[128] = {};
    const ssize_t n = ::readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
    return n > 0 ? std::string(link, static_cast<size_t>(n)) : std::string();
}

/// Who listens on a rank's heap socket and sends from it, as that rank publishes it through the store.
struct Listener {
    int64_t pid = 0;
    std::string pid_namespace;  // empty: unknown (the pid is then not compared)
};

std::string listener_key(const std::string& prefix, int rank) { return prefix + "/listener/" + std::to_string(rank); }

Bytes encode_listener() {
    const std::string text = std::to_string(::getpid()) + " " + pid_namespace();
    return Bytes(text.begin(), text.end());
}

Listener decode_listener(const Bytes& bytes, int rank) {
    const std::string text(bytes.begin(), bytes.end());
    const size_t space = text.find(' ');
    Listener l;
    try {
        WEFT_CHECK(space != std::string::npos && space > 0, "no pid");
        size_t used = 0;
        l.pid = std::stoll(text.substr(0, space), &used);
        WEFT_CHECK(used == space && l.pid > 0, "bad pid");
    } catch (const std::exception&) {
        WEFT_FAIL("rank " << rank << " published a malformed heap socket record '" << text.substr(0, 64) << "'");
    }
    l.pid_namespace = text.substr(space + 1);
    return l;
}

/// The pid to expect from `peer`'s end of a connection, or 0 when its pid namespace is not ours (or unknown):
/// SO_PEERCRED reports pids as seen from the reader's namespace.
int64_t expected_pid(const Listener& peer, const std::string& own_namespace) {
    return !own_namespace.empty() && peer.pid_namespace == own_namespace ? peer.pid : 0;
}

// The longest wait on sockets between two looks at FdExchange::stop_reason.
constexpr std::chrono::milliseconds kStopCheckSlice{250};

/// Throws weft::Error when `ex` has a stop reason: `what` is the wait it ends.
void stop_if_asked(const FdExchange& ex, const std::string& what) {
    if (!ex.stop_reason) return;
    if (const std::optional<std::string> why = ex.stop_reason()) {
        WEFT_FAIL("rank " << ex.rank << " stopped " << what << ": " << *why);
    }
}

/// Connects to a peer's heap socket without blocking (a full backlog refuses with EAGAIN), retrying until
/// `deadline` (or ex's stop reason).
UniqueFd connect_to(const FdExchange& ex, const std::string& name, std::chrono::steady_clock::time_point deadline) {
    socklen_t length = 0;
    sockaddr_un addr = abstract_socket_address(name, &length);
    auto next_stop_check = std::chrono::steady_clock::now() + kStopCheckSlice;
    for (int attempt = 0;; ++attempt) {
        UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
        WEFT_CHECK(fd.get() >= 0, "socket(AF_UNIX) failed: " << errno_text(errno));
        if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), length) == 0) return fd;
        const int err = errno;
        // The peer listens before the barrier that precedes this call, so a refusal is unexpected but retried
        // (a full backlog also refuses) until the deadline.
        if ((err != ECONNREFUSED && err != EAGAIN && err != EINTR) || std::chrono::steady_clock::now() > deadline) {
            WEFT_FAIL("could not connect to '@" << name << "': " << errno_text(err));
        }
        if (std::chrono::steady_clock::now() >= next_stop_check) {
            stop_if_asked(ex, "connecting to '@" + name + "'");
            next_stop_check = std::chrono::steady_clock::now() + kStopCheckSlice;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50, 1 << std::min(attempt, 5))));
    }
}

/// Refuses (weft::Error) unless the process listening at the other end of `sock` is ours to trust: the same
/// user, and the pid `peer` published when both share a pid namespace.
void check_listener(int sock, const FdExchange& ex, int peer, const Listener& published,
                    const std::string& own_namespace) {
    ucred cred{};
    socklen_t length = sizeof(cred);
    WEFT_CHECK(::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &length) == 0,
               "SO_PEERCRED on the connection to rank " << peer << "'s heap socket failed: " << errno_text(errno));
    const uid_t my_uid = ::geteuid();
    const int64_t pid = expected_pid(published, own_namespace);
    const bool uid_ok = cred.uid == my_uid;
    const bool pid_ok = pid == 0 || cred.pid == pid;
    if (uid_ok && pid_ok) return;
    WEFT_FAIL("rank " << ex.rank << " refuses to send its symmetric heap handle to rank " << peer << ": the process "
                      << "listening on '@" << heap_socket_name(ex.job_id, peer) << "' runs as uid " << cred.uid
                      << " (pid " << cred.pid << "), expected uid " << my_uid << " (this user)"
                      << (pid != 0 ? " and pid " + std::to_string(pid) + " (published by rank " +
                                         std::to_string(peer) + " through the store)"
                                   : std::string(" (the pid is not compared: another pid namespace)")));
}

/// Sends `message` with `fd` attached, waiting for buffer space no later than `deadline`.
void send_with_fd(int sock, const Message& message, int fd, std::chrono::steady_clock::time_point deadline) {
    const char* data = reinterpret_cast<const char*>(&message);
    size_t sent_bytes = 0;
    while (sent_bytes < sizeof(message)) {
        iovec iov{};
        iov.iov_base = const_cast<char*>(data + sent_bytes);
        iov.iov_len = sizeof(message) - sent_bytes;
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
        msghdr msg{};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        if (sent_bytes == 0) {  // the descriptor travels with the first byte
            msg.msg_control = control;
            msg.msg_controllen = sizeof(control);
            cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
            cmsg->cmsg_level = SOL_SOCKET;
            cmsg->cmsg_type = SCM_RIGHTS;
            cmsg->cmsg_len = CMSG_LEN(sizeof(int));
            std::memcpy(CMSG_DATA(cmsg), &fd, sizeof(int));
        }
        const ssize_t sent = ::sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (sent > 0) {
            sent_bytes += static_cast<size_t>(sent);
            continue;
        }
        if (sent < 0 && errno == EINTR) continue;
        if (sent < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            pollfd p{sock, POLLOUT, 0};
            const int rc = ::poll(&p, 1, static_cast<int>(remaining_ms(deadline).count()));
            if (rc == 0 && std::chrono::steady_clock::now() >= deadline) {
                WEFT_FAIL("sendmsg of a heap descriptor did not complete before the deadline");
            }
            continue;
        }
        WEFT_FAIL("sendmsg of a heap descriptor failed: " << (sent < 0 ? errno_text(errno) : "nothing sent"));
    }
}

/// One connection to this rank's heap socket, read without blocking until its message is whole.
struct Incoming {
    UniqueFd sock;
    ucred cred{};
    Message message{};
    size_t bytes = 0;
    std::vector<UniqueFd> fds;  // every descriptor that came with it, owned so none leaks
    bool control_truncated = false;
};

/// Reads what `in` has available. Returns false when the connection is finished with (closed, failed,
/// or whole); `*why` is empty when the message is whole, else says what went wrong.
bool read_incoming(Incoming& in, std::string* why) {
    while (in.bytes < sizeof(in.message)) {
        iovec iov{};
        iov.iov_base = reinterpret_cast<char*>(&in.message) + in.bytes;
        iov.iov_len = sizeof(in.message) - in.bytes;
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
        msghdr msg{};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control;
        msg.msg_controllen = sizeof(control);
        const ssize_t got = ::recvmsg(in.sock.get(), &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;  // more later
        // Take ownership of every descriptor that arrived before judging the message, so none leaks.
        for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
            const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (size_t i = 0; i < count; ++i) {
                int received = -1;
                std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
                in.fds.emplace_back(received);
            }
        }
        in.control_truncated = in.control_truncated || (msg.msg_flags & MSG_CTRUNC) != 0;
        if (got < 0) {
            *why = "recvmsg failed: " + errno_text(errno);
            return false;
        }
        if (got == 0) {
            *why = "closed after " + std::to_string(in.bytes) + " of " + std::to_string(sizeof(in.message)) + " bytes";
            return false;
        }
        in.bytes += static_cast<size_t>(got);
    }
    if (in.control_truncated || in.fds.size() != 1) {
        *why = "expected exactly one descriptor, got " + std::to_string(in.fds.size()) +
               (in.control_truncated ? " (and more were cut off)" : "");
    }
    return false;
}

}  // namespace

std::map<int, UniqueFd> exchange_fds(const FdExchange& ex, int own_fd) {
    WEFT_CHECK(ex.store != nullptr, "exchange_fds needs a store");
    WEFT_CHECK(ex.job_id.size() < kJobIdBytes, "job id '" << ex.job_id << "' is too long");
    const auto deadline = std::chrono::steady_clock::now() + ex.timeout;
    const std::string prefix = "weft/heap/fd/" + ex.job_id;
    const std::string own_namespace = pid_namespace();
    std::map<int, UniqueFd> received;

    // Every rank publishes who it is (pid, pid namespace) before the barrier, so that senders can check who
    // listens on a peer's socket and receivers who sent a message, before trusting either.
    ex.store->set(listener_key(prefix, ex.rank), encode_listener());
    UniqueFd listener;
    if (!ex.local_peers.empty()) listener = listen_on(heap_socket_name(ex.job_id, ex.rank));
    ex.store->barrier(prefix + "/listening", ex.rank, ex.num_ranks, remaining_ms(deadline));
    std::map<int, Listener> peers;
    for (int peer : ex.local_peers) {
        peers[peer] = decode_listener(ex.store->get(listener_key(prefix, peer), remaining_ms(deadline)), peer);
    }

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
            outgoing.push_back(connect_to(ex, heap_socket_name(ex.job_id, peer), deadline));
        } catch (const Error& e) {
            WEFT_FAIL("rank " << ex.rank << " could not reach rank " << peer
                              << "'s heap socket (is it still running?): " << e.what());
        }
        check_listener(outgoing.back().get(), ex, peer, peers.at(peer), own_namespace);
        send_with_fd(outgoing.back().get(), out, own_fd, deadline);
    }

    // Receive from every connection at once, without blocking on any: a connection that sends part of a
    // message and stalls holds up nobody, and every wait ends at the deadline.
    std::set<int> expected(ex.local_peers.begin(), ex.local_peers.end());
    const size_t max_incoming = kMaxIncoming + expected.size();
    const uid_t my_uid = ::geteuid();
    std::vector<Incoming> incoming;
    while (!expected.empty()) {
        if (std::chrono::steady_clock::now() >= deadline) {
            WEFT_FAIL("rank " << ex.rank << " did not receive the symmetric heap handles of "
                              << format_rank_list(std::vector<int>(expected.begin(), expected.end())) << " within "
                              << ex.timeout.count() << " ms"
                              << (incoming.empty() ? std::string()
                                                   : " (" + std::to_string(incoming.size()) +
                                                         " connection(s) had sent part of a message)"));
        }
        stop_if_asked(ex, "waiting for the symmetric heap handles of " +
                              format_rank_list(std::vector<int>(expected.begin(), expected.end())));
        std::vector<pollfd> fds;
        fds.push_back({listener.get(), POLLIN, 0});
        for (const Incoming& in : incoming) fds.push_back({in.sock.get(), POLLIN, 0});
        const int rc =
            ::poll(fds.data(), fds.size(), static_cast<int>(std::min(remaining_ms(deadline), kStopCheckSlice).count()));
        if (rc < 0 && errno != EINTR) WEFT_FAIL("poll on the heap socket failed: " << errno_text(errno));
        if (rc <= 0) continue;

        std::vector<Incoming> still;
        for (size_t i = 0; i < incoming.size(); ++i) {
            Incoming& in = incoming[i];
            if (fds[i + 1].revents == 0) {
                still.push_back(std::move(in));
                continue;
            }
            std::string why;
            if (read_incoming(in, &why)) {
                still.push_back(std::move(in));
                continue;
            }
            if (!why.empty()) {
                WEFT_LOG_WARN("dropped a malformed message on the heap socket from pid " << in.cred.pid << ": " << why);
                continue;
            }
            const Message& m = in.message;
            const bool same_job = std::memcmp(m.magic, kMagic, sizeof(kMagic)) == 0 &&
                                  std::memcmp(m.job_id, out.job_id, kJobIdBytes) == 0;
            if (!same_job || expected.count(m.rank) == 0) {
                WEFT_LOG_WARN("dropped a heap descriptor from pid " << in.cred.pid << " ("
                                                                    << (same_job ? "" : "another job, ")
                                                                    << "claimed rank " << m.rank << ")");
                continue;
            }
            const int64_t pid = expected_pid(peers.at(m.rank), own_namespace);
            if (pid != 0 && in.cred.pid != pid) {
                WEFT_LOG_WARN("dropped a heap descriptor claiming to come from rank "
                              << m.rank << ": it came from pid " << in.cred.pid << ", rank " << m.rank
                              << " published pid " << pid);
                continue;
            }
            WEFT_CHECK(m.heap_bytes == ex.heap_bytes, "rank " << m.rank << " sent a heap of " << m.heap_bytes
                                                              << " bytes; this rank's heap is " << ex.heap_bytes);
            expected.erase(m.rank);
            received.emplace(m.rank, std::move(in.fds.front()));
        }
        incoming = std::move(still);

        if (fds[0].revents != 0) {
            for (;;) {
                UniqueFd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
                if (conn.get() < 0) {
                    if (errno == EINTR || errno == ECONNABORTED) continue;
                    if (errno == EAGAIN || errno == EWOULDBLOCK) break;
                    WEFT_FAIL("accept on the heap socket failed: " << errno_text(errno));
                }
                Incoming in;
                socklen_t cred_length = sizeof(in.cred);
                if (::getsockopt(conn.get(), SOL_SOCKET, SO_PEERCRED, &in.cred, &cred_length) != 0 ||
                    in.cred.uid != my_uid) {
                    WEFT_LOG_WARN("dropped a connection to the heap socket from another user (uid "
                                  << in.cred.uid << ", pid " << in.cred.pid << ")");
                    continue;
                }
                if (incoming.size() >= max_incoming) {
                    WEFT_LOG_WARN("dropped a connection to the heap socket from pid "
                                  << incoming.front().cred.pid << ": " << max_incoming
                                  << " connections had sent part of a message");
                    incoming.erase(incoming.begin());
                }
                in.sock = std::move(conn);
                incoming.push_back(std::move(in));
            }
        }
    }
    // Every descriptor has arrived everywhere before any sending socket closes.
    ex.store->barrier(prefix + "/received", ex.rank, ex.num_ranks, remaining_ms(deadline));
    ex.store->erase(listener_key(prefix, ex.rank));
    return received;
}

}  // namespace weft::detail
