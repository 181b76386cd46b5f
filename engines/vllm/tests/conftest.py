"""vLLM picks its platform at import: the CPU platform here (the wheel is a CUDA build, so say so). The
fixtures every test module shares: a PQ bundle of the production indexer geometry, and the plugin loaded by
vLLM's own loader."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

PRESET = "bench-v32"  # the production indexer: 64 heads x 128, top-2048


@pytest.fixture(scope="session")
def codebooks():
    from helpers import kmeans_codebooks, synthetic_keys

    return kmeans_codebooks(synthetic_keys(8192, seed=11))


@pytest.fixture(scope="session")
def bundle(tmp_path_factory, codebooks):
    from helpers import write_pq_bundle

    path = tmp_path_factory.mktemp("b") / "bench-v32-pq"
    write_pq_bundle(path, PRESET, codebooks=codebooks)
    return path


@pytest.fixture
def plugin(monkeypatch, bundle):
    """The plugin loaded by vLLM's own loader in this process; the registry restored afterwards. Its selector
    scores by the PQ codes at every step size: the runtime's exact scan of small steps (``exact_below``,
    ``DSAINDEX_EXACT_BELOW``, 1,088K keys past an offset by default) would otherwise serve every CPU-sized step here, and these
    tests are about the codes' path."""
    import inspect

    import vllm.envs as envs
    import vllm.plugins
    from dsaindex_vllm import op
    from vllm.model_executor.custom_op import op_registry_oot

    from dsaindex.runtime.paged_select import PagedCacheSelector

    if "exact_below" in inspect.signature(PagedCacheSelector).parameters:
        class CodesOnly(PagedCacheSelector):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **{**kwargs, "exact_below": 0})

        monkeypatch.setattr(op, "PagedCacheSelector", CodesOnly)

    monkeypatch.setenv("VLLM_PLUGINS", "dsaindex")
    monkeypatch.setenv("DSAINDEX_ARTIFACTS", str(bundle))
    monkeypatch.setenv("DSAINDEX_CANDIDATES", "4096")
    saved = dict(op_registry_oot)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    if hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    vllm.plugins.load_general_plugins()
    yield
    op_registry_oot.clear()
    op_registry_oot.update(saved)
