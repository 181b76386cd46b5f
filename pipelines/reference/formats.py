"""Decoders of the data files two Debian packages of the reference corpus ship, so that neither R nor the
``bible`` program is needed: :func:`read_r_strings` reads the character vectors of an R lazy-load database
(``r-cran-janeaustenr``), :func:`read_brs_text` the text of a Bible Retrieval System compressed data file
(``bible-kjv-text``: windows of Unix ``compress`` LZW streams)."""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

from dsaindex.errors import DsaIndexError


def read_r_strings(rdb: Path, rdx: Path) -> dict[str, list[str]]:
    """The character-vector objects of an R lazy-load database (``Rdata.rdb`` + ``Rdata.rdx``) by name.

    Minimal reader of R's serialization format 2/3 (XDR): the index is a list whose ``variables`` maps
    names to (offset, length) in the database; each entry is a 4-byte length and a zlib stream of one
    serialized object. Only STRSXP objects are returned (others are skipped)."""
    index = _RReader(gzip.decompress(rdx.read_bytes()) if rdx.read_bytes()[:2] == b"\x1f\x8b"
                     else zlib.decompress(rdx.read_bytes()[4:])).object()
    names = index.get("variables", {})
    data = rdb.read_bytes()
    out = {}
    for name, where in names.items():
        offset, length = int(where[0]), int(where[1])
        blob = zlib.decompress(data[offset + 4 : offset + length])
        obj = _RReader(blob).object()
        if isinstance(obj, list) and all(isinstance(x, str) or x is None for x in obj):
            out[name] = [x or "" for x in obj]
    return out


class _RReader:
    """R's XDR serialization: enough of it for lists, named lists, numbers and strings."""

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise DsaIndexError("not an XDR R serialization.", "pass the package's Rdata.rdb / Rdata.rdx.")
        self.data, self.at = data, 2
        self.refs: list = []  # symbols in order of appearance (later uses are REFSXP)
        version = self.int()
        self.int(), self.int()
        if version == 3:
            n = self.int()  # the native encoding's name follows
            self.at += n

    def int(self) -> int:
        (value,) = struct.unpack(">i", self.data[self.at : self.at + 4])
        self.at += 4
        return value

    def object(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if kind == 254:  # NILVALUE_SXP
            return None
        if kind == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            text = self.data[self.at : self.at + n].decode("utf-8", "replace")
            self.at += n
            return text
        if kind == 1:  # SYMSXP: its print name, remembered for later references
            name = self.object()
            self.refs.append(name)
            return name
        if kind == 255:  # REFSXP: an earlier symbol
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == 2:  # LISTSXP (pairlist): attributes
            out = {}
            while kind == 2:
                if has_attr:
                    self.object()
                tag = self.object() if has_tag else None
                out[tag] = self.object()
                flags = self.int()
                kind, has_attr, has_tag = flags & 0xFF, bool(flags & (1 << 9)), bool(flags & (1 << 10))
            return out
        if kind in (10, 13, 14, 16, 19):  # logical, integer, real, string, list vectors
            n = self.int()
            if kind == 16:
                values = [self.object() for _ in range(n)]
            elif kind == 19:
                values = [self.object() for _ in range(n)]
            elif kind == 14:
                values = list(struct.unpack(f">{n}d", self.data[self.at : self.at + 8 * n]))
                self.at += 8 * n
            else:
                values = list(struct.unpack(f">{n}i", self.data[self.at : self.at + 4 * n]))
                self.at += 4 * n
            attrs = self.object() if has_attr else None
            if kind == 19 and isinstance(attrs, dict) and isinstance(attrs.get("names"), list):
                return dict(zip(attrs["names"], values, strict=False))
            return values
        raise DsaIndexError(f"R serialization type {kind} is not supported by this reader.",
                            "the package's data format changed: update read_r_strings.")


def _lzw_decompress(data: bytes, max_bits: int) -> bytes:
    """One stream of Unix ``compress`` (LZW in block mode, codes of 9 to ``max_bits`` bits, least
    significant bit first) without the 3-byte ``.Z`` header.

    compress writes codes in groups of eight: when the code width grows, or a CLEAR code (256) empties the
    table, the rest of the current group is padding."""
    table = [bytes([i]) for i in range(256)] + [b""]  # entry 256 is the CLEAR code
    n_bits, group_start, at, end = 9, 0, 0, 8 * len(data)
    data += b"\0\0"  # a code is read from three bytes, which may run past the last
    out, prev = [], b""

    def next_group(at: int) -> int:
        group = 8 * n_bits
        return group_start + -(-(at - group_start) // group) * group

    while True:
        if n_bits < max_bits and len(table) >= 1 << n_bits:
            at = group_start = next_group(at)
            n_bits += 1
        if at + n_bits > end:
            break
        code = (int.from_bytes(data[at >> 3 : (at >> 3) + 3], "little") >> (at & 7)) & ((1 << n_bits) - 1)
        at += n_bits
        if not out:
            if code > 255:
                raise DsaIndexError(f"An LZW stream starts with code {code}.", "the data file is damaged: download it again.")
            prev = table[code]
            out.append(prev)
            continue
        if code == 256:  # the next code's entry lands on 256, never read: compress's own behavior
            del table[256:]
            at = group_start = next_group(at)
            n_bits = 9
            continue
        if code < len(table):
            entry = table[code]
        elif code == len(table):  # the entry being defined: previous string plus its own first byte
            entry = prev + prev[:1]
        else:
            raise DsaIndexError(f"LZW code {code} is past the table ({len(table)} entries).",
                                "the data file is damaged: download it again.")
        out.append(entry)
        if len(table) < 1 << max_bits:
            table.append(prev + entry[:1])
        prev = entry
    return b"".join(out)


def read_brs_text(path: Path) -> str:
    """The text of a Bible Retrieval System compressed data file (``bible-kjv-text``'s ``bible.data``).

    Layout (integers big-endian uint32): the magic ``EC02`` and a NUL-padded description up to byte 84;
    the window size (bytes of text per window) and the number of windows W; W + 1 file offsets (the
    windows' starts, then the file's end). Each window is one LZW stream of Unix ``compress``; the ``.Z``
    header (3 bytes: magic and maximal code width) stands once, just before the first window."""
    data = path.read_bytes()
    if data[:4] != b"EC02":
        raise DsaIndexError(f"{path} is not a BRS compressed data file (it starts with {data[:4]!r}, not b'EC02').",
                            "pass the bible-kjv-text package's bible.data; download it again if it is damaged.")
    window, count = struct.unpack(">II", data[84:92]) if len(data) >= 92 else (0, 0)
    offsets = struct.unpack(f">{count + 1}I", data[92 : 96 + 4 * count]) if len(data) >= 96 + 4 * count else ()
    if not offsets or list(offsets) != sorted(offsets) or offsets[-1] != len(data) or offsets[0] < 96 + 4 * count:
        raise DsaIndexError(f"{path.name}'s window table does not fit the file ({count} windows, {len(data)} bytes).",
                            "the file is damaged or truncated: download it again.")
    header = data[offsets[0] - 3 : offsets[0]]
    max_bits = header[2] & 0x1F if header[:2] == b"\x1f\x9d" else 16
    if not 9 <= max_bits <= 16:
        raise DsaIndexError(f"{path.name} declares LZW codes of up to {max_bits} bits (compress writes 9 to 16).",
                            "the file is damaged: download it again.")
    windows = []
    for i in range(count):
        text = _lzw_decompress(data[offsets[i] : offsets[i + 1]], max_bits)
        if (len(text) != window and i < count - 1) or len(text) > window:
            raise DsaIndexError(f"Window {i} of {path.name} holds {len(text)} bytes of text, not {window}.",
                                "the file is damaged: download it again.")
        windows.append(text)
    return b"".join(windows).decode("utf-8", "replace")
