import os

import pytest
import torch

from helpers import PRESETS

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def loaded_models():
    """One loaded instance per preset for the whole session (loading takes ~0.1 s, but keeps tests short)."""
    from dsaindex.pipelines.models import load_model

    return {ref: load_model(ref) for ref in PRESETS}
