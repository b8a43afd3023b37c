// SPDX-License-Identifier: MIT
// The softmax scale of the attention ops (decode, prefill, AgAttention): the kernels take it in base 2.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>

#include "weft/runtime/error.hpp"

namespace weft::ops::detail {

inline constexpr float kLog2e = 1.4426950408889634f;

/// options.scale, else 1 / sqrt(head_dim), times log2(e) as the kernels take it; weft::Error naming `op` when that is
/// not finite (a scale above about 2.3e38 in magnitude overflows there).
inline float attention_scale_log2(const std::optional<float>& scale, int64_t head_dim, const char* op) {
    const float s = scale ? *scale : 1.f / std::sqrt(static_cast<float>(head_dim));
    WEFT_CHECK(std::isfinite(s * kLog2e),
               op << ": options.scale must be finite and at most about 2.3e38 in magnitude, got " << s);
    return s * kLog2e;
}

}  // namespace weft::ops::detail
