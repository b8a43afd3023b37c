// SPDX-License-Identifier: MIT
// SHA-256 over OpenSSL's EVP interface.
#include "weft/jit/hash.hpp"

#include <openssl/evp.h>

#include "weft/runtime/error.hpp"

namespace weft::jit {

struct Sha256::State {
    EVP_MD_CTX* ctx = nullptr;
    bool finished = false;
};

Sha256::Sha256() : state_(std::make_unique<State>()) {
    state_->ctx = EVP_MD_CTX_new();
    WEFT_CHECK(state_->ctx != nullptr, "OpenSSL: EVP_MD_CTX_new failed");
    WEFT_CHECK(EVP_DigestInit_ex(state_->ctx, EVP_sha256(), nullptr) == 1, "OpenSSL: EVP_DigestInit_ex(sha256) failed");
}

Sha256::~Sha256() { EVP_MD_CTX_free(state_->ctx); }

Sha256& Sha256::update(const void* data, size_t bytes) {
    WEFT_CHECK(!state_->finished, "Sha256::update after finish()");
    if (bytes > 0) {
        WEFT_CHECK(EVP_DigestUpdate(state_->ctx, data, bytes) == 1, "OpenSSL: EVP_DigestUpdate failed");
    }
    return *this;
}

Sha256& Sha256::field(std::string_view text) {
    const uint64_t size = text.size();
    uint8_t prefix[8];
    for (int i = 0; i < 8; ++i) prefix[i] = static_cast<uint8_t>(size >> (8 * i));
    update(prefix, sizeof(prefix));
    return update(text);
}

Digest Sha256::finish() {
    WEFT_CHECK(!state_->finished, "Sha256::finish called twice");
    state_->finished = true;
    Digest digest{};
    unsigned int length = 0;
    WEFT_CHECK(EVP_DigestFinal_ex(state_->ctx, digest.data(), &length) == 1 && length == digest.size(),
               "OpenSSL: EVP_DigestFinal_ex failed");
    return digest;
}

Digest sha256(const void* data, size_t bytes) {
    Sha256 h;
    h.update(data, bytes);
    return h.finish();
}

std::string to_hex(const Digest& digest) {
    static const char kDigits[] = "0123456789abcdef";
    std::string out;
    out.reserve(digest.size() * 2);
    for (uint8_t b : digest) {
        out.push_back(kDigits[b >> 4]);
        out.push_back(kDigits[b & 15]);
    }
    return out;
}

}  // namespace weft::jit
