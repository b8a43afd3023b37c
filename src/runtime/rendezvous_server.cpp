// SPDX-License-Identifier: MIT
// The rendezvous store server: one poll() thread serving every connection, so store operations never race.
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "rendezvous_socket.hpp"
#include "weft/detail/rendezvous_protocol.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/rendezvous.hpp"

namespace weft {

using namespace detail::rendezvous;  // NOLINT: this file implements the protocol
using detail::UniqueFd;

namespace {

constexpr size_t kReadChunkBytes = 64 * 1024;
constexpr int kMaxReadsPerWakeup = 16;  // then let other connections have a turn
// Accepts per wakeup, at most half the pending bound: a connection accepted in one round is read (its HELLO
// served) at the start of the next, before newer connections can push it out of the pending set.
constexpr int kMinAcceptsPerWakeup = 1;

/// Parses a counter stored by add(): optional '-' then decimal digits, nothing else.
std::optional<int64_t> parse_counter(const Bytes& value) {
    const char* begin = reinterpret_cast<const char*>(value.data());
    const char* end = begin + value.size();
    int64_t v = 0;
    auto [ptr, ec] = std::from_chars(begin, end, v);
    if (value.empty() || ec != std::errc() || ptr != end) return std::nullopt;
    return v;
}

/// Empties `buffer`, returning its memory when a large frame made it grow (so idle clients hold little).
void release_if_large(Bytes& buffer) {
    if (buffer.capacity() > 4 * kReadChunkBytes) {
        Bytes().swap(buffer);
    } else {
        buffer.clear();
    }
}

Bytes counter_bytes(int64_t v) {
    std::string text = std::to_string(v);
    return Bytes(text.begin(), text.end());
}

}  // namespace

struct TcpStoreServer::Impl {
    struct PendingGet {
        std::string key;
        Clock::time_point deadline;
    };
    struct Connection {
        UniqueFd fd;
        std::string peer;
        int rank = -1;  // from HELLO
        bool authenticated = false;
        bool dead = false;
        Clock::time_point hello_deadline;
        Bytes in;
        size_t in_offset = 0;
        Bytes out;
        size_t out_offset = 0;
        std::optional<PendingGet> pending;

        size_t unsent() const { return out.size() - out_offset; }
    };

    RendezvousOptions options;
    Limits limits;
    uint32_t owner_uid = 0;  // the only user a server without a token serves
    UniqueFd listen_fd;
    UniqueFd wake_fd;
    int port = 0;
    std::string address;
    std::thread thread;
    std::atomic<bool> stop{false};
    std::mutex adopted_mutex;
    std::vector<UniqueFd> adopted;  // handed over by adopt_connection(), taken by the server thread

    std::atomic<uint64_t> accepted{0}, authenticated{0}, rejected{0}, evicted{0}, errors{0}, requests{0},
        open_connections{0}, keys{0}, buffered_bytes{0};

    // Owned by the server thread.
    std::map<uint64_t, Connection> connections;
    uint64_t next_id = 1;
    std::unordered_map<std::string, Bytes> data;
    std::unordered_map<std::string, std::vector<uint64_t>> waiters;
    Clock::time_point accept_paused_until{};

    void listen_on(const RendezvousOptions& opts);
    void listen_on_unix(const std::string& name);
    void run();
    void loop_once();
    void accept_all();
    void take_adopted();
    void add_connection(UniqueFd fd, std::string peer);
    void serve(uint64_t id, Connection& c, short revents);
    void authenticate(Connection& c, const Message& hello);
    void read_from(uint64_t id, Connection& c);
    void process_frames(uint64_t id, Connection& c);
    void handle(uint64_t id, Connection& c, Message& m);
    void respond(Connection& c, const Message& m);
    void flush(Connection& c);
    void reject(Connection& c, const std::string& why);
    void fail(Connection& c, const char* what, const std::exception* e);
    void drop_waiter(uint64_t id, Connection& c);
    void wake_waiters(const std::string& key);
    void sweep();

    std::string who(const Connection& c) const {
        return c.peer + (c.rank >= 0 ? " (rank " + std::to_string(c.rank) + ")" : std::string());
    }
};

namespace {

/// Who holds the abstract socket `name` (for the error when binding it failed), or "" when nobody answers.
std::string describe_holder(const std::string& name) {
    socklen_t length = 0;
    sockaddr_un addr = abstract_socket_address(name, &length);
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd || ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), length) != 0) return {};
    std::string why;
    std::optional<PeerCredentials> cred = unix_peer_credentials(fd.get(), &why);
    if (!cred) return {};
    const uint32_t own = static_cast<uint32_t>(::geteuid());
    return " (it is held by pid " + std::to_string(cred->pid) + " of uid " + std::to_string(cred->uid) +
           (cred->uid == own ? std::string(", this user: another store of the same name is still open")
                             : ", another user: that process took the name first; this user is uid " +
                                   std::to_string(own)) +
           ")";
}

}  // namespace

/// An abstract Unix-domain socket: no file, no port; peers are told apart by SO_PEERCRED.
void TcpStoreServer::Impl::listen_on_unix(const std::string& name) {
    socklen_t length = 0;
    sockaddr_un addr = abstract_socket_address(name, &length);
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    WEFT_CHECK(fd, "rendezvous: socket(AF_UNIX) failed: " << errno_text(errno));
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), length) != 0) {
        const int err = errno;
        WEFT_FAIL("rendezvous: cannot bind the store socket '@" << name << "': " << errno_text(err)
                                                                << (err == EADDRINUSE ? describe_holder(name) : ""));
    }
    WEFT_CHECK(::listen(fd.get(), SOMAXCONN) == 0,
               "rendezvous: listen() on '@" << name << "' failed: " << errno_text(errno));
    listen_fd = std::move(fd);
    address = "@" + name;
    port = 0;
    make_nonblocking(listen_fd.get());
}

void TcpStoreServer::Impl::listen_on(const RendezvousOptions& opts) {
    if (!opts.unix_socket.empty()) return listen_on_unix(opts.unix_socket);
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* list = nullptr;
    std::string port_text = std::to_string(opts.port);
    int gai = ::getaddrinfo(opts.host.c_str(), port_text.c_str(), &hints, &list);
    WEFT_CHECK(gai == 0, "rendezvous: cannot resolve the listen host '" << opts.host << "' (RendezvousOptions.host / "
                                                                         << "MASTER_ADDR): " << gai_strerror(gai));
    std::string last_error = "no address";
    for (addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
        UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
        if (!fd) {
            last_error = errno_text(errno);
            continue;
        }
        int one = 1;
        ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
            last_error = describe_address(ai->ai_addr) + ": " + errno_text(errno);
            continue;
        }
        if (!is_loopback(ai->ai_addr) && opts.token.empty()) {
            std::string where = describe_address(ai->ai_addr);
            ::freeaddrinfo(list);
            WEFT_FAIL("rendezvous: listening on the non-loopback address "
                      << where << " requires a job token (RendezvousOptions.token / WEFT_JOB_TOKEN), but it is empty");
        }
        listen_fd = std::move(fd);
        break;
    }
    ::freeaddrinfo(list);
    WEFT_CHECK(listen_fd, "rendezvous: cannot bind " << opts.host << ":" << opts.port << ": " << last_error
                                                     << " (address in use: another process holds the port; cannot "
                                                        "assign the address: it is not one of this host's)");
    WEFT_CHECK(::listen(listen_fd.get(), SOMAXCONN) == 0,
               "rendezvous: listen() on " << opts.host << ":" << opts.port << " failed: " << errno_text(errno));
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    WEFT_CHECK(::getsockname(listen_fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) == 0,
               "rendezvous: getsockname failed: " << errno_text(errno));
    address = describe_address(reinterpret_cast<sockaddr*>(&bound));
    port = bound.ss_family == AF_INET ? ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port)
                                      : ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
    make_nonblocking(listen_fd.get());
}

void TcpStoreServer::Impl::run() {
    while (!stop.load(std::memory_order_acquire)) {
        // Errors of one connection are handled in serve(); what reaches here (poll failing, memory running
        // out between connections) is logged, and the server keeps serving after a short pause.
        try {
            loop_once();
        } catch (const std::exception& e) {
            WEFT_LOG_ERROR("rendezvous server on " << address << ": " << e.what() << "; continuing");
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
    }
    connections.clear();
    open_connections = 0;
    buffered_bytes = 0;
}

void TcpStoreServer::Impl::loop_once() {
    Clock::time_point now = Clock::now();
    Clock::time_point next_deadline = now + std::chrono::seconds(1);
    for (auto& [id, c] : connections) {
        if (!c.authenticated) next_deadline = std::min(next_deadline, c.hello_deadline);
        if (c.pending) next_deadline = std::min(next_deadline, c.pending->deadline);
    }
    const bool accepting = now >= accept_paused_until;
    if (!accepting) next_deadline = std::min(next_deadline, accept_paused_until);

    std::vector<pollfd> fds;
    std::vector<uint64_t> ids;
    fds.reserve(connections.size() + 2);
    fds.push_back({wake_fd.get(), POLLIN, 0});
    fds.push_back({listen_fd.get(), static_cast<short>(accepting ? POLLIN : 0), 0});
    for (auto& [id, c] : connections) {
        // A connection whose replies are not drained is not read: its requests wait in the kernel's buffers.
        short events = c.unsent() < options.max_unsent_reply_bytes ? POLLIN : 0;
        if (c.unsent() > 0) events |= POLLOUT;
        fds.push_back({c.fd.get(), events, 0});
        ids.push_back(id);
    }
    int n = ::poll(fds.data(), fds.size(), poll_timeout_ms(next_deadline));
    if (n < 0) {
        WEFT_CHECK(errno == EINTR, "rendezvous server: poll failed: " << errno_text(errno));
        return;
    }
    if (stop.load(std::memory_order_acquire)) return;
    if (fds[0].revents != 0) {
        uint64_t count = 0;
        ssize_t got = ::read(wake_fd.get(), &count, sizeof(count));
        (void)got;  // EAGAIN when another wakeup already drained it
        take_adopted();
    }
    // Connections first, then new ones: a connection accepted in the previous round has its HELLO served
    // before newer connections can evict it.
    for (size_t i = 0; i < ids.size(); ++i) {
        short revents = fds[i + 2].revents;
        if (revents == 0) continue;
        auto it = connections.find(ids[i]);
        if (it == connections.end() || it->second.dead) continue;
        serve(ids[i], it->second, revents);
    }
    if (fds[1].revents != 0) accept_all();
    now = Clock::now();
    for (auto& [id, c] : connections) {
        if (c.dead) continue;
        try {
            if (!c.authenticated && now >= c.hello_deadline) {
                reject(c, "no HELLO within " +
                              std::to_string(std::min(options.hello_timeout, options.timeout).count()) + " ms");
            } else if (c.pending && now >= c.pending->deadline) {
                drop_waiter(id, c);
                respond(c, make_timeout());
            }
        } catch (const std::exception& e) {
            fail(c, "expiring a wait", &e);
        }
    }
    sweep();
}

void TcpStoreServer::Impl::serve(uint64_t id, Connection& c, short revents) {
    try {
        if (revents & POLLOUT) flush(c);
        if (!c.dead && (revents & (POLLIN | POLLHUP | POLLERR))) read_from(id, c);
        // Replies drained below the bound: serve the requests that were held back, if any.
        if (!c.dead && !c.pending && c.in_offset < c.in.size() && c.unsent() < options.max_unsent_reply_bytes) {
            process_frames(id, c);
        }
    } catch (const std::exception& e) {
        fail(c, "serving", &e);
    } catch (...) {
        fail(c, "serving", nullptr);
    }
}

void TcpStoreServer::Impl::fail(Connection& c, const char* what, const std::exception* e) {
    ++errors;
    WEFT_LOG_ERROR("rendezvous server on " << address << ": closing the connection from " << who(c) << ": "
                                           << what << " it failed: " << (e ? e->what() : "an unknown exception"));
    c.dead = true;
}

void TcpStoreServer::Impl::accept_all() {
    const int max_accepts = std::max(kMinAcceptsPerWakeup, options.max_pending_connections / 2);
    for (int i = 0; i < max_accepts; ++i) {
        sockaddr_storage peer{};
        socklen_t len = sizeof(peer);
        int fd = ::accept4(listen_fd.get(), reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) return;
            // Out of descriptors (EMFILE/ENFILE) or memory: back off instead of spinning on a readable socket.
            WEFT_LOG_WARN("rendezvous server on " << address << ": accept failed: " << errno_text(errno));
            accept_paused_until = Clock::now() + std::chrono::milliseconds(100);
            return;
        }
        UniqueFd owned(fd);
        ++accepted;
        std::string who = describe_address(reinterpret_cast<sockaddr*>(&peer));
        if (peer.ss_family == AF_UNIX) {
            std::string why;
            if (std::optional<PeerCredentials> cred = unix_peer_credentials(owned.get(), &why)) {
                who = "pid " + std::to_string(cred->pid) + " (uid " + std::to_string(cred->uid) + ") on " + address;
            }
        }
        add_connection(std::move(owned), std::move(who));
    }
}

void TcpStoreServer::Impl::take_adopted() {
    std::vector<UniqueFd> taken;
    {
        std::lock_guard<std::mutex> lock(adopted_mutex);
        taken.swap(adopted);
    }
    for (UniqueFd& fd : taken) {
        ++accepted;
        std::string peer = "an adopted connection (fd " + std::to_string(fd.get()) + ")";
        add_connection(std::move(fd), std::move(peer));
    }
}

void TcpStoreServer::Impl::add_connection(UniqueFd fd, std::string peer) {
    // Pending connections beyond the bound: close the oldest (the map is in accept order). Its client, if it
    // is a weft client, reconnects; an idle socket simply goes away.
    size_t num_pending = 0;
    for (const auto& [id, c] : connections) num_pending += (!c.dead && !c.authenticated) ? 1 : 0;
    const size_t max_pending = static_cast<size_t>(std::max(options.max_pending_connections, 1));
    for (auto it = connections.begin(); num_pending >= max_pending && it != connections.end(); ++it) {
        Connection& old = it->second;
        if (old.dead || old.authenticated) continue;
        ++evicted;
        WEFT_LOG_DEBUG("rendezvous server on " << address << ": closing " << who(old) << " before its HELLO: "
                                               << max_pending << " connections await HELLO (max_pending_connections)");
        old.dead = true;
        old.fd.reset();  // closed now, so a flood cannot exhaust descriptors before the sweep
        --num_pending;
    }
    make_nonblocking(fd.get());
    Connection c;
    c.fd = std::move(fd);
    c.peer = std::move(peer);
    c.hello_deadline = Clock::now() + std::min(options.hello_timeout, options.timeout);
    connections.emplace(next_id++, std::move(c));
    open_connections = connections.size();
}

void TcpStoreServer::Impl::read_from(uint64_t id, Connection& c) {
    // Before HELLO, read no more than a HELLO can be: an unauthenticated peer cannot make the server buffer.
    const size_t max_hello_bytes = kHeaderBytes + limits.max_key_bytes + 4;
    for (int i = 0; i < kMaxReadsPerWakeup && !c.dead; ++i) {
        // Replies not drained: leave further requests in the kernel's buffers (TCP flow control holds the
        // client back) rather than in ours.
        if (c.unsent() >= options.max_unsent_reply_bytes) return;
        size_t old_size = c.in.size();
        size_t buffered = old_size - c.in_offset;
        size_t chunk = c.authenticated ? kReadChunkBytes
                                       : std::min(kReadChunkBytes, max_hello_bytes - std::min(buffered, max_hello_bytes - 1));
        c.in.resize(old_size + chunk);
        ssize_t got = ::recv(c.fd.get(), c.in.data() + old_size, chunk, 0);
        if (got <= 0) {
            c.in.resize(old_size);
            if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
            // EOF or a reset: the client went away. Not an error unless it was mid-frame.
            if (c.in.size() > c.in_offset) {
                reject(c, "connection closed in the middle of a frame");
            } else {
                WEFT_LOG_DEBUG("rendezvous server: " << who(c) << " disconnected");
                c.dead = true;
            }
            return;
        }
        c.in.resize(old_size + static_cast<size_t>(got));
        if (c.pending) {
            // The client is synchronous: nothing may arrive while its get() waits.
            reject(c, "sent a request while its get('" + c.pending->key + "') was pending");
            return;
        }
        process_frames(id, c);
        if (static_cast<size_t>(got) < chunk) return;  // drained for now
    }
}

void TcpStoreServer::Impl::process_frames(uint64_t id, Connection& c) {
    while (!c.dead && !c.pending && c.in_offset < c.in.size() && c.unsent() < options.max_unsent_reply_bytes) {
        const uint8_t* p = c.in.data() + c.in_offset;
        size_t avail = c.in.size() - c.in_offset;
        Header header;
        DecodeResult r = decode_header(p, avail, Role::kRequest, limits, &header);
        if (r.status == DecodeStatus::kInvalid) return reject(c, r.error);
        if (r.status == DecodeStatus::kNeedMore) break;
        // Authentication is decided on the header, before any payload of another type is buffered.
        if (!c.authenticated && header.type != MsgType::kHello) {
            return reject(c, std::string("the first message must be HELLO, got ") +
                                 type_name(static_cast<uint16_t>(header.type)));
        }
        if (c.authenticated && header.type == MsgType::kHello) return reject(c, "HELLO sent twice");
        // NOTE: nothing is reserved from the header's length: the buffer grows as the bytes arrive, so a
        // header announcing 64 MiB costs nothing until 64 MiB are actually sent.
        if (avail < r.frame_bytes) break;
        Message m;
        r = decode_frame(p, avail, Role::kRequest, limits, &m);
        if (r.status != DecodeStatus::kComplete) return reject(c, r.error);
        c.in_offset += r.frame_bytes;
        handle(id, c, m);
        if (c.pending && c.in_offset < c.in.size() && !c.dead) {
            drop_waiter(id, c);
            return reject(c, "sent a request while its get('" + m.key + "') was pending");
        }
    }
    if (c.in_offset == c.in.size()) {
        release_if_large(c.in);
        c.in_offset = 0;
    } else if (c.in_offset > 0) {
        c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(c.in_offset));
        c.in_offset = 0;
    }
}

void TcpStoreServer::Impl::authenticate(Connection& c, const Message& hello) {
    if (!options.token.empty()) {
        if (!constant_time_equal(options.token, hello.key)) {
            return reject(c, "authentication failed: the job token (WEFT_JOB_TOKEN) does not match");
        }
    } else {
        // No token: only the server's own user (the server listens on loopback only; see listen_on).
        std::string why;
        std::optional<uint32_t> uid = peer_uid(c.fd.get(), &why);
        if (!uid) {
            return reject(c, "authentication failed: cannot tell which user connected (" + why +
                                 "); set a job token (WEFT_JOB_TOKEN) on every rank");
        }
        if (*uid != owner_uid) {
            return reject(c, "authentication failed: the peer runs as uid " + std::to_string(*uid) +
                                 ", but a store without a job token (WEFT_JOB_TOKEN) serves only its own user, uid " +
                                 std::to_string(owner_uid));
        }
    }
    size_t num_authenticated = 0;
    for (const auto& [id, other] : connections) num_authenticated += (!other.dead && other.authenticated) ? 1 : 0;
    if (num_authenticated >= static_cast<size_t>(std::max(options.max_connections, 1))) {
        return reject(c, "the store already serves " + std::to_string(num_authenticated) +
                             " connections (RendezvousOptions.max_connections)");
    }
    c.authenticated = true;
    c.rank = decode_i32(hello.value);
    ++authenticated;
    WEFT_LOG_DEBUG("rendezvous server: " << who(c) << " authenticated");
    respond(c, make_ok());
}

void TcpStoreServer::Impl::handle(uint64_t id, Connection& c, Message& m) {
    switch (m.type) {
        case MsgType::kHello: return authenticate(c, m);
        case MsgType::kSet: {
            ++requests;
            data[m.key] = std::move(m.value);
            keys = data.size();
            respond(c, make_ok());
            return wake_waiters(m.key);
        }
        case MsgType::kGet: {
            ++requests;
            auto it = data.find(m.key);
            if (it != data.end()) return respond(c, make_ok(it->second));
            uint64_t timeout_ms = std::min(decode_u64(m.value), kMaxWaitMs);
            if (timeout_ms == 0) return respond(c, make_timeout());
            c.pending = PendingGet{m.key, Clock::now() + std::chrono::milliseconds(timeout_ms)};
            waiters[m.key].push_back(id);
            return;
        }
        case MsgType::kAdd: {
            ++requests;
            int64_t delta = decode_i64(m.value);
            int64_t current = 0;
            auto it = data.find(m.key);
            if (it != data.end()) {
                std::optional<int64_t> parsed = parse_counter(it->second);
                if (!parsed) {
                    return respond(c, make_error("add('" + m.key + "'): the key holds " +
                                                 std::to_string(it->second.size()) +
                                                 " bytes that are not a decimal counter"));
                }
                current = *parsed;
            }
            int64_t next = 0;
            if (__builtin_add_overflow(current, delta, &next)) {
                return respond(c, make_error("add('" + m.key + "'): " + std::to_string(current) + " + " +
                                             std::to_string(delta) + " overflows int64"));
            }
            data[m.key] = counter_bytes(next);
            keys = data.size();
            respond(c, make_ok(encode_i64(next)));
            return wake_waiters(m.key);
        }
        case MsgType::kCheck: {
            ++requests;
            return respond(c, make_ok(Bytes{static_cast<uint8_t>(data.count(m.key) ? 1 : 0)}));
        }
        case MsgType::kErase: {
            ++requests;
            data.erase(m.key);
            keys = data.size();
            return respond(c, make_ok());
        }
        default:
            // decode_header admits requests only; anything else is a bug here, not in the peer.
            return reject(c, std::string("unhandled request type ") + type_name(static_cast<uint16_t>(m.type)));
    }
}

void TcpStoreServer::Impl::respond(Connection& c, const Message& m) {
    Bytes frame = encode_frame(m, limits);
    if (c.out_offset == c.out.size()) {
        c.out = std::move(frame);
        c.out_offset = 0;
    } else {
        c.out.insert(c.out.end(), frame.begin(), frame.end());
    }
    flush(c);
}

void TcpStoreServer::Impl::flush(Connection& c) {
    while (c.out_offset < c.out.size()) {
        ssize_t sent = ::send(c.fd.get(), c.out.data() + c.out_offset, c.out.size() - c.out_offset,
                              MSG_NOSIGNAL | MSG_DONTWAIT);
        if (sent < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;  // POLLOUT resumes
            WEFT_LOG_DEBUG("rendezvous server: send to " << who(c) << " failed: " << errno_text(errno));
            c.dead = true;
            return;
        }
        c.out_offset += static_cast<size_t>(sent);
    }
    release_if_large(c.out);
    c.out_offset = 0;
}

void TcpStoreServer::Impl::reject(Connection& c, const std::string& why) {
    ++rejected;
    WEFT_LOG_WARN("rendezvous server on " << address << ": closing the connection from " << who(c) << ": " << why);
    // Best effort: tell the peer why (one non-blocking send), then close.
    Bytes frame = encode_frame(make_error(why.substr(0, std::min<size_t>(kMaxErrorBytes, limits.max_value_bytes))),
                               limits);
    if (c.fd && c.out_offset == c.out.size()) {
        ::send(c.fd.get(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    c.dead = true;
}

void TcpStoreServer::Impl::drop_waiter(uint64_t id, Connection& c) {
    if (!c.pending) return;
    auto it = waiters.find(c.pending->key);
    if (it != waiters.end()) {
        std::erase(it->second, id);
        if (it->second.empty()) waiters.erase(it);
    }
    c.pending.reset();
}

void TcpStoreServer::Impl::wake_waiters(const std::string& key) {
    auto it = waiters.find(key);
    if (it == waiters.end()) return;
    std::vector<uint64_t> ids = std::move(it->second);
    waiters.erase(it);
    const Bytes& value = data.at(key);
    for (uint64_t id : ids) {
        auto conn = connections.find(id);
        if (conn == connections.end() || conn->second.dead || !conn->second.pending) continue;
        conn->second.pending.reset();
        respond(conn->second, make_ok(value));
    }
}

void TcpStoreServer::Impl::sweep() {
    uint64_t buffered = 0;
    for (auto it = connections.begin(); it != connections.end();) {
        if (it->second.dead) {
            drop_waiter(it->first, it->second);
            it = connections.erase(it);
        } else {
            buffered += it->second.in.capacity() + it->second.out.capacity();
            ++it;
        }
    }
    open_connections = connections.size();
    buffered_bytes = buffered;
}

TcpStoreServer::TcpStoreServer(const RendezvousOptions& options) : impl_(std::make_unique<Impl>()) {
    WEFT_CHECK(options.port >= 0 && options.port <= 65535,
               "RendezvousOptions.port must be in [0, 65535], got " << options.port);
    WEFT_CHECK(options.timeout.count() > 0,
               "RendezvousOptions.timeout must be positive, got " << options.timeout.count() << " ms");
    WEFT_CHECK(options.max_key_bytes >= 1, "RendezvousOptions.max_key_bytes must be at least 1, got 0");
    WEFT_CHECK(options.max_value_bytes <= (1u << 30),
               "RendezvousOptions.max_value_bytes must be at most 1 GiB, got " << options.max_value_bytes);
    WEFT_CHECK(options.hello_timeout.count() > 0,
               "RendezvousOptions.hello_timeout must be positive, got " << options.hello_timeout.count() << " ms");
    impl_->options = options;
    impl_->options.timeout = std::min(options.timeout, std::chrono::milliseconds(kMaxWaitMs));
    impl_->owner_uid = static_cast<uint32_t>(::geteuid());
    impl_->limits = Limits{options.max_key_bytes, options.max_value_bytes};
    impl_->listen_on(options);
    impl_->wake_fd.reset(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    WEFT_CHECK(impl_->wake_fd, "rendezvous: eventfd failed: " << errno_text(errno));
    WEFT_LOG_INFO("rendezvous server listening on " << impl_->address);
    impl_->thread = std::thread([impl = impl_.get()] { impl->run(); });
}

TcpStoreServer::~TcpStoreServer() {
    impl_->stop.store(true, std::memory_order_release);
    uint64_t one = 1;
    ssize_t written = ::write(impl_->wake_fd.get(), &one, sizeof(one));
    (void)written;  // the counter cannot overflow here; poll() also wakes within a second
    if (impl_->thread.joinable()) impl_->thread.join();
}

void TcpStoreServer::adopt_connection(int fd) {
    UniqueFd owned(fd);
    int type = 0;
    socklen_t len = sizeof(type);
    WEFT_CHECK(fd >= 0 && ::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_STREAM,
               "TcpStoreServer::adopt_connection: fd " << fd << " is not a stream socket");
    {
        std::lock_guard<std::mutex> lock(impl_->adopted_mutex);
        impl_->adopted.push_back(std::move(owned));
    }
    uint64_t one = 1;
    ssize_t written = ::write(impl_->wake_fd.get(), &one, sizeof(one));
    (void)written;  // the counter cannot overflow here; poll() also wakes within a second
}

int TcpStoreServer::port() const { return impl_->port; }

TcpStoreServer::Stats TcpStoreServer::stats() const {
    Stats s;
    s.accepted = impl_->accepted.load();
    s.authenticated = impl_->authenticated.load();
    s.rejected = impl_->rejected.load();
    s.evicted = impl_->evicted.load();
    s.errors = impl_->errors.load();
    s.requests = impl_->requests.load();
    s.open_connections = impl_->open_connections.load();
    s.keys = impl_->keys.load();
    s.buffered_bytes = impl_->buffered_bytes.load();
    return s;
}

}  // namespace weft
