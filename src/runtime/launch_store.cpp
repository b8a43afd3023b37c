// SPDX-License-Identifier: MIT
// The store of a launched job: an abstract Unix socket on one host, TCP on a derived port across hosts.
#include "weft/detail/launch_store.hpp"

#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "runtime_internal.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/rendezvous.hpp"

namespace weft::detail {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

/// Where rank 0 publishes the World id in its store.
constexpr const char* kWorldIdKey = "weft/launch/world";

std::string hex16(uint64_t v) {
    char text[17];
    std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(v));
    return text;
}

std::string describe(const LaunchEnv& env, uint64_t world_index, const LaunchStoreAddress& where) {
    const std::string at =
        where.unix_socket.empty() ? where.host + ":" + std::to_string(where.port) : "@" + where.unix_socket;
    return env.launcher + " job '" + env.job_id + "', rank " + std::to_string(env.rank) + " of " +
           std::to_string(env.num_ranks) + ", World " + std::to_string(world_index) + " of this process, store at " +
           at;
}

}  // namespace

uint64_t stable_hash64(const std::string& text) {
    uint64_t hash = 0xcbf29ce484222325ull;  // FNV-1a, 64 bit
    for (unsigned char c : text) {
        hash ^= c;
        hash *= 0x100000001b3ull;
    }
    hash ^= hash >> 30;
    hash *= 0xbf58476d1ce4e5b9ull;
    hash ^= hash >> 27;
    hash *= 0x94d049bb133111ebull;
    hash ^= hash >> 31;
    return hash;
}

LaunchStoreAddress launch_store_address(const LaunchEnv& env, uint32_t uid, uint64_t world_index, uint64_t port_slot) {
    WEFT_CHECK(env.num_ranks > 1, "a job of " << env.num_ranks << " rank needs no store");
    WEFT_CHECK(!env.job_id.empty(), "the launch environment names no job (LaunchEnv::job_id is empty)");
    LaunchStoreAddress where;
    where.world_id = env.job_id + " / World " + std::to_string(world_index);
    if (env.local_num_ranks == env.num_ranks) {
        // One host: the ranks share a network namespace (the runtime needs that anyway: the heap's descriptors
        // travel over abstract sockets too), so an abstract name reaches them all, and binding it is atomic.
        where.unix_socket = "weft-store-" + hex16(stable_hash64(std::to_string(uid) + "\n" + where.world_id));
        return where;
    }
    where.host = env.master_addr;
    if (env.store_port != 0) {
        WEFT_CHECK(env.store_port != env.master_port,
                   "WEFT_STORE_PORT (" << env.store_port << ") must differ from MASTER_PORT: the launcher's or "
                                       << "torch.distributed's store listens there");
        // Worlds open at once each have their own port: WEFT_STORE_PORT + the World's slot (past MASTER_PORT).
        int64_t port = static_cast<int64_t>(env.store_port) + static_cast<int64_t>(port_slot);
        if (env.store_port < env.master_port && port >= env.master_port) ++port;
        WEFT_CHECK(port <= 65535, "WEFT_STORE_PORT (" << env.store_port << ") is the port of a World made while no "
                                                      << "other is open, and each World open beside it listens one "
                                                      << "port higher: " << port_slot + 1
                                                      << " Worlds open at once would need port " << port
                                                      << ", past 65535; set a lower WEFT_STORE_PORT");
        where.port = static_cast<int>(port);
        return where;
    }
    where.port = derived_master_port(where.world_id);
    if (where.port == env.master_port) where.port = where.port == 32767 ? 20000 : where.port + 1;
    return where;
}

namespace {

// Where rank 0 listens across hosts: the wildcard address of the family `host` resolves to ("::" or "0.0.0.0"), and
// whether `host` names this host (loopback, or an interface's address). nullopt when `host` does not resolve (the
// server then names the failure).
struct ListenAddress {
    std::string wildcard;
    bool this_host = true;
};
std::optional<ListenAddress> listen_address_for(const std::string& host) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* list = nullptr;
    if (::getaddrinfo(host.c_str(), nullptr, &hints, &list) != 0 || list == nullptr) return std::nullopt;
    ListenAddress where;
    where.wildcard = list->ai_family == AF_INET6 ? "::" : "0.0.0.0";
    ifaddrs* interfaces = nullptr;
    if (::getifaddrs(&interfaces) == 0) {
        // The address bytes of an IPv4 or IPv6 socket address (empty for another family).
        const auto bytes = [](const sockaddr* sa) -> std::string {
            if (sa->sa_family == AF_INET) {
                const auto& a = reinterpret_cast<const sockaddr_in*>(sa)->sin_addr;
                return std::string(reinterpret_cast<const char*>(&a), sizeof(a));
            }
            if (sa->sa_family == AF_INET6) {
                const auto& a = reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
                return std::string(reinterpret_cast<const char*>(&a), sizeof(a));
            }
            return {};
        };
        bool found = false;
        for (addrinfo* a = list; a != nullptr && !found; a = a->ai_next) {
            const std::string mine = bytes(a->ai_addr);
            for (ifaddrs* i = interfaces; i != nullptr && !found; i = i->ifa_next) {
                found = i->ifa_addr != nullptr && i->ifa_addr->sa_family == a->ai_family && !mine.empty() &&
                        bytes(i->ifa_addr) == mine;
            }
        }
        where.this_host = found;
        ::freeifaddrs(interfaces);
    }  // else nothing to compare with: taken as this host's
    ::freeaddrinfo(list);
    return where;
}

RendezvousOptions launch_store_options(const LaunchEnv& env, const LaunchStoreAddress& where, milliseconds timeout,
                                       milliseconds reply_timeout) {
    // Across hosts the store listens on a network address, which needs the job's secret: every rank says so at once
    // (rank 0's store would refuse to listen without it, and the others would wait for it until the timeout).
    WEFT_CHECK(!where.unix_socket.empty() || is_loopback_name(where.host) || !env.job_token.empty(),
               "the ranks of this job span hosts (" << env.local_num_ranks << " of " << env.num_ranks
                                                    << " on this one) and meet at a store on " << where.host
                                                    << ", which needs WEFT_JOB_TOKEN (the same secret on every rank; "
                                                       "weftrun sets it), but it is not set");
    RendezvousOptions options;
    options.rank = env.rank;
    options.num_ranks = env.num_ranks;
    options.token = env.job_token;
    options.timeout = timeout;
    options.reply_timeout = reply_timeout;
    options.unix_socket = where.unix_socket;
    if (where.unix_socket.empty()) {
        options.host = where.host;
        options.port = where.port;
    }
    return options;
}

}  // namespace

void make_room_for_connections(RendezvousOptions& options, int num_ranks) {
    const auto needed = static_cast<rlim_t>(2 * static_cast<int64_t>(num_ranks) + 256);
    options.max_connections = std::max(options.max_connections, 2 * num_ranks + 64);
    rlimit lim{};
    if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY || lim.rlim_cur >= needed) return;
    rlimit raised = lim;
    raised.rlim_cur = lim.rlim_max == RLIM_INFINITY ? needed : std::min(needed, lim.rlim_max);
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) {
        WEFT_LOG_INFO("rendezvous: raised the soft limit on open files from "
                      << lim.rlim_cur << " to " << raised.rlim_cur << " for " << num_ranks << " ranks' connections");
    }
    rlimit now{};
    if (::getrlimit(RLIMIT_NOFILE, &now) == 0 && now.rlim_cur != RLIM_INFINITY && now.rlim_cur < needed) {
        WEFT_LOG_WARN("rendezvous: rank 0's limit on open files (" << now.rlim_cur << ", hard " << now.rlim_max
                                                                   << ") is below the " << needed << " that "
                                                                   << num_ranks
                                                                   << " ranks' connections need (two each): raise it "
                                                                      "(ulimit -n) or the last ranks cannot connect");
    }
}

std::unique_ptr<Store> connect_launch_store(const LaunchEnv& env, uint64_t world_index, milliseconds timeout,
                                            milliseconds reply_timeout, uint64_t port_slot) {
    const LaunchStoreAddress where =
        launch_store_address(env, static_cast<uint32_t>(::geteuid()), world_index, port_slot);
    return connect_tcp_store(launch_store_options(env, where, timeout, reply_timeout));
}

std::unique_ptr<Store> make_launch_store(const LaunchEnv& env, uint64_t world_index, milliseconds timeout,
                                         milliseconds reply_timeout, uint64_t port_slot) {
    const LaunchStoreAddress where =
        launch_store_address(env, static_cast<uint32_t>(::geteuid()), world_index, port_slot);
    // The calls' reply bound is fixed here: connecting below gets what is left of `timeout`, not the calls after it.
    RendezvousOptions options =
        launch_store_options(env, where, timeout, reply_timeout.count() > 0 ? reply_timeout : timeout);
    const Bytes world_id(where.world_id.begin(), where.world_id.end());
    WEFT_LOG_DEBUG("rendezvous: " << describe(env, world_index, where));
    const auto deadline = Clock::now() + timeout;
    std::string last_error = "no attempt";
    try {
        if (env.rank == 0) {
            // Across hosts rank 0 listens on every interface (with the job's token), as torch's store does:
            // MASTER_ADDR is where the others connect, and on rank 0's own host it may resolve to an address they
            // cannot reach (a host name that /etc/hosts maps to 127.0.1.1, a service address in front of it).
            if (options.unix_socket.empty() && !is_loopback_name(options.host)) {
                if (const std::optional<ListenAddress> listen = listen_address_for(options.host)) {
                    if (!listen->this_host) {
                        WEFT_LOG_WARN("rendezvous: MASTER_ADDR '"
                                      << options.host
                                      << "' is not an address of rank 0's host: rank 0 listens on every interface, "
                                         "but the other ranks connect to MASTER_ADDR, which is right only where it "
                                         "forwards to this host (a service or NAT address); else set it to rank 0's "
                                         "host");
                    }
                    options.host = listen->wildcard;
                }
            }
            make_room_for_connections(options, env.num_ranks);
            std::unique_ptr<Store> store = make_tcp_store(options);
            store->set(kWorldIdKey, world_id);
            return store;
        }
        // A store at this address may still be a previous World's (its rank 0 closes it only after every rank
        // has left it): such a store is left for the next attempt, until this World's appears.
        auto backoff = milliseconds(10);
        while (true) {
            options.timeout = remaining_ms(deadline);
            std::unique_ptr<Store> store = connect_tcp_store(options);  // refused, or out of time: final
            try {
                const Bytes found = store->get(kWorldIdKey, remaining_ms(deadline));
                if (found == world_id) return store;
                last_error = "the store there belongs to '" + std::string(found.begin(), found.end()) + "'";
            } catch (const Error& e) {
                last_error = e.what();  // a closing store: try again
            }
            store.reset();
            if (std::optional<std::string> why = wait_interrupted()) {  // the embedding's (Ctrl-C in Python)
                throw_wait_interrupted("World::from_env (" + describe(env, world_index, where) +
                                       "): waiting for this World's store (last: " + last_error + ") stopped: " + *why);
            }
            WEFT_CHECK(Clock::now() < deadline, "no store of this World within " << timeout.count()
                                                                                 << " ms; last: " << last_error);
            std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - Clock::now()));
            backoff = std::min(backoff * 2, milliseconds(500));
        }
    } catch (const WaitInterrupted&) {
        throw;  // not a mismatch of the ranks' calls: the hint below does not apply
    } catch (const Error& e) {
        std::string what = e.what();
        if (what.rfind("weft: ", 0) == 0) what.erase(0, 6);
        throw Error("weft: World::from_env (" + describe(env, world_index, where) + "): " + what +
                    " (the ranks of a job meet at the store of their n-th World::from_env: every process makes "
                    "the same calls in the same order)");
    }
}

std::shared_ptr<const uint64_t> take_store_port_slot() {
    static std::mutex mutex;
    static std::set<uint64_t> taken;
    std::lock_guard<std::mutex> lock(mutex);
    uint64_t slot = 0;
    while (taken.count(slot) != 0) ++slot;
    taken.insert(slot);
    return std::shared_ptr<const uint64_t>(new uint64_t(slot), [](const uint64_t* p) {
        {
            std::lock_guard<std::mutex> released(mutex);
            taken.erase(*p);
        }
        delete p;
    });
}

uint64_t next_launch_world_index() {
    static std::atomic<uint64_t> next{0};
    return next.fetch_add(1);
}

}  // namespace weft::detail
