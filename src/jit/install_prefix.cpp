// SPDX-License-Identifier: MIT
// The install prefix slot (see weft/detail/install_prefix.hpp) and its rewriting.
#include "weft/detail/install_prefix.hpp"

#include <algorithm>
#include <cstring>

#include "weft/runtime/error.hpp"
#include "weft_configured_install_prefix.hpp"  // generated: WEFT_CONFIGURED_INSTALL_PREFIX

// NOTE: the tag's text exists only here, as the start of the slot: the rewriter reads it from this
// process's own slot, so a library file holds it exactly once (a second copy as a string literal would
// make the slot ambiguous).
#define WEFT_INSTALL_PREFIX_TAG "<weft install prefix>:::"
static_assert(sizeof(WEFT_INSTALL_PREFIX_TAG) - 1 == weft::detail::kInstallPrefixTagBytes);
static_assert(sizeof(WEFT_CONFIGURED_INSTALL_PREFIX) <=
                  weft::detail::kInstallPrefixSlotBytes - weft::detail::kInstallPrefixTagBytes,
              "CMAKE_INSTALL_PREFIX is longer than weft's install prefix slot");

namespace weft::detail {

char install_prefix_slot[kInstallPrefixSlotBytes] = WEFT_INSTALL_PREFIX_TAG WEFT_CONFIGURED_INSTALL_PREFIX;

std::string installed_prefix() {
    // Read through a volatile pointer: the bytes are the file's, whatever the compiler saw at build time.
    const volatile char* p = install_prefix_slot + kInstallPrefixTagBytes;
    std::string prefix;
    for (std::size_t i = kInstallPrefixTagBytes; i < kInstallPrefixSlotBytes && *p != '\0'; ++i, ++p) {
        prefix.push_back(*p);
    }
    return prefix;
}

void rewrite_install_prefix_slot(std::vector<char>& image, const std::string& prefix) {
    WEFT_CHECK(!prefix.empty() && prefix.front() == '/',
               "the install prefix must be an absolute path, got '" << prefix << "'");
    WEFT_CHECK(prefix.size() < kInstallPrefixSlotBytes - kInstallPrefixTagBytes,
               "the install prefix '" << prefix << "' has " << prefix.size() << " bytes; weft's slot holds at most "
                                      << kInstallPrefixSlotBytes - kInstallPrefixTagBytes - 1);
    WEFT_CHECK(prefix.find('\0') == std::string::npos, "the install prefix must not contain a NUL byte");
    const volatile char* own_slot = install_prefix_slot;
    std::string tag(kInstallPrefixTagBytes, '\0');
    for (std::size_t i = 0; i < kInstallPrefixTagBytes; ++i) tag[i] = own_slot[i];

    std::size_t found = 0;
    int count = 0;
    for (auto at = std::search(image.begin(), image.end(), tag.begin(), tag.end()); at != image.end();
         at = std::search(at + 1, image.end(), tag.begin(), tag.end())) {
        found = static_cast<std::size_t>(at - image.begin());
        ++count;
    }
    WEFT_CHECK(count == 1, "expected exactly one install prefix slot in the library file, found "
                               << count << (count == 0 ? " (not weft's library, or one built with link-time "
                                                         "optimisation, which keeps no plain slot)"
                                                       : ""));
    WEFT_CHECK(found + kInstallPrefixSlotBytes <= image.size(),
               "the install prefix slot at byte " << found << " runs past the end of the library file ("
                                                  << image.size() << " bytes)");
    char* slot = image.data() + found + kInstallPrefixTagBytes;
    const std::size_t room = kInstallPrefixSlotBytes - kInstallPrefixTagBytes;
    WEFT_CHECK(std::memchr(slot, '\0', room) != nullptr,
               "the install prefix slot at byte " << found << " holds no terminated prefix: not weft's slot");
    std::fill(slot, slot + room, '\0');
    std::copy(prefix.begin(), prefix.end(), slot);
}

}  // namespace weft::detail
