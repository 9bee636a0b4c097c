"""A Hugging Face model folder (what ``save_pretrained`` and ``zckpt merge`` write) as a
:class:`~zckpt.state.model.Checkpoint`: weights only, metadata only, no tensor byte read.

What it reads, as ``from_pretrained`` finds it::

    model.safetensors                         an 8-byte header length, a JSON header (each tensor's dtype, shape and
                                              data offsets), the tensor bytes
    model-00001-of-00002.safetensors ...      sharded, with model.safetensors.index.json (weight_map: name -> file)
    pytorch_model.bin (+ shards and           torch zips (or legacy torch files), read through the allow-list
    pytorch_model.bin.index.json)             (:func:`zckpt.encoding.safeload.load`): no pickle code run, tensors
                                              as ``LazyTensor`` s
    config.json                               kept as ``Checkpoint.extra["hf"]["config"]`` (facts for ``info``)

Where both safetensors and ``.bin`` weights are there, the safetensors are read, as ``from_pretrained`` does.
Every tensor is a record of kind ``frozen`` (a folder of weights says nothing of training: no optimizer state, no
groups), its value one piece of its file. Checksums: a ``.bin`` file's zip entries carry CRC-32s, checked when the
bytes are read (the loaded dicts are ``Checkpoint.model_states``, whose storages :mod:`zckpt.state.checksums`
knows); **safetensors holds no checksum**: its header's offsets are checked against each other and against the
file's size, and its bytes only against a push manifest's sha256 (``verify --deep``).

:func:`claims` leaves a folder that is also a training checkpoint (a Trainer ``checkpoint-N`` with
``global_stepN`` / ``latest`` beside its ``model.safetensors``, a DCP or Megatron folder) to its own reader: its
training state is what is read there. :func:`weight_files` answers for any folder (``zckpt diff`` of the
weights beside a training state).
"""

from __future__ import annotations

import json
import math
import re
import struct

from zckpt.encoding import safeload
from zckpt.encoding.lazytensor import DTYPE_SIZES, FLOATING, LazyTensor
from zckpt.engine.segments import Piece
from zckpt.errors import CheckpointNotFound, CorruptFile, IncompleteCheckpoint, InvalidArgument, UnsupportedLayout
from zckpt.io import storage
from zckpt.state.model import Checkpoint, Location, RankFile, TensorRecord, pieces_of

FORMAT = "hf"
SINGLE = ("model.safetensors", "pytorch_model.bin")
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SHARDS = (re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$"), re.compile(r"^pytorch_model-(\d{5})-of-(\d{5})\.bin$"))
#: safetensors' dtype names -> torch's
ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16",
             "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
             "C64": "complex64"}
MAX_HEADER = 100 << 20  # the safetensors library's own limit on a header (100 MB)
#: what makes a folder a training checkpoint, read by another reader even when HF weights sit beside it
_TRAINING = ("latest", "latest_universal", ".metadata", "pytorch_model_fsdp_0", "latest_checkpointed_iteration.txt",
             "common.pt")
_TRAINING_RE = re.compile(r"^(global_step\d+|iter_\d{7}|.*_model_states\.pt|.*_optim_states\.pt|.*\.distcp)$")
HINT = "re-save it with save_pretrained (or zckpt merge), or re-copy the folder"


def weight_files(path: str, storage_options: dict | None = None) -> list[str]:
    """The weight files of the folder, in the order ``from_pretrained`` reads them (an index's files in its order,
    each checked to be there); [] when it has none."""
    try:
        names = set(storage.listdir(str(path), storage_options))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for single, index, shard in zip(SINGLE, INDEXES, _SHARDS):
        if index in names:
            files = list(dict.fromkeys(_weight_map(storage.join(str(path), index), storage_options).values()))
            missing = [f for f in files if f not in names]
            if missing:
                raise IncompleteCheckpoint(f"{index} names {len(missing)} file(s) not here, e.g. {missing[0]}",
                                           path=str(path), hint="copy every shard the index lists")
            return files
        if single in names:
            return [single]
        shards = sorted(n for n in names if shard.match(n))
        if shards:
            raise IncompleteCheckpoint(f"shards ({shards[0]}...) without their {index}", path=str(path),
                                       hint="copy the index file too, or re-save the model")
    return []


def claims(path: str, storage_options: dict | None = None) -> bool:
    """The opener's question (:mod:`zckpt.state.open`): HF weight files here, and nothing of a training checkpoint."""
    try:
        names = storage.listdir(str(path), storage_options)
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return False
    if any(n in _TRAINING or _TRAINING_RE.match(n) for n in names):
        return False
    return any(n in SINGLE or n in INDEXES or any(s.match(n) for s in _SHARDS) for n in names)


def read(path: str, tag: str | None = None, storage_options: dict | None = None) -> Checkpoint:
    """The opener's read: :func:`open_hf` (a folder of weights has no tags, so ``tag`` is refused)."""
    if tag is not None:
        raise InvalidArgument("a Hugging Face folder holds one set of weights and no tags", path=str(path),
                              param="tag", hint="drop `tag`")
    return open_hf(path, storage_options)


def open_hf(path: str, storage_options: dict | None = None) -> Checkpoint:
    """The Hugging Face folder at ``path`` as a Checkpoint of ``frozen`` records (see the module docstring)."""
    path, opts = str(path), storage_options
    files = weight_files(path, opts)
    if not files:
        raise CheckpointNotFound("no model.safetensors, pytorch_model.bin or shard index here", path=path,
                                 hint="pass the folder save_pretrained or zckpt merge wrote")
    names = set(storage.listdir(path, opts))
    index = next((i for i in INDEXES if i in names and files[0].endswith(i.split(".index")[0].rsplit(".", 1)[1])),
                 None)
    weight_map = _weight_map(storage.join(path, index), opts) if index else None
    records, rank_files, loaded = [], [], []
    seen: dict[str, str] = {}
    for name in files:
        fpath = storage.join(path, name)
        size = storage.size(fpath, opts)
        rank_files.append(RankFile(fpath, name, "data", None, 0, size))
        if name.endswith(".safetensors"):
            found = _safetensors(fpath, size, opts)
        else:
            state = safeload.load(fpath, storage_options=opts, size_hint=size)
            loaded.append(state)  # its LazyTensors' storages carry the zip entries' CRC-32s (state/checksums)
            found = _torch_file(state, fpath)
        for tname, dtype, shape, pieces in found:
            if tname in seen:
                raise CorruptFile(f"tensor '{tname}' is in both {seen[tname]} and {name}", path=path, hint=HINT)
            if weight_map is not None and weight_map.get(tname) != name:
                where = f"in {weight_map[tname]}" if tname in weight_map else "nowhere"
                raise CorruptFile(f"{name} holds '{tname}', which {index} places {where}", path=fpath, hint=HINT)
            seen[tname] = name
            records.append(TensorRecord(tname, shape, "frozen", dtype, pieces))
    if weight_map is not None:
        absent = [n for n in weight_map if n not in seen]
        if absent:
            raise CorruptFile(f"{index} places {len(absent)} tensor(s) in files that do not hold them, e.g. "
                              f"'{absent[0]}' in {weight_map[absent[0]]}", path=path, hint=HINT)
    floating = sorted({r.dtype for r in records if r.dtype in FLOATING})
    precision = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(floating[0], floating[0]) \
        if len(floating) == 1 else ("mixed" if floating else "none")
    loc = Location(path, path, "", path, None, data_files=rank_files, storage_options=opts)
    bin_too = files[0].endswith(".safetensors") and any(n in names for n in SINGLE[1:] + INDEXES[1:])
    notes = ["pytorch_model.bin weights are here too; the safetensors are read, as from_pretrained does"] \
        if bin_too else []
    why = "a Hugging Face folder holds weights only: no optimizer state, no ZeRO partitions"
    return Checkpoint(
        location=loc, stage=0, flavour="hf", precision=precision, world_size=1, records=records, groups=[],
        model_state={}, optim_states=[], model_states=loaded, notes=notes, reshard_refusal=why, state_refusal=why,
        format=FORMAT,
        extra={"hf": {"weights_format": "safetensors" if files[0].endswith(".safetensors") else "pt",
                      "files": list(files), "index": index, "config": _config(path, names, opts),
                      "checksums": None if files[0].endswith(".safetensors") else "crc32"}},
    )


def _weight_map(ipath: str, opts) -> dict[str, str]:
    try:
        wm = json.loads(storage.read_bytes(ipath, opts))["weight_map"]
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise TypeError("weight_map is not a map of tensor names to file names")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptFile(f"not a valid index ({exc})", path=ipath, hint=HINT) from None
    bad = [v for v in wm.values() if "/" in v or "\\" in v or v in ("", ".", "..")]
    if bad:
        raise CorruptFile(f"weight_map names a file outside the folder: {bad[0]!r}", path=ipath, hint=HINT)
    return wm


def _config(path: str, names, opts) -> dict | None:
    if "config.json" not in names:
        return None
    try:
        cfg = json.loads(storage.read_bytes(storage.join(path, "config.json"), opts))
    except ValueError:
        return None
    return cfg if isinstance(cfg, dict) else None


def _safetensors(fpath: str, size: int, opts) -> list[tuple[str, str, tuple, list[Piece]]]:
    """Each tensor of a safetensors file's header, checked against the file's size (the format holds no CRC)."""
    head = storage.read_range(fpath, 0, 8, opts) if size >= 8 else b""
    if len(head) != 8:
        raise CorruptFile("is not a safetensors file (shorter than its 8-byte header length)", path=fpath, hint=HINT)
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER or 8 + n > size:
        raise CorruptFile(f"its header length ({n} bytes) does not fit the file's {size} bytes", path=fpath,
                          hint=HINT)
    try:
        header = json.loads(storage.read_range(fpath, 8, n, opts))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise CorruptFile(f"its header is not valid JSON ({exc})", path=fpath, hint=HINT) from None
    out, spans, base = [], [], 8 + n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = ST_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            lo, hi = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise UnsupportedLayout(f"'{name}': a header entry zckpt cannot read ({str(entry)[:80]})",
                                    path=fpath) from None
        numel = math.prod(shape)
        if min(shape, default=0) < 0 or lo < 0 or hi - lo != numel * DTYPE_SIZES[dtype] or base + hi > size:
            raise CorruptFile(f"'{name}': bytes {lo}-{hi} do not hold {list(shape)} {dtype} inside the file",
                              path=fpath, hint=HINT)
        spans.append((lo, hi, name))
        out.append((name, dtype, shape, [Piece(fpath, base + lo, numel, dtype)] if numel else []))
    spans.sort()
    for (_, e0, a), (s1, _, b) in zip(spans, spans[1:]):
        if s1 < e0:
            raise CorruptFile(f"tensors '{a}' and '{b}' overlap", path=fpath, hint=HINT)
    end = base + (spans[-1][1] if spans else 0)
    if end != size:
        raise CorruptFile(f"is {size} bytes, its header says {end} (truncated or appended to)", path=fpath, hint=HINT)
    return out


def _torch_file(state, fpath: str) -> list[tuple[str, str, tuple, list[Piece]]]:
    """A ``pytorch_model.bin``'s flat state dict (name -> tensor)."""
    if not isinstance(state, dict):
        raise UnsupportedLayout("not a state dict (a dict of tensors)", path=fpath)
    out = []
    for name, t in state.items():
        if not isinstance(t, LazyTensor):
            raise UnsupportedLayout(f"'{name}' is not a tensor; a pytorch_model.bin is a flat state dict", path=fpath)
        out.append((str(name), t.dtype, tuple(t.shape), pieces_of(t)))
    return out
