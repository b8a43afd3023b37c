// SPDX-License-Identifier: MIT
// Passing file descriptors between processes of one host over abstract Unix-domain sockets (SCM_RIGHTS);
// an implementation detail of the symmetric heap, exposed for its unit tests.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "weft/detail/unique_fd.hpp"

namespace weft {
class Store;
}

namespace weft::detail {

/// Everything the exchange needs to know about one rank.
struct FdExchange {
    std::string job_id;  ///< random, shared by every rank: names the sockets, checked in messages
    int rank = 0;
    std::vector<int> local_peers;  ///< ranks on this host (not this rank) to send to and receive from
    uint64_t heap_bytes = 0;       ///< checked in every message
    Store* store = nullptr;        ///< for the barriers that order listen -> send -> close
    int num_ranks = 0;
    std::chrono::milliseconds timeout{10000};
    /// Asked between the waits on sockets (every 250 ms at most): a reason ends the exchange at once with a
    /// weft::Error giving it (a peer that failed to start, an aborted World). Empty: only the timeout ends them.
    std::function<std::optional<std::string>()> stop_reason;
};

/// The abstract socket (no file; "@name" in ss -x) on which `rank` of job `job_id` receives descriptors.
std::string heap_socket_name(const std::string& job_id, int rank);

/// Sends `own_fd` to every local peer and receives one descriptor from each; returns rank -> descriptor.
/// Collective over all ranks (it runs store barriers, so ranks without local peers call it too). Every rank
/// publishes its pid and pid namespace through the store first.
/// Sending: before a descriptor leaves, the process listening on the peer's socket must be of this user
/// (SO_PEERCRED), and, when both share a pid namespace, have the pid the peer published; otherwise this
/// throws weft::Error naming what was expected and what was found, and nothing is sent.
/// Receiving: connections are read together without blocking, so a sender that stalls mid-message holds up
/// no other; messages from a process of another user, of another job, of an unexpected rank, or of a pid
/// other than the one the claimed rank published are dropped with a warning. Every wait (connecting,
/// sending, receiving) ends by `exchange.timeout`: weft::Error names the ranks whose descriptor is missing.
std::map<int, UniqueFd> exchange_fds(const FdExchange& exchange, int own_fd);

}  // namespace weft::detail
