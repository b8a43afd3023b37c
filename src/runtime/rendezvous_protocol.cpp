// SPDX-License-Identifier: MIT
// Encoding and validating decoding of the rendezvous store's framed messages (no I/O: fuzzable).
#include "weft/detail/rendezvous_protocol.hpp"

#include <algorithm>

#include "weft/runtime/error.hpp"

namespace weft::detail::rendezvous {

namespace {

uint32_t load_u32(const uint8_t* p) {
    return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
           (static_cast<uint32_t>(p[3]) << 24);
}
uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

void store_u32(uint8_t* p, uint32_t v) {
    for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void store_u16(uint8_t* p, uint16_t v) {
    p[0] = static_cast<uint8_t>(v);
    p[1] = static_cast<uint8_t>(v >> 8);
}

/// The value size a type requires, or -1 when any size up to the limit is allowed.
int64_t required_value_bytes(MsgType type) {
    switch (type) {
        case MsgType::kHello: return 4;
        case MsgType::kGet: return 8;
        case MsgType::kAdd: return 8;
        case MsgType::kCheck: return 0;
        case MsgType::kErase: return 0;
        case MsgType::kTimeout: return 0;
        default: return -1;
    }
}

bool key_required(MsgType type) {
    return type == MsgType::kSet || type == MsgType::kGet || type == MsgType::kAdd || type == MsgType::kCheck ||
           type == MsgType::kErase;
}

/// Empty when the lengths fit the type and the limits; otherwise why not.
std::string check_lengths(MsgType type, uint64_t key_bytes, uint64_t value_bytes, const Limits& limits) {
    std::string t = type_name(static_cast<uint16_t>(type));
    if (key_bytes > limits.max_key_bytes) {
        return t + " key of " + std::to_string(key_bytes) + " bytes exceeds the limit of " +
               std::to_string(limits.max_key_bytes);
    }
    if (value_bytes > limits.max_value_bytes) {
        return t + " value of " + std::to_string(value_bytes) + " bytes exceeds the limit of " +
               std::to_string(limits.max_value_bytes);
    }
    if (key_required(type) && key_bytes == 0) return t + " needs a non-empty key";
    if (is_response(static_cast<uint16_t>(type)) && key_bytes != 0) return t + " must not carry a key";
    int64_t need = required_value_bytes(type);
    if (need >= 0 && value_bytes != static_cast<uint64_t>(need)) {
        return t + " value must be " + std::to_string(need) + " bytes, got " + std::to_string(value_bytes);
    }
    if (type == MsgType::kError && value_bytes > kMaxErrorBytes) {
        return "error text of " + std::to_string(value_bytes) + " bytes exceeds the limit of " +
               std::to_string(kMaxErrorBytes);
    }
    return {};
}

DecodeResult invalid(std::string why) { return DecodeResult{DecodeStatus::kInvalid, 0, std::move(why)}; }

}  // namespace

bool is_request(uint16_t type) {
    return type >= static_cast<uint16_t>(MsgType::kHello) && type <= static_cast<uint16_t>(MsgType::kErase);
}
bool is_response(uint16_t type) {
    return type >= static_cast<uint16_t>(MsgType::kOk) && type <= static_cast<uint16_t>(MsgType::kError);
}

const char* type_name(uint16_t type) {
    switch (static_cast<MsgType>(type)) {
        case MsgType::kHello: return "HELLO";
        case MsgType::kSet: return "SET";
        case MsgType::kGet: return "GET";
        case MsgType::kAdd: return "ADD";
        case MsgType::kCheck: return "CHECK";
        case MsgType::kErase: return "ERASE";
        case MsgType::kOk: return "OK";
        case MsgType::kTimeout: return "TIMEOUT";
        case MsgType::kError: return "ERROR";
    }
    return "UNKNOWN";
}

DecodeResult decode_header(const uint8_t* data, size_t size, Role role, const Limits& limits, Header* header) {
    // Check whatever prefix is present, so garbage is rejected after its first bytes.
    uint8_t magic[4];
    store_u32(magic, kMagic);
    for (size_t i = 0; i < std::min<size_t>(size, 4); ++i) {
        if (data[i] != magic[i]) return invalid("bad magic: not a weft rendezvous frame");
    }
    if (size < 6) return {};
    uint16_t version = load_u16(data + 4);
    if (version != kVersion) {
        return invalid("unsupported protocol version " + std::to_string(version) + " (this build speaks " +
                       std::to_string(kVersion) + ")");
    }
    if (size < 8) return {};
    uint16_t type = load_u16(data + 6);
    bool type_ok = role == Role::kRequest ? is_request(type) : is_response(type);
    if (!type_ok) {
        return invalid(std::string("unexpected message type ") + std::to_string(type) + " (" + type_name(type) +
                       ") for a " + (role == Role::kRequest ? "request" : "response"));
    }
    if (size < 12) return {};
    uint32_t key_bytes = load_u32(data + 8);
    // Check the key length alone first (the value length is not in yet).
    if (key_bytes > limits.max_key_bytes) {
        return invalid(std::string(type_name(type)) + " key of " + std::to_string(key_bytes) +
                       " bytes exceeds the limit of " + std::to_string(limits.max_key_bytes));
    }
    if (size < kHeaderBytes) return {};
    uint32_t value_bytes = load_u32(data + 12);
    std::string why = check_lengths(static_cast<MsgType>(type), key_bytes, value_bytes, limits);
    if (!why.empty()) return invalid(std::move(why));
    header->type = static_cast<MsgType>(type);
    header->key_bytes = key_bytes;
    header->value_bytes = value_bytes;
    return DecodeResult{DecodeStatus::kComplete, header->frame_bytes(), {}};
}

DecodeResult decode_frame(const uint8_t* data, size_t size, Role role, const Limits& limits, Message* message) {
    Header header;
    DecodeResult r = decode_header(data, size, role, limits, &header);
    if (r.status != DecodeStatus::kComplete) return r;
    if (size < r.frame_bytes) return DecodeResult{DecodeStatus::kNeedMore, r.frame_bytes, {}};
    const uint8_t* key = data + kHeaderBytes;
    const uint8_t* value = key + header.key_bytes;
    message->type = header.type;
    message->key.assign(reinterpret_cast<const char*>(key), header.key_bytes);
    message->value.assign(value, value + header.value_bytes);
    return r;
}

Bytes encode_frame(const Message& message, const Limits& limits) {
    auto type = static_cast<uint16_t>(message.type);
    WEFT_CHECK(is_request(type) || is_response(type), "rendezvous: cannot encode unknown message type " << type);
    std::string why = check_lengths(message.type, message.key.size(), message.value.size(), limits);
    // A HELLO's key is the job's secret: never in a message.
    const bool show_key = !message.key.empty() && message.type != MsgType::kHello;
    WEFT_CHECK(why.empty(), "rendezvous: cannot send " << (show_key ? "'" + message.key + "': " : "") << why);
    uint8_t header[kHeaderBytes];
    store_u32(header, kMagic);
    store_u16(header + 4, kVersion);
    store_u16(header + 6, type);
    store_u32(header + 8, static_cast<uint32_t>(message.key.size()));
    store_u32(header + 12, static_cast<uint32_t>(message.value.size()));
    // NOTE: built from the header array and filled through iterators; GCC 12 (-O3) warns falsely about
    // writes through frame.data() and about vector::insert here.
    Bytes frame(header, header + kHeaderBytes);
    frame.resize(kHeaderBytes + message.key.size() + message.value.size());
    auto key_at = frame.begin() + static_cast<std::ptrdiff_t>(kHeaderBytes);
    std::copy(message.key.begin(), message.key.end(), key_at);
    std::copy(message.value.begin(), message.value.end(), key_at + static_cast<std::ptrdiff_t>(message.key.size()));
    return frame;
}

Bytes encode_u64(uint64_t v) {
    Bytes b(8);
    for (int i = 0; i < 8; ++i) b[static_cast<size_t>(i)] = static_cast<uint8_t>(v >> (8 * i));
    return b;
}
Bytes encode_i64(int64_t v) { return encode_u64(static_cast<uint64_t>(v)); }
Bytes encode_i32(int32_t v) {
    Bytes b(4);
    store_u32(b.data(), static_cast<uint32_t>(v));
    return b;
}

uint64_t decode_u64(const Bytes& b) {
    WEFT_CHECK(b.size() == 8, "rendezvous: expected an 8-byte integer, got " << b.size() << " bytes");
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | b[static_cast<size_t>(i)];
    return v;
}
int64_t decode_i64(const Bytes& b) { return static_cast<int64_t>(decode_u64(b)); }
int32_t decode_i32(const Bytes& b) {
    WEFT_CHECK(b.size() == 4, "rendezvous: expected a 4-byte integer, got " << b.size() << " bytes");
    return static_cast<int32_t>(load_u32(b.data()));
}

Message make_hello(const std::string& token, int32_t rank) { return {MsgType::kHello, token, encode_i32(rank)}; }
Message make_set(const std::string& key, const Bytes& value) { return {MsgType::kSet, key, value}; }
Message make_get(const std::string& key, uint64_t timeout_ms) { return {MsgType::kGet, key, encode_u64(timeout_ms)}; }
Message make_add(const std::string& key, int64_t delta) { return {MsgType::kAdd, key, encode_i64(delta)}; }
Message make_check(const std::string& key) { return {MsgType::kCheck, key, {}}; }
Message make_erase(const std::string& key) { return {MsgType::kErase, key, {}}; }
Message make_ok(Bytes value) { return {MsgType::kOk, {}, std::move(value)}; }
Message make_timeout() { return {MsgType::kTimeout, {}, {}}; }
Message make_error(std::string_view text) {
    text = text.substr(0, kMaxErrorBytes);
    return {MsgType::kError, {}, Bytes(text.begin(), text.end())};
}

bool constant_time_equal(std::string_view expected, std::string_view given) {
    // NOTE: the loop runs over `expected` only and never exits early, so the time does not depend on
    // where (or whether) `given` differs.
    unsigned diff = expected.size() == given.size() ? 0u : 1u;
    for (size_t i = 0; i < expected.size(); ++i) {
        unsigned char g = i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
        diff |= static_cast<unsigned>(static_cast<unsigned char>(expected[i]) ^ g);
    }
    // Launder through a volatile so the compiler cannot turn the loop into an early-exit comparison.
    volatile unsigned result = diff;
    return result == 0;
}

}  // namespace weft::detail::rendezvous
