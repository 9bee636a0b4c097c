"""Megatron-Core GPT weights under Hugging Face Llama's names, for ``merge`` (the reader keeps Megatron's own).

Used only when the files say the model is Llama-shaped: SwiGLU, RMSNorm, RoPE, no linear biases, and the head
counts known (``common.pt``'s args). Each mapped tensor is a slice of the record's pieces (row blocks of a
row-major weight are contiguous bytes), nothing is copied or reordered in memory::

    embedding.word_embeddings.weight                        model.embed_tokens.weight
    decoder.layers.<i>.self_attention.linear_qkv.weight     model.layers.<i>.self_attn.{q,k,v}_proj.weight
        rows per query group g: [heads_per_group * kv_channels q rows, kv_channels k rows, kv_channels v rows]
    decoder.layers.<i>.self_attention.linear_proj.weight    model.layers.<i>.self_attn.o_proj.weight
    decoder.layers.<i>.self_attention.linear_qkv.layer_norm_weight   model.layers.<i>.input_layernorm.weight
    decoder.layers.<i>.mlp.linear_fc1.weight                model.layers.<i>.mlp.{gate,up}_proj.weight (halves)
    decoder.layers.<i>.mlp.linear_fc1.layer_norm_weight     model.layers.<i>.post_attention_layernorm.weight
    decoder.layers.<i>.mlp.linear_fc2.weight                model.layers.<i>.mlp.down_proj.weight
    decoder.final_layernorm.weight                          model.norm.weight
    output_layer.weight                                     lm_head.weight (tied: not written, as save_pretrained)

``config.json`` is a ``LlamaConfig`` of what the files hold, written only when they hold all of it: the RMSNorm
epsilon and the RoPE base change the model's outputs, and LlamaConfig's defaults (1e-6, 10000) are not Megatron's
(``--norm-epsilon`` 1e-5): without ``norm_epsilon`` and ``rotary_base`` (and ``rotary_percent`` 1.0) in the args,
the weights are written under Llama's names and no ``config.json`` (a note names what is missing).
"""

from __future__ import annotations

import dataclasses
import json
import re

from zckpt.engine.segments import slice_pieces
from zckpt.megatron import moe_hf
from zckpt.state.model import Checkpoint, TensorRecord

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SIMPLE = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_LAYER_SIMPLE = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32",
          "bf16": "bfloat16", "fp16": "float16"}
CONFIG_FACTS = {"norm_epsilon": "rms_norm_eps", "rotary_base": "rope_theta"}  # the args' name -> LlamaConfig's


def why_not(f: dict) -> str | None:
    """Why the files do not say the model is Llama-shaped (None: they do)."""
    checks = [("swiglu", f.get("swiglu") is True), ("RMSNorm", f.get("normalization") == "RMSNorm"),
              ("RoPE", f.get("position_embedding_type") == "rope"), ("no linear biases", f.get("add_bias_linear") is False)]
    checks += [(k, isinstance(f.get(k), int)) for k in ("num_attention_heads", "num_query_groups", "kv_channels",
                                                         "hidden_size", "ffn_hidden_size", "num_layers")]
    missing = [what for what, ok in checks if not ok]
    return f"the files do not say {', '.join(missing)}" if missing else None




def _rows(rec: TensorRecord, name: str, blocks: list[tuple[int, int]], state: bool = False) -> TensorRecord:
    """A record of the rows ``blocks`` [(first row, rows)] of ``rec`` (a 2-D weight), concatenated; ``state``:
    the master's rows with the same rows of both Adam moments (the optimizer state split as the weight is)."""
    width = rec.shape[1]

    def rows(pieces):
        return [p for first, n in blocks for p in slice_pieces(pieces, first * width, n * width)]
    out = TensorRecord(name, (sum(n for _, n in blocks), width), rec.kind, rec.dtype, rows(rec.value),
                       group=rec.group, lp_dtype=rec.lp_dtype)
    if state and rec.exp_avg:
        out.exp_avg, out.exp_avg_sq = rows(rec.exp_avg), rows(rec.exp_avg_sq)
    return out


def _mapped(rec: TensorRecord, f: dict, state: bool = False) -> list[TensorRecord] | None:
    if rec.name in _SIMPLE:
        return [_renamed(rec, _SIMPLE[rec.name], state)]
    m = _LAYER.match(rec.name)
    if not m:
        return None
    i, rest = m.groups()
    pre = f"model.layers.{i}."
    if rest in _LAYER_SIMPLE:
        return [_renamed(rec, pre + _LAYER_SIMPLE[rest], state)]
    if rest == "mlp.linear_fc1.weight":
        half = rec.shape[0] // 2
        return [_rows(rec, pre + "mlp.gate_proj.weight", [(0, half)], state),
                _rows(rec, pre + "mlp.up_proj.weight", [(half, half)], state)]
    if rest == "self_attention.linear_qkv.weight":
        groups, kv = f["num_query_groups"], f["kv_channels"]
        per = f["num_attention_heads"] // groups
        stride = (per + 2) * kv
        if rec.shape[0] != groups * stride:
            return None
        return [_rows(rec, pre + "self_attn.q_proj.weight", [(g * stride, per * kv) for g in range(groups)], state),
                _rows(rec, pre + "self_attn.k_proj.weight", [(g * stride + per * kv, kv) for g in range(groups)],
                      state),
                _rows(rec, pre + "self_attn.v_proj.weight", [(g * stride + (per + 1) * kv, kv)
                                                             for g in range(groups)], state)]
    return None


def _renamed(rec: TensorRecord, name: str, state: bool = False) -> TensorRecord:
    tied_to = _SIMPLE.get(rec.tied_to, rec.tied_to) if rec.tied_to else None
    if state:
        return dataclasses.replace(rec, name=name, tied_to=tied_to)
    return dataclasses.replace(rec, name=name, tied_to=tied_to, exp_avg=[], exp_avg_sq=[], other_state={})


def config(f: dict, dtype: str) -> dict:
    """The LlamaConfig of what the files say (nothing guessed: :func:`config_missing` must be empty)."""
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": f["hidden_size"], "intermediate_size": f["ffn_hidden_size"],
        "num_hidden_layers": f["num_layers"], "num_attention_heads": f["num_attention_heads"],
        "num_key_value_heads": f["num_query_groups"], "head_dim": f["kv_channels"], "vocab_size": f["vocab_size"],
        "tie_word_embeddings": bool(f["tied"]), "attention_bias": False, "mlp_bias": False,
        "torch_dtype": _DTYPE.get(dtype, dtype),
    }
    if isinstance(f.get("max_position_embeddings"), int):
        cfg["max_position_embeddings"] = f["max_position_embeddings"]
    cfg.update({hf: f[arg] for arg, hf in CONFIG_FACTS.items()})
    return cfg


def config_missing(f: dict) -> list[str]:
    """What the args lack for a ``config.json`` that computes what the Megatron model computed."""
    missing = [arg for arg in CONFIG_FACTS if f.get(arg) is None]
    if f.get("rotary_percent") != 1.0:
        missing.append("rotary_percent (1.0)" if f.get("rotary_percent") is None else
                       f"rotary_percent 1.0 (it is {f['rotary_percent']}: partial RoPE is not Llama's)")
    return missing


def merge_view(ckpt: Checkpoint, dtype: str) -> tuple[Checkpoint, dict[str, bytes], list[str]]:
    """``ckpt`` with its records under Llama's names, the ``config.json`` to write beside them and the notes; when
    the files do not say the model is Llama-shaped, or a tensor has no Llama name, ``ckpt`` as it is (Megatron's
    names), no files, and a note saying why."""
    f = ckpt.extra["megatron"]
    why = why_not(f) or ("the files do not say whether the output layer is tied" if f.get("tied") is None else None)
    records, source = [], ckpt.records
    is_moe = bool(ckpt.extra.get("moe_coverage"))
    if is_moe and not why:  # transformers' Mixtral: experts fused per layer, the router as mlp.gate
        why = moe_hf.why_not(ckpt.records, f)
        source = source if why else moe_hf.fuse(source, f, state=False)[0]
    for rec in [] if why else source:
        if rec.name.startswith("model.layers."):  # named by moe_hf already
            records.append(rec)
            continue
        mapped = _mapped(rec, f)
        if mapped is None:
            why = f"'{rec.name}' has no {'Mixtral' if is_moe else 'Llama'} name"
            break
        records += mapped
    model = "Mixtral" if is_moe else "Llama"
    if why:
        return ckpt, {}, [f"{note} (not mapped to Hugging Face {model} names: {why})"
                          for note in ckpt.extra.get("merge_notes") or []]
    view = dataclasses.replace(ckpt, records=records, extra={**ckpt.extra, "merge_notes": []})
    notes = [f"Hugging Face {model} names (SwiGLU, RMSNorm, RoPE, no biases: as the files say"
             + ("; experts fused per layer as transformers' MixtralExperts, the router as mlp.gate" if is_moe else "")
             + "); --native-names keeps Megatron's names"]
    missing = config_missing(f)
    if is_moe and not missing and (differs := moe_hf.router_differs(ckpt.extra.get("args") or {})):
        notes.append(f"no config.json written: the router is not Mixtral's ({', '.join(differs)}); the weights "
                     "are written under Mixtral's names")
        return view, {}, notes
    if missing:
        notes.append(f"no config.json written: the checkpoint's args do not hold {', '.join(missing)}, which "
                     "LlamaConfig needs to compute what the Megatron model computed (its defaults differ); write "
                     "config.json with the run's --norm-epsilon and --rotary-base")
        return view, {}, notes
    cfg = config(f, dtype)
    if is_moe:  # MixtralConfig: no attention_bias / mlp_bias fields (Mixtral has neither)
        cfg = {k: v for k, v in cfg.items() if k not in ("attention_bias", "mlp_bias")}
        cfg.update(moe_hf.config(f, ckpt.extra.get("args") or {}))
    cfg = json.dumps(cfg, indent=2, sort_keys=True) + "\n"
    return view, {"config.json": cfg.encode()}, notes


# a Llama decoder layer's parameters in ``LlamaForCausalLM.named_parameters()`` order (transformers'
# LlamaDecoderLayer: self_attn q, k, v, o; mlp gate, up, down; the two norms), which a DeepSpeed engine built from
# the model lays its flat groups out in
_LAYER_ORDER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                "input_layernorm.weight", "post_attention_layernorm.weight")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _hf_rank(name: str, order=_LAYER_ORDER) -> tuple:
    if name == "model.embed_tokens.weight":
        return (0, 0, 0)
    m = _HF_LAYER.match(name)
    if m:
        return (1, int(m.group(1)), order.index(m.group(2)))
    return (2, 0, 0) if name == "model.norm.weight" else (3, 0, 0)


def state_view(ckpt: Checkpoint) -> tuple[list[TensorRecord], dict[str, list[str]]] | None:
    """The records (masters and both Adam moments included) under Llama's names, in ``LlamaForCausalLM``'s
    parameter order, and {Megatron name: its Llama names}; None when the files do not say the model is
    Llama-shaped or a tensor has no Llama name (the caller keeps Megatron's names)."""
    f = ckpt.extra["megatron"]
    if why_not(f) or f.get("tied") is None:
        return None
    records, names, source, order = [], {}, ckpt.records, _LAYER_ORDER
    if ckpt.extra.get("moe_coverage"):  # transformers' Mixtral (moe_hf), or Megatron's names
        if moe_hf.why_not(source, f):
            return None
        source, names = moe_hf.fuse(source, f, state=True)
        order = moe_hf.LAYER_ORDER
    for rec in source:
        if rec.name.startswith("model.layers."):  # named by moe_hf already
            records.append(rec)
            continue
        mapped = _mapped(rec, f, state=True)
        if mapped is None:
            return None
        records += mapped
        names[rec.name] = [m.name for m in mapped]
    return sorted(records, key=lambda r: _hf_rank(r.name, order)), names
