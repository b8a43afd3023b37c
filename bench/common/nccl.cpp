// SPDX-License-Identifier: MIT
// NCCL as a benchmark baseline: its entry points from the process's libnccl, and the communicator over a World's ranks.
#include "common/nccl.hpp"

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "weft/detail/nccl_library.hpp"
#include "weft/runtime/store.hpp"
#include "weft/runtime/world.hpp"

namespace weft::bench {
const Nccl& nccl() {
    static const Nccl api = [] {
        Nccl a;
        const detail::NcclLibrary& lib = detail::NcclLibrary::process();
        if (!lib.loaded()) {
            a.why_not = lib.why_not();
            return a;
        }
        a.path = lib.path();
        std::string missing;
        lib.resolve(a.get_unique_id, "ncclGetUniqueId", missing);
        lib.resolve(a.comm_init_rank, "ncclCommInitRank", missing);
        lib.resolve(a.comm_destroy, "ncclCommDestroy", missing);
        lib.resolve(a.all_reduce, "ncclAllReduce", missing);
        lib.resolve(a.all_gather, "ncclAllGather", missing);
        lib.resolve(a.reduce_scatter, "ncclReduceScatter", missing);
        lib.resolve(a.error_string, "ncclGetErrorString", missing);
        lib.resolve(a.get_version, "ncclGetVersion", missing);
        std::string optional;  // all-to-all as ncclAlltoAll, else as grouped send/recv
        lib.resolve(a.all_to_all, "ncclAlltoAll", optional);
        lib.resolve(a.send, "ncclSend", optional);
        lib.resolve(a.recv, "ncclRecv", optional);
        lib.resolve(a.group_start, "ncclGroupStart", optional);
        lib.resolve(a.group_end, "ncclGroupEnd", optional);
        if (!missing.empty()) {
            a.why_not = a.path + " lacks an NCCL entry point (" + missing + ")";
            return a;
        }
        a.loaded = true;
        a.version = lib.version();
        return a;
    }();
    return api;
}

ncclDataType_t nccl_type(DType t) {
    return t == DType::kBF16 ? ncclBfloat16 : t == DType::kF16 ? ncclFloat16 : ncclFloat32;
}

NcclBaseline open_nccl_baseline(World& w, bool enabled, const std::string& key) {
    NcclBaseline b;
    const bool shared = w.max_ranks_per_device() > 1;
    const bool spans = w.num_nodes() > 1;
    const bool processes = !w.same_process();
    if (!enabled) {
        b.note = "NCCL: off (--no-nccl)";
        return b;
    }
    if (shared && (!processes || !spans)) {
        b.note = "NCCL: n/a (ranks share a GPU)";
        return b;
    }
    if (!nccl().loaded) {
        b.note = "NCCL: n/a (" + nccl().why_not + ")";
        return b;
    }
    ::setenv("NCCL_NVLS_ENABLE", "0", 0);
    if (shared) {
        // Processes on one GPU over virtual nodes: NCCL refuses two ranks of one host on one GPU, so every rank is a
        // host of its own to NCCL (set before this process's first NCCL call) and NCCL's network transport carries all
        // of the baseline's bytes.
        const std::string id = "weft-bench-rank" + std::to_string(w.rank());
        ::setenv("NCCL_HOSTID", id.c_str(), 1);
        ::setenv("NCCL_P2P_DISABLE", "1", 0);
        ::setenv("NCCL_SHM_DISABLE", "1", 0);
    }
    ncclUniqueId id{};
    if (w.rank() == 0) {
        BENCH_NCCL_CHECK(nccl().get_unique_id(&id));
        w.store().set(key, Bytes(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
    }
    const Bytes blob = w.store().get(key, w.timeout());
    WEFT_CHECK(blob.size() == sizeof(id), "NCCL unique id of " << blob.size() << " bytes");
    std::memcpy(&id, blob.data(), sizeof(id));
    BENCH_NCCL_CHECK(nccl().comm_init_rank(&b.comm, w.num_ranks(), id, w.rank()));
    std::ostringstream os;
    os << "NCCL " << nccl().version << " from " << nccl().path << (spans ? " (flat, over every rank)" : "");
    b.note = os.str();
    return b;
}

void close_nccl_baseline(NcclBaseline& b) {
    if (b.comm != nullptr) nccl().comm_destroy(b.comm);
    b.comm = nullptr;
}

}  // namespace weft::bench
