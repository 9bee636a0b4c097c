"""PyTorch Distributed Checkpoint (DCP) metadata, read without running pickle code, and checked.

A DCP checkpoint written by ``FileSystemWriter`` (torch 2.x, ``torch/distributed/checkpoint/filesystem.py``)::

    <dir>/.metadata          pickle of metadata.Metadata, written last (temp file + rename): DCP's commit marker
        state_dict_metadata  flat key -> TensorStorageMetadata(properties(dtype, ...), size,
                                                               chunks=[ChunkStorageMetadata(offsets, sizes)])
                                       or BytesStorageMetadata()
        storage_data         MetadataIndex(fqn, offsets) -> _StorageInfo(relative_path, offset, length)
        planner_data         flat key -> its path in the nested state dict, e.g. "optim.state.w.exp_avg" ->
                             ("optim", "state", "w", "exp_avg") (keys may hold dots themselves)
    <dir>/__{rank}_{n}.distcp   data: each item is a small torch.save zip at [offset, offset+length) (a tensor
                             chunk, or a pickled non-tensor value: BYTE_IO), one after another

:func:`read_metadata` unpickles ``.metadata`` through :func:`zckpt.encoding.safeload.load_plain`: DCP's dataclasses,
``torch.Size``, the dtypes and ``torch.strided`` map to inert stand-ins; any other global is refused. It then checks
everything a reader relies on, refusing in one line: a dtype zckpt does not know, a size over :data:`MAX_NUMEL`,
a chunk outside its tensor, chunks that overlap or leave part of the tensor uncovered (:func:`cut`: chunks that
are the cells of a grid, as tensor parallelism cuts them, tile it by construction; any others are cut into runs
and checked by :func:`chunk_runs`, at most :data:`MAX_RUNS` of them), a storage entry missing, in a file outside
the folder, past the end of its file, or stored through a transform (compression, encryption) zckpt cannot read as
raw bytes.
"""

from __future__ import annotations

import bisect
import math
import operator
import re
from dataclasses import dataclass, field
from itertools import chain, cycle

from zckpt.errors import CorruptFile, UnsupportedLayout
from zckpt.encoding import safeload

MAX_NUMEL = 1 << 44  # elements in one tensor: far beyond any real model, far below an integer overflow
MAX_RUNS = 1 << 20  # contiguous runs one tensor's chunks may cut it into
MAX_DIMS = 64
_DATA_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")

_M = "torch.distributed.checkpoint.metadata."
_DCP_CLASSES = [_M + n for n in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                                 "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")]
_DCP_CLASSES += ["torch.distributed.checkpoint.filesystem._StorageInfo"]
# Megatron-Core's torch_dist save keeps its save plans in planner_data (read as inert stand-ins, not used)
_DCP_CLASSES += ["torch.distributed.checkpoint.planner." + n for n in ("SavePlan", "WriteItem", "WriteItemType",
                                                                         "TensorWriteData")]


def _stand_in(qual: str) -> type:
    return type(qual.rsplit(".", 1)[-1], (safeload.Inert,), {"_qualname": qual})


def _layout(name):
    if name != "torch.strided":
        raise UnsupportedLayout(f"tensor layout {_show(name, 40)} (only torch.strided is read)")
    return "strided"


def _path(*parts):
    return "/".join(str(p) for p in parts)


EXTRA_GLOBALS = {q: _stand_in(q) for q in _DCP_CLASSES}
_CLASSES = {q.rsplit(".", 1)[-1]: cls for q, cls in EXTRA_GLOBALS.items()}  # "ChunkStorageMetadata" -> stand-in
EXTRA_GLOBALS.update({"torch.serialization._get_layout": _layout, "pathlib.PosixPath": _path,
                      "pathlib.WindowsPath": _path, "pathlib.Path": _path})


# ---------------------------------------------------------------------------------------------- the model

@dataclass(unsafe_hash=True, slots=True)
class Chunk:
    """One saved rectangle of a tensor: ``offsets``/``sizes`` per dim; its torch zip is ``length`` bytes at
    ``offset`` of the data file ``file`` (a name inside the checkpoint folder). Never changed once read (hashed by
    its fields; not ``frozen``: a frozen dataclass is built 7x slower, and a checkpoint has 10**5-10**6 of them)."""

    offsets: tuple
    sizes: tuple
    file: str
    offset: int
    length: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass
class TensorEntry:
    key: str  # the flat DCP key
    dtype: str
    shape: tuple
    chunks: list[Chunk]
    # (chunk sizes, item length) -> the zip layout its items were read with at open (zckpt.encoding.distcp.Layout),
    # checked against each item's own zip directory when its bytes are read
    layouts: dict = field(default_factory=dict, compare=False, repr=False)
    runs: list | None = field(default=None, compare=False, repr=False)  # chunk_runs(self), kept by parse
    # (runs, their flat starts): what runs_in bisects (a stacked tensor is taken in many ranges)
    starts: tuple | None = field(default=None, compare=False, repr=False)
    # chunks cut on an inner dim that form a grid (tensor parallelism): the runs are made per range asked for
    # (:func:`runs_in`), not kept, since they are one per row (a 70B model's row-parallel weight at TP 8: 5*10**6)
    grid: "Grid | None" = field(default=None, compare=False, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class BytesEntry:
    key: str
    file: str
    offset: int
    length: int


@dataclass
class DcpMetadata:
    tensors: dict[str, TensorEntry]
    values: dict[str, BytesEntry]  # non-tensor items (param groups, scalars), each a pickled torch.save zip
    paths: dict[str, tuple]  # flat key -> path in the nested state dict (planner_data); {} when not saved
    version: str | None = None
    files: list[str] = field(default_factory=list)  # the data files the entries name, sorted

    def path_of(self, key: str) -> tuple:
        return self.paths.get(key) or (key,)


# ---------------------------------------------------------------------------------------------- reading

def _show(value, width: int = 60) -> str:
    """``value`` for a message, never walked: read without :func:`~zckpt.encoding.pickles.check_nesting`, an
    unchecked object may nest 10**6 levels or share one list 10**6 times (its ``repr`` would never end)."""
    if type(value) in (str, bytes):
        return repr(value[:width])
    if type(value) in (int, float, bool, type(None)):
        return repr(value)[:width]
    if type(value) in (tuple, list) and len(value) <= MAX_DIMS and all(type(v) in (int, str) for v in value):
        return repr(value)[:width]
    return f"a {type(value).__name__}"


def _fields(obj, cls: str, path: str) -> dict:
    """The state of ``obj``, a stand-in of DCP's class ``cls`` (its class checked, not a name it claims)."""
    if type(obj) is not _CLASSES.get(cls):
        raise CorruptFile(f"DCP metadata: expected {cls}, found {type(obj).__name__}", path=path)
    return obj.__dict__


def _ints(value, what: str, path: str) -> tuple:
    if type(value) is tuple and len(value) <= MAX_DIMS and set(map(type, value)) <= _INT and \
            (not value or min(value) >= 0):
        return value  # the common case, checked in C
    if not isinstance(value, (tuple, list)) or len(value) > MAX_DIMS or \
            not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise CorruptFile(f"DCP metadata: {what} is not a list of non-negative integers: {_show(value)}", path=path)
    return tuple(value)


_INT = {int}


def _dtype(props, key: str, path: str) -> str:
    state = props.__dict__.get("_state") if isinstance(props, safeload.Inert) else None
    dtype = state[0] if isinstance(state, tuple) and state else _fields(props, "TensorProperties", path).get("dtype")
    if not isinstance(dtype, safeload.TorchDtype) or str(dtype) not in safeload.DTYPE_SIZES:
        raise UnsupportedLayout(f"DCP metadata: '{key}' has dtype {_show(dtype, 40)}, which zckpt does not read",
                                path=path)
    return str(dtype)


def _storage_index(storage_data, path: str) -> dict:
    """fqn -> {offsets or None: (file, offset, length)}, every entry checked (by name first: a tensor's 10**5
    chunks are then looked up by their offsets alone, no (name, offsets) tuple made and hashed per chunk)."""
    if not isinstance(storage_data, dict):
        raise CorruptFile("DCP metadata: storage_data is not a dict (not written by FileSystemWriter)", path=path)
    out, names = {}, set()  # names: the file names checked already (a few, named by every entry)
    index_cls, info_cls = _CLASSES["MetadataIndex"], _CLASSES["_StorageInfo"]
    for idx, info in storage_data.items():
        if type(idx) is not index_cls or type(info) is not info_cls:  # (the checks of _fields, inline: 10**6 entries)
            _fields(idx, "MetadataIndex", path), _fields(info, "_StorageInfo", path)
        i, s = idx.__dict__, info.__dict__
        fqn, offs = i.get("fqn"), i.get("offset")
        name, off, length = s.get("relative_path"), s.get("offset"), s.get("length")
        # (the types first: nothing unchecked is hashed or printed)
        if type(fqn) is not str or type(name) is not str or (name not in names and (not _DATA_NAME.match(name)
                                                                                  or name in (".", ".."))):
            raise CorruptFile(f"DCP metadata: storage entry of {_show(fqn)} names the file {_show(name)}, "
                              "not a file of the checkpoint folder", path=path)
        if offs is not None and not (type(offs) is tuple and len(offs) <= MAX_DIMS and set(map(type, offs)) <= _INT
                                     and (not offs or min(offs) >= 0)):
            offs = _ints(offs, f"the storage offset of '{fqn}'", path)
        if type(off) is not int or type(length) is not int or off < 0 or length < 0:
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (off, length)):
                raise CorruptFile(f"DCP metadata: storage entry of '{fqn}' has offset {_show(off)}, length "
                                  f"{_show(length)}", path=path)
        names.add(name)
        if s.get("transform_descriptors"):
            raise UnsupportedLayout(f"DCP item '{fqn}' is stored through transforms {_show(s['transform_descriptors'])}"
                                    " (compression or another extension); zckpt reads raw torch.save items only",
                                    path=path)
        sub = out.get(fqn)
        if sub is None:
            sub = out[fqn] = {}
        sub[offs] = (name, off, length)
    return out


_STATE = operator.attrgetter("__dict__")
_GET_OFFSETS, _GET_SIZES = operator.methodcaller("get", "offsets"), operator.methodcaller("get", "sizes")


def _fast_chunks(key: str, raw: list, shape: tuple, index: dict, file_sizes: dict | None, seen: set) -> list | None:
    """The chunks of one tensor checked at once (each check one C loop over all of them: 10**6 chunks), or None
    when any check fails: the chunk-by-chunk loop of :func:`parse` then finds and names the first bad one. The same
    checks: each a chunk object of its own (in no other list), offsets and sizes of the tensor's rank, non-negative
    integers, inside its size, no two at one offset, each with its storage entry inside its file."""
    n, ndim = len(raw), len(shape)
    if not n:
        return []
    if set(map(type, raw)) != {_CLASSES["ChunkStorageMetadata"]}:
        return None
    ids = set(map(id, raw))
    if len(ids) != n or not ids.isdisjoint(seen):
        return None
    states = list(map(_STATE, raw))
    offs, sizes = list(map(_GET_OFFSETS, states)), list(map(_GET_SIZES, states))
    if set(map(type, offs)) != {tuple} or set(map(type, sizes)) != {tuple} or set(map(len, offs)) != {ndim} or \
            set(map(len, sizes)) != {ndim}:
        return None
    if ndim:
        flat_offs, flat_sizes = list(chain.from_iterable(offs)), list(chain.from_iterable(sizes))
        if not (set(map(type, flat_offs)) <= _INT and set(map(type, flat_sizes)) <= _INT) or \
                min(flat_offs) < 0 or min(flat_sizes) < 0 or \
                not all(map(operator.le, map(operator.add, flat_offs, flat_sizes), cycle(shape))):
            return None
    if len(set(offs)) != n:
        return None
    wheres = list(map(index.get(key, {}).get, offs))
    if None in wheres:
        return None
    files, at, length = zip(*wheres)
    if file_sizes is not None:
        ends = list(map(file_sizes.get, files))
        if None in ends or not all(map(operator.le, map(operator.add, at, length), ends)):
            return None
    seen |= ids
    return list(map(Chunk, offs, sizes, files, at, length))


def parse(obj, path: str, file_sizes: dict[str, int] | None = None) -> DcpMetadata:
    """Check an unpickled ``Metadata`` stand-in and turn it into a :class:`DcpMetadata`. ``file_sizes`` (data
    file name -> bytes): when given, every item must lie inside its file."""
    md = _fields(obj, "Metadata", path)
    sdm = md.get("state_dict_metadata")
    if not isinstance(sdm, dict):
        raise CorruptFile("DCP metadata: state_dict_metadata is not a dict", path=path)
    index = _storage_index(md.get("storage_data"), path)
    tensors, values = {}, {}
    seen: set[int] = set()  # ids of the chunk objects read (all alive in ``obj`` while this runs)
    chunk_cls = _CLASSES["ChunkStorageMetadata"]
    for key, entry in sdm.items():
        if not isinstance(key, str):
            raise CorruptFile(f"DCP metadata: key {_show(key)} is not a string", path=path)
        if type(entry) is _CLASSES["BytesStorageMetadata"]:
            where = index.get(key, {}).get(None)
            if where is None:
                raise CorruptFile(f"DCP metadata: no storage entry for the value '{key}'", path=path)
            if file_sizes is not None:
                _inside(where, file_sizes, path)
            values[key] = BytesEntry(key, *where)
            continue
        t = _fields(entry, "TensorStorageMetadata", path)
        shape = _ints(t.get("size"), f"the size of '{key}'", path)
        if math.prod(shape) > MAX_NUMEL:
            raise CorruptFile(f"DCP metadata: '{key}' claims {math.prod(shape)} elements (size {list(shape)})",
                              path=path)
        raw = t.get("chunks")
        if not isinstance(raw, list):
            raise CorruptFile(f"DCP metadata: the chunks of '{key}' are not a list", path=path)
        chunks = _fast_chunks(key, raw, shape, index, file_sizes, seen)
        if chunks is None:  # (a check failed: found and named chunk by chunk)
            chunks, starts, ndim = [], set(), len(shape)
            for c in raw:
                if id(c) in seen:  # one object listed twice (a crafted list of memo references): overlapping chunks
                    raise CorruptFile(f"DCP metadata: the chunks of '{key}' overlap (one chunk object listed twice)",
                                      path=path)
                seen.add(id(c))
                cf = c.__dict__ if type(c) is chunk_cls else _fields(c, "ChunkStorageMetadata", path)
                offs, sizes = cf.get("offsets"), cf.get("sizes")
                if not (type(offs) is tuple and type(sizes) is tuple and len(offs) == ndim and len(sizes) == ndim
                        and set(map(type, offs + sizes)) <= _INT and (not ndim or min(offs + sizes) >= 0)):
                    offs = _ints(offs, f"a chunk offset of '{key}'", path)  # (the common case checked above, in C)
                    sizes = _ints(sizes, f"a chunk size of '{key}'", path)
                if len(offs) != ndim or len(sizes) != ndim or \
                        (ndim and not all(map(operator.le, map(operator.add, offs, sizes), shape))):
                    raise CorruptFile(f"DCP metadata: a chunk of '{key}' (offsets {list(offs)}, sizes {list(sizes)}) "
                                      f"lies outside its size {list(shape)}", path=path)
                if offs in starts:  # two chunks at one offset: refused here, before 10**7 of them are cut into runs
                    raise CorruptFile(f"DCP metadata: the chunks of '{key}' overlap (two start at {list(offs)})",
                                      path=path)
                starts.add(offs)
                where = index.get(key, {}).get(offs)
                if where is None:
                    raise CorruptFile(f"DCP metadata: no storage entry for the chunk of '{key}' at {list(offs)}",
                                      path=path)
                if file_sizes is not None:
                    _inside(where, file_sizes, path)
                chunks.append(Chunk(offs, sizes, *where))
        te = TensorEntry(key, _dtype(t.get("properties"), key, path), shape, chunks)
        cut(te, path)  # the chunks cover the tensor exactly once (kept: readers cut by them)
        tensors[key] = te
    planner = md.get("planner_data")
    paths = {}
    if isinstance(planner, dict):
        for k, v in planner.items():  # (a path is a few names long: one tuple shared by 10**6 keys is not walked)
            if type(k) is str and type(v) is tuple and len(v) <= MAX_DIMS and set(map(type, v)) <= _STR:
                paths[k] = v  # the common case, checked in C
            elif isinstance(k, str) and isinstance(v, tuple) and len(v) <= MAX_DIMS and \
                    all(isinstance(p, (str, int)) for p in v):
                paths[k] = tuple(str(p) for p in v)
    version = md.get("version") if isinstance(md.get("version"), str) else None
    files = sorted({c.file for te in tensors.values() for c in te.chunks} | {v.file for v in values.values()})
    return DcpMetadata(tensors, values, paths, version, files)


_STR = {str}


def _inside(where: tuple, file_sizes: dict, path: str) -> None:
    """Refuse an item ``(file, offset, length)`` outside the data files ``file_sizes`` names."""
    name, offset, length = where
    size = file_sizes.get(name)
    if size is None:
        raise CorruptFile(f"DCP metadata names the data file {name}, which is not in the folder", path=path)
    if offset + length > size:
        raise CorruptFile(f"DCP metadata: an item of {name} at bytes [{offset}, {offset + length}) lies past its "
                          f"end ({size} bytes)", path=path)


def chunk_runs(te: TensorEntry, path: str | None = None) -> list[tuple[int, Chunk, int, int]]:
    """The chunks of ``te`` as runs of the row-major flat tensor: (flat start, chunk, start inside the chunk's own
    row-major elements, length), sorted by flat start. A chunk cut on dim 0 is one run; a chunk cut on an inner
    dim is one run per row of the dims before the cut. Refused unless the runs tile the tensor exactly."""
    shape, runs, count = te.shape, [], 0
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    for c in te.chunks:
        if c.numel == 0:
            continue
        k = len(shape) - 1  # the outermost dim from which the chunk spans whole rows of the tensor
        while k > 0 and c.sizes[k] == shape[k]:
            k -= 1
        length = c.sizes[k] * strides[k] if shape else 1
        if k <= 0:  # cut on dim 0 (or a scalar): one run (FSDP2's Shard(0), the common case)
            count += 1
            runs.append((c.offsets[0] * strides[0] if shape else 0, c, 0, length))
            continue
        outer = c.sizes[:k]
        count += math.prod(outer)
        if count > MAX_RUNS:
            raise UnsupportedLayout(f"DCP metadata: the chunks of '{te.key}' cut it into more than {MAX_RUNS} runs",
                                    path=path)
        cstrides = [math.prod(c.sizes[d + 1:]) for d in range(len(c.sizes))]
        for flat in range(math.prod(outer)):
            idx, rem = [], flat
            for d in reversed(outer):
                idx.append(rem % d)
                rem //= d
            idx.reverse()
            start = sum((c.offsets[d] + i) * strides[d] for d, i in enumerate(idx)) + \
                (c.offsets[k] * strides[k] if shape else 0)
            local = sum(i * cstrides[d] for d, i in enumerate(idx))
            runs.append((start, c, local, length))
    runs.sort(key=_first)
    at = 0
    for start, _, _, length in runs:
        if start != at:
            what = "overlap" if start < at else f"leave elements [{at}, {start}) uncovered"
            raise CorruptFile(f"DCP metadata: the chunks of '{te.key}' {what} (size {list(shape)})", path=path)
        at += length
    if at != te.numel:
        raise CorruptFile(f"DCP metadata: the chunks of '{te.key}' cover {at} of its {te.numel} elements", path=path)
    return runs


_first = operator.itemgetter(0)


class Grid:
    """Chunks that are exactly the cells of a grid (every dim cut at the same points for all of them: tensor and
    pipeline parallelism, stacked layers), cut on an inner dim ``k``: the tensor's row-major elements are ``rows``
    rows (the dims before ``k``), each one run per cell along ``k``. Its runs are made for the range asked for."""

    __slots__ = ("k", "points", "cells", "row", "along", "widths", "tail", "_rows")

    def __init__(self, k, points, cells, shape):
        self.k, self.points, self.cells = k, points, cells
        step = math.prod(shape[k + 1:])  # elements per index of dim k
        self.row = shape[k] * step  # elements per row (dims k.. whole)
        self.along = [p * step for p in points[k]]  # each cell's flat start inside a row
        self.widths = [(e - p) * step for p, e in zip(points[k], points[k][1:] + [shape[k]])]
        self.tail = (0,) * (len(shape) - k - 1)  # the dims after k: whole in every chunk
        self._rows: dict = {}  # cell prefix (dims before k) -> the chunks along k

    def runs(self, shape, start: int, end: int):
        """(flat start, chunk, start inside the chunk, length) of the runs meeting ``[start, end)``, in order. A row's
        runs lie at the same row of their chunks (a grid: the same cells before ``k``), so each run starts at that
        row times its own length."""
        k, points, row, along, widths = self.k, self.points, self.row, self.along, self.widths
        out = []
        if end <= start:
            return out
        for r in range(start // row, (end - 1) // row + 1):
            idx, prefix, chunks, pos = self._row(shape, r)
            base = r * row
            for j, c in enumerate(chunks):
                flat, n = base + along[j], widths[j]
                if flat + n <= start:
                    continue
                if flat >= end:
                    break
                out.append((flat, c, pos * n, n))
        return out

    def _row(self, shape, r: int):
        """Row ``r``'s index over the dims before ``k``, its cell prefix, the chunks along ``k`` and the row inside
        them (row-major over their dims before ``k``)."""
        k, points = self.k, self.points
        idx, rem = [0] * k, r
        for d in range(k - 1, -1, -1):
            rem, idx[d] = divmod(rem, shape[d])
        prefix = tuple(bisect.bisect_right(points[d], idx[d]) - 1 for d in range(k))
        chunks = self._rows.get(prefix)
        if chunks is None:
            chunks = self._rows[prefix] = [self.cells[prefix + (j,) + self.tail] for j in range(len(self.along))]
        first, pos = chunks[0], 0
        for d in range(k):
            pos = pos * first.sizes[d] + idx[d] - first.offsets[d]
        return idx, prefix, chunks, pos

    def blocks(self, shape, r0: int, r1: int):
        """(first row, rows, chunks along ``k``, the first row inside them) of the whole rows ``[r0, r1)``, a block
        per run of rows in the same cells: inside a block the rows are consecutive rows of the same chunks, so
        row ``r0 + i`` of a block is the chunks' row ``pos + i`` (every run ``pos + i`` times its own length)."""
        k, points = self.k, self.points
        r = r0
        while r < r1:
            idx, prefix, chunks, pos = self._row(shape, r)
            cell = prefix[k - 1]  # the rows left in this cell of dim k - 1 (the dims before it stay)
            edge = points[k - 1][cell + 1] if cell + 1 < len(points[k - 1]) else shape[k - 1]
            count = min(edge - idx[k - 1], r1 - r)
            yield r, count, chunks, pos
            r += count


def _grid(te: TensorEntry) -> Grid | None:
    """``te``'s chunks as a :class:`Grid` cut on an inner dim, or None (cut on dim 0 only, a scalar, an empty
    chunk, or not a grid: then :func:`chunk_runs` cuts and checks them). Checked a dim at a time, each check one C
    loop over all the chunks (10**5 per tensor in a 10**6-chunk save)."""
    shape, chunks = te.shape, te.chunks
    if len(shape) < 2 or not chunks:
        return None
    by_dim = list(zip(*map(_OFFSETS, chunks)))  # each dim's chunk offsets, in chunk order
    sizes = list(zip(*map(_SIZES, chunks)))
    if any(0 in s for s in sizes):
        return None
    points = [sorted(set(offs)) for offs in by_dim]
    k = max((d for d in range(len(shape)) if len(points[d]) > 1), default=0)
    if k == 0 or math.prod(len(p) for p in points) != len(chunks) or any(p[0] != 0 for p in points):
        return None  # (chunk_runs names what is uncovered or doubled)
    cell = []
    for d, pts in enumerate(points):
        at = list(map({p: i for i, p in enumerate(pts)}.__getitem__, by_dim[d]))
        if list(map(operator.add, by_dim[d], sizes[d])) != list(map((pts[1:] + [shape[d]]).__getitem__, at)):
            return None  # a chunk spanning more than its cell: not a grid (chunk_runs decides)
        cell.append(at)
    cells = dict(zip(zip(*cell), chunks))
    if len(cells) != len(chunks):
        return None
    # the cells' sizes sum to each dim's size and no two chunks share a cell: they tile the tensor exactly
    return Grid(k, points, cells, shape)


_OFFSETS, _SIZES = operator.attrgetter("offsets"), operator.attrgetter("sizes")


def cut(te: TensorEntry, path: str | None = None) -> None:
    """Check that ``te``'s chunks tile it exactly once and keep how readers cut it: a :class:`Grid` cut on an inner
    dim (runs made per range), else the runs of :func:`chunk_runs`."""
    te.grid = _grid(te)
    te.runs = None if te.grid is not None else chunk_runs(te, path)


def runs_in(te: TensorEntry, start: int, end: int, path: str | None = None) -> list[tuple[int, Chunk, int, int]]:
    """(flat start, chunk, start inside the chunk's row-major elements, length) of the runs of ``te`` meeting the
    flat range ``[start, end)``, in order (each run whole: the caller clips)."""
    if te.runs is None and te.grid is None:
        cut(te, path)
    if te.grid is not None:
        return te.grid.runs(te.shape, start, end)
    runs = te.runs
    first = 0
    if start:  # the runs tile the tensor in order: bisect (a stacked tensor taken a layer at a time)
        if te.starts is None or te.starts[0] is not runs:
            te.starts = (runs, [r[0] for r in runs])
        first = max(0, bisect.bisect_right(te.starts[1], start) - 1)
    out = []
    for i in range(first, len(runs)):
        r = runs[i]
        if r[0] >= end:
            break
        if r[0] + r[3] > start:
            out.append(r)
    return out


def read_metadata(data: bytes, path: str, file_sizes: dict[str, int] | None = None) -> DcpMetadata:
    """``.metadata``'s bytes -> a checked :class:`DcpMetadata` (see :func:`parse`); no code from the pickle runs."""
    with safeload.gc_paused():  # millions of live objects, no garbage
        # no check_nesting walk (5 s of 10**6 chunks): parse reads a fixed shape and keeps only what it checked
        obj = safeload.load_plain(data, path, EXTRA_GLOBALS, nesting=False)
        try:
            md = parse(obj, path, file_sizes)
            del obj  # freed here, with the collector still paused: its next pass sees only what parse kept
            return md
        except (CorruptFile, UnsupportedLayout):
            raise
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as exc:
            detail = "" if isinstance(exc, KeyError) else f": {exc}"  # (a KeyError's text is its key's repr)
            raise CorruptFile(f"DCP metadata of an unexpected shape ({type(exc).__name__}{detail})"[:240],
                              path=path) from None
