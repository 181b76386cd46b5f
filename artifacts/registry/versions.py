"""Which version a registered name and a ref (``3``, ``v3``, ``@alias``, ``alias``, ``latest``) mean,
and moving an alias onto a version (:func:`promote`)."""

from __future__ import annotations

import re
from typing import Any

from dsaindex.artifacts.registry.names import _check_name
from dsaindex.artifacts.registry.recovery import _alias_version, _effective_aliases, _registering, _unfinished
from dsaindex.artifacts.registry.session import _session
from dsaindex.artifacts.registry.tracking import _LIST_FIX, PRODUCTION, _call, _error_code, _set_alias
from dsaindex.errors import DsaIndexError


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
                f"{name} version {number} is not completely registered (its registration is running, or was "
                "cut short: the next registry command undoes it, at once on a sqlite store or on the machine that "
                "registered, from elsewhere once it is 15 minutes old).",
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
        _set_alias(client, name, alias, number)
    return {"name": name, "version": int(number), "alias": alias,
            "previous": int(previous) if previous is not None else None}


def _aliases_by_version(aliases: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for alias, version in aliases.items():
        out.setdefault(str(version), []).append(alias)
    return {k: sorted(v) for k, v in out.items()}
