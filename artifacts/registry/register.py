"""Registering a bundle: an MLflow run with its params, metrics, plots and manifest, a LoggedModel
holding the bundle folder, and a new version of the target model's registered name with the alias
``candidate``.

Registration is all or nothing: if a step fails the version is deleted, the logged model and run are
marked failed and a :class:`DsaIndexError` is raised (see :mod:`.recovery` for a process that dies
instead). Registering a bundle whose ``bundle_id`` is already registered returns that version.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsaindex.artifacts.registry.names import _flatten, _metric_key, registered_name
from dsaindex.artifacts.registry.recovery import (
    PROCESS,
    STALE_VERSION_S,
    _alias_version,
    _no_answer,
    _point_candidate,
    _registering,
    _roll_back,
)
from dsaindex.artifacts.registry.session import _session
from dsaindex.artifacts.registry.tracking import (
    CANDIDATE,
    DEFAULT_EXPERIMENT,
    REGISTERING,
    TAG,
    _call,
    _create_once,
    _credentials_error,
    _error_code,
    _interrupts_between_calls,
    _is_http,
    _registration_lock,
    _short,
    artifact_root,
    resolve_tracking_uri,
    sqlite_path,
)
from dsaindex.artifacts.registry.versions import _aliases_by_version, _registered
from dsaindex.errors import DsaIndexError

if TYPE_CHECKING:
    from dsaindex.artifacts.bundle import BundleManifest

# How long the undoing of a registration cut short by Ctrl-C may take; after a store that stopped answering
# (a tracking server let one request and its retry time out) a shorter try: the next command finishes it.
ROLLBACK_S = 6.0
NO_ANSWER_ROLLBACK_S = 3.0
# a tag only this registration's run and logged model carry: a create whose answer was lost is looked up by it
ATTEMPT = TAG + "attempt"


def _left_note(uri: str) -> str:
    """What a rollback that ran out of time leaves, and who finishes it."""
    what = "What it wrote stays unfinished (hidden from every reader)"
    if sqlite_path(uri) is not None:
        return f"{what}; the next registry command on {uri} undoes it."
    return (f"{what}; the next registry command on this machine undoes it, one from any other machine once it is "
            f"{STALE_VERSION_S / 60:.0f} minutes old.")


def _first(found: Any) -> Any:
    """The first of a search's results, or None."""
    return found[0] if len(found) else None


def _experiment_id(client, experiment: str, tracking_uri: str) -> str:
    exp = _call(client.get_experiment_by_name, experiment)
    if exp is not None:
        return exp.experiment_id
    root = artifact_root(tracking_uri)
    location = (root / experiment).as_uri() if root is not None else None
    try:
        return _create_once(lambda: client.create_experiment(experiment, artifact_location=location),
                            lambda: getattr(client.get_experiment_by_name(experiment), "experiment_id", None))
    except Exception as err:  # noqa: BLE001 - a racing process may have created it
        if "ALREADY_EXISTS" not in _error_code(err):
            raise
        return _call(client.get_experiment_by_name, experiment).experiment_id


def register_bundle(
    bundle_path: str | Path,
    params: dict[str, Any],
    metrics: dict[str, float],
    plots: list[Path],
    tracking_uri: str | None = None,
    experiment: str = DEFAULT_EXPERIMENT,
) -> dict[str, Any]:
    """Log a training and register its bundle; returns ``{name, version, run_id, model_id, alias, existing}``.

    Parameters
    ----------
    bundle_path : a bundle written by :func:`dsaindex.artifacts.bundle.write_bundle` (a folder, or an
        ``s3://`` prefix, downloaded into a temporary folder for MLflow); it is verified
        (every checksum) before anything is logged.
    params : training parameters (nested dicts become ``a.b`` keys), logged with the manifest's params.
    metrics : training metrics, logged with the manifest's metrics; ``layer<id>/<name>`` are per layer.
    plots : image (or any) files, logged as run artifacts under ``plots/``.
    tracking_uri, experiment : where to log; see the module docstring for the default.

    The new version gets the alias ``candidate`` (``alias`` None where a registration running at the same
    time made a newer version, which then holds it: :func:`~.recovery._point_candidate`). Any failure
    leaves no version behind and raises :class:`DsaIndexError` (the logged model and the run are marked
    failed). A bundle whose ``bundle_id``
    is already registered under its name is not registered again: that version is returned with
    ``existing=True`` and ``alias`` one of its aliases (``candidate`` first) or None.
    """
    from dsaindex.artifacts.bundle import local_bundle

    # MLflow logs artifacts from a folder: an s3:// bundle is downloaded (and verified) into a temporary one
    with local_bundle(bundle_path) as folder:
        return _register_folder(folder, str(bundle_path), params, metrics, plots, tracking_uri, experiment)


def _register_folder(bundle_path: Path, shown: str, params: dict[str, Any], metrics: dict[str, float],
                     plots: list[Path], tracking_uri: str | None, experiment: str) -> dict[str, Any]:
    """:func:`register_bundle` of the local bundle folder ``bundle_path``; ``shown`` names the bundle as the
    user gave it (in the commands an error suggests)."""
    from mlflow.entities import LoggedModelStatus, Metric, Param

    from dsaindex.artifacts.bundle import read_bundle

    manifest, _ = read_bundle(bundle_path, verify=True)
    for plot in plots:
        if not Path(plot).is_file():
            raise DsaIndexError(f"Plot file {plot} does not exist.", "pass existing files, or no plots.")
    name = registered_name(manifest.model)
    uri = resolve_tracking_uri(tracking_uri)
    all_params = _flatten({**manifest.params, **params})
    all_metrics = {**manifest.metrics, **{k: float(v) for k, v in metrics.items()}}
    command = f"dsaindex registry register {shown} --tracking-uri {uri}"
    again = f"check that the tracking store is reachable and writable, then register again: {command}"
    attempt = uuid.uuid4().hex

    with contextlib.ExitStack() as stack:
        stack.enter_context(_interrupts_between_calls())  # Ctrl-C never cuts an MLflow write in two
        try:
            stack.enter_context(_registration_lock(uri))
            client = stack.enter_context(_session(uri, create=True, lock_init=False))
        except DsaIndexError as err:
            raise DsaIndexError(f"{err.problem} Nothing was registered.",
                                f"{err.fix.rstrip('.')}; then register the bundle: {command}") from err
        existing = _registered_bundle(client, name, manifest.bundle_id)
        if existing is not None:
            return existing
        try:
            exp_id = _experiment_id(client, experiment, uri)
            run = _create_once(
                lambda: client.create_run(exp_id, run_name=f"train-{manifest.bundle_id}", tags={
                    TAG + "bundle_id": manifest.bundle_id, TAG + "registered_name": name, ATTEMPT: attempt,
                    PROCESS: json.dumps({"pid": os.getpid(), "host": socket.gethostname()})}),
                lambda: _first(client.search_runs([exp_id], f"tags.`{ATTEMPT}` = '{attempt}'", max_results=1)))
        except Exception as err:  # noqa: BLE001 - nothing exists yet, nothing to roll back
            refused = _credentials_error(err, uri)
            if refused is not None:
                raise DsaIndexError(f"{refused.problem} Nothing was registered.", refused.fix) from None
            raise DsaIndexError(
                f"Cannot start a run in {uri} ({type(err).__name__}: {_short(err)}); nothing was registered.",
                again,
            ) from err
        run_id = run.info.run_id
        model_id: str | None = None
        version: str | None = None
        previous_candidate: str | None = None
        try:
            model = _create_once(
                lambda: client.create_logged_model(
                    exp_id, name=f"bundle-{manifest.bundle_id}", source_run_id=run_id,
                    tags={TAG + "bundle_id": manifest.bundle_id, TAG + "registered_name": name, ATTEMPT: attempt},
                    params={"basis": manifest.basis, "key_format": manifest.key_format,
                            "schema": f"{manifest.schema_id}/{manifest.schema_version}"},
                    model_type="dsaindex-bundle"),
                lambda: _first(client.search_logged_models([exp_id], f"tags.`{ATTEMPT}` = '{attempt}'",
                                                           max_results=1)))
            model_id = model.model_id
            _call(client.log_model_artifacts, model_id, str(bundle_path))
            now = int(time.time() * 1000)
            param_items = [Param(k, v) for k, v in all_params.items()]
            for i in range(0, len(param_items), 100):
                _call(client.log_batch, run_id, params=param_items[i : i + 100])
            metric_items = [Metric(_metric_key(k), v, now, 0, model_id=model_id) for k, v in all_metrics.items()]
            for i in range(0, len(metric_items), 1000):
                _call(client.log_batch, run_id, metrics=metric_items[i : i + 1000])
            with tempfile.TemporaryDirectory() as tmp:
                manifest_file = Path(tmp) / "bundle_manifest.json"
                manifest_file.write_text(manifest.model_dump_json(indent=2))
                _call(client.log_artifact, run_id, str(manifest_file))
            for plot in plots:
                _call(client.log_artifact, run_id, str(plot), "plots")
            _call(client.finalize_logged_model, model_id, LoggedModelStatus.READY)

            try:  # a try whose outcome is unknown is sent again: a second one meets ALREADY_EXISTS
                _create_once(lambda: client.create_registered_model(
                    name, tags={TAG + "model_name": manifest.model.name, TAG + "family": manifest.model.family},
                    description=f"dsaindex artifact bundles for {manifest.model.name} "
                                f"(weights {manifest.model.weights_digest})."), lambda: None)
            except Exception as err:  # noqa: BLE001
                if "ALREADY_EXISTS" not in _error_code(err):
                    raise
            previous_candidate = _alias_version(client, name, CANDIDATE)
            # Unfinished until the last step: readers skip it, the next command undoes it if this dies.
            record = {"started": int(time.time() * 1000), "previous_candidate": previous_candidate,
                      "pid": os.getpid(), "host": socket.gethostname()}
            mv = _create_once(
                lambda: client.create_model_version(name, source=f"models:/{model_id}", run_id=run_id,
                                                    model_id=model_id, tags={**_version_tags(manifest, model_id),
                                                                             REGISTERING: json.dumps(record)}),
                lambda: _first(client.search_model_versions(f"name='{name}' and run_id='{run_id}'")))
            version = str(mv.version)
            # the newest version of the name, this one unless another registration made a newer one meanwhile
            candidate = _point_candidate(client, name)
            status = _call(client.get_model_version, name, version).status
            if str(status) != "READY":
                raise RuntimeError(f"model version {name}/{version} is {status}, not READY")
            _call(client.set_terminated, run_id, "FINISHED")
            _call(client.delete_model_version_tag, name, version, REGISTERING)
        except BaseException as err:
            interrupted = not isinstance(err, Exception)
            budget_s = (ROLLBACK_S if interrupted or (_no_answer(err) and not _is_http(uri)) else
                        NO_ANSWER_ROLLBACK_S if _no_answer(err) else None)
            undone = _roll_back(client, name, version, previous_candidate, model_id, run_id, budget_s=budget_s)
            left = "" if undone else " " + _left_note(uri)
            if interrupted:
                if not undone:
                    print(f"registry: interrupted.{left}", file=sys.stderr, flush=True)
                raise
            if isinstance(err, DsaIndexError):
                if undone:
                    raise
                raise type(err)(err.problem + left, err.fix) from err
            nothing = "nothing was registered" if undone else "the registration is not complete"
            refused = _credentials_error(err, uri)
            if refused is not None:
                raise DsaIndexError(f"{refused.problem.rstrip('.')}; {nothing}.{left}", refused.fix) from None
            raise DsaIndexError(
                f"Registering {shown} in {uri} failed ({type(err).__name__}: {_short(err)}); {nothing}.{left}",
                again,
            ) from err
    return {"name": name, "version": int(version), "run_id": run_id, "model_id": model_id,
            "alias": CANDIDATE if candidate == version else None, "existing": False}


def _registered_bundle(client, name: str, bundle_id: str) -> dict[str, Any] | None:
    """The finished version of ``name`` holding bundle ``bundle_id`` (as :func:`register_bundle` returns
    it, ``existing=True``), or None."""
    found = [mv for mv in _call(client.search_model_versions, f"name='{name}' and tags.`{TAG}bundle_id` = '{bundle_id}'")
             if _registering(mv.tags) is None]
    if not found:
        return None
    mv = max(found, key=lambda v: int(v.version))
    mine = _aliases_by_version(dict(_registered(client, name).aliases or {})).get(str(mv.version), [])
    alias = CANDIDATE if CANDIDATE in mine else (mine[0] if mine else None)
    return {"name": name, "version": int(mv.version), "run_id": mv.run_id,
            "model_id": (mv.tags or {}).get(TAG + "model_id"), "alias": alias, "existing": True}


def _version_tags(manifest: BundleManifest, model_id: str) -> dict[str, str]:
    return {
        TAG + "bundle_id": manifest.bundle_id,
        TAG + "model_id": model_id,
        TAG + "model_name": manifest.model.name,
        TAG + "family": manifest.model.family,
        TAG + "layers": ",".join(str(i) for i in manifest.layer_ids),
        TAG + "kinds": ",".join(sorted({a.kind for a in manifest.layers.values()})),
        TAG + "basis": manifest.basis,
        TAG + "key_format": manifest.key_format,
        TAG + "schema": f"{manifest.schema_id}/{manifest.schema_version}",
    }
