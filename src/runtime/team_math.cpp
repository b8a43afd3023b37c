// SPDX-License-Identifier: MIT
// Team membership maths (see include/weft/detail/team_math.hpp).
#include "weft/detail/team_math.hpp"

#include <algorithm>
#include <cstdint>
#include <map>
#include <tuple>

#include "weft/runtime/error.hpp"

namespace weft::detail {

TeamMembers split_strided_members(const TeamMembers& parent, int start, int stride, int size) {
    const int parent_size = static_cast<int>(parent.size());
    WEFT_CHECK(size >= 1, "split_strided: size must be at least 1, got " << size);
    WEFT_CHECK(start >= 0 && start < parent_size,
               "split_strided: start must be a rank of the parent team [0, " << parent_size << "), got " << start);
    WEFT_CHECK(size == 1 || stride >= 1, "split_strided: stride must be at least 1 when size > 1, got " << stride);
    const int64_t last = static_cast<int64_t>(start) + static_cast<int64_t>(stride) * (size - 1);
    WEFT_CHECK(last < parent_size, "split_strided: start " << start << " + stride " << stride << " * (size " << size
                                                           << " - 1) = " << last << " is outside the parent team of "
                                                           << parent_size << " ranks");
    TeamMembers members;
    members.reserve(static_cast<size_t>(size));
    for (int i = 0; i < size; ++i) members.push_back(parent[static_cast<size_t>(start + i * stride)]);
    return members;
}

TeamMembers split_color_members(const TeamMembers& parent, const std::vector<int>& colors, const std::vector<int>& keys,
                                int color) {
    WEFT_CHECK(colors.size() == parent.size() && keys.size() == parent.size(),
               "split_color: need one colour and key per parent rank (" << parent.size() << "), got " << colors.size()
                                                                        << " colours and " << keys.size() << " keys");
    TeamMembers members;
    if (color < 0) return members;
    std::vector<std::tuple<int, int, int>> picked;  // (key, parent rank, world rank)
    for (size_t i = 0; i < parent.size(); ++i) {
        if (colors[i] == color) picked.emplace_back(keys[i], static_cast<int>(i), parent[i]);
    }
    std::sort(picked.begin(), picked.end());
    for (const auto& p : picked) members.push_back(std::get<2>(p));
    return members;
}

int team_rank_of(const TeamMembers& members, int world_rank) {
    auto it = std::find(members.begin(), members.end(), world_rank);
    return it == members.end() ? -1 : static_cast<int>(it - members.begin());
}

int world_rank_of(const TeamMembers& members, int team_rank) {
    WEFT_CHECK(team_rank >= 0 && team_rank < static_cast<int>(members.size()),
               "team rank must be in [0, " << members.size() << "), got " << team_rank);
    return members[static_cast<size_t>(team_rank)];
}

std::vector<int> group_by_label(const std::vector<std::string>& labels) {
    std::map<std::string, int> index;
    std::vector<int> groups;
    groups.reserve(labels.size());
    for (const auto& label : labels) {
        auto [it, inserted] = index.emplace(label, static_cast<int>(index.size()));
        groups.push_back(it->second);
    }
    return groups;
}

}  // namespace weft::detail
