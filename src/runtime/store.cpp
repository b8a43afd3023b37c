// SPDX-License-Identifier: MIT
// Store's default barrier and all-gather, built on set/get/add/check/erase (any Store implementation), and
// the prefix view of a store.
#include "weft/runtime/store.hpp"

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>

#include "runtime_internal.hpp"
#include "weft/runtime/error.hpp"

namespace weft {

namespace detail {

std::string format_rank_list(const std::vector<int>& ranks) {
    if (ranks.empty()) return "no rank";
    std::string text = ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
    return text;
}

std::chrono::milliseconds remaining_ms(std::chrono::steady_clock::time_point deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    return std::max(left, std::chrono::milliseconds(1));
}

bool ended_early(std::chrono::steady_clock::time_point get_start, std::chrono::milliseconds asked) {
    return std::chrono::steady_clock::now() - get_start < asked / 2;
}

}  // namespace detail

namespace {

void check_rank(const char* what, const std::string& name, int rank, int num_ranks) {
    WEFT_CHECK(num_ranks >= 1, what << " '" << name << "': num_ranks must be positive, got " << num_ranks);
    WEFT_CHECK(rank >= 0 && rank < num_ranks,
               what << " '" << name << "': rank must be in [0, " << num_ranks << "), got " << rank);
}

// Ranks r in [0, num_ranks) whose key `prefix + r` is not set; a failing store yields an explanation instead.
// `early`: the failed get ended early (ended_early), so ranks that have all arrived did not arrive late.
std::string describe_missing(Store& store, const std::string& prefix, int num_ranks, bool early) {
    std::vector<int> missing;
    try {
        for (int r = 0; r < num_ranks; ++r) {
            if (!store.check(prefix + std::to_string(r))) missing.push_back(r);
        }
    } catch (const std::exception& e) {
        return std::string("the missing ranks could not be listed (") + e.what() + ")";
    }
    if (missing.empty()) {
        return early ? "every rank has arrived by now; the store ended the wait before the deadline"
                     : "every rank arrived just after the deadline";
    }
    return std::to_string(num_ranks - static_cast<int>(missing.size())) + " of " + std::to_string(num_ranks) +
           " ranks arrived; " + detail::format_rank_list(missing) + " did not arrive";
}

/// make_prefix_store's view: forwards every call with the prefix prepended.
class PrefixStore final : public Store {
public:
    PrefixStore(std::shared_ptr<Store> store, std::string prefix)
        : store_(std::move(store)), prefix_(std::move(prefix) + "/") {}

    void set(const std::string& key, const Bytes& value) override { store_->set(prefix_ + key, value); }
    Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
        return store_->get(prefix_ + key, timeout);
    }
    int64_t add(const std::string& key, int64_t delta) override { return store_->add(prefix_ + key, delta); }
    bool check(const std::string& key) override { return store_->check(prefix_ + key); }
    void erase(const std::string& key) override { store_->erase(prefix_ + key); }

private:
    std::shared_ptr<Store> store_;
    std::string prefix_;
};

}  // namespace

std::shared_ptr<Store> make_prefix_store(std::shared_ptr<Store> store, const std::string& prefix) {
    WEFT_CHECK(store != nullptr, "make_prefix_store: the store is null");
    WEFT_CHECK(!prefix.empty(), "make_prefix_store: the prefix must not be empty");
    WEFT_CHECK(std::all_of(prefix.begin(), prefix.end(), [](unsigned char ch) { return ch > 0x20 && ch < 0x7f; }),
               "make_prefix_store: the prefix must be printable ASCII without spaces, got '" << prefix << "'");
    return std::make_shared<PrefixStore>(std::move(store), prefix);
}

namespace {
std::atomic<WaitInterruptCheck> wait_interrupt_check{nullptr};
}  // namespace

void set_wait_interrupt_check(WaitInterruptCheck check) { wait_interrupt_check.store(check); }

bool detail::wait_interrupt_check_set() { return wait_interrupt_check.load(std::memory_order_relaxed) != nullptr; }

void detail::throw_wait_interrupted(const std::string& message) { throw WaitInterrupted("weft: " + message); }

std::optional<std::string> wait_interrupted() {
    const WaitInterruptCheck check = wait_interrupt_check.load(std::memory_order_relaxed);
    return check != nullptr ? check() : std::nullopt;
}

// Protocol: every rank marks `name/rank/<r>` and increments `name/arrive`; the last arriver sets `name/done`,
// on which everyone waits. On the way out each rank removes its mark and increments `name/leave`; the last
// one out erases the shared keys, so a long job's store does not grow with every barrier.
void Store::barrier(const std::string& name, int rank, int num_ranks, std::chrono::milliseconds timeout) {
    check_rank("barrier", name, rank, num_ranks);
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + timeout;
    const std::string mark = name + "/rank/" + std::to_string(rank);
    set(mark, Bytes{1});
    const int64_t arrived = add(name + "/arrive", 1);
    WEFT_CHECK(arrived <= num_ranks, "barrier '" << name << "': " << arrived << " arrivals for " << num_ranks
                                                 << " ranks; the barrier name was reused before it completed");
    if (arrived == num_ranks) set(name + "/done", Bytes{1});
    const auto asked = detail::remaining_ms(deadline);
    const auto get_start = std::chrono::steady_clock::now();
    try {
        get(name + "/done", asked);
    } catch (const std::exception& e) {  // a store of the user's may throw any std::exception
        const auto waited =
            std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
        WEFT_FAIL(
            "barrier '" << name << "' failed on rank " << rank << " after " << waited.count() << " ms (timeout "
                        << timeout.count() << " ms): "
                        << describe_missing(*this, name + "/rank/", num_ranks, detail::ended_early(get_start, asked))
                        << " [store: " << e.what() << "]");
    }
    erase(mark);
    if (add(name + "/leave", 1) == num_ranks) {
        erase(name + "/arrive");
        erase(name + "/done");
        erase(name + "/leave");
    }
}

// Every rank sets `name/<r>` and reads all of them in rank order; the last rank out erases them.
std::vector<Bytes> Store::all_gather(const std::string& name, int rank, int num_ranks, const Bytes& blob,
                                     std::chrono::milliseconds timeout) {
    check_rank("all_gather", name, rank, num_ranks);
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + timeout;
    const std::string prefix = name + "/";
    set(prefix + std::to_string(rank), blob);
    std::vector<Bytes> blobs(static_cast<size_t>(num_ranks));
    for (int r = 0; r < num_ranks; ++r) {
        if (r == rank) {
            blobs[static_cast<size_t>(r)] = blob;
            continue;
        }
        const auto asked = detail::remaining_ms(deadline);
        const auto get_start = std::chrono::steady_clock::now();
        try {
            blobs[static_cast<size_t>(r)] = get(prefix + std::to_string(r), asked);
        } catch (const std::exception& e) {  // a store of the user's may throw any std::exception
            const auto waited =
                std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
            WEFT_FAIL(
                "all_gather '" << name << "' failed on rank " << rank << " after " << waited.count() << " ms (timeout "
                               << timeout.count() << " ms): "
                               << describe_missing(*this, prefix, num_ranks, detail::ended_early(get_start, asked))
                               << " [store: " << e.what() << "]");
        }
    }
    if (add(prefix + "leave", 1) == num_ranks) {
        for (int r = 0; r < num_ranks; ++r) erase(prefix + std::to_string(r));
        erase(prefix + "leave");
    }
    return blobs;
}

}  // namespace weft
