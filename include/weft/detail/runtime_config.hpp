// SPDX-License-Identifier: MIT
// Pure resolution of the runtime's settings (option, else environment variable, else default), unit-tested.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace weft::detail {

inline constexpr uint64_t kDefaultHeapBytes = 1ull << 30;           ///< WEFT_SYMMETRIC_HEAP_BYTES default
/// WEFT_TIMEOUT_MS default: ten minutes, like NCCL's and PyTorch's, so that a rank that starts a collective late
/// (checkpointing, data loading) is waited for; dead ranks are the watchdog's (WEFT_DEAD_PEER_MS, seconds).
inline constexpr std::chrono::milliseconds kDefaultTimeout{600000};

/// Heap size: `option_bytes` when non-zero, else `env_value` (WEFT_SYMMETRIC_HEAP_BYTES, e.g. "512M"), else
/// 1 GiB; rounded up to a multiple of `granularity`. Throws weft::Error naming the variable when it is
/// malformed or zero.
uint64_t resolve_heap_bytes(uint64_t option_bytes, const std::optional<std::string>& env_value, uint64_t granularity);

/// Timeout: `option` when positive, else `env_value` (WEFT_TIMEOUT_MS, whole milliseconds > 0), else `fallback`.
/// Throws weft::Error naming `option_name` or the variable when a value is negative or above 30 days (deadlines are
/// steady-clock nanoseconds, and the device bound is a count of nanoseconds too).
std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds option, const std::optional<std::string>& env_value,
                                          const char* option_name = "WorldOptions::timeout",
                                          std::chrono::milliseconds fallback = kDefaultTimeout);

/// resolve_timeout(option, WEFT_TIMEOUT_MS), or kDefaultTimeout where this rank refuses them: the bound of the waits
/// before the World's start-up exchange, which refuses the setting where every rank hears of it.
std::chrono::milliseconds timeout_before_exchange(std::chrono::milliseconds option);

/// SM budget: `option` when positive, else `env_value` (WEFT_SM_BUDGET), else sm_count / ranks_on_device
/// (at least 1). Throws weft::Error when the chosen value is outside [1, sm_count].
int resolve_sm_budget(int option, const std::optional<std::string>& env_value, int sm_count, int ranks_on_device);

/// The compute capability weft's kernels are built for: 9.0 (Hopper: H100, H200, GH200), as sm_90a.
inline constexpr int kRequiredComputeMajor = 9;
inline constexpr int kRequiredComputeMinor = 0;

/// The architecture check every World makes before anything is compiled or launched: empty when a device of
/// compute capability `major`.`minor` runs weft's kernels, otherwise the plain sentence of the error, naming
/// what weft needs and what `rank` found (`device_name` as CUDA reports it, the capability, the CUDA ordinal
/// `device`). sm_90a code runs on compute capability 9.0 only: neither on earlier GPUs nor on later ones.
std::string unsupported_device_message(int rank, int device, const std::string& device_name, int major, int minor);

/// The warning the lowest rank on a GPU (`first_on_device`) gives when processes share it although they see several
/// GPUs (empty otherwise): `others` ranks of other processes on its device `device` (CUDA ordinal, from `local_rank`
/// % `visible_devices`), of `visible_devices` the process sees. Processes time-slice a shared GPU, which is what
/// weftrun -n 4 on one GPU wants, but with more GPUs in view it usually means LOCAL_RANK (or CUDA_VISIBLE_DEVICES) does
/// not give each process its own. Ranks that are threads of one process (`same_process`) share a GPU by design, and a
/// device the program chose (`device_given`: WorldOptions::device) is its own business: neither gets a warning.
std::string shared_gpu_warning(bool same_process, bool device_given, bool first_on_device, int local_rank, int device,
                               int others, int visible_devices);

/// "4096 bytes", "64 KiB", "1 GiB", "1.50 GiB (1610612736 bytes)": for messages.
std::string format_bytes(uint64_t bytes);

}  // namespace weft::detail
