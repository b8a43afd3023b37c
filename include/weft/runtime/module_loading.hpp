// SPDX-License-Identifier: MIT
// Eager CUDA module loading: lazy loading can deadlock a spinning kernel (GPU.md), so weft selects eager.
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

}  // namespace weft
