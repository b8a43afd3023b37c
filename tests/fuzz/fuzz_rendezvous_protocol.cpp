// SPDX-License-Identifier: MIT
// libFuzzer target for the rendezvous decoder: any bytes decode to a frame that re-encodes exactly, or to
// "need more" or a clean rejection, for both roles; never a crash or an out-of-bounds read.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "weft/detail/rendezvous_protocol.hpp"

namespace rp = weft::detail::rendezvous;

namespace {

void check(bool ok) {
    if (!ok) std::abort();
}

void decode_stream(const uint8_t* data, size_t size, rp::Role role, const rp::Limits& limits) {
    size_t offset = 0;
    while (offset < size) {
        rp::Message message;
        rp::DecodeResult r = rp::decode_frame(data + offset, size - offset, role, limits, &message);
        if (r.status == rp::DecodeStatus::kInvalid) {
            check(!r.error.empty());
            return;
        }
        if (r.status == rp::DecodeStatus::kNeedMore) {
            check(r.frame_bytes == 0 || r.frame_bytes > size - offset);
            return;
        }
        check(r.frame_bytes >= rp::kHeaderBytes && r.frame_bytes <= size - offset);
        weft::Bytes again = rp::encode_frame(message, limits);
        check(again.size() == r.frame_bytes);
        for (size_t i = 0; i < again.size(); ++i) check(again[i] == data[offset + i]);
        offset += r.frame_bytes;
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const rp::Limits limits{64, 4096};
    decode_stream(data, size, rp::Role::kRequest, limits);
    decode_stream(data, size, rp::Role::kResponse, limits);
    return 0;
}
