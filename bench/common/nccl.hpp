// SPDX-License-Identifier: MIT
// NCCL as a benchmark baseline: loaded at run time (dlopen), and a communicator over every rank of a World wherever
// NCCL can run there (one GPU per rank, or ranks as processes over virtual nodes).
#pragma once

#include <nccl.h>

#include <string>

#include "weft/common/dtype.hpp"
#include "weft/runtime/error.hpp"

namespace weft {
class World;
}

namespace weft::bench {

/// NCCL's entry points, from the process's libnccl, the one weft's network backends use (weft/detail/nccl_library.hpp:
/// WEFT_NCCL_LIBRARY alone when set, else libnccl.so.2 on the loader's path, in $CUDA_HOME, $CUDA_PATH or
/// /usr/local/cuda, else in python3's nvidia.nccl package). `loaded` is false when none loads or the library lacks a
/// required entry point (`why_not` says which).
struct Nccl {
    bool loaded = false;
    std::string path;
    int version = 0;
    decltype(&ncclGetUniqueId) get_unique_id = nullptr;
    decltype(&ncclCommInitRank) comm_init_rank = nullptr;
    decltype(&ncclCommDestroy) comm_destroy = nullptr;
    decltype(&ncclAllReduce) all_reduce = nullptr;
    decltype(&ncclAllGather) all_gather = nullptr;
    decltype(&ncclReduceScatter) reduce_scatter = nullptr;
    decltype(&ncclGetErrorString) error_string = nullptr;
    decltype(&ncclGetVersion) get_version = nullptr;
    // Optional: all-to-all as ncclAlltoAll, else as grouped send/recv (absent: no NCCL all-to-all).
    decltype(&ncclAlltoAll) all_to_all = nullptr;
    decltype(&ncclSend) send = nullptr;
    decltype(&ncclRecv) recv = nullptr;
    decltype(&ncclGroupStart) group_start = nullptr;
    decltype(&ncclGroupEnd) group_end = nullptr;
    std::string why_not;  // when not loaded
};

/// The process's NCCL, loaded on first use (thread-safe).
const Nccl& nccl();

/// NCCL's element type for a benchmark dtype (bf16, f16, else f32).
ncclDataType_t nccl_type(DType t);

/// Checks an NCCL call in benchmark code: a weft::Error naming the call and NCCL's error string.
#define BENCH_NCCL_CHECK(call)                                                                                     \
    do {                                                                                                           \
        const ncclResult_t bench_r_ = (call);                                                                      \
        WEFT_CHECK(bench_r_ == ncclSuccess, #call << " failed: " << ::weft::bench::nccl().error_string(bench_r_)); \
    } while (0)

/// An NCCL communicator over every rank of a World (rank r of the World is NCCL rank r), or why there is none.
struct NcclBaseline {
    ncclComm_t comm = nullptr;  ///< nullptr: NCCL does not run here (`note` says why)
    /// One line for the table's header: "NCCL: off (--no-nccl)", "NCCL: n/a (<reason>)", or
    /// "NCCL <version> from <path>" (+ " (flat, over every rank)" when the World spans nodes).
    std::string note;
};

/// Collective over the World (every rank calls it, before the first NCCL call of its process): the communicator of
/// the NCCL baseline, or a note saying why there is none. `enabled` false: "off (--no-nccl)". NCCL refuses two ranks
/// of one host on one GPU, so ranks that share a GPU get none ("n/a (ranks share a GPU)") unless they are processes of
/// their own over virtual nodes: then every rank is a host of its own to NCCL (NCCL_HOSTID per rank, and unless set
/// NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1) and NCCL's network transport carries every byte of the baseline.
/// NVLink multicast stays off (NCCL_NVLS_ENABLE=0 unless set). Rank 0 makes the unique id and publishes it through
/// the World's store under `key` (bounded by the World's timeout). Throws weft::Error when NCCL fails.
NcclBaseline open_nccl_baseline(World& w, bool enabled, const std::string& key);

/// Destroys the communicator, if any (every rank, at the same point: after a barrier).
void close_nccl_baseline(NcclBaseline& b);

}  // namespace weft::bench
