# SPDX-License-Identifier: MIT
"""What the GPU tests share (a module of its own: two conftest.py files make `import conftest` ambiguous)."""
import torch


def rank_generator(seed):
    """A CUDA generator seeded the same on every rank (for data every rank must share)."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return g


def rel_error(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()
