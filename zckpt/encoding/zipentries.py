"""The zip structure of a torch ``.pt`` file, checked: where every entry's bytes are, and that the directory is sound.

The one zip-structure reader of zckpt (:mod:`zckpt.encoding.safeload`, :mod:`zckpt.engine.torchzip`,
:mod:`zckpt.backup.scan` and :mod:`zckpt.ops.verify` call it). ``torch.save`` writes stored (uncompressed) entries,
each a local header followed by its bytes, then the central directory::

    offset 0     [local header: PK\\x03\\x04, flags, method, (sizes), name, extra "FB" padding][data][descriptor]
                 [local header][data][descriptor] ...
    cd_start     [central record: PK\\x01\\x02, method, crc, sizes, name, local header offset] ... (one per entry)
                 [zip64 end record + locator, when needed][end of central directory: PK\\x05\\x06]

:func:`read_entries` reads the end record, the central directory and each entry's local header (a few dozen
bytes each; never the payload) and refuses, as
:class:`~zckpt.errors.CorruptFile` naming the file and the entry:

- a directory that cannot be parsed (no end record, bad signatures, a record count or size that disagrees, a
  directory past the end of the file);
- a compressed entry, or one whose compressed and uncompressed sizes differ (torch writes stored entries);
- a local header that is missing or disagrees with its directory record (name, method; sizes and CRC when the
  header carries them rather than a data descriptor);
- data that runs past the start of the central directory (a size past the end of the file, a truncated file),
  overlaps the next entry, or is not followed exactly by its data descriptor (CRC and sizes agreeing with the
  directory) or the next header.

``torch.load`` refuses most such files ("invalid header or archive is corrupted"), Python's ``zipfile`` the rest
(a local header naming another entry, a compression flag on stored bytes); checking them here lets ``info``,
``verify``, ``merge``, ``reshard`` and ``push`` refuse them cheaply, before any tensor byte is read.
"""

from __future__ import annotations

import io
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO, Callable

from zckpt.errors import CorruptFile

LOCAL_SIG = b"PK\x03\x04"
LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # sig, version, flags, method, time, date, crc, csize, usize, n, e
CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # sig, made by, needed, flags, method, time, date, crc, csize, usize,
#                                                name, extra, comment lengths, disk, int. attrs, ext. attrs, offset
END = struct.Struct("<4sHHHHIIH")  # sig, disk, directory disk, entries here, entries, dir size, dir offset, comment
ZIP64_LOCATOR = struct.Struct("<4sIQI")  # sig, disk, offset of the zip64 end record, disks
ZIP64_END = struct.Struct("<4sQHHIIQQQQ")  # sig, size, versions, disks, entries here, entries, dir size, offset
_DATA_DESCRIPTOR = 0x08  # flag bit 3: sizes and CRC follow the data, the local header holds zeros
_DESCRIPTOR_GAPS = (12, 16, 20, 24)  # crc + 32- or 64-bit sizes, with or without the PK\x07\x08 signature
_UTF8 = 0x800
IN_ZIP64_16, IN_ZIP64_32 = 0xFFFF, 0xFFFFFFFF  # a field of this value is in the zip64 record


@dataclass(frozen=True)
class ZipEntry:
    """One stored entry: ``size`` bytes at ``data_offset``; ``crc`` is the CRC-32 its directory record gives."""

    name: str
    header_offset: int
    data_offset: int
    size: int
    crc: int


def read_entries(f: BinaryIO, file_size: int | None = None, path: str | None = None,
                 payloads: Callable[[str, int], bool] | None = None) -> dict[str, ZipEntry]:
    """Every entry of the zip in ``f`` (file order), after checking the directory against the local headers.

    ``f`` is open for binary random access; ``file_size`` is its size (measured when None); ``path`` names the file
    in errors. Raises :class:`~zckpt.errors.CorruptFile`.

    A file with a ``prefetch(ranges)`` method (a remote :class:`zckpt.io.storage.RangeFile`) is first asked, in one
    call, for every byte range this will read (the local headers, the data descriptors) and the bytes of the
    entries ``payloads(name, size)`` picks (what the caller reads next, e.g. the pickle); the checks below then
    read them exactly as from a local file."""
    if file_size is None:
        f.seek(0, os.SEEK_END)
        file_size = f.tell()

    def damaged(what: str) -> CorruptFile:
        return CorruptFile(what, path=path)

    cd_start, cd, count = _central_directory(f, file_size, damaged)
    records = _central_records(cd, damaged)
    if len(records) != count:
        raise damaged(f"zip directory holds {len(records)} records, its end record says {count}")
    prefetch = getattr(f, "prefetch", None)
    if prefetch is not None:
        prefetch(_wanted(records, cd_start, payloads))
    entries: dict[str, ZipEntry] = {}
    described: set[str] = set()  # entries followed by a data descriptor
    for raw_name, flags, method, crc, csize, usize, header_offset in records:
        name = raw_name.decode("utf-8" if flags & _UTF8 else "cp437", "replace")
        if method != 0:
            raise damaged(f"zip entry {_short(name)} is compressed (method {method}); torch writes stored entries")
        if csize != usize:
            raise damaged(f"zip entry {_short(name)}: directory gives {csize} stored bytes but a size of {usize}")
        if name in entries:
            raise damaged(f"zip entry {_short(name)} appears twice in the directory")
        entries[name], has_descriptor = _check_local(f, name, raw_name, crc, usize, header_offset, cd_start,
                                                     damaged)
        if has_descriptor:
            described.add(name)
    ordered = sorted(entries.values(), key=lambda e: e.header_offset)
    for e, gap in _check_spacing(ordered, described, cd_start, damaged):
        end = e.data_offset + e.size
        f.seek(end)  # local headers and descriptors are read one by one: never the tensor bytes between them
        raw = f.read(gap)
        _check_descriptor(e, raw, damaged)
    return entries


_HEADER_SLACK = 256  # bytes of a local header's extra field fetched ahead (torch pads it to 64-byte alignment)


def _wanted(records: list[tuple], cd_start: int, payloads) -> list[tuple[int, int]]:
    """(start, end) of the bytes :func:`read_entries` will read (each local header with some of its extra field,
    the data descriptor before it) and of the payloads ``payloads`` picks; an estimate: reads outside it are
    still served, one request each."""
    out = []
    for raw_name, flags, _method, _crc, _csize, usize, offset in records:
        end = offset + LOCAL_HEADER.size + len(raw_name) + _HEADER_SLACK
        if payloads is not None and payloads(raw_name.decode("utf-8" if flags & _UTF8 else "cp437", "replace"),
                                             usize):
            end += usize + max(_DESCRIPTOR_GAPS)
        out.append((max(0, offset - max(_DESCRIPTOR_GAPS)), min(end, cd_start)))
    out.append((max(0, cd_start - max(_DESCRIPTOR_GAPS)), cd_start))  # the last entry's descriptor
    return out


def _check_spacing(ordered: list[ZipEntry], described: set[str], cd_start: int, damaged) -> list[tuple]:
    """Entries follow each other exactly: after an entry's data comes its data descriptor (torch: 16 or 24 bytes)
    or nothing (zckpt), then the next local header or the directory. A gap of any other size means a size or
    length field is wrong, which would shift or cut the bytes read. Returns (entry, gap) of the descriptors."""
    out = []
    for i, a in enumerate(ordered):
        nxt = ordered[i + 1].header_offset if i + 1 < len(ordered) else cd_start
        what = f"the next entry {_short(ordered[i + 1].name)}" if i + 1 < len(ordered) else "the zip directory"
        gap = nxt - (a.data_offset + a.size)
        if gap < 0:
            raise damaged(f"zip entry {_short(a.name)}: its {a.size} bytes overlap {what} (a size field is wrong)")
        if gap not in (_DESCRIPTOR_GAPS if a.name in described else (0,)):
            raise damaged(f"zip entry {_short(a.name)}: {gap} unexplained bytes between its data and {what} "
                          "(a size or length field is wrong)")
        if gap:
            out.append((a, gap))
    return out


def _check_descriptor(e: ZipEntry, raw: bytes, damaged) -> None:
    """The data descriptor after an entry's bytes (CRC and sizes) agrees with the directory."""
    body = raw[4:] if len(raw) in (16, 24) else raw
    if len(raw) in (16, 24) and raw[:4] != b"PK\x07\x08":
        raise damaged(f"zip entry {_short(e.name)}: no data descriptor after its {e.size} bytes "
                      "(a size or length field is wrong)")
    if len(body) == 12:
        crc, csize, usize = struct.unpack("<III", body)
    elif len(body) == 20:
        crc, csize, usize = struct.unpack("<IQQ", body)
    else:
        raise damaged(f"zip entry {_short(e.name)}: data descriptor truncated")
    if (crc, csize, usize) != (e.crc, e.size, e.size):
        raise damaged(f"zip entry {_short(e.name)}: its data descriptor gives {usize} bytes (CRC {crc:08x}), "
                      f"the directory {e.size} (CRC {e.crc:08x})")


def _central_directory(f: BinaryIO, file_size: int, damaged) -> tuple[int, bytes, int]:
    """(offset, bytes, entry count) of the central directory, from the end record (and the zip64 end record)."""
    tail_len = min(file_size, END.size)  # torch writes no comment: the end record ends the file
    f.seek(file_size - tail_len)
    tail = f.read(tail_len)
    if len(tail) < END.size or tail[:4] != b"PK\x05\x06" or END.unpack_from(tail)[7]:
        tail_len = min(file_size, END.size + 0xFFFF)  # a comment (or damage): the end record is further back
        f.seek(file_size - tail_len)
        tail = f.read(tail_len)
    last = pos = tail.rfind(b"PK\x05\x06")
    while pos >= 0:  # the end record whose comment ends the file (a signature inside a comment is skipped)
        if pos + END.size <= len(tail) and pos + END.size + END.unpack_from(tail, pos)[7] == len(tail):
            break
        pos = tail.rfind(b"PK\x05\x06", 0, pos)
    if pos < 0:
        pos = last
    if pos < 0 or pos + END.size > len(tail):
        raise damaged("no zip directory at the end of the file (truncated?)")
    end_at = file_size - tail_len + pos
    _sig, disk, cd_disk, _n_here, n, cd_size, cd_offset, _clen = END.unpack_from(tail, pos)
    dir_end = end_at
    if IN_ZIP64_16 in (n, disk, cd_disk) or IN_ZIP64_32 in (cd_size, cd_offset):
        loc_at = end_at - ZIP64_LOCATOR.size
        if loc_at < 0:
            raise damaged("zip64 end record missing")
        f.seek(loc_at)
        loc = f.read(ZIP64_LOCATOR.size)
        if len(loc) != ZIP64_LOCATOR.size or loc[:4] != b"PK\x06\x07":
            raise damaged("zip64 end-record locator missing")
        z64_at = ZIP64_LOCATOR.unpack(loc)[2]
        if z64_at + ZIP64_END.size > loc_at:
            raise damaged(f"zip64 end record at byte {z64_at} lies outside the file")
        f.seek(z64_at)
        z64 = f.read(ZIP64_END.size)
        if len(z64) != ZIP64_END.size or z64[:4] != b"PK\x06\x06":
            raise damaged(f"no zip64 end record at byte {z64_at}")
        n, cd_size, cd_offset = ZIP64_END.unpack(z64)[7:10]
        dir_end = z64_at
    if cd_offset + cd_size > dir_end:
        raise damaged(f"zip directory of {cd_size} bytes at byte {cd_offset} runs past its end record at byte "
                      f"{dir_end} (truncated, or a damaged size field)")
    f.seek(cd_offset)
    cd = f.read(cd_size)
    if len(cd) != cd_size:
        raise damaged("zip directory is truncated")
    return cd_offset, cd, n


def _central_records(cd: bytes, damaged) -> list[tuple]:
    """(name bytes, flags, method, crc, compressed size, size, local header offset) of every directory record."""
    out, pos = [], 0
    while pos < len(cd):
        if pos + CENTRAL.size > len(cd) or cd[pos:pos + 4] != b"PK\x01\x02":
            raise damaged(f"damaged zip directory (no record signature at its byte {pos})")
        (_sig, _made, _need, flags, method, _t, _d, crc, csize, usize, nlen, elen, clen, _disk, _ia, _ea,
         offset) = CENTRAL.unpack_from(cd, pos)
        start = pos + CENTRAL.size
        if start + nlen + elen + clen > len(cd):
            raise damaged("damaged zip directory (a record runs past its end)")
        name = cd[start:start + nlen]
        if IN_ZIP64_32 in (csize, usize, offset):
            usize, csize, offset = _zip64_fields(cd[start + nlen:start + nlen + elen], (usize, csize, offset),
                                                 name, damaged)
        out.append((name, flags, method, crc, csize, usize, offset))
        pos = start + nlen + elen + clen
    return out


def _zip64_fields(extra: bytes, values: tuple, name: bytes, damaged) -> tuple:
    """Replace the 0xFFFFFFFF fields of ``values`` (size, compressed size[, offset]) by the zip64 record's."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            data, k, out = extra[pos + 4:pos + 4 + size], 0, []
            for v in values:
                if v == IN_ZIP64_32:
                    if k + 8 > len(data):
                        raise damaged(f"zip entry {_short(name.decode('utf-8', 'replace'))}: short zip64 record")
                    v = struct.unpack_from("<Q", data, k)[0]
                    k += 8
                out.append(v)
            return tuple(out)
        pos += 4 + size
    raise damaged(f"zip entry {_short(name.decode('utf-8', 'replace'))}: sizes of 0xFFFFFFFF without a zip64 record")


def _short(name: str) -> str:
    """``data/1`` for ``<archive>/data/1``: the file is named already, its archive folder only repeats it."""
    return name.split("/", 1)[1] if "/" in name else name


def _check_local(f: BinaryIO, name: str, raw_name: bytes, crc: int, size: int,
                 header_offset: int, cd_start: int, damaged) -> tuple[ZipEntry, bool]:
    """The entry's local header read and compared with its directory record."""
    n = LOCAL_HEADER.size + len(raw_name)
    if header_offset + n > cd_start:
        raise damaged(f"zip entry {_short(name)}: local header offset {header_offset} lies outside the data "
                      "(the zip directory is damaged or the file truncated)")
    f.seek(header_offset)
    head = f.read(n)
    if len(head) != n or head[:4] != LOCAL_SIG:
        raise damaged(f"zip entry {_short(name)}: no local header at byte {header_offset}")
    _sig, _ver, flags, method, _t, _d, lcrc, lcsize, lusize, nlen, elen = LOCAL_HEADER.unpack_from(head)
    if nlen != len(raw_name) or head[LOCAL_HEADER.size:] != raw_name:
        raise damaged(f"zip entry {_short(name)}: local header names "
                      f"{head[LOCAL_HEADER.size:].decode('utf-8', 'replace')!r}")
    if method != 0:
        raise damaged(f"zip entry {_short(name)}: local header says compression method {method}, the directory 0")
    data_offset = header_offset + n + elen
    if not flags & _DATA_DESCRIPTOR:  # the local header carries sizes and CRC: they must agree
        if IN_ZIP64_32 in (lcsize, lusize):
            f.seek(header_offset + n)
            extra = f.read(elen)
            lusize, lcsize = _zip64_fields(extra, (lusize, lcsize), raw_name, damaged)
        if (lcsize, lusize) != (size, size) or lcrc != crc:
            raise damaged(f"zip entry {_short(name)}: local header gives {lusize} bytes (CRC {lcrc:08x}), "
                          f"the directory {size} (CRC {crc:08x})")
    if data_offset + size > cd_start:
        raise damaged(f"zip entry {_short(name)}: {size} bytes at byte {data_offset} run past the end of "
                      f"the data ({cd_start} bytes; truncated, or a damaged size field)")
    return ZipEntry(name, header_offset, data_offset, size, crc), bool(flags & _DATA_DESCRIPTOR)


class StreamedCrcs:
    """The CRC-32 of every entry of a zip, over the file's bytes as they stream past once from its start (a
    hash of the whole file, ``on_chunk``): call it with each chunk in order, then :meth:`damaged`."""

    def __init__(self, entries):
        # [data start, data end, expected CRC, name, running CRC]
        self.spans = sorted([e.data_offset, e.data_offset + e.size, e.crc, e.name, 0] for e in entries)
        self.pos, self.first = 0, 0

    def __call__(self, chunk: memoryview) -> None:
        from zckpt.io.hashing import crc32
        pos, end = self.pos, self.pos + len(chunk)
        for span in self.spans[self.first:]:
            if span[0] >= end:
                break
            lo, hi = max(span[0], pos), min(span[1], end)
            if lo < hi:
                span[4] = crc32(chunk[lo - pos:hi - pos], span[4])
        while self.first < len(self.spans) and self.spans[self.first][1] <= end:
            self.first += 1
        self.pos = end

    def damaged(self) -> list[str]:
        """Names of the entries whose bytes did not stream past whole or do not match their CRC."""
        return [name for _start, stop, want, name, crc in self.spans if stop > self.pos or crc != want]


def read_file_entries(path: str) -> dict[str, ZipEntry]:
    """:func:`read_entries` of a local file by name."""
    with open(path, "rb") as f:
        return read_entries(f, os.fstat(f.fileno()).st_size, path)


class Window(io.RawIOBase):
    """Bytes [start, start+length) of an open file, as a file of their own (one DCP item's torch zip)."""

    def __init__(self, f, start: int, length: int):
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def seekable(self):
        return True

    def readable(self):
        return True

    def seek(self, pos, whence=os.SEEK_SET):
        self.pos = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence] + pos
        return self.pos

    def tell(self):
        return self.pos

    def read(self, n=-1):
        n = self.length - self.pos if n is None or n < 0 else min(n, max(self.length - self.pos, 0))
        self.f.seek(self.start + self.pos)
        data = self.f.read(n)
        self.pos += len(data)
        return data

    def readinto(self, b):
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def close(self):  # the underlying file stays open for the next item
        super().close()
