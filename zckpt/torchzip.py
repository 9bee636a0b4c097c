"""Writing torch ``.pt`` files by streaming, without torch.save and without the tensors in memory.

The output is the zip layout ``torch.save`` writes (and ``torch.load``, ``mmap=True`` included, reads)::

    <archive>/data.pkl  <archive>/.format_version  <archive>/.storage_alignment  <archive>/byteorder
    <archive>/data/0 ... data/N-1   (stored, 64-byte aligned)   <archive>/version   central directory

The object to save is ordinary Python data whose tensors are :class:`TensorOut` (dtype, shape and a list of
segments: input :class:`~zckpt.deepspeed.layout.Piece` s, cast pieces, zero fill or literal bytes). The pickle
names globals through :class:`GlobalRef` (``deepspeed.runtime.fp16.loss_scaler.LossScaler`` and friends), so
files DeepSpeed reads can be written where DeepSpeed is not installed. Sizes are known up front: every entry's
offset is fixed before any data moves, chunks are written in parallel with ``pwrite``, and CRCs are combined.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

from zckpt.deepspeed.layout import Piece
from zckpt.safeload import DTYPE_SIZES

ALIGN = 64
CHUNK_BYTES = 4 << 20
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


def enum_member(module: str, name: str, value: int) -> Reduce:
    return Reduce(GlobalRef(module, name), (int(value),))


@dataclass
class Fill:
    """``numel`` elements of value zero."""

    numel: int
    dtype: str

    @property
    def nbytes(self):
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass
class Cast:
    """Input pieces (``src_dtype``) converted to the tensor's dtype with torch's ``Tensor.to``."""

    pieces: list
    src_dtype: str

    @property
    def numel(self):
        return sum(p.numel for p in self.pieces)


@dataclass
class TensorOut:
    dtype: str
    shape: tuple
    segments: list = field(default_factory=list)  # Piece | Cast | Fill | bytes

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


def seg_numel(seg, dtype: str) -> int:
    if isinstance(seg, (bytes, bytearray)):
        return len(seg) // DTYPE_SIZES[dtype]
    return seg.numel


# ------------------------------------------------------------------------------------------- pickling

class _Pickler(pickle._Pickler):
    def __init__(self, file, tensors: list):
        super().__init__(file, protocol=2)
        self.tensors = tensors
        self.keys: dict[int, str] = {}

    dispatch = dict(pickle._Pickler.dispatch)

    def save_globalref(self, obj):
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[GlobalRef] = save_globalref

    def persistent_id(self, obj):
        if isinstance(obj, _StorageOut):
            return ("storage", GlobalRef("torch", STORAGE_CLASSES[obj.tensor.dtype]), obj.key, "cpu",
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
            size = Reduce(GlobalRef("torch", "Size"), (shape,))
            return (GlobalRef("torch._utils", "_rebuild_tensor_v2"),
                    (_StorageOut(obj, key), 0, size, stride, False, OrderedDict()))
        return NotImplemented


class _StorageOut:
    def __init__(self, tensor, key):
        self.tensor, self.key = tensor, key


def dumps(obj) -> tuple[bytes, list[TensorOut]]:
    buf = io.BytesIO()
    tensors: list[TensorOut] = []
    p = _Pickler(buf, tensors)
    p.dump(obj)
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
    entries: list[Entry]
    size: int = 0
    central: bytes = b""


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


def plan_archive(obj, archive_name: str) -> Archive:
    """Pickle ``obj`` and fix every entry's offsets; data is written later by :func:`write_archive`."""
    pkl, tensors = dumps(obj)
    for t in tensors:
        have = sum(seg_numel(s, t.dtype) for s in t.segments)
        if have != t.numel:
            raise ValueError(f"tensor segments hold {have} elements, shape {list(t.shape)} needs {t.numel}")
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
            e.crc = zlib.crc32(e.data)
        e.local_header = _local_header(e.name.encode(), e.size, e.crc, pos, zip64)
        e.data_offset = pos + len(e.local_header)
        pos = e.data_offset + e.size
    return Archive(entries, pos)


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

def _gf2_times(mat, vec):
    s = 0
    i = 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _gf2_square(mat):
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC of A+B from crc(A), crc(B) and len(B) (zlib's crc32_combine)."""
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]
    even = _gf2_square(odd)
    odd = _gf2_square(even)
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


# ---------------------------------------------------------------------------------------------- writing

def _chunks(t: TensorOut):
    """Split a tensor's segments into jobs of at most CHUNK_BYTES output bytes: (out_start_byte, [segments])."""
    size = DTYPE_SIZES[t.dtype]
    per = max(1, CHUNK_BYTES // max(size, 4))
    pos = 0
    cur, cur_n, cur_start = [], 0, 0
    for seg in t.segments:
        if isinstance(seg, (bytes, bytearray)):
            parts = [seg]
        else:
            n = seg_numel(seg, t.dtype)
            parts = [_sub(seg, s, min(per, n - s)) for s in range(0, n, per)] if n else []
        for part in parts:
            pn = seg_numel(part, t.dtype)
            if cur and cur_n + pn > per:
                yield cur_start, cur
                cur, cur_n, cur_start = [], 0, pos
            cur.append(part)
            cur_n += pn
            pos += pn * size
    if cur:
        yield cur_start, cur


def _sub(seg, start, n):
    from zckpt.merge import slice_pieces
    if isinstance(seg, Piece):
        return slice_pieces([seg], start, n)[0]
    if isinstance(seg, Cast):
        return Cast(slice_pieces(seg.pieces, start, n), seg.src_dtype)
    if isinstance(seg, Fill):
        return Fill(n, seg.dtype)
    raise TypeError(seg)


def _render(parts, dtype: str, worker) -> memoryview:
    """Bytes of a chunk's parts (converted to ``dtype``), in the worker's per-thread buffer."""
    size = DTYPE_SIZES[dtype]
    total = sum(seg_numel(p, dtype) for p in parts) * size
    out = worker.buffer(total, "out")
    view = memoryview(out)
    pos = 0
    for p in parts:
        if isinstance(p, (bytes, bytearray)):
            view[pos:pos + len(p)] = p
            pos += len(p)
        elif isinstance(p, Fill):
            out[pos:pos + p.nbytes] = 0
            pos += p.nbytes
        elif isinstance(p, Piece):
            if p.dtype != dtype:
                raise ValueError(f"piece of {p.dtype} in a {dtype} tensor")
            worker.reader.read_into(p, view[pos:pos + p.nbytes])
            pos += p.nbytes
        else:  # Cast
            data = worker.render(p.pieces, p.src_dtype, dtype, p.numel)
            out[pos:pos + data.nbytes] = data
            pos += data.nbytes
    return view[:pos]


def write_archive(archive: Archive, fd: int, pool=None, progress=None, worker=None) -> None:
    """Write a planned archive to ``fd`` (a new file), data chunks in parallel when ``pool`` is given."""
    from zckpt.merge import _pwrite_all, _Worker
    own = worker is None
    worker = worker or _Worker()
    try:
        jobs = []
        for idx, e in enumerate(archive.entries):
            if isinstance(e.data, TensorOut):
                for start, parts in _chunks(e.data):
                    jobs.append((idx, e.data_offset + start, parts, e.data.dtype))

        def run(job):
            idx, off, parts, dtype = job
            data = _render(parts, dtype, worker)
            _pwrite_all(fd, data, off)
            return idx, zlib.crc32(data), len(data)

        results = pool.map(run, jobs) if pool is not None else map(run, jobs)
        crcs: dict[int, tuple[int, int]] = {}
        for idx, crc, n in results:  # map keeps job order, so chunks combine in file order
            c, length = crcs.get(idx, (0, 0))
            crcs[idx] = (crc32_combine(c, crc, n) if length else crc, length + n)
            if progress:
                progress(n)
        for idx, e in enumerate(archive.entries):
            if isinstance(e.data, TensorOut):
                e.crc = crcs.get(idx, (0, 0))[0]
                zip64 = e.size >= 0xFFFFFFFF or e.header_offset >= 0xFFFFFFFF
                e.local_header = _local_header(e.name.encode(), e.size, e.crc, e.header_offset, zip64)
            else:
                _pwrite_all(fd, memoryview(e.data), e.data_offset)
            _pwrite_all(fd, memoryview(e.local_header), e.header_offset)
        _pwrite_all(fd, memoryview(_central(archive)), archive.size)
    finally:
        if own:
            worker.close()


def save(obj, path: str, archive_name: str | None = None, pool=None, progress=None, worker=None,
         reader=None) -> int:
    """Write ``obj`` (with :class:`TensorOut` leaves) as a torch file at ``path``; returns the file size.

    ``worker`` (a ``zckpt.merge._Worker``) or ``reader`` (a ``zckpt.tensors.Reader``) lets several files share
    open input descriptors."""
    if worker is None and reader is not None:
        from zckpt.merge import _Worker
        worker = _Worker()
        worker.reader.close()
        worker.reader = reader
    name = archive_name or os.path.splitext(os.path.basename(path))[0]
    archive = plan_archive(obj, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_archive(archive, fd, pool, progress, worker)
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------- merge's .bin shards

def layout_state_dict(shard) -> None:
    """Plan a merge shard (``zckpt.merge.ShardPlan``) as a torch state-dict file."""
    from zckpt.merge import _strip_ext
    sd = OrderedDict()
    for t in shard.tensors:
        segs = t.pieces if t.src_dtype == t.dtype else [Cast(t.pieces, t.src_dtype)]
        sd[t.name] = TensorOut(t.dtype, t.shape, list(segs))
    shard.archive = plan_archive(sd, _strip_ext(shard.filename))
    shard.size = shard.archive.size + len(_central(shard.archive))


def write_state_dict(shard, fd, pool, worker, progress) -> None:
    write_archive(shard.archive, fd, pool, progress, worker)
