"""The artifact bundle: trained index parameters for one target model, in a zarr v3 group.

Layout (``L`` = a layer id, ``NAME`` = an array name of that layer's artifact)::

    <bundle>/                  group; attributes hold {"dsaindex": <BundleManifest as JSON>}
      layers/L/NAME            any shape and numeric dtype (codebooks, encoder weights, plans)

The manifest carries its own ``schema_version`` (not the library version), the fingerprint of the
model the bundle was trained for, one :class:`LayerArtifact` per layer (its kind, its parameters and a
shape/dtype/sha256 record of each array), the training lineage (which capture store, by digest; which
sequences trained and which evaluated) and the metrics of the training.

A bundle is written into a hidden sibling folder and renamed into place at the end, so ``path`` holds
either a whole bundle or nothing. In object storage (``s3://bucket/prefix``, :mod:`dsaindex.artifacts.storage`),
which has no rename, the arrays are put first and the root ``zarr.json`` (which holds the manifest) last: it
is the commit marker, and a reader refuses a prefix without it. Reading verifies every array against its
checksum. Nothing is ever
pickled, and no string of a manifest is ever turned into code.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from dsaindex._version import __version__
from dsaindex.artifacts.fingerprint import ModelFingerprint
from dsaindex.artifacts.storage import ObjectLocation, location
from dsaindex.errors import CorruptBundleError, DsaIndexError

if TYPE_CHECKING:
    from dsaindex.artifacts.capture_store import CaptureStore

SCHEMA_ID = "dsaindex.artifact-bundle"
SCHEMA_VERSION = 1
ATTR_KEY = "dsaindex"
CHUNK_BYTES = 16 << 20
_ARRAY_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_REWRITE_FIX = "train again to write a fresh bundle, or pull it again from the registry."


class ArrayRecord(BaseModel):
    """Shape, numpy dtype name and content checksum (see :func:`array_sha256`) of one array."""

    model_config = ConfigDict(extra="forbid")
    shape: list[int]
    dtype: str
    sha256: str


class LayerArtifact(BaseModel):
    """What one layer's index is: its kind (one of :mod:`dsaindex.artifacts.kinds`), its parameters,
    and its arrays (filled by :func:`write_bundle`).

    The bundle is a container: it checks that the kind is registered; the kind's own parameter model
    and array names are checked where the layer is used (:func:`dsaindex.runtime.loader.place_layers`)."""

    model_config = ConfigDict(extra="forbid")
    kind: str
    params: dict[str, Any]
    arrays: dict[str, ArrayRecord] = {}

    @field_validator("kind")
    @classmethod
    def _registered(cls, kind: str) -> str:
        from dsaindex.artifacts.kinds import KINDS

        if kind not in KINDS:
            raise ValueError(f"unknown artifact kind {kind!r} (this dsaindex knows {', '.join(sorted(KINDS))})")
        return kind


class Lineage(BaseModel):
    """Where the training data came from: the capture store (id, path, content digest) and the split."""

    model_config = ConfigDict(extra="forbid")
    capture_store_id: str
    capture_store_path: str
    capture_store_digest: str
    train_sequences: list[int]
    eval_sequences: list[int]


class BundleManifest(BaseModel):
    """The manifest of an artifact bundle; ``layers`` is keyed by ``str(layer id)``."""

    model_config = ConfigDict(extra="forbid")
    schema_id: Literal["dsaindex.artifact-bundle"] = SCHEMA_ID
    schema_version: int = SCHEMA_VERSION
    bundle_id: str
    created_at: str
    dsaindex_version: str
    model: ModelFingerprint
    basis: str
    key_format: str
    layers: dict[str, LayerArtifact]
    lineage: Lineage
    metrics: dict[str, float] = {}
    params: dict[str, Any] = {}

    @property
    def layer_ids(self) -> list[int]:
        return sorted(int(k) for k in self.layers)


def new_bundle_manifest(
    model: ModelFingerprint,
    basis: str,
    key_format: str,
    layers: dict[str, LayerArtifact] | dict[int, LayerArtifact],
    lineage: Lineage,
    metrics: dict[str, float] | None = None,
    params: dict[str, Any] | None = None,
) -> BundleManifest:
    """A manifest with a fresh ``bundle_id``, the current UTC time and this library's version.

    ``layers`` may be keyed by int or str layer ids; the manifest keys them by ``str(layer id)``.
    """
    return BundleManifest(
        bundle_id=uuid.uuid4().hex[:12],
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        dsaindex_version=__version__,
        model=model,
        basis=basis,
        key_format=key_format,
        layers={str(k): v for k, v in layers.items()},
        lineage=lineage,
        metrics=dict(metrics or {}),
        params=dict(params or {}),
    )


def array_sha256(values: np.ndarray) -> str:
    """sha256 (hex) over the dtype name, the shape and the little-endian C-order bytes of ``values``."""
    values = np.asarray(values)
    h = hashlib.sha256()
    h.update(f"{values.dtype.name}|{list(values.shape)}|".encode())
    h.update(np.asarray(values, dtype=values.dtype.newbyteorder("<"), order="C").tobytes())
    return h.hexdigest()


# ---- writing ---------------------------------------------------------------------------------------
def _chunks(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...] | str:
    """Whole array in one chunk, or row blocks of about CHUNK_BYTES for big ones."""
    if not shape:
        return "auto"  # zarr mishandles an explicit () for 0-d arrays
    row_bytes = itemsize * int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else itemsize
    rows = max(1, min(shape[0], CHUNK_BYTES // max(1, row_bytes)))
    return (rows, *(max(1, s) for s in shape[1:]))


def _check_arrays(manifest: BundleManifest, arrays: dict[int, dict[str, np.ndarray]]) -> None:
    for layer, named in arrays.items():
        if str(layer) not in manifest.layers:
            raise DsaIndexError(
                f"Arrays were given for layer {layer}, which the manifest does not list "
                f"(it lists {', '.join(manifest.layers) or 'none'}).",
                "add a LayerArtifact for that layer to the manifest, or drop its arrays.",
            )
        for name, values in named.items():
            if not _ARRAY_NAME.match(name):
                raise DsaIndexError(
                    f"Array name {name!r} of layer {layer} is not a plain name.",
                    "use letters, digits, '_', '.' or '-' only.",
                )
            kind = np.asarray(values).dtype.kind
            if kind not in "biuf":
                raise DsaIndexError(
                    f"Array {name!r} of layer {layer} has dtype {np.asarray(values).dtype}; bundles hold "
                    "bool, integer and float arrays only.",
                    "convert it to a numeric dtype (bfloat16 as its uint16 bits).",
                )


def check_bundle_destination(path: str | Path) -> Path | ObjectLocation:
    """Refuse a bundle destination that exists and is not an empty folder, or that cannot be created
    and written (a read-only filesystem, ``/proc``, a path under a file); call it before long work.

    The probe creates and removes an empty hidden folder where :func:`write_bundle` will write (beside
    ``path``, or in the closest existing folder above it); it creates none of the missing folders. In
    object storage the prefix must hold no object, and a probe object is put and deleted there."""
    path = location(path)
    if isinstance(path, ObjectLocation):
        from dsaindex.artifacts.storage import check_writable, list_objects

        if list_objects(path):
            raise DsaIndexError(f"{path} holds objects already.",
                                "write the bundle to a new prefix, or delete the objects under that one.")
        check_writable(path)
        return path
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise DsaIndexError(f"{path} exists and is not empty.",
                            "write the bundle to a new path (or leave out --out for a fresh default name), "
                            "or delete the old one.")
    base = path.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    fix = "pass --out on a writable filesystem (a folder of yours, e.g. under runs/ or $HOME)."
    if not base.is_dir():
        raise DsaIndexError(f"{path} cannot be created: {base} is a file, not a folder.", fix)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{path.name}.probe-", dir=base))
    except OSError as err:
        raise DsaIndexError(f"{path} cannot be written: creating a folder in {base} fails "
                            f"({err.strerror or type(err).__name__}).", fix) from None
    return path


def fresh_bundle_path(path: str | Path) -> Path:
    """``path`` where it is free (missing or an empty folder), else the first free of ``path-2``,
    ``path-3``, ...: a default destination that a rerun never collides with."""
    path = Path(path)

    def free(p: Path) -> bool:
        return not p.exists() or (p.is_dir() and not any(p.iterdir()))

    n = 2
    candidate = path
    while not free(candidate):
        candidate = path.with_name(f"{path.name}-{n}")
        n += 1
    return candidate


def write_bundle(path: str | Path, manifest: BundleManifest, arrays: dict[int, dict[str, np.ndarray]]) -> BundleManifest:
    """Write a bundle at ``path`` and return its manifest with ``layers[..].arrays`` filled in.

    Parameters
    ----------
    path : folder to create; must not exist, or be empty.
    manifest : from :func:`new_bundle_manifest`; its ``layers[..].arrays`` are replaced.
    arrays : ``{layer id: {array name: numpy array}}``; any shape, bool/int/float dtypes. Every layer
        must appear in ``manifest.layers``.

    Everything is written into a hidden sibling folder first and renamed onto ``path`` at the end, so a
    crash leaves no half bundle at ``path``. For ``s3://bucket/prefix`` the bundle is written into a local
    temporary folder and put there with its root ``zarr.json`` last (see :func:`publish_bundle`).
    """
    path = check_bundle_destination(path)
    _check_arrays(manifest, arrays)
    layers = {key: art.model_copy(update={"arrays": {}}) for key, art in manifest.layers.items()}
    for layer, named in arrays.items():
        layers[str(layer)].arrays = {
            name: ArrayRecord(shape=list(np.shape(v)), dtype=np.asarray(v).dtype.name, sha256=array_sha256(v))
            for name, v in named.items()
        }
    manifest = manifest.model_copy(update={"layers": layers})

    if isinstance(path, ObjectLocation):
        with tempfile.TemporaryDirectory(prefix="dsaindex-bundle-") as staging:
            folder = Path(staging) / path.name
            _write_group(folder, manifest, arrays)
            _upload(folder, path)
        return manifest
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        _write_group(tmp, manifest, arrays)
        if path.exists():
            path.rmdir()  # empty (checked above); rename needs the name free
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _write_group(folder: Path, manifest: BundleManifest, arrays: dict[int, dict[str, np.ndarray]]) -> None:
    """The bundle's zarr group in a new local ``folder``: every array, then the manifest."""
    import zarr

    group = zarr.open_group(str(folder), mode="w", zarr_format=3)
    compressors = [zarr.codecs.ZstdCodec(level=3)]
    for layer, named in arrays.items():
        sub = group.require_group(f"layers/{layer}")
        for name, values in named.items():
            values = np.asarray(values, order="C")
            arr = sub.create_array(
                name, shape=values.shape, chunks=_chunks(values.shape, values.dtype.itemsize),
                dtype=values.dtype, compressors=compressors, fill_value=0,
            )
            arr[...] = values
    group.attrs.update({ATTR_KEY: manifest.model_dump(mode="json")})


def _upload(folder: Path, dest: ObjectLocation) -> None:
    """Put a local bundle folder under ``dest``, its root ``zarr.json`` (the manifest, the commit marker)
    last; a failure part-way leaves a prefix that every reader refuses (:func:`_open`)."""
    from dsaindex.artifacts.storage import upload_folder

    upload_folder(folder, dest, last="zarr.json")


def publish_bundle(folder: str | Path, dest: str | Path) -> BundleManifest:
    """Copy the local bundle ``folder`` to ``dest`` (a new or empty folder, or an empty ``s3://`` prefix),
    verified first; returns its manifest. In object storage the root ``zarr.json`` is put last."""
    manifest, _ = read_bundle(folder, verify=True)
    dest = check_bundle_destination(dest)
    if isinstance(dest, ObjectLocation):
        _upload(Path(folder), dest)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.partial-{uuid.uuid4().hex[:8]}"
        try:
            shutil.copytree(folder, tmp)
            if dest.exists():
                dest.rmdir()
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return manifest


@contextmanager
def local_bundle(path: str | Path) -> Iterator[Path]:
    """A local folder holding the bundle at ``path``: ``path`` itself, or for ``s3://`` a verified download
    into a temporary folder removed afterwards (for tools that read folders only, such as MLflow's
    artifact logging)."""
    where = location(path)
    if not isinstance(where, ObjectLocation):
        yield where
        return
    from dsaindex.artifacts.storage import download_folder

    read_manifest(where)  # an unfinished or foreign prefix is refused before anything is downloaded
    with tempfile.TemporaryDirectory(prefix="dsaindex-bundle-") as staging:
        folder = Path(staging) / where.name
        download_folder(where, folder)
        read_bundle(folder, verify=True)
        yield folder


# ---- reading ---------------------------------------------------------------------------------------
def _open(path: Path | ObjectLocation):
    import zarr

    if isinstance(path, ObjectLocation):
        return _open_remote(path)
    if not path.is_dir():
        raise CorruptBundleError(f"No artifact bundle at {path}.", "check the path, or pull the bundle from the registry.")
    try:
        return zarr.open_group(str(path), mode="r", zarr_format=3)  # the format pinned: never a v2 reading
    except Exception as err:  # noqa: BLE001 - zarr raises several kinds for foreign folders
        what = "a zarr v2 group, not the v3 group" if (path / ".zgroup").is_file() else "not a zarr v3 group"
        raise CorruptBundleError(
            f"{path} is {what} a dsaindex bundle is ({type(err).__name__}: {err}).",
            "point at a bundle written by dsaindex training, or pull it again from the registry.",
        ) from None


def _open_remote(path: ObjectLocation):
    """The zarr group of a bundle in object storage, refused unless its root ``zarr.json`` (put last) is there."""
    import zarr

    from dsaindex.artifacts.storage import list_objects, object_error, object_exists

    if not object_exists(path, "zarr.json"):
        if list_objects(path):
            raise CorruptBundleError(
                f"{path} holds an unfinished bundle: its arrays are there but not its root zarr.json, the "
                "manifest a writer puts last (the write stopped part-way, or is still going on).",
                "write the bundle again into a new prefix (train again, or `dsaindex registry pull` it), and "
                "delete the objects under this one.")
        raise CorruptBundleError(f"No artifact bundle at {path}.",
                                 "check the URI, or pull the bundle from the registry.")
    try:
        return zarr.open_group(store=path.zarr_store(read_only=True), mode="r", zarr_format=3)
    except Exception as err:  # noqa: BLE001 - zarr and s3fs raise several kinds
        if isinstance(err, ValueError | KeyError | TypeError):
            raise CorruptBundleError(f"{path} is not a zarr v3 group a dsaindex bundle is ({type(err).__name__}: "
                                     f"{err}).", "point at a bundle written by dsaindex training.") from None
        raise object_error(path, err, "Opening") from None


def _manifest_of(path: Path | ObjectLocation, group) -> BundleManifest:
    attrs = dict(group.attrs).get(ATTR_KEY)
    if not isinstance(attrs, dict) or attrs.get("schema_id") != SCHEMA_ID:
        raise CorruptBundleError(
            f"{path} is a zarr group but not a dsaindex artifact bundle (no '{ATTR_KEY}' bundle manifest).",
            "point at a bundle written by dsaindex training; a capture store is not a bundle.",
        )
    version = attrs.get("schema_version")
    if isinstance(version, int) and version > SCHEMA_VERSION:
        raise CorruptBundleError(
            f"{path} has bundle schema version {version}; this dsaindex {__version__} reads up to {SCHEMA_VERSION}.",
            "upgrade dsaindex, or train the bundle again with this version.",
        )
    try:
        return BundleManifest.model_validate(attrs)
    except ValidationError as err:
        first = err.errors()[0]
        raise CorruptBundleError(
            f"{path} has an invalid bundle manifest ({'.'.join(map(str, first['loc']))}: {first['msg']}).",
            "the bundle was written by an incompatible version or edited by hand; " + _REWRITE_FIX,
        ) from None


def read_manifest(path: str | Path) -> BundleManifest:
    """The validated manifest of the bundle at ``path`` (arrays are not read)."""
    path = location(path)
    return _manifest_of(path, _open(path))


def read_bundle(path: str | Path, verify: bool = True) -> tuple[BundleManifest, dict[int, dict[str, np.ndarray]]]:
    """Read a bundle: its manifest and ``{layer id: {array name: numpy array}}``.

    Every array the manifest records must be present with its recorded shape and dtype; with
    ``verify`` its sha256 must match too. Any failure raises :class:`CorruptBundleError` naming the
    layer and array.
    """
    path = location(path)
    group = _open(path)
    manifest = _manifest_of(path, group)
    out: dict[int, dict[str, np.ndarray]] = {}
    for key in sorted(manifest.layers, key=int):
        layer = int(key)
        named: dict[str, np.ndarray] = {}
        for name, record in manifest.layers[key].arrays.items():
            where = f"{path}: layer {layer} array {name!r}"
            try:
                values = np.asarray(group[f"layers/{key}/{name}"][...])
            except KeyError:
                raise CorruptBundleError(f"{where} is missing.", _REWRITE_FIX) from None
            except Exception as err:  # noqa: BLE001 - a damaged chunk fails to decode in several ways
                raise CorruptBundleError(f"{where} cannot be decoded ({type(err).__name__}: {err}).", _REWRITE_FIX) from None
            if list(values.shape) != record.shape or values.dtype.name != record.dtype:
                raise CorruptBundleError(
                    f"{where} is {values.dtype.name}{list(values.shape)}, the manifest says "
                    f"{record.dtype}{record.shape}.",
                    _REWRITE_FIX,
                )
            if verify and array_sha256(values) != record.sha256:
                raise CorruptBundleError(f"{where} fails its sha256 checksum (the data changed on disk).", _REWRITE_FIX)
            named[name] = values
        out[layer] = named
    return manifest, out


# ---- lineage ---------------------------------------------------------------------------------------
def store_digest(store: CaptureStore) -> str:
    """16 hex chars identifying a capture store's content.

    sha256 over the manifest JSON, the committed counts and, for every chunk file of its arrays
    (sorted by path), its relative path and the sha256 of its bytes. Metadata files, lock files and
    interrupted ``.partial`` writes are left out.
    """
    h = hashlib.sha256()
    h.update(json.dumps(store.manifest.model_dump(mode="json"), sort_keys=True).encode())
    h.update(json.dumps(store.committed.model_dump(), sort_keys=True).encode())
    if isinstance(store.path, ObjectLocation):  # the same keys in the same order: a copy has the same digest
        from dsaindex.artifacts.storage import list_objects, read_object

        for rel in list_objects(store.path):
            parts = rel.split("/")
            if parts[-1] == "zarr.json" or rel.endswith(".partial") or any(p.startswith(".") for p in parts):
                continue
            h.update(rel.encode() + b"\0")
            h.update(hashlib.sha256(read_object(store.path, rel)).digest())
        return h.hexdigest()[:16]
    root = Path(store.path)
    for file in sorted(root.rglob("*")):
        rel = file.relative_to(root)
        if not file.is_file() or file.name == "zarr.json" or file.suffix == ".partial":
            continue
        if any(part.startswith(".") for part in rel.parts):
            continue
        h.update(rel.as_posix().encode() + b"\0")
        h.update(hashlib.sha256(file.read_bytes()).digest())
    return h.hexdigest()[:16]


def store_lineage(store: CaptureStore, split: tuple[list[int], list[int]]) -> Lineage:
    """The lineage of artifacts trained on ``store``: its id, path and content digest, and the split."""
    return Lineage(
        capture_store_id=store.manifest.store_id,
        capture_store_path=(str(store.path) if isinstance(store.path, ObjectLocation)
                            else str(Path(store.path).resolve())),
        capture_store_digest=store_digest(store),
        train_sequences=list(split[0]),
        eval_sequences=list(split[1]),
    )
