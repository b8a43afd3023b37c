// SPDX-License-Identifier: MIT
// A step-by-step model of GEMM+ReduceScatter's cross-rank protocol (push and pull modes, kernels/gemm_rs/README.md)
// run under random schedules: every rank's GEMM CTAs (and, in pull mode, reduction CTAs) are state machines that
// follow the kernels' order of waits, stores and notifies over the real tile order (RsGemmOrder); calls go back
// to back with M changing between them. Checks that no schedule deadlocks, and that every partial a reader reads
// is the one of its own call (never overwritten early, never stale).
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "weft/common/gemm_config.hpp"
#include "weft/common/tp_schedule.hpp"

namespace weft {
namespace {

enum class Mode { kPush, kPull };

struct RsSetup {
    Mode mode;
    int ranks;
    int64_t chunk_rows;
    int gemm_ctas;  // grid of the GEMM (capped at its tiles)
    int reduce_ctas;
    std::vector<int64_t> rows_per_call;  // rows per rank of each call, the same on every rank
};

/// The shared state of all ranks (what lives in device memory) and each rank's progress.
class Model {
public:
    Model(const RsSetup& s, const GemmConfig& cfg) : s_(s), cfg_(cfg) {
        int max_cpr = 1;
        for (int64_t rows : s.rows_per_call) max_cpr = std::max(max_cpr, order(rows, 0).map.chunks_per_rank());
        const auto w = static_cast<size_t>(s.ranks);
        counters_.assign(w, std::vector<uint64_t>(w * static_cast<size_t>(max_cpr), 0));
        released_.assign(w, std::vector<uint64_t>(w, 0));
        gemm_calls_.assign(w, 0);
        tile_counter_.assign(w, 0);
        exit_count_.assign(w, 0);
        call_.assign(w, -1);
        ranks_.resize(w);
    }

    /// As run(), with every first-load wait already satisfied (released starts high): a broken protocol.
    std::string run_without_release_waits(uint64_t seed) {
        for (auto& on : released_) {
            for (uint64_t& v : on) v = uint64_t{1} << 40;
        }
        return run(seed);
    }

    /// Runs one schedule; returns "" or what went wrong.
    std::string run(uint64_t seed) {
        std::mt19937_64 rng(seed);
        for (int r = 0; r < s_.ranks; ++r) launch_next(r);
        while (true) {
            std::vector<std::pair<int, size_t>> runnable;  // (rank, cta index in that rank's live CTAs)
            bool all_done = true;
            for (int r = 0; r < s_.ranks; ++r) {
                for (size_t i = 0; i < ranks_[static_cast<size_t>(r)].ctas.size(); ++i) {
                    Cta& c = ranks_[static_cast<size_t>(r)].ctas[i];
                    if (c.done) continue;
                    all_done = false;
                    if (can_step(r, c)) runnable.emplace_back(r, i);
                }
            }
            if (!error_.empty()) return error_;
            if (all_done) return "";
            if (runnable.empty()) return "deadlock: " + describe_blocked();
            const auto [r, i] = runnable[rng() % runnable.size()];
            step(r, ranks_[static_cast<size_t>(r)].ctas[i]);
            if (!error_.empty()) return error_;
            RankState& rs = ranks_[static_cast<size_t>(r)];
            bool call_done = true;
            for (const Cta& c : rs.ctas) call_done = call_done && c.done;
            if (call_done) launch_next(r);
        }
    }

private:
    enum class Kind { kGemm, kReduce };
    struct Cta {
        Kind kind = Kind::kGemm;
        std::vector<GemmTile> tiles;  // GEMM: this CTA's tiles in order
        size_t next = 0;              // GEMM: next tile; reduce: next (phase, chunk) pair
        int stage = 0;                // GEMM: 0 first-load wait, 1 notify previous, 2 own-tile add, 3 store
        bool waited = false;
        bool has_pending = false;
        GemmTile pending{};
        bool done = false;
    };
    struct RankState {
        std::vector<Cta> ctas;
    };

    RsGemmOrder order(int64_t rows, int rank) const {
        return RsGemmOrder(cfg_, rows, s_.ranks, s_.chunk_rows, static_cast<int32_t>(kCols), rank);
    }
    int64_t rows(int r) const { return s_.rows_per_call[static_cast<size_t>(call_[static_cast<size_t>(r)])]; }
    /// Counter [source][chunk] on rank `on`, in the layout (chunks per rank) of the caller's call.
    uint64_t& counter(int on, int source, int chunk, int chunks_per_rank) {
        return counters_[static_cast<size_t>(on)][static_cast<size_t>(rs_counter_index(source, chunk, chunks_per_rank))];
    }

    void launch_next(int r) {
        auto& call = call_[static_cast<size_t>(r)];
        RankState& rs = ranks_[static_cast<size_t>(r)];
        rs.ctas.clear();
        if (call + 1 >= static_cast<int>(s_.rows_per_call.size())) return;
        ++call;
        const RsGemmOrder o = order(rows(r), r);
        const int grid = std::min(s_.gemm_ctas, o.num_tiles());
        for (int b = 0; b < grid; ++b) {
            Cta c;
            for (int t = b; t < o.num_tiles(); t += grid) c.tiles.push_back(o.tile(t));
            rs.ctas.push_back(c);
        }
        if (s_.mode == Mode::kPull) {
            for (int b = 0; b < s_.reduce_ctas; ++b) {
                Cta c;
                c.kind = Kind::kReduce;
                rs.ctas.push_back(c);
            }
        }
    }

    bool can_step(int r, const Cta& c) {
        const RsGemmOrder o = order(rows(r), r);
        if (c.kind == Kind::kReduce) {
            const int cprr = o.map.chunks_per_rank();
            if (c.next >= static_cast<size_t>(s_.ranks * cprr)) return true;  // the exit step
            const int phase = static_cast<int>(c.next) / cprr, chunk = static_cast<int>(c.next) % cprr;
            const int source = rs_source_at(r, phase, s_.ranks);
            const auto need = static_cast<uint64_t>(o.map.expected_count(o.map.local_signal_at(r, chunk)));
            return counter(r, source, chunk, cprr) >= need;
        }
        if (c.next >= c.tiles.size()) return true;  // the final notify
        if (c.stage == 0 && !c.waited) {
            const uint64_t calls = gemm_calls_[static_cast<size_t>(r)];
            for (int s = 0; s < s_.ranks; ++s) {
                if (released_[static_cast<size_t>(r)][static_cast<size_t>(s)] < calls) return false;
            }
            return true;
        }
        if (c.stage == 2 && s_.mode == Mode::kPush) {
            const GemmTile& t = c.tiles[c.next];
            if (o.dest_of(t) != r) return true;
            const auto need =
                static_cast<uint64_t>(o.map.expected_count(o.map.local_signal_at(r, o.chunk_of(t))));
            for (int s = 0; s < s_.ranks; ++s) {
                if (s != r && counter(r, s, o.chunk_of(t), o.map.chunks_per_rank()) < need) return false;
            }
        }
        return true;
    }

    /// Tile versions: who wrote which partial tile for which call. Key: (storage rank, slot/source, m_idx, n_idx).
    using Key = std::tuple<int, int, int, int>;

    void expect_version(const Key& k, int call, const std::string& what) {
        auto it = versions_.find(k);
        const int seen = it == versions_.end() ? -1 : it->second;
        if (seen != call && error_.empty()) {
            std::ostringstream os;
            os << what << ": read the partial of call " << seen << ", expected call " << call;
            error_ = os.str();
        }
    }

    void notify(int r, const GemmTile& t) {
        const RsGemmOrder o = order(rows(r), r);
        const int dest = o.dest_of(t);
        if (s_.mode == Mode::kPull || dest != r) ++counter(dest, r, o.chunk_of(t), o.map.chunks_per_rank());
        auto& tc = tile_counter_[static_cast<size_t>(r)];
        if (++tc != static_cast<uint64_t>(o.num_tiles())) return;
        tc = 0;
        if (s_.mode == Mode::kPush) release(r, o);
        ++gemm_calls_[static_cast<size_t>(r)];
    }

    void release(int r, const RsGemmOrder& o) {  // zero this call's counters, then released[r] += 1 everywhere
        for (int i = 0; i < o.map.num_signals(); ++i) counters_[static_cast<size_t>(r)][static_cast<size_t>(i)] = 0;
        for (int pe = 0; pe < s_.ranks; ++pe) ++released_[static_cast<size_t>(pe)][static_cast<size_t>(r)];
    }

    void step(int r, Cta& c) {
        const RsGemmOrder o = order(rows(r), r);
        const int call = call_[static_cast<size_t>(r)];
        if (c.kind == Kind::kReduce) {
            const int cprr = o.map.chunks_per_rank();
            if (c.next >= static_cast<size_t>(s_.ranks * cprr)) {
                if (++exit_count_[static_cast<size_t>(r)] == static_cast<uint64_t>(s_.reduce_ctas)) {
                    exit_count_[static_cast<size_t>(r)] = 0;
                    release(r, o);
                }
                c.done = true;
                return;
            }
            const int phase = static_cast<int>(c.next) / cprr, chunk = static_cast<int>(c.next) % cprr;
            const int source = rs_source_at(r, phase, s_.ranks);
            for (int m = 0; m < o.map.m_tiles_per_rank(); ++m) {
                if (o.map.signal_index(r, m) - r * cprr != chunk) continue;
                for (int n = 0; n < o.map.n_tiles(); ++n) {
                    expect_version({source, r, r * o.map.m_tiles_per_rank() + m, n}, call,
                                   "pull: rank " + std::to_string(r) + " reading source " + std::to_string(source));
                }
            }
            ++c.next;
            return;
        }
        if (c.next >= c.tiles.size()) {
            if (c.has_pending) notify(r, c.pending);
            c.done = true;
            return;
        }
        const GemmTile& t = c.tiles[c.next];
        const int dest = o.dest_of(t);
        switch (c.stage) {
            case 0:  // the first load of the CTA waits (can_step checked released); later tiles pass
                c.waited = true;
                c.stage = 1;
                return;
            case 1:  // mainloop done: the previous tile's stores are complete, notify it
                if (c.has_pending) notify(r, c.pending);
                c.has_pending = false;
                c.stage = 2;
                return;
            case 2:  // push: own tiles read every peer's partial (can_step checked the counters)
                if (s_.mode == Mode::kPush && dest == r) {
                    for (int s = 0; s < s_.ranks; ++s) {
                        if (s == r) continue;
                        expect_version({r, s, t.m_idx, t.n_idx}, call,
                                       "push: rank " + std::to_string(r) + " reading source " + std::to_string(s));
                    }
                }
                c.stage = 3;
                return;
            default:  // store: push writes a peer's tile into its slot; pull writes the local partial
                if (s_.mode == Mode::kPush) {
                    if (dest != r) versions_[{dest, r, t.m_idx, t.n_idx}] = call;
                } else {
                    versions_[{r, dest, t.m_idx, t.n_idx}] = call;
                }
                c.pending = t;
                c.has_pending = true;
                c.stage = 0;
                ++c.next;
                return;
        }
    }

    std::string describe_blocked() {
        std::ostringstream os;
        for (int r = 0; r < s_.ranks; ++r) {
            os << "rank " << r << " call " << call_[static_cast<size_t>(r)] << " (gemm_calls "
               << gemm_calls_[static_cast<size_t>(r)] << ", released";
            for (uint64_t v : released_[static_cast<size_t>(r)]) os << " " << v;
            os << "); ";
        }
        return os.str();
    }

    static constexpr int64_t kCols = 300;
    RsSetup s_;
    GemmConfig cfg_;
    std::vector<std::vector<uint64_t>> counters_;  // [on rank][source * cpr + chunk]
    std::vector<std::vector<uint64_t>> released_;  // [on rank][of rank]
    std::vector<uint64_t> gemm_calls_, tile_counter_, exit_count_;
    std::vector<int> call_;
    std::vector<RankState> ranks_;
    std::map<Key, int> versions_;
    std::string error_;
};

GemmConfig config_128() {
    GemmConfig c = gemm_candidate(6, DType::kBF16, DType::kBF16, BLayout::kNK);  // 128x128
    c.cluster_m = c.cluster_n = 1;
    return c;
}

void run_schedules(const RsSetup& s, int schedules) {
    for (int i = 0; i < schedules; ++i) {
        Model m(s, config_128());
        const std::string bad = m.run(0x5eed0000ull + static_cast<uint64_t>(i));
        ASSERT_TRUE(bad.empty()) << (s.mode == Mode::kPush ? "push" : "pull") << " W=" << s.ranks << " chunk_rows "
                                 << s.chunk_rows << " gemm CTAs " << s.gemm_ctas << " reduce CTAs " << s.reduce_ctas
                                 << " schedule " << i << ": " << bad;
    }
}

// Back to back, M changing between calls: no schedule deadlocks or reads a partial of another call.
TEST(TpRsProtocol, PushModeNeverDeadlocksNorReadsAnotherCallsPartial) {
    for (int w : {2, 3, 4, 8}) {
        for (int64_t chunk : {128, 256}) {
            for (int grid : {1, 2, 7, 1000}) {
                run_schedules({Mode::kPush, w, chunk, grid, 0, {300, 200, 300, 129, 300, 300}}, 30);
            }
        }
    }
}

TEST(TpRsProtocol, PullModeNeverDeadlocksNorReadsAnotherCallsPartial) {
    for (int w : {2, 3, 4, 8}) {
        for (int64_t chunk : {128, 256}) {
            for (int grid : {1, 3, 1000}) {
                for (int reduce : {1, 3}) {
                    run_schedules({Mode::kPull, w, chunk, grid, reduce, {300, 200, 300, 129, 300, 300}}, 20);
                }
            }
        }
    }
}

// The model can fail: without the first-load wait a fast rank overwrites a partial before its reader read it.
TEST(TpRsProtocol, TheModelCatchesAMissingReleaseWait) {
    // One CTA per tile and calls of one tile row: over 200 schedules some fast rank overwrites a slot early.
    const RsSetup s{Mode::kPush, 2, 128, 1000, 0, {128, 128, 128, 128}};
    int caught = 0;
    for (int i = 0; i < 200; ++i) {
        Model m(s, config_128());
        const std::string bad = m.run_without_release_waits(0xbad0000ull + static_cast<uint64_t>(i));
        if (!bad.empty()) ++caught;
    }
    EXPECT_GT(caught, 0) << "no schedule showed the race: the model cannot fail";
}

}  // namespace
}  // namespace weft
