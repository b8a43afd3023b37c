// SPDX-License-Identifier: MIT
// TensorView: a small non-owning description of a device buffer (pointer, shape, strides, dtype).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "weft/common/dtype.hpp"

namespace weft {

/// Row-major by default; strides are in elements. Up to kMaxDims dimensions. Ops validate views
/// (shape, dtype, alignment, symmetric-heap membership) and throw weft::Error naming the argument.
struct TensorView {
    static constexpr int kMaxDims = 4;

    void* data = nullptr;
    DType dtype = DType::kBF16;
    int32_t ndim = 0;
    std::array<int64_t, kMaxDims> shape{};
    std::array<int64_t, kMaxDims> strides{};  ///< in elements

    TensorView() = default;
    /// A contiguous row-major view.
    TensorView(void* ptr, DType type, std::initializer_list<int64_t> dims);
    /// A view with explicit strides (in elements).
    TensorView(void* ptr, DType type, std::initializer_list<int64_t> dims,
               std::initializer_list<int64_t> element_strides);

    /// Throws weft::Error when ndim is outside [0, kMaxDims] or the count overflows int64.
    int64_t numel() const;
    /// numel() x the element size; throws weft::Error as numel() does, or when the product overflows int64.
    int64_t size_bytes() const;
    int64_t dim(int i) const { return shape.at(static_cast<size_t>(i)); }
    int64_t stride(int i) const { return strides.at(static_cast<size_t>(i)); }
    /// True when the innermost stride is 1 and every outer stride is the product of inner extents.
    bool is_contiguous() const;
    /// "bf16[8192, 4096] strides [4096, 1]"
    std::string describe() const;
};

}  // namespace weft
