"""Shared fixtures of the SGLang contract tests: test bundles, a model folder, the plugin loaded once
through SGLang's own loader."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
STUBS = HERE / "stubs"  # the torchvision stand-in (see stubs/torchvision/__init__.py)
sys.path.insert(0, str(STUBS))
sys.path.insert(0, str(HERE))
os.environ["PYTHONPATH"] = os.pathsep.join([str(STUBS), str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)

from bundles import model_dir, pq_bundle  # noqa: E402


@pytest.fixture(scope="session")
def bench_dir(tmp_path_factory):
    """A model folder (config.json only) of the bench-v32 preset: production indexer, 64 heads x 128."""
    return model_dir(tmp_path_factory.mktemp("model") / "bench-v32", "bench-v32")


@pytest.fixture(scope="session")
def bench_bundle(tmp_path_factory, bench_dir):
    path = tmp_path_factory.mktemp("bundle") / "bench"
    pq_bundle(path, "bench-v32", trained=True)
    return path


@pytest.fixture(scope="session")
def plugin(bench_bundle, bench_dir):
    """SGLang's plugin loader run in this process with the bench bundle, then SGLang's ModelConfig built
    for the bench model (the hook validates and loads the artifacts)."""
    os.environ["DSAINDEX_ARTIFACTS"] = str(bench_bundle)
    os.environ.setdefault("DSAINDEX_CANDIDATES", "4096")
    # the contract tests run the codes' path at their small sizes; the exact path has its own test
    os.environ.setdefault("DSAINDEX_EXACT_BELOW", "0")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.configs.model_config import ModelConfig

    config = ModelConfig(str(bench_dir))
    import dsaindex_sglang.hooks as hooks

    return {"state": hooks.STATE, "model_config": config}


def run_json(code: str, env: dict) -> dict:
    """Run ``code`` in a fresh interpreter (its last stdout line is JSON) with ``env`` added."""
    import subprocess

    full = dict(os.environ, **env)
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=full,
                         timeout=300)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON output (rc={out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return json.loads(lines[-1])
