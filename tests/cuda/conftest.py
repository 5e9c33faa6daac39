"""The CUDA tier: tests marked `cuda` run on CUDA tensors where a GPU is present and are skipped cleanly elsewhere.
`tests/cuda/run_tier.sh OUT_DIR` runs the whole tier on a GPU machine and writes its summary there."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="CUDA tier: no CUDA device on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(no_gpu)
