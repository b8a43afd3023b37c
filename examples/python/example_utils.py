# SPDX-License-Identifier: MIT
"""What the Python examples share besides weft: a timer on torch's current stream and a relative error."""
import torch


def time_ms(fn, iters=20, warmup=3):
    """Milliseconds per call of fn, from CUDA events around `iters` back-to-back calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / iters


def rel_error(out, ref):
    """|out - ref| / |ref| (Frobenius norms, in fp32)."""
    ref = ref.float()
    return ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
