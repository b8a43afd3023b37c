// SPDX-License-Identifier: MIT
// World::from_env: one process per rank, from the launcher's environment and the job's store.
#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>

#include "runtime_internal.hpp"
#include "weft/detail/launch_store.hpp"
#include "weft/detail/runtime_config.hpp"
#include "weft/detail/watchdog.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/in_process_store.hpp"
#include "weft/runtime/launch_env.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/module_loading.hpp"
#include "weft/runtime/world.hpp"

namespace weft {

std::unique_ptr<World> World::from_env(const WorldOptions& options) {
    prepare_cuda_environment();  // before this process's first CUDA call
    const uint64_t world_index = detail::next_launch_world_index();
    detail::WorldSetup setup;
    setup.options = options;
    std::optional<LaunchEnv> launch = detect_launch_env();
    if (!launch) {
        WEFT_LOG_INFO("no launcher environment (weftrun, torchrun, mpirun or srun) found: a world of one rank");
        setup.store = make_in_process_store();
        setup.same_process = true;
        return std::unique_ptr<World>(new World(std::move(setup)));
    }
    setup.rank = launch->rank;
    setup.num_ranks = launch->num_ranks;
    setup.local_rank = launch->local_rank;
    setup.local_num_ranks = launch->local_num_ranks;
    setup.device_hint = launch->local_rank;
    setup.same_process = launch->num_ranks == 1;
    set_log_rank(launch->rank);
    WEFT_LOG_DEBUG("launched by " << launch->launcher << ": rank " << launch->rank << " of " << launch->num_ranks
                                  << ", local rank " << launch->local_rank << " of " << launch->local_num_ranks
                                  << ", job '" << launch->job_id << "', World " << world_index << " of this process");
    if (launch->num_ranks == 1) {
        setup.store = make_in_process_store();
        return std::unique_ptr<World>(new World(std::move(setup)));
    }
    // Connecting waits for rank 0's store, which starts when its process does: allow at least 30 s. A store call
    // whose reply is later than the dead-peer bound fails: rank 0's host froze or dropped off the network without
    // closing the connection (a dead rank 0 is noticed like any other dead rank, not after `timeout`).
    // A setting this rank refuses is refused in the World's start-up exchange, where every rank hears of it: until
    // then its default stands in.
    const auto timeout = std::max(detail::timeout_before_exchange(options.timeout), std::chrono::milliseconds(30000));
    std::chrono::milliseconds reply_bound = detail::kDefaultDeadPeer;
    try {
        const auto heartbeat = detail::resolve_heartbeat(options.heartbeat, env::get("WEFT_HEARTBEAT_MS"));
        reply_bound = detail::resolve_dead_peer(options.dead_peer_timeout, env::get("WEFT_DEAD_PEER_MS"), heartbeat);
    } catch (const Error&) {
    }
    // The port slot is held as long as the store (rank 0's server) is: until the World is gone.
    std::shared_ptr<const uint64_t> slot = detail::take_store_port_slot();
    Store* store = detail::make_launch_store(*launch, world_index, timeout, reply_bound, *slot).release();
    // With an embedding's wait check set, waits that ask it (wait_interrupted) until the World's own view takes over;
    // without one, the store itself.
    setup.store = detail::make_abortable_store(std::shared_ptr<Store>(store, [slot](Store* s) { delete s; }), nullptr);
    // The watchdog's own client: its beats must not queue behind a blocking call of this rank's thread.
    setup.connect_watchdog_store = [env = *launch, world_index, timeout, reply_bound,
                                    port_slot = *slot]() -> std::shared_ptr<Store> {
        return detail::connect_launch_store(env, world_index, timeout, reply_bound, port_slot);
    };
    return std::unique_ptr<World>(new World(std::move(setup)));
}

}  // namespace weft
