// SPDX-License-Identifier: MIT
// Integer index arithmetic shared by host code, kernels and tile maps: the one ceil_div and round_up.
#pragma once

#include "weft/common/macros.hpp"

namespace weft {

/// ceil(a / b) for a >= 0, b > 0.
WEFT_HOST_DEVICE constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/// The smallest multiple of `m` that is >= x, for x >= 0, m > 0.
WEFT_HOST_DEVICE constexpr int64_t round_up(int64_t x, int64_t m) { return ceil_div(x, m) * m; }

}  // namespace weft
