"""Reading layer tars: a streaming header reader of our own, forward only, keeping nothing.

Python 3.11's tarfile cannot be trusted with a hostile layer: its PAX regex is quadratic
(CVE-2024-6232), it keeps every member in memory, a negative base-256 size sends it back to an
earlier header (forever), and it expands GNU sparse files. This reader reads ustar, PAX (local and
global) and GNU long name/link headers and gives the same members as tarfile for every tar snap,
Docker or skopeo write (names, types, modes, owners, sizes, mtimes, link names, devices, PAX
records), and refuses, with an IntegrityError naming the problem, anything else that could hang,
blow up memory or mislead an extractor:

- sizes can only move the stream forward: negative or absurd sizes are refused;
- PAX and GNU long name/link data is capped (MAX_META) and PAX records are parsed in one pass;
- GNU sparse entries (old and PAX forms) are refused: OCI layers do not use them;
- mtimes must be finite and fit a timestamp, owners and device numbers a 32-bit id;
- NUL bytes in names, link targets and xattr names are refused;
- a layer of more than LAYER_MAX_ENTRIES members, an image of more than SNAP_MAX_ENTRIES, or of
  more extended header bytes than 2 KiB per entry a layer may hold (EntryCount), is refused: what
  its readers keep per entry (verify's expected tree, the extractor's written paths, the restore
  journal, the skeletons' headers) stays bounded, and a layer of millions of empty files (a few
  hundred MB of headers that compress to almost nothing) is refused once a layer's worth of
  headers is read, in time proportional to them.
Members are TarInfo objects (the attributes of tarfile's), made one at a time and dropped.
"""

from __future__ import annotations

import os
import re
import struct
import tarfile
from typing import BinaryIO, Iterator, Optional

from snapshotter.errors import IntegrityError, UsageError

from .rules import XATTR_PAX

READ_BUFFER = 1 << 20
MAX_META = 4 << 20  # PAX records, GNU long names and links: snap's are a few hundred bytes
MAX_SIZE = (1 << 63) - 1  # what a file offset can hold
MAX_ID = 0xFFFFFFFE  # uid, gid, device numbers: 32-bit, not -1
MAX_MTIME = 1 << 33  # seconds either side of 1970 (year 2242): as nanoseconds it still fits 64 bits
# Members (files, directories, links, whiteouts) of one layer: what one hostile layer can make restore
# and verify keep. They keep about 0.6 KiB per entry at their peak (the expected tree or the base's
# index, the paths written, the journal) over about 80 MiB: measured, 190 MiB at 200k entries and
# 248 MiB at 300k, so a layer of millions of headers is refused under 256 MiB. snap's own layers
# are bundles far smaller; a base image's biggest layer holds a few tens of thousands.
LAYER_MAX_ENTRIES = 250_000
# Members of one image, its layers together: real GPU boxes hold 76k to 200k, a VM's whole OS and
# its venvs more; at the cap restore and verify keep about 700 MiB.
DEFAULT_MAX_ENTRIES = 1_000_000
MAX_ENTRIES_ENV = "SNAP_MAX_ENTRIES"
# PAX records and GNU long names, on average over an image's cap: snap's are about 100 bytes (an
# mtime in ns, a long path's name), a path of PATH_MAX 4 KiB.
META_PER_ENTRY = 2048
_OCTAL = re.compile(rb" *[0-7]* *")
_DECIMAL = re.compile(r"-?[0-9]+(?:\.[0-9]*)?")
_PAX_LENGTH_DIGITS = 20
_META_TYPES = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
               tarfile.GNUTYPE_LONGLINK)
_PAX_INT = {"size": MAX_SIZE, "uid": MAX_ID, "gid": MAX_ID}


class ForwardStream:
    """A byte stream that is read and skipped forward only, counting its position: the layer
    stream as the tar reader sees it. A source with a `skip(n)` method (a split layer, layer/staging.py)
    skips without reading; any other is read and dropped."""

    def __init__(self, src: BinaryIO):
        self.src = src
        self._skip = getattr(src, "skip", None)
        self.buf = b""
        self.at = 0  # read position in buf
        self.pos = 0  # position in the stream of buf[at]

    def read(self, n: int) -> bytes:
        """Up to n bytes (fewer only at the end of the stream, or of what is buffered)."""
        left = len(self.buf) - self.at
        if not left:
            if n >= READ_BUFFER:
                data = self.src.read(n)
                self.pos += len(data)
                return data
            self.buf, self.at = self.src.read(READ_BUFFER), 0
            left = len(self.buf)
        n = min(n, left)
        data = self.buf[self.at:self.at + n] if n < len(self.buf) else self.buf
        self.at += n
        self.pos += n
        return data

    def read_exact(self, n: int) -> bytes:
        """n bytes, or fewer at the end of the stream."""
        data = self.read(n)
        if len(data) == n or not data:
            return data
        parts = [data]
        got = len(data)
        while got < n:
            more = self.read(n - got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        return b"".join(parts)

    def skip(self, n: int) -> int:
        """Move n bytes forward; returns how far it got (less at the end of the stream)."""
        if n < 0:
            raise IntegrityError("layer stream: a tar header moves backwards: refusing a hostile layer")
        done = min(n, len(self.buf) - self.at)
        self.at += done
        self.pos += done
        if done < n and self._skip is not None:
            moved = self._skip(n - done)
            self.pos += moved
            return done + moved
        while done < n:
            data = self.src.read(min(n - done, READ_BUFFER))
            if not data:
                break
            done += len(data)
            self.pos += len(data)
        return done

    def drain(self) -> None:
        """Read to the end (so that a hash over the stream covers all of it)."""
        self.at = len(self.buf)
        while self.src.read(READ_BUFFER):
            pass


def max_entries() -> int:
    """The most members an image may hold (SNAP_MAX_ENTRIES, else DEFAULT_MAX_ENTRIES)."""
    text = os.environ.get(MAX_ENTRIES_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_ENTRIES
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{MAX_ENTRIES_ENV}={text!r} is not a positive number of entries")
    return int(text)


class EntryCount:
    """The members read of one image so far, over its layers, and the bytes of their extended
    headers (PAX, GNU long names: META_PER_ENTRY per entry of the cap, on average): past either cap,
    IntegrityError naming the layer that went past it. Shared by the readers of one image's layers
    (threads may race on the counts: off by a little at most)."""

    def __init__(self, cap: Optional[int] = None):
        self.cap = max_entries() if cap is None else cap
        self.layer_cap = min(self.cap, LAYER_MAX_ENTRIES)
        self.total = 0
        self.meta = 0
        self.by_layer: dict[str, int] = {}

    def rewind(self, total: int, layer: str) -> None:
        """Back to `total`, `layer` not counted: a layer not applied, to be applied again."""
        self.total = total
        self.by_layer.pop(layer, None)

    def add(self, n: int, layer: str) -> None:
        self.total += n
        here = self.by_layer[layer] = self.by_layer.get(layer, 0) + n
        if here > self.layer_cap:
            raise IntegrityError(f"{layer} holds more than {self.layer_cap} entries (files, directories, links, "
                                 f"whiteouts; a layer may hold {LAYER_MAX_ENTRIES} at most, {MAX_ENTRIES_ENV} lowers "
                                 "it): refusing a hostile layer")
        if self.total > self.cap:
            raise IntegrityError(f"{layer} brings the image past {self.cap} entries (files, directories, links, "
                                 f"whiteouts; {MAX_ENTRIES_ENV} raises the cap): refusing a hostile layer")

    def add_meta(self, size: int, layer: str) -> None:
        self.meta += size
        if self.meta > self.layer_cap * META_PER_ENTRY:
            raise IntegrityError(f"{layer} brings the image past {self.layer_cap * META_PER_ENTRY} bytes of extended "
                                 f"headers ({META_PER_ENTRY} per entry a layer may hold): refusing a hostile layer")


class TarReader:
    """Iterates over the members of a tar stream. Between two members, `read_data` reads the
    current member's content; what is left of it is skipped when the next member is asked for."""

    def __init__(self, src: BinaryIO, layer: str = "layer", entries: Optional[EntryCount] = None):
        self.stream = src if isinstance(src, ForwardStream) else ForwardStream(src)
        self.layer = layer  # for messages
        self.entries = entries if entries is not None else EntryCount()  # this layer's alone, unless shared
        self._data_left = 0  # content of the current member not read yet
        self._pad = 0
        self._globals: dict[str, str] = {}
        self._globals_size = 0

    def _bad(self, what: str) -> IntegrityError:
        return IntegrityError(f"{self.layer} is not a valid tar: {what}: refusing a hostile or corrupt layer")

    def __iter__(self) -> Iterator[tarfile.TarInfo]:
        while True:
            self._skip_rest()
            m = self._next()
            if m is None:
                return
            self.entries.add(1, self.layer)
            yield m

    def read_data(self, n: int) -> bytes:
        """Up to n bytes of the current member's content; b"" at its end. A stream that ends
        inside the content is an IntegrityError."""
        if not self._data_left:
            return b""
        data = self.stream.read(min(n, self._data_left))
        if not data:
            raise self._bad("it ends inside a file's content (truncated)")
        self._data_left -= len(data)
        return data

    def skip_data(self) -> None:
        """Skip the rest of the current member's content (a split layer's source skips it unread)."""
        self._skip_rest()

    def _skip_rest(self) -> None:
        want = self._data_left + self._pad
        if want:
            got = self.stream.skip(want)
            if got < self._data_left:
                raise self._bad("it ends inside a file's content (truncated)")
            self._data_left = self._pad = 0

    def _block(self) -> Optional[bytes]:
        buf = self.stream.read_exact(tarfile.BLOCKSIZE)
        if not buf:
            return None
        if len(buf) < tarfile.BLOCKSIZE:
            raise self._bad("it ends inside a header (truncated)")
        return buf

    def _next(self) -> Optional[tarfile.TarInfo]:
        pax: Optional[dict[str, str]] = None
        long_name = long_link = None
        meta_size = 0
        offset = self.stream.pos
        while True:
            buf = self._block()
            if buf is None:
                if pax is not None or long_name is not None or long_link is not None:
                    raise self._bad("it ends after an extended header")
                return None  # the end of the stream, without end-of-archive blocks: as tarfile does
            if buf.count(0) == tarfile.BLOCKSIZE:
                if pax is not None or long_name is not None or long_link is not None:
                    raise self._bad("an extended header is followed by the end of the archive")
                return None  # end of archive; what follows (record padding) is the caller's to drain
            kind, size, chksum = self._check_header(buf)
            if kind in _META_TYPES:
                meta_size += size
                if meta_size > MAX_META:
                    raise self._bad(f"an extended header of {size} bytes (at most {MAX_META} are read)")
                self.entries.add_meta(size, self.layer)
                data = self.stream.read_exact(size)
                if len(data) < size:
                    raise self._bad("it ends inside an extended header (truncated)")
                self.stream.skip(-size % tarfile.BLOCKSIZE)
                if kind == tarfile.GNUTYPE_LONGNAME:
                    long_name = _nts(data)
                elif kind == tarfile.GNUTYPE_LONGLINK:
                    long_link = _nts(data)
                elif kind == tarfile.XGLTYPE:
                    self._globals_size += size
                    if self._globals_size > MAX_META:
                        raise self._bad(f"global extended headers of more than {MAX_META} bytes")
                    self._globals.update(self._pax_records(data))
                else:
                    pax = pax or {}
                    pax.update(self._pax_records(data))
                continue
            if kind == tarfile.GNUTYPE_SPARSE:
                raise self._bad(f"member {_nts(buf[0:100])!r} is a GNU sparse file (OCI layers have none)")
            return self._member(buf, kind, size, chksum, offset, pax, long_name, long_link)

    def _check_header(self, buf: bytes) -> tuple[bytes, int, int]:
        field = buf[148:156]
        chksum = self._number(field, "checksum")
        if chksum != 256 + sum(buf) - sum(field) and \
                chksum != 256 + sum(struct.unpack_from("148b8x356b", buf)):  # signed: some old tars
            raise self._bad("a header has a bad checksum")
        size = self._number(buf[124:136], "size")
        if size > MAX_SIZE:
            raise self._bad(f"a member's size is absurd ({size})")
        return buf[156:157], size, chksum

    def _number(self, field: bytes, what: str, signed: bool = False) -> int:
        try:
            return header_number(field, signed)
        except ValueError as e:
            raise self._bad(f"a header's {what} field {e}") from None

    def _pax_records(self, data: bytes) -> dict[str, str]:
        try:
            return pax_records(data)
        except ValueError as e:
            raise self._bad(str(e)) from None

    def _member(self, buf: bytes, kind: bytes, size: int, chksum: int, offset: int, pax: Optional[dict[str, str]],
                long_name: Optional[str], long_link: Optional[str]) -> tarfile.TarInfo:
        m = tarfile.TarInfo()
        m.name = _nts(buf[0:100])
        m.mode, m.uid, m.gid = self._fields(buf[100:124], _MODE_OWNER)
        m.size = size
        m.mtime = self._number(buf[136:148], "mtime", signed=True)
        m.chksum = chksum
        m.type = kind
        m.linkname = _nts(buf[157:257]) if buf[157] else ""
        m.uname, m.gname, m.devmajor, m.devminor = self._fields(buf[265:345], _NAMES_DEVICES)
        prefix = _nts(buf[345:500]) if buf[345] else ""
        if kind == tarfile.AREGTYPE and m.name.endswith("/"):
            m.type = tarfile.DIRTYPE  # old V7 tars mark a directory by the slash
        if m.isdir():
            m.name = m.name.rstrip("/")
        if prefix:
            m.name = prefix + "/" + m.name
        if long_name is not None:
            m.name = long_name.removesuffix("/") if m.isdir() else long_name
        if long_link is not None:
            m.linkname = long_link
        records = self._globals
        if pax:
            records = {**self._globals, **pax}
        if records:
            self._apply_pax(m, records)
        m.pax_headers = records.copy() if records else {}
        m.offset = offset
        m.offset_data = self.stream.pos
        self._validate(m)
        if m.isreg() or m.type not in tarfile.SUPPORTED_TYPES:  # what tarfile reads as content
            self._data_left, self._pad = m.size, -m.size % tarfile.BLOCKSIZE
        return m

    def _fields(self, block: bytes, layout: tuple[tuple[int, int, Optional[str]], ...]) -> tuple:
        """Header fields that repeat from one header to the next (a mode and owner, the owner's
        names and the device numbers), parsed once per distinct run of bytes: `layout` is
        (start, end, what: a number's name, None for a name) of each field in `block`."""
        got = _FIELDS_SEEN.get(block)
        if got is None:
            got = tuple(_nts(block[a:b]) if what is None else self._number(block[a:b], what) for a, b, what in layout)
            if len(_FIELDS_SEEN) >= _FIELDS_SEEN_MAX:
                _FIELDS_SEEN.clear()  # kept small, whatever the layer
            _FIELDS_SEEN[block] = got
        return got

    def _apply_pax(self, m: tarfile.TarInfo, records: dict[str, str]) -> None:
        for key, value in records.items():
            if key in _PAX_INT:
                if not value.isdigit() or int(value) > _PAX_INT[key]:
                    raise self._bad(f"PAX {key} {value[:40]!r} is out of range")
                setattr(m, key, int(value))
            elif key == "mtime":
                if not _DECIMAL.fullmatch(value) or abs(float(value)) >= MAX_MTIME:
                    raise self._bad(f"PAX mtime {value[:40]!r} is not a valid time")
                m.mtime = float(value)
            elif key == "path":
                m.name = value.rstrip("/")
            elif key == "linkpath":
                m.linkname = value
            elif key in ("uname", "gname"):
                setattr(m, key, value)

    def _validate(self, m: tarfile.TarInfo) -> None:
        for what, value in (("uid", m.uid), ("gid", m.gid), ("device major", m.devmajor), ("device minor", m.devminor)):
            if value > MAX_ID:
                raise self._bad(f"member {m.name!r} has a {what} out of range ({value})")
        if abs(m.mtime) >= MAX_MTIME:
            raise self._bad(f"member {m.name!r} has an mtime out of range ({m.mtime})")
        if "\0" in m.name:
            raise self._bad(f"member {m.name!r} has a NUL byte in its name")
        if "\0" in m.linkname:
            raise self._bad(f"member {m.name!r} has a NUL byte in its link target {m.linkname!r}")
        for key in m.pax_headers:
            if key.startswith(XATTR_PAX) and not key[len(XATTR_PAX):]:
                raise self._bad(f"member {m.name!r} has an xattr with an empty name")


# Runs of header fields already parsed (TarReader._fields): the mode and owner, the owner's names and
# the device numbers repeat in nearly every header. Sizes, mtimes and checksums rarely do: not kept.
_FIELDS_SEEN: dict[bytes, tuple] = {}
_FIELDS_SEEN_MAX = 4096
_MODE_OWNER = ((0, 8, "mode"), (8, 16, "uid"), (16, 24, "gid"))  # header bytes 100:124
_NAMES_DEVICES = ((0, 32, None), (32, 64, None), (64, 72, "device major"), (72, 80, "device minor"))  # 265:345


def header_number(field: bytes, signed: bool = False) -> int:
    """A numeric header field: octal, or base-256 as GNU tar writes big values. ValueError for
    anything else, and for a negative value unless `signed` (only an mtime may be negative)."""
    if field[0] == 0o200:
        return int.from_bytes(field[1:], "big")
    if field[0] == 0o377:
        n = int.from_bytes(field[1:], "big") - 256 ** (len(field) - 1)
        if not signed:
            raise ValueError(f"is negative ({n})")
        return n
    text = field.split(b"\0", 1)[0]
    if not _OCTAL.fullmatch(text):
        raise ValueError(f"is not a number ({text[:20]!r})")
    return int(text.strip() or b"0", 8)


def pax_records(data: bytes) -> dict[str, str]:
    """PAX records ("LENGTH KEY=VALUE\\n"), parsed in one pass (tarfile's regex is quadratic),
    up to trailing NULs. ValueError for a malformed record or a GNU sparse file."""
    out: dict[str, str] = {}
    pos, end = 0, len(data)
    while pos < end and data[pos] != 0:
        space = data.find(b" ", pos, pos + _PAX_LENGTH_DIGITS + 1)
        digits = data[pos:space] if space > pos else b""
        if not digits.isdigit():
            raise ValueError("a malformed PAX record")
        length = int(digits)
        eq = data.find(b"=", space + 1, pos + length)
        if length <= space + 1 - pos or pos + length > end or eq < 0 or data[pos + length - 1] != 0x0A:
            raise ValueError("a malformed PAX record")
        key = data[space + 1:eq].decode("utf-8", "surrogateescape")
        if "GNU.sparse" in key:
            raise ValueError("a GNU sparse file (OCI layers have none)")
        if "\0" in key:
            raise ValueError(f"a PAX record name with a NUL byte ({key!r})")
        out[key] = data[eq + 1:pos + length - 1].decode("utf-8", "surrogateescape")
        pos += length
    return out


def _nts(b: bytes) -> str:
    """A NUL-terminated header field as text (undecodable bytes kept as surrogates, as tarfile does)."""
    p = b.find(b"\0")
    return (b[:p] if p >= 0 else b).decode("utf-8", "surrogateescape")


def iter_members(src: BinaryIO, layer: str = "layer",
                 entries: Optional[EntryCount] = None) -> Iterator[tuple[TarReader, tarfile.TarInfo]]:
    """(reader, member) for each member of a tar stream, then the stream read to its end. `entries`:
    the image's count (EntryCount), else the layer's alone."""
    reader = TarReader(src, layer, entries)
    for m in reader:
        yield reader, m
    reader.stream.drain()


def data_chunks(reader: TarReader, size: int = READ_BUFFER) -> Iterator[bytes]:
    """The current member's content, in pieces."""
    while chunk := reader.read_data(size):
        yield chunk
