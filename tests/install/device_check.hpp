// SPDX-License-Identifier: MIT
// The installing project's own nvcc-compiled kernel on weft's device layer (device_check.cu).
#pragma once

#include "weft/common/device_ctx.hpp"

/// Runs a 64-thread kernel that calls weft::device::symm_at on this rank's heap; returns the threads that found
/// their own heap (64 when right), or -1 when a CUDA call failed.
int device_layer_check(const weft::DeviceCtx& ctx);
