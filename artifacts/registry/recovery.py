"""Unfinished registrations: recognising them, how aliases look past them, and undoing them.

A new version carries the tag ``dsaindex.registering`` (when it started, which version was ``@candidate``
before) until the last step of :func:`~dsaindex.artifacts.registry.register.register_bundle` removes it;
nothing resolves to, lists or counts a version with that tag. A failed step is undone at once
(:func:`_roll_back`). If the process dies instead (kill -9, power), the next registry command of any
process undoes what it left (:func:`_settle`): it deletes the version, moves ``@candidate`` back, marks
the run and its logged models failed. On sqlite, one registration at a time holds a file lock beside the
database for its whole length, so a command that takes the lock knows every unfinished registration it
finds is dead; on a tracking server (no lock) only registrations older than :data:`STALE_VERSION_S`
(a version) or :data:`STALE_RUN_S` (a run without one) are undone.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsaindex.artifacts.registry.tracking import (
    CANDIDATE,
    DEFAULT_EXPERIMENT,
    REGISTERING,
    TAG,
    _call,
    _error_code,
)

STALE_VERSION_S = 900.0
STALE_RUN_S = 24 * 3600.0


def _registering(tags: dict[str, str] | None) -> dict[str, Any] | None:
    """The registration record of an unfinished version (``{started, previous_candidate, ...}``), else None."""
    text = (tags or {}).get(REGISTERING)
    if text is None:
        return None
    try:
        info = json.loads(text)
    except ValueError:
        info = None
    return info if isinstance(info, dict) else {}


def _unfinished(client, name: str) -> dict[str, dict[str, Any]]:
    """{version: registration record} of the versions of ``name`` still carrying the registering tag."""
    found = _call(client.search_model_versions, f"name='{name}' and tags.`{REGISTERING}` LIKE '%'")
    return {str(mv.version): _registering(mv.tags) or {} for mv in found}


def _effective_aliases(aliases: dict[str, Any], unfinished: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Aliases as readers see them: one on an unfinished version falls back to the version the
    registration moved ``@candidate`` from (or disappears)."""
    out: dict[str, str] = {}
    for alias, version in aliases.items():
        version = str(version)
        if version not in unfinished:
            out[alias] = version
            continue
        before = unfinished[version].get("previous_candidate") if alias == CANDIDATE else None
        if before is not None and str(before) not in unfinished:
            out[alias] = str(before)
    return out


def _settle(client, uri: str, everything: bool) -> None:
    """Undo registrations that a dead process left unfinished: delete their versions (``@candidate``
    goes back where it was), mark their runs and logged models FAILED.

    ``everything``: the caller holds the sqlite registration lock, so no registration is running and all
    unfinished ones are dead. Otherwise (tracking servers) only those older than :data:`STALE_VERSION_S`
    (versions) or :data:`STALE_RUN_S` (runs of the default experiment without a version) are undone.
    Never raises for a registry that cannot search by tag.
    """
    from mlflow.exceptions import MlflowException

    now_ms = time.time() * 1000
    try:
        versions = _call(client.search_model_versions, f"tags.`{REGISTERING}` LIKE '%'")
    except MlflowException:
        versions = []
    for mv in versions:
        info = _registering(mv.tags) or {}
        started = float(info.get("started") or mv.creation_timestamp or 0)
        if not everything and now_ms - started < STALE_VERSION_S * 1000:
            continue
        name, version = mv.name, str(mv.version)
        candidate = None
        with contextlib.suppress(Exception):
            candidate = _alias_version(client, name, CANDIDATE)
        restore = info.get("previous_candidate") if candidate == version else None
        _roll_back(client, name, version, None if restore is None else str(restore),
                   (mv.tags or {}).get(TAG + "model_id"), mv.run_id)
    try:
        exp = _call(client.get_experiment_by_name, DEFAULT_EXPERIMENT)
        if exp is None:
            return
        runs = _call(client.search_runs, [exp.experiment_id],
                     filter_string=f"attributes.status = 'RUNNING' and tags.`{TAG}bundle_id` LIKE '%'")
    except MlflowException:
        return
    for run in runs:
        if not everything and now_ms - float(run.info.start_time or 0) < STALE_RUN_S * 1000:
            continue
        _fail_run(client, exp.experiment_id, run.info.run_id)


def _fail_run(client, experiment_id: str, run_id: str) -> None:
    """Mark a dead registration's run FAILED and its logged models that are not FAILED too; never raises."""
    from mlflow.entities import LoggedModelStatus

    with contextlib.suppress(Exception):
        for model in _call(client.search_logged_models, [experiment_id], filter_string=f"source_run_id = '{run_id}'"):
            if str(model.status) != "FAILED":
                _call(client.finalize_logged_model, model.model_id, LoggedModelStatus.FAILED)
            _drop_artifacts(client, model.model_id)
    with contextlib.suppress(Exception):
        _call(client.set_terminated, run_id, "FAILED")


def _drop_artifacts(client, model_id: str) -> None:
    """Delete the artifact copy of a failed registration's logged model where it is a local folder (a file
    store's or a sqlite store's artifacts; a remote store keeps it for ``mlflow gc``); never raises."""
    import shutil
    from urllib.parse import unquote, urlparse

    with contextlib.suppress(Exception):
        location = str(_call(client.get_logged_model, model_id).artifact_location or "")
        parsed = urlparse(location)
        if parsed.scheme in ("", "file"):
            folder = Path(unquote(parsed.path if parsed.scheme else location))
            if folder.is_dir() and model_id in folder.parts:  # the model's own folder, nothing above it
                shutil.rmtree(folder, ignore_errors=True)


def _roll_back(client, name: str, version: str | None, previous_candidate: str | None,
               model_id: str | None, run_id: str | None) -> None:
    """Undo a failed registration as far as possible; never raises."""
    from mlflow.entities import LoggedModelStatus

    # In this order a process killed in between leaves what the next command's cleanup finishes: the
    # version keeps its registering tag until deleted, the run stays RUNNING until marked.
    steps: list[tuple[Callable[..., Any], tuple]] = []
    if version is not None:
        if previous_candidate is not None:
            steps.append((client.set_registered_model_alias, (name, CANDIDATE, previous_candidate)))
        steps.append((client.delete_model_version, (name, version)))
    if model_id is not None:
        steps.append((client.finalize_logged_model, (model_id, LoggedModelStatus.FAILED)))
        steps.append((_drop_artifacts, (client, model_id)))
    if run_id:
        steps.append((client.set_terminated, (run_id, "FAILED")))
    for fn, args in steps:
        with contextlib.suppress(Exception):
            _call(fn, *args)


def _alias_version(client, name: str, alias: str) -> str | None:
    try:
        return str(_call(client.get_model_version_by_alias, name, alias).version)
    except Exception as err:  # noqa: BLE001
        if "NOT_EXIST" in _error_code(err) or "not found" in str(err).lower():
            return None
        raise
