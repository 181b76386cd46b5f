"""Where a registry store is, and touching it safely: tracking URIs, store location checks, the
registration lock of a sqlite store, retries of calls that meet a locked database or leave a create's outcome
unknown, artifact downloads.

Where things live: ``--tracking-uri`` > ``MLFLOW_TRACKING_URI`` > ``sqlite:///<cwd>/runs/mlflow/mlflow.db``.
For a sqlite store, artifacts are kept beside the database (``<db folder>/artifacts``); a team points
``MLFLOW_TRACKING_URI`` at a tracking server and lets the server place artifacts (e.g. on S3).

Nothing here imports MLflow at module level.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dsaindex.errors import DsaIndexError

DEFAULT_EXPERIMENT = "dsaindex"
CANDIDATE = "candidate"
PRODUCTION = "production"
TAG = "dsaindex."
REGISTERING = TAG + "registering"
LOCK_TIMEOUT_S = 600.0
_LIST_FIX = "run `dsaindex registry list` to see the registered names, versions and aliases."
_STORE_FIX = "check that --tracking-uri (or MLFLOW_TRACKING_URI) names a reachable MLflow store, then retry."


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


# ---- locks, retries, downloads ---------------------------------------------------------------------
def _short(err: BaseException, limit: int = 300) -> str:
    return " ".join(str(err).split())[:limit]


def _tables_exist(db: Path) -> bool:
    """Whether MLflow has made its tables in ``db`` (its schema revision is stamped)."""
    try:
        with contextlib.closing(_connect_ro(db)) as con:
            return bool(con.execute("SELECT version_num FROM alembic_version").fetchall())
    except sqlite3.Error:
        return False


def _connect_ro(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(db.as_uri() + "?mode=ro", uri=True, timeout=10.0)


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


_interrupt = {"deferring": False, "pending": False}


@contextlib.contextmanager
def _interrupts_between_calls() -> Iterator[None]:
    """Within: Ctrl-C (SIGINT) takes effect when the MLflow call that runs returns (:func:`_call` raises
    ``KeyboardInterrupt`` then), never in the middle of one; a second Ctrl-C takes effect at once.

    An interrupt inside a call can leave a database connection in the middle of a transaction, holding
    sqlite's lock, and every later write of this process (the rollback) waits on it. Outside the main
    thread, or nested, this does nothing."""
    if threading.current_thread() is not threading.main_thread() or _interrupt["deferring"]:
        yield
        return

    def handler(signum, frame):
        if _interrupt["pending"]:
            raise KeyboardInterrupt
        _interrupt["pending"] = True
        print("registry: Ctrl-C: stopping after the current request (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, handler)
    _interrupt.update(deferring=True, pending=False)
    try:
        yield
    finally:  # one that came after the last call is dropped: the work it would have cut short is done
        signal.signal(signal.SIGINT, previous)
        _interrupt.update(deferring=False, pending=False)


def _take_interrupt() -> None:
    if _interrupt["pending"]:
        _interrupt["pending"] = False
        raise KeyboardInterrupt


def _call(fn: Callable[..., Any], *args: Any, attempts: int = 8, **kwargs: Any) -> Any:
    """Call an MLflow function, retrying when sqlite reports ``database is locked``; a Ctrl-C deferred by
    :func:`_interrupts_between_calls` is raised once it returns."""
    for attempt in range(attempts):
        try:
            result = fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - MlflowException wraps the sqlalchemy OperationalError
            _take_interrupt()
            if "database is locked" not in str(err) or attempt == attempts - 1:
                raise
            time.sleep(min(2.0, 0.1 * 2**attempt))
            continue
        _take_interrupt()
        return result
    raise AssertionError("unreachable")


def _outcome_unknown(err: BaseException) -> bool:
    """Whether a failed write may still have been applied: no answer in time, a connection that broke, or a
    5xx (a proxy's, or the server's after it committed). MLflow (3.18 on) does not send such a create again."""
    text = str(err).lower()
    return (any(s in text for s in ("timed out", "timeout", "failed with exception"))
            or re.search(r"error code 5\d\d", text) is not None)


def _create_once(create: Callable[[], Any], find: Callable[[], Any]) -> Any:
    """``create()`` (through :func:`_call`), sent again after a failure that leaves its outcome unknown only
    when ``find()``, which looks for what the failed try would have made by a tag or id no other write uses,
    finds nothing (then its result is returned). As many tries as ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` allows,
    after MLflow's backoff; a failing lookup raises the write's own error."""
    retries = int(os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES") or 0)
    backoff = float(os.environ.get("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR") or 0)
    for attempt in range(retries + 1):
        try:
            return _call(create)
        except Exception as err:  # noqa: BLE001 - MlflowException and the transport's errors
            if attempt == retries or not _outcome_unknown(err):
                raise
            try:
                found = _call(find)
            except Exception:  # noqa: BLE001 - the store is not answering: the write's error says so
                raise err from None
            if found is not None:
                return found
            time.sleep(min(4.0, backoff * 2**attempt))
    raise AssertionError("unreachable")


def _error_code(err: Exception) -> str:
    return str(getattr(err, "error_code", ""))


# what a tracking server's database says when two writers insert the same alias row at once (PostgreSQL, MySQL,
# sqlite): the loser's write failed whole, and writing the alias again is the same write
_ALIAS_RACE = ("duplicate key value violates unique constraint", "UniqueViolation", "Duplicate entry",
               "UNIQUE constraint failed")


def _set_alias(client: Any, name: str, alias: str, version: str | int, attempts: int = 6) -> None:
    """``client.set_registered_model_alias`` (through :func:`_call`), written again when another writer's
    write of the same alias won a race on its row (the server reports a unique-constraint violation: a server
    writes an alias as delete-then-insert, and two inserts can meet)."""
    for attempt in range(attempts):
        try:
            _call(client.set_registered_model_alias, name, alias, version)
            return
        except Exception as err:  # noqa: BLE001 - MlflowException / RestException wrap the database's error
            if not any(text in str(err) for text in _ALIAS_RACE) or attempt == attempts - 1:
                raise
            time.sleep(0.05 * 2**attempt)


_CREDENTIALS_FIX = ("set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (the server's basic auth) or "
                    "MLFLOW_TRACKING_TOKEN (a bearer token) to credentials the server accepts, then retry.")


def _credentials_error(err: BaseException, uri: str) -> DsaIndexError | None:
    """A :class:`DsaIndexError` naming the variables to set when ``err`` is a tracking server refusing the
    credentials (HTTP 401) or the permission (HTTP 403); None for any other error."""
    try:
        status = int(err.get_http_status_code())  # MlflowException's, from its error code
    except (AttributeError, TypeError, ValueError):
        return None
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    given = (f"user {user!r}" if user and os.environ.get("MLFLOW_TRACKING_PASSWORD") is not None else
             "a token" if os.environ.get("MLFLOW_TRACKING_TOKEN") else
             f"user {user!r} without a password" if user else "no credentials")
    if status == 401:
        return DsaIndexError(f"The MLflow tracking server at {uri} refused the credentials (HTTP 401; {given} "
                             "given).", _CREDENTIALS_FIX)
    if status == 403:
        return DsaIndexError(f"The MLflow tracking server at {uri} denied a request to {given} (HTTP 403: "
                             f"{_short(err, 120)}).",
                             "ask the server's admin for permission on this experiment and registered model, or "
                             + _CREDENTIALS_FIX.replace("credentials the server accepts", "a user that has it"))
    return None


def _download(artifact_uri: str, dst: Path) -> Path:
    import mlflow.artifacts

    return Path(mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, dst_path=str(dst)))
