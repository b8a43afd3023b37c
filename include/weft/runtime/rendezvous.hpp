// SPDX-License-Identifier: MIT
// The rendezvous store: a key-value server hosted by rank 0 that every rank's process connects to, over TCP
// (host:port) or, for the ranks of one host, an abstract Unix-domain socket ("@name": no file, no port).
//
// Wire format: include/weft/detail/rendezvous_protocol.hpp. Each connection's first message is a HELLO;
// nothing is served before a valid one. Authentication (docs/runtime.md, "Who may use the store"):
//   - with a job token (WEFT_JOB_TOKEN), the HELLO must carry it (compared in constant time);
//   - without one, the server listens on loopback or a Unix socket only and accepts only peers of its own
//     user: the uid owning the peer's socket (SO_PEERCRED on a Unix-domain socket, /proc/net/tcp{,6} for
//     TCP) must equal the server's effective uid.
// On a Unix socket the client checks the server too: before it sends anything (the HELLO carries the token),
// the process listening there must be of the client's own user (SO_PEERCRED), since anyone may bind an
// abstract name first. Listening on a non-loopback address requires a non-empty token. A malformed,
// oversized, foreign or unauthenticated message closes that connection (logged as a warning); other clients
// and the stored data are unaffected, and an exception while serving one connection closes that connection, never the server.
// Limits: connections that have not completed HELLO are bounded apart from the authenticated ones, and
// must complete it within `hello_timeout` (clients reconnect and retry until their own timeout); a
// connection whose replies are not read stops being read; a frame's memory is allocated as its bytes
// arrive. Counters made by add() are stored as decimal text ("42"), so get() of a counter returns its digits.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "weft/runtime/store.hpp"

namespace weft {

struct RendezvousOptions {
    std::string host = "127.0.0.1";  ///< where rank 0 listens and the others connect (name or address)
    int port = 0;                    ///< 0: rank 0 picks a free port (only when num_ranks == 1)
    /// Non-empty: rank 0 listens on the abstract Unix-domain socket "@unix_socket" and the others connect there
    /// (host and port are not used). For ranks of one host sharing a network namespace; at most 107 bytes.
    std::string unix_socket;
    int rank = 0;
    int num_ranks = 1;
    std::string token;                        ///< job token; required when `host` is not a loopback address
    std::chrono::milliseconds timeout{30000};  ///< connect (with retries: rank 0 may start late) and each reply
    /// Non-zero: a reply not back within this much (beyond a get's own wait) means the store stopped (its host
    /// froze or dropped off the network without closing the connection); the call fails and the connection is
    /// given up. 0: `timeout`. World::from_env sets the World's dead-peer bound.
    std::chrono::milliseconds reply_timeout{0};
    // Beyond the API sketch; the defaults suit every launcher.
    uint32_t max_key_bytes = 1024;        ///< longer keys are rejected (error on the client, closed on the server)
    uint32_t max_value_bytes = 64u << 20; ///< larger values are rejected likewise
    int max_connections = 4096;           ///< authenticated connections; a HELLO beyond this many is refused
    /// Connections not yet past HELLO; when one more arrives, the oldest of them is closed (its client, if it
    /// is a weft client, reconnects). Idle sockets therefore cannot take the places of real ranks.
    int max_pending_connections = 64;
    /// A connection must complete HELLO within min(hello_timeout, timeout) or it is closed.
    std::chrono::milliseconds hello_timeout{2000};
    /// A connection whose unsent replies exceed this many bytes is not read (nor its buffered requests
    /// served) until they drain: a client that never reads its replies holds at most this plus one reply.
    size_t max_unsent_reply_bytes = 1u << 20;
};

/// Collective over the job's processes: rank 0 starts the server thread on host:port (or unix_socket) and
/// connects to it like everyone else; ranks != 0 connect, retrying until `timeout`. The returned store is thread-safe
/// (calls are serialised per process). Rank 0's store must outlive the others' use of it (the runtime
/// meets at a barrier before destroying it). Throws weft::Error naming the option or the address.
std::unique_ptr<Store> make_tcp_store(const RendezvousOptions& options);

/// Only the client: connects to a server on options.unix_socket, else options.host:options.port (which must
/// then be non-zero). A Unix socket held by another user's process is refused before anything is sent.
std::unique_ptr<Store> connect_tcp_store(const RendezvousOptions& options);

/// The server alone (make_tcp_store uses it on rank 0; tests use it directly).
class TcpStoreServer {
public:
    /// Binds options.unix_socket, else options.host:options.port (0: a free port), listens and starts the server
    /// thread. Throws weft::Error naming the address; for a Unix socket already bound, also who holds it.
    explicit TcpStoreServer(const RendezvousOptions& options);
    /// Takes ownership of `fd`, a connected stream socket (one end of a socketpair, or a connection accepted
    /// elsewhere), and serves it like an accepted connection: the same HELLO, authentication and limits.
    /// Thread-safe. Throws weft::Error (and closes `fd`) when `fd` is not a socket.
    void adopt_connection(int fd);
    /// Stops the thread, closes every socket and joins; pending get()s of clients then fail on their side.
    ~TcpStoreServer();
    TcpStoreServer(const TcpStoreServer&) = delete;
    TcpStoreServer& operator=(const TcpStoreServer&) = delete;

    int port() const;  ///< the port actually bound (0 on a Unix socket)

    struct Stats {
        uint64_t accepted = 0;          ///< connections accepted
        uint64_t authenticated = 0;     ///< connections that passed HELLO
        uint64_t rejected = 0;          ///< connections closed for a bad frame, token, user or protocol violation
        uint64_t evicted = 0;           ///< connections closed before HELLO to make room (max_pending_connections)
        uint64_t errors = 0;            ///< connections closed because serving them threw (logged as errors)
        uint64_t requests = 0;          ///< requests served (HELLO excluded)
        uint64_t open_connections = 0;  ///< connections open now
        uint64_t keys = 0;              ///< keys stored now
        uint64_t buffered_bytes = 0;    ///< bytes reserved by connection buffers now (requests and replies)
    };
    Stats stats() const;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace weft
