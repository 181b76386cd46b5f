"""Synthetic long-range documents of the reference corpus (its ``synthetic`` source): needles (passkeys
hidden at random depths of natural filler, one asked for at the end), key-value lookups, variable-tracking
chains and passages copied from at least 4K bytes earlier (:func:`synthetic_documents` mixes the four);
the passkey task's wording (:func:`passkeys`, :func:`passkey_statement`, :func:`passkey_question`,
:func:`passkey_answer`), shared with the needle gate (:mod:`dsaindex.pipelines.reference.gates`) and the
tasks spliced into training windows (:mod:`dsaindex.pipelines.reference.tasks`); and
:func:`write_synthetic`, fresh documents for evaluation captures, filled with a built corpus's held-out
natural text.

:class:`Document`, the record of one corpus document of any source, is defined here as well: the corpus
builder (:mod:`dsaindex.pipelines.reference.corpus`) imports it with the generators.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from dsaindex.errors import DsaIndexError


@dataclass
class Document:
    source: str
    title: str
    text: str
    heldout: bool = False


_WORDS = ("the of and to in that it was for on are as with his they at be this from have or one had by word but "
          "not what all were when we there can an your which their said if do will each about how up out them "
          "then she many some so these would other into has more her two like him see time could no make than "
          "first been its who now people my made over did down only way find use may water long little very "
          "after words called just where most know get through back much before go good new write our used "
          "me man too any day same right look think also around another came come work three must because "
          "does part even place well such here take why help put different away again off went old number").split()


def _filler(rng: random.Random, n_bytes: int, natural: list[str]) -> str:
    """Natural text (a random slice of ``natural`` documents) or, without any, word salad."""
    if natural:
        doc = rng.choice(natural)
        if len(doc) > n_bytes:
            start = rng.randrange(0, len(doc) - n_bytes)
            return doc[start : start + n_bytes]
    out, size = [], 0
    while size < n_bytes:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def _key(rng: random.Random, n: int = 8) -> str:
    return "".join(rng.choice("abcdefghjkmnpqrstuvwxyz23456789") for _ in range(n))


# The passkey task's wording, shared by the corpus's needle documents, the needle gate's prompts
# (reference_gates) and the tasks spliced into training windows (reference_tasks).


def passkeys(rng: random.Random, keys: int) -> dict[str, str]:
    """``keys`` passkey names (5 characters) and their 6-digit values."""
    return {_key(rng, 5): str(rng.randrange(10**5, 10**6)) for _ in range(keys)}


def passkey_statement(name: str, value: str) -> str:
    return f"\nThe passkey for {name} is {value}. Remember it.\n"


def passkey_question(name: str) -> str:
    """The question, up to the answer (which :func:`passkey_answer` completes)."""
    return f"\nQuestion: what is the passkey for {name}?\nAnswer: the passkey for {name} is"


def passkey_answer(value: str) -> str:
    return f" {value}."


def needle_document(rng: random.Random, size: int, natural: list[str], keys: int = 4) -> Document:
    """``keys`` passkeys hidden at random depths of natural filler; at the end, one of them is asked for
    and answered (the answer lies at least ``size / (keys + 1)`` bytes back)."""
    values = passkeys(rng, keys)
    pieces = []
    for name, value in values.items():
        pieces.append(_filler(rng, size // (keys + 1), natural))
        pieces.append(passkey_statement(name, value))
    pieces.append(_filler(rng, size // (keys + 1), natural))
    asked = rng.choice(list(values))
    pieces.append(passkey_question(asked) + passkey_answer(values[asked]) + "\n")
    return Document("synthetic", f"needle x{keys}", "".join(pieces))


def lookup_document(rng: random.Random, size: int, queries: int = 16) -> Document:
    """A long table of key-value pairs, then lookups of keys from anywhere in it."""
    pairs, text = [], ["Key-value table:\n"]
    while sum(len(t) for t in text) < size * 0.8:
        k, v = _key(rng), _key(rng, 6)
        pairs.append((k, v))
        text.append(f"{k} = {v}\n")
    text.append("\nLookups:\n")
    for k, v in rng.sample(pairs, min(queries, len(pairs))):
        text.append(f"{k} -> {v}\n")
    return Document("synthetic", "key-value lookup", "".join(text))


def chain_document(rng: random.Random, size: int, natural: list[str], hops: int = 6) -> Document:
    """Variable-tracking: ``x1 = 48213``, later ``x2 = x1``, ... spread through filler; the end asks for
    the last variable's value (following every hop back)."""
    names = [f"var_{_key(rng, 4)}" for _ in range(hops)]
    value = str(rng.randrange(10**4, 10**5))
    pieces = [f"\nLet {names[0]} = {value}.\n"]
    for prev, cur in zip(names, names[1:], strict=False):
        pieces.append(_filler(rng, size // hops, natural))
        pieces.append(f"\nLet {cur} = {prev}.\n")
    pieces.append(_filler(rng, size // (2 * hops), natural))
    pieces.append(f"\nQuestion: what is the value of {names[-1]}?\nAnswer: {names[-1]} = {value}.\n")
    return Document("synthetic", f"variable chain x{hops}", "".join(pieces))


def copy_document(rng: random.Random, size: int, natural: list[str], span: int = 512, distance: int = 4096) -> Document:
    """Natural text whose end repeats a ``span``-byte passage from at least ``distance`` bytes earlier,
    introduced by a marker that names where it came from."""
    head = _filler(rng, max(size - span - 200, distance + span), natural)
    start = rng.randrange(0, max(1, len(head) - distance - span))
    passage = head[start : start + span]
    return Document("synthetic", "long copy", f"{head}\n\nRepeat the passage that began at byte {start}:\n{passage}\n")


GENERATORS = ("needle", "lookup", "chain", "copy")


def synthetic_documents(total_bytes: int, natural: list[str], seed: int, heldout: bool,
                        doc_bytes: int = 48_000) -> list[Document]:
    """About ``total_bytes`` of the four tasks in turn (deterministic for a seed)."""
    rng = random.Random(seed)
    docs, used, i = [], 0, 0
    while used < total_bytes:
        kind = GENERATORS[i % len(GENERATORS)]
        size = rng.randrange(doc_bytes // 2, doc_bytes)
        if kind == "needle":
            doc = needle_document(rng, size, natural, keys=rng.choice((1, 2, 4, 8)))
        elif kind == "lookup":
            doc = lookup_document(rng, size)
        elif kind == "chain":
            doc = chain_document(rng, size, natural, hops=rng.choice((3, 6, 10)))
        else:
            doc = copy_document(rng, max(size, 8192), natural)
        doc.heldout = heldout
        docs.append(doc)
        used += len(doc.text)
        i += 1
    return docs


FILLER_SOURCES = ("austen", "sotu", "dictionary", "bible")


def write_synthetic(corpus: Path, out: Path, total_bytes: int, seed: int) -> dict:
    """Fresh synthetic documents for evaluation captures longer than the corpus's held-out synthetic split
    allows: the four tasks from ``seed``, filled with the corpus's held-out natural text, written to
    ``out`` as JSONL (``dsaindex capture -c OUT``). Refuses the corpus's own seeds (its training split's and
    its held-out split's), which would rebuild documents a checkpoint trained on that corpus has seen, and
    an ``out`` that exists. Returns a summary: documents, bytes, tasks, seed, filler documents."""
    corpus, out = Path(corpus), Path(out)
    record_path, heldout_path = corpus / "corpus.json", corpus / "heldout.jsonl"
    for path in (record_path, heldout_path):
        if not path.is_file():
            raise DsaIndexError(f"{path} does not exist: {corpus} is not a corpus folder.",
                                "pass the folder `dsaindex reference corpus` wrote.")
    own = int(json.loads(record_path.read_text()).get("seed", 0))
    if seed in (own, own + 1):
        raise DsaIndexError(f"seed {seed} is the corpus's own (its training split used {own}, its held-out "
                            f"split {own + 1}): those documents are not new to a checkpoint trained on it.",
                            f"pass another --seed, e.g. {own + 101}.")
    if out.exists():
        raise DsaIndexError(f"{out} exists.", "pass a new file name; nothing is overwritten.")
    natural = []
    with heldout_path.open() as f:
        for line in f:
            doc = json.loads(line)
            if doc.get("source") in FILLER_SOURCES:
                natural.append(doc["text"])
    if not natural:
        raise DsaIndexError(f"{heldout_path} holds no held-out {', '.join(FILLER_SOURCES)} text to fill with.",
                            "build the corpus with at least one of those sources.")
    docs = synthetic_documents(total_bytes, natural, seed, heldout=True)
    partial = out.with_name(out.name + ".partial")
    with partial.open("w") as f:
        for d in docs:
            f.write(json.dumps({"source": d.source, "title": d.title, "text": d.text}) + "\n")
    partial.rename(out)
    tasks: dict[str, int] = {}
    for d in docs:
        task = d.title.split(" x")[0]
        tasks[task] = tasks.get(task, 0) + 1
    return {"out": str(out), "documents": len(docs), "bytes": sum(len(d.text.encode()) for d in docs),
            "tasks": tasks, "seed": seed, "filler_documents": len(natural)}
