"""The items of a DCP checkpoint's ``.distcp`` data files, whatever wrote them (``dcp.save``, Megatron-Core's
``torch_dist``): each item is a small torch.save zip at ``[offset, offset + length)`` of its data file, named by
``.metadata`` (:mod:`zckpt.encoding.dcpmeta`).

- :class:`Items`: loads items through :func:`zckpt.encoding.safeload.load` on that byte window, one open file per
  data file: a chunk becomes a ``LazyTensor`` whose offsets are absolute in its data file (no tensor byte read), a
  bytes item the (allow-listed) value it pickles. A chunk is placed by its :class:`Layout` (where the tensor's
  bytes lie in the item's zip: the same for every item of one dtype, chunk size and item length), learned from the
  first such item read whole; the rest are not read at open, so a checkpoint opens in a bounded number of reads
  per data file, not one per item. When their bytes are read, each item's own zip directory is read for its
  CRC-32s (:func:`crc_entries_of`) and must match the layout it was placed by, or the read is refused (the
  first item of a layout in a file as any zip, the others as its twins: two reads each, :class:`_Twin`);
- :func:`flat_runs`: a whole tensor's row-major flat form as byte runs (``zckpt.state.model.dcp_pieces``: any
  range of it as pieces, from the runs of :func:`zckpt.encoding.dcpmeta.runs_in`);
- :func:`items_by_file` / :func:`item_entries`: every item of a checkpoint by data file, and the zip entries (with
  their CRC-32s) of items, for the input check and ``verify --deep``.
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass

from zckpt.encoding import dcpmeta, safeload
from zckpt.encoding.safeload import DTYPE_SIZES, LazyTensor, StorageRef
from zckpt.encoding.zipentries import (CENTRAL, END, IN_ZIP64_16, IN_ZIP64_32, LOCAL_HEADER, Window, ZipEntry,
                                      read_entries)
from zckpt.errors import CorruptFile
from zckpt.io import storage

SMALL_ITEM = 64 << 10  # an item up to this size (a value, a step) is read whole, in one request, and parsed in memory
GAP = 1 << 20  # small items of one file at most this far apart are fetched in one read (on S3: one request instead
#                of two costs about this many bytes)
LOCAL_GAP = 64 << 10  # ... of a local file (a disk reads 64 KiB in about the time of one small read)
SPAN = 32 << 20  # ... within reads of at most this many bytes
TWIN_BYTES = 8 << 20  # the bytes kept per data file by the input check's twins (distinct layouts, item lengths)
_SCALAR = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i"}


@dataclass(frozen=True)
class Layout:
    """Where a tensor item's bytes lie inside its torch zip: the same for every item of one (dtype, chunk sizes,
    item length) one writer saved (the zip's entries and pickle depend on nothing else). Learned from one item at
    open (``sample``: ``FILE@OFFSET``); each item read later is checked against it (:meth:`mismatch`)."""

    key: str  # the storage's zip entry: <archive>/data/<key>
    data_offset: int  # the storage's first byte, from the item's start
    nbytes: int
    storage_offset: int
    shape: tuple
    stride: tuple
    entries: tuple  # (name, header offset, data offset, size) of every zip entry, from the item's start
    pickle_crc: int  # data.pkl's CRC-32: the same pickle is the same dtype, shape, stride and storage key
    sample: str
    contiguous: bool = True  # row-major: the chunk's elements are one byte range

    def mismatch(self, found: dict[str, ZipEntry]) -> str | None:
        """What differs between this layout and an item's zip entries (offsets from the item's start), or None."""
        got = {e.name: (e.header_offset, e.data_offset, e.size) for e in found.values()}
        want = {name: (h, d, n) for name, h, d, n in self.entries}
        if set(got) != set(want):
            return f"its zip holds entries {sorted(got)[:4]}, not {sorted(want)[:4]}"
        for name, (_h, d, n) in want.items():
            if got[name] != want[name]:
                return (f"its entry {name.split('/', 1)[-1]} is {got[name][2]} bytes at byte {got[name][1]}, not "
                        f"{n} at {d}")
        pkl = next(e for e in found.values() if e.name.endswith("/data.pkl"))
        if pkl.crc != self.pickle_crc:
            return "its data.pkl differs (another dtype, stride or storage)"
        return None


class Items:
    """Loads DCP items (each a torch.save zip inside a data file of ``folder``) through :func:`safeload.load`,
    one open file per data file. A tensor chunk's zip is read once per layout (:class:`Layout`: its dtype, chunk
    sizes and item length), not once per item: a checkpoint opens in a few reads per data file and per layout."""

    def __init__(self, folder: str, opts: dict | None):
        self.folder, self.opts, self.files = folder, opts, {}
        self.layouts: dict[tuple, Layout] = {}
        self._paths: dict[str, str] = {}
        self._small: dict[tuple[str, int, int], bytes] = {}  # (file, offset, length) -> the item, fetched ahead
        self.reads = 0  # reads of item bytes (a test counts them)

    def prefetch(self, items) -> None:
        """Fetch the small items ``(file, offset, length)`` the open reads whole (steps, param-group values) in as few
        reads as their places allow: per data file, items at most :data:`GAP` bytes apart (:data:`LOCAL_GAP` in a
        local file) in one read of at most :data:`SPAN` bytes (a checkpoint's steps and values lie together in few
        files: a few reads, not one per parameter; items further apart cost a read each, as before, never more
        bytes between two of them than one read would cost). Each item's bytes are checked when parsed, as if read
        alone."""
        by_file: dict[str, list] = {}
        for name, offset, length in items:
            if length <= SMALL_ITEM:
                by_file.setdefault(name, []).append((offset, length))
        for name, spans in by_file.items():
            spans.sort()
            gap = GAP if storage.is_url(self.path(name)) else LOCAL_GAP
            run = [spans[0]]
            for span in spans[1:] + [None]:
                if span is not None and span[0] - (run[-1][0] + run[-1][1]) <= gap \
                        and span[0] + span[1] - run[0][0] <= SPAN and span[0] >= run[-1][0]:
                    run.append(span)
                    continue
                lo = run[0][0]
                hi = max(o + n for o, n in run)
                data = self._bytes(name, lo, hi - lo, ahead=True)
                for o, n in run:
                    self._small[(name, o, n)] = data[o - lo:o - lo + n]
                run = [span]

    def path(self, name: str) -> str:
        """The data file ``name``'s path (joined once per file)."""
        p = self._paths.get(name)
        if p is None:
            p = self._paths[name] = storage.join(self.folder, name)
        return p

    def _file(self, name: str, path: str):
        f = self.files.get(name)
        if f is None:
            f = self.files[name] = open(path, "rb") if not storage.is_url(path) else storage.open_input(path, self.opts)
        return f

    def _bytes(self, name: str, offset: int, length: int, ahead: bool = False) -> bytes:
        """The item's bytes, in one read (one ranged GET on an object store), or fetched ahead (:meth:`prefetch`)."""
        if not ahead:
            kept = self._small.pop((name, offset, length), None)
            if kept is not None:
                return kept
        self.reads += 1
        path = self.path(name)
        if storage.is_url(path):
            data = storage.read_range(path, offset, length, self.opts)
        else:
            f = self._file(name, path)
            f.seek(offset)
            data = f.read(length)
        if len(data) != length:
            what = "DCP items" if ahead else "DCP item"
            raise CorruptFile(f"{what} at byte {offset}: the file ends {length - len(data)} bytes before its end "
                              "(truncated?)", path=path)
        return data

    def _window(self, name: str, offset: int, length: int):
        """The item as a file of its own: in memory (one read) when small, else a window on the data file."""
        if length <= SMALL_ITEM:
            return io.BytesIO(self._bytes(name, offset, length))
        return Window(self._file(name, self.path(name)), offset, length)

    def load(self, name: str, offset: int, length: int, memo: dict | None = None):
        """The item's object through the allow-list. ``memo`` (bytes -> object): a small item whose bytes equal
        one already parsed is that object (a save's many identical objects, e.g. Megatron's extra states, parsed
        once; the caller must not change it)."""
        path = self.path(name)
        if memo is not None and length <= SMALL_ITEM:
            data = self._bytes(name, offset, length)
            if data not in memo:
                memo[data] = safeload.load(path, opener=lambda _p: io.BytesIO(data))
            return memo[data]
        window = self._window(name, offset, length)
        return safeload.load(path, opener=lambda _p: window)

    def _chunk(self, te: dcpmeta.TensorEntry, c: dcpmeta.Chunk) -> tuple[LazyTensor, dict[str, ZipEntry], bytes]:
        """The chunk's item read through the allow-list: (LazyTensor, offsets from the item's start; its zip
        entries; its bytes when small, else b"")."""
        path = self.path(c.file)
        data = self._bytes(c.file, c.offset, c.length) if c.length <= SMALL_ITEM else b""

        def window():
            return io.BytesIO(data) if data else Window(self._file(c.file, path), c.offset, c.length)
        t = safeload.load(path, opener=lambda _p: window())
        if not isinstance(t, LazyTensor):
            raise CorruptFile(f"DCP item of '{te.key}' at byte {c.offset} is not a tensor", path=path)
        if t.dtype != te.dtype or tuple(t.shape) != tuple(c.sizes):
            raise CorruptFile(f"DCP chunk of '{te.key}' at byte {c.offset} holds {t.dtype} {list(t.shape)}, the "
                              f"metadata says {te.dtype} {list(c.sizes)}", path=path)
        return t, read_entries(window(), c.length, path), data

    def _learn(self, te: dcpmeta.TensorEntry, c: dcpmeta.Chunk) -> Layout:
        t, entries, _ = self._chunk(te, c)
        return self._layout_of(t, entries, c)

    @staticmethod
    def _layout_of(t: LazyTensor, entries: dict[str, ZipEntry], c: dcpmeta.Chunk) -> Layout:
        pkl = next(e for e in entries.values() if e.name.endswith("/data.pkl"))
        s = t.storage
        return Layout(s.key, s.offset, s.nbytes, t.storage_offset, tuple(t.shape), tuple(t.stride),
                      tuple(sorted((e.name, e.header_offset, e.data_offset, e.size) for e in entries.values())),
                      pkl.crc, f"{c.file}@{c.offset}", t.is_contiguous())

    def layout(self, te: dcpmeta.TensorEntry, c: dcpmeta.Chunk) -> Layout:
        """The chunk's layout (the first item of that layout is read; the others are checked against it when their
        bytes are read: :func:`crc_entries_of`)."""
        sizes = (tuple(c.sizes), c.length)
        lay = te.layouts.get(sizes)
        if lay is None:
            lay = self.layouts.get((te.dtype,) + sizes)
            if lay is None:
                lay = self.layouts[(te.dtype,) + sizes] = self._learn(te, c)
            te.layouts[sizes] = lay
        return lay

    def tensor(self, te: dcpmeta.TensorEntry, c: dcpmeta.Chunk) -> LazyTensor:
        """The chunk as a LazyTensor whose offsets are absolute in its data file, placed by its layout."""
        lay = self.layout(te, c)
        return LazyTensor(StorageRef(self.path(c.file), lay.key, te.dtype, c.offset + lay.data_offset, lay.nbytes),
                          lay.storage_offset, lay.shape, lay.stride, te.dtype)

    def scalar(self, te: dcpmeta.TensorEntry, c: dcpmeta.Chunk):
        """A one-element chunk (Adam's step) read whole, its zip and the CRC-32 of its bytes checked: (the chunk as
        a LazyTensor with absolute offsets, its value). The first of each (dtype, size, item length) is parsed
        whole (its pickle through the allow-list); the others are read by its :class:`Layout` once their own zip
        directory is found laid out as it (the same entries at the same places, the same data.pkl CRC-32)."""
        path = self.path(c.file)
        if c.length > SMALL_ITEM:
            raise CorruptFile(f"DCP item of '{te.key}' at byte {c.offset}: {c.length} bytes for one element",
                              path=path)
        lay = self.layouts.get(("scalar", te.dtype, tuple(c.sizes), c.length))
        if lay is not None:
            data = self._bytes(c.file, c.offset, c.length)
            entries = read_entries(io.BytesIO(data), c.length, path)
            why = lay.mismatch(entries)
            if why is not None:
                raise CorruptFile(f"DCP item of '{te.key}' at byte {c.offset}: {why}, unlike the item of its dtype, "
                                  f"size and length read whole ({lay.sample})", path=path)
            for e in entries.values():  # every byte read is checked: its pickle's too
                if zlib.crc32(data[e.data_offset:e.data_offset + e.size]) != e.crc:
                    raise CorruptFile(f"DCP item of '{te.key}' at byte {c.offset}: its entry "
                                      f"{e.name.split('/', 1)[-1]} does not match the CRC-32 its zip records: the "
                                      "file is damaged", path=path)
            t = LazyTensor(StorageRef(path, lay.key, te.dtype, lay.data_offset, lay.nbytes), lay.storage_offset,
                           lay.shape, lay.stride, te.dtype)
        else:
            t, entries, data = self._chunk(te, c)
            self.layouts[("scalar", te.dtype, tuple(c.sizes), c.length)] = self._layout_of(t, entries, c)
        s = t.storage
        e = next((e for e in entries.values() if e.data_offset == s.offset), None)
        if e is None or zlib.crc32(data[e.data_offset:e.data_offset + e.size]) != e.crc:
            raise CorruptFile(f"DCP item of '{te.key}' at byte {c.offset}: its bytes do not match the CRC-32 its "
                              "zip records: the file is damaged", path=path)
        at = s.offset + t.storage_offset * t.itemsize
        if t.numel != 1 or te.dtype not in _SCALAR or at + t.itemsize > s.offset + s.nbytes:
            raise CorruptFile(f"'{te.key}': expected a scalar, got {te.dtype} {list(t.shape)}", path=path)
        value = struct.unpack_from(_SCALAR[te.dtype], data, at)[0]
        return (LazyTensor(StorageRef(path, s.key, s.dtype, s.offset + c.offset, s.nbytes), t.storage_offset,
                           t.shape, t.stride, t.dtype), int(value) if float(value).is_integer() else value)

    def close(self):
        """Close the open data files (a later read opens its file again)."""
        for f in self.files.values():
            f.close()
        self.files.clear()


def _joiner(folder: str):
    """``join(name)``: ``storage.join(folder, name)``, once per name."""
    paths: dict[str, str] = {}

    def join(name: str) -> str:
        p = paths.get(name)
        if p is None:
            p = paths[name] = storage.join(folder, name)
        return p
    return join


def flat_runs(items: Items, te: dcpmeta.TensorEntry, path: str) -> list[tuple[str, int, int]] | None:
    """``te``'s row-major flat elements as ``(data file path, byte offset, elements)`` runs, in order, straight from
    its chunks' layouts (no LazyTensor per chunk: what a reader of whole tensors needs); None when a chunk's
    elements are not one byte range (then ``zckpt.state.model.dcp_pieces``)."""
    size = DTYPE_SIZES[te.dtype]
    out = []
    for _flat, c, local, n in dcpmeta.runs_in(te, 0, te.numel, path):
        lay = items.layout(te, c)
        if not lay.contiguous:
            return None
        out.append((items.path(c.file), c.offset + lay.data_offset + (lay.storage_offset + local) * size, n))
    return out


def items_by_file(md: dcpmeta.DcpMetadata, folder: str) -> dict[str, list[tuple[int, int, str]]]:
    """Every item of ``md`` by data file path (in ``folder``): (offset, length, key), sorted."""
    out: dict[str, list] = {}
    join = _joiner(folder)
    for te in md.tensors.values():
        for c in te.chunks:
            out.setdefault(join(c.file), []).append((c.offset, c.length, te.key))
    for v in md.values.values():
        out.setdefault(join(v.file), []).append((v.offset, v.length, v.key))
    return {k: sorted(v) for k, v in sorted(out.items())}


def item_entries(path: str, spans: list[tuple[int, int]], storage_options: dict | None = None,
                 layouts: dict | None = None) -> list[ZipEntry]:
    """The entries of the torch zips at ``(offset, length)`` ``spans`` of a DCP data file, at their offsets in it.
    ``layouts``: {item offset: (:class:`Layout`, key)} of the items read through a layout at open: each such item's
    zip must be laid out as that layout says, or :class:`CorruptFile` names the file and the item.

    The first item of each layout in the file is read as any zip (:func:`read_entries`: every record and local
    header, a dozen small reads); the others in two reads, the bytes before and after their tensor's, which must
    be those of the first byte for byte but for the CRC-32 fields and the per-save id (:class:`_Twin`); anything
    else is read as any zip, so the result and the refusals are the same either way."""
    out = []
    twins: dict = {}  # id(layout), or an item length where no layout placed it -> its twin (None: none)
    kept = 0  # bytes the twins hold (at most about TWIN_BYTES: then the other kinds are read as any zip)
    opener = storage.open_ranges if storage.is_url(path) else storage.open_input
    with opener(path, storage_options) as f:
        for offset, length in spans:
            laid = (layouts or {}).get(offset)
            kin = id(laid[0]) if laid is not None else length
            twin = twins.get(kin)
            found = twin.entries(f, offset) if twin is not None else None
            if found is None:
                found = read_entries(Window(f, offset, length), length, path)
                why = laid[0].mismatch(found) if laid is not None else None
                if why is not None:
                    lay, key = laid
                    raise CorruptFile(f"DCP item of '{key}' at byte {offset}: {why}, unlike the item of its dtype, "
                                      f"chunk size and length it was read by at open ({lay.sample}): refused, its "
                                      "bytes would be taken from the wrong place", path=path,
                                      hint="the file was rewritten by another writer or is damaged; copy it again "
                                           "from where it was saved")
                if kin not in twins:
                    twin = _Twin.of(f, offset, length, laid[0] if laid is not None else None, found) \
                        if kept < TWIN_BYTES else None
                    kept += len(twin.head) + len(twin.tail) if twin is not None else 0
                    twins[kin] = twin
            out += [ZipEntry(e.name, offset + e.header_offset, offset + e.data_offset, e.size, e.crc)
                    for e in found.values()]
    return out


class _Twin:
    """The bytes around the tensor of an item checked by :func:`read_entries` (``head``: before its first byte,
    ``tail``: after its last), and the ranges in them that may differ between items of one layout: the CRC-32
    fields of the tensor's entry and of the ``.data/serialization_id`` entry (its directory record's, and its
    local header's or, torch's, its data descriptor's), and that id's payload (one per item). An item whose bytes
    equal these elsewhere has the same zip, entry for entry; the two CRC-32s are read from its own fields, which
    must agree as :func:`read_entries` requires."""

    _ID = "/.data/serialization_id"

    def __init__(self, head: bytes, gap: int, tail: bytes, crc_at: list, same: list, entries: dict[str, ZipEntry]):
        self.head, self.gap, self.tail, self.crc_at, self.same, self._entries = head, gap, tail, crc_at, same, entries

    @classmethod
    def of(cls, f, offset: int, length: int, lay: Layout | None, found: dict[str, ZipEntry]) -> _Twin | None:
        """From an item whose zip ``found`` was checked, placed by ``lay`` (None: an item read whole at open, a
        step or a value: its one storage entry's bytes may differ, or none); None where its zip is not of the
        plain shape this reads (zip64 records, a comment, a record inside the tensor's bytes, several storages):
        its twins are then read as any zip."""
        if lay is not None:
            lo, hi = lay.data_offset, lay.data_offset + lay.nbytes
        else:
            data = [e for e in found.values() if "/data/" in e.name]
            if len(data) > 1:
                return None
            lo, hi = (data[0].data_offset, data[0].data_offset + data[0].size) if data else (0, 0)
        if lo + length - hi > SMALL_ITEM:  # (zip records of torch's size: never megabytes read per item)
            return None
        f.seek(offset)
        head = f.read(lo)
        f.seek(offset + hi)
        tail = f.read(length - hi)
        if len(head) != lo or len(tail) != length - hi or len(tail) < END.size:
            return None

        def unpack(st: struct.Struct, pos: int):  # a record of the item outside the tensor's bytes, or None
            if pos + st.size <= lo:
                return st.unpack_from(head, pos)
            return st.unpack_from(tail, pos - hi) if pos >= hi and pos + st.size <= length else None

        end = unpack(END, length - END.size)
        if end is None or end[0] != b"PK\x05\x06" or end[7] != 0 or end[4] != len(found) \
                or IN_ZIP64_16 in end[1:5] or IN_ZIP64_32 in end[5:7]:  # (zip64: read as any zip)
            return None
        records, pos = {}, end[6]
        for _ in range(end[4]):
            rec = unpack(CENTRAL, pos)
            if rec is None or rec[0] != b"PK\x01\x02" or pos < hi:
                return None
            records[tail[pos - hi + 46:pos - hi + 46 + rec[10]].decode("utf-8", "replace")] = pos
            pos += 46 + rec[10] + rec[11] + rec[12]
        crc_at, varies = [], []
        ordered = sorted(found.values(), key=lambda e: e.header_offset)
        for i, e in enumerate(ordered):
            local = unpack(LOCAL_HEADER, e.header_offset)
            if e.name not in records or local is None:
                return None
            if e.data_offset != lo and not e.name.endswith(cls._ID):
                continue  # (its bytes, CRC-32 fields included, must equal this item's)
            if local[2] & 0x08:  # its CRC-32 in the data descriptor after its bytes (torch), with or without PK78
                gap = (ordered[i + 1].header_offset if i + 1 < len(ordered) else end[6]) - e.data_offset - e.size
                first = e.data_offset + e.size + (4 if gap in (16, 24) else 0)
            else:  # in its local header (zckpt's writer)
                first = e.header_offset + 14
            crc_at.append((e.name, _at(first, lo, hi), _at(records[e.name] + 16, lo, hi)))
            varies += [(first, 4), (records[e.name] + 16, 4)]
            if e.data_offset != lo:  # the per-item id's bytes
                varies.append((e.data_offset, e.size))
        if any(a < hi and a + n > lo for a, n in varies):
            return None
        cut, pos = [], 0  # the ranges compared, as (0: head or 1: tail, start, end) in that buffer
        for a, n in sorted(varies) + [(length, 0)]:
            if a > pos:
                if pos < lo:
                    cut.append((0, pos, min(a, lo)))
                if a > hi:
                    cut.append((1, max(pos, hi) - hi, a - hi))
            pos = max(pos, a + n)
        return cls(head, hi - lo, tail, crc_at, cut, found)

    def entries(self, f, offset: int) -> dict[str, ZipEntry] | None:
        """The zip entries of the item at ``offset`` (offsets from its start), or None where it is not this one's
        twin (then read as any zip: the same result, or the refusal that names what differs)."""
        f.seek(offset)
        head = f.read(len(self.head))
        f.seek(offset + len(self.head) + self.gap)
        tail = f.read(len(self.tail))
        if len(head) != len(self.head) or len(tail) != len(self.tail):
            return None
        bufs, mine = (head, tail), (self.head, self.tail)
        for which, a, b in self.same:
            if bufs[which][a:b] != mine[which][a:b]:
                return None
        out = dict(self._entries)  # the same entries, in the same order; the varying ones' CRC-32s are the item's
        for name, (lw, la), (cw, ca) in self.crc_at:
            crc = bufs[cw][ca:ca + 4]
            if bufs[lw][la:la + 4] != crc:
                return None
            e = self._entries[name]
            out[name] = ZipEntry(name, e.header_offset, e.data_offset, e.size, int.from_bytes(crc, "little"))
        return out


def _at(pos: int, lo: int, hi: int) -> tuple[int, int]:
    """A position of an item outside its tensor's bytes ``[lo, hi)`` as (0: head, 1: tail, offset in it)."""
    return (0, pos) if pos < lo else (1, pos - hi)


def layouts_by_file(md: dcpmeta.DcpMetadata, folder: str) -> dict[str, dict[int, tuple[Layout, str]]]:
    """{data file path: {item offset: (layout, key)}} of the chunks read through a :class:`Layout` at open."""
    out: dict[str, dict] = {}
    join = _joiner(folder)
    for te in md.tensors.values():
        if te.layouts:
            for c in te.chunks:
                lay = te.layouts.get((tuple(c.sizes), c.length))
                if lay is not None:
                    out.setdefault(join(c.file), {})[c.offset] = (lay, te.key)
    return out


def crc_entries_of(md: dcpmeta.DcpMetadata, folder: str, storage_options: dict | None = None):
    """``entries(path)``: the zip entries of the items of each data file of ``md`` (a file's directories are read
    on first use), each item placed through a layout at open checked against it: the hook
    :mod:`zckpt.state.checksums` asks a format for."""
    by_file = items_by_file(md, folder)
    laid: dict | None = None

    def entries(path: str) -> list[ZipEntry]:
        nonlocal laid
        if laid is None:
            laid = layouts_by_file(md, folder)
        return item_entries(path, [(off, n) for off, n, _ in by_file.get(path, ())], storage_options, laid.get(path))
    return entries
