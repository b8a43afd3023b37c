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
    if torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        pytest.skip("GPU tests: one GPU per rank needed (NCCL refuses ranks sharing a GPU)")
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
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
