"""Names in the registry: one registered-model name per target model, and the metric and param keys
MLflow accepts."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from dsaindex.artifacts.registry.tracking import _LIST_FIX
from dsaindex.errors import DsaIndexError

if TYPE_CHECKING:
    from dsaindex.artifacts.fingerprint import ModelFingerprint

_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


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
