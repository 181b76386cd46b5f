"""Errors a user can act on.

Every error raised on bad input is a :class:`DsaIndexError`: it names the problem and the fix. The CLI
prints it on one line and exits with code 2; library callers can catch it.
"""


from typing import Any


def differences(a: Any, b: Any, left: str = "store", right: str = "now", limit: int = 3) -> str:
    """Where two nested dicts differ, shortly, for an error message: ``'x.y: store=1 vs now=2; ...'``."""
    parts: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                walk(x.get(k), y.get(k), f"{path}.{k}" if path else str(k))
        elif x != y:
            parts.append(f"{path}: {left}={x!r} vs {right}={y!r}")

    walk(a, b, "")
    return "; ".join(parts[:limit]) + (" ..." if len(parts) > limit else "")


class DsaIndexError(Exception):
    """An error caused by input the user controls, with the fix to apply."""

    def __init__(self, problem: str, fix: str):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} Fix: {fix}")


class UnsupportedModelError(DsaIndexError):
    """The model has no DSA indexer, or belongs to a family this project does not know."""


class StoreMismatchError(DsaIndexError):
    """A store was made with another model or other settings than the ones given now."""


class WriterLockError(DsaIndexError):
    """Another writer holds a store's writer lock (or took it over from this one): nothing of that store may
    be removed or committed by this process."""


class CorruptStoreError(DsaIndexError):
    """A store is damaged, or is not a store of this project."""


class EmptyCorpusError(DsaIndexError):
    """The corpus holds no usable text."""


class ModelNotFoundError(DsaIndexError):
    """A model reference points at nothing that can be loaded offline."""


class CorruptBundleError(DsaIndexError):
    """An artifact bundle is missing, damaged, or is not a bundle of this project."""


class ArtifactMismatchError(DsaIndexError):
    """The artifacts were trained for another model, basis or format than the one being served."""
