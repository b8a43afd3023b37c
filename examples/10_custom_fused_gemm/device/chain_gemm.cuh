// SPDX-License-Identifier: MIT
// The chain GEMM's device side: a tile scheduler that waits for the rows of X it loads, and an epilogue hook that
// tells the next rank a tile of its X has arrived. weft instantiates weft::kernels::gemm::gemm_kernel with both.
#pragma once

#include "chain_params.hpp"
#include "weft/common/gemm_config.hpp"
#include "weft/device.cuh"

namespace example {

namespace tile = weft::device::tile;

/// Each CTA takes tiles blockIdx.x, blockIdx.x + gridDim.x, ... in row-major order (a whole row of tiles before the
/// next: the order the previous rank finishes them in), and waits for a tile's rows of X before loading them.
template <weft::GemmConfig kCfg>
class WaitForRows {
public:
    using Params = ChainWait;

    __device__ WaitForRows(const Params& p, const weft::GemmArgs& args)
        : p_(p), n_tiles_((args.n + kCfg.tile_n - 1) / kCfg.tile_n),
          tiles_(n_tiles_ * ((args.m + kCfg.tile_m - 1) / kCfg.tile_m)) {}

    __device__ int32_t num_tiles() const {
        const int32_t cta = static_cast<int32_t>(blockIdx.x), ctas = static_cast<int32_t>(gridDim.x);
        return cta < tiles_ ? (tiles_ - 1 - cta) / ctas + 1 : 0;
    }

    __device__ weft::GemmTile tile(int32_t i) const {
        const int32_t t = static_cast<int32_t>(blockIdx.x) + i * static_cast<int32_t>(gridDim.x);
        const int32_t m_idx = t / n_tiles_, n_idx = t % n_tiles_;
        return weft::GemmTile{m_idx, n_idx, m_idx * kCfg.tile_m, n_idx * kCfg.tile_n, true};
    }

    /// The producer thread, before it loads the tile's rows of X: wait (bounded, acquire at system scope) until the
    /// previous rank has stored every tile of those rows. Rank 0 waits on no signal: still a wait, whose fence lets
    /// the TMA loads that take the Token see what it guards. The checked form is inline (a call anywhere in the
    /// kernel would serialise its wgmma). On a timeout its Diagnostic is recorded and the kernel traps here: returning
    /// the WaitResult instead would let the kernel run on and the hook below tell the next rank that tiles of undefined
    /// data are ready, before that rank could learn of the failure.
    __device__ weft::device::Token wait_before_load(const weft::GemmTile& t) const {
        return tile::wait_checked(weft::device::Thread{}, p_.ctx, p_.rows_ready + t.m_idx, p_.wait != 0 ? 1 : 0,
                                  weft::Cmp::kGe, p_.expected)
            .token_or_trap();
    }

private:
    const Params& p_;  // in the kernel's parameter bank: the producer has 40 registers
    int32_t n_tiles_, tiles_;
};

/// Once a tile is in the next rank's X (the kernel's TMA stores went there and have completed): publish it.
struct NotifyNextRank {
    using Params = ChainNotify;
    static constexpr bool kNotifies = true;

    __device__ static bool after_tile_stored(const Params& p, const weft::GemmTile& t) {
        if (p.next_rank < 0) return true;
        weft::ptx::fence_proxy_async_global();  // the async-proxy stores before the generic-proxy release
        // Checked: runs inside the consumer warpgroups, which must not trap; false (Diagnostic recorded) when the
        // next rank is unreachable, and the kernel traps after its tile loop.
        return tile::notify_checked(weft::device::Thread{}, p.ctx, p.rows_ready + t.m_idx, p.next_rank, 1);
    }
};

}  // namespace example
