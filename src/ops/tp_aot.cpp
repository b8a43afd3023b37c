// SPDX-License-Identifier: MIT
// The tensor-parallel fused ops' ahead-of-time kernel specs, in one list.
#include "weft/ops/tp_aot.hpp"

#include <algorithm>
#include <mutex>
#include <utility>

#include "tp_common.hpp"
#include "weft/jit/aot.hpp"
#include "weft/ops/ag_gemm.hpp"
#include "weft/ops/gemm_ar.hpp"
#include "weft/ops/gemm_rs.hpp"

namespace weft::ops {

std::vector<jit::KernelSpec> tp_aot_specs() {
    std::vector<jit::KernelSpec> out;
    out.push_back(detail::ag_notify_kernel_spec());
    out.push_back(detail::ag_relay_kernel_spec());
    out.push_back(tp_detail::peer_pull_kernel_spec());
    out.push_back(detail::net_check_calls_kernel_spec());
    for (DType t : {DType::kBF16, DType::kF16}) {
        for (const GemmConfig& c : fused_gemm_candidates(t, t)) {
            out.push_back(detail::ag_gemm_kernel_spec(c));
            out.push_back(detail::gemm_rs_kernel_spec(c));
            out.push_back(detail::gemm_rs_kernel_spec(c, "", GemmRsMode::kPush));
            GemmConfig f32 = c;
            f32.out_dtype = DType::kF32;
            if (is_valid(f32)) out.push_back(detail::gemm_rs_kernel_spec(f32));
        }
        out.push_back(detail::rs_node_sum_kernel_spec(t));
        for (DType partial : {t, DType::kF32}) {
            out.push_back(detail::rs_reduce_kernel_spec(partial, t));
            out.push_back(detail::ar_reduce_kernel_spec(partial, t));
            // GemmAr's tiled GEMM (the plain kernel with a fused candidate): those that are not plain candidates
            // themselves (a ping-pong pair's tile without its cluster).
            const std::vector<GemmConfig> plain = gemm_candidate_configs(t, partial, BLayout::kNK);
            for (const GemmConfig& c : fused_gemm_candidates(t, partial)) {
                if (std::find(plain.begin(), plain.end(), c) == plain.end()) {
                    out.push_back(fused_gemm_kernel_spec(plain_gemm_fused_spec(), c));
                }
            }
        }
    }
    return out;
}

void register_tp_aot_specs() {
    static std::once_flag once;
    std::call_once(once, [] {
        for (auto& spec : tp_aot_specs()) jit::register_aot_spec(std::move(spec));
    });
}

}  // namespace weft::ops
