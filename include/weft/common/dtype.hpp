// SPDX-License-Identifier: MIT
// Element types known to weft, shared by host code, kernels and the JIT code generator.
#pragma once

#include "weft/common/macros.hpp"  // fixed-width integers under g++, nvcc and NVRTC

namespace weft {

enum class DType : int32_t {
    kBF16 = 0,
    kF16 = 1,
    kF32 = 2,
    kF8E4M3 = 3,
    kI32 = 4,
    kI64 = 5,
    kU8 = 6,
};

/// Bytes per element.
WEFT_HOST_DEVICE constexpr int dtype_bytes(DType t) {
    switch (t) {
        case DType::kBF16: return 2;
        case DType::kF16: return 2;
        case DType::kF32: return 4;
        case DType::kF8E4M3: return 1;
        case DType::kI32: return 4;
        case DType::kI64: return 8;
        case DType::kU8: return 1;
    }
    return 0;
}

/// Short name ("bf16", "f16", ...), as used in logs, cache keys and benchmark tables.
WEFT_HOST_DEVICE constexpr const char* dtype_name(DType t) {
    switch (t) {
        case DType::kBF16: return "bf16";
        case DType::kF16: return "f16";
        case DType::kF32: return "f32";
        case DType::kF8E4M3: return "f8e4m3";
        case DType::kI32: return "i32";
        case DType::kI64: return "i64";
        case DType::kU8: return "u8";
    }
    return "?";
}

/// The C++ type name kernels use for a dtype (the JIT prints it into generated code).
WEFT_HOST_DEVICE constexpr const char* dtype_cpp_name(DType t) {
    switch (t) {
        case DType::kBF16: return "__nv_bfloat16";
        case DType::kF16: return "__half";
        case DType::kF32: return "float";
        case DType::kF8E4M3: return "__nv_fp8_e4m3";
        case DType::kI32: return "int32_t";
        case DType::kI64: return "int64_t";
        case DType::kU8: return "uint8_t";
    }
    return "?";
}

/// The enumerator as generated code spells it ("weft::DType::kBF16", ...): the one spelling the JIT code
/// generators print into kernel instantiations.
WEFT_HOST_DEVICE constexpr const char* dtype_enum_name(DType t) {
    switch (t) {
        case DType::kBF16: return "weft::DType::kBF16";
        case DType::kF16: return "weft::DType::kF16";
        case DType::kF32: return "weft::DType::kF32";
        case DType::kF8E4M3: return "weft::DType::kF8E4M3";
        case DType::kI32: return "weft::DType::kI32";
        case DType::kI64: return "weft::DType::kI64";
        case DType::kU8: return "weft::DType::kU8";
    }
    return "?";
}

}  // namespace weft
