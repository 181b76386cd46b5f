"""The MLflow client session on a tracking store: HTTP timeouts, the first question to a tracking
server, the first touch of a sqlite store (under the registration lock) and the undoing of dead
registrations before any command reads or writes.

Tracking servers (``http(s)://``) are first asked one cheap question with a short timeout, so an
unreachable server fails in seconds with its URI in the message; MLflow's own HTTP settings
(``MLFLOW_HTTP_REQUEST_TIMEOUT``, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, ``..._BACKOFF_FACTOR``,
``..._BACKOFF_JITTER``) get short defaults unless the user set them. MLflow is imported inside
:func:`_session`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsaindex.artifacts.registry.recovery import _settle
from dsaindex.artifacts.registry.tracking import (
    _STORE_FIX,
    _call,
    _credentials_error,
    _is_http,
    _no_database,
    _registration_lock,
    _short,
    _tables_exist,
    resolve_tracking_uri,
    sqlite_path,
)
from dsaindex.errors import DsaIndexError

# MLflow's defaults (120 s per request, 7 retries with backoff 2) wait minutes on a dead server; these give
# up on a server that stops answering mid-registration within ~15 s (a request and its retry, 6 s each, then a
# rollback of at most NO_ANSWER_ROLLBACK_S). A transient 5xx (a proxy in front of the server) is retried once
# (a create, by tracking._create_once: MLflow leaves it to the caller).
HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "6", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
                 "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5"}
HTTP_PROBE_SETTINGS = {**HTTP_SETTINGS, "MLFLOW_HTTP_REQUEST_TIMEOUT": "4", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"}
_announced: set[str] = set()


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
    keys = ("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "MLFLOW_TRACKING_URI",
            *HTTP_SETTINGS)
    saved_env = {k: os.environ.get(k) for k in keys}
    previous = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    # on a tracking server MLflow writes run links to stdout, which carries the commands' output (--json)
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
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
        refused = _credentials_error(err, uri)
        if refused is not None:
            raise refused from None
        raise DsaIndexError(f"The MLflow store {uri} refused a request ({_short(err)}).", _STORE_FIX) from err
    finally:
        mlflow.set_tracking_uri(previous)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


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
            raise  # the server answered, with an error: reported as refused credentials or a refused request
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
