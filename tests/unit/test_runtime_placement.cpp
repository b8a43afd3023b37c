// SPDX-License-Identifier: MIT
// Unit tests for World::from_store's store-level parts: where the ranks are (host, process), the exchange through
// a store of the user's under a prefix, and the membership errors (all before any CUDA call).
#include <gtest/gtest.h>

#include <unistd.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "support/error_text.hpp"
#include "weft/detail/runtime_placement.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/in_process_store.hpp"
#include "weft/runtime/world.hpp"

namespace weft::detail {
namespace {

using namespace std::chrono_literals;

using testing::error_of;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(RuntimePlacement, ThreadsOfOneProcess) {
    const ProcessRecord me{"node-a", "pid:[4026531836]", 4242};
    const std::vector<ProcessRecord> records(4, me);
    for (int r = 0; r < 4; ++r) {
        const Placement p = placement_from_records(records, r);
        EXPECT_TRUE(p.same_process);
        EXPECT_EQ(p.local_rank, r);
        EXPECT_EQ(p.local_num_ranks, 4);
    }
    EXPECT_TRUE(placement_from_records({me}, 0).same_process);  // one rank
}

TEST(RuntimePlacement, ProcessesOnSeveralHostsInRankOrder) {
    // Ranks 0, 2, 3 on host a; 1 and 4 on host b; every rank a process of its own (the same pid on two hosts,
    // or in two pid namespaces of one host, is two processes).
    const std::vector<ProcessRecord> records = {{"a", "pid:[1]", 100},
                                                {"b", "pid:[1]", 100},
                                                {"a", "pid:[1]", 101},
                                                {"a", "pid:[2]", 101},
                                                {"b", "pid:[1]", 102}};
    const int local_rank[] = {0, 0, 1, 2, 1};
    const int local_num_ranks[] = {3, 2, 3, 3, 2};
    for (int r = 0; r < 5; ++r) {
        const Placement p = placement_from_records(records, r);
        EXPECT_FALSE(p.same_process) << r;
        EXPECT_EQ(p.local_rank, local_rank[r]) << r;
        EXPECT_EQ(p.local_num_ranks, local_num_ranks[r]) << r;
    }
}

TEST(RuntimePlacement, AMixOfThreadsAndProcessesIsNamed) {
    const std::vector<ProcessRecord> records = {{"a", "ns", 100}, {"a", "ns", 100}, {"a", "ns", 200}};
    const std::string e = error_of([&] { placement_from_records(records, 2); });
    EXPECT_TRUE(contains(e, "all threads of one process or all processes of their own") &&
                contains(e, "ranks 0, 1 are threads of pid 100 on a") && contains(e, "3 ranks in 2 processes"))
        << e;
    EXPECT_TRUE(contains(error_of([&] { placement_from_records(records, 3); }), "rank 3 is outside"));
}

TEST(RuntimePlacement, ExchangeThroughAPrefixOfAUserStore) {
    // The threads of this process as ranks, through a view of a store that also carries someone else's keys.
    auto user = std::make_shared<InProcessStore>();
    user->set("torch/own/key", Bytes{1});
    auto view = make_prefix_store(user, "weft-job");
    const int n = 3;
    std::vector<Placement> placements(n);
    std::vector<std::string> errors(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
            errors[static_cast<size_t>(r)] = error_of([&] {
                placements[static_cast<size_t>(r)] = exchange_placement(*view, "weft/placement", r, n, 10000ms);
            });
        });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r) {
        EXPECT_EQ(errors[static_cast<size_t>(r)], "");
        EXPECT_TRUE(placements[static_cast<size_t>(r)].same_process);
        EXPECT_EQ(placements[static_cast<size_t>(r)].local_rank, r);
        EXPECT_EQ(placements[static_cast<size_t>(r)].local_num_ranks, n);
    }
    EXPECT_EQ(user->num_keys(), 1u);  // the exchange removed its keys; the other user's key is untouched
    const ProcessRecord me = this_process_record();
    EXPECT_EQ(me.pid, static_cast<int64_t>(::getpid()));
    EXPECT_FALSE(me.host.empty());
}

TEST(RuntimePlacement, MissingAndMalformedRanksAreNamed) {
    auto user = std::make_shared<InProcessStore>();
    auto view = make_prefix_store(user, "p");
    const std::string missing = error_of([&] { exchange_placement(*view, "weft/placement", 0, 2, 100ms); });
    EXPECT_TRUE(contains(missing, "rank 1 did not arrive") && contains(missing, "p/weft/placement/1")) << missing;
    user->set("p/weft/garbled/1", Bytes{'x'});  // what "rank 1" published
    const std::string garbled = error_of([&] { exchange_placement(*view, "weft/garbled", 0, 2, 1000ms); });
    EXPECT_TRUE(contains(garbled, "rank 1 published a malformed process record 'x'")) << garbled;
}

TEST(WorldFromStore, MembershipErrorsNameTheField) {
    // Checked before any CUDA call, so they are the same with or without a GPU.
    auto store = make_in_process_store();
    auto error_with = [&](WorldMembership m, std::shared_ptr<Store> s) {
        return error_of([&] { World::from_store(std::move(s), m); });
    };
    auto valid = [] {
        WorldMembership m;
        m.rank = 1;
        m.num_ranks = 2;
        return m;
    };
    EXPECT_TRUE(contains(error_with(valid(), nullptr), "store is null"));
    WorldMembership m = valid();
    m.num_ranks = 0;
    EXPECT_TRUE(contains(error_with(m, store), "WorldMembership::num_ranks must be at least 1, got 0"));
    m = valid();
    m.rank = 2;
    EXPECT_TRUE(contains(error_with(m, store), "WorldMembership::rank must be in [0, num_ranks=2), got 2"));
    m = valid();
    m.rank = -1;
    EXPECT_TRUE(contains(error_with(m, store), "WorldMembership::rank"));
    m = valid();
    m.local_rank = 0;
    EXPECT_TRUE(contains(error_with(m, store), "WorldMembership::local_num_ranks must be in [1, num_ranks=2]"));
    m = valid();
    m.local_num_ranks = 2;
    EXPECT_TRUE(contains(error_with(m, store), "WorldMembership::local_rank must be in [0, local_num_ranks=2)"));
    m = valid();
    m.local_rank = 1;
    m.local_num_ranks = 3;
    EXPECT_TRUE(contains(error_with(m, store), "local_num_ranks must be in [1, num_ranks=2]"));
    m = valid();
    m.key_prefix = "";
    EXPECT_TRUE(contains(error_with(m, store), "WorldMembership::key_prefix"));
    m.key_prefix = "two words";
    EXPECT_TRUE(contains(error_with(m, store), "'two words'"));
    // Nothing was written to the store by a call that failed its checks.
    EXPECT_EQ(std::static_pointer_cast<InProcessStore>(store)->num_keys(), 0u);
}

}  // namespace
}  // namespace weft::detail
