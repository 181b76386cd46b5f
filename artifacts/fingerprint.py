"""The fingerprint of a model: which model a capture store or an artifact bundle belongs to.

Recorded in every store and bundle manifest and compared by :mod:`dsaindex.artifacts.compat`:
``config_digest`` identifies the architecture and ``weights_digest`` the indexer weights that produce the
keys (two checkpoints of one architecture have different keys, so codebooks do not transfer between
them); ``geometry`` is the typed :class:`dsaindex.geometry.IndexerGeometry`.

The config digest hashes the whole transformers config, and transformers releases rename labels and add
fields with defaults (5.17's ``layer_types`` entry ``deepseek_sparse_attention`` is 5.24's
``indexed_attention``; 5.24 adds ``output_router_logits``). So a fingerprint also records the fields
themselves (``config_fields``), and two configs whose digests differ still agree
(:func:`configs_agree`) when every field both record holds the same value, labels aside: artifacts
trained under one transformers release serve under another.
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


def config_fields(config: Any) -> dict[str, Any] | None:
    """A model's transformers config as a JSON-ready dict, without the fields of
    :data:`_CONFIG_DIGEST_IGNORES`: what :func:`config_digest` hashes and a fingerprint records.

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
    return json.loads(json.dumps(d, sort_keys=True, default=str))


def config_digest(config: Any) -> str | None:
    """16 hex chars identifying a model's architecture: sha256 of :func:`config_fields` as sorted JSON (the
    ``config_digest`` of a :class:`ModelFingerprint`); ``None`` where the fields cannot be built."""
    fields = config_fields(config)
    if fields is None:
        return None
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _is_label(value: Any) -> bool:
    """A name rather than a quantity: a string, or a list of strings (``layer_types``)."""
    return isinstance(value, str) or (isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value))


def config_field_differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The fields both configs record whose values differ, top-level labels (strings and lists of strings,
    which transformers releases rename) left out; a field only one records is a default that one release
    added, also left out. Nested values (``rope_parameters``) are compared whole."""
    return {k: (a[k], b[k]) for k in sorted(set(a) & set(b))
            if a[k] != b[k] and not (_is_label(a[k]) and _is_label(b[k]))}


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
    config_fields: dict[str, Any] | None = None

    def same_model(self, other: ModelFingerprint) -> bool:
        """Same architecture (:func:`configs_agree`) and the same indexer weights (the name and dtype may
        differ)."""
        return ((self.family, self.weights_digest) == (other.family, other.weights_digest)
                and configs_agree(self, other))

    def describe(self) -> str:
        return f"{self.name} ({self.family}, weights {self.weights_digest})"


def configs_match(digest_a: str | None, fields_a: dict | None, digest_b: str | None, fields_b: dict | None) -> bool:
    """One architecture: equal config digests, or, where the digests differ and both sides record their
    config fields, no :func:`config_field_differences` (two transformers releases describing one model).
    A side written before fields were recorded matches only by its digest."""
    if digest_a == digest_b:
        return True
    return fields_a is not None and fields_b is not None and not config_field_differences(fields_a, fields_b)


def configs_agree(a: ModelFingerprint, b: ModelFingerprint) -> bool:
    """:func:`configs_match` of two fingerprints."""
    return configs_match(a.config_digest, a.config_fields, b.config_digest, b.config_fields)


def fingerprint_model(model: Any, name: str) -> ModelFingerprint:
    """The fingerprint of a loaded transformers DSA model (what a capture records, and what a server
    compares a bundle against)."""
    geometry = geometry_from_config(model.config)
    return ModelFingerprint(
        name=name,
        family=geometry.family,
        geometry=geometry,
        config_digest=config_digest(model.config),
        config_fields=config_fields(model.config),
        weights_digest=indexer_weights_digest(model, geometry),
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
    )
