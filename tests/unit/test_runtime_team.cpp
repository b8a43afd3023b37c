// SPDX-License-Identifier: MIT
// Unit tests for team maths: strided and colour splits, rank translation, grouping by label.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "weft/detail/team_math.hpp"
#include "weft/runtime/error.hpp"

namespace weft::detail {
namespace {

TeamMembers iota_members(int n, int first = 0) {
    TeamMembers m(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) m[static_cast<size_t>(i)] = first + i;
    return m;
}

TEST(RuntimeTeamMath, SplitStrided) {
    const TeamMembers world = iota_members(8);
    EXPECT_EQ(split_strided_members(world, 0, 2, 4), (TeamMembers{0, 2, 4, 6}));
    EXPECT_EQ(split_strided_members(world, 1, 2, 4), (TeamMembers{1, 3, 5, 7}));
    EXPECT_EQ(split_strided_members(world, 5, 1, 3), (TeamMembers{5, 6, 7}));
    EXPECT_EQ(split_strided_members(world, 7, 0, 1), (TeamMembers{7}));
    // Of a sub-team: indices are parent team ranks, results are world ranks.
    const TeamMembers odd{1, 3, 5, 7, 9, 11};
    EXPECT_EQ(split_strided_members(odd, 1, 3, 2), (TeamMembers{3, 9}));
}

TEST(RuntimeTeamMath, SplitStridedRejectsRanksOutsideTheParent) {
    const TeamMembers world = iota_members(6);
    EXPECT_THROW(split_strided_members(world, 0, 2, 4), Error);  // 0,2,4,6: 6 is outside
    EXPECT_THROW(split_strided_members(world, -1, 1, 2), Error);
    EXPECT_THROW(split_strided_members(world, 6, 1, 1), Error);
    EXPECT_THROW(split_strided_members(world, 0, 1, 0), Error);
    EXPECT_THROW(split_strided_members(world, 0, 0, 2), Error);
    EXPECT_THROW(split_strided_members(world, 1, 1 << 30, 3), Error);  // no int overflow
    try {
        split_strided_members(world, 0, 2, 4);
        FAIL() << "no error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("outside the parent team of 6 ranks"), std::string::npos) << e.what();
    }
}

TEST(RuntimeTeamMath, SplitColorOrdersByKeyThenParentRank) {
    const TeamMembers parent{10, 11, 12, 13, 14, 15};
    const std::vector<int> colors{0, 1, 0, 1, 0, -1};
    const std::vector<int> keys{5, 0, 5, 2, 1, 0};
    EXPECT_EQ(split_color_members(parent, colors, keys, 0), (TeamMembers{14, 10, 12}));  // key 1, then 5, 5 by rank
    EXPECT_EQ(split_color_members(parent, colors, keys, 1), (TeamMembers{11, 13}));
    EXPECT_TRUE(split_color_members(parent, colors, keys, -1).empty());
    EXPECT_TRUE(split_color_members(parent, colors, keys, 7).empty());
    EXPECT_THROW(split_color_members(parent, {0, 1}, keys, 0), Error);
}

TEST(RuntimeTeamMath, SplitColorPartitionsRandomly) {
    std::mt19937 rng(std::random_device{}());
    for (int round = 0; round < 50; ++round) {
        const int n = 1 + static_cast<int>(rng() % 13);
        const TeamMembers parent = iota_members(n, 100);
        std::vector<int> colors(static_cast<size_t>(n)), keys(static_cast<size_t>(n));
        for (int i = 0; i < n; ++i) {
            colors[static_cast<size_t>(i)] = static_cast<int>(rng() % 4);
            keys[static_cast<size_t>(i)] = static_cast<int>(rng() % 3);
        }
        std::vector<int> seen;
        for (int color = 0; color < 4; ++color) {
            auto team = split_color_members(parent, colors, keys, color);
            for (size_t t = 0; t < team.size(); ++t) {
                const int parent_rank = team[t] - 100;
                EXPECT_EQ(colors[static_cast<size_t>(parent_rank)], color);
                if (t > 0) {
                    const int prev = team[t - 1] - 100;
                    const auto a = std::make_pair(keys[static_cast<size_t>(prev)], prev);
                    const auto b = std::make_pair(keys[static_cast<size_t>(parent_rank)], parent_rank);
                    EXPECT_LT(a, b);
                }
                seen.push_back(team[t]);
            }
        }
        std::sort(seen.begin(), seen.end());
        EXPECT_EQ(seen, parent);  // every rank in exactly one team
    }
}

TEST(RuntimeTeamMath, Translation) {
    const TeamMembers team{4, 2, 9};
    EXPECT_EQ(team_rank_of(team, 2), 1);
    EXPECT_EQ(team_rank_of(team, 9), 2);
    EXPECT_EQ(team_rank_of(team, 3), -1);
    EXPECT_EQ(world_rank_of(team, 0), 4);
    EXPECT_THROW(world_rank_of(team, 3), Error);
    EXPECT_THROW(world_rank_of(team, -1), Error);
    for (int t = 0; t < 3; ++t) EXPECT_EQ(team_rank_of(team, world_rank_of(team, t)), t);
}

TEST(RuntimeTeamMath, GroupByLabel) {
    EXPECT_EQ(group_by_label({"b", "a", "b", "c", "a"}), (std::vector<int>{0, 1, 0, 2, 1}));
    EXPECT_TRUE(group_by_label({}).empty());
}

}  // namespace
}  // namespace weft::detail
