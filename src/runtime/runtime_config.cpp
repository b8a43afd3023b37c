// SPDX-License-Identifier: MIT
// Resolution of the runtime's settings (see include/weft/detail/runtime_config.hpp).
#include "weft/detail/runtime_config.hpp"

#include <cstdio>
#include <sstream>

#include "weft/detail/rendezvous_protocol.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"

namespace weft::detail {

uint64_t resolve_heap_bytes(uint64_t option_bytes, const std::optional<std::string>& env_value, uint64_t granularity) {
    WEFT_CHECK(granularity > 0, "heap granularity must be positive");
    uint64_t bytes = kDefaultHeapBytes;
    if (option_bytes > 0) {
        bytes = option_bytes;
    } else if (env_value) {
        bytes = env::parse_bytes(*env_value, "WEFT_SYMMETRIC_HEAP_BYTES");
        WEFT_CHECK(bytes > 0, "WEFT_SYMMETRIC_HEAP_BYTES must be positive, got '" << *env_value << "'");
    }
    const uint64_t rem = bytes % granularity;
    if (rem != 0) {
        WEFT_CHECK(bytes <= UINT64_MAX - (granularity - rem), "symmetric heap size " << bytes << " is too large");
        bytes += granularity - rem;
    }
    return bytes;
}

std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds option, const std::optional<std::string>& env_value,
                                          const char* option_name, std::chrono::milliseconds fallback) {
    constexpr auto kMaxMs = static_cast<int64_t>(rendezvous::kMaxWaitMs);
    WEFT_CHECK(option.count() >= 0, option_name << " must not be negative, got " << option.count() << " ms");
    WEFT_CHECK(option.count() <= kMaxMs,
               option_name << " must be at most 30 days (" << kMaxMs << " ms), got " << option.count() << " ms");
    if (option.count() > 0) return option;
    if (env_value) {
        int64_t ms = env::parse_int(*env_value, "WEFT_TIMEOUT_MS");
        WEFT_CHECK(ms > 0 && ms <= kMaxMs,
                   "WEFT_TIMEOUT_MS must be a positive number of milliseconds, at most 30 days ("
                       << kMaxMs << "), got '" << *env_value << "'");
        return std::chrono::milliseconds(ms);
    }
    return fallback;
}

std::chrono::milliseconds timeout_before_exchange(std::chrono::milliseconds option) {
    try {
        return resolve_timeout(option, env::get("WEFT_TIMEOUT_MS"));
    } catch (const Error&) {
        return kDefaultTimeout;
    }
}

int resolve_sm_budget(int option, const std::optional<std::string>& env_value, int sm_count, int ranks_on_device) {
    WEFT_CHECK(sm_count > 0, "the device reports " << sm_count << " SMs");
    WEFT_CHECK(ranks_on_device > 0, "ranks on device must be positive, got " << ranks_on_device);
    WEFT_CHECK(option >= 0, "WorldOptions::sm_budget must not be negative, got " << option);
    int budget = 0;
    const char* source = "WorldOptions::sm_budget";
    if (option > 0) {
        budget = option;
    } else if (env_value) {
        int64_t v = env::parse_int(*env_value, "WEFT_SM_BUDGET");
        WEFT_CHECK(v > 0 && v <= sm_count,
                   "WEFT_SM_BUDGET must be in [1, " << sm_count << "] (the device's SMs), got '" << *env_value << "'");
        budget = static_cast<int>(v);
        source = "WEFT_SM_BUDGET";
    } else {
        budget = sm_count / ranks_on_device;
        if (budget < 1) budget = 1;
    }
    WEFT_CHECK(budget >= 1 && budget <= sm_count,
               source << " must be in [1, " << sm_count << "] (the device's SMs), got " << budget);
    return budget;
}

std::string unsupported_device_message(int rank, int device, const std::string& device_name, int major, int minor) {
    if (major == kRequiredComputeMajor && minor == kRequiredComputeMinor) return {};
    std::ostringstream os;
    os << "weft needs an NVIDIA Hopper GPU (compute capability " << kRequiredComputeMajor << "."
       << kRequiredComputeMinor << ", sm_90a: H100, H200 or GH200); rank " << rank << " found "
       << (device_name.empty() ? std::string("a GPU without a name") : device_name) << " (compute capability "
       << major << "." << minor << ") as CUDA device " << device << ". ";
    if (major < kRequiredComputeMajor) {
        os << "Its kernels use Hopper instructions (wgmma, TMA, thread-block clusters) that this older GPU lacks";
    } else {
        os << "Its kernels are built for sm_90a, whose Hopper-specific instructions (wgmma) later GPUs do not run";
    }
    os << "; run on a Hopper GPU (CUDA_VISIBLE_DEVICES selects which GPUs a process sees)";
    return os.str();
}

std::string shared_gpu_warning(bool same_process, bool device_given, bool first_on_device, int local_rank, int device,
                               int others, int visible_devices) {
    if (same_process || device_given || !first_on_device || others <= 0 || visible_devices <= 1) return {};
    std::ostringstream os;
    os << "local rank " << local_rank << " shares CUDA device " << device << " with " << others
       << " rank(s) of other processes although its process sees " << visible_devices
       << " GPUs: processes on one GPU time-slice it. Give each process its own GPU (a LOCAL_RANK per process on "
          "the host, or CUDA_VISIBLE_DEVICES / --gpus-per-task), or choose one with WorldOptions::device";
    return os.str();
}

std::string format_bytes(uint64_t bytes) {
    static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
    if (bytes < 1024) return std::to_string(bytes) + " bytes";
    int unit = -1;
    uint64_t scale = 1;
    while (unit < 3 && bytes >= scale * 1024) {
        scale *= 1024;
        ++unit;
    }
    if (bytes % scale == 0) return std::to_string(bytes / scale) + " " + kUnits[unit];
    char text[64];
    std::snprintf(text, sizeof(text), "%.2f %s (%llu bytes)", static_cast<double>(bytes) / static_cast<double>(scale),
                  kUnits[unit], static_cast<unsigned long long>(bytes));
    return text;
}

}  // namespace weft::detail
