"""The transformers 5 MoE classes whose AutoEP checkpoints ``merge`` and ``convert --to dcp`` write under the class's
own names (:mod:`zckpt.deepspeed.hf_moe`): what each MoE block holds beside its fused experts, and which of the
class's layers are MoE blocks, read from transformers 5.25's modeling code.

Every family's experts are AutoEP's ``experts.w1`` / ``w3`` (gate, up) fused into ``experts.gate_up_proj`` and
``experts.w2`` as ``experts.down_proj``. Beside them, each block holds exactly the names of its family's
``block`` table, every one of them, under AutoEP's name (left) and written under the class's (right)::

    mixtral, qwen3_moe     router.gate.weight                  gate.weight
    deepseek_v2            router.gate.weight                  gate.weight
                           shared_experts.{gate,up,down}_proj.weight (as they are: AutoEP keeps the module)
    deepseek_v3            the same, and
                           router.e_score_correction_bias      gate.e_score_correction_bias
    qwen3_5_moe_text       router.gate.weight                  gate.weight
                           shared_experts.{gate,up,down}_proj.weight   shared_expert.{gate,up,down}_proj.weight
                           shared_experts_gate.weight          shared_expert_gate.weight

(AutoEP's layer keeps the block's shared expert as its own ``shared_experts`` / ``shared_experts_gate``, whatever
the class calls them: Qwen3.5's ``shared_expert`` is renamed back, DeepSeek's ``shared_experts`` is the same name.)
Qwen3.5-MoE is its text backbone, ``Qwen3_5MoeForCausalLM`` (``model_type`` ``qwen3_5_moe_text``, the only one
DeepSpeed's ``qwen3_5_moe`` preset takes).

DeepSeek-V3's ``e_score_correction_bias`` is a persistent buffer of ``DeepseekV3TopkRouter`` (zeros at init, set by
a pretrained checkpoint); AutoEP copies it onto its router (``auto_ep_layer._copy_e_score_correction_bias``), so
the save holds it among the module's buffers, as stored (fp32). A block holding anything else (a router bias,
AutoEP's ``expert_bias``), or missing a name of its table, is not mapped: AutoEP's names are kept with a note.

The checkpoint's MoE layers must be the class's, and their experts its config's: the layers the class builds an MoE
block for (Mixtral: every layer; Qwen3-MoE: those not in ``mlp_only_layers`` whose ``(i + 1) %
decoder_sparse_step == 0``; DeepSeek: from ``first_k_dense_replace`` on), the number of routed experts and each
expert's intermediate size; else the class would not load the output and AutoEP's names are kept with a note.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_ROUTER = {"router.gate.weight": "gate.weight"}
_SHARED = {f"shared_experts.{w}_proj.weight": f"shared_experts.{w}_proj.weight" for w in ("gate", "up", "down")}
_SHARED35 = {**{f"shared_experts.{w}_proj.weight": f"shared_expert.{w}_proj.weight" for w in ("gate", "up", "down")},
             "shared_experts_gate.weight": "shared_expert_gate.weight"}


@dataclass(frozen=True)
class Family:
    cls: str  # the ForCausalLM class
    experts: tuple  # config.json's keys of the number of routed experts (transformers writes one of them)
    inter: str  # ... of each expert's intermediate size
    block: dict = field(default_factory=dict)  # AutoEP's name under the MoE block -> the class's
    # the class's _keep_in_fp32_modules_strict (transformers 5.25): held in fp32 when the model loads in bf16 / fp16
    keep_fp32: tuple = ()

    def kept_fp32(self, name: str) -> bool:
        """Whether the class keeps tensor ``name`` in fp32 at any dtype (as transformers matches the names)."""
        return any(name == p or name.endswith("." + p) for p in self.keep_fp32)

    def moe_layers(self, cfg: dict) -> list[int] | None:
        """The decoder layers the class builds an MoE block for, from ``cfg`` (None: it does not say)."""
        n = cfg.get("num_hidden_layers")
        if not isinstance(n, int):
            return None
        if self.cls.startswith("Deepseek"):
            first = cfg.get("first_k_dense_replace") or 0
            return list(range(first, n)) if isinstance(first, int) else None
        if self.cls.startswith("Qwen3Moe"):
            only, step = cfg.get("mlp_only_layers") or [], cfg.get("decoder_sparse_step") or 1
            return [i for i in range(n) if i not in only and (i + 1) % step == 0] if isinstance(step, int) else None
        return list(range(n))


FAMILIES = {
    "mixtral": Family("MixtralForCausalLM", ("num_local_experts",), "intermediate_size", dict(_ROUTER)),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", ("num_local_experts", "num_experts"), "moe_intermediate_size",
                        dict(_ROUTER)),
    "deepseek_v2": Family("DeepseekV2ForCausalLM", ("n_routed_experts", "num_local_experts"), "moe_intermediate_size",
                          {**_ROUTER, **_SHARED}, keep_fp32=("gate.weight",)),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", ("n_routed_experts", "num_local_experts"), "moe_intermediate_size",
                          {**_ROUTER, "router.e_score_correction_bias": "gate.e_score_correction_bias", **_SHARED},
                          keep_fp32=("e_score_correction_bias", "gate.weight")),
    "qwen3_5_moe_text": Family("Qwen3_5MoeForCausalLM", ("num_experts", "num_local_experts"), "moe_intermediate_size",
                               {**_ROUTER, **_SHARED35}),
}
CLASSES = {k: f.cls for k, f in FAMILIES.items()}


def config_mismatch(cfg: dict, path: str, layers: list[dict], shapes: dict[str, tuple]) -> str:
    """Why the class ``cfg`` names would not take these AutoEP layers (``shapes``: each layer's ``experts.w1``
    shape), or ''."""
    fam = FAMILIES[cfg["model_type"]]
    want = fam.moe_layers(cfg)
    got = []
    for x in layers:
        head, _, tail = x["layer"].rpartition(".")
        idx = head.rpartition(".")[2]
        if tail != "mlp" or not head.startswith("model.layers.") or not idx.isdigit():
            return f"AutoEP layer {x['layer']} is not a decoder layer's mlp of {fam.cls}"
        got.append(int(idx))
    if want is None or sorted(got) != want:
        return (f"the checkpoint's MoE layers are {sorted(got)}, {path} makes {fam.cls}'s "
                f"{want if want is not None else '(not said)'}")
    key = next((k for k in fam.experts if k in cfg), fam.experts[0])
    for x in layers:
        n, inter, _ = shapes[x["layer"]]
        if (cfg.get(key), cfg.get(fam.inter)) != (n, inter):
            return (f"layer {x['layer']} holds {n} experts of intermediate size {inter}, {path} says "
                    f"{key} {cfg.get(key)}, {fam.inter} {cfg.get(fam.inter)}")
    return ""
