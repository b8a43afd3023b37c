// SPDX-License-Identifier: MIT
// How the network path cuts a message into pipelined chunks: pure, unit-tested on the CPU.
#pragma once

#include <cstdint>
#include <vector>

namespace weft::net {

/// One chunk: units [begin, begin + count) of the message.
struct Chunk {
    uint64_t begin = 0;
    uint64_t count = 0;
};

/// The most chunks one call uses (the backend keeps this many signal words per direction).
inline constexpr int kMaxChunks = 64;
/// WEFT_NET_CHUNK_BYTES default.
inline constexpr uint64_t kDefaultChunkBytes = 4ull << 20;

/// Cuts `num_units` units of `unit_bytes` bytes into consecutive chunks of about `chunk_bytes` bytes: every chunk but
/// the last holds the same number of units, a multiple of `unit_multiple` (so each chunk splits evenly, e.g. over the
/// ranks of a node), at least one multiple; at most kMaxChunks chunks (chunks grow to fit). Zero units: no chunk.
/// Throws weft::Error when unit_bytes, unit_multiple or chunk_bytes is zero.
std::vector<Chunk> plan_chunks(uint64_t num_units, uint64_t unit_bytes, uint64_t unit_multiple, uint64_t chunk_bytes);

/// The chunk size: `env_value` (WEFT_NET_CHUNK_BYTES, e.g. "4M") when set, else kDefaultChunkBytes. Throws weft::Error
/// naming the variable when it is malformed or zero.
uint64_t resolve_chunk_bytes(const char* env_value);

/// resolve_chunk_bytes of this process's WEFT_NET_CHUNK_BYTES: the chunk size every network path uses.
uint64_t chunk_bytes_from_env();

}  // namespace weft::net
