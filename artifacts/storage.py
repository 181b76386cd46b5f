"""Where capture stores and bundles live: a local folder, or a prefix in S3-compatible object storage.

:func:`location` turns what a user typed into a :class:`~pathlib.Path` (a local folder, ``file://`` allowed)
or an :class:`ObjectLocation` (``s3://bucket/prefix``); any other scheme, and a mistyped ``s3:/x``, is a
:class:`~dsaindex.errors.DsaIndexError` naming the fix, never a local folder named after the scheme.

Objects are reached through zarr v3's own ``zarr.storage.FsspecStore`` over s3fs (and s3fs itself for the
few listings, copies and deletions zarr does not do). s3fs rather than obstore: s3fs resolves credentials
through botocore, so the standard AWS chain holds as a team has it (environment variables, ``~/.aws/config``
and ``~/.aws/credentials`` profiles, SSO, instance roles) and ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``
point it at an S3-compatible service; obstore reads environment variables only, not the config files. And
fsspec is already among zarr's own dependencies.

Object storage has no rename and no fsync, but a PUT replaces a whole object at once and a read after it
sees it: the formats build their commit protocols on that (see :mod:`.capture_store` and :mod:`.bundle`).
"""

from __future__ import annotations

import functools
import os
import re
import uuid
from pathlib import Path
from typing import Any

from dsaindex.errors import DsaIndexError, WriterLockError

SCHEME = "s3"
_SCHEME_PREFIX = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(.*)$", re.S)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SUPPORTED = "a local path or an s3://bucket/prefix URI"


class ObjectLocation(str):
    """An ``s3://bucket/prefix`` URI, normalized (no trailing slash, no empty or dot segments). It is a
    ``str``: it prints, logs and formats as the URI the user gave."""

    __slots__ = ()

    @property
    def bucket(self) -> str:
        return self[len("s3://"):].split("/", 1)[0]

    @property
    def key(self) -> str:
        """The prefix inside the bucket (``a/b`` of ``s3://bucket/a/b``)."""
        return self[len("s3://"):].split("/", 1)[1]

    @property
    def name(self) -> str:
        return self.rsplit("/", 1)[1]

    @property
    def fs_path(self) -> str:
        """``bucket/prefix``, as s3fs names it."""
        return self[len("s3://"):]

    def child(self, rel: str) -> ObjectLocation:
        return ObjectLocation(f"{self}/{rel.strip('/')}")

    def sibling(self, name: str) -> ObjectLocation:
        return ObjectLocation(f"{self.rsplit('/', 1)[0]}/{name}")

    def zarr_store(self, read_only: bool):
        """zarr v3's ``FsspecStore`` over this prefix (an async s3fs; no listings cache: another writer's
        objects are seen at once)."""
        import zarr

        try:
            return zarr.storage.FsspecStore.from_url(str(self), read_only=read_only,
                                                     storage_options={"use_listings_cache": False})
        except ImportError as err:
            raise _missing_s3fs(err) from None


def _missing_s3fs(err: Exception) -> DsaIndexError:
    return DsaIndexError(f"s3:// locations need the s3fs package, which is not installed ({err}).",
                         "install it (`pip install s3fs`), or use a local path.")


def location(value: str | os.PathLike) -> Path | ObjectLocation:
    """A local :class:`Path` (``file://`` stripped) or an :class:`ObjectLocation` for ``s3://bucket/prefix``.

    Raises :class:`DsaIndexError` for another scheme (``gs://``, ``http://``, ...), a mistyped ``s3:/x`` or
    ``s3:x`` (one that a path library would take for a local folder named ``s3:``), and an ``s3://`` URI
    without a bucket or a prefix."""
    if isinstance(value, ObjectLocation):
        return value
    if isinstance(value, Path):  # a Path keeps its meaning; a collapsed 's3:/b/p' is still caught below
        text = str(value)
    else:
        text = os.fspath(value)
    match = _SCHEME_PREFIX.match(text)
    if match is None:
        return Path(text)
    scheme, rest = match.group(1), match.group(2)
    if scheme.lower() == "file" and rest.startswith("//"):
        return Path(rest[2:])
    if scheme.lower() == SCHEME:
        if not rest.startswith("//"):
            raise DsaIndexError(f"{text!r} is not an S3 URI (an s3 URI starts with two slashes: "
                                "s3://bucket/prefix).",
                                f"write it as s3://{rest.lstrip('/') or 'bucket/prefix'}.")
        return _object_location(text, rest[2:])
    if not rest.startswith("/") and scheme.lower() not in ("gs", "gcs", "az", "abfs", "abfss", "http", "https",
                                                           "hdfs", "ftp", "sftp", "ssh", "oss", "r2"):
        return Path(text)  # 'a:b': a local name with a colon, not a URI
    raise DsaIndexError(f"{text!r}: the scheme {scheme}:// is not supported; dsaindex reads and writes {_SUPPORTED}.",
                        "copy the data to an S3 bucket (S3-compatible services work through AWS_ENDPOINT_URL) "
                        "and pass s3://bucket/prefix, or pass a local path.")


def _object_location(text: str, rest: str) -> ObjectLocation:
    parts = [p for p in rest.split("/") if p]
    fix = "pass s3://bucket/prefix, e.g. s3://my-bucket/captures/v32.zarr."
    if not parts:
        raise DsaIndexError(f"{text!r} names no bucket.", fix)
    if len(parts) < 2:
        raise DsaIndexError(f"{text!r} names a bucket but no prefix in it (a store or bundle needs a prefix of "
                            "its own, not a whole bucket).", fix)
    if not _BUCKET.match(parts[0]):
        raise DsaIndexError(f"{text!r}: {parts[0]!r} is not a valid S3 bucket name (3-63 lowercase letters, "
                            "digits, '.' and '-').", fix)
    if any(p in (".", "..") for p in parts):
        raise DsaIndexError(f"{text!r} has a '.' or '..' segment; object keys are not resolved like paths.", fix)
    return ObjectLocation("s3://" + "/".join(parts))


def is_remote(value: Any) -> bool:
    """Whether ``value`` is an :class:`ObjectLocation` or a string naming one."""
    return isinstance(value, ObjectLocation) or (isinstance(value, str) and value.lower().startswith("s3://"))


def display(value: Any) -> str:
    """A location as a user reads it: the URI of an object location, the path of a local one."""
    return str(value)


# ---- objects ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def filesystem():
    """The process's synchronous s3fs filesystem (credentials and endpoint from the standard AWS config)."""
    try:
        import s3fs
    except ImportError as err:
        raise _missing_s3fs(err) from None
    return s3fs.S3FileSystem(use_listings_cache=False)


def object_error(where: ObjectLocation, err: BaseException, doing: str) -> DsaIndexError:
    """One line for an object-storage failure: a missing bucket, refused credentials, an endpoint that does
    not answer."""
    name = type(err).__name__
    text = " ".join(str(err).split())[:200]
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    at = f" at {endpoint}" if endpoint else ""
    if "bucket does not exist" in text.lower() or "NoSuchBucket" in text:
        return DsaIndexError(f"{doing} {where} failed: the bucket {where.bucket!r} does not exist{at}.",
                             "create the bucket first, or check the bucket name and AWS_ENDPOINT_URL.")
    if name in ("NoCredentialsError", "PartialCredentialsError") or "credentials" in text.lower():
        return DsaIndexError(f"{doing} {where} failed: no AWS credentials were found ({text}).",
                             "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile in ~/.aws/credentials "
                             "(AWS_PROFILE).")
    if isinstance(err, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        return DsaIndexError(f"{doing} {where} failed: access denied{at} ({text}).",
                             "check the credentials' permissions on that bucket and prefix.")
    if "connect" in (name + text).lower() or "endpoint" in text.lower():
        return DsaIndexError(f"{doing} {where} failed: the object store{at} does not answer ({name}: {text}).",
                             "check AWS_ENDPOINT_URL (for S3-compatible services) and the network.")
    return DsaIndexError(f"{doing} {where} failed ({name}: {text}).",
                         "check the URI, the credentials (AWS_* variables or ~/.aws) and AWS_ENDPOINT_URL.")


def list_objects(where: ObjectLocation) -> list[str]:
    """Keys under ``where/``, relative to it, sorted by their segments (as a sorted folder walk is)."""
    fs = filesystem()
    try:
        found = fs.find(where.fs_path + "/")
    except Exception as err:  # noqa: BLE001 - s3fs raises OSError kinds, botocore its own (credentials, endpoint)
        raise object_error(where, err, "Listing") from None
    base = where.fs_path + "/"
    return sorted((key[len(base):] for key in found if key.startswith(base)), key=lambda k: tuple(k.split("/")))


def object_sizes(where: ObjectLocation) -> dict[str, int]:
    """Relative key -> bytes of every object under ``where/``."""
    try:
        found = filesystem().find(where.fs_path + "/", detail=True)
    except Exception as err:  # noqa: BLE001 - see list_objects
        raise object_error(where, err, "Listing") from None
    base = where.fs_path + "/"
    return {key[len(base):]: int(info.get("size") or 0) for key, info in found.items() if key.startswith(base)}


def object_exists(where: ObjectLocation, rel: str) -> bool:
    try:
        return bool(filesystem().exists(f"{where.fs_path}/{rel}"))
    except Exception as err:  # noqa: BLE001 - see list_objects
        raise object_error(where, err, "Reading") from None


def read_object(where: ObjectLocation, rel: str) -> bytes:
    try:
        return filesystem().cat_file(f"{where.fs_path}/{rel}")
    except Exception as err:  # noqa: BLE001 - see list_objects
        raise object_error(where, err, "Reading") from None


def remove_objects(where: ObjectLocation, keep: tuple[str, ...] = ()) -> None:
    """Delete every object under ``where/`` but those named in ``keep`` (a store this run created and
    committed nothing to)."""
    keys = [f"{where.fs_path}/{rel}" for rel in list_objects(where) if rel not in keep]
    if keys:
        filesystem().rm(keys)


def check_writable(where: ObjectLocation) -> None:
    """Put and delete a probe object under ``where/``: the bucket exists, the credentials may write there and
    the endpoint answers, checked before long work. Raises :class:`DsaIndexError` naming which failed."""
    probe = f"{where.fs_path}/.dsaindex-probe-{uuid.uuid4().hex[:8]}"
    fs = filesystem()
    try:
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except Exception as err:  # noqa: BLE001 - see list_objects
        raise object_error(where, err, "Writing to") from None


def upload_folder(folder: Path, where: ObjectLocation, last: str = "zarr.json") -> int:
    """Copy every file under ``folder`` to ``where/`` with the same relative keys, the root ``last`` file
    after all others: a reader that requires it never sees a half copy. Returns the number of objects."""
    fs = filesystem()
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    rels = [p.relative_to(folder).as_posix() for p in files]
    first = [r for r in rels if r != last]
    try:
        if first:  # one batch: s3fs puts them concurrently
            fs.put([str(folder / r) for r in first], [f"{where.fs_path}/{r}" for r in first])
        if last in rels:  # only once every other object is in
            fs.put_file(str(folder / last), f"{where.fs_path}/{last}")
    except Exception as err:  # noqa: BLE001 - see list_objects
        raise object_error(where, err, "Writing to") from None
    return len(rels)


def put_file(file: Path, where: ObjectLocation) -> ObjectLocation:
    """Put one local file as the object ``where``; returns ``where``."""
    try:
        filesystem().put_file(str(file), where.fs_path)
    except Exception as err:  # noqa: BLE001 - see list_objects
        raise object_error(where, err, "Writing to") from None
    return where


def download_folder(where: ObjectLocation, folder: Path) -> int:
    """Copy every object under ``where/`` into ``folder`` (created); returns the number of objects."""
    rels = list_objects(where)
    fs = filesystem()
    try:
        for rel in rels:
            target = folder / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{where.fs_path}/{rel}", str(target))
    except OSError as err:
        if isinstance(err, FileNotFoundError | PermissionError) and not str(err).startswith(str(folder)):
            raise object_error(where, err, "Reading") from None
        raise
    except Exception as err:  # noqa: BLE001 - see list_objects
        raise object_error(where, err, "Reading") from None
    return len(rels)


# ---- one writer -------------------------------------------------------------------------------------
LOCK_OBJECT = ".writer.lock"  # under a store's prefix; never part of the store's data
LOCK_TTL_S = 60.0  # a lock not refreshed for this long belongs to a writer that died elsewhere
LOCK_HEARTBEAT_S = 10.0


def _precondition_failed(err: BaseException) -> bool:
    """Whether an s3fs error is S3's 412 (a conditional PUT whose condition did not hold); s3fs turns it
    into FileExistsError (If-None-Match) or an OSError (If-Match) carrying botocore's error."""
    seen: BaseException | None = err
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
            return True
        if "pre-conditions you specified did not hold" in str(seen) or "PreconditionFailed" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class ObjectLock:
    """One writer at a time for a store in object storage, as ``flock`` gives on a local disk.

    The lock is the object ``<prefix>/.writer.lock``, created with a conditional PUT (``If-None-Match: *``:
    of two writers racing, exactly one PUT succeeds) and refreshed every ``heartbeat`` seconds by a
    background thread with ``If-Match`` on its own ETag, so a refresh never overwrites another writer's lock.
    It names its holder (host, pid, a random id). A lock is taken over, again by ``If-Match`` on the ETag that
    was read, when its holder is known dead: the same host with that pid gone (a capture killed with SIGKILL
    and rerun), or no refresh for ``ttl`` seconds by the object store's own clock (a writer that died on
    another machine). A holder whose refresh fails on the ETag has lost the lock; :meth:`check`, called
    before each commit, then raises instead of committing beside the new holder. Needs conditional writes
    (AWS S3 since 2024, MinIO, moto); a service without them is refused when the lock is taken."""

    def __init__(self, where: ObjectLocation, ttl: float = LOCK_TTL_S, heartbeat: float = LOCK_HEARTBEAT_S):
        import socket
        import threading

        self.where = where
        self.key = f"{where.fs_path}/{LOCK_OBJECT}"
        self.ttl, self.heartbeat = float(ttl), float(heartbeat)
        self.owner = {"id": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid()}
        self.etag: str | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()

    # the object: PUT with a condition, HEAD for its ETag and the age of its last refresh
    def _put(self, **condition) -> str:
        import json
        import time

        body = json.dumps(self.owner | {"refreshed": time.time()}).encode()
        bucket, _, key = self.key.partition("/")
        out = filesystem().call_s3("put_object", Bucket=bucket, Key=key, Body=body, **condition)
        return out["ETag"]

    def _holder(self) -> tuple[dict, str, float] | None:
        """(holder, ETag, seconds since its last refresh by the store's clock), or None when there is none.
        The ETag is read before the body: a lock replaced in between makes a takeover conditioned on that
        ETag fail, never succeed over the newer holder."""
        import json
        from email.utils import parsedate_to_datetime

        bucket, _, key = self.key.partition("/")
        fs = filesystem()
        try:
            head = fs.call_s3("head_object", Bucket=bucket, Key=key)
            raw = fs.cat_file(self.key)
        except FileNotFoundError:
            return None
        now = parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
        age = (now - head["LastModified"]).total_seconds()
        try:
            holder = json.loads(raw)
        except ValueError:
            holder = {}
        return (holder if isinstance(holder, dict) else {}), head["ETag"], age

    def _dead(self, holder: dict, age: float) -> str | None:
        """Why the holder is known dead, or None."""
        import socket

        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int) \
                and holder["pid"] != os.getpid() and not _pid_alive(holder["pid"]):
            return f"its process {holder['pid']} on this host is gone"
        if age > self.ttl:
            return f"it was last refreshed {age:.0f} s ago (more than {self.ttl:.0f} s)"
        return None

    def acquire(self) -> None:
        """Take the lock or raise :class:`DsaIndexError` naming its holder and what to do."""
        import logging
        import threading

        try:
            try:
                self.etag = self._put(IfNoneMatch="*")
            except Exception as err:  # noqa: BLE001 - s3fs raises OSError kinds, botocore its own
                if not _precondition_failed(err):
                    raise
                found = self._holder()
                if found is None:  # released meanwhile: one more try, as a racing writer would
                    try:
                        self.etag = self._put(IfNoneMatch="*")
                    except Exception as err2:  # noqa: BLE001
                        if _precondition_failed(err2):
                            raise WriterLockError(f"Another writer took {self.where}/{LOCK_OBJECT} at the same time.",
                                                  "wait for it to finish, or write to another prefix.") from None
                        raise
                else:
                    holder, etag, age = found
                    why = self._dead(holder, age)
                    if why is None:
                        who = f"process {holder.get('pid', '?')} on {holder.get('host', '?')}"
                        raise WriterLockError(
                            f"Another writer ({who}, last refreshed {age:.0f} s ago) holds {self.where}/{LOCK_OBJECT}.",
                            "wait for it to finish; if it died on another machine, run again after "
                            f"{max(0.0, self.ttl - age):.0f} s, when its lock expires.") from None
                    try:
                        self.etag = self._put(IfMatch=etag)
                    except Exception as err2:  # noqa: BLE001
                        if _precondition_failed(err2):
                            raise WriterLockError(f"Another writer took {self.where}/{LOCK_OBJECT} at the same time.",
                                                  "wait for it to finish, or write to another prefix.") from None
                        raise
                    logging.getLogger(__name__).warning(
                        "took over the writer lock of %s from process %s on %s: %s", self.where, holder.get("pid"),
                        holder.get("host"), why)
        except DsaIndexError:
            raise
        except Exception as err:  # noqa: BLE001
            if _conditional_writes_unsupported(err):
                raise DsaIndexError(f"The object store refused a conditional write under {self.where}, which the "
                                    "writer lock needs.",
                                    "use an S3 service with conditional writes (AWS S3, MinIO, moto), or a local "
                                    "path.") from None
            raise object_error(self.where, err, "Locking") from None
        self._stop.clear()
        self._thread = threading.Thread(target=self._refresh, name="dsaindex-object-lock", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(self.heartbeat):
            with self._guard:
                if self.etag is None:
                    return
                try:
                    self.etag = self._put(IfMatch=self.etag)
                except Exception as err:  # noqa: BLE001 - a refresh that fails transiently is tried again
                    if _precondition_failed(err):
                        self.lost = "another writer took its lock over"
                        self.etag = None
                        return

    def check(self) -> None:
        """Raise :class:`DsaIndexError` when this writer has lost the lock (before it commits anything)."""
        if self.lost is not None:
            raise WriterLockError(f"This writer lost {self.where}/{LOCK_OBJECT}: {self.lost}. Nothing more was "
                                "committed.",
                                "check that no other capture writes to this store, then run the command again: "
                                "it resumes after the last committed sequence.")

    def release(self) -> None:
        """Stop refreshing and delete the lock if it is still this writer's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat + 5)
            self._thread = None
        with self._guard:
            etag, self.etag = self.etag, None
        if etag is None:
            return
        try:
            found = self._holder()
            if found is not None and found[1] == etag:
                filesystem().rm_file(self.key)
        except Exception:  # noqa: BLE001 - a lock left behind expires, or is taken over by this host's next run
            pass


def _conditional_writes_unsupported(err: BaseException) -> bool:
    text = str(err)
    return "NotImplemented" in text or "not implemented" in text.lower()
