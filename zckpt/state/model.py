"""The training-state model every reader produces and every writer consumes, whatever the format.

A :class:`Checkpoint` lists :class:`TensorRecord` s in the model's ``state_dict`` order; each holds ``Piece``
lists (file, byte offset, element count, dtype) for its value and, for trainable parameters, the master weights
and both Adam moments, in the dtypes the files store. Concatenating a list's pieces gives the flat tensor. Every
reader's records pass :func:`check_records` when the :class:`Checkpoint` is built. :class:`GroupInfo` holds each
optimizer param group's hyperparameters and step; :class:`Location` says where the files are.

Readers (:mod:`zckpt.state.open` asks each in turn): DeepSpeed (:mod:`zckpt.deepspeed.reader` picks one of its readers) and PyTorch DCP (:mod:`zckpt.dcp.reader`);
``Checkpoint.format`` says which. Writers and consumers (:mod:`zckpt.ops.merge`, :mod:`zckpt.ops.reshard`,
:mod:`zckpt.ops.verify`...) read this model only; nothing here knows a file format.
"""

from __future__ import annotations

import contextlib
import math
import struct
import threading
from itertools import repeat
from dataclasses import dataclass, field
from typing import Any

from zckpt.encoding import safeload
from zckpt.encoding.dcpmeta import cut, runs_in
from zckpt.io import storage
from zckpt.engine.segments import Piece
from zckpt.errors import CorruptFile, UnsupportedLayout, ZckptError
from zckpt.encoding.safeload import LazyTensor
from zckpt.units import format_size


@dataclass
class RankFile:
    path: str
    name: str
    kind: str  # "model" or "optim" (DeepSpeed); "data" or "metadata" (DCP)
    dp_rank: int | None
    mp_rank: int
    size: int = -1
    index: int | None = None  # layer files: the pipeline layer index; expert files: the MoE layer id
    expert: int | None = None  # expert files: the global expert id

    def __repr__(self) -> str:
        return f"<RankFile {self.name!r} ({self.kind}, {format_size(self.size) if self.size >= 0 else '? B'})>"


@dataclass
class Location:
    """Where a checkpoint's files are."""

    input_path: str
    save_dir: str
    tag: str
    tag_dir: str
    trainer_dir: str | None
    model_files: list[RankFile] = field(default_factory=list)
    optim_files: list[RankFile] = field(default_factory=list)
    other_files: list[str] = field(default_factory=list)
    has_latest: bool = False
    layer_files: list[RankFile] = field(default_factory=list)  # pipeline: layer_XX-model_states.pt
    expert_files: list[RankFile] = field(default_factory=list)  # MoE: layer_L_expert_E_mp_rank_XX_model_states.pt
    data_files: list[RankFile] = field(default_factory=list)  # DCP: the .distcp files, then .metadata
    universal: bool = False  # a universal checkpoint: optim_files are zero/optimizer_state.pt, zero/<param>/*.pt
    # the fsspec options its files are read with (URLs); passed to every read, never kept process-wide, never shown
    storage_options: dict | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        files = len(self.model_files) + len(self.optim_files) + len(self.layer_files) + len(self.expert_files) \
            + len(self.data_files)
        return f"<Location {self.input_path!r} tag {self.tag!r}: {files} files>"


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
    # elementwise optimizer state other than Adam's moments, key -> pieces laid out like ``value`` (SGD's
    # momentum_buffer, Lion's exp_avg when there is no exp_avg_sq), in the optimizer's key order
    other_state: dict = field(default_factory=dict)
    # a trainable parameter (requires_grad) in no optimizer param group, kind "frozen": its value is the module's,
    # in its dtype, with no optimizer state (an empty param group, a module attached after deepspeed.initialize)
    no_group: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        extra = f" -> {self.tied_to!r}" if self.tied_to else f", {len(self.value)} piece(s)"
        return f"<TensorRecord {self.name!r} {self.kind} {list(self.shape)} {self.dtype}{extra}>"

    @property
    def state_dtype(self) -> str | None:
        """The dtype the Adam moments are stored in (None when the checkpoint has none)."""
        return self.exp_avg[0].dtype if self.exp_avg else None


_PIECE_LISTS = ("value", "exp_avg", "exp_avg_sq")
_BUILDING = threading.RLock()  # one build at a time (a record read from two threads is built once)


def _deferred(name: str) -> property:
    key = "_" + name

    def get(self):
        if self._build is not None:
            self.build()
        return self.__dict__[key]

    def put(self, pieces):
        if getattr(self, "_build", None) is not None:  # the others keep what the build gives them
            self.build()
        self.__dict__[key] = pieces
    return property(get, put)


class DeferredRecord(TensorRecord):
    """A :class:`TensorRecord` whose piece lists (``value``, ``exp_avg``, ``exp_avg_sq``) are built when first read,
    by ``build()`` -> the three lists (an empty list: none), and checked then (:func:`check_records`): a checkpoint of
    10**6 chunks opens (info, plain verify's metadata) without placing the 10**7 pieces of its row-parallel weights
    that only a command reading values needs. Everything else is known at open: ``state_dtype`` (the moments'
    dtype, None: none) without a build, so what describes the checkpoint builds nothing. ``dataclasses.replace``,
    ``==`` and ``copy`` see the built lists."""

    value = _deferred("value")
    exp_avg = _deferred("exp_avg")
    exp_avg_sq = _deferred("exp_avg_sq")

    def __init__(self, *args, build=None, state_dtype=None, path: str | None = None, **kwargs):
        self._build = None
        super().__init__(*args, **kwargs)
        self._state_dtype, self._path = state_dtype, path
        self._build = build  # (after the init: its defaults are not what the build gives)

    def build(self) -> None:
        """Build the piece lists now (once) and check them; a damaged layout raises here, naming the file."""
        with _BUILDING:
            build = self._build
            if build is None:
                return
            lists = build()
            d = self.__dict__
            for name, pieces in zip(_PIECE_LISTS, lists):
                d["_" + name] = pieces
            self._build = None
            try:
                check_records([self], self._path)
                got = self.exp_avg[0].dtype if self.exp_avg else None
                if got != self._state_dtype:
                    raise CorruptFile(f"'{self.name}': exp_avg is stored as {got}, its metadata says "
                                      f"{self._state_dtype}", path=self._path)
            except BaseException:
                self._build = build  # (not built: every read of a damaged record raises, none gets its lists)
                raise

    @property
    def pending(self) -> bool:
        """True until the piece lists are built."""
        return self._build is not None

    @property
    def state_dtype(self) -> str | None:
        return self._state_dtype if self._build is not None else TensorRecord.state_dtype.fget(self)

    def __getstate__(self):  # (a copy or pickle holds the built lists, never the build)
        self.build()
        return self.__dict__

    def __repr__(self) -> str:
        if self._build is not None:
            return f"<TensorRecord {self.name!r} {self.kind} {list(self.shape)} {self.dtype}, pieces not built>"
        return super().__repr__()


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
        if rec.kind == "tied" or getattr(rec, "pending", False):  # (a DeferredRecord checks itself when built)
            continue
        lists = [("value", rec.value)]
        if rec.exp_avg or rec.exp_avg_sq:
            lists += [("exp_avg", rec.exp_avg), ("exp_avg_sq", rec.exp_avg_sq)]
        lists += [(key, pieces) for key, pieces in rec.other_state.items()]
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

    def __repr__(self) -> str:
        return f"<GroupInfo {self.index}: {len(self.names)} params, step {self.step}, lr {self.hyperparams.get('lr')}>"


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
    # why the optimizer state the files hold cannot be carried (None: it can): the weights are read exactly, but
    # whatever carries the whole training state (convert, resume) must refuse rather than drop it
    state_refusal: str | None = None
    # (name, parameter): a ``module`` entry in no optimizer group holding the very bytes of a trainable parameter's
    # training-dtype copy, with no tie recorded: a separate parameter (its value is that copy) or an unrecorded tie
    # (its value is the master) cannot be told apart; what reads values refuses until a tie is declared
    # (:func:`zckpt.deepspeed.model.declared_ties`, ``--tie`` / ``--no-tie``); info and verify report it
    ambiguous_ties: list = field(default_factory=list)
    format: str = "deepspeed"  # the reader that built it: "deepspeed", "dcp" or "megatron"
    extra: dict = field(default_factory=dict)  # facts only one format has (DCP: its key scheme, scalars)

    def __post_init__(self):
        check_records(self.records, self.location.tag_dir)

    def __repr__(self) -> str:
        """What a REPL user wants first: where, which layout, how big (the full model is in ``records``)."""
        files = self.files
        params = sum(r.numel for r in self.records if r.kind in ("trainable", "frozen"))
        layout = f"{self.format} ZeRO-{self.stage} {self.precision}" if self.format == "deepspeed" \
            else f"{self.format} {self.precision}"
        return (f"<Checkpoint {self.location.input_path!r} tag {self.tag!r}: {layout}, world size "
                f"{self.world_size}, {len(self.records)} tensors ({params:,} parameters), {len(files)} files, "
                f"{format_size(sum(max(f.size, 0) for f in files))}>")

    @property
    def master_dtypes(self) -> list[str]:
        """The dtypes the trainable parameters' master weights are stored in (e.g. ["float32"])."""
        return sorted({r.dtype for r in self.records if r.kind == "trainable"})

    @property
    def no_group(self) -> list[TensorRecord]:
        """Trainable parameters in no optimizer param group (read from ``module``, no optimizer state)."""
        return [r for r in self.records if r.no_group]

    @property
    def other_state_keys(self) -> list[str]:
        """Elementwise optimizer-state keys other than Adam's moments (e.g. ``momentum_buffer``)."""
        return list(dict.fromkeys(k for r in self.records for k in r.other_state))

    def check_ties(self) -> None:
        """Refuse reading values while a tie cannot be told from a separate parameter (``ambiguous_ties``)."""
        if self.ambiguous_ties:
            name, other = self.ambiguous_ties[0]
            more = f" (and {len(self.ambiguous_ties) - 1} more)" if len(self.ambiguous_ties) > 1 else ""
            raise UnsupportedLayout(
                f"'{name}' is in no optimizer group and holds the very bytes of '{other}'{more}, with no tie "
                "recorded: a separate parameter and an unrecorded tie cannot be told apart", path=self.location.tag_dir,
                hint=f"pass --no-tie {name} if it is a parameter of its own, --tie {name}={other} if it is a second "
                     f"name of '{other}'")

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
        return loc.model_files + loc.layer_files + loc.expert_files + loc.optim_files + loc.data_files

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


LP_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

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


def dcp_pieces(items, te, path: str, start: int = 0, length: int | None = None, cache: dict | None = None) -> list:
    """The elements ``[start, start + length)`` of a DCP tensor's row-major flat form (default: all of it; ``te``: a
    :class:`~zckpt.encoding.dcpmeta.TensorEntry`, its items read by ``items``, a :class:`zckpt.encoding.distcp.Items`)
    as :class:`~zckpt.engine.segments.Piece` s, in order: a run of a contiguous chunk is one piece, placed from the
    chunk's layout without a LazyTensor call per run. A row-parallel weight has a run per row and chunk: its whole
    rows are placed a block of rows at a time (:meth:`~zckpt.encoding.dcpmeta.Grid.blocks`), each chunk's pieces
    made in one pass. ``cache``: kept across calls, so a chunk's zip is placed once when a tensor is taken in
    several ranges."""
    end = te.numel if length is None else start + length
    placed = {} if cache is None else cache
    if te.runs is None and te.grid is None:
        cut(te, path)
    g = te.grid
    if g is None or end - start < 2 * g.row:
        return _run_pieces(items, te, path, start, end, placed)
    a, b = -(-start // g.row) * g.row, end // g.row * g.row  # the whole rows of the range: [a, b)
    dtype, out = te.dtype, _run_pieces(items, te, path, start, a, placed)
    for r, count, chunks, pos in g.blocks(te.shape, a // g.row, b // g.row):
        cols = placed.get(id(chunks))  # (the grid keeps one list of chunks per cell prefix)
        if cols is None:
            cols = placed[id(chunks)] = [_placed(items, te, c, placed) for c in chunks]
        if any(w[1] is None for w in cols):  # a chunk saved with strides of its own: element runs
            out += _run_pieces(items, te, path, r * g.row, (r + count) * g.row, placed)
            continue
        block, step = [None] * (count * len(cols)), len(cols)
        for j, (w, n) in enumerate(zip(cols, g.widths)):
            if (pos + count) * n > w[4]:  # (grid cells are checked against the shape: a damaged layout)
                raise CorruptFile(f"slice [{pos * n}, {(pos + count) * n}) outside a DCP chunk of {w[4]} elements "
                                  f"of '{te.key}'", path=w[1])
            nb = n * w[3]
            first = w[2] + pos * nb
            block[j::step] = map(Piece, repeat(w[1], count), range(first, first + count * nb, nb), repeat(n, count),
                                 repeat(dtype, count))
        out += block
    out += _run_pieces(items, te, path, b, end, placed)
    return out


def _placed(items, te, c, placed: dict) -> tuple:
    """How chunk ``c``'s elements are placed: (None, its file, the byte offset of its first element, the element
    size, its elements) when its zip holds them contiguously, else (its LazyTensor, None, 0, 0, 0)."""
    w = placed.get(id(c))  # (by identity: a chunk lives as long as its entry; hashing its fields costs more)
    if w is None:
        lay = items.layout(te, c)
        size = safeload.DTYPE_SIZES[te.dtype]
        if lay.contiguous:  # (as flat_runs places it: the chunk's bytes from its layout)
            w = (None, items.path(c.file), c.offset + lay.data_offset + lay.storage_offset * size, size, c.numel)
        else:
            w = (items.tensor(te, c), None, 0, 0, 0)
        placed[id(c)] = w
    return w


def _run_pieces(items, te, path: str, start: int, end: int, placed: dict) -> list:
    """:func:`dcp_pieces` a run at a time (any chunking; a range inside a row of a grid)."""
    dtype, out = te.dtype, []
    if end <= start:
        return out
    for flat, c, local, n in runs_in(te, start, end, path):
        lo, hi = max(flat, start), min(flat + n, end)
        if lo >= hi:
            continue
        w = _placed(items, te, c, placed)
        local, n = local + lo - flat, hi - lo
        if w[1] is None:
            out += pieces_of(w[0], local, n)  # (a chunk saved with strides of its own: element runs)
        elif local + n > w[4]:  # (runs come from checked chunk geometry: a damaged layout, never a real save)
            raise CorruptFile(f"slice [{local}, {local + n}) outside a DCP chunk of {w[4]} elements of "
                              f"'{te.key}'", path=w[1])
        else:
            out.append(Piece(w[1], w[2] + local * w[3], n, dtype))
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
