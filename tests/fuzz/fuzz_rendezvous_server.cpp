// SPDX-License-Identifier: MIT
// libFuzzer target for the rendezvous store server itself: each input is what one client sends over a
// socketpair the server adopts. The server must answer only well-formed response frames, never throw while
// serving (Stats::errors stays 0), close the connection or keep it, and go on serving a well-behaved client.
//
// Input: byte 0 holds flags (bit 0: a valid HELLO goes first, so the fuzzer reaches the authenticated
// requests at once; bit 1: the client reads no reply before it has sent everything; bit 2: the rest
// describes frames rather than raw bytes, see frames_from), byte 1 the HELLO's rank, the rest is the byte
// stream the client sends, or its description.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "weft/detail/rendezvous_protocol.hpp"
#include "weft/runtime/rendezvous.hpp"

namespace rp = weft::detail::rendezvous;
using Clock = std::chrono::steady_clock;

namespace {

const rp::Limits kLimits{64, 4096};

[[noreturn]] void fail(const char* what) {
    std::fprintf(stderr, "fuzz_rendezvous_server: %s\n", what);
    std::abort();
}

weft::RendezvousOptions server_options() {
    weft::RendezvousOptions o;
    o.host = "127.0.0.1";
    o.token = "";  // the same user over a socketpair: SO_PEERCRED authenticates
    o.timeout = std::chrono::milliseconds(2000);
    o.hello_timeout = std::chrono::milliseconds(200);
    o.max_key_bytes = kLimits.max_key_bytes;
    o.max_value_bytes = kLimits.max_value_bytes;
    o.max_unsent_reply_bytes = 8192;  // small, so that replies the client does not read hold the server back
    return o;
}

/// Sends `data` on `fd` and reads replies until the server closes the connection (or 5 s pass, which would
/// mean a connection the server never closes after the client's EOF: a failure). `read_while_sending`
/// drains replies between sends.
weft::Bytes converse(int fd, const uint8_t* data, size_t size, bool read_while_sending) {
    weft::Bytes replies;
    size_t sent = 0;
    bool write_closed = false;
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    uint8_t buf[65536];
    while (true) {
        if (sent == size && !write_closed) {
            ::shutdown(fd, SHUT_WR);
            write_closed = true;
        }
        pollfd p{fd, 0, 0};
        if (read_while_sending || write_closed) p.events |= POLLIN;
        if (!write_closed) p.events |= POLLOUT;
        const int left_ms =
            static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
        if (left_ms <= 0 || ::poll(&p, 1, left_ms) <= 0) fail("the server neither answered nor closed within 5 s");
        if ((p.revents & POLLOUT) && sent < size) {
            const ssize_t n = ::send(fd, data + sent, size - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (n > 0) sent += static_cast<size_t>(n);
            if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                sent = size;  // the server closed: stop sending, read what it said
            }
        }
        if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
            const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
            if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return replies;
            if (n > 0) replies.insert(replies.end(), buf, buf + n);
        }
    }
}

/// Every byte the server sent is a sequence of valid response frames, except at most a prefix of one at the
/// end (the best-effort ERROR it sends before closing may be cut short by a full socket buffer).
void check_replies(const weft::Bytes& replies) {
    size_t offset = 0;
    while (offset < replies.size()) {
        rp::Message m;
        const rp::DecodeResult r =
            rp::decode_frame(replies.data() + offset, replies.size() - offset, rp::Role::kResponse, kLimits, &m);
        if (r.status == rp::DecodeStatus::kInvalid) fail("the server sent a malformed frame");
        if (r.status == rp::DecodeStatus::kNeedMore) return;
        offset += r.frame_bytes;
    }
}

/// A well-behaved client on a fresh socketpair: HELLO, SET, GET must all succeed.
void check_still_serving(weft::TcpStoreServer& server) {
    int pair[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) fail("socketpair failed");
    server.adopt_connection(pair[0]);
    const weft::Bytes value = {'v', 0, 'w'};
    weft::Bytes request;
    for (const rp::Message& m :
         {rp::make_hello("", 0), rp::make_set("fuzz/probe", value), rp::make_get("fuzz/probe", 0)}) {
        const weft::Bytes f = rp::encode_frame(m, kLimits);
        request.insert(request.end(), f.begin(), f.end());
    }
    const weft::Bytes replies = converse(pair[1], request.data(), request.size(), true);
    ::close(pair[1]);
    size_t offset = 0;
    for (int i = 0; i < 3; ++i) {
        rp::Message m;
        const rp::DecodeResult r =
            rp::decode_frame(replies.data() + offset, replies.size() - offset, rp::Role::kResponse, kLimits, &m);
        if (r.status != rp::DecodeStatus::kComplete || m.type != rp::MsgType::kOk) fail("the server stopped serving");
        if (i == 2 && m.value != value) fail("the server returned a wrong value");
        offset += r.frame_bytes;
    }
}

/// Turns records [type][key bytes][value bytes, 2 bytes LE][key][value] into frames with a valid magic and
/// version, so that mutations explore requests rather than the magic. The type byte picks a request type
/// (values past the last one are sent raw, invalid); the lengths are sent as given, checked by nobody here.
weft::Bytes frames_from(const uint8_t* data, size_t size) {
    weft::Bytes out;
    size_t i = 0;
    while (i + 4 <= size) {
        const uint8_t t = data[i];
        const uint32_t key_bytes = data[i + 1];
        const uint32_t value_bytes = static_cast<uint32_t>(data[i + 2]) | (static_cast<uint32_t>(data[i + 3]) << 8);
        i += 4;
        const uint16_t type = t < 240 ? static_cast<uint16_t>(1 + t % 6) : t;
        const uint8_t header[rp::kHeaderBytes] = {
            'W', 'E', 'F', 'T', static_cast<uint8_t>(rp::kVersion), 0, static_cast<uint8_t>(type),
            static_cast<uint8_t>(type >> 8), static_cast<uint8_t>(key_bytes), 0, 0, 0,
            static_cast<uint8_t>(value_bytes), static_cast<uint8_t>(value_bytes >> 8), 0, 0};
        out.insert(out.end(), header, header + rp::kHeaderBytes);
        const size_t payload = std::min<size_t>(key_bytes + value_bytes, size - i);
        out.insert(out.end(), data + i, data + i + payload);
        i += payload;
    }
    return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    // Every rejected input logs a warning; keep the output to what matters (errors, and the fuzzer's own).
    ::setenv("WEFT_LOG", "error", 1);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size < 2) return 0;
    const uint8_t flags = data[0];
    const int32_t rank = static_cast<int8_t>(data[1]);
    data += 2;
    // Bounded, so the stream always fits the socket buffers even when the client reads nothing until the end.
    size = std::min<size_t>(size - 2, 16384);
    weft::Bytes stream;
    if (flags & 1) stream = rp::encode_frame(rp::make_hello("", rank), kLimits);
    if (flags & 4) {
        const weft::Bytes frames = frames_from(data, size);
        stream.insert(stream.end(), frames.begin(), frames.end());
    } else {
        stream.insert(stream.end(), data, data + size);
    }

    // A fresh server per input: an input's effect never depends on the ones before (reproducible crashes).
    weft::TcpStoreServer server(server_options());
    int pair[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) fail("socketpair failed");
    server.adopt_connection(pair[0]);
    const weft::Bytes replies = converse(pair[1], stream.data(), stream.size(), (flags & 2) == 0);
    ::close(pair[1]);
    check_replies(replies);
    check_still_serving(server);
    if (server.stats().errors != 0) fail("serving a connection threw (Stats::errors is not 0)");
    return 0;
}
