// SPDX-License-Identifier: MIT
// weft's host umbrella header: the runtime API (World, run_local, SymmetricHeap, Team, stream helpers ...) and the
// tile maps host and kernels share.
#pragma once

#include "weft/common/device_ctx.hpp"
#include "weft/common/diagnostics.hpp"
#include "weft/common/dtype.hpp"
#include "weft/common/tile_map.hpp"
#include "weft/runtime/diagnostics.hpp"
#include "weft/runtime/driver.hpp"
#include "weft/runtime/env.hpp"
#include "weft/runtime/error.hpp"
#include "weft/runtime/in_process_store.hpp"
#include "weft/runtime/log.hpp"
#include "weft/runtime/module_loading.hpp"
#include "weft/runtime/store.hpp"
#include "weft/runtime/stream.hpp"
#include "weft/runtime/symmetric_heap.hpp"
#include "weft/runtime/team.hpp"
#include "weft/runtime/tensor_view.hpp"
#include "weft/runtime/world.hpp"
