"""ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): every parameter partitioned on its own.

A parameter of n elements is split into ws slices of ceil(n/ws); the last rank's slice ends with
(ws - n % ws) % ws zeros. Rank r's optimizer file holds, per sub-group s (``sub_group_size``)::

    fp32_flat_groups[s]                          master weights (fp32, or bf16 with bf16_master_weights_and_grads:
                                                 the dtype is read from the file), concat over the sub-group's params (``param_shapes[s]`` order)
                                                 of rank r's ceil(n/ws) slice
    optimizer_state_dict.state[s]                {step, exp_avg, exp_avg_sq}, laid out like fp32_flat_groups[s]
    optimizer_state_dict.param_groups[k].params  the sub-group ids of user param group k
    partition_count                              ws (an int)

Every rank writes ``zero_pp_rank_R_mp_rank_00_model_states.pt`` whose ``module`` has 0-element placeholders for
params, real buffers, and ``frozen_param_fragments``: rank r's ceil(n/ws) slice of each frozen param.
``shared_params`` is filled only in rank 0's file.
"""

from __future__ import annotations

import math

from zckpt.deepspeed.discover import Location
from zckpt.deepspeed.model import (
    LP_DTYPES, Checkpoint, GroupInfo, TensorRecord, check_ranks, common_records, elementwise_state, pieces_of,
    precision_of, scalar_value, uniform_dtype,
)
from zckpt.errors import CorruptFile, IncompleteCheckpoint
from zckpt.encoding.safeload import LazyTensor


def build(loc: Location, model_states: list[dict], optim_states: list[dict]) -> Checkpoint:
    osds = [s["optimizer_state_dict"] for s in optim_states]
    opath = [f.path for f in loc.optim_files]
    ws = osds[0].get("partition_count")
    if isinstance(ws, (list, tuple)):
        ws = max(ws)
    if not isinstance(ws, int) or ws < 1:
        raise CorruptFile(f"invalid partition_count {ws!r}", path=opath[0])
    check_ranks(loc, ws, per_rank_model_files=True)
    ms0 = model_states[0]
    mpath = loc.model_files[0].path
    param_shapes = ms0.get("param_shapes")
    if not isinstance(param_shapes, list):
        raise CorruptFile("no param_shapes list", path=mpath)
    nsub = len(param_shapes)
    precision = precision_of(ms0, ms0.get("module"))
    module = ms0.get("module") or {}

    flats, rank_states = [], []
    for r, osd in enumerate(osds):
        fl = osd.get("fp32_flat_groups")
        if not isinstance(fl, list) or len(fl) != nsub or not all(isinstance(t, LazyTensor) for t in fl):
            raise CorruptFile(f"fp32_flat_groups should list {nsub} sub-groups", path=opath[r])
        flats.append(fl)
        inner = osd.get("optimizer_state_dict") or {}
        state = inner.get("state") or {}
        rank_states.append([state.get(s) if isinstance(state.get(s), dict) and state.get(s) else None
                            for s in range(nsub)])
    # per-element state of any optimizer (Adam's moments, SGD's momentum_buffer...), laid out like fp32_flat_groups
    sub_keys, other, odd = [], set(), None
    for s in range(nsub):
        n = flats[0][s].numel
        keys, bad = elementwise_state([rank_states[r][s] for r in range(ws)], [n] * ws, [n] * ws,
                                      f"sub-group {s}", opath)
        odd = odd or ((bad[0], f"sub-group {s}: {bad[1]}") if bad else None)
        sub_keys.append(keys)
    has_moments = all("exp_avg" in k and "exp_avg_sq" in k for k in sub_keys)
    moments = [([(rank_states[r][s] or {}).get("exp_avg") for s in range(nsub)],
                [(rank_states[r][s] or {}).get("exp_avg_sq") for s in range(nsub)]) for r in range(ws)]
    other_keys = [[k for k in keys if not has_moments or k not in ("exp_avg", "exp_avg_sq")] for keys in sub_keys]
    for keys in other_keys:
        other.update(keys)

    trainable: dict[str, TensorRecord] = {}
    sub_of: dict[str, int] = {}
    for s in range(nsub):
        need = sum(math.ceil(math.prod(shape) / ws) for shape in param_shapes[s].values())
        for r in range(ws):
            if flats[r][s].numel != need:
                raise CorruptFile(f"sub-group {s}: fp32 partition has {flats[r][s].numel} elements, its params "
                                  f"need {need}", path=opath[r], hint="param_shapes and the optimizer files disagree")
            for key in ("exp_avg", "exp_avg_sq"):
                t = (rank_states[r][s] or {}).get(key)
                if isinstance(t, LazyTensor) and len(t.shape) == 1 and t.numel != need:
                    raise CorruptFile(f"sub-group {s}: Adam moments do not match the fp32 partition", path=opath[r])
        master_dtype = uniform_dtype([flats[r][s] for r in range(ws)], f"the master weights of sub-group {s}",
                                     opath[0])
        if has_moments:
            uniform_dtype([m[k][s] for m in moments for k in (0, 1)], f"the Adam moments of sub-group {s}", opath[0])
        off = 0
        for name, shape in param_shapes[s].items():
            shape = tuple(int(d) for d in shape)
            n = math.prod(shape)
            part = math.ceil(n / ws)
            fp, ea, eas, extra = [], [], [], {k: [] for k in other_keys[s]}
            for r in range(ws):
                take = max(0, min(part, n - r * part))
                if take:
                    fp += pieces_of(flats[r][s], off, take)
                    if has_moments:
                        ea += pieces_of(moments[r][0][s], off, take)
                        eas += pieces_of(moments[r][1][s], off, take)
                    for k in other_keys[s]:
                        extra[k] += pieces_of(rank_states[r][s][k], off, take)
            lp = module[name].dtype if isinstance(module.get(name), LazyTensor) else LP_DTYPES[precision]
            trainable[name] = TensorRecord(name, shape, "trainable", master_dtype, fp, ea, eas, lp_dtype=lp,
                                           other_state=extra)
            sub_of[name] = s
            off += part

    # user param groups: which sub-groups each one owns (param_groups[k]['params'] lists sub-group ids)
    inner0 = osds[0].get("optimizer_state_dict") or {}
    pgroups = inner0.get("param_groups") or [{"params": list(range(nsub))}]
    groups = param_groups(pgroups, inner0.get("state") or {}, trainable, sub_of, opath[0], loc.storage_options)

    frozen = frozen_records(loc, model_states, ws)

    records = common_records(loc, ms0, trainable, frozen, LP_DTYPES[precision], module_has_params=False)
    cfg = ms0.get("ds_config") or {}
    zcfg = (cfg.get("zero_optimization") or {}) if isinstance(cfg, dict) else {}
    off_cfg = zcfg.get("offload_optimizer") if isinstance(zcfg, dict) else None
    offload = isinstance(off_cfg, dict) and off_cfg.get("device") in ("cpu", "nvme")
    refusal = (f"optimizer state '{odd[0]}' ({odd[1]}) is not elementwise: it cannot be re-partitioned"
               if odd else None)
    notes = [f"not read: {refusal}"] if refusal else []
    if other:
        notes.append(f"optimizer state {', '.join(repr(k) for k in sorted(other))} (not Adam's moments) read per "
                     "element, like the master weights")
    ckpt = Checkpoint(loc, 3, "zero3", precision, ws, records, groups, ms0, optim_states, model_states,
                      offload=offload, notes=notes, state_refusal=refusal)
    return ckpt


def param_groups(pgroups: list, state: dict, trainable: dict[str, TensorRecord], sub_of: dict[str, int],
                 path: str, storage_options: dict | None = None) -> list[GroupInfo]:
    """User param groups from ``param_groups[k]['params']`` (the sub-group ids each owns); sets ``record.group``.
    The step is the first sub-group's (read with ``storage_options`` when its file is behind a URL)."""
    groups = []
    for k, pg in enumerate(pgroups):
        subs = [int(x) for x in pg.get("params", [])]
        names = [n for n, s in sub_of.items() if s in subs]
        for n in names:
            trainable[n].group = k
        step = None
        if subs and isinstance(state.get(subs[0]), dict) and state[subs[0]].get("step") is not None:
            step = scalar_value(state[subs[0]]["step"], storage_options)
        groups.append(GroupInfo(k, {a: b for a, b in pg.items() if a != "params"}, step, names))
    for n, rec in trainable.items():
        if rec.group is None:
            raise CorruptFile(f"sub-group of '{n}' belongs to no param group", path=path)
    return groups


def frozen_records(loc: Location, model_states: list[dict], ws: int) -> dict[str, TensorRecord]:
    """Frozen weights: rank r's ceil(n/ws) slice of each in its own model-states file (``frozen_param_fragments``)."""
    frozen = {}
    for name, shape in (model_states[0].get("frozen_param_shapes") or {}).items():
        shape = tuple(int(d) for d in shape)
        n = math.prod(shape)
        part = math.ceil(n / ws)
        if len(model_states) != ws:
            raise IncompleteCheckpoint(f"frozen '{name}' is split over {ws} ranks but {len(model_states)} "
                                       "model-states files are here", path=loc.tag_dir)
        pieces, dtype = [], None
        for r, ms in enumerate(model_states):
            frag = (ms.get("frozen_param_fragments") or {}).get(name)
            if not isinstance(frag, LazyTensor) or frag.numel != part:
                raise IncompleteCheckpoint(f"rank {r} has no {part}-element fragment of frozen '{name}'",
                                           path=loc.model_files[r].path)
            dtype = frag.dtype
            pieces += pieces_of(frag, 0, max(0, min(part, n - r * part)))
        frozen[name] = TensorRecord(name, shape, "frozen", dtype, pieces, lp_dtype=dtype)
    return frozen
