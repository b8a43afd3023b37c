# SPDX-License-Identifier: MIT
# CPU tests of the Python package (no GPU, torch optional): python/tests/gpu holds the GPU tests, run under torchrun.
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
collect_ignore = [] if os.environ.get("WORLD_SIZE") else ["gpu"]
