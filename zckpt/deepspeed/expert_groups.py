"""How the expert groups of a mixture-of-experts checkpoint lie over the data-parallel ranks, and views of its files
restricted to some groups and ranks: what the native MoE reader (:mod:`zckpt.deepspeed.moe`) and the AutoEP
reader (:mod:`zckpt.deepspeed.autoep`) share, and :class:`MoELayout` (``Checkpoint.extra["moe"]``), what
:mod:`zckpt.ops.reshard` lays out again."""

from __future__ import annotations

import dataclasses
import re

from zckpt.deepspeed.discover import Location, RankFile
from zckpt.deepspeed.model import Checkpoint, TensorRecord
from zckpt.errors import CorruptFile, UnsupportedLayout
from zckpt.encoding.safeload import LazyTensor

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
