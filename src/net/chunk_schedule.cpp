// SPDX-License-Identifier: MIT
// The network path's chunk schedule (see include/weft/net/chunk_schedule.hpp).
#include "weft/net/chunk_schedule.hpp"

#include <algorithm>
#include <cstdlib>

#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"

namespace weft::net {

std::vector<Chunk> plan_chunks(uint64_t num_units, uint64_t unit_bytes, uint64_t unit_multiple, uint64_t chunk_bytes) {
    WEFT_CHECK(unit_bytes > 0, "plan_chunks: unit_bytes must be positive");
    WEFT_CHECK(unit_multiple > 0, "plan_chunks: unit_multiple must be positive");
    WEFT_CHECK(chunk_bytes > 0, "plan_chunks: chunk_bytes must be positive");
    std::vector<Chunk> chunks;
    if (num_units == 0) return chunks;
    uint64_t per_chunk = std::max<uint64_t>(1, chunk_bytes / unit_bytes / unit_multiple) * unit_multiple;
    // Grow the chunks until at most kMaxChunks cover the message.
    const uint64_t max_chunks = static_cast<uint64_t>(kMaxChunks);
    if ((num_units + per_chunk - 1) / per_chunk > max_chunks) {
        const uint64_t needed = (num_units + max_chunks - 1) / max_chunks;
        per_chunk = (needed + unit_multiple - 1) / unit_multiple * unit_multiple;
    }
    for (uint64_t begin = 0; begin < num_units; begin += per_chunk) {
        chunks.push_back({begin, std::min(per_chunk, num_units - begin)});
    }
    return chunks;
}

uint64_t resolve_chunk_bytes(const char* env_value) {
    if (env_value == nullptr || *env_value == '\0') return kDefaultChunkBytes;
    const uint64_t bytes = env::parse_bytes(env_value, "WEFT_NET_CHUNK_BYTES");
    WEFT_CHECK(bytes > 0, "WEFT_NET_CHUNK_BYTES must be positive, got '" << env_value << "'");
    return bytes;
}

uint64_t chunk_bytes_from_env() { return resolve_chunk_bytes(std::getenv("WEFT_NET_CHUNK_BYTES")); }

}  // namespace weft::net
