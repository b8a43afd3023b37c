// SPDX-License-Identifier: MIT
// Registers the kernel specialisations weft's ops launch, so `weft-compile --builtin` can warm a cache.
#pragma once

namespace weft::ops {

/// Registers (weft::jit::register_aot_spec) every specialisation the ops launch in common configurations
/// (today: the collectives for worlds of up to 8 ranks). Idempotent.
void register_aot_specs();

}  // namespace weft::ops
