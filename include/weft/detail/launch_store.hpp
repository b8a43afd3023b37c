// SPDX-License-Identifier: MIT
// How the processes of a launched job find their store without a port of their own (World::from_env);
// docs/runtime.md, "Finding the store". Exposed for its unit tests; not a user API.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "weft/runtime/launch_env.hpp"
#include "weft/runtime/rendezvous.hpp"
#include "weft/runtime/store.hpp"

namespace weft::detail {

/// 64-bit FNV-1a of `text`, then splitmix64's finaliser (FNV-1a's low bits are weak for short texts such as
/// "12345"). The same value on every machine and run: it names ports and sockets every rank must agree on.
uint64_t stable_hash64(const std::string& text);

/// Where the store of a launched job's World lives.
struct LaunchStoreAddress {
    /// Ranks all on this host: the abstract Unix socket "@unix_socket" (rank 0 binds it; no port, no file).
    std::string unix_socket;
    /// Ranks on several hosts: TCP on rank 0's host (MASTER_ADDR) at `port`: WEFT_STORE_PORT + the World's port slot
    /// (skipping MASTER_PORT), else derived_master_port(job id, World index), never MASTER_PORT.
    std::string host;
    int port = 0;
    /// The job id and the World index: rank 0 publishes it in its store, so a rank that reached a store knows
    /// it is this World's (and not a previous World's of the same address).
    std::string world_id;
};

/// Pure: the address of the store of World `world_index` (the n-th World::from_env of each process, from 0)
/// of the job `env` describes, for user `uid`. The Unix socket's name is a hash of (uid, job id, index), so
/// concurrent jobs, users and Worlds never share a name. With WEFT_STORE_PORT the port is that plus `port_slot`
/// (take_store_port_slot), past MASTER_PORT. Throws weft::Error for a job of one rank (it needs no store) or without a
/// job id.
LaunchStoreAddress launch_store_address(const LaunchEnv& env, uint32_t uid, uint64_t world_index,
                                        uint64_t port_slot = 0);

/// The lowest port slot no open World of this process holds, held until the returned token is destroyed: a World made
/// when none is open takes slot 0, so consecutive Worlds reuse WEFT_STORE_PORT, and Worlds open at once take the next
/// ports. Every process of a job makes and destroys its Worlds in the same order, so each takes the same slot.
std::shared_ptr<const uint64_t> take_store_port_slot();

/// Collective over the job's processes: rank 0 starts the store at launch_store_address(env, euid,
/// world_index) and publishes the World id there; the others connect (retrying until `timeout`, since rank 0
/// may start late, and past a store whose World id is not theirs). Needs no port of the launcher's and no
/// variable beyond what the launchers set; the store's authentication is make_tcp_store's (a job token when
/// WEFT_JOB_TOKEN is set, else this user only). Throws weft::Error naming the launcher, the job, the World
/// index and the address.
/// `reply_timeout` is RendezvousOptions::reply_timeout (0: `timeout`).
std::unique_ptr<Store> make_launch_store(const LaunchEnv& env, uint64_t world_index, std::chrono::milliseconds timeout,
                                         std::chrono::milliseconds reply_timeout = std::chrono::milliseconds(0),
                                         uint64_t port_slot = 0);

/// Another client of the store make_launch_store made (or connected to) for the same `env` and `world_index`, on
/// every rank, rank 0 included (a World's watchdog beats through its own connection). Throws weft::Error when the
/// store cannot be reached within `timeout`.
std::unique_ptr<Store> connect_launch_store(const LaunchEnv& env, uint64_t world_index,
                                            std::chrono::milliseconds timeout,
                                            std::chrono::milliseconds reply_timeout = std::chrono::milliseconds(0),
                                            uint64_t port_slot = 0);

/// The index of the next World this process creates with World::from_env: 0, 1, 2 ... (thread-safe).
uint64_t next_launch_world_index();

/// Rank 0's store takes two connections per rank (the rank's own and its watchdog's): raises the soft limit on open
/// files toward the hard one where it would not hold 2 * num_ranks + 256 (warning when the hard one does not either),
/// and options.max_connections to at least 2 * num_ranks + 64.
void make_room_for_connections(RendezvousOptions& options, int num_ranks);

}  // namespace weft::detail
