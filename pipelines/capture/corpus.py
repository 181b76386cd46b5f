"""Corpus readers and sequence packing.

A corpus is a list of files or folders (text files, or JSONL with a text field), or the built-in
default ``stdlib``: the Python standard library's own source files, real text present on every machine.
Documents are read in sorted path order, tokenized, joined with an end-of-document token and cut into
sequences of a fixed length, so the same corpus always yields the same sequences (a resumed capture
regenerates and skips the ones it already holds).

Files of the user's sources that look binary (a NUL byte, or bytes that are not UTF-8, in their first
8 KiB) are skipped and counted (``skipped_binary`` in :meth:`CorpusSpec.describe`). The built-in
``stdlib`` corpus is read as it always was (its few Latin-1 test files with replaced characters), so
its stores keep resuming.
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
        """The corpus record of a capture store: sources, file count, bytes and a digest of the files read;
        ``skipped_binary`` (only when there are any, so records of corpora without them are unchanged) counts
        the binary files left out."""
        files, skipped = scan_files(self)
        digest = hashlib.sha256()
        for f in files:
            digest.update(f"{f.name}:{f.stat().st_size}\n".encode())
        record = {
            "sources": list(self.sources),
            "text_field": self.text_field,
            "files": len(files),
            "bytes": sum(f.stat().st_size for f in files),
            "digest": digest.hexdigest()[:16],
        }
        if skipped:
            record["skipped_binary"] = len(skipped)
        return record


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


BINARY_SNIFF_BYTES = 8192


def looks_binary(path: Path) -> bool:
    """Whether a file is binary: a NUL byte, or bytes that do not decode as UTF-8, in its first 8 KiB (a
    multi-byte character cut by that window does not count). Raises :class:`EmptyCorpusError` when the
    file cannot be read."""
    try:
        with path.open("rb") as fh:
            head = fh.read(BINARY_SNIFF_BYTES)
    except OSError as err:
        raise EmptyCorpusError(f"Corpus file {path} cannot be read ({err.strerror or err}).",
                               "make it readable, or leave it out of --corpus.") from None
    if b"\0" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        cut_at_window = len(head) == BINARY_SNIFF_BYTES and err.reason == "unexpected end of data"
        return not cut_at_window
    return False


def scan_files(spec: CorpusSpec) -> tuple[list[Path], list[Path]]:
    """(files of the corpus in reading order, binary files of the user's sources left out). Raises
    :class:`EmptyCorpusError` for a missing source or when no non-empty text file remains."""
    files: list[Path] = []
    skipped: list[Path] = []
    for source in spec.sources:
        if source == "stdlib":
            files += [f for f in walk_files(stdlib_root(), {".py"}) if f.stat().st_size > 0]
            continue
        path = Path(source).expanduser()
        if path.is_dir():
            found = walk_files(path, TEXT_SUFFIXES)
        elif path.is_file():
            found = [path]
        else:
            raise EmptyCorpusError(
                f"Corpus path {source!r} does not exist.",
                "pass existing files or folders with --corpus, or leave it out to use the built-in stdlib corpus.",
            )
        for f in found:
            if not f.is_file() or f.stat().st_size == 0:  # sockets, fifos, empty files
                continue
            (skipped if looks_binary(f) else files).append(f)
    if not files:
        binary = f" ({len(skipped)} binary files skipped)" if skipped else ""
        raise EmptyCorpusError(
            f"The corpus {', '.join(spec.sources)} holds no non-empty text files{binary} "
            f"(looked for {', '.join(sorted(TEXT_SUFFIXES))}).",
            "point --corpus at text or JSONL files, or leave it out to use the built-in stdlib corpus.",
        )
    return files, skipped


def list_files(spec: CorpusSpec) -> list[Path]:
    """Files of the corpus in reading order (binary ones left out, see :func:`scan_files`). Raises
    :class:`EmptyCorpusError` when there are none."""
    return scan_files(spec)[0]


def no_sequence_error(spec: CorpusSpec) -> EmptyCorpusError:
    return EmptyCorpusError(
        "The corpus yields no sequence (fewer than 16 tokens of text; JSONL records need the "
        f"{spec.text_field!r} field).",
        "add text to the corpus, set --text-field, or leave --corpus out to use the built-in stdlib corpus.",
    )


def check_text(spec: CorpusSpec, enough_chars: int) -> None:
    """Read the corpus until ``enough_chars`` characters of text were seen (or it ends), so that a corpus
    without text, or a bad record in the part a capture will read, is refused before a model loads.
    Raises :class:`EmptyCorpusError`."""
    seen = 0
    for text in iter_documents(spec):
        seen += len(text)
        if seen >= enough_chars:
            return
    if seen == 0:
        raise no_sequence_error(spec)


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
