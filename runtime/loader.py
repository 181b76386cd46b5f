"""Loading artifact bundles at server startup, with validation against the serving model."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsaindex.errors import DsaIndexError

SUPPORTED_SCHEMA_VERSIONS = (1,)
SUPPORTED_KINDS = ("pq", "ivf")


class ArtifactMismatchError(DsaIndexError):
    """The artifacts were trained for another model, basis or format than the one being served."""


@dataclass
class PQLayer:
    """One layer's PQ parameters on the device.

    codebooks : [M, K, D/M] float32; metric : optional [M, D/M, D/M] float32 (score-aware encoding)
    """

    codebooks: Any
    metric: Any | None = None

    @property
    def subspaces(self) -> int:
        return int(self.codebooks.shape[0])


@dataclass
class IVFLayer:
    """One layer's causal-IVF routing encoder on the device: float32 ``params`` (see
    :mod:`dsaindex.train.ivf`) and the index settings it was trained with (window, cluster size, ...)."""

    params: dict
    settings: dict

    @property
    def nbytes(self) -> int:
        return sum(int(t.numel()) * 4 for t in self.params.values())


@dataclass
class LoadedArtifacts:
    """Artifacts ready for the runtime indexers: per-layer parameters, the manifest, startup cost."""

    manifest: Any
    path: Path
    layers: dict[int, PQLayer] = field(default_factory=dict)
    startup_seconds: float = 0.0
    device_bytes: int = 0

    def summary(self) -> dict[str, Any]:
        return {
            "bundle": str(self.path),
            "bundle_id": self.manifest.bundle_id,
            "model": self.manifest.model.name,
            "family": self.manifest.model.family,
            "basis": self.manifest.basis,
            "key_format": self.manifest.key_format,
            "layers": {str(k): ({"kind": "pq", "subspaces": v.subspaces, "score_aware": v.metric is not None}
                                if isinstance(v, PQLayer) else {"kind": "ivf", **v.settings})
                       for k, v in self.layers.items()},
            "device_bytes": self.device_bytes,
            "startup_seconds": round(self.startup_seconds, 4),
        }


def check_compatible(manifest, model_config: Any, basis: str = "hadamard") -> None:
    """Refuse artifacts that do not fit the served model, naming both sides and the fix.

    Checks the schema version, the family, that the bundle covers exactly the model's indexer
    layers, the key dim, the key basis the engine scores in, and the key storage format.
    """
    from dsaindex.geometry import geometry_from_config

    fix_retrain = "train artifacts for this model (`dsaindex capture` from it, then `dsaindex train pq`)"
    if manifest.schema_version not in SUPPORTED_SCHEMA_VERSIONS:
        raise ArtifactMismatchError(
            f"Bundle schema version {manifest.schema_version} is not supported by this runtime "
            f"(supports {', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}).",
            "upgrade dsaindex on the server, or retrain the artifacts with the server's dsaindex version.",
        )
    geometry = geometry_from_config(model_config)
    trained = manifest.model.geometry
    checks = [
        ("family", manifest.model.family, geometry.family),
        ("indexer head dim", int(trained["head_dim"]), geometry.head_dim),
        ("indexer heads", int(trained["n_heads"]), geometry.n_heads),
        ("key stride", int(trained["key_stride"]), geometry.key_stride),
        ("key format", manifest.key_format, geometry.key_format),
        ("key basis", manifest.basis, basis),
    ]
    for what, theirs, ours in checks:
        if theirs != ours:
            raise ArtifactMismatchError(
                f"The artifacts' {what} is {theirs!r} (trained for {manifest.model.name}) but the served model's "
                f"is {ours!r}.",
                fix_retrain + ("" if what != "key basis" else f", or serve with basis={theirs!r}") + ".",
            )
    have = sorted(int(i) for i in manifest.layers)
    want = list(geometry.indexer_layers)
    if have != want:
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        raise ArtifactMismatchError(
            f"The artifacts cover indexer layers {have} but the served model's indexer layers are {want}"
            + (f" (missing {missing})" if missing else "") + (f" (not in the model: {extra})" if extra else "") + ".",
            fix_retrain + ".",
        )
    for layer_id, layer in manifest.layers.items():
        if layer.kind not in SUPPORTED_KINDS:
            raise ArtifactMismatchError(
                f"Layer {layer_id} holds a {layer.kind!r} artifact; this runtime loads {', '.join(SUPPORTED_KINDS)}.",
                "upgrade dsaindex on the server.",
            )


def load(uri: str | Path, model_config: Any, device: str = "cpu", basis: str = "hadamard",
         cache_dir: str | Path | None = None, tracking_uri: str | None = None) -> LoadedArtifacts:
    """Resolve, verify, validate and place a bundle's parameters on ``device``.

    Parameters
    ----------
    uri : local bundle path, ``models:/<name>@<alias>`` or ``models:/<name>/<version>``
    model_config : the served model's transformers config (object or dict)
    basis : the key basis the engine scores in (engines rotate keys with a Hadamard matrix)

    Raises
    ------
    ArtifactMismatchError, CorruptBundleError, DsaIndexError
    """
    import torch

    from dsaindex.artifacts.bundle import read_bundle

    t0 = time.perf_counter()
    text = str(uri)
    if text.startswith("models:/"):
        from dsaindex.artifacts.registry import load_uri  # imports mlflow only for registry URIs

        path = load_uri(text, dest_cache=cache_dir, tracking_uri=tracking_uri)
    else:
        path = Path(text[len("file://"):] if text.startswith("file://") else text)
    manifest, arrays = read_bundle(path, verify=True)
    check_compatible(manifest, model_config, basis)
    loaded = LoadedArtifacts(manifest=manifest, path=Path(path))
    loaded.layers = place_layers(manifest, arrays, device)
    loaded.device_bytes = sum(
        (v.codebooks.numel() * 4 + (0 if v.metric is None else v.metric.numel() * 4)) if isinstance(v, PQLayer)
        else v.nbytes for v in loaded.layers.values())
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    loaded.startup_seconds = time.perf_counter() - t0
    return loaded


def place_layers(manifest, arrays: dict, device: str = "cpu") -> dict[int, PQLayer | IVFLayer]:
    """Per-layer parameters of a read bundle (``read_bundle``'s arrays) as float32 tensors on ``device``:
    :class:`PQLayer` for kind ``pq``, :class:`IVFLayer` for kind ``ivf``."""
    import torch

    layers = {}
    for layer_id, art in manifest.layers.items():
        layer = int(layer_id)
        tensors = {k: torch.from_numpy(v).to(device=device, dtype=torch.float32) for k, v in arrays[layer].items()}
        if art.kind == "ivf":
            keep = ("window", "cluster_size", "refit_every", "sinks", "features", "hidden")
            layers[layer] = IVFLayer(tensors, {k: art.params[k] for k in keep if k in art.params})
        else:
            layers[layer] = PQLayer(tensors["codebooks"], tensors.get("metric"))
    return layers
