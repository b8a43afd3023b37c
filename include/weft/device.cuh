// SPDX-License-Identifier: MIT
// The device umbrella: everything a weft kernel uses to talk to other ranks (ptx, shmem, tile layers).
#pragma once

// The device layer is Hopper's (sm_90a: TMA, mbarrier transactions, wgmma, clusters).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error \
    "weft's device layer needs sm_90a (Hopper): compile for it (nvcc -arch=sm_90a; CMake: CUDA_ARCHITECTURES 90a, or weft_cuda_target(<target>))"
#endif

#include "weft/common/collectives.hpp"
#include "weft/common/device_ctx.hpp"
#include "weft/common/diagnostics.hpp"
#include "weft/common/group_copy.hpp"
#include "weft/common/tile_map.hpp"
#include "weft/ptx/atom.cuh"
#include "weft/ptx/cvt.cuh"
#include "weft/ptx/fence.cuh"
#include "weft/ptx/ld_st.cuh"
#include "weft/ptx/memory_order.cuh"
#include "weft/ptx/timer.cuh"
#include "weft/device/block_barrier.cuh"
#include "weft/device/copy.cuh"
#include "weft/device/scope.cuh"
#include "weft/device/ll.cuh"
#include "weft/device/record.cuh"
#include "weft/device/shmem.cuh"
#include "weft/device/signal.cuh"
#include "weft/device/spin.cuh"
#include "weft/device/symmetric.cuh"
#include "weft/device/tile.cuh"
#include "weft/device/token.cuh"
