// SPDX-License-Identifier: MIT
// The watchdog's pure parts: settings, watched peers, heartbeat bookkeeping, process liveness (weft/detail/watchdog.hpp).
#include <signal.h>

#include <cerrno>
#include <fstream>
#include <sstream>

#include "weft/detail/rendezvous_protocol.hpp"
#include "weft/detail/watchdog.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"

namespace weft::detail {

namespace {

std::chrono::milliseconds resolve_ms(std::chrono::milliseconds option, const std::optional<std::string>& env_value,
                                     const char* option_name, const char* env_name,
                                     std::chrono::milliseconds fallback) {
    constexpr auto kMaxMs =
        static_cast<int64_t>(rendezvous::kMaxWaitMs);  // 30 days: steady-clock deadlines stay in range
    WEFT_CHECK(option.count() >= 0 && option.count() <= kMaxMs,
               option_name << " must be in [0, 30 days], got " << option.count() << " ms");
    if (option.count() > 0) return option;
    if (env_value) {
        const int64_t ms = env::parse_int(*env_value, env_name);
        WEFT_CHECK(ms > 0 && ms <= kMaxMs, env_name << " must be a positive number of milliseconds, at most 30 days ("
                                                    << kMaxMs << "), got '" << *env_value << "'");
        return std::chrono::milliseconds(ms);
    }
    return fallback;
}

}  // namespace

std::chrono::milliseconds resolve_heartbeat(std::chrono::milliseconds option,
                                            const std::optional<std::string>& env_value) {
    return resolve_ms(option, env_value, "WorldOptions::heartbeat", "WEFT_HEARTBEAT_MS", kDefaultHeartbeat);
}

std::chrono::milliseconds resolve_dead_peer(std::chrono::milliseconds option,
                                            const std::optional<std::string>& env_value,
                                            std::chrono::milliseconds heartbeat) {
    const auto chosen =
        resolve_ms(option, env_value, "WorldOptions::dead_peer_timeout", "WEFT_DEAD_PEER_MS", kDefaultDeadPeer);
    return std::max(chosen, 2 * heartbeat);
}

std::vector<int> watched_peers(int rank, int num_ranks, int count) {
    WEFT_CHECK(num_ranks >= 1 && rank >= 0 && rank < num_ranks,
               "watched_peers: rank " << rank << " is outside [0, " << num_ranks << ")");
    std::vector<int> peers;
    for (int i = 1; i <= count && i < num_ranks; ++i) peers.push_back((rank + i) % num_ranks);
    return peers;
}

bool process_running(int64_t pid) {
    if (pid <= 0) return false;
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno != EPERM) return false;
    // A killed process stays a zombie until its parent reaps it: /proc/<pid>/stat's state is then Z (or X).
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string text;
    if (!stat || !std::getline(stat, text)) return true;  // no /proc: kill's answer stands
    const size_t paren = text.rfind(')');  // the command name may contain spaces and parentheses
    if (paren == std::string::npos || paren + 2 >= text.size()) return true;
    const char state = text[paren + 2];
    return state != 'Z' && state != 'X' && state != 'x';
}

HeartbeatBook::HeartbeatBook(std::vector<int> peers, std::chrono::milliseconds dead_after, Clock::time_point start)
    : peers_(std::move(peers)), entries_(peers_.size()), dead_after_(dead_after) {
    for (Entry& e : entries_) e.renewed = start;
}

const HeartbeatBook::Entry* HeartbeatBook::find(int peer) const {
    for (size_t i = 0; i < peers_.size(); ++i) {
        if (peers_[i] == peer) return &entries_[i];
    }
    return nullptr;
}

void HeartbeatBook::observe(int peer, int64_t counter, Clock::time_point now) {
    auto* e = const_cast<Entry*>(find(peer));
    if (e == nullptr || counter == e->counter) return;
    e->counter = counter;
    e->renewed = now;
}

void HeartbeatBook::mark_gone(int peer, std::string why) {
    auto* e = const_cast<Entry*>(find(peer));
    if (e != nullptr && e->gone.empty()) e->gone = why.empty() ? std::string("its process is gone") : std::move(why);
}

void HeartbeatBook::excuse(Clock::duration stalled, Clock::time_point now) {
    for (Entry& e : entries_) e.renewed = std::min(e.renewed + stalled, now);
}

std::optional<int> HeartbeatBook::first_dead(Clock::time_point now) const {
    for (size_t i = 0; i < peers_.size(); ++i) {
        const Entry& e = entries_[i];
        if (!e.gone.empty() || now - e.renewed > dead_after_) return peers_[i];
    }
    return std::nullopt;
}

std::string HeartbeatBook::reason(int peer, Clock::time_point now, const std::string& where) const {
    const Entry* e = find(peer);
    std::ostringstream os;
    os << "rank " << peer << " is gone: ";
    if (e == nullptr) {
        os << "it is not watched here";
    } else {
        const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - e->renewed);
        if (!e->gone.empty()) {
            os << e->gone;
        } else {
            os << "its heartbeat has stood still for " << silent.count() << " ms (the dead-peer bound is "
               << dead_after_.count() << " ms, WEFT_DEAD_PEER_MS)";
        }
    }
    if (!where.empty()) os << " [" << where << "]";
    return os.str();
}

std::string encode_abort_record(char kind, const std::string& reason) { return std::string(1, kind) + reason; }

std::pair<char, std::string> decode_abort_record(const std::string& record) {
    if (!record.empty() && (record[0] == 'D' || record[0] == 'A')) return {record[0], record.substr(1)};
    return {'A', record};
}

}  // namespace weft::detail
