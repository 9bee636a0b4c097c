"""The layout of a legacy (non-zip) torch file, read without running code.

``torch.save(obj, f, _use_new_zipfile_serialization=False)`` (DeepSpeed with ``"checkpoint":
{"checkpoint_serialization": false}``; torch/serialization.py ``_legacy_save``) writes five pickles back to back,
then the bytes of every storage, and nothing else::

    offset 0     pickle  magic number 0x1950a86a20f9469cfc6c
                 pickle  protocol version 1001
                 pickle  sys info {"protocol_version": 1001, "little_endian": True, "type_sizes": {...}}
                 pickle  the object; each storage a persistent id
                         ('storage', <dtype>Storage, key, location, numel, view_metadata=None)
                 pickle  the storage keys, sorted: [key, ...]
    data_start   for each key in that order:
                   int64 little-endian  numel (elements of the storage's dtype; bytes for an UntypedStorage)
                   numel * element size bytes
    end of file  (exactly: the size of the file is data_start + sum(8 + nbytes))

No pickle records its length: :func:`read_header` walks each one's opcodes to its STOP
(:func:`zckpt.encoding.pickles.scan`), reading more of the file only while a pickle is unfinished. The storages'
places follow from the keys' order and the numels in the object pickle (:func:`locate`), checked against the
file's size and each storage's own size field. :mod:`zckpt.encoding.safeload` unpickles the object pickle with its
allow-list and gives tensors these places, so every reader, planner and the engine treat a legacy file exactly as
a zip one (a ``Piece`` is a path, a byte offset, a count and a dtype). Refused as
:class:`~zckpt.errors.CorruptFile` naming the file: a truncated file, a pickle that does not end, a wrong magic
number or protocol, keys that disagree with the object pickle (missing, extra, repeated), more storages than the
file has room for, sizes that do not add up to the file, and a size field that disagrees with the pickle.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import BinaryIO

from zckpt.errors import CorruptFile, UnsupportedLayout
from zckpt.encoding.pickles import Truncated, plain_loads, scan

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
SIZE_FIELD = 8  # the int64 numel in front of each storage's bytes
FIRST_READ = 16 << 10  # the pickles of most optimizer files fit; more is read only while one is unfinished
MAX_HEADER_BYTES = 1 << 30  # pickles larger than this together are not a checkpoint we should trust
_SMALL_PICKLE = 4096  # the magic, protocol and sys-info pickles are a few dozen bytes each


def is_legacy(head: bytes) -> bool:
    """Whether a file starting with ``head`` (its first bytes) is a legacy torch file: a pickle ``PROTO`` opcode."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


@dataclass
class Header:
    """The pickles of one legacy file: the object pickle's bytes, the storage keys in file order, where data
    starts. ``bytes_read``: how much of the file was read to find them."""

    path: str | None
    size: int
    obj_pickle: bytes
    keys: list[str]
    data_start: int
    bytes_read: int = 0
    prefix: bytes = field(default=b"", repr=False)  # the bytes read from offset 0 (pickles and maybe some data)


def read_header(f: BinaryIO, size: int, path: str | None = None) -> Header:
    """Find and check the five pickles at the start of ``f`` (``size`` bytes, open for random access)."""
    buf, want = bytearray(), min(size, FIRST_READ)
    f.seek(0)
    while True:  # read on (never again from the start) while a pickle is unfinished
        more = f.read(want - len(buf))
        buf += more
        if len(buf) != want:
            raise CorruptFile(f"file is shorter than its size ({len(buf)} of {want} bytes readable)", path=path)
        try:
            spans = _pickle_spans(buf, path)
            break
        except Truncated:
            if want >= size:
                raise CorruptFile("legacy torch file is truncated (its pickles do not end)", path=path) from None
            if want >= MAX_HEADER_BYTES:
                raise CorruptFile(f"legacy torch file's pickles run past {MAX_HEADER_BYTES} bytes", path=path) \
                    from None
            want = min(size, want * 4, MAX_HEADER_BYTES)
    buf = bytes(buf)
    (m0, m1), (p0, p1), (s0, s1), (o0, o1), (k0, k1) = spans
    magic = plain_loads(buf[m0:m1], path, "magic number pickle")
    if magic != MAGIC_NUMBER:
        raise CorruptFile("not a torch file (a pickle without torch's magic number)", path=path)
    proto = plain_loads(buf[p0:p1], path, "protocol pickle")
    if proto != PROTOCOL_VERSION:
        raise UnsupportedLayout(f"legacy torch protocol {proto!r} (zckpt reads {PROTOCOL_VERSION})", path=path)
    info = plain_loads(buf[s0:s1], path, "sys info pickle")
    if not isinstance(info, dict) or info.get("little_endian") is not True:
        raise UnsupportedLayout("big-endian legacy torch files are not supported", path=path)
    keys = plain_loads(buf[k0:k1], path, "storage keys pickle")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CorruptFile("the storage keys pickle is not a list of keys", path=path)
    if len(set(keys)) != len(keys):
        raise CorruptFile("the storage keys list names a storage twice", path=path)
    if len(keys) * SIZE_FIELD > size - k1:
        raise CorruptFile(f"the file lists {len(keys)} storages but has room for {(size - k1) // SIZE_FIELD}",
                          path=path)
    return Header(path, size, bytes(buf[o0:o1]), keys, k1, len(buf), buf)


def _pickle_spans(buf: bytes, path: str | None) -> list[tuple[int, int]]:
    spans, pos = [], 0
    for i, what in enumerate(("magic number pickle", "protocol pickle", "sys info pickle", "object pickle",
                              "storage keys pickle")):
        if i < 3 and pos < len(buf) and not is_legacy(buf[pos:pos + 2]):
            raise CorruptFile(f"not a torch file ({what} missing at byte {pos})", path=path)
        end = scan(buf, pos, path, what)
        if i < 3 and end - pos > _SMALL_PICKLE:
            raise CorruptFile(f"{what} of {end - pos} bytes (torch writes a few dozen)", path=path)
        spans.append((pos, end))
        pos = end
    return spans


@dataclass(frozen=True)
class Place:
    """Where one storage's bytes are: ``nbytes`` at ``offset``, after its size field at ``offset - 8``."""

    key: str
    offset: int
    nbytes: int
    numel: int


def locate(f: BinaryIO, header: Header, storages: dict[str, tuple[int, int]]) -> tuple[dict[str, Place], int]:
    """Every storage's place, from ``storages`` (key -> (numel, element size) as the object pickle gives them).

    Checks that the keys list names exactly the object pickle's storages, that their sizes end the file exactly,
    and that each size field agrees with the pickle (reading the 8 bytes of each; fields inside the bytes already
    read come from those). Returns (key -> place, bytes read)."""
    path = header.path
    missing = [k for k in storages if k not in set(header.keys)]
    if missing:
        raise CorruptFile(f"storage {missing[0]} named in the pickle has no bytes (it is not in the keys list)",
                          path=path)
    extra = [k for k in header.keys if k not in storages]
    if extra:
        raise CorruptFile(f"the storage keys list names {extra[0]}, which the pickle does not use", path=path)
    places, pos = {}, header.data_start
    for key in header.keys:
        numel, itemsize = storages[key]
        nbytes = numel * itemsize
        places[key] = Place(key, pos + SIZE_FIELD, nbytes, numel)
        pos += SIZE_FIELD + nbytes
        if pos > header.size:
            break
    if pos != header.size:
        raise CorruptFile(f"its storages need {pos} bytes but the file has {header.size} (truncated, or a size in "
                          "the pickle is wrong)", path=path)
    read = 0
    for p in places.values():
        at = p.offset - SIZE_FIELD
        if at + SIZE_FIELD <= len(header.prefix):
            raw = header.prefix[at:at + SIZE_FIELD]
        else:
            f.seek(at)
            raw = f.read(SIZE_FIELD)
            read += len(raw)
        if len(raw) != SIZE_FIELD:
            raise CorruptFile(f"storage {p.key}: its size field at byte {at} is unreadable", path=path)
        (field_numel,) = struct.unpack("<q", raw)
        if field_numel != p.numel:
            raise CorruptFile(f"storage {p.key}: its size field says {field_numel} elements, the pickle {p.numel}",
                              path=path)
    return places, read


def size_fields(places: dict[str, Place]) -> list[tuple[int, bytes]]:
    """(offset, the 8 bytes expected there) of every storage's size field, in file order (``verify --deep``
    compares them with the bytes it streams)."""
    return sorted((p.offset - SIZE_FIELD, struct.pack("<q", p.numel)) for p in places.values())


class FieldCheck:
    """``on_chunk`` callback for a stream of a whole legacy file: compares the bytes at each storage's size field
    with :func:`size_fields` and counts what was read (``verify --deep``: a legacy file has no CRCs)."""

    def __init__(self, fields: list[tuple[int, bytes]]):
        self.fields, self.pos, self.first = fields, 0, 0
        self.seen = [bytearray() for _ in fields]

    def __call__(self, chunk) -> None:
        end = self.pos + len(chunk)
        for i in range(self.first, len(self.fields)):
            at, want = self.fields[i]
            if at >= end:
                break
            lo, hi = max(at, self.pos), min(at + len(want), end)
            if lo < hi:
                self.seen[i] += bytes(chunk[lo - self.pos:hi - self.pos])
        while self.first < len(self.fields) and self.fields[self.first][0] + SIZE_FIELD <= end:
            self.first += 1
        self.pos = end

    def problems(self, size: int) -> list[str]:
        bad = [f"size field at byte {at} reads {bytes(got).hex()} in the stream, {want.hex()} expected"
               for (at, want), got in zip(self.fields, self.seen) if bytes(got) != want]
        if self.pos != size:
            bad.append(f"{self.pos} of {size} bytes readable")
        return bad
