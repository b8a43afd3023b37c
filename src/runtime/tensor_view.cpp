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
    int64_t s = 1;
    for (int k = ndim - 1; k >= 0; --k) {
        strides[static_cast<size_t>(k)] = s;
        s *= shape[static_cast<size_t>(k)];
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
    if (ndim == 0) return 0;
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[static_cast<size_t>(i)];
    return n;
}

bool TensorView::is_contiguous() const {
    int64_t expect = 1;
    for (int k = ndim - 1; k >= 0; --k) {
        if (shape[static_cast<size_t>(k)] != 1 && strides[static_cast<size_t>(k)] != expect) return false;
        expect *= shape[static_cast<size_t>(k)];
    }
    return true;
}

std::string TensorView::describe() const {
    std::ostringstream os;
    os << dtype_name(dtype) << "[";
    for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << shape[static_cast<size_t>(i)];
    os << "] strides [";
    for (int i = 0; i < ndim; ++i) os << (i ? ", " : "") << strides[static_cast<size_t>(i)];
    os << "]";
    return os.str();
}

}  // namespace weft
