"""The reference v2 corpus builder, offline: its readers on hand-made package files, the synthetic tasks,
the download checks, and builds of the code and synthetic sources and of the Bible and kernel packages
(faked downloads) with a tokenizer."""

import base64
import gzip
import hashlib
import io
import json
import random
import re
import shutil
import struct
import tarfile
import zlib

import pytest

from dsaindex.errors import DsaIndexError
from dsaindex.pipelines.capture.models import REFERENCE_DIR
from dsaindex.pipelines.reference import corpus as rc
from dsaindex.pipelines.reference import formats as rf
from dsaindex.pipelines.reference import synthetic as rs
from helpers import run_cli


def _i(v):
    return struct.pack(">i", v)


def _chars(s):
    b = s.encode()
    return _i(0x00040009) + _i(len(b)) + b


def _strsxp(items, attrs=b""):
    return _i(16 | (0x200 if attrs else 0)) + _i(len(items)) + b"".join(_chars(x) for x in items) + attrs


def _names_attr(names):
    return _i(0x402) + _i(1) + _chars("names") + _strsxp(names) + _i(254)


def _serialized(body):
    return b"X\n" + _i(3) + _i(0x40201) + _i(0x30500) + _i(5) + b"UTF-8" + body


def test_r_lazy_load_database_yields_the_character_vectors(tmp_path):
    books = {"emma": ["EMMA", "", "By Jane Austen"], "tiny": ["a"]}
    rdb, variables = b"", []
    for name, lines in books.items():
        blob = _serialized(_strsxp(lines))
        entry = _i(len(blob)) + zlib.compress(blob)
        variables.append((name, len(rdb), len(entry)))
        rdb += entry
    pairs = b"".join(_i(13) + _i(2) + _i(off) + _i(n) for _, off, n in variables)
    var_list = _i(19 | 0x200) + _i(len(variables)) + pairs + _names_attr([v[0] for v in variables])
    index = _i(19 | 0x200) + _i(2) + var_list + _i(19) + _i(0) + _names_attr(["variables", "references"])
    (tmp_path / "Rdata.rdb").write_bytes(rdb)
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(_serialized(index)))
    assert rc.read_r_strings(tmp_path / "Rdata.rdb", tmp_path / "Rdata.rdx") == books
    with pytest.raises(DsaIndexError, match="not an XDR"):
        rf._RReader(b"RDX3\n")


def _npm_tarball(path, files):
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            raw = json.dumps(data).encode()
            info = tarfile.TarInfo(f"package/data/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))


def test_addresses_come_in_date_order_and_the_latest_are_held_out(tmp_path):
    files = {f"{y}_p{y}.json": {"year": y, "name": f"P{y}", "party": "x", "text": f"address {y}"}
             for y in (1801, 1790, 2001, 1950, 1999, 1980, 1970, 1960, 1940, 1930, 1920, 1910)}
    _npm_tarball(tmp_path / "sotu.tgz", files)
    docs = rc.sotu_documents(tmp_path / "sotu.tgz")
    years = [int(d.title.split()[0]) for d in docs]
    assert years == sorted(years) and len(docs) == 12
    assert [d.heldout for d in docs] == [False, False] + [True] * 10
    assert docs[-1].text.startswith("State of the Union, 2001, P2001")


def test_mail_is_grouped_into_threads_by_subject(tmp_path):
    files = {
        "easy-ham-1/1.json": {"text": "From a\nSubject: build fails\n\nit fails"},
        "easy-ham-1/2.json": {"text": "From b\nSubject: Re: build fails\n\n> it fails\nworks here"},
        "easy-ham-1/3.json": {"text": "From c\nSubject: lonely\n\nnobody answers"},
        "spam-1/4.json": {"text": "From d\nSubject: Re: build fails\n\nbuy now"},
    }
    _npm_tarball(tmp_path / "mail.tgz", files)
    docs = rc.email_documents(tmp_path / "mail.tgz", heldout_every=1000)
    assert len(docs) == 1 and docs[0].title == "build fails"
    assert "> it fails" in docs[0].text and "buy now" not in docs[0].text


def test_dictionary_entries_are_grouped_by_letter_with_their_cross_references(tmp_path):
    text = ("00-database-info\n   FOLDOC\n\nalpha\n\n   the first {beta}\n\nbeta\n\n   see {alpha}\n\n"
            "quine\n\n   a program\n\nzeta\n\n   last\n")
    root = tmp_path / "usr/share/dictd"
    root.mkdir(parents=True)
    (root / "foldoc.dict.dz").write_bytes(gzip.compress(text.encode()))
    docs = rc.foldoc_documents(tmp_path)
    assert [d.title for d in docs] == ["FOLDOC a", "FOLDOC b", "FOLDOC q", "FOLDOC z"]
    assert "{beta}" in docs[0].text and [d.heldout for d in docs] == [False, False, True, False]


def test_synthetic_tasks_ask_for_what_lies_far_back():
    rng = random.Random(3)
    natural = ["word " * 20_000]
    needle = rs.needle_document(rng, 40_000, natural, keys=4)
    asked = needle.text.rsplit("what is the passkey for ", 1)[1].split("?")[0]
    value = needle.text.rsplit(" is ", 1)[1].rstrip(".\n")
    said = needle.text.index(f"The passkey for {asked} is {value}.")
    assert len(needle.text) - said > 40_000 // 5 - 100
    chain = rs.chain_document(rng, 30_000, natural, hops=5)
    answer = chain.text.rsplit("= ", 1)[1].rstrip(".\n")
    assert f"= {answer}." in chain.text.split("Question:")[0]
    copy = rs.copy_document(rng, 20_000, [" ".join(str(i) for i in range(10_000))])
    passage = copy.text.rsplit(":\n", 1)[1].rstrip("\n")
    at = copy.text.index(passage)
    assert len(passage) >= 500 and len(copy.text) - at > 4096
    a = rs.synthetic_documents(200_000, natural, seed=1, heldout=False)
    b = rs.synthetic_documents(200_000, natural, seed=1, heldout=False)
    assert [d.text for d in a] == [d.text for d in b] and sum(len(d.text) for d in a) >= 200_000
    assert {d.title.split()[0] for d in a} >= {"needle", "key-value", "variable", "long"}


def test_fresh_synthetic_documents_use_a_new_seed_and_held_out_filler_and_overwrite_nothing(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "corpus.json").write_text(json.dumps({"seed": 7}))
    heldout = [{"source": "austen", "title": "Persuasion", "text": "Anne Elliot walked on. " * 3_000},
               {"source": "code", "title": "pkg", "text": "def never_used_as_filler(): pass\n" * 3_000}]
    (corpus / "heldout.jsonl").write_text("".join(json.dumps(d) + "\n" for d in heldout))
    out = tmp_path / "synth.jsonl"

    proc = run_cli("reference", "synthetic", str(corpus), str(out), "--mb", "0.3", "--seed", "8")
    assert proc.returncode != 0 and "seed 8 is the corpus's own" in proc.stderr and not out.exists()

    proc = run_cli("reference", "synthetic", str(corpus), str(out), "--mb", "0.3", "--seed", "20", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    docs = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["documents"] == len(docs) and summary["bytes"] >= 300_000 and summary["filler_documents"] == 1
    assert {d["title"].split()[0] for d in docs} == {"needle", "key-value", "variable", "long"}
    text = "".join(d["text"] for d in docs)
    assert "Anne Elliot" in text and "never_used_as_filler" not in text
    for d in docs:
        if d["title"].startswith("needle"):
            asked = d["text"].rsplit("what is the passkey for ", 1)[1].split("?")[0]
            value = d["text"].rsplit(" is ", 1)[1].rstrip(".\n")
            assert f"The passkey for {asked} is {value}." in d["text"]
    again = rs.synthetic_documents(300_000, [heldout[0]["text"]], 20, heldout=True)
    assert [d.text for d in again] == [d["text"] for d in docs]

    before = out.read_bytes()
    proc = run_cli("reference", "synthetic", str(corpus), str(out), "--seed", "21")
    assert proc.returncode != 0 and "exists" in proc.stderr and out.read_bytes() == before
    proc = run_cli("reference", "synthetic", str(tmp_path), str(tmp_path / "x.jsonl"))
    assert proc.returncode != 0 and "not a corpus folder" in proc.stderr


def test_downloads_are_checked_against_the_registry(tmp_path, monkeypatch):
    data = b"a tarball"
    good = "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()

    def fake_run(cmd, cwd=None):
        if cmd[:2] == ["npm", "view"]:
            return json.dumps({"version": "1.0.0", "license": "MIT", "dist.integrity": fake_run.integrity})
        (cwd / "x-pkg-1.0.0.tgz").write_bytes(data)
        return ""

    monkeypatch.setattr(rc, "_run", fake_run)
    fake_run.integrity = good
    tarball, meta = rc.fetch_npm("@x/pkg", tmp_path)
    assert meta["license"] == "MIT" and meta["sha256"] == hashlib.sha256(data).hexdigest()
    fake_run.integrity = "sha512-" + base64.b64encode(b"\0" * 64).decode()
    with pytest.raises(DsaIndexError, match="does not match"):
        rc.fetch_npm("@x/pkg", tmp_path)
    assert not tarball.exists()  # the bad download is removed, the next run fetches again


def test_build_writes_disjoint_splits_a_tokenizer_and_the_sources_table(tmp_path):
    record = rc.build_corpus(tmp_path / "c", ["code", "synthetic"], code_bytes=400_000, synthetic_share=0.2,
                             vocab=400, seed=2)
    out = tmp_path / "c"
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert train and held and not {d["title"] + d["text"][:64] for d in train} & {d["title"] + d["text"][:64] for d in held}
    names = {r["name"]: r for r in record["sources"]}
    assert set(names) == {"code", "synthetic"} and names["code"]["extra"]["distributions"]
    assert names["synthetic"]["bytes"] >= 0.15 * (names["code"]["bytes"] + names["synthetic"]["bytes"])
    assert record["tokenizer"]["vocab"] == 400 and record["tokenizer"]["heldout_bytes_per_token"] > 1.0
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    sample = held[0]["text"][:2000]
    assert tok.decode(tok.encode(sample).ids) == sample  # byte-level: lossless
    assert json.loads((out / "corpus.json").read_text()) == record
    with pytest.raises(DsaIndexError, match="not empty"):
        rc.build_corpus(out, ["synthetic"])
    with pytest.raises(DsaIndexError, match="Unknown corpus sources"):
        rc.build_corpus(tmp_path / "d", ["poetry"])


def test_code_comes_in_dependency_order_with_tests_last(tmp_path):
    from importlib.metadata import PathDistribution

    dists = []
    for name, requires in (("pkg-a", ["pkg-b>=1"]), ("pkg-b", [])):
        mod = name.replace("-", "_")
        info = tmp_path / f"{mod}-1.0.dist-info"
        info.mkdir()
        (tmp_path / mod / "tests").mkdir(parents=True)
        (tmp_path / mod / "core.py").write_text(f"X = '{name}'\n")
        (tmp_path / mod / "tests" / "test_core.py").write_text("def test(): pass\n")
        meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\nLicense: MIT\n"
        meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
        (info / "METADATA").write_text(meta)
        (info / "RECORD").write_text(f"{mod}/tests/test_core.py,,\n{mod}/core.py,,\n")
        dists.append(PathDistribution(info))
    docs, info = rc.code_documents(10_000, distributions=dists)
    assert [d.title for d in docs] == ["pkg-b 1.0", "pkg-a 1.0"]
    text = docs[1].text
    assert text.index("# file: pkg-a/pkg_a/core.py") < text.index("# file: pkg-a/pkg_a/tests/test_core.py")
    assert info[0]["license"] == "MIT"


def test_cli_refuses_bad_options_before_work(tmp_path):
    proc = run_cli("reference", "corpus", str(tmp_path / "c"), "--sources", "poetry")
    assert proc.returncode != 0 and "Unknown corpus sources" in proc.stderr
    proc = run_cli("reference", "corpus", str(tmp_path / "c"), "--vocab", "100")
    assert proc.returncode != 0 and "--vocab" in proc.stderr
    proc = run_cli("reference", "corpus", str(tmp_path / "c"), "--sources", "kernel", "--kernel-mb", "0")
    assert proc.returncode != 0 and "--kernel-mb" in proc.stderr and not (tmp_path / "c").exists()


def test_debian_packages_are_checked_against_the_archive_index(tmp_path, monkeypatch):
    deb = tmp_path / "dict-x_1.0-1_all.deb"
    deb.write_bytes(b"a deb")
    calls = []

    def fake_run(cmd, cwd=None):
        calls.append(cmd[0])
        if cmd[0] == "apt-cache":
            return f"Package: dict-x\nVersion: 1.0-1\nSHA256: {fake_run.sha}\n"
        if cmd[0] == "dpkg-deb":
            doc = tmp_path / "dict-x-tree/usr/share/doc/dict-x"
            doc.mkdir(parents=True)
            (doc / "copyright").write_text("Copyright 1993.\nDistributed under the GNU Free Documentation License.\n")
        return ""

    monkeypatch.setattr(rc, "_run", fake_run)
    fake_run.sha = hashlib.sha256(b"a deb").hexdigest()
    root, meta = rc.fetch_deb("dict-x", tmp_path)
    assert meta["version"] == "1.0-1" and meta["license"] == "GNU Free Documentation License"
    assert "apt-get" not in calls  # the cached package was used
    fake_run.sha = "0" * 64
    with pytest.raises(DsaIndexError, match="does not match the archive"):
        rc.fetch_deb("dict-x", tmp_path)
    assert not deb.exists()


# ------------------------------------------------------------------------------------------- bible


def _lzw(data, max_bits):
    """Unix compress's LZW (block mode, no header), as the reader expects it: codes of growing width in
    groups of eight, the rest of a group padded when the width grows or after CLEAR (sent when full)."""
    out, at, n_bits, start, reader_next, sent = 0, 0, 9, 0, 257, 0

    def pad():
        nonlocal at, start
        group = 8 * n_bits
        at = start = start + -(-(at - start) // group) * group

    def put(code):
        nonlocal out, at, n_bits, reader_next, sent
        if n_bits < max_bits and reader_next >= 1 << n_bits:  # the reader widens before its next code
            pad()
            n_bits += 1
        out |= code << at
        at += n_bits
        if sent and code != 256 and reader_next < 1 << max_bits:  # the reader's table, one code behind
            reader_next += 1
        sent += 1

    table, word = {bytes([i]): i for i in range(256)}, b""
    for byte in data:
        c = bytes([byte])
        if word + c in table:
            word += c
            continue
        put(table[word])
        if len(table) + 1 < 1 << max_bits:
            table[word + c] = len(table) + 1
        else:
            put(256)
            pad()
            n_bits, reader_next, table = 9, 256, {bytes([i]): i for i in range(256)}
        word = c
    put(table[word])
    return out.to_bytes((at + 7) // 8, "little")


def _brs_file(path, text, window=16_384, max_bits=16):
    """A bible.data: the EC02 header, the window table, the .Z header once, a compress stream per window."""
    streams = [_lzw(text[i : i + window], max_bits) for i in range(0, len(text), window)]
    head = b"EC02" + b"Compressed Data File".ljust(80, b"\0") + struct.pack(">II", window, len(streams))
    offsets = [len(head) + 4 * (len(streams) + 1) + 3]
    for stream in streams:
        offsets.append(offsets[-1] + len(stream))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + struct.pack(f">{len(offsets)}I", *offsets) + bytes([0x1F, 0x9D, 0x80 | max_bits])
                     + b"".join(streams))


def _verses(abbr, chapters=2, verses=3, words=8, rng=None):
    rng = rng or random.Random(abbr)
    return [f"{abbr}{c}:{v} " + " ".join(rng.choice(rs._WORDS) for _ in range(words)).capitalize() + "."
            for c in range(1, chapters + 1) for v in range(1, verses + 1)]


def _bible_tree(root, file_order=("Ge", "Exo", "Mat", "Psa", "2Jn", "3Jn", "Jude", "Rev"), **verses):
    """A bible-kjv-text tree (books in ``file_order``), and each book's verse lines."""
    books = {abbr: _verses(abbr, **verses) for abbr in file_order}
    text = "Holy Bible, Authorized (King James) Version.  Textfile 930105.\n"
    text += "".join(line + "\n" for abbr in file_order for line in books[abbr])
    _brs_file(root / "usr/lib/bible.data", text.encode())
    doc = root / "usr/share/doc/bible-kjv-text"
    doc.mkdir(parents=True)
    (doc / "copyright").write_text("Its licence is GPL version 2 or later.\n\nThe copyright for the King James "
                                   "Version text of the Bible is expired since\nthe  translation was done in 1611.\n")
    return books


def test_bible_data_windows_decode_to_the_text_through_width_changes_and_clears(tmp_path):
    rng = random.Random(0)
    words = [rs._key(rng, rng.randrange(2, 9)) for _ in range(3000)]
    text = (" ".join(rng.choice(words) for _ in range(12_000)) + "a" * 3000 + "abab" * 500).encode()
    for max_bits in (16, 10):  # 16: codes widen from 9 bits; 10: the table fills and is cleared
        _brs_file(tmp_path / f"{max_bits}.data", text, max_bits=max_bits)
        assert rc.read_brs_text(tmp_path / f"{max_bits}.data").encode() == text
    (tmp_path / "bad.data").write_bytes(b"EC01" + bytes(200))
    with pytest.raises(DsaIndexError, match="not a BRS compressed data file"):
        rc.read_brs_text(tmp_path / "bad.data")
    data = bytearray((tmp_path / "16.data").read_bytes())
    (tmp_path / "cut.data").write_bytes(bytes(data[:-50]))
    with pytest.raises(DsaIndexError, match="window table"):
        rc.read_brs_text(tmp_path / "cut.data")


def test_bible_books_come_in_canonical_order_whole_and_the_last_held_out(tmp_path):
    books = _bible_tree(tmp_path)  # Psalms stands after Matthew in the file
    docs, info = rc.bible_documents(tmp_path)
    assert [d.title for d in docs] == ["Genesis", "Exodus", "Psalms", "Matthew", "2 John", "3 John", "Jude", "Revelation"]
    assert [d.heldout for d in docs] == [False] * 4 + [True] * 4
    for doc, abbr in zip(docs, ("Ge", "Exo", "Psa", "Mat", "2Jn", "3Jn", "Jude", "Rev"), strict=True):
        assert doc.text.startswith(f"{doc.title} (King James Version)\n\n")
        assert doc.text.splitlines()[2:] == [line[len(abbr):] for line in books[abbr]]  # whole, "1:1 ..." lines
    train = "".join(d.text for d in docs if not d.heldout)
    assert not any(line.split(" ", 1)[1] in train for abbr in ("2Jn", "3Jn", "Jude", "Rev") for line in books[abbr])
    assert info["verses"] == 8 * 6 and info["edition"].startswith("Holy Bible, Authorized (King James) Version.")
    assert info["copyright"].startswith("The copyright for the King James Version text of the Bible is expired")
    _bible_tree(tmp_path / "odd", file_order=("Ge", "Gospel"))
    with pytest.raises(DsaIndexError, match="books Gospel"):
        rc.bible_documents(tmp_path / "odd")
    with pytest.raises(DsaIndexError, match="no usr/lib/bible.data"):
        rc.bible_documents(tmp_path / "empty")


# ------------------------------------------------------------------------------------------- kernel

_KERNEL_FILES = {
    "kernel/sched/sched.h": '/* SPDX-License-Identifier: GPL-2.0 */\n#include <linux/sched.h>\nstruct rq;\n',
    "kernel/sched/autogroup.h": '/* SPDX-License-Identifier: GPL-2.0 */\n#include "sched.h"\nstruct autogroup;\n',
    "kernel/sched/stats.h": '/* SPDX-License-Identifier: GPL-2.0 */\n# include "autogroup.h"\n#include "sched.h"\n',
    "kernel/sched/core.c": '// SPDX-License-Identifier: GPL-2.0-only\n#include "sched.h"\n#include "stats.h"\nint core;\n',
    "kernel/sched/build_policy.c": '// SPDX-License-Identifier: GPL-2.0-only\n#include "idle.c"\n#include "../../mm/internal.h"\n',
    "kernel/sched/idle.c": '// SPDX-License-Identifier: GPL-2.0-only\n#include "sched.h"\nvoid do_idle(void) {}\n',
    "kernel/sched/sub/deep.c": "int deeper;\n",  # a subdirectory: not part of kernel/sched's document
    "kernel/sched/Makefile": "obj-y += core.o\n",
    "mm/internal.h": "/* SPDX-License-Identifier: GPL-2.0-or-later */\nstruct page;\n",
    "mm/slab.c": '// SPDX-License-Identifier: GPL-2.0\n#include "internal.h"\nint slab;\n',
    "net/ipv4/tcp.c": "// SPDX-License-Identifier: GPL-2.0-or-later\n" + "int tcp;\n" * 400,  # over the budget
    "fs/ext4/ext4.h": "// SPDX-License-Identifier: GPL-2.0\nstruct ext4_inode;\n",
    "fs/ext4/inode.c": '// SPDX-License-Identifier: GPL-2.0\n#include "ext4.h"\nint ext4;\n',
    "kernel/time/timer.c": '// SPDX-License-Identifier: GPL-2.0\nint jiffies;\n',
    "drivers/misc/x.c": "int unlisted;\n",
}


def _kernel_tree(root, files=_KERNEL_FILES, extra=None):
    src = root / "usr/src"
    src.mkdir(parents=True)
    with tarfile.open(src / "linux-source-6.1.tar.xz", "w:xz") as tar:
        for name, text in {**files, **(extra or {})}.items():
            raw = text if isinstance(text, bytes) else text.encode()
            info = tarfile.TarInfo(f"linux-source-6.1/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    doc = root / "usr/share/doc/linux-source-6.1"
    doc.mkdir(parents=True)
    (doc / "copyright").write_text("Files: *\nCopyright: 1991-2012 Linus Torvalds and many others\nLicense: GPL-2\n")


def _file_order(text):
    return [line.removeprefix("// file: ") for line in text.splitlines() if line.startswith("// file: ")]


def test_kernel_directories_are_packed_with_headers_before_their_includers(tmp_path):
    _kernel_tree(tmp_path, extra={"mm/latin1.c": b"/* \xe9t\xe9 */\n"})
    dirs = ("kernel/sched", "mm", "net/ipv4", "fs/ext4", "crypto")
    docs, info = rc.kernel_documents(tmp_path, 2_000, directories=dirs, heldout=("fs/ext4",))
    assert [d.title for d in docs] == ["kernel/sched", "mm", "fs/ext4"]  # in list order; tcp.c too large
    assert info["skipped"] == ["net/ipv4"] and sum(d["bytes"] for d in info["directories"]) <= 2_000
    sched = _file_order(docs[0].text)
    assert sched == ["kernel/sched/sched.h", "kernel/sched/autogroup.h", "kernel/sched/stats.h",
                     "kernel/sched/idle.c", "kernel/sched/build_policy.c", "kernel/sched/core.c"]
    for i, path in enumerate(sched):  # every local include stands earlier, every header before any .c
        for dep in re.findall(r'#\s*include "([^"]+)"', _KERNEL_FILES[path]):
            assert "/" in dep or sched.index(f"kernel/sched/{dep}") < i
    assert max(i for i, p in enumerate(sched) if p.endswith(".h")) < min(i for i, p in enumerate(sched) if p.endswith(".c"))
    for doc in docs:  # each file whole, right after its path header
        for path in _file_order(doc.text):
            assert f"// file: {path}\n{_KERNEL_FILES[path]}" in doc.text
    assert _file_order(docs[1].text) == ["mm/internal.h", "mm/slab.c"]  # the non-UTF-8 file is left out
    assert "deeper" not in docs[0].text and "obj-y" not in docs[0].text
    assert [d.heldout for d in docs] == [False, False, True]
    assert not any("fs/ext4" in d.text or "ext4_inode" in d.text for d in docs if not d.heldout)
    assert info["spdx"] == {"GPL-2.0": 6, "GPL-2.0-only": 3, "GPL-2.0-or-later": 1}
    assert info["tarball"] == "linux-source-6.1.tar.xz"
    with pytest.raises(DsaIndexError, match="no usr/src/linux-source"):
        rc.kernel_documents(tmp_path / "empty", 2_000)
    with pytest.raises(DsaIndexError, match="has no .c or .h files"):
        rc.kernel_documents(tmp_path, 2_000, directories=("crypto", "lib"))


def test_bible_and_kernel_builds_record_the_debian_packages(tmp_path, monkeypatch):
    trees, debs = {}, {}
    for package, make in (("bible-kjv-text", _bible_tree), ("linux-source-6.1", _kernel_tree)):
        trees[package] = tmp_path / "made" / package
        make(trees[package])
        debs[package] = f"a {package} deb".encode()

    def fake_run(cmd, cwd=None):
        package = cmd[-1] if cmd[0] != "dpkg-deb" else None
        if cmd[0] == "apt-cache":
            return f"Package: {package}\nVersion: 9.{len(package)}-1\nSHA256: {hashlib.sha256(debs[package]).hexdigest()}\n"
        if cmd[0] == "apt-get":
            (cwd / f"{package}_9_all.deb").write_bytes(debs[package])
        if cmd[0] == "dpkg-deb":
            shutil.copytree(trees[cmd[2].split("/")[-1].split("_")[0]], cmd[3])
        return ""

    monkeypatch.setattr(rc, "_run", fake_run)
    record = rc.build_corpus(tmp_path / "c", ["kernel", "bible"], cache=tmp_path / "cache", vocab=300, seed=1)
    sources = {r["name"]: r for r in record["sources"]}
    assert list(sources) == ["bible", "kernel"]  # SOURCES order
    bible, kernel = sources["bible"], sources["kernel"]
    assert bible["origin"] == "debian bible-kjv-text 9.14-1" and bible["license"] == "public domain"
    assert "expired" in bible["extra"]["copyright"] and "copyright" in bible["notes"]
    assert kernel["origin"] == "debian linux-source-6.1 9.16-1" and kernel["license"] == "GPL-2.0"
    assert kernel["extra"]["package_license"] == "GPL-2"
    for rec in (bible, kernel):
        assert rec["sha256"] == hashlib.sha256(debs[rec["origin"].split()[1]]).hexdigest()
        assert rec["verified"] == "Debian archive index (apt-cache SHA256)"
    assert (bible["documents"], bible["heldout_documents"]) == (4, 4)
    assert kernel["heldout_documents"] == 1  # kernel/time, one of HELDOUT_KERNEL_DIRS
    assert [d["name"] for d in kernel["extra"]["directories"]] == ["kernel/sched", "mm", "fs/ext4", "net/ipv4",
                                                                    "kernel/time"]
    out = tmp_path / "c"
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (out / "heldout.jsonl").read_text().splitlines()]
    assert {d["title"] for d in held} == {"2 John", "3 John", "Jude", "Revelation", "kernel/time"}
    assert not {d["title"] for d in train} & {d["title"] for d in held}
    for rec in (bible, kernel):
        mine = [d for d in train if d["source"] == rec["name"]]
        assert rec["bytes"] == sum(len(d["text"].encode()) for d in mine) and rec["documents"] == len(mine)
    assert record["heldout"]["bytes"] == sum(len(d["text"].encode()) for d in held)
    v2 = REFERENCE_DIR / "metrics.json"
    if v2.is_file():  # the sources reach the model card of a checkpoint trained on this corpus
        from dsaindex.pipelines.reference.card import model_card

        card = model_card({**json.loads(v2.read_text()), "corpus": record})
        assert "corpus (the King James Bible, Linux kernel C source) with" in card
        assert "| bible | debian bible-kjv-text 9.14-1 | public domain | 4 |" in card
        assert "| kernel | debian linux-source-6.1 9.16-1 | GPL-2.0 | 4 |" in card
