"""The fingerprint of a model: which model a capture store or an artifact bundle belongs to.

Recorded in every store and bundle manifest and compared by :mod:`dsaindex.artifacts.compat`:
``config_digest`` identifies the architecture and ``weights_digest`` the indexer weights that produce the
keys (two checkpoints of one architecture have different keys, so codebooks do not transfer between
them); ``geometry`` is the typed :class:`dsaindex.geometry.IndexerGeometry`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from dsaindex.geometry import IndexerGeometry


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
