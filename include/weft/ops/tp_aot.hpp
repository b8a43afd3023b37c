// SPDX-License-Identifier: MIT
// The kernels of the tensor-parallel fused ops (AgGemm, GemmRs, GemmAr), for weft::jit's ahead-of-time registry.
#pragma once

#include <string>
#include <vector>

#include "weft/jit/compiler.hpp"

namespace weft::ops {

/// Every kernel the tensor-parallel ops launch with their default options plus the tuning candidates: for bf16 and
/// f16, the AllGather+GEMM and GEMM+ReduceScatter GEMMs of every fused candidate config (fused_gemm_candidates; RS
/// also with fp32 partials), the reductions, the notify kernel, and GemmAr's plain tiled GEMMs that are not
/// weft::ops::gemm candidates themselves (the other plain and small-M GEMMs are weft::ops::gemm's).
/// register_tp_aot_specs() hands them to weft::jit::register_aot_spec once, so that `weft-compile --builtin` warms
/// them (weft::ops::register_op_aot_specs calls it).
std::vector<jit::KernelSpec> tp_aot_specs();
void register_tp_aot_specs();

namespace detail {
/// AgGemm's and GemmRs's check, on a team that spans nodes, of the call descriptors that crossed the network
/// (kernels/tp_common/net_call_check.cuh).
jit::KernelSpec net_check_calls_kernel_spec(const std::string& arch = "");
}  // namespace detail

}  // namespace weft::ops
