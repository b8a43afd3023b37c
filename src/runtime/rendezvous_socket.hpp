// SPDX-License-Identifier: MIT
// Small socket helpers shared by the rendezvous server and client (private to src/runtime).
#pragma once

#include <sys/socket.h>
#include <sys/un.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "weft/detail/unique_fd.hpp"

namespace weft::detail::rendezvous {

using Clock = std::chrono::steady_clock;

/// strerror text of `err`, thread-safe.
std::string errno_text(int err);
/// Milliseconds left until `deadline`, clamped to [0, 1 day] (a poll() timeout).
int poll_timeout_ms(Clock::time_point deadline);
/// The abstract-namespace Unix-domain address "@name" (no file: the name vanishes with the socket) and its
/// length in `*length`. Throws weft::Error when `name` is empty or too long.
sockaddr_un abstract_socket_address(const std::string& name, socklen_t* length);

/// Who holds the other end of the connected Unix-domain socket `fd` (SO_PEERCRED: for a client, the process
/// that called listen()), as seen in this process's namespaces.
struct PeerCredentials {
    uint32_t uid = 0;
    int64_t pid = 0;
};
/// nullopt, with the reason in `*why`, when SO_PEERCRED fails.
std::optional<PeerCredentials> unix_peer_credentials(int fd, std::string* why);

/// "127.0.0.1:29500" / "[::1]:29500" / "@name" (abstract Unix socket) / "a Unix-domain socket" (unnamed).
std::string describe_address(const sockaddr* addr);
/// True for 127.0.0.0/8, ::1 and ::ffff:127.0.0.0/104.
bool is_loopback(const sockaddr* addr);
/// Sets O_NONBLOCK and TCP_NODELAY (best effort for the latter).
void make_nonblocking(int fd);

/// The user id that owns the other end of the connected stream socket `fd`, as seen in this process's
/// user namespace: SO_PEERCRED for a Unix-domain socket; for TCP over loopback (or any address of this
/// network namespace) the owner of the peer's socket, found by its address pair in /proc/net/tcp or
/// /proc/net/tcp6. nullopt, with the reason in `*why`, when it cannot be established (then trust nothing).
std::optional<uint32_t> peer_uid(int fd, std::string* why);

}  // namespace weft::detail::rendezvous
