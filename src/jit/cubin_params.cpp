// SPDX-License-Identifier: MIT
// A kernel's parameter count from its cubin's .nv.info.<name> section (see weft/detail/cubin_params.hpp).
#include "weft/detail/cubin_params.hpp"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace weft::detail {

namespace {

// ELF64 header and section header field offsets (the ELF specification; cubins are ELF64, little-endian).
constexpr size_t kElfHeaderBytes = 64;
constexpr size_t kShoffAt = 0x28;
constexpr size_t kShentsizeAt = 0x3a;
constexpr size_t kShnumAt = 0x3c;
constexpr size_t kShstrndxAt = 0x3e;
constexpr size_t kSectionHeaderBytes = 64;
constexpr size_t kShNameAt = 0x00;
constexpr size_t kShOffsetAt = 0x18;
constexpr size_t kShSizeAt = 0x20;

// .nv.info entries: a format byte, an attribute byte, then two bytes that hold the value (formats 1-3) or the
// size of the payload that follows (EIFMT_SVAL).
constexpr uint8_t kFormatNval = 0x01;
constexpr uint8_t kFormatHval = 0x03;
constexpr uint8_t kFormatSval = 0x04;
constexpr uint8_t kAttrKparamInfo = 0x17;
constexpr size_t kKparamInfoBytes = 12;  // uint32 index, uint16 ordinal, uint16 offset, uint32 flags and size
constexpr size_t kKparamOrdinalAt = 4;

template <class T>
bool read(const char* data, size_t size, size_t at, T* out) {
    if (at > size || size - at < sizeof(T)) return false;
    std::memcpy(out, data + at, sizeof(T));
    return true;
}

}  // namespace

std::optional<size_t> cubin_kernel_param_count(const char* data, size_t size, std::string_view name) {
    if (data == nullptr || size < kElfHeaderBytes) return std::nullopt;
    // Magic, ELFCLASS64, ELFDATA2LSB.
    if (std::memcmp(data, "\x7f" "ELF", 4) != 0 || data[4] != 2 || data[5] != 1) return std::nullopt;
    uint64_t shoff = 0;
    uint16_t shentsize = 0, shnum = 0, shstrndx = 0;
    if (!read(data, size, kShoffAt, &shoff) || !read(data, size, kShentsizeAt, &shentsize) ||
        !read(data, size, kShnumAt, &shnum) || !read(data, size, kShstrndxAt, &shstrndx)) {
        return std::nullopt;
    }
    if (shentsize < kSectionHeaderBytes || shstrndx >= shnum || shoff > size ||
        (size - shoff) / shentsize < shnum) {
        return std::nullopt;
    }
    const auto section = [&](uint16_t i, uint32_t* name_at, uint64_t* offset, uint64_t* bytes) {
        const size_t at = static_cast<size_t>(shoff) + static_cast<size_t>(i) * shentsize;
        return read(data, size, at + kShNameAt, name_at) && read(data, size, at + kShOffsetAt, offset) &&
               read(data, size, at + kShSizeAt, bytes) && *offset <= size && *bytes <= size - *offset;
    };
    uint32_t unused = 0;
    uint64_t strtab_at = 0, strtab_bytes = 0;
    if (!section(shstrndx, &unused, &strtab_at, &strtab_bytes)) return std::nullopt;
    const std::string wanted = ".nv.info." + std::string(name);
    for (uint16_t i = 0; i < shnum; ++i) {
        uint32_t name_at = 0;
        uint64_t at = 0, bytes = 0;
        if (!section(i, &name_at, &at, &bytes)) return std::nullopt;
        // The name must fit, with its terminating zero, inside the string table.
        if (name_at >= strtab_bytes || strtab_bytes - name_at < wanted.size() + 1) continue;
        const char* section_name = data + strtab_at + name_at;
        if (std::memcmp(section_name, wanted.data(), wanted.size()) != 0 || section_name[wanted.size()] != '\0') {
            continue;
        }
        std::vector<bool> seen;
        size_t pos = static_cast<size_t>(at);
        const size_t end = static_cast<size_t>(at + bytes);
        while (pos < end) {
            if (end - pos < 4) return std::nullopt;
            const auto format = static_cast<uint8_t>(data[pos]);
            const auto attribute = static_cast<uint8_t>(data[pos + 1]);
            uint16_t value = 0;
            std::memcpy(&value, data + pos + 2, 2);
            pos += 4;
            if (format == kFormatSval) {
                if (end - pos < value) return std::nullopt;
                if (attribute == kAttrKparamInfo) {
                    if (value < kKparamInfoBytes) return std::nullopt;
                    uint16_t ordinal = 0;
                    std::memcpy(&ordinal, data + pos + kKparamOrdinalAt, 2);
                    if (ordinal >= seen.size()) seen.resize(static_cast<size_t>(ordinal) + 1, false);
                    if (seen[ordinal]) return std::nullopt;
                    seen[ordinal] = true;
                }
                pos += value;
            } else if (format < kFormatNval || format > kFormatHval) {
                return std::nullopt;
            }
        }
        for (bool s : seen) {
            if (!s) return std::nullopt;
        }
        return seen.size();
    }
    return std::nullopt;
}

}  // namespace weft::detail
