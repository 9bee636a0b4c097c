"""What resuming a DeepSpeed engine from another layout checks before a byte is read: the engine's target layout
(:class:`Target`: data-parallel size and rank, stage, optimizer, sub-group size), and the checkpoint against the
engine's model (names, shapes, trainable / frozen, optimizer groups, partition sizes, MoE expert placement) and the
plan against the engine (:func:`check_compatible`, :func:`check_plan`); used by :mod:`zckpt.ops.resume`."""

import logging
from dataclasses import dataclass, field

from zckpt.state.model import Checkpoint
from zckpt.errors import InvalidArgument, UnsupportedLayout

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- target

@dataclass
class Target:
    """What the live engine expects: its data-parallel layout and optimizer."""

    world_size: int
    rank: int
    stage: int
    bf16_optimizer: bool
    precision: str
    zero: dict = field(default_factory=dict)  # layout-shaping zero_optimization values
    # the engine's expert-parallel sizes where they differ from the checkpoint's: one for every MoE layer, or one
    # per MoE layer in the checkpoint's layer order (zckpt.deepspeed.expert_groups.target_eps)
    ep: int | tuple | None = None
    # the engine's param groups in the planned file's order where the engine holds them in another (DeepSpeed orders
    # a rank's expert groups by a set of names: ranks without one PYTHONHASHSEED differ): planned group of each
    group_order: list[int] | None = None
    # where ``ep`` is set: what the engine's expert param groups say of the max_group_size DeepSpeed's helper cut them
    # at, (lo, hi) (zckpt.deepspeed.group_cuts.limit_of): the planned groups are cut as the engine holds them
    max_group_size: tuple | None = None

    @property
    def flavour(self) -> str:
        return "zero3" if self.stage == 3 else ("bf16_optimizer" if self.bf16_optimizer else "zero")


def engine_target(engine) -> Target:
    """The target layout of a DeepSpeed engine (raises :class:`UnsupportedLayout` for what zckpt cannot feed)."""
    import deepspeed.comm as dist
    stage = int(engine.zero_optimization_stage())
    if stage == 0 or engine.optimizer is None:
        raise UnsupportedLayout("the engine does not use a ZeRO optimizer (stage 0); load with engine.load_checkpoint"
                                + (" (at another expert-parallel size: zckpt reshard --ep N first)"
                                   if getattr(engine, "has_moe_layers", False) else ""))
    if getattr(engine, "pipeline_parallelism", False):
        raise UnsupportedLayout("pipeline-parallel engines are not loaded by zckpt.deepspeed.load_checkpoint: run "
                                "`zckpt reshard --world-size <data-parallel size>` (stages kept), then "
                                "engine.load_checkpoint")
    if int(getattr(engine, "mp_world_size", 1) or 1) > 1:
        raise UnsupportedLayout("model-parallel engines (mp_world_size > 1) are not supported")
    if getattr(engine, "has_moe_layers", False) and stage == 3 and not _engine_layer_eps(engine)[1]:
        raise UnsupportedLayout("native mixture-of-experts engines at ZeRO-3 are not supported (zckpt resumes "
                                "native MoE at ZeRO-1/2, AutoEP at ZeRO-1/2/3)")
    if engine.load_universal_checkpoint():
        raise InvalidArgument("the engine config sets checkpoint.load_universal",
                              hint="drop it: zckpt loads DeepSpeed's native layout at any world size")
    if engine.zero_nvme_offload_optimizer():
        raise UnsupportedLayout("NVMe optimizer offload is not supported (CPU offload is)")
    zc = engine._config.zero_config
    if getattr(zc, "round_robin_gradients", False):
        raise UnsupportedLayout("round_robin_gradients reorders the flat groups per world size; not supported")
    group = getattr(engine.optimizer, "dp_process_group", None)
    precision = "bf16" if engine.bfloat16_enabled() else ("fp16" if engine.fp16_enabled() else "fp32")
    bf16_optimizer = type(engine.optimizer).__name__ == "BF16_Optimizer"
    zero = {"sub_group_size": int(zc.sub_group_size)} if stage == 3 else \
        {"parameter_alignment": bool(getattr(zc, "parameter_alignment", False))}
    return Target(dist.get_world_size(group=group), dist.get_rank(group=group), 1 if bf16_optimizer else stage,
                  bf16_optimizer, precision, zero)


# ---------------------------------------------------------------------------------------------- validation

def _engine_params(engine) -> dict:
    """name -> (shape, trainable) of every parameter the engine's module has (tied aliases included), under the
    checkpoint's names (:func:`moe_experts`: global expert ids, AutoEP's fused experts at their full shape).
    Trainable: ``requires_grad``, and in one of the optimizer's flat groups where the optimizer shows them (a
    parameter in no param group is read from ``module``, as a frozen one)."""
    experts = moe_experts(engine)
    opt = getattr(engine, "optimizer", None)
    flat = next((getattr(opt, a) for a in ("bit16_groups", "bf16_groups", "fp16_groups")
                 if isinstance(getattr(opt, a, None), list)), None)
    owned = {id(q) for g in flat for q in g} if flat is not None else None
    out = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        name, shape = experts.get(name, (name, _shape(p)))
        out[name] = (shape, bool(p.requires_grad) and (owned is None or id(p) in owned))
    return out


def _shape(p) -> tuple:
    """A parameter's full shape (ZeRO-3 partitions it: ``ds_shape``)."""
    return tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)


def moe_experts(engine) -> dict:
    """The engine's expert parameters: live name -> (checkpoint name, checkpoint shape). A native MoE layer's
    local expert i of expert-parallel rank e is global expert ``e * num_local + i``; an AutoEP layer's fused
    ``experts.wK`` of ``[num_local, ...]`` is ``[num_local * ep_size, ...]`` in the checkpoint."""
    if not getattr(engine, "has_moe_layers", False):
        return {}
    import re
    from deepspeed.utils import groups
    out = {}
    for mname, mod in engine.module.named_modules():
        prefix = f"{mname}." if mname else ""
        if type(mod).__name__ == "AutoEPMoELayer":
            for w in ("w1", "w2", "w3"):
                p = getattr(mod.experts, w, None)
                if p is not None:
                    shape = _shape(p)
                    out[f"{prefix}experts.{w}"] = (f"{prefix}experts.{w}", (shape[0] * int(mod.ep_size), *shape[1:]))
        elif hasattr(mod, "expert_group_name") and hasattr(mod, "num_local_experts") and hasattr(mod, "deepspeed_moe"):
            e, nlocal = groups._get_expert_parallel_rank(mod.expert_group_name), int(mod.num_local_experts)
            pat = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..+)$")
            for name, p in mod.named_parameters(prefix=mname, remove_duplicate=False):
                m = pat.match(name)
                if m:
                    out[name] = (f"{m.group(1)}{e * nlocal + int(m.group(2))}{m.group(3)}", _shape(p))
    return out


def _engine_layer_eps(engine) -> tuple[dict[str, int], bool]:
    """The engine's MoE layers: module name -> expert-parallel size (native ``MoE.ep_size``, AutoEP's
    ``AutoEPMoELayer.ep_size``), in model order, and whether they are AutoEP's."""
    out, autoep = {}, False
    for name, mod in engine.module.named_modules():
        if type(mod).__name__ == "AutoEPMoELayer":
            out[name], autoep = int(mod.ep_size), True
        elif hasattr(mod, "expert_group_name") and hasattr(mod, "ep_size") and hasattr(mod, "deepspeed_moe"):
            out[name] = int(mod.ep_size)
    return out, autoep


def _engine_buffers(engine) -> dict:
    out = {}
    for mname, mod in engine.module.named_modules():
        for bname, buf in mod.named_buffers(recurse=False):
            if buf is not None and bname not in mod._non_persistent_buffers_set:
                out[f"{mname}.{bname}" if mname else bname] = tuple(buf.shape)
    return out


def _engine_groups(engine, target: Target) -> list[list[str]] | None:
    """Parameter names of the engine's flat groups (stage 1/2, BF16 optimizer: one per optimizer param group;
    stage 3: one per sub-group), or None when the optimizer does not expose them."""
    opt = engine.optimizer
    attr = "fp16_groups" if target.stage == 3 else ("bf16_groups" if target.bf16_optimizer else "bit16_groups")
    groups = getattr(opt, attr, None)
    if groups is None:
        return None
    names, experts = getattr(engine, "param_names", {}), moe_experts(engine)
    return [[experts.get(names.get(p, "?"), (names.get(p, "?"),))[0] for p in g] for g in groups]


def _engine_cut(engine, target: Target) -> tuple | None:
    """What the engine's expert param groups (``moe``, consecutive groups of one name: DeepSpeed's helper cut them at
    its ``max_group_size``) say of that limit, (lo, hi) (:func:`zckpt.deepspeed.group_cuts.bounds_of`, each
    parameter counted as the helper counts it); None where the optimizer does not say."""
    from zckpt.deepspeed.group_cuts import bounds_of
    opt = getattr(engine, "optimizer", None)
    pgs = getattr(getattr(opt, "optimizer", None), "param_groups", None)
    if target.stage == 3:  # per sub-group: gathered back into their param groups
        subs, of = getattr(opt, "fp16_groups", None), getattr(opt, "sub_group_to_group_id", None)
        if subs is None or of is None or pgs is None:
            return None
        held: dict = {}
        for s, params in enumerate(subs):
            held.setdefault(of.get(s), []).extend(params)
        groups = [held.get(i, []) for i in range(len(pgs))]
    else:
        groups = getattr(opt, "bf16_groups" if target.bf16_optimizer else "bit16_groups", None)
        if groups is None or pgs is None or len(groups) != len(pgs):
            return None
    runs, prev = [], None
    for pg, params in zip(pgs, groups):
        name = pg.get("name") if pg.get("moe") else None
        if name is not None:
            numels = [int(getattr(p, "ds_numel", None) or p.numel()) for p in params]
            runs[-1].append(numels) if name == prev else runs.append([numels])
        prev = name
    return bounds_of(runs)[:2] if runs else None


def _engine_partitions(engine, target: Target) -> list[int] | None:
    """This rank's fp32 partition sizes per flat group (as held by the optimizer)."""
    opt = engine.optimizer
    attr = "fp32_partitioned_groups_flat" if target.stage == 3 else \
        ("fp32_groups_flat_partition" if target.bf16_optimizer else "single_partition_of_fp32_groups")
    flats = getattr(opt, attr, None)
    if flats is None:
        return None
    return [int(t.numel()) for t in flats]


def check_compatible(ckpt: Checkpoint, engine, target: Target) -> None:
    """Refuse a source that cannot fill this engine: precision, names, shapes, trainable/frozen, groups."""
    path = ckpt.location.tag_dir
    if ckpt.precision != target.precision:
        raise InvalidArgument(f"the checkpoint was trained in {ckpt.precision}, the engine runs {target.precision}",
                              path=path, hint="start the engine with the checkpoint's precision")
    moe = _check_moe_engine(ckpt, engine, target)
    layout = moe.layout if moe is not None else None
    params, buffers = _engine_params(engine), _engine_buffers(engine)
    recs = ckpt.by_name()
    for name, (shape, trainable) in params.items():
        rec = recs.get(name)
        if rec is None or rec.kind == "buffer":
            raise InvalidArgument(f"the model's parameter '{name}' is not in the checkpoint", path=path,
                                  hint="resume with the model the checkpoint was saved from")
        if tuple(rec.shape) != shape:
            raise InvalidArgument(f"'{name}' has shape {list(rec.shape)} in the checkpoint but {list(shape)} in the "
                                  "model", path=path, hint="resume with the model the checkpoint was saved from")
        kind = recs[rec.tied_to].kind if rec.kind == "tied" and rec.tied_to in recs else rec.kind
        # a zero-element parameter is never the optimizer's (DeepSpeed saves it with the frozen ones, trainable
        # or not): nothing to tell apart, nothing to restore
        if (kind == "trainable") != trainable and 0 not in shape:
            state = "trainable" if kind == "trainable" else "frozen"
            raise InvalidArgument(f"'{name}' is {state} in the checkpoint but not in the model", path=path,
                                  hint="freeze the same parameters as the run that saved it")
    for name, shape in buffers.items():
        rec = recs.get(name)
        if rec is not None and rec.kind == "buffer" and tuple(rec.shape) != shape:
            raise InvalidArgument(f"buffer '{name}' has shape {list(rec.shape)} in the checkpoint but {list(shape)} "
                                  "in the model", path=path)
    extra = [r.name for r in ckpt.records if r.kind != "buffer" and r.name not in params
             and not (moe is not None and r.name in moe.other_experts)]  # other expert-parallel ranks'
    if extra:
        raise InvalidArgument(f"the checkpoint has parameters the model lacks: {', '.join(extra[:5])}"
                              + (" ..." if len(extra) > 5 else ""), path=path)
    want = [list(g.names) for g in ckpt.groups]
    if layout is not None:  # an expert group holds this rank's experts only (the groups at the engine's sizes)
        dense = {g.index: names for g, names in zip(ckpt.groups, want)
                 if g.index not in {s for ss in (layout.regroup or {}).values() for s in ss} | set(layout.ep)}
        order = sorted(dense) + sorted(layout.regroup) if layout.regroup else [g.index for g in ckpt.groups]
        want = [[r.name for _, r in layout.shards[g][layout.ep_rank(
            ckpt.model_state, target.world_size, layout.ep[g], target.rank, path)[0]]]
                if g in layout.ep else dense[g] for g in order]
    have = _engine_groups(engine, target)
    if have is not None and target.stage != 3 and have != want and layout is not None:
        target.group_order = _group_order(have, want)
    if have is not None and target.stage != 3 and have != want and target.group_order is None:
        raise InvalidArgument(f"the optimizer's param groups differ from the checkpoint's ({len(have)} groups of "
                              f"{[len(g) for g in have]} params vs {len(want)} of {[len(g) for g in want]})",
                              path=path, hint="build the optimizer's param groups as the run that saved it did")
    if have is not None and target.stage == 3 and [n for g in have for n in g] != [n for g in want for n in g]:
        raise InvalidArgument("the optimizer's parameters (or their order) differ from the checkpoint's", path=path,
                              hint="build the optimizer's param groups as the run that saved it did")


def _group_order(have: list[list[str]], want: list[list[str]]) -> list[int] | None:
    """Where the engine's groups are the planned ones in another order (each group's names whole): the planned
    group of each engine group; None otherwise."""
    keys = [tuple(g) for g in want]
    if len(set(keys)) != len(keys) or sorted(keys) != sorted(tuple(g) for g in have):
        return None
    return [keys.index(tuple(g)) for g in have]


def reorder_groups(plan, target: Target) -> None:
    """The planned optimizer file's param groups put in the engine's order (``target.group_order``): every
    per-group entry and the base optimizer's param groups (each keeps its state ids, which torch's
    ``load_state_dict`` maps by the groups' order)."""
    if not target.group_order:
        return
    from zckpt.deepspeed.expert_groups import PER_GROUP_KEYS
    osd, order = _own_optim(plan, target)["optimizer_state_dict"], target.group_order
    for key in PER_GROUP_KEYS:
        if isinstance(osd.get(key), list):
            osd[key] = [osd[key][i] for i in order]
    bos = osd.get("base_optimizer_state")
    if isinstance(bos, dict) and isinstance(bos.get("param_groups"), list):
        bos["param_groups"] = [bos["param_groups"][i] for i in order]


@dataclass
class _EngineMoE:
    """The MoE layout of a checkpoint as one rank of the engine sees it."""

    layout: object  # zckpt.deepspeed.moe.MoELayout
    other_experts: set  # expert parameters held by other expert-parallel ranks (absent from this rank's module)


def _check_moe_engine(ckpt: Checkpoint, engine, target: Target | None = None) -> _EngineMoE | None:
    """An MoE engine takes an MoE checkpoint of the same layers at any expert-parallel sizes DeepSpeed runs: each
    layer's size read from the engine's module (native ``MoE.ep_size``, AutoEP's ``AutoEPMoELayer.ep_size``); where
    some differ from the checkpoint's, ``target.ep`` says them (one size, or one per MoE layer in the checkpoint's
    layer order) and the layout is the one ``zckpt reshard --ep`` writes (:func:`zckpt.deepspeed.write_parallel.
    check_moe`; AutoEP at ZeRO-3: :func:`~zckpt.deepspeed.write_parallel.autoep_zero3_target`). An engine without
    MoE takes a dense checkpoint only; refused in one line otherwise."""
    path = ckpt.location.tag_dir
    moe_engine = bool(getattr(engine, "has_moe_layers", False))
    if ckpt.parallel == "moe" and not moe_engine:
        raise InvalidArgument("a mixture-of-experts checkpoint into an engine without MoE layers", path=path,
                              hint="resume with the model the checkpoint was saved from")
    if not moe_engine:
        return None
    if ckpt.parallel != "moe":
        raise InvalidArgument("the engine has mixture-of-experts layers, the checkpoint none", path=path,
                              hint="resume with the model the checkpoint was saved from")
    layout = ckpt.extra.get("moe")
    autoep_z3 = ckpt.stage == 3 and bool(ckpt.model_state.get("ds_autoep_layers"))
    if layout is None and not autoep_z3:
        raise UnsupportedLayout(ckpt.reshard_refusal or "this mixture-of-experts checkpoint is not resharded",
                                path=path, hint="load it with engine.load_checkpoint")
    from zckpt.deepspeed.write_parallel import autoep_zero3_target, check_moe
    layers, autoep = _engine_layer_eps(engine)
    cover = sorted(ckpt.extra.get("moe_coverage") or [], key=lambda x: x["index"])
    if autoep != (autoep_z3 or bool(layout is not None and layout.autoep)) or sorted(layers) != sorted(
            str(x["layer"]) for x in cover):
        raise InvalidArgument(f"the engine's MoE layers ({', '.join(layers) or 'none'}, "
                              f"{'AutoEP' if autoep else 'native'}) are not the checkpoint's ("
                              + ", ".join(str(x["layer"]) for x in cover) + ")", path=path,
                              hint="resume with the model the checkpoint was saved from")
    want = tuple(layers[str(x["layer"])] for x in cover)
    if target is not None and want != tuple(int(x.get("ep") or 1) for x in cover):
        target.ep = want[0] if len(set(want)) == 1 else want
        target.max_group_size = _engine_cut(engine, target)
    if autoep_z3:
        if target is not None:
            autoep_zero3_target(ckpt, target.world_size, None, None, "deepspeed", target.ep)  # DeepSpeed runs it
        return _EngineMoE(None, set())
    if target is not None:
        layout, _ = check_moe(ckpt, target.world_size, None, None, "deepspeed", target.ep, target.max_group_size)
    mine = {n for n, _ in moe_experts(engine).values()}
    names = {r.name for by_rank in layout.shards.values() for recs in by_rank.values() for _, r in recs}
    names |= {key for tensors, _, _ in layout.expert_files.values() for key, _ in tensors}
    return _EngineMoE(layout, names - mine)


def check_plan(plan, engine, target: Target) -> None:
    """The planned fp32 partitions of this rank have the sizes the engine's optimizer holds."""
    have = _engine_partitions(engine, target)
    if have is None:
        return
    osd = _own_optim(plan, target)["optimizer_state_dict"]
    parts = osd["fp32_flat_groups"] if target.stage == 3 else osd["single_partition_of_fp32_groups"]
    want = [t.numel for t in parts]
    if target.stage != 3 and not target.bf16_optimizer:  # the engine holds the padded partition
        want = [t.numel + pad for t, pad in zip(parts, osd["group_paddings"])]
    if want != have:
        raise InvalidArgument(f"rank {target.rank}'s planned partitions ({want}) differ from the engine's ({have})",
                              path=plan.source, hint="the engine's ZeRO settings do not match the checkpoint's")


def _own_optim(plan, target: Target):
    for f in plan.files:
        if "optim_states" in f.relpath:
            return f.obj
    raise InvalidArgument(f"no optimizer file planned for rank {target.rank}", path=plan.source)
