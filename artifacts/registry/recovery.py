"""Unfinished registrations: recognising them, how aliases look past them, and undoing them.

A new version carries the tag ``dsaindex.registering`` (when it started, which version was ``@candidate``
before) until the last step of :func:`~dsaindex.artifacts.registry.register.register_bundle` removes it;
nothing resolves to, lists or counts a version with that tag. A failed step is undone at once
(:func:`_roll_back`). If the process dies instead (kill -9, power), the next registry command of any
process undoes what it left (:func:`_settle`): it deletes the version, moves ``@candidate`` back, marks
the run and its logged models failed. On sqlite, one registration at a time holds a file lock beside the
database for its whole length, so a command that takes the lock knows every unfinished registration it
finds is dead; on a tracking server (no lock) a version is undone once its record names a process of this
machine that no longer runs (its ``pid`` and ``host``), or is older than :data:`STALE_VERSION_S`; a run
without a version likewise (its :data:`PROCESS` tag), or once older than :data:`STALE_RUN_S`.

``@candidate`` names the newest version that no rollback has given up (:data:`ABANDONED`). MLflow has no
compare-and-set for aliases, so every writer of it (a registration's last steps, a rollback) converges
instead of writing once (:func:`_point_candidate`): it lists the versions, points the alias at that newest
one, and lists again until a listing made after its last write agrees. Two registrations at once on a
tracking server (no lock) so end with ``@candidate`` on the higher of their versions, whichever writes last.
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
    _set_alias,
)

# the run tag naming the registering process ({"pid", "host"}): its run is undone once that process is gone
PROCESS = TAG + "process"
# the version tag a rollback sets first: the version no longer counts for @candidate, before it is deleted
ABANDONED = TAG + "abandoned"
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
        if not everything and now_ms - started < STALE_VERSION_S * 1000 and not _dead_here(info):
            continue
        restore = info.get("previous_candidate")
        _roll_back(client, mv.name, str(mv.version), None if restore is None else str(restore),
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
            try:
                process = json.loads((run.data.tags or {}).get(PROCESS) or "{}")
            except ValueError:
                process = {}
            if not (isinstance(process, dict) and _dead_here(process)):
                continue
        _fail_run(client, exp.experiment_id, run.info.run_id)


def _dead_here(info: dict[str, Any]) -> bool:
    """Whether a registration record names a process of this machine that no longer runs."""
    import os
    import socket

    pid = info.get("pid")
    if info.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it runs, as another user
        return False
    return False


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


@contextlib.contextmanager
def _short_http(seconds: float):
    """MLflow's HTTP requests within: one try each, at most ``seconds`` (a rollback must not wait minutes
    on a server that stopped answering)."""
    import os

    keys = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, int(seconds))), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _roll_back(client, name: str, version: str | None, previous_candidate: str | None,
               model_id: str | None, run_id: str | None, budget_s: float | None = None) -> bool:
    """Undo a failed registration as far as possible within ``budget_s`` seconds (None: no bound);
    never raises. ``@candidate`` on the version goes back to ``previous_candidate``, or onto a newer
    version registered meanwhile (:func:`_give_back_candidate`). Returns whether every step was done; what
    is left keeps its registering tag (readers skip it) and a later command's :func:`_settle` finishes it.
    After a request that timed out, the first step that fails for want of an answer ends the rollback (the
    server is not answering)."""
    from mlflow.entities import LoggedModelStatus

    # In this order a process killed in between leaves what the next command's cleanup finishes: the
    # version keeps its registering tag until deleted, the run stays RUNNING until marked.
    steps: list[tuple[Callable[..., Any], tuple]] = []
    if version is not None:  # given up first, so that every writer of @candidate looks past it from then on
        steps.append((client.set_model_version_tag, (name, version, ABANDONED, "true")))
        steps.append((_give_back_candidate, (client, name, version, previous_candidate)))
        steps.append((client.delete_model_version, (name, version)))
    if model_id is not None:
        steps.append((client.finalize_logged_model, (model_id, LoggedModelStatus.FAILED)))
        steps.append((_drop_artifacts, (client, model_id)))
    if run_id:
        steps.append((client.set_terminated, (run_id, "FAILED")))
    deadline = None if budget_s is None else time.monotonic() + budget_s
    for fn, args in steps:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0.5:
            return False
        try:
            with _short_http(left) if left is not None else contextlib.nullcontext():
                _call(fn, *args, attempts=8 if left is None else 2)
        except Exception as err:  # noqa: BLE001
            if left is not None and _no_answer(err):
                return False
    return True


def _no_answer(err: BaseException) -> bool:
    """Whether ``err`` says the store did not answer (a timeout, a refused or dropped connection, sqlite
    busy), as opposed to answering with an error."""
    text = str(err).lower()
    return any(s in text for s in ("timed out", "timeout", "failed with exception", "connection", "database is locked"))


def _alias_version(client, name: str, alias: str) -> str | None:
    try:
        return str(_call(client.get_model_version_by_alias, name, alias).version)
    except Exception as err:  # noqa: BLE001
        if "NOT_EXIST" in _error_code(err) or "not found" in str(err).lower():
            return None
        raise


def _give_back_candidate(client, name: str, version: str, previous_candidate: str | None) -> None:
    """Where ``@candidate`` is on ``version`` (already :data:`ABANDONED`), move it back to
    ``previous_candidate``, or onto a newer version registered meanwhile (:func:`_point_candidate`); an alias
    elsewhere (moved by a newer registration, or by hand) is left alone. A writer that reads the versions
    before the mark and writes ``version`` after this check reads them again after its write, sees the mark
    and moves the alias on itself."""
    if _alias_version(client, name, CANDIDATE) == str(version):
        _point_candidate(client, name, previous_candidate)


def _point_candidate(client, name: str, floor: str | None = None, rounds: int = 20) -> str | None:
    """Point ``@candidate`` of ``name`` at the newest version not :data:`ABANDONED` (finished or still
    registering) and return it; with ``floor`` (a rollback's ``previous_candidate``) at ``floor`` instead
    while no such version is newer than it. None (alias left as it is) where there is no version to name.

    Without compare-and-set the alias is written, then the versions listed again, until a listing made
    after this writer's last write agrees with the alias: whichever writer writes last saw every version
    made before its last listing, and one made later is written by its own registration, so concurrent
    writers end with the alias on the newest version."""
    target: str | None = None
    for _ in range(rounds):
        live = [int(v.version) for v in _call(client.search_model_versions, f"name='{name}'")
                if ABANDONED not in (v.tags or {})]
        newest = max(live, default=None)
        if floor is not None and int(floor) in live and (newest is None or newest <= int(floor)):
            newest = int(floor)
        if newest is None:
            return None
        target = str(newest)
        if _alias_version(client, name, CANDIDATE) == target:
            return target
        _set_alias(client, name, CANDIDATE, target)
    return target
