"""ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and the BF16 optimizer: flat, 2*ws-aligned partitions per param group.

Per optimizer param group g, DeepSpeed concatenates the trainable params (``param_shapes[g]`` order; with
``parameter_alignment`` each is followed by ``param_alignment_paddings[g][i]`` zeros), pads the whole buffer to a
multiple of 2*ws, and gives rank r the slice [r*P, (r+1)*P)::

    flat group g:  | p0 | p1 |  p2  | p3 |...| pad |
    rank 0:        [--------- P ---------)
    rank 1:                               [--------- P ---------)   (the padding is at the tail of the last ranks)

Rank r's optimizer file holds, per group::

    single_partition_of_fp32_groups[g]   master slice, fp32 (bf16 with bf16_master_weights_and_grads: the dtype
                                         is read from the file); ZeRO-1/2: padding stripped (P - group_paddings[g]
                                         elements); BF16 optimizer: padding kept (P elements)
    base_optimizer_state                 the torch optimizer's state_dict: state[k] = {step, exp_avg(P),
                                         exp_avg_sq(P)} for Adam, any per-element keys for others (SGD's
                                         momentum_buffer(P)), with k = param_groups[g]['params'][0]; or
                                         (elastic) a list of per-group dicts
    param_slice_mappings[g]              name -> fragment_address(numel, start) for params touching rank r
    group_paddings, partition_count, param_alignment_paddings (0.19.7+), zero_stage (absent: BF16 optimizer)

Frozen params: stage 2 stores full lp tensors in ``frozen_param_fragments``; ZeRO-1 and the BF16 optimizer keep
them only in ``module`` (handled by :func:`layout.common_records`). A trainable parameter in no optimizer group
is in neither ``param_shapes`` nor ``frozen_param_shapes``: it is read from ``module``
(:func:`zckpt.deepspeed.model.unlisted_params`), never taken for a tie by its bytes.
"""

from __future__ import annotations

import math

from zckpt.deepspeed.discover import Location
from zckpt.deepspeed.model import (
    LP_DTYPES, Checkpoint, GroupInfo, TensorRecord, check_ranks, common_records, pieces_of,
    elementwise_state, precision_of, scalar_value, uniform_dtype, unlisted_params,
)
from zckpt.errors import CorruptFile, IncompleteCheckpoint, UnsupportedLayout
from zckpt.encoding.safeload import LazyTensor


def _as_list(value, n, what, path):
    if isinstance(value, int):
        return [value] * n
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise CorruptFile(f"'{what}' should have one entry per param group ({n})", path=path)
    return list(value)


def _moments(osd: dict, g: int, path: str):
    """(step, state, hyperparams) of group g from ``base_optimizer_state``: ``state`` is the torch optimizer's
    state dict of the group's flat partition (None before the first step or for a stateless optimizer)."""
    bos = osd.get("base_optimizer_state")
    if isinstance(bos, list):  # elastic_checkpoint: per-group dicts, padding stripped
        # no param_groups (no hyperparameters) in an elastic file; the Adam step is the state's own ('step'), the
        # param group's step (base_optimizer_state_step, only saved by optimizers keeping one) otherwise
        st = bos[g] if g < len(bos) else None
        step = st.get("step") if isinstance(st, dict) and st.get("step") is not None \
            else osd.get("base_optimizer_state_step")
        hyper = {}
    elif isinstance(bos, dict):
        groups = bos.get("param_groups") or []
        if g >= len(groups):
            raise CorruptFile(f"base_optimizer_state has no param group {g}", path=path)
        hyper = {k: v for k, v in groups[g].items() if k != "params"}
        key = (groups[g].get("params") or [g])[0]
        st = (bos.get("state") or {}).get(key)
        step = st.get("step") if isinstance(st, dict) else None
    else:
        raise CorruptFile("optimizer file has no base_optimizer_state", path=path)
    return step, (st if isinstance(st, dict) and st else None), hyper


def build(loc: Location, model_states: list[dict], optim_states: list[dict]) -> Checkpoint:
    ms0 = model_states[0]
    mpath = loc.model_files[0].path
    osds = [s["optimizer_state_dict"] for s in optim_states]
    opath = [f.path for f in loc.optim_files]
    osd0 = osds[0]
    flavour = "zero" if osd0.get("zero_stage") is not None else "bf16_optimizer"
    stage = int(osd0["zero_stage"]) if flavour == "zero" else 1
    fp32_groups0 = osd0.get("single_partition_of_fp32_groups")
    if not isinstance(fp32_groups0, list):
        raise CorruptFile("no single_partition_of_fp32_groups list", path=opath[0])
    ngroups = len(fp32_groups0)
    counts = _as_list(osd0.get("partition_count"), ngroups, "partition_count", opath[0])
    if len(set(counts)) > 1:
        raise UnsupportedLayout(f"param groups partitioned over different ranks {counts} (MoE expert groups)",
                                path=opath[0])
    ws = int(counts[0])
    check_ranks(loc, ws, per_rank_model_files=False)
    param_shapes = ms0.get("param_shapes")
    if not isinstance(param_shapes, list) or len(param_shapes) != ngroups:
        raise CorruptFile(f"param_shapes lists {len(param_shapes or [])} groups, the optimizer {ngroups}",
                          path=mpath)
    precision = precision_of(ms0, ms0.get("module"))
    module = ms0.get("module") or {}

    cfg = ms0.get("ds_config") or {}
    zcfg = cfg.get("zero_optimization") or {} if isinstance(cfg, dict) else {}
    # round_robin_gradients: the flat groups are in param_shapes' (round-robin) order, but DeepSpeed 0.19.8 links
    # each param's slice, and writes param_slice_mappings, in model order (stage_1_and_2 link_hp_params without
    # param_offsets when no alignment padding): the mappings then name the wrong params, so they are not checked
    round_robin = isinstance(zcfg, dict) and bool(zcfg.get("round_robin_gradients"))
    trainable: dict[str, TensorRecord] = {}
    groups: list[GroupInfo] = []
    other_state: dict[str, list[int]] = {}
    bad_state: dict[str, tuple[int, str]] = {}
    for g in range(ngroups):
        fp32_parts, states, reals, sizes = [], [], [], []
        step = hyper = None
        P = None
        for r, osd in enumerate(osds):
            fp = (osd.get("single_partition_of_fp32_groups") or [None] * ngroups)[g] \
                if len(osd.get("single_partition_of_fp32_groups") or []) == ngroups else None
            if not isinstance(fp, LazyTensor):
                raise CorruptFile(f"rank {r} has no fp32 partition for group {g}", path=opath[r])
            pad = _as_list(osd.get("group_paddings", [0] * ngroups), ngroups, "group_paddings", opath[r])[g]
            size = fp.numel + pad if flavour == "zero" else fp.numel
            if P is None:
                P = size
            elif size != P:
                raise CorruptFile(f"group {g}: partition of {size} elements, rank 0 has {P}", path=opath[r],
                                  hint="the rank files come from different saves")
            s, st, h = _moments(osd, g, opath[r])
            if r == 0:
                step, hyper = s, h
            fp32_parts.append(fp)
            reals.append(P - pad)
            sizes.append(P)
            states.append(st)
        # per-element state of any optimizer (Adam's moments, SGD's momentum_buffer, Lion's exp_avg...): laid out
        # like the partition; a tensor of another size (factored moments) cannot be re-partitioned: refused
        keys, odd = elementwise_state(states, reals, sizes, f"group {g}", opath, loc.storage_options)
        if odd is not None:
            bad_state.setdefault(odd[0], (g, odd[1]))
        for key in (k for k in ("exp_avg", "exp_avg_sq") if isinstance(states[0] and states[0].get(k), LazyTensor)):
            t = states[0][key]
            if key not in keys and len(t.shape) == 1 and t.numel < reals[0]:
                raise CorruptFile(f"group {g}: Adam moment '{key}' of {t.numel} elements, partition has {reals[0]}",
                                  path=opath[0])
        has_moments = "exp_avg" in keys and "exp_avg_sq" in keys
        other_keys = [k for k in keys if not has_moments or k not in ("exp_avg", "exp_avg_sq")]
        ea_parts = [st["exp_avg"] for st in states] if has_moments else []
        eas_parts = [st["exp_avg_sq"] for st in states] if has_moments else []
        for k in other_keys:
            other_state.setdefault(k, []).append(g)
        # the dtypes come from the files: fp32 masters, or bf16 with bf16_master_weights_and_grads; moments may
        # differ from the masters (bf16_optimizer_states, or CPU Adam's fp32 states)
        master_dtype = uniform_dtype(fp32_parts, f"the master weights of group {g}", opath[0])
        if has_moments:
            uniform_dtype(ea_parts + eas_parts, f"the Adam moments of group {g}", opath[0])
        for k in other_keys:
            uniform_dtype([st[k] for st in states], f"the optimizer state '{k}' of group {g}", opath[0])
        align = param_shapes_alignment(osd0, g, len(param_shapes[g]))
        offset = 0
        names = []
        for i, (name, shape) in enumerate(param_shapes[g].items()):
            shape = tuple(int(d) for d in shape)
            n = math.prod(shape)
            fp, ea, eas, other = [], [], [], {k: [] for k in other_keys}
            for r in range(offset // P, (offset + n - 1) // P + 1) if n else ():
                lo, hi = max(offset, r * P), min(offset + n, (r + 1) * P)
                if r >= ws or hi - r * P > reals[r]:
                    raise CorruptFile(f"parameter '{name}' lies beyond the saved partitions (group {g})",
                                      path=opath[min(r, ws - 1)], hint="param_shapes and the optimizer files disagree")
                fp += pieces_of(fp32_parts[r], lo - r * P, hi - lo)
                if has_moments:
                    ea += pieces_of(ea_parts[r], lo - r * P, hi - lo)
                    eas += pieces_of(eas_parts[r], lo - r * P, hi - lo)
                for k in other_keys:
                    other[k] += pieces_of(states[r][k], lo - r * P, hi - lo)
                if not round_robin:
                    _check_mapping(osds[r], g, name, lo - r * P, hi - lo, opath[r])
            lp = module[name].dtype if isinstance(module.get(name), LazyTensor) else LP_DTYPES[precision]
            trainable[name] = TensorRecord(name, shape, "trainable", master_dtype, fp, ea, eas, group=g,
                                           lp_dtype=lp, other_state=other)
            names.append(name)
            offset += n + (align[i] if i < len(align) else 0)
        avail = sum(reals)
        a2 = 2 * ws
        if math.ceil(offset / a2) * a2 != math.ceil(avail / a2) * a2 and offset != avail:
            raise CorruptFile(f"group {g}: parameters use {offset} elements but the partitions hold {avail}",
                              path=opath[0], hint="param_shapes and the optimizer files disagree")
        step_value = scalar_value(step, loc.storage_options) if step is not None else None
        hyper = dict(hyper or {})
        groups.append(GroupInfo(g, hyper, step_value, names))

    frozen: dict[str, TensorRecord] = {}
    fshapes = ms0.get("frozen_param_shapes") or {}
    ffrags = ms0.get("frozen_param_fragments") or {}
    for name, shape in fshapes.items():
        shape = tuple(int(d) for d in shape)
        t = ffrags.get(name)
        if t is None and isinstance(module.get(name), LazyTensor):
            t = module[name]
        if not isinstance(t, LazyTensor):
            raise CorruptFile(f"frozen parameter '{name}' has no saved tensor", path=mpath)
        if t.numel != math.prod(shape):
            raise CorruptFile(f"frozen parameter '{name}' has {t.numel} elements, its shape says "
                              f"{math.prod(shape)}", path=mpath)
        frozen[name] = TensorRecord(name, shape, "frozen", t.dtype, pieces_of(t), lp_dtype=t.dtype)

    ms0, ambiguous = unlisted_params(ms0, trainable, frozen, mpath, loc.storage_options)
    records = common_records(loc, ms0, trainable, frozen, LP_DTYPES[precision],
                             no_group=stage == 2 and isinstance(ms0.get("frozen_param_shapes"), dict))
    off = zcfg.get("offload_optimizer") if isinstance(zcfg, dict) else None
    offload = bool(zcfg.get("cpu_offload")) or (isinstance(off, dict) and off.get("device") in ("cpu", "nvme"))
    notes = ["round_robin_gradients: the flat groups are read in param_shapes' order; DeepSpeed's "
             "param_slice_mappings (in model order) are not checked"] if round_robin else []
    refusal = None
    if bad_state:  # e.g. Adafactor's factored moments: a reshard without them would drop the state, exit 0
        key, (g, what) = next(iter(bad_state.items()))
        refusal = (f"optimizer state '{key}' of param group {g} is not elementwise ({what}): it cannot be "
                   "re-partitioned")
        notes.append(f"not read: {refusal}")
    if other_state:
        notes.append(f"optimizer state {', '.join(repr(k) for k in other_state)} (not Adam's moments) read "
                     "per element, like the master weights")
    notes += [f"'{a}' holds the very bytes of '{b}' and is in no optimizer group, no tie recorded: a parameter of "
              f"its own or a second name of '{b}' (declare which: --no-tie {a} / --tie {a}={b})" for a, b in ambiguous]
    return Checkpoint(loc, stage, flavour, precision, ws, records, groups, ms0, optim_states, model_states,
                      offload=offload, notes=notes, state_refusal=refusal, ambiguous_ties=ambiguous)


def param_shapes_alignment(osd: dict, g: int, nparams: int) -> list[int]:
    apa = osd.get("param_alignment_paddings")
    if not apa:
        return [0] * nparams
    if g >= len(apa) or len(apa[g]) not in (nparams, max(nparams - 1, 0)):
        raise CorruptFile(f"param_alignment_paddings[{g}] does not match the {nparams} params of the group")
    return [int(x) for x in apa[g]]


def _check_mapping(osd: dict, g: int, name: str, start: int, numel: int, path: str) -> None:
    """Cross-check a slice with the rank's own ``param_slice_mappings`` (when saved)."""
    maps = osd.get("param_slice_mappings")
    if not isinstance(maps, list) or g >= len(maps) or not isinstance(maps[g], dict):
        return
    frag = maps[g].get(name)
    if frag is None:
        raise IncompleteCheckpoint(f"param_slice_mappings has no entry for '{name}' in group {g}", path=path,
                                   hint="param_shapes and the optimizer files come from different saves")
    if int(frag.get("start", -1)) != start or int(frag.get("numel", -1)) != numel:
        raise CorruptFile(f"'{name}': expected slice start={start} numel={numel}, param_slice_mappings says "
                          f"start={frag.get('start')} numel={frag.get('numel')}", path=path)
