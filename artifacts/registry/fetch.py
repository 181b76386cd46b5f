"""Fetching bundles: :func:`pull` a version into a folder (or an ``s3://`` prefix), and :func:`load_uri`,
which turns a ``models:/`` URI (pulled once into a cache), a local bundle path or an ``s3://`` bundle into
a verified bundle location."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from dsaindex.artifacts.registry.session import _session
from dsaindex.artifacts.registry.tracking import TAG, _call, _download
from dsaindex.artifacts.registry.versions import _registered, _resolve
from dsaindex.artifacts.storage import ObjectLocation, location
from dsaindex.errors import CorruptBundleError, DsaIndexError


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


def pull(name: str, ref: str, dest: str | Path, tracking_uri: str | None = None) -> Path | ObjectLocation:
    """Download a version's bundle to ``dest`` (must not exist, or be empty; or an empty ``s3://`` prefix),
    verify every checksum and return ``dest``. A damaged download raises :class:`CorruptBundleError` and
    leaves nothing behind; into object storage the bundle is staged locally, then put with its manifest
    last (:func:`dsaindex.artifacts.bundle.publish_bundle`)."""
    target = location(dest)
    if isinstance(target, ObjectLocation):
        import tempfile

        from dsaindex.artifacts.bundle import check_bundle_destination, publish_bundle

        check_bundle_destination(target)  # before the download
    with _session(tracking_uri) as client:
        _registered(client, name)
        version = _resolve(client, name, ref)
        if not isinstance(target, ObjectLocation):
            return _pull_version(client, name, version, target)
        with tempfile.TemporaryDirectory(prefix="dsaindex-pull-") as staging:
            publish_bundle(_pull_version(client, name, version, Path(staging) / target.name), target)
        return target


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


def load_uri(uri: str | Path, dest_cache: str | Path | None = None,
             tracking_uri: str | None = None) -> Path | ObjectLocation:
    """A verified bundle location for ``uri``.

    ``uri`` is ``models:/<name>@<alias>``, ``models:/<name>/<version>`` (pulled once into
    ``<dest_cache>/bundles/<name>/v<version>`` and re-verified on later calls), a local bundle path
    (``file://`` allowed) or an ``s3://bucket/prefix`` bundle, both verified in place (an unfinished
    ``s3://`` bundle, without its manifest, is refused). Another scheme is refused with the fix. MLflow is
    imported only for ``models:/`` URIs.
    """
    from dsaindex.artifacts.bundle import read_bundle

    text = str(uri)
    if not text.startswith("models:/"):
        path = location(uri)
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
