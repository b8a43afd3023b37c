// SPDX-License-Identifier: MIT
// World::from_env: one process per rank, from the launcher's environment and the TCP store.
#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>

#include "runtime_internal.hpp"
#include "weft/detail/runtime_config.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/in_process_store.hpp"
#include "weft/runtime/launch_env.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/module_loading.hpp"
#include "weft/runtime/rendezvous.hpp"
#include "weft/runtime/world.hpp"

namespace weft {

std::unique_ptr<World> World::from_env(const WorldOptions& options) {
    prepare_cuda_environment();  // before this process's first CUDA call
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
    RendezvousOptions rendezvous;
    rendezvous.host = launch->master_addr;
    rendezvous.port = launch->master_port;
    rendezvous.rank = launch->rank;
    rendezvous.num_ranks = launch->num_ranks;
    rendezvous.token = launch->job_token;
    // Connecting waits for rank 0's server, which starts when its process does: allow at least 30 s.
    rendezvous.timeout = std::max(detail::resolve_timeout(options.timeout, env::get("WEFT_TIMEOUT_MS")),
                                  std::chrono::milliseconds(30000));
    WEFT_LOG_DEBUG("launched by " << launch->launcher << ": rank " << launch->rank << " of " << launch->num_ranks
                                  << ", local rank " << launch->local_rank << " of " << launch->local_num_ranks
                                  << ", rendezvous " << launch->master_addr << ":" << launch->master_port);
    setup.store = std::shared_ptr<Store>(make_tcp_store(rendezvous));
    return std::unique_ptr<World>(new World(std::move(setup)));
}

}  // namespace weft
