"""MLflow 3 tracking and registry of artifact bundles.

A training is an MLflow *run* (its params, metrics, plots and the bundle manifest as artifacts). The
bundle itself is a *LoggedModel* of that run, whose artifacts are the bundle folder; it is registered as
a new version of one registered model per target model (:func:`registered_name`) and gets the alias
``candidate``; :func:`promote` moves ``production`` (or any alias) onto a version.

Where things live: ``--tracking-uri`` > ``MLFLOW_TRACKING_URI`` > ``sqlite:///<cwd>/runs/mlflow/mlflow.db``.
For a sqlite store, artifacts are kept beside the database (``<db folder>/artifacts``); a team points
``MLFLOW_TRACKING_URI`` at a tracking server and lets the server place artifacts (e.g. on S3).

Registration is all or nothing. A new version carries the tag ``dsaindex.registering`` (when it started,
which version was ``@candidate`` before) until the last step removes it; nothing resolves to, lists or
counts a version with that tag. If a step fails, the version is deleted, the logged model and run are
marked failed and a :class:`DsaIndexError` is raised. If the process dies instead (kill -9, power), the
next registry command of any process undoes what it left: it deletes the version, moves ``@candidate``
back, marks the run and its logged models failed. On sqlite, one registration at a time holds a file
lock beside the database for its whole length, so a command that takes the lock knows every unfinished
registration it finds is dead; on a tracking server (no lock) only registrations older than
:data:`STALE_VERSION_S` (a version) or :data:`STALE_RUN_S` (a run without one) are undone. Registering a
bundle whose ``bundle_id`` is already registered returns that version.

Tracking servers (``http(s)://``) are first asked one cheap question with a short timeout, so an
unreachable server fails in seconds with its URI in the message; MLflow's own HTTP settings
(``MLFLOW_HTTP_REQUEST_TIMEOUT``, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``..._BACKOFF_FACTOR``,
``..._BACKOFF_JITTER``) get short defaults unless the user set them.

MLflow is imported inside the functions that use it. :func:`list_versions` on a sqlite store reads the
database directly (read-only; MLflow's import alone takes seconds) and falls back to MLflow when the
schema is not the one it knows or when an unfinished registration needs undoing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import shutil
import socket
import sqlite3
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsaindex.errors import CorruptBundleError, DsaIndexError

if TYPE_CHECKING:
    from dsaindex.artifacts.bundle import BundleManifest
    from dsaindex.artifacts.fingerprint import ModelFingerprint

DEFAULT_EXPERIMENT = "dsaindex"
CANDIDATE = "candidate"
PRODUCTION = "production"
TAG = "dsaindex."
REGISTERING = TAG + "registering"
LOCK_TIMEOUT_S = 600.0
STALE_VERSION_S = 900.0
STALE_RUN_S = 24 * 3600.0
# MLflow's defaults (120 s per request, 7 retries with backoff 2) wait minutes on a dead server.
HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "20", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5"}
HTTP_PROBE_SETTINGS = {**HTTP_SETTINGS, "MLFLOW_HTTP_REQUEST_TIMEOUT": "4", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"}
# What `registry list` shows first: recall at the default candidate count / budget (DESIGN.md).
HEADLINE_METRICS = (
    "mean/k512/rerank@2048",  # PQ: top-2048 by PQ score, exact rerank, recall of the exact top-512
    "mean/k512/filter@2048",  # the same behind LeanSparse's miss filter
    "mean/ivf-learned/recall@16384",  # IVF prefill at a 16K budget, learned representatives
    "mean/ivf/recall@16384",
    "mean/blocks/recall@16384",
)
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
_LAYER_METRIC = re.compile(r"^layer(\d+)/(.+)$")
_LIST_FIX = "run `dsaindex registry list` to see the registered names, versions and aliases."
_STORE_FIX = "check that --tracking-uri (or MLFLOW_TRACKING_URI) names a reachable MLflow store, then retry."
_announced: set[str] = set()


# ---- where the store is ----------------------------------------------------------------------------
def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else a sqlite file under ``./runs/mlflow`` (absolute)."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return "sqlite:///" + str((Path.cwd() / "runs" / "mlflow" / "mlflow.db").absolute())


def resolve_tracking_uri(tracking_uri: str | None = None) -> str:
    """The tracking URI to use: the one given, else :func:`default_tracking_uri`."""
    return tracking_uri or default_tracking_uri()


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (relative paths against the cwd), else None."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    rest = tracking_uri[len("sqlite:///"):].split("?", 1)[0]
    if not rest or rest == ":memory:":
        return None
    return Path(rest).absolute()


def artifact_root(tracking_uri: str) -> Path | None:
    """Folder that holds the artifacts of a sqlite store (beside the database); None for servers."""
    db = sqlite_path(tracking_uri)
    return None if db is None else db.parent / "artifacts"


def _is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def check_store_location(tracking_uri: str | None = None) -> str:
    """The resolved URI; a sqlite URI whose folder does not exist (a mistyped path) raises
    :class:`DsaIndexError` naming the path, since reading it can only ever find nothing."""
    uri = resolve_tracking_uri(tracking_uri)
    db = sqlite_path(uri)
    if db is not None and not db.parent.is_dir():
        raise DsaIndexError(
            f"No registry at {uri}: the folder {db.parent} does not exist.",
            "check the path in --tracking-uri (or MLFLOW_TRACKING_URI); the default store is "
            "./runs/mlflow/mlflow.db of the folder you trained in.",
        )
    return uri


def _no_database(uri: str, db: Path) -> DsaIndexError:
    where = "the database file does not exist" if db.parent.is_dir() else f"the folder {db.parent} does not exist"
    return DsaIndexError(
        f"No registry at {uri} ({where}).",
        "register a bundle first, or pass --tracking-uri (or set MLFLOW_TRACKING_URI) to the store in use.",
    )


# ---- names -----------------------------------------------------------------------------------------
def registered_name(model: ModelFingerprint) -> str:
    """One registered-model name per target model: ``dsaindex-<model name>-<weights digest[:8]>``.

    Only ``[A-Za-z0-9._-]`` survive; other runs of characters (``/`` of a hub id, spaces) become ``-``.
    """
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", model.name).strip("-.") or "model"
    digest = re.sub(r"[^A-Za-z0-9]", "", model.weights_digest)[:8] or "nodigest"
    return f"dsaindex-{base[:120]}-{digest}"


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise DsaIndexError(f"{name!r} is not a registered-model name of dsaindex.", _LIST_FIX)


def _metric_key(key: str) -> str:
    """A metric/param name MLflow accepts: characters outside ``[/\\w.\\- ]`` become ``_``."""
    key = re.sub(r"[^/\w.\- ]", "_", key)
    key = re.sub(r"/+", "/", key).strip("/")
    return key[:250] or "_"


def _flatten(params: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts -> ``a.b`` keys; values as JSON for lists/None, ``str`` otherwise."""
    out: dict[str, str] = {}
    for key, value in params.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, full + "."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            out[_metric_key(full)] = text[:6000]
    return out


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


# ---- sessions, locks, retries ----------------------------------------------------------------------
@contextlib.contextmanager
def _session(tracking_uri: str | None, create: bool = False, lock_init: bool = True) -> Iterator[Any]:
    """An ``MlflowClient`` on the resolved URI, with that URI also set as MLflow's global one for the
    duration: MLflow 3's sqlite registry resolves ``models:/<model_id>`` through the global URI.

    Without ``create``, a sqlite URI whose database file does not exist raises (reading must not
    create an empty store). The first touch of a sqlite store (which may create or migrate its tables,
    and two processes doing so at once break each other) happens under the registration lock unless a
    registration holds it on an already made store; pass ``lock_init=False`` when the caller holds it.
    Then unfinished registrations of dead processes are undone (:func:`_settle`). A tracking server is
    asked a cheap question first (:func:`_probe`).
    """
    uri = resolve_tracking_uri(tracking_uri)
    db = sqlite_path(uri)
    if db is not None:
        if not db.exists() and not create:
            raise _no_database(uri, db)
        db.parent.mkdir(parents=True, exist_ok=True)
    if _is_http(uri) and uri not in _announced:  # before MLflow's import: a user waiting sees what for
        _announced.add(uri)
        timeout = os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT") or HTTP_PROBE_SETTINGS["MLFLOW_HTTP_REQUEST_TIMEOUT"]
        retries = os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES") or HTTP_PROBE_SETTINGS["MLFLOW_HTTP_REQUEST_MAX_RETRIES"]
        print(f"registry: contacting the MLflow tracking server at {uri} (timeout {timeout} s, retries {retries})",
              file=sys.stderr, flush=True)
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    for noisy in ("alembic", "mlflow.store.db.utils", "mlflow.store.model_registry", "mlflow.tracking"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    keys = ("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "MLFLOW_TRACKING_URI", *HTTP_SETTINGS)
    saved_env = {k: os.environ.get(k) for k in keys}
    previous = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    mlflow.set_tracking_uri(uri)
    try:
        client = MlflowClient(tracking_uri=uri)
        if db is not None:
            _open_sqlite(client, uri, db, lock_held=not lock_init)
        else:
            if _is_http(uri):
                _probe(client, uri, saved_env)
            _settle(client, uri, everything=False)
        yield client
    except MlflowException as err:
        raise DsaIndexError(f"The MLflow store {uri} refused a request ({_short(err)}).", _STORE_FIX) from err
    finally:
        mlflow.set_tracking_uri(previous)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _short(err: BaseException, limit: int = 300) -> str:
    return " ".join(str(err).split())[:limit]


def _open_sqlite(client, uri: str, db: Path, lock_held: bool) -> None:
    """First touch of a sqlite store (tables made or migrated under the lock), then :func:`_settle`."""

    def first_touch() -> None:
        try:
            _call(client.search_experiments, max_results=1)
            _call(client.search_registered_models, max_results=1)
        except DsaIndexError:
            raise
        except Exception as err:  # noqa: BLE001 - table creation/migration errors come in many kinds
            raise DsaIndexError(f"Cannot open the MLflow store {uri} ({type(err).__name__}: {_short(err)}).",
                                _STORE_FIX) from err

    if lock_held:
        first_touch()
        _settle(client, uri, everything=True)
        return
    with _registration_lock(uri, timeout_s=0) as held:
        if held:  # no registration runs: whatever is unfinished was left by a dead process
            first_touch()
            _settle(client, uri, everything=True)
            return
    if _tables_exist(db):  # a live registration holds the lock for its whole length: leave it be
        first_touch()
        return
    with _registration_lock(uri):  # the registration is creating the tables: wait for it
        first_touch()
        _settle(client, uri, everything=True)


def _tables_exist(db: Path) -> bool:
    """Whether MLflow has made its tables in ``db`` (its schema revision is stamped)."""
    try:
        with contextlib.closing(_connect_ro(db)) as con:
            return bool(con.execute("SELECT version_num FROM alembic_version").fetchall())
    except sqlite3.Error:
        return False


def _connect_ro(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(db.as_uri() + "?mode=ro", uri=True, timeout=10.0)


def _probe(client, uri: str, user_env: dict[str, str | None]) -> None:
    """Ask a tracking server one cheap question with short timeouts; an unreachable server raises a
    :class:`DsaIndexError` within seconds. MLflow's HTTP settings the user set are kept."""
    from mlflow.exceptions import MlflowException

    def apply(settings: dict[str, str]) -> None:
        for key, default in settings.items():
            os.environ[key] = user_env.get(key) or default

    apply(HTTP_PROBE_SETTINGS)
    start = time.monotonic()
    try:
        client.search_experiments(max_results=1)
    except MlflowException as err:
        text = str(err)
        if "failed with exception" not in text and "timeout exception" not in text:
            raise  # the server answered, with an error: reported as a refused request
        reason = ("connection refused" if "refused" in text.lower() else
                  "no answer in time" if "timed out" in text.lower() or "timeout" in text.lower() else _short(err, 160))
        raise DsaIndexError(
            f"Cannot reach the MLflow tracking server at {uri} ({reason}; gave up after "
            f"{time.monotonic() - start:.0f} s).",
            "start the server or correct --tracking-uri / MLFLOW_TRACKING_URI; MLFLOW_HTTP_REQUEST_TIMEOUT and "
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES set how long to wait.",
        ) from None
    apply(HTTP_SETTINGS)


def ensure_reachable(tracking_uri: str | None = None) -> str:
    """The resolved URI, after checking that a tracking server answers (a sqlite store is left as it
    is: registering creates it); raises :class:`DsaIndexError` otherwise. For callers that want to
    know before a long training."""
    uri = resolve_tracking_uri(tracking_uri)
    if sqlite_path(uri) is None:
        with _session(uri):
            pass
    return uri


@contextlib.contextmanager
def _registration_lock(tracking_uri: str, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[bool]:
    """Exclusive file lock beside a sqlite database (no-op, yielding True, for other stores).

    With ``timeout_s=0`` it does not wait: it yields False when another process holds the lock."""
    db = sqlite_path(tracking_uri)
    if db is None:
        yield True
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(db) + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        held = True
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if timeout_s <= 0:
                    held = False
                    break
                if time.monotonic() > deadline:
                    raise DsaIndexError(
                        f"Another registration has held {db}.lock for over {timeout_s:.0f} s.",
                        "wait for it to finish, or remove the lock file if no dsaindex process is running.",
                    ) from None
                time.sleep(0.05)
        yield held
    finally:
        os.close(fd)  # closing releases the lock


def _call(fn: Callable[..., Any], *args: Any, attempts: int = 8, **kwargs: Any) -> Any:
    """Call an MLflow function, retrying when sqlite reports ``database is locked``."""
    for attempt in range(attempts):
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - MlflowException wraps the sqlalchemy OperationalError
            if "database is locked" not in str(err) or attempt == attempts - 1:
                raise
            time.sleep(min(2.0, 0.1 * 2**attempt))
    raise AssertionError("unreachable")


def _error_code(err: Exception) -> str:
    return str(getattr(err, "error_code", ""))


def _experiment_id(client, experiment: str, tracking_uri: str) -> str:
    exp = _call(client.get_experiment_by_name, experiment)
    if exp is not None:
        return exp.experiment_id
    root = artifact_root(tracking_uri)
    location = (root / experiment).as_uri() if root is not None else None
    try:
        return _call(client.create_experiment, experiment, artifact_location=location)
    except Exception as err:  # noqa: BLE001 - a racing process may have created it
        if "ALREADY_EXISTS" not in _error_code(err):
            raise
        return _call(client.get_experiment_by_name, experiment).experiment_id


# ---- unfinished registrations ----------------------------------------------------------------------
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
    with contextlib.suppress(Exception):
        _call(client.set_terminated, run_id, "FAILED")


# ---- registering -----------------------------------------------------------------------------------
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
    bundle_path : a bundle written by :func:`dsaindex.artifacts.bundle.write_bundle`; it is verified
        (every checksum) before anything is logged.
    params : training parameters (nested dicts become ``a.b`` keys), logged with the manifest's params.
    metrics : training metrics, logged with the manifest's metrics; ``layer<id>/<name>`` are per layer.
    plots : image (or any) files, logged as run artifacts under ``plots/``.
    tracking_uri, experiment : where to log; see the module docstring for the default.

    The new version gets the alias ``candidate``. Any failure leaves no version behind and raises
    :class:`DsaIndexError` (the logged model and the run are marked failed). A bundle whose ``bundle_id``
    is already registered under its name is not registered again: that version is returned with
    ``existing=True`` and ``alias`` one of its aliases (``candidate`` first) or None.
    """
    from mlflow.entities import LoggedModelStatus, Metric, Param

    from dsaindex.artifacts.bundle import read_bundle

    bundle_path = Path(bundle_path)
    manifest, _ = read_bundle(bundle_path, verify=True)
    for plot in plots:
        if not Path(plot).is_file():
            raise DsaIndexError(f"Plot file {plot} does not exist.", "pass existing files, or no plots.")
    name = registered_name(manifest.model)
    uri = resolve_tracking_uri(tracking_uri)
    all_params = _flatten({**manifest.params, **params})
    all_metrics = {**manifest.metrics, **{k: float(v) for k, v in metrics.items()}}
    command = f"dsaindex registry register {bundle_path} --tracking-uri {uri}"
    again = f"check that the tracking store is reachable and writable, then register again: {command}"

    with contextlib.ExitStack() as stack:
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
            run = _call(client.create_run, exp_id, run_name=f"train-{manifest.bundle_id}",
                        tags={TAG + "bundle_id": manifest.bundle_id, TAG + "registered_name": name})
        except Exception as err:  # noqa: BLE001 - nothing exists yet, nothing to roll back
            raise DsaIndexError(
                f"Cannot start a run in {uri} ({type(err).__name__}: {_short(err)}); nothing was registered.",
                again,
            ) from err
        run_id = run.info.run_id
        model_id: str | None = None
        version: str | None = None
        previous_candidate: str | None = None
        try:
            model = _call(
                client.create_logged_model, exp_id, name=f"bundle-{manifest.bundle_id}", source_run_id=run_id,
                tags={TAG + "bundle_id": manifest.bundle_id, TAG + "registered_name": name},
                params={"basis": manifest.basis, "key_format": manifest.key_format,
                        "schema": f"{manifest.schema_id}/{manifest.schema_version}"},
                model_type="dsaindex-bundle",
            )
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

            try:
                _call(client.create_registered_model, name,
                      tags={TAG + "model_name": manifest.model.name, TAG + "family": manifest.model.family},
                      description=f"dsaindex artifact bundles for {manifest.model.name} "
                                  f"(weights {manifest.model.weights_digest}).")
            except Exception as err:  # noqa: BLE001
                if "ALREADY_EXISTS" not in _error_code(err):
                    raise
            previous_candidate = _alias_version(client, name, CANDIDATE)
            # Unfinished until the last step: readers skip it, the next command undoes it if this dies.
            record = {"started": int(time.time() * 1000), "previous_candidate": previous_candidate,
                      "pid": os.getpid(), "host": socket.gethostname()}
            mv = _call(client.create_model_version, name, source=f"models:/{model_id}", run_id=run_id,
                       model_id=model_id, tags={**_version_tags(manifest, model_id), REGISTERING: json.dumps(record)})
            version = str(mv.version)
            _call(client.set_registered_model_alias, name, CANDIDATE, version)
            status = _call(client.get_model_version, name, version).status
            if str(status) != "READY":
                raise RuntimeError(f"model version {name}/{version} is {status}, not READY")
            _call(client.set_terminated, run_id, "FINISHED")
            _call(client.delete_model_version_tag, name, version, REGISTERING)
        except BaseException as err:
            _roll_back(client, name, version, previous_candidate, model_id, run_id)
            if isinstance(err, DsaIndexError | KeyboardInterrupt | SystemExit):
                raise
            raise DsaIndexError(
                f"Registering {bundle_path} in {uri} failed ({type(err).__name__}: {_short(err)}); "
                "nothing was registered.",
                again,
            ) from err
    return {"name": name, "version": int(version), "run_id": run_id, "model_id": model_id, "alias": CANDIDATE,
            "existing": False}


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
    if run_id:
        steps.append((client.set_terminated, (run_id, "FAILED")))
    for fn, args in steps:
        with contextlib.suppress(Exception):
            _call(fn, *args)


# ---- reading ---------------------------------------------------------------------------------------
def _alias_version(client, name: str, alias: str) -> str | None:
    try:
        return str(_call(client.get_model_version_by_alias, name, alias).version)
    except Exception as err:  # noqa: BLE001
        if "NOT_EXIST" in _error_code(err) or "not found" in str(err).lower():
            return None
        raise


def _registered(client, name: str):
    _check_name(name)
    try:
        return _call(client.get_registered_model, name)
    except Exception as err:  # noqa: BLE001
        if "NOT_EXIST" in _error_code(err):
            raise DsaIndexError(f"No registered model named {name!r}.", _LIST_FIX) from None
        raise


def _resolve(client, name: str, ref: str) -> str:
    """The finished version ``ref`` means; never one whose registration is unfinished."""
    rm = _registered(client, name)
    unfinished = _unfinished(client, name)
    ref = str(ref).strip()
    if ref.lower() == "latest":
        versions = [int(v.version) for v in _call(client.search_model_versions, f"name='{name}'")
                    if _registering(v.tags) is None]
        if not versions:
            raise DsaIndexError(f"{name} has no versions.", _LIST_FIX)
        return str(max(versions))
    if ref.lstrip("v").isdigit():
        number = ref.lstrip("v")
        if number in unfinished:
            raise DsaIndexError(
                f"{name} version {number} is not completely registered (its registration is running, or "
                "was interrupted and is undone by the next registry command).",
                "retry in a moment; " + _LIST_FIX,
            )
        try:
            return str(_call(client.get_model_version, name, number).version)
        except Exception as err:  # noqa: BLE001
            if "NOT_EXIST" in _error_code(err):
                raise DsaIndexError(f"{name} has no version {number}.", _LIST_FIX) from None
            raise
    alias = ref[1:] if ref.startswith("@") else ref
    aliases = _effective_aliases(dict(rm.aliases or {}), unfinished)
    if alias not in aliases:
        known = ", ".join(f"@{a}" for a in sorted(aliases)) or "none"
        raise DsaIndexError(
            f"{name} has no version or alias {ref!r} (aliases: {known}).",
            "give a version number, '@<alias>' or 'latest'; " + _LIST_FIX,
        )
    return aliases[alias]


def resolve(name: str, version_or_alias: str, tracking_uri: str | None = None) -> int:
    """The version number meant by ``"3"``, ``"v3"``, ``"@production"``, ``"production"`` or ``"latest"``."""
    with _session(tracking_uri) as client:
        return int(_resolve(client, name, version_or_alias))


def promote(name: str, version: str | int, alias: str = PRODUCTION, tracking_uri: str | None = None) -> dict[str, Any]:
    """Point ``alias`` at ``version`` (a version number or any ref :func:`resolve` accepts).

    Returns ``{name, version, alias, previous}`` where ``previous`` is the version the alias left (or None).
    """
    alias = alias.lstrip("@")
    if not re.match(r"^[\w-]+$", alias) or alias.lower() == "latest" or re.match(r"^[vV]\d+$", alias):
        raise DsaIndexError(f"{alias!r} cannot be an alias.", "use letters, digits, '_' or '-' (not 'latest' or 'v<number>').")
    with _session(tracking_uri) as client:
        number = _resolve(client, name, str(version))
        previous = _alias_version(client, name, alias)
        _call(client.set_registered_model_alias, name, alias, number)
    return {"name": name, "version": int(number), "alias": alias,
            "previous": int(previous) if previous is not None else None}


def _aliases_by_version(aliases: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for alias, version in aliases.items():
        out.setdefault(str(version), []).append(alias)
    return {k: sorted(v) for k, v in out.items()}


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
    if db is not None:
        fast = _list_sqlite(uri, db, name)
        if fast is not None:
            return fast
    return _list_mlflow(uri, name)


def _list_mlflow(uri: str, name: str | None) -> list[dict[str, Any]]:
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


_LIST_COLUMNS = {
    "registered_models": {"name"},
    "registered_model_tags": {"name", "key", "value"},
    "registered_model_aliases": {"name", "alias", "version"},
    "model_versions": {"name", "version", "creation_time", "status", "run_id", "current_stage"},
    "model_version_tags": {"name", "version", "key", "value"},
    "latest_metrics": {"run_uuid", "key", "value", "is_nan"},
    "runs": {"run_uuid", "status", "experiment_id", "lifecycle_stage"},
    "experiments": {"experiment_id", "name"},
    "tags": {"run_uuid", "key"},
}


def _list_sqlite(uri: str, db: Path, name: str | None) -> list[dict[str, Any]] | None:
    """:func:`list_versions` read straight from a sqlite store, without importing MLflow: None when
    the schema is not the one this reads (or workspaces are on), so MLflow answers instead.

    Unfinished registrations are left out; when some may be dead (the registration lock is free), they
    are undone through MLflow first.
    """
    if os.environ.get("MLFLOW_WORKSPACE") or os.environ.get("MLFLOW_ENABLE_WORKSPACES", "").lower() in ("1", "true"):
        return None
    try:
        with contextlib.closing(_connect_ro(db)) as con:
            columns: dict[str, set[str]] = {}
            for table in _LIST_COLUMNS:
                columns[table] = {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
                if not _LIST_COLUMNS[table] <= columns[table]:
                    return None
            dead = con.execute(  # what _settle would undo
                "SELECT 1 FROM model_version_tags t JOIN model_versions v ON v.name = t.name AND v.version = t.version "
                "WHERE t.key = ? AND v.current_stage != 'Deleted_Internal' UNION ALL "
                "SELECT 1 FROM runs r JOIN tags g ON g.run_uuid = r.run_uuid JOIN experiments e ON "
                "e.experiment_id = r.experiment_id WHERE r.status = 'RUNNING' AND r.lifecycle_stage = 'active' "
                "AND g.key = ? AND e.name = ? LIMIT 1", (REGISTERING, TAG + "bundle_id", DEFAULT_EXPERIMENT)).fetchall()
            if dead:
                with _registration_lock(uri, timeout_s=0) as held:
                    if held:  # nothing is registering: undo what dead processes left, then read
                        with _session(uri, lock_init=False):
                            pass
            return _read_sqlite_rows(con, columns, name, uri)
    except sqlite3.Error:
        return None


def _read_sqlite_rows(con: sqlite3.Connection, columns: dict[str, set[str]], name: str | None,
                      uri: str) -> list[dict[str, Any]]:
    def scoped(table: str, alias: str = "") -> str:  # MLflow's single-tenant mode reads the default workspace
        col = f"{alias}.workspace" if alias else "workspace"
        return f" AND {col} = 'default'" if "workspace" in columns[table] else ""

    prompts = {r[0] for r in con.execute(
        "SELECT name FROM registered_model_tags WHERE key = 'mlflow.prompt.is_prompt' AND lower(value) = 'true'"
        + scoped("registered_model_tags"))}
    names = [r[0] for r in con.execute("SELECT name FROM registered_models WHERE 1=1" + scoped("registered_models")
                                       + " ORDER BY name")]
    names = [n for n in names if n not in prompts]
    if name is not None:
        if name not in names:
            raise DsaIndexError(f"No registered model named {name!r}.", _LIST_FIX)
        names = [name]
    rows = []
    for model in names:
        tags: dict[int, dict[str, str]] = {}
        for version, key, value in con.execute(
                "SELECT version, key, value FROM model_version_tags WHERE name = ?" + scoped("model_version_tags"),
                (model,)):
            tags.setdefault(int(version), {})[key] = value
        versions = con.execute(
            "SELECT version, creation_time, status, run_id FROM model_versions WHERE name = ? AND "
            "current_stage != 'Deleted_Internal'" + scoped("model_versions") + " ORDER BY version DESC",
            (model,)).fetchall()
        unfinished = {str(v): _registering(t) for v, t in tags.items() if _registering(t) is not None}
        aliases = _effective_aliases(dict(con.execute(
            "SELECT alias, version FROM registered_model_aliases WHERE name = ?" + scoped("registered_model_aliases"),
            (model,)).fetchall()), unfinished)
        by_version = _aliases_by_version(aliases)
        for version, created, status, run_id in versions:
            if str(version) in unfinished:
                continue
            metrics = {key: (math.nan if is_nan else float(value)) for key, value, is_nan in con.execute(
                "SELECT key, value, is_nan FROM latest_metrics WHERE run_uuid = ?", (run_id or "",))}
            rows.append(_row(model, version, by_version.get(str(version), []), created, status,
                             tags.get(int(version), {}), metrics, run_id))
    return rows


def _download(artifact_uri: str, dst: Path) -> Path:
    import mlflow.artifacts

    return Path(mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, dst_path=str(dst)))


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


# ---- fetching --------------------------------------------------------------------------------------
def _pull_version(client, name: str, version: str, dest: Path) -> Path:
    from dsaindex.artifacts.bundle import read_bundle

    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise DsaIndexError(f"{dest} exists and is not empty.", "pull into a new path, or delete the old one.")
    location = _call(client.get_model_version_download_uri, name, version)
    expected_id = dict(_call(client.get_model_version, name, version).tags or {}).get(TAG + "bundle_id")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.pull-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        root = _download(location, tmp)
        try:
            manifest, _ = read_bundle(root, verify=True)
        except CorruptBundleError as err:
            raise CorruptBundleError(
                f"{name} version {version} downloaded from {location} is damaged: {err.problem}",
                "register the bundle again; the stored artifacts changed after registration.",
            ) from None
        if expected_id and manifest.bundle_id != expected_id:
            raise CorruptBundleError(
                f"{name} version {version} was registered with bundle {expected_id}, but {location} holds "
                f"bundle {manifest.bundle_id}.",
                "register the bundle again; the stored artifacts were replaced.",
            )
        if dest.exists():
            dest.rmdir()
        os.rename(root, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def pull(name: str, ref: str, dest: str | Path, tracking_uri: str | None = None) -> Path:
    """Download a version's bundle to ``dest`` (must not exist, or be empty), verify every checksum and
    return ``dest``. A damaged download raises :class:`CorruptBundleError` and leaves nothing behind."""
    with _session(tracking_uri) as client:
        _registered(client, name)
        version = _resolve(client, name, ref)
        return _pull_version(client, name, version, Path(dest))


def default_cache() -> Path:
    """``$DSAINDEX_CACHE`` or ``~/.cache/dsaindex``; pulled bundles go under ``bundles/<name>/v<version>``."""
    return Path(os.environ.get("DSAINDEX_CACHE") or Path.home() / ".cache" / "dsaindex")


def parse_models_uri(uri: str) -> tuple[str, str]:
    """``models:/<name>@<alias>`` -> (name, "@alias"); ``models:/<name>/<version>`` -> (name, version)."""
    rest = uri[len("models:/"):].strip("/")
    if "@" in rest and "/" not in rest:
        name, alias = rest.split("@", 1)
        if name and alias:
            return name, "@" + alias
    parts = rest.split("/")
    if len(parts) == 2 and all(parts):
        return parts[0], parts[1]
    raise DsaIndexError(
        f"{uri!r} is not a registry URI dsaindex understands.",
        "use models:/<name>@<alias>, models:/<name>/<version>, or a local bundle path.",
    )


def load_uri(uri: str | Path, dest_cache: str | Path | None = None, tracking_uri: str | None = None) -> Path:
    """A local, verified bundle folder for ``uri``.

    ``uri`` is ``models:/<name>@<alias>``, ``models:/<name>/<version>`` (pulled once into
    ``<dest_cache>/bundles/<name>/v<version>`` and re-verified on later calls) or a local bundle path
    (``file://`` allowed), which is verified in place. MLflow is imported only for ``models:/`` URIs.
    """
    from dsaindex.artifacts.bundle import read_bundle

    text = str(uri)
    if not text.startswith("models:/"):
        path = Path(text[len("file://"):] if text.startswith("file://") else text)
        read_bundle(path, verify=True)
        return path
    name, ref = parse_models_uri(text)
    cache = Path(dest_cache) if dest_cache is not None else default_cache()
    with _session(tracking_uri) as client:
        version = _resolve(client, name, ref)
        target = cache / "bundles" / name / f"v{version}"
        expected_id = dict(_call(client.get_model_version, name, version).tags or {}).get(TAG + "bundle_id")
        if target.exists():
            try:
                if read_bundle(target, verify=True)[0].bundle_id == expected_id:
                    return target
            except CorruptBundleError:
                pass
            shutil.rmtree(target, ignore_errors=True)
        try:
            return _pull_version(client, name, version, target)
        except (DsaIndexError, OSError):
            # another process may have pulled the same version at the same time
            if target.exists() and read_bundle(target, verify=True)[0].bundle_id == expected_id:
                return target
            raise
