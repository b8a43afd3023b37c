# SPDX-License-Identifier: MIT
"""weft from Python: compute-communication overlapping kernels driven from PyTorch.

    import torch, torch.distributed as dist, weft
    dist.init_process_group("nccl")               # optional: weft then meets on torch's store
    torch.cuda.set_device(local_rank)
    weft.init()                                   # collective
    x = weft.empty((1024, 4096), torch.bfloat16)  # on the symmetric heap (zero copy)
    weft.all_reduce(x)                            # on torch's current stream
    weft.free(x)                                  # collective
    weft.finalize()                               # collective (also at exit)

Importing weft needs neither torch nor a GPU; every function that takes tensors needs torch. The API:
docs/python.md.
"""
import os as _os

try:
    from . import _weft
except ImportError as _e:  # a CUDA library the extension links (cudart, NVRTC, nvJitLink) not found by the loader
    _missing = str(_e)
    if any(name in _missing for name in ("libcudart", "libnvrtc", "libnvJitLink", "libcrypto")):
        raise ImportError(
            f"weft's extension could not load a library it needs ({_missing}). It was built against the CUDA 13 "
            "toolkit: install one at the same path, or add its lib64 folder to LD_LIBRARY_PATH (importing a PyTorch "
            "built for CUDA 13 first also loads these libraries); libcrypto is OpenSSL 3's.") from _e
    raise
from ._weft import Error, TensorView

# The JIT reads weft's headers and kernel templates at run time; the package carries them (include/,
# share/weft/kernels/). Pointing WEFT_HOME here, unless the user set it, keeps a weft source tree found upward from
# the Python interpreter's folder from shadowing the headers this extension was built with.
_package_dir = _os.path.dirname(_os.path.abspath(__file__))
if "WEFT_HOME" not in _os.environ and _os.path.isfile(
        _os.path.join(_package_dir, "include", "weft", "device", "token.cuh")):
    _os.environ["WEFT_HOME"] = _package_dir

from ._runtime import (Team, finalize, init, is_initialized, num_ranks, rank, world)  # noqa: E402
from ._tensor import empty, free, is_symmetric  # noqa: E402
from . import ep  # noqa: E402
from ._attention import (AgAttention, attention_status, check_attention_status, decode_attention,  # noqa: E402
                         decode_attention_workspace_bytes, flash_attention, sp_decode_attention)
from ._moe import (MoeAgGroupedGemm, MoeGroupedGemmRs, MoeRouting, check_grouped_status,  # noqa: E402
                   check_moe_routing_status, grouped_gemm, grouped_gemm_gathered, grouped_gemm_gathered_combine,
                   grouped_status, moe_combine, moe_gathered_rows, moe_route, moe_routing_status)
from ._ops import (AgGemm, GemmAr, GemmRs, ag_gemm, all_gather, all_reduce, all_to_all, all_to_all_v,  # noqa: E402
                   gemm, gemm_ar, gemm_rs, reduce_scatter, ulysses_head_to_seq, ulysses_seq_to_head)

__version__ = _weft.__version__

__all__ = [
    "Error", "TensorView", "Team", "init", "finalize", "is_initialized", "world", "rank", "num_ranks", "empty",
    "free", "is_symmetric", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v",
    "ulysses_seq_to_head", "ulysses_head_to_seq", "gemm", "ag_gemm", "gemm_rs", "gemm_ar", "AgGemm", "GemmRs",
    "GemmAr", "ep", "flash_attention", "decode_attention", "decode_attention_workspace_bytes", "sp_decode_attention",
    "AgAttention", "attention_status", "check_attention_status", "grouped_gemm", "grouped_status",
    "check_grouped_status", "MoeRouting", "moe_route", "moe_gathered_rows", "moe_routing_status",
    "check_moe_routing_status", "MoeAgGroupedGemm", "MoeGroupedGemmRs", "grouped_gemm_gathered",
    "grouped_gemm_gathered_combine", "moe_combine",
]
