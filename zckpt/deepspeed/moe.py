"""Mixture-of-experts checkpoints (native ``deepspeed.moe.layer.MoE``) of ZeRO-1/2 and the BF16 optimizer.

``engine._save_moe_checkpoint`` writes the experts apart from the rest of the model::

    global_step3/
      mp_rank_00_model_states.pt      module = the model WITHOUT expert tensors (the gate stays), num_experts
                                      (one count per MoE layer), param_shapes: one dict per optimizer group;
                                      expert groups list rank 0's experts under LOCAL ids (deepspeed_experts.0, 1)
      layer_{L}_expert_{E}_mp_rank_00_model_states.pt   MoE layer L's expert E (GLOBAL id) lp tensors, GLOBAL names
      [bf16_]zero_pp_rank_{R}_mp_rank_00_optim_states.pt   an ordinary ZeRO-1/2 file of dp rank R, whose groups are
                                      partitioned over different rank sets: partition_count [2, 1] for ep_size 2

DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer`` gives expert parameters their own optimizer
groups (``moe: True``, ``name: "ep_size_N"``). A dense group is partitioned over all ``ws`` data-parallel ranks as
usual. An expert group of ``ep_size`` N is partitioned over the ``ws/N`` ranks of an expert-data-parallel group:
ranks ``R`` with ``R % N == e`` hold expert-parallel rank ``e``'s local experts (``groups._create_expert_and_data_
parallel``: expert-parallel groups are blocks of N consecutive ranks), split in the order ``R // N``; with
``use_data_before_expert_parallelism: true`` (read from the saved ``ds_config``) it is the block of ``ws/N``
consecutive ranks ``[e * ws/N, (e+1) * ws/N)`` (:func:`expert_data_ranks`). Local expert ``i`` of
expert-parallel rank ``e`` is global expert ``e * num_local + i``.

This reader builds the dense groups and each (expert group, expert-parallel rank) with
:func:`zckpt.deepspeed.zero12.build` over a view of the files restricted to those groups and ranks, renames local
expert ids to global ones, and takes the experts' lp dtypes (and any frozen expert tensors) from the expert files.
Names are the live model's ``state_dict`` keys with global expert ids: the model one would build with
``ep_size=1``.

Reshard (:mod:`zckpt.ops.reshard`, also on load in :mod:`zckpt.ops.resume`) changes the data-parallel size W
only; ``Checkpoint.extra["moe"]`` (:class:`MoELayout`) keeps what it needs: each expert group's ep_size and, per
expert-parallel rank, its flat group (names as ``param_slice_mappings`` gives them, records). At the new size
(W a multiple of every ep_size) dense groups are partitioned over all W ranks, expert group g of ep_size N for each
expert-parallel rank e over its W/N expert-data-parallel ranks (:func:`expert_data_ranks` at W, the same
topology option), rank R's file holding R's window of each (``partition_count`` [W, W/N]); the expert files and
``mp_rank_00_model_states.pt`` do not depend on W (the latter gets the new ``dp_world_size``, AutoEP layers their
``expert_data_parallel_world_size``). DeepSpeed 0.19.8 checks only ``dp_world_size`` against the live size on
load (``_load_zero_checkpoint``); each rank then reads its own file. Refused in one line: another expert-parallel
size, ZeRO stage or optimizer, the universal format, elastic files, and MoE without ZeRO (``expp_rank_*``: each
expert-parallel rank's optimizer whole, loaded as it is at any data-parallel size).

AutoEP (DeepSpeed 0.19.2+, fused ``experts.w1/w2/w3`` of logical shape ``[num_experts, ...]``, ``ds_autoep_layers``
with affine maps) is read at ZeRO-1/2 from its expert groups and expert files (:func:`_build_autoep`) and at
ZeRO-3 (``checkpoint_format: zero3_partitioned``, no expert files) from the per-rank ZeRO-3 files, where each
rank's local expert shards are a sub-group partitioned over its expert-data-parallel group
(:func:`_build_autoep_zero3`); both put each expert-parallel rank's shard where the affine map says
(:func:`_autoep_full`). ZeRO-3 AutoEP is merged, verified and converted, not resharded (:data:`Z3_REFUSAL`).
"""

from __future__ import annotations

import dataclasses
import math
import re

from zckpt.deepspeed.discover import Location, RankFile
from zckpt.deepspeed.model import (
    LP_DTYPES, Checkpoint, GroupInfo, TensorRecord, check_ranks, common_records, load_all, pieces_of, precision_of,
)
from zckpt.errors import CorruptFile, IncompleteCheckpoint, UnsupportedLayout
from zckpt.encoding.safeload import LazyTensor

EXPERT_RE = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..+)$")
EP_NAME_RE = re.compile(r"^ep_size_(\d+)$")
PER_GROUP_KEYS = ("single_partition_of_fp32_groups", "group_paddings", "partition_count",
                  "param_alignment_paddings", "param_slice_mappings")

Z3_REFUSAL = ("AutoEP checkpoint of ZeRO-3: each expert parameter is partitioned over its expert-parallel rank's "
              "expert-data-parallel group, which zckpt does not lay out again; merge / info / verify read it")
REFUSAL = ("mixture-of-experts checkpoint: zckpt reshards only its data-parallel size, in the DeepSpeed layout, "
           "keeping the expert-parallel size, the ZeRO stage and the optimizer")
ZERO0_REFUSAL = ("mixture-of-experts checkpoint without ZeRO: each expert-parallel rank's whole optimizer is in "
                 "expp_rank_{e}_mp_rank_00_optim_states.pt, which DeepSpeed loads at any data-parallel size with the "
                 "same expert-parallel size as it is; nothing to reshard (changing the expert-parallel size is not "
                 "supported)")


@dataclasses.dataclass
class MoELayout:
    """How a ZeRO-1/2 MoE checkpoint's expert groups lie over the ranks (``Checkpoint.extra["moe"]``), what
    :mod:`zckpt.ops.reshard` needs to lay them out at another data-parallel size.

    ``ep``: expert param group -> its ep_size. ``shards``: expert group -> expert-parallel rank -> that rank's flat
    group as (the name ``param_slice_mappings`` gives it on that rank, its record), in flat-group order: native MoE
    names a local expert id (``deepspeed_experts.0``) and its record is the global expert; AutoEP's record is the
    rank's ``[num_local, ...]`` block of the fused parameter. ``expert_files``: per expert file (its name) its
    tensors in file order and (ep_size, the expert-parallel rank that loads it)."""

    ep: dict[int, int]
    shards: dict[int, dict[int, list[tuple[str, TensorRecord]]]]
    expert_files: dict[str, tuple[list[tuple[str, LazyTensor]], int, int]]
    autoep: bool = False

    def ep_rank(self, ms0: dict, ws: int, ep: int, rank: int, path: str) -> tuple[int, int]:
        """(expert-parallel rank, index in its expert-data-parallel group) of data-parallel rank ``rank`` at world
        size ``ws`` (:func:`expert_data_ranks`)."""
        for e in range(ep):
            ranks = expert_data_ranks(ms0, ws, ep, e, path)
            if rank in ranks:
                return e, ranks.index(rank)
        raise ValueError(f"rank {rank} is in no expert-data-parallel group of {ws} ranks")


def build(loc: Location, model_states: list[dict], optim_states: list[dict]) -> Checkpoint:
    from zckpt.deepspeed import zero12

    ms0 = model_states[0]
    mpath = loc.model_files[0].path
    if ms0.get("ds_autoep_layers"):
        layers = ms0["ds_autoep_layers"]
        if isinstance(layers, list) and any(isinstance(x, dict) and x.get("checkpoint_format") == "zero3_partitioned"
                                            for x in layers):
            return _build_autoep_zero3(loc, model_states, optim_states)
        return _build_autoep(loc, model_states, optim_states)
    if not isinstance(ms0.get("num_experts"), (list, tuple)) or not ms0["num_experts"]:
        raise UnsupportedLayout("mixture-of-experts expert files, but the model-states file has no num_experts list: "
                                "not a native MoE save", path=mpath,
                                hint="remove stray layer_*_expert_* files, or pass a complete MoE checkpoint")
    if loc.optim_files and all(f.kind == "expp" for f in loc.optim_files):
        return _build_zero0(loc, model_states, optim_states)
    if not optim_states:
        raise UnsupportedLayout("mixture-of-experts checkpoint without optimizer files (no *_optim_states.pt and no "
                                "expp_rank_*_optim_states.pt)", path=mpath)
    if len(loc.model_files) != 1 or loc.model_files[0].dp_rank is not None:
        raise UnsupportedLayout("mixture-of-experts checkpoint of ZeRO-3 (per-rank model files); zckpt reads MoE "
                                "checkpoints of ZeRO-1/2", path=loc.tag_dir)
    osds = [st.get("optimizer_state_dict") for st in optim_states]
    if not all(isinstance(o, dict) for o in osds):
        raise CorruptFile("not a DeepSpeed optimizer-states file (no 'optimizer_state_dict')", path=loc.tag_dir)
    if osds[0].get("zero_stage") is not None and int(osds[0]["zero_stage"]) not in (1, 2):
        raise UnsupportedLayout(f"mixture-of-experts checkpoint of ZeRO stage {int(osds[0]['zero_stage'])}",
                                path=loc.tag_dir)
    ws = len(loc.optim_files)
    param_shapes = ms0.get("param_shapes")
    ngroups = len(osds[0].get("single_partition_of_fp32_groups") or [])
    if not isinstance(param_shapes, list) or len(param_shapes) != ngroups:
        raise CorruptFile(f"param_shapes lists {len(param_shapes or [])} groups, the optimizer {ngroups}", path=mpath)
    hyper = _param_groups(osds[0], ngroups)
    experts = [g for g in range(ngroups) if hyper[g].get("moe") or any(EXPERT_RE.match(n) for n in param_shapes[g])]
    dense = [g for g in range(ngroups) if g not in experts]

    ms_dense = {**ms0, "param_shapes": [param_shapes[g] for g in dense],
                "frozen_param_shapes": _dense_only(ms0.get("frozen_param_shapes")),
                "frozen_param_fragments": _dense_only(ms0.get("frozen_param_fragments"))}
    dense_loc = _sub_location(loc, loc.optim_files)
    base = zero12.build(dense_loc, [ms_dense], [_select(st, dense) for st in optim_states])
    groups = [dataclasses.replace(gi, index=dense[gi.index]) for gi in base.groups]
    records = [dataclasses.replace(r, group=dense[r.group]) if r.group is not None else r for r in base.records]

    expert_recs: dict[str, TensorRecord] = {}
    placed: dict[int, tuple[int, dict[int, list[tuple[str, str]]]]] = {}
    for g in experts:
        recs, info, ep, by_rank = _expert_group(loc, ms0, optim_states, hyper[g], g, param_shapes[g], ws)
        expert_recs.update(recs)
        groups.append(info)
        placed[g] = (ep, by_rank)
    groups.sort(key=lambda gi: gi.index)
    tensors = _expert_tensors(loc, ms0)
    expert_recs = _from_expert_files(loc, ms0, expert_recs, tensors)
    records = _insert_experts(records, list(expert_recs.values()))
    notes = [f"mixture of experts: {len(loc.expert_files)} expert files, expert groups "
             + ", ".join(f"{g} ({hyper[g].get('name', '?')})" for g in experts)]
    ep_of = {name: ep for ep, by_rank in placed.values() for pairs in by_rank.values() for _, name in pairs}
    layer_ep: dict[int, int] = {}
    for name, _, layer, _, _ in tensors:
        if name in ep_of:
            layer_ep.setdefault(layer, ep_of[name])
    layout = MoELayout({g: ep for g, (ep, _) in placed.items()},
                       {g: {e: [(local, expert_recs[name]) for local, name in pairs] for e, pairs in by_rank.items()}
                        for g, (_, by_rank) in placed.items()},
                       _file_tensors(loc, [(f, n, t) for n, t, _, _, f in tensors], layer_ep,
                                     dict(enumerate(int(n) for n in ms0["num_experts"]))))
    return Checkpoint(loc, base.stage, base.flavour, base.precision, ws, records, groups, ms0, optim_states,
                      model_states, offload=base.offload, notes=notes, parallel="moe", reshard_refusal=REFUSAL,
                      extra={"moe": layout}, state_refusal=_state_refusal(base, records))


def _build_zero0(loc: Location, model_states: list[dict], optim_states: list[dict]) -> Checkpoint:
    """MoE without ZeRO: ``module`` holds the dense model, each expert-parallel rank e's whole optimizer (dense
    params and its own experts, as :mod:`zero0` reads it) is ``expp_rank_{e}_mp_rank_00_optim_states.pt``
    ({"optimizer": ...}, written by its expert-data-parallel rank 0), the experts' lp weights are in the expert
    files. Rank e's masters are matched to the dense params and to rank e's experts only (global ids
    ``e * num_local .. (e+1) * num_local - 1``), by ``param_names`` or by values, never by position."""
    from zckpt.deepspeed import zero0

    ms0, mpath = model_states[0], loc.model_files[0].path
    files = sorted(zip(loc.optim_files, optim_states), key=lambda p: p[0].dp_rank)
    ep = len(files)
    if [f.dp_rank for f, _ in files] != list(range(ep)):
        raise IncompleteCheckpoint(f"expp_rank files of expert-parallel ranks {[f.dp_rank for f, _ in files]}, "
                                   f"expected 0..{ep - 1}", path=loc.tag_dir)
    module = ms0.get("module")
    if not isinstance(module, dict):
        raise CorruptFile("MoE model-states file without a 'module' state dict", path=mpath)
    dense, tied = zero0.module_params(module, ms0.get("buffer_names"))
    precision = precision_of(ms0, module)
    counts = [int(n) for n in ms0["num_experts"]]
    ws = ms0.get("dp_world_size")
    ws = int(ws) if isinstance(ws, int) and ws > 0 else ep
    held = _zero0_expert_ids(ms0, files, counts, ws, loc.tag_dir)
    tensors = _expert_tensors(loc, ms0)
    dense_names = {n for n, _ in dense}
    trainable: dict[str, TensorRecord] = {}
    groups: list[GroupInfo] = []
    notes: list[str] = []
    for e, (f, st) in enumerate(files):
        mine = [(n, t) for n, t, layer, gid, _ in tensors if gid in held[e][layer]]
        opt = st.get("optimizer") if isinstance(st, dict) else None
        recs, gis, more = zero0.read_optimizer(opt, dense + mine, precision, f.path, loc.storage_options)
        notes += [type(n)(f"expert-parallel rank {e}: {n}") for n in more]
        for gi in gis:
            expert_group = bool(gi.hyperparams.get("moe"))
            if any((n in dense_names) == expert_group for n in gi.names):
                raise CorruptFile(f"param group {gi.index} ({gi.hyperparams.get('name')}) mixes dense and expert "
                                  "parameters", path=f.path)
            if e == 0:
                groups.append(gi)
            elif expert_group:
                groups[gi.index].names += gi.names
        trainable.update({n: r for n, r in recs.items() if e == 0 or n not in dense_names})
    ms = dict(ms0, shared_params=tied)
    records = common_records(loc, ms, {n: r for n, r in trainable.items() if n in dense_names}, {},
                             LP_DTYPES[precision])
    experts = _from_expert_files(loc, ms0, {n: r for n, r in trainable.items() if n not in dense_names}, tensors)
    records = _insert_experts(records, list(experts.values()))
    notes.insert(0, f"mixture of experts without ZeRO: {len(loc.expert_files)} expert files, {ep} expp_rank files")
    return Checkpoint(loc, 0, "zero0", precision, ws, records, groups, ms0, [], model_states, notes=notes,
                      parallel="moe", reshard_refusal=ZERO0_REFUSAL,
                      state_refusal=next((n for n in notes if isinstance(n, zero0.StateNotRead)), None))


def _zero0_expert_ids(ms0: dict, files: list, counts: list[int], ws: int, path: str) -> list[list[set[int]]]:
    """Per expp_rank file e, per MoE layer: the global expert ids whose masters the file may hold.

    DeepSpeed writes ``expp_rank_{e}`` from the expert-data-parallel rank 0 of expert-parallel rank e of the
    LARGEST expert group (``groups._get_max_expert_size_name``); that rank's optimizer holds every layer's experts
    of ITS expert-parallel rank in that layer's own group. Which ep_size each layer has is not saved, only the
    expert groups' names (``ep_size_N``): a layer's candidates are the experts that rank holds under each of those
    sizes, and the masters are then told apart by ``param_names`` or values (:mod:`zero0`), never by position."""
    sizes: set[int] = set()
    for _, st in files:
        opt = st.get("optimizer") if isinstance(st, dict) else None
        osd = opt.get("optimizer_state_dict", opt) if isinstance(opt, dict) else None
        for pg in (osd.get("param_groups") if isinstance(osd, dict) else None) or []:
            m = EP_NAME_RE.match(str(pg.get("name", ""))) if isinstance(pg, dict) and pg.get("moe") else None
            if m:
                sizes.add(int(m.group(1)))
    ep = len(files)
    sizes = sizes or {ep}
    if max(sizes) != ep or any(ws % n for n in sizes):
        raise CorruptFile(f"{ep} expp_rank files, but expert groups of ep_size {sorted(sizes)} over {ws} ranks",
                          path=path)
    for layer, n in enumerate(counts):
        if not any(n % size == 0 for size in sizes):
            raise CorruptFile(f"MoE layer {layer}'s {n} experts do not split over any expert group's ep_size "
                              f"{sorted(sizes)}", path=path)
    out = []
    for e in range(ep):
        writer = expert_data_ranks(ms0, ws, ep, e, path)[0]
        per_layer = []
        for n in counts:
            ids: set[int] = set()
            for size in (s for s in sizes if n % s == 0):
                mine = next(r for r in range(size) if writer in expert_data_ranks(ms0, ws, size, r, path))
                ids.update(range(mine * (n // size), (mine + 1) * (n // size)))
            per_layer.append(ids)
        out.append(per_layer)
    return out


def _build_autoep(loc: Location, model_states: list[dict], optim_states: list[dict]) -> Checkpoint:
    """AutoEP (DeepSpeed 0.19.2+) at ZeRO-1/2: ``ds_autoep_layers`` in the model states describes each MoE layer
    (``module_path``, ``num_experts``, ``ep_size``, ``expert_placement``, and an ``affine_maps`` entry per fused
    expert parameter ``{module_path}.experts.w1/w2/w3``: its logical ``[num_experts, ...]`` shape and, per
    expert-parallel rank, which block of it that rank's ``[num_local, ...]`` shard is). Expert params are in their
    own optimizer groups (``ep_size_N``), partitioned over each expert-parallel rank's expert-data-parallel ranks;
    every rank's shard is read with :func:`zckpt.deepspeed.zero12.build` and the shards are put where the map says
    (only whole contiguous blocks without scale; anything else is refused). The expert files
    (``layer_{L}_expert_{E}``, one ``experts.wK.{E}`` slice each) give the training dtype and must all be there.
    ZeRO-3 AutoEP (``zero3_partitioned``) is :func:`_build_autoep_zero3`."""
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
    osds = [st.get("optimizer_state_dict") for st in optim_states]
    if not all(isinstance(o, dict) for o in osds) or int(osds[0].get("zero_stage") or 0) not in (1, 2):
        raise UnsupportedLayout("AutoEP checkpoint whose optimizer files are not ZeRO-1/2", path=loc.tag_dir)
    ws = len(loc.optim_files)
    param_shapes = ms0.get("param_shapes")
    ngroups = len(osds[0].get("single_partition_of_fp32_groups") or [])
    if not isinstance(param_shapes, list) or len(param_shapes) != ngroups:
        raise CorruptFile(f"param_shapes lists {len(param_shapes or [])} groups, the optimizer {ngroups}", path=mpath)
    hyper = _param_groups(osds[0], ngroups)
    experts = [g for g in range(ngroups) if any(n in maps for n in param_shapes[g])]
    for g in experts:
        if not all(n in maps for n in param_shapes[g]):
            raise CorruptFile(f"param group {g} mixes AutoEP expert and dense parameters", path=mpath)
    dense = [g for g in range(ngroups) if g not in experts]
    drop = (lambda d: None if d is None else {k: v for k, v in d.items() if k not in maps})
    ms_dense = {**ms0, "param_shapes": [param_shapes[g] for g in dense],
                "frozen_param_shapes": drop(ms0.get("frozen_param_shapes")),
                "frozen_param_fragments": drop(ms0.get("frozen_param_fragments"))}
    base = zero12.build(_sub_location(loc, loc.optim_files), [ms_dense], [_select(st, dense) for st in optim_states])
    groups = [dataclasses.replace(gi, index=dense[gi.index]) for gi in base.groups]
    records = [dataclasses.replace(r, group=dense[r.group]) if r.group is not None else r for r in base.records]
    lp, file_tensors = _autoep_expert_files(loc, layers, maps)
    counts = osds[0].get("partition_count")
    expert_recs: list[TensorRecord] = []
    sub_keys: set[str] = set()  # the expert groups' per-element state other than Adam's
    eps: dict[int, int] = {}
    shards_of: dict[int, dict[int, list[tuple[str, TensorRecord]]]] = {}
    for g in experts:
        ep = _ep_size(hyper[g], counts[g] if isinstance(counts, (list, tuple)) else counts, ws, g, mpath)
        ms_g = {**ms0, "module": None, "param_shapes": [param_shapes[g]], "frozen_param_shapes": None,
                "frozen_param_fragments": None, "shared_params": {}, "buffer_names": []}
        shards: dict[str, dict[int, TensorRecord]] = {}
        info = None
        for e in range(ep):
            ranks = expert_data_ranks(ms0, ws, ep, e, loc.tag_dir)
            files = [dataclasses.replace(loc.optim_files[r], dp_rank=i) for i, r in enumerate(ranks)]
            sub = zero12.build(_sub_location(loc, files), [ms_g], [_select(optim_states[r], [g]) for r in ranks])
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
    return Checkpoint(loc, base.stage, base.flavour, base.precision, ws, records, groups, ms0, optim_states,
                      model_states, offload=base.offload, notes=notes, parallel="moe", reshard_refusal=REFUSAL,
                      extra={"moe": MoELayout(eps, shards_of, file_tensors, autoep=True)},
                      state_refusal=_state_refusal(base, records, sub_keys))


def _build_autoep_zero3(loc: Location, model_states: list[dict], optim_states: list[dict]) -> Checkpoint:
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
    parameters are refused; so are reshard and resume (:data:`Z3_REFUSAL`)."""
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
    check_ranks(loc, ws, per_rank_model_files=True)
    ms0 = mfiles[0][1]
    param_shapes = ms0.get("param_shapes")
    if not isinstance(param_shapes, list) or not all(isinstance(p, dict) for p in param_shapes):
        raise CorruptFile("no param_shapes list of sub-groups", path=mpath)
    per_rank, maps, layer_of = _z3_layers(mfiles, param_shapes)
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
    base = zero3.build(_sub_location(loc, [f for f, _ in ofiles]), [ms_dense] + [ms for _, ms in mfiles[1:]],
                       [_z3_dense_view(st, len(param_shapes), dense) for _, st in ofiles])
    lp = LP_DTYPES[base.precision]
    trainable: dict[str, TensorRecord] = {}
    sub_of: dict[str, int] = {}
    for s in experts:
        lidx = {layer_of[n] for n in param_shapes[s]}
        if len(lidx) != 1:
            raise UnsupportedLayout(f"sub-group {s} holds the experts of {len(lidx)} AutoEP layers (not read)",
                                    path=mpath)
        li = lidx.pop()
        members, edp = _z3_expert_members(s, li, ws, mfiles, ofiles, per_rank, pgroups)
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
    notes = [f"AutoEP at ZeRO-3: {len(ms0['ds_autoep_layers'])} MoE layer(s), expert sub-groups "
             + ", ".join(str(s) for s in experts)] + list(base.notes)
    return Checkpoint(loc, 3, "zero3", base.precision, ws, records, groups, ms0, optim_states, model_states,
                      offload=base.offload, notes=notes, parallel="moe", reshard_refusal=Z3_REFUSAL,
                      state_refusal=_state_refusal(base, records))


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
    :func:`_build_autoep_zero3`)."""
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


def _basename(path: str) -> str:
    return path.replace("\\", "/").rsplit("/", 1)[-1]


def _autoep_expert_files(loc: Location, layers: list[dict], maps: dict[str, dict]):
    """The training dtype of each fused expert parameter, from the expert files (``{param}.{E}`` of shape
    ``logical[1:]`` in ``layer_{L}_expert_{E}``), every one of which must be present; and the files' tensors
    (:func:`_file_tensors`)."""
    have = {(f.index, f.expert): f for f in loc.expert_files}
    want = {(int(x.get("moe_layer_id", i)), e) for i, x in enumerate(layers) for e in range(int(x["num_experts"]))}
    if want - set(have):
        missing = sorted(want - set(have))[:4]
        raise IncompleteCheckpoint("expert files missing: " + ", ".join(
            f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer, e in missing), path=loc.tag_dir)
    files = sorted(loc.expert_files, key=lambda f: (f.index, f.expert))
    dtypes: dict[str, set] = {}
    seen: list[tuple[RankFile, str, LazyTensor]] = []
    for f, sd in zip(files, load_all(files, loc.storage_options)):
        for key, t in sd.items():
            seen.append((f, key, t))
            name, _, gid = key.rpartition(".")
            amap = maps.get(name)
            if amap is None or not gid.isdigit() or int(gid) != f.expert or not isinstance(t, LazyTensor) \
                    or tuple(t.shape) != tuple(amap["logical_shape"][1:]):
                raise CorruptFile(f"'{key}' is not a slice of an AutoEP expert parameter of expert {f.expert}",
                                  path=f.path)
            dtypes.setdefault(name, set()).add(t.dtype)
    if set(dtypes) != set(maps) or any(len(d) != 1 for d in dtypes.values()):
        raise CorruptFile("the expert files do not hold every AutoEP expert parameter in one dtype", path=loc.tag_dir)
    ids = [int(x.get("moe_layer_id", i)) for i, x in enumerate(layers)]
    return {n: d.pop() for n, d in dtypes.items()}, _file_tensors(
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


def _state_refusal(base: Checkpoint, records: list[TensorRecord], keys=()) -> str | None:
    """Why the optimizer state of an MoE checkpoint cannot be carried: the dense reader's reason, or per-element
    state other than Adam's moments (SGD's momentum_buffer...), which the expert readers do not place."""
    keys = sorted(set(keys) | set(base.other_state_keys) | {k for r in records for k in r.other_state})
    if base.state_refusal or not keys:
        return base.state_refusal
    return (f"optimizer state {', '.join(repr(k) for k in keys)} of a mixture-of-experts checkpoint is not Adam's "
            "exp_avg / exp_avg_sq, which is all zckpt re-partitions there")


def _strides(shape: tuple) -> tuple:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= int(d)
    return tuple(reversed(out))


def _param_groups(osd: dict, ngroups: int) -> list[dict]:
    bos = osd.get("base_optimizer_state")
    pgs = bos.get("param_groups") if isinstance(bos, dict) else None
    if not isinstance(pgs, list) or len(pgs) != ngroups:
        return [{} for _ in range(ngroups)]
    return [pg if isinstance(pg, dict) else {} for pg in pgs]


def _dense_only(d):
    return None if d is None else {k: v for k, v in d.items() if not EXPERT_RE.match(k)}


def _sub_location(loc: Location, optim_files: list[RankFile]) -> Location:
    return Location(loc.input_path, loc.save_dir, loc.tag, loc.tag_dir, loc.trainer_dir,
                    model_files=list(loc.model_files), optim_files=optim_files, has_latest=loc.has_latest,
                    storage_options=loc.storage_options)


def _select(state: dict, idxs: list[int]) -> dict:
    """A view of one optimizer file holding only the param groups ``idxs`` (in that order)."""
    osd = state["optimizer_state_dict"]
    out = dict(osd)
    for key in PER_GROUP_KEYS:
        v = osd.get(key)
        if isinstance(v, (list, tuple)):
            if max(idxs, default=-1) >= len(v):
                raise CorruptFile(f"'{key}' has {len(v)} entries, fewer than the param groups")
            out[key] = [v[i] for i in idxs]
    bos = osd.get("base_optimizer_state")
    if isinstance(bos, dict) and isinstance(bos.get("param_groups"), list):
        out["base_optimizer_state"] = {**bos, "param_groups": [bos["param_groups"][i] for i in idxs]}
    elif isinstance(bos, list):  # elastic: one state dict per group
        out["base_optimizer_state"] = [bos[i] for i in idxs]
    return {**state, "optimizer_state_dict": out}


def _ep_size(hyper: dict, count, ws: int, g: int, path: str) -> int:
    m = EP_NAME_RE.match(str(hyper.get("name", "")))
    ep = int(m.group(1)) if m else None
    if not isinstance(count, int) or count < 1 or ws % count:
        raise CorruptFile(f"expert group {g}: partition_count {count!r} does not divide {ws} ranks", path=path)
    if ep is None:
        ep = ws // count
    if ep * count != ws:
        raise CorruptFile(f"expert group {g} ({hyper.get('name')}): ep_size {ep} x partition_count {count} is "
                          f"not the {ws} data-parallel ranks", path=path)
    return ep


def _expert_group(loc, ms0, optim_states, hyper, g, shapes, ws):
    """Expert group ``g``: one zero12 build per expert-parallel rank, local expert ids renamed to global ones.
    Returns (records by global name, the group, ep_size, per expert-parallel rank its (local, global) names in
    the order of its flat group)."""
    from zckpt.deepspeed import zero12

    counts = optim_states[0]["optimizer_state_dict"].get("partition_count")
    count = counts[g] if isinstance(counts, (list, tuple)) and g < len(counts) else counts
    ep = _ep_size(hyper, count, ws, g, loc.optim_files[0].path)
    nlocal = _num_local(shapes)
    ms_g = {**ms0, "module": None, "param_shapes": [shapes], "frozen_param_shapes": None,
            "frozen_param_fragments": None, "shared_params": {}, "buffer_names": []}
    out: dict[str, TensorRecord] = {}
    by_rank: dict[int, list[tuple[str, str]]] = {}
    info = None
    for e in range(ep):
        ranks = expert_data_ranks(ms0, ws, ep, e, loc.tag_dir)
        files = [dataclasses.replace(loc.optim_files[r], dp_rank=i) for i, r in enumerate(ranks)]
        sub = zero12.build(_sub_location(loc, files), [ms_g], [_select(optim_states[r], [g]) for r in ranks])
        names = []
        for rec in sub.of_kind("trainable"):
            name = _global_name(rec.name, e, nlocal)
            out[name] = dataclasses.replace(rec, name=name, group=g)
            names.append(name)
            by_rank.setdefault(e, []).append((rec.name, name))
        if info is None:
            info = GroupInfo(g, sub.groups[0].hyperparams, sub.groups[0].step, [])
        info.names += names
    return out, info, ep, by_rank


def expert_data_ranks(ms0: dict, ws: int, ep: int, e: int, path: str) -> list[int]:
    """The data-parallel ranks holding expert-parallel rank ``e``'s experts, in partition order (DeepSpeed
    ``groups._create_expert_and_data_parallel``, no model parallelism): ranks ``R % ep == e`` by default, the
    block ``[e * ws/ep, (e+1) * ws/ep)`` with ``use_data_before_expert_parallelism: true`` (read from the saved
    ``ds_config``). Where the two differ and the checkpoint has no config, the layout is refused."""
    cfg = ms0.get("ds_config")
    if isinstance(cfg, dict):
        dbe = bool(cfg.get("use_data_before_expert_parallelism", False))
    elif ep in (1, ws):  # both topologies give the same groups
        dbe = False
    else:
        raise UnsupportedLayout(f"mixture-of-experts checkpoint with ep_size {ep} over {ws} ranks and no ds_config: "
                                "which ranks hold which experts depends on use_data_before_expert_parallelism",
                                path=path)
    if dbe:
        stride = ws // ep
        return list(range(e * stride, (e + 1) * stride))
    return [r for r in range(ws) if r % ep == e]


def _num_local(shapes) -> dict[str, int]:
    """Experts per MoE layer (keyed by the name prefix up to ``deepspeed_experts.``) in one rank's group."""
    ids: dict[str, set[int]] = {}
    for name in shapes:
        if m := EXPERT_RE.match(name):
            ids.setdefault(m.group(1), set()).add(int(m.group(2)))
    for prefix, s in ids.items():
        if s != set(range(len(s))):
            raise CorruptFile(f"local expert ids of {prefix}* are {sorted(s)}, expected 0..{len(s) - 1}")
    return {p: len(s) for p, s in ids.items()}


def _global_name(name: str, ep_rank: int, nlocal: dict[str, int]) -> str:
    m = EXPERT_RE.match(name)
    if not m:
        raise CorruptFile(f"'{name}' is in an expert param group but is not a deepspeed_experts parameter")
    return f"{m.group(1)}{ep_rank * nlocal[m.group(1)] + int(m.group(2))}{m.group(3)}"


def _file_tensors(loc: Location, tensors: list[tuple[RankFile, str, LazyTensor]], eps: dict[int, int],
                  counts: dict[int, int]) -> dict[str, tuple[list[tuple[str, LazyTensor]], int, int]]:
    """Per expert file: its (key, tensor) pairs in file order, and (ep_size, owning expert-parallel rank) for its
    MoE layer (``eps``: layer -> ep_size, ``counts``: layer -> num_experts)."""
    out: dict[str, tuple[list, int, int]] = {}
    for f, key, t in tensors:
        name = f.path.replace("\\", "/").rsplit("/", 1)[-1]
        ep = eps.get(f.index, 1)
        owner = f.expert // max(1, counts.get(f.index, 1) // ep)
        out.setdefault(name, ([], ep, owner))[0].append((key, t))
    return out


def _expert_tensors(loc: Location, ms0: dict) -> list[tuple[str, LazyTensor, int, int, RankFile]]:
    """(global name, tensor, MoE layer, global expert id, file) of every expert-file tensor, in (layer, expert)
    order; every expert of ``num_experts`` must have its file."""
    counts = ms0.get("num_experts")
    want = {(layer, e) for layer, n in enumerate(counts) for e in range(int(n))} \
        if isinstance(counts, (list, tuple)) else set()
    have = {(f.index, f.expert) for f in loc.expert_files}
    if want - have:
        missing = sorted(want - have)[:4]
        raise IncompleteCheckpoint("expert files missing: " + ", ".join(
            f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer, e in missing), path=loc.tag_dir)
    out = []
    files = sorted(loc.expert_files, key=lambda f: (f.index, f.expert))
    for f, sd in zip(files, load_all(files, loc.storage_options)):  # metadata only; in parallel for URLs
        if not isinstance(sd, dict) or not all(isinstance(t, LazyTensor) for t in sd.values()):
            raise CorruptFile("an expert file should hold a state_dict of tensors", path=f.path)
        for name, t in sd.items():
            m = EXPERT_RE.match(name)
            if not m or int(m.group(2)) != f.expert:
                raise CorruptFile(f"'{name}' is not a tensor of expert {f.expert}", path=f.path)
            out.append((name, t, f.index, f.expert, f))
    return out


def _from_expert_files(loc: Location, ms0: dict, trainable: dict[str, TensorRecord],
                       tensors: list | None = None) -> dict[str, TensorRecord]:
    """Every expert-file tensor: trainable ones get their lp dtype from the file, the rest are frozen."""
    out: dict[str, TensorRecord] = {}
    for name, t, _, _, f in (_expert_tensors(loc, ms0) if tensors is None else tensors):
        path = f.path
        rec = trainable.get(name)
        if rec is None:
            out[name] = TensorRecord(name, tuple(t.shape), "frozen", t.dtype, pieces_of(t), lp_dtype=t.dtype)
        elif tuple(rec.shape) != tuple(t.shape):
            raise CorruptFile(f"'{name}' has shape {list(t.shape)}, param_shapes says {list(rec.shape)}", path=path)
        else:
            out[name] = dataclasses.replace(rec, lp_dtype=t.dtype)
    lost = [n for n in trainable if n not in out]
    if lost:
        raise IncompleteCheckpoint(f"no expert file holds {', '.join(lost[:4])}", path=loc.tag_dir)
    return out


def _insert_experts(records: list[TensorRecord], experts: list[TensorRecord]) -> list[TensorRecord]:
    """Experts go where the live module has them: after the last tensor of their MoE layer (its gate)."""
    by_layer: dict[str, list[TensorRecord]] = {}
    for rec in experts:
        layer = rec.name.split(".deepspeed_experts.")[0].rsplit(".experts", 1)[0]
        by_layer.setdefault(layer, []).append(rec)
    out = list(records)
    for layer, recs in by_layer.items():
        at = max((i + 1 for i, r in enumerate(out) if r.name.startswith(layer + ".")), default=len(out))
        out[at:at] = recs
    return out
