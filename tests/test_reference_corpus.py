"""The reference v2 corpus builder, offline: its readers on hand-made package files, the synthetic tasks,
the download checks, and a build of the code and synthetic sources with a tokenizer."""

import base64
import gzip
import hashlib
import io
import json
import random
import struct
import tarfile
import zlib

import pytest

from dsaindex.errors import DsaIndexError
from dsaindex.pipelines import reference_corpus as rc
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
        rc._RReader(b"RDX3\n")


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
    needle = rc.needle_document(rng, 40_000, natural, keys=4)
    asked = needle.text.rsplit("what is the passkey for ", 1)[1].split("?")[0]
    value = needle.text.rsplit(" is ", 1)[1].rstrip(".\n")
    said = needle.text.index(f"The passkey for {asked} is {value}.")
    assert len(needle.text) - said > 40_000 // 5 - 100
    chain = rc.chain_document(rng, 30_000, natural, hops=5)
    answer = chain.text.rsplit("= ", 1)[1].rstrip(".\n")
    assert f"= {answer}." in chain.text.split("Question:")[0]
    copy = rc.copy_document(rng, 20_000, [" ".join(str(i) for i in range(10_000))])
    passage = copy.text.rsplit(":\n", 1)[1].rstrip("\n")
    at = copy.text.index(passage)
    assert len(passage) >= 500 and len(copy.text) - at > 4096
    a = rc.synthetic_documents(200_000, natural, seed=1, heldout=False)
    b = rc.synthetic_documents(200_000, natural, seed=1, heldout=False)
    assert [d.text for d in a] == [d.text for d in b] and sum(len(d.text) for d in a) >= 200_000
    assert {d.title.split()[0] for d in a} >= {"needle", "key-value", "variable", "long"}


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
        rc.build_corpus(tmp_path / "d", ["bible"])


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
    proc = run_cli("reference", "corpus", str(tmp_path / "c"), "--sources", "bible")
    assert proc.returncode != 0 and "Unknown corpus sources" in proc.stderr
    proc = run_cli("reference", "corpus", str(tmp_path / "c"), "--vocab", "100")
    assert proc.returncode != 0 and "--vocab" in proc.stderr


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
