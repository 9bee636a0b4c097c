"""How DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer`` (0.19.8) cuts an expert group into
several param groups of one name, the ``max_group_size`` the source's cut allows, and the cut of a group laid out
again (:func:`zckpt.deepspeed.expert_groups.at_ep`). The helper walks a group's parameters in order and starts a new
param group where the next parameter would take the current one over ``max_group_size`` (178956971 by default; the
engine's ``configure_moe_param_groups`` calls it so for a config optimizer, native MoE and AutoEP alike)."""

from __future__ import annotations

from zckpt.errors import InvalidArgument, UnsupportedLayout

def cut_bounds(layout, names: dict[int, str]) -> tuple[int, int | None, bool]:
    """What the source's expert groups (``layout``: a :class:`~zckpt.deepspeed.expert_groups.MoELayout`) say of
    the ``max_group_size`` its run passed to DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``,
    which cuts an expert group's parameters (in order)
    into param groups of one name, a new one when the next parameter would take it over the limit: (lo, hi, cut).
    Every group holds at most the limit (lo: the largest, on expert-parallel rank 0, whose parameters are the same
    on every rank); each cut group plus the first parameter of the next exceeds it (hi, None where nothing was
    cut; a group of one parameter may hold more than the limit, so it does not bound it from below). ``names``: group
    -> its name; consecutive groups of one name are one cut group."""
    gs = sorted(layout.shards)
    size = {g: sum(r.numel for _, r in layout.shards[g][0]) for g in gs}
    lo = max((size[g] for g in gs if len(layout.shards[g][0]) > 1), default=0)
    hi = None
    for g, nxt in zip(gs, gs[1:]):
        if nxt == g + 1 and names.get(g) == names.get(nxt) and layout.shards[nxt][0]:
            over = size[g] + layout.shards[nxt][0][0][1].numel - 1
            hi = over if hi is None else min(hi, over)
    return lo, hi, hi is not None


def cuts(numels: list[int], limit: int, what: str, path: str) -> list[int]:
    """Where DeepSpeed's helper starts a new param group (indices into ``numels``), as 0.19.8 cuts: a parameter
    that would take the group over the limit starts the next (alone over it if it is larger)."""
    if numels and numels[0] > limit:
        raise UnsupportedLayout(f"{what}: its first parameter of {numels[0]} elements is over max_group_size {limit}: "
                                "DeepSpeed's helper would make an empty param group", path=path,
                                hint="pass a larger --max-group-size")
    starts, size = [0], 0
    for i, n in enumerate(numels):
        if size + n > limit:
            starts.append(i)
            size = 0
        size += n
    return starts


def output_cuts(numels: list[int], n: int, bounds: tuple, limit: int | None, path: str) -> list[int] | None:
    """Where DeepSpeed cuts an output expert group of ep_size ``n`` whose rank-0 parameters have ``numels``: at
    ``limit`` (``--max-group-size``) where given; else where every limit the source's cut allows (``bounds``,
    :func:`cut_bounds`) cuts alike, refused in one line where they do not; None for a source nothing was cut in
    (one group, which the caller checks against DeepSpeed's default: ``expert_groups.check_group_size``)."""
    lo, hi, cut = bounds
    what = f"expert group ep_size_{n}"
    if limit is not None:
        return cuts(numels, limit, what, path)
    if not cut:
        return None
    starts = cuts(numels, lo, what, path)
    if cuts(numels, hi, what, path) != starts:
        raise UnsupportedLayout(f"{what} would hold {sum(numels)} elements on a rank, which DeepSpeed's "
                                "split_params_into_different_moe_groups_for_optimizer cuts as its max_group_size "
                                f"says, and the source's cut says only that it was between {lo} and {hi}", path=path,
                                hint="pass --max-group-size N, the run's max_group_size")
    return starts


def check_max_group_size(layout, names: dict[int, str], limit: int | None, path: str):
    """``--max-group-size`` against what the source's cut says (:func:`cut_bounds`): refused in one line where
    DeepSpeed would have cut the source otherwise."""
    lo, hi, cut = cut_bounds(layout, names)
    if limit is not None and (limit < lo or (hi is not None and limit > hi)):
        said = f"between {lo} and {hi}" if cut else f"at least {lo} (nothing was cut)"
        raise InvalidArgument(f"{limit} would not cut the source's expert groups as they are: their "
                              f"cut says the run's max_group_size was {said}", param="max_group_size", path=path,
                              hint="pass the max_group_size the run gave split_params_into_different_moe_groups_"
                              "for_optimizer")
    return lo, hi, cut
