// SPDX-License-Identifier: MIT
// The construction-time agreement of a collective object's members (ep::Buffer's Config, the TP MoE layers' shape):
// every member's record, or the error that kept it from making one.
#pragma once

#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "weft/runtime/error.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/world.hpp"

namespace weft::ops::detail {

/// All-gathers over `team` (under `key`) every member's record, made by `make_record()` (which validates the member's
/// arguments and may throw): a tag byte, then the record, or the error's text in its place, so that a
/// member whose arguments are invalid fails every member at once instead of leaving them waiting in the exchange.
/// This member's own error is rethrown; a peer's is named: "<op>: world rank r's <what> invalid (<its error>)".
/// Returns the members' records (without the tag) in team-rank order; a team of one exchanges nothing.
template <class MakeRecord>
std::vector<std::vector<uint8_t>> exchange_member_records(const Team& team, const std::string& key, const char* op,
                                                          const char* what, MakeRecord&& make_record) {
    if (team.num_ranks() == 1) return {make_record()};
    std::exception_ptr invalid;
    std::vector<uint8_t> mine{0};
    try {
        const std::vector<uint8_t> record = make_record();
        mine.insert(mine.end(), record.begin(), record.end());
    } catch (const std::exception& e) {
        invalid = std::current_exception();
        const std::string why = e.what();
        mine.assign(1, 1);
        mine.insert(mine.end(), why.begin(), why.end());
    }
    std::vector<std::vector<uint8_t>> all = team.all_gather(key, mine);
    if (invalid) std::rethrow_exception(invalid);
    for (int r = 0; r < team.num_ranks(); ++r) {
        std::vector<uint8_t>& theirs = all[static_cast<size_t>(r)];
        WEFT_CHECK(!theirs.empty() && theirs[0] == 0,
                   op << ": world rank " << team.world_rank(r) << "'s " << what << " invalid ("
                      << (theirs.empty() ? std::string("no record") : std::string(theirs.begin() + 1, theirs.end()))
                      << ")");
        theirs.erase(theirs.begin());
    }
    return all;
}

/// The records as int64 fields: `mine` as bytes, for exchange_member_records.
inline std::vector<uint8_t> fields_record(const std::vector<int64_t>& mine) {
    std::vector<uint8_t> record(mine.size() * sizeof(int64_t));
    std::memcpy(record.data(), mine.data(), record.size());
    return record;
}

/// Compares every member's fields (`all`, from exchange_member_records of fields_record(mine)) with the first
/// member's; the first that differs fails, with the same text on every member: "<op>: the members' <names[f]> differ:
/// world rank a has x, world rank b has y" (a the team's first member, b the first that differs), each value written
/// by `format(f, value)` when given.
inline void check_member_fields(const Team& team, const std::vector<std::vector<uint8_t>>& all,
                                const std::vector<int64_t>& mine, const char* const* names, const char* op,
                                const std::function<std::string(size_t, int64_t)>& format = {}) {
    const auto text = [&](size_t f, int64_t v) { return format ? format(f, v) : std::to_string(v); };
    const auto fields_of = [&](int r) {
        const std::vector<uint8_t>& b = all[static_cast<size_t>(r)];
        WEFT_CHECK(b.size() == mine.size() * sizeof(int64_t),
                   op << ": world rank " << team.world_rank(r) << " sent a malformed record");
        std::vector<int64_t> fields(mine.size());
        std::memcpy(fields.data(), b.data(), b.size());
        return fields;
    };
    const std::vector<int64_t> first = fields_of(0);
    for (int r = 1; r < team.num_ranks(); ++r) {
        const std::vector<int64_t> theirs = fields_of(r);
        for (size_t f = 0; f < mine.size(); ++f) {
            WEFT_CHECK(theirs[f] == first[f], op << ": the members' " << names[f] << " differ: world rank "
                                                 << team.world_rank(0) << " has " << text(f, first[f])
                                                 << ", world rank " << team.world_rank(r) << " has "
                                                 << text(f, theirs[f]));
        }
    }
}

}  // namespace weft::ops::detail
