"""torchtitan 0.3.0's DeepSeek-V3 (``models/deepseek_v3``) against transformers 5's ``DeepseekV3ForCausalLM``: one
table of names, read both ways, shared by the DCP reader's view of a torchtitan save under the class's names
(:mod:`zckpt.dcp.titan_hf`, ``--hf-config``) and the DeepSpeed AutoEP checkpoint named as torchtitan's model
(:mod:`zckpt.deepspeed.hf_moe`, ``convert --layout torchtitan``); no format package imports another, so it lives
below them.

The table is torchtitan's ``DeepSeekV3StateDictAdapter.from_hf_map`` (its ``to_hf`` copies every tensor as it is:
no permutation, torchtitan's ``ComplexRoPE`` rotates interleaved pairs as the class does with ``rope_interleave``;
its experts' ``w1_EFD`` / ``w3_EFD`` / ``w2_EDF`` [E, ...] are split per expert, which transformers 5 fuses back
into ``gate_up_proj`` (per expert e, gate then up) and ``down_proj``)::

    model.embed_tokens.weight                        tok_embeddings.weight
    model.layers.{i}.self_attn.q_proj.weight         layers.{i}.attention.wq.weight        (q_lora_rank 0)
    ...self_attn.q_a_proj / q_a_layernorm / q_b_proj ...attention.wq_a / q_norm / wq_b     (q_lora_rank > 0)
    ...self_attn.kv_a_proj_with_mqa.weight           ...attention.wkv_a.weight
    ...self_attn.kv_a_layernorm.weight               ...attention.kv_norm.weight
    ...self_attn.kv_b_proj.weight, o_proj.weight     ...attention.wkv_b.weight, wo.weight
    ...mlp.gate_proj / up_proj / down_proj.weight    ...feed_forward.w1 / w3 / w2.weight   (dense layers)
    ...mlp.experts.gate_up_proj                      ...moe.routed_experts.inner_experts.w1_EFD | w3_EFD
    ...mlp.experts.down_proj                         ...moe.routed_experts.inner_experts.w2_EDF
    ...mlp.gate.weight                               ...moe.router.gate.weight
    ...mlp.gate.e_score_correction_bias (a buffer)   ...moe.expert_bias_E (a buffer: load_balance_coeff set)
    ...mlp.shared_experts.gate/up/down_proj.weight   ...moe.shared_experts.w1 / w3 / w2.weight
    ...input_layernorm / post_attention_layernorm    ...attention_norm / ffn_norm .weight
    model.norm.weight, lm_head.weight                norm.weight, lm_head.weight

AutoEP's DeepSeek-V3 layer names the router ``mlp.router.gate.weight`` / ``mlp.router.e_score_correction_bias`` and
keeps the experts stacked as ``mlp.experts.w1`` / ``w2`` / ``w3`` [E, ...] (torchtitan's GroupedExperts as they
are). torchtitan's multi-token-prediction layers (``mtp_layers.*``) have no place in the class (it builds none).
"""

from __future__ import annotations

import re

CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM"}
_EXPERTS = "moe.routed_experts.inner_experts."
# a decoder layer's names, in the class's order (named_parameters, then its buffer): the class's -> torchtitan's
LAYER = (
    ("self_attn.q_proj.weight", "attention.wq.weight"),
    ("self_attn.q_a_proj.weight", "attention.wq_a.weight"),
    ("self_attn.q_a_layernorm.weight", "attention.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attention.wq_b.weight"),
    ("self_attn.kv_a_proj_with_mqa.weight", "attention.wkv_a.weight"),
    ("self_attn.kv_a_layernorm.weight", "attention.kv_norm.weight"),
    ("self_attn.kv_b_proj.weight", "attention.wkv_b.weight"),
    ("self_attn.o_proj.weight", "attention.wo.weight"),
    ("mlp.gate_proj.weight", "feed_forward.w1.weight"),
    ("mlp.up_proj.weight", "feed_forward.w3.weight"),
    ("mlp.down_proj.weight", "feed_forward.w2.weight"),
    ("mlp.experts.gate_up_proj", None),  # w1_EFD | w3_EFD, fused per expert
    ("mlp.experts.down_proj", _EXPERTS + "w2_EDF"),
    ("mlp.gate.weight", "moe.router.gate.weight"),
    ("mlp.shared_experts.gate_proj.weight", "moe.shared_experts.w1.weight"),
    ("mlp.shared_experts.up_proj.weight", "moe.shared_experts.w3.weight"),
    ("mlp.shared_experts.down_proj.weight", "moe.shared_experts.w2.weight"),
    ("input_layernorm.weight", "attention_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate.e_score_correction_bias", "moe.expert_bias_E"),
)
TOP = (("model.embed_tokens.weight", "tok_embeddings.weight"), ("model.norm.weight", "norm.weight"),
       ("lm_head.weight", "lm_head.weight"))
BUFFERS = ("moe.expert_bias_E",)  # torchtitan's buffers (each the class's buffer too)
# the class's _keep_in_fp32_modules_strict (transformers 5.25): held in fp32 when it loads in bf16 / fp16
KEEP_FP32 = ("e_score_correction_bias", "gate.weight")
# AutoEP's names under a DeepSeek-V3 MoE block where they are not the class's
_AUTOEP = {"mlp.gate.weight": "mlp.router.gate.weight",
           "mlp.gate.e_score_correction_bias": "mlp.router.e_score_correction_bias"}
_TO_HF = {titan: hf for hf, titan in LAYER if titan}
_ORDER = [hf for hf, _ in LAYER]


def to_hf(name: str) -> str | None:
    """The class's name of torchtitan's ``name`` (None: none; ``w1_EFD`` / ``w3_EFD`` are fused by the caller)."""
    for hf, titan in TOP:
        if name == titan:
            return hf
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    hf = _TO_HF.get(m.group(2)) if m else None
    return f"model.layers.{m.group(1)}.{hf}" if hf else None


def is_buffer(name: str) -> bool:
    """Whether torchtitan's ``name`` is one of its buffers (saved without optimizer state, not a parameter)."""
    return any(name.endswith("." + b) for b in BUFFERS)


def hf_order(name: str) -> tuple:
    """The position of the class's ``name`` in its ``state_dict()``."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m:
        return (1, int(m.group(1)), _ORDER.index(m.group(2)))
    return ({"model.embed_tokens.weight": 0, "model.norm.weight": 2}.get(name, 3), 0, 0)


def kept_fp32(name: str) -> bool:
    """Whether the class keeps its tensor ``name`` in fp32 at any dtype (as transformers matches the names)."""
    return any(name == p or name.endswith("." + p) for p in KEEP_FP32)


def autoep_table() -> tuple:
    """(pattern of an AutoEP DeepSeek-V3 name, torchtitan's name) pairs, for ``--layout torchtitan``."""
    layer = r"model\.layers\.(\d+)\."
    out = [(re.escape(hf), titan) for hf, titan in TOP]
    for hf, titan in LAYER:
        if titan is not None and not hf.startswith("mlp.experts."):
            out.append((layer + re.escape(_AUTOEP.get(hf, hf)), "layers.{}." + titan))
    out += [(layer + rf"mlp\.experts\.{w}", "layers.{}." + _EXPERTS + t)
            for w, t in (("w1", "w1_EFD"), ("w2", "w2_EDF"), ("w3", "w3_EFD"))]
    return tuple(out)


def check_shapes(cfg: dict, by: dict, layers: list[int]) -> str:
    """Why the class ``cfg`` builds would not hold torchtitan's tensors ``by`` (name -> record with ``shape``), or
    '': the attention's low-rank sizes and heads, which layers are MoE (from ``first_k_dense_replace`` on), the
    experts, the shared experts, the router's bias (``expert_bias_E``: the class's ``e_score_correction_bias`` is a
    buffer of every MoE layer), the dense layers' size, no multi-token-prediction layer."""
    emb = by.get("tok_embeddings.weight")
    if emb is None or [int(d) for d in emb.shape] != [cfg.get("vocab_size"), cfg.get("hidden_size")]:
        return (f"vocab_size x hidden_size {[cfg.get('vocab_size'), cfg.get('hidden_size')]}, the checkpoint's "
                f"tok_embeddings {list(emb.shape) if emb is not None else '(none)'}")
    if cfg.get("num_hidden_layers") != len(layers):
        return f"num_hidden_layers {cfg.get('num_hidden_layers')}, the checkpoint has {len(layers)}"
    mtp = sorted(n for n in by if n.startswith("mtp_layers."))
    if mtp:
        return (f"'{mtp[0]}' is torchtitan's multi-token-prediction layer, which {CLASSES['deepseek_v3']} has no "
                "place for")
    heads, nope, rope, v = (cfg.get(k) for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                                  "v_head_dim"))
    q_lora, kv_lora, hidden = cfg.get("q_lora_rank") or 0, cfg.get("kv_lora_rank"), cfg.get("hidden_size")
    if not all(isinstance(x, int) and x > 0 for x in (heads, nope, rope, v, kv_lora, hidden)):
        return "it does not say the heads, qk_nope/qk_rope/v head sizes, kv_lora_rank and hidden_size of an MLA"
    first = cfg.get("first_k_dense_replace") or 0
    n, inter = cfg.get("n_routed_experts"), cfg.get("moe_intermediate_size")
    shared = (cfg.get("n_shared_experts") or 0) * (inter or 0)

    def shape(name):
        r = by.get(name)
        return None if r is None else [int(d) for d in r.shape]
    for i in layers:
        a, e = f"layers.{i}.attention.", f"layers.{i}.{_EXPERTS}"
        want = {"wkv_a.weight": [kv_lora + rope, hidden], "kv_norm.weight": [kv_lora],
                "wkv_b.weight": [heads * (nope + v), kv_lora], "wo.weight": [hidden, heads * v]}
        want.update({"wq_a.weight": [q_lora, hidden], "q_norm.weight": [q_lora],
                     "wq_b.weight": [heads * (nope + rope), q_lora]} if q_lora else
                    {"wq.weight": [heads * (nope + rope), hidden]})
        if i >= first:
            want = {**{a + k: s for k, s in want.items()}, e + "w1_EFD": [n, inter, hidden],
                    e + "w3_EFD": [n, inter, hidden], e + "w2_EDF": [n, hidden, inter],
                    f"layers.{i}.moe.router.gate.weight": [n, hidden]}
            if shared:
                want[f"layers.{i}.moe.shared_experts.w1.weight"] = [shared, hidden]
        else:
            want = {**{a + k: s for k, s in want.items()},
                    f"layers.{i}.feed_forward.w1.weight": [cfg.get("intermediate_size"), hidden]}
        for name, s in want.items():
            if shape(name) != s:
                return f"layer {i} holds {name} {shape(name) or '(none)'}, the config makes it {s}"
        if i >= first and shape(f"layers.{i}.moe.expert_bias_E") != [n]:
            return (f"layer {i} holds no moe.expert_bias_E [{n}] (torchtitan's load_balance_coeff None), and the "
                    "class's router adds its e_score_correction_bias buffer, which zckpt does not make up")
        known = set(want) | {f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"}
        known |= {f"layers.{i}.moe.shared_experts.{w}.weight" for w in ("w2", "w3") if shared} | \
            {f"layers.{i}.moe.expert_bias_E"} if i >= first else \
            {f"layers.{i}.feed_forward.{w}.weight" for w in ("w2", "w3")}
        extra = sorted(k for k in by if k.startswith(f"layers.{i}.") and k not in known)
        if extra:
            return f"layer {i} holds {extra[0]}, which the config's layer has no counterpart of"
    return ""
