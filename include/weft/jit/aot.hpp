// SPDX-License-Identifier: MIT
// Ahead-of-time compilation: the specs weft's ops will need, and the spec-file format of weft-compile.
#pragma once

#include <string>
#include <vector>

#include "weft/jit/compiler.hpp"

namespace weft::jit {

/// Adds a spec to the list weft-compile --builtin compiles (ops register the configs they will
/// launch, so a deployment can warm its cache on a machine without a GPU). Thread-safe.
void register_aot_spec(KernelSpec spec);
/// Every registered spec, after weft's built-in ones (today: the JIT self-test kernels).
std::vector<KernelSpec> aot_specs();

/// The JIT self-test kernel kernels/jit_selftest/saxpy.cuh for one config.
KernelSpec jit_selftest_saxpy_spec(int items_per_thread, int redundant_passes);

/// Parses a spec file. One spec per line: `header|instantiation`, split at the first '|' (the
/// instantiation may itself contain '|'); a line ending in '\' continues on the next; blank lines
/// and lines starting with '#' are ignored; surrounding whitespace is trimmed. Throws weft::Error
/// naming `file_name` and the line when a line is malformed.
std::vector<KernelSpec> parse_spec_file(const std::string& text, const std::string& file_name);

}  // namespace weft::jit
