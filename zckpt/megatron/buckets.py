"""Megatron-Core's ``dp_reshardable`` optimizer layout: where each parameter's fp32 master and Adam moments sit in
the distributed optimizer's flat buckets, read from the files and checked against them.

A ``dp_reshardable`` save (Megatron-LM's default) keeps, per model-parallel rank ``G`` and grad buffer bucket ``B``,
one 1-D tensor per state (``optimizer.distributed.dp_group_idx_G.gbuf_idx_0.dtype_(...).bucket_idx_B.{param,
exp_avg,exp_avg_sq}``) of the bucket's unpadded size, saved as one DCP chunk per parameter fragment and per gap
(``DistributedOptimizer.sharded_param_state_dp_reshardable``, megatron-core 0.16). The files do not name the
parameter of a chunk. Megatron-Core lays its buckets out by a fixed rule (``_ParamAndGradBuffer.__init__``): the
parameters of ``module.named_parameters()`` in reverse order, each start padded to a multiple of 64 elements, a
new bucket when the files' bucket ends. The registration order is that of megatron-core's GPT model with the local
layer spec (``TransformerLayer``: input norm, ``self_attention`` [``linear_proj``, ``linear_qkv``, q/k norms],
pre-MLP norm, ``mlp`` [``linear_fc1``, ``linear_fc2``]; embedding before the layers, final norm and output layer
after), named as Megatron saves them.

That rule is never taken on trust; a placement is used only when the files confirm all of it:

1. every bucket ends exactly where its last parameter ends (the bucket tensor's size in ``.metadata``);
2. every parameter's start and end is a chunk boundary of all three state tensors, and no chunk straddles one;
3. (:func:`check_values`, run by ``merge`` and ``convert`` before anything is written) every parameter's master,
   cast to the training dtype, equals the model weight the files hold, element for element: a parameter put in
   another's place is found by its own values. (Two parameters of one size whose saved weights are still equal,
   norms at 1.0 in bf16, cannot be told apart by values: their places are the rule's, which the rest confirmed.)

Anything else is refused in one line: pipeline stages (``pp > 1``), virtual pipelines, more than one grad buffer
(several parameter dtypes, experts), a parameter name outside that model, a bucket the rule does not fill.
Tensor parallelism is read: a model-parallel rank's buffer holds its TP shard of each parameter (column-parallel
rows, row-parallel columns, SwiGLU's ``linear_fc1`` as its gate and up shards, norms whole), put back in place.
"""

from __future__ import annotations

import re

from zckpt.errors import CorruptFile, UnsupportedLayout
from zckpt.megatron.hf_names import cut

BUCKET_RE = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)"
                       r"\.(param|exp_avg|exp_avg_sq)$")
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
ALIGN = 64  # _pad_start_of_param_if_needed: params start at multiples of 64 elements
LAYERS = "decoder.layers."
HINT = "save with --dist-ckpt-optim-fully-reshardable to carry the optimizer state (zckpt merge reads the weights)"

# module registration order (megatron-core 0.16, GPTModel + get_gpt_layer_local_spec), under the names Megatron
# saves (the local spec maps input_layernorm. -> self_attention.linear_qkv.layer_norm_ and pre_mlp_layernorm. ->
# mlp.linear_fc1.layer_norm_); each module's weight before its bias
_TOP_BEFORE = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_LAYER = ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
          "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
          "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
          "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
          "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
          "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
          "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
          "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
_TOP_AFTER = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight",
              "output_layer.bias")
# how tensor parallelism splits a parameter (megatron-core's Column/RowParallelLinear, VocabParallelEmbedding);
# all others are whole on every TP rank (norms, row-parallel biases, position embeddings)
_ROWS = {"embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias",
         "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"}
_FC1 = {"mlp.linear_fc1.weight", "mlp.linear_fc1.bias"}  # rows; with SwiGLU the shard is [gate_r; up_r]
_COLS = {"self_attention.linear_proj.weight", "mlp.linear_fc2.weight"}


def _refuse(why: str, path: str) -> UnsupportedLayout:
    return UnsupportedLayout(f"dp_reshardable optimizer state: {why}", path=path, hint=HINT)


def _short(name: str) -> str:
    """A record name without ``decoder.layers.<i>.``."""
    if name.startswith(LAYERS):
        return name[len(LAYERS):].split(".", 1)[1]
    return name


def _order(records, path: str) -> list:
    """The trainable records in ``named_parameters()`` order."""
    by_name = {r.name: r for r in records if r.kind == "trainable"}
    layers = sorted({int(n[len(LAYERS):].split(".", 1)[0]) for n in by_name if n.startswith(LAYERS)})
    names = [n for n in _TOP_BEFORE if n in by_name]
    for i in layers:
        names += [f"{LAYERS}{i}.{rest}" for rest in _LAYER if f"{LAYERS}{i}.{rest}" in by_name]
    names += [n for n in _TOP_AFTER if n in by_name]
    unknown = sorted(set(by_name) - set(names))
    if unknown:
        raise _refuse(f"'{unknown[0]}' is not a parameter of megatron-core's GPT model (local spec), whose bucket "
                      "layout zckpt knows", path)
    return [by_name[n] for n in names]


def _local_numel(rec, tp: int, path: str) -> int:
    short = _short(rec.name)
    if short in _ROWS or short in _FC1 or short in _COLS:
        axis = 1 if short in _COLS else 0
        parts = tp * (2 if short in _FC1 and rec.swiglu else 1)
        if len(rec.shape) <= axis or rec.shape[axis] % parts:
            raise _refuse(f"'{rec.name}' of size {list(rec.shape)} does not split into {parts} tensor-parallel "
                          "parts", path)
        return rec.numel // tp
    return rec.numel


class _Rec:
    """What placing needs of a record."""

    def __init__(self, rec, swiglu: bool):
        self.rec, self.name, self.shape, self.numel, self.swiglu = rec, rec.name, tuple(rec.shape), rec.numel, swiglu


def _buckets(md, tp: int, path: str) -> dict[int, list[dict]]:
    """model-parallel rank -> its buckets in order, each {state key: tensor entry}."""
    found: dict = {}
    for key, te in md.tensors.items():
        if not key.startswith("optimizer."):
            continue
        m = BUCKET_RE.match(key)
        if not m:
            raise _refuse(f"'{key[:120]}' is not a bucket tensor of megatron-core's distributed optimizer", path)
        g, gbuf, dtype, b, state = int(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4)), m.group(5)
        if gbuf != 0:
            raise _refuse(f"'{key[:120]}': more than one grad buffer (several parameter dtypes or experts)", path)
        if len(te.shape) != 1:
            raise CorruptFile(f"'{key[:120]}' has size {list(te.shape)}, not a flat bucket", path=path)
        found.setdefault(g, {}).setdefault(b, {}).setdefault(dtype, {})[state] = te
    if sorted(found) != list(range(tp)):
        raise _refuse(f"buckets for model-parallel ranks {sorted(found)}, the args say {tp} (tp x pp)", path)
    out = {}
    for g, buckets in found.items():
        if sorted(buckets) != list(range(len(buckets))):
            raise CorruptFile(f"model-parallel rank {g}: buckets {sorted(buckets)} are not 0..{len(buckets) - 1}",
                              path=path)
        out[g] = []
        for b in range(len(buckets)):
            if len(buckets[b]) != 1:
                raise _refuse(f"rank {g} bucket {b} has several dtypes", path)
            states = next(iter(buckets[b].values()))
            if set(states) != set(STATE_KEYS) or len({tuple(t.shape) for t in states.values()}) != 1:
                raise CorruptFile(f"rank {g} bucket {b}: expected param, exp_avg and exp_avg_sq of one size, got "
                                  f"{ {k: list(t.shape) for k, t in states.items()} }", path=path)
            out[g].append(states)
    return out


def _boundaries(te, path: str) -> tuple[set, list]:
    spans = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in te.chunks)
    cursor = 0
    for lo, hi in spans:
        if lo != cursor:
            raise CorruptFile(f"'{te.key[:120]}': chunks leave [{cursor}, {lo}) uncovered or overlap", path=path)
        cursor = hi
    if cursor != te.shape[0]:
        raise CorruptFile(f"'{te.key[:120]}': chunks end at {cursor}, the tensor has {te.shape[0]} elements",
                          path=path)
    return {b for s in spans for b in s}, spans


def place(records, md, f: dict, args: dict, tensors, path: str) -> dict[str, tuple[list, list, list]]:
    """Record name -> (master, exp_avg, exp_avg_sq) pieces in the record's row-major order (see the module
    docstring); raises UnsupportedLayout / CorruptFile when the files do not confirm the layout."""
    tp, pp = f.get("tp"), f.get("pp")
    if pp != 1:
        raise _refuse(f"pipeline parallel size {pp}: each stage's buckets would need its own share of the layers, "
                      "which zckpt does not place", path)
    if not isinstance(tp, int) or tp < 1:
        raise _refuse("the files do not say the tensor-parallel size", path)
    if args.get("virtual_pipeline_model_parallel_size") not in (None, 1):
        raise _refuse("virtual pipeline stages (several model chunks per rank)", path)
    if args.get("num_experts") not in (None, 0):
        raise _refuse("mixture-of-experts parameters (an expert grad buffer)", path)
    swiglu = f.get("swiglu")
    fc1 = [r for r in records if _short(r.name) in _FC1 and r.kind == "trainable"]
    if fc1 and tp > 1 and swiglu is None:
        raise _refuse("the args do not say whether linear_fc1 is SwiGLU (gate and up shards per TP rank)", path)
    order = [_Rec(r, bool(swiglu)) for r in _order(records, path)]
    buckets = _buckets(md, tp, path)
    local = {g: {} for g in range(tp)}  # rank -> name -> (bucket states, start, numel)
    for g in range(tp):
        todo = list(reversed(order))
        for b, states in enumerate(buckets[g]):
            size = states["param"].shape[0]
            bounds = [_boundaries(states[k], path) for k in STATE_KEYS]
            if len({tuple(s) for _, s in bounds}) != 1:
                raise CorruptFile(f"rank {g} bucket {b}: param, exp_avg and exp_avg_sq are chunked differently",
                                  path=path)
            edges, spans = bounds[0]
            cursor, placed = 0, []
            while todo and cursor < size:
                p = todo.pop(0)
                n = _local_numel(p, tp, path)
                start = -(-cursor // ALIGN) * ALIGN
                end = start + n
                if end > size:
                    raise _refuse(f"'{p.name}' ({n} elements at {start}) runs past the end of rank {g}'s bucket {b} "
                                  f"({size}): not the layout megatron-core's GPT model gives", path)
                placed.append((p, start, end))
                cursor = end
            if cursor != size:
                raise _refuse(f"rank {g} bucket {b} holds {size} elements, the parameters fill {cursor}", path)
            for p, start, end in placed:
                if start not in edges or end not in edges or any(lo < start < hi or lo < end < hi for lo, hi in spans):
                    raise _refuse(f"'{p.name}' at [{start}, {end}) of rank {g}'s bucket {b} is not where the "
                                  "files' chunks put a parameter", path)
                local[g][p.name] = (states, start, end - start)
        if todo:
            raise _refuse(f"rank {g}'s buckets end before '{todo[0].name}' and {len(todo) - 1} more parameter(s)",
                          path)
    return {p.name: tuple(_global(p, local, tp, tensors, k) for k in STATE_KEYS) for p in order}


def _global(p: _Rec, local: dict, tp: int, tensors, key: str) -> list:
    """The pieces of state ``key`` of parameter ``p`` in its global row-major order, from the TP ranks' shards."""
    def shard(g):
        states, start, n = local[g][p.name]
        return tensors.pieces(states[key], start, n)
    short = _short(p.name)
    if tp == 1 or not (short in _ROWS or short in _FC1 or short in _COLS):
        return shard(0)  # whole on every TP rank: Megatron's main replica is TP rank 0's
    shards = [shard(g) for g in range(tp)]
    n = sum(x.numel for x in shards[0])
    if short in _COLS:  # [rows, cols/tp] per rank: each global row is the ranks' row pieces side by side
        rows = p.shape[0]
        width = n // rows
        return [x for r in range(rows) for g in range(tp) for x in cut(shards[g], r * width, width)]
    if short in _FC1 and p.swiglu:  # rank r holds [gate_r; up_r]; global is [gate_0..gate_tp-1; up_0..up_tp-1]
        half = n // 2
        return [x for h in range(2) for g in range(tp) for x in cut(shards[g], h * half, half)]
    return [x for g in range(tp) for x in shards[g]]


def attach(ckpt):
    """``ckpt`` (a ``dp_reshardable`` read) with each parameter's fp32 master and moments from the buckets, after
    :func:`check_values`; raises the reason the reader could not place them."""
    import dataclasses
    error, placed = ckpt.extra.get("bucket_error"), ckpt.extra.get("buckets")
    if error is not None:
        raise error
    def crc(pieces):  # a mismatch: a damaged byte is named as such (the entries' CRC-32), before a layout is blamed
        from zckpt.state import checksums
        check = checksums.input_check(ckpt)
        for p in pieces:
            check.ensure(p.path, p.offset, p.nbytes)
    check_values(ckpt.records, placed, ckpt.location.storage_options, crc)
    records = []
    for rec in ckpt.records:
        if rec.name in placed:
            master, avg, avg_sq = placed[rec.name]
            rec = dataclasses.replace(rec, value=master, dtype="float32", exp_avg=avg, exp_avg_sq=avg_sq,
                                      lp_dtype=rec.dtype)
        records.append(rec)
    return dataclasses.replace(ckpt, records=records)


def check_values(records, placed: dict, reader_opts=None, on_mismatch=None, block: int = 1 << 20) -> None:
    """Every placed master, cast to its record's training dtype, must equal the record's saved weight, bit for bit
    (see the module docstring); raises UnsupportedLayout naming the first parameter that differs, after
    ``on_mismatch(pieces)`` (which may raise CorruptFile) is given both tensors' pieces. Blocks of ``block``
    elements, cast by :func:`zckpt.encoding.casting.cast` (torch's rounding, without importing torch)."""
    import numpy as np
    from zckpt.encoding import casting
    from zckpt.encoding.safeload import DTYPE_SIZES
    from zckpt.encoding.tensors import Reader
    reader = Reader(reader_opts)
    master_buf = bytearray(block * 4)
    try:
        for rec in records:
            if rec.name not in placed:
                continue
            master, size = placed[rec.name][0], DTYPE_SIZES[rec.dtype]
            weight_buf = bytearray(block * size)
            for start in range(0, rec.numel, block):
                n = min(block, rec.numel - start)
                mv, wv = memoryview(master_buf)[:n * 4], memoryview(weight_buf)[:n * size]
                reader.read_pieces(cut(master, start, n), mv)
                reader.read_pieces(cut(rec.value, start, n), wv)
                got = casting.cast(np.frombuffer(mv, dtype=np.uint8), "float32", rec.dtype)
                want = np.frombuffer(wv, dtype=np.uint8)
                if not np.array_equal(got, want):
                    diff = (got.reshape(n, size) != want.reshape(n, size)).any(axis=1)
                    bad = int(np.flatnonzero(diff)[0]) + start
                    if on_mismatch is not None:
                        on_mismatch(master + rec.value)
                    raise UnsupportedLayout(
                        f"dp_reshardable optimizer state: the fp32 master placed for '{rec.name}' does not cast to "
                        f"its saved {rec.dtype} weight (element {bad}): the bucket layout is not the one "
                        "megatron-core's GPT model gives, or the files are damaged",
                        path=master[0].path if master else None, hint=HINT)
    finally:
        reader.close()
