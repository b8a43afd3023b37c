// SPDX-License-Identifier: MIT
// Unit tests for the rendezvous store: wire format (with a bounded mutation fuzz), server and clients.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "support/error_text.hpp"
#include "support/freezing_proxy.hpp"
#include "weft/detail/rendezvous_protocol.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/rendezvous.hpp"

namespace weft {
namespace {

namespace rp = detail::rendezvous;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

Bytes to_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }

using testing::error_of;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

/// Concatenation by appending (GCC 12 warns falsely about `"literal" + std::string` under -O3).
template <class... Parts>
std::string cat(const Parts&... parts) {
    std::string s;
    (s.append(parts), ...);
    return s;
}

// ---- wire format --------------------------------------------------------------------------------------

std::vector<rp::Message> sample_messages() {
    Bytes binary = {0, 1, 2, 255, 0, 10, 13};
    return {rp::make_hello("tok", 3),        rp::make_hello("", -1),         rp::make_set("k", binary),
            rp::make_set("key/with spaces", {}), rp::make_get("g", 1234567890123ull), rp::make_add("counter", -42),
            rp::make_check("c"),             rp::make_erase("e"),            rp::make_ok(binary),
            rp::make_ok(),                   rp::make_timeout(),             rp::make_error("it failed")};
}

rp::Role role_of(const rp::Message& m) {
    return rp::is_request(static_cast<uint16_t>(m.type)) ? rp::Role::kRequest : rp::Role::kResponse;
}

TEST(RendezvousProtocol, RoundTripsEveryMessageType) {
    for (const rp::Message& m : sample_messages()) {
        Bytes frame = rp::encode_frame(m);
        ASSERT_EQ(frame.size(), rp::kHeaderBytes + m.key.size() + m.value.size());
        rp::Message out;
        rp::DecodeResult r = rp::decode_frame(frame.data(), frame.size(), role_of(m), {}, &out);
        ASSERT_EQ(r.status, rp::DecodeStatus::kComplete) << r.error;
        EXPECT_EQ(r.frame_bytes, frame.size());
        EXPECT_EQ(out.type, m.type);
        EXPECT_EQ(out.key, m.key);
        EXPECT_EQ(out.value, m.value);
        // Every strict prefix is a valid beginning that needs more bytes.
        for (size_t n = 0; n < frame.size(); ++n) {
            rp::DecodeResult p = rp::decode_frame(frame.data(), n, role_of(m), {}, &out);
            ASSERT_EQ(p.status, rp::DecodeStatus::kNeedMore) << "prefix " << n << ": " << p.error;
            if (n >= rp::kHeaderBytes) {
                EXPECT_EQ(p.frame_bytes, frame.size());
            }
        }
    }
}

TEST(RendezvousProtocol, DecodesBackToBackFrames) {
    Bytes stream;
    std::vector<rp::Message> sent = {rp::make_set("a", to_bytes("1")), rp::make_get("a", 5), rp::make_erase("a")};
    for (auto& m : sent) {
        Bytes f = rp::encode_frame(m);
        stream.insert(stream.end(), f.begin(), f.end());
    }
    size_t offset = 0;
    for (auto& m : sent) {
        rp::Message out;
        auto r = rp::decode_frame(stream.data() + offset, stream.size() - offset, rp::Role::kRequest, {}, &out);
        ASSERT_EQ(r.status, rp::DecodeStatus::kComplete);
        EXPECT_EQ(out.key, m.key);
        EXPECT_EQ(out.type, m.type);
        offset += r.frame_bytes;
    }
    EXPECT_EQ(offset, stream.size());
}

/// Overwrites bytes [at, at+4) of `frame` with `v` little-endian.
void poke_u32(Bytes& frame, size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) frame[at + static_cast<size_t>(i)] = static_cast<uint8_t>(v >> (8 * i));
}

std::string decode_error(const Bytes& frame, rp::Role role, const rp::Limits& limits = {}) {
    rp::Message out;
    rp::DecodeResult r = rp::decode_frame(frame.data(), frame.size(), role, limits, &out);
    if (r.status != rp::DecodeStatus::kInvalid) return "(not rejected)";
    EXPECT_FALSE(r.error.empty());
    return r.error;
}

TEST(RendezvousProtocol, RejectsMalformedHeaders) {
    Bytes good = rp::encode_frame(rp::make_set("key", to_bytes("value")));
    Bytes f = good;
    f[0] ^= 0xff;
    EXPECT_TRUE(contains(decode_error(f, rp::Role::kRequest), "magic"));
    // Garbage is rejected from its first byte: no need to wait for a whole header.
    rp::Message out;
    uint8_t http[] = {'G'};
    EXPECT_EQ(rp::decode_frame(http, 1, rp::Role::kRequest, {}, &out).status, rp::DecodeStatus::kInvalid);
    f = good;
    f[4] = 2;
    EXPECT_TRUE(contains(decode_error(f, rp::Role::kRequest), "version 2"));
    f = good;
    f[6] = 99;
    EXPECT_TRUE(contains(decode_error(f, rp::Role::kRequest), "type 99"));
    // Requests are not responses and vice versa.
    EXPECT_TRUE(contains(decode_error(good, rp::Role::kResponse), "SET"));
    EXPECT_TRUE(contains(decode_error(rp::encode_frame(rp::make_ok()), rp::Role::kRequest), "OK"));
    // Oversized lengths are rejected from the header alone (the payload is never awaited).
    f = good;
    poke_u32(f, 8, 1025);
    EXPECT_TRUE(contains(decode_error(Bytes(f.begin(), f.begin() + 12), rp::Role::kRequest), "1025"));
    f = good;
    poke_u32(f, 12, 0xffffffffu);
    EXPECT_TRUE(contains(decode_error(Bytes(f.begin(), f.begin() + 16), rp::Role::kRequest), "exceeds"));
    rp::Limits small{16, 100};
    EXPECT_TRUE(contains(decode_error(rp::encode_frame(rp::make_set("k", Bytes(101))), rp::Role::kRequest, small),
                         "101 bytes exceeds the limit of 100"));
    // Per-type rules.
    f = rp::encode_frame(rp::make_get("k", 1));
    poke_u32(f, 12, 7);
    EXPECT_TRUE(contains(decode_error(f, rp::Role::kRequest), "must be 8 bytes"));
    f = rp::encode_frame(rp::make_set("k", {}));
    poke_u32(f, 8, 0);
    EXPECT_TRUE(contains(decode_error(f, rp::Role::kRequest), "non-empty key"));
    f = rp::encode_frame(rp::make_ok());
    poke_u32(f, 8, 1);
    EXPECT_TRUE(contains(decode_error(f, rp::Role::kResponse), "must not carry a key"));
    f = rp::encode_frame(rp::make_error("x"));
    poke_u32(f, 12, rp::kMaxErrorBytes + 1);
    EXPECT_TRUE(contains(decode_error(f, rp::Role::kResponse), "error text"));
}

TEST(RendezvousProtocol, EncoderRefusesWhatTheDecoderWouldReject) {
    EXPECT_THROW(rp::encode_frame(rp::make_set(std::string(1025, 'k'), {})), Error);
    EXPECT_THROW(rp::encode_frame(rp::make_set("", {})), Error);
    EXPECT_THROW(rp::encode_frame(rp::make_set("k", Bytes(11)), rp::Limits{8, 10}), Error);
    EXPECT_THROW(rp::encode_frame(rp::Message{rp::MsgType::kGet, "k", Bytes(3)}), Error);
    EXPECT_THROW(rp::encode_frame(rp::Message{static_cast<rp::MsgType>(7), "k", {}}), Error);
    EXPECT_NO_THROW(rp::encode_frame(rp::make_set(std::string(1024, 'k'), Bytes(10)), rp::Limits{1024, 10}));
}

TEST(RendezvousProtocol, ConstantTimeEqual) {
    EXPECT_TRUE(rp::constant_time_equal("", ""));
    EXPECT_TRUE(rp::constant_time_equal("abc", "abc"));
    EXPECT_FALSE(rp::constant_time_equal("abc", "abd"));
    EXPECT_FALSE(rp::constant_time_equal("abc", "ab"));
    EXPECT_FALSE(rp::constant_time_equal("abc", "abcd"));
    EXPECT_FALSE(rp::constant_time_equal("", "a"));
    EXPECT_FALSE(rp::constant_time_equal("a", ""));
    EXPECT_FALSE(rp::constant_time_equal(std::string("a\0b", 3), std::string("a\0c", 3)));
}

/// Checks decode_frame's contract on arbitrary bytes: a complete frame re-encodes to exactly the bytes
/// consumed; "need more" never claims a frame that is already present; "invalid" says why.
void check_decode_contract(const uint8_t* data, size_t size, rp::Role role, const rp::Limits& limits) {
    rp::Message out;
    rp::DecodeResult r = rp::decode_frame(data, size, role, limits, &out);
    switch (r.status) {
        case rp::DecodeStatus::kComplete: {
            ASSERT_LE(r.frame_bytes, size);
            Bytes again = rp::encode_frame(out, limits);
            ASSERT_EQ(again.size(), r.frame_bytes);
            ASSERT_TRUE(std::equal(again.begin(), again.end(), data));
            break;
        }
        case rp::DecodeStatus::kNeedMore:
            ASSERT_TRUE(r.frame_bytes == 0 || r.frame_bytes > size);
            ASSERT_LE(r.frame_bytes, rp::kHeaderBytes + limits.max_key_bytes + size_t{limits.max_value_bytes});
            break;
        case rp::DecodeStatus::kInvalid: ASSERT_FALSE(r.error.empty()); break;
    }
}

TEST(RendezvousProtocol, BoundedMutationFuzz) {
    // Fixed seed: the same 100k inputs every run. Mutated, truncated, extended, length-poked and random frames.
    std::mt19937_64 rng(0x5eed'f00du);
    const rp::Limits limits{64, 4096};
    std::vector<Bytes> seeds;
    for (const rp::Message& m : sample_messages()) seeds.push_back(rp::encode_frame(m, limits));
    auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
    size_t complete = 0, invalid = 0, need_more = 0;
    const auto start = Clock::now();
    for (int iter = 0; iter < 100000; ++iter) {
        Bytes data = seeds[pick(seeds.size())];
        switch (iter % 6) {
            case 0:  // bit flips
                for (int k = 0, n = 1 + static_cast<int>(pick(4)); k < n; ++k) data[pick(data.size())] ^= 1u << pick(8);
                break;
            case 1:  // random bytes written over the header or payload
                for (int k = 0, n = 1 + static_cast<int>(pick(3)); k < n; ++k) {
                    data[pick(data.size())] = static_cast<uint8_t>(rng());
                }
                break;
            case 2:  // truncation
                data.resize(pick(data.size() + 1));
                break;
            case 3:  // random tail appended (the next frame's start, or junk)
                for (size_t k = 0, n = pick(64); k < n; ++k) data.push_back(static_cast<uint8_t>(rng()));
                break;
            case 4:  // poke a length field with an edge value
            {
                static const uint32_t kEdges[] = {0, 1, 7, 8, 63, 64, 65, 4095, 4096, 4097, 0x7fffffffu, 0xffffffffu};
                poke_u32(data, pick(2) == 0 ? 8 : 12, kEdges[pick(std::size(kEdges))]);
                break;
            }
            default:  // pure noise, sometimes behind a valid magic and version
                data.assign(pick(48), 0);
                for (auto& b : data) b = static_cast<uint8_t>(rng());
                if (data.size() >= 6 && pick(2) == 0) std::copy_n(seeds[0].begin(), 6, data.begin());
                break;
        }
        for (rp::Role role : {rp::Role::kRequest, rp::Role::kResponse}) {
            check_decode_contract(data.data(), data.size(), role, limits);
            if (HasFatalFailure()) FAIL() << "iteration " << iter;
        }
        rp::Message out;
        switch (rp::decode_frame(data.data(), data.size(), rp::Role::kRequest, limits, &out).status) {
            case rp::DecodeStatus::kComplete: ++complete; break;
            case rp::DecodeStatus::kInvalid: ++invalid; break;
            case rp::DecodeStatus::kNeedMore: ++need_more; break;
        }
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    // The mutations must reach every outcome, or the fuzz tests less than it claims.
    EXPECT_GT(complete, 1000u);
    EXPECT_GT(invalid, 10000u);
    EXPECT_GT(need_more, 1000u);
    EXPECT_LT(seconds, 5.0);
}

// ---- server and clients -------------------------------------------------------------------------------

RendezvousOptions local_options(const std::string& token = "test-token") {
    RendezvousOptions o;
    o.host = "127.0.0.1";
    o.token = token;
    o.timeout = milliseconds(10000);  // generous: positive paths must never flake
    return o;
}

std::unique_ptr<Store> client_of(const TcpStoreServer& server, const std::string& token = "test-token",
                                 int rank = 0) {
    RendezvousOptions o = local_options(token);
    o.port = server.port();
    o.num_ranks = 64;
    o.rank = rank;
    return connect_tcp_store(o);
}

/// Waits (bounded) until `pred` holds.
template <class Pred>
bool eventually(Pred pred, milliseconds limit = milliseconds(5000)) {
    auto deadline = Clock::now() + limit;
    while (Clock::now() < deadline) {
        if (pred()) return true;
        std::this_thread::sleep_for(milliseconds(2));
    }
    return pred();
}

TEST(Rendezvous, SetGetAddCheckErase) {
    TcpStoreServer server(local_options());
    auto store = client_of(server);
    std::mt19937 rng(1234);
    Bytes binary(100003);
    for (auto& b : binary) b = static_cast<uint8_t>(rng());
    binary[7] = 0;
    store->set("bin", binary);
    store->set("empty", {});
    EXPECT_EQ(store->get("bin", milliseconds(1000)), binary);
    EXPECT_TRUE(store->get("empty", milliseconds(1000)).empty());
    store->set("bin", to_bytes("overwritten"));
    EXPECT_EQ(store->get("bin", milliseconds(0)), to_bytes("overwritten"));
    EXPECT_TRUE(store->check("bin"));
    EXPECT_FALSE(store->check("missing"));
    EXPECT_EQ(store->add("n", 5), 5);
    EXPECT_EQ(store->add("n", -7), -2);
    EXPECT_EQ(store->add("n", 0), -2);
    EXPECT_EQ(store->get("n", milliseconds(0)), to_bytes("-2"));  // counters are decimal text
    store->erase("n");
    EXPECT_FALSE(store->check("n"));
    EXPECT_EQ(store->add("n", 3), 3);  // re-created at 0
    store->erase("never-set");         // no error
    std::string max_key(1024, 'k');
    store->set(max_key, to_bytes("v"));
    EXPECT_EQ(store->get(max_key, milliseconds(0)), to_bytes("v"));
    EXPECT_EQ(server.stats().keys, 4u);  // bin, empty, n, max_key
    EXPECT_EQ(server.stats().rejected, 0u);
}

TEST(Rendezvous, HugeTimeoutsDoNotOverflow) {
    RendezvousOptions o = local_options();
    o.timeout = milliseconds::max();
    TcpStoreServer server(o);
    o.port = server.port();
    auto store = connect_tcp_store(o);
    store->set("k", to_bytes("v"));
    EXPECT_EQ(store->get("k", milliseconds::max()), to_bytes("v"));
    std::thread t([&] {
        std::this_thread::sleep_for(milliseconds(50));
        client_of(server)->set("later", to_bytes("w"));
    });
    EXPECT_EQ(store->get("later", milliseconds::max()), to_bytes("w"));
    t.join();
}

TEST(Rendezvous, LargeValuesAtTheLimit) {
    RendezvousOptions o = local_options();
    o.max_value_bytes = 8u << 20;
    TcpStoreServer server(o);
    o.port = server.port();
    auto store = connect_tcp_store(o);
    Bytes big(8u << 20);
    std::mt19937 rng(99);
    for (size_t i = 0; i < big.size(); i += 4096) big[i] = static_cast<uint8_t>(rng());
    big.back() = 0xab;
    store->set("big", big);
    EXPECT_EQ(store->get("big", milliseconds(1000)), big);
    // One byte over: refused on the client, naming the key and the limit; the connection stays usable.
    big.push_back(1);
    std::string e = error_of([&] { store->set("big2", big); });
    EXPECT_TRUE(contains(e, "big2") && contains(e, "8388608")) << e;
    e = error_of([&] { store->set(std::string(1025, 'x'), {}); });
    EXPECT_TRUE(contains(e, "1024")) << e;
    EXPECT_TRUE(store->check("big"));
    EXPECT_FALSE(store->check("big2"));
}

TEST(Rendezvous, GetWaitsForALaterSet) {
    TcpStoreServer server(local_options());
    auto waiter = client_of(server);
    auto setter = client_of(server);
    std::thread t([&] {
        std::this_thread::sleep_for(milliseconds(100));
        setter->set("late", to_bytes("here"));
    });
    auto start = Clock::now();
    Bytes v = waiter->get("late", milliseconds(10000));
    t.join();
    EXPECT_EQ(v, to_bytes("here"));
    EXPECT_GE(Clock::now() - start, milliseconds(90));
    EXPECT_LT(Clock::now() - start, milliseconds(5000));  // woken by the set, not by the 10 s timeout
    // add() also wakes a waiter.
    std::thread t2([&] {
        std::this_thread::sleep_for(milliseconds(50));
        setter->add("count", 41);
    });
    EXPECT_EQ(waiter->get("count", milliseconds(10000)), to_bytes("41"));
    t2.join();
}

TEST(Rendezvous, GetTimeoutNamesTheKey) {
    TcpStoreServer server(local_options());
    auto store = client_of(server, "test-token", 5);
    auto start = Clock::now();
    std::string e = error_of([&] { store->get("never/set", milliseconds(150)); });
    auto took = Clock::now() - start;
    EXPECT_TRUE(contains(e, "never/set") && contains(e, "timed out") && contains(e, "rank 5")) << e;
    EXPECT_GE(took, milliseconds(140));
    EXPECT_LT(took, milliseconds(3000));
    e = error_of([&] { store->get("also/missing", milliseconds(0)); });
    EXPECT_TRUE(contains(e, "also/missing")) << e;
    // The connection is still good after timeouts.
    store->set("k", to_bytes("v"));
    EXPECT_EQ(store->get("k", milliseconds(0)), to_bytes("v"));
    EXPECT_EQ(server.stats().rejected, 0u);
}

TEST(Rendezvous, AddIsAtomicAcrossClients) {
    TcpStoreServer server(local_options());
    constexpr int kClients = 8, kOps = 200;
    std::vector<std::vector<int64_t>> seen(kClients);
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (int c = 0; c < kClients; ++c) {
        threads.emplace_back([&, c] {
            try {
                auto store = client_of(server, "test-token", c);
                for (int i = 0; i < kOps; ++i) seen[static_cast<size_t>(c)].push_back(store->add("shared", 1));
            } catch (const std::exception&) {
                ++failures;
            }
        });
    }
    for (auto& t : threads) t.join();
    ASSERT_EQ(failures.load(), 0);
    std::set<int64_t> all;
    for (auto& s : seen) all.insert(s.begin(), s.end());
    // Each add saw a distinct count, and together they are exactly 1..kClients*kOps.
    ASSERT_EQ(all.size(), size_t{kClients * kOps});
    EXPECT_EQ(*all.begin(), 1);
    EXPECT_EQ(*all.rbegin(), kClients * kOps);
    for (auto& s : seen) EXPECT_TRUE(std::is_sorted(s.begin(), s.end()));
}

TEST(Rendezvous, ConcurrentClientsMixedOperations) {
    TcpStoreServer server(local_options());
    constexpr int kClients = 8, kOps = 200;
    std::atomic<int> failures{0};
    std::vector<std::thread> threads;
    for (int c = 0; c < kClients; ++c) {
        threads.emplace_back([&, c] {
            try {
                auto store = client_of(server, "test-token", c);
                std::mt19937 rng(static_cast<unsigned>(c) * 7919u);
                for (int i = 0; i < kOps; ++i) {
                    std::string key = cat("c", std::to_string(c), "/", std::to_string(i % 17));
                    Bytes value(rng() % 300);
                    for (auto& b : value) b = static_cast<uint8_t>(rng());
                    store->set(key, value);
                    if (store->get(key, milliseconds(1000)) != value || !store->check(key)) ++failures;
                    if (i % 5 == 0) {
                        store->erase(key);
                        if (store->check(key)) ++failures;
                    }
                    // Read a neighbour's progress counter: written by another client, concurrently.
                    store->add("progress/" + std::to_string(c), 1);
                }
            } catch (const std::exception& e) {
                ADD_FAILURE() << "client " << c << ": " << e.what();
                ++failures;
            }
        });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(failures.load(), 0);
    auto store = client_of(server);
    for (int c = 0; c < kClients; ++c) {
        EXPECT_EQ(store->get("progress/" + std::to_string(c), milliseconds(0)), to_bytes(std::to_string(kOps)));
    }
    EXPECT_EQ(server.stats().rejected, 0u);
}

TEST(Rendezvous, ServerSideErrorsKeepTheConnection) {
    TcpStoreServer server(local_options());
    auto store = client_of(server);
    store->set("text", to_bytes("not a number"));
    std::string e = error_of([&] { store->add("text", 1); });
    EXPECT_TRUE(contains(e, "text") && contains(e, "not a decimal counter")) << e;
    store->add("big", INT64_MAX);
    e = error_of([&] { store->add("big", 1); });
    EXPECT_TRUE(contains(e, "overflows")) << e;
    EXPECT_EQ(store->get("big", milliseconds(0)), to_bytes(std::to_string(INT64_MAX)));  // unchanged
    EXPECT_EQ(store->get("text", milliseconds(0)), to_bytes("not a number"));
    EXPECT_THROW(store->get("x", milliseconds(-1)), Error);
}

TEST(Rendezvous, WrongTokenIsRejected) {
    TcpStoreServer server(local_options("right"));
    auto good = client_of(server, "right");
    good->set("secret", to_bytes("s"));
    std::string e = error_of([&] { client_of(server, "wrong"); });
    EXPECT_TRUE(contains(e, "rejected") && contains(e, "token")) << e;
    e = error_of([&] { client_of(server, ""); });
    EXPECT_TRUE(contains(e, "token")) << e;
    e = error_of([&] { client_of(server, "righ"); });  // a prefix is not enough
    EXPECT_TRUE(contains(e, "token")) << e;
    EXPECT_TRUE(eventually([&] { return server.stats().rejected == 3; }));
    EXPECT_EQ(good->get("secret", milliseconds(0)), to_bytes("s"));
}

TEST(Rendezvous, NonLoopbackNeedsAToken) {
    RendezvousOptions o = local_options("");
    o.host = "0.0.0.0";
    std::string e = error_of([&] { TcpStoreServer server(o); });
    EXPECT_TRUE(contains(e, "token") && contains(e, "WEFT_JOB_TOKEN")) << e;
    o.token = "t";
    TcpStoreServer server(o);  // with a token it listens
    o.port = server.port();
    o.host = "127.0.0.1";
    auto store = connect_tcp_store(o);
    store->set("a", to_bytes("b"));
    EXPECT_TRUE(store->check("a"));
    // Loopback without a token is allowed (single-user machine, weft's own tests).
    TcpStoreServer open_server(local_options(""));
    EXPECT_NO_THROW(client_of(open_server, "")->set("x", {}));
}

/// A raw TCP connection to the server, for sending what a weft client never would.
class RawConnection {
public:
    explicit RawConnection(int port) {
        fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_port = htons(static_cast<uint16_t>(port));
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
        timeval tv{5, 0};
        ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    }
    ~RawConnection() { ::close(fd_); }
    bool connected() const { return connected_; }
    void send_bytes(const Bytes& b) { (void)::send(fd_, b.data(), b.size(), MSG_NOSIGNAL); }
    void send_message(const rp::Message& m) { send_bytes(rp::encode_frame(m)); }
    /// Reads until the server closes the connection (true) or 5 s pass (false); keeps what arrived.
    bool closed_by_server() {
        uint8_t buf[4096];
        while (true) {
            ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
            if (n == 0) return true;
            if (n < 0) return errno == ECONNRESET;
            received_.insert(received_.end(), buf, buf + n);
        }
    }
    /// Reads one response frame (5 s limit).
    rp::Message reply() {
        rp::Message m;
        uint8_t buf[4096];
        while (true) {
            auto r = rp::decode_frame(received_.data(), received_.size(), rp::Role::kResponse, {}, &m);
            if (r.status == rp::DecodeStatus::kComplete) {
                received_.erase(received_.begin(), received_.begin() + static_cast<std::ptrdiff_t>(r.frame_bytes));
                return m;
            }
            if (r.status == rp::DecodeStatus::kInvalid) throw Error("bad reply: " + r.error);
            ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
            if (n <= 0) throw Error("no reply");
            received_.insert(received_.end(), buf, buf + n);
        }
    }
    /// The text of an ERROR frame among the bytes received, if any.
    std::string error_text() const {
        rp::Message m;
        auto r = rp::decode_frame(received_.data(), received_.size(), rp::Role::kResponse, {}, &m);
        if (r.status != rp::DecodeStatus::kComplete || m.type != rp::MsgType::kError) return {};
        return std::string(m.value.begin(), m.value.end());
    }

private:
    int fd_ = -1;
    bool connected_ = false;
    Bytes received_;
};

TEST(Rendezvous, ForeignAndMalformedConnectionsAreClosed) {
    TcpStoreServer server(local_options());
    auto good = client_of(server);
    good->set("keep", to_bytes("me"));
    Bytes set_frame = rp::encode_frame(rp::make_set("evil", to_bytes("x")));
    Bytes hello = rp::encode_frame(rp::make_hello("test-token", 9));

    struct Case {
        const char* name;
        std::function<void(RawConnection&)> send;
        const char* expected_error;  // in the ERROR frame the server sends before closing
    };
    std::vector<Case> cases = {
        {"http", [](RawConnection& c) { c.send_bytes(to_bytes("GET / HTTP/1.1\r\nHost: x\r\n\r\n")); }, "magic"},
        {"set before hello", [&](RawConnection& c) { c.send_bytes(set_frame); }, "first message must be HELLO"},
        {"wrong version",
         [&](RawConnection& c) {
             Bytes f = hello;
             f[4] = 9;
             c.send_bytes(f);
         },
         "version 9"},
        {"response type as request",
         [&](RawConnection& c) { c.send_bytes(rp::encode_frame(rp::make_ok())); }, "unexpected message type"},
        {"oversized value length",
         [&](RawConnection& c) {
             c.send_bytes(hello);
             Bytes f(set_frame.begin(), set_frame.begin() + 16);
             poke_u32(f, 12, 0x7fffffffu);  // 2 GiB announced, never sent
             c.send_bytes(f);
         },
         "exceeds the limit"},
        {"oversized key length",
         [&](RawConnection& c) {
             Bytes f(hello.begin(), hello.begin() + 16);
             poke_u32(f, 8, 1u << 20);
             c.send_bytes(f);
         },
         "exceeds the limit"},
        {"hello twice",
         [&](RawConnection& c) {
             c.send_bytes(hello);
             c.send_bytes(hello);
         },
         "HELLO sent twice"},
        {"garbage after hello",
         [&](RawConnection& c) {
             c.send_bytes(hello);
             Bytes junk(64);
             std::mt19937 rng(5);
             for (auto& b : junk) b = static_cast<uint8_t>(rng());
             c.send_bytes(junk);
         },
         "magic"},
    };
    uint64_t rejected_before = server.stats().rejected;
    for (const Case& k : cases) {
        RawConnection raw(server.port());
        ASSERT_TRUE(raw.connected()) << k.name;
        k.send(raw);
        EXPECT_TRUE(raw.closed_by_server()) << k.name;
        // After a successful HELLO the first frame is its OK; the ERROR follows it.
        std::string text = raw.error_text();
        if (text.empty()) {
            try {
                rp::Message first = raw.reply();
                EXPECT_EQ(first.type, rp::MsgType::kOk) << k.name;
                rp::Message second = raw.reply();
                text = std::string(second.value.begin(), second.value.end());
            } catch (const Error&) {
            }
        }
        EXPECT_TRUE(contains(text, k.expected_error)) << k.name << ": '" << text << "'";
        // The legitimate client is unaffected, and so is the data.
        EXPECT_EQ(good->get("keep", milliseconds(0)), to_bytes("me")) << k.name;
    }
    EXPECT_FALSE(good->check("evil"));
    EXPECT_TRUE(eventually([&] { return server.stats().rejected == rejected_before + cases.size(); }));
}

TEST(Rendezvous, GarbageSenderWhileOthersWork) {
    TcpStoreServer server(local_options());
    std::atomic<bool> stop{false};
    std::atomic<int> garbage_connections{0};
    std::thread attacker([&] {
        std::mt19937 rng(77);
        const Bytes hello = rp::encode_frame(rp::make_hello("test-token", 1));
        for (int i = 0; i < 200 && !stop.load(); ++i) {
            RawConnection raw(server.port());
            Bytes junk(1 + rng() % 200);
            for (auto& b : junk) b = static_cast<uint8_t>(rng());
            // Half of them start like a valid HELLO header, so the junk reaches deeper into the decoder.
            if (rng() % 2 && junk.size() >= 16) std::copy_n(hello.begin(), 16, junk.begin());
            raw.send_bytes(junk);
            ++garbage_connections;
        }
    });
    std::vector<std::thread> workers;
    std::atomic<int> failures{0};
    for (int c = 0; c < 4; ++c) {
        workers.emplace_back([&, c] {
            try {
                auto store = client_of(server, "test-token", c);
                for (int i = 0; i < 100; ++i) {
                    std::string key = cat("w", std::to_string(c), "/", std::to_string(i));
                    store->set(key, to_bytes(key));
                    if (store->get(key, milliseconds(1000)) != to_bytes(key)) ++failures;
                    store->add("total", 1);
                }
            } catch (const std::exception& e) {
                ADD_FAILURE() << e.what();
                ++failures;
            }
        });
    }
    for (auto& t : workers) t.join();
    stop = true;
    attacker.join();
    EXPECT_EQ(failures.load(), 0);
    EXPECT_GT(garbage_connections.load(), 0);
    EXPECT_EQ(client_of(server)->get("total", milliseconds(0)), to_bytes("400"));
}

TEST(Rendezvous, SilentConnectionIsDroppedAfterTheHelloDeadline) {
    RendezvousOptions o = local_options();
    o.timeout = milliseconds(200);
    TcpStoreServer server(o);
    RawConnection raw(server.port());
    ASSERT_TRUE(raw.connected());
    auto start = Clock::now();
    EXPECT_TRUE(raw.closed_by_server());
    EXPECT_LT(Clock::now() - start, milliseconds(4000));
    EXPECT_TRUE(contains(raw.error_text(), "no HELLO")) << raw.error_text();
    EXPECT_TRUE(eventually([&] { return server.stats().open_connections == 0; }));
}

TEST(Rendezvous, ConnectionLimit) {
    RendezvousOptions o = local_options();
    o.max_connections = 2;
    TcpStoreServer server(o);
    o.port = server.port();
    auto a = connect_tcp_store(o);
    auto b = connect_tcp_store(o);
    // A third HELLO is refused, saying why; refused connections never count against the limit.
    std::string e = error_of([&] { connect_tcp_store(o); });
    EXPECT_TRUE(contains(e, "rejected") && contains(e, "max_connections")) << e;
    a.reset();
    ASSERT_TRUE(eventually([&] { return server.stats().open_connections == 1; }));
    EXPECT_NO_THROW(connect_tcp_store(o)->set("x", {}));
}

TEST(Rendezvous, LoopbackRejectsOtherUid) {
    // A store without a token serves only its own user. Proving it needs a second user: CI runs as root,
    // which can become `nobody` in a child process.
    if (::geteuid() != 0) GTEST_SKIP() << "needs root, to connect as another user";
    TcpStoreServer server(local_options(""));
    auto own = client_of(server, "");  // the server's own user is served without a token
    own->set("secret", to_bytes("s"));
    const uint64_t rejected_before = server.stats().rejected;
    const uint64_t authenticated_before = server.stats().authenticated;

    // Everything the child needs is prepared before fork(): after it, the child makes system calls only.
    const Bytes hello = rp::encode_frame(rp::make_hello("", 1));
    const Bytes get = rp::encode_frame(rp::make_get("secret", 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(server.port()));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        ::close(out[0]);
        const long nobody = 65534;
        if (::syscall(SYS_setresgid, nobody, nobody, nobody) != 0 ||
            ::syscall(SYS_setresuid, nobody, nobody, nobody) != 0) {
            ::_exit(10);
        }
        int fd = ::socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0 || ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) ::_exit(11);
        (void)::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL);
        (void)::send(fd, get.data(), get.size(), MSG_NOSIGNAL);
        // Forward whatever the server answers, until it closes (or 10 s pass).
        uint8_t buf[4096];
        for (;;) {
            pollfd p{fd, POLLIN, 0};
            if (::poll(&p, 1, 10000) <= 0) ::_exit(12);
            ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
            if (n <= 0) ::_exit(0);
            (void)::write(out[1], buf, static_cast<size_t>(n));
        }
    }
    ::close(out[1]);
    Bytes answer;
    uint8_t buf[4096];
    for (ssize_t n; (n = ::read(out[0], buf, sizeof(buf))) > 0;) answer.insert(answer.end(), buf, buf + n);
    ::close(out[0]);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 10) GTEST_SKIP() << "uid 65534 is not available here";
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
    // The answer is one ERROR naming the user, then the server closed; the GET was never served.
    rp::Message m;
    auto r = rp::decode_frame(answer.data(), answer.size(), rp::Role::kResponse, {}, &m);
    ASSERT_EQ(r.status, rp::DecodeStatus::kComplete) << answer.size() << " bytes";
    EXPECT_EQ(m.type, rp::MsgType::kError);
    const std::string text(m.value.begin(), m.value.end());
    EXPECT_TRUE(contains(text, "uid 65534") && contains(text, "WEFT_JOB_TOKEN")) << text;
    EXPECT_EQ(r.frame_bytes, answer.size()) << "more than the ERROR came back";
    EXPECT_TRUE(eventually([&] { return server.stats().rejected == rejected_before + 1; }));
    EXPECT_EQ(server.stats().authenticated, authenticated_before);
    // With a token, the token decides (as it always did): the other user holding it is served.
    TcpStoreServer with_token(local_options("t"));
    addr.sin_port = htons(static_cast<uint16_t>(with_token.port()));
    const Bytes hello_with_token = rp::encode_frame(rp::make_hello("t", 1));
    const pid_t second = ::fork();
    ASSERT_GE(second, 0);
    if (second == 0) {
        const long nobody = 65534;
        if (::syscall(SYS_setresgid, nobody, nobody, nobody) != 0 ||
            ::syscall(SYS_setresuid, nobody, nobody, nobody) != 0) {
            ::_exit(10);
        }
        int fd = ::socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0 || ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) ::_exit(11);
        (void)::send(fd, hello_with_token.data(), hello_with_token.size(), MSG_NOSIGNAL);
        uint8_t reply[rp::kHeaderBytes];
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, 10000) <= 0 || ::recv(fd, reply, sizeof(reply), MSG_WAITALL) != sizeof(reply)) ::_exit(12);
        ::_exit(reply[6] == static_cast<uint8_t>(rp::MsgType::kOk) ? 0 : 13);
    }
    ASSERT_EQ(::waitpid(second, &status, 0), second);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
}

TEST(Rendezvous, TokenlessStoreKnowsItsOwnUserOverEitherLoopback) {
    // The owner of a TCP peer's socket is looked up in /proc/net/tcp (IPv4) or /proc/net/tcp6 (IPv6).
    for (const char* host : {"127.0.0.1", "::1", "localhost"}) {
        RendezvousOptions o = local_options("");
        o.host = host;
        std::unique_ptr<TcpStoreServer> server;
        try {
            server = std::make_unique<TcpStoreServer>(o);
        } catch (const Error& e) {
            if (std::string(host) == "::1") continue;  // no IPv6 loopback on this machine
            FAIL() << host << ": " << e.what();
        }
        o.port = server->port();
        o.rank = 1;
        o.num_ranks = 2;
        auto store = connect_tcp_store(o);
        store->set("k", to_bytes(host));
        EXPECT_EQ(store->get("k", milliseconds(0)), to_bytes(host)) << host;
        EXPECT_EQ(server->stats().rejected, 0u) << host;
    }
}

/// A plain TCP connection to 127.0.0.1:port that sends nothing (-1 when it could not connect).
int idle_socket(int port) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        ::close(fd);
        return -1;
    }
    return fd;
}

TEST(Rendezvous, IdleSocketsCannotLockOutRanks) {
    RendezvousOptions o = local_options();
    o.max_connections = 4;
    o.max_pending_connections = 8;
    TcpStoreServer server(o);
    o.port = server.port();
    // Far more idle sockets than either bound, opened first and kept open, and more opened while the ranks
    // connect.
    std::vector<int> idle;
    for (int i = 0; i < 100; ++i) idle.push_back(idle_socket(server.port()));
    std::atomic<bool> stop{false};
    std::vector<int> flood;
    std::thread flooder([&] {
        for (int i = 0; i < 300 && !stop.load(); ++i) {
            flood.push_back(idle_socket(server.port()));
            std::this_thread::sleep_for(milliseconds(1));
        }
    });
    std::vector<std::unique_ptr<Store>> ranks(4);
    std::vector<std::string> errors(4);
    std::vector<std::thread> threads;
    const auto start = Clock::now();
    for (int r = 0; r < 4; ++r) {
        threads.emplace_back([&, r] {
            RendezvousOptions mine = o;
            mine.rank = r;
            mine.num_ranks = 4;
            errors[static_cast<size_t>(r)] = error_of([&] {
                ranks[static_cast<size_t>(r)] = connect_tcp_store(mine);
                ranks[static_cast<size_t>(r)]->add("arrived", 1);
            });
        });
    }
    for (auto& t : threads) t.join();
    const auto took = Clock::now() - start;
    stop = true;
    flooder.join();
    for (int r = 0; r < 4; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    EXPECT_LT(took, milliseconds(8000));
    ASSERT_TRUE(ranks[0]);
    EXPECT_EQ(ranks[0]->get("arrived", milliseconds(0)), to_bytes("4"));
    EXPECT_GT(server.stats().evicted, 0u);
    // At most max_pending_connections sockets wait for HELLO at any time, beside the 4 ranks.
    EXPECT_LE(server.stats().open_connections, 4u + 8u);
    for (int fd : idle) ::close(fd);
    for (int fd : flood) ::close(fd);
}

/// This process's resident set size in bytes (VmRSS).
size_t resident_bytes() {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line)) {
        if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
    }
    return 0;
}

TEST(Rendezvous, PipelinedGetsAreBounded) {
    TcpStoreServer server(local_options());
    auto store = client_of(server);
    Bytes big(4u << 20);
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 7 + i / 4096);
    store->set("big", big);
    RawConnection raw(server.port());
    ASSERT_TRUE(raw.connected());
    raw.send_message(rp::make_hello("test-token", 1));
    ASSERT_EQ(raw.reply().type, rp::MsgType::kOk);
    const size_t rss_before = resident_bytes();
    const uint64_t requests_before = server.stats().requests;
    // 100 GETs of 4 MiB (2.7 KB of requests) whose replies are not read: 400 MiB if the server queued them all.
    constexpr int kGets = 100;
    Bytes gets;
    for (int i = 0; i < kGets; ++i) {
        Bytes f = rp::encode_frame(rp::make_get("big", 0));
        gets.insert(gets.end(), f.begin(), f.end());
    }
    raw.send_bytes(gets);
    // Let the server do all it will do: wait until it stops serving (bounded).
    uint64_t served = 0;
    for (auto deadline = Clock::now() + milliseconds(5000); Clock::now() < deadline;) {
        std::this_thread::sleep_for(milliseconds(300));
        const uint64_t now_served = server.stats().requests - requests_before;
        if (now_served == served || now_served == kGets) break;
        served = now_served;
    }
    const size_t growth = resident_bytes() - std::min(resident_bytes(), rss_before);
    EXPECT_LT(growth, size_t{32} << 20) << "served " << server.stats().requests - requests_before << " GETs";
    EXPECT_LT(server.stats().buffered_bytes, uint64_t{32} << 20);
    EXPECT_LT(server.stats().requests - requests_before, uint64_t{kGets});  // held back, not all served
    // Reading resumes the service: every reply arrives, whole and in order, and the store stays usable.
    for (int i = 0; i < kGets; ++i) {
        rp::Message m = raw.reply();
        ASSERT_EQ(m.type, rp::MsgType::kOk) << "reply " << i;
        ASSERT_EQ(m.value.size(), big.size()) << "reply " << i;
        ASSERT_TRUE(m.value.front() == big.front() && m.value[12345] == big[12345] && m.value.back() == big.back());
    }
    EXPECT_EQ(server.stats().rejected, 0u);
    EXPECT_TRUE(store->check("big"));
}

TEST(Rendezvous, AnnouncedLengthsReserveNothing) {
    // A header announcing a 64 MiB value costs the server nothing until the bytes come.
    TcpStoreServer server(local_options());
    std::vector<std::unique_ptr<RawConnection>> conns;
    Bytes set_header = rp::encode_frame(rp::make_set("k", Bytes(64u << 20)));
    set_header.resize(rp::kHeaderBytes + 1);  // the header and the key, no value
    for (int i = 0; i < 16; ++i) {
        conns.push_back(std::make_unique<RawConnection>(server.port()));
        conns.back()->send_message(rp::make_hello("test-token", i));
        ASSERT_EQ(conns.back()->reply().type, rp::MsgType::kOk);
        conns.back()->send_bytes(set_header);
    }
    std::this_thread::sleep_for(milliseconds(200));
    auto store = client_of(server);  // the server still serves
    store->set("x", to_bytes("y"));
    EXPECT_LT(server.stats().buffered_bytes, uint64_t{16} << 20);
    EXPECT_EQ(server.stats().rejected, 0u);
}

TEST(Rendezvous, AdoptedSocketpairIsServedWithTheSameRules) {
    TcpStoreServer server(local_options(""));
    int pair[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
    server.adopt_connection(pair[0]);
    const Bytes set = rp::encode_frame(rp::make_set("a", to_bytes("b")));
    const Bytes hello = rp::encode_frame(rp::make_hello("", 3));
    // Nothing but HELLO first.
    (void)::send(pair[1], set.data(), set.size(), MSG_NOSIGNAL);
    uint8_t buf[4096];
    Bytes got;
    timeval tv{5, 0};
    ::setsockopt(pair[1], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    for (ssize_t n; (n = ::recv(pair[1], buf, sizeof(buf), 0)) > 0;) got.insert(got.end(), buf, buf + n);
    ::close(pair[1]);
    rp::Message m;
    ASSERT_EQ(rp::decode_frame(got.data(), got.size(), rp::Role::kResponse, {}, &m).status,
              rp::DecodeStatus::kComplete);
    EXPECT_TRUE(contains(std::string(m.value.begin(), m.value.end()), "first message must be HELLO"));
    // The same user over a socketpair (SO_PEERCRED) is served without a token.
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
    server.adopt_connection(pair[0]);
    ::setsockopt(pair[1], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    (void)::send(pair[1], hello.data(), hello.size(), MSG_NOSIGNAL);
    (void)::send(pair[1], set.data(), set.size(), MSG_NOSIGNAL);
    got.clear();
    while (got.size() < 2 * rp::kHeaderBytes) {
        ssize_t n = ::recv(pair[1], buf, sizeof(buf), 0);
        ASSERT_GT(n, 0);
        got.insert(got.end(), buf, buf + n);
    }
    ::close(pair[1]);
    EXPECT_TRUE(client_of(server, "")->check("a"));
    EXPECT_THROW(server.adopt_connection(-1), Error);
}

int free_port() {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    ::close(fd);
    return ntohs(addr.sin_port);
}

TEST(Rendezvous, MakeTcpStoreAcrossRanksWithALateRankZero) {
    for (int num_ranks : {1, 3, 5}) {
        RendezvousOptions o = local_options("job");
        o.port = free_port();
        o.num_ranks = num_ranks;
        std::vector<std::unique_ptr<Store>> stores(static_cast<size_t>(num_ranks));
        std::vector<std::string> errors(static_cast<size_t>(num_ranks));
        std::vector<std::thread> threads;
        // Ranks 1.. start first and retry; rank 0 arrives 200 ms later.
        for (int r = num_ranks - 1; r >= 0; --r) {
            threads.emplace_back([&, r] {
                if (r == 0) std::this_thread::sleep_for(milliseconds(200));
                RendezvousOptions mine = o;
                mine.rank = r;
                try {
                    auto& store = stores[static_cast<size_t>(r)];
                    store = make_tcp_store(mine);
                    store->set("rank/" + std::to_string(r), to_bytes(std::to_string(r * r)));
                    for (int peer = 0; peer < num_ranks; ++peer) {
                        Bytes v = store->get("rank/" + std::to_string(peer), milliseconds(10000));
                        if (v != to_bytes(std::to_string(peer * peer))) errors[static_cast<size_t>(r)] = "bad value";
                    }
                    store->add("done", 1);
                } catch (const std::exception& e) {
                    errors[static_cast<size_t>(r)] = e.what();
                }
            });
        }
        for (auto& t : threads) t.join();
        for (int r = 0; r < num_ranks; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
        ASSERT_TRUE(stores[0]);
        EXPECT_EQ(stores[0]->get("done", milliseconds(0)), to_bytes(std::to_string(num_ranks)));
        // Other ranks disconnect first; rank 0's store (and server) goes last.
        for (int r = num_ranks - 1; r >= 0; --r) stores[static_cast<size_t>(r)].reset();
    }
}

TEST(Rendezvous, BarrierAndAllGatherOverTcp) {
    // Store's default barrier / all_gather (store.cpp) over this store: ranks as threads, one client each.
    for (int num_ranks : {1, 3, 5}) {
        TcpStoreServer server(local_options());
        std::vector<std::string> errors(static_cast<size_t>(num_ranks));
        std::vector<std::thread> threads;
        for (int r = 0; r < num_ranks; ++r) {
            threads.emplace_back([&, r] {
                try {
                    auto store = client_of(server, "test-token", r);
                    for (int round = 0; round < 3; ++round) {
                        std::this_thread::sleep_for(milliseconds(5 * ((r + round) % num_ranks)));
                        std::string tag = std::to_string(round);
                        store->add("arrived/" + tag, 1);
                        store->barrier("b/" + tag, r, num_ranks, milliseconds(10000));
                        // Nobody leaves a barrier before everyone arrived.
                        if (store->get("arrived/" + tag, milliseconds(0)) != to_bytes(std::to_string(num_ranks))) {
                            errors[static_cast<size_t>(r)] = "left barrier " + tag + " early";
                        }
                        Bytes mine(static_cast<size_t>(10 + 7 * r + round), static_cast<uint8_t>(r * 16 + round));
                        auto all = store->all_gather("g/" + tag, r, num_ranks, mine, milliseconds(10000));
                        for (int q = 0; q < num_ranks; ++q) {
                            Bytes expect(static_cast<size_t>(10 + 7 * q + round), static_cast<uint8_t>(q * 16 + round));
                            if (all.at(static_cast<size_t>(q)) != expect) errors[static_cast<size_t>(r)] = "bad blob";
                        }
                    }
                } catch (const std::exception& e) {
                    errors[static_cast<size_t>(r)] = e.what();
                }
            });
        }
        for (auto& t : threads) t.join();
        for (int r = 0; r < num_ranks; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
    }
}

TEST(Rendezvous, BarrierTimeoutOverTcpNamesTheMissingRank) {
    TcpStoreServer server(local_options());
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    const auto start = Clock::now();
    for (int r = 0; r < 2; ++r) {  // rank 2 of 3 never comes
        threads.emplace_back([&, r] {
            auto store = client_of(server, "test-token", r);
            errors[static_cast<size_t>(r)] = error_of([&] { store->barrier("lonely", r, 3, milliseconds(300)); });
        });
    }
    for (auto& t : threads) t.join();
    EXPECT_LT(Clock::now() - start, milliseconds(5000));  // the 300 ms timeout, not the 10 s connection timeout
    for (const std::string& e : errors) EXPECT_TRUE(contains(e, "lonely") && contains(e, "rank 2")) << e;
}

TEST(Rendezvous, OptionErrorsNameTheOption) {
    RendezvousOptions o = local_options();
    o.num_ranks = 2;
    EXPECT_TRUE(contains(error_of([&] { make_tcp_store(o); }), "RendezvousOptions.port"));  // port 0 with 2 ranks
    o.port = 1;
    o.rank = 2;
    EXPECT_TRUE(contains(error_of([&] { make_tcp_store(o); }), "rank"));
    o.rank = 0;
    o.num_ranks = 0;
    EXPECT_TRUE(contains(error_of([&] { make_tcp_store(o); }), "num_ranks"));
    o.num_ranks = 1;
    o.port = 70000;
    EXPECT_TRUE(contains(error_of([&] { make_tcp_store(o); }), "port"));
    o.port = 0;
    o.timeout = milliseconds(0);
    EXPECT_TRUE(contains(error_of([&] { make_tcp_store(o); }), "timeout"));
    o = local_options();
    EXPECT_TRUE(contains(error_of([&] { connect_tcp_store(o); }), "port"));
    o.host = "";
    EXPECT_TRUE(contains(error_of([&] { make_tcp_store(o); }), "host"));
    // A single rank may let the server pick its port.
    auto single = make_tcp_store(local_options());
    single->set("a", to_bytes("1"));
    EXPECT_EQ(single->add("c", 2), 2);
}

TEST(Rendezvous, ConnectTimesOutNamingTheAddress) {
    RendezvousOptions o = local_options();
    o.port = free_port();  // nobody listens there
    o.rank = 1;
    o.num_ranks = 2;
    o.timeout = milliseconds(300);
    auto start = Clock::now();
    std::string e = error_of([&] { connect_tcp_store(o); });
    auto took = Clock::now() - start;
    EXPECT_TRUE(contains(e, "127.0.0.1:" + std::to_string(o.port)) && contains(e, "rank 1")) << e;
    EXPECT_GE(took, milliseconds(290));
    EXPECT_LT(took, milliseconds(3000));
}

// Whatever answers HELLO with bytes that are not a frame of this protocol version (another program on the port, a
// store built from another weft version) gives the same answer every time: the client fails at once, saying so.
TEST(Rendezvous, AServerThatDoesNotSpeakThisVersionFailsAtOnce) {
    for (const bool weft_of_another_version : {false, true}) {
        const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
        ASSERT_GE(listener, 0);
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
        ASSERT_EQ(::listen(listener, 8), 0);
        socklen_t len = sizeof(addr);
        ASSERT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
        Bytes answer = rp::encode_frame(rp::make_ok());
        if (weft_of_another_version) {
            answer[4] = 7;  // the version field
        } else {
            answer = to_bytes("HTTP/1.1 400 Bad Request\r\n\r\n");
        }
        std::thread server([&] {  // answers every connection, until the client stops coming
            while (true) {
                pollfd p{listener, POLLIN, 0};
                if (::poll(&p, 1, 1000) <= 0) return;
                const int c = ::accept(listener, nullptr, nullptr);
                if (c < 0) return;
                char buf[256];
                (void)::recv(c, buf, sizeof(buf), 0);
                (void)::send(c, answer.data(), answer.size(), MSG_NOSIGNAL);
                ::close(c);
            }
        });
        RendezvousOptions o = local_options();
        o.port = ntohs(addr.sin_port);
        o.rank = 1;
        o.num_ranks = 2;
        o.timeout = milliseconds(20000);
        const auto start = Clock::now();
        const std::string e = error_of([&] { connect_tcp_store(o); });
        const auto took = Clock::now() - start;
        server.join();
        ::close(listener);
        EXPECT_TRUE(contains(e, "does not answer as a weft store of this version")) << e;
        EXPECT_TRUE(contains(e, weft_of_another_version ? "version 7" : "magic")) << e;
        EXPECT_LT(took, milliseconds(5000)) << "retried instead of failing at once: " << e;
    }
}

// The job token travels as HELLO's key: one over the key limit is refused by name, and the secret is never printed.
TEST(Rendezvous, AnOverlongTokenIsRefusedWithoutPrintingIt) {
    RendezvousOptions o = local_options(std::string(1100, 'S') + "ECRET");
    o.port = free_port();
    o.rank = 1;
    o.num_ranks = 2;
    const std::string e = error_of([&] { connect_tcp_store(o); });
    EXPECT_TRUE(contains(e, "WEFT_JOB_TOKEN") && contains(e, "1105")) << e;
    EXPECT_FALSE(contains(e, "SSSSSSSS")) << e;
    o.rank = 0;
    EXPECT_FALSE(contains(error_of([&] { make_tcp_store(o); }), "SSSSSSSS"));
}

TEST(Rendezvous, ServerShutdownFailsPendingGetsPromptly) {
    auto server = std::make_unique<TcpStoreServer>(local_options());
    auto store = client_of(*server);
    store->set("a", to_bytes("1"));
    std::string error;
    auto start = Clock::now();
    std::thread t([&] { error = error_of([&] { store->get("never", milliseconds(20000)); }); });
    std::this_thread::sleep_for(milliseconds(100));
    server.reset();  // joins its thread, closes every socket
    t.join();
    EXPECT_LT(Clock::now() - start, milliseconds(5000));
    EXPECT_TRUE(contains(error, "never") && contains(error, "closed")) << error;
    // Later calls fail at once, saying the connection was lost.
    std::string later = error_of([&] { store->check("a"); });
    EXPECT_TRUE(contains(later, "lost earlier")) << later;
}

// The store's host freezes or drops off the network (no FIN, no RST): a call fails once its reply is reply_timeout
// late, not at the 10 s timeout; a get's own wait on a live store does not count against that bound.
TEST(Rendezvous, AStoreWhoseHostFreezesFailsACallAtTheReplyBound) {
    TcpStoreServer server(local_options());
    testing::FreezingProxy proxy(server.port());
    RendezvousOptions o = local_options();
    o.port = proxy.port();
    o.num_ranks = 2;
    o.rank = 1;
    o.reply_timeout = milliseconds(300);
    auto store = connect_tcp_store(o);
    store->set("a", to_bytes("1"));
    auto start = Clock::now();
    const std::string waited = error_of([&] { store->get("never", milliseconds(700)); });
    EXPECT_GE(Clock::now() - start, milliseconds(700));
    EXPECT_TRUE(contains(waited, "timed out after 700 ms") && contains(waited, "no rank set the key")) << waited;
    EXPECT_TRUE(store->check("a")) << "a get's own wait broke the connection";

    proxy.freeze();
    start = Clock::now();
    const std::string frozen = error_of([&] { store->set("b", to_bytes("2")); });
    const auto took = Clock::now() - start;
    EXPECT_GE(took, milliseconds(250));
    EXPECT_LT(took, milliseconds(3000)) << "the call waited for the 10 s timeout, not the reply bound";
    EXPECT_TRUE(contains(frozen, "reply timed out") && contains(frozen, "300 ms past when it was due") &&
                contains(frozen, "stopped"))
        << frozen;
    start = Clock::now();
    const std::string later = error_of([&] { store->check("a"); });
    EXPECT_LT(Clock::now() - start, milliseconds(100));
    EXPECT_TRUE(contains(later, "lost earlier")) << later;

    o.reply_timeout = milliseconds(-1);
    EXPECT_TRUE(contains(error_of([&] { connect_tcp_store(o); }), "reply_timeout must be >= 0"));
}

TEST(Rendezvous, ManyConnectionsAtOnce) {
    TcpStoreServer server(local_options());
    std::vector<std::unique_ptr<Store>> clients;
    for (int i = 0; i < 100; ++i) clients.push_back(client_of(server, "test-token", i % 64));
    for (size_t i = 0; i < clients.size(); ++i) clients[i]->add("n", 1);
    EXPECT_EQ(clients[0]->get("n", milliseconds(0)), to_bytes("100"));
    EXPECT_EQ(server.stats().open_connections, 100u);
    clients.clear();
    EXPECT_TRUE(eventually([&] { return server.stats().open_connections == 0; }));
}

// ---- the store on an abstract Unix-domain socket ------------------------------------------------------

/// A name no other test (nor another run of this binary) uses.
std::string unique_socket_name(const char* what) {
    static std::atomic<int> counter{0};
    return cat("weft-unit-", what, "-", std::to_string(::getpid()), "-", std::to_string(counter++));
}

sockaddr_un abstract_address(const std::string& name, socklen_t* length) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path + 1, name.data(), name.size());
    *length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    return addr;
}

/// In a forked child: becomes uid/gid 65534 (nobody), or exits with 10 when it cannot.
void become_nobody_or_exit() {
    const long nobody = 65534;
    if (::syscall(SYS_setresgid, nobody, nobody, nobody) != 0 ||
        ::syscall(SYS_setresuid, nobody, nobody, nobody) != 0) {
        ::_exit(10);
    }
}

TEST(Rendezvous, UnixSocketStoreAcrossRanksWithALateRankZero) {
    for (int num_ranks : {2, 5}) {
        RendezvousOptions o = local_options("");  // no token: the socket's peers are told apart by SO_PEERCRED
        o.unix_socket = unique_socket_name("ranks");
        o.num_ranks = num_ranks;
        std::vector<std::string> errors(static_cast<size_t>(num_ranks));
        std::vector<std::unique_ptr<Store>> stores(static_cast<size_t>(num_ranks));
        std::vector<std::thread> threads;
        for (int r = num_ranks - 1; r >= 0; --r) {
            threads.emplace_back([&, r] {
                if (r == 0) std::this_thread::sleep_for(milliseconds(200));  // the others retry meanwhile
                RendezvousOptions mine = o;
                mine.rank = r;
                try {
                    auto& store = stores[static_cast<size_t>(r)];
                    store = make_tcp_store(mine);
                    store->barrier("b", r, num_ranks, milliseconds(10000));
                    const Bytes mine_blob = to_bytes(std::to_string(r * 7));
                    auto all = store->all_gather("g", r, num_ranks, mine_blob, milliseconds(10000));
                    for (int q = 0; q < num_ranks; ++q) {
                        if (all[static_cast<size_t>(q)] != to_bytes(std::to_string(q * 7))) {
                            errors[static_cast<size_t>(r)] = "bad blob";
                        }
                    }
                    store->barrier("end", r, num_ranks, milliseconds(10000));
                } catch (const std::exception& e) {
                    errors[static_cast<size_t>(r)] = e.what();
                }
            });
        }
        for (auto& t : threads) t.join();
        for (int r = 0; r < num_ranks; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
        for (int r = num_ranks - 1; r >= 0; --r) stores[static_cast<size_t>(r)].reset();
    }
}

TEST(Rendezvous, UnixSocketNameInUseNamesTheHolder) {
    RendezvousOptions o = local_options("");
    o.unix_socket = unique_socket_name("taken");
    TcpStoreServer first(o);
    EXPECT_EQ(first.port(), 0);
    const std::string e = error_of([&] { TcpStoreServer second(o); });
    EXPECT_TRUE(contains(e, "'@" + o.unix_socket + "'") && contains(e, "held by pid " + std::to_string(::getpid())) &&
                contains(e, "this user"))
        << e;
}

TEST(Rendezvous, UnixSocketRejectsOtherUid) {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root, to connect as another user";
    RendezvousOptions o = local_options("");
    o.unix_socket = unique_socket_name("uid");
    TcpStoreServer server(o);
    RendezvousOptions client = o;
    client.rank = 1;
    client.num_ranks = 2;
    connect_tcp_store(client)->set("secret", to_bytes("s"));  // the server's own user is served
    const uint64_t rejected_before = server.stats().rejected;

    const Bytes hello = rp::encode_frame(rp::make_hello("", 1));
    const Bytes get = rp::encode_frame(rp::make_get("secret", 0));
    socklen_t length = 0;
    const sockaddr_un addr = abstract_address(o.unix_socket, &length);
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        ::close(out[0]);
        become_nobody_or_exit();
        int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
        if (fd < 0 || ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), length) != 0) ::_exit(11);
        (void)::send(fd, hello.data(), hello.size(), MSG_NOSIGNAL);
        (void)::send(fd, get.data(), get.size(), MSG_NOSIGNAL);
        uint8_t buf[4096];
        for (;;) {
            pollfd p{fd, POLLIN, 0};
            if (::poll(&p, 1, 10000) <= 0) ::_exit(12);
            ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
            if (n <= 0) ::_exit(0);
            (void)::write(out[1], buf, static_cast<size_t>(n));
        }
    }
    ::close(out[1]);
    Bytes answer;
    uint8_t buf[4096];
    for (ssize_t n; (n = ::read(out[0], buf, sizeof(buf))) > 0;) answer.insert(answer.end(), buf, buf + n);
    ::close(out[0]);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 10) GTEST_SKIP() << "uid 65534 is not available here";
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
    rp::Message m;
    auto r = rp::decode_frame(answer.data(), answer.size(), rp::Role::kResponse, {}, &m);
    ASSERT_EQ(r.status, rp::DecodeStatus::kComplete) << answer.size() << " bytes";
    EXPECT_EQ(m.type, rp::MsgType::kError);
    EXPECT_TRUE(contains(std::string(m.value.begin(), m.value.end()), "uid 65534"));
    EXPECT_EQ(r.frame_bytes, answer.size()) << "more than the ERROR came back";
    EXPECT_TRUE(eventually([&] { return server.stats().rejected == rejected_before + 1; }));
}

TEST(Rendezvous, UnixSocketOfAnotherUserGetsNothing) {
    // Anyone may bind an abstract name first. A client finding another user's process there fails, naming
    // it, and sends it nothing (not even the HELLO, which would carry a token); rank 0 cannot bind the name
    // and says who holds it.
    if (::geteuid() != 0) GTEST_SKIP() << "needs root, to listen as another user";
    const std::string name = unique_socket_name("squat");
    socklen_t length = 0;
    const sockaddr_un addr = abstract_address(name, &length);
    int ready[2], stop[2];
    ASSERT_EQ(::pipe(ready), 0);
    ASSERT_EQ(::pipe(stop), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
        ::close(ready[0]);
        ::close(stop[1]);
        become_nobody_or_exit();
        int listener = ::socket(AF_UNIX, SOCK_STREAM, 0);
        if (listener < 0 || ::bind(listener, reinterpret_cast<const sockaddr*>(&addr), length) != 0 ||
            ::listen(listener, 16) != 0) {
            ::_exit(11);
        }
        (void)::write(ready[1], "R", 1);
        // Count every byte any connection sends until the parent says stop; report the count.
        uint64_t received = 0;
        int conns[16];
        int num_conns = 0;
        for (;;) {
            pollfd p[18];
            p[0] = {stop[0], POLLIN, 0};
            p[1] = {listener, POLLIN, 0};
            for (int i = 0; i < num_conns; ++i) p[2 + i] = {conns[i], POLLIN, 0};
            if (::poll(p, static_cast<nfds_t>(2 + num_conns), 20000) <= 0) ::_exit(12);
            if (p[0].revents != 0) break;
            if (p[1].revents != 0 && num_conns < 16) {
                int c = ::accept(listener, nullptr, nullptr);
                if (c >= 0) conns[num_conns++] = c;
            }
            for (int i = 0; i < num_conns; ++i) {
                if (p[2 + i].revents == 0) continue;
                uint8_t buf[256];
                ssize_t n = ::recv(conns[i], buf, sizeof(buf), MSG_DONTWAIT);
                if (n > 0) received += static_cast<uint64_t>(n);
            }
        }
        (void)::write(ready[1], &received, sizeof(received));
        ::_exit(0);
    }
    ::close(ready[1]);
    ::close(stop[0]);
    char r = 0;
    const bool listening = ::read(ready[0], &r, 1) == 1;
    std::string client_error, server_error;
    if (listening) {
        RendezvousOptions o = local_options("secret-token");
        o.unix_socket = name;
        o.rank = 1;
        o.num_ranks = 2;
        o.timeout = milliseconds(2000);
        client_error = error_of([&] { connect_tcp_store(o); });
        o.rank = 0;
        server_error = error_of([&] { make_tcp_store(o); });
    }
    (void)::write(stop[1], "S", 1);
    uint64_t received = ~0ull;
    const bool reported = ::read(ready[0], &received, sizeof(received)) == sizeof(received);
    ::close(ready[0]);
    ::close(stop[1]);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    if (WIFEXITED(status) && WEXITSTATUS(status) == 10) GTEST_SKIP() << "uid 65534 is not available here";
    ASSERT_TRUE(listening && reported && WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
    EXPECT_TRUE(contains(client_error, "of uid 65534, not by this user (uid 0)") &&
                contains(client_error, "nothing was sent"))
        << client_error;
    EXPECT_TRUE(contains(server_error, "'@" + name + "'") && contains(server_error, "of uid 65534, another user"))
        << server_error;
    EXPECT_EQ(received, 0u) << "the other user's process received bytes";
}

}  // namespace
}  // namespace weft
