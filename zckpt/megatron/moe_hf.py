"""A Megatron-Core mixture-of-experts GPT under transformers' Mixtral names (``MixtralForCausalLM``, transformers
5: experts fused per layer), for ``merge`` and for the optimizer state ``convert`` carries.

transformers 5's ``MixtralSparseMoeBlock`` holds ``gate`` (``MixtralTopKRouter``: ``weight`` [E, H]) and
``experts`` (``MixtralExperts``: ``gate_up_proj`` [E, 2F, H], whose rows are ``[gate; up]`` as ``chunk(2)`` splits
them, and ``down_proj`` [E, H, F]). Megatron saves each expert's ``linear_fc1`` as ``[gate; up]`` rows ([2F, H],
its SwiGLU halves, independent of tensor parallelism) and ``linear_fc2`` [H, F], so::

    decoder.layers.<i>.mlp.router.weight                        model.layers.<i>.mlp.gate.weight
    decoder.layers.<i>.mlp.experts.experts.<e>.linear_fc1.weight  model.layers.<i>.mlp.experts.gate_up_proj[e]
    decoder.layers.<i>.mlp.experts.experts.<e>.linear_fc2.weight  model.layers.<i>.mlp.experts.down_proj[e]
    decoder.layers.<i>.mlp.linear_fc1.layer_norm_weight          model.layers.<i>.post_attention_layernorm.weight

each fused tensor being the experts' pieces one after another (no byte moves; masters and both moments the
same). The rest is Llama's map (:mod:`zckpt.megatron.hf_names`). Only when the files say so: every layer an MoE
layer of SwiGLU experts without biases or shared experts. ``config.json`` (``MixtralConfig``) is written only
when the router computes what Mixtral's does: softmax scores, top-k, renormalised over the k (Megatron's default:
``moe_router_score_function`` softmax, ``moe_router_pre_softmax`` false, no top-k scaling factor, no expert
bias, no group-limited routing, no input jitter).
"""

from __future__ import annotations

import re

from zckpt.megatron import moe
from zckpt.state.model import TensorRecord

_ROUTER = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.router\.weight$")
_FUSED = {"linear_fc1.weight": "gate_up_proj", "linear_fc2.weight": "down_proj"}
# Megatron-LM args -> the value under which its router is Mixtral's (None: unset / default)
_ROUTER_AS_MIXTRAL = {"moe_router_score_function": ("softmax", None), "moe_router_pre_softmax": (False, None),
                      "moe_router_topk_scaling_factor": (None,), "moe_router_enable_expert_bias": (False, None),
                      "moe_router_num_groups": (None,), "moe_router_group_topk": (None,),
                      "moe_input_jitter_eps": (None,), "moe_shared_expert_intermediate_size": (None,)}


def why_not(records, f: dict) -> str | None:
    """Why the records are not a Mixtral's (None: they are)."""
    m = f.get("moe") or {}
    if not m.get("num_experts"):
        return "the args do not say the number of experts"
    if f.get("swiglu") is not True:
        return "the experts are not SwiGLU"
    routers = {int(x.group(1)) for r in records if (x := _ROUTER.match(r.name))}
    if f.get("num_layers") is None or routers != set(range(f["num_layers"])):
        return (f"layers {sorted(set(range(f.get('num_layers') or 0)) - routers)} are dense (--moe-layer-freq): "
                "Mixtral has an MoE block in every layer")
    for r in records:
        x = moe.expert_of(r.name)
        if x and x[2] not in _FUSED:
            return f"'{r.name}' is not an expert parameter Mixtral has"
        if r.name.endswith(".bias") or "shared_experts." in r.name:
            return f"'{r.name}' has no Mixtral name"
    return None


def router_differs(args: dict) -> list[str]:
    """The router args under which Megatron's routing is not Mixtral's."""
    return [f"{k}={args[k]!r}" for k, ok in _ROUTER_AS_MIXTRAL.items() if k in args and args[k] not in ok] + \
        [f"{k} (not saved)" for k in ("moe_router_score_function", "moe_router_pre_softmax") if k not in args]


def fuse(records, f: dict, state: bool) -> tuple[list[TensorRecord], dict[str, list[str]]]:
    """The expert and router records under Mixtral's names (experts fused per layer), the other records as they
    are, and {Megatron name: its Mixtral name}."""
    n = f["moe"]["num_experts"]
    experts: dict[tuple[int, str], dict[int, TensorRecord]] = {}
    out, names = [], {}
    for r in records:
        x = moe.expert_of(r.name)
        if x:
            experts.setdefault((x[0], x[2]), {})[x[1]] = r
            continue
        m = _ROUTER.match(r.name)
        if m:
            name = f"model.layers.{m.group(1)}.mlp.gate.weight"
            out.append(_copy(r, name, r.shape, r.value, r.exp_avg, r.exp_avg_sq, state))
            names[r.name] = [name]
            continue
        out.append(r)
    for (i, param), by_e in sorted(experts.items()):
        parts = [by_e[e] for e in range(n)]  # coverage is checked at read: every expert once
        name = f"model.layers.{i}.mlp.experts.{_FUSED[param]}"
        first = parts[0]
        out.append(_copy(first, name, (n, *first.shape), [p for r in parts for p in r.value],
                         [p for r in parts for p in r.exp_avg], [p for r in parts for p in r.exp_avg_sq], state))
        names.update({r.name: [name] for r in parts})
    return out, names


def _copy(r: TensorRecord, name: str, shape, value, avg, avg_sq, state: bool) -> TensorRecord:
    out = TensorRecord(name, tuple(shape), r.kind, r.dtype, list(value), group=r.group, lp_dtype=r.lp_dtype)
    if state and r.exp_avg:
        out.exp_avg, out.exp_avg_sq = list(avg), list(avg_sq)
    return out


def config(f: dict, args: dict) -> dict:
    """``MixtralConfig`` fields beyond Llama's (:func:`zckpt.megatron.hf_names.config` gives the shared ones)."""
    m = f["moe"]
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": m.get("ffn_hidden_size") or f["ffn_hidden_size"],
            "num_local_experts": m["num_experts"], "num_experts_per_tok": m["topk"], "router_jitter_noise": 0.0,
            "output_router_logits": False, "sliding_window": None}


# MixtralForCausalLM's parameter order within a decoder layer (self_attn q, k, v, o; mlp gate, experts gate_up,
# down; the two norms): the order a DeepSpeed engine built from the model lays its flat groups out in
LAYER_ORDER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj",
               "input_layernorm.weight", "post_attention_layernorm.weight")
