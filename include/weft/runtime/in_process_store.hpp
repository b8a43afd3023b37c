// SPDX-License-Identifier: MIT
// InProcessStore: the Store shared by the threads of one process (run_local), a map under a mutex.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "weft/runtime/store.hpp"

namespace weft {

/// Thread-safe Store for ranks that are threads of one process. Counters (`add`) are stored as decimal
/// text. `abort(reason)` makes every blocked and every later call throw weft::Error carrying `reason`:
/// run_local uses it so that one failing rank makes the others fail at once instead of at their timeout.
class InProcessStore final : public Store {
public:
    void set(const std::string& key, const Bytes& value) override;
    /// Throws weft::Error naming the key and the timeout when the key is not set in time.
    Bytes get(const std::string& key, std::chrono::milliseconds timeout) override;
    int64_t add(const std::string& key, int64_t delta) override;
    bool check(const std::string& key) override;
    void erase(const std::string& key) override;

    /// Fails every blocked and later call with `reason` (the first reason wins).
    void abort(const std::string& reason);
    /// Number of keys currently set (tests check that barriers and all-gathers clean up after themselves).
    size_t num_keys() const;

private:
    void throw_if_aborted_locked() const;

    mutable std::mutex mutex_;
    std::condition_variable changed_;
    std::map<std::string, Bytes> values_;
    std::string abort_reason_;
};

/// A fresh, empty in-process store.
std::shared_ptr<Store> make_in_process_store();

}  // namespace weft
