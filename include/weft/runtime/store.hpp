// SPDX-License-Identifier: MIT
// Store: the key-value interface ranks use to exchange handles and meet at host barriers.
//
// Two implementations: the TCP store hosted by rank 0 (processes; see rendezvous.hpp) and an in-process
// store shared by the threads of `run_local`. Every blocking call takes a timeout and throws weft::Error
// naming the key and the ranks that did not arrive when it expires.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace weft {

using Bytes = std::vector<uint8_t>;

class Store {
public:
    virtual ~Store() = default;

    /// Sets `key` to `value` (overwrites).
    virtual void set(const std::string& key, const Bytes& value) = 0;
    /// Returns the value of `key`, waiting up to `timeout` for it to be set.
    virtual Bytes get(const std::string& key, std::chrono::milliseconds timeout) = 0;
    /// Atomically adds `delta` to the integer counter `key` (created at 0) and returns the new value.
    virtual int64_t add(const std::string& key, int64_t delta) = 0;
    /// True when `key` is set (never blocks).
    virtual bool check(const std::string& key) = 0;
    /// Removes `key` (no error when absent).
    virtual void erase(const std::string& key) = 0;

    /// Host barrier among `num_ranks` ranks; `name` must be unique per barrier instance (callers use
    /// a sequence number). Throws on timeout, naming the ranks that did not arrive.
    virtual void barrier(const std::string& name, int rank, int num_ranks, std::chrono::milliseconds timeout);
    /// Every rank contributes `blob`; returns all ranks' blobs in rank order.
    virtual std::vector<Bytes> all_gather(const std::string& name, int rank, int num_ranks, const Bytes& blob,
                                          std::chrono::milliseconds timeout);
};

}  // namespace weft
