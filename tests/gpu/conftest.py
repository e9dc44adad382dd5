"""Tests marked `gpu` need a CUDA device: skipped elsewhere, so CI's plain `pytest` passes."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Engines of earlier tests must not hold their KV caches against later ones."""
    yield
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()
