"""torchtitan's Llama 3 under transformers' ``LlamaForCausalLM`` names (``--hf-config`` of a config whose
``model_type`` is ``llama``), for :mod:`zckpt.dcp.titan_hf`.

The names are torchtitan 0.3.0's ``Llama3StateDictAdapter.from_hf_map`` read backwards: the dense Qwen3 table less
``q_norm`` / ``k_norm`` (Llama has none)::

    tok_embeddings.weight                            model.embed_tokens.weight
    layers.{i}.attention.qkv_linear.wq/wk/wv.weight  model.layers.{i}.self_attn.q_proj/k_proj/v_proj.weight
    layers.{i}.attention.wo.weight                   ...self_attn.o_proj.weight
    layers.{i}.attention_norm.weight                 ...input_layernorm.weight
    layers.{i}.ffn_norm.weight                       ...post_attention_layernorm.weight
    layers.{i}.feed_forward.w1/w3/w2.weight          ...mlp.gate_proj/up_proj/down_proj.weight
    norm.weight, lm_head.weight                      model.norm.weight, lm_head.weight

torchtitan's Llama rotates interleaved pairs (``ComplexRoPE``: rows 2i, 2i+1 of a head are one complex number),
transformers' rotates halves (rows i, i + head/2). Its ``to_hf`` therefore permutes the rows of ``wq`` and ``wk``
within each head (``_permute``: ``w.view(heads, head // 2, 2, cols).transpose(1, 2)``): row ``h*head + j*head/2 +
i`` of the class's ``q_proj`` is row ``h*head + 2i + j`` of torchtitan's ``wq`` (``k_proj``, ``wk``: the same per
key-value head). The optimizer state is elementwise, so the masters, ``exp_avg`` and ``exp_avg_sq`` of q/k (split
from the fused ``wqkv`` first, as torchtitan fuses it) are permuted the same way: Adam in one layout is Adam in the
other.
"""

from __future__ import annotations

import dataclasses
import re

from zckpt.errors import UnsupportedLayout
from zckpt.state.model import TensorRecord
from zckpt.state.titan_llama import MODEL_TYPE, permute_rows, qk_heads

CLASSES = {MODEL_TYPE: "LlamaForCausalLM"}
# torchtitan names of its Qwen3 table that torchtitan's Llama 3 has no counterpart of
NOT_LLAMA = re.compile(r"layers\.\d+\.(attention\.[qk]_norm\.weight|moe\..*)")


def to_hf_record(rec: TensorRecord, cfg: dict, path: str) -> TensorRecord:
    """``rec`` (already under the class's name, q/k's state split from ``wqkv``) as the class holds it: q_proj and
    k_proj's value and every elementwise state permuted as torchtitan's ``to_hf`` permutes the weight; the rest as
    it is."""
    heads = qk_heads(rec.name, cfg)
    if heads is None or rec.kind == "tied":
        return rec
    rows, cols = (int(x) for x in rec.shape)
    if rows % heads or (rows // heads) % 2:
        raise UnsupportedLayout(f"{rec.name}: {rows} rows in {heads} heads of an odd size; torchtitan's RoPE "
                                "permutation pairs a head's rows", path=path)
    perm = (lambda ps: permute_rows(ps, heads, rows, cols) if ps else ps)
    return dataclasses.replace(rec, value=perm(rec.value), exp_avg=perm(rec.exp_avg),
                               exp_avg_sq=perm(rec.exp_avg_sq),
                               other_state={k: perm(v) for k, v in rec.other_state.items()})


def check_family(cfg: dict, names, layers: list[int], cpath: str) -> None:
    """Refuse a config of the other family: torchtitan's Qwen3 has q_norm / k_norm in every layer, its Llama 3 none
    (its RoPE layouts differ too: a Llama save written under Qwen3's names would load with q/k unpermuted)."""
    llama = cfg["model_type"] in CLASSES
    for i in layers:
        if (f"layers.{i}.attention.q_norm.weight" in names) == llama:
            raise UnsupportedLayout(
                f"--hf-config says {cfg['model_type']}, and the checkpoint's layer {i} "
                f"{'has' if llama else 'has no'} attention.q_norm (torchtitan's "
                f"{'Qwen3' if llama else 'Llama 3'}, not its {'Llama 3' if llama else 'Qwen3'})", path=cpath,
                hint=f"state the config.json of a {'Qwen3' if llama else 'Llama'} model")
