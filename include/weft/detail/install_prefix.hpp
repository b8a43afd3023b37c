// SPDX-License-Identifier: MIT
// The install prefix compiled into weft's library: the last place the JIT looks for weft's headers and kernels.
//
// The library holds the prefix in a fixed-size slot in its data: the configured CMAKE_INSTALL_PREFIX at build
// time, rewritten in the installed file by `cmake --install` (through weft-install-prefix) to the prefix the
// install goes to (`--prefix DIR` included; DESTDIR is not part of it). So a program that links the static
// library from an install finds <prefix>/include and <prefix>/share/weft/kernels wherever it lives itself.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace weft::detail {

/// Bytes in the slot: the tag, then the prefix, NUL-terminated and NUL-padded.
inline constexpr std::size_t kInstallPrefixSlotBytes = 4096;
/// Bytes of the tag that starts the slot and identifies it in a library file.
inline constexpr std::size_t kInstallPrefixTagBytes = 24;

/// The slot of this process's weft (written only by rewriting the library file, never at run time).
/// NOTE: not const, so that the compiler reads what the file holds instead of folding the configured value
/// into the code that uses it.
extern char install_prefix_slot[kInstallPrefixSlotBytes];

/// The prefix in this process's slot; empty when none was configured.
std::string installed_prefix();

/// Rewrites the slot in `image` (a library file's bytes) to hold `prefix`, leaving every other byte as it was.
/// Throws weft::Error when `image` holds no slot or more than one (a library built with link-time
/// optimisation keeps no plain slot), or when `prefix` is not an absolute path shorter than the slot.
void rewrite_install_prefix_slot(std::vector<char>& image, const std::string& prefix);

}  // namespace weft::detail
