"""The ZeRO-1/2 (and BF16 optimizer) and ZeRO-3 rank files of a target layout, as object trees whose tensors are
:class:`~zckpt.engine.torchzip.TensorOut` s of source pieces and zero fill (partition maths:
:mod:`zckpt.deepspeed.partition`, DeepSpeed 0.19.8's exactly)."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field

from zckpt.deepspeed import group_cuts, partition as W
from zckpt.deepspeed.expert_groups import autoep_layers_at, check_group_size, expert_data_ranks
from zckpt.deepspeed.partition import TorchObject
from zckpt.state.model import TensorRecord
from zckpt.encoding.safeload import DTYPE_SIZES
from zckpt.engine.segments import slice_pieces
from zckpt.engine.torchzip import TensorOut
from zckpt.errors import UnsupportedLayout

from zckpt.deepspeed.target import (
    Group, Target, clip_grad, elastic_base, flat_dtypes, frozen_records, group_params, key_dtype, loss_scaler_state,
    model_file, module_zero12, module_zero3, optim_file, state_dict_out, state_pieces,
)


# ---- ZeRO-1/2 and the BF16 optimizer

@dataclass
class FlatGroup:
    """One param group laid out flat at the target size: ``flat`` maps fp32 / exp_avg / exp_avg_sq to the
    segments of the whole padded group, in the dtypes the source stores them in."""

    group: Group
    layout: W.FlatGroupLayout
    flat: dict[str, list]
    master_dtype: str
    state_dtype: str | None
    names: list[str] | None = None  # the names param_slice_mappings gives the records (default: theirs)
    key_dtypes: dict = field(default_factory=dict)  # per-element state key -> its dtype


def flat_group(t: Target, g: Group, ws: int, names: list[str] | None = None) -> FlatGroup:
    """Group ``g`` laid out flat over ``ws`` partitions (the data-parallel size; an expert group's: its
    expert-data-parallel size)."""
    align = bool((t.cfg.get("zero_optimization") or {}).get("parameter_alignment", False)) and t.flavour == "zero"
    itemsize = DTYPE_SIZES[t.lp_dtype(g.records[0])] if g.records else 2
    lay = W.flat_group_layout([r.numel for r in g.records], ws, itemsize, align)
    mdt, sdt = flat_dtypes(t, g.records, f"param group {g.index}")
    flat = {"fp32": lay.flat([list(r.value) for r in g.records], mdt)}
    dtypes = {}
    for key in t.state_keys if t.has_state else ():
        dtypes[key] = key_dtype(t, g.records, key, f"param group {g.index}")
        flat[key] = lay.flat([state_pieces(r, key) for r in g.records], dtypes[key])
    return FlatGroup(g, lay, flat, mdt, sdt, names, dtypes)


def flat_groups(t: Target) -> list[FlatGroup]:
    return [flat_group(t, g, t.world_size) for g in t.groups]


def flat_partitions(t: Target, fgs: list[FlatGroup]) -> list[dict]:
    return [{"group": fg.group.index, "numel": sum(r.numel for r in fg.group.records),
             "partition": fg.layout.partition, "paddings": [fg.layout.group_padding(r) for r in range(t.world_size)]}
            for fg in fgs]


def zero12_optim(t: Target, fgs: list[FlatGroup], rank: int, windows: list[int] | None = None) -> TorchObject:
    """Rank ``rank``'s optimizer-states file: its window of every flat group, moments, paddings, slice maps.
    ``windows``: the partition each group takes (default ``rank``; an MoE expert group: the rank's index in its
    expert-data-parallel group, whose size is the group's ``layout.ws``, its ``partition_count``)."""
    fp32_parts, state, pgroups, gpads, maps = [], OrderedDict(), [], [], []
    for gi, fg in enumerate(fgs):
        lay, flat = fg.layout, fg.flat
        w = rank if windows is None else windows[gi]
        P, pad = lay.partition, lay.group_padding(w)
        keep = P if t.flavour == "bf16_optimizer" else P - pad
        fp32_parts.append(TensorOut(fg.master_dtype, (keep,), W.slice_segments(flat["fp32"], w * P, keep)))
        if t.has_state:
            state[gi] = state_dict_out(t, fg.group, lambda key, fg=fg, w=w, P=P: TensorOut(
                fg.key_dtypes[key], (P,), W.slice_segments(fg.flat[key], w * P, P)))
        pgroups.append(group_params(fg.group.hyper, [gi], t.conv))
        gpads.append(pad)
        names = fg.names or [r.name for r in fg.group.records]
        maps.append(OrderedDict((names[i], W.fragment_address(n, s)) for i, n, s in lay.slice_map(w)))
    osd = OrderedDict()
    if t.flavour == "zero":
        osd.update(loss_scaler_state(t))
    clip = clip_grad(t)
    if clip is not None:  # None: not known (a DCP source converted without a config): the engine keeps its own
        osd["clip_grad"] = clip
    osd["base_optimizer_state"] = elastic_base(state, gpads) if t.elastic else {"state": state,
                                                                                  "param_groups": pgroups}
    if t.elastic and "base_optimizer_state_step" in t.osd0:
        osd["base_optimizer_state_step"] = t.conv(t.osd0["base_optimizer_state_step"])
    osd["single_partition_of_fp32_groups"] = fp32_parts
    if t.flavour == "zero":
        osd["zero_stage"] = W.zero_stage_enum(t.stage)
    osd["group_paddings"] = gpads
    if t.flavour == "zero":
        osd["param_alignment_paddings"] = [list(fg.layout.param_paddings) for fg in fgs]
    osd["partition_count"] = [fg.layout.ws for fg in fgs]
    osd["ds_version"] = t.version
    osd["param_slice_mappings"] = maps
    return optim_file(t, rank, osd)


def _zero12_model(t: Target) -> TorchObject:
    """The one model-states file of ZeRO-1/2: full weights; ZeRO-2 also lists the frozen params."""
    module = module_zero12(t)
    param_shapes = [OrderedDict((r.name, W.torch_size(r.shape)) for r in g.records) for g in t.groups]
    frozen_shapes = frozen_frags = None
    if t.stage == 2:
        frozen = frozen_records(t)
        if frozen or t.ms0.get("frozen_param_shapes") is not None:
            frozen_shapes = OrderedDict((r.name, W.torch_size(r.shape)) for r in frozen)
            frozen_frags = OrderedDict((r.name, module[r.name] if r.name in module else
                                        TensorOut(r.dtype, r.shape, list(r.value))) for r in frozen)
    return model_file(t, 0, module, param_shapes, frozen_shapes, frozen_frags)


def plan_zero12(t: Target) -> tuple[list[TorchObject], list[dict]]:
    fgs = flat_groups(t)
    optim = [zero12_optim(t, fgs, rank) for rank in t.ranks]
    return [_zero12_model(t)] + optim, flat_partitions(t, fgs)


# ---- ZeRO-3

@dataclass
class _SubGroup:
    """One ZeRO-3 sub-group: consecutive params of a user group flattened into one partition per rank."""

    group: Group
    records: list[TensorRecord]
    master_dtype: str
    state_dtype: str | None

    def partition(self, ws: int) -> int:
        return sum(W.zero3_part(r.numel, ws) for r in self.records)

    def rank_slice(self, attr: str, ws: int, rank: int, dtype: str | None = None) -> TensorOut:
        """This sub-group's partition of rank ``rank``: each param's ceil(n/ws) slice, for ``attr`` (value, or a
        per-element optimizer-state key stored as ``dtype``)."""
        dtype = self.master_dtype if attr == "value" else dtype or self.state_dtype
        segs = []
        for r in self.records:
            segs += W.zero3_rank_slice(list(r.value) if attr == "value" else state_pieces(r, attr), r.numel, ws,
                                       rank, dtype)
        return TensorOut(dtype, (self.partition(ws),), segs)


def _sub_groups(t: Target) -> list[_SubGroup]:
    sgs = t.cfg.get("zero_optimization", {}).get("sub_group_size", W.DEFAULT_SUB_GROUP_SIZE)
    sgs = int(float(sgs)) if sgs is not None else None
    cut = [(g, [g.records[i] for i in idx]) for g in t.groups
           for idx in W.zero3_sub_groups([r.numel for r in g.records], t.world_size, sgs)]
    return [_SubGroup(g, recs, *flat_dtypes(t, recs, f"ZeRO-3 sub-group {s}")) for s, (g, recs) in enumerate(cut)]


def _sub_partitions(t: Target, subs: list[_SubGroup]) -> list[dict]:
    return [{"sub_group": s, "group": sg.group.index, "params": len(sg.records),
             "partition": sg.partition(t.world_size)} for s, sg in enumerate(subs)]


def _zero3_optim(t: Target, subs: list[_SubGroup], rank: int) -> TorchObject:
    """Rank ``rank``'s optimizer-states file: its slice of every sub-group, moments, the user param groups."""
    ws, flat, state = t.world_size, [], OrderedDict()
    for s, sg in enumerate(subs):
        flat.append(sg.rank_slice("value", ws, rank))
        if t.has_state:
            dts = {k: key_dtype(t, sg.records, k, f"ZeRO-3 sub-group {s}") for k in t.state_keys}
            state[s] = state_dict_out(t, sg.group, lambda key, sg=sg, dts=dts: sg.rank_slice(key, ws, rank,
                                                                                                dts[key]))
    pgroups = [group_params(g.hyper, [s for s, sg in enumerate(subs) if sg.group.index == g.index], t.conv)
               for g in t.groups]
    osd = OrderedDict([("zero_stage", W.zero_stage_enum(3))])
    osd.update(loss_scaler_state(t))
    osd["partition_count"] = ws
    osd["optimizer_state_dict"] = {"state": state, "param_groups": pgroups}
    osd["fp32_flat_groups"] = flat
    return optim_file(t, rank, osd)


def _zero3_model(t: Target, subs: list[_SubGroup], module: OrderedDict, rank: int) -> TorchObject:
    """Rank ``rank``'s model-states file: placeholder module, shapes per sub-group, its frozen-param slices."""
    ws, frozen = t.world_size, frozen_records(t)
    param_shapes = [OrderedDict((r.name, W.torch_size(r.shape)) for r in sg.records) for sg in subs]
    frozen_shapes = frozen_frags = None
    if frozen or t.ms0.get("frozen_param_shapes") is not None:
        frozen_shapes = OrderedDict((r.name, W.torch_size(r.shape)) for r in frozen)
        frozen_frags = OrderedDict(
            (r.name, TensorOut(r.dtype, (W.zero3_part(r.numel, ws),),
                               W.zero3_rank_slice(list(r.value), r.numel, ws, rank, r.dtype)))
            for r in frozen)
    return model_file(t, rank, module, param_shapes, frozen_shapes, frozen_frags)


def plan_zero3(t: Target) -> tuple[list[TorchObject], list[dict]]:
    subs = _sub_groups(t)
    module = module_zero3(t)  # one placeholder module, shared by every rank's file
    models = [_zero3_model(t, subs, module, rank) for rank in t.ranks]
    optims = [_zero3_optim(t, subs, rank) for rank in t.ranks]
    return models + optims, _sub_partitions(t, subs)


# ---- AutoEP at ZeRO-3 (zero3_partitioned): dense sub-groups over every rank, each expert-parallel rank's local
# shards over its expert-data-parallel group

def _autoep_cut_groups(t: Target, fused: set, ep: int, limit: int | None) -> list[Group]:
    """The target's param groups with the AutoEP expert group at ``ep``: named ``ep_size_{ep}``, and where DeepSpeed's
    ``configure_moe_param_groups`` cut it into several param groups of one name (its ``max_group_size``), its
    parameters laid out as one sequence and cut again as the helper cuts them at ``ep`` (each expert parameter counts
    its local ``[E/ep, ...]`` elements: :func:`~zckpt.deepspeed.group_cuts.output_cuts`, the limit ``limit`` or read
    from the source's cut). Each output group is one ZeRO-3 sub-group, as DeepSpeed makes it."""
    tag_dir = t.ckpt.location.tag_dir
    at = [i for i, g in enumerate(t.groups) if g.records and all(r.name in fused for r in g.records)]
    egroups = [t.groups[i] for i in at]
    plain = [{k: v for k, v in g.hyper.items() if k != "params"} for g in egroups]
    if not at or at != list(range(at[0], at[0] + len(at))) or any(h != plain[0] for h in plain):
        raise UnsupportedLayout(f"{len(at)} AutoEP expert param groups apart or of other names or hyperparameters "
                                "(several user param groups): not laid out again", path=tag_dir)
    recs = [r for g in egroups for r in g.records]
    bad = next((r for r in recs if not r.shape or int(r.shape[0]) % ep), None)
    if bad is not None:
        raise UnsupportedLayout(f"AutoEP '{bad.name}': {bad.shape[0] if bad.shape else '?'} experts do not split "
                                f"over expert-parallel size {ep}", path=tag_dir, hint="pass an --ep dividing it")
    src_ep = max(int(x.get("ep") or 1) for x in t.ckpt.extra.get("moe_coverage") or [{}])
    bounds = group_cuts.check_limit(group_cuts.bounds_of([[[r.numel // src_ep for r in g.records]
                                                            for g in egroups]]), limit, tag_dir)
    local = [r.numel // ep for r in recs]
    starts = group_cuts.output_cuts(local, ep, bounds, limit, tag_dir)
    if starts is None:  # nothing was cut in the source: one group, up to DeepSpeed's default limit
        check_group_size(f"ep_size_{ep}", sum(local), tag_dir, sum(r.numel // src_ep for r in recs))
        starts = [0]
    cut = []
    for k, (a, b) in enumerate(zip(starts, starts[1:] + [len(recs)])):
        g = egroups[min(k, len(egroups) - 1)]  # its step and saved state keys (one value for every cut group)
        hyper = OrderedDict((key, f"ep_size_{ep}" if key == "name" else v) for key, v in g.hyper.items())
        cut.append(dataclasses.replace(g, hyper=hyper, records=recs[a:b]))
    groups = t.groups[:at[0]] + cut + t.groups[at[-1] + 1:]
    return [dataclasses.replace(g, index=i) for i, g in enumerate(groups)]


def plan_autoep_zero3(t: Target, ep: int, max_group_size: int | None = None) -> tuple[list[TorchObject], list[dict]]:
    """The ZeRO-3 files of an AutoEP model (``checkpoint_format: zero3_partitioned``) at expert-parallel size ``ep``
    and data-parallel size ``t.world_size`` (:mod:`zckpt.deepspeed.autoep`'s reader in reverse). Dense groups are
    cut into sub-groups and partitioned over every rank as :func:`plan_zero3` does; an expert group is one
    sub-group (several where DeepSpeed's ``max_group_size`` cut it into param groups of one name:
    :func:`_autoep_cut_groups`) holding, on rank R of expert-parallel rank e, R's local ``[E/ep, ...]`` shard of
    each fused expert parameter (experts ``e * E/ep ..`` of the full record), each partitioned in ceil(n/edp) slices over e's
    expert-data-parallel ranks (:func:`~zckpt.deepspeed.expert_groups.expert_data_ranks`). Each rank's optimizer
    file states its partitions (``ds_zero_partition_groups``: count, rank, ranks, families, group names), which
    DeepSpeed compares with its own ("parameter placement topology"); each rank's model-states file its
    ``ds_autoep_layers`` (placement, affine maps, its ep_rank, expert-data-parallel rank, experts)."""
    ckpt, ws, tag_dir = t.ckpt, t.world_size, t.ckpt.location.tag_dir
    fused = {n for x in ckpt.extra.get("moe_coverage") or [] for n in x.get("fused") or []}
    edp = ws // ep
    sgs = t.cfg.get("zero_optimization", {}).get("sub_group_size", W.DEFAULT_SUB_GROUP_SIZE)
    sgs = int(float(sgs)) if sgs is not None else None
    subs: list[tuple[bool, _SubGroup, list[TensorRecord]]] = []  # (expert, sub-group, full records)
    t.groups = _autoep_cut_groups(t, fused, ep, max_group_size)
    for g in t.groups:
        expert = bool(g.records) and all(r.name in fused for r in g.records)
        if not expert:
            if any(r.name in fused for r in g.records):
                raise UnsupportedLayout(f"param group {g.index} mixes AutoEP expert and dense parameters",
                                        path=tag_dir)
            for idx in W.zero3_sub_groups([r.numel for r in g.records], ws, sgs):
                recs = [g.records[i] for i in idx]
                subs.append((False, _SubGroup(g, recs, *flat_dtypes(t, recs, f"ZeRO-3 sub-group {len(subs)}")),
                             recs))
            continue
        local = [r.numel // int(r.shape[0]) * (int(r.shape[0]) // ep) for r in g.records]
        if len(W.zero3_sub_groups(local, edp, sgs)) != 1:
            raise UnsupportedLayout(f"AutoEP expert group {g.hyper.get('name')!r} would be cut into several ZeRO-3 "
                                    "sub-groups (sub_group_size), which zckpt does not lay out", path=tag_dir)
        subs.append((True, _SubGroup(g, g.records, *flat_dtypes(t, g.records, f"ZeRO-3 sub-group {len(subs)}")),
                     g.records))
    meta0 = ckpt.optim_states[0]["optimizer_state_dict"].get("ds_zero_partition_groups") or []
    kinds = {}
    for m in meta0:
        s = m.get("sub_group") if isinstance(m, dict) else None
        osub = (ckpt.model_state.get("param_shapes") or [])[s] if isinstance(s, int) else {}
        kind, desc = any(n in fused for n in osub), (m.get("families"), m.get("group_names"))
        if kinds.setdefault(kind, desc) != desc:  # (e.g. shared experts placed apart: not laid out)
            raise UnsupportedLayout(f"the {'expert' if kind else 'dense'} sub-groups have other placement families "
                                    f"({kinds[kind]} and {desc}): not laid out again",
                                    path=ckpt.location.optim_files[0].path)
    if set(kinds) != {False, True}:
        raise UnsupportedLayout("the optimizer files' ds_zero_partition_groups do not describe a dense and an expert "
                                "sub-group", path=ckpt.location.optim_files[0].path)
    module = module_zero3(t)
    ranks_of = {e: expert_data_ranks(ckpt.model_state, ws, ep, e, tag_dir) for e in range(ep)}
    layers0 = autoep_layers_at(ckpt.model_state["ds_autoep_layers"], ep, ws)
    objects, optims = [], []
    for rank in t.ranks:
        e = next(x for x, rs in ranks_of.items() if rank in rs)
        p = ranks_of[e].index(rank)
        mine = []  # this rank's sub-groups: (the sub-group of its records, partition count, rank in it, ranks)
        for expert, sg, recs in subs:
            if not expert:
                mine.append((sg, ws, rank, list(range(ws)), False))
                continue
            shards = []
            for r in recs:
                nl = int(r.shape[0]) // ep
                per = r.numel // int(r.shape[0])

                def cut(pieces, nl=nl, per=per):
                    return slice_pieces(pieces, e * nl * per, nl * per) if pieces else []
                shards.append(dataclasses.replace(r, shape=(nl, *r.shape[1:]), value=cut(r.value),
                                                  exp_avg=cut(r.exp_avg), exp_avg_sq=cut(r.exp_avg_sq),
                                                  other_state={k: cut(v) for k, v in r.other_state.items()}))
            mine.append((_SubGroup(sg.group, shards, sg.master_dtype, sg.state_dtype), edp, p, ranks_of[e], True))
        flat, state, meta = [], OrderedDict(), []
        for s, (sg, count, prank, pranks, expert) in enumerate(mine):
            flat.append(sg.rank_slice("value", count, prank))
            if t.has_state:
                dts = {k: key_dtype(t, sg.records, k, f"ZeRO-3 sub-group {s}") for k in t.state_keys}
                state[s] = state_dict_out(t, sg.group, lambda key, sg=sg, c=count, pr=prank, dts=dts:
                                          sg.rank_slice(key, c, pr, dts[key]))
            families, names = kinds[expert]
            meta.append({"sub_group": s, "partition_count": count, "partition_rank": prank,
                         "partition_ranks": list(pranks), "families": list(families or []),
                         "group_names": [f"ep_size_{ep}"] if expert else list(names or [])})
        pgroups = [group_params(g.hyper, [s for s, (sg, *_) in enumerate(mine) if sg.group.index == g.index], t.conv)
                   for g in t.groups]
        osd = OrderedDict([("zero_stage", W.zero_stage_enum(3))])
        osd.update(loss_scaler_state(t))
        osd["partition_count"] = ws
        osd["ds_zero_partition_groups"] = meta
        osd["optimizer_state_dict"] = {"state": state, "param_groups": pgroups}
        osd["fp32_flat_groups"] = flat
        optims.append(optim_file(t, rank, osd))
        param_shapes = [OrderedDict((r.name, W.torch_size(r.shape)) for r in sg.records) for sg, *_ in mine]
        if frozen_records(t):
            raise UnsupportedLayout("AutoEP ZeRO-3 checkpoint with frozen parameters: not laid out again",
                                    path=tag_dir)
        mf = model_file(t, rank, module, param_shapes, None if t.ms0.get("frozen_param_shapes") is None
                        else OrderedDict(), None if t.ms0.get("frozen_param_fragments") is None else OrderedDict())
        layers = [dict(x, ep_rank=e, expert_data_parallel_rank=p, global_expert_start=e * int(x["num_local_experts"]),
                       global_expert_end=(e + 1) * int(x["num_local_experts"])) if isinstance(x, dict) else x
                  for x in layers0]
        mf.obj["ds_autoep_layers"] = t.conv(layers)
        uci = mf.obj.get("universal_checkpoint_info")
        if isinstance(uci, dict) and "ds_autoep_layers" in uci:
            mf.obj["universal_checkpoint_info"] = dict(uci, ds_autoep_layers=t.conv(layers))
        objects.append(mf)
    partitions = [{"sub_group": s, "group": sg.group.index, "params": len(recs),
                   "partition": sg.partition(ws) if not expert else
                   sum(W.zero3_part(r.numel // ep, edp) for r in recs)} for s, (expert, sg, recs) in enumerate(subs)]
    return objects + optims, partitions
