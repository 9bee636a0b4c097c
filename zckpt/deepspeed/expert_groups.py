"""How the expert groups of a mixture-of-experts checkpoint lie over the data-parallel ranks, and views of its files
restricted to some groups and ranks: what the native MoE reader (:mod:`zckpt.deepspeed.moe`) and the AutoEP
reader (:mod:`zckpt.deepspeed.autoep`) share, and :class:`MoELayout` (``Checkpoint.extra["moe"]``), what
:mod:`zckpt.ops.reshard` lays out again."""

from __future__ import annotations

import dataclasses
import math
import re

from zckpt.deepspeed.discover import Location, RankFile
from zckpt.deepspeed.group_cuts import check_max_group_size, cut_bounds, output_cuts  # noqa: F401 (the writers')
from zckpt.deepspeed.model import Checkpoint, TensorRecord
from zckpt.errors import CorruptFile, InvalidArgument, UnsupportedLayout
from zckpt.deepspeed.partition import torch_size
from zckpt.engine.segments import slice_pieces
from zckpt.encoding.safeload import LazyTensor
from zckpt.state import experts as coverage

EP_NAME_RE = re.compile(r"^ep_size_(\d+)$")
PER_GROUP_KEYS = ("single_partition_of_fp32_groups", "group_paddings", "partition_count",
                  "param_alignment_paddings", "param_slice_mappings")

REFUSAL = ("mixture-of-experts checkpoint: zckpt reshards only its data-parallel size, in the DeepSpeed layout, "
           "keeping the expert-parallel size, the ZeRO stage and the optimizer")


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
    # another expert-parallel size that changes the expert groups (:func:`at_ep`): new group -> the source groups
    # its parameters come from (hyperparameters and step from the first)
    regroup: dict[int, list[int]] | None = None

    def ep_rank(self, ms0: dict, ws: int, ep: int, rank: int, path: str) -> tuple[int, int]:
        """(expert-parallel rank, index in its expert-data-parallel group) of data-parallel rank ``rank`` at world
        size ``ws`` (:func:`expert_data_ranks`)."""
        for e in range(ep):
            ranks = expert_data_ranks(ms0, ws, ep, e, path)
            if rank in ranks:
                return e, ranks.index(rank)
        raise ValueError(f"rank {rank} is in no expert-data-parallel group of {ws} ranks")


def moe_state_refusal(base: Checkpoint, records: list[TensorRecord], keys=()) -> str | None:
    """Why the optimizer state of an MoE checkpoint cannot be carried: the dense reader's reason, or per-element
    state other than Adam's moments (SGD's momentum_buffer...), which the expert readers do not place."""
    keys = sorted(set(keys) | set(base.other_state_keys) | {k for r in records for k in r.other_state})
    if base.state_refusal or not keys:
        return base.state_refusal
    return (f"optimizer state {', '.join(repr(k) for k in keys)} of a mixture-of-experts checkpoint is not Adam's "
            "exp_avg / exp_avg_sq, which is all zckpt re-partitions there")


def param_groups_of(osd: dict, ngroups: int) -> list[dict]:
    bos = osd.get("base_optimizer_state")
    pgs = bos.get("param_groups") if isinstance(bos, dict) else None
    if not isinstance(pgs, list) or len(pgs) != ngroups:
        return [{} for _ in range(ngroups)]
    return [pg if isinstance(pg, dict) else {} for pg in pgs]


def in_rank0_order(loc: Location, optim_states: list[dict], param_shapes: list) -> list[dict]:
    """Every rank's optimizer file seen with its param groups in rank 0's order (``param_shapes`` is rank 0's).

    DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer`` appends one expert group per
    ``ep_size_N`` name by walking a ``set`` of those names, so ranks without a fixed ``PYTHONHASHSEED`` save
    expert groups of different sizes in different orders (rank 0 [dense, ep_size_2, ep_size_4], rank 1 [dense,
    ep_size_4, ep_size_2]). Each rank's groups are matched to rank 0's by the name in its own
    ``base_optimizer_state`` (the k-th group of a name to the k-th), and each match is checked: the group's
    ``param_slice_mappings`` names must be rank 0's ``param_shapes`` names of that group. A rank whose groups
    cannot be matched so is refused, naming the cause."""
    if len(optim_states) < 2:
        return optim_states
    ngroups = len(param_shapes)

    def names(st) -> list | None:
        bos = st["optimizer_state_dict"].get("base_optimizer_state")
        pgs = bos.get("param_groups") if isinstance(bos, dict) else None
        if not isinstance(pgs, list) or len(pgs) != ngroups:
            return None
        return [pg.get("name") if isinstance(pg, dict) else None for pg in pgs]

    def keyed(seq: list) -> list:
        seen: dict = {}
        out = []
        for n in seq:
            out.append((n, seen.setdefault(n, 0)))
            seen[n] += 1
        return out

    ref = names(optim_states[0])
    out = []
    for f, st in zip(loc.optim_files, optim_states):
        mine = names(st)
        if ref is None or mine is None or mine == ref:
            out.append(st)
            continue
        where = {k: i for i, k in enumerate(keyed(mine))}
        perm = [where.get(k) for k in keyed(ref)]
        maps = st["optimizer_state_dict"].get("param_slice_mappings")
        why = None
        if None in ref or None in perm:
            why = f"its param groups are named {mine}, rank 0's {ref}"
        elif isinstance(maps, list) and len(maps) == ngroups:
            bad = [g for g, i in enumerate(perm) if isinstance(maps[i], dict) and not set(maps[i]) <= set(
                param_shapes[g])]
            if bad:
                why = f"its group {ref[bad[0]]!r} holds other parameters than rank 0's"
        if why:
            raise CorruptFile(f"the param groups are in another order than rank 0's and cannot be matched: {why}",
                              path=f.path, hint="DeepSpeed orders a rank's expert groups by a set of names: "
                              "every rank should come from the same save")
        out.append(select_groups(st, perm))
    return out


def sub_location(loc: Location, optim_files: list[RankFile]) -> Location:
    return Location(loc.input_path, loc.save_dir, loc.tag, loc.tag_dir, loc.trainer_dir,
                    model_files=list(loc.model_files), optim_files=optim_files, has_latest=loc.has_latest,
                    storage_options=loc.storage_options)


def select_groups(state: dict, idxs: list[int]) -> dict:
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


def ep_size_of(hyper: dict, count, ws: int, g: int, path: str) -> int:
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


def expert_file_tensors(loc: Location, tensors: list[tuple[RankFile, str, LazyTensor]], eps: dict[int, int],
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


def native_layers(tensors: list, counts: list[int], layer_ep: dict[int, int], path: str) -> list[dict]:
    """The coverage description (:mod:`zckpt.state.experts`) of each native MoE layer, from its expert files'
    tensors ((global name, tensor, layer, expert, file), every file of ``num_experts`` present): records
    ``{prefix}{E}.{param}``, the router ``{module}.deepspeed_moe.gate.*``."""
    prefixes: dict[int, set[str]] = {}
    for name, _, layer, _, _ in tensors:
        m = re.match(r"^(.*\.deepspeed_experts\.)\d+\.", name)
        if m:
            prefixes.setdefault(layer, set()).add(m.group(1))
    out = []
    for layer, n in enumerate(counts):
        found = prefixes.get(layer) or set()
        if len(found) != 1:
            raise CorruptFile(f"MoE layer {layer}'s expert files name {len(found)} expert modules "
                              f"({', '.join(sorted(found)) or 'none'})", path=path)
        prefix = found.pop()
        module = prefix.split(".deepspeed_moe.")[0] if ".deepspeed_moe." in prefix else prefix.rsplit(".experts", 1)[0]
        out.append({"layer": module, "index": layer, "experts": int(n), "ep": layer_ep.get(layer),
                    "router": f"{module}.deepspeed_moe.gate.", "prefix": prefix})
    return out


def autoep_layers(layers: list[dict], maps: dict[str, dict], path: str) -> list[dict]:
    """The coverage description (:mod:`zckpt.state.experts`) of each AutoEP layer: its fused expert parameters,
    which expert-parallel rank holds each expert (from every parameter's affine map, which must agree), the
    router ``{module_path}.router.*``. Each expert must be held exactly once (checked here, before the shards are
    put together)."""
    out = []
    for i, layer in enumerate(layers):
        mp = layer.get("module_path")
        names = [n for n, a in maps.items() if a["_layer"] is layer]
        owners, first = None, None
        desc = {"layer": mp, "index": int(layer.get("moe_layer_id", i)), "experts": int(layer.get("num_experts") or 0),
                "ep": int(layer.get("ep_size") or 1), "router": f"{mp}.router.", "fused": names}
        for name in names:
            own = _owners(name, maps[name], path)
            coverage.check_owners({**desc, "owners": own}, path)
            if owners is None:
                owners, first = own, name
            elif own != owners:
                raise CorruptFile(f"MoE layer {int(layer.get('moe_layer_id', i))} ({mp}): the affine maps of "
                                  f"'{first}' and '{name}' place the experts differently", path=path)
        desc["owners"] = owners or {}
        coverage.check_owners(desc, path)
        out.append(desc)
    return out


def _owners(name: str, amap: dict, path: str) -> dict[int, list[int]]:
    """Expert -> the expert-parallel ranks whose shard of ``name`` holds it (the affine map's pieces, each whole
    experts of the logical ``[num_experts, ...]`` tensor)."""
    per = math.prod(int(d) for d in amap["logical_shape"][1:])
    out: dict[int, list[int]] = {}
    for e, entry in sorted(((int(k), v) for k, v in (amap.get("ranks") or {}).items())):
        for pc in (entry or {}).get("pieces") or []:
            soff, shape = int(pc["source"][0]), [int(d) for d in pc["shape"]]
            if per == 0 or soff % per or math.prod(shape[1:]) != per:
                raise CorruptFile(f"AutoEP '{name}': expert-parallel rank {e}'s piece is not whole experts",
                                  path=path)
            for x in range(soff // per, soff // per + shape[0]):
                out.setdefault(x, []).append(e)
    return out


_LOCAL_RE = re.compile(r"^(.*\.deepspeed_experts\.)(\d+)(\..+)$")

# DeepSpeed's split_params_into_different_moe_groups_for_optimizer cuts an expert group holding more elements than
# this (its default, the engine's for a config optimizer) into several param groups of one name
MAX_GROUP_SIZE = 178956971


def check_group_size(name: str, numel: int, path: str, source: int = 0) -> None:
    """An expert group of the output that DeepSpeed may cut into several param groups is refused in one line: over
    its default ``max_group_size`` and over the largest expert group the source's ranks hold whole (``source``: a
    run that held one so large passed a larger limit to the helper)."""
    limit = max(MAX_GROUP_SIZE, source)
    if numel > limit:
        raise UnsupportedLayout(f"expert group {name} would hold {numel} elements on a rank, more than DeepSpeed's "
                                f"max_group_size {MAX_GROUP_SIZE}" + (f" and the source's largest group ({source})"
                                                                      if source > MAX_GROUP_SIZE else "")
                                + ": DeepSpeed may cut it into several param groups, which zckpt does not lay out "
                                "at another expert-parallel size", path=path, hint="drop --ep")


def at_ep(layout: MoELayout, ep, param_shapes: list, path: str, records: dict | None = None,
          names: dict[int, str] | None = None, max_group_size: int | None = None) -> tuple[MoELayout, dict[int, dict]]:
    """A native MoE layout laid out again at other expert-parallel sizes (``zckpt reshard --ep``): ``ep`` one size
    for every MoE layer, or ``{MoE layer index: size}``. Expert-parallel rank e of a layer of size N holds its global
    experts ``e * E/N .. (e+1) * E/N - 1`` under local ids ``0 .. E/N - 1``. DeepSpeed gives each size one expert
    param group (``ep_size_N``, after the dense groups) whose flat group holds, layer by layer in model order, each
    local expert's parameters in module order (the source's order, read from its expert-parallel rank 0), which
    ``split_params_into_different_moe_groups_for_optimizer`` cuts into several groups of that name over its
    ``max_group_size`` (:func:`_cuts`): the limit is ``max_group_size`` where given (checked against the source's
    cut), else read from the source's cut (:func:`cut_bounds`) where every limit that cut allows cuts the output
    alike, else refused in one line asking for it; a source nothing was cut in is written uncut up to DeepSpeed's
    default or its own largest group (:func:`check_group_size`). Returns the layout and, per expert group, the new
    ``param_shapes`` entry (rank 0's local experts, shapes as the source saved them). Where the groups change
    (sizes merged, split, swapped or cut), ``MoELayout.regroup`` says from which source groups each new one comes:
    its order is the source rank 0's order of the same names, else the order the source's groups first hold its
    layers. Refused in one line: a layer whose experts do not split, a layer's experts in several source groups of
    other names or two source groups of one name apart (several user param groups), source expert groups before a
    dense one."""
    if layout.autoep:
        sizes = set(ep.values()) if isinstance(ep, dict) else {ep}
        if len(sizes) > 1:
            raise UnsupportedLayout(f"AutoEP layers at expert-parallel sizes {sorted(sizes)}: DeepSpeed's AutoEP "
                                    "requires one size for every layer", path=path, hint="pass one --ep size")
        return _autoep_at_ep(layout, sizes.pop(), records or {}, path, names or {}, max_group_size)
    names = names or {}
    recs: dict[str, TensorRecord] = {}
    blocks: dict[str, tuple[list[int], int, list[str]]] = {}  # prefix -> (source groups, experts, suffixes)
    ids: dict[str, set[int]] = {}
    order: list[str] = []
    gs = sorted(layout.shards)
    src_names = [names.get(g, f"ep_size_{layout.ep[g]}") for g in gs]
    for i, n in enumerate(src_names):
        if n in src_names[:i] and src_names[i - 1] != n:
            raise UnsupportedLayout(f"expert param groups {src_names}: two of one name apart (several user param "
                                    "groups) are not laid out at another expert-parallel size", path=path,
                                    hint="drop --ep")
    for g in gs:
        by_rank = layout.shards[g]
        recs.update({rec.name: rec for pairs in by_rank.values() for _, rec in pairs})
        for local, _ in by_rank[0]:
            m = _LOCAL_RE.match(local)
            if m is None:
                raise CorruptFile(f"'{local}' is in an expert group but is not a deepspeed_experts parameter",
                                  path=path)
            prefix, i, suffix = m.group(1), int(m.group(2)), m.group(3)
            if prefix in blocks and blocks[prefix][0][-1] != g:
                last = blocks[prefix][0][-1]
                if names.get(last, last) != names.get(g, g) or layout.ep[last] != layout.ep[g] or \
                        blocks[prefix][0][-1] != g - 1:
                    raise UnsupportedLayout(f"MoE layer {_module(prefix)}'s experts are in expert groups "
                                            f"{blocks[prefix][0][0]} and {g} (several user param groups): not laid "
                                            "out at another expert-parallel size", path=path, hint="drop --ep")
                blocks[prefix][0].append(g)  # one group cut by DeepSpeed's max_group_size
            if prefix not in blocks:
                blocks[prefix] = ([g], 0, [])
                order.append(prefix)
            ids.setdefault(prefix, set()).add(i)
            if suffix not in blocks[prefix][2]:
                blocks[prefix][2].append(suffix)
    for prefix in order:
        blocks[prefix] = (blocks[prefix][0], len(ids[prefix]) * layout.ep[blocks[prefix][0][0]], blocks[prefix][2])
    lo, hi, cut = check_max_group_size(layout, names, max_group_size, path)
    shape_of = {k: v for g in gs for k, v in (param_shapes[g] if g < len(param_shapes) else {}).items()}
    layer_of = _layer_indices(layout, order)
    size_of = {p: (ep[layer_of[p]] if isinstance(ep, dict) else ep) for p in order}
    for p in order:
        if blocks[p][1] % size_of[p]:
            raise UnsupportedLayout(f"MoE layer {_module(p)}: {blocks[p][1]} experts do not split over expert-parallel "
                                    f"size {size_of[p]}", path=path, hint="pass an --ep dividing it")
    sizes: list[int] = []
    for p in order:
        if size_of[p] not in sizes:
            sizes.append(size_of[p])
    if {f"ep_size_{n}" for n in sizes} == set(src_names):
        sizes.sort(key=lambda n: src_names.index(f"ep_size_{n}"))
    base = min(layout.shards)
    shards: dict[int, dict[int, list]] = {}
    shapes: dict[int, dict] = {}
    regroup: dict[int, list[int]] = {}
    nl_of: dict[str, int] = {}
    eps: dict[int, int] = {}
    k = base
    for n in sizes:
        new: dict[int, list] = {e: [] for e in range(n)}
        mine = sorted((p for p in order if size_of[p] == n), key=lambda p: layer_of[p])
        for prefix in mine:
            _, total, suffixes = blocks[prefix]
            nl = nl_of[prefix] = total // n
            for e in range(n):
                new[e].extend((f"{prefix}{i}{sfx}", recs[f"{prefix}{e * nl + i}{sfx}"])
                              for i in range(nl) for sfx in suffixes)
        src = {g for p in mine for g in blocks[p][0]}
        first = {g: min(order.index(p) for p in mine if g in blocks[p][0]) for g in src}
        numels = [r.numel for _, r in new[0]]
        starts = output_cuts(numels, n, (lo, hi, cut), max_group_size, path)
        if starts is None:  # nothing was cut in the source
            check_group_size(f"ep_size_{n}", sum(numels), path, max(
                sum(r.numel for _, r in by_rank[0]) for by_rank in layout.shards.values()))
            starts = [0]
        for a, b in zip(starts, starts[1:] + [len(numels)]):
            regroup[k] = sorted(src, key=lambda g: (first[g], g))
            shapes[k] = {local: shape_of[_LOCAL_RE.sub(lambda m: f"{m.group(1)}0{m.group(3)}", local)]
                         for local, _ in new[0][a:b]}
            shards[k] = {e: pairs[a:b] for e, pairs in new.items()}
            eps[k] = n
            k += 1
    files = {}
    for name, (tensors, _, _) in layout.expert_files.items():  # (ep, the expert-parallel rank that loads it)
        m = _LOCAL_RE.match(tensors[0][0]) if tensors else None
        p = m.group(1) if m else None
        files[name] = (tensors, size_of.get(p, 1), int(m.group(2)) // nl_of[p] if p in nl_of else 0)
    out = MoELayout(eps, shards, files)
    if regroup != {g: [g] for g in layout.shards}:
        out.regroup = regroup
    return out, shapes


def _module(prefix: str) -> str:
    return prefix.split(".deepspeed_moe.")[0]


def _layer_indices(layout: MoELayout, prefixes: list[str]) -> dict[str, int]:
    """MoE layer index (``layer_{L}_expert_{E}`` of the expert files) of each expert name prefix."""
    out: dict[str, int] = {}
    for name, (tensors, _, _) in layout.expert_files.items():
        m, t = re.match(r"^layer_(\d+)_expert_", name), _LOCAL_RE.match(tensors[0][0]) if tensors else None
        if m and t:
            out.setdefault(t.group(1), int(m.group(1)))
    missing = [p for p in prefixes if p not in out]
    if missing:
        raise CorruptFile(f"no expert file names the MoE layer of {missing[0]}*")
    return out


def _autoep_at_ep(layout: MoELayout, ep: int, records: dict, path: str, names: dict[int, str],
                  max_group_size: int | None) -> tuple[MoELayout, dict[int, dict]]:
    """AutoEP at expert-parallel size ``ep``: expert-parallel rank e's shard of each fused expert parameter is
    experts ``e * E/ep .. (e+1) * E/ep - 1`` of the full (logical) record, masters and moments sliced alike
    (:func:`autoep_layers_at` rewrites ``ds_autoep_layers``). An expert group DeepSpeed cut into several param groups
    of one name (``configure_moe_param_groups`` calls the helper at its ``max_group_size``) is laid out as one
    sequence and cut again as the helper cuts it (:func:`output_cuts`)."""
    gs = sorted(layout.shards)
    if any(names.get(g) != names.get(gs[0]) for g in gs) or gs != list(range(gs[0], gs[0] + len(gs))):
        raise UnsupportedLayout(f"{len(gs)} AutoEP expert param groups of other names or apart (several user param "
                                "groups): not laid out at another expert-parallel size", path=path, hint="drop --ep")
    bounds = check_max_group_size(layout, names, max_group_size, path)
    new: dict[int, list] = {}
    for g in gs:
        for name, _ in layout.shards[g][0]:
            full = records.get(name)
            if full is None or not full.shape or full.shape[0] % ep:
                raise UnsupportedLayout(f"AutoEP '{name}': {full.shape[0] if full else '?'} experts do not split "
                                        f"over expert-parallel size {ep}", path=path, hint="pass an --ep dividing it")
            nl = int(full.shape[0]) // ep
            per = math.prod(int(d) for d in full.shape[1:])
            for e in range(ep):
                def cut(pieces, e=e):
                    return slice_pieces(pieces, e * nl * per, nl * per) if pieces else []
                new.setdefault(e, []).append((name, dataclasses.replace(
                    full, shape=(nl, *full.shape[1:]), value=cut(full.value), exp_avg=cut(full.exp_avg),
                    exp_avg_sq=cut(full.exp_avg_sq), other_state={k: cut(v) for k, v in full.other_state.items()})))
    starts = output_cuts([r.numel for _, r in new[0]], ep, bounds, max_group_size, path)
    if starts is None:  # nothing was cut in the source
        check_group_size(f"ep_size_{ep}", sum(r.numel for _, r in new[0]), path,
                         sum(r.numel for _, r in layout.shards[gs[0]][0]))
        starts = [0]
    shards: dict[int, dict[int, list]] = {}
    shapes: dict[int, dict] = {}
    for k, (a, b) in enumerate(zip(starts, starts[1:] + [len(new[0])])):
        g = gs[0] + k
        shards[g] = {e: [(n, dataclasses.replace(r, group=g)) for n, r in pairs[a:b]] for e, pairs in new.items()}
        shapes[g] = {name: torch_size(rec.shape) for name, rec in shards[g][0]}
    files = {}
    for fname, (tensors, _, owner) in layout.expert_files.items():  # the expert-parallel rank that loads it now
        name, _, gid = tensors[0][0].rpartition(".") if tensors else ("", "", "")
        full = records.get(name)
        if full is not None and gid.isdigit() and full.shape:
            owner = int(gid) // max(1, int(full.shape[0]) // ep)
        files[fname] = (tensors, ep, owner)
    out = MoELayout({g: ep for g in shards}, shards, files, autoep=True)
    if len(shards) != len(gs):
        out.regroup = {g: list(gs) for g in shards}
    return out, shapes


def autoep_layers_at(layers: list, ep: int, world_size: int) -> list:
    """``ds_autoep_layers`` (rank 0's view) at expert-parallel size ``ep`` and data-parallel size ``world_size``:
    the placement (rank e holds experts ``e * E/ep ..``), every fused parameter's affine map (one whole block per
    rank), the group name and rank 0's own fields, as DeepSpeed writes them."""
    out = []
    for x in layers:
        if not isinstance(x, dict) or "ep_size" not in x:
            out.append(x)
            continue
        n = int(x["num_experts"])
        nl = n // ep
        y = dict(x)
        y.update(num_local_experts=nl, ep_size=ep, ep_group_name=f"ep_size_{ep}", ep_rank=0,
                 expert_data_parallel_rank=0, expert_data_parallel_world_size=world_size // ep,
                 global_expert_start=0, global_expert_end=nl)
        if isinstance(x.get("expert_placement"), dict):
            y["expert_placement"] = dict(x["expert_placement"], ep_size=ep, ranks=[
                {"rank": e, "experts": list(range(e * nl, (e + 1) * nl))} for e in range(ep)])
        params = {}
        for name, amap in ((x.get("affine_maps") or {}).get("params") or {}).items():
            logical = [int(d) for d in amap["logical_shape"]]
            shard = [nl, *logical[1:]]
            strides = list(_strides_of(logical))
            per = math.prod(logical[1:])
            params[name] = dict(amap, ranks={e: {"shard_shape": list(shard), "pieces": [
                {"shape": list(shard), "source": [e * nl * per, list(strides)], "dest": [0, list(_strides_of(shard))],
                 "locations": [e]}]} for e in range(ep)})
        if params:
            y["affine_maps"] = dict(x["affine_maps"], params=params)
        out.append(y)
    return out


def _strides_of(shape) -> tuple:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= int(d)
    return tuple(reversed(out))




def target_eps(ep, layers: list[dict], world_size: int, path: str) -> dict[int, int]:
    """Each MoE layer's expert-parallel size in the output (MoE layer index -> size). ``ep``: one size for every
    layer, or a sequence of one size per MoE layer in model order (the ``layer_{L}`` order of the expert files, as
    ``info`` lists them). Refused in one line: a count other than the layers', a size below 1, a size not dividing
    the layer's experts or not dividing ``world_size`` (DeepSpeed builds neither)."""
    order = sorted(layers, key=lambda x: x["index"])
    sizes = [ep] * len(order) if isinstance(ep, int) else list(ep)
    if len(sizes) != len(order):
        raise InvalidArgument(f"{len(sizes)} expert-parallel sizes for {len(order)} MoE layers: give one size, or "
                              "one per MoE layer in order", param="ep", path=path,
                              hint=f"e.g. --ep {','.join(str(x.get('ep') or 'N') for x in order)}")
    out: dict[int, int] = {}
    for x, n in zip(order, sizes):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"the expert-parallel size must be a positive integer, not {n!r}", param="ep")
        if int(x["experts"]) % n:
            raise UnsupportedLayout(f"MoE layer {x['index']} ({x['layer']}): {x['experts']} experts do not split "
                                    f"over expert-parallel size {n}", path=path, hint="pass an --ep dividing it")
        if world_size % n:
            raise UnsupportedLayout(f"mixture-of-experts checkpoint: data-parallel size {world_size} is not a "
                                    f"multiple of the expert-parallel size {n} (MoE layer {x['index']})", path=path,
                                    hint=f"pass a multiple of {n}, or another --ep")
        out[int(x["index"])] = n
    return out
