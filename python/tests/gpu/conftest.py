# SPDX-License-Identifier: MIT
# GPU tests of the Python package. Every process of a torchrun job runs pytest; the tests are collective and run in
# the same order on every rank. One GPU per rank (NCCL refuses two ranks on one GPU):
#     python3 -m torch.distributed.run --standalone --nproc_per_node=2 -m pytest -p no:cacheprovider python/tests/gpu
import os

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import weft  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _session():
    """torch.distributed with the NCCL backend first, then weft.init() in the same process, on torch's store."""
    if "WORLD_SIZE" not in os.environ or not torch.cuda.is_available():
        pytest.skip("GPU tests: run under torchrun on a machine with one GPU per rank")
    local_rank = int(os.environ["LOCAL_RANK"])
    # WEFT_TEST_TORCH_BACKEND=gloo lets ranks share a GPU (NCCL refuses that); the torch references then run on
    # gloo, which lacks some collectives on CUDA tensors (those tests fail in torch, not in weft).
    backend = os.environ.get("WEFT_TEST_TORCH_BACKEND", "nccl")
    if backend == "nccl" and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        pytest.skip("GPU tests: one GPU per rank needed (NCCL refuses ranks sharing a GPU); "
                    "WEFT_TEST_TORCH_BACKEND=gloo shares one")
    device = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    if backend == "nccl":
        dist.init_process_group("nccl", device_id=torch.device("cuda", device))
    else:
        dist.init_process_group(backend)
    weft.init()
    yield
    weft.finalize()
    dist.destroy_process_group()


@pytest.fixture
def world():
    """The current World (a test may finalize and init again: later tests get the new one)."""
    return weft.init()


@pytest.fixture
def rank(world):
    return world.rank


@pytest.fixture
def num_ranks(world):
    return world.num_ranks
