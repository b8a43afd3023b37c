// SPDX-License-Identifier: MIT
// The rendezvous store client (every rank) and make_tcp_store, which adds the server on rank 0.
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <thread>

#include "rendezvous_socket.hpp"
#include "runtime_internal.hpp"
#include "weft/detail/rendezvous_protocol.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/rendezvous.hpp"

namespace weft {

using namespace detail::rendezvous;  // NOLINT: this file implements the protocol
using detail::UniqueFd;
using std::chrono::milliseconds;

namespace {

/// wait_ready's answer when the deadline passed.
constexpr const char* kTimedOut = "timed out";

/// Waits until `fd` is ready for `events` or `deadline` passes. Returns an empty string when ready.
std::string wait_ready(int fd, short events, Clock::time_point deadline) {
    while (true) {
        pollfd p{fd, events, 0};
        int n = ::poll(&p, 1, poll_timeout_ms(deadline));
        if (n > 0) return {};
        if (n == 0) return kTimedOut;
        if (errno != EINTR) return "poll failed: " + errno_text(errno);
    }
}

std::string send_all(int fd, const Bytes& data, Clock::time_point deadline) {
    size_t done = 0;
    while (done < data.size()) {
        ssize_t sent = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (sent > 0) {
            done += static_cast<size_t>(sent);
            continue;
        }
        if (sent < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            return "send failed: " + errno_text(errno);
        }
        if (std::string e = wait_ready(fd, POLLOUT, deadline); !e.empty()) return "send " + e;
    }
    return {};
}

std::string recv_exact(int fd, uint8_t* out, size_t bytes, Clock::time_point deadline) {
    size_t done = 0;
    while (done < bytes) {
        ssize_t got = ::recv(fd, out + done, bytes - done, MSG_DONTWAIT);
        if (got > 0) {
            done += static_cast<size_t>(got);
            continue;
        }
        if (got == 0) return "the server closed the connection";
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return "recv failed: " + errno_text(errno);
        if (std::string e = wait_ready(fd, POLLIN, deadline); !e.empty()) return "reply " + e;
    }
    return {};
}

/// Reads one response frame; returns an error text on failure (the connection is then unusable). `malformed`, when
/// given, is set when the bytes came but are not a frame of this protocol version (another program, or a store of
/// another rendezvous protocol version, answered: trying again gets the same answer).
std::string recv_response(int fd, const Limits& limits, Clock::time_point deadline, Message* message,
                          bool* malformed = nullptr) {
    Bytes frame(kHeaderBytes);
    if (std::string e = recv_exact(fd, frame.data(), kHeaderBytes, deadline); !e.empty()) return e;
    Header header;
    DecodeResult r = decode_header(frame.data(), frame.size(), Role::kResponse, limits, &header);
    if (r.status != DecodeStatus::kComplete) {
        if (malformed != nullptr) *malformed = true;
        return "malformed reply: " + r.error;
    }
    frame.resize(r.frame_bytes);
    if (std::string e = recv_exact(fd, frame.data() + kHeaderBytes, r.frame_bytes - kHeaderBytes, deadline);
        !e.empty()) {
        return e;
    }
    r = decode_frame(frame.data(), frame.size(), Role::kResponse, limits, message);
    if (r.status != DecodeStatus::kComplete) return "malformed reply: " + r.error;
    return {};
}

std::string error_text(const Message& m) { return std::string(m.value.begin(), m.value.end()); }

/// The longest wait of one connection attempt to one address (then the next address, or the next round).
constexpr auto kConnectAttempt = std::chrono::seconds(5);
/// How often the waits of connecting ask the embedding's wait check (wait_interrupted).
constexpr auto kInterruptSlice = std::chrono::milliseconds(250);

/// Asks the embedding's wait check (wait_interrupted; Ctrl-C in Python): its reason throws detail::WaitInterrupted
/// naming the store being connected to, `endpoint`.
void stop_connecting_if_interrupted(const std::string& endpoint) {
    if (std::optional<std::string> why = wait_interrupted()) {
        detail::throw_wait_interrupted("rendezvous: connecting to the store at " + endpoint + " stopped: " + *why);
    }
}

/// wait_ready in slices of kInterruptSlice, asking the embedding's wait check after each that ran out. For the waits
/// of connecting only: a request's reply is read whole or the connection is lost, so its waits are not cut short.
std::string wait_ready_or_stop(int fd, short events, Clock::time_point deadline, const std::string& endpoint) {
    while (true) {
        std::string e = wait_ready(fd, events, std::min(deadline, Clock::now() + kInterruptSlice));
        if (e != kTimedOut || Clock::now() >= deadline) return e;
        stop_connecting_if_interrupted(endpoint);
    }
}

/// Connects to host:port, retrying refused or unreachable attempts until `deadline` (rank 0 may be late). Throws
/// weft::Error naming the reason when the embedding's wait check (wait_interrupted), asked between two attempts and
/// every 250 ms of one, answers.
UniqueFd connect_with_retry(const std::string& host, int port, Clock::time_point deadline, std::string* last_error) {
    auto backoff = std::chrono::milliseconds(10);
    std::string port_text = std::to_string(port);
    while (true) {
        addrinfo hints{};
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = AI_NUMERICSERV;
        addrinfo* list = nullptr;
        int gai = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &list);
        if (gai != 0) {
            *last_error = std::string("cannot resolve '") + host + "': " + gai_strerror(gai);
        }
        for (addrinfo* ai = gai == 0 ? list : nullptr; ai != nullptr; ai = ai->ai_next) {
            UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
            if (!fd) {
                *last_error = "socket failed: " + errno_text(errno);
                continue;
            }
            int rc = ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen);
            if (rc != 0 && errno == EINPROGRESS) {
                // One attempt waits at most kConnectAttempt: an address whose packets are dropped (a firewalled IPv6
                // address listed before the IPv4 one) must not take the whole deadline from the next address.
                std::string e;
                try {
                    e = wait_ready_or_stop(fd.get(), POLLOUT, std::min(deadline, Clock::now() + kConnectAttempt),
                                           host + ":" + port_text);
                } catch (...) {
                    ::freeaddrinfo(list);
                    throw;
                }
                if (!e.empty()) {
                    *last_error = describe_address(ai->ai_addr) + ": connect " + e;
                    continue;
                }
                int err = 0;
                socklen_t len = sizeof(err);
                ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
                rc = err == 0 ? 0 : -1;
                errno = err;
            }
            if (rc == 0) {
                ::freeaddrinfo(list);
                make_nonblocking(fd.get());
                return fd;
            }
            *last_error = describe_address(ai->ai_addr) + ": " + errno_text(errno);
        }
        if (list != nullptr) ::freeaddrinfo(list);
        stop_connecting_if_interrupted(host + ":" + port_text);
        if (Clock::now() >= deadline) return UniqueFd();
        std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
        backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
    }
}

/// Connects to the abstract Unix socket "@name", retrying until `deadline` while nobody listens there yet
/// (ECONNREFUSED) or its backlog is full (EAGAIN). Throws weft::Error as connect_with_retry does when interrupted.
UniqueFd connect_unix_with_retry(const std::string& name, Clock::time_point deadline, std::string* last_error) {
    socklen_t length = 0;
    const sockaddr_un addr = abstract_socket_address(name, &length);
    auto backoff = std::chrono::milliseconds(10);
    while (true) {
        UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
        if (!fd) {
            *last_error = "socket(AF_UNIX) failed: " + errno_text(errno);
        } else if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), length) == 0) {
            return fd;
        } else {
            *last_error = "@" + name + ": " + errno_text(errno);
        }
        stop_connecting_if_interrupted("@" + name);
        if (Clock::now() >= deadline) return UniqueFd();
        std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
        backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
    }
}

/// Anyone may bind an abstract name first: before anything (a HELLO carries the token) goes to the process
/// listening on "@name", it must be of this process's user.
void check_unix_server(int fd, const std::string& name, int rank) {
    std::string why;
    std::optional<PeerCredentials> cred = unix_peer_credentials(fd, &why);
    WEFT_CHECK(cred, "rendezvous: rank " << rank << " cannot tell who listens on the store socket '@" << name
                                         << "' (" << why << "); nothing was sent to it");
    const uint32_t own = static_cast<uint32_t>(::geteuid());
    WEFT_CHECK(cred->uid == own, "rendezvous: rank " << rank << ": the store socket '@" << name << "' is held by pid "
                                                     << cred->pid << " of uid " << cred->uid
                                                     << ", not by this user (uid " << own
                                                     << "); nothing was sent to it (another user's process took "
                                                        "the name before this job's rank 0)");
}

class TcpStoreClient final : public Store {
public:
    TcpStoreClient(const RendezvousOptions& options, std::unique_ptr<TcpStoreServer> server)
        : server_(std::move(server)),
          options_(capped(options)),
          limits_{options.max_key_bytes, options.max_value_bytes},
          endpoint_(options.unix_socket.empty() ? options.host + ":" + std::to_string(options.port)
                                                : "@" + options.unix_socket) {
        // Connect and HELLO, again from the start when the connection is lost before the reply: the server
        // closes connections that wait too long for HELLO or that newer ones push out of its pending set.
        // A refusal (an ERROR reply) is final.
        const Clock::time_point deadline = Clock::now() + options_.timeout;
        const Bytes hello = encode_frame(make_hello(options.token, options.rank), limits_);
        std::string last_error = "no attempt";
        auto backoff = milliseconds(10);
        for (int attempt = 1;; ++attempt) {
            const bool unix_socket = !options.unix_socket.empty();
            fd_ = unix_socket ? connect_unix_with_retry(options.unix_socket, deadline, &last_error)
                              : connect_with_retry(options.host, options.port, deadline, &last_error);
            WEFT_CHECK(fd_, "rendezvous: rank " << options.rank << " could not connect to the store at " << endpoint_
                                               << " within " << options.timeout.count() << " ms ("
                                               << (unix_socket ? "is rank 0 of this job running?"
                                                               : "is rank 0 running, and is this its address?")
                                               << "): " << last_error);
            if (unix_socket) check_unix_server(fd_.get(), options.unix_socket, options.rank);
            std::string e = send_all(fd_.get(), hello, deadline);
            Message reply;
            bool malformed = false;
            // The reply's first byte awaited in slices (rank 0 may be slow to answer); the rest follows it.
            if (e.empty()) {
                e = wait_ready_or_stop(fd_.get(), POLLIN, deadline, endpoint_);
                if (!e.empty()) e = "reply " + e;
            }
            if (e.empty()) e = recv_response(fd_.get(), limits_, deadline, &reply, &malformed);
            WEFT_CHECK(!malformed, "rendezvous: rank " << options.rank << " reached " << endpoint_
                                                       << ", which does not answer as a weft store of this version ("
                                                       << e << "): another program on that address, or a weft "
                                                       << "whose rendezvous protocol differs");
            if (e.empty()) {
                WEFT_CHECK(reply.type != MsgType::kError, "rendezvous: the store at " << endpoint_ << " rejected rank "
                                                                                      << options.rank << ": "
                                                                                      << error_text(reply));
                expect(reply, MsgType::kOk, "connect", "");
                break;
            }
            fd_.reset();
            last_error = "HELLO attempt " + std::to_string(attempt) + ": " + e;
            WEFT_CHECK(Clock::now() < deadline, "rendezvous: rank " << options.rank
                                                                    << " could not complete HELLO with the store at "
                                                                    << endpoint_ << " within " << options.timeout.count()
                                                                    << " ms: " << last_error);
            stop_connecting_if_interrupted(endpoint_);
            WEFT_LOG_DEBUG("rendezvous: rank " << options.rank << " retrying HELLO with " << endpoint_ << ": " << e);
            std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
            backoff = std::min(backoff * 2, milliseconds(500));
        }
        WEFT_LOG_DEBUG("rendezvous: connected to the store at " << endpoint_);
    }

    ~TcpStoreClient() override { fd_.reset(); }  // before server_ (declared first, destroyed last)

    void set(const std::string& key, const Bytes& value) override {
        Message reply = call(make_set(key, value), reply_deadline(), "set", key);
        expect(reply, MsgType::kOk, "set", key);
    }

    Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
        WEFT_CHECK(timeout.count() >= 0, "store get('" << key << "'): timeout must be >= 0, got " << timeout.count()
                                                       << " ms");
        timeout = std::min(timeout, milliseconds(kMaxWaitMs));
        // The server answers at `timeout`; the reply bound beyond it only covers a server that stopped.
        Message reply =
            call(make_get(key, static_cast<uint64_t>(timeout.count())), reply_deadline() + timeout, "get", key);
        if (reply.type == MsgType::kTimeout) {
            WEFT_FAIL("store get('" << key << "') timed out after " << timeout.count()
                                    << " ms: no rank set the key (rank " << options_.rank << ", store at "
                                    << endpoint_ << ")");
        }
        expect(reply, MsgType::kOk, "get", key);
        return std::move(reply.value);
    }

    int64_t add(const std::string& key, int64_t delta) override {
        Message reply = call(make_add(key, delta), reply_deadline(), "add", key);
        expect(reply, MsgType::kOk, "add", key);
        if (reply.value.size() != 8) broken("add", key, "malformed reply: counter of " + std::to_string(reply.value.size()) + " bytes");
        return decode_i64(reply.value);
    }

    bool check(const std::string& key) override {
        Message reply = call(make_check(key), reply_deadline(), "check", key);
        expect(reply, MsgType::kOk, "check", key);
        if (reply.value.size() != 1 || reply.value[0] > 1) broken("check", key, "malformed reply to check");
        return reply.value[0] == 1;
    }

    void erase(const std::string& key) override {
        Message reply = call(make_erase(key), reply_deadline(), "erase", key);
        expect(reply, MsgType::kOk, "erase", key);
    }

private:
    static RendezvousOptions capped(RendezvousOptions o) {
        o.timeout = std::min(o.timeout, milliseconds(kMaxWaitMs));
        // Not capped by the timeout: make_launch_store connects with what is left of its own (a few ms once rank 0
        // came late), which must not become the bound of every later call.
        o.reply_timeout = o.reply_timeout.count() > 0 ? std::min(o.reply_timeout, milliseconds(kMaxWaitMs)) : o.timeout;
        return o;
    }

    Clock::time_point reply_deadline() const { return Clock::now() + options_.reply_timeout; }

    /// One request and its reply, serialised with other threads of this process.
    Message call(const Message& request, Clock::time_point deadline, const char* op, const std::string& key) {
        // Encoding first: a key or value over the limits is the caller's error and leaves the connection usable.
        Bytes frame;
        try {
            frame = encode_frame(request, limits_);
        } catch (const Error& e) {
            WEFT_FAIL("store " << op << "('" << key.substr(0, 64) << (key.size() > 64 ? "...": "")
                               << "') rejected before sending: " << e.what());
        }
        std::lock_guard<std::mutex> lock(mutex_);
        return exchange_frame(frame, deadline, op, key);
    }

    Message exchange_frame(const Bytes& frame, Clock::time_point deadline, const char* op, const std::string& key) {
        WEFT_CHECK(broken_.empty(), "store " << op << "('" << key << "'): the connection to the store at " << endpoint_
                                             << " was lost earlier (rank " << options_.rank << "): " << broken_);
        std::string e = send_all(fd_.get(), frame, deadline);
        Message reply;
        if (e.empty()) e = recv_response(fd_.get(), limits_, deadline, &reply);
        if (e == "reply timed out") {
            e += ": nothing came " + std::to_string(options_.reply_timeout.count()) +
                 " ms past when it was due (the store's host stopped, or the network to it is down)";
        }
        if (!e.empty()) broken(op, key, e);
        return reply;
    }

    void expect(const Message& reply, MsgType type, const char* op, const std::string& key) {
        if (reply.type == type) return;
        if (reply.type == MsgType::kError) {
            WEFT_FAIL("store " << op << "('" << key << "') failed on the server (rank " << options_.rank << ", store at "
                               << endpoint_ << "): " << error_text(reply));
        }
        broken(op, key, std::string("unexpected reply ") + type_name(static_cast<uint16_t>(reply.type)));
    }

    [[noreturn]] void broken(const char* op, const std::string& key, const std::string& why) {
        broken_ = why;
        fd_.reset();
        WEFT_FAIL("store " << op << "('" << key << "') failed (rank " << options_.rank << ", store at " << endpoint_
                           << "): " << why);
    }

    std::unique_ptr<TcpStoreServer> server_;  // rank 0 only; declared first so it is destroyed last
    RendezvousOptions options_;
    Limits limits_;
    std::string endpoint_;
    UniqueFd fd_;
    std::mutex mutex_;
    std::string broken_;  // non-empty once the connection failed; every later call throws it
};

void check_common(const RendezvousOptions& o) {
    WEFT_CHECK(!o.host.empty() || !o.unix_socket.empty(), "RendezvousOptions.host (MASTER_ADDR) must not be empty");
    WEFT_CHECK(o.num_ranks >= 1, "RendezvousOptions.num_ranks must be at least 1, got " << o.num_ranks);
    WEFT_CHECK(o.rank >= 0 && o.rank < o.num_ranks,
               "RendezvousOptions.rank must be in [0, num_ranks=" << o.num_ranks << "), got " << o.rank);
    WEFT_CHECK(o.port >= 0 && o.port <= 65535, "RendezvousOptions.port must be in [0, 65535], got " << o.port);
    WEFT_CHECK(o.timeout.count() > 0, "RendezvousOptions.timeout must be positive, got " << o.timeout.count() << " ms");
    WEFT_CHECK(o.reply_timeout.count() >= 0,
               "RendezvousOptions.reply_timeout must be >= 0 (0: timeout), got " << o.reply_timeout.count() << " ms");
    // The token travels as the HELLO's key (never printed: it is the job's secret).
    WEFT_CHECK(o.token.size() <= o.max_key_bytes, "RendezvousOptions.token (WEFT_JOB_TOKEN) must be at most "
                                                      << o.max_key_bytes << " bytes, got " << o.token.size());
}

/// Where rank 0's own client connects when the server listens on a wildcard address.
std::string connect_host(const std::string& host) {
    if (host == "0.0.0.0" || host == "*") return "127.0.0.1";
    if (host == "::" || host == "[::]") return "::1";
    return host;
}

}  // namespace

std::unique_ptr<Store> connect_tcp_store(const RendezvousOptions& options) {
    check_common(options);
    WEFT_CHECK(options.port != 0 || !options.unix_socket.empty(),
               "RendezvousOptions.port must name the server's port, got 0");
    return std::make_unique<TcpStoreClient>(options, nullptr);
}

std::unique_ptr<Store> make_tcp_store(const RendezvousOptions& options) {
    check_common(options);
    WEFT_CHECK(options.port != 0 || options.num_ranks == 1 || !options.unix_socket.empty(),
               "RendezvousOptions.port is 0 (rank 0 picks a free port), but then the other "
                   << options.num_ranks - 1 << " rank(s) cannot find it: set RendezvousOptions.port");
    if (options.rank != 0) return connect_tcp_store(options);
    auto server = std::make_unique<TcpStoreServer>(options);
    RendezvousOptions client_options = options;
    if (options.unix_socket.empty()) {
        client_options.host = connect_host(options.host);
        client_options.port = server->port();
    }
    return std::make_unique<TcpStoreClient>(client_options, std::move(server));
}

}  // namespace weft
