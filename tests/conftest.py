"""Test setup: real kernels on a GPU; without one, Triton's CPU interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is imported, so it is decided here from the
environment before anything imports leanfa. Every kernel test takes the ``device`` fixture.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["LEANFA_POISON_OUTPUTS"] = "1"  # every output starts as NaN: unwritten elements fail


@pytest.fixture
def device():
    return "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
