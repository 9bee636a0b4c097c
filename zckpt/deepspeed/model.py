"""The model every DeepSpeed reader produces: a :class:`Checkpoint` of :class:`TensorRecord` s made of pieces.

A :class:`TensorRecord` is one entry of the model's ``state_dict`` in model order; it holds ``Piece`` lists (file,
byte offset, element count, dtype) for its value and, for trainable parameters, the master weights and both Adam
moments, in the dtypes the files store. Concatenating a list's pieces gives the flat tensor. Every reader's records
pass :func:`check_records` when the :class:`Checkpoint` is built. The readers (:mod:`zero0`, :mod:`zero12`,
:mod:`zero3`, :mod:`pipeline`, :mod:`moe`, :mod:`tp`, :mod:`universal_read`) import from here only;
:mod:`zckpt.deepspeed.layout` picks the reader.
"""

from __future__ import annotations

import contextlib
import logging
import math
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from zckpt.formats import safeload
from zckpt.io import storage
from zckpt.engine.segments import Piece
from zckpt.deepspeed.discover import Location, RankFile
from zckpt.errors import CorruptFile, IncompleteCheckpoint, UnsupportedLayout, ZckptError
from zckpt.formats.safeload import LazyTensor

log = logging.getLogger(__name__)

@dataclass
class TensorRecord:
    """One entry of the model's state dict.

    kind: ``trainable`` (value = fp32 master), ``frozen`` (value in the training dtype), ``buffer``, or
    ``tied`` (an alias of ``tied_to``; no pieces of its own).
    """

    name: str
    shape: tuple
    kind: str
    dtype: str  # dtype of ``value`` pieces as stored
    value: list[Piece] = field(default_factory=list)
    exp_avg: list[Piece] = field(default_factory=list)
    exp_avg_sq: list[Piece] = field(default_factory=list)
    group: int | None = None  # optimizer param group (trainable)
    tied_to: str | None = None
    lp_dtype: str | None = None  # the training (low-precision) dtype of a parameter

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def state_dtype(self) -> str | None:
        """The dtype the Adam moments are stored in (None when the checkpoint has none)."""
        return self.exp_avg[0].dtype if self.exp_avg else None


# dtypes a master weight or an optimizer moment may be stored in; anything else is refused, never guessed
STATE_DTYPES = ("float32", "bfloat16", "float16")


def uniform_dtype(tensors, what: str, path: str | None = None) -> str | None:
    """The one dtype of ``tensors`` (LazyTensors or Pieces, ``None`` entries ignored), or a CorruptFile.

    Master weights and moments are read as the dtype their files say; partitions of one group that disagree
    (one rank saved bf16, another fp32) cannot be concatenated and are refused."""
    dtypes = {t.dtype for t in tensors if t is not None}
    if len(dtypes) > 1:
        raise CorruptFile(f"{what} is stored in several dtypes ({', '.join(sorted(dtypes))})", path=path,
                          hint="the rank files come from different saves or an unknown layout")
    if dtypes and next(iter(dtypes)) not in STATE_DTYPES:
        raise UnsupportedLayout(f"{what} is stored as {next(iter(dtypes))}; zckpt reads master weights and "
                                f"optimizer states only as {', '.join(STATE_DTYPES)}", path=path)
    return next(iter(dtypes)) if dtypes else None


def check_records(records: list[TensorRecord], path: str | None = None) -> None:
    """The invariant every reader's output must satisfy before anything uses it.

    Each list of pieces (value, exp_avg, exp_avg_sq) is in one dtype and covers exactly the record's element
    count; ``record.dtype`` is the dtype of its value pieces. A reader that labels bytes with a dtype they are
    not stored in, or that mis-counts a partition, fails here instead of producing reinterpreted values."""
    for rec in records:
        if rec.kind == "tied":
            continue
        lists = [("value", rec.value)]
        if rec.exp_avg or rec.exp_avg_sq:
            lists += [("exp_avg", rec.exp_avg), ("exp_avg_sq", rec.exp_avg_sq)]
        for what, pieces in lists:
            dtypes = {p.dtype for p in pieces}
            numel = sum(p.numel for p in pieces)
            if numel != rec.numel:
                raise CorruptFile(f"'{rec.name}': {what} covers {numel} elements, its shape "
                                  f"{list(rec.shape)} has {rec.numel}", path=path)
            if len(dtypes) > 1:
                raise CorruptFile(f"'{rec.name}': {what} is stored in several dtypes "
                                  f"({', '.join(sorted(dtypes))})", path=path)
            if what == "value" and dtypes and dtypes != {rec.dtype}:
                raise CorruptFile(f"'{rec.name}': labelled {rec.dtype} but stored as {dtypes.pop()}", path=path)
            if dtypes and next(iter(dtypes)) not in safeload.DTYPE_SIZES:
                raise UnsupportedLayout(f"'{rec.name}': {what} has unknown dtype {next(iter(dtypes))}", path=path)


@dataclass
class GroupInfo:
    """One optimizer param group (ZeRO-3: one per user group, spanning its sub-groups)."""

    index: int
    hyperparams: dict
    step: Any  # float or int, read from the step tensor(s)
    names: list[str] = field(default_factory=list)


@dataclass
class Checkpoint:
    location: Location
    stage: int  # 1, 2 or 3 (the BF16 optimizer counts as 1)
    flavour: str  # "zero" (DeepSpeedZeroOptimizer), "bf16_optimizer", "zero3"
    precision: str  # "bf16", "fp16" or "fp32"
    world_size: int
    records: list[TensorRecord]
    groups: list[GroupInfo]
    model_state: dict  # rank-0 model-states metadata (module tensors as LazyTensor)
    optim_states: list[dict]  # per dp rank: the optimizer file's metadata
    model_states: list[dict]  # per model file (ZeRO-3: per dp rank)
    offload: bool = False
    notes: list[str] = field(default_factory=list)
    parallel: str | None = None  # "pipeline" or "moe" (zckpt.deepspeed.pipeline / .moe); None: data parallel only
    reshard_refusal: str | None = None  # why ``reshard`` cannot re-partition this layout (None: it can)

    def __post_init__(self):
        check_records(self.records, self.location.tag_dir)

    @property
    def master_dtypes(self) -> list[str]:
        """The dtypes the trainable parameters' master weights are stored in (e.g. ["float32"])."""
        return sorted({r.dtype for r in self.records if r.kind == "trainable"})

    @property
    def state_dtypes(self) -> list[str]:
        """The dtypes the Adam moments are stored in ([] when the checkpoint holds none)."""
        return sorted({r.state_dtype for r in self.records if r.kind == "trainable" and r.state_dtype})

    # convenience --------------------------------------------------------------------------------
    @property
    def tag(self) -> str:
        return self.location.tag

    @property
    def ds_version(self) -> str | None:
        return self.model_state.get("ds_version")

    @property
    def ds_config(self) -> dict:
        cfg = self.model_state.get("ds_config")
        return cfg if isinstance(cfg, dict) else {}

    def by_name(self) -> dict[str, TensorRecord]:
        return {r.name: r for r in self.records}

    def of_kind(self, kind: str) -> list[TensorRecord]:
        return [r for r in self.records if r.kind == kind]

    @property
    def storage_options(self) -> dict | None:
        """The fsspec options this checkpoint was opened with (``open_checkpoint(..., storage_options=)``): pass
        them on to whatever reads its files (``Worker``, ``Reader``, ``Publisher``...)."""
        return self.location.storage_options

    @property
    def files(self) -> list[RankFile]:
        loc = self.location
        return loc.model_files + loc.layer_files + loc.expert_files + loc.optim_files

    @property
    def loss_scaler(self) -> dict | None:
        osd = self.optim_states[0].get("optimizer_state_dict", {}) if self.optim_states else {}
        scaler = osd.get("loss_scaler")
        if scaler is None:
            return None
        state = {k: v for k, v in vars(scaler).items() if not k.startswith("_")}
        return {"class": getattr(scaler, "_qualname", type(scaler).__name__).rsplit(".", 1)[-1], **state}

    @property
    def client_state(self) -> dict:
        return {k: v for k, v in self.model_state.items() if k not in MODEL_STATE_KEYS}


MODEL_STATE_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
    "shared_params", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info", "num_experts",
    "ds_autoep_layers", "folding", "iteration",
}


# ------------------------------------------------------------------------------------------ piece helpers

def pieces_of(t: LazyTensor, start: int = 0, length: int | None = None) -> list[Piece]:
    """Pieces for elements [start, start+length) of ``t`` in row-major order."""
    n = t.numel
    length = n - start if length is None else length
    if start < 0 or length < 0 or start + length > n:
        raise CorruptFile(f"slice [{start}, {start + length}) outside a tensor of {n} elements",
                          path=t.storage.path)
    if length == 0:
        return []
    size = t.itemsize
    if t.is_contiguous():
        return [Piece(t.storage.path, t.byte_offset + start * size, length, t.dtype)]
    # rare: a strided tensor in a state dict; describe it element run by element run
    out: list[Piece] = []
    shape, stride = t.shape, t.stride
    for flat in range(start, start + length):
        idx, rem = 0, flat
        for dim, st in zip(reversed(shape), reversed(stride)):
            idx += (rem % dim) * st
            rem //= dim
        off = t.storage.offset + (t.storage_offset + idx) * size
        if out and out[-1].offset + out[-1].nbytes == off:
            last = out[-1]
            out[-1] = Piece(last.path, last.offset, last.numel + 1, last.dtype)
        else:
            out.append(Piece(t.storage.path, off, 1, t.dtype))
    return out


def scalar_value(t, storage_options: dict | None = None) -> Any:
    """Read a 0-d (or 1-element) tensor such as Adam's ``step`` (``storage_options``: for a file behind a URL)."""
    if not isinstance(t, LazyTensor):
        return t
    if t.numel != 1:
        raise CorruptFile(f"expected a scalar, got shape {list(t.shape)}", path=t.storage.path)
    raw = storage.read_range(t.storage.path, t.byte_offset, t.itemsize, storage_options)
    fmt = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i"}.get(t.dtype)
    if fmt is None or len(raw) != t.itemsize:
        raise CorruptFile(f"cannot read a {t.dtype} scalar", path=t.storage.path)
    value = struct.unpack(fmt, raw)[0]
    return int(value) if float(value).is_integer() else value


def precision_of(model_state: dict, module: dict | None) -> str:
    """The engine's training precision: from the saved config when it says (an fp32 engine may train fp32
    adapters on a frozen bf16 base); from the module's dtypes only for a checkpoint saved without a config."""
    cfg = model_state.get("ds_config") or {}
    said = False
    for key, name in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        sub = cfg.get(key) if isinstance(cfg, dict) else None
        if isinstance(sub, dict) and sub.get("enabled") is True:
            return name
        said = said or isinstance(sub, dict)
    if said:
        return "fp32"
    if module:
        for t in module.values():
            if isinstance(t, LazyTensor) and t.dtype in ("bfloat16", "float16"):
                return "bf16" if t.dtype == "bfloat16" else "fp16"
    return "fp32"


LP_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


# ---------------------------------------------------------------------------------------- open_checkpoint

def load_all(files: list[RankFile], storage_options: dict | None = None) -> list[dict]:
    """Every file's metadata (:func:`zckpt.formats.safeload.load`); ``storage_options``: for files behind URLs."""
    def one(f: RankFile):
        obj = safeload.load(f.path, storage_options=storage_options)
        if not isinstance(obj, dict):
            raise CorruptFile(f"expected a dict at the top level, found {type(obj).__name__}", path=f.path)
        return obj

    if len(files) > 2 and storage.is_url(files[0].path):
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(one, files))
    return [one(f) for f in files]


@contextlib.contextmanager
def metadata_errors(path: str):
    """Metadata of the wrong type or shape (a hostile or damaged pickle that unpickled fine) becomes one
    :class:`CorruptFile` naming the checkpoint, instead of a TypeError deep in a reader."""
    try:
        yield
    except ZckptError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, RecursionError) as exc:
        raise CorruptFile(f"unexpected metadata ({type(exc).__name__}: {exc})"[:240], path=path) from exc


def check_ranks(loc: Location, world_size: int, per_rank_model_files: bool) -> None:
    """Every data-parallel rank 0..world_size-1 has its optimizer (and, ZeRO-3, model) file, and no extras.

    A missing file is named, as the user's path leads to it (the first few, then how many more)."""
    want = set(range(world_size))
    have = [f.dp_rank for f in loc.optim_files]
    prefixes = sorted({_optim_prefix(f.name) for f in loc.optim_files})
    mp = loc.optim_files[0].mp_rank if loc.optim_files else 0
    if sorted(have) != sorted(want):
        missing = sorted(want - set(have))
        if missing:
            prefix = max(prefixes, key=lambda p: sum(_optim_prefix(f.name) == p for f in loc.optim_files)) \
                if prefixes else ""
            raise missing_files(loc, [f"{prefix}zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt" for r in missing],
                                f"optimizer states of {_ranks(missing)} of {world_size}")
        extra = sorted(set(have) - want)
        raise unexpected_files(loc, [f for f in loc.optim_files if f.dp_rank in extra], world_size)
    if len(prefixes) > 1:
        raise IncompleteCheckpoint("optimizer files of two precisions (bf16_ and plain) in one tag", path=loc.tag_dir,
                                   hint="remove the stale files of the older save")
    if per_rank_model_files:
        mranks = sorted(f.dp_rank for f in loc.model_files if f.dp_rank is not None)
        if mranks != sorted(want):
            missing = sorted(want - set(mranks))
            if missing:
                raise missing_files(loc, [f"zero_pp_rank_{r}_mp_rank_{mp:02d}_model_states.pt" for r in missing],
                                    f"ZeRO-3 model states of {_ranks(missing)} of {world_size}")
            extra = sorted(set(mranks) - want)
            raise unexpected_files(loc, [f for f in loc.model_files if f.dp_rank in extra], world_size)


def missing_files(loc: Location, names: list[str], what: str, shown: int = 3) -> IncompleteCheckpoint:
    """One error naming the missing files of a tag folder (``ck/global_step3/x.pt: missing: ...``): the first
    ``shown``, then "and N more"; its ``path`` is the first missing file."""
    paths = [storage.join(loc.tag_dir, n) for n in names]
    listed = ", ".join(paths[:shown]) + (f" and {len(paths) - shown} more" if len(paths) > shown else "")
    return IncompleteCheckpoint(f"{listed}: missing: {what}", path=paths[0])


def unexpected_files(loc: Location, files: list[RankFile], world_size: int, shown: int = 3) -> IncompleteCheckpoint:
    """Rank files beyond partition_count's ranks (the stale files of a larger run saved under the same tag)."""
    listed = ", ".join(f.path for f in files[:shown]) + (f" and {len(files) - shown} more"
                                                         if len(files) > shown else "")
    return IncompleteCheckpoint(f"{listed}: unexpected: partition_count says {world_size} "
                                f"rank{'s' if world_size > 1 else ''} ({_ranks(range(world_size))})",
                                path=files[0].path, hint="remove the stale files of an older save, or use "
                                "an earlier tag with --tag")


def missing_model_states(loc: Location) -> IncompleteCheckpoint:
    """No ``*_model_states.pt`` at all in a tag folder that has optimizer files: name the file(s) DeepSpeed writes
    there (``mp_rank_00_model_states.pt``; ZeRO-3: ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank, told
    from the first optimizer file's metadata)."""
    if not loc.optim_files or loc.universal:
        return missing_files(loc, ["mp_rank_00_model_states.pt"], "the model states file of model-parallel rank 0")
    mp = loc.optim_files[0].mp_rank
    stage = None
    try:
        osd = load_all(loc.optim_files[:1], getattr(loc, "storage_options", None))[0].get("optimizer_state_dict")
        stage = int(osd.get("zero_stage")) if isinstance(osd, dict) and osd.get("zero_stage") is not None else None
    except (ZckptError, OSError, TypeError, ValueError, AttributeError):
        pass  # a damaged optimizer file: name the ZeRO-1/2 model file, the one every other layout has
    if stage == 3:
        ranks = sorted({f.dp_rank for f in loc.optim_files})
        return missing_files(loc, [f"zero_pp_rank_{r}_mp_rank_{mp:02d}_model_states.pt" for r in ranks],
                             f"ZeRO-3 model states of {_ranks(ranks)} of {ranks[-1] + 1}")
    return missing_files(loc, [f"mp_rank_{mp:02d}_model_states.pt"],
                         f"the model states file of model-parallel rank {mp}")


def _ranks(ranks) -> str:
    """``rank 2``, ``ranks 0-3, 6, 9-10``: runs of three or more as ranges."""
    ranks = sorted(ranks)
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = []
    for run in runs:
        parts += [f"{run[0]}-{run[-1]}"] if len(run) > 2 else [str(r) for r in run]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _optim_prefix(name: str) -> str:
    return name.split("zero_pp_rank_")[0]


def _memory(t) -> tuple | None:
    """Where a ``module`` tensor's bytes are (storage, offset, shape, stride): equal for tied parameters."""
    if not isinstance(t, LazyTensor) or not t.numel:
        return None
    return (t.storage.path, t.storage.key, t.storage_offset, tuple(t.shape), tuple(t.stride))


def common_records(loc: Location, ms0: dict, trainable: dict[str, TensorRecord], frozen: dict[str, TensorRecord],
                   lp_dtype: str, module_has_params: bool = True) -> list[TensorRecord]:
    """Assemble the final record list in ``module`` order: buffers and params from their sources, tied aliases,
    and (ZeRO-1 / BF16 optimizer) frozen weights that exist only in ``module``."""
    module = ms0.get("module") or {}
    buffer_names = list(ms0.get("buffer_names") or [])
    shared = dict(ms0.get("shared_params") or {})
    records: dict[str, TensorRecord] = {}
    mpath = loc.model_files[0].path

    def module_record(name, kind):
        t = module.get(name)
        if not isinstance(t, LazyTensor):
            raise CorruptFile(f"'{name}' is listed but has no tensor in 'module'", path=mpath)
        return TensorRecord(name, tuple(t.shape), kind, t.dtype, pieces_of(t),
                            lp_dtype=t.dtype if kind == "frozen" else None)

    seen: dict[tuple, str] = {}  # where each parameter's module tensor is -> its name
    order = list(module.keys())
    for extra in list(trainable) + list(frozen) + list(shared) + buffer_names:
        if extra not in module:
            order.append(extra)
    for name in order:
        mem = _memory(module.get(name))
        tie = seen.get(mem) if mem is not None else None
        if mem is not None and name not in buffer_names and name not in shared:
            seen.setdefault(mem, name)
        if name in trainable:
            records[name] = trainable[name]
        elif name in frozen:
            records[name] = frozen[name]
        elif name in shared:
            src = shared[name]
            if src not in trainable and src not in frozen and src not in module:
                raise CorruptFile(f"tied parameter '{name}' points to unknown '{src}'", path=mpath)
            records[name] = None  # filled below, once the source is known
        elif name in buffer_names:
            records[name] = module_record(name, "buffer")
        elif name in module and module_has_params and tie is not None:
            # the very bytes of a parameter already seen: a tie whose shared_params entry is missing (DeepSpeed
            # fills shared_params on global rank 0 only; with a 0.17.1+ writer engine another rank writes the file)
            shared[name] = tie
            records[name] = None
        elif name in module and module_has_params:
            # in module but in no optimizer group: a frozen weight of ZeRO-1 / BF16 optimizer (or a zero-size param)
            records[name] = module_record(name, "frozen")
    for name, rec in list(records.items()):
        if rec is None:
            src = shared[name]
            while src in shared and shared[src] != src:  # chains of aliases
                src = shared[src]
            base = records.get(src)
            shape = base.shape if base is not None else tuple(module[src].shape)
            records[name] = TensorRecord(name, shape, "tied", base.dtype if base else lp_dtype, tied_to=src,
                                         lp_dtype=base.lp_dtype if base else lp_dtype)
    return list(records.values())
