// SPDX-License-Identifier: MIT
// Socket helpers shared by the rendezvous server and client.
#include "rendezvous_socket.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "weft/runtime/error.hpp"

namespace weft::detail::rendezvous {

std::string errno_text(int err) {
    char buf[256];
    // GNU strerror_r returns the message pointer (which may or may not be `buf`).
    const char* text = strerror_r(err, buf, sizeof(buf));
    return text != nullptr ? std::string(text) : "errno " + std::to_string(err);
}

int poll_timeout_ms(Clock::time_point deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    // Round up so a poll() does not return just before the deadline and spin.
    return static_cast<int>(std::clamp<long long>(left + 1, 0, 24ll * 3600 * 1000));
}

sockaddr_un abstract_socket_address(const std::string& name, socklen_t* length) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    WEFT_CHECK(!name.empty() && name.size() + 1 <= sizeof(addr.sun_path),
               "the abstract socket name '" << name << "' must have 1 to " << sizeof(addr.sun_path) - 1 << " bytes");
    addr.sun_path[0] = '\0';
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    *length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    return addr;
}

std::optional<PeerCredentials> unix_peer_credentials(int fd, std::string* why) {
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
        *why = "SO_PEERCRED failed: " + errno_text(errno);
        return std::nullopt;
    }
    return PeerCredentials{static_cast<uint32_t>(cred.uid), static_cast<int64_t>(cred.pid)};
}

std::string describe_address(const sockaddr* addr) {
    char text[INET6_ADDRSTRLEN] = {};
    if (addr->sa_family == AF_INET) {
        auto* in = reinterpret_cast<const sockaddr_in*>(addr);
        inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
        return std::string(text) + ":" + std::to_string(ntohs(in->sin_port));
    }
    if (addr->sa_family == AF_INET6) {
        auto* in6 = reinterpret_cast<const sockaddr_in6*>(addr);
        inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text));
        // Appends rather than `"[" + std::string(...)`, which trips GCC 12's -Wrestrict false positive.
        std::string result = "[";
        result.append(text).append("]:").append(std::to_string(ntohs(in6->sin6_port)));
        return result;
    }
    if (addr->sa_family == AF_UNIX) {
        auto* un = reinterpret_cast<const sockaddr_un*>(addr);
        if (un->sun_path[0] == '\0' && un->sun_path[1] != '\0') {
            std::string result = "@";  // appended, for the same GCC 12 -Wrestrict false positive as above
            result.append(un->sun_path + 1, strnlen(un->sun_path + 1, sizeof(un->sun_path) - 1));
            return result;
        }
        if (un->sun_path[0] != '\0') return std::string(un->sun_path, strnlen(un->sun_path, sizeof(un->sun_path)));
        return "a Unix-domain socket";
    }
    return "(address family " + std::to_string(addr->sa_family) + ")";
}

bool is_loopback(const sockaddr* addr) {
    if (addr->sa_family == AF_INET) {
        auto* in = reinterpret_cast<const sockaddr_in*>(addr);
        return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
    }
    if (addr->sa_family == AF_INET6) {
        auto* in6 = reinterpret_cast<const sockaddr_in6*>(addr);
        if (IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr)) return true;
        return IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr) && in6->sin6_addr.s6_addr[12] == 127;
    }
    return false;
}

void make_nonblocking(int fd) {
    int flags = ::fcntl(fd, F_GETFL, 0);
    WEFT_CHECK(flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0,
               "rendezvous: cannot make a socket non-blocking: " << errno_text(errno));
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

namespace {

/// One TCP endpoint as /proc/net/tcp{,6} prints it: the address as 32-bit words in host order, the port.
struct ProcEndpoint {
    std::array<uint32_t, 4> words{};
    int num_words = 0;  // 1 (IPv4) or 4 (IPv6)
    uint32_t port = 0;
    bool operator==(const ProcEndpoint& o) const {
        return num_words == o.num_words && port == o.port &&
               std::equal(words.begin(), words.begin() + num_words, o.words.begin());
    }
};

/// `addr` as /proc/net/tcp (IPv4, also for an IPv4-mapped IPv6 address) or /proc/net/tcp6 lists it.
std::optional<ProcEndpoint> proc_endpoint(const sockaddr_storage& addr) {
    ProcEndpoint e;
    if (addr.ss_family == AF_INET) {
        const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
        std::memcpy(e.words.data(), &in->sin_addr, 4);  // the kernel prints the raw word: host order
        e.num_words = 1;
        e.port = ntohs(in->sin_port);
        return e;
    }
    if (addr.ss_family == AF_INET6) {
        const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
        if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
            std::memcpy(e.words.data(), in6->sin6_addr.s6_addr + 12, 4);
            e.num_words = 1;
        } else {
            std::memcpy(e.words.data(), in6->sin6_addr.s6_addr, 16);
            e.num_words = 4;
        }
        e.port = ntohs(in6->sin6_port);
        return e;
    }
    return std::nullopt;
}

/// Parses "0100007F:1F90" (or 32 hex digits before the colon for IPv6).
std::optional<ProcEndpoint> parse_proc_endpoint(const std::string& text) {
    const size_t colon = text.find(':');
    if (colon != 8 && colon != 32) return std::nullopt;
    ProcEndpoint e;
    e.num_words = static_cast<int>(colon / 8);
    for (int w = 0; w < e.num_words; ++w) {
        const std::string hex = text.substr(static_cast<size_t>(w) * 8, 8);
        char* end = nullptr;
        e.words[static_cast<size_t>(w)] = static_cast<uint32_t>(std::strtoul(hex.c_str(), &end, 16));
        if (end != hex.c_str() + 8) return std::nullopt;
    }
    const std::string port = text.substr(colon + 1);
    char* end = nullptr;
    e.port = static_cast<uint32_t>(std::strtoul(port.c_str(), &end, 16));
    if (port.empty() || *end != '\0') return std::nullopt;
    return e;
}

/// Searches one /proc/net/tcp* table for the socket whose local end is `local` and remote end `remote`.
/// Returns its uid; `*readable` says whether the table could be opened.
std::optional<uint32_t> find_socket_owner(const char* table, const ProcEndpoint& local, const ProcEndpoint& remote,
                                          bool* readable) {
    std::ifstream in(table);
    *readable = in.good();
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
        // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...
        std::istringstream fields(line);
        std::string slot, local_text, remote_text, state, queues, timer, retransmits, uid_text;
        if (!(fields >> slot >> local_text >> remote_text >> state >> queues >> timer >> retransmits >> uid_text)) {
            continue;
        }
        std::optional<ProcEndpoint> l = parse_proc_endpoint(local_text);
        if (!l || !(*l == local)) continue;
        std::optional<ProcEndpoint> r = parse_proc_endpoint(remote_text);
        if (!r || !(*r == remote)) continue;
        char* end = nullptr;
        const unsigned long uid = std::strtoul(uid_text.c_str(), &end, 10);
        if (uid_text.empty() || *end != '\0') return std::nullopt;
        return static_cast<uint32_t>(uid);
    }
    return std::nullopt;
}

}  // namespace

std::optional<uint32_t> peer_uid(int fd, std::string* why) {
    sockaddr_storage local{}, peer{};
    socklen_t local_len = sizeof(local), peer_len = sizeof(peer);
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
        ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) {
        *why = "cannot read the connection's addresses: " + errno_text(errno);
        return std::nullopt;
    }
    if (local.ss_family == AF_UNIX) {
        std::optional<PeerCredentials> cred = unix_peer_credentials(fd, why);
        if (!cred) return std::nullopt;
        return cred->uid;
    }
    std::optional<ProcEndpoint> server_end = proc_endpoint(local);
    std::optional<ProcEndpoint> client_end = proc_endpoint(peer);
    if (!server_end || !client_end || server_end->num_words != client_end->num_words) {
        *why = "the connection is neither TCP nor a Unix-domain socket";
        return std::nullopt;
    }
    // The peer's socket lists the peer's address as local and ours as remote. An IPv4 peer of a dual-stack
    // listener appears in /proc/net/tcp, an IPv6 one in /proc/net/tcp6; a mapped address could be in either.
    const bool v4 = client_end->num_words == 1;
    bool any_readable = false;
    for (const char* table : {v4 ? "/proc/net/tcp" : "/proc/net/tcp6", v4 ? "/proc/net/tcp6" : nullptr}) {
        if (table == nullptr) break;
        bool readable = false;
        std::optional<uint32_t> uid;
        if (std::string(table) == "/proc/net/tcp6" && v4) {
            // An IPv6 socket connected over IPv4-mapped addresses: ::ffff:a.b.c.d is words {0, 0, 0xffff, a.b.c.d}.
            ProcEndpoint l6 = *client_end, r6 = *server_end;
            for (ProcEndpoint* e : {&l6, &r6}) {
                const uint32_t v4_word = e->words[0];
                const uint8_t mapped_prefix[4] = {0, 0, 0xff, 0xff};
                uint32_t prefix_word = 0;
                std::memcpy(&prefix_word, mapped_prefix, 4);
                e->words = {0, 0, prefix_word, v4_word};
                e->num_words = 4;
            }
            uid = find_socket_owner(table, l6, r6, &readable);
        } else {
            uid = find_socket_owner(table, *client_end, *server_end, &readable);
        }
        any_readable = any_readable || readable;
        if (uid) return uid;
    }
    sockaddr_storage peer_copy = peer;
    *why = any_readable ? "no socket of this network namespace connects from " +
                              describe_address(reinterpret_cast<sockaddr*>(&peer_copy)) + " (/proc/net/tcp, tcp6)"
                        : std::string("/proc/net/tcp and /proc/net/tcp6 cannot be read");
    return std::nullopt;
}

}  // namespace weft::detail::rendezvous
