"""AutoEP (DeepSpeed 0.19.2+, fused ``experts.w1/w2/w3`` of logical shape ``[num_experts, ...]``, ``ds_autoep_layers``
with affine maps) is read at ZeRO-1/2 from its expert groups and expert files (:func:`build_autoep`) and at
ZeRO-3 (``checkpoint_format: zero3_partitioned``, no expert files) from the per-rank ZeRO-3 files, where each
rank's local expert shards are a sub-group partitioned over its expert-data-parallel group
(:func:`build_autoep_zero3`); both put each expert-parallel rank's shard where the affine map says
(:func:`_autoep_full`). ZeRO-3 AutoEP is merged, verified, converted and resharded offline
and on load (:func:`zckpt.deepspeed.write_zero.plan_autoep_zero3`, through
:func:`zckpt.deepspeed.writer.plan_ranks`), never by the ZeRO-3 writer of dense models (:data:`Z3_REFUSAL`).

Both readers build on :mod:`zckpt.deepspeed.expert_groups` (the views of the files restricted to groups and ranks,
:func:`~zckpt.deepspeed.expert_groups.expert_data_ranks`) and are reached through :func:`zckpt.deepspeed.moe.build`.
"""

from __future__ import annotations

import dataclasses
import math

from zckpt.deepspeed.discover import Location, RankFile
from zckpt.deepspeed.expert_groups import (
    EP_NAME_RE, REFUSAL, MoELayout, autoep_layers, ep_size_of, expert_data_ranks, expert_file_tensors,
    moe_state_refusal, param_groups_of, select_groups, sub_location,
)
from zckpt.deepspeed.model import LP_DTYPES, Checkpoint, GroupInfo, TensorRecord, check_ranks, load_all, pieces_of
from zckpt.errors import CorruptFile, IncompleteCheckpoint, UnsupportedLayout
from zckpt.encoding.safeload import LazyTensor
from zckpt.state import experts as coverage

Z3_REFUSAL = ("AutoEP checkpoint of ZeRO-3: each expert parameter is partitioned over its expert-parallel rank's "
              "expert-data-parallel group, which zckpt lays out again only as AutoEP (zckpt reshard [--ep N], "
              "zckpt.deepspeed.load_checkpoint)")


def build_autoep(loc: Location, model_states: list[dict], optim_states: list[dict]) -> Checkpoint:
    """AutoEP (DeepSpeed 0.19.2+) at ZeRO-1/2: ``ds_autoep_layers`` in the model states describes each MoE layer
    (``module_path``, ``num_experts``, ``ep_size``, ``expert_placement``, and an ``affine_maps`` entry per fused
    expert parameter ``{module_path}.experts.w1/w2/w3``: its logical ``[num_experts, ...]`` shape and, per
    expert-parallel rank, which block of it that rank's ``[num_local, ...]`` shard is). Expert params are in their
    own optimizer groups (``ep_size_N``), partitioned over each expert-parallel rank's expert-data-parallel ranks;
    every rank's shard is read with :func:`zckpt.deepspeed.zero12.build` and the shards are put where the map says
    (only whole contiguous blocks without scale; anything else is refused). The expert files
    (``layer_{L}_expert_{E}``, one ``experts.wK.{E}`` slice each) give the training dtype and must all be there.
    ZeRO-3 AutoEP (``zero3_partitioned``) is :func:`build_autoep_zero3`."""
    from zckpt.deepspeed import zero12

    ms0, mpath = model_states[0], loc.model_files[0].path
    layers = ms0["ds_autoep_layers"]
    if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
        raise CorruptFile("ds_autoep_layers is not a list of layer descriptions", path=mpath)
    if not optim_states or len(loc.model_files) != 1 or any(f.kind != "optim" for f in loc.optim_files):
        raise UnsupportedLayout("AutoEP checkpoint of ZeRO-3 or without ZeRO (no per-rank ZeRO-1/2 optimizer files); "
                                "zckpt reads AutoEP checkpoints of ZeRO-1/2", path=loc.tag_dir)
    maps: dict[str, dict] = {}
    for layer in layers:
        if layer.get("checkpoint_format") != "per_expert_files" or (layer.get("affine_maps") or {}).get("version") != 1:
            raise UnsupportedLayout(f"AutoEP layer {layer.get('module_path')}: checkpoint_format "
                                    f"{layer.get('checkpoint_format')!r}, affine map version "
                                    f"{(layer.get('affine_maps') or {}).get('version')!r} (zckpt reads "
                                    "per_expert_files, version 1)", path=mpath)
        for name, amap in ((layer.get("affine_maps") or {}).get("params") or {}).items():
            maps[name] = {**amap, "_layer": layer}
    described = autoep_layers(layers, maps, mpath)  # each expert held once, before anything is put together
    osds = [st.get("optimizer_state_dict") for st in optim_states]
    if not all(isinstance(o, dict) for o in osds) or int(osds[0].get("zero_stage") or 0) not in (1, 2):
        raise UnsupportedLayout("AutoEP checkpoint whose optimizer files are not ZeRO-1/2", path=loc.tag_dir)
    ws = len(loc.optim_files)
    param_shapes = ms0.get("param_shapes")
    ngroups = len(osds[0].get("single_partition_of_fp32_groups") or [])
    if not isinstance(param_shapes, list) or len(param_shapes) != ngroups:
        raise CorruptFile(f"param_shapes lists {len(param_shapes or [])} groups, the optimizer {ngroups}", path=mpath)
    hyper = param_groups_of(osds[0], ngroups)
    experts = [g for g in range(ngroups) if any(n in maps for n in param_shapes[g])]
    for g in experts:
        if not all(n in maps for n in param_shapes[g]):
            raise CorruptFile(f"param group {g} mixes AutoEP expert and dense parameters", path=mpath)
    dense = [g for g in range(ngroups) if g not in experts]
    drop = (lambda d: None if d is None else {k: v for k, v in d.items() if k not in maps})
    ms_dense = {**ms0, "param_shapes": [param_shapes[g] for g in dense],
                "frozen_param_shapes": drop(ms0.get("frozen_param_shapes")),
                "frozen_param_fragments": drop(ms0.get("frozen_param_fragments"))}
    base = zero12.build(sub_location(loc, loc.optim_files), [ms_dense],
                        [select_groups(st, dense) for st in optim_states])
    groups = [dataclasses.replace(gi, index=dense[gi.index]) for gi in base.groups]
    records = [dataclasses.replace(r, group=dense[r.group]) if r.group is not None else r for r in base.records]
    lp, file_tensors = _autoep_expert_files(loc, layers, maps)
    counts = osds[0].get("partition_count")
    expert_recs: list[TensorRecord] = []
    sub_keys: set[str] = set()  # the expert groups' per-element state other than Adam's
    eps: dict[int, int] = {}
    shards_of: dict[int, dict[int, list[tuple[str, TensorRecord]]]] = {}
    for g in experts:
        ep = ep_size_of(hyper[g], counts[g] if isinstance(counts, (list, tuple)) else counts, ws, g, mpath)
        ms_g = {**ms0, "module": None, "param_shapes": [param_shapes[g]], "frozen_param_shapes": None,
                "frozen_param_fragments": None, "shared_params": {}, "buffer_names": []}
        shards: dict[str, dict[int, TensorRecord]] = {}
        info = None
        for e in range(ep):
            ranks = expert_data_ranks(ms0, ws, ep, e, loc.tag_dir)
            files = [dataclasses.replace(loc.optim_files[r], dp_rank=i) for i, r in enumerate(ranks)]
            sub = zero12.build(sub_location(loc, files), [ms_g], [select_groups(optim_states[r], [g]) for r in ranks])
            sub_keys.update(sub.other_state_keys)
            for rec in sub.of_kind("trainable"):
                shards.setdefault(rec.name, {})[e] = rec
                shards_of.setdefault(g, {}).setdefault(e, []).append(
                    (rec.name, dataclasses.replace(rec, group=g, lp_dtype=lp.get(rec.name))))
            info = info or GroupInfo(g, sub.groups[0].hyperparams, sub.groups[0].step, [])
        eps[g] = ep
        for name in param_shapes[g]:
            expert_recs.append(_autoep_full(name, shards[name], maps[name], g, lp[name], mpath))
            info.names.append(name)
        groups.append(info)
    groups.sort(key=lambda gi: gi.index)
    for layer in layers:
        mine = [r for r in expert_recs if r.name in maps and maps[r.name]["_layer"] is layer]
        prefix = f"{layer.get('module_path')}."
        at = max((i + 1 for i, r in enumerate(records) if r.name.startswith(prefix)), default=len(records))
        records[at:at] = mine
    notes = [f"AutoEP: {len(layers)} MoE layer(s), {len(loc.expert_files)} expert files, expert groups "
             + ", ".join(f"{g} ({hyper[g].get('name', '?')})" for g in experts)]
    coverage.check(described, records, loc.tag_dir)
    return Checkpoint(loc, base.stage, base.flavour, base.precision, ws, records, groups, ms0, optim_states,
                      model_states, offload=base.offload, notes=notes, parallel="moe", reshard_refusal=REFUSAL,
                      extra={"moe": MoELayout(eps, shards_of, file_tensors, autoep=True),
                             "moe_coverage": described},
                      state_refusal=moe_state_refusal(base, records, sub_keys))


def build_autoep_zero3(loc: Location, model_states: list[dict], optim_states: list[dict]) -> Checkpoint:
    """AutoEP at ZeRO-3 (``checkpoint_format: zero3_partitioned``): every rank R writes its own
    ``zero_pp_rank_R`` model states (0-element placeholders in ``module``, no expert tensors, no expert files) and
    ZeRO-3 optimizer file. ``param_shapes`` lists sub-groups: the dense ones, partitioned over all ``ws`` ranks as
    :mod:`zckpt.deepspeed.zero3` reads them, and one sub-group per expert group (``ep_size_N``, ``moe: True``)
    holding R's LOCAL ``[num_local, ...]`` shards of the fused expert parameters, each partitioned on its own in
    ceil(n/edp) slices over R's expert-data-parallel group (``stage3._get_param_partition_group``). Which ranks
    those are is read from each rank's own files and cross-checked: ``ds_zero_partition_groups`` (partition_count,
    partition_rank, partition_ranks per sub-group), its ``ds_autoep_layers`` entry (``ep_rank``,
    ``expert_data_parallel_rank`` / ``_world_size``, ``global_expert_start`` / ``_end``) and
    :func:`expert_data_ranks`. Each expert-parallel rank's shard is put where the affine map says
    (:func:`_autoep_full`). The router's second name (``setattr(layer, router_name, layer.router)`` in
    ``auto_ep_layer``, missed by ``shared_params``) is tied to ``{module_path}.router.*``. No file holds an expert
    weight in its training dtype: it is the checkpoint's precision, as for any ZeRO-3 parameter. Frozen expert
    parameters are refused."""
    from zckpt.deepspeed import zero3

    mpath = loc.model_files[0].path
    if not optim_states or any(f.kind != "optim" for f in loc.optim_files) or \
            any(f.dp_rank is None for f in loc.model_files + loc.optim_files):
        raise UnsupportedLayout("AutoEP ZeRO-3 checkpoint without per-rank ZeRO-3 optimizer and model-states files",
                                path=loc.tag_dir)
    mfiles = sorted(zip(loc.model_files, model_states), key=lambda p: p[0].dp_rank)
    ofiles = sorted(zip(loc.optim_files, optim_states), key=lambda p: p[0].dp_rank)
    osds = [st.get("optimizer_state_dict") for _, st in ofiles]
    if not all(isinstance(o, dict) for o in osds):
        raise CorruptFile("not a DeepSpeed optimizer-states file (no 'optimizer_state_dict')", path=loc.tag_dir)
    if any(o.get("zero_stage") is None or int(o["zero_stage"]) != 3 for o in osds):
        raise UnsupportedLayout("AutoEP checkpoint with zero3_partitioned layers whose optimizer files are not "
                                "ZeRO-3", path=loc.tag_dir)
    ws = osds[0].get("partition_count")
    if not isinstance(ws, int) or ws < 1:
        raise CorruptFile(f"invalid partition_count {ws!r}", path=ofiles[0][0].path)
    try:
        check_ranks(loc, ws, per_rank_model_files=True)
    except IncompleteCheckpoint as exc:  # say which experts the missing ranks hold
        raise IncompleteCheckpoint(f"{exc.message}{_rank_experts(mfiles[0][1], ws, loc)}", path=exc.path,
                                   hint=exc.hint) from None
    ms0 = mfiles[0][1]
    param_shapes = ms0.get("param_shapes")
    if not isinstance(param_shapes, list) or not all(isinstance(p, dict) for p in param_shapes):
        raise CorruptFile("no param_shapes list of sub-groups", path=mpath)
    per_rank, maps, layer_of = _z3_layers(mfiles, param_shapes)
    described = autoep_layers(ms0["ds_autoep_layers"], maps, mpath)  # each expert held once
    experts = [s for s in range(len(param_shapes)) if any(n in maps for n in param_shapes[s])]
    for s in experts:
        if not all(n in maps for n in param_shapes[s]):
            raise CorruptFile(f"sub-group {s} mixes AutoEP expert and dense parameters", path=mpath)
    if {n for s in experts for n in param_shapes[s]} != set(maps):
        raise CorruptFile("the affine maps name expert parameters that are in no sub-group", path=mpath)
    dense = [s for s in range(len(param_shapes)) if s not in experts]
    if any(n in maps for n in (ms0.get("frozen_param_shapes") or {})):
        raise UnsupportedLayout("AutoEP ZeRO-3 checkpoint with frozen expert parameters (not read)", path=mpath)
    inner = [o.get("optimizer_state_dict") or {} for o in osds]
    pgroups = inner[0].get("param_groups")
    if not isinstance(pgroups, list) or not all(isinstance(pg, dict) for pg in pgroups):
        raise CorruptFile("optimizer_state_dict has no param_groups", path=ofiles[0][0].path)
    for k, pg in enumerate(pgroups):  # dense-only or expert-only ('params' are sub-group ids)
        subs = {int(x) for x in pg.get("params", [])}
        if subs & set(experts) and subs - set(experts):
            raise CorruptFile(f"param group {k} ({pg.get('name')}) mixes expert and dense sub-groups",
                              path=ofiles[0][0].path)

    ms_dense = {**ms0, "param_shapes": [param_shapes[s] for s in dense],
                "shared_params": _z3_router_ties(ms0, param_shapes, dense, mpath)}
    base = zero3.build(sub_location(loc, [f for f, _ in ofiles]), [ms_dense] + [ms for _, ms in mfiles[1:]],
                       [_z3_dense_view(st, len(param_shapes), dense) for _, st in ofiles])
    lp = LP_DTYPES[base.precision]
    trainable: dict[str, TensorRecord] = {}
    sub_of: dict[str, int] = {}
    for s in experts:  # one sub-group may hold the experts of several layers (all of them, by default)
        found = [(li, _z3_expert_members(s, li, ws, mfiles, ofiles, per_rank, pgroups))
                 for li in sorted({layer_of[n] for n in param_shapes[s]})]
        members, edp = found[0][1]
        for li, other in found[1:]:
            if other != (members, edp):
                raise CorruptFile(f"expert sub-group {s} holds the experts of AutoEP layers "
                                  f"{ms0['ds_autoep_layers'][found[0][0]].get('module_path')} and "
                                  f"{ms0['ds_autoep_layers'][li].get('module_path')}, whose ranks' ep_rank / "
                                  "expert-data-parallel rank differ", path=mpath)
        for name, rec in _z3_expert_records(s, param_shapes[s], members, edp, ofiles, maps, lp, mpath).items():
            trainable[name], sub_of[name] = rec, s
    if len({r.dtype for r in trainable.values()}) > 1:
        raise CorruptFile("the expert master weights are in more than one dtype", path=loc.tag_dir)
    egroups = zero3.param_groups(pgroups, inner[0].get("state") or {}, trainable, sub_of, ofiles[0][0].path,
                                 loc.storage_options)
    groups = [eg if any(int(x) in experts for x in pgroups[k].get("params", [])) else gi
              for k, (gi, eg) in enumerate(zip(base.groups, egroups))]
    records = list(base.records)
    for li, layer in enumerate(ms0["ds_autoep_layers"]):  # after the layer's router, as in the live module
        mine = [trainable[n] for s in experts for n in param_shapes[s] if layer_of[n] == li]
        prefix = f"{layer.get('module_path')}."
        at = max((i + 1 for i, r in enumerate(records) if r.name.startswith(prefix)), default=len(records))
        records[at:at] = mine
    names = [pg.get("name") for pg in pgroups if {int(x) for x in pg.get("params", [])} & set(experts)]
    cut = {n: c for n in dict.fromkeys(names) if (c := names.count(n)) > 1}
    notes = [f"AutoEP at ZeRO-3: {len(ms0['ds_autoep_layers'])} MoE layer(s), expert sub-groups "
             + ", ".join(str(s) for s in experts)
             + ("; " + ", ".join(f"{n} is {c} param groups" for n, c in cut.items()) + " (DeepSpeed's "
                "split_params_into_different_moe_groups_for_optimizer cuts an expert group over its max_group_size)"
                if cut else "")] + list(base.notes)
    coverage.check(described, records, loc.tag_dir)
    return Checkpoint(loc, 3, "zero3", base.precision, ws, records, groups, ms0, optim_states, model_states,
                      offload=base.offload, notes=notes, parallel="moe", reshard_refusal=Z3_REFUSAL,
                      extra={"moe_coverage": described},
                      state_refusal=moe_state_refusal(base, records))


def _z3_layers(mfiles: list, param_shapes: list) -> tuple[list[list[dict]], dict[str, dict], dict[str, int]]:
    """Each rank's ``ds_autoep_layers`` (all ``zero3_partitioned``, affine maps version 1, the same on every rank
    but for the rank's own fields; the same ``param_shapes``), and rank 0's affine map and layer index per fused
    expert parameter."""
    ms0 = mfiles[0][1]
    rank_keys = ("ep_rank", "expert_data_parallel_rank", "global_expert_start", "global_expert_end")

    def common(layers):
        return [{k: v for k, v in x.items() if k not in rank_keys} for x in layers]

    per_rank: list[list[dict]] = []
    for f, ms in mfiles:
        layers = ms.get("ds_autoep_layers")
        if not isinstance(layers, list) or not layers or not all(isinstance(x, dict) for x in layers):
            raise CorruptFile("ds_autoep_layers is not a list of layer descriptions", path=f.path)
        for x in layers:
            if x.get("checkpoint_format") != "zero3_partitioned" or (x.get("affine_maps") or {}).get("version") != 1:
                raise UnsupportedLayout(f"AutoEP layer {x.get('module_path')}: checkpoint_format "
                                        f"{x.get('checkpoint_format')!r}, affine map version "
                                        f"{(x.get('affine_maps') or {}).get('version')!r} (zckpt reads "
                                        "zero3_partitioned, version 1, in every layer)", path=f.path)
        if ms.get("param_shapes") != param_shapes:
            raise CorruptFile("param_shapes differ from rank 0's", path=f.path)
        if common(layers) != common(ms0["ds_autoep_layers"]):
            raise CorruptFile("ds_autoep_layers describes other layers or maps than rank 0's", path=f.path)
        per_rank.append(layers)
    maps: dict[str, dict] = {}
    layer_of: dict[str, int] = {}
    for i, layer in enumerate(ms0["ds_autoep_layers"]):
        for name, amap in ((layer.get("affine_maps") or {}).get("params") or {}).items():
            if name in maps:
                raise CorruptFile(f"two AutoEP layers map '{name}'", path=mfiles[0][0].path)
            maps[name], layer_of[name] = {**amap, "_layer": layer}, i
    return per_rank, maps, layer_of


def _z3_router_ties(ms0: dict, param_shapes: list, dense: list[int], path: str) -> dict[str, str]:
    """``shared_params`` plus the router's second name: a ``module`` entry in no sub-group, frozen list or tie is
    ``{module_path}.{alias}.{p}`` of an AutoEP layer whose ``{module_path}.router.{p}`` is a dense parameter (the
    0-element placeholders of ZeRO-3 hold no bytes to compare); anything else is refused."""
    module = ms0.get("module") or {}
    shared = dict(ms0.get("shared_params") or {})
    listed = {n for p in param_shapes for n in p} | set(ms0.get("frozen_param_shapes") or {}) | set(shared) | \
        set(ms0.get("buffer_names") or [])
    for name in (n for n in module if n not in listed):
        layer = next((x for x in ms0["ds_autoep_layers"] if name.startswith(f"{x.get('module_path')}.")), None)
        prefix = f"{layer.get('module_path')}." if layer else ""
        child, _, rest = name[len(prefix):].partition(".")
        target = f"{prefix}router.{rest}"
        if not layer or child == "router" or not rest or not any(target in param_shapes[s] for s in dense) or \
                getattr(module.get(target), "dtype", None) != getattr(module[name], "dtype", None):
            raise UnsupportedLayout(f"'{name}' is in 'module' but in no param_shapes sub-group, frozen_param_shapes "
                                    "or shared_params, and is not a second name of an AutoEP router parameter: which "
                                    "parameter it is cannot be told", path=path)
        shared[name] = target
    return shared


def _z3_dense_view(st: dict, nsub: int, dense: list[int]) -> dict:
    """One ZeRO-3 optimizer file seen with its dense sub-groups only (renumbered; param groups keep their place)."""
    osd = st["optimizer_state_dict"]
    fl = osd.get("fp32_flat_groups")
    if not isinstance(fl, list) or len(fl) != nsub:
        raise CorruptFile(f"fp32_flat_groups should list {nsub} sub-groups")
    renum = {s: i for i, s in enumerate(dense)}
    inn = osd.get("optimizer_state_dict") or {}
    state = inn.get("state") or {}
    pgs = [{**pg, "params": [renum[int(x)] for x in pg.get("params", []) if int(x) in renum]}
           for pg in inn.get("param_groups") or []]
    return {**st, "optimizer_state_dict": {
        **osd, "fp32_flat_groups": [fl[s] for s in dense],
        "optimizer_state_dict": {**inn, "state": {renum[s]: state[s] for s in dense if s in state},
                                 "param_groups": pgs}}}


def _z3_expert_members(s: int, li: int, ws: int, mfiles: list, ofiles: list, per_rank: list[list[dict]],
                       pgroups: list[dict]) -> tuple[dict[int, dict[int, int]], int]:
    """Expert sub-group ``s`` (of AutoEP layer ``li``): per expert-parallel rank, its partition index -> data-parallel
    rank, and the expert-data-parallel size; every rank's own files cross-checked (see
    :func:`build_autoep_zero3`)."""
    ms0 = mfiles[0][1]
    layer0 = ms0["ds_autoep_layers"][li]
    ep, nexp = int(layer0.get("ep_size") or 0), int(layer0.get("num_experts") or 0)
    if ep < 1 or nexp % ep or ws % ep:
        raise CorruptFile(f"AutoEP layer {layer0.get('module_path')}: ep_size {ep}, {nexp} experts over {ws} "
                          "ranks", path=mfiles[0][0].path)
    nlocal, edp = nexp // ep, ws // ep
    owner = [pg for pg in pgroups if s in {int(x) for x in pg.get("params", [])}]
    m = EP_NAME_RE.match(str(owner[0].get("name", ""))) if len(owner) == 1 else None
    if not m or int(m.group(1)) != ep or not owner[0].get("moe"):
        raise CorruptFile(f"expert sub-group {s} is not in one moe param group named ep_size_{ep}",
                          path=ofiles[0][0].path)
    members: dict[int, dict[int, int]] = {}
    for r, ((of, st), (mf, _)) in enumerate(zip(ofiles, mfiles)):
        meta = st["optimizer_state_dict"].get("ds_zero_partition_groups")
        entry = meta[s] if isinstance(meta, list) and s < len(meta) and isinstance(meta[s], dict) else None
        x = per_rank[r][li]
        e = x.get("ep_rank")
        if entry is None or entry.get("sub_group") != s:
            raise CorruptFile(f"no ds_zero_partition_groups entry for expert sub-group {s}", path=of.path)
        if not isinstance(e, int) or not 0 <= e < ep:
            raise CorruptFile(f"ep_rank {e!r} is not one of {ep} expert-parallel ranks", path=mf.path)
        pranks, prank = entry.get("partition_ranks"), entry.get("partition_rank")
        if entry.get("partition_count") != edp or x.get("expert_data_parallel_world_size") != edp or \
                not isinstance(prank, int) or prank != x.get("expert_data_parallel_rank") or \
                pranks != expert_data_ranks(ms0, ws, ep, e, mf.path) or r not in pranks or \
                pranks.index(r) != prank or \
                (x.get("global_expert_start"), x.get("global_expert_end")) != (e * nlocal, (e + 1) * nlocal):
            raise CorruptFile(f"rank {r}'s expert sub-group {s} is not partitioned as its expert-data-parallel "
                              f"group of {edp} ranks (ep_rank {e}) should be: ds_zero_partition_groups says ranks "
                              f"{pranks}, rank {prank} of {entry.get('partition_count')}; {_basename(mf.path)} says "
                              f"rank {x.get('expert_data_parallel_rank')} of "
                              f"{x.get('expert_data_parallel_world_size')}, experts "
                              f"{x.get('global_expert_start')}..{x.get('global_expert_end')}", path=of.path)
        if prank in members.setdefault(e, {}):
            raise CorruptFile(f"two ranks hold partition {prank} of expert-parallel rank {e}", path=of.path)
        members[e][prank] = r
    if sorted(members) != list(range(ep)) or any(sorted(m) != list(range(edp)) for m in members.values()):
        raise IncompleteCheckpoint(f"expert sub-group {s}: not every expert-parallel rank has its {edp} partitions",
                                   path=ofiles[0][0].path)
    return members, edp


def _z3_expert_records(s: int, shapes: dict, members: dict[int, dict[int, int]], edp: int, ofiles: list,
                       maps: dict[str, dict], lp: str, path: str) -> dict[str, TensorRecord]:
    """The fused expert parameters of sub-group ``s`` at their logical shapes: each expert-parallel rank's local
    shard from the ceil(n/edp) slices of its expert-data-parallel ranks (masters and Adam moments), then placed by
    the affine map (:func:`_autoep_full`)."""
    need = sum(math.ceil(math.prod(int(d) for d in shape) / edp) for shape in shapes.values())
    flats, moms = {}, {}
    for r, (of, st) in enumerate(ofiles):
        osd = st["optimizer_state_dict"]
        fl = osd.get("fp32_flat_groups")
        t = fl[s] if isinstance(fl, list) and s < len(fl) else None
        state = ((osd.get("optimizer_state_dict") or {}).get("state") or {}).get(s) or {}
        ea, eas = state.get("exp_avg"), state.get("exp_avg_sq")
        if not isinstance(t, LazyTensor) or t.numel != need:
            raise CorruptFile(f"expert sub-group {s}: fp32 partition has {getattr(t, 'numel', None)} elements, "
                              f"its params need {need} (ceil(n/{edp}) each)", path=of.path)
        if not all(isinstance(m, LazyTensor) and m.numel == need and m.dtype == t.dtype for m in (ea, eas)):
            raise CorruptFile(f"expert sub-group {s}: Adam moments do not match the fp32 partition", path=of.path)
        flats[r], moms[r] = t, (ea, eas)
    out: dict[str, TensorRecord] = {}
    off = 0
    for name, shape in shapes.items():
        shape = tuple(int(d) for d in shape)
        n = math.prod(shape)
        part = math.ceil(n / edp)
        shards: dict[int, TensorRecord] = {}
        for e, by_part in members.items():
            fp, ea, eas = [], [], []
            for i in range(edp):
                take, r = max(0, min(part, n - i * part)), by_part[i]
                if take:
                    fp += pieces_of(flats[r], off, take)
                    ea += pieces_of(moms[r][0], off, take)
                    eas += pieces_of(moms[r][1], off, take)
            shards[e] = TensorRecord(name, shape, "trainable", flats[by_part[0]].dtype, fp, ea, eas, lp_dtype=lp)
        out[name] = _autoep_full(name, shards, maps[name], None, lp, path)
        off += part
    return out


def _rank_experts(ms0: dict, ws: int, loc: Location) -> str:
    """``; rank 1 held experts 4..7 of MoE layers 0 (model.layers.0.mlp), 1 (...)``: what the ranks without files
    hold, from the AutoEP layers' ``ep_size`` / ``num_experts`` and the expert-data-parallel groups; empty when that
    cannot be said."""
    have = {f.dp_rank for f in loc.optim_files} & {f.dp_rank for f in loc.model_files}
    layers = ms0.get("ds_autoep_layers") or []
    parts = []
    try:
        for r in sorted(set(range(ws)) - have):
            held = []
            for i, x in enumerate(layers):
                ep, n = int(x["ep_size"]), int(x["num_experts"])
                e = next(e for e in range(ep) if r in expert_data_ranks(ms0, ws, ep, e, loc.tag_dir))
                held.append((e * (n // ep), (e + 1) * (n // ep) - 1, f"{int(x.get('moe_layer_id', i))} "
                                                                       f"({x.get('module_path')})"))
            spans = sorted({(a, b) for a, b, _ in held})
            what = ", ".join(f"{a}..{b}" for a, b in spans)
            parts.append(f"rank {r} held its partition of experts {what} of MoE "
                         f"layer{'s' if len(held) > 1 else ''} " + ", ".join(w for _, _, w in held))
    except (KeyError, TypeError, ValueError, StopIteration, UnsupportedLayout):
        return ""
    return "; " + "; ".join(parts) if parts else ""


def _basename(path: str) -> str:
    return path.replace("\\", "/").rsplit("/", 1)[-1]


def _autoep_expert_files(loc: Location, layers: list[dict], maps: dict[str, dict]):
    """The training dtype of each fused expert parameter, from the expert files (``{param}.{E}`` of shape
    ``logical[1:]`` in ``layer_{L}_expert_{E}``), every one of which must be present; and the files' tensors
    (:func:`expert_file_tensors`)."""
    have = {(f.index, f.expert): f for f in loc.expert_files}
    want = {(int(x.get("moe_layer_id", i)), e) for i, x in enumerate(layers) for e in range(int(x["num_experts"]))}
    if want - set(have):
        missing = sorted(want - set(have))[:4]
        raise IncompleteCheckpoint(f"MoE layer {missing[0][0]}: expert {missing[0][1]} has no file; expert files "
                                   "missing: " + ", ".join(f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"
                                                           for layer, e in missing), path=loc.tag_dir)
    if set(have) - want:
        beyond = min(set(have) - want)
        raise CorruptFile(f"MoE layer {beyond[0]}: expert {beyond[1]} is beyond the AutoEP layers' experts "
                          "(ds_autoep_layers)", path=have[beyond].path,
                          hint="remove the stray expert file, or pass a complete MoE checkpoint")
    files = sorted(loc.expert_files, key=lambda f: (f.index, f.expert))
    dtypes: dict[str, set] = {}
    seen: list[tuple[RankFile, str, LazyTensor]] = []
    for f, sd in zip(files, load_all(files, loc.storage_options)):
        for key, t in sd.items():
            seen.append((f, key, t))
            name, _, gid = key.rpartition(".")
            amap = maps.get(name)
            if amap is not None and gid.isdigit() and int(gid) != f.expert and (f.index, int(gid)) in have:
                raise CorruptFile(f"MoE layer {f.index}: expert {gid} is held twice (its own file and '{key}' in "
                                  f"the file of expert {f.expert})", path=f.path)
            if amap is None or not gid.isdigit() or int(gid) != f.expert or not isinstance(t, LazyTensor) \
                    or tuple(t.shape) != tuple(amap["logical_shape"][1:]):
                raise CorruptFile(f"'{key}' is not a slice of an AutoEP expert parameter of expert {f.expert}",
                                  path=f.path)
            dtypes.setdefault(name, set()).add(t.dtype)
    if set(dtypes) != set(maps) or any(len(d) != 1 for d in dtypes.values()):
        raise CorruptFile("the expert files do not hold every AutoEP expert parameter in one dtype", path=loc.tag_dir)
    ids = [int(x.get("moe_layer_id", i)) for i, x in enumerate(layers)]
    return {n: d.pop() for n, d in dtypes.items()}, expert_file_tensors(
        loc, seen, {i: int(x.get("ep_size") or 1) for i, x in zip(ids, layers)},
        {i: int(x["num_experts"]) for i, x in zip(ids, layers)})


def _autoep_full(name: str, shards: dict[int, TensorRecord], amap: dict, g: int, lp_dtype: str,
                 path: str) -> TensorRecord:
    """One fused expert parameter at its logical shape: each expert-parallel rank's shard where the affine map
    puts it (whole contiguous blocks only)."""
    logical = tuple(int(d) for d in amap["logical_shape"])
    ranks = amap.get("ranks") or {}
    runs = []
    for e, rec in shards.items():
        entry = ranks.get(e, ranks.get(str(e)))
        pieces = (entry or {}).get("pieces") or []
        shard = tuple(int(d) for d in (entry or {}).get("shard_shape", ()))
        if tuple(rec.shape) != shard or len(pieces) != 1:
            raise UnsupportedLayout(f"AutoEP '{name}': expert-parallel rank {e}'s shard {list(rec.shape)} is not one "
                                    "whole piece of the affine map", path=path)
        pc = pieces[0]
        (soff, sstr), (doff, dstr) = pc["source"], pc["dest"]
        if tuple(pc["shape"]) != shard or int(doff) != 0 or tuple(dstr) != _strides(shard) or \
                tuple(sstr) != _strides(logical) or float(pc.get("scale", 1)) != 1.0:
            raise UnsupportedLayout(f"AutoEP '{name}': rank {e}'s piece is not a contiguous block of the full tensor "
                                    "(strided or scaled pieces are not read)", path=path)
        runs.append((int(soff), rec.numel, e))
    runs.sort()
    end = 0
    for soff, n, _ in runs:
        if soff != end:
            raise CorruptFile(f"AutoEP '{name}': the shards leave a gap or overlap at element {end}", path=path)
        end += n
    if end != math.prod(logical):
        raise CorruptFile(f"AutoEP '{name}': the shards cover {end} of {math.prod(logical)} elements", path=path)
    order = [shards[e] for _, _, e in runs]
    has = all(r.exp_avg for r in order)
    return TensorRecord(name, logical, "trainable", order[0].dtype, [p for r in order for p in r.value],
                        [p for r in order for p in r.exp_avg] if has else [],
                        [p for r in order for p in r.exp_avg_sq] if has else [], group=g, lp_dtype=lp_dtype)


def _strides(shape: tuple) -> tuple:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= int(d)
    return tuple(reversed(out))
