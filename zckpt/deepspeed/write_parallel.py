"""Pipeline-parallel and mixture-of-experts checkpoints re-partitioned over a new data-parallel size: each
pipeline stage, and each expert group over its expert-data-parallel ranks, planned by the ZeRO-1/2 writer
(:mod:`zckpt.deepspeed.write_zero`); layer and expert files copied."""

from __future__ import annotations

import os
import re
from collections import OrderedDict

from zckpt.deepspeed.expert_groups import (
    EP_NAME_RE, at_ep, autoep_layers_at, check_group_size, check_max_group_size, cut_bounds, expert_data_ranks,
    target_eps,
)
from zckpt.deepspeed.model import scalar_value
from zckpt.deepspeed.partition import Converter, TorchObject
from zckpt.encoding.safeload import LazyTensor
from zckpt.state.model import Checkpoint
from zckpt.errors import InvalidArgument, UnsupportedLayout

from zckpt.deepspeed.target import (
    Group, ReshardPlan, Target, check_world_size, copied, is_elastic, output_tag, planned, side_planned, target_of,
)
from zckpt.deepspeed.write_zero import (
    FlatGroup, flat_group, flat_groups, flat_partitions, plan_autoep_zero3, zero12_optim,
)


# ---- pipeline parallel: each stage re-partitioned over the new data-parallel size

def plan_pipeline(ckpt: Checkpoint, world_size: int, stage: int | None, bf16_optimizer: bool | None,
                  fmt: str, side=()) -> ReshardPlan:
    """A ``PipelineEngine`` checkpoint (:mod:`zckpt.deepspeed.pipeline`) at data-parallel size ``world_size``, the
    stage count kept. Each stage is an ordinary ZeRO-1 / BF16-optimizer checkpoint of its own parameters over the
    data-parallel ranks: its ``[bf16_]zero_pp_rank_{d}_mp_rank_{SS}_optim_states.pt`` are planned by the same
    writer as a plain checkpoint's (``zero12_optim``); ``mp_rank_{SS}_model_states.pt`` is the source's with the
    new ``dp_world_size`` (what ``engine.load_checkpoint`` checks against the live data-parallel size and uses to
    name the optimizer files it reads); the ``layer_XX-model_states.pt`` files do not depend on it and are copied."""
    check_world_size(world_size)
    tag_dir = ckpt.location.tag_dir
    if fmt != "deepspeed":
        raise UnsupportedLayout("a pipeline-parallel checkpoint is resharded in the DeepSpeed layout only",
                                path=tag_dir, hint="drop --format universal")
    if stage is not None and stage != ckpt.stage:
        raise UnsupportedLayout(f"changing the ZeRO stage of a pipeline-parallel checkpoint is not supported "
                                f"(PipelineEngine runs ZeRO-0/1): keep stage {ckpt.stage}; only the data-parallel "
                                "size can change", path=tag_dir, hint="drop --stage")
    if ckpt.stage == 0:  # engine.load_checkpoint feeds the model file's `optimizer` to the BF16 optimizer there
        raise UnsupportedLayout("resharding a ZeRO-0 pipeline-parallel checkpoint is not supported (its BF16-"
                                "optimizer state is also in mp_rank_XX_model_states.pt, which DeepSpeed loads "
                                "per rank): resume it at the same data-parallel size; ZeRO-1 pipelines reshard",
                                path=tag_dir)
    src_bf16 = ckpt.flavour == "bf16_optimizer"
    if bf16_optimizer is not None and bool(bf16_optimizer) != src_bf16:
        raise UnsupportedLayout("changing the optimizer (BF16 optimizer / ZeRO) of a pipeline-parallel checkpoint "
                                "is not supported: only the data-parallel size can change", path=tag_dir,
                                hint="drop --bf16-optimizer")
    zcfg = ckpt.ds_config.get("zero_optimization") or {}
    if isinstance(zcfg, dict) and zcfg.get("round_robin_gradients"):
        raise UnsupportedLayout("round_robin_gradients reorders the flat groups per world size; not supported",
                                path=tag_dir)
    objects: list[TorchObject] = []
    partitions: list[dict] = []
    tag = output_tag(ckpt)
    stage_ms = ckpt.extra["stage_model_states"]
    for s, sub in enumerate(ckpt.extra["pipeline_stages"]):
        t = target_of(sub, world_size, ckpt.stage, sub.flavour)
        t.mp_rank = s
        fgs = flat_groups(t)
        ms = {k: (world_size if k == "dp_world_size" else t.conv(v)) for k, v in stage_ms[s].items()}
        objects.append(TorchObject(t.relpath(f"mp_rank_{s:02d}_model_states.pt"), ms))
        objects += [zero12_optim(t, fgs, rank) for rank in t.ranks]
        partitions += [{"pipeline_stage": s, **p} for p in flat_partitions(t, fgs)]
    layers = [copied(os.path.join(tag, f.path.rsplit("/", 1)[-1]), f.path, f.size)
              for f in sorted(ckpt.location.layer_files, key=lambda f: f.index)]
    files = [planned(o) for o in objects] + layers + side_planned(side, world_size)
    pp = len(stage_ms)
    plan = ReshardPlan(ckpt.location.input_path, tag, fmt, ckpt.stage, ckpt.flavour, ckpt.world_size, ckpt.stage,
                       ckpt.flavour, world_size, ckpt.precision, files, partitions=partitions)
    plan.notes.append(f"pipeline parallel: {pp} stages kept, data-parallel size {ckpt.world_size} -> {world_size} "
                      f"(launch {pp * world_size} ranks)")
    return plan


# ---- mixture of experts: dense groups over the new data-parallel size, each expert group over its new
# expert-data-parallel ranks

def check_moe(ckpt: Checkpoint, world_size, stage: int | None, bf16_optimizer: bool | None, fmt: str,
              ep: int | None = None, max_group_size: int | None = None):
    """The :class:`zckpt.deepspeed.moe.MoELayout` of an MoE checkpoint that can be laid out at ``world_size`` (and
    expert-parallel size ``ep``: :func:`~zckpt.deepspeed.expert_groups.at_ep`), with the new ``param_shapes``
    entries of its expert groups (empty when ``ep`` is kept); what cannot is refused in one line."""
    check_world_size(world_size)
    tag_dir = ckpt.location.tag_dir
    layout = ckpt.extra.get("moe")
    if layout is None:  # MoE without ZeRO (expp_rank files): DeepSpeed loads it at any data-parallel size
        raise UnsupportedLayout(ckpt.reshard_refusal or "this mixture-of-experts checkpoint is not resharded",
                                path=tag_dir, hint="load it with engine.load_checkpoint at the new size"
                                if ckpt.stage == 0 else "zckpt merge / info / verify / convert read this layout")
    if fmt != "deepspeed":
        raise UnsupportedLayout("a mixture-of-experts checkpoint is resharded in the DeepSpeed layout only",
                                path=tag_dir, hint="drop --format universal")
    if stage is not None and stage != ckpt.stage:
        raise UnsupportedLayout(f"changing the ZeRO stage of a mixture-of-experts checkpoint is not supported: keep "
                                f"stage {ckpt.stage}; only the data-parallel size can change", path=tag_dir,
                                hint="drop --stage")
    if bf16_optimizer is not None and bool(bf16_optimizer) != (ckpt.flavour == "bf16_optimizer"):
        raise UnsupportedLayout("changing the optimizer (BF16 optimizer / ZeRO) of a mixture-of-experts checkpoint "
                                "is not supported: only the data-parallel size can change", path=tag_dir,
                                hint="drop --bf16-optimizer")
    if is_elastic(ckpt):
        raise UnsupportedLayout("an elastic mixture-of-experts checkpoint (elastic_checkpoint=true) is not "
                                "resharded", path=tag_dir)
    zcfg = ckpt.ds_config.get("zero_optimization") or {}
    if isinstance(zcfg, dict) and zcfg.get("round_robin_gradients"):
        raise UnsupportedLayout("round_robin_gradients reorders the flat groups per world size; not supported",
                                path=tag_dir)
    shapes: dict = {}
    names = {g.index: g.hyperparams.get("name") for g in ckpt.groups if g.index in layout.ep}
    changed = False
    if ep is not None:
        cover = ckpt.extra.get("moe_coverage") or []
        new = target_eps(ep, cover, world_size, tag_dir)
        if any(new[int(x["index"])] != x.get("ep") for x in cover):
            changed = True
            layout, shapes = at_ep(layout, ep if isinstance(ep, int) else new,
                                   ckpt.model_state.get("param_shapes") or [], tag_dir, ckpt.by_name(), names,
                                   max_group_size)
    if max_group_size is not None and not changed:  # the expert groups are kept as cut: the limit must agree
        check_max_group_size(layout, names, max_group_size, tag_dir)
    bad = sorted({n for n in layout.ep.values() if world_size % n})
    if bad:
        raise UnsupportedLayout(f"mixture-of-experts checkpoint: data-parallel size {world_size} is not a multiple "
                                f"of the expert-parallel size {bad[0]}", path=tag_dir,
                                hint=f"pass a multiple of {bad[0]}" + ("" if ep else ", or another --ep"))
    return layout, shapes


def rename_expert_groups(t: Target, layout, shapes: dict) -> None:
    """Another expert-parallel size: DeepSpeed names each expert group after it (``ep_size_N``); where the expert
    groups change (``layout.regroup``), the target's groups become the dense ones and one per new expert group."""
    tag_dir, opts = t.ckpt.location.tag_dir, t.ckpt.location.storage_options
    if layout.regroup:
        src = {g.index: g for g in t.groups}
        dense = [g for g in t.groups if g.index not in {s for ss in layout.regroup.values() for s in ss}]
        if [g.index for g in dense] != list(range(len(dense))) or min(layout.regroup) != len(dense):
            raise UnsupportedLayout("expert param groups before a dense one: not laid out at other expert-parallel "
                                    "sizes", path=tag_dir, hint="drop --ep")
        groups = list(dense)
        for k, ss in sorted(layout.regroup.items()):
            first = src[ss[0]]
            for s in ss[1:]:
                other = src[s]
                if [(a, b) for a, b in other.hyper.items() if a != "name"] != \
                        [(a, b) for a, b in first.hyper.items() if a != "name"]:
                    raise UnsupportedLayout(f"expert groups {first.hyper.get('name')!r} and "
                                            f"{other.hyper.get('name')!r} have other hyperparameters and would be one "
                                            f"group at expert-parallel size {layout.ep[k]}", path=tag_dir,
                                            hint="give their layers different --ep sizes")
                if _step_of(first.step, opts) != _step_of(other.step, opts):
                    raise UnsupportedLayout(f"expert groups {first.hyper.get('name')!r} and "
                                            f"{other.hyper.get('name')!r} are at other optimizer steps and would be "
                                            "one group", path=tag_dir, hint="give their layers different --ep sizes")
            recs = [r for e in sorted(layout.shards[k]) for _, r in layout.shards[k][e]]
            groups.append(Group(k, first.hyper, first.step, recs, first.template))
        t.groups = groups
    for g in t.groups:
        if g.index in shapes:
            g.hyper = OrderedDict((k, f"ep_size_{layout.ep[g.index]}" if k == "name" else v)
                                  for k, v in g.hyper.items())


def _step_of(step, storage_options):
    return scalar_value(step, storage_options) if isinstance(step, LazyTensor) else step


def _moe_model(t: Target, layout, shapes: dict | None = None) -> TorchObject:
    """``mp_rank_00_model_states.pt``: the source's (dense module, rank 0's param_shapes, num_experts...) with the
    new ``dp_world_size`` and, for AutoEP, each layer's new ``expert_data_parallel_world_size``."""
    def layers(v):
        if not isinstance(v, list):
            return v
        if shapes and layout.autoep:  # another expert-parallel size
            return autoep_layers_at(v, next(iter(layout.ep.values())), t.world_size)
        return [dict(x, expert_data_parallel_world_size=t.world_size // int(x.get("ep_size") or 1))
                if isinstance(x, dict) and "expert_data_parallel_world_size" in x else x for x in v]

    ms = {}
    for k, v in t.ms0.items():
        if k == "dp_world_size":
            v = t.world_size
        elif k == "param_shapes" and shapes:  # another expert-parallel size: rank 0's local experts
            v = [OrderedDict(shapes[g.index]) if g.index in shapes else v[g.index] for g in t.groups]
        elif k == "ds_autoep_layers":
            v = layers(v)
        elif k == "universal_checkpoint_info" and isinstance(v, dict) and "ds_autoep_layers" in v:
            v = dict(v, ds_autoep_layers=layers(v["ds_autoep_layers"]))
        ms[k] = t.conv(v)
    return TorchObject(t.model_path(0), ms)


def plan_moe(t: Target, layout, expert_files: str,
             shapes: dict | None = None) -> tuple[list[TorchObject], list[dict]]:
    """The model- and optimizer-states files of ``t.ranks`` (and the expert files: ``"object"`` for each rank's own
    experts, as objects to load; ``"none"``: none, they are copied). A dense group is partitioned over all
    ``world_size`` ranks, an expert group of ep_size N separately for each expert-parallel rank e over its
    ``world_size / N`` expert-data-parallel ranks (:meth:`MoELayout.ep_rank`); both by the ZeRO-1/2 writer."""
    tag_dir, ws = t.ckpt.location.tag_dir, t.world_size
    flat: dict[tuple[int, int | None], FlatGroup] = {}
    partitions = []
    for g in t.groups:
        ep = layout.ep.get(g.index)
        if ep is None:
            flat[(g.index, None)] = fg = flat_group(t, g, ws)
            partitions.append({"group": g.index, "numel": sum(r.numel for r in g.records),
                               "partition": fg.layout.partition,
                               "paddings": [fg.layout.group_padding(r) for r in range(ws)]})
            continue
        for e, pairs in sorted(layout.shards[g.index].items()):
            sub = Group(g.index, g.hyper, g.step, [r for _, r in pairs])
            flat[(g.index, e)] = fg = flat_group(t, sub, ws // ep, [n for n, _ in pairs])
            partitions.append({"group": g.index, "expert_parallel_rank": e, "expert_parallel_size": ep,
                               "numel": sum(r.numel for r in sub.records), "partition": fg.layout.partition,
                               "paddings": [fg.layout.group_padding(r) for r in range(ws // ep)]})
    objects = [_moe_model(t, layout, shapes)]
    own: set[tuple[int, int]] = set()
    for rank in t.ranks:
        fgs, windows = [], []
        for g in t.groups:
            ep = layout.ep.get(g.index)
            e, w = (None, rank) if ep is None else layout.ep_rank(t.ms0, ws, ep, rank, tag_dir)
            fgs.append(flat[(g.index, e)])
            windows.append(w)
            if ep is not None:
                own.add((ep, e))
        if not layout.ep:
            own.add((1, 0))
        objects.append(zero12_optim(t, fgs, rank, windows))
    if expert_files == "object":
        objects += [TorchObject(t.relpath(name), OrderedDict((k, t.conv(v)) for k, v in tensors))
                    for name, (tensors, ep, owner) in sorted(layout.expert_files.items())
                    if (ep, owner) in own or not layout.ep]
    return objects, partitions


def moe_reshard(ckpt: Checkpoint, world_size: int, stage: int | None, bf16_optimizer: bool | None,
                fmt: str, side=(), ep: int | None = None, max_group_size: int | None = None) -> ReshardPlan:
    """An MoE checkpoint (:mod:`zckpt.deepspeed.moe`) at data-parallel size ``world_size``, the expert-parallel
    size, stage and optimizer kept; the expert files ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt`` do not
    depend on the data-parallel size and are copied."""
    autoep_z3 = ckpt.stage == 3 and bool(ckpt.model_state.get("ds_autoep_layers"))
    if max_group_size is not None and not autoep_z3 and (ckpt.extra.get("moe") is None or ckpt.stage == 3):
        raise InvalidArgument("MoE checkpoints zckpt reshards with their expert groups only (native MoE at "
                              "ZeRO-1/2, AutoEP at ZeRO-1/2/3)", param="max_group_size",
                              path=ckpt.location.tag_dir, hint="drop --max-group-size")
    if autoep_z3:
        return _autoep_zero3(ckpt, world_size, stage, bf16_optimizer, fmt, side, ep, max_group_size)
    if ckpt.extra.get("moe_zero0") and ep is not None:
        tag_dir = ckpt.location.tag_dir
        if stage not in (None, 0) or bf16_optimizer:
            raise UnsupportedLayout("changing the ZeRO stage or optimizer of a mixture-of-experts checkpoint is not "
                                    "supported: without ZeRO it stays without", path=tag_dir,
                                    hint="drop --stage / --bf16-optimizer")
        if fmt != "deepspeed":
            raise UnsupportedLayout("a mixture-of-experts checkpoint is resharded in the DeepSpeed layout only",
                                    path=tag_dir, hint="drop --format universal")
        if _changes_ep(ckpt, ep):
            return moe_zero0_at_ep(ckpt, world_size, ep, side)
    src_eps = sorted(set((ckpt.extra.get("moe").ep if ckpt.extra.get("moe") else {}).values()))
    layout, shapes = check_moe(ckpt, world_size, stage, bf16_optimizer, fmt, ep, max_group_size)
    t = target_of(ckpt, world_size, ckpt.stage, ckpt.flavour)
    rename_expert_groups(t, layout, shapes)
    objects, partitions = plan_moe(t, layout, "none", shapes)
    experts = [copied(os.path.join(t.tag, f.path.replace("\\", "/").rsplit("/", 1)[-1]), f.path, f.size)
               for f in sorted(ckpt.location.expert_files, key=lambda f: (f.index, f.expert))]
    files = [planned(o) for o in objects] + experts + side_planned(side, world_size)
    plan = ReshardPlan(ckpt.location.input_path, t.tag, fmt, ckpt.stage, ckpt.flavour, ckpt.world_size, ckpt.stage,
                       ckpt.flavour, world_size, ckpt.precision, files, partitions=partitions)
    eps = sorted(set(layout.ep.values()))
    kept = f"{', '.join(map(str, eps))} kept" if not shapes else \
        f"{'/'.join(map(str, src_eps))} -> {'/'.join(map(str, eps))}"
    cover = sorted(ckpt.extra.get("moe_coverage") or [], key=lambda x: x["index"])
    if shapes and len(src_eps) + len(eps) > 2:
        new = target_eps(ep, cover, world_size, ckpt.location.tag_dir)
        kept = ", ".join(f"layer {x['index']} {x.get('ep')} -> {new[int(x['index'])]}" for x in cover)
    plan.notes.append(f"mixture of experts: expert-parallel size {kept}, data-parallel size "
                      f"{ckpt.world_size} -> {world_size}; each expert group over "
                      + ", ".join(str(world_size // ep) for ep in eps) + " expert-data-parallel ranks")
    src = ckpt.extra.get("moe")
    if shapes and max_group_size is None and src is not None and not src.autoep:
        names = {g.index: g.hyperparams.get("name") for g in ckpt.groups if g.index in src.ep}
        lo, _, cut = cut_bounds(src, names)
        big = max((sum(r.numel for _, r in by_rank[0]) for by_rank in layout.shards.values()), default=0)
        if not cut and big > lo:  # the source's groups say only that the run's limit was at least lo
            plan.notes.append(f"an expert group of {big} elements per rank is written whole, as DeepSpeed's default "
                              "max_group_size keeps it (the source's largest held whole: "
                              f"{lo}); a run that passed split_params_into_different_moe_groups_for_optimizer a "
                              "smaller one: --max-group-size N")
    if ckpt.extra.get("mixed_group_orders"):
        plan.notes.append("the source's ranks saved their param groups in different orders (no fixed "
                          "PYTHONHASHSEED); every output file has rank 0's order ("
                          + ", ".join(str(g.hyper.get("name")) for g in t.groups) + "): resume with a "
                          "PYTHONHASHSEED that gives every rank that order")
    if not t.has_state:
        plan.notes.append("the source has no optimizer state yet (saved before the first step); none is written")
    return plan


# ---- mixture of experts without ZeRO at another expert-parallel size: each expp_rank file rebuilt

_EXPERT = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..+)$")


def moe_zero0_at_ep(ckpt: Checkpoint, world_size: int, ep, side=()) -> ReshardPlan:
    """A native MoE checkpoint without ZeRO (:func:`zckpt.deepspeed.moe._build_zero0`'s files) laid out at other
    expert-parallel sizes (``ep``: one, or one per MoE layer: :func:`~zckpt.deepspeed.expert_groups.target_eps`).

    DeepSpeed saves ``expp_rank_{e}_mp_rank_00_optim_states.pt`` = ``{"optimizer": engine.optimizer.state_dict()}``
    of the expert-data-parallel rank 0 of expert-parallel rank e of the largest expert group, and each rank loads
    the file of its own expert-parallel rank (``engine._load_checkpoint``): a torch optimizer state (one state entry
    per parameter, numbered across the groups) and, for the bf16/fp16 ``FP16_UnfusedOptimizer``, ``fp32_groups`` (one
    fp32 master per parameter), both by position. File e' is that writer rank's: the dense groups as saved, then one
    expert group per expert-parallel size (``ep_size_N``) holding, layer by layer in model order, the rank's experts
    ``e * E/N ..`` under local ids, each parameter's master and state entry (step, moments) taken whole from the
    source file the reader matched it in (:mod:`zckpt.deepspeed.zero0`). ``mp_rank_00_model_states.pt`` gets the new
    ``dp_world_size`` and rank 0's new optimizer; the expert files (global ids) are copied."""
    check_world_size(world_size)
    tag_dir = ckpt.location.tag_dir
    saved = ckpt.extra.get("moe_zero0")
    if not saved:
        raise UnsupportedLayout(ckpt.reshard_refusal or "this mixture-of-experts checkpoint is not resharded",
                                path=tag_dir)
    layers = {int(x["index"]): x for x in ckpt.extra["moe_coverage"]}
    new = target_eps(ep, list(layers.values()), world_size, tag_dir)
    layer_of = {x["prefix"]: i for i, x in layers.items()}
    f0, opt0, names0 = saved[0]
    flat = "fp32_groups" in opt0
    if not flat and not ("state" in opt0 and "param_groups" in opt0):
        raise UnsupportedLayout("mixture-of-experts checkpoint without ZeRO whose optimizer keeps one flat master per "
                                "group (FP16_Optimizer): its flat groups are not laid out at another expert-parallel "
                                "size", path=f0.path)
    where: dict[str, tuple[int, int, int]] = {}  # name -> (file, group, position)
    for e, (_, _, names) in enumerate(saved):
        for g, ns in enumerate(names):
            for j, n in enumerate(ns):
                where.setdefault(n, (e, g, j))
    pgs0 = _osd(opt0)["param_groups"]
    suffixes: dict[str, list[str]] = {}
    plan_groups: list[tuple[dict, list[int] | int]] = []  # (hyper, dense group index | expert sizes' layers)
    expert_groups: dict[int, tuple[dict, list[int]]] = {}  # new size -> (hyper, layers)
    for g, ns in enumerate(names0):
        if not pgs0[g].get("moe"):
            plan_groups.append((pgs0[g], g))
            continue
        for n in ns:
            m = _EXPERT.match(n)
            if m is None or m.group(1) not in layer_of:
                raise UnsupportedLayout(f"'{n}' is in an expert param group but is not an expert of a MoE layer",
                                        path=f0.path)
            sfx = suffixes.setdefault(m.group(1), [])
            if m.group(3) not in sfx:
                sfx.append(m.group(3))
            size = new[layer_of[m.group(1)]]
            hyper = {k: v for k, v in pgs0[g].items() if k not in ("name", "params")}
            if "param_names" in hyper:
                raise UnsupportedLayout(f"expert group {pgs0[g].get('name')!r} saves param_names (local expert "
                                        "names of its rank), which zckpt does not rename for another "
                                        "expert-parallel size", path=f0.path)
            got = expert_groups.get(size)
            if got is None:
                expert_groups[size] = (dict(pgs0[g], name=f"ep_size_{size}"), [])
                plan_groups.append((None, size))
            elif {k: v for k, v in got[0].items() if k not in ("name", "params")} != hyper:
                raise UnsupportedLayout(f"expert groups {got[0].get('name')!r} and {pgs0[g].get('name')!r} have other "
                                        f"hyperparameters and would be one group at expert-parallel size {size}",
                                        path=f0.path, hint="give their layers different --ep sizes")
            if layer_of[m.group(1)] not in expert_groups[size][1]:
                expert_groups[size][1].append(layer_of[m.group(1)])
    src_names = [str(pgs0[g].get("name")) for g in range(len(names0)) if pgs0[g].get("moe")]
    if {f"ep_size_{n}" for n in expert_groups} == set(src_names):  # the names stay: rank 0's order of them
        sizes = sorted(expert_groups, key=lambda n: src_names.index(f"ep_size_{n}"))
        plan_groups = [x for x in plan_groups if x[0] is not None] + [(None, n) for n in sizes]
    missing = sorted(set(layers) - {i for _, ls in expert_groups.values() for i in ls})
    if missing:
        raise UnsupportedLayout(f"MoE layer {missing[0]}'s experts are in no expert param group of rank 0's optimizer",
                                path=f0.path)
    biggest = max(new.values())
    files, conv, byname = [], Converter(), ckpt.by_name()
    source = max((sum(byname[n].numel for n in ns) for g, ns in enumerate(names0) if pgs0[g].get("moe")), default=0)
    for e in range(biggest):
        writer = expert_data_ranks(ckpt.model_state, world_size, biggest, e, tag_dir)[0]
        groups = []
        for hyper, which in plan_groups:
            if hyper is not None:  # a dense group: as saved (every rank holds it)
                groups.append((hyper, [(0, which, j) for j in range(len(names0[which]))]))
                continue
            ghyper, ls = expert_groups[which]
            er = next(r for r in range(which) if writer in expert_data_ranks(ckpt.model_state, world_size, which, r,
                                                                              tag_dir))
            members, numel = [], 0
            for i in sorted(ls):
                prefix, nl = layers[i]["prefix"], int(layers[i]["experts"]) // which
                for x in range(er * nl, (er + 1) * nl):
                    for sfx in suffixes[prefix]:
                        n = f"{prefix}{x}{sfx}"
                        if n not in where:
                            raise UnsupportedLayout(f"no expp_rank file holds the optimizer state of '{n}'",
                                                    path=tag_dir)
                        members.append(where[n])
                        numel += byname[n].numel
            check_group_size(f"ep_size_{which}", numel, tag_dir, source)
            groups.append((ghyper, members))
        files.append(_zero0_optimizer(saved, groups, flat, conv))
    ms = OrderedDict((k, world_size if k == "dp_world_size" else files[0] if k == "optimizer" else conv(v))
                     for k, v in ckpt.model_state.items())
    tag = output_tag(ckpt)
    objects = [TorchObject(os.path.join(tag, "mp_rank_00_model_states.pt"), ms)]
    objects += [TorchObject(os.path.join(tag, f"expp_rank_{e}_mp_rank_00_optim_states.pt"), {"optimizer": o})
                for e, o in enumerate(files)]
    experts = [copied(os.path.join(tag, f.path.replace("\\", "/").rsplit("/", 1)[-1]), f.path, f.size)
               for f in sorted(ckpt.location.expert_files, key=lambda f: (f.index, f.expert))]
    out = [planned(o) for o in objects] + experts + side_planned(side, world_size)
    plan = ReshardPlan(ckpt.location.input_path, tag, "deepspeed", 0, ckpt.flavour, ckpt.world_size, 0,
                       ckpt.flavour, world_size, ckpt.precision, out)
    src = _zero0_layer_eps(ckpt)
    plan.notes.append("mixture of experts without ZeRO: expert-parallel size " + ", ".join(
        f"layer {i} {src[i] or '?'} -> {new[i]}" for i in sorted(new)) + f", data-parallel size {ckpt.world_size} -> "
        f"{world_size}; {biggest} expp_rank files")
    if len(expert_groups) > 1:
        plan.notes.append("expert groups in the order " + ", ".join(f"ep_size_{n}" for h, n in plan_groups if h is None)
                          + ": DeepSpeed orders them by a set of names, so resume with a PYTHONHASHSEED giving it")
    return plan


def _zero0_layer_eps(ckpt: Checkpoint) -> dict[int, int | None]:
    """MoE layer index -> the expert-parallel size of the group (``ep_size_N``) rank 0's optimizer holds its
    experts in (None: not found)."""
    _, opt0, names0 = ckpt.extra["moe_zero0"][0]
    pgs0 = _osd(opt0)["param_groups"]
    of_prefix = {}
    for g, ns in enumerate(names0):
        m = EP_NAME_RE.match(str(pgs0[g].get("name", ""))) if pgs0[g].get("moe") else None
        for n in ns if m else ():
            x = _EXPERT.match(n)
            if x:
                of_prefix.setdefault(x.group(1), int(m.group(1)))
    return {int(x["index"]): of_prefix.get(x["prefix"]) for x in ckpt.extra["moe_coverage"]}


def _changes_ep(ckpt: Checkpoint, ep) -> bool:
    """Whether ``ep`` gives some MoE layer another expert-parallel size than it has (unknown sizes count as other)."""
    src = _zero0_layer_eps(ckpt)
    sizes = [ep] * len(src) if isinstance(ep, int) else list(ep)
    return len(sizes) != len(src) or any(src[i] != n for i, n in zip(sorted(src), sizes))


def _osd(opt: dict) -> dict:
    return opt["optimizer_state_dict"] if "fp32_groups" in opt else opt


def _zero0_optimizer(saved: list, groups: list[tuple[dict, list[tuple[int, int, int]]]], flat: bool,
                     conv: Converter) -> OrderedDict:
    """One rank's ``optimizer.state_dict()``: ``groups`` as (param group, the (file, group, position) of each
    parameter in the source files), state entries renumbered across the groups as torch numbers them."""
    state, pgs, masters = OrderedDict(), [], []
    pid = 0
    for hyper, members in groups:
        ids, mine = [], []
        for e, g, j in members:
            opt = saved[e][1]
            osd = _osd(opt)
            src = osd["param_groups"][g]["params"][j]
            if src in (osd.get("state") or {}):
                state[pid] = conv(osd["state"][src])
            if flat:
                mine.append(conv(opt["fp32_groups"][g][j]))
            ids.append(pid)
            pid += 1
        pgs.append(OrderedDict((k, ids if k == "params" else conv(v)) for k, v in hyper.items()))
        masters.append(mine)
    osd = OrderedDict([("state", state), ("param_groups", pgs)])
    if not flat:
        return osd
    return OrderedDict((k, osd if k == "optimizer_state_dict" else masters if k == "fp32_groups" else conv(v))
                       for k, v in saved[0][1].items())


# ---- AutoEP at ZeRO-3 at another data-parallel and expert-parallel size

def autoep_zero3_target(ckpt: Checkpoint, world_size: int, stage, bf16_optimizer, fmt: str, ep,
                        ranks=None) -> tuple[Target, int, list[int]]:
    """The target of an AutoEP ZeRO-3 checkpoint at ``world_size`` ranks (``ranks`` of them planned) and
    expert-parallel size ``ep`` (default: kept): (target, the new size, the source's sizes); what DeepSpeed cannot
    run is refused in one line."""
    check_world_size(world_size)
    tag_dir = ckpt.location.tag_dir
    if stage not in (None, 3) or bf16_optimizer:
        raise UnsupportedLayout("changing the ZeRO stage or optimizer of an AutoEP ZeRO-3 checkpoint is not "
                                "supported: keep stage 3", path=tag_dir, hint="drop --stage / --bf16-optimizer")
    if fmt != "deepspeed":
        raise UnsupportedLayout("a mixture-of-experts checkpoint is resharded in the DeepSpeed layout only",
                                path=tag_dir, hint="drop --format universal")
    cover = sorted(ckpt.extra.get("moe_coverage") or [], key=lambda x: x["index"])
    src = sorted({int(x.get("ep") or 1) for x in cover})
    new = target_eps(src[0] if ep is None and len(src) == 1 else ep, cover, world_size, tag_dir)
    if len(set(new.values())) != 1:
        raise UnsupportedLayout(f"AutoEP layers at expert-parallel sizes {sorted(set(new.values()))}: DeepSpeed's "
                                "AutoEP requires one size for every layer", path=tag_dir, hint="pass one --ep size")
    return target_of(ckpt, world_size, 3, "zero3", ranks), next(iter(new.values())), src


def _autoep_zero3(ckpt: Checkpoint, world_size: int, stage, bf16_optimizer, fmt: str, side, ep,
                  max_group_size: int | None = None) -> ReshardPlan:
    """AutoEP at ZeRO-3 (``zero3_partitioned``) laid out at ``world_size`` ranks and expert-parallel size ``ep``
    (default: kept) by :func:`zckpt.deepspeed.write_zero.plan_autoep_zero3` (an expert group DeepSpeed cut into
    several param groups cut again as its helper cuts at ``max_group_size``, else at the source's cut)."""
    t, size, src = autoep_zero3_target(ckpt, world_size, stage, bf16_optimizer, fmt, ep)
    objects, partitions = plan_autoep_zero3(t, size, max_group_size)
    files = [planned(o) for o in objects] + side_planned(side, world_size)
    plan = ReshardPlan(ckpt.location.input_path, t.tag, fmt, 3, ckpt.flavour, ckpt.world_size, 3, ckpt.flavour,
                       world_size, ckpt.precision, files, partitions=partitions)
    plan.notes.append(f"AutoEP at ZeRO-3: expert-parallel size {'/'.join(map(str, src))}"
                      + (" kept" if src == [size] else f" -> {size}") + f", data-parallel size {ckpt.world_size} -> "
                      f"{world_size}; each expert shard over {world_size // size} expert-data-parallel ranks")
    if not t.has_state:
        plan.notes.append("the source has no optimizer state yet (saved before the first step); none is written")
    return plan
