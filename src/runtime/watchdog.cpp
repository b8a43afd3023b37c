// SPDX-License-Identifier: MIT
// Late and dead peers: the World's abort word, its watchdog thread, and store waits that stop once the World is
// aborted (docs/reliability.md, "Late and dead peers").
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "runtime_internal.hpp"
#include "weft/detail/watchdog.hpp"
#include "weft/runtime/diagnostics.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/log.hpp"

namespace weft::detail {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Store keys, under the World's own prefix.
std::string heartbeat_key(int rank) { return "weft/watchdog/beat/" + std::to_string(rank); }
std::string record_key(int64_t index) { return "weft/watchdog/abort/" + std::to_string(index); }
constexpr const char* kRecordIndexKey = "weft/watchdog/abort/next";

// How long a slice of a store wait lasts before the abort state is asked again.
constexpr milliseconds kStoreWaitSlice{250};
// A watchdog get of a key that check() found set: answered at once while the key is there; the first bound covers a
// key removed in between (its rank stopped its watchdog), the second a key still there on a store slow to answer (a
// user's store whose wait counts its own round trip).
constexpr milliseconds kPresentKeyGet{100};
constexpr milliseconds kPresentKeySlowGet{5000};

/// The value of a key that check() found: nullopt when it is gone by the get (its rank removed it meanwhile); a store
/// that failed throws.
std::optional<Bytes> get_present(Store& store, const std::string& key) {
    try {
        return store.get(key, kPresentKeyGet);
    } catch (const std::exception&) {
        if (!store.check(key)) return std::nullopt;
    }
    return store.get(key, kPresentKeySlowGet);
}

// The sliced gets in progress on this thread: a view of no World inside one (the World's own view over from_env's or
// from_store's start-up store) passes its get through whole, the outer view slicing and asking already.
thread_local int sliced_gets_in_progress = 0;

/// make_abortable_store's view.
class AbortableStore final : public Store {
public:
    AbortableStore(std::shared_ptr<Store> store, const WorldContext* world) : store_(std::move(store)), world_(world) {}

    void set(const std::string& key, const Bytes& value) override { store_->set(key, value); }
    int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
    bool check(const std::string& key) override { return store_->check(key); }
    void erase(const std::string& key) override { store_->erase(key); }

    Bytes get(const std::string& key, milliseconds timeout) override {
        if (world_ == nullptr && (sliced_gets_in_progress > 0 || !wait_interrupt_check_set())) {
            return store_->get(key, timeout);
        }
        ++sliced_gets_in_progress;
        struct Leave {
            ~Leave() { --sliced_gets_in_progress; }
        } leave;
        const auto start = Clock::now();
        const auto deadline = start + timeout;
        const auto stopped = [&](const std::string& why) {
            const auto waited = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
            return (world_ != nullptr ? "rank " + std::to_string(world_->rank) + ": " : std::string()) + "store get('" +
                   key + "') stopped after " + std::to_string(waited.count()) + " ms: " + why;
        };
        const auto stop = [&](const std::string& why) { WEFT_FAIL(stopped(why)); };
        while (true) {
            if (world_ != nullptr) {
                const std::optional<std::string> why = key == WorldContext::kStartupFailedKey
                                                           ? world_->store_wait_stop()
                                                           : world_->startup_wait_stop(*store_);
                if (why) stop(*why);
            }
            const auto left = deadline - Clock::now();
            if (left <= Clock::duration::zero()) return store_->get(key, milliseconds(0));
            const milliseconds slice = std::min(kStoreWaitSlice, remaining_ms(deadline));
            const auto slice_start = Clock::now();
            try {
                return store_->get(key, slice);
            } catch (const std::exception&) {
                // A slice that ended early failed for another reason than its timeout (a store that is gone):
                // that failure is the answer. One that ran its course is a timeout: ask again.
                if (ended_early(slice_start, slice) || Clock::now() >= deadline) throw;
            }
            // Only now, the slice having run out: a get answered at once never runs the embedding's check.
            if (std::optional<std::string> why = wait_interrupted()) throw_wait_interrupted(stopped(*why));
        }
    }

private:
    std::shared_ptr<Store> store_;
    const WorldContext* world_;
};

}  // namespace

std::shared_ptr<Store> make_abortable_store(std::shared_ptr<Store> store, const WorldContext* world) {
    if (world == nullptr && !wait_interrupt_check_set()) return store;  // nothing to ask: the store as it is
    return std::make_shared<AbortableStore>(std::move(store), world);
}

std::string read_diagnostic(const WorldContext& world, bool wait_for_writer) {
    Diagnostic* record = world.diag_host.get();
    if (record == nullptr) return "";
    uint32_t claimed = __atomic_load_n(&record->claimed, __ATOMIC_ACQUIRE);
    // A writer sets 1, fills the fields, then sets 2; give one caught mid-write a moment to finish.
    for (int i = 0; i < 100 && wait_for_writer && claimed == 1; ++i) {
        std::this_thread::sleep_for(milliseconds(1));
        claimed = __atomic_load_n(&record->claimed, __ATOMIC_ACQUIRE);
    }
    if (claimed == 0) return "";
    Diagnostic copy;
    std::memcpy(&copy, record, sizeof(copy));
    copy.claimed = claimed;
    return format_diagnostic(copy);
}

void WorldContext::raise_abort(const std::string& reason, bool is_dead_peer) {
    if (is_dead_peer) dead_peer_known = true;
    {
        std::lock_guard<std::mutex> lock(abort_mutex);
        if (abort_reason.empty()) abort_reason = reason;
    }
    if (abort_host) {
        uint32_t expected = kAbortNone;
        __atomic_compare_exchange_n(abort_host.get(), &expected, uint32_t{kAbortByHost}, false, __ATOMIC_SEQ_CST,
                                    __ATOMIC_SEQ_CST);
    }
}

uint32_t WorldContext::abort_word() const {
    return abort_host ? __atomic_load_n(abort_host.get(), __ATOMIC_ACQUIRE) : uint32_t{kAbortNone};
}

std::string WorldContext::abort_text() const {
    if (abort_word() == kAbortNone) return "";
    {
        std::lock_guard<std::mutex> lock(abort_mutex);
        if (!abort_reason.empty()) return abort_reason;
    }
    const std::string diagnosis = read_diagnostic(*this, true);
    // The word was raised on the device: by a wait that gave up, or (before a trap) by a put to an unreachable
    // peer or a collective mismatch, which are no waits.
    const Diagnostic* record = diag_host.get();
    const bool wait = record == nullptr || diagnosis.empty() ||
                      (record->kind != SpinKind::kUnreachablePeer && record->kind != SpinKind::kCollectiveMismatch &&
                       record->kind != SpinKind::kCollectiveEpoch && record->kind != SpinKind::kAllToAllCounts &&
                       record->kind != SpinKind::kBadArgument);
    return "rank " + std::to_string(rank) + (wait ? ": a device wait gave up" : ": a device operation failed") +
           (diagnosis.empty() ? "" : ": " + diagnosis);
}

std::optional<std::string> WorldContext::startup_wait_stop(Store& from) const {
    std::optional<std::string> why = store_wait_stop();
    if (why || !starting) return why;
    try {
        if (from.check(kStartupFailedKey)) {
            const Bytes text = from.get(kStartupFailedKey, milliseconds(0));
            startup_stopped_by_peer = true;
            return std::string(text.begin(), text.end());
        }
    } catch (const std::exception&) {
        // A store that is gone: the caller's own store call reports it.
    }
    return std::nullopt;
}

std::optional<std::string> WorldContext::store_wait_stop() const {
    if (shutting_down && !dead_peer_known) return std::nullopt;
    if (abort_word() == kAbortNone) return std::nullopt;
    return "the World was aborted: " + abort_text();
}

Watchdog::Watchdog(WorldContext* world, std::shared_ptr<Store> store) : world_(world), store_(std::move(store)) {
    beat();  // the first beat before any peer may count this rank's silence
    thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() { stop(false); }

void Watchdog::beat() {
    const std::string text = std::to_string(++beats_);
    store_->set(heartbeat_key(world_->rank), Bytes(text.begin(), text.end()));
}

bool Watchdog::publish(char kind, const std::string& reason, bool keep) noexcept {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopped_) return false;
        ++publishing_;  // stop() removes this rank's records only after this publish noted its own
    }
    bool ok = false;
    try {
        const int64_t index = store_->add(kRecordIndexKey, 1);
        {
            // Noted before the record is written: this rank's own reads skip it (an abort cleared meanwhile must not
            // come back from it), and stop() erases it unless kept.
            std::lock_guard<std::mutex> lock(mutex_);
            published_.push_back(index);
            if (keep) kept_.push_back(index);
        }
        const std::string record = encode_abort_record(kind, reason);
        store_->set(record_key(index), Bytes(record.begin(), record.end()));
        ok = true;
    } catch (const std::exception& e) {
        WEFT_LOG_WARN("watchdog: publishing the abort to the other ranks failed: " << e.what());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    --publishing_;
    idle_.notify_all();  // under the lock: stop() may free this Watchdog once it sees publishing_ == 0
    return ok;
}

void Watchdog::stop(bool last_out) noexcept {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopped_ || stop_) return;
        stop_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
    std::vector<int64_t> published, kept;
    {
        std::unique_lock<std::mutex> lock(mutex_);
        idle_.wait(lock, [this] { return publishing_ == 0; });
        stopped_ = true;
        published = published_;
        kept = kept_;
    }
    try {
        store_->erase(heartbeat_key(world_->rank));
        for (int64_t index : published) {
            if (std::find(kept.begin(), kept.end(), index) == kept.end()) store_->erase(record_key(index));
        }
        if (last_out) store_->erase(kRecordIndexKey);
    } catch (const std::exception& e) {
        WEFT_LOG_DEBUG("watchdog: removing its keys failed: " << e.what());
    }
}

void Watchdog::read_records() {
    WorldContext& w = *world_;
    // Abort records other ranks published (and this rank's own, which it skips), up to the index the last publisher
    // took. An index without its record is either being written (the publisher takes the index, then writes) or was
    // removed by a rank that stopped: it is looked at again on later reads, so that neither a late write nor a gap
    // hides the records after it.
    if (!store_->check(kRecordIndexKey)) return;  // no record yet (add would create the key)
    const int64_t last = store_->add(kRecordIndexKey, 0);
    std::vector<int64_t> to_read;
    to_read.swap(unread_records_);
    for (int64_t i = seen_records_ + 1; i <= last; ++i) to_read.push_back(i);
    if (last > seen_records_) seen_records_ = last;
    // This rank's own records are skipped; publish() notes an index before it writes the record, so one read here
    // (after its get) is known by then.
    const auto own = [this](int64_t i) {
        std::lock_guard<std::mutex> lock(mutex_);
        return std::find(published_.begin(), published_.end(), i) != published_.end();
    };
    for (int64_t i : to_read) {
        if (own(i)) continue;
        if (!store_->check(record_key(i))) {
            unread_records_.push_back(i);
            continue;
        }
        const std::optional<Bytes> bytes = get_present(*store_, record_key(i));
        if (!bytes) {
            unread_records_.push_back(i);
            continue;
        }
        if (own(i)) continue;
        const auto [kind, reason] = decode_abort_record(std::string(bytes->begin(), bytes->end()));
        // The abort first, the line after: a host log sink that blocks must not hold up the World's abort.
        const bool first = w.abort_word() == kAbortNone;
        w.raise_abort(reason, kind == 'D');
        if (first) WEFT_LOG_ERROR("watchdog: aborting the World: " << reason);
    }
    // Removed records stay missing: keep looking at the most recent few only.
    constexpr size_t kMaxUnread = 64;
    if (unread_records_.size() > kMaxUnread) {
        unread_records_.erase(unread_records_.begin(), unread_records_.end() - static_cast<std::ptrdiff_t>(kMaxUnread));
    }
}

void Watchdog::read_records_now() noexcept {
    try {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (stopped_) return;
        }
        std::lock_guard<std::mutex> lock(records_mutex_);
        read_records();
    } catch (const std::exception& e) {
        WEFT_LOG_WARN("watchdog: reading the other ranks' abort records failed: " << e.what());
    }
}

void Watchdog::run() {
    WorldContext& w = *world_;
    set_log_rank(w.rank);
    // The peers to watch: a few through their heartbeats (any host), and every peer process of this host by pid —
    // by heartbeat alone when its pid is of another pid namespace (containers sharing the host's name and network),
    // or when either namespace is unknown: there its pid names another process, or none.
    std::vector<int> peers = w.same_process ? std::vector<int>() : watched_peers(w.rank, w.num_ranks);
    std::vector<int> local_processes;
    if (!w.same_process) {
        const RankInfo& me = w.ranks[static_cast<size_t>(w.rank)];
        for (int r = 0; r < w.num_ranks; ++r) {
            const RankInfo& info = w.ranks[static_cast<size_t>(r)];
            if (r == w.rank || info.host != me.host) continue;
            if (!me.pid_namespace.empty() && info.pid_namespace == me.pid_namespace) local_processes.push_back(r);
            if (std::find(peers.begin(), peers.end(), r) == peers.end()) peers.push_back(r);
        }
    }
    HeartbeatBook book(peers, w.dead_peer, Clock::now());
    const auto describe = [&](int r) {
        const RankInfo& info = w.ranks[static_cast<size_t>(r)];
        return "host " + info.host + ", pid " + std::to_string(info.pid);
    };
    auto last_done = Clock::now();
    while (true) {
        {
            std::unique_lock<std::mutex> lock(mutex_);
            if (wake_.wait_for(lock, w.heartbeat, [this] { return stop_; })) return;
        }
        const auto start = Clock::now();
        try {
            beat();
            // Peers' heartbeats: a value that changed renews the peer (a key not there yet renews nothing), as of
            // when it was read.
            for (int p : book.peers()) {
                if (w.same_process || !store_->check(heartbeat_key(p))) continue;
                const std::optional<Bytes> value = get_present(*store_, heartbeat_key(p));
                if (!value) continue;  // its watchdog stopped meanwhile
                const std::string text(value->begin(), value->end());
                book.observe(p, text.empty() ? -1 : std::strtoll(text.c_str(), nullptr, 10), Clock::now());
            }
            std::lock_guard<std::mutex> lock(records_mutex_);
            read_records();
        } catch (const std::exception& e) {
            // The store is the World's meeting point: without it no rank can be told anything.
            if (w.abort_word() == kAbortNone) WEFT_LOG_ERROR("watchdog: the World's store failed: " << e.what());
            w.raise_abort("rank " + std::to_string(w.rank) + " lost the World's store (" + e.what() + ")", true);
            return;
        }
        // A watcher that did not look for a while (its process stopped, its store calls stalled, a Python store
        // waiting for the GIL) saw nothing of its peers meanwhile: of a stall longer than half the dead-peer bound,
        // the part beyond that half is not counted as their silence (every rank's watchdog stalls together when the
        // store's host does). The half still counts, so a dead peer is found however slow every look is.
        const auto done = Clock::now();
        const auto stalled = std::max(start - last_done - std::chrono::duration_cast<Clock::duration>(w.heartbeat),
                                      Clock::duration::zero()) +
                             (done - start);
        const auto half = std::chrono::duration_cast<Clock::duration>(w.dead_peer) / 2;
        if (stalled > half) {
            WEFT_LOG_WARN("watchdog: this rank did not watch its peers for "
                          << std::chrono::duration_cast<std::chrono::milliseconds>(stalled).count()
                          << " ms (a stopped process or a slow store); their silence beyond "
                          << std::chrono::duration_cast<std::chrono::milliseconds>(half).count()
                          << " ms of it is not counted");
            book.excuse(stalled - half, done);
        }
        last_done = done;
        if (w.past_shutdown_barrier) continue;  // peers that met at the shutdown barrier may exit now
        for (int p : local_processes) {
            const int64_t pid = w.ranks[static_cast<size_t>(p)].pid;
            if (!process_running(pid))
                book.mark_gone(p, "its process " + std::to_string(pid) + " on this host has exited");
        }
        // This rank's own news: a dead peer, or a device wait that gave up (World::abort publishes itself).
        if (const auto dead = book.first_dead(Clock::now())) {
            const std::string reason =
                book.reason(*dead, Clock::now(), describe(*dead) + "; noticed by rank " + std::to_string(w.rank));
            if (!w.dead_peer_known.exchange(true)) {
                w.raise_abort(reason, true);
                publish('D', reason);
                WEFT_LOG_ERROR("watchdog: aborting the World: " << reason);
            }
        }
        if (w.abort_word() == kAbortByDeviceWait && !w.device_abort_published.exchange(true)) {
            const std::string reason = w.abort_text();
            WEFT_LOG_ERROR("watchdog: a device wait gave up; aborting the World: " << reason);
            publish('A', reason);
        }
    }
}

}  // namespace weft::detail
