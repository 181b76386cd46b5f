"""Shared test helpers (importable: tests/ is on pytest's pythonpath)."""

import os
import subprocess
import sys

PRESETS = ("preset:tiny-v32", "preset:tiny-glm5", "preset:tiny-v4")


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m dsaindex ARGS`` in a subprocess, as a user would."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "dsaindex", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
