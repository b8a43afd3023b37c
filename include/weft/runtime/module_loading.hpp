// SPDX-License-Identifier: MIT
// The CUDA environment spinning kernels need: eager module loading and enough hardware work queues.
#pragma once

namespace weft {

/// Sets CUDA_MODULE_LOADING=EAGER when the variable is unset, and says so in the log (info level). The
/// driver reads the variable once, when CUDA initialises, so this must run before the process's first
/// CUDA call: World::from_env and run_local call it first; call it yourself (e.g. first thing in main)
/// when your program makes CUDA calls before creating a World. A value the user set is left alone (a
/// warning is logged when it is not EAGER). Idempotent and thread-safe; returns true when weft set it.
bool ensure_eager_module_loading();

/// After CUDA is initialised: asks the driver which loading mode it uses and logs a warning (once) when
/// it is lazy although weft asked for eager, i.e. CUDA was initialised before ensure_eager_module_loading.
/// Never throws.
void warn_if_lazy_module_loading();

/// The number of hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS) weft asks for.
inline constexpr int kDeviceConnections = 32;

/// Sets CUDA_DEVICE_MAX_CONNECTIONS=32 (the most CUDA allows) when the variable is unset. CUDA maps the
/// streams of one process onto that many hardware work queues (8 by default) and runs each queue in order:
/// when ranks of one process share a GPU (run_local), a rank's kernel that spins on a flag can sit ahead
/// of the peer work that would set the flag in the same queue, and wait forever (the spin's timeout then
/// traps). More queues, and few streams per rank (weft's ops use one side stream when ranks share a GPU),
/// keep every rank's streams apart. Like the loading mode, the driver reads it when CUDA initialises: call
/// before the first CUDA call. A value the user set is left alone (a warning is logged when it is lower
/// than 32). Idempotent and thread-safe; returns true when weft set it.
bool ensure_device_connections();

/// ensure_eager_module_loading() and ensure_device_connections(): what World::from_env and run_local call
/// first, and what a program that makes CUDA calls before creating a World should call first in main.
void prepare_cuda_environment();

}  // namespace weft
