"""Corpus readers and sequence packing.

A corpus is a list of files or folders (text files, or JSONL with a text field), or the built-in
default ``stdlib``: the Python standard library's own source files, real text present on every machine.
Documents are read in sorted path order, tokenized, joined with an end-of-document token and cut into
sequences of a fixed length, so the same corpus always yields the same sequences (a resumed capture
regenerates and skips the ones it already holds).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsaindex.errors import EmptyCorpusError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".jsonl", ".toml", ".cfg", ".html", ".tex"}
MIN_TAIL_TOKENS = 16


@dataclass(frozen=True)
class CorpusSpec:
    """Where text comes from: ``sources`` are paths, or ``("stdlib",)`` for the built-in corpus."""

    sources: tuple[str, ...] = ("stdlib",)
    text_field: str = "text"

    def describe(self) -> dict:
        files = list_files(self)
        digest = hashlib.sha256()
        for f in files:
            digest.update(f"{f.name}:{f.stat().st_size}\n".encode())
        return {
            "sources": list(self.sources),
            "text_field": self.text_field,
            "files": len(files),
            "bytes": sum(f.stat().st_size for f in files),
            "digest": digest.hexdigest()[:16],
        }


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def walk_files(
    root: Path,
    suffixes: Collection[str] | None = None,
    skip_hidden: bool = False,
    max_bytes: int | None = None,
) -> list[Path]:
    """Files under ``root`` in a fixed order (each folder's files sorted by name, then its sorted subfolders).

    Parameters
    ----------
    suffixes : keep only files whose :attr:`Path.suffix` is one of these (``None``: every file)
    skip_hidden : also leave out folders whose name starts with ``.``; :data:`SKIPPED_DIRS` (installed
        packages, bytecode caches) are always left out
    max_bytes : keep only files of 1 to ``max_bytes`` bytes; files whose size cannot be read are left out.
        ``None``: no size check here (callers check sizes themselves)
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIPPED_DIRS and not (skip_hidden and d.startswith("."))
        )
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if suffixes is not None and path.suffix not in suffixes:
                continue
            if max_bytes is not None:
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                if not 0 < size <= max_bytes:
                    continue
            found.append(path)
    return found


def list_files(spec: CorpusSpec) -> list[Path]:
    """Files of the corpus in reading order. Raises :class:`EmptyCorpusError` when there are none."""
    files: list[Path] = []
    for source in spec.sources:
        if source == "stdlib":
            files += walk_files(stdlib_root(), {".py"})
            continue
        path = Path(source).expanduser()
        if path.is_dir():
            files += walk_files(path, TEXT_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise EmptyCorpusError(
                f"Corpus path {source!r} does not exist.",
                "pass existing files or folders with --corpus, or leave it out to use the built-in stdlib corpus.",
            )
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise EmptyCorpusError(
            f"The corpus {', '.join(spec.sources)} holds no non-empty text files "
            f"(looked for {', '.join(sorted(TEXT_SUFFIXES))}).",
            "point --corpus at text or JSONL files, or leave it out to use the built-in stdlib corpus.",
        )
    return files


def iter_documents(spec: CorpusSpec) -> Iterator[str]:
    """Texts of the corpus, one per file (or per JSONL line), in a fixed order."""
    for path in list_files(spec):
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8", errors="replace") as fh:
                for line_no, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise EmptyCorpusError(
                            f"{path}:{line_no} is not valid JSON ({err.msg}).",
                            "fix or remove that line; each line of a .jsonl corpus file must be one JSON object.",
                        ) from None
                    text = record.get(spec.text_field) if isinstance(record, dict) else None
                    if isinstance(text, str) and text:
                        yield text
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
            if text:
                yield text


def pack_sequences(
    documents: Iterator[str], encode, seq_len: int, separator: Sequence[int]
) -> Iterator[list[int]]:
    """Concatenate tokenized documents (each followed by ``separator``) and cut sequences of
    ``seq_len`` tokens; a final shorter remainder of at least 16 tokens is yielded too."""
    buffer: list[int] = []
    for text in documents:
        buffer.extend(encode(text))
        buffer.extend(separator)
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            buffer = buffer[seq_len:]
    if len(buffer) >= MIN_TAIL_TOKENS:
        yield buffer
