"""Token streams of a corpus, as models are trained and measured on them.

Two sources. Python sources present on any machine with Python (the standard library's ``.py`` files plus
those of the running interpreter's site-packages) as byte tokens (0..255); documents are joined with EOS
(257) and every training / evaluation window starts with BOS (256) followed by ``seq_len - 1`` tokens of
the stream. Whole files are held out for evaluation: a file is held out when the hash of its path
relative to its root (``stdlib/...`` or ``site-packages/...``) falls below ``heldout_percent``, so the split
is the same on every machine that has the same file. Or a ``dsaindex reference corpus`` folder, tokenized
with its own BPE (:func:`corpus_token_streams`), whose split the corpus builder made.
:func:`checkpoint_streams` picks the one a checkpoint needs; :func:`sample_windows` and
:func:`heldout_windows` cut windows from a stream.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsaindex.pipelines.capture.corpus import stdlib_root, walk_files
from dsaindex.pipelines.capture.presets import BOS_ID, EOS_ID


def python_source_roots() -> list[tuple[str, Path]]:
    """``(label, folder)`` of the text sources: the stdlib and the running interpreter's site-packages."""
    roots = [("stdlib", stdlib_root())]
    seen = {roots[0][1].resolve()}
    for key in ("purelib", "platlib"):
        p = Path(sysconfig.get_paths()[key])
        if p.is_dir() and p.resolve() not in seen:
            seen.add(p.resolve())
            roots.append(("site-packages", p))
    return roots


def list_python_files(max_file_bytes: int = 400_000) -> list[tuple[str, Path]]:
    """Every non-empty ``.py`` file under :func:`python_source_roots`, as ``(key, path)`` with ``key`` =
    ``label/relative/path`` (the split key). The stdlib walk skips its site-packages (read as its own
    root). Files above ``max_file_bytes`` (generated tables) are left out."""
    return [
        (f"{label}/{p.relative_to(root).as_posix()}", p)
        for label, root in python_source_roots()
        for p in walk_files(root, {".py"}, skip_hidden=True, max_bytes=max_file_bytes)
    ]


def path_hash(key: str) -> float:
    """Deterministic value in [0, 100) from a path key (sha256), used for the split and the order."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64 * 100.0


def is_heldout(key: str, heldout_percent: float) -> bool:
    """Whole-file split: ``key`` is held out when its hash falls below ``heldout_percent``."""
    return path_hash(key) < heldout_percent


@dataclass
class TokenStreams:
    """Byte-token streams: ``train`` / ``heldout`` are 1-D int16 numpy arrays (documents joined with EOS)."""

    train: Any
    heldout: Any
    info: dict = field(default_factory=dict)


def build_token_streams(
    max_train_bytes: int = 160_000_000,
    max_heldout_bytes: int = 8_000_000,
    heldout_percent: float = 2.0,
    files: list[tuple[str, Path]] | None = None,
) -> TokenStreams:
    """Read the corpus into train / held-out token streams.

    Files are taken in the order of a second hash of their key (so a byte budget samples every package
    rather than the alphabetically first ones) until each budget is reached. Raw file bytes are the
    tokens (UTF-8 sources); each document is followed by EOS.
    """
    import numpy as np

    files = list_python_files() if files is None else files
    order = sorted(files, key=lambda kp: path_hash("order:" + kp[0]))
    parts: dict[str, list[Any]] = {"train": [], "heldout": []}
    used = {"train": 0, "heldout": 0}
    counts = {"train": 0, "heldout": 0}
    budget = {"train": max_train_bytes, "heldout": max_heldout_bytes}
    eos = np.array([EOS_ID], dtype=np.int16)
    for key, path in order:
        split = "heldout" if is_heldout(key, heldout_percent) else "train"
        if used[split] >= budget[split]:
            if all(used[s] >= budget[s] for s in used):
                break
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data:
            continue
        parts[split] += [np.frombuffer(data, dtype=np.uint8).astype(np.int16), eos]
        used[split] += len(data) + 1
        counts[split] += 1
    streams = {s: (np.concatenate(parts[s]) if parts[s] else np.zeros(0, dtype=np.int16)) for s in parts}
    info = {
        "roots": [f"{label}: {root}" for label, root in python_source_roots()],
        "files_available": len(files),
        "train_files": counts["train"],
        "heldout_files": counts["heldout"],
        "train_tokens": int(streams["train"].size),
        "heldout_tokens": int(streams["heldout"].size),
        "heldout_percent": heldout_percent,
        "split": "whole files; held out when sha256(label/relative_path) maps below heldout_percent of 100",
    }
    return TokenStreams(streams["train"], streams["heldout"], info)


@dataclass
class Vocabulary:
    """The tokens of a run: ``size`` entries, the BOS / EOS / PAD ids, the tokenizer (None: raw bytes) and
    the bytes of text per token on held-out text (bits per byte = bits per token / bytes_per_token)."""

    size: int
    bos: int
    eos: int
    pad: int
    tokenizer: Path | None = None
    bytes_per_token: float = 1.0


BYTE_VOCABULARY = Vocabulary(size=260, bos=BOS_ID, eos=EOS_ID, pad=259)
TOKEN_CACHE = "tokens.npz"


def corpus_vocabulary(corpus: Path) -> Vocabulary:
    """The vocabulary of a corpus built by ``dsaindex reference corpus`` (its ``tokenizer.json``, whose
    special tokens are ``<|bos|>``, ``<|eos|>``, ``<|pad|>``)."""
    from tokenizers import Tokenizer

    from dsaindex.errors import DsaIndexError

    path = corpus / "tokenizer.json"
    if not path.is_file():
        raise DsaIndexError(f"{corpus} has no tokenizer.json: it is not a corpus built by `dsaindex reference corpus`.",
                            f"build one with `dsaindex reference corpus {corpus}`, or pass its folder.")
    tok = Tokenizer.from_file(str(path))
    ids = [tok.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>")]
    if None in ids:
        raise DsaIndexError(f"{path} lacks the special tokens <|bos|>, <|eos|>, <|pad|>.",
                            "rebuild the corpus with `dsaindex reference corpus`.")
    return Vocabulary(size=tok.get_vocab_size(), bos=ids[0], eos=ids[1], pad=ids[2], tokenizer=path)


def corpus_token_streams(corpus: Path, max_train_tokens: int | None = None,
                         max_heldout_tokens: int | None = None) -> tuple[TokenStreams, Vocabulary]:
    """Token streams of a ``dsaindex reference corpus`` folder: its ``train.jsonl`` / ``heldout.jsonl``
    documents in file order, each tokenized with the folder's ``tokenizer.json`` and followed by EOS.

    The tokens are cached in ``tokens.npz`` beside them, keyed by the tokenizer's and the documents'
    digests; a folder holding only ``tokenizer.json`` and a matching ``tokens.npz`` (a copy carried to a
    machine without the text) is enough. Returns the streams (uint16) and the vocabulary, with
    ``bytes_per_token`` measured on the held-out split."""
    import numpy as np

    from dsaindex.errors import DsaIndexError

    vocab = corpus_vocabulary(corpus)
    tok_digest = hashlib.sha256(vocab.tokenizer.read_bytes()).hexdigest()[:16]
    texts = {split: corpus / f"{split}.jsonl" for split in ("train", "heldout")}
    have_text = all(p.is_file() for p in texts.values())
    text_digest = (hashlib.sha256(b"".join(str(p.stat().st_size).encode() for p in texts.values())).hexdigest()[:16]
                   if have_text else None)
    cache = corpus / TOKEN_CACHE
    cached = None
    if cache.is_file():
        with np.load(cache) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta["tokenizer"] == tok_digest and (text_digest is None or meta["text"] == text_digest):
                cached = {"train": z["train"], "heldout": z["heldout"], "meta": meta}
    if cached is None:
        if not have_text:
            raise DsaIndexError(f"{corpus} has neither its documents (train.jsonl, heldout.jsonl) nor tokens "
                                f"({TOKEN_CACHE}) of this tokenizer.", "pass the folder `dsaindex reference corpus` wrote.")
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(vocab.tokenizer))
        arrays, counts = {}, {}
        for split, path in texts.items():
            docs = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
            parts = []
            for start in range(0, len(docs), 256):
                for enc in tok.encode_batch(docs[start : start + 256]):
                    parts += [np.asarray(enc.ids, dtype=np.uint16), np.array([vocab.eos], dtype=np.uint16)]
            arrays[split] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
            counts[split] = {"documents": len(docs), "bytes": sum(len(d.encode()) for d in docs)}
        meta = {"tokenizer": tok_digest, "text": text_digest, "documents": counts}
        tmp = cache.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, train=arrays["train"], heldout=arrays["heldout"],
                            meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
        tmp.replace(cache)
        cached = {**arrays, "meta": meta}
    meta = cached["meta"]
    held = meta["documents"]["heldout"]
    vocab.bytes_per_token = held["bytes"] / max(1, cached["heldout"].size - held["documents"])
    train = cached["train"] if max_train_tokens is None else cached["train"][:max_train_tokens]
    heldout = cached["heldout"] if max_heldout_tokens is None else cached["heldout"][:max_heldout_tokens]
    info = {"corpus": str(corpus), "tokenizer": f"byte-level BPE, {vocab.size} entries (sha256 {tok_digest})",
            "train_documents": meta["documents"]["train"]["documents"],
            "heldout_documents": held["documents"], "train_tokens": int(train.size),
            "heldout_tokens": int(heldout.size), "heldout_bytes_per_token": round(vocab.bytes_per_token, 4),
            "split": "whole documents, as the corpus builder held them out"}
    return TokenStreams(train.astype(np.int32), heldout.astype(np.int32), info), vocab


def checkpoint_streams(name: str, own_tokenizer: str | None, corpus: Path | None, vocab_size: int,
                       train_tokens: int, heldout_tokens: int,
                       heldout_percent: float = 2.0) -> tuple[TokenStreams, Vocabulary]:
    """The token streams a checkpoint ``name`` is trained or measured on, at most ``train_tokens`` /
    ``heldout_tokens`` of each split: ``corpus``'s own tokens (a ``dsaindex reference corpus`` folder), or
    without it the byte-token Python sources. Refused, naming the fix: a checkpoint with its own tokenizer
    (``own_tokenizer``, its name; ``None`` for byte tokens) and no corpus, which would be fed byte tokens,
    and a corpus whose vocabulary the checkpoint's ``vocab_size`` entries cannot hold."""
    from dsaindex.errors import DsaIndexError

    if corpus is None:
        if own_tokenizer is not None:
            raise DsaIndexError(f"{name} has its own tokenizer ({own_tokenizer}); without --corpus it would be fed "
                                "byte tokens.",
                                "pass --corpus with the corpus it was trained on (the folder `dsaindex reference "
                                "corpus` wrote), or a byte-token checkpoint such as -m reference-v1.")
        return (build_token_streams(train_tokens, heldout_tokens, heldout_percent=heldout_percent),
                BYTE_VOCABULARY)
    streams, vocab = corpus_token_streams(corpus, max_train_tokens=train_tokens, max_heldout_tokens=heldout_tokens)
    if vocab.size > vocab_size:
        raise DsaIndexError(f"{corpus} has a vocabulary of {vocab.size:,} entries; the model has {vocab_size:,}.",
                            "pass the corpus the checkpoint was trained on, or leave --corpus out for a byte-token "
                            "checkpoint (reference-v1).")
    return streams, vocab


def sample_windows(stream, batch: int, seq_len: int, generator, bos: int = BOS_ID) -> tuple[Any, Any]:
    """Random training windows.

    Parameters
    ----------
    stream : 1-D int tensor of tokens (on the training device)
    generator : ``torch.Generator`` on the stream's device

    Returns
    -------
    input_ids [batch, seq_len] int64 (``bos``, then ``seq_len - 1`` stream tokens) and labels
    [batch, seq_len] int64 (the next token at every position).
    """
    import torch

    starts = torch.randint(0, stream.numel() - seq_len, (batch,), device=stream.device, generator=generator)
    idx = starts[:, None] + torch.arange(seq_len, device=stream.device)[None, :]
    chunk = stream[idx].long()  # [B, S]
    first = torch.full((batch, 1), bos, dtype=torch.long, device=stream.device)
    return torch.cat([first, chunk[:, :-1]], dim=1), chunk


def heldout_windows(stream, seq_len: int, max_windows: int, bos: int = BOS_ID) -> tuple[Any, Any]:
    """Consecutive non-overlapping held-out windows, same layout as :func:`sample_windows`.

    Returns input_ids [N, seq_len] and labels [N, seq_len] (int64, on the stream's device).
    """
    import torch

    n = min(max_windows, stream.numel() // seq_len)
    chunk = stream[: n * seq_len].view(n, seq_len).long()
    first = torch.full((n, 1), bos, dtype=torch.long, device=stream.device)
    return torch.cat([first, chunk[:, :-1]], dim=1), chunk
