// SPDX-License-Identifier: MIT
// A DLPack capsule (the unversioned DLManagedTensor ABI, DLPack 0.x/1.x) over memory weft owns, for zero-copy tensors.
#include <Python.h>

#include "binding.hpp"

#include "weft/runtime/error.hpp"

namespace weft::python {

namespace {

// The DLPack ABI, as dlpack.h defines it (the layout is frozen for the unversioned capsule).
struct DLDevice {
    int32_t device_type;  // kDLCUDA = 2
    int32_t device_id;
};
struct DLDataType {
    uint8_t code;  // kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4
    uint8_t bits;
    uint16_t lanes;
};
struct DLTensor {
    void* data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t* shape;
    int64_t* strides;
    uint64_t byte_offset;
};
struct DLManagedTensor {
    DLTensor dl_tensor;
    void* manager_ctx;
    void (*deleter)(DLManagedTensor* self);
};

constexpr int32_t kDLCUDA = 2;
constexpr const char* kCapsuleName = "dltensor";

struct Owned {
    DLManagedTensor managed{};
    int64_t shape[TensorView::kMaxDims]{};
    int64_t strides[TensorView::kMaxDims]{};
};

void delete_owned(DLManagedTensor* self) { delete static_cast<Owned*>(self->manager_ctx); }

// A capsule nobody consumed still owns its DLManagedTensor; a consumer renames it "used_dltensor" and calls the
// deleter itself when its tensor dies.
void capsule_destructor(PyObject* capsule) {
    if (PyCapsule_IsValid(capsule, kCapsuleName)) {
        auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
        if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
    }
}

DLDataType dl_dtype(DType dtype) {
    switch (dtype) {
        case DType::kBF16: return {4, 16, 1};
        case DType::kF16: return {2, 16, 1};
        case DType::kF32: return {2, 32, 1};
        case DType::kI32: return {0, 32, 1};
        case DType::kI64: return {0, 64, 1};
        case DType::kU8: return {1, 8, 1};
        case DType::kF8E4M3: break;
    }
    // NOTE: fp8 has no code in every DLPack version torch accepts; the Python layer exports u8 and views it.
    WEFT_FAIL("dtype: " << dtype_name(dtype) << " cannot be exported through DLPack; export u8 and view it");
}

}  // namespace

nb::object make_dlpack_capsule(const TensorView& view, int device) {
    WEFT_CHECK(view.ndim >= 1 && view.ndim <= TensorView::kMaxDims,
               "shape: expected 1 to " << TensorView::kMaxDims << " dimensions, got " << view.ndim);
    auto owned = std::make_unique<Owned>();
    DLTensor& t = owned->managed.dl_tensor;
    t.data = view.data;
    t.device = {kDLCUDA, device};
    t.ndim = view.ndim;
    t.dtype = dl_dtype(view.dtype);
    for (int i = 0; i < view.ndim; ++i) {
        owned->shape[i] = view.shape[static_cast<size_t>(i)];
        owned->strides[i] = view.strides[static_cast<size_t>(i)];
    }
    t.shape = owned->shape;
    t.strides = owned->strides;
    t.byte_offset = 0;
    owned->managed.manager_ctx = owned.get();
    owned->managed.deleter = delete_owned;
    PyObject* capsule = PyCapsule_New(&owned->managed, kCapsuleName, capsule_destructor);
    if (capsule == nullptr) throw nb::python_error();
    owned.release();
    return nb::steal(capsule);
}

}  // namespace weft::python
