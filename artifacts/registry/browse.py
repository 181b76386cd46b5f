"""Reading the registry through MLflow's client API (the same code on a sqlite or file store and on a
tracking server): the list of versions (:func:`list_versions`), one version in full (:func:`show`), what
differs between two versions (:func:`diff`) and the metrics a listing shows first (:func:`headline_metrics`)."""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsaindex.artifacts.registry.names import _check_name, _metric_key
from dsaindex.artifacts.registry.recovery import _effective_aliases, _registering, _unfinished
from dsaindex.artifacts.registry.session import _session
from dsaindex.artifacts.registry.tracking import (
    TAG,
    _call,
    _download,
    _no_database,
    resolve_tracking_uri,
    sqlite_path,
)
from dsaindex.artifacts.registry.versions import _aliases_by_version, _registered, _resolve
from dsaindex.errors import CorruptBundleError

if TYPE_CHECKING:
    from dsaindex.artifacts.bundle import BundleManifest

# What `registry list` shows first: recall at the default candidate count / budget (DESIGN.md).
HEADLINE_METRICS = (
    "mean/k512/rerank@2048",  # PQ: top-2048 by PQ score, exact rerank, recall of the exact top-512
    "mean/k512/filter@2048",  # the same behind LeanSparse's miss filter
    "mean/ivf-learned/recall@16384",  # IVF prefill at a 16K budget, learned representatives
    "mean/ivf/recall@16384",
    "mean/blocks/recall@16384",
)
_LAYER_METRIC = re.compile(r"^layer(\d+)/(.+)$")


def headline_metrics(metrics: dict[str, float], count: int = 3) -> list[tuple[str, float]]:
    """Up to ``count`` (label, value) pairs to show for a version: those of :data:`HEADLINE_METRICS`
    present (under their original or MLflow-safe names), else recall-like metrics (rerank, filter,
    recall, by name), else the first by name; never query counts. Labels drop ``mean/``."""
    picked = []
    for name in HEADLINE_METRICS:
        for key in (name, _metric_key(name)):
            if key in metrics:
                picked.append((name.removeprefix("mean/"), metrics[key]))
                break
    if not picked:
        kinds = ("rerank", "filter", "recall")
        rank = {k: next((i for i, kind in enumerate(kinds) if kind in k), len(kinds)) for k in metrics}
        picked = [(k.removeprefix("mean/"), metrics[k]) for k in sorted(metrics, key=lambda k: (rank[k], k))
                  if not k.endswith("/queries")]
    return picked[:count]


def _iso(ms: int | None) -> str | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")


def _row(name: str, version: Any, aliases: list[str], created_ms: int | None, status: Any,
         tags: dict[str, str], metrics: dict[str, float], run_id: str | None) -> dict[str, Any]:
    """One row of :func:`list_versions`."""
    layers = [int(x) for x in tags.get(TAG + "layers", "").split(",") if x.strip().isdigit()]
    return {
        "name": name,
        "version": int(version),
        "aliases": aliases,
        "created": _iso(created_ms),
        "status": str(status),
        "family": tags.get(TAG + "family"),
        "model": tags.get(TAG + "model_name"),
        "layers": layers,
        "kinds": [k for k in tags.get(TAG + "kinds", "").split(",") if k],
        "metrics": {k: v for k, v in sorted(metrics.items()) if not _LAYER_METRIC.match(k)},
        "bundle_id": tags.get(TAG + "bundle_id"),
        "run_id": run_id,
        "model_id": tags.get(TAG + "model_id"),
    }


def _version_row(client, mv, aliases: dict[str, str]) -> dict[str, Any]:
    metrics: dict[str, float] = {}
    if mv.run_id:
        with contextlib.suppress(Exception):
            metrics = dict(_call(client.get_run, mv.run_id).data.metrics)
    return _row(mv.name, mv.version, _aliases_by_version(aliases).get(str(mv.version), []),
                mv.creation_timestamp, mv.status, dict(mv.tags or {}), metrics, mv.run_id)


def list_versions(name: str | None = None, tracking_uri: str | None = None) -> list[dict[str, Any]]:
    """Every registered version (of ``name``, or of all names), newest first within a name; versions
    whose registration is unfinished are left out.

    Each row: name, version, aliases, created (ISO UTC), status, family, model, layers, kinds,
    metrics (the aggregate ones; per-layer metrics are in :func:`show`), bundle_id, run_id, model_id.
    An absent sqlite store lists nothing.
    """
    uri = resolve_tracking_uri(tracking_uri)
    db = sqlite_path(uri)
    if db is not None and not db.exists():
        if name is not None:
            raise _no_database(uri, db)
        return []
    if name is not None:
        _check_name(name)
    with _session(uri) as client:
        models = [_registered(client, name)] if name else list(_call(client.search_registered_models, max_results=1000))
        rows = []
        for rm in sorted(models, key=lambda m: m.name):
            versions = _call(client.search_model_versions, f"name='{rm.name}'")
            unfinished = {str(v.version): _registering(v.tags) for v in versions if _registering(v.tags) is not None}
            aliases = _effective_aliases(dict(rm.aliases or {}), unfinished)
            for mv in sorted(versions, key=lambda v: -int(v.version)):
                if str(mv.version) not in unfinished:
                    rows.append(_version_row(client, mv, aliases))
    return rows


def _manifest_of_version(client, name: str, version: str) -> BundleManifest:
    """The bundle manifest of a version, read from the group metadata (``zarr.json``) of its artifacts."""
    from dsaindex.artifacts.bundle import BundleManifest

    location = _call(client.get_model_version_download_uri, name, version)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            meta = json.loads(_download(location.rstrip("/") + "/zarr.json", Path(tmp)).read_text())
        except Exception as err:  # noqa: BLE001
            raise CorruptBundleError(
                f"{name} version {version} has no readable bundle metadata at {location} ({type(err).__name__}).",
                "register the bundle again; the stored artifacts are missing or damaged.",
            ) from None
    try:
        return BundleManifest.model_validate(meta["attributes"]["dsaindex"])
    except Exception as err:  # noqa: BLE001
        raise CorruptBundleError(
            f"{name} version {version} holds an invalid bundle manifest ({type(err).__name__}).",
            "register the bundle again with this dsaindex version.",
        ) from None


def show(name: str, ref: str, tracking_uri: str | None = None) -> dict[str, Any]:
    """One version in full: ``{name, version, aliases, created, status, run_id, model_id, source,
    metrics, params, lineage, manifest}``. ``metrics`` are the manifest's (original names) plus any
    metric logged with the run only; ``params`` are the run's logged params."""
    with _session(tracking_uri) as client:
        rm = _registered(client, name)
        version = _resolve(client, name, ref)
        mv = _call(client.get_model_version, name, version)
        manifest = _manifest_of_version(client, name, version)
        run = _call(client.get_run, mv.run_id) if mv.run_id else None
        row = _version_row(client, mv, _effective_aliases(dict(rm.aliases or {}), _unfinished(client, name)))
    logged = dict(run.data.metrics) if run else {}
    metrics = dict(manifest.metrics)
    known = {_metric_key(k) for k in metrics}
    metrics.update({k: v for k, v in logged.items() if k not in known})
    return {
        "name": name,
        "version": int(version),
        "aliases": row["aliases"],
        "created": row["created"],
        "status": row["status"],
        "run_id": mv.run_id,
        "model_id": row["model_id"],
        "source": mv.source,
        "metrics": dict(sorted(metrics.items())),
        "params": dict(sorted((run.data.params if run else {}).items())),
        "lineage": manifest.lineage.model_dump(),
        "manifest": manifest.model_dump(mode="json"),
    }


def _differs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, list[Any]]:
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def diff(name: str, ref_a: str, ref_b: str, tracking_uri: str | None = None) -> dict[str, Any]:
    """What differs between two versions of ``name``.

    Returns ``{"a": version, "b": version, "bundle": {field: [a, b]}, "params": {key: [a, b]},
    "metrics": {key: [a, b]}, "layers": {layer id: {"kind": [a, b], "params": {...}, "metrics": {...},
    "arrays": {array: [[shape, dtype] | None, ...]}}}}``; only differing entries appear, a layer absent on one
    side shows ``"present": [bool, bool]``. Metrics named ``layer<id>/<metric>`` count per layer.
    """
    with _session(tracking_uri) as client:
        va, vb = _resolve(client, name, ref_a), _resolve(client, name, ref_b)
        ma, mb = _manifest_of_version(client, name, va), _manifest_of_version(client, name, vb)

    def split(metrics: dict[str, float]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        overall: dict[str, float] = {}
        per_layer: dict[str, dict[str, float]] = {}
        for key, value in metrics.items():
            m = _LAYER_METRIC.match(key)
            if m:
                per_layer.setdefault(m.group(1), {})[m.group(2)] = value
            else:
                overall[key] = value
        return overall, per_layer

    overall_a, layer_metrics_a = split(ma.metrics)
    overall_b, layer_metrics_b = split(mb.metrics)
    out: dict[str, Any] = {
        "name": name,
        "a": int(va),
        "b": int(vb),
        "bundle": _differs(
            {"model": ma.model.model_dump(), "basis": ma.basis, "key_format": ma.key_format,
             "lineage": ma.lineage.model_dump(), "schema_version": ma.schema_version},
            {"model": mb.model.model_dump(), "basis": mb.basis, "key_format": mb.key_format,
             "lineage": mb.lineage.model_dump(), "schema_version": mb.schema_version},
        ),
        "params": _differs(ma.params, mb.params),
        "metrics": _differs(overall_a, overall_b),
        "layers": {},
    }
    for key in sorted(set(ma.layers) | set(mb.layers) | set(layer_metrics_a) | set(layer_metrics_b), key=int):
        la, lb = ma.layers.get(key), mb.layers.get(key)
        entry: dict[str, Any] = {}
        if (la is None) != (lb is None):
            entry["present"] = [la is not None, lb is not None]
        if la is not None and lb is not None and la.kind != lb.kind:
            entry["kind"] = [la.kind, lb.kind]
        params = _differs(la.params if la else {}, lb.params if lb else {})
        metrics = _differs(layer_metrics_a.get(key, {}), layer_metrics_b.get(key, {}))
        arrays = _differs(
            {n: [r.shape, r.dtype] for n, r in (la.arrays if la else {}).items()},
            {n: [r.shape, r.dtype] for n, r in (lb.arrays if lb else {}).items()},
        )
        for label, part in (("params", params), ("metrics", metrics), ("arrays", arrays)):
            if part:
                entry[label] = part
        if entry:
            out["layers"][key] = entry
    return out
