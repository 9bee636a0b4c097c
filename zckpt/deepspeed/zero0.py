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

FP16_Optimizer's mapping is exact (shared storage, see :func:`_fused`). For the others no file names which
module parameter a master belongs to. The optimizer saw each group's trainable parameters in the order the client
listed them; zckpt assumes model (``named_parameters``) order within each group, as every builder of param groups
it knows does, and accepts the mapping only when it is the single one that fits the shapes (per group; groups
must not claim the same parameter). With fp32 masters of bf16/fp16 weights the values settle it: the optimizer
copies each master into its parameter, so the pair must agree when the master is rounded (the first
``SAMPLE`` elements are compared); a shape-only answer that fails this is redone with it, which also resolves
same-shaped candidates. Parameters no group takes are frozen. Anything still ambiguous or impossible is
refused: a wrong mapping would silently swap weights. Merge takes the masters (what the optimizer would
continue from), not the low-precision module copies.
"""

from __future__ import annotations

from zckpt.formats import casting
from zckpt.io import storage
from zckpt.deepspeed.discover import Location
from zckpt.deepspeed.model import (
    LP_DTYPES, Checkpoint, GroupInfo, TensorRecord, common_records, pieces_of, precision_of, scalar_value, uniform_dtype,
)
from zckpt.errors import CorruptFile, UnsupportedLayout
from zckpt.formats.safeload import LazyTensor


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
    buffers = set(ms0.get("buffer_names") or [])
    params = [(n, t) for n, t in module.items() if n not in buffers and isinstance(t, LazyTensor)]
    tied = _ties(params)
    candidates = [(n, t) for n, t in params if n not in tied]
    precision = precision_of(ms0, module)
    opt = ms0.get("optimizer")
    notes: list[str] = []

    if opt is None:
        trainable, groups = {}, []
        notes.append("saved without optimizer state: every parameter is reported as frozen (module values)")
    elif not isinstance(opt, dict):
        raise CorruptFile(f"'optimizer' is a {type(opt).__name__}, not a state dict", path=mpath)
    elif "fp32_groups" in opt:
        trainable, groups = _unfused(opt, candidates, mpath, loc.storage_options)
    elif "fp32_groups_flat" in opt:
        trainable, groups = _fused(opt, candidates, mpath, loc.storage_options)
    elif "state" in opt and "param_groups" in opt:
        trainable, groups, more = _plain(opt, candidates, precision, mpath, loc.storage_options)
        notes += more
    else:
        raise UnsupportedLayout("ZeRO-0 'optimizer' has neither fp32 master groups nor a torch optimizer state "
                                f"(keys: {', '.join(map(str, list(opt)[:8]))})", path=mpath)

    ms = dict(ms0, shared_params=tied)  # ties as common_records expects them (DeepSpeed saves None at ZeRO-0)
    records = common_records(loc, ms, trainable, {}, LP_DTYPES[precision])
    ws = ms0.get("dp_world_size")
    ws = int(ws) if isinstance(ws, int) and ws > 0 else 1
    ckpt = Checkpoint(loc, 0, "zero0", precision, ws, records, groups, ms0, [], model_states,
                      reshard_refusal=REFUSAL)
    ckpt.notes += notes
    return ckpt


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
                 same=None) -> list[list[str]]:
    """Names for each group's tensors: each group a subsequence of ``candidates`` (module order) of equal shapes.

    Accepted only when unique: per group, the leftmost and the rightmost fitting subsequences coincide (every
    fit lies between them, so there is exactly one), and no name is claimed by two groups. ``same(g, j, name)``
    (optional) says whether master j of group g holds the values of module entry ``name``: it checks the
    shape-only answer, and settles it where shapes alone leave a choice."""
    names = [n for n, _ in candidates]
    cshapes = [tuple(s) for _, s in candidates]
    out, owner = [], {}
    for g, want in enumerate(shapes):
        want = [tuple(s) for s in want]
        left, right = _fit(want, cshapes, None)
        if same is not None and (left is None or left != right or
                                 not all(same(g, j, names[i]) for j, i in enumerate(left))):
            left, right = _fit(want, cshapes, lambda j, i, g=g: same(g, j, names[i]))
        if left is None:
            raise UnsupportedLayout(f"ZeRO-0: the {len(want)} master weights of param group {g} do not fit the "
                                    "module's parameters in order (a param group listed out of model order?)",
                                    path=path)
        if left != right:
            amb = next(i for i, (a, b) in enumerate(zip(left, right)) if a != b)
            raise UnsupportedLayout(f"ZeRO-0: cannot tell which parameter master {amb} of param group {g} belongs "
                                    f"to ('{names[left[amb]]}' or '{names[right[amb]]}' fit; DeepSpeed saves no "
                                    "names at stage 0)", path=path,
                                    hint="merge the module weights instead (they are the training-dtype copy)")
        for i in left:
            if names[i] in owner:
                raise UnsupportedLayout(f"ZeRO-0: '{names[i]}' fits a master of param groups {owner[names[i]]} "
                                        f"and {g}", path=path)
            owner[names[i]] = g
        out.append([names[i] for i in left])
    return out


def _fit(want: list[tuple], have: list[tuple], pred) -> tuple[list[int] | None, list[int] | None]:
    """The leftmost and the rightmost embeddings of ``want`` in ``have`` (equal shapes and ``pred(j, i)``)."""
    ok = (lambda j, i: want[j] == have[i] and (pred is None or pred(j, i)))
    left, j = [], 0
    for i in range(len(have)):
        if j < len(want) and ok(j, i):
            left.append(i)
            j += 1
    if j < len(want):
        return None, None
    right, j = [], len(want) - 1
    for i in range(len(have) - 1, -1, -1):
        if j >= 0 and ok(j, i):
            right.append(i)
            j -= 1
    return left, right[::-1]


SAMPLE = 256  # elements compared per (master, module weight) pair


def rounds_to(master: LazyTensor, lp: LazyTensor, storage_options: dict | None = None) -> bool:
    """Whether the first elements of ``master`` cast to ``lp``'s dtype are ``lp``'s (the optimizer copies every
    updated master into its low-precision parameter, so the right pair always agrees). ``storage_options``: for
    files behind URLs."""
    if tuple(master.shape) != tuple(lp.shape) or not (master.is_contiguous() and lp.is_contiguous()):
        return False
    n = min(master.numel, SAMPLE)
    if n == 0:
        return True
    raw = storage.read_range(master.storage.path, master.byte_offset, n * master.itemsize, storage_options)
    ref = storage.read_range(lp.storage.path, lp.byte_offset, n * lp.itemsize, storage_options)
    return bytes(casting.cast(raw, master.dtype, lp.dtype)) == bytes(ref)


def _torch_state(osd: dict, path: str) -> tuple[list[list], dict]:
    if not isinstance(osd, dict) or not isinstance(osd.get("param_groups"), list):
        raise CorruptFile("ZeRO-0 optimizer has no torch optimizer_state_dict", path=path)
    ids = [list(pg.get("params") or []) for pg in osd["param_groups"]]
    state = osd.get("state") or {}
    return ids, state


def _group_info(g: int, pg: dict, state: dict, ids: list, names: list[str],
                storage_options: dict | None = None) -> GroupInfo:
    st = state.get(ids[0]) if ids else None
    has_step = isinstance(st, dict) and st.get("step") is not None
    step = scalar_value(st.get("step"), storage_options) if has_step else None
    return GroupInfo(g, {k: v for k, v in pg.items() if k != "params"}, step, names)


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
    named = match_groups([[tuple(t.shape) for t in grp] for grp in fp32],
                         [(n, tuple(t.shape)) for n, t in candidates], path,
                         same=lambda g, j, name: rounds_to(fp32[g][j], by[name], storage_options))
    trainable, groups = {}, []
    pgs = opt["optimizer_state_dict"]["param_groups"]
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
        notes.append("some optimizer parameters have no state (frozen params passed to the optimizer, or no step "
                     "yet): parameters are not told apart from frozen ones; values are the module weights")
        return {}, [GroupInfo(g, {k: v for k, v in pg.items() if k != "params"}, None, [])
                    for g, pg in enumerate(opt["param_groups"])], notes
    named = match_groups(shapes, [(n, tuple(t.shape)) for n, t in candidates], path)
    by = dict(candidates)
    trainable, groups = {}, []
    for g, (names, pids) in enumerate(zip(named, ids)):
        masters = [by[n] for n in names]
        moments = [(_moment(state, p, "exp_avg", m.numel, path, n), _moment(state, p, "exp_avg_sq", m.numel, path, n))
                   for n, m, p in zip(names, masters, pids)]
        trainable.update(_records_for(g, names, masters, moments, by, path))
        groups.append(_group_info(g, opt["param_groups"][g], state, pids, names, storage_options))
    if precision != "fp32":
        raise UnsupportedLayout(f"ZeRO-0 {precision} checkpoint whose optimizer keeps no fp32 masters", path=path)
    return trainable, groups, notes
