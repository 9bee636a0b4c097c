"""The layout of a PyTorch Distributed Checkpoint (DCP), planned without torch and without tensors in memory: shared
by every format written as DCP files (FSDP2's ``dcp.save``: :mod:`zckpt.dcp.writer`; Megatron-Core's
``torch_dist``: :mod:`zckpt.megatron.writer`), which is why it lives below the formats.

The input is a state dict as ``dcp.save`` would receive it, with plain Python values and
:class:`~zckpt.engine.torchzip.TensorOut` leaves (dtype, shape and segments: byte ranges of the source files), plus
:class:`SameAs` leaves for a tensor that is another key's tensor (tied weights). The output is what torch 2.13's
``FileSystemWriter`` writes (``torch/distributed/checkpoint/filesystem.py``, ``metadata.py``)::

    OUT/__0_0.distcp  OUT/__1_0.distcp ...   each a run of small torch.save zips, one per tensor chunk (a block of
                                             rows, dim 0) or per non-tensor value (its pickle in a zip), back to back
    OUT/.metadata                            a pickle of torch's ``Metadata`` dataclass, written last: the commit

Keys are flattened as torch's ``flatten_state_dict`` does (``_traverse.py``): nested dicts join with ``.``, a list
is walked by index when it holds dicts, lists or tensors and is one value otherwise; a tuple is always one value.
``.metadata`` maps every key to ``TensorStorageMetadata(properties, size, chunks)`` or ``BytesStorageMetadata``;
``storage_data`` maps ``MetadataIndex(key, chunk offsets)`` to ``_StorageInfo(file, byte offset, length)``;
``planner_data`` maps each key to its path in the nested dict. The pickle is written by zckpt's own pickler
(:func:`zckpt.engine.torchzip.dumps`) with torch's class names as globals, the objects ``dcp.load`` unpickles.

Every archive's offsets are fixed before a byte moves; :func:`zckpt.engine.run.write_dcp_part` writes each
``.distcp`` file with one :func:`zckpt.engine.torchzip.write_archives` (``copy_file_range`` for same-dtype local
pieces, chunks in parallel).
"""

from __future__ import annotations

import math
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from zckpt.engine import torchzip
from zckpt.engine.segments import slice_segments
from zckpt.engine.torchzip import Archive, GlobalRef, Reduce, TensorOut
from zckpt.errors import UnsupportedLayout
from zckpt.encoding.safeload import DTYPE_SIZES, TorchDevice, TorchDtype

METADATA = ".metadata"
DCP_VERSION = "1.0.0"  # filesystem.CURRENT_DCP_VERSION in torch 2.13
CHUNK_BYTES = 256 << 20  # rows of one tensor per chunk (what one loading rank reads whole)
FILE_BYTES = 1 << 30  # a .distcp file is closed once it holds this much (enough files for every rank of a launcher to
# write its own: one file takes only ~3.5-4 GB/s whatever its writers; docs/benchmarks.md, "At the copy limit")
_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_TORCH_DTYPES = {"float64": "float64", "float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                 "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8", "uint8": "uint8",
                 "bool": "bool"}


@dataclass(frozen=True)
class SameAs:
    """A tensor that is the tensor at another path (a tied weight): its chunks point at the same bytes."""

    path: tuple


@dataclass(frozen=True)
class Whole:
    """A non-tensor value stored as one DCP item whatever it holds, never walked (a Megatron ``ShardedObject``'s
    ``[data]``, which megatron-core ``torch.save``s whole)."""

    value: object


@dataclass
class ChunkedOut:
    """A tensor stored as exactly the chunks given, each ``(offsets, sizes, TensorOut)`` (Megatron-Core's
    ``dp_reshardable`` buckets: one chunk per parameter fragment or gap of a data-parallel rank)."""

    dtype: str
    shape: tuple
    chunks: list


@dataclass
class Chunk:
    """One stored piece of a key: a tensor chunk (``offsets``/``sizes``) or a whole non-tensor value."""

    offsets: tuple | None
    sizes: tuple | None
    archive: Archive
    file: str = ""
    offset: int = 0

    @property
    def length(self) -> int:
        return self.archive.file_size


@dataclass
class Item:
    key: str  # the flattened key, e.g. "optim.state.emb.weight.exp_avg"
    path: tuple  # its path in the nested state dict
    dtype: str | None  # None: a non-tensor value (DCP's BYTE_IO)
    shape: tuple | None
    chunks: list[Chunk] = field(default_factory=list)
    alias_of: str | None = None

    @property
    def payload_bytes(self) -> int:
        return 0 if self.alias_of or self.dtype is None else math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass
class DcpFile:
    name: str
    placed: list[tuple[Archive, int]] = field(default_factory=list)
    size: int = 0


@dataclass
class DcpPlan:
    items: list[Item]
    files: list[DcpFile]
    metadata: bytes
    commit_name = METADATA  # the file ``metadata`` is written as, last (DCP's commit)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files) + len(self.metadata)

    @property
    def payload_bytes(self) -> int:
        return sum(i.payload_bytes for i in self.items)

    def keys(self) -> list[str]:
        return [i.key for i in self.items]


# ------------------------------------------------------------------------------------------- flattening

def _is_tensor(v) -> bool:
    return isinstance(v, (TensorOut, SameAs, ChunkedOut))


def _terminal(value) -> bool:
    """torch's ``traverse_state_dict`` rule: a dict is walked; a list is one value unless it holds a dict,
    a list that is walked, or a tensor; anything else (tuples included) is one value."""
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    return not any(isinstance(v, dict) or (isinstance(v, list) and not _terminal(v)) or _is_tensor(v)
                   for v in value)


def flatten(state: dict) -> list[tuple[tuple, object]]:
    """(path, leaf) for every leaf, in ``flatten_state_dict`` order; the key is ``".".join(map(str, path))``."""
    out: list[tuple[tuple, object]] = []

    def walk(path, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(path + (str(k),), v)
        elif _terminal(value):
            out.append((path, value))
        else:
            for i, v in enumerate(value):
                walk(path + (i,), v)

    for k, v in state.items():
        walk((str(k),), v)
    return out


def key_of(path: tuple) -> str:
    return ".".join(map(str, path))


_PLAIN = (bool, int, float, str, bytes, type(None))


def plain_value(value, key: str, _done: dict | None = None):
    """``value`` as DCP pickles it: plain data (exact builtin types) as it is, a torch dtype or device read through
    the allow-list as ``torch.<dtype>`` / ``torch.device`` (what ``torch.load(weights_only=True)`` accepts); anything
    else (an enum or object stand-in: its class is zckpt's, not the framework's) is refused. Each container is
    converted once (by identity): a value the pickle shares stays shared, so tuples that each hold the one before
    twice (a few hundred bytes, 2**40 paths) take 40 steps, and a list that holds itself ends."""
    if type(value) in _PLAIN:
        return value
    if isinstance(value, TorchDtype):
        return GlobalRef("torch", str(value))
    if isinstance(value, TorchDevice):
        return Reduce(GlobalRef("torch", "device"), (str(value),))
    kind = type(value)
    if kind not in (list, tuple, dict, OrderedDict):
        raise UnsupportedLayout(f"'{key}' holds a {kind.__name__}, not plain data; DCP would need its class")
    done = {} if _done is None else _done
    got = done.get(id(value))
    if got is not None:
        return got[0]
    if kind is tuple:  # made whole (a tuple that holds itself does so through a list or dict, memoized first)
        out = tuple(plain_value(v, key, done) for v in value)
        done[id(value)] = (out, value)
        return out
    out = kind()
    done[id(value)] = (out, value)  # (the source kept alive while its id is a key)
    if kind is list:
        out.extend(plain_value(v, key, done) for v in value)
    else:
        for k, v in value.items():
            out[plain_value(k, key, done)] = plain_value(v, key, done)
    return out


def check_plain(value, key: str) -> None:
    plain_value(value, key)


# ------------------------------------------------------------------------------------------- planning

def _tensor_chunks(t: TensorOut, chunk_bytes: int) -> list[tuple[tuple, tuple, TensorOut]]:
    """Blocks of whole rows (dim 0) of at most ``chunk_bytes`` each (one block for 0-d and small tensors)."""
    shape = tuple(int(d) for d in t.shape)
    row = math.prod(shape[1:]) if shape else 1
    row_bytes = max(1, row * DTYPE_SIZES[t.dtype])
    if not shape or shape[0] == 0 or shape[0] * row_bytes <= chunk_bytes:
        return [((0,) * len(shape), shape, TensorOut(t.dtype, shape, list(t.segments)))]
    per = max(1, chunk_bytes // row_bytes)
    out = []
    for r0 in range(0, shape[0], per):
        n = min(per, shape[0] - r0)
        segs = slice_segments(t.segments, r0 * row, n * row)
        out.append(((r0,) + (0,) * (len(shape) - 1), (n,) + shape[1:], TensorOut(t.dtype, (n,) + shape[1:], segs)))
    return out


def plan_dcp(state: dict, checkpoint_id: str | None = None, chunk_bytes: int = CHUNK_BYTES,
             file_bytes: int = FILE_BYTES) -> DcpPlan:
    """Lay ``state`` out as a DCP checkpoint: every chunk's archive, file and offset, and the ``.metadata`` bytes."""
    items: list[Item] = []
    by_path: dict[tuple, Item] = {}
    by_key: dict[str, Item] = {}
    aliases: list[tuple[Item, SameAs]] = []
    for path, leaf in flatten(state):
        key = key_of(path)
        if isinstance(leaf, TensorOut):
            if leaf.dtype not in _TORCH_DTYPES:
                raise UnsupportedLayout(f"'{key}': no torch dtype for {leaf.dtype}")
            item = Item(key, path, leaf.dtype, tuple(int(d) for d in leaf.shape))
            for offsets, sizes, part in _tensor_chunks(leaf, chunk_bytes):
                item.chunks.append(Chunk(offsets, sizes, torchzip.plan_archive(part, "archive")))
        elif isinstance(leaf, ChunkedOut):
            if leaf.dtype not in _TORCH_DTYPES:
                raise UnsupportedLayout(f"'{key}': no torch dtype for {leaf.dtype}")
            item = Item(key, path, leaf.dtype, tuple(int(d) for d in leaf.shape))
            for offsets, sizes, part in leaf.chunks:
                item.chunks.append(Chunk(tuple(offsets), tuple(sizes), torchzip.plan_archive(part, "archive")))
        elif isinstance(leaf, SameAs):
            item = Item(key, path, None, None)
            aliases.append((item, leaf))
        else:
            value = leaf.value if isinstance(leaf, Whole) else leaf
            item = Item(key, path, None, None,
                        [Chunk(None, None, torchzip.plan_archive(plain_value(value, key), "archive"))])
        items.append(item)
        by_path[path] = item
        by_key[key] = item
    for item, same in aliases:
        target = by_path.get(tuple(same.path))
        if target is None or target.dtype is None or target.alias_of:
            raise UnsupportedLayout(f"'{item.key}' is tied to '{key_of(same.path)}', which is not a stored tensor")
        item.dtype, item.shape, item.alias_of = target.dtype, target.shape, target.key
    files = _place(items, file_bytes)
    for item in items:
        if item.alias_of:
            item.chunks = list(by_key[item.alias_of].chunks)
    return DcpPlan(items, files, metadata_bytes(items, checkpoint_id))


def _place(items: list[Item], file_bytes: int) -> list[DcpFile]:
    """Chunks into ``.distcp`` files in key order, back to back; a file is closed once it reaches ``file_bytes``."""
    files = [DcpFile("__0_0.distcp")]
    for item in items:
        if item.alias_of:
            continue
        for ch in item.chunks:
            f = files[-1]
            if f.size and f.size + ch.length > file_bytes:
                f = DcpFile(f"__{len(files)}_0.distcp")
                files.append(f)
            ch.file, ch.offset = f.name, f.size
            f.placed.append((ch.archive, f.size))
            f.size += ch.length
    return [f for f in files if f.placed]


# ------------------------------------------------------------------------------------------- .metadata

class _Refs:
    """One object per global name / shared value, so the pickler's memo writes each once (a third of the size)."""

    def __init__(self):
        self.cache: dict = {}

    def ref(self, module: str, name: str) -> GlobalRef:
        got = self.cache.get((module, name))
        if got is None:  # (made once: ten thousand calls for a checkpoint of 651 items)
            got = self.cache[module, name] = GlobalRef(module, name)
        return got

    def obj(self, module: str, name: str, state):
        """``plain_object`` with its class reference shared."""
        return Reduce(self.ref("copyreg", "_reconstructor"), (self.ref(module, name), self.ref("builtins", "object"),
                                                              None), state)

    def size(self, dims) -> Reduce:
        return Reduce(self.ref("torch", "Size"), (tuple(int(d) for d in dims),))

    def properties(self, dtype: str):
        # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory-format encoding, pin_memory)
        key = ("properties", dtype)
        if key not in self.cache:
            layout = Reduce(self.ref("torch.serialization", "_get_layout"), ("torch.strided",))
            contiguous = Reduce(self.ref(_META, "_MEM_FORMAT_ENCODING"), (0,))
            self.cache[key] = self.obj(_META, "TensorProperties", (self.ref("torch", _TORCH_DTYPES[dtype]), layout,
                                                                   False, contiguous, False))
        return self.cache[key]


def metadata_object(items: list[Item], checkpoint_id: str | None = None):
    """torch's ``Metadata`` for ``items`` as a pickle-ready object tree (classes named, never imported)."""
    r = _Refs()
    sd_meta, storage, planner = {}, {}, {}
    for item in items:
        if item.dtype is None:
            sd_meta[item.key] = r.obj(_META, "BytesStorageMetadata", {})
        else:
            chunks = [r.obj(_META, "ChunkStorageMetadata", {"offsets": r.size(c.offsets), "sizes": r.size(c.sizes)})
                      for c in item.chunks]
            sd_meta[item.key] = r.obj(_META, "TensorStorageMetadata", {
                "properties": r.properties(item.dtype), "size": r.size(item.shape), "chunks": chunks})
        for i, c in enumerate(item.chunks):
            idx = r.obj(_META, "MetadataIndex", {"fqn": item.key, "offset": None if c.offsets is None else
                                                 r.size(c.offsets), "index": None if item.dtype is None else i})
            storage[idx] = r.obj(_FS, "_StorageInfo", {"relative_path": c.file, "offset": c.offset,
                                                       "length": c.length})
        planner[item.key] = tuple(item.path)
    meta = r.obj(_META, "StorageMeta", {"checkpoint_id": checkpoint_id, "save_id": str(uuid.uuid4()),
                                        "load_id": None, "modules": []})
    return r.obj(_META, "Metadata", {"state_dict_metadata": sd_meta, "planner_data": planner,
                                     "storage_data": storage, "storage_meta": meta, "version": DCP_VERSION})


def metadata_bytes(items: list[Item], checkpoint_id: str | None = None) -> bytes:
    data, tensors = torchzip.dumps(metadata_object(items, checkpoint_id), plain=True)
    assert not tensors
    return data
