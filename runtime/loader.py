"""Loading artifact bundles at server startup, with validation against the serving model.

:func:`load` resolves a bundle (local path or ``models:/<name>@<alias>``), verifies every checksum,
checks that it fits the served model (:func:`dsaindex.artifacts.compat.check_bundle_for_model`) and
places each layer's parameters on the device as the object its kind serves with
(:mod:`dsaindex.artifacts.kinds`: a :class:`dsaindex.pq.PQCodec` for ``pq``, an
:class:`~dsaindex.artifacts.kinds.IVFLayer` for ``ivf``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsaindex.artifacts.compat import check_bundle_for_model
from dsaindex.artifacts.kinds import ArtifactKind, IVFLayer, get_kind
from dsaindex.coarse import PREFILTER, RECALL_TARGET
from dsaindex.errors import ArtifactMismatchError, DsaIndexError
from dsaindex.pq import PQCodec

if TYPE_CHECKING:
    from dsaindex.artifacts.bundle import BundleManifest
    from dsaindex.artifacts.fingerprint import ModelFingerprint

__all__ = ["ArtifactMismatchError", "IVFLayer", "LoadedArtifacts", "PQCodec", "candidates_for_recall",
           "candidates_per_layer", "load", "place_layers"]

MIN_BAND_QUERIES = 8  # a prefix band's recall counts for ``candidates="auto"`` with at least this many queries


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


def candidates_for_recall(metrics: dict[str, float], layers: list[int], topk: int, target: float = RECALL_TARGET,
                          source: str = "the bundle", prefilter: int | None = None) -> dict[int, int]:
    """Per layer, the smallest candidate count C whose held-out recall of the exact top-``topk`` reaches
    ``target``, read from a ``pq`` bundle's recorded metrics as ``dsaindex train pq`` evaluates them: with
    ``prefilter`` P, the recall of the served step whose stage 1 keeps P x C keys
    (``layer{L}/k{topk}/prefilter{P}@{C}``; of the largest recorded factor below P where P itself is not
    recorded, a lower bound), else, for bundles that record none, the recall of the top-C by coarse score
    after exact rerank (``layer{L}/k{topk}/rerank@{C}``, an upper bound of the served one). A
    layer's recall at C is the lowest of its mean over every held-out query and its mean in the longest
    prefix band with at least :data:`MIN_BAND_QUERIES` queries, so long requests, the ones C matters for,
    decide. Raises :class:`DsaIndexError` when the bundle has no such metrics for a layer or no measured C
    reaches ``target`` (naming the best one, and a larger recorded prefilter that would reach it)."""
    out: dict[int, int] = {}
    for layer in layers:
        head = f"layer{layer}/k{topk}"
        recorded = _recorded_prefilters(metrics, head)
        metric = "rerank"  # bundles trained before the served recall was recorded: an upper bound of it
        if prefilter and recorded:
            below = [p for p in recorded if p <= prefilter]
            if not below:
                raise DsaIndexError(f"{source} records layer {layer}'s served recall with stage 1 keeping "
                                    f"{', '.join(map(str, recorded))} x C keys, none at or below the {prefilter} "
                                    "asked, so C cannot be chosen for it.",
                                    f"pass --prefilter {recorded[0]} or more, or a number to --candidates.")
            metric = f"prefilter{max(below)}"  # a smaller stage 1 keeps less: a lower bound where P is not recorded
        recall = _recall_at(metrics, head, metric)
        if not recall:
            raise DsaIndexError(f"{source} records no held-out recall of the top-{topk} for layer {layer}, so C "
                                "cannot be chosen from it.",
                                "pass a number to --candidates, or train the bundle with `dsaindex train pq` "
                                "(which measures it) at this top-k.")
        good = sorted(c for c, r in recall.items() if r >= target)
        if not good:
            best = max(recall, key=recall.get)
            stage = f" with stage 1 keeping {metric[len('prefilter'):]} x C keys" if metric != "rerank" else ""
            fixes = ["pass a lower --recall-target or a number to --candidates",
                     "serve a code of more bytes per key (RQ32)"]
            for p in recorded:
                reach = {c: r for c, r in _recall_at(metrics, head, f"prefilter{p}").items() if r >= target}
                if prefilter and p > prefilter and reach:
                    c = min(reach)
                    fixes.insert(0, f"pass --prefilter {p} (it reaches {_floor_pct(reach[c])} at C = {c}, at a "
                                    "slower stage 2)")
                    break
            raise DsaIndexError(f"Layer {layer} of {source} reaches at most {_floor_pct(recall[best])} held-out recall "
                                f"of the top-{topk} (at C = {best}{stage}), short of the {100 * target:.2f}% asked.",
                                "; or ".join(fixes) + ".")
        out[layer] = good[0]
    return out


def selection_for_recall(metrics: dict[str, float], layers: list[int], topk: int, target: float = RECALL_TARGET,
                         source: str = "the bundle") -> dict[int, tuple[int, int]]:
    """Per layer, the stage-1 factor P and candidate count C of the cheapest served step whose recorded
    recall (``prefilter{P}@{C}``, read as :func:`candidates_for_recall` reads it) reaches ``target``: the
    least stage-2 work P x C, then the smaller C. A layer whose keys the folded stage 1 ranks well keeps a
    small P; one that reaches far back gets the larger P it needs, and only it pays for it. Raises
    :class:`DsaIndexError` for a bundle that records no served recall, or a layer no recorded pair serves."""
    out: dict[int, tuple[int, int]] = {}
    for layer in layers:
        head = f"layer{layer}/k{topk}"
        recorded = _recorded_prefilters(metrics, head)
        if not recorded:
            raise DsaIndexError(f"{source} records no served recall per stage-1 factor for layer {layer} (it was "
                                "trained before `train pq` measured it), so the prefilter cannot be chosen from it.",
                                "train the bundle again with `dsaindex train pq`, or pass a number to --prefilter.")
        pairs = [(p * c, c, p, r) for p in recorded for c, r in _recall_at(metrics, head, f"prefilter{p}").items()]
        good = sorted(x for x in pairs if x[3] >= target)
        if not good:
            _, c, p, r = max(pairs, key=lambda x: x[3])
            raise DsaIndexError(f"Layer {layer} of {source} reaches at most {_floor_pct(r)} held-out recall of the "
                                f"top-{topk} (at C = {c} with stage 1 keeping {p} x C keys), short of the "
                                f"{100 * target:.2f}% asked.",
                                "pass a lower --recall-target, or serve a code of more bytes per key (RQ32).")
        out[layer] = (good[0][2], good[0][1])
    return out


def _floor_pct(value: float) -> str:
    """A recall as a percentage rounded down to 2 decimals: 0.98996 reads 98.99%, not the 99.00% it falls short of."""
    return f"{math.floor(value * 10000 + 1e-9) / 100:.2f}%"


def _recorded_prefilters(metrics: dict[str, float], head: str) -> list[int]:
    """The stage-1 factors P of a layer's recorded ``{head}/prefilter{P}@{C}`` metrics, ascending."""
    return sorted({int(name[len(f"{head}/prefilter"):].split("@", 1)[0]) for name in metrics
                   if name.startswith(f"{head}/prefilter")})


def _recall_at(metrics: dict[str, float], head: str, metric: str) -> dict[int, float]:
    """{C: recall} of ``{head}/{metric}@{C}``, each the lower of the overall mean and the mean in the longest
    prefix band with at least :data:`MIN_BAND_QUERIES` queries."""
    overall = {int(name.rsplit("@", 1)[1]): v for name, v in metrics.items() if name.startswith(f"{head}/{metric}@")}
    bands = {}
    for name, n in metrics.items():  # layer{L}/k{topk}@{band}/queries
        if name.startswith(f"{head}@") and name.endswith("/queries") and n >= MIN_BAND_QUERIES:
            band = name[len(head) + 1 : -len("/queries")]
            bands[band] = _band_start(band)
    longest = max(bands, key=bands.get) if bands else None
    recall = {}
    for c, value in overall.items():
        band_value = metrics.get(f"{head}@{longest}/{metric}@{c}") if longest else None
        recall[c] = min(value, band_value) if band_value is not None else value
    return recall


def _band_start(band: str) -> int:
    """Keys at the start of a prefix band named like ``64K-128K`` or ``1M-max`` (the names
    :func:`dsaindex.train.recall.prefix_band` gives)."""
    low = band.split("-", 1)[0]
    scale = {"K": 1 << 10, "M": 1 << 20}.get(low[-1:], 1)
    return int(float(low.rstrip("KM") or 0) * scale)


def _pq_layers(loaded: LoadedArtifacts, layers: list[int] | None) -> list[int]:
    """The ``pq`` layers of ``loaded``, all of them or those among ``layers``."""
    served = sorted(layer for layer, obj in loaded.layers.items() if isinstance(obj, PQCodec))
    return served if layers is None else [layer for layer in served if layer in set(layers)]


def decode_settings(candidates: str | int | None, prefilter: str | int | None, loaded: LoadedArtifacts, topk: int,
                    default: int, target: float = RECALL_TARGET,
                    layers: list[int] | None = None) -> tuple[dict[int, int], dict[int, int]]:
    """(C per layer, stage-1 factor P per layer) for each ``pq`` layer of ``loaded`` (or of ``layers`` among
    them), from a server's two settings. ``prefilter``: a factor for every layer, none / empty
    (:data:`~dsaindex.coarse.PREFILTER`), or ``auto`` with ``candidates`` ``auto``: each layer's cheapest
    recorded pair that reaches ``target`` (:func:`selection_for_recall`). ``candidates`` as
    :func:`candidates_per_layer` reads it, at the layer's P. What ``dsaindex serve`` and the engine plugins
    read (``DSAINDEX_CANDIDATES``, ``DSAINDEX_PREFILTER``)."""
    p_text = "" if prefilter is None else str(prefilter).strip().lower()
    c_text = "" if candidates is None else str(candidates).strip().lower()
    if p_text == "auto":
        if c_text != "auto":
            raise DsaIndexError(f"The prefilter `auto` chooses each layer's stage 1 together with its C, and the "
                                f"candidate count is {candidates!r}.",
                                "set the candidates to `auto` too, or the prefilter to a number (e.g. 4).")
        pairs = selection_for_recall(loaded.manifest.metrics, _pq_layers(loaded, layers), topk, target, str(loaded.path))
        return {layer: c for layer, (_, c) in pairs.items()}, {layer: p for layer, (p, _) in pairs.items()}
    if p_text and (not p_text.isdigit() or int(p_text) < 1):
        raise DsaIndexError(f"The prefilter {prefilter!r} is neither a positive factor nor `auto`.",
                            f"set a number (e.g. {PREFILTER}) or `auto`.")
    factor = int(p_text) if p_text else PREFILTER
    chosen = candidates_per_layer(candidates, loaded, topk, default, target, layers, prefilter=factor)
    return chosen, dict.fromkeys(chosen, factor)


def candidates_per_layer(setting: str | int | None, loaded: LoadedArtifacts, topk: int, default: int,
                         target: float = RECALL_TARGET, layers: list[int] | None = None,
                         prefilter: int | None = None) -> dict[int, int]:
    """C for each ``pq`` layer of ``loaded`` (or of ``layers`` among them), from a server's setting: a count
    (every layer), ``auto`` (:func:`candidates_for_recall` at ``target``, for a step whose stage 1 keeps
    ``prefilter`` x C keys), or none / 0 / empty (``default``).
    What the engine plugins read from ``DSAINDEX_CANDIDATES``; a :class:`DsaIndexError` naming the fix for
    any other value."""
    layers = _pq_layers(loaded, layers)
    text = "" if setting is None else str(setting).strip().lower()
    if text == "auto":
        return candidates_for_recall(loaded.manifest.metrics, layers, topk, target, str(loaded.path), prefilter)
    if text in ("", "0"):
        return dict.fromkeys(layers, default)
    if not text.isdigit():
        raise DsaIndexError(f"The candidate count {setting!r} is neither a positive count nor `auto`.",
                            "set a number of keys (e.g. 2048) or `auto`.")
    return dict.fromkeys(layers, int(text))
