// SPDX-License-Identifier: MIT
// How Worlds start with one process per rank: a second World::from_env beside the first (its own store), and
// World::from_store on a store rank 0 hosts (as torch.distributed's rank 0 hosts its TCPStore) and on an
// in-process store shared by threads.
#include <gtest/gtest.h>

#include <chrono>

#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dist/dist_world.hpp"
#include "support/jit_testing.hpp"
#include "support/runtime_checks.hpp"
#include "weft/runtime/in_process_store.hpp"
#include "weft/runtime/rendezvous.hpp"
#include "weft/weft.hpp"

namespace weft {
namespace {

World& world() { return test::dist_world(); }

/// The checks every new World makes here: its place matches the process's World, peers' heaps are mapped
/// and written through symm_at, and a barrier passes.
void check_world(World& sub, int rank, int num_ranks) {
    EXPECT_EQ(sub.rank(), rank);
    EXPECT_EQ(sub.num_ranks(), num_ranks);
    for (int r = 0; r < sub.num_ranks(); ++r) {
        EXPECT_NE(sub.heap().peer_bases()[static_cast<size_t>(r)], nullptr) << "rank " << r << "'s heap";
    }
    test::check_exchange_through_symm_at(sub, 4096 + 7);
    sub.barrier();
}

TEST(DistBootstrap, SecondWorldFromEnvBesideTheFirst) {
    // The second World::from_env of every process meets at the second World's store while the first World
    // (made in main) still holds its own.
    World& w = world();
    auto second = World::from_env(test::test_options(32ull << 20));
    check_world(*second, w.rank(), w.num_ranks());
    EXPECT_EQ(second->local_rank(), w.local_rank());
    EXPECT_EQ(second->local_num_ranks(), w.local_num_ranks());
    second.reset();  // collective
    w.barrier();
}

TEST(DistBootstrap, SettingsThatDifferAcrossRanksFailEveryRankNamingTheVariable) {
    // WEFT_NET_CHUNK_BYTES cuts the network paths' blocks: ranks that cut differently would pair sends and receives
    // wrongly, so a World whose ranks disagree is refused at start-up, on every rank.
    World& w = world();
    std::string error;
    try {
        const testing::ScopedEnv chunk("WEFT_NET_CHUNK_BYTES", w.rank() == 0 ? "2M" : "4M");
        auto other = World::from_env(test::test_options(32ull << 20));
    } catch (const Error& e) {
        error = e.what();
    }
    EXPECT_NE(error.find("WEFT_NET_CHUNK_BYTES"), std::string::npos) << error;
    EXPECT_NE(error.find("differs across ranks"), std::string::npos) << error;
    w.barrier();

    // A heartbeat slower on one rank than its peers' dead-peer bound allows would get it declared dead.
    WorldOptions options = test::test_options(32ull << 20);
    options.heartbeat = std::chrono::milliseconds(w.rank() == 0 ? 1000 : 2000);
    options.dead_peer_timeout = std::chrono::milliseconds(10000);
    error.clear();
    try {
        auto other = World::from_env(options);
    } catch (const Error& e) {
        error = e.what();
    }
    EXPECT_NE(error.find("WEFT_HEARTBEAT_MS and WEFT_DEAD_PEER_MS"), std::string::npos) << error;
    EXPECT_NE(error.find("differs across ranks"), std::string::npos) << error;
    w.barrier();
}

TEST(DistBootstrap, ARankThatRefusesBeforeTheExchangeFailsEveryRankAtOnceNamingIt) {
    // A per-rank refusal before the start-up exchange (an option, a malformed variable): the refusing rank still
    // takes part in the exchange, so the others fail at once naming it instead of waiting for it until the timeout.
    World& w = world();
    const int refusing = w.num_ranks() - 1;
    for (int round = 0; round < 2; ++round) {
        WorldOptions options = test::test_options(32ull << 20);
        options.timeout = std::chrono::milliseconds(120000);
        if (w.rank() == refusing && round == 0) options.device = 4096;
        const auto start = std::chrono::steady_clock::now();
        std::string error;
        try {
            std::optional<testing::ScopedEnv> heartbeat;
            if (w.rank() == refusing && round == 1) heartbeat.emplace("WEFT_HEARTBEAT_MS", "soon");
            auto other = World::from_env(options);
        } catch (const Error& e) {
            error = e.what();
        }
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30)) << "waited for the timeout";
        const std::string what = round == 0 ? "WorldOptions::device" : "WEFT_HEARTBEAT_MS";
        EXPECT_NE(error.find(what), std::string::npos) << error;
        if (w.rank() != refusing) {
            EXPECT_NE(error.find("refused before the start-up exchange (rank " + std::to_string(refusing) + ": "),
                      std::string::npos)
                << error;
        } else {
            EXPECT_EQ(error.find("refused before the start-up exchange"), std::string::npos)
                << "its own error: " << error;
        }
        w.barrier();
    }
}

TEST(DistBootstrap, FromStoreOnAStoreHostedByRankZero) {
    // Rank 0 hosts a store (here weft's own server on an abstract socket; under torch it would be torch's
    // TCPStore), every rank is its client, and two Worlds are built on it one after the other under one prefix.
    World& w = world();
    const std::string name = "weft-dist-user-store-" + std::to_string(::getpid());
    std::unique_ptr<TcpStoreServer> server;
    if (w.rank() == 0) {
        RendezvousOptions o;
        o.unix_socket = name;
        server = std::make_unique<TcpStoreServer>(o);
        const std::string text = name;
        w.store().set("dist/bootstrap/user-store", Bytes(text.begin(), text.end()));
    }
    const Bytes published = w.store().get("dist/bootstrap/user-store", w.timeout());
    RendezvousOptions client;
    client.unix_socket = std::string(published.begin(), published.end());
    client.rank = w.rank();
    client.num_ranks = w.num_ranks();
    std::shared_ptr<Store> store = connect_tcp_store(client);
    for (int round = 0; round < 2; ++round) {
        WorldMembership m;
        m.rank = w.rank();
        m.num_ranks = w.num_ranks();
        m.key_prefix = "torch-job";  // reused by the second World
        auto sub = World::from_store(store, m, test::test_options(32ull << 20));
        check_world(*sub, w.rank(), w.num_ranks());
        // Local ranks found from the host names agree with the launcher's.
        EXPECT_EQ(sub->local_rank(), w.local_rank());
        EXPECT_EQ(sub->local_num_ranks(), w.local_num_ranks());
        EXPECT_EQ(sub->node_team().num_ranks(), w.node_team().num_ranks());
    }
    store.reset();
    w.barrier();  // every rank has destroyed its Worlds and closed its connection
    if (server) {
        EXPECT_EQ(server->stats().keys, 0u) << "the Worlds left keys in the user's store";
        EXPECT_EQ(server->stats().rejected, 0u);
    }
    w.barrier();
}

TEST(DistBootstrap, FromStoreWithThreadsOfEachProcess) {
    // In every process, two threads form a World of two ranks on an in-process store: from_store finds that its
    // ranks share a process (peers' heaps by address, no descriptors), on this process's GPU.
    World& w = world();
    auto store = make_in_process_store();
    std::vector<std::string> errors(2);
    std::vector<std::thread> threads;
    for (int t = 0; t < 2; ++t) {
        threads.emplace_back([&, t] {
            try {
                WorldMembership m;
                m.rank = t;
                m.num_ranks = 2;
                WorldOptions o = test::test_options(32ull << 20);
                o.device = w.device();
                auto sub = World::from_store(store, m, o);
                WEFT_CHECK(sub->local_num_ranks() == 2 && sub->local_rank() == t,
                           "thread " << t << ": local rank " << sub->local_rank() << " of " << sub->local_num_ranks());
                WEFT_CHECK(sub->num_ranks_on_device() == 2, "thread " << t << ": " << sub->num_ranks_on_device()
                                                                      << " ranks on its GPU, expected 2");
                test::check_exchange_through_symm_at(*sub, 1024 + 3);
            } catch (const std::exception& e) {
                errors[static_cast<size_t>(t)] = e.what();
            }
        });
    }
    for (auto& t : threads) t.join();
    for (int t = 0; t < 2; ++t) EXPECT_EQ(errors[static_cast<size_t>(t)], "") << "thread " << t;
    EXPECT_EQ(std::static_pointer_cast<InProcessStore>(store)->num_keys(), 0u);
    w.barrier();
}

}  // namespace
}  // namespace weft
