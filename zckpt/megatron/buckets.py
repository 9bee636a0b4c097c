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

Pipeline stages: model-parallel rank ``G = pp_rank * tp + tp_rank`` holds stage ``pp_rank``'s parameters (the
embedding on the first, final norm and output layer on the last, the layers split evenly); a tied output layer
is a copy of the embedding on the last stage, in a bucket of its own (``shared_embedding``), whose state is
checked like the others and not carried (Megatron's main replica is the first stage's). Anything else is refused
in one line: uneven or virtual pipelines, more than one grad buffer (several parameter dtypes, experts), a
parameter name outside that model, a bucket the rule does not fill.
Tensor parallelism is read: a model-parallel rank's buffer holds its TP shard of each parameter (column-parallel
rows, row-parallel columns, SwiGLU's ``linear_fc1`` as its gate and up shards, norms whole), put back in place.
"""

from __future__ import annotations

import re

from zckpt.errors import CorruptFile, UnsupportedLayout
from zckpt.engine.segments import slice_pieces as cut

BUCKET_RE = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                       r"\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$")
# an expert's record name (zckpt.megatron.moe): its buffer is the second optimizer's (chained_1)
_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.experts\.(\d+)\.(.+)$")
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
          "mlp.router.weight", "mlp.router.bias",  # an MoE layer's router (MoELayer: router, then its experts)
          "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
          "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
_TOP_AFTER = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight",
              "output_layer.bias")
# how tensor parallelism splits a parameter (megatron-core's Column/RowParallelLinear, VocabParallelEmbedding);
# all others are whole on every TP rank (norms, row-parallel biases, position embeddings)
ROWS = {"embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias",
         "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"}
FC1 = {"mlp.linear_fc1.weight", "mlp.linear_fc1.bias"}  # rows; with SwiGLU the shard is [gate_r; up_r]
COLS = {"self_attention.linear_proj.weight", "mlp.linear_fc2.weight"}


def _refuse(why: str, path: str) -> UnsupportedLayout:
    return UnsupportedLayout(f"dp_reshardable optimizer state: {why}", path=path, hint=HINT)


def short_name(name: str) -> str:
    """A record name without ``decoder.layers.<i>.`` (an expert's: ``mlp.<param>``, split as a dense MLP's)."""
    m = _EXPERT.match(name)
    if m:
        return "mlp." + m.group(3)
    if name.startswith(LAYERS):
        return name[len(LAYERS):].split(".", 1)[1]
    return name


_EXPERT_PARAMS = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")


def _order(records, path: str, experts_inline: bool = False) -> list:
    """The trainable records in ``named_parameters()`` order; an MoE layer's experts after its router when they
    share the dense buffer (``experts_inline``: expert-parallel size 1, one optimizer), else aside (their own
    buffer, :func:`_experts`)."""
    by_name = {r.name: r for r in records if r.kind == "trainable" and (experts_inline or not _EXPERT.match(r.name))}
    experts: dict[int, list] = {}
    for n in by_name:
        if m := _EXPERT.match(n):
            experts.setdefault(int(m.group(1)), []).append(
                (int(m.group(2)), _EXPERT_PARAMS.index(m.group(3)) if m.group(3) in _EXPERT_PARAMS else -1, n))
    layers = sorted({int(n[len(LAYERS):].split(".", 1)[0]) for n in by_name if n.startswith(LAYERS)})
    names = [n for n in _TOP_BEFORE if n in by_name]
    for i in layers:
        for rest in _LAYER:
            names += [f"{LAYERS}{i}.{rest}"] if f"{LAYERS}{i}.{rest}" in by_name else []
            if rest == "mlp.router.bias":  # MoELayer: the router, then experts.local_experts.<j> (fc1, fc2)
                names += [n for e, k, n in sorted(experts.get(i, [])) if k >= 0]
    names += [n for n in _TOP_AFTER if n in by_name]
    unknown = sorted(set(by_name) - set(names))
    if unknown:
        raise _refuse(f"'{unknown[0]}' is not a parameter of megatron-core's GPT model (local spec), whose bucket "
                      "layout zckpt knows", path)
    return [by_name[n] for n in names]


def local_numel(rec, tp: int, path: str) -> int:
    short = short_name(rec.name)
    if short in ROWS or short in FC1 or short in COLS:
        axis = 1 if short in COLS else 0
        parts = tp * (2 if short in FC1 and rec.swiglu else 1)
        if len(rec.shape) <= axis or rec.shape[axis] % parts:
            raise _refuse(f"'{rec.name}' of size {list(rec.shape)} does not split into {parts} tensor-parallel "
                          "parts", path)
        return rec.numel // tp
    return rec.numel


class _Rec:
    """What placing needs of a record; ``name`` is where its state goes (a tied output layer's copy on the last
    pipeline stage is ``output_layer.weight``, with the embedding's shape), ``shared``: Megatron's
    ``shared_embedding`` (a bucket of its own)."""

    def __init__(self, rec, swiglu: bool, name: str | None = None, shared: bool = False):
        self.rec, self.name, self.shape, self.numel = rec, name or rec.name, tuple(rec.shape), rec.numel
        self.swiglu, self.shared = swiglu, shared


def _layer(name: str) -> int | None:
    return int(name[len(LAYERS):].split(".", 1)[0]) if name.startswith(LAYERS) else None


# args that move layers between pipeline stages (megatron-core 0.16 TransformerConfig / Megatron-LM arguments)
_UNEVEN = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
           "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage", "pipeline_model_parallel_layout",
           "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def stages(records, pp: int, swiglu: bool, args: dict, path: str,
           experts_inline: bool | None = None) -> list[list[_Rec]]:
    """Each pipeline stage's parameters in ``named_parameters()`` order: the first holds the embedding, the last
    the final norm and the output layer (tied: a copy of the embedding, Megatron's ``shared_embedding``), the
    layers split evenly (megatron-core's default; the args that change it are refused)."""
    if experts_inline is None:  # megatron-core: expert parameters are allreduce=False only when ep > 1
        experts_inline = bool(args.get("num_experts")) and (args.get("expert_model_parallel_size") or 1) == 1
    order = _order(records, path, experts_inline)
    if pp == 1:
        return [[_Rec(r, swiglu) for r in order]]
    for key in _UNEVEN:
        if args.get(key) not in (None, False):
            raise _refuse(f"the args set {key}={args[key]!r}: layers are not split evenly over the pipeline stages",
                          path)
    layers = sorted({_layer(r.name) for r in order if _layer(r.name) is not None})
    if layers != list(range(len(layers))) or len(layers) % pp:
        raise _refuse(f"{len(layers)} layers do not split evenly over {pp} pipeline stages", path)
    per = len(layers) // pp
    tied = {r.name: r.tied_to for r in records if r.kind == "tied"}
    embedding = next((r for r in order if r.name == _TOP_BEFORE[0]), None)
    shared = bool(tied) and embedding is not None
    if tied and (list(tied.items()) != [("output_layer.weight", _TOP_BEFORE[0])] or embedding is None):
        raise _refuse(f"tied parameters {tied} are not Megatron's tied output layer", path)
    out = []
    for p in range(pp):
        stage = []
        for r in order:
            i = _layer(r.name)
            if i is not None:
                keep = p * per <= i < (p + 1) * per
            else:
                keep = p == 0 if r.name in _TOP_BEFORE else p == pp - 1
            if keep:
                stage.append(_Rec(r, swiglu, shared=shared and r.name == _TOP_BEFORE[0]))
        if p == pp - 1 and shared:
            stage.append(_Rec(embedding, swiglu, name="output_layer.weight", shared=True))
        out.append(stage)
    return out


_stages = stages  # (the name tests/test_megatron_convert.py calls)


def _buckets(md, tp: int, path: str, chained: int = 0) -> dict[int, list[dict]]:
    """model-parallel rank -> its buckets in order, each {state key: tensor entry}; ``chained``: those of one
    optimizer of a chain (an MoE model's ``chained_0``: dense, ``chained_1``: experts; one optimizer: 0)."""
    prefixed = {bool(re.match(r"chained_\d+\.optimizer\.", k)) for k in md.tensors if "optimizer." in k}
    if len(prefixed) > 1:
        raise _refuse("bucket tensors of one optimizer and of an optimizer chain in one checkpoint", path)
    found: dict = {}
    for key, te in md.tensors.items():
        if not key.startswith("optimizer.") and not re.match(r"chained_\d+\.optimizer\.", key):
            continue
        m = BUCKET_RE.match(key)
        if not m:
            raise _refuse(f"'{key[:120]}' is not a bucket tensor of megatron-core's distributed optimizer", path)
        c = int(m.group(1)) if m.group(1) is not None else 0
        if c != chained:
            if c not in (0, 1):  # a third optimizer
                raise _refuse(f"'{key[:120]}': the buckets of an optimizer chain zckpt does not know (it reads one "
                              "optimizer, or an MoE model's dense chained_0 and expert chained_1)", path)
            continue
        g, gbuf, dtype, b, state = int(m.group(2)), int(m.group(3)), m.group(4), int(m.group(5)), m.group(6)
        if gbuf != 0:
            raise _refuse(f"'{key[:120]}': more than one grad buffer (several parameter dtypes or experts)", path)
        if len(te.shape) != 1:
            raise CorruptFile(f"'{key[:120]}' has size {list(te.shape)}, not a flat bucket", path=path)
        found.setdefault(g, {}).setdefault(b, {}).setdefault(dtype, {})[state] = te
    if sorted(found) != list(range(tp)):
        raise _refuse(f"buckets for model-parallel ranks {sorted(found)}, the args say {tp} " +
                      ("(tp x pp)" if chained != 1 else "(expert tp x ep x pp)"), path)
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
    """Name -> (master, exp_avg, exp_avg_sq) pieces in the parameter's row-major order (see the module docstring;
    with a tied output layer on another pipeline stage, ``output_layer.weight``: its copy's state, which is
    checked, not carried); raises UnsupportedLayout / CorruptFile when the files do not confirm the layout."""
    tp, pp = f.get("tp"), f.get("pp")
    if not isinstance(tp, int) or tp < 1 or not isinstance(pp, int) or pp < 1:
        raise _refuse("the files do not say the tensor- and pipeline-parallel sizes", path)
    if args.get("virtual_pipeline_model_parallel_size") not in (None, 1) or \
            args.get("num_virtual_stages_per_pipeline_rank") not in (None, 1):
        raise _refuse("virtual pipeline stages (several model chunks per rank)", path)
    moe = f.get("moe") or {}
    if not moe and any(k.startswith("chained_") and not k.startswith("chained_0.") for k in md.tensors):
        raise _refuse("the buckets of several optimizers in a model the args say has no experts", path)
    swiglu = f.get("swiglu")
    fc1 = [r for r in records if short_name(r.name) in FC1 and r.kind == "trainable"]
    if fc1 and tp > 1 and swiglu is None:
        raise _refuse("the args do not say whether linear_fc1 is SwiGLU (gate and up shards per TP rank)", path)
    # expert-parallel size 1: the experts are ordinary parameters of the one optimizer and buffer (megatron-core
    # marks expert parameters allreduce=False only with expert parallelism); otherwise the chain's second
    chained = any(k.startswith("chained_1.") for k in md.tensors)
    inline = bool(moe) and not chained
    if bool(moe) and inline != ((moe.get("ep") or 1) == 1):  # (TransformerConfig: expert_parallel = ep > 1)
        raise _refuse(f"expert-parallel size {moe.get('ep')} " + ("without the experts' own optimizer (chained_1)"
                      if inline else "with an expert optimizer (chained_1)"), path)
    per_stage = stages(records, pp, bool(swiglu), args, path, inline)
    buckets = _buckets(md, tp * pp, path)
    local: dict[int, dict] = {}  # model-parallel rank (pp rank x tp + tp rank) -> name -> (states, start, numel)
    ranks_of = {}
    for s, params in enumerate(per_stage):
        for t in range(tp):
            g = s * tp + t  # the rank in megatron-core's tp-pp group: tp fastest
            local[g] = _walk(params, buckets[g], g, tp, path)
        ranks_of.update({p.name: [s * tp + t for t in range(tp)] for p in params})
    out = {p.name: tuple(_global(p, local, ranks_of[p.name], tp, tensors, k) for k in STATE_KEYS)
           for params in per_stage for p in params}
    if moe and not inline:
        out.update(_experts(records, moe, pp, bool(swiglu), md, tensors, path))
    return out


def _experts(records, moe: dict, pp: int, swiglu: bool, md, tensors, path: str) -> dict:
    """An MoE model's expert state: the second optimizer's buckets, one set per rank of the expert tensor x expert
    x pipeline group (``g = etp_rank + etp * (ep_rank + ep * pp_rank)``, megatron-core's ``tp-ep-pp`` order), each
    holding that expert-parallel rank's experts (global ``ep_rank * E/ep + j``) of its stage's MoE layers, in
    ``named_parameters()`` order (layer by layer, local expert by expert, ``linear_fc1`` then ``linear_fc2``)."""
    n, ep, etp = moe.get("num_experts"), moe.get("ep") or 1, moe.get("etp") or 1
    if not n or n % ep:
        raise _refuse(f"{n} experts do not split over expert-parallel size {ep}", path)
    by_layer: dict[int, dict[int, list]] = {}
    for r in records:
        m = _EXPERT.match(r.name)
        if m and r.kind == "trainable":
            by_layer.setdefault(int(m.group(1)), {}).setdefault(int(m.group(2)), []).append(r)
    order = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")
    for recs in (x for es in by_layer.values() for x in es.values()):
        unknown = [r.name for r in recs if _EXPERT.match(r.name).group(3) not in order]
        if unknown:
            raise _refuse(f"'{unknown[0]}' is not a parameter of SequentialMLP's experts", path)
        recs.sort(key=lambda r: order.index(_EXPERT.match(r.name).group(3)))
    all_layers = sorted({_layer(r.name) for r in records if _layer(r.name) is not None})
    if len(all_layers) % pp:
        raise _refuse(f"{len(all_layers)} layers do not split evenly over {pp} pipeline stages", path)
    per_stage, local_n = len(all_layers) // pp, n // ep
    buckets = _buckets(md, etp * ep * pp, path, 1)
    local, ranks_of, params_of = {}, {}, {}
    for s in range(pp):
        for r in range(ep):
            params = [_Rec(x, swiglu) for i in sorted(by_layer) if s * per_stage <= i < (s + 1) * per_stage
                      for e in range(r * local_n, (r + 1) * local_n) for x in by_layer[i].get(e, [])]
            for t in range(etp):
                g = t + etp * (r + ep * s)
                local[g] = _walk(params, buckets[g], g, etp, path)
            ranks_of.update({p.name: [t + etp * (r + ep * s) for t in range(etp)] for p in params})
            params_of.update({p.name: p for p in params})
    return {name: tuple(_global(params_of[name], local, ranks, etp, tensors, k) for k in STATE_KEYS)
            for name, ranks in ranks_of.items()}


def _walk(params: list[_Rec], buckets: list[dict], g: int, tp: int, path: str) -> dict:
    """Place ``params`` (one rank's, registration order) in its buckets: reversed, starts padded to 64 elements, a
    bucket closed where the files' bucket ends (or before and after a shared embedding, Megatron's own bucket)."""
    out, b, cursor, placed = {}, 0, 0, []

    def close(at: int) -> None:
        nonlocal b, cursor, placed
        states = buckets[b]
        size = states["param"].shape[0]
        if at != size:
            raise _refuse(f"rank {g} bucket {b} holds {size} elements, the parameters fill {at}", path)
        bounds = [_boundaries(states[k], path) for k in STATE_KEYS]
        if len({tuple(sp) for _, sp in bounds}) != 1:
            raise CorruptFile(f"rank {g} bucket {b}: param, exp_avg and exp_avg_sq are chunked differently",
                              path=path)
        edges, spans = bounds[0]
        for p, start, end in placed:
            if start not in edges or end not in edges or any(lo < start < hi or lo < end < hi for lo, hi in spans):
                raise _refuse(f"'{p.name}' at [{start}, {end}) of rank {g}'s bucket {b} is not where the files' "
                              "chunks put a parameter", path)
            out[p.name] = (states, start, end - start)
        b, cursor, placed = b + 1, 0, []

    for p in reversed(params):
        start = -(-cursor // ALIGN) * ALIGN
        if p.shared and placed:  # megatron-core: a shared embedding starts a bucket; the one before ends here
            close(start)
            start = 0
        if b >= len(buckets):
            raise _refuse(f"rank {g}'s buckets end before '{p.name}'", path)
        n = local_numel(p, tp, path)
        end, size = start + n, buckets[b]["param"].shape[0]
        if end > size:
            raise _refuse(f"'{p.name}' ({n} elements at {start}) runs past the end of rank {g}'s bucket {b} "
                          f"({size}): not the layout megatron-core's GPT model gives", path)
        placed.append((p, start, end))
        cursor = end
        if end == size or p.shared:
            close(end)
    if placed:
        close(cursor)
    if b != len(buckets):
        raise _refuse(f"rank {g} has {len(buckets)} buckets, its parameters fill {b}", path)
    return out


def _global(p: _Rec, local: dict, ranks: list[int], tp: int, tensors, key: str) -> list:
    """The pieces of state ``key`` of parameter ``p`` in its global row-major order, from the TP ranks' shards
    (``ranks``: the model-parallel ranks of TP ranks 0..tp-1 holding it)."""
    def shard(t):
        states, start, n = local[ranks[t]][p.name]
        return tensors.pieces(states[key], start, n)
    short = short_name(p.name)
    if tp == 1 or not (short in ROWS or short in FC1 or short in COLS):
        return shard(0)  # whole on every TP rank: Megatron's main replica is TP rank 0's
    shards = [shard(g) for g in range(tp)]
    n = sum(x.numel for x in shards[0])
    if short in COLS:  # [rows, cols/tp] per rank: each global row is the ranks' row pieces side by side
        rows = p.shape[0]
        width = n // rows
        return [x for r in range(rows) for g in range(tp) for x in cut(shards[g], r * width, width)]
    if short in FC1 and p.swiglu:  # rank r holds [gate_r; up_r]; global is [gate_0..gate_tp-1; up_0..up_tp-1]
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
        if rec.name in placed and rec.kind != "tied":  # a tied copy's state was checked, the embedding's carried
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
        by_name = {r.name: r for r in records}
        for name, triple in placed.items():
            rec = by_name[name]
            if rec.kind == "tied":  # the output layer's copy on the last stage: the embedding's weight
                rec = by_name[rec.tied_to]
            master, size = triple[0], DTYPE_SIZES[rec.dtype]
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
                        f"dp_reshardable optimizer state: the fp32 master placed for '{name}' does not cast to "
                        f"its saved {rec.dtype} weight (element {bad}): the bucket layout is not the one "
                        "megatron-core's GPT model gives, or the files are damaged",
                        path=master[0].path if master else None, hint=HINT)
    finally:
        reader.close()
