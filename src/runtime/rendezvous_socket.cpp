// SPDX-License-Identifier: MIT
// Socket helpers shared by the rendezvous server and client.
#include "rendezvous_socket.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "weft/runtime/error.hpp"

namespace weft::detail::rendezvous {

void UniqueFd::reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
}

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

}  // namespace weft::detail::rendezvous
