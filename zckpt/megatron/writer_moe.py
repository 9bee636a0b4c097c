"""A Megatron-Core mixture-of-experts checkpoint (the local spec's ``SequentialMLP``, :mod:`zckpt.megatron.moe`)
written back as a ``fully_reshardable`` save folder for another expert-parallel size (``convert --to megatron
--ep N``).

What depends on the expert-parallel size, read from megatron-core 0.16.1 (``optimizer/__init__.py``
``get_megatron_optimizer``, ``optimizer.py`` ``ChainedOptimizer``, ``distrib_optimizer.py`` ``load_state_dict``):

- the tensors do not: ``fully_reshardable`` keeps every expert in model space under its global key
  (``decoder.layers.mlp.experts.experts.linear_fc1.weight`` [L, E, ...] and its ``optimizer.state.{param,exp_avg,
  exp_avg_sq}.`` twins, no ``chained_N.`` prefix: ``chained_optim_avoid_prefix``), whatever ranks wrote them;
- the optimizer's common state does. At ep > 1 the experts' weights are ``allreduce=False`` and get their own
  distributed optimizer over the expert data-parallel group: ``ChainedOptimizer([dense, experts])``, whose state in
  ``common.pt`` is ``{0: {optimizer: {param_groups: dense groups}}, 1: {... expert groups (is_expert_parallel)}}``.
  At ep 1 the experts are ordinary parameters of the one optimizer (``ChainedOptimizer`` of one: a plain
  ``{optimizer: {param_groups}}``), in the groups of their multipliers. ``ChainedOptimizer.load_state_dict`` refuses
  another count of entries, so a save made at ep 2 does not load at ep 1 in Megatron itself, nor the reverse.
- ``DistributedOptimizer.load_state_dict`` takes each of its own groups' settings and step from the saved group of
  the same (``wd_mult``, ``lr_mult``, ``is_expert_parallel``, ``is_decoupled_lr``): so the groups written for the
  target are the source's, moved between the two optimizers with ``is_expert_parallel`` set as the target has it;
  a group that would be merged into one of other settings is refused (Megatron could not hold both).

Refused in one line: an expert count ``--ep`` does not divide (``moe_layer.py``: ``num_moe_experts % ep_size``),
``dp_reshardable`` output (the experts' own buckets are not written), a source whose param groups do not say which
are the experts' at ep > 1.
"""

from __future__ import annotations

from zckpt.errors import OptionError, UnsupportedLayout
from zckpt.megatron import moe

_KEY = ("wd_mult", "lr_mult", "is_decoupled_lr")  # with is_expert_parallel: megatron-core's group identity


def is_moe(ckpt) -> bool:
    """The checkpoint holds SequentialMLP experts (or its args name experts)."""
    args = ckpt.extra.get("args") or {}
    return bool(args.get("num_experts")) or any(moe.is_expert_key(k) for k in ckpt.extra["metadata"].tensors)


def moe_layers(freq, num_layers: int) -> list[int] | None:
    """The MoE layers ``--moe-layer-freq`` names (an int k: every k-th from 0; a list: 1 per MoE layer), None when
    the args do not say it in either form."""
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return [i for i in range(num_layers) if i % freq == 0]
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and all(v in (0, 1) for v in freq):
        return [i for i, v in enumerate(freq) if v == 1]
    return None


def target_ep(ckpt, ep, layout: str, path: str, pp: int = 1) -> int | None:
    """The expert-parallel size to write for (None: a dense model), checked as megatron-core checks it."""
    if not is_moe(ckpt):
        if ep is not None:
            raise OptionError("--ep sets a mixture-of-experts model's expert-parallel size; this model has no "
                              "experts", path=path, hint="drop --ep")
        return None
    if layout != "fully_reshardable":
        raise UnsupportedLayout("a mixture-of-experts model's dp_reshardable buckets (the experts' own, chained_1) "
                                "are not written", path=path,
                                hint="write --layout fully_reshardable (it loads at any TP/PP/DP/EP)")
    f = moe.facts(ckpt.extra.get("args") or {})
    n = f.get("num_experts")
    source = f.get("ep") or 1
    ep = source if ep is None else ep
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise OptionError(f"--ep must be a positive integer, got {ep!r}")
    if not n:
        raise UnsupportedLayout("the args do not say num_experts, which megatron-core divides by the "
                                "expert-parallel size", path=path)
    if not any(moe.is_expert_key(k) for k in ckpt.extra["metadata"].tensors):
        raise UnsupportedLayout(f"the args name {n} experts (--num-experts) but .metadata holds no SequentialMLP "
                                "expert tensor (mlp.experts.experts.*)", path=path)
    if n % ep:
        raise UnsupportedLayout(f"{n} experts do not divide into --ep {ep} (megatron-core asserts num_moe_experts "
                                "% expert_model_parallel_size == 0)", path=path,
                                hint=f"choose an --ep that divides {n}")
    num_layers = (ckpt.extra.get("megatron") or {}).get("num_layers")
    if ep > 1 and pp > 1 and num_layers:
        layers = moe_layers(f.get("layer_freq"), num_layers)
        per = num_layers // pp
        if layers is None:
            raise UnsupportedLayout(f"the args' moe_layer_freq ({f.get('layer_freq')!r}) does not say which layers "
                                    f"are MoE, which --pp {pp} at --ep {ep} depends on", path=path)
        empty = [s for s in range(pp) if not any(s * per <= i < (s + 1) * per for i in layers)]
        if empty:  # one optimizer there, two elsewhere: common.pt holds one structure for every rank
            raise UnsupportedLayout(f"at --pp {pp} pipeline stage {empty[0]} holds no MoE layer: megatron-core builds "
                                    f"one optimizer there and two (dense, experts) on the other stages at --ep {ep}, "
                                    "and a save's common state has one of the two forms", path=path,
                                    hint="choose a --pp whose every stage holds an MoE layer, or --ep 1")
    return ep


def records_by_key(key: str, shape: tuple, by_name: dict, path: str) -> list:
    """The records of an expert key in the key's own element order (layer-major, then the global expert)."""
    names = [e[0] for e in moe.entries(key, tuple(shape), None, None, path)]
    return [by_name.get(n) for n in names]


def _same(a: dict, b: dict) -> bool:
    skip = ("is_expert_parallel", "params")
    return {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}


def optimizer_state(groups: list[dict], source_ep: int, ep: int, layout: str, path: str) -> dict:
    """``common.pt``'s ``optimizer`` for the target's expert-parallel size: one optimizer's state at ep 1, the
    chain's ``{0: dense, 1: experts}`` at ep > 1 (``groups``: the source's, step set)."""
    dense = [g for g in groups if not g.get("is_expert_parallel")]
    expert = [g for g in groups if g.get("is_expert_parallel")]
    if source_ep > 1 and not expert:
        raise UnsupportedLayout(f"the source's expert-parallel size is {source_ep} but its param groups hold no "
                                "expert group (is_expert_parallel)", path=path)
    if ep > 1:
        # at ep 1 the experts were in the dense groups of their multipliers: each one's settings, as an expert group
        expert = expert or [{**g, "is_expert_parallel": True} for g in dense]
        return {i: {"optimizer": {"param_groups": gs}, "param_state_sharding_type": layout}
                for i, gs in enumerate((dense, expert))}
    merged = list(dense)
    for g in expert:
        twin = next((d for d in merged if all(d.get(k) == g.get(k) for k in _KEY)), None)
        if twin is None:
            merged.append({**g, "is_expert_parallel": False})
        elif not _same(twin, g):
            diff = sorted(k for k in set(twin) | set(g) if k not in ("is_expert_parallel", "params")
                          and twin.get(k) != g.get(k))
            raise UnsupportedLayout(f"at --ep 1 the experts join the dense param group of the same multipliers, "
                                    f"whose {', '.join(diff)} differ from the expert group's", path=path,
                                    hint="write for an --ep above 1")
    return {"optimizer": {"param_groups": merged}, "param_state_sharding_type": layout}


def args_update(ckpt, ep: int) -> dict:
    """What the output's args state of the experts' parallel sizes."""
    return {"expert_model_parallel_size": ep}


def notes(ckpt, ep: int) -> list[str]:
    f = moe.facts(ckpt.extra.get("args") or {})
    source = f.get("ep") or 1
    chain = "two optimizers (dense, experts)" if ep > 1 else "one optimizer (the experts in the dense groups)"
    more = [f"the experts' param groups: an expert copy of each of the {len(ckpt.extra.get('param_groups') or [])} "
            "dense groups (an ep 1 checkpoint does not say which held experts; megatron-core takes those of its "
            "experts' multipliers)"] if source == 1 and ep > 1 else []
    return more + [
        f"MoE: {f.get('num_experts')} experts per layer in model space (every expert under its global index: loads "
        f"at any expert-parallel size); common.pt's optimizer written for --ep {ep} (source {source}): {chain}, as "
        "megatron-core's ChainedOptimizer loads it",
        f"args state expert_model_parallel_size {ep}; expert_tensor_parallel_size as the source's ({f.get('etp')}; "
        "fully_reshardable loads at any, the run's flag decides)"]
