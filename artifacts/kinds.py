"""The artifact kinds a bundle layer can hold, registered in one place.

Each kind says what its parameters are (a pydantic model validated on write and on load), which arrays
a layer of that kind stores, how those arrays become the object the runtime serves with (placed on a
device) and how that object is summarized. The bundle writer, the loader, the registry and the CLI
dispatch through :func:`get_kind`, so a new kind (cross-layer reuse plans, say) is one
:func:`register_kind` call beside its parameters, not edits in five files.

Built in:

* ``pq``: per-layer PQ codebooks (:class:`dsaindex.pq.PQCodec`), arrays ``codebooks`` [M, K, D/M] and,
  for score-aware codebooks, ``metric`` [M, D/M, D/M];
* ``ivf``: a causal-IVF routing encoder (:class:`IVFLayer`): the encoder's arrays
  (:data:`ENCODER_ARRAYS`) and the index settings it was trained with (:class:`IVFIndexSettings`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from dsaindex.errors import DsaIndexError

ENCODER_ARRAYS = ("phi_weight", "phi_bias", "hidden_weight", "hidden_bias", "out_weight", "out_bias")


@dataclass(frozen=True)
class ArtifactKind:
    """One kind of layer artifact.

    name : the ``kind`` string of a bundle layer
    params : pydantic model of the layer's ``params`` (extra keys allowed: training notes)
    arrays : array names every layer of the kind stores; optional_arrays : names it may store
    place : ``(params, {name: float32 tensor on the device}) -> served object``
    summary : ``served object -> dict`` (JSON-ready, with ``kind``); describe : ``-> one short line``
    """

    name: str
    params: type[BaseModel]
    arrays: tuple[str, ...]
    place: Callable[[Any, dict[str, Any]], Any]
    summary: Callable[[Any], dict[str, Any]]
    describe: Callable[[Any], str]
    optional_arrays: tuple[str, ...] = ()

    def check_arrays(self, names: set[str], where: str) -> None:
        """Refuse a layer whose arrays are not this kind's (missing required ones, or unknown ones)."""
        missing = sorted(set(self.arrays) - names)
        unknown = sorted(names - set(self.arrays) - set(self.optional_arrays))
        if missing or unknown:
            raise DsaIndexError(
                f"{where}: a {self.name!r} layer stores {', '.join(self.arrays)}"
                + (f" (and optionally {', '.join(self.optional_arrays)})" if self.optional_arrays else "")
                + (f"; missing {', '.join(missing)}" if missing else "") + (f"; unknown {', '.join(unknown)}" if unknown else "")
                + ".",
                "write the layer's arrays under the kind's own names.",
            )


KINDS: dict[str, ArtifactKind] = {}


def register_kind(kind: ArtifactKind) -> ArtifactKind:
    """Add a kind to the registry (its name must be new)."""
    if kind.name in KINDS:
        raise ValueError(f"artifact kind {kind.name!r} is registered twice")
    KINDS[kind.name] = kind
    return kind


def get_kind(name: str) -> ArtifactKind:
    """The registered kind ``name``; an unknown one raises :class:`DsaIndexError` naming the known ones."""
    kind = KINDS.get(name)
    if kind is None:
        raise DsaIndexError(
            f"Artifact kind {name!r} is not one this dsaindex knows ({', '.join(sorted(KINDS))}).",
            "upgrade dsaindex to the version that wrote the bundle.",
        )
    return kind


# ---- pq --------------------------------------------------------------------------------------------
class PQParams(BaseModel):
    """Parameters of a ``pq`` layer; training notes (trainer, train_keys, ...) ride along as extras."""

    model_config = ConfigDict(extra="allow")
    subspaces: int
    centroids: int = 256
    score_aware: bool = False


def _place_pq(params: PQParams, tensors: dict[str, Any]):
    from dsaindex.pq import PQCodec

    return PQCodec(tensors["codebooks"], tensors.get("metric"))


def _summarize_pq(codec) -> dict[str, Any]:
    return {"kind": "pq", "subspaces": codec.subspaces, "score_aware": codec.metric is not None}


def _describe_pq(codec) -> str:
    return f"PQ{codec.subspaces}{' score-aware' if codec.metric is not None else ''}"


# ---- ivf -------------------------------------------------------------------------------------------
class IVFIndexSettings(BaseModel):
    """How a causal IVF index groups keys: one type for training, the bundle and the runtime.

    window : keys per seal (the open window); cluster_size : keys per cluster (a seal's cap);
    refit_every : keys between refits of the whole prefix (0 = never); sinks : first keys always kept
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    window: int = 1024
    cluster_size: int = 128
    refit_every: int = 16384
    sinks: int = 4

    @model_validator(mode="after")
    def _consistent(self) -> IVFIndexSettings:
        if self.cluster_size <= 0 or self.window <= 0 or self.window % self.cluster_size:
            raise ValueError(f"window {self.window} must be a positive multiple of cluster_size {self.cluster_size}")
        if self.refit_every < 0 or self.sinks < 0:
            raise ValueError("refit_every and sinks must not be negative")
        return self


class IVFParams(IVFIndexSettings):
    """Parameters of an ``ivf`` layer: the index settings, the encoder's widths, and training notes
    (steps, learning rate, the training summary) as extras."""

    model_config = ConfigDict(extra="allow", frozen=True)
    features: int = 64
    hidden: int = 256

    def index_settings(self) -> IVFIndexSettings:
        return IVFIndexSettings(**{k: getattr(self, k) for k in IVFIndexSettings.model_fields})


@dataclass
class IVFLayer:
    """One layer's causal-IVF routing encoder on the device: float32 ``params`` (:data:`ENCODER_ARRAYS`,
    the forward is :func:`dsaindex.runtime.causal_ivf.representatives`) and the index settings it was
    trained with."""

    params: dict[str, Any]
    settings: IVFIndexSettings

    @property
    def nbytes(self) -> int:
        return sum(int(t.numel()) * 4 for t in self.params.values())


def _place_ivf(params: IVFParams, tensors: dict[str, Any]) -> IVFLayer:
    return IVFLayer(tensors, params.index_settings())


def _summarize_ivf(layer: IVFLayer) -> dict[str, Any]:
    return {"kind": "ivf", **layer.settings.model_dump()}


def _describe_ivf(layer: IVFLayer) -> str:
    s = layer.settings
    return f"IVF routing (window {s.window}, clusters of {s.cluster_size}, refit every {s.refit_every})"


register_kind(ArtifactKind("pq", PQParams, ("codebooks",), _place_pq, _summarize_pq, _describe_pq,
                           optional_arrays=("metric",)))
register_kind(ArtifactKind("ivf", IVFParams, ENCODER_ARRAYS, _place_ivf, _summarize_ivf, _describe_ivf))
