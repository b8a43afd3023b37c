// SPDX-License-Identifier: MIT
// Unit tests of the JIT's last search root: the install prefix slot in weft's library, how `cmake --install`
// rewrites it, and the search order that ends with it.
#include <gtest/gtest.h>
#include <nvrtc.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "support/jit_testing.hpp"
#include "weft/detail/install_prefix.hpp"
#include "weft/jit/cache.hpp"
#include "weft/jit/paths.hpp"
#include "weft/runtime/error.hpp"

namespace weft::jit {
namespace {

namespace fs = std::filesystem;
using weft::detail::install_prefix_slot;
using weft::detail::kInstallPrefixSlotBytes;
using weft::detail::kInstallPrefixTagBytes;
using weft::detail::rewrite_install_prefix_slot;
using weft::testing::TempDir;
using weft::testing::write_text_file;

std::vector<char> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

// The tag, read from this process's own slot (the only place its text exists).
std::string tag() { return std::string(install_prefix_slot, kInstallPrefixTagBytes); }

// A slot as a library file holds it: tag, prefix, NUL padding.
std::string slot_holding(const std::string& prefix) {
    std::string slot = tag() + prefix;
    slot.resize(kInstallPrefixSlotBytes, '\0');
    return slot;
}

// The prefix in the slot that starts at `offset` of `image`.
std::string prefix_at(const std::vector<char>& image, size_t offset) {
    return std::string(image.data() + offset + kInstallPrefixTagBytes);
}

size_t count_slots(const std::vector<char>& image) {
    const std::string t = tag();
    size_t n = 0;
    for (auto at = std::search(image.begin(), image.end(), t.begin(), t.end()); at != image.end();
         at = std::search(at + 1, image.end(), t.begin(), t.end())) {
        ++n;
    }
    return n;
}

void expect_error(const std::function<void()>& fn, const std::string& fragment) {
    try {
        fn();
        ADD_FAILURE() << "expected weft::Error containing '" << fragment << "'";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
}

TEST(JitInstallPrefix, RewritesTheSlotAndNothingElse) {
    const std::string head = std::string("\x7f" "ELF", 4) + std::string(100, '\x11') + std::string(3, '\0');
    const std::string tail = std::string(5, '\0') + "text after the slot" + std::string(77, '\x22');
    const std::vector<char> before = bytes_of(head + slot_holding("/usr/local") + tail);
    std::vector<char> image = before;
    rewrite_install_prefix_slot(image, "/opt/weft-0.1");
    ASSERT_EQ(image.size(), before.size());
    EXPECT_EQ(prefix_at(image, head.size()), "/opt/weft-0.1");
    for (size_t i = 0; i < image.size(); ++i) {
        const bool in_slot_text =
            i >= head.size() + kInstallPrefixTagBytes && i < head.size() + kInstallPrefixSlotBytes;
        if (!in_slot_text) {
            ASSERT_EQ(image[i], before[i]) << "byte " << i << " outside the slot's text changed";
        }
    }
    // A longer prefix, then a shorter one: no byte of the longer survives after the terminator.
    rewrite_install_prefix_slot(image, "/a/much/longer/prefix/than/before");
    rewrite_install_prefix_slot(image, "/b");
    EXPECT_EQ(prefix_at(image, head.size()), "/b");
    EXPECT_TRUE(std::all_of(image.begin() + static_cast<std::ptrdiff_t>(head.size() + kInstallPrefixTagBytes + 2),
                            image.begin() + static_cast<std::ptrdiff_t>(head.size() + kInstallPrefixSlotBytes),
                            [](char c) { return c == '\0'; }));
    // The longest prefix that fits leaves room for the terminator.
    std::string longest(kInstallPrefixSlotBytes - kInstallPrefixTagBytes - 1, 'p');
    longest.front() = '/';
    rewrite_install_prefix_slot(image, longest);
    EXPECT_EQ(prefix_at(image, head.size()), longest);
}

TEST(JitInstallPrefix, RejectsWhatIsNotExactlyOneSlotOrABadPrefix) {
    std::vector<char> none = bytes_of(std::string(10000, 'x'));
    expect_error([&] { rewrite_install_prefix_slot(none, "/opt/weft"); }, "found 0");
    std::vector<char> two = bytes_of(slot_holding("/usr/local") + "between" + slot_holding("/usr/local"));
    expect_error([&] { rewrite_install_prefix_slot(two, "/opt/weft"); }, "found 2");
    std::vector<char> cut = bytes_of("head" + slot_holding("/usr/local").substr(0, 100));
    expect_error([&] { rewrite_install_prefix_slot(cut, "/opt/weft"); }, "runs past the end");
    std::vector<char> unterminated = bytes_of(tag() + std::string(kInstallPrefixSlotBytes, 'q'));
    expect_error([&] { rewrite_install_prefix_slot(unterminated, "/opt/weft"); }, "no terminated prefix");

    const std::vector<char> good = bytes_of(slot_holding("/usr/local"));
    std::vector<char> image = good;
    expect_error([&] { rewrite_install_prefix_slot(image, "relative/prefix"); }, "absolute");
    expect_error([&] { rewrite_install_prefix_slot(image, ""); }, "absolute");
    std::string too_long(kInstallPrefixSlotBytes - kInstallPrefixTagBytes, 'p');
    too_long.front() = '/';
    expect_error([&] { rewrite_install_prefix_slot(image, too_long); }, "at most");
    expect_error([&] { rewrite_install_prefix_slot(image, std::string("/a\0b", 4)); }, "NUL");
    EXPECT_EQ(image, good) << "a refused rewrite changed the image";
}

// The test binary links weft like any program: it holds one slot, which is what installed_prefix() reads, and
// which rewrites like the synthetic ones above.
TEST(JitInstallPrefix, TheLinkedProgramHoldsOneSlotHoldingTheConfiguredPrefix) {
    std::vector<char> image = read_file_bytes("/proc/self/exe");
    ASSERT_EQ(count_slots(image), 1u);
    const std::string t = tag();
    const auto at = std::search(image.begin(), image.end(), t.begin(), t.end());
    const size_t offset = static_cast<size_t>(at - image.begin());
    EXPECT_EQ(prefix_at(image, offset), weft::detail::installed_prefix());
    EXPECT_FALSE(weft::detail::installed_prefix().empty());
    EXPECT_EQ(weft::detail::installed_prefix().front(), '/') << weft::detail::installed_prefix();
    rewrite_install_prefix_slot(image, "/somewhere/else");
    EXPECT_EQ(prefix_at(image, offset), "/somewhere/else");
}

TEST(JitPaths, SearchEndsWithTheInstallPrefix) {
    TempDir prefix("weft_prefix");  // an install layout
    write_text_file(prefix / "include/weft/device/token.cuh", "#pragma once\n");
    fs::create_directories(prefix / "share/weft/kernels");
    TempDir elsewhere("weft_elsewhere");  // where a program that linked weft lives: nothing of weft above it
    fs::create_directories(elsewhere / "bin");

    const IncludeRoots roots = search_include_roots({elsewhere / "bin"}, prefix.path());
    EXPECT_EQ(roots.weft_include, fs::canonical(prefix / "include"));
    EXPECT_EQ(roots.weft_kernels, fs::canonical(prefix / "share/weft/kernels"));
    EXPECT_NE(roots.found_by.find("install prefix"), std::string::npos) << roots.found_by;

    // A tree found upward from a start comes first.
    TempDir tree("weft_tree");
    write_text_file(tree / "include/weft/device/token.cuh", "#pragma once\n");
    fs::create_directories(tree / "kernels");
    fs::create_directories(tree / "build/ci/tools");
    const IncludeRoots first = search_include_roots({tree / "build/ci/tools"}, prefix.path());
    EXPECT_EQ(first.weft_kernels, fs::canonical(tree / "kernels"));
    EXPECT_NE(first.found_by.find("searched upward"), std::string::npos) << first.found_by;

    // The prefix is not searched upward, and a failure names it among the places searched.
    fs::create_directories(prefix / "lib");
    expect_error([&] { search_include_roots({elsewhere / "bin"}, prefix / "lib"); },
                 (prefix / "lib").string() + " (the install prefix compiled into weft)");
    expect_error([&] { search_include_roots({elsewhere / "bin"}, fs::path()); }, (elsewhere / "bin").string());
}

// CUDA_HOME with another major version's headers than the NVRTC weft runs is passed over (for the headers beside
// that NVRTC, with a warning); the same major is taken.
TEST(JitPaths, CudaHomeOfAnotherMajorVersionIsPassedOver) {
    int major = 0, minor = 0;
    ASSERT_EQ(nvrtcVersion(&major, &minor), NVRTC_SUCCESS);
    TempDir home("weft_cuda_home");
    write_text_file(home / "include/cuda_fp16.h", "#pragma once\n");
    write_text_file(home / "include/cuda.h", "#define CUDA_VERSION " + std::to_string((major - 1) * 1000 + 80) + "\n");
    {
        weft::testing::ScopedEnv env("CUDA_HOME", home.path().string());
        weft::testing::ScopedEnv path_env("CUDA_PATH", std::nullopt);
        const std::vector<fs::path> dirs = find_cuda_include_dirs();
        ASSERT_FALSE(dirs.empty());
        EXPECT_NE(dirs.front(), fs::canonical(home / "include"));
        EXPECT_TRUE(fs::exists(dirs.front() / "cuda_fp16.h")) << dirs.front();
    }
    write_text_file(home / "include/cuda.h",
                    "#define CUDA_VERSION " + std::to_string(major * 1000 + minor * 10) + "\n");
    weft::testing::ScopedEnv env("CUDA_HOME", home.path().string());
    weft::testing::ScopedEnv path_env("CUDA_PATH", std::nullopt);
    const std::vector<fs::path> dirs = find_cuda_include_dirs();
    ASSERT_FALSE(dirs.empty());
    EXPECT_EQ(dirs.front(), fs::canonical(home / "include"));
}

// A tree the caller rejects (find_include_roots: another weft's headers) is passed over for the next place, the
// install prefix last; with every tree rejected, the error names each and why.
TEST(JitPaths, SearchPassesOverATreeItRejects) {
    TempDir prefix("weft_prefix");
    write_text_file(prefix / "include/weft/device/token.cuh", "#pragma once\n");
    fs::create_directories(prefix / "share/weft/kernels");
    TempDir tree("weft_tree");  // an older weft above the program
    write_text_file(tree / "include/weft/device/token.cuh", "#pragma once\n");
    fs::create_directories(tree / "kernels");
    fs::create_directories(tree / "bin");
    const fs::path old_include = fs::canonical(tree / "include");
    const auto reject_old = [&](const IncludeRoots& r) -> std::optional<std::string> {
        if (r.weft_include == old_include) return std::string("older headers");
        return std::nullopt;
    };
    const IncludeRoots roots = search_include_roots({tree / "bin"}, prefix.path(), reject_old);
    EXPECT_EQ(roots.weft_include, fs::canonical(prefix / "include"));
    EXPECT_NE(roots.found_by.find("install prefix"), std::string::npos) << roots.found_by;

    const auto reject_all = [](const IncludeRoots&) -> std::optional<std::string> { return std::string("other"); };
    expect_error([&] { search_include_roots({tree / "bin"}, prefix.path(), reject_all); },
                 "every weft tree found holds other headers");
    expect_error([&] { search_include_roots({tree / "bin"}, prefix.path(), reject_all); },
                 tree.path().string() + ": other");
}

}  // namespace
}  // namespace weft::jit
