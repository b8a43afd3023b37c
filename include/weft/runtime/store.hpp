// SPDX-License-Identifier: MIT
// Store: the key-value interface ranks use to exchange handles and meet at host barriers.
//
// Implementations in weft: the store hosted by rank 0 of a launched job (rendezvous.hpp), the in-process
// store shared by the threads of `run_local` (in_process_store.hpp), and a prefix view of any store
// (make_prefix_store). A store of your own (torch.distributed's, say) can carry a World: World::from_store.
//
// The contract every implementation honours, and a store of your own must honour too:
//   - Visibility: once set(), add() or erase() has returned on one rank, every rank's later get(), check()
//     and add() on that key see its effect (the store is linearizable per key).
//   - Keys are printable ASCII text, '/'-separated, at most a few hundred bytes (the World's own keys are
//     under 200 bytes before any prefix). Values are arbitrary bytes (NUL included); the World's own values
//     are small (under 4 KiB per key, except a heap allocation's record: 32 bytes and 16 per free block of the
//     requested size or larger on the posting rank, a few hundred bytes in practice).
//   - get(key, timeout) blocks until the key is set, then returns its value; when `timeout` passes first it
//     throws (weft::Error, or any std::exception: its message is passed on). It never returns a value for a
//     key that was not set, and it honours `timeout` (a store whose own deadline is shorter may throw
//     earlier; one that waits longer makes weft's errors late). The World passes timeouts of WEFT_TIMEOUT_MS,
//     and at least 60 s while it starts.
//   - add(key, delta) is atomic across every rank and process: it treats a missing key as 0, stores the sum
//     and returns it. The World never reads a counter with get() and never mixes set() and add() on one key.
//   - check(key) and erase(key) never block waiting for other ranks; erase of a missing key is no error.
//     set(), add(), check() and erase() may block for the store's own I/O, bounded by its own timeout, and
//     throw when the store is unreachable.
//   - Every method may be called by several threads at once (the ranks of one process may share a store).
//   - The store serves every rank until every rank's World is destroyed: the World's destructor meets the
//     others through it. When one rank's process hosts the store (as rank 0 hosts torch's TCPStore), that
//     rank's World waits in its destructor until every other rank has left, so it is safe for that process
//     to exit right after destroying its World.
// torch.distributed's Store maps onto it as: set = set, get = wait([key], timeout) then get(key), add = add,
// check = check([key]), erase = delete_key.
// Blocking calls throw weft::Error naming the key (and, for barrier and all_gather, the ranks that did not
// arrive) when their timeout expires.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace weft {

using Bytes = std::vector<uint8_t>;

class Store {
public:
    virtual ~Store() = default;

    /// Sets `key` to `value` (overwrites).
    virtual void set(const std::string& key, const Bytes& value) = 0;
    /// Returns the value of `key`, waiting up to `timeout` for it to be set; throws when it is not.
    virtual Bytes get(const std::string& key, std::chrono::milliseconds timeout) = 0;
    /// Atomically adds `delta` to the integer counter `key` (created at 0) and returns the new value.
    virtual int64_t add(const std::string& key, int64_t delta) = 0;
    /// True when `key` is set (never waits for other ranks).
    virtual bool check(const std::string& key) = 0;
    /// Removes `key` (no error when absent).
    virtual void erase(const std::string& key) = 0;

    /// Host barrier among `num_ranks` ranks; `name` must be unique per barrier instance (callers use
    /// a sequence number). Throws on timeout, naming the ranks that did not arrive. Built on set, get, add,
    /// check and erase; the keys it uses (under `name` + "/") are removed by the last rank to leave.
    virtual void barrier(const std::string& name, int rank, int num_ranks, std::chrono::milliseconds timeout);
    /// Every rank contributes `blob`; returns all ranks' blobs in rank order. Built like barrier; its keys
    /// are removed by the last rank to leave.
    virtual std::vector<Bytes> all_gather(const std::string& name, int rank, int num_ranks, const Bytes& blob,
                                          std::chrono::milliseconds timeout);
};

/// A view of `store` in which every key is `prefix + "/" + key`, so that several users share one store
/// without colliding (several Worlds, or a World and a torch job's own keys). Every call goes to `store`,
/// which the view keeps alive; barrier and all_gather are Store's, over the prefixed keys. Thread-safe when
/// `store` is. Throws weft::Error when `store` is null or `prefix` is empty or not printable ASCII.
std::shared_ptr<Store> make_prefix_store(std::shared_ptr<Store> store, const std::string& prefix);

/// For an embedding whose own interruptions must end weft's host waits (the Python binding: Ctrl-C, a signal
/// handler that raised). While a check is set, a World's store waits (its start-up, barriers, heap and team
/// agreements, its shutdown) ask it on the waiting thread each time a slice of at most 250 ms ran out without the key
/// (a get answered at once never asks), from_env's connection to rank 0's store asks it between its attempts (at
/// most 0.5 s apart) and every 250 ms within one, and
/// World::sync_and_check queries its stream instead of blocking in cudaStreamSynchronize and asks it every 100 ms: a
/// reason ends the wait with a weft::Error naming it (sync_and_check's leaves the stream's work running: abort the
/// World to end weft's device waits), nullopt lets it go on. With no
/// check set (the default) nothing asks, and from_env's and from_store's start-up waits are not sliced: each is one
/// get of the store. Process-wide and one check only (the last set wins; no chaining): set it before making a World.
/// The check runs on every thread that waits (it decides which ones it interrupts) and must not throw.
using WaitInterruptCheck = std::optional<std::string> (*)() noexcept;
void set_wait_interrupt_check(WaitInterruptCheck check);
/// The check's answer for the calling thread (nullopt when none is set): what those waits ask.
std::optional<std::string> wait_interrupted();

}  // namespace weft
