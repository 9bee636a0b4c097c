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
    base_optimizer_state                 torch Adam state_dict: state[k] = {step, exp_avg(P), exp_avg_sq(P)} with
                                         k = param_groups[g]['params'][0]; or (elastic) a list of per-group dicts
    param_slice_mappings[g]              name -> fragment_address(numel, start) for params touching rank r
    group_paddings, partition_count, param_alignment_paddings (0.19.7+), zero_stage (absent: BF16 optimizer)

Frozen params: stage 2 stores full lp tensors in ``frozen_param_fragments``; ZeRO-1 and the BF16 optimizer keep
them only in ``module`` (handled by :func:`layout.common_records`).
"""

from __future__ import annotations

import hashlib
import math

from zckpt.io import storage
from zckpt.deepspeed.discover import Location
from zckpt.deepspeed.model import (
    LP_DTYPES, Checkpoint, GroupInfo, TensorRecord, check_ranks, common_records, pieces_of,
    precision_of, scalar_value, uniform_dtype,
)
from zckpt.errors import CorruptFile, IncompleteCheckpoint, UnsupportedLayout
from zckpt.formats.safeload import LazyTensor


def _as_list(value, n, what, path):
    if isinstance(value, int):
        return [value] * n
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise CorruptFile(f"'{what}' should have one entry per param group ({n})", path=path)
    return list(value)


def _moments(osd: dict, g: int, path: str):
    """(step, exp_avg, exp_avg_sq, hyperparams) of group g from ``base_optimizer_state``."""
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
    if not isinstance(st, dict):
        return step, None, None, hyper  # no state yet (saved before the first step) or a stateless optimizer
    ea, eas = st.get("exp_avg"), st.get("exp_avg_sq")
    return step, ea if isinstance(ea, LazyTensor) else None, eas if isinstance(eas, LazyTensor) else None, hyper


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
    for g in range(ngroups):
        fp32_parts, ea_parts, eas_parts, reals = [], [], [], []
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
            s, ea, eas, h = _moments(osd, g, opath[r])
            if r == 0:
                step, hyper = s, h
            fp32_parts.append(fp)
            reals.append(P - pad)
            ea_parts.append(ea)
            eas_parts.append(eas)
        has_moments = all(t is not None for t in ea_parts + eas_parts)
        # the dtypes come from the files: fp32 masters, or bf16 with bf16_master_weights_and_grads; moments may
        # differ from the masters (bf16_optimizer_states, or CPU Adam's fp32 states)
        master_dtype = uniform_dtype(fp32_parts, f"the master weights of group {g}", opath[0])
        if has_moments:
            uniform_dtype(ea_parts + eas_parts, f"the Adam moments of group {g}", opath[0])
        for r in range(ws):
            for t in (ea_parts[r], eas_parts[r]) if has_moments else ():
                if t.numel < reals[r]:
                    raise CorruptFile(f"group {g}: Adam moment of {t.numel} elements, partition has {reals[r]}",
                                      path=opath[r])
        align = param_shapes_alignment(osd0, g, len(param_shapes[g]))
        offset = 0
        names = []
        for i, (name, shape) in enumerate(param_shapes[g].items()):
            shape = tuple(int(d) for d in shape)
            n = math.prod(shape)
            fp, ea, eas = [], [], []
            for r in range(offset // P, (offset + n - 1) // P + 1) if n else ():
                lo, hi = max(offset, r * P), min(offset + n, (r + 1) * P)
                if r >= ws or hi - r * P > reals[r]:
                    raise CorruptFile(f"parameter '{name}' lies beyond the saved partitions (group {g})",
                                      path=opath[min(r, ws - 1)], hint="param_shapes and the optimizer files disagree")
                fp += pieces_of(fp32_parts[r], lo - r * P, hi - lo)
                if has_moments:
                    ea += pieces_of(ea_parts[r], lo - r * P, hi - lo)
                    eas += pieces_of(eas_parts[r], lo - r * P, hi - lo)
                if not round_robin:
                    _check_mapping(osds[r], g, name, lo - r * P, hi - lo, opath[r])
            lp = module[name].dtype if isinstance(module.get(name), LazyTensor) else LP_DTYPES[precision]
            trainable[name] = TensorRecord(name, shape, "trainable", master_dtype, fp, ea, eas, group=g,
                                           lp_dtype=lp)
            names.append(name)
            offset += n + (align[i] if i < len(align) else 0)
        avail = sum(reals)
        a2 = 2 * ws
        if math.ceil(offset / a2) * a2 != math.ceil(avail / a2) * a2 and offset != avail:
            raise CorruptFile(f"group {g}: parameters use {offset} elements but the partitions hold {avail}",
                              path=opath[0], hint="param_shapes and the optimizer files disagree")
        step_value = scalar_value(step, loc.storage_options) if step is not None else None
        groups.append(GroupInfo(g, hyper or {}, step_value, names))

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

    if stage == 2 and isinstance(ms0.get("frozen_param_shapes"), dict):
        ms0 = _with_unrecorded_ties(ms0, module, trainable, frozen, mpath, loc.storage_options)
    records = common_records(loc, ms0, trainable, frozen, LP_DTYPES[precision])
    off = zcfg.get("offload_optimizer") if isinstance(zcfg, dict) else None
    offload = bool(zcfg.get("cpu_offload")) or (isinstance(off, dict) and off.get("device") in ("cpu", "nvme"))
    notes = ["round_robin_gradients: the flat groups are read in param_shapes' order; DeepSpeed's "
             "param_slice_mappings (in model order) are not checked"] if round_robin else []
    return Checkpoint(loc, stage, flavour, precision, ws, records, groups, ms0, optim_states, model_states,
                      offload=offload, notes=notes)


def _with_unrecorded_ties(ms0: dict, module: dict, trainable: dict, frozen: dict, path: str,
                          storage_options: dict | None = None) -> dict:
    """ZeRO-2 lists every parameter: trainable ones in ``param_shapes``, all others (frozen, zero-size) in
    ``frozen_param_shapes``, both walked with ``named_parameters()``, which yields a shared parameter once. A
    ``module`` entry in neither (nor a buffer, nor in ``shared_params``) is therefore a second name of a parameter
    whose tie DeepSpeed did not record (``shared_params`` is found by ``data_ptr``; ``torch.save`` copies may have
    split the storage, as in AutoEP's router alias). It is tied to the one parameter holding the same bytes;
    none or several such parameters are refused: as a frozen tensor it would give the training-dtype copy where
    the engine has the master."""
    shared = dict(ms0.get("shared_params") or {})
    listed = set(trainable) | set(frozen) | set(shared) | set(ms0.get("buffer_names") or [])
    extra = [n for n, t in module.items() if n not in listed and isinstance(t, LazyTensor)]
    if not extra:
        return ms0
    digests: dict[str, tuple] = {}

    def digest(name: str) -> tuple:
        if name not in digests:
            t = module[name]
            h = hashlib.sha256()
            for p in pieces_of(t):
                h.update(storage.read_range(p.path, p.offset, p.nbytes, storage_options))
            digests[name] = (tuple(t.shape), t.dtype, h.hexdigest())
        return digests[name]

    for name in extra:
        t = module[name]
        same = [n for n in list(trainable) + list(frozen) if isinstance(module.get(n), LazyTensor)
                and (tuple(module[n].shape), module[n].dtype) == (tuple(t.shape), t.dtype) and digest(n) == digest(name)]
        if len(same) != 1:
            raise UnsupportedLayout(f"'{name}' is in 'module' but in neither param_shapes nor frozen_param_shapes (a "
                                    "parameter shared under a second name), and " +
                                    (f"{len(same)} parameters ({', '.join(same[:3])}) hold its values" if same else
                                     "no parameter holds its values") + ": which one it is cannot be told", path=path)
        shared[name] = same[0]
    return dict(ms0, shared_params=shared)


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
