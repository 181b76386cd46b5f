"""Loading artifact bundles at server startup, with validation against the serving model.

:func:`load_bundle` resolves a bundle (local path or ``models:/<name>@<alias>``), verifies every checksum,
checks that it fits the served model (:func:`dsaindex.artifacts.compat.check_bundle_for_model`) and
places each layer's parameters on the device as the object its kind serves with
(:mod:`dsaindex.artifacts.kinds`: a :class:`dsaindex.pq.PQCodec` for ``pq``, an
:class:`~dsaindex.artifacts.kinds.IVFLayer` for ``ivf``).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsaindex.artifacts.compat import check_bundle_for_model
from dsaindex.artifacts.kinds import ArtifactKind, IVFLayer, get_kind
from dsaindex.coarse import PREFILTER, RECALL_TARGET
from dsaindex.errors import ArtifactMismatchError, DsaIndexError
from dsaindex.pq import PQCodec
from dsaindex.runtime.operating_points import OperatingPoints, band_start, expected_step_us
from dsaindex.runtime.settings import STAGE1_KINDS, STAGE1_SETTINGS, DecodeSettings, parse_candidates

if TYPE_CHECKING:
    from dsaindex.artifacts.bundle import BundleManifest
    from dsaindex.artifacts.fingerprint import ModelFingerprint

__all__ = ["ArtifactMismatchError", "IVFLayer", "LoadedArtifacts", "PQCodec", "candidates_for_recall",
           "candidates_per_layer", "decode_settings", "load_bundle", "per_layer", "place_layers"]



@dataclass
class LoadedArtifacts:
    """Artifacts ready for the runtime indexers: per-layer served objects, the manifest, startup cost."""

    manifest: BundleManifest
    path: Path | str  # a local folder, or the s3:// URI of a bundle read in place
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


def load_bundle(uri: str | Path, model_config: Any, device: str = "cpu", basis: str = "hadamard",
         cache_dir: str | Path | None = None, tracking_uri: str | None = None,
         served: ModelFingerprint | None = None, allow_other_weights: bool = False) -> LoadedArtifacts:
    """Resolve, verify, validate and place a bundle's parameters on ``device``.

    Parameters
    ----------
    uri : local bundle path, ``s3://bucket/prefix`` (read in place; credentials and endpoint from the
        standard AWS config), ``models:/<name>@<alias>`` or ``models:/<name>/<version>``
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
    loaded = LoadedArtifacts(manifest=manifest, path=path)  # a Path, or an s3:// location (a str)
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
                          source: str = "the bundle", prefilter: int | None = None,
                          stage1: str = "codes") -> dict[int, int]:
    """Per layer, the smallest candidate count C whose held-out recall of the exact top-``topk`` reaches
    ``target``, from a ``pq`` bundle's recorded operating points
    (:class:`dsaindex.runtime.operating_points.OperatingPoints`): with ``prefilter`` P, the recall of the
    served step whose stage 1 keeps P x C keys (of the largest recorded factor below P where P itself is not
    recorded, a lower bound), else, for bundles that record none, the recall of the top-C by coarse score
    after exact rerank (an upper bound of the served one). A point's recall is the lower of its overall
    and its longest prefix band's. Raises :class:`DsaIndexError` when the bundle has no such metrics for a
    layer or no measured C reaches ``target`` (naming the best one, and a larger recorded prefilter that
    would reach it). ``stage1``: what the served stage 1 scores (``codes`` or ``folds``: the points recorded
    as ``folds{P}@{C}``; a bundle that records none for it is refused, as there is no upper bound to read)."""
    table = OperatingPoints.from_metrics(metrics)
    out: dict[int, int] = {}
    for layer in layers:
        recorded = table.prefilters(layer, topk, stage1)
        if stage1 != "codes" and not recorded:
            raise DsaIndexError(f"{source} records no served recall with stage 1 by {stage1} for layer {layer}, so "
                                "C cannot be chosen for it.",
                                "pass --stage1 codes, or train the bundle again with `dsaindex train pq` (which "
                                "measures it).")
        factor = None  # bundles trained before the served recall was recorded: rerank, an upper bound of it
        if prefilter and recorded:
            below = [p for p in recorded if p <= prefilter]
            if not below:
                raise DsaIndexError(f"{source} records layer {layer}'s served recall with stage 1 keeping "
                                    f"{', '.join(map(str, recorded))} x C keys, none at or below the {prefilter} "
                                    "asked, so C cannot be chosen for it.",
                                    f"pass --prefilter {recorded[0]} or more, or a number to --candidates.")
            factor = max(below)  # a smaller stage 1 keeps less: a lower bound where P is not recorded
        recall = table.recall(layer, topk, factor, stage1)
        if not recall:
            raise DsaIndexError(f"{source} records no held-out recall of the top-{topk} for layer {layer}, so C "
                                "cannot be chosen from it.",
                                "pass a number to --candidates, or train the bundle with `dsaindex train pq` "
                                "(which measures it) at this top-k.")
        good = sorted(c for c, r in recall.items() if r >= target)
        if not good:
            best = max(recall, key=recall.get)
            stage = f" with stage 1 keeping {factor} x C keys by {stage1}" if factor is not None else ""
            fixes = ["pass a lower --recall-target or a number to --candidates",
                     "serve a code of more bytes per key (RQ32)"]
            for p in recorded:
                reach = {c: r for c, r in table.recall(layer, topk, p, stage1).items() if r >= target}
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
                         source: str = "the bundle", stage1s: tuple[str, ...] = STAGE1_KINDS,
                         suggest: tuple[str, ...] | None = None) -> dict[int, tuple[str, int, int]]:
    """Per layer, (stage 1, factor P, candidate count C) of the cheapest served step whose recorded recall
    reaches ``target`` (read as :func:`candidates_for_recall` reads it) among the points whose stage 1 is one
    of ``stage1s`` (``codes``, ``folds``): the least expected step cost
    (:attr:`~dsaindex.runtime.operating_points.OperatingPoint.cost_us`, stage 1's scan and stage 2's P x C
    keys), then the smaller C. A layer whose keys the folded stage 1 ranks well keeps the codes at a small P;
    one that reaches far back gets the folds or the larger P it needs, and only it pays for them. Raises
    :class:`DsaIndexError` for a bundle that records no served recall, or a layer no recorded point serves (its
    fix names the stage 1s of ``suggest`` the bundle records a point of, default every one not in ``stage1s``)."""
    table = OperatingPoints.from_metrics(metrics)
    out: dict[int, tuple[str, int, int]] = {}
    for layer in layers:
        points = [p for p in table.of(layer, topk, stage1=None) if p.stage1 in stage1s]
        if not points:
            raise DsaIndexError(f"{source} records no served recall per stage-1 factor for layer {layer} (it was "
                                "trained before `train pq` measured it), so the prefilter cannot be chosen from it.",
                                "train the bundle again with `dsaindex train pq`, or pass a number to --prefilter.")
        good = sorted((p for p in points if p.recall >= target), key=lambda p: (p.cost_us, p.candidates))
        if not good:
            best = max(points, key=lambda p: p.recall)
            others = sorted({p.stage1 for p in table.of(layer, topk, stage1=None)} - set(stage1s)
                            & set(STAGE1_KINDS if suggest is None else suggest))
            fixes = ["pass a lower --recall-target, or serve a code of more bytes per key (RQ32)"]
            if others:
                fixes.insert(0, f"serve stage 1 by {' or '.join(others)}, as recorded (--stage1 auto, "
                                "DSAINDEX_STAGE1=auto, where it runs)")
            raise DsaIndexError(f"Layer {layer} of {source} reaches at most {_floor_pct(best.recall)} held-out recall "
                                f"of the top-{topk} (at C = {best.candidates} with stage 1 keeping {best.prefilter} x "
                                f"C keys by {best.stage1}), short of the {100 * target:.2f}% asked.",
                                "; or ".join(fixes) + ".")
        out[layer] = (good[0].stage1, good[0].prefilter, good[0].candidates)
    return out


def _floor_pct(value: float) -> str:
    """A recall as a percentage rounded down to 2 decimals: 0.98996 reads 98.99%, not the 99.00% it falls short of."""
    return f"{math.floor(value * 10000 + 1e-9) / 100:.2f}%"


def _decode_layers(loaded: LoadedArtifacts, layers: list[int] | None) -> list[int]:
    """The layers of ``loaded`` whose kind serves decode (``pq``), all of them or those among ``layers``."""
    served = sorted(layer for layer in loaded.layers if loaded.kind_of(layer).role == "decode")
    return served if layers is None else [layer for layer in served if layer in set(layers)]


def folds_refusal(codec: Any, unavailable: str | None = None) -> str | None:
    """Why a layer of ``codec`` cannot serve stage 1 by the fold scan (None: it can): ``unavailable`` (why the
    scan does not run on this device, :func:`dsaindex.runtime.paged_select.fold_scan_unavailable`), or codes the
    folds do not score (:func:`dsaindex.kernels.pq_fold_cuda.takes`)."""
    from dsaindex.kernels.pq_fold_cuda import takes

    if unavailable:
        return unavailable
    m, centroids, sub = codec.codebooks.shape
    residual = bool(getattr(codec, "residual", False))
    return takes(2, sub if residual else m * sub, m, centroids, residual)


def decode_settings(decode: DecodeSettings, loaded: LoadedArtifacts, topk: int, layers: list[int] | None = None,
                    folds: str | None = None) -> tuple[dict[int, int], dict[int, int], dict[int, str]]:
    """(C, stage-1 factor P, what stage 1 scores) per layer, for each decode layer of ``loaded`` (or of
    ``layers`` among them) under ``decode``. ``prefilter="auto"`` (with ``candidates="auto"``): each layer's
    cheapest recorded point that reaches ``decode.recall_target`` (:func:`selection_for_recall`), among those
    whose stage 1 ``decode.stage1`` allows (``auto``: the codes' points and, where the layer's codes fit the
    fold scan and it runs here, the folds'; a layer whose bundle records no served recall, trained before it
    was measured, gets C from its rerank recall at the default stage 1, as ``candidates="auto"`` reads it);
    ``candidates="auto"`` alone: :func:`candidates_for_recall` at the given stage 1 (``auto``: the codes); a
    count or a layer -> count mapping as given. ``folds``: why the fold scan does not run here (None: it does).
    What ``dsaindex serve``, ``runtime check`` and the engine plugins choose with; raises
    :class:`DsaIndexError` when no recorded point reaches the target, naming what would, or where stage 1 by
    folds is asked of a layer that cannot serve it."""
    served = _decode_layers(loaded, layers)
    metrics, source = loaded.manifest.metrics, str(loaded.path)
    asked = per_layer_text(decode.stage1, served, "stage 1", STAGE1_SETTINGS)
    kinds: dict[int, tuple[str, ...]] = {}
    for layer in served:
        why = folds_refusal(loaded.layers[layer], folds)
        if asked[layer] == "folds" and why:
            raise DsaIndexError(f"Layer {layer} cannot serve stage 1 by folds: {why}.", "pass --stage1 codes "
                                "(DSAINDEX_STAGE1=codes), or auto.")
        kinds[layer] = ("codes", "folds") if asked[layer] == "auto" and not why else (
            ("codes",) if asked[layer] == "auto" else (asked[layer],))
    if decode.prefilter == "auto":
        table = OperatingPoints.from_metrics(metrics)
        chosen: dict[int, int] = {}
        factors: dict[int, int] = {}
        stages: dict[int, str] = {}
        # bundles trained before the served recall was measured: C from the rerank recall at the default stage 1
        older = [layer for layer in served if not table.of(layer, topk, stage1=None)]
        for layer in served:
            if layer not in older:
                # a stage 1 the layer serves but was not asked for is worth naming in a refusal
                suggest = () if asked[layer] == "auto" or folds_refusal(loaded.layers[layer], folds) else None
                stages[layer], factors[layer], chosen[layer] = selection_for_recall(
                    metrics, [layer], topk, decode.recall_target, source, kinds[layer], suggest)[layer]
        for layer in older:
            stage = "folds" if kinds[layer] == ("folds",) else "codes"
            chosen |= candidates_for_recall(metrics, [layer], topk, decode.recall_target, source, PREFILTER, stage)
            factors[layer], stages[layer] = PREFILTER, stage
        return dict(sorted(chosen.items())), dict(sorted(factors.items())), dict(sorted(stages.items()))
    factors = per_layer(decode.prefilter, served, "stage-1 prefilter")
    stages = {layer: kinds[layer][0] for layer in served}  # auto, where P is given: the codes
    if decode.candidates == "auto":
        chosen = {}
        for factor, stage in sorted({(factors[layer], stages[layer]) for layer in served}):
            group = [layer for layer in served if (factors[layer], stages[layer]) == (factor, stage)]
            chosen |= candidates_for_recall(metrics, group, topk, decode.recall_target, source, factor, stage)
        return dict(sorted(chosen.items())), factors, stages
    return per_layer(decode.candidates, served, "candidate count C"), factors, stages


COST_KEYS = (1 << 17, 1 << 20)  # the prefix lengths a startup line prices a decode step at


def step_bytes(keys: int, code_bytes: int, candidates: int, prefilter: int, key_bytes: int = 132) -> dict[str, int]:
    """HBM bytes one decode query reads to select over ``keys`` keys: the exact indexer (every key's FP8
    bytes and scale, ``key_bytes``) and the codes' step (stage 1 scans every key's ``code_bytes`` of codes,
    stage 2 reads its ``prefilter`` x C survivors' codes again, the exact rescoring C keys). A floor that
    says how the point's cost grows, not a timing: the steps are timed by ``dsaindex bench``."""
    survivors = min(keys, prefilter * candidates)
    coded = keys * code_bytes + survivors * code_bytes + min(keys, candidates) * key_bytes
    return {"exact": keys * key_bytes, "codes": coded}


def code_bytes_of(codec: Any) -> tuple[int, int]:
    """(bytes of codes a key, bytes of an exact FP8 key with its scales) of a PQ / RQ codec: one code byte per
    subspace (or residual level) of 256 centroids; D FP8 bytes plus a float32 scale per 128 of them."""
    m, _, sub = codec.codebooks.shape
    dim = sub if getattr(codec, "residual", False) else m * sub
    return int(m), int(dim + 4 * max(1, dim // 128))


def growth_bands(metrics: Mapping[str, float], candidates: Mapping[int, int], prefilter: Mapping[int, int],
                 topk: int, stage1: Mapping[int, str] | None = None) -> dict[int, int]:
    """Layer -> the keys past which its C grows with the prefix (``grow_band`` of
    :class:`~dsaindex.runtime.paged_select.PagedCacheSelector`): the end of the longest prefix band the bundle
    records its served recall in at the layer's (C, stage 1 and what it scores, ``stage1``, default the codes);
    0 (a fixed C) where it records none, or where that band is open-ended (its recall holds to any length)."""
    table = OperatingPoints.from_metrics(metrics)
    out = {}
    for layer in sorted(candidates):
        found = [x for x in table.of(layer, topk, int(prefilter[layer]), stage1=(stage1 or {}).get(layer, "codes"))
                 if x.candidates == int(candidates[layer])]
        band = found[0].band if found else None
        end = band.split("-", 1)[1] if band and "-" in band else ""
        out[layer] = band_start(end) if end and end[0].isdigit() else 0
    return out


def describe_points(metrics: Mapping[str, float], candidates: Mapping[int, int], prefilter: Mapping[int, int],
                    topk: int, target: float = RECALL_TARGET,
                    code_bytes: Mapping[int, tuple[int, int]] | None = None,
                    grow: Mapping[int, tuple[int, int]] | None = None,
                    stage1: Mapping[int, str] | None = None) -> str:
    """What a server says at startup of its decode layers' operating points: per group of layers at the same
    (C, stage 1), the held-out recall of the exact top-``topk`` the bundle records there (the lower of all
    queries' and the longest prefix band's, whose end it names: recall past it was not measured, and a fixed
    C serves less there), and how it stands against ``target``; "not recorded" where
    the bundle has no measurement at that point (a count given by hand). With ``code_bytes`` (layer -> the
    codes' and the exact key's bytes, :func:`code_bytes_of`), the step's cost too: the share of the exact
    scan's bytes a query reads at 128K and 1M keys (:func:`step_bytes`). With ``grow`` (layer -> (band, most):
    C grows past ``band`` keys by up to ``most``, as :func:`growth_bands` and ``DSAINDEX_LONG_PREFIX=grow``
    set it), how C grows past the measured prefixes instead of "longer ones not measured". ``stage1``: what each
    layer's stage 1 scores (default the codes), named with it, with the step's expected device time a query at
    1M keys (:func:`~dsaindex.runtime.operating_points.expected_step_us`; C grown there as ``grow`` grows it,
    fixed where it gives the layer no band, as choosers rank points without ``grow``)."""
    table = OperatingPoints.from_metrics(metrics)
    groups: dict[tuple[int, int, str, str], list[int]] = {}
    for layer in sorted(candidates):
        c, p = int(candidates[layer]), int(prefilter[layer])
        kind = (stage1 or {}).get(layer, "codes")
        grown = None if grow is None else grow.get(layer, (0, 1))  # C at 1M keys: as this server grows it
        found = [x for x in table.of(layer, topk, p, stage1=kind) if x.candidates == c]
        if not found:
            said = "held-out recall not recorded"
        else:
            recall = found[0].recall
            gap = "" if recall >= target else f", {100 * (target - recall):.2f} points under the {100 * target:.2f}% target"
            # where the bundle measured it, and what C does past it (a fixed C serves longer requests less)
            reach = f" at prefixes up to {found[0].band.split('-', 1)[1]}" if found[0].band and "-" in found[0].band \
                else ""
            band, most = (grow or {}).get(layer, (0, 1))
            if reach and band and most > 1:
                reach += (f"; past {_keys(band)} C doubles with each doubling of the prefix, up to {most} x C = "
                          f"{most * c:,} past {_keys(band * most // 2)} (recall there not recorded by the bundle)")
            elif reach:
                reach += " (longer ones not measured; C stays fixed there)"
            said = f"held-out recall {_floor_pct(recall)}{reach}{gap}"
        if code_bytes is not None and layer in code_bytes:
            m, key_bytes = code_bytes[layer]
            shares = [step_bytes(n, m, c, p, key_bytes) for n in COST_KEYS]
            said += (f", a query reads {shares[0]['codes'] / shares[0]['exact']:.2f}x the exact scan's bytes at 128K "
                     f"keys, {shares[1]['codes'] / shares[1]['exact']:.2f}x at 1M")
        if stage1 is not None:
            said += f", expected step {expected_step_us(kind, p, c, grown):.1f} us a query at 1M keys (H100)"
        groups.setdefault((c, p, kind, said), []).append(layer)
    return "; ".join(f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}: C = {c}, stage 1 {p} x C"
                     f"{f' by {kind}' if stage1 is not None else ''}, {said}"
                     for (c, p, kind, said), layers in groups.items())


def _keys(n: int) -> str:
    """A key count as a prefix length: 131072 -> 128K, 1048576 -> 1M."""
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n:,}"


def per_layer(value: int | Mapping[int, int], layers: Iterable[int], what: str) -> dict[int, int]:
    """One decode setting for every layer in ``layers``, or a layer -> value mapping that must cover them all
    (a :class:`DsaIndexError` names the layers it misses). The loader's choosers and ``ServedIndex`` share it."""
    layers = list(layers)
    if not layers:
        return {}
    if isinstance(value, Mapping):
        missing = sorted(set(layers) - set(value))
        if missing:
            raise DsaIndexError(f"No {what} for decode layers {missing}.",
                                f"give every layer with a pq artifact its {what}, or one for all.")
        return {layer: int(value[layer]) for layer in layers}
    return dict.fromkeys(layers, int(value))


def per_layer_text(value: str | Mapping[int, str], layers: Iterable[int], what: str,
                   allowed: tuple[str, ...]) -> dict[int, str]:
    """:func:`per_layer` for a setting in words (one of ``allowed``): one for every layer, or a layer -> word
    mapping that covers them all."""
    layers = list(layers)
    given = value if isinstance(value, Mapping) else dict.fromkeys(layers, value)
    missing = sorted(set(layers) - set(given))
    if missing:
        raise DsaIndexError(f"No {what} for decode layers {missing}.",
                            f"give every layer with a pq artifact its {what}, or one for all.")
    bad = sorted({str(given[layer]) for layer in layers} - set(allowed))
    if bad:
        raise DsaIndexError(f"{what} {', '.join(bad)} is not one of {', '.join(allowed)}.",
                            f"give {what} as one of {', '.join(allowed)}.")
    return {layer: str(given[layer]) for layer in layers}


def candidates_per_layer(setting: str | int | None, loaded: LoadedArtifacts, topk: int, default: int,
                         target: float = RECALL_TARGET, layers: list[int] | None = None,
                         prefilter: int | None = None) -> dict[int, int]:
    """C for each decode layer of ``loaded`` (or of ``layers`` among them), from a server's setting as text or
    number (:func:`dsaindex.runtime.settings.parse_candidates`): a count (every layer), ``auto``
    (:func:`candidates_for_recall` at ``target``, for a step whose stage 1 keeps ``prefilter`` x C keys), or
    none / 0 / empty (``default``)."""
    parsed = parse_candidates(setting)
    if parsed == "auto":
        return candidates_for_recall(loaded.manifest.metrics, _decode_layers(loaded, layers), topk, target,
                                     str(loaded.path), prefilter)
    return dict.fromkeys(_decode_layers(loaded, layers), parsed or default)


IVF_RECALL = re.compile(r"^mean/ivf-learned/recall@(\d+)$")


def ivf_budget_for_recall(metrics: Mapping[str, float], target: float, source: str = "the bundle") -> int | None:
    """The smallest IVF budget (candidates per prefill query) whose held-out recall with learned routing, as
    an ivf bundle records it (``mean/ivf-learned/recall@B``, the mean over its layers), reaches ``target``;
    None where the bundle records none (trained before it was measured). Raises :class:`DsaIndexError`
    naming the best recorded budget where none reaches it."""
    recorded = sorted((int(m.group(1)), float(v)) for k, v in metrics.items() if (m := IVF_RECALL.match(k)))
    if not recorded:
        return None
    for budget, recall in recorded:
        if recall >= target:
            return budget
    budget, recall = max(recorded, key=lambda br: br[1])
    raise DsaIndexError(f"{source} records a held-out prefill recall of at most {_floor_pct(recall)} (IVF budget "
                        f"{budget:,}), under the {100 * target:.2f}% target.",
                        f"pass --ivf-budget N (e.g. {budget:,}, at that recall) or a lower --ivf-recall-target, "
                        "or train the ivf bundle with larger --budgets (`dsaindex train ivf`).")
