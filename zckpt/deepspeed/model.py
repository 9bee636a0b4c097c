"""What the DeepSpeed readers share beyond the format-neutral model: reading rank files' metadata, checking ranks,
the precision a config says, assembling records in ``module`` order.

The model itself (:class:`Checkpoint`, :class:`TensorRecord`, :class:`GroupInfo`, :func:`check_records`...) lives in
:mod:`zckpt.state.model`, shared with the DCP reader; its names are re-exported here so the readers (:mod:`zero0`,
:mod:`zero12`, :mod:`zero3`, :mod:`pipeline`, :mod:`moe`, :mod:`tp`, :mod:`universal_read`) import from here only;
:mod:`zckpt.deepspeed.reader` picks the reader.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

from zckpt.encoding import safeload
from zckpt.io import storage
from zckpt.state.model import (  # noqa: F401 - the format-neutral model, re-exported for the DeepSpeed readers
    LP_DTYPES, MODEL_STATE_KEYS, STATE_DTYPES, Checkpoint, GroupInfo, Location, Piece, RankFile, TensorRecord,
    check_records, metadata_errors, pieces_of, scalar_value, uniform_dtype,
)
from zckpt.errors import CorruptFile, IncompleteCheckpoint, InvalidArgument, ZckptError
from zckpt.encoding.safeload import LazyTensor

log = logging.getLogger(__name__)

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



# ---------------------------------------------------------------------------------------- open_checkpoint

def load_all(files: list[RankFile], storage_options: dict | None = None) -> list[dict]:
    """Every file's metadata (:func:`zckpt.encoding.safeload.load`); ``storage_options``: for files behind URLs."""
    def one(f: RankFile):
        obj = safeload.load(f.path, storage_options=storage_options, size_hint=f.size if f.size >= 0 else None)
        if not isinstance(obj, dict):
            raise CorruptFile(f"expected a dict at the top level, found {type(obj).__name__}", path=f.path)
        return obj

    if len(files) > 1 and storage.is_url(files[0].path):  # each file's round trips beside the others'
        with ThreadPoolExecutor(min(16, len(files))) as pool:
            return list(pool.map(one, files))
    return [one(f) for f in files]

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
                                "an earlier tag with `tag`")


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


_SCALAR_STORAGE = 1 << 16  # a one-element state tensor's storage read whole (CRC-checked) up to this size


def _element_bytes(t: LazyTensor, storage_options: dict | None) -> bytes | None:
    """The bytes of a one-element tensor, its storage's CRC-32 checked (None: a storage too large to read whole)."""
    import zlib
    ref = t.storage
    if ref.nbytes > _SCALAR_STORAGE or ref.offset < 0:
        return None
    raw = storage.read_range(ref.path, ref.offset, ref.nbytes, storage_options)
    if len(raw) != ref.nbytes or (ref.crc is not None and zlib.crc32(raw) != ref.crc):
        raise CorruptFile(f"storage {ref.key} fails its CRC check (the file is damaged)", path=ref.path)
    at = t.storage_offset * t.itemsize
    return bytes(raw[at:at + t.itemsize])


def same_scalar(vs: list, storage_options: dict | None = None) -> bool:
    """Every rank's value is a one-element tensor (shape ``[]`` or ``[1]``) of one dtype and shape holding the
    same bytes: a scalar the optimizer keeps per partition (DeepSpeed's own ``HybridStateOptimizer`` test:
    ``tensor_step``), carried as saved by a reshard, as ``step`` is."""
    if not vs or not all(isinstance(t, LazyTensor) and t.numel == 1 and len(t.shape) <= 1 for t in vs):
        return False
    if len({(t.dtype, tuple(t.shape)) for t in vs}) > 1:
        return False
    values = [_element_bytes(t, storage_options) for t in vs]
    return values[0] is not None and all(v == values[0] for v in values)


def elementwise_state(states: list, reals: list[int], sizes: list[int], where: str, paths: list[str],
                      storage_options: dict | None = None):
    """The per-element optimizer state of one flat group, from each rank's state dict (``states[r]``; ``reals``:
    the partition's elements without padding, ``sizes``: with): (keys laid out like the partition, in the
    optimizer's order; the first key that is a tensor of another size: factored or per-group state, which
    cannot be re-partitioned, as ``(key, description)``, or None). Other values (``step``, counters, a
    one-element tensor equal on every rank: :func:`same_scalar`) are not elementwise and are carried as saved;
    a one-element tensor that differs between ranks is per-partition state, refused like a factored one."""
    if all(st is None for st in states):
        return [], None
    if any(st is None for st in states):
        r = next(i for i, st in enumerate(states) if st is None)
        raise CorruptFile(f"{where}: rank {r} has no optimizer state, rank 0 has", path=paths[r])
    keys, odd = [], None
    for key, v in states[0].items():
        if key == "step" or not isinstance(v, LazyTensor):
            continue
        vs = [st.get(key) for st in states]
        elem = all(isinstance(t, LazyTensor) and len(t.shape) == 1 and t.numel in (reals[r], sizes[r]) and
                   t.numel >= reals[r] for r, t in enumerate(vs))
        if elem:
            keys.append(str(key))
        elif odd is None and v.numel == 1 and len(v.shape) <= 1 and not (len(vs) == 1 and len(v.shape) == 0):
            if not same_scalar(vs, storage_options):  # ([] on one rank: carried as saved, as it always was)
                odd = (str(key), f"a one-element tensor {list(v.shape)} whose value differs between ranks")
        elif (len(v.shape) or v.numel != 1) and odd is None:
            odd = (str(key), f"{list(v.shape)} where the partition has {sizes[0]} elements")
    return keys, odd


# ------------------------------------------------------------------------------------------------ ties

#: ties the user declared for ``module`` entries in no optimizer group: name -> the parameter it is a second name
#: of, or None (a parameter of its own); see :func:`declared_ties`
_DECLARED_TIES: ContextVar[dict | None] = ContextVar("zckpt_declared_ties", default=None)


@contextlib.contextmanager
def declared_ties(ties: dict[str, str | None] | None):
    """Within the block, checkpoints are opened with these ties declared (the CLI's ``--tie NAME=PARAM`` and
    ``--no-tie NAME``): ``{name: param}``, ``name`` is a second name of ``param``; ``{name: None}``, ``name`` is a
    parameter of its own. Needed only where the files cannot tell (``Checkpoint.ambiguous_ties``)."""
    token = _DECLARED_TIES.set(dict(ties) if ties else None)
    try:
        yield
    finally:
        _DECLARED_TIES.reset(token)


def set_declared_ties(ties: dict[str, str | None] | None) -> None:
    """:func:`declared_ties` for the rest of the current context (one CLI command)."""
    _DECLARED_TIES.set(dict(ties) if ties else None)


def _autoep_router_alias(ms0: dict, name: str, trainable: dict) -> str | None:
    """``{module_path}.router.{p}`` when ``name`` is ``{module_path}.{alias}.{p}`` of an AutoEP layer
    (``ds_autoep_layers``): the router's second name (``setattr(layer, router_name, layer.router)`` in
    ``auto_ep_layer``), which ``shared_params`` misses (``named_children`` yields the module once)."""
    module = ms0.get("module") or {}
    for layer in ms0.get("ds_autoep_layers") or []:
        path = layer.get("module_path") if isinstance(layer, dict) else None
        if not isinstance(path, str) or not name.startswith(f"{path}."):
            continue
        child, _, rest = name[len(path) + 1:].partition(".")
        target = f"{path}.router.{rest}"
        if child != "router" and rest and target in trainable and \
                getattr(module.get(target), "dtype", None) == getattr(module.get(name), "dtype", None):
            return target
    return None


def unlisted_params(ms0: dict, trainable: dict[str, TensorRecord], frozen: dict[str, TensorRecord], path: str,
                    storage_options: dict | None = None) -> tuple[dict, list[tuple[str, str]]]:
    """The ``module`` entries of a ZeRO-1/2 file that are no listed parameter, buffer or recorded tie.

    ``param_shapes`` lists the optimizer's parameters, ``frozen_param_shapes`` (ZeRO-2) those with
    ``requires_grad=False`` or no elements: a trainable parameter in no param group (an empty group, a module
    attached after ``deepspeed.initialize``) is in neither, and DeepSpeed loads it from ``module``. Ties come only
    from what the files say: ``shared_params``, storage shared in ``module`` (:func:`common_records`), AutoEP's
    router alias (``ds_autoep_layers``), and ties the user declared (:func:`declared_ties`). Equal bytes never make
    a tie; an entry holding the very bytes of a trainable parameter's training-dtype copy (where the master differs
    in dtype, so a tie and a separate parameter read differently) is returned as ambiguous. Returns
    (``ms0`` with the ties added to ``shared_params``, the ambiguous (entry, parameter) pairs)."""
    module = ms0.get("module") or {}
    shared = dict(ms0.get("shared_params") or {})
    listed = set(trainable) | set(frozen) | set(shared) | set(ms0.get("buffer_names") or [])
    extra = [n for n, t in module.items() if n not in listed and isinstance(t, LazyTensor)]
    declared = dict(_DECLARED_TIES.get() or {})
    for name, src in declared.items():
        if name not in extra:
            raise InvalidArgument(f"'{name}' is not a module entry outside the optimizer's groups"
                                  + (f" ({', '.join(extra[:4])} are)" if extra else " (there is none)"),
                                  param="--tie" if src else "--no-tie", path=path)
        if src is not None and src not in trainable and src not in frozen:
            raise InvalidArgument(f"'{src}' is not a parameter of this checkpoint", param="--tie", path=path)
    saved_at = {}
    for n in list(trainable) + list(frozen):
        mem = _memory(module.get(n))
        if mem is not None:
            saved_at.setdefault(mem, n)
    digests: dict[str, str] = {}

    def digest(n: str) -> str:
        if n not in digests:
            h = hashlib.sha256()
            for p in pieces_of(module[n]):
                h.update(storage.read_range(p.path, p.offset, p.nbytes, storage_options))
            digests[n] = h.hexdigest()
        return digests[n]

    ambiguous = []
    for name in extra:
        t = module[name]
        if name in declared:
            if declared[name] is not None:
                shared[name] = declared[name]
            continue
        if _memory(t) in saved_at:  # the very storage of a listed parameter: common_records ties it
            continue
        alias = _autoep_router_alias(ms0, name, trainable)
        if alias is not None:
            shared[name] = alias
            continue
        same = [n for n, rec in trainable.items() if isinstance(module.get(n), LazyTensor) and t.numel
                and (tuple(module[n].shape), module[n].dtype) == (tuple(t.shape), t.dtype) and rec.dtype != t.dtype
                and digest(n) == digest(name)]
        if same:
            ambiguous.append((name, same[0]))
    return (dict(ms0, shared_params=shared) if shared != dict(ms0.get("shared_params") or {}) else ms0), ambiguous


def common_records(loc: Location, ms0: dict, trainable: dict[str, TensorRecord], frozen: dict[str, TensorRecord],
                   lp_dtype: str, module_has_params: bool = True, no_group: bool = False) -> list[TensorRecord]:
    """Assemble the final record list in ``module`` order: buffers and params from their sources, tied aliases,
    and weights that exist only in ``module``: frozen ones of ZeRO-1 / the BF16 optimizer (which do not list
    them), parameters in no optimizer group (``no_group``: ZeRO-2, which lists every frozen one; ZeRO-3: a full
    tensor in ``module`` where the partitioned parameters have empty placeholders)."""
    module = ms0.get("module") or {}
    buffer_names = list(ms0.get("buffer_names") or [])
    shared = dict(ms0.get("shared_params") or {})
    records: dict[str, TensorRecord] = {}
    mpath = loc.model_files[0].path

    def module_record(name, kind, outside=False):
        t = module.get(name)
        if not isinstance(t, LazyTensor):
            raise CorruptFile(f"'{name}' is listed but has no tensor in 'module'", path=mpath)
        return TensorRecord(name, tuple(t.shape), kind, t.dtype, pieces_of(t),
                            lp_dtype=t.dtype if kind == "frozen" else None, no_group=outside)

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
            # in module but in no optimizer group: a frozen weight of ZeRO-1 / BF16 optimizer (or a zero-size
            # param), or (ZeRO-2, which lists the frozen ones) a trainable parameter in no group
            records[name] = module_record(name, "frozen", outside=no_group and bool(getattr(module[name], "numel", 0)))
        elif isinstance(module.get(name), LazyTensor) and module[name].numel:
            # ZeRO-3: a full tensor where partitioned parameters have placeholders: a parameter DeepSpeed never
            # partitioned (attached after deepspeed.initialize), in no group; DeepSpeed loads it from 'module'
            records[name] = module_record(name, "frozen", outside=True)
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
