"""Writing torch ``.pt`` files by streaming, without torch.save and without the tensors in memory.

The output is the zip layout ``torch.save`` writes (and ``torch.load``, ``mmap=True`` included, reads)::

    <archive>/data.pkl  <archive>/.format_version  <archive>/.storage_alignment  <archive>/byteorder
    <archive>/data/0 ... data/N-1   (stored, 64-byte aligned)   <archive>/version   central directory

The object to save is ordinary Python data whose tensors are :class:`TensorOut` (dtype, shape and a list of
segments: input :class:`~zckpt.state.model.Piece` s, cast pieces, zero fill or literal bytes). The pickle
names globals through :class:`GlobalRef` (``deepspeed.runtime.fp16.loss_scaler.LossScaler`` and friends), so
files DeepSpeed reads can be written where DeepSpeed is not installed. Sizes are known up front: every entry's
offset is fixed before any data moves, chunks are written in parallel with ``pwrite``, and CRCs are combined.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
import struct
import sys
import threading
import types
from collections import OrderedDict
from dataclasses import dataclass, field

from zckpt.engine.checked import MappedCrc
from zckpt.engine.executor import CHUNK_BYTES, Worker, chunks, pwrite_pieces, run_jobs, zeros_crc
from zckpt.engine.segments import Fill, Piece, Shaped, coalesce, seg_numel, source_segments
from zckpt.io.allocation import allocate
from zckpt.io.hashing import crc32, crc32_combine

ALIGN = 64
STORAGE_CLASSES = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage", "bfloat16": "BFloat16Storage",
    "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage", "int8": "CharStorage",
    "uint8": "ByteStorage", "bool": "BoolStorage",
}


class GlobalRef:
    """A reference to ``module.name`` emitted as a pickle GLOBAL without importing ``module``."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name
        self.__name__ = name

    def __call__(self, *a, **k):  # pickle requires reduce callables to be callable
        raise TypeError("GlobalRef is a pickle placeholder")

    def __eq__(self, other):
        return isinstance(other, GlobalRef) and (self.module, self.name) == (other.module, other.name)

    def __hash__(self):
        return hash((self.module, self.name))


class Reduce:
    """Pickles as ``func(*args)`` (then ``__setstate__``/``__dict__`` update with ``state`` when given)."""

    def __init__(self, func: GlobalRef, args: tuple = (), state=None):
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


def plain_object(module: str, name: str, state: dict) -> Reduce:
    """An instance of ``module.name`` restored without calling its ``__init__`` (protocol-0 style)."""
    return Reduce(GlobalRef("copyreg", "_reconstructor"),
                  (GlobalRef(module, name), GlobalRef("builtins", "object"), None), state)


@dataclass(frozen=True)
class NewObj:
    """Pickles as protocol 2's ``NEWOBJ`` of the class ``cls`` (no arguments), then ``BUILD`` with ``state``: what
    ``pickle`` writes for a plain instance (an ``argparse.Namespace``), the form ``torch.load(weights_only=True)``
    accepts for an allowed class (``copyreg._reconstructor`` is not allowed)."""

    cls: GlobalRef
    state: dict


def enum_member(module: str, name: str, value: int) -> Reduce:
    return Reduce(GlobalRef(module, name), (int(value),))


@dataclass
class TensorOut(Shaped):
    dtype: str
    shape: tuple
    segments: list = field(default_factory=list)  # Piece | Cast | Fill | bytes


# ------------------------------------------------------------------------------------------- pickling

class _Pickler(pickle._Pickler):
    def __init__(self, file, tensors: list):
        super().__init__(file, protocol=2)
        self.tensors = tensors
        self.keys: dict[int, str] = {}
        self.refs: dict[tuple[str, str], GlobalRef] = {}  # torch's names, one object each: written once, then memo

    def ref(self, module: str, name: str) -> GlobalRef:
        got = self.refs.get((module, name))
        if got is None:
            got = self.refs[(module, name)] = GlobalRef(module, name)
        return got

    dispatch = dict(pickle._Pickler.dispatch)

    def save_globalref(self, obj):
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[GlobalRef] = save_globalref

    def save_newobj(self, obj):
        self.save(obj.cls)
        self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
        self.memoize(obj)
        self.save(obj.state)
        self.write(pickle.BUILD)

    dispatch[NewObj] = save_newobj

    def persistent_id(self, obj):  # the C pickler asks this of every object it writes: kept short
        if type(obj) is _StorageOut:
            return ("storage", self.ref("torch", STORAGE_CLASSES[obj.tensor.dtype]), obj.key, "cpu",
                    obj.tensor.numel)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, TensorOut):
            key = self.keys.get(id(obj))
            if key is None:
                key = str(len(self.tensors))
                self.keys[id(obj)] = key
                self.tensors.append(obj)
            shape = tuple(int(d) for d in obj.shape)
            stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            size = Reduce(self.ref("torch", "Size"), (shape,))
            return (self.ref("torch._utils", "_rebuild_tensor_v2"),
                    (_StorageOut(obj, key), 0, size, stride, False, OrderedDict()))
        cls = type(obj)
        if cls.__module__.startswith("zckpt.") and cls not in _WRITTEN_AS_THEMSELVES:
            # a stand-in read through the allow-list (a dtype, an enum member, an inert object) names a class of
            # zckpt's: written as it is, the output would name zckpt instead of the framework's class
            from zckpt.errors import UnsupportedLayout
            raise UnsupportedLayout(f"a {cls.__name__} (zckpt's stand-in for a pickled object) reached the writer "
                                    "unconverted; the output would name a zckpt class, so nothing is written")
        return NotImplemented


class _StorageOut:
    def __init__(self, tensor, key):
        self.tensor, self.key = tensor, key


_WRITTEN_AS_THEMSELVES = (GlobalRef, Reduce, NewObj, _StorageOut)  # the pickler's own vocabulary


# The C pickler (pickle.Pickler) writes a GLOBAL only for an object it finds under that name in a module it imports,
# which would mean importing torch and DeepSpeed. :func:`dumps` names each GlobalRef of the object as an attribute of
# a module of zckpt's own (_PLACEHOLDERS), lets the C pickler write those, then puts the real names in their place:
# protocol 2 has no frames and the memo counts objects, not bytes, so a GLOBAL's text can change length. Each
# placeholder is written once (memoized after); if any appears other than exactly once in the bytes (a string in
# the data that holds one), the pure-Python pickler above does the whole object instead. 4-6x faster on the
# .metadata of a DCP checkpoint and on the planned objects of a resume.
_PLACEHOLDERS = types.ModuleType("zckpt.engine._pickle_globals")
sys.modules.setdefault(_PLACEHOLDERS.__name__, _PLACEHOLDERS)
_PLACEHOLDERS = sys.modules[_PLACEHOLDERS.__name__]
_PLACEHOLDER_LOCK = threading.Lock()
_PLACEHOLDER_TEXT = f"c{_PLACEHOLDERS.__name__}\n".encode()
_PLACEHOLDER_GLOBAL = re.compile(re.escape(_PLACEHOLDER_TEXT) + rb"(g[0-9]+)\n")


class _FastPlain(pickle.Pickler):
    """The C pickler with zckpt's vocabulary, for objects that hold no tensor (a DCP ``.metadata``): no
    ``persistent_id``, which the C pickler would ask of every object it writes (47,000 calls for the ``.metadata``
    of 651 items)."""

    def __init__(self, file, tensors: list):
        super().__init__(file, protocol=2)
        self.tensors = tensors
        self.keys: dict[int, str] = {}
        self.refs: dict[tuple[str, str], GlobalRef] = {}
        self.named: dict[int, tuple[bytes, GlobalRef]] = {}  # id -> (placeholder name, the GlobalRef, kept alive)

    ref = _Pickler.ref

    def reducer_override(self, obj):
        cls = type(obj)
        if cls is GlobalRef:
            got = self.named.get(id(obj))
            if got is None:
                got = (f"g{len(self.named)}".encode(), obj)
                self.named[id(obj)] = got
                setattr(_PLACEHOLDERS, got[0].decode(), obj)
            return got[0].decode()
        if cls is Reduce:
            return obj.__reduce__()
        if cls is NewObj:  # NEWOBJ of a class it cannot import: the pure-Python pickler writes the whole object
            raise pickle.PicklingError("NewObj")
        if type(self) is _FastPlain and isinstance(obj, TensorOut):
            raise ValueError("a tensor in an object pickled as holding none")
        return _Pickler.reducer_override(self, obj)


class _FastPickler(_FastPlain):
    """:class:`_FastPlain` that writes tensors: their storages as persistent ids."""

    persistent_id = _Pickler.persistent_id


def dumps(obj, plain: bool = False) -> tuple[bytes, list[TensorOut]]:
    """The protocol-2 pickle of ``obj`` (GlobalRef as GLOBALs, TensorOut as torch's rebuilt tensors with
    persistent storage ids) and the tensors in storage-key order. ``plain``: ``obj`` holds no tensor (a tensor
    met raises ValueError), and is pickled without asking each object for a persistent id."""
    tensors: list[TensorOut] = []
    buf = io.BytesIO()
    fast = (_FastPlain if plain else _FastPickler)(buf, tensors)
    try:
        with _PLACEHOLDER_LOCK:  # one pickle at a time owns the placeholder names and GlobalRef.__module__
            try:
                GlobalRef.__module__ = _PLACEHOLDERS.__name__  # where the C pickler's whichmodule() looks
                fast.dump(obj)
            finally:
                GlobalRef.__module__ = __name__
                for name, _ in fast.named.values():
                    delattr(_PLACEHOLDERS, name.decode())
        data = buf.getvalue()
        real = {name: b"c%s\n%s\n" % (ref.module.encode(), ref.name.encode()) for name, ref in fast.named.values()}
        found = _PLACEHOLDER_GLOBAL.findall(data)
        if (len(found) == len(real) == len(set(found)) == data.count(_PLACEHOLDER_TEXT)
                and set(found) == set(real)):
            return _PLACEHOLDER_GLOBAL.sub(lambda m: real[m.group(1)], data), tensors
    except pickle.PicklingError:
        pass
    tensors = []
    buf = io.BytesIO()
    _Pickler(buf, tensors).dump(obj)
    return buf.getvalue(), tensors


# ------------------------------------------------------------------------------------------- zip layout

@dataclass
class Entry:
    name: str
    size: int
    data: bytes | TensorOut
    header_offset: int = 0
    data_offset: int = 0
    crc: int = 0
    local_header: bytes = b""


@dataclass
class Archive:
    """A torch zip laid out by :func:`plan_archive`: the pickle and small records in memory, every entry's offset
    fixed; only the tensor bytes (and their CRCs) are left for :func:`write_archive`."""

    entries: list[Entry]
    size: int = 0  # where the central directory starts
    central: bytes = b""
    file_size: int = 0  # the whole file, central directory included

    @property
    def payload_bytes(self) -> int:
        """Tensor bytes: what :func:`write_archive` copies (and reports to ``progress``)."""
        return sum(e.size for e in self.entries if isinstance(e.data, TensorOut))


def _local_header(name: bytes, size: int, crc: int, offset_after_header_start: int, zip64: bool) -> bytes:
    extra = b""
    if zip64:
        extra += struct.pack("<HHQQ", 1, 16, size, size)
    fixed = 30 + len(name) + len(extra)
    pad = (-(offset_after_header_start + fixed + 4)) % ALIGN
    extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # torch's "FB" padding record
    csize = 0xFFFFFFFF if zip64 else size
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, 0, 0, 0x21, crc, csize, csize,
                       len(name), len(extra)) + name + extra


# A lone tensor's archive (each chunk of a DCP checkpoint is one) depends only on the archive's name, the dtype and
# the shape, but for its bytes and its random serialization id: the first one of a kind is planned whole, the
# others copy its entries (a DCP of 26 layers: 651 archives of about 20 kinds; planning them took 0.06 s of 0.1).
_LONE_TENSOR_LAYOUTS: dict[tuple, Archive] = {}
_LONE_TENSOR_LAYOUTS_MAX = 4096


def _check_numel(t: TensorOut) -> None:
    have = sum(seg_numel(s, t.dtype) for s in t.segments)
    if have != t.numel:
        raise ValueError(f"tensor segments hold {have} elements, shape {list(t.shape)} needs {t.numel}")


def plan_archive(obj, archive_name: str) -> Archive:
    """Pickle ``obj`` and fix every entry's offsets; data is written later by :func:`write_archive`."""
    if type(obj) is TensorOut:
        key = (archive_name, obj.dtype, tuple(int(d) for d in obj.shape))
        proto = _LONE_TENSOR_LAYOUTS.get(key)
        if proto is None:
            proto = _plan_archive(TensorOut(obj.dtype, key[2], [Fill(obj.numel, obj.dtype)]),
                                  archive_name)
            if len(_LONE_TENSOR_LAYOUTS) >= _LONE_TENSOR_LAYOUTS_MAX:
                _LONE_TENSOR_LAYOUTS.clear()
            _LONE_TENSOR_LAYOUTS[key] = proto
        _check_numel(obj)
        archive = Archive([Entry(e.name, e.size, obj if isinstance(e.data, TensorOut) else e.data, e.header_offset,
                                 e.data_offset, e.crc, e.local_header) for e in proto.entries],
                          proto.size, b"", proto.file_size)
        set_serialization_id(archive, os.urandom(10).hex().encode())
        return archive
    return _plan_archive(obj, archive_name)


def _plan_archive(obj, archive_name: str) -> Archive:
    pkl, tensors = dumps(obj)
    for t in tensors:
        _check_numel(t)
    pre = f"{archive_name}/"
    entries = [Entry(pre + "data.pkl", len(pkl), pkl), Entry(pre + ".format_version", 1, b"1"),
               Entry(pre + ".storage_alignment", 2, b"64"), Entry(pre + "byteorder", 6, b"little")]
    entries += [Entry(f"{pre}data/{i}", t.nbytes, t) for i, t in enumerate(tensors)]
    entries += [Entry(pre + "version", 2, b"3\n"),
                Entry(pre + ".data/serialization_id", 20, os.urandom(10).hex().encode())]
    pos = 0
    for e in entries:
        e.header_offset = pos
        zip64 = e.size >= 0xFFFFFFFF or pos >= 0xFFFFFFFF
        if isinstance(e.data, bytes):
            e.crc = crc32(e.data)
        e.local_header = _local_header(e.name.encode(), e.size, e.crc, pos, zip64)
        e.data_offset = pos + len(e.local_header)
        pos = e.data_offset + e.size
    archive = Archive(entries, pos)
    archive.file_size = pos + len(_central(archive))  # its length does not depend on the CRCs still to come
    return archive


def serialization_id(archive: Archive) -> bytes:
    """The archive's ``.data/serialization_id`` (random per file, as torch.save's)."""
    return next((e.data for e in archive.entries if e.name.endswith("/.data/serialization_id")), b"")


def set_serialization_id(archive: Archive, value: bytes) -> None:
    """Give the archive another serialization id of the same length (processes writing one file agree on it)."""
    for e in archive.entries:
        if e.name.endswith("/.data/serialization_id"):
            if len(value) != e.size:
                raise ValueError(f"a serialization id of {len(value)} bytes for an entry of {e.size}")
            e.data, e.crc = bytes(value), crc32(value)
            zip64 = e.size >= 0xFFFFFFFF or e.header_offset >= 0xFFFFFFFF
            e.local_header = _local_header(e.name.encode(), e.size, e.crc, e.header_offset, zip64)


def _central(archive: Archive) -> bytes:
    out = io.BytesIO()
    start = archive.size
    for e in archive.entries:
        name = e.name.encode()
        big = e.size >= 0xFFFFFFFF or e.header_offset >= 0xFFFFFFFF
        extra = struct.pack("<HHQQQ", 1, 24, e.size, e.size, e.header_offset) if big else b""
        sz = 0xFFFFFFFF if big else e.size
        off = 0xFFFFFFFF if big else e.header_offset
        out.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45 if big else 20, 45 if big else 20, 0, 0, 0, 0x21,
                              e.crc, sz, sz, len(name), len(extra), 0, 0, 0, 0, off) + name + extra)
    cd = out.getvalue()
    n = len(archive.entries)
    tail = b""
    if start + len(cd) >= 0xFFFFFFFF or n >= 0xFFFF:
        z64 = start + len(cd)
        tail += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, len(cd), start)
        tail += struct.pack("<IIQI", 0x07064B50, 0, z64, 1)
        tail += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    else:
        tail += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(cd), start, 0)
    return cd + tail


# ---------------------------------------------------------------------------------------------- CRC combine

# ---------------------------------------------------------------------------------------------- writing

class SourceMaps:
    """CRCs of input byte ranges: a whole stored entry of an input zip reuses the CRC in its central directory
    (resharding by a factor moves whole partitions); other ranges are checksummed on a read-only map of the
    page-cached file, without copying it out."""

    def __init__(self):
        import threading
        self._mapped = MappedCrc()
        self._entries_cache: dict[str, dict] = {}
        self._lock = threading.Lock()

    def _entries(self, path: str) -> dict[int, tuple[int, int]]:
        """data offset -> (size, CRC) of every stored entry of the input zip (its central directory)."""
        ent = self._entries_cache.get(path)
        if ent is None:
            ent = {}
            try:
                from zckpt.errors import ZckptError
                from zckpt.encoding.zipentries import read_file_entries
                ent = {e.data_offset: (e.size, e.crc) for e in read_file_entries(path).values() if e.size >= 1 << 20}
            except (OSError, ZckptError):
                ent = {}
            with self._lock:
                self._entries_cache[path] = ent
        return ent

    def crc(self, path: str, offset: int, n: int, crc: int) -> int:
        whole = self._entries(path).get(offset)
        if whole is not None and whole[0] == n:  # a whole input entry: its stored CRC, no need to read it
            return crc32_combine(crc, whole[1], n)
        return self._mapped.crc(path, offset, n, crc)

    def tensor_crc(self, t: TensorOut) -> int | None:
        """The CRC of a whole output tensor from metadata alone, when it is made of whole input entries and zero
        fill only (resharding by a factor of the world size); None otherwise."""
        crc = 0
        for seg in t.segments:
            if isinstance(seg, Fill):
                crc = zeros_crc(seg.nbytes, crc)
            elif isinstance(seg, Piece) and seg.dtype == t.dtype:
                whole = self._entries(seg.path).get(seg.offset)
                if whole is None or whole[0] != seg.nbytes:
                    return None
                crc = crc32_combine(crc, whole[1], seg.nbytes)
            else:
                return None
        return crc

    def close(self) -> None:
        self._mapped.close()


def archive_jobs(archive: Archive, maps: "SourceMaps", chunk_bytes: int = CHUNK_BYTES) -> tuple[list, dict]:
    """``(jobs, known)`` of a planned archive: jobs ``(entry index, file offset, parts, dtype)`` of every tensor
    entry's chunks in file order; ``known``: entry index -> CRC, for tensors made of whole input entries (their CRC
    comes from the inputs' central directories, nothing to compute)."""
    fast = hasattr(os, "copy_file_range")
    jobs, known = [], {}
    for idx, e in enumerate(archive.entries):
        if isinstance(e.data, TensorOut):
            e.data.segments = coalesce(e.data.segments)
            crc = maps.tensor_crc(e.data) if fast else None
            if crc is not None:
                known[idx] = crc
            for start, parts in chunks(e.data.segments, e.data.dtype, chunk_bytes):
                jobs.append((idx, e.data_offset + start, parts, e.data.dtype))
    return jobs, known


def archive_meta(archive: Archive, crcs: dict[int, int]) -> list[tuple[int, bytes]]:
    """Every byte of the archive that is not tensor data, as ``(file offset, bytes)``: local headers (with the
    tensor CRCs ``crcs``, entry index -> CRC-32), the small entries and the central directory."""
    out = []
    for idx, e in enumerate(archive.entries):
        if isinstance(e.data, TensorOut):
            e.crc = crcs.get(idx, 0)
            zip64 = e.size >= 0xFFFFFFFF or e.header_offset >= 0xFFFFFFFF
            e.local_header = _local_header(e.name.encode(), e.size, e.crc, e.header_offset, zip64)
        else:
            out.append((e.data_offset, e.data))
        out.append((e.header_offset, e.local_header))
    out.append((archive.size, _central(archive)))
    return out


def write_archive(archive: Archive, fd: int, pool=None, progress=None, worker=None,
                  maps: "SourceMaps | None" = None) -> None:
    """Write a planned archive to ``fd`` (a new file), chunks in parallel when ``pool`` is given.

    Same-dtype local pieces move in-kernel (``copy_file_range``); a tensor made of whole input entries gets its
    CRC from the inputs' central directories, other CRCs are computed on read-only maps of the page-cached source;
    conversions (:class:`Cast`) and remote pieces go through the worker's buffers (remote ranges fetched ahead,
    :func:`zckpt.engine.executor.run_jobs`). Chunk CRCs are combined with :func:`crc32_combine`, in file order."""
    allocate(fd, archive.size + len(_central(archive)))
    write_archives([(archive, 0)], fd, pool, progress, worker, maps)


def write_archives(placed: list[tuple[Archive, int]], fd: int, pool=None, progress=None, worker=None,
                   maps: "SourceMaps | None" = None) -> None:
    """Write planned archives, each at its byte offset ``base`` of ``fd`` (a file already at its final size),
    as :func:`write_archive` does for one: every archive's chunks go through one ``pool.map``, so many small
    archives (DCP's one zip per tensor chunk in a ``.distcp`` file) copy as fast as one large one. Offsets inside
    an archive stay relative to its own start (what a reader of the byte range ``[base, base + file_size)`` sees)."""
    own_worker, own_maps = worker is None, maps is None
    worker = worker or Worker()
    maps = maps or SourceMaps()
    try:
        jobs, known = [], {}
        for a, (archive, base) in enumerate(placed):
            ajobs, aknown = archive_jobs(archive, maps)
            jobs += [((a, idx), base + off, parts, dtype) for idx, off, parts, dtype in ajobs]
            known.update({(a, idx): crc for idx, crc in aknown.items()})

        def run(job):
            key, off, parts, dtype = job
            crc, n = worker.write(fd, off, parts, dtype, crc_of=maps.crc, want_crc=key not in known)
            return key, crc, n

        crcs: dict[tuple[int, int], tuple[int, int]] = {}
        for key, crc, n in run_jobs(pool, run, jobs, worker, parts_of=lambda j: j[2]):  # job order: file order
            c, length = crcs.get(key, (0, 0))
            crcs[key] = (crc32_combine(c, crc, n) if length else crc, length + n)
            if progress:
                progress(n)
        final: dict[int, dict[int, int]] = {}
        for (a, idx), (c, _) in crcs.items():
            final.setdefault(a, {})[idx] = c
        for (a, idx), c in known.items():
            final.setdefault(a, {})[idx] = c
        for a, (archive, base) in enumerate(placed):
            pwrite_pieces(fd, archive_meta(archive, final.get(a, {})), base)
    finally:
        if own_worker:
            worker.close()
        if own_maps:
            maps.close()


def save(obj, path: str, archive_name: str | None = None, pool=None, progress=None, worker=None,
         reader=None, fsync: bool = False, maps: "SourceMaps | None" = None) -> int:
    """Write ``obj`` (with :class:`TensorOut` leaves) as a torch file at ``path``; returns the file size.

    ``worker`` (a :class:`zckpt.engine.Worker`) or ``reader`` (a ``zckpt.encoding.tensors.Reader``) and ``maps`` let several
    files share open inputs; ``fsync=True`` flushes the file before returning (or see :func:`fsync_all`)."""
    if worker is None and reader is not None:
        worker = Worker(reader=reader)
    return write_planned(plan_archive(obj, archive_name_of(path, archive_name)), path, pool, progress, worker,
                         fsync, maps)


def archive_name_of(path: str, archive_name: str | None = None) -> str:
    """The folder inside the zip: ``torch.save``'s default, the file name without its extension."""
    return archive_name or os.path.splitext(os.path.basename(path))[0]


def write_planned(archive: Archive, path: str, pool=None, progress=None, worker=None, fsync: bool = False,
                  maps: "SourceMaps | None" = None) -> int:
    """Write an archive planned by :func:`plan_archive` as the new file ``path`` (nothing is pickled again);
    returns the file size, ``archive.file_size``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # less the umask, as open() gives
    try:
        write_archive(archive, fd, pool, progress, worker, maps)
        if fsync:
            os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def fsync_all(paths: list[str], pool=None) -> None:
    """Flush finished files to disk, concurrently (the kernel has been writing them back meanwhile)."""
    def one(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    list(pool.map(one, paths)) if pool is not None else [one(p) for p in paths]


# ---------------------------------------------------------------------------------- merge's .bin shards

def layout_state_dict(shard) -> None:
    """Plan a merge shard (``zckpt.hf.writer.ShardPlan``) as a torch state-dict file."""
    sd = OrderedDict()
    for t in shard.tensors:
        sd[t.name] = TensorOut(t.dtype, t.shape, source_segments(t.pieces, t.src_dtype, t.dtype))
    shard.archive = plan_archive(sd, shard.filename.rsplit(".", 1)[0])
    shard.size = shard.archive.size + len(_central(shard.archive))


def step_tensor(step, where: str, path: str) -> TensorOut:
    """Adam's step as torch keeps it (a float32 0-d tensor), refused when float32 cannot hold it exactly."""
    from zckpt.errors import UnsupportedLayout
    value = float(step)
    packed = struct.pack("<f", value)
    if struct.unpack("<f", packed)[0] != value:
        raise UnsupportedLayout(f"{where}: step {step} is not exact as torch's float32 step", path=path)
    return TensorOut("float32", (), [packed])
