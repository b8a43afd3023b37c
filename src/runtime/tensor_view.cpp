// SPDX-License-Identifier: MIT
// TensorView helpers.
#include "weft/runtime/tensor_view.hpp"

#include <sstream>

#include "weft/runtime/error.hpp"

namespace weft {

TensorView::TensorView(void* ptr, DType type, std::initializer_list<int64_t> dims) : data(ptr), dtype(type) {
    WEFT_CHECK(dims.size() >= 1 && dims.size() <= kMaxDims,
               "TensorView takes 1 to " << kMaxDims << " dimensions, got " << dims.size());
    ndim = static_cast<int32_t>(dims.size());
    int i = 0;
    for (int64_t d : dims) {
        WEFT_CHECK(d >= 0, "TensorView dimension " << i << " must be non-negative, got " << d);
        shape[static_cast<size_t>(i++)] = d;
    }
    (void)numel();  // throws when the element count overflows int64
    int64_t s = 1;
    for (int k = ndim - 1; k >= 0; --k) {
        strides[static_cast<size_t>(k)] = s;
        if (__builtin_mul_overflow(s, shape[static_cast<size_t>(k)], &s)) s = 0;  // only with a zero extent
    }
}

TensorView::TensorView(void* ptr, DType type, std::initializer_list<int64_t> dims,
                       std::initializer_list<int64_t> element_strides)
    : TensorView(ptr, type, dims) {
    WEFT_CHECK(element_strides.size() == dims.size(),
               "TensorView needs one stride per dimension: " << dims.size() << " dimensions, "
                                                              << element_strides.size() << " strides");
    int i = 0;
    for (int64_t s : element_strides) {
        WEFT_CHECK(s >= 0, "TensorView stride " << i << " must be non-negative, got " << s);
        strides[static_cast<size_t>(i++)] = s;
    }
}

int64_t TensorView::numel() const {
    // The fields are public: a view set up by hand may hold any ndim and extents.
    WEFT_CHECK(ndim >= 0 && ndim <= kMaxDims,
               "TensorView must have 0 to " << kMaxDims << " dimensions, got ndim = " << ndim);
    if (ndim == 0) return 0;
    for (int i = 0; i < ndim; ++i) {
        if (shape[static_cast<size_t>(i)] == 0) return 0;
    }
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) {
        WEFT_CHECK(!__builtin_mul_overflow(n, shape[static_cast<size_t>(i)], &n),
                   "TensorView's element count overflows int64: " << describe());
    }
    return n;
}

int64_t TensorView::size_bytes() const {
    int64_t bytes = 0;
    WEFT_CHECK(!__builtin_mul_overflow(numel(), int64_t{dtype_bytes(dtype)}, &bytes),
               "TensorView's byte size overflows int64: " << describe());
    return bytes;
}

bool TensorView::is_contiguous() const {
    if (ndim < 0 || ndim > kMaxDims) return false;
    int64_t expect = 1;
    for (int k = ndim - 1; k >= 0; --k) {
        if (shape[static_cast<size_t>(k)] != 1 && strides[static_cast<size_t>(k)] != expect) return false;
        if (__builtin_mul_overflow(expect, shape[static_cast<size_t>(k)], &expect)) return false;
    }
    return true;
}

std::string TensorView::describe() const {
    std::ostringstream os;
    if (ndim < 0 || ndim > kMaxDims) {
        os << dtype_name(dtype) << " with ndim = " << ndim << " (not 0 to " << kMaxDims << ")";
        return os.str();
    }
    os << dtype_name(dtype) << "[";
    for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[static_cast<size_t>(i)];
    os << "] strides [";
    for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << strides[static_cast<size_t>(i)];
    os << "]";
    return os.str();
}

}  // namespace weft
