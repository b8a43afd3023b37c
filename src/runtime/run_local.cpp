// SPDX-License-Identifier: MIT
// run_local: the ranks of a World as threads of this process, and the error that names the rank that failed first.
#include <algorithm>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "runtime_internal.hpp"
#include "weft/detail/rank_threads.hpp"
#include "weft/detail/runtime_config.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/in_process_store.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/module_loading.hpp"
#include "weft/runtime/world.hpp"

namespace weft {

void run_local(int num_ranks, const std::function<void(World&)>& fn, const WorldOptions& options) {
    WEFT_CHECK(num_ranks >= 1, "run_local: num_ranks must be at least 1, got " << num_ranks);
    WEFT_CHECK(static_cast<bool>(fn), "run_local: fn must not be empty");
    prepare_cuda_environment();  // before any thread makes a CUDA call

    // Everything the rank threads touch is owned here, shared: a thread abandoned below (it did not return)
    // outlives this call, and must find its state (and fn) still alive whenever it resumes.
    struct Failure {
        uint64_t order;
        int rank;
        std::string message;
    };
    struct Shared {
        std::function<void(World&)> fn;
        WorldOptions options;
        std::shared_ptr<InProcessStore> store = std::make_shared<InProcessStore>();
        std::mutex mutex;
        std::vector<Failure> failures;
        std::vector<std::string> diagnoses;  // device diagnostic records left by any rank (ranks share the context)
        uint64_t next_order = 0;
        std::vector<std::unique_ptr<World>> worlds;  // slot r: touched by rank r's thread only

        void record_failure(int rank, std::string message) {
            if (message.rfind("weft: ", 0) == 0) message.erase(0, 6);
            {
                std::lock_guard<std::mutex> lock(mutex);
                failures.push_back({next_order++, rank, message});
            }
            // The others' blocking store calls fail now rather than at their timeout.
            store->abort("rank " + std::to_string(rank) + " failed: " + message);
        }
        void keep_diagnosis(int rank) {
            // A rank whose kernel trapped may not be the rank that noticed first (one CUDA context).
            World* world = worlds[static_cast<size_t>(rank)].get();
            std::string diagnosis = world != nullptr ? world->diagnostic_message(false) : std::string();
            if (diagnosis.empty()) return;
            std::lock_guard<std::mutex> lock(mutex);
            diagnoses.push_back(std::move(diagnosis));
        }
    };
    auto shared = std::make_shared<Shared>();
    shared->fn = fn;
    shared->options = options;
    shared->worlds.resize(static_cast<size_t>(num_ranks));

    detail::RankThreadBody body;
    body.work = [shared, num_ranks](int r) {
        set_log_rank(r);
        try {
            detail::WorldSetup setup;
            setup.rank = r;
            setup.num_ranks = num_ranks;
            setup.local_rank = r;
            setup.local_num_ranks = num_ranks;
            setup.device_hint = r;
            setup.store = shared->store;
            setup.same_process = true;
            setup.options = shared->options;
            shared->worlds[static_cast<size_t>(r)].reset(new World(std::move(setup)));
            shared->fn(*shared->worlds[static_cast<size_t>(r)]);
            if (cudaError_t st = cudaDeviceSynchronize(); st != cudaSuccess) {
                WEFT_LOG_WARN("cudaDeviceSynchronize after fn returned " << cudaGetErrorName(st));
            }
            return true;
        } catch (const std::exception& e) {
            shared->record_failure(r, e.what());
        } catch (...) {
            shared->record_failure(r, "an exception that is not a std::exception");
        }
        return false;
    };
    // NOTE: run_rank_threads calls finish only after every rank has finished fn and synchronised its device:
    // peers in this process use each other's heaps directly, even when the store was aborted.
    body.finish = [shared](int r) {
        shared->keep_diagnosis(r);
        shared->worlds[static_cast<size_t>(r)].reset();
        set_log_rank(-1);
    };
    // A peer never returned and may still use this rank's heap: the World is leaked, never released.
    body.abandon = [shared](int r) {
        shared->keep_diagnosis(r);
        if (shared->worlds[static_cast<size_t>(r)]) {
            WEFT_LOG_WARN("run_local: leaving this rank's World (heap, streams) unreleased: a peer did not return");
            (void)shared->worlds[static_cast<size_t>(r)].release();
        }
        set_log_rank(-1);
    };
    // Once a rank has failed (the store is aborted, so the others' store calls fail at once), a rank still
    // busy may be in a device wait (bounded by the timeout), its shutdown (likewise) or a kernel compile.
    const auto timeout = detail::resolve_timeout(options.timeout, env::get("WEFT_TIMEOUT_MS"));
    const auto grace = 2 * std::max(timeout, detail::kMinInitTimeout);
    const detail::RankThreadsOutcome outcome = detail::run_rank_threads(num_ranks, body, grace);

    std::lock_guard<std::mutex> lock(shared->mutex);  // abandoned threads may still record
    std::vector<Failure> failures = shared->failures;
    const std::vector<std::string> diagnoses = shared->diagnoses;
    if (failures.empty()) return;
    std::sort(failures.begin(), failures.end(), [](const Failure& a, const Failure& b) { return a.order < b.order; });
    std::ostringstream os;
    os << "run_local: rank " << failures[0].rank << " failed first: " << failures[0].message;
    if (failures.size() > 1) {
        std::vector<int> others;
        for (size_t i = 1; i < failures.size(); ++i) others.push_back(failures[i].rank);
        std::sort(others.begin(), others.end());
        os << " (then " << detail::format_rank_list(others) << " failed too)";
    }
    if (!outcome.not_returned.empty() || !outcome.not_finished.empty()) {
        os << "; "
           << detail::format_rank_list(outcome.not_returned.empty() ? outcome.not_finished : outcome.not_returned)
           << (outcome.not_returned.empty() ? " did not finish shutting down" : " did not return from fn") << " within "
           << grace.count() << " ms of that failure: their threads are left running, detached "
           << "(a thread cannot be stopped), and no rank's World was released (peers may still use it); end the "
           << "process soon";
    }
    // Every rank's record: on a shared GPU the rank that trapped first need not be the one whose wait explains
    // the hang (a peer's own wait, or its absence, says what it was doing).
    bool first_record = true;
    for (const std::string& d : diagnoses) {
        if (failures[0].message.find(d) != std::string::npos || os.str().find(d) != std::string::npos) continue;
        os << (first_record ? "; device diagnostic records: " : "; ") << d;
        first_record = false;
    }
    if (!diagnoses.empty() && diagnoses.size() < static_cast<size_t>(num_ranks)) {
        // NOTE: ranks sharing a GPU can have a kernel that never started (docs/runtime.md, "Pageable host copies").
        os << "; the ranks without a record were not in a weft wait: with ranks sharing a GPU their kernel may "
              "never have started, queued while a peer's spun (seen around copies to or from pageable host memory: "
              "use pinned memory: docs/runtime.md, \"Pageable host copies\")";
    }
    throw Error("weft: " + os.str());
}

}  // namespace weft
