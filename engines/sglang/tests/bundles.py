"""Test bundles for preset geometries, written with dsaindex.artifacts.bundle.write_bundle the way
/work/main/tests/test_runtime_loader.py's ``pq_bundle`` writes them. The model fingerprint is built from
the preset's config (config digest as the runtime check computes it) instead of instantiating the model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from dsaindex.artifacts.bundle import LayerArtifact, Lineage, new_bundle_manifest, write_bundle
from dsaindex.artifacts.fingerprint import ModelFingerprint, config_digest
from dsaindex.geometry import geometry_from_config
from dsaindex.pipelines.capture.presets import preset_config


def fingerprint(config, name: str) -> ModelFingerprint:
    geometry = geometry_from_config(config)
    return ModelFingerprint(name=name, family=geometry.family, geometry=geometry, config_digest=config_digest(config),
                            weights_digest="0" * 16, dtype="bfloat16")


def key_sample(n: int = 8192, dim: int = 128, seed: int = 0) -> torch.Tensor:
    """Keys of one synthetic "model" (a few dominant directions shared by every request, as real index
    keys have, plus per-token noise), float32 [n, dim]; ``seed`` draws the tokens, not the model."""
    basis = torch.randn(16, dim, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g) @ basis * 0.5 + torch.randn(n, dim, generator=g) * 0.3


def fit_codebooks(keys: torch.Tensor, subspaces: int = 32, k: int = 256, iters: int = 6, seed: int = 0) -> np.ndarray:
    """Small k-means per subspace (torch Lloyd): [M, K, D/M] float32."""
    g = torch.Generator().manual_seed(seed)
    n, d = keys.shape
    sub = d // subspaces
    x = keys.view(n, subspaces, sub).transpose(0, 1)  # [M, n, sub]
    cb = x[:, torch.randperm(n, generator=g)[:k]].clone()
    for _ in range(iters):
        assign = torch.cdist(x, cb).argmin(-1)  # [M, n]
        for m in range(subspaces):
            sums = torch.zeros(k, sub).index_add_(0, assign[m], x[m])
            counts = torch.bincount(assign[m], minlength=k).clamp_min(1).unsqueeze(1)
            cb[m] = torch.where(counts > 1, sums / counts, cb[m])
    return cb.numpy().astype(np.float32)


def pq_bundle(path, preset: str = "bench-v32", layers=None, basis: str = "hadamard", subspaces: int = 32,
              seed: int = 0, config=None, trained: bool = False, metrics=None):
    """A PQ bundle for a preset's geometry (or ``config``): codebooks fitted on :func:`key_sample` keys
    (``trained``) or random, as the runtime loader's tests build them; ``metrics``: the held-out recall
    its manifest records (as ``train pq`` writes it)."""
    config = config if config is not None else preset_config(preset)
    geometry = geometry_from_config(config)
    layer_ids = geometry.indexer_layers if layers is None else layers
    rng = np.random.default_rng(seed)
    sub = geometry.head_dim // subspaces
    if trained:
        codebooks = fit_codebooks(key_sample(dim=geometry.head_dim, seed=seed), subspaces)
    arrays = {i: {"codebooks": codebooks if trained else rng.standard_normal((subspaces, 256, sub)).astype(np.float32),
                  "metric": np.tile(np.eye(sub, dtype=np.float32), (subspaces, 1, 1))} for i in layer_ids}
    manifest = new_bundle_manifest(
        fingerprint(config, f"preset:{preset}"), basis, geometry.key_format,
        {str(i): LayerArtifact(kind="pq", params={"subspaces": subspaces, "score_aware": True}) for i in layer_ids},
        Lineage(capture_store_id="s", capture_store_path="/nowhere", capture_store_digest="d" * 16,
                train_sequences=[0], eval_sequences=[1]),
        metrics=metrics,
    )
    write_bundle(path, manifest, arrays)
    return arrays


def model_dir(path, preset: str, **overrides) -> Path:
    """A model folder holding the preset's config.json (what SGLang's ModelConfig reads)."""
    path = Path(path)
    config = preset_config(preset)
    for k, v in overrides.items():
        setattr(config, k, v)
    config.save_pretrained(path)
    data = json.loads((path / "config.json").read_text())
    data["architectures"] = ["DeepseekV32ForCausalLM"]  # SGLang's ModelConfig reads architectures[0]
    (path / "config.json").write_text(json.dumps(data, indent=1))
    return path
