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
    runs: list[list[list[int]]] = []  # consecutive groups of one name: each group's parameters' numels (rank 0)
    for i, g in enumerate(gs):
        numels = [r.numel for _, r in layout.shards[g][0]]
        if i and g == gs[i - 1] + 1 and names.get(g) == names.get(gs[i - 1]):
            runs[-1].append(numels)
        else:
            runs.append([numels])
    return bounds_of(runs)


def bounds_of(runs: list[list[list[int]]]) -> tuple[int, int | None, bool]:
    """:func:`cut_bounds` of cut groups given as numbers: each run is one expert group the helper cut, as the list
    of its param groups, each the numels of its parameters in order (on one expert-parallel rank). The limit is at
    least the first parameter too (under it the helper makes an empty first group, which no save holds)."""
    lo, hi = 0, None
    for run in runs:
        lo = max([lo] + [sum(g) for g in run if len(g) > 1] + [run[0][0]] * bool(run and run[0]))
        for g, nxt in zip(run, run[1:]):
            if nxt:
                hi = sum(g) + nxt[0] - 1 if hi is None else min(hi, sum(g) + nxt[0] - 1)
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
    limit = limit_of(bounds, limit, path)
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
    return check_limit(cut_bounds(layout, names), limit, path)


def check_limit(bounds: tuple, limit: int | None, path: str):
    """``limit`` against the source's ``bounds`` (:func:`cut_bounds`, :func:`bounds_of`), refused in one line
    where DeepSpeed would have cut the source otherwise; the bounds back."""
    lo, hi, cut = bounds
    if isinstance(limit, int) and (limit < lo or (hi is not None and limit > hi)):
        said = f"between {lo} and {hi}" if cut else f"at least {lo} (nothing was cut)"
        raise InvalidArgument(f"{limit} would not cut the source's expert groups as they are: their "
                              f"cut says the run's max_group_size was {said}", param="max_group_size", path=path,
                              hint="pass the max_group_size the run gave split_params_into_different_moe_groups_"
                              "for_optimizer")
    return lo, hi, cut


def limit_of(bounds: tuple, limit, path: str) -> int | None:
    """The ``max_group_size`` to cut at: ``limit`` as given (a number, or None), or, for a range ``(lo, hi)`` (what
    a live engine's own expert param groups say of the limit its helper cut them at: :mod:`zckpt.ops.resume`), its
    least, which cuts the engine's parameters as the engine holds them whatever the source's run passed."""
    return limit[0] if isinstance(limit, tuple) else limit
