"""torchtitan 0.3.0's Llama 3 and transformers' ``LlamaForCausalLM``: the names (its
``Llama3StateDictAdapter.from_hf_map``) and the per-head row permutation of q/k between the two RoPE layouts, shared
by the readers that go either way (``zckpt.dcp.titan_llama``: torchtitan -> the class; ``zckpt.deepspeed.titan_dense``:
the class -> torchtitan).

torchtitan's Llama rotates interleaved pairs (``ComplexRoPE``: rows 2i, 2i+1 of a head are one complex number),
transformers' rotates halves (rows i, i + head/2). ``to_hf`` permutes the rows of ``wq`` / ``wk`` within each head
(``_permute``: ``w.view(heads, head // 2, 2, cols).transpose(1, 2)``), ``from_hf`` back (``_reverse_permute``). The
optimizer state is elementwise: masters and moments are permuted the same way.
"""

from __future__ import annotations

import bisect
import re

from zckpt.engine.segments import Piece, slice_pieces

MODEL_TYPE = "llama"
# Llama3StateDictAdapter.from_hf_map: the class's name -> torchtitan's (rotary_emb.inv_freq: not saved by either)
FROM_HF = (
    (r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "layers.{}.attention.qkv_linear.wq.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "layers.{}.attention.qkv_linear.wk.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "layers.{}.attention.qkv_linear.wv.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "layers.{}.attention.wo.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "layers.{}.feed_forward.w1.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "layers.{}.feed_forward.w3.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "layers.{}.feed_forward.w2.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{}.attention_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{}.ffn_norm.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
)


def titan_name(hf_name: str) -> str | None:
    """torchtitan's Llama 3 name of the class's parameter ``hf_name`` (None: it has none)."""
    for pattern, out in FROM_HF:
        m = re.fullmatch(pattern, hf_name)
        if m:
            return out.format(*m.groups())
    return None


def permute_rows(pieces: list[Piece], heads: int, rows: int, cols: int, reverse: bool = False) -> list[Piece]:
    """torchtitan's ``Llama3StateDictAdapter._permute(w, heads, rows, cols)`` (``reverse``: its
    ``_reverse_permute``) of the [rows, cols] tensor whose elements ``pieces`` hold, as pieces (each output row a
    slice of one source row): ``_permute``'s row ``h*d + j*d/2 + i`` is row ``h*d + 2i + j`` of its input."""
    head = rows // heads if heads else 0
    starts, pos = [], 0
    for p in pieces:
        starts.append(pos)
        pos += p.numel
    if pos != rows * cols or not head or head % 2 or rows % heads:
        raise ValueError(f"{pos} elements, {rows} rows of {cols} in {heads} heads: not a q/k weight to permute")

    def row(r: int) -> list[Piece]:
        k = bisect.bisect_right(starts, r * cols) - 1  # the piece holding the row's first element
        return slice_pieces(pieces[k:], r * cols - starts[k], cols)

    order = [h * head + 2 * i + j for h in range(heads) for j in (0, 1) for i in range(head // 2)]
    if reverse:  # _reverse_permute: the inverse row order
        inverse = [0] * rows
        for out_row, src in enumerate(order):
            inverse[src] = out_row
        order = inverse
    out: list[Piece] = []
    for r in order:
        for p in row(r):
            last = out[-1] if out else None
            if last is not None and last.path == p.path and last.dtype == p.dtype and \
                    last.offset + last.nbytes == p.offset:
                out[-1] = Piece(p.path, last.offset, last.numel + p.numel, p.dtype)
            else:
                out.append(p)
    return out


def qk_heads(name: str, cfg: dict) -> int | None:
    """The heads q/k's rows are permuted in (``num_attention_heads`` for q, ``num_key_value_heads`` for k) where
    ``name`` (either naming) is a q/k weight, else None."""
    if re.fullmatch(r"(model\.layers\.\d+\.self_attn\.q_proj|layers\.\d+\.attention\.qkv_linear\.wq)\.weight", name):
        return cfg.get("num_attention_heads")
    if re.fullmatch(r"(model\.layers\.\d+\.self_attn\.k_proj|layers\.\d+\.attention\.qkv_linear\.wk)\.weight", name):
        return cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    return None
