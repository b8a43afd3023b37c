// SPDX-License-Identifier: MIT
// World::from_store: a World on a store of the user's (torch.distributed's, say), scoped by a key prefix.
#include <algorithm>
#include <chrono>
#include <memory>

#include "runtime_internal.hpp"
#include "weft/detail/runtime_config.hpp"
#include "weft/detail/runtime_placement.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/launch_env.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/module_loading.hpp"
#include "weft/runtime/world.hpp"

namespace weft {

std::unique_ptr<World> World::from_store(std::shared_ptr<Store> store, const WorldMembership& membership,
                                         const WorldOptions& options) {
    const WorldMembership& m = membership;
    WEFT_CHECK(store != nullptr, "World::from_store: the store is null");
    WEFT_CHECK(m.num_ranks >= 1, "WorldMembership::num_ranks must be at least 1, got " << m.num_ranks);
    WEFT_CHECK(m.rank >= 0 && m.rank < m.num_ranks,
               "WorldMembership::rank must be in [0, num_ranks=" << m.num_ranks << "), got " << m.rank);
    const bool local_given = m.local_rank >= 0 || m.local_num_ranks > 0;
    if (local_given) {
        WEFT_CHECK(m.local_num_ranks >= 1 && m.local_num_ranks <= m.num_ranks,
                   "WorldMembership::local_num_ranks must be in [1, num_ranks="
                       << m.num_ranks << "] when local_rank is given, got " << m.local_num_ranks);
        WEFT_CHECK(m.local_rank >= 0 && m.local_rank < m.local_num_ranks,
                   "WorldMembership::local_rank must be in [0, local_num_ranks="
                       << m.local_num_ranks << ") when local_num_ranks is given, got " << m.local_rank);
    } else {
        WEFT_CHECK(m.local_rank == -1 && m.local_num_ranks == 0,
                   "WorldMembership::local_rank and local_num_ranks are given together or left at -1 and 0, got "
                       << m.local_rank << " and " << m.local_num_ranks);
    }
    WEFT_CHECK(!m.key_prefix.empty() && std::all_of(m.key_prefix.begin(), m.key_prefix.end(),
                                                    [](unsigned char ch) { return ch > 0x20 && ch < 0x7f; }),
               "WorldMembership::key_prefix must be non-empty printable ASCII without spaces, got '" << m.key_prefix
                                                                                                    << "'");
    // Validation first: a wrong argument is reported before this process's CUDA environment changes. A timeout this
    // rank refuses is refused in the World's start-up exchange, where every rank hears of it.
    const auto timeout = detail::timeout_before_exchange(options.timeout);
    prepare_cuda_environment();  // before this process's first CUDA call, if it has made none
    set_log_rank(m.rank);

    detail::WorldSetup setup;
    setup.options = options;
    setup.rank = m.rank;
    setup.num_ranks = m.num_ranks;
    // With an embedding's wait check set, waits that ask it (wait_interrupted) until the World's own view takes over;
    // without one, the store itself.
    setup.store = detail::make_abortable_store(make_prefix_store(std::move(store), m.key_prefix), nullptr);
    // Processes start seconds apart: the same start-up allowance as the World's own exchanges. The sizes first: a
    // rank given another num_ranks than rank 0 fails at once naming both (the placement exchange below would
    // otherwise meet a World of other ranks, or wait for a rank that never comes); World::World checks them again.
    const auto start_timeout = std::max(timeout, detail::kMinInitTimeout);
    detail::agree_on_world_size(*setup.store, m.rank, m.num_ranks, start_timeout);
    const detail::Placement placement = detail::start_exchange(*setup.store, m.rank, m.num_ranks, [&] {
        return detail::exchange_placement(*setup.store, "weft/placement", m.rank, m.num_ranks, start_timeout);
    });
    setup.local_rank = local_given ? m.local_rank : placement.local_rank;
    setup.local_num_ranks = local_given ? m.local_num_ranks : placement.local_num_ranks;
    setup.device_hint = setup.local_rank;
    if (!local_given && !placement.same_process) {
        // A process launched with a LOCAL_RANK (torchrun, srun, mpirun, weftrun) keeps that GPU: a World of part of the
        // job (a TP group of 4 of a host's 8 processes) would otherwise bind its ranks' indices among the World's
        // ranks on the host, 0..3, on both groups' processes, and leave half the GPUs idle. Only a launch with at least
        // the World's processes on this host: processes a single launched task spawned share its LOCAL_RANK.
        try {
            const std::optional<LaunchEnv> launch = detect_launch_env();
            if (launch && launch->local_num_ranks >= placement.local_num_ranks) setup.device_hint = launch->local_rank;
        } catch (const Error& e) {
            WEFT_LOG_DEBUG("World::from_store: the launch environment is not usable (" << e.what()
                                                                                       << "); device by local rank");
        }
    }
    setup.same_process = placement.same_process;
    WEFT_LOG_DEBUG("World::from_store: rank " << m.rank << " of " << m.num_ranks << ", local rank "
                                              << setup.local_rank << " of " << setup.local_num_ranks
                                              << (placement.same_process ? ", ranks are threads of one process"
                                                                         : ", one process per rank")
                                              << ", keys under '" << m.key_prefix << "/'");
    return std::unique_ptr<World>(new World(std::move(setup)));
}

}  // namespace weft
