"""Shared test helpers (importable: tests/ is on pytest's pythonpath)."""

import os
import subprocess
import sys

PRESETS = ("preset:tiny-v32", "preset:tiny-glm5", "preset:tiny-v4")


def run_cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m dsaindex ARGS`` in a subprocess, as a user would (``env``: variables to set there)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
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


def model_index_keys(net, tokens):
    """Every indexer layer's keys [N, D] of ``net`` (a V3.2-class transformers model) for ``tokens`` [N],
    as the indexer scores them, in the Hadamard basis: layer id -> float32 tensor."""
    import torch

    from dsaindex.hooks import ModuleHooks
    from dsaindex.indexer import mla_indexer_tensors
    from dsaindex.quant import to_basis

    keys = {}
    with ModuleHooks() as hooks, torch.no_grad():
        for i, layer in enumerate(net.model.layers):
            def grab(mod, a, i=i):
                cos, sin = a["position_embeddings"]
                k, _, _ = mla_indexer_tensors(mod, "half_split_head", a["hidden_states"], a["q_resid"], cos, sin)
                keys[i] = to_basis(k[0].float(), "hadamard")
            hooks.register(layer.self_attn.indexer, pre=grab)
        net(input_ids=tokens.unsqueeze(0), use_cache=False)
    return keys
