// SPDX-License-Identifier: MIT
// Whether two views' bytes meet: the ops' checks that an output is apart from its inputs.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "weft/runtime/tensor_view.hpp"

namespace weft::ops::detail {

/// Whether the bytes two views may touch intersect (each view's span: its first element to its last, strides included;
/// an empty view touches nothing). Two row-major matrices with the same row pitch are compared row by row: column
/// slices of one buffer side by side ([M, K] and [M, N] of an [M, K + N]) do not overlap.
bool views_overlap(const TensorView& x, const TensorView& y);

/// The bytes of `count` int32 values at `data` (an index or count array passed as a pointer) as a 1-D view.
TensorView int32_array_view(const int32_t* data, int64_t count);

/// An argument a call reads, named as the caller wrote it.
struct NamedView {
    const char* name;
    TensorView view;
};

/// Throws weft::Error "<op>: <out_name> must not overlap <input> (<why>), got ..." naming both views (shape, strides,
/// address), for the first input whose bytes meet `out`'s. `why` says where the two meet on the device.
void check_apart(const char* op, const char* out_name, const TensorView& out, std::initializer_list<NamedView> inputs,
                 const char* why);

}  // namespace weft::ops::detail
