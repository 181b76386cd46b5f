"""The fingerprint of a model: which model a capture store or an artifact bundle belongs to.

Recorded in every store and bundle manifest and compared by :mod:`dsaindex.artifacts.compat`:
``config_digest`` identifies the architecture and ``weights_digest`` the indexer weights that produce the
keys (two checkpoints of one architecture have different keys, so codebooks do not transfer between
them); ``geometry`` is the typed :class:`dsaindex.geometry.IndexerGeometry`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from dsaindex.geometry import IndexerGeometry, geometry_from_config

# config fields that say how a checkpoint was saved or is run, not what the model is
_CONFIG_DIGEST_IGNORES = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "architectures",
                          "_attn_implementation")


def config_digest(config: Any) -> str | None:
    """16 hex chars identifying a model's architecture: sha256 of its transformers config as a sorted JSON
    dict, without the fields of :data:`_CONFIG_DIGEST_IGNORES` (the ``config_digest`` of a
    :class:`ModelFingerprint`).

    ``config`` is a transformers config object, or a dict (``config.json``) which is first built into its
    config class so that defaults count the same way. ``None`` where that cannot be done (a dict without
    a known ``model_type``).
    """
    if isinstance(config, dict):
        try:
            from transformers import AutoConfig

            config = AutoConfig.for_model(**config)
        except (ImportError, KeyError, TypeError, ValueError):
            return None
    d = config.to_dict()
    for k in _CONFIG_DIGEST_IGNORES:
        d.pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def indexer_weights_digest(model: Any, geometry: IndexerGeometry) -> str:
    """16 hex chars identifying the weights that produce the keys: sha256 of every parameter of every
    indexer module of ``model`` (a transformers DSA model), in float32, with its layer, name and shape."""
    from dsaindex.indexer import find_indexers

    h = hashlib.sha256()
    for layer, module in find_indexers(model, geometry).items():
        for name, p in sorted(module.state_dict().items()):
            t = p.detach().float().cpu().contiguous()
            h.update(f"{layer}.{name}:{tuple(t.shape)}".encode())
            h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


class ModelFingerprint(BaseModel):
    """Identifies the model a store (or artifact) belongs to."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    family: str
    geometry: IndexerGeometry
    config_digest: str
    weights_digest: str
    dtype: str

    def same_model(self, other: ModelFingerprint) -> bool:
        """Same architecture and the same indexer weights (the name and dtype may differ)."""
        return (self.family, self.config_digest, self.weights_digest) == (
            other.family, other.config_digest, other.weights_digest)

    def describe(self) -> str:
        return f"{self.name} ({self.family}, weights {self.weights_digest})"


def fingerprint_model(model: Any, name: str) -> ModelFingerprint:
    """The fingerprint of a loaded transformers DSA model (what a capture records, and what a server
    compares a bundle against)."""
    geometry = geometry_from_config(model.config)
    return ModelFingerprint(
        name=name,
        family=geometry.family,
        geometry=geometry,
        config_digest=config_digest(model.config),
        weights_digest=indexer_weights_digest(model, geometry),
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
    )
