// SPDX-License-Identifier: MIT
// Where the ranks of a World built on a store of the user's are (World::from_store): which share a host, and
// whether they are threads of one process. Exposed for its unit tests; not a user API.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "weft/runtime/store.hpp"

namespace weft::detail {

/// What each rank publishes about its process.
struct ProcessRecord {
    std::string host;           ///< host name
    std::string pid_namespace;  ///< "pid:[4026531836]", or "" when /proc cannot say
    int64_t pid = 0;
};

/// This process's record.
ProcessRecord this_process_record();

/// What the records say about one rank.
struct Placement {
    int local_rank = 0;         ///< index among the ranks of its host (same host name), in rank order
    int local_num_ranks = 1;    ///< ranks of its host
    bool same_process = true;   ///< every rank is a thread of one process
};

/// Pure: the placement of `rank` among `records` (one per rank, in rank order). Throws weft::Error when some
/// ranks share a process and others do not (a World's ranks are all threads of one process, or all processes
/// of their own), naming the ranks and the processes.
Placement placement_from_records(const std::vector<ProcessRecord>& records, int rank);

/// Collective: every rank publishes this_process_record() through `store` under `name` (an all-gather, whose
/// keys are removed afterwards) and gets placement_from_records of them all. Throws weft::Error naming the
/// ranks that did not arrive within `timeout`, or a malformed record.
Placement exchange_placement(Store& store, const std::string& name, int rank, int num_ranks,
                             std::chrono::milliseconds timeout);

}  // namespace weft::detail
