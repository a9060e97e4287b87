"""Shared test setup: small thread counts so the suite behaves on a 2-core CI machine."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None and not has_cuda:
            item.add_marker(skip)
