// SPDX-License-Identifier: MIT
// Every op's ahead-of-time kernel specs, registered in one place (an explicit call: a static library drops
// self-registering objects that nothing references).
#include "weft/ops/aot.hpp"

#include "weft/ops/ag_attention.hpp"
#include "weft/ops/attention.hpp"
#include "weft/ops/collectives.hpp"
#include "weft/ops/ep.hpp"
#include "weft/ops/gemm_codegen.hpp"
#include "weft/ops/grouped_gemm.hpp"
#include "weft/ops/tp_aot.hpp"

namespace weft::ops {

void register_op_aot_specs() {
    register_gemm_aot_specs();
    register_grouped_gemm_aot_specs();
    register_collective_aot_specs(8);
    ep::register_ep_aot_specs();
    register_tp_aot_specs();
    register_attention_aot_specs();
    register_prefill_attention_aot_specs();
}

}  // namespace weft::ops
