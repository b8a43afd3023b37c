// SPDX-License-Identifier: MIT
#include "weft/detail/host_mapped_pool.hpp"

#include <cstring>
#include <mutex>
#include <vector>

#include <cuda_runtime_api.h>

#include "weft/runtime/error.hpp"
#include "weft/runtime/stream.hpp"

namespace weft::detail {

namespace {

constexpr size_t kChunkBytes = 64 * 1024;

struct Pool {
    std::mutex mu;
    std::vector<char*> free_blocks;  // host addresses
    // Chunks are never released: blocks may be read by the host after a kernel that used them failed, and the
    // process's exit releases pinned memory anyway (cudaFreeHost after CUDA's own teardown would fail).

    void add_chunk() {
        void* p = nullptr;
        const RelaxedCaptureMode relaxed;  // beside another rank thread's capture in global mode
        WEFT_CUDA_CHECK(cudaHostAlloc(&p, kChunkBytes, cudaHostAllocMapped | cudaHostAllocPortable));
        char* base = static_cast<char*>(p);
        for (size_t off = kChunkBytes; off >= kHostMappedBlockBytes; off -= kHostMappedBlockBytes) {
            free_blocks.push_back(base + off - kHostMappedBlockBytes);
        }
    }
};

Pool& pool() {
    static Pool* p = new Pool();  // never destroyed: blocks may be returned by other static destructors
    return *p;
}

}  // namespace

HostMappedBlock host_mapped_alloc(size_t bytes) {
    WEFT_CHECK(bytes > 0 && bytes <= kHostMappedBlockBytes,
               "host_mapped_alloc: " << bytes << " bytes asked; a block holds 1.." << kHostMappedBlockBytes);
    Pool& p = pool();
    char* host = nullptr;
    {
        std::lock_guard<std::mutex> lock(p.mu);
        if (p.free_blocks.empty()) p.add_chunk();
        host = p.free_blocks.back();
        p.free_blocks.pop_back();
    }
    std::memset(host, 0, kHostMappedBlockBytes);
    HostMappedBlock b;
    b.host = host;
    const cudaError_t st = cudaHostGetDevicePointer(&b.device, host, 0);
    if (st != cudaSuccess) {
        host_mapped_free(host);
        WEFT_CUDA_CHECK(st);
    }
    return b;
}

void host_mapped_free(void* host) noexcept {
    if (host == nullptr) return;
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mu);
    p.free_blocks.push_back(static_cast<char*>(host));
}

void host_mapped_reserve() {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mu);
    if (p.free_blocks.empty()) p.add_chunk();
}

}  // namespace weft::detail
