"""Mixture-of-experts coverage: every MoE layer of a checkpoint holds each of its experts exactly once, each with its
value (the master, for a trainable parameter) and every per-element optimizer state the checkpoint keeps, and its
router. A reader that finds MoE layers describes them (plain data, ``Checkpoint.extra["moe_coverage"]``) and calls
:func:`check` before it returns, so every command refuses a checkpoint that fails it, in one line naming the layer
and the expert; ``verify`` runs :func:`check` again over the records and ``info`` reports :func:`summary`.

A layer is described as a dict::

    layer      the MoE module's path ("model.layers.0.mlp", "moe")
    index      its index among the MoE layers (DeepSpeed's layer_{L}_expert_{E} files)
    experts    how many experts it has (the files' num_experts / the affine map's logical shape)
    ep         its expert-parallel size
    router     the prefix of the router's parameter names (at least one record must have it)
    prefix     per-expert records: ``{prefix}{E}.{param}`` (native DeepSpeed MoE, one record per expert parameter)
    fused      or fused records, ``[experts, ...]`` (AutoEP, transformers' 3-D experts): their names
    owners     (fused) expert -> the expert-parallel ranks whose shard holds it, from the files' placement
"""

from __future__ import annotations

import re

from zckpt.errors import CorruptFile, IncompleteCheckpoint

ADAM = ("exp_avg", "exp_avg_sq")


def _states(rec) -> set[str]:
    return ({k for k in ADAM if getattr(rec, k)}) | set(rec.other_state)


def _want_states(records) -> set[str]:
    """The per-element state keys every trainable record of the checkpoint has (none when it keeps none)."""
    sets = [_states(r) for r in records if r.kind == "trainable"]
    return set.union(*sets) if sets and any(sets) else set()


def check(layers: list[dict], records, path: str | None = None) -> None:
    """Raise :class:`~zckpt.errors.IncompleteCheckpoint` (an expert, its state or a router missing) or
    :class:`~zckpt.errors.CorruptFile` (an expert held twice, or beyond the layer's count), naming the layer and
    the expert."""
    by_name: dict[str, list] = {}
    for r in records:
        by_name.setdefault(r.name, []).append(r)
    want = _want_states(records)
    for layer in layers:
        where = f"MoE layer {layer.get('index', '?')} ({layer['layer']})"
        n = int(layer["experts"])
        router = layer.get("router")
        if router and not any(r.name.startswith(router) for r in records):
            raise IncompleteCheckpoint(f"{where}: no router ('{router}*')", path=path)
        if layer.get("fused") is not None:
            _check_fused(layer, where, n, by_name, want, path)
        else:
            _check_per_expert(layer, where, n, records, want, path)


def _check_state(rec, where: str, expert, want: set[str], path) -> None:
    if rec.kind == "tied":
        return
    if not rec.value:
        raise IncompleteCheckpoint(f"{where}: expert {expert} has no value for '{rec.name}'", path=path)
    if rec.kind == "trainable" and want - _states(rec):
        raise IncompleteCheckpoint(f"{where}: expert {expert} has no {', '.join(sorted(want - _states(rec)))} "
                                   f"for '{rec.name}'", path=path)


def check_owners(layer: dict, path: str | None = None) -> None:
    """A fused layer's placement alone: each expert held by exactly one expert-parallel rank (before the shards
    are put together)."""
    where = f"MoE layer {layer.get('index', '?')} ({layer['layer']})"
    n = int(layer["experts"])
    owners = {int(e): list(r) for e, r in (layer.get("owners") or {}).items()}
    for e in sorted(owners):
        if e >= n or e < 0:
            raise CorruptFile(f"{where}: expert {e} is beyond its {n} experts (expert-parallel rank "
                              f"{owners[e][0]})", path=path)
        if len(owners[e]) > 1:
            raise CorruptFile(f"{where}: expert {e} is held twice (expert-parallel ranks "
                              f"{' and '.join(map(str, owners[e]))})", path=path)
    lost = [e for e in range(n) if not owners.get(e)]
    if lost:
        raise IncompleteCheckpoint(f"{where}: expert {lost[0]} is held by no expert-parallel rank"
                                   + (f" (nor experts {', '.join(map(str, lost[1:8]))})" if lost[1:] else ""),
                                   path=path)


def _check_fused(layer: dict, where: str, n: int, by_name: dict, want: set[str], path) -> None:
    if layer.get("owners") is not None:  # (a DCP's fused tensors are whole: no placement, the shape says it)
        check_owners(layer, path)
    for name in layer["fused"]:
        recs = by_name.get(name) or []
        if len(recs) != 1:
            raise (CorruptFile if recs else IncompleteCheckpoint)(
                f"{where}: the experts' '{name}' is {'held twice' if recs else 'missing'}", path=path)
        rec = recs[0]
        if not rec.shape or int(rec.shape[0]) != n:
            raise CorruptFile(f"{where}: '{name}' holds {rec.shape[0] if rec.shape else 0} experts, the layer {n}",
                              path=path)
        _check_state(rec, where, f"0..{n - 1}", want, path)


def _check_per_expert(layer: dict, where: str, n: int, records, want: set[str], path) -> None:
    pat = re.compile(re.escape(layer["prefix"]) + r"(\d+)\.(.+)$")
    params: dict[int, dict[str, list]] = {}
    for r in records:
        m = pat.match(r.name)
        if m:
            params.setdefault(int(m.group(1)), {}).setdefault(m.group(2), []).append(r)
    for e in sorted(params):
        if e >= n:
            raise CorruptFile(f"{where}: expert {e} is beyond its {n} experts ('{layer['prefix']}{e}.*')", path=path)
        twice = [p for p, rs in params[e].items() if len(rs) > 1]
        if twice:
            raise CorruptFile(f"{where}: expert {e} is held twice ('{layer['prefix']}{e}.{twice[0]}')", path=path)
    lost = [e for e in range(n) if e not in params]
    if lost:
        raise IncompleteCheckpoint(f"{where}: expert {lost[0]} is missing"
                                   + (f" (and experts {', '.join(map(str, lost[1:8]))})" if lost[1:] else ""),
                                   path=path)
    names = set().union(*(set(p) for p in params.values()))
    for e in range(n):
        if set(params[e]) != names:
            raise IncompleteCheckpoint(f"{where}: expert {e} has no "
                                       f"'{layer['prefix']}{e}.{sorted(names - set(params[e]))[0]}'", path=path)
        for rs in params[e].values():
            _check_state(rs[0], where, e, want, path)


def summary(ckpt) -> dict | None:
    """What ``info`` and ``verify`` report: MoE layers x experts, the expert-parallel sizes and what was checked
    (None without MoE layers). Runs :func:`check` (raising as it does)."""
    layers = ckpt.extra.get("moe_coverage")
    if not layers:
        return None
    check(layers, ckpt.records, ckpt.location.tag_dir)
    counts = [int(x["experts"]) for x in layers]
    eps = sorted({int(x["ep"]) for x in layers if x.get("ep")}) or [None]
    states = sorted(_want_states(ckpt.records), key=lambda k: (k not in ADAM, k))
    # a reader that placed the state beside the records (Megatron's dp_reshardable buckets) says what it checked
    states = list(ckpt.extra.get("moe_states") or states)
    return {"layers": len(layers), "experts": counts[0] if len(set(counts)) == 1 else counts,
            "ep": eps[0] if len(eps) == 1 else eps, "checked": True,
            "each_expert_has": ["value"] + states, "routers": sum(bool(x.get("router")) for x in layers),
            "whole": all(x.get("ep") is None and x.get("owners") is None for x in layers),  # a DCP's, by shape
            "by_layer": [{"layer": x["layer"], "experts": int(x["experts"]), "ep": x.get("ep")} for x in layers]}


def render(s: dict) -> str:
    """``2 layers x 8 experts, ep 2: every expert once, with value, exp_avg, exp_avg_sq; 2 routers`` (ep ``?``: not
    saved)."""
    experts = "/".join(map(str, s["experts"])) if isinstance(s["experts"], list) else s["experts"]
    ep = "/".join(map(str, s["ep"])) if isinstance(s["ep"], list) else (s["ep"] or "?")
    ep = " (whole [E, ...] tensors: counted by their shape)" if s.get("whole") else f", ep {ep}"
    return (f"{s['layers']} layer{'s' if s['layers'] != 1 else ''} x {experts} experts{ep}: every expert "
            f"once, with {', '.join(s['each_expert_has'])}; {s['routers']} router{'s' if s['routers'] != 1 else ''}")
