"""Loading artifact bundles at server startup, with validation against the serving model.

:func:`load` resolves a bundle (local path or ``models:/<name>@<alias>``), verifies every checksum,
checks that it fits the served model (:func:`dsaindex.artifacts.compat.check_bundle_for_model`) and
places each layer's parameters on the device as the object its kind serves with
(:mod:`dsaindex.artifacts.kinds`: a :class:`dsaindex.pq.PQCodec` for ``pq``, an
:class:`~dsaindex.artifacts.kinds.IVFLayer` for ``ivf``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsaindex.artifacts.compat import check_bundle_for_model
from dsaindex.artifacts.kinds import ArtifactKind, IVFLayer, get_kind
from dsaindex.errors import ArtifactMismatchError
from dsaindex.pq import PQCodec

if TYPE_CHECKING:
    from dsaindex.artifacts.bundle import BundleManifest
    from dsaindex.artifacts.fingerprint import ModelFingerprint

__all__ = ["ArtifactMismatchError", "IVFLayer", "LoadedArtifacts", "PQCodec", "load", "place_layers"]


@dataclass
class LoadedArtifacts:
    """Artifacts ready for the runtime indexers: per-layer served objects, the manifest, startup cost."""

    manifest: BundleManifest
    path: Path
    layers: dict[int, Any] = field(default_factory=dict)
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
            "layers": {str(k): self.kind_of(k).summary(v) for k, v in self.layers.items()},
            "device_bytes": self.device_bytes,
            "startup_seconds": round(self.startup_seconds, 4),
        }

    def kind_of(self, layer: int) -> ArtifactKind:
        """The :class:`dsaindex.artifacts.kinds.ArtifactKind` of a layer."""
        return get_kind(self.manifest.layers[str(layer)].kind)

    def describe_layers(self) -> str:
        """``'0 (PQ32 score-aware), 1 (...)'``: one short description per layer."""
        return ", ".join(f"{k} ({self.kind_of(k).describe(v)})" for k, v in self.layers.items())


def load(uri: str | Path, model_config: Any, device: str = "cpu", basis: str = "hadamard",
         cache_dir: str | Path | None = None, tracking_uri: str | None = None,
         served: ModelFingerprint | None = None, allow_other_weights: bool = False) -> LoadedArtifacts:
    """Resolve, verify, validate and place a bundle's parameters on ``device``.

    Parameters
    ----------
    uri : local bundle path, ``models:/<name>@<alias>`` or ``models:/<name>/<version>``
    model_config : the served model's transformers config (object or dict)
    basis : the key basis the engine scores in (engines rotate keys with a Hadamard matrix)
    served : the served model's fingerprint; its config and indexer-weights digests must equal the
        bundle's. Without it only the config digest computed from ``model_config`` is compared (see
        :func:`dsaindex.artifacts.compat.check_same_model`)
    allow_other_weights : serve artifacts trained for another model of the same geometry (deliberate
        transfer; the geometry, layers, basis and format are still checked)

    Raises
    ------
    ArtifactMismatchError, CorruptBundleError, DsaIndexError
    """
    import torch

    from dsaindex.artifacts.bundle import read_bundle
    from dsaindex.artifacts.registry import load_uri  # imports mlflow only for models:/ URIs

    t0 = time.perf_counter()
    path = load_uri(uri, dest_cache=cache_dir, tracking_uri=tracking_uri)
    manifest, arrays = read_bundle(path, verify=True)
    check_bundle_for_model(manifest, model_config, basis, served=served, allow_other_weights=allow_other_weights)
    loaded = LoadedArtifacts(manifest=manifest, path=Path(path))
    loaded.layers = place_layers(manifest, arrays, device)
    loaded.device_bytes = sum(layer.nbytes for layer in loaded.layers.values())
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    loaded.startup_seconds = time.perf_counter() - t0
    return loaded


def place_layers(manifest: BundleManifest, arrays: dict, device: str = "cpu") -> dict[int, Any]:
    """Per-layer served objects of a read bundle (``read_bundle``'s arrays): each layer's parameters
    validated by its kind, its arrays checked against the kind's names and placed on ``device`` as
    float32 tensors, then built into the kind's object."""
    import torch

    from dsaindex.errors import CorruptBundleError, DsaIndexError

    layers = {}
    for layer_id, art in manifest.layers.items():
        layer = int(layer_id)
        kind = get_kind(art.kind)
        where = f"bundle {manifest.bundle_id} layer {layer_id}"
        try:
            params = kind.params.model_validate(art.params)
            kind.check_arrays(set(arrays[layer]), where)
        except Exception as err:  # noqa: BLE001 - a pydantic ValidationError or the kind's own refusal
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise CorruptBundleError(f"{where} is not a valid {art.kind} artifact ({problem}).",
                                     "train the artifacts again with this dsaindex version.") from None
        tensors = {k: torch.from_numpy(v).to(device=device, dtype=torch.float32) for k, v in arrays[layer].items()}
        try:
            layers[layer] = kind.place(params, tensors)
        except DsaIndexError as err:  # the kind refuses arrays that contradict its params (named with the layer)
            raise CorruptBundleError(f"{where}: {err.problem}", err.fix) from None
    return layers
