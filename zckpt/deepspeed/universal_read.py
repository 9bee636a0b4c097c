"""Reading DeepSpeed's universal checkpoints (``ds_to_universal``, or ``zckpt reshard --format universal``).

The layout (DeepSpeed 0.19.8, ``deepspeed/checkpoint/ds_to_universal.py``)::

    <tag>_universal/mp_rank_00_model_states.pt        stage 1/2: the source's model states (module, param_shapes,
                                                      frozen_param_fragments, buffers, client state), copied
    <tag>_universal/zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3: every rank's model states, copied
    <tag>_universal/zero/optimizer_state.pt           stage 1/2: rank 0's optimizer dict without its sharded keys,
                                                      + param_groups; stage 3: rank 0's optimizer dict (its
                                                      optimizer_state_dict holds the steps) + param_groups
    <tag>_universal/zero/<param>/fp32.pt              stage 1/2: {'param': full tensor, 'cat_dim': 0}; stage 3: the
    <tag>_universal/zero/<param>/exp_avg.pt, exp_avg_sq.pt   flat tensor itself (numel elements)
    <tag>_universal/zero/<param>/step.pt              stage 1/2: the step tensor of the param's group
    <tag>_universal/zero/<frozen or buffer>/fp32.pt   stage 1/2, 0.19.8: {'param': t.float()} (not read: the
                                                      model states hold these in their own dtype)

:func:`build` turns it into the same :class:`~zckpt.state.model.Checkpoint` the native readers produce:
trainable records' pieces point into the ``fp32.pt``/``exp_avg*.pt`` files, with the dtype each file stores
(never assumed float32); frozen weights, buffers and tied aliases come from the model states as in the native
layout. ``optim_states`` holds one dict shaped like a native rank-0 optimizer file (``optimizer_state_dict`` with
``base_optimizer_state`` for stage 1/2, ``optimizer_state_dict.state`` for stage 3), so ``reshard`` can use a
universal checkpoint as its source.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from zckpt.encoding import safeload
from zckpt.io import storage
from zckpt.deepspeed.discover import Location, RankFile
from zckpt.deepspeed import zero3 as stage3
from zckpt.deepspeed.model import (
    LP_DTYPES, Checkpoint, GroupInfo, TensorRecord, common_records, pieces_of, precision_of, scalar_value,
    uniform_dtype,
)
from zckpt.errors import CorruptFile, IncompleteCheckpoint
from zckpt.encoding.safeload import LazyTensor

STATES = ("fp32", "exp_avg", "exp_avg_sq", "step")


def _load(files: list[RankFile], storage_options: dict | None = None) -> list:
    if len(files) > 2 and storage.is_url(files[0].path):
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(lambda f: safeload.load(f.path, storage_options=storage_options), files))
    return [safeload.load(f.path, storage_options=storage_options) for f in files]


def _tensor(obj, f: RankFile) -> LazyTensor:
    """The tensor of a ``zero/<param>/<state>.pt`` file: ``{'param': t, ...}`` (stage 1/2) or ``t`` (stage 3)."""
    t = obj.get("param") if isinstance(obj, dict) else obj
    if not isinstance(t, LazyTensor):
        raise CorruptFile("expected a tensor (or a dict with 'param') in a universal checkpoint file", path=f.path)
    return t


def build(loc: Location) -> Checkpoint:
    """Describe the universal checkpoint ``loc`` (``loc.universal``; its files listed by ``discover``)."""
    model_states = _load(loc.model_files, loc.storage_options)
    for f, ms in zip(loc.model_files, model_states):
        if not isinstance(ms, dict) or ("module" not in ms and "param_shapes" not in ms):
            raise CorruptFile("not a DeepSpeed model-states file (no 'module' or 'param_shapes')", path=f.path)
    ms0, mpath = model_states[0], loc.model_files[0].path
    opt_file = loc.optim_files[0]
    loaded = _load(loc.optim_files, loc.storage_options)
    osd_u = loaded[0]
    if not isinstance(osd_u, dict) or not isinstance(osd_u.get("param_groups"), list):
        raise CorruptFile("not a universal optimizer_state.pt (no 'param_groups')", path=opt_file.path)
    # zero/<param>/<state>.pt -> (file, loaded object)
    states: dict[str, dict[str, tuple[RankFile, object]]] = {}
    for f, obj in zip(loc.optim_files[1:], loaded[1:]):
        _, param, state = f.name.split("/", 2)
        states.setdefault(param, {})[state[:-3]] = (f, obj)

    zero3 = isinstance(osd_u.get("optimizer_state_dict"), dict) or any(f.dp_rank is not None for f in loc.model_files)
    stage = 3 if zero3 else int(osd_u.get("zero_stage", 1))
    flavour = "zero3" if zero3 else ("zero" if osd_u.get("zero_stage") is not None else "bf16_optimizer")
    precision = precision_of(ms0, ms0.get("module"))
    module = ms0.get("module") or {}
    param_shapes = ms0.get("param_shapes")
    if not isinstance(param_shapes, list):
        raise CorruptFile("no param_shapes list", path=mpath)
    ws = int(ms0.get("dp_world_size") or len(loc.model_files) or 1)

    trainable: dict[str, TensorRecord] = {}
    sub_of: dict[str, int] = {}
    for g, shapes in enumerate(param_shapes):
        for name, shape in shapes.items():
            shape = tuple(int(d) for d in shape)
            trainable[name] = _trainable(name, shape, states.get(name, {}), loc, module, precision)
            trainable[name].group = None if zero3 else g
            sub_of[name] = g
    with_moments = [r for r in trainable.values() if r.exp_avg]
    if with_moments and len(with_moments) != len(trainable):
        missing = next(r.name for r in trainable.values() if not r.exp_avg)
        raise IncompleteCheckpoint(f"zero/{missing}/exp_avg.pt missing (other parameters have Adam moments)",
                                   path=loc.tag_dir)

    groups, osd_native = (_groups_stage3(osd_u, trainable, sub_of, opt_file, loc.storage_options) if zero3
                          else _groups_stage12(osd_u, trainable, param_shapes, states, loc.storage_options))
    frozen = stage3.frozen_records(loc, model_states, ws) if zero3 else _frozen_stage12(ms0, module, mpath)
    records = common_records(loc, ms0, trainable, frozen, LP_DTYPES[precision], module_has_params=not zero3)
    optim_state = {"optimizer_state_dict": osd_native,
                   "ds_version": osd_u.get("ds_version") or ms0.get("ds_version")}
    cfg = ms0.get("ds_config") or {}
    zcfg = (cfg.get("zero_optimization") or {}) if isinstance(cfg, dict) else {}
    off = zcfg.get("offload_optimizer") if isinstance(zcfg, dict) else None
    offload = isinstance(off, dict) and off.get("device") in ("cpu", "nvme")
    ckpt = Checkpoint(loc, stage, flavour, precision, ws, records, groups, ms0, [optim_state], model_states,
                      offload=offload)
    ckpt.notes.append("universal checkpoint: fp32 masters and Adam moments read from zero/<param>/*.pt")
    return ckpt


def _trainable(name: str, shape: tuple, files: dict, loc: Location, module: dict, precision: str) -> TensorRecord:
    if "fp32" not in files:
        raise IncompleteCheckpoint(f"zero/{name}/fp32.pt missing for trainable parameter '{name}'", path=loc.tag_dir)
    n = math.prod(shape)
    tensors = {}
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        if key in files:
            f, obj = files[key]
            t = _tensor(obj, f)
            if t.numel != n:
                raise CorruptFile(f"holds {t.numel} elements, parameter '{name}' of shape {list(shape)} has {n}",
                                  path=f.path)
            tensors[key] = t
    if ("exp_avg" in tensors) != ("exp_avg_sq" in tensors):
        raise IncompleteCheckpoint(f"zero/{name}: only one of exp_avg.pt, exp_avg_sq.pt", path=loc.tag_dir)
    master = uniform_dtype([tensors["fp32"]], f"the master weight of '{name}'", files["fp32"][0].path)
    if "exp_avg" in tensors:
        uniform_dtype([tensors["exp_avg"], tensors["exp_avg_sq"]], f"the Adam moments of '{name}'",
                      files["exp_avg"][0].path)
    pieces = {k: pieces_of(t) for k, t in tensors.items()}
    lp = module[name].dtype if isinstance(module.get(name), LazyTensor) else LP_DTYPES[precision]
    return TensorRecord(name, shape, "trainable", master, pieces["fp32"], pieces.get("exp_avg", []),
                        pieces.get("exp_avg_sq", []), lp_dtype=lp)


def _groups_stage12(osd_u: dict, trainable: dict, param_shapes: list, states: dict,
                    storage_options: dict | None = None):
    """Groups (hyperparameters, step from the group's first ``step.pt``) and a native-shaped optimizer dict."""
    pgroups = osd_u["param_groups"]
    if len(pgroups) != len(param_shapes):
        raise CorruptFile(f"optimizer_state.pt has {len(pgroups)} param groups, the model states "
                          f"{len(param_shapes)}")
    groups, state = [], OrderedDict()
    for g, (pg, shapes) in enumerate(zip(pgroups, param_shapes)):
        names = list(shapes)
        step_obj = None
        for name in names:
            if "step" in states.get(name, {}):
                step_obj = states[name]["step"][1]
                break
        step = scalar_value(step_obj, storage_options) if step_obj is not None else None
        groups.append(GroupInfo(g, {k: v for k, v in pg.items() if k != "params"}, step, names))
        key = (pg.get("params") or [g])[0]
        if step_obj is not None:
            state[key] = {"step": step_obj}
    osd = OrderedDict((k, v) for k, v in osd_u.items() if k != "param_groups")
    osd["base_optimizer_state"] = {"state": state, "param_groups": pgroups}
    return groups, osd


def _groups_stage3(osd_u: dict, trainable: dict, sub_of: dict, opt_file: RankFile,
                   storage_options: dict | None = None):
    inner = osd_u.get("optimizer_state_dict")
    if not isinstance(inner, dict):  # a universal stage-3 dict always has it; tolerate its absence
        inner = {"state": {}, "param_groups": osd_u["param_groups"]}
    pgroups = inner.get("param_groups") or osd_u["param_groups"]
    st = inner.get("state") or {}
    groups = stage3.param_groups(pgroups, st, trainable, sub_of, opt_file.path, storage_options)
    state = OrderedDict((s, {"step": v["step"]}) for s, v in st.items() if isinstance(v, dict) and "step" in v)
    osd = OrderedDict((k, v) for k, v in osd_u.items() if k not in ("param_groups", "optimizer_state_dict",
                                                                    "fp32_flat_groups"))
    osd["optimizer_state_dict"] = {"state": state, "param_groups": pgroups}
    return groups, osd


def _frozen_stage12(ms0: dict, module: dict, mpath: str) -> dict[str, TensorRecord]:
    """Stage 2 keeps frozen weights in ``frozen_param_fragments``; ZeRO-1 and the BF16 optimizer in ``module``
    (picked up by ``common_records``)."""
    frozen = {}
    ffrags = ms0.get("frozen_param_fragments") or {}
    for name, shape in (ms0.get("frozen_param_shapes") or {}).items():
        shape = tuple(int(d) for d in shape)
        t = ffrags.get(name)
        if t is None and isinstance(module.get(name), LazyTensor):
            t = module[name]
        if not isinstance(t, LazyTensor) or t.numel != math.prod(shape):
            raise CorruptFile(f"frozen parameter '{name}' has no saved tensor of shape {list(shape)}", path=mpath)
        frozen[name] = TensorRecord(name, shape, "frozen", t.dtype, pieces_of(t), lp_dtype=t.dtype)
    return frozen


