// SPDX-License-Identifier: MIT
// The pure parts of a World's watchdog: which peers a rank watches, heartbeat bookkeeping, process liveness on this
// host, and the words of its reasons (unit-tested without a GPU or a store).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace weft::detail {

inline constexpr std::chrono::milliseconds kDefaultHeartbeat{1000};   ///< WEFT_HEARTBEAT_MS default
inline constexpr std::chrono::milliseconds kDefaultDeadPeer{10000};   ///< WEFT_DEAD_PEER_MS default
/// How many ranks each rank watches through the store (each rank is watched by as many): enough that one death is
/// noticed even when a watcher dies with it, few enough that the store's load grows linearly with the ranks.
inline constexpr int kWatchedPeers = 2;

/// Heartbeat period: `option` when positive, else `env_value` (WEFT_HEARTBEAT_MS, whole milliseconds > 0), else
/// 1 s. Throws weft::Error naming the setting when it is malformed, zero or negative.
std::chrono::milliseconds resolve_heartbeat(std::chrono::milliseconds option,
                                            const std::optional<std::string>& env_value);

/// How long a peer's heartbeat may stand still before the peer counts as dead: `option` when positive, else
/// `env_value` (WEFT_DEAD_PEER_MS), else 10 s; at least two heartbeats (`heartbeat` x 2) either way, so that one
/// late beat is not a death. Throws weft::Error naming the setting when it is malformed, zero or negative.
std::chrono::milliseconds resolve_dead_peer(std::chrono::milliseconds option,
                                            const std::optional<std::string>& env_value,
                                            std::chrono::milliseconds heartbeat);

/// The ranks `rank` watches: the next min(count, num_ranks - 1) ranks after it, cyclically. Every rank is watched
/// by as many others.
std::vector<int> watched_peers(int rank, int num_ranks, int count = kWatchedPeers);

/// Whether process `pid` of this host is running: false when it does not exist or is a zombie (killed, not yet
/// reaped by its parent). A process of another user counts as running (it exists).
bool process_running(int64_t pid);

/// Heartbeat bookkeeping of the peers one rank watches. Pure: the caller reads the counters and the clock.
class HeartbeatBook {
public:
    using Clock = std::chrono::steady_clock;

    /// Watches `peers` (world ranks); each counts as alive from `start` on.
    HeartbeatBook(std::vector<int> peers, std::chrono::milliseconds dead_after, Clock::time_point start);

    /// The heartbeat counter read for `peer` at `now`: a value other than the last one seen renews the peer. A peer
    /// not watched is ignored.
    void observe(int peer, int64_t counter, Clock::time_point now);
    /// The peer's process was found gone (`why`, e.g. "its process 1234 on host h has exited"): dead from now on.
    void mark_gone(int peer, std::string why);
    /// The watcher itself did not look for `stalled` (its process stopped, its store calls stalled): that time is no
    /// peer's silence. Every peer's last renewal moves `stalled` later, to `now` at most.
    void excuse(Clock::duration stalled, Clock::time_point now);

    /// The first watched peer (in the order given) that is dead at `now`: gone, or whose counter has stood still
    /// for longer than dead_after; nullopt when every peer is alive.
    std::optional<int> first_dead(Clock::time_point now) const;
    /// Why `peer` counts as dead at `now` ("rank 3 is gone: ..."), naming the rank, how long its heartbeat has stood
    /// still and what `describe_peer(peer)` adds (its host and pid).
    std::string reason(int peer, Clock::time_point now, const std::string& where) const;

    const std::vector<int>& peers() const { return peers_; }

private:
    struct Entry {
        int64_t counter = -1;
        Clock::time_point renewed;
        std::string gone;  ///< non-empty: the process was found gone
    };
    const Entry* find(int peer) const;

    std::vector<int> peers_;
    std::vector<Entry> entries_;
    std::chrono::milliseconds dead_after_;
};

/// The words of the abort record a watchdog publishes in the store: `kind` 'D' (a dead peer) or 'A' (any other
/// abort), then the reason. decode returns {kind, reason}; a record of another form is an 'A' with its bytes as text.
std::string encode_abort_record(char kind, const std::string& reason);
std::pair<char, std::string> decode_abort_record(const std::string& record);

}  // namespace weft::detail
