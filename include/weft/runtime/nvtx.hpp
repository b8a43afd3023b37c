// SPDX-License-Identifier: MIT
// NVTX ranges in the "weft" domain: Nsight Systems shows every op call and its phases (setup, autotune, launch) by
// name on the calling thread's row. Without a tool attached a range costs two calls that return at once.
#pragma once

namespace weft {

/// An NVTX push/pop range in the "weft" domain for the lifetime of the object, on the calling thread. `name` is
/// copied by the tool when the range opens: a temporary string is fine. Never throws.
class NvtxRange {
public:
    explicit NvtxRange(const char* name) noexcept;
    ~NvtxRange();
    NvtxRange(const NvtxRange&) = delete;
    NvtxRange& operator=(const NvtxRange&) = delete;
};

/// A named point in time in the "weft" domain (e.g. a decision), on the calling thread's row.
void nvtx_mark(const char* name) noexcept;

}  // namespace weft

#define WEFT_NVTX_CONCAT_INNER_(a, b) a##b
#define WEFT_NVTX_CONCAT_(a, b) WEFT_NVTX_CONCAT_INNER_(a, b)
/// An NvtxRange named `name` (a const char*) until the end of the enclosing scope.
#define WEFT_NVTX_RANGE(name) const ::weft::NvtxRange WEFT_NVTX_CONCAT_(weft_nvtx_range_, __LINE__)(name)
