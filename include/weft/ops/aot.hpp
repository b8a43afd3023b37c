// SPDX-License-Identifier: MIT
// The kernels weft's ops launch, handed to weft::jit's ahead-of-time registry (weft-compile --builtin).
#pragma once

namespace weft::ops {

/// Registers (once per process) every op's kernel specs with weft::jit::register_aot_spec, so that
/// weft::jit::aot_specs() lists them. weft-compile calls it for --builtin; a program that warms its own cache
/// may call it too. Thread-safe.
void register_op_aot_specs();

}  // namespace weft::ops
