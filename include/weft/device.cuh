// SPDX-License-Identifier: MIT
// The device umbrella: everything a weft kernel uses to talk to other ranks (ptx, shmem, tile layers).
#pragma once

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
#include "weft/device/copy.cuh"
#include "weft/device/scope.cuh"
#include "weft/device/shmem.cuh"
#include "weft/device/signal.cuh"
#include "weft/device/spin.cuh"
#include "weft/device/symmetric.cuh"
#include "weft/device/tile.cuh"
#include "weft/device/token.cuh"
