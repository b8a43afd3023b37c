// SPDX-License-Identifier: MIT
// SHA-256 (OpenSSL EVP underneath) for cache keys and cache-entry checksums.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace weft::jit {

using Digest = std::array<uint8_t, 32>;

/// Incremental SHA-256. Not copyable; `finish()` may be called once.
class Sha256 {
public:
    Sha256();
    ~Sha256();
    Sha256(const Sha256&) = delete;
    Sha256& operator=(const Sha256&) = delete;

    Sha256& update(const void* data, size_t bytes);
    Sha256& update(std::string_view text) { return update(text.data(), text.size()); }
    /// Length-prefixed field: keeps "ab"+"c" and "a"+"bc" apart.
    Sha256& field(std::string_view text);
    Digest finish();

private:
    struct State;
    std::unique_ptr<State> state_;
};

Digest sha256(const void* data, size_t bytes);
inline Digest sha256(std::string_view text) { return sha256(text.data(), text.size()); }
/// Lower-case hexadecimal, 64 characters.
std::string to_hex(const Digest& digest);

}  // namespace weft::jit
