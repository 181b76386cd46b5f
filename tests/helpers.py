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


def text_corpus(root, files: int = 2, words: int = 600, seed: int = 1):
    """A folder ``root/corpus`` of ``files`` text files of ``words`` words each from a small vocabulary."""
    import numpy as np

    d = root / "corpus"
    d.mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "indexer", "key", "query", "sparse", "attention", "\n"]
    for i in range(files):
        (d / f"doc{i}.txt").write_text(" ".join(rng.choice(vocab, words)))
    return d
