// SPDX-License-Identifier: MIT
// The rendezvous store's wire format: pure, allocation-bounded encoding and decoding of framed messages.
//
// Every frame is a 16-byte header followed by the key and the value:
//
//   offset  bytes  field
//   0       4      magic      0x54464557 little-endian (the bytes "WEFT")
//   4       2      version    kVersion
//   6       2      type       MsgType
//   8       4      key_bytes  <= Limits::max_key_bytes
//   12      4      value_bytes<= Limits::max_value_bytes, and exactly the size the type requires
//   16      ...    key, then value
//
// All integers are little-endian. The header alone decides whether a frame is acceptable (magic, version,
// type for the expected role, every length against its limit and its type's rule), so a receiver rejects
// a foreign or oversized frame before buffering its payload. A connection's first request must be kHello.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "weft/runtime/store.hpp"

namespace weft::detail::rendezvous {

inline constexpr uint32_t kMagic = 0x54464557u;
inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kHeaderBytes = 16;
inline constexpr uint32_t kDefaultMaxKeyBytes = 1024;
inline constexpr uint32_t kDefaultMaxValueBytes = 64u << 20;
/// kError texts are cut to this length by the encoder helpers and rejected above it by the decoder.
inline constexpr uint32_t kMaxErrorBytes = 4096;
/// Longer waits (get timeouts, connection timeouts) are cut to this, so deadlines never overflow.
inline constexpr uint64_t kMaxWaitMs = 30ull * 24 * 3600 * 1000;

enum class MsgType : uint16_t {
    // Requests (client -> server).
    kHello = 1,  ///< key: the job token (may be empty); value: int32 rank of the client
    kSet = 2,    ///< key, value
    kGet = 3,    ///< key; value: uint64 timeout in milliseconds (0: do not wait)
    kAdd = 4,    ///< key; value: int64 delta
    kCheck = 5,  ///< key; value empty
    kErase = 6,  ///< key; value empty
    // Responses (server -> client).
    kOk = 64,       ///< value: get: the value; add: int64 new count; check: one byte 0/1; otherwise empty
    kTimeout = 65,  ///< get only: the key was not set in time; value empty
    kError = 66,    ///< value: UTF-8 text saying why the request failed
};

/// Which side decodes: a server accepts only requests, a client only responses.
enum class Role { kRequest, kResponse };

struct Limits {
    uint32_t max_key_bytes = kDefaultMaxKeyBytes;
    uint32_t max_value_bytes = kDefaultMaxValueBytes;
};

struct Header {
    MsgType type = MsgType::kOk;
    uint32_t key_bytes = 0;
    uint32_t value_bytes = 0;
    size_t frame_bytes() const { return kHeaderBytes + key_bytes + static_cast<size_t>(value_bytes); }
};

struct Message {
    MsgType type = MsgType::kOk;
    std::string key;
    Bytes value;
};

enum class DecodeStatus {
    kComplete,  ///< a whole valid frame was decoded
    kNeedMore,  ///< the bytes so far are a valid prefix; read more
    kInvalid,   ///< the bytes can never become a valid frame; `error` says why (close the connection)
};

struct DecodeResult {
    DecodeStatus status = DecodeStatus::kNeedMore;
    size_t frame_bytes = 0;  ///< kComplete: bytes consumed; kNeedMore: the full frame size once the header is in
    std::string error;       ///< kInvalid only
};

/// Validates the header at the front of `data` (any prefix of it is checked as far as it goes).
/// On kComplete `*header` is set and frame_bytes is the size of the whole frame (payload not yet checked
/// for presence). Never reads past `data + size`.
DecodeResult decode_header(const uint8_t* data, size_t size, Role role, const Limits& limits, Header* header);

/// Decodes one frame from the front of `data`. kComplete fills `*message` and says how many bytes it used.
DecodeResult decode_frame(const uint8_t* data, size_t size, Role role, const Limits& limits, Message* message);

/// Encodes `message`; throws weft::Error when it breaks the limits or its type's rules (so a valid
/// sender never emits a frame the peer would reject).
Bytes encode_frame(const Message& message, const Limits& limits = {});

/// True when `type` is a request (kHello .. kErase) or a response (kOk .. kError) respectively.
bool is_request(uint16_t type);
bool is_response(uint16_t type);
const char* type_name(uint16_t type);

// Fixed-size payloads.
Bytes encode_u64(uint64_t v);
Bytes encode_i64(int64_t v);
Bytes encode_i32(int32_t v);
/// Little-endian reads of exactly 8 / 4 bytes; throw weft::Error on any other size.
uint64_t decode_u64(const Bytes& b);
int64_t decode_i64(const Bytes& b);
int32_t decode_i32(const Bytes& b);

// Message builders.
Message make_hello(const std::string& token, int32_t rank);
Message make_set(const std::string& key, const Bytes& value);
Message make_get(const std::string& key, uint64_t timeout_ms);
Message make_add(const std::string& key, int64_t delta);
Message make_check(const std::string& key);
Message make_erase(const std::string& key);
Message make_ok(Bytes value = {});
Message make_timeout();
Message make_error(std::string_view text);  ///< cut to kMaxErrorBytes

/// Compares two secrets in time that depends only on `expected.size()` (no early exit on a mismatch).
bool constant_time_equal(std::string_view expected, std::string_view given);

}  // namespace weft::detail::rendezvous
