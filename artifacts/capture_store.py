"""The capture store: indexer keys, sampled queries and head weights of model runs, in a zarr v3 group.

Layout (``L`` = a layer id that runs an indexer)::

    <store>/                         group; attributes hold {"dsaindex": {"manifest": ..., "committed": ...}}
      sequence_tokens    [S]         int32 tokens per captured sequence
      sequence_keys      [S]         int32 keys per sequence (tokens, or V4 compressed entries)
      sequence_queries   [S]         int32 sampled queries per sequence
      tokens             [N_tok]     int32 token ids, sequences back to back
      query_position     [M]         int32 token position of each sampled query in its sequence
      query_sequence     [M]         int32 sequence index of each sampled query
      query_window       [M]         int32 decode-window id of the query, -1 for a scattered one
      layers/L/keys      [N_keys, D] keys as scored (after norm + RoPE), in the manifest's basis
      layers/L/queries   [M, H, D]   queries at the sampled positions (same positions in every layer)
      layers/L/head_weights [M, H]   float32 effective head weights (see dsaindex.score)

bfloat16 arrays are stored as their uint16 bit patterns; the manifest names the logical dtype. Chunks are
blosc-compressed and, in stores written since the checksums were added, end with a crc32c of their bytes:
:meth:`CaptureStore.verify` reads every committed chunk, and a chunk that fails to decode is reported as a
:class:`~dsaindex.errors.CorruptStoreError` naming its array.

Crash safety: data is appended first, then ``committed`` (the row counts of every array) is advanced
in the group attributes. Zarr replaces each chunk file atomically, so committed rows are never torn; on
reopening, rows past ``committed`` (a write the crash interrupted) are cut away and the capture resumes
from ``committed.sequences``. A lock file keeps to one writer.

A store may also live in object storage (``s3://bucket/prefix``, :mod:`dsaindex.artifacts.storage`). The
same protocol holds there without rename or fsync: every chunk and the group's ``zarr.json`` (which holds
``committed``) is one PUT, which replaces the whole object at once and is durable and visible when it
returns; the group's ``zarr.json`` is put after the rows it counts. A new store's arrays are put before its
group's ``zarr.json``, so a creation cut short leaves array metadata only, which the next run replaces.
Object storage has no advisory locks: there the writer lock is an object, ``.writer.lock`` under the
store's prefix, taken with a conditional PUT and refreshed while the writer runs
(:class:`~dsaindex.artifacts.storage.ObjectLock`); a writer that lost it commits nothing more.
"""

from __future__ import annotations

import fcntl
import fnmatch
import os
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from dsaindex._version import __version__
from dsaindex.artifacts.fingerprint import ModelFingerprint
from dsaindex.artifacts.storage import LOCK_OBJECT, ObjectLocation, ObjectLock, location
from dsaindex.errors import CorruptStoreError, DsaIndexError, StoreMismatchError, WriterLockError, differences

if TYPE_CHECKING:
    import torch

SCHEMA_ID = "dsaindex.capture-store"
SCHEMA_VERSION = 1
ATTR_KEY = "dsaindex"
KEY_DTYPES = ("bfloat16", "float32")

SEQUENCE_ARRAYS = ("sequence_tokens", "sequence_keys", "sequence_queries")
QUERY_ARRAYS = ("query_position", "query_sequence", "query_window")


class QuerySampling(BaseModel):
    """Which positions of each sequence get their queries and head weights recorded.

    ``scattered`` positions are drawn uniformly over the sequence; ``windows`` runs of ``window_len``
    consecutive positions (decode-like steps) start in the second half of it. The draw depends only on
    the seed and the sequence index, so every layer sees the same positions.
    """

    model_config = ConfigDict(extra="forbid")
    scattered: int = 32
    windows: int = 2
    window_len: int = 16
    seed: int = 0


class PrefillSelection(BaseModel):
    """How the captured model chose the keys its sparse attention read during the capture, where that was
    not its own exact indexer: the runtime's IVF prefill selection (``kind``) from the ivf bundle
    ``bundle_id`` at ``budget`` candidates a query, as ``dsaindex serve`` prefills. Later layers' keys
    follow from that choice, so it is part of what a store holds."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["ivf"] = "ivf"
    bundle_id: str
    budget: int


class CaptureSettings(BaseModel):
    """Settings that shape what a capture writes; a resume must use the same ones. ``prefill_selection``:
    None where the model selected with its own exact indexer (every store before it was recorded)."""

    model_config = ConfigDict(extra="forbid")
    seq_len: int = 4096
    chunk_len: int = 2048
    basis: Literal["raw", "hadamard"] = "hadamard"
    key_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    sampling: QuerySampling = QuerySampling()
    prefill_selection: PrefillSelection | None = None


class CaptureManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    schema_id: Literal["dsaindex.capture-store"] = SCHEMA_ID
    schema_version: int = SCHEMA_VERSION
    store_id: str
    created_at: str
    dsaindex_version: str
    model: ModelFingerprint
    settings: CaptureSettings
    corpus: dict[str, Any]
    tokenizer: str


class Committed(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sequences: int = 0
    tokens: int = 0
    keys: int = 0
    queries: int = 0


class SequenceBatch(BaseModel):
    """Captured data of whole sequences, ready to append (numpy arrays, host memory)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    sequence_tokens: list[int] = []
    sequence_keys: list[int] = []
    sequence_queries: list[int] = []
    tokens: list[np.ndarray] = []
    query_position: list[np.ndarray] = []
    query_sequence: list[np.ndarray] = []
    query_window: list[np.ndarray] = []
    keys: dict[int, list[np.ndarray]] = {}
    queries: dict[int, list[np.ndarray]] = {}
    head_weights: dict[int, list[np.ndarray]] = {}

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(self.sequence_tokens)


def _storage_dtype(logical: str) -> str:
    return {"bfloat16": "uint16", "float32": "float32"}[logical]


def _compressors():
    import zarr

    # crc32c after blosc: a damaged chunk fails its checksum instead of decoding into wrong numbers
    return [zarr.codecs.BloscCodec(cname="zstd", clevel=3, shuffle=zarr.codecs.BloscShuffle.bitshuffle),
            zarr.codecs.Crc32cCodec()]


def _damaged(path: Path | ObjectLocation, name: str, err: Exception, where: str = "") -> CorruptStoreError:
    detail = " ".join(str(err).split())
    if "checksum" in detail.lower():
        detail = "its crc32c checksum does not match"
    else:
        detail = f"{type(err).__name__}: {detail[:160]}"
    return CorruptStoreError(
        f"{path}: array {name}{where} cannot be read ({detail}).",
        "the store is damaged on disk: restore it from a copy, or capture again into a new path.",
    )


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path("/")


class CaptureStore:
    """A capture store on disk. Use :meth:`create`, :meth:`open` or :meth:`open_for_append`."""

    def __init__(self, path: Path | ObjectLocation, group, manifest: CaptureManifest, committed: Committed,
                 every_chunk_written: bool = True):
        self.path = path
        self.group = group
        self.manifest = manifest
        self.committed = committed
        # stores created before chunks of zeros were written too: a missing chunk there may be one zarr skipped
        self.every_chunk_written = every_chunk_written
        self._lock_fd: int | None = None
        self._object_lock: ObjectLock | None = None  # in object storage

    # ---- opening -------------------------------------------------------------------------------
    @staticmethod
    def exists(path: str | Path) -> bool:
        where = location(path)
        if isinstance(where, ObjectLocation):
            from dsaindex.artifacts.storage import object_exists

            return object_exists(where, "zarr.json")
        return (where / "zarr.json").is_file()

    @classmethod
    def check_location(cls, path: str | Path) -> None:
        """Refuse, before anything is loaded or written, a store path that cannot become a store: a regular
        file (or a path under one), a folder that holds other things, a foreign zarr group, or a location
        where nothing can be created (read-only filesystem, no permission, ``/proc``). An existing store is
        opened to check it is one of ours; nothing is created or changed. In object storage: the prefix holds
        one of our stores or nothing, and a probe object can be put and deleted there."""
        path = location(path)
        if isinstance(path, ObjectLocation):
            from dsaindex.artifacts.storage import check_writable, list_objects

            if cls.exists(path):
                cls.open(path)
            elif not _creation_cut_short(list_objects(path)):
                raise DsaIndexError(f"{path} holds objects but no capture store.",
                                    "capture into a new prefix, or resume an existing store.")
            check_writable(path)
            return
        if cls.exists(path):
            cls.open(path)
            if not os.access(path, os.W_OK):
                raise DsaIndexError(f"The capture store {path} is read-only here.",
                                    "make it writable (or copy it somewhere writable) to resume it.")
            return
        base = _nearest_existing(path)
        if not base.is_dir():
            what = "is a file" if base == path else f"cannot be created: {base} is a file"
            raise DsaIndexError(f"The store path {path} {what}, not a folder.",
                                "pass a new folder path for the capture store.")
        if base == path and any(path.iterdir()):
            raise DsaIndexError(f"{path} exists and is not empty.",
                                "capture into a new path, or resume an existing store.")
        try:  # os.access is not enough: root passes it on /proc, and it says nothing of quotas
            os.rmdir(tempfile.mkdtemp(prefix=".dsaindex-probe-", dir=base))
        except OSError as err:
            raise DsaIndexError(
                f"The capture store {path} cannot be created: nothing can be written under {base} "
                f"({err.strerror or err}).",
                "pass a store path on a writable filesystem (check permissions, and that it is not read-only).",
            ) from None

    @classmethod
    def open(cls, path: str | Path) -> CaptureStore:
        """Open an existing store read-only (sees only committed rows)."""
        import zarr

        path = location(path)
        if isinstance(path, ObjectLocation):
            return cls._from_group(path, _open_remote_group(path, "r"))
        if not path.exists():
            raise CorruptStoreError(f"No capture store at {path}.", "check the path, or create one with `dsaindex capture`.")
        if not path.is_dir():
            raise CorruptStoreError(f"{path} is a file, not a capture store (a folder).",
                                    "check the path, or create a store with `dsaindex capture`.")
        try:
            group = zarr.open_group(str(path), mode="r", zarr_format=3)  # the format pinned: never a v2 reading
        except Exception as err:  # noqa: BLE001 - zarr raises several kinds for foreign folders
            what = "a zarr v2 group, not the v3 group" if (path / ".zgroup").is_file() else "not a zarr v3 group"
            raise CorruptStoreError(
                f"{path} is {what} a capture store is ({type(err).__name__}: {err}).",
                "point at a store written by `dsaindex capture`, or capture into a new path.",
            ) from None
        return cls._from_group(path, group)

    @classmethod
    def _from_group(cls, path: Path | ObjectLocation, group) -> CaptureStore:
        attrs = dict(group.attrs).get(ATTR_KEY)
        if not isinstance(attrs, dict) or "manifest" not in attrs:
            raise CorruptStoreError(
                f"{path} is a zarr group but not a dsaindex capture store (no '{ATTR_KEY}' manifest).",
                "capture into a new path; this one belongs to something else.",
            )
        try:
            manifest = CaptureManifest.model_validate(attrs["manifest"])
            committed = Committed.model_validate(attrs.get("committed", {}))
        except ValidationError as err:
            first = err.errors()[0]
            raise CorruptStoreError(
                f"{path} has an invalid capture manifest ({'.'.join(map(str, first['loc']))}: {first['msg']}).",
                "the store was written by an incompatible version or edited by hand; capture into a new path.",
            ) from None
        store = cls(path, group, manifest, committed, every_chunk_written=bool(attrs.get("every_chunk_written")))
        store._check_arrays()
        return store

    @classmethod
    def create(cls, path: str | Path, manifest: CaptureManifest) -> CaptureStore:
        path = location(path)
        if isinstance(path, ObjectLocation):
            from dsaindex.artifacts.storage import list_objects, remove_objects, upload_folder

            lock = ObjectLock(path)  # two first runs into one prefix: one creates, the other is refused
            lock.acquire()
            try:
                found = list_objects(path)
                if not _creation_cut_short(found):
                    raise DsaIndexError(f"{path} holds objects already.", "capture into a new prefix, or resume an "
                                        "existing store.")
                remove_objects(path, keep=(LOCK_OBJECT,))
                # made in a local folder (metadata only: the arrays are empty), then put with the group's
                # zarr.json last: until it is there the prefix is no store, and the next run starts it again
                with tempfile.TemporaryDirectory(prefix="dsaindex-store-") as staging:
                    cls._create(Path(staging), manifest)
                    upload_folder(Path(staging), path, last="zarr.json")
            finally:
                lock.release()
            return cls._from_group(path, _open_remote_group(path, "r+"))
        if path.exists() and not path.is_dir():
            raise DsaIndexError(f"The store path {path} is a file, not a folder.",
                                "pass a new folder path for the capture store.")
        if path.exists() and any(path.iterdir()):
            raise DsaIndexError(f"{path} exists and is not empty.", "capture into a new path, or resume an existing store.")
        try:
            return cls._create(path, manifest)
        except OSError as err:
            raise DsaIndexError(f"The capture store {path} cannot be created ({err.strerror or err}).",
                                "pass a store path on a writable filesystem with free space.") from None

    @classmethod
    def _create(cls, path: Path, manifest: CaptureManifest) -> CaptureStore:
        import zarr

        group = zarr.open_group(str(path), mode="w", zarr_format=3)
        geometry = manifest.model.geometry
        heads, dim = geometry.n_heads, geometry.head_dim
        key_dtype = _storage_dtype(manifest.settings.key_dtype)
        comp = _compressors()
        for name in SEQUENCE_ARRAYS:
            group.create_array(name, shape=(0,), chunks=(4096,), dtype="int32", compressors=comp)
        group.create_array("tokens", shape=(0,), chunks=(1 << 18,), dtype="int32", compressors=comp)
        for name in QUERY_ARRAYS:
            group.create_array(name, shape=(0,), chunks=(8192,), dtype="int32", compressors=comp)
        key_rows = max(1024, (4 << 20) // (dim * 2))  # ~4 MiB chunks
        query_rows = max(16, (4 << 20) // (heads * dim * 2))
        for layer in geometry.indexer_layers:
            sub = group.require_group(f"layers/{layer}")
            sub.create_array("keys", shape=(0, dim), chunks=(key_rows, dim), dtype=key_dtype, compressors=comp)
            sub.create_array(
                "queries", shape=(0, heads, dim), chunks=(query_rows, heads, dim), dtype=key_dtype, compressors=comp
            )
            sub.create_array("head_weights", shape=(0, heads), chunks=(8192, heads), dtype="float32", compressors=comp)
        store = cls(path, group, manifest, Committed())
        store._write_attrs()
        return store

    @classmethod
    def open_for_append(cls, path: str | Path, expected: CaptureManifest | None = None) -> CaptureStore:
        """Open a store for writing: take the writer lock, check it matches ``expected`` (model and
        settings), and cut away rows past the committed counts."""
        import zarr

        store = cls.open(path)
        try:
            store._lock()
            if expected is not None:
                store._check_matches(expected)
            # the next append rewrites each array's last, partly filled chunk: it must decode
            store.verify(tail_only=True)
            if isinstance(store.path, ObjectLocation):
                store.group = _open_remote_group(store.path, "r+")
                store._truncate_to_committed()  # each PUT is whole: no partial object to sweep
            else:
                store.group = zarr.open_group(str(store.path), mode="r+", zarr_format=3)
                store._truncate_to_committed()
                for stray in store.path.rglob("*.partial"):
                    stray.unlink(missing_ok=True)
        except OSError as err:
            store.close()
            raise DsaIndexError(f"The capture store {store.path} cannot be opened for writing ({err.strerror or err}).",
                                "make the store writable, or capture into a new path.") from None
        except BaseException:
            store.close()
            raise
        return store

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._object_lock is not None:
            self._object_lock.release()
            self._object_lock = None

    def __enter__(self) -> CaptureStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- checks --------------------------------------------------------------------------------
    def _lock(self) -> None:
        if isinstance(self.path, ObjectLocation):  # a lock object, conditional PUTs (storage.ObjectLock)
            lock = ObjectLock(self.path)
            lock.acquire()
            self._object_lock = lock
            return
        fd = os.open(self.path / ".writer.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise WriterLockError(
                f"Another process is writing to {self.path}.", "wait for it to finish, or capture into another path."
            ) from None
        self._lock_fd = fd

    def _check_matches(self, expected: CaptureManifest) -> None:
        from dsaindex.artifacts.fingerprint import config_field_differences, configs_agree

        have, want = self.manifest, expected
        # the model: everything but the config, and the config by configs_agree (a store captured under
        # another transformers release, or before fingerprints recorded their fields, resumes)
        loose = {"config_fields", "config_digest"}
        model_a, model_b = have.model.model_dump(exclude=loose), want.model.model_dump(exclude=loose)
        if model_a == model_b and not configs_agree(have.model, want.model):
            model_a["config_digest"], model_b["config_digest"] = have.model.config_digest, want.model.config_digest
            if have.model.config_fields is not None and want.model.config_fields is not None:  # name the fields
                fields = config_field_differences(have.model.config_fields, want.model.config_fields)
                model_a["config_fields"] = {k: a for k, (a, _) in fields.items()}
                model_b["config_fields"] = {k: b for k, (_, b) in fields.items()}
        for label, a, b in (
            ("model", model_a, model_b),
            ("settings", have.settings.model_dump(), want.settings.model_dump()),
            ("corpus", have.corpus, want.corpus),
            ("tokenizer", have.tokenizer, want.tokenizer),
        ):
            if a != b:
                diffs = differences(a, b)
                raise StoreMismatchError(
                    f"{self.path} was captured with another {label} ({diffs}).",
                    "resume with the store's own model and settings (`dsaindex store info` shows them), "
                    "or capture into a new path.",
                )

    def _arrays(self) -> dict[str, tuple[Any, str]]:
        """name -> (array, which committed count its rows follow)."""
        g = self.group
        out = {name: (g[name], "sequences") for name in SEQUENCE_ARRAYS}
        out["tokens"] = (g["tokens"], "tokens")
        out.update({name: (g[name], "queries") for name in QUERY_ARRAYS})
        for layer in self.layers:
            out[f"layers/{layer}/keys"] = (g[f"layers/{layer}/keys"], "keys")
            out[f"layers/{layer}/queries"] = (g[f"layers/{layer}/queries"], "queries")
            out[f"layers/{layer}/head_weights"] = (g[f"layers/{layer}/head_weights"], "queries")
        return out

    def _check_arrays(self) -> None:
        counts = self.committed.model_dump()
        try:
            arrays = self._arrays()
        except KeyError as err:
            raise CorruptStoreError(
                f"{self.path} lacks the array {err.args[0]!r}.", "the store is damaged; capture into a new path."
            ) from None
        for name, (arr, which) in arrays.items():
            if arr.shape[0] < counts[which]:
                raise CorruptStoreError(
                    f"{self.path}: array {name} has {arr.shape[0]} rows but {counts[which]} are committed.",
                    "the store is damaged; capture into a new path.",
                )

    def _truncate_to_committed(self) -> None:
        counts = self.committed.model_dump()
        for _name, (arr, which) in self._arrays().items():
            if arr.shape[0] != counts[which]:
                arr.resize((counts[which], *arr.shape[1:]))

    # ---- writing -------------------------------------------------------------------------------
    def _write_attrs(self) -> None:
        self.group.attrs.update(
            {ATTR_KEY: {"manifest": self.manifest.model_dump(mode="json"), "committed": self.committed.model_dump(),
                        "every_chunk_written": self.every_chunk_written}}
        )

    def append(self, batch: SequenceBatch) -> None:
        """Append whole sequences, then advance ``committed``. A crash in between loses only this batch."""
        if batch.num_sequences == 0:
            return
        import zarr

        with zarr.config.set({"array.write_empty_chunks": True}):  # a chunk of zeros is stored too, so a missing
            self._append(batch)  # file is always a loss (check_chunks), never a chunk zarr chose not to write

    def _append(self, batch: SequenceBatch) -> None:
        arrays = self._arrays()
        columns: dict[str, np.ndarray] = {
            "sequence_tokens": np.asarray(batch.sequence_tokens, dtype=np.int32),
            "sequence_keys": np.asarray(batch.sequence_keys, dtype=np.int32),
            "sequence_queries": np.asarray(batch.sequence_queries, dtype=np.int32),
            "tokens": np.concatenate(batch.tokens).astype(np.int32),
            "query_position": np.concatenate(batch.query_position).astype(np.int32),
            "query_sequence": np.concatenate(batch.query_sequence).astype(np.int32),
            "query_window": np.concatenate(batch.query_window).astype(np.int32),
        }
        for layer in self.layers:
            columns[f"layers/{layer}/keys"] = np.concatenate(batch.keys[layer])
            columns[f"layers/{layer}/queries"] = np.concatenate(batch.queries[layer])
            columns[f"layers/{layer}/head_weights"] = np.concatenate(batch.head_weights[layer]).astype(np.float32)
        counts = self.committed.model_dump()
        try:
            for name, values in columns.items():
                arr, which = arrays[name]
                start = counts[which]
                arr.resize((start + len(values), *arr.shape[1:]))
                arr[start : start + len(values)] = values
        except OSError as err:
            raise DsaIndexError(
                f"Writing to the capture store {self.path} failed ({err.strerror or err}); "
                f"{self.committed.sequences} sequences stay committed.",
                "free space or fix permissions there, then run the same command again: it resumes after the "
                "last committed sequence.",
            ) from None
        self.committed = Committed(
            sequences=self.committed.sequences + batch.num_sequences,
            tokens=self.committed.tokens + len(columns["tokens"]),
            keys=self.committed.keys + sum(batch.sequence_keys),
            queries=self.committed.queries + len(columns["query_position"]),
        )
        if self._object_lock is not None:
            self._object_lock.check()  # another writer took the store over: commit nothing beside it
        self._write_attrs()

    # ---- reading -------------------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        return list(self.manifest.model.geometry.indexer_layers)

    def _read(self, name: str, which: str) -> np.ndarray:
        n = getattr(self.committed, which)
        self._check_chunks(name, self.group[name], n)  # zarr reads a missing chunk as zeros: refuse it first
        try:
            return self.group[name][:n]
        except MemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - blosc, crc32c and zarr raise several kinds for a bad chunk
            raise _damaged(self.path, name, err) from None

    def verify(self, tail_only: bool = False, layers: list[int] | None = None) -> int:
        """Read every chunk of the committed rows of every array (only the last one of each with
        ``tail_only``; of the given ``layers`` and the shared arrays only, with ``layers``); a chunk that is
        missing (zarr would read it as zeros), fails to decode or to match its checksum raises
        :class:`~dsaindex.errors.CorruptStoreError` naming the array and the rows. Returns the number of
        chunks read."""
        counts = self.committed.model_dump()
        read = 0
        wanted = None if layers is None else {f"layers/{layer}/" for layer in layers}
        for name, (arr, which) in self._arrays().items():
            if wanted is not None and name.startswith("layers/") and not any(name.startswith(w) for w in wanted):
                continue
            rows, step = counts[which], arr.chunks[0]
            starts = range(0, rows, step)
            for start in starts[-1:] if tail_only else starts:
                stop = min(start + step, rows)
                self._check_chunks(name, arr, stop, start)
                try:
                    arr[start:stop]
                except MemoryError:
                    raise
                except Exception as err:  # noqa: BLE001 - see _read
                    raise _damaged(self.path, name, err, f" (rows {start}-{stop - 1})") from None
                read += 1
        return read

    def check_chunks(self, layers: list[int] | None = None) -> int:
        """That every chunk of the committed rows of every array (of ``layers`` and the shared arrays, with
        ``layers``) is stored, without reading one: what a training checks for all its layers before the first
        starts (stores this version creates store every chunk, zeros included; older ones are not checked). Raises :class:`~dsaindex.errors.CorruptStoreError` naming the array and rows of a missing one;
        returns the number of chunks checked. (:meth:`verify` also reads them, for checksums.)"""
        counts = self.committed.model_dump()
        wanted = None if layers is None else {f"layers/{layer}/" for layer in layers}
        checked = 0
        for name, (arr, which) in self._arrays().items():
            if wanted is not None and name.startswith("layers/") and not any(name.startswith(w) for w in wanted):
                continue
            checked += self._check_chunks(name, arr, counts[which])
        return checked

    def _check_chunks(self, name: str, arr: Any, stop: int, start: int = 0) -> int:
        """Refuse a missing chunk among rows [start, stop) of ``arr``; returns the chunks checked (0 for a store
        written before every chunk was stored, where a missing one may be zeros zarr chose not to write)."""
        if not self.every_chunk_written:
            return 0
        step = arr.chunks[0]
        for index in range(start // step, -(-stop // step)):
            if not _chunk_exists(arr, index):
                first, last = index * step, min((index + 1) * step, stop) - 1
                raise CorruptStoreError(f"{self.path}: array {name} has lost its chunk of committed rows "
                                        f"{first}-{last} (a missing file reads back as zeros).",
                                        "restore the store from a copy, or capture into a new path.")
        return max(0, -(-stop // step) - start // step)

    def keys(self, layer: int) -> np.ndarray:
        """[N_keys, D] keys of a layer in storage form (uint16 bf16 bits or float32)."""
        return self._read(f"layers/{layer}/keys", "keys")

    def queries(self, layer: int) -> np.ndarray:
        return self._read(f"layers/{layer}/queries", "queries")

    def head_weights(self, layer: int) -> np.ndarray:
        return self._read(f"layers/{layer}/head_weights", "queries")

    def array(self, name: str) -> np.ndarray:
        which = "sequences" if name in SEQUENCE_ARRAYS else "queries" if name in QUERY_ARRAYS else "tokens"
        return self._read(name, which)

    def as_float(self, values: np.ndarray) -> torch.Tensor:
        """Storage form -> torch float32 tensor (decodes bf16 bits)."""
        import torch

        t = torch.from_numpy(np.ascontiguousarray(values))
        if self.manifest.settings.key_dtype == "bfloat16":
            return t.view(torch.bfloat16).float()
        return t.float()

    def engine_keys(self, rows: np.ndarray, key_format: str | None = None) -> torch.Tensor:
        """Stored keys (rows of :meth:`keys`, any slice) as the engine holds them: float32 [N, D] after the
        FP8 e4m3 + ue8m0 round trip of ``key_format`` (default: the store's model's,
        :func:`dsaindex.quant.engine_keys`). The one reader of engine-precision keys: training, recall and
        benchmarks all read through it."""
        from dsaindex.quant import engine_keys

        return engine_keys(self.as_float(rows), key_format or self.manifest.model.geometry.key_format)

    def nbytes_stored(self, under: str = "") -> int:
        """Bytes on disk of the whole store, or of the arrays whose path matches ``under`` (a glob)."""
        if isinstance(self.path, ObjectLocation):
            from dsaindex.artifacts.storage import object_sizes

            pattern = under.split("/") if under else []

            def matches(rel: str) -> bool:  # as Path.glob(under) then rglob: the first segments match
                parts = rel.split("/")
                return len(parts) > len(pattern) and all(
                    fnmatch.fnmatchcase(part, want) for part, want in zip(parts, pattern, strict=False))

            return sum(size for rel, size in object_sizes(self.path).items() if matches(rel))
        roots = list(self.path.glob(under)) if under else [self.path]
        return sum(f.stat().st_size for root in roots for f in root.rglob("*") if f.is_file())

    def info(self) -> dict[str, Any]:
        m = self.manifest
        g = m.model.geometry
        return {
            "path": str(self.path),
            "store_id": m.store_id,
            "schema": f"{m.schema_id}/{m.schema_version}",
            "created_at": m.created_at,
            "model": {"name": m.model.name, "family": m.model.family, "dtype": m.model.dtype,
                      "config_digest": m.model.config_digest, "weights_digest": m.model.weights_digest},
            "layers": self.layers,
            "n_heads": g.n_heads,
            "head_dim": g.head_dim,
            "topk": g.topk,
            "key_stride": g.key_stride,
            "basis": m.settings.basis,
            "key_dtype": m.settings.key_dtype,
            "settings": m.settings.model_dump(),
            "corpus": m.corpus,
            "tokenizer": m.tokenizer,
            "committed": self.committed.model_dump(),
            "keys_per_layer": self.committed.keys,
            "queries_per_layer": self.committed.queries,
            "bytes_on_disk": self.nbytes_stored(),
            "key_bytes_on_disk": self.nbytes_stored("layers/*/keys"),
        }


def new_manifest(model: ModelFingerprint, settings: CaptureSettings, corpus: dict, tokenizer: str) -> CaptureManifest:
    return CaptureManifest(
        store_id=uuid.uuid4().hex[:12],
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        dsaindex_version=__version__,
        model=model,
        settings=settings,
        corpus=corpus,
        tokenizer=tokenizer,
    )


def _creation_cut_short(objects: list[str]) -> bool:
    """Whether the objects under a prefix are nothing, or what a store creation cut short leaves in object
    storage: array and group metadata without the root ``zarr.json`` (put last), no chunk; a writer's lock
    object aside."""
    return "zarr.json" not in objects and all(key.endswith("/zarr.json") or key == LOCK_OBJECT for key in objects)


def _open_remote_group(path: ObjectLocation, mode: Literal["r", "r+"]):
    """The zarr group of a store in object storage; a missing or foreign one raises :class:`CorruptStoreError`,
    an unreachable bucket a :class:`DsaIndexError` naming the fix."""
    import zarr

    from dsaindex.artifacts.storage import list_objects, object_error

    try:
        return zarr.open_group(store=path.zarr_store(read_only=mode == "r"), mode=mode, zarr_format=3)
    except DsaIndexError:
        raise
    except Exception as err:  # noqa: BLE001 - zarr and s3fs raise several kinds
        objects = list_objects(path)  # a missing bucket or refused credentials are named here
        if not objects:
            raise CorruptStoreError(f"No capture store at {path}.",
                                    "check the URI, or create one with `dsaindex capture`.") from None
        if "zarr.json" not in objects:
            what = "a zarr v2 group, not the v3 group" if ".zgroup" in objects else "not a zarr v3 group"
            raise CorruptStoreError(f"{path} is {what} a capture store is (no zarr.json).",
                                    "point at a store written by `dsaindex capture`, or capture into a new "
                                    "prefix.") from None
        raise object_error(path, err, "Opening") from None


def _chunk_exists(arr: Any, index: int) -> bool:
    """Whether the chunk ``index`` along the rows of ``arr`` (every other dimension is one chunk) is stored."""
    from zarr.core.sync import sync

    key = arr.metadata.encode_chunk_key((index,) + (0,) * (len(arr.shape) - 1))
    return bool(sync(arr.store_path.store.exists(f"{arr.path}/{key}")))
