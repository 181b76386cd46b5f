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
    from dsaindex.pipelines.capture.models import load_model

    return {ref: load_model(ref) for ref in PRESETS}


@pytest.fixture(scope="session")
def routing_store(tmp_path_factory):
    """A capture store of preset:tiny-v32 (the default corpus, 5 sequences of 1,536 tokens in chunks of 768),
    captured once for the modules that train and evaluate on it (IVF routing, cross-layer reuse): training
    and evaluation only read a store."""
    from helpers import run_cli

    store = tmp_path_factory.mktemp("routing") / "store"
    proc = run_cli("capture", str(store), "-m", "preset:tiny-v32", "-n", "5", "--seq-len", "1536",
                   "--chunk-len", "768", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    before = _digest(store)
    yield store
    assert _digest(store) == before, f"a test changed the shared store {store}"


def _digest(path) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file() and not p.name.startswith(".writer"):  # the writer's lock file
            h.update(str(p.relative_to(path)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()
