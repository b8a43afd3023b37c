// SPDX-License-Identifier: MIT
// The in-process Store (see include/weft/runtime/in_process_store.hpp).
#include "weft/runtime/in_process_store.hpp"

#include <string>

#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"

namespace weft {

void InProcessStore::throw_if_aborted_locked() const {
    if (!abort_reason_.empty()) throw Error("weft: the in-process store was aborted: " + abort_reason_);
}

void InProcessStore::set(const std::string& key, const Bytes& value) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        throw_if_aborted_locked();
        values_[key] = value;
    }
    changed_.notify_all();
}

Bytes InProcessStore::get(const std::string& key, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        throw_if_aborted_locked();
        auto it = values_.find(key);
        if (it != values_.end()) return it->second;
        if (changed_.wait_until(lock, deadline) == std::cv_status::timeout) {
            throw_if_aborted_locked();
            it = values_.find(key);
            if (it != values_.end()) return it->second;
            WEFT_FAIL("store key '" << key << "' was not set within " << timeout.count() << " ms");
        }
    }
}

int64_t InProcessStore::add(const std::string& key, int64_t delta) {
    int64_t value = 0;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        throw_if_aborted_locked();
        auto it = values_.find(key);
        if (it != values_.end()) {
            std::string text(it->second.begin(), it->second.end());
            value = env::parse_int(text, ("store counter '" + key + "'").c_str());
        }
        value += delta;
        std::string text = std::to_string(value);
        values_[key] = Bytes(text.begin(), text.end());
    }
    changed_.notify_all();
    return value;
}

bool InProcessStore::check(const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    throw_if_aborted_locked();
    return values_.count(key) != 0;
}

void InProcessStore::erase(const std::string& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    throw_if_aborted_locked();
    values_.erase(key);
}

void InProcessStore::abort(const std::string& reason) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (abort_reason_.empty()) abort_reason_ = reason.empty() ? std::string("aborted") : reason;
    }
    changed_.notify_all();
}

size_t InProcessStore::num_keys() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return values_.size();
}

std::shared_ptr<Store> make_in_process_store() { return std::make_shared<InProcessStore>(); }

}  // namespace weft
