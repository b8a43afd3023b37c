// SPDX-License-Identifier: MIT
// Pure resolution of the runtime's settings (option, else environment variable, else default), unit-tested.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace weft::detail {

inline constexpr uint64_t kDefaultHeapBytes = 1ull << 30;           ///< WEFT_SYMMETRIC_HEAP_BYTES default
inline constexpr std::chrono::milliseconds kDefaultTimeout{10000};  ///< WEFT_TIMEOUT_MS default

/// Heap size: `option_bytes` when non-zero, else `env_value` (WEFT_SYMMETRIC_HEAP_BYTES, e.g. "512M"), else
/// 1 GiB; rounded up to a multiple of `granularity`. Throws weft::Error naming the variable when it is
/// malformed or zero.
uint64_t resolve_heap_bytes(uint64_t option_bytes, const std::optional<std::string>& env_value, uint64_t granularity);

/// Timeout: `option` when positive, else `env_value` (WEFT_TIMEOUT_MS, whole milliseconds > 0), else 10 s.
std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds option,
                                          const std::optional<std::string>& env_value);

/// SM budget: `option` when positive, else `env_value` (WEFT_SM_BUDGET), else sm_count / ranks_on_device
/// (at least 1). Throws weft::Error when the chosen value is outside [1, sm_count].
int resolve_sm_budget(int option, const std::optional<std::string>& env_value, int sm_count, int ranks_on_device);

/// "4096 bytes", "64 KiB", "1 GiB", "1.50 GiB (1610612736 bytes)": for messages.
std::string format_bytes(uint64_t bytes);

}  // namespace weft::detail
