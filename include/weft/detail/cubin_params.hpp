// SPDX-License-Identifier: MIT
// How many parameters a kernel of a cubin takes, read from the cubin itself (no driver call).
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace weft::detail {

/// The number of parameters of the kernel `name` (its lowered, i.e. mangled, name) in the ELF cubin
/// `data[0, size)`: the EIATTR_KPARAM_INFO entries of its `.nv.info.<name>` section (one per parameter; ordinals
/// 0..n-1), 0 for a kernel whose section has none. nullopt when `data` is not a 64-bit little-endian ELF, has no
/// such section, or the section or an entry is malformed (any ordinal missing, repeated or out of bounds).
/// jit::Kernel asks the driver (cuKernelGetParamInfo) about exactly these indices: the driver has no count query
/// in CUDA 13.0, and asking one index past the last, to find the end, is an API error that compute-sanitizer
/// reports for every kernel. The section's layout is the one cuobjdump -elf decodes; nothing here trusts it
/// further than the bounds of `data`.
std::optional<size_t> cubin_kernel_param_count(const char* data, size_t size, std::string_view name);

}  // namespace weft::detail
