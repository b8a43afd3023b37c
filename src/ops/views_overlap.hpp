// SPDX-License-Identifier: MIT
// Whether two views' bytes meet: the ops' checks that an output is apart from its inputs.
#pragma once

#include "weft/runtime/tensor_view.hpp"

namespace weft::ops::detail {

/// Whether the bytes two views may touch intersect (each view's span: its first element to its last, strides included;
/// an empty view touches nothing).
bool views_overlap(const TensorView& x, const TensorView& y);

}  // namespace weft::ops::detail
