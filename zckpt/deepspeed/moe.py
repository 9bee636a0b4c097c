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

AutoEP (DeepSpeed 0.19.2+, fused ``experts.w1/w2/w3``) is read by :mod:`zckpt.deepspeed.autoep`; how expert groups
lie over the ranks (:class:`MoELayout`, :func:`expert_data_ranks`) and the views of the files that both readers
build are in :mod:`zckpt.deepspeed.expert_groups`.
"""

from __future__ import annotations

import dataclasses
import re

from zckpt.deepspeed import autoep
from zckpt.deepspeed.discover import Location, RankFile
from zckpt.deepspeed.expert_groups import (
    EP_NAME_RE, REFUSAL, MoELayout, ep_size_of, expert_data_ranks, expert_file_tensors, in_rank0_order,
    moe_state_refusal, native_layers, param_groups_of, select_groups, sub_location,
)
from zckpt.deepspeed.model import (
    LP_DTYPES, Checkpoint, GroupInfo, TensorRecord, common_records, load_all, pieces_of, precision_of,
)
from zckpt.errors import CorruptFile, IncompleteCheckpoint, UnsupportedLayout, ZckptError
from zckpt.encoding.safeload import LazyTensor
from zckpt.state import experts as coverage

EXPERT_RE = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..+)$")

ZERO0_REFUSAL = ("mixture-of-experts checkpoint without ZeRO: each expert-parallel rank's whole optimizer is in "
                 "expp_rank_{e}_mp_rank_00_optim_states.pt, which DeepSpeed loads at any data-parallel size with the "
                 "same expert-parallel size as it is: resharding it at the same expert-parallel size is not "
                 "supported (nothing to do; --ep N lays it out at another)")


def build(loc: Location, model_states: list[dict], optim_states: list[dict]) -> Checkpoint:
    from zckpt.deepspeed import zero12

    ms0 = model_states[0]
    mpath = loc.model_files[0].path
    if ms0.get("ds_autoep_layers"):
        layers = ms0["ds_autoep_layers"]
        if isinstance(layers, list) and any(isinstance(x, dict) and x.get("checkpoint_format") == "zero3_partitioned"
                                            for x in layers):
            return autoep.build_autoep_zero3(loc, model_states, optim_states)
        return autoep.build_autoep(loc, model_states, optim_states)
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
    viewed = in_rank0_order(loc, optim_states, param_shapes)  # ranks of other hash seeds: other orders
    reordered = [f.dp_rank for f, a, b in zip(loc.optim_files, viewed, optim_states) if a is not b]
    optim_states = viewed
    hyper = param_groups_of(osds[0], ngroups)
    experts = [g for g in range(ngroups) if hyper[g].get("moe") or any(EXPERT_RE.match(n) for n in param_shapes[g])]
    dense = [g for g in range(ngroups) if g not in experts]

    ms_dense = {**ms0, "param_shapes": [param_shapes[g] for g in dense],
                "frozen_param_shapes": _dense_only(ms0.get("frozen_param_shapes")),
                "frozen_param_fragments": _dense_only(ms0.get("frozen_param_fragments"))}
    dense_loc = sub_location(loc, loc.optim_files)
    try:
        base = zero12.build(dense_loc, [ms_dense], [select_groups(st, dense) for st in optim_states])
    except IncompleteCheckpoint as exc:  # a rank's file missing: say which experts it held
        counts = osds[0].get("partition_count")
        raise IncompleteCheckpoint(exc.message + _rank_experts(loc, ms0, param_shapes, hyper, experts, counts),
                                   path=exc.path, hint=exc.hint) from None
    groups = [dataclasses.replace(gi, index=dense[gi.index]) for gi in base.groups]
    records = [dataclasses.replace(r, group=dense[r.group]) if r.group is not None else r for r in base.records]

    expert_recs: dict[str, TensorRecord] = {}
    placed: dict[int, tuple[int, dict[int, list[tuple[str, str]]]]] = {}
    # a layer's local experts may lie in several param groups of one name (DeepSpeed's max_group_size cut, or several
    # user param groups): counted over every expert group
    nlocal = _num_local(name for g in experts for name in param_shapes[g])
    for g in experts:
        recs, info, ep, by_rank = _expert_group(loc, ms0, optim_states, hyper[g], g, param_shapes[g], ws, nlocal)
        expert_recs.update(recs)
        groups.append(info)
        placed[g] = (ep, by_rank)
    groups.sort(key=lambda gi: gi.index)
    tensors = _expert_tensors(loc, ms0)
    expert_recs = _from_expert_files(loc, ms0, expert_recs, tensors)
    records = _insert_experts(records, list(expert_recs.values()))
    notes = [f"mixture of experts: {len(loc.expert_files)} expert files, expert groups "
             + ", ".join(f"{g} ({hyper[g].get('name', '?')})" for g in experts)]
    cut = {n: c for n in dict.fromkeys(hyper[g].get("name") for g in experts)
           if (c := sum(hyper[g].get("name") == n for g in experts)) > 1}
    if cut:
        notes[0] += ("; " + ", ".join(f"{n} is {c} param groups" for n, c in cut.items())
                     + " (DeepSpeed's split_params_into_different_moe_groups_for_optimizer cuts an expert group over "
                     "its max_group_size; or several user param groups)")
    if reordered:
        notes.append(f"the optimizer files of rank{'s' if len(reordered) > 1 else ''} "
                     f"{', '.join(map(str, sorted(reordered)))} list their param groups in another order than rank "
                     f"0's ({', '.join(str(h.get('name')) for h in hyper)}): DeepSpeed orders expert groups by a set "
                     "of names, so ranks without a fixed PYTHONHASHSEED differ; each was read in its own order, and "
                     "files zckpt writes have rank 0's on every rank")
    ep_of = {name: ep for ep, by_rank in placed.values() for pairs in by_rank.values() for _, name in pairs}
    layer_ep: dict[int, int] = {}
    for name, _, layer, _, _ in tensors:
        if name in ep_of:
            layer_ep.setdefault(layer, ep_of[name])
    layout = MoELayout({g: ep for g, (ep, _) in placed.items()},
                       {g: {e: [(local, expert_recs[name]) for local, name in pairs] for e, pairs in by_rank.items()}
                        for g, (_, by_rank) in placed.items()},
                       expert_file_tensors(loc, [(f, n, t) for n, t, _, _, f in tensors], layer_ep,
                                     dict(enumerate(int(n) for n in ms0["num_experts"]))))
    layers = native_layers(tensors, [int(n) for n in ms0["num_experts"]], layer_ep, loc.tag_dir)
    coverage.check(layers, records, loc.tag_dir)
    return Checkpoint(loc, base.stage, base.flavour, base.precision, ws, records, groups, ms0, optim_states,
                      model_states, offload=base.offload, notes=notes, parallel="moe", reshard_refusal=REFUSAL,
                      extra={"moe": layout, "moe_coverage": layers, "mixed_group_orders": reordered}, state_refusal=moe_state_refusal(base, records))


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
    saved = []  # per expp_rank file: (file, its optimizer object, each group's names in position order)
    for e, (f, st) in enumerate(files):
        mine = [(n, t) for n, t, layer, gid, _ in tensors if gid in held[e][layer]]
        opt = st.get("optimizer") if isinstance(st, dict) else None
        recs, gis, more = zero0.read_optimizer(opt, dense + mine, precision, f.path, loc.storage_options)
        saved.append((f, opt, [list(gi.names) for gi in gis]))
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
    layers = native_layers(tensors, counts, {}, loc.tag_dir)  # (which ep_size a layer has is not saved)
    coverage.check(layers, records, loc.tag_dir)
    return Checkpoint(loc, 0, "zero0", precision, ws, records, groups, ms0, [], model_states, notes=notes,
                      parallel="moe", reshard_refusal=ZERO0_REFUSAL,
                      extra={"moe_coverage": layers, "moe_zero0": saved},
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


def _rank_experts(loc: Location, ms0: dict, param_shapes: list, hyper: list, experts: list, counts) -> str:
    """``; rank 1 held experts 4..7 of moe (ep_size_2)``: the experts of the ranks whose optimizer file is missing
    (empty when that cannot be said)."""
    try:
        ws = int(counts[next(g for g in range(len(param_shapes)) if g not in experts)])
        missing = sorted(set(range(ws)) - {f.dp_rank for f in loc.optim_files})
        nlocal = _num_local(name for g in experts for name in param_shapes[g])
        parts = []
        for r in missing:
            held = []
            for g in experts:
                ep = ep_size_of(hyper[g], counts[g], ws, g, loc.tag_dir)
                e = next(e for e in range(ep) if r in expert_data_ranks(ms0, ws, ep, e, loc.tag_dir))
                for prefix in dict.fromkeys(m.group(1) for m in map(EXPERT_RE.match, param_shapes[g]) if m):
                    n, module = nlocal[prefix], prefix.split(".deepspeed_moe.")[0]
                    what = f"experts {e * n}..{(e + 1) * n - 1} of {module} ({hyper[g].get('name', g)})"
                    if what not in held:
                        held.append(what)
            if held:
                parts.append(f"rank {r} held its partition of " + ", ".join(held))
    except (ZckptError, TypeError, ValueError, IndexError, KeyError, StopIteration):
        return ""
    return "; " + "; ".join(parts) if parts else ""


def _dense_only(d):
    return None if d is None else {k: v for k, v in d.items() if not EXPERT_RE.match(k)}


def _expert_group(loc, ms0, optim_states, hyper, g, shapes, ws, nlocal):
    """Expert group ``g``: one zero12 build per expert-parallel rank, local expert ids renamed to global ones
    (``nlocal``: each MoE layer's local experts, counted over all expert groups, :func:`_num_local`).
    Returns (records by global name, the group, ep_size, per expert-parallel rank its (local, global) names in
    the order of its flat group)."""
    from zckpt.deepspeed import zero12

    counts = optim_states[0]["optimizer_state_dict"].get("partition_count")
    count = counts[g] if isinstance(counts, (list, tuple)) and g < len(counts) else counts
    ep = ep_size_of(hyper, count, ws, g, loc.optim_files[0].path)
    ms_g = {**ms0, "module": None, "param_shapes": [shapes], "frozen_param_shapes": None,
            "frozen_param_fragments": None, "shared_params": {}, "buffer_names": []}
    out: dict[str, TensorRecord] = {}
    by_rank: dict[int, list[tuple[str, str]]] = {}
    info = None
    for e in range(ep):
        ranks = expert_data_ranks(ms0, ws, ep, e, loc.tag_dir)
        files = [dataclasses.replace(loc.optim_files[r], dp_rank=i) for i, r in enumerate(ranks)]
        sub = zero12.build(sub_location(loc, files), [ms_g], [select_groups(optim_states[r], [g]) for r in ranks])
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


def _num_local(names) -> dict[str, int]:
    """Experts per MoE layer (keyed by the name prefix up to ``deepspeed_experts.``) on one rank: ``names`` are the
    parameter names of rank 0's expert groups, all of them (DeepSpeed's ``split_params_into_different_moe_groups_
    for_optimizer`` cuts an expert group over ``max_group_size`` into several param groups of one name, a layer's
    experts spread over them, a cut even within an expert)."""
    ids: dict[str, set[int]] = {}
    for name in names:
        if m := EXPERT_RE.match(name):
            ids.setdefault(m.group(1), set()).add(int(m.group(2)))
    for prefix, s in ids.items():
        if s != set(range(len(s))):
            raise CorruptFile(f"the expert param groups (param_shapes) hold local expert ids {sorted(s)} of "
                              f"{prefix}*, expected 0..{len(s) - 1}")
    return {p: len(s) for p, s in ids.items()}


def _global_name(name: str, ep_rank: int, nlocal: dict[str, int]) -> str:
    m = EXPERT_RE.match(name)
    if not m:
        raise CorruptFile(f"'{name}' is in an expert param group but is not a deepspeed_experts parameter")
    return f"{m.group(1)}{ep_rank * nlocal[m.group(1)] + int(m.group(2))}{m.group(3)}"


def _expert_tensors(loc: Location, ms0: dict) -> list[tuple[str, LazyTensor, int, int, RankFile]]:
    """(global name, tensor, MoE layer, global expert id, file) of every expert-file tensor, in (layer, expert)
    order; every expert of ``num_experts`` must have its file."""
    counts = ms0.get("num_experts")
    want = {(layer, e) for layer, n in enumerate(counts) for e in range(int(n))} \
        if isinstance(counts, (list, tuple)) else set()
    have = {(f.index, f.expert) for f in loc.expert_files}
    if want - have:
        missing = sorted(want - have)[:4]
        raise IncompleteCheckpoint(f"MoE layer {missing[0][0]}: expert {missing[0][1]} has no file; expert files "
                                   "missing: " + ", ".join(f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"
                                                           for layer, e in missing), path=loc.tag_dir)
    beyond = sorted(have - want)
    if beyond:
        layer, e = beyond[0]
        f = next(f for f in loc.expert_files if (f.index, f.expert) == beyond[0])
        raise CorruptFile(f"MoE layer {layer}: expert {e} is beyond its "
                          f"{int(counts[layer]) if layer < len(counts) else 0} experts (num_experts "
                          f"{[int(n) for n in counts]})", path=f.path,
                          hint="remove the stray expert file, or pass a complete MoE checkpoint")
    out = []
    files = sorted(loc.expert_files, key=lambda f: (f.index, f.expert))
    for f, sd in zip(files, load_all(files, loc.storage_options)):  # metadata only; in parallel for URLs
        if not isinstance(sd, dict) or not all(isinstance(t, LazyTensor) for t in sd.values()):
            raise CorruptFile("an expert file should hold a state_dict of tensors", path=f.path)
        for name, t in sd.items():
            m = EXPERT_RE.match(name)
            if m and int(m.group(2)) != f.expert and (f.index, int(m.group(2))) in have:
                raise CorruptFile(f"MoE layer {f.index}: expert {m.group(2)} is held twice (its own file and "
                                  f"'{name}' in the file of expert {f.expert})", path=f.path)
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
