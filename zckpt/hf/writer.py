"""The Hugging Face folder writer: a training state's weights as the files ``from_pretrained`` loads.

:func:`plan_merge` turns a :class:`~zckpt.state.model.Checkpoint` (any format's reader) into a :class:`MergePlan`:
the output files (``model.safetensors`` or ``pytorch_model.bin``, sharded greedily as
``huggingface_hub.split_torch_state_dict_into_shards`` does, with the index), each tensor's dtype, shape, byte
offset in its file, and the input pieces it is made of; no bytes read. The engine writes each file at its
final size (:func:`zckpt.engine.run.run_merge`: the header, then tensor bytes in chunks through
:class:`zckpt.engine.executor.Worker`, several files at once); :func:`trainer_files` gives a Trainer checkpoint's config (its dtype set to the output's) and tokenizer files.
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass, field

from zckpt.encoding.safeload import FLOATING
from zckpt.engine.segments import Shaped
from zckpt.errors import InvalidArgument
from zckpt.io import links, storage
from zckpt.state.model import Checkpoint, Piece
from zckpt.units import format_size

log = logging.getLogger(__name__)

PURE_CAST_BYTES = 32 << 20  # bf16 -> fp32 output bytes below which a pure-Python upcast beats importing numpy
DTYPE_FLAGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # as --dtype spells them
DTYPE_ALIASES = {
    "fp32": "float32", "float32": "float32", "float": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
}
ST_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "uint16": "U16", "uint32": "U32",
    "uint64": "U64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
}
FORMATS = {
    "safetensors": ("model.safetensors", "model-{:05d}-of-{:05d}.safetensors", "model.safetensors.index.json"),
    "pt": ("pytorch_model.bin", "pytorch_model-{:05d}-of-{:05d}.bin", "pytorch_model.bin.index.json"),
}
TRAINER_COPY = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
    "processor_config.json", "README.md",
)


def parse_size(text) -> int:
    """``--max-shard-size``: '5GB' = '5G' -> 5*10**9, '200MiB' -> 200*2**20, 1000 -> 1000 (bytes); see zckpt.units."""
    from zckpt.units import parse_size as _parse

    return _parse(text, flag="max_shard_size", what="a shard size")


def out_dtype_name(dtype: str) -> str:
    if dtype not in DTYPE_ALIASES:
        raise InvalidArgument(f"unknown dtype {dtype!r}", param="dtype", hint="use fp32, bf16 or fp16")
    return DTYPE_ALIASES[dtype]


# ------------------------------------------------------------------------------------------------- plan

@dataclass
class OutTensor(Shaped):
    name: str
    dtype: str  # output dtype
    shape: tuple
    src_dtype: str
    pieces: list[Piece]
    offset: int = 0  # byte offset in its file (absolute)


@dataclass
class ShardPlan:
    filename: str
    tensors: list[OutTensor]
    header: bytes = b""  # safetensors: 8-byte length + JSON
    size: int = 0
    archive: object = None  # pt: the planned torch zip (zckpt.engine.torchzip.Archive)

    def __repr__(self) -> str:
        return f"<ShardPlan {self.filename!r}: {len(self.tensors)} tensors, {format_size(self.size)}>"


@dataclass
class MergePlan:
    fmt: str
    dtype: str
    shards: list[ShardPlan]
    index_name: str | None
    index: dict | None
    total_size: int
    skipped_tied: dict = field(default_factory=dict)  # alias -> source (stored once, under the source)

    def __repr__(self) -> str:
        tensors = sum(len(sh.tensors) for sh in self.shards)
        return (f"<MergePlan {tensors} tensors, {format_size(self.total_size)} "
                f"{DTYPE_FLAGS.get(self.dtype, self.dtype)} {self.fmt} in {len(self.shards)} file(s)"
                + (f", {len(self.skipped_tied)} tied stored once" if self.skipped_tied else "") + ">")

    def summary(self) -> dict:
        return {
            "format": self.fmt, "dtype": self.dtype, "total_bytes": self.total_size,
            "tensors": sum(len(s.tensors) for s in self.shards),
            "files": [{"name": s.filename, "bytes": s.size, "tensors": len(s.tensors)} for s in self.shards]
            + ([{"name": self.index_name, "bytes": None, "tensors": 0}] if self.index_name else []),
            "tied": self.skipped_tied,
        }


def output_tensors(ckpt: Checkpoint, dtype: str, exclude_frozen: bool = False,
                   keep_tied: bool = False) -> tuple[list[OutTensor], dict]:
    """The tensors of the consolidated state dict, in model order: floating ones cast to ``dtype`` (but those the
    view keeps in another, ``extra["keep_dtype"]``: {name: dtype}, as the model class holds them)."""
    ckpt.check_ties()  # a value that depends on an undeclared tie is never guessed
    target = out_dtype_name(dtype)
    keep = ckpt.extra.get("keep_dtype") or {}
    byname = ckpt.by_name()
    out, tied = [], {}
    for rec in ckpt.records:
        if rec.kind == "frozen" and exclude_frozen:
            continue
        src = rec
        if rec.kind == "tied":
            src = byname.get(rec.tied_to)
            if src is None or (src.kind == "frozen" and exclude_frozen):
                continue
            if not keep_tied:
                tied[rec.name] = rec.tied_to
                continue
        dt = keep.get(rec.name, target) if src.dtype in FLOATING else src.dtype
        out.append(OutTensor(rec.name, dt, tuple(src.shape), src.dtype, src.value))
    return out, tied


def plan_merge(ckpt: Checkpoint, fmt: str = "safetensors", dtype: str = "fp32", max_shard_size="5GB",
               exclude_frozen: bool = False, keep_tied: bool = False) -> MergePlan:
    if fmt not in FORMATS:
        raise InvalidArgument(f"unknown output format {fmt!r}", param="fmt", hint="use safetensors or pt")
    limit = parse_size(max_shard_size)
    tensors, tied = output_tensors(ckpt, dtype, exclude_frozen, keep_tied)
    groups: list[list[OutTensor]] = []
    current, size = [], 0
    for t in tensors:  # greedy, like huggingface_hub's split_state_dict_into_shards_factory
        if current and size + t.nbytes > limit:
            groups.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current or not groups:
        groups.append(current)
    single, pattern, index_name = FORMATS[fmt]
    n = len(groups)
    shards = [ShardPlan(single if n == 1 else pattern.format(i + 1, n), g) for i, g in enumerate(groups)]
    for shard in shards:
        if fmt == "safetensors":
            layout_safetensors(shard)
        else:
            from zckpt.engine import torchzip
            torchzip.layout_state_dict(shard)
    total = sum(t.nbytes for s in shards for t in s.tensors)
    index = None
    if n > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.name: s.filename for s in shards for t in s.tensors}}
    return MergePlan(fmt, out_dtype_name(dtype), shards, index_name if n > 1 else None, index, total, tied)


def layout_safetensors(shard: ShardPlan) -> None:
    header, pos = {}, 0
    for t in shard.tensors:
        if t.dtype not in ST_DTYPES:
            raise InvalidArgument(f"safetensors cannot store dtype {t.dtype} of '{t.name}'", hint="use `fmt`=pt")
        header[t.name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    shard.header = struct.pack("<Q", len(raw)) + raw
    pos = len(shard.header)
    for t in shard.tensors:
        t.offset = pos
        pos += t.nbytes
    shard.size = pos


# ---------------------------------------------------------------------------------------------- execute

def trainer_files(ckpt: Checkpoint, dtype: str) -> dict[str, bytes]:
    """config, generation config and tokenizer files of a Trainer checkpoint, config dtype set to ``dtype``."""
    src, opts = ckpt.location.trainer_dir, ckpt.storage_options
    if not src:
        return {}
    names = set(storage.listdir(src, opts))
    out = {}
    for name in TRAINER_COPY:
        if name in names and storage.isfile(storage.join(src, name), opts):
            links.check([storage.join(src, name)], src)  # a side file that is a link out of the checkpoint
            out[name] = storage.read_bytes(storage.join(src, name), opts)
    if "config.json" in out:
        try:
            cfg = json.loads(out["config.json"])
        except ValueError:
            log.warning("config.json of %s is not valid JSON; copied as is", src)
        else:
            name = out_dtype_name(dtype)
            keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]
            for k in keys:
                cfg[k] = name
            out["config.json"] = (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()
    return out
