"""ZeRO-0 (no ZeRO optimizer): one model-states file holds the weights and the whole optimizer.

DeepSpeed 0.19.8 writes, for any data-parallel world size, only ``<tag>/mp_rank_00_model_states.pt``::

    module            the full model state_dict in the training dtype (bf16/fp16/fp32); a tied weight appears
                      under each name, the same storage (``shared_params`` is None: ties are seen by storage)
    buffer_names      persistent buffers
    param_shapes      None (no flat groups), frozen_param_shapes / shared_params: None
    dp_world_size     the data-parallel size (every rank held a full replica)
    optimizer         what ``engine.optimizer.state_dict()`` returned:

      bf16/fp16, unfused client optimizer: FP16_UnfusedOptimizer
        {dynamic_loss_scale, cur_scale, cur_iter[, last_overflow_iter, scale_factor, scale_window],
         optimizer_state_dict: torch state_dict (state[id] = {step, exp_avg, exp_avg_sq}, full shapes),
         fp32_groups: [[full-shape fp32 master per trainable param of group g]]}
      bf16/fp16, fused client optimizer (FusedAdam): FP16_Optimizer
        {..., optimizer_state_dict (state[g] = flat moments), fp32_groups_flat: [flat fp32 masters of group g],
         clip_grad}; the group's module params are views of one flat lp buffer (shared storage, offsets)
      fp32: the client torch optimizer's own state_dict {state, param_groups}: the module weights are the masters

FP16_Optimizer's mapping is exact (shared storage, see :func:`_fused`). For the others the mapping is read or
proven, never taken from positions (a client may list a group's params in any order; DeepSpeed saves no names at
stage 0): the ``param_names`` torch saves in each param group when the optimizer was built from
``named_parameters()`` name the masters; otherwise a master may belong to any module parameter of its shape, and
with fp32 masters of bf16/fp16 weights the values narrow that down (the optimizer copies each master into its
parameter, so the right pair agrees once the master is rounded: the first ``SAMPLE`` elements, then the whole
tensors). A parameter left as a master's only choice is its owner (:func:`match_groups`). Masters that still
fit several parameters (two LayerNorm weights that round to the same bf16 values) are refused in one line: a
guess would silently swap them. fp32 without ``param_names``: the weights are the module's (exact), but Adam
moments of same-shaped params cannot be placed; they are left out with a note and every param is reported as
frozen. Parameters no group takes are frozen. Merge takes the masters (what the optimizer would continue
from), not the low-precision module copies.
"""

from __future__ import annotations

import hashlib
import zlib

from zckpt.encoding import casting, zipentries
from zckpt.io import storage
from zckpt.deepspeed.discover import Location
from zckpt.deepspeed.model import (
    LP_DTYPES, Checkpoint, GroupInfo, TensorRecord, common_records, pieces_of, precision_of, scalar_value, uniform_dtype,
)
from zckpt.errors import CorruptFile, UnsupportedLayout
from zckpt.encoding.safeload import LazyTensor


REFUSAL = ("ZeRO-0 checkpoint: every rank holds the whole model and optimizer in mp_rank_00_model_states.pt, "
           "so DeepSpeed loads it at any data-parallel size as it is; converting it to ZeRO-1/2/3 is not supported")


def build(loc: Location, model_states: list[dict]) -> Checkpoint:
    ms0 = model_states[0]
    mpath = loc.model_files[0].path
    if len(loc.model_files) != 1:
        raise CorruptFile(f"ZeRO-0 checkpoint with {len(loc.model_files)} model-states files", path=loc.tag_dir)
    module = ms0.get("module")
    if not isinstance(module, dict):
        raise CorruptFile("ZeRO-0 model-states file without a 'module' state dict", path=mpath)
    candidates, tied = module_params(module, ms0.get("buffer_names"))
    precision = precision_of(ms0, module)
    trainable, groups, notes = read_optimizer(ms0.get("optimizer"), candidates, precision, mpath,
                                              loc.storage_options)

    ms = dict(ms0, shared_params=tied)  # ties as common_records expects them (DeepSpeed saves None at ZeRO-0)
    records = common_records(loc, ms, trainable, {}, LP_DTYPES[precision])
    ws = ms0.get("dp_world_size")
    ws = int(ws) if isinstance(ws, int) and ws > 0 else 1
    ckpt = Checkpoint(loc, 0, "zero0", precision, ws, records, groups, ms0, [], model_states,
                      reshard_refusal=REFUSAL)
    ckpt.notes += notes
    ckpt.state_refusal = next((n for n in notes if isinstance(n, StateNotRead)), None)
    return ckpt


class StateNotRead(str):
    """A note saying the files hold optimizer state that cannot be placed (the checkpoint's ``state_refusal``).
    ``params``: how many parameters that state is for (trainable ones, reported among the frozen since their state
    has no owner), or None where unknown."""

    params: int | None = None

    @classmethod
    def of(cls, text: str, params: int | None) -> "StateNotRead":
        note = cls(text)
        note.params = params
        return note


def module_params(module: dict, buffer_names) -> tuple[list[tuple[str, LazyTensor]], dict[str, str]]:
    """(name, tensor) of every parameter of ``module`` that is not a buffer or a tied alias, and the ties."""
    buffers = set(buffer_names or [])
    params = [(n, t) for n, t in module.items() if n not in buffers and isinstance(t, LazyTensor)]
    tied = _ties(params)
    return [(n, t) for n, t in params if n not in tied], tied


def read_optimizer(opt, candidates: list[tuple[str, LazyTensor]], precision: str, path: str,
                   storage_options: dict | None = None) -> tuple[dict[str, TensorRecord], list[GroupInfo], list[str]]:
    """The trainable records, param groups and notes of a ZeRO-0 ``optimizer`` entry (what the engine's optimizer
    returned) for the module parameters ``candidates``; every other candidate is frozen."""
    notes: list[str] = []
    if opt is None:
        return {}, [], ["saved without optimizer state: every parameter is reported as frozen (module values)"]
    if not isinstance(opt, dict):
        raise CorruptFile(f"'optimizer' is a {type(opt).__name__}, not a state dict", path=path)
    if "fp32_groups" in opt:
        trainable, groups = _unfused(opt, candidates, path, storage_options)
    elif "fp32_groups_flat" in opt:
        trainable, groups = _fused(opt, candidates, path, storage_options)
    elif "state" in opt and "param_groups" in opt:
        trainable, groups, notes = _plain(opt, candidates, precision, path, storage_options)
    else:
        raise UnsupportedLayout("ZeRO-0 'optimizer' has neither fp32 master groups nor a torch optimizer state "
                                f"(keys: {', '.join(map(str, list(opt)[:8]))})", path=path)
    return trainable, groups, notes


def _ties(params: list[tuple[str, LazyTensor]]) -> dict[str, str]:
    """{alias: first name} for module entries that are the same tensor (same storage, offset, shape, stride)."""
    first: dict[tuple, str] = {}
    tied: dict[str, str] = {}
    for name, t in params:
        key = (t.storage.path, t.storage.key, t.storage_offset, tuple(t.shape), tuple(t.stride), t.dtype)
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    return tied


def match_groups(shapes: list[list[tuple]], candidates: list[tuple[str, tuple]], path: str,
                 fingerprint=None, names: list | None = None) -> list[list[str]]:
    """Names for each group's masters (group order), read or proven, never assumed from positions.

    ``names[g]`` (optional, per group; None where not saved): the ``param_names`` torch saved for group g (an
    optimizer built from ``named_parameters()``): used as they are, after checking each is a module entry of the
    master's shape (and, with ``fingerprint``, of its values). Elsewhere a master may be any module entry of its
    shape; ``fingerprint`` (optional, ``fingerprint(key, full)`` with key ``("m", g, j, dtype)`` for master j of
    group g rounded to ``dtype`` or ``("c", name)`` for a module entry; ``full``: the whole tensor instead of its
    first ``SAMPLE`` elements) removes the entries whose values differ. An entry left as a master's only option
    is its owner (and is taken from the others); a master with no option, or masters left with several, are
    refused with ``UnsupportedLayout``: the files cannot tell them apart, and a guess would silently swap
    weights. Parameters no master takes are frozen."""
    cshape = {n: tuple(s) for n, s in candidates}
    by_shape: dict[tuple, list[str]] = {}
    for n, s in candidates:
        by_shape.setdefault(tuple(s), []).append(n)
    options: dict[tuple[int, int], list[str]] = {}
    for g, want in enumerate(shapes):
        given = names[g] if names is not None and g < len(names) else None
        if given is not None and len(given) != len(want):
            raise CorruptFile(f"ZeRO-0: param group {g} names {len(given)} params but holds {len(want)} masters",
                              path=path)
        for j, shape in enumerate(want):
            if given is None:
                options[(g, j)] = list(by_shape.get(tuple(shape), []))
            elif cshape.get(given[j]) != tuple(shape):
                raise UnsupportedLayout(f"ZeRO-0: param group {g} names '{given[j]}' for a master of shape "
                                        f"{list(shape)}, which the module does not have", path=path)
            else:
                options[(g, j)] = [given[j]]
    if fingerprint is not None:
        for full in (False, True):
            for (g, j), opts in options.items():
                if full and len(opts) < 2:
                    continue
                options[(g, j)] = [n for n in opts if fingerprint(("m", g, j, n), full) == fingerprint(("c", n), full)]
                if not options[(g, j)] and names is not None and g < len(names) and names[g] is not None:
                    raise CorruptFile(f"ZeRO-0: the master of '{names[g][j]}' (param group {g}) does not round to "
                                      "its module weight", path=path)
            if all(len(o) < 2 for o in options.values()):
                break
    return _assign(shapes, options, path, "values and shape" if fingerprint is not None else "shape")


def _assign(shapes: list[list[tuple]], options: dict[tuple[int, int], list[str]], path: str,
            alike: str) -> list[list[str]]:
    """The one assignment of masters to module entries the options allow (forced choices only)."""
    owner: dict[str, tuple[int, int]] = {}
    pending = dict(options)
    while pending:
        progress = False
        for key in list(pending):
            left = [n for n in pending[key] if n not in owner]
            if not left:
                g, j = key
                taken = [n for n in pending[key] if n in owner]
                raise UnsupportedLayout(
                    f"ZeRO-0: master {j} of param group {g} (shape {list(shapes[g][j])}) fits no module parameter"
                    + (f" ('{taken[0]}' is param group {owner[taken[0]][0]}'s)" if taken else ""), path=path)
            if len(left) == 1:
                owner[left[0]] = key
                del pending[key]
                progress = True
        if not progress:
            (g, j), left = next((k, [n for n in v if n not in owner]) for k, v in pending.items())
            raise UnsupportedLayout(
                f"ZeRO-0: cannot tell which parameter master {j} of param group {g} belongs to ("
                + " or ".join(f"'{n}'" for n in left[:3]) + f" have the same {alike}; DeepSpeed saves no "
                "names at stage 0)", path=path,
                hint="build the optimizer from model.named_parameters() (torch then saves param_names), or "
                     "load the checkpoint with the same DeepSpeed engine")
    out = [[""] * len(want) for want in shapes]
    for name, (g, j) in owner.items():
        out[g][j] = name
    return out


SAMPLE = 256  # elements compared per (master, module weight) pair before the whole tensors are


def fingerprints(masters: list[list[LazyTensor]], module: dict[str, LazyTensor], storage_options: dict | None = None):
    """``fingerprint(key, full)`` for :func:`match_groups`: the bytes of a module entry, or of a master rounded to
    that entry's dtype (the optimizer copies every updated master into its low-precision parameter, so the right
    pair always agrees); the first ``SAMPLE`` elements, or (``full``) a sha256 of all of them. Cached."""
    cache: dict = {}

    def fingerprint(key, full: bool):
        if key[0] == "c":
            t, to, k = module[key[1]], None, (key, full)
        else:
            _, g, j, name = key
            t, to = masters[g][j], module[name].dtype
            k = (("m", g, j, to), full)
        if k not in cache:
            cache[k] = _digest(t, to, full, storage_options)
        return cache[k]

    return fingerprint


def first_damaged(tensors: list[LazyTensor], storage_options: dict | None = None) -> tuple[str, str] | None:
    """(file, zip entry) of the first storage of ``tensors`` whose bytes fail the CRC its zip directory gives, or
    None. Only on a failure path: it reads every storage named."""
    entries: dict[str, dict] = {}
    seen = set()
    for t in tensors:
        ref = t.storage
        if (ref.path, ref.offset) in seen:
            continue
        seen.add((ref.path, ref.offset))
        if ref.path not in entries:
            with storage.open_input(ref.path, storage_options) as f:
                entries[ref.path] = {e.data_offset: e for e in zipentries.read_entries(f, None, ref.path).values()}
        e = entries[ref.path].get(ref.offset)
        if e is not None and zlib.crc32(storage.read_range(ref.path, e.data_offset, e.size, storage_options)) != e.crc:
            return ref.path, e.name
    return None


def _digest(t: LazyTensor, to: str | None, full: bool, storage_options: dict | None):
    n = t.numel if full else min(t.numel, SAMPLE)
    h = hashlib.sha256() if full else None
    out = bytearray()
    step = 1 << 20
    for start in range(0, n, step):
        raw = b"".join(storage.read_range(p.path, p.offset, p.numel * t.itemsize, storage_options)
                       for p in pieces_of(t, start, min(step, n - start)))
        if to is not None and to != t.dtype:
            raw = bytes(casting.cast(raw, t.dtype, to))
        if h is not None:
            h.update(raw)
        else:
            out += raw
    return (to or t.dtype, h.hexdigest() if h is not None else bytes(out))


def _torch_state(osd: dict, path: str) -> tuple[list[list], dict]:
    if not isinstance(osd, dict) or not isinstance(osd.get("param_groups"), list):
        raise CorruptFile("ZeRO-0 optimizer has no torch optimizer_state_dict", path=path)
    ids = [list(pg.get("params") or []) for pg in osd["param_groups"]]
    state = osd.get("state") or {}
    return ids, state


def _saved_names(pgs: list, path: str) -> list | None:
    """Per param group, the ``param_names`` torch saves when the optimizer was built from ``named_parameters()``
    (None for a group without them)."""
    out = []
    for pg in pgs:
        got = pg.get("param_names") if isinstance(pg, dict) else None
        if got is not None and not (isinstance(got, (list, tuple)) and all(isinstance(n, str) for n in got)):
            raise CorruptFile("ZeRO-0: an optimizer param group's param_names is not a list of names", path=path)
        out.append(list(got) if got is not None else None)
    return out if any(n is not None for n in out) else None


def _group_info(g: int, pg: dict, state: dict, ids: list, names: list[str],
                storage_options: dict | None = None) -> GroupInfo:
    st = state.get(ids[0]) if ids else None
    has_step = isinstance(st, dict) and st.get("step") is not None
    step = scalar_value(st.get("step"), storage_options) if has_step else None
    return GroupInfo(g, {k: v for k, v in pg.items() if k not in ("params", "param_names")}, step, names)


def _moment(state: dict, pid, key: str, numel: int, path: str, name: str):
    st = state.get(pid)
    t = st.get(key) if isinstance(st, dict) else None
    if t is None:
        return None
    if not isinstance(t, LazyTensor) or t.numel != numel:
        raise CorruptFile(f"ZeRO-0: {key} of '{name}' does not match its parameter", path=path)
    return t


def _records_for(g: int, names: list[str], masters: list[LazyTensor], moments: list[tuple], candidates: dict,
                 path: str) -> dict[str, TensorRecord]:
    out = {}
    mdtype = uniform_dtype(masters, f"the master weights of param group {g}", path)
    have = all(ea is not None and eas is not None for ea, eas in moments)
    if have:
        uniform_dtype([t for pair in moments for t in pair], f"the Adam moments of param group {g}", path)
    for name, m, (ea, eas) in zip(names, masters, moments):
        lp = candidates[name]
        out[name] = TensorRecord(name, tuple(lp.shape), "trainable", mdtype, pieces_of(m),
                                 pieces_of(ea) if have else [], pieces_of(eas) if have else [],
                                 group=g, lp_dtype=lp.dtype)
    return out


def _unfused(opt: dict, candidates: list, path: str, storage_options: dict | None = None):
    """FP16_UnfusedOptimizer: ``fp32_groups[g][i]`` is the master of the torch optimizer's params[g][i]."""
    fp32 = opt["fp32_groups"]
    ids, state = _torch_state(opt.get("optimizer_state_dict"), path)
    if not isinstance(fp32, list) or len(fp32) != len(ids) or any(
            not isinstance(grp, list) or len(grp) != len(i) or not all(isinstance(t, LazyTensor) for t in grp)
            for grp, i in zip(fp32, ids)):
        raise CorruptFile("ZeRO-0: fp32_groups and the optimizer's param groups disagree", path=path)
    by = dict(candidates)
    pgs = opt["optimizer_state_dict"]["param_groups"]
    try:
        named = match_groups([[tuple(t.shape) for t in grp] for grp in fp32],
                             [(n, tuple(t.shape)) for n, t in candidates], path,
                             fingerprint=fingerprints(fp32, by, storage_options), names=_saved_names(pgs, path))
    except (UnsupportedLayout, CorruptFile) as exc:  # values that match nothing: damaged bytes say so first
        bad = first_damaged([t for grp in fp32 for t in grp] + [t for _, t in candidates], storage_options)
        if bad is not None:
            raise CorruptFile(f"{bad[1]} fails its CRC check (the values zckpt matches masters by are damaged)",
                              path=bad[0]) from exc
        raise
    trainable, groups = {}, []
    for g, (names, masters, pids) in enumerate(zip(named, fp32, ids)):
        moments = [(_moment(state, p, "exp_avg", m.numel, path, n), _moment(state, p, "exp_avg_sq", m.numel, path, n))
                   for n, m, p in zip(names, masters, pids)]
        trainable.update(_records_for(g, names, masters, moments, by, path))
        groups.append(_group_info(g, pgs[g], state, pids, names, storage_options))
    return trainable, groups


def _fused(opt: dict, candidates: list, path: str, storage_options: dict | None = None):
    """FP16_Optimizer: one flat fp32 master per group, the group's params back to back (no padding).

    The optimizer made each group's low-precision params views of one flat buffer (``p.data = flat[...]``), so in
    ``module`` the group's params share one storage and their storage offsets are their offsets in the flat
    master: the mapping is read, not guessed. A group whose buffer cannot be told apart (two storages of its size
    that could be it) is refused."""
    flats = opt["fp32_groups_flat"]
    ids, state = _torch_state(opt.get("optimizer_state_dict"), path)
    if not isinstance(flats, list) or len(flats) != len(ids) or not all(isinstance(t, LazyTensor) for t in flats):
        raise CorruptFile("ZeRO-0: fp32_groups_flat and the optimizer's param groups disagree", path=path)
    by_storage: dict[tuple, list] = {}
    for name, t in candidates:
        by_storage.setdefault((t.storage.path, t.storage.key), []).append((name, t))
    pgs = opt["optimizer_state_dict"]["param_groups"]
    trainable, groups, used = {}, [], set()
    for g, flat in enumerate(flats):
        fits = [k for k, members in by_storage.items() if k not in used and members[0][1].storage.numel == flat.numel
                and sum(t.numel for _, t in members) == flat.numel]
        if len(fits) != 1:
            raise UnsupportedLayout(f"ZeRO-0 FP16_Optimizer: {len(fits)} module storages could hold the "
                                    f"{flat.numel} elements of param group {g}'s flat master", path=path,
                                    hint="merge the module weights instead (they are the training-dtype copy)")
        used.add(fits[0])
        members = sorted(by_storage[fits[0]], key=lambda m: m[1].storage_offset)
        pid = ids[g][0] if ids[g] else None
        ea, eas = (_moment(state, pid, k, flat.numel, path, f"group {g}") for k in ("exp_avg", "exp_avg_sq"))
        have = ea is not None and eas is not None
        mdtype = uniform_dtype([flat], f"the master weights of param group {g}", path)
        names, end = [], 0
        for name, t in members:
            off, n = t.storage_offset, t.numel
            if not t.is_contiguous() or off < end:
                raise CorruptFile(f"ZeRO-0: '{name}' is not a contiguous slice of its group's flat buffer", path=path)
            trainable[name] = TensorRecord(name, tuple(t.shape), "trainable", mdtype, pieces_of(flat, off, n),
                                           pieces_of(ea, off, n) if have else [],
                                           pieces_of(eas, off, n) if have else [], group=g, lp_dtype=t.dtype)
            names.append(name)
            end = off + n
        groups.append(_group_info(g, pgs[g], state, ids[g], names, storage_options))
    return trainable, groups


def _plain(opt: dict, candidates: list, precision: str, path: str, storage_options: dict | None = None):
    """fp32 engine, no wrapper: the module weights are what the optimizer updates; the moments are mapped to
    names by their shapes when that is certain. Parameters whose state is missing cannot be placed."""
    if precision != "fp32":
        raise UnsupportedLayout(f"ZeRO-0 {precision} checkpoint whose optimizer keeps no fp32 masters", path=path)
    ids, state = _torch_state(opt, path)
    notes = []
    shapes = []
    for pids in ids:
        st = [state.get(p) for p in pids]
        if not all(isinstance(s, dict) and isinstance(s.get("exp_avg"), LazyTensor) for s in st):
            shapes = None
            break
        shapes.append([tuple(s["exp_avg"].shape) for s in st])
    if shapes is None:
        note = ("some optimizer parameters have no state (frozen params passed to the optimizer, or no step "
                "yet): parameters are not told apart from frozen ones; values are the module weights")
        has_some = any(isinstance(s, dict) and isinstance(s.get("exp_avg"), LazyTensor) for s in state.values())
        with_state = sum(isinstance(s, dict) and isinstance(s.get("exp_avg"), LazyTensor) for s in state.values())
        # moments that exist but are not read: a refusal
        notes.append(StateNotRead.of(note, with_state) if has_some else note)
        return {}, [GroupInfo(g, {k: v for k, v in pg.items() if k not in ("params", "param_names")}, None, [])
                    for g, pg in enumerate(opt["param_groups"])], notes
    try:
        named = match_groups(shapes, [(n, tuple(t.shape)) for n, t in candidates], path,
                             names=_saved_names(opt["param_groups"], path))
    except UnsupportedLayout as exc:  # the weights are the module's either way; the moments cannot be placed
        notes.append(StateNotRead.of(f"Adam moments not read: {exc.message}; parameters are not told apart from "
                                     "frozen ones; values are the module weights", sum(len(p) for p in ids)))
        return {}, [GroupInfo(g, {k: v for k, v in pg.items() if k not in ("params", "param_names")}, None, [])
                    for g, pg in enumerate(opt["param_groups"])], notes
    by = dict(candidates)
    trainable, groups = {}, []
    for g, (names, pids) in enumerate(zip(named, ids)):
        masters = [by[n] for n in names]
        moments = [(_moment(state, p, "exp_avg", m.numel, path, n), _moment(state, p, "exp_avg_sq", m.numel, path, n))
                   for n, m, p in zip(names, masters, pids)]
        trainable.update(_records_for(g, names, masters, moments, by, path))
        groups.append(_group_info(g, opt["param_groups"][g], state, pids, names, storage_options))
    return trainable, groups, notes
