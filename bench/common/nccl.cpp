// SPDX-License-Identifier: MIT
// NCCL as a benchmark baseline: the run-time loader and the communicator over a World's ranks.
#include "common/nccl.hpp"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <type_traits>
#include <vector>

#include "weft/runtime/env.hpp"
#include "weft/runtime/store.hpp"
#include "weft/runtime/world.hpp"

namespace weft::bench {
namespace {

std::string python_nccl_dir() {
    FILE* p = popen(
        "python3 -c \"import nvidia.nccl,os;print(os.path.dirname(nvidia.nccl.__file__ or "
        "nvidia.nccl.__path__[0]))\" 2>/dev/null",
        "r");
    if (p == nullptr) return "";
    char buf[4096] = {};
    const size_t n = std::fread(buf, 1, sizeof(buf) - 1, p);
    pclose(p);
    std::string s(buf, n);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    return s;
}

}  // namespace

const Nccl& nccl() {
    static const Nccl api = [] {
        Nccl a;
        std::vector<std::string> candidates;
        if (const auto e = env::get("WEFT_NCCL_LIBRARY")) candidates.push_back(*e);
        if (const std::string dir = python_nccl_dir(); !dir.empty()) {
            candidates.push_back(dir + "/lib/libnccl.so.2");
            candidates.push_back(dir + "/libnccl.so.2");
        }
        candidates.push_back("libnccl.so.2");
        for (const char* var : {"CUDA_HOME", "CUDA_PATH"}) {
            if (const auto e = env::get(var)) candidates.push_back(*e + "/lib64/libnccl.so.2");
        }
        for (const std::string& c : candidates) {
            a.handle = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
            if (a.handle != nullptr) {
                a.path = c;
                break;
            }
        }
        if (a.handle == nullptr) {
            a.why_not = "libnccl.so.2 not found (set WEFT_NCCL_LIBRARY)";
            return a;
        }
        const auto load = [&](auto& fn, const char* name) {
            fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(a.handle, name));
        };
        load(a.get_unique_id, "ncclGetUniqueId");
        load(a.comm_init_rank, "ncclCommInitRank");
        load(a.comm_destroy, "ncclCommDestroy");
        load(a.all_reduce, "ncclAllReduce");
        load(a.all_gather, "ncclAllGather");
        load(a.reduce_scatter, "ncclReduceScatter");
        load(a.error_string, "ncclGetErrorString");
        load(a.get_version, "ncclGetVersion");
        load(a.all_to_all, "ncclAlltoAll");  // optional, as are the send/recv group calls below
        load(a.send, "ncclSend");
        load(a.recv, "ncclRecv");
        load(a.group_start, "ncclGroupStart");
        load(a.group_end, "ncclGroupEnd");
        if (!a.get_unique_id || !a.comm_init_rank || !a.comm_destroy || !a.all_reduce || !a.all_gather ||
            !a.reduce_scatter || !a.error_string || !a.get_version) {
            a.why_not = a.path + " lacks an NCCL entry point";
            dlclose(a.handle);
            a.handle = nullptr;
            return a;
        }
        a.get_version(&a.version);
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
    if (nccl().handle == nullptr) {
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
