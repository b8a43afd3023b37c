// SPDX-License-Identifier: MIT
// Small pinned, device-mapped blocks for the status words of ops, carved from chunks allocated once per process.
#pragma once

#include <cstddef>

namespace weft::detail {

/// Bytes of one block (every allocation gets one whole block).
inline constexpr size_t kHostMappedBlockBytes = 256;

/// A block: its host address and the address kernels use.
struct HostMappedBlock {
    void* host = nullptr;
    void* device = nullptr;
};

/// A zeroed block of pinned, device-mapped memory (`bytes` <= kHostMappedBlockBytes, else weft::Error).
/// cudaHostAlloc and cudaFreeHost wait for kernels spinning anywhere on the device (docs/runtime.md), so ops made
/// or destroyed while other ranks' kernels spin take their host-mapped words from here: a chunk is allocated only
/// when every block is taken, and host_mapped_reserve() (called when a World is made) has one ready before
/// anything spins. Thread-safe; chunks live until the process ends.
HostMappedBlock host_mapped_alloc(size_t bytes);
/// Returns a block from host_mapped_alloc (nullptr is ignored).
void host_mapped_free(void* host) noexcept;
/// Makes sure a chunk with free blocks exists.
void host_mapped_reserve();

}  // namespace weft::detail
