"""MoE layers found by name in a state dict that names its modules as the model class does (a DCP saved by FSDP2
of a transformers or torchtitan model), described for the coverage check (:mod:`zckpt.state.experts`).

The experts' layouts recognised, each with the router beside it (names after the MoE block's path ``{mp}``)::

    transformers 5 (Mixtral, Qwen3-MoE...)   {mp}.experts.gate_up_proj [E, 2I, H], {mp}.experts.down_proj [E, H, I]
                                             router {mp}.gate.weight [E, H] ({mp}.router.weight: gpt-oss, Llama 4)
    torchtitan 0.3.0 (GroupedExperts)        {mp}.routed_experts.inner_experts.w1_EFD / w2_EDF / w3_EFD [E, ...]
                                             router {mp}.router.gate.weight [E, H]
    AutoEP / torchtitan before 0.3           {mp}.experts.w1 / w2 / w3 [E, ...], router {mp}.router.gate.weight
    one module per expert (transformers 4)   {mp}.experts.{e}.<param>, router {mp}.gate.weight [E, H]

For fused experts the number of experts is the tensors' first dimension, checked against the router's rows; for
one module per expert it is the router's rows, and every index 0..E-1 must be there exactly once with the same
parameters. The layer's ``ep`` is None: a DCP holds every expert whole, whatever expert-parallel size saved it.
"""

from __future__ import annotations

import re

# (the experts' module under {mp}, its fused parameter names, the router's possible prefixes under {mp})
FUSED = (
    ("experts", ("gate_up_proj", "down_proj"), ("gate.", "router.")),
    ("routed_experts.inner_experts", ("w1_EFD", "w2_EDF", "w3_EFD"), ("router.gate.",)),
    ("experts", ("w1", "w2", "w3"), ("router.gate.",)),
)
_PER_EXPERT = re.compile(r"(.+)\.experts\.(\d+)\.")


def _rows(rec) -> int | None:
    return int(rec.shape[0]) if rec is not None and len(rec.shape) == 2 else None


def _router(by: dict, mp: str, prefixes) -> str | None:
    return next((p for p in prefixes if _rows(by.get(f"{mp}.{p}weight")) is not None), None)


def layers(records) -> list[dict]:
    """The MoE layers of ``records`` (model order), as :mod:`zckpt.state.experts` describes them. A layer whose
    router is not found by name is checked for one only where the checkpoint's other layers have theirs (a model
    family naming it otherwise, as gpt-oss's ``mlp.router``, is not refused for it)."""
    by = {r.name: r for r in records}
    found: dict[str, dict] = {}
    for r in records:
        for module, params, routers in FUSED:
            suffix = f".{module}.{params[0]}"
            if not r.name.endswith(suffix) or len(r.shape) != 3:
                continue
            mp = r.name[:-len(suffix)]
            router = _router(by, mp, routers)
            rows = _rows(by.get(f"{mp}.{router}weight")) if router else None
            found.setdefault(mp, {"layer": mp, "experts": rows if rows is not None else int(r.shape[0]), "ep": None,
                                  "router": f"{mp}.{router}" if router else None, "routers": routers,
                                  "fused": [f"{mp}.{module}.{p}" for p in params]})
            break
        m = _PER_EXPERT.match(r.name)
        if m and m.group(1) not in found:
            mp = m.group(1)
            router = _router(by, mp, ("gate.", "router."))
            if router is not None:  # the router says how many experts there are; without one nothing is claimed
                found[mp] = {"layer": mp, "experts": _rows(by[f"{mp}.{router}weight"]), "ep": None,
                             "router": f"{mp}.{router}", "prefix": f"{mp}.experts."}
    out = list(found.values())
    named = [x["router"][len(x["layer"]) + 1:] for x in out if x.get("router")]
    for i, x in enumerate(out):
        routers = x.pop("routers", ())
        if x.get("router") is None and named:  # the others have theirs: this one is checked for it (and refused)
            x["router"] = f"{x['layer']}.{named[0] if named[0] in routers else routers[0]}"
        x["index"] = i
    return out
