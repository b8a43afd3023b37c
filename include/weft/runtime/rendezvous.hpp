// SPDX-License-Identifier: MIT
// The TCP rendezvous store: a key-value server hosted by rank 0 that every rank's process connects to.
//
// Wire format: include/weft/detail/rendezvous_protocol.hpp. Each connection's first message is a HELLO
// carrying the job token (WEFT_JOB_TOKEN), compared in constant time; nothing is served before a valid
// one. Listening on a non-loopback address requires a non-empty token. A malformed, oversized, foreign or
// unauthenticated message closes that connection (logged as a warning); other clients and the stored data
// are unaffected. Counters made by add() are stored as decimal text ("42"), so get() of a counter returns
// its digits.
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
    int rank = 0;
    int num_ranks = 1;
    std::string token;                        ///< job token; required when `host` is not a loopback address
    std::chrono::milliseconds timeout{30000};  ///< connect (with retries: rank 0 may start late) and each reply
    // Beyond the API sketch; the defaults suit every launcher.
    uint32_t max_key_bytes = 1024;        ///< longer keys are rejected (error on the client, closed on the server)
    uint32_t max_value_bytes = 64u << 20; ///< larger values are rejected likewise
    int max_connections = 4096;           ///< the server refuses connections beyond this many
};

/// Collective over the job's processes: rank 0 starts the server thread on host:port and connects to it
/// like everyone else; ranks != 0 connect, retrying until `timeout`. The returned store is thread-safe
/// (calls are serialised per process). Rank 0's store must outlive the others' use of it (the runtime
/// meets at a barrier before destroying it). Throws weft::Error naming the option or the address.
std::unique_ptr<Store> make_tcp_store(const RendezvousOptions& options);

/// Only the client: connects to a server on options.host:options.port (which must be non-zero).
std::unique_ptr<Store> connect_tcp_store(const RendezvousOptions& options);

/// The server alone (make_tcp_store uses it on rank 0; tests use it directly).
class TcpStoreServer {
public:
    /// Binds options.host:options.port (0: a free port), listens and starts the server thread.
    explicit TcpStoreServer(const RendezvousOptions& options);
    /// Stops the thread, closes every socket and joins; pending get()s of clients then fail on their side.
    ~TcpStoreServer();
    TcpStoreServer(const TcpStoreServer&) = delete;
    TcpStoreServer& operator=(const TcpStoreServer&) = delete;

    int port() const;  ///< the port actually bound

    struct Stats {
        uint64_t accepted = 0;          ///< connections accepted
        uint64_t authenticated = 0;     ///< connections that passed HELLO
        uint64_t rejected = 0;          ///< connections closed for a bad frame, token or protocol violation
        uint64_t requests = 0;          ///< requests served (HELLO excluded)
        uint64_t open_connections = 0;  ///< connections open now
        uint64_t keys = 0;              ///< keys stored now
    };
    Stats stats() const;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace weft
