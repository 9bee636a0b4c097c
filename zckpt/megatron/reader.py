"""A Megatron-Core ``torch_dist`` checkpoint (Megatron-LM's default ``--ckpt-format``) as a
:class:`~zckpt.state.model.Checkpoint` (fixtures/megatron/README.md draws the files)::

    <save>/latest_checkpointed_iteration.txt  the iteration ("3") or "release"; names <save>/iter_0000003
    <save>/iter_NNNNNNN/metadata.json         {"sharded_backend": "torch_dist", ...}: the only backend read
    <save>/iter_NNNNNNN/common.pt             torch.save of the non-sharded state (args, iteration, optimizer
                                              layout and param groups), read through the allow-list
    <save>/iter_NNNNNNN/.metadata             PyTorch DCP metadata (:mod:`zckpt.encoding.dcpmeta`)
    <save>/iter_NNNNNNN/__R_I.distcp          DCP items (:mod:`zckpt.encoding.distcp`); each chunk's file is the one
                                              ``.metadata`` names, never assumed from the rank

Records keep Megatron's names. Layers saved stacked (``decoder.layers.<rest>`` with a leading layer axis) become
one record per layer, ``decoder.layers.<i>.<rest>``; per-layer keys (``non_homogeneous_layers``) are read as they
are. A tied output layer (``untie_embeddings_and_output_weights`` false in the args, no ``output_layer.weight``
saved) is a ``tied`` record ``output_layer.weight`` -> ``embedding.word_embeddings.weight``; without the args no
tie is assumed.

Optimizer state: ``fully_reshardable`` keeps, per model key, ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``
in model space: each record's value is the fp32 master (``param``; the training-dtype weight is its cast, as
Megatron copies it), with both moments. The param groups in ``common.pt`` do not list their parameters, so the
groups are left unknown here (``state_refusal``) until the user states them (:mod:`zckpt.megatron.state`).
``dp_reshardable`` (Megatron-LM's default) saves flat DDP buckets that do not name the parameter of a chunk: the
records keep the weights as saved, and :mod:`zckpt.megatron.buckets` places each parameter's state in the buckets
(``extra["buckets"]``, or ``extra["bucket_error"]``: why not), which ``convert`` checks against the weights and
carries; its param groups and step are the ranks' ``optimizer.distributed.dp_group_idx_G.optimizer`` objects.
``fully_sharded_model_space``, ``fsdp_dtensor`` and the legacy ``torch`` format
(``mp_rank_XX/model_optim_rng.pt``) are refused in one line.
"""

from __future__ import annotations

import json
import operator
import re
from functools import partial

from zckpt.encoding import dcpmeta, distcp, safeload
from zckpt.encoding.safeload import Inert
from zckpt.errors import (
    CheckpointNotFound, CorruptFile, IncompleteCheckpoint, InvalidArgument, UnsafePickle, UnsupportedLayout,
)
from zckpt.io import links, storage
from zckpt.megatron import buckets, moe
from zckpt.megatron.claims import (  # noqa: F401 - claims: reader.claims, as before
    ITER_RE, LATEST, META_JSON, claims, isfile as _isfile, iterations as _iterations)
from zckpt.encoding.dcpmeta import cut
from zckpt.state.model import (
    Checkpoint, DeferredRecord, Location, RankFile, TensorRecord, dcp_pieces, metadata_errors,
)

FORMAT = "megatron"  # what the package declares to the registry: zckpt.megatron.format

COMMON = "common.pt"
METADATA = ".metadata"
_DATA_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
_RNG_RE = re.compile(r"^rng_state/shard_(\d+)\.(\d+)_(\d+)\.(\d+)$")  # shard_{pp}.{tp}_{PP}.{TP}
LAYERS = "decoder.layers."
OPTIM_STATE = "optimizer.state."
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
READ_LAYOUTS = ("fully_reshardable", "dp_reshardable")
SUPPORTED = ("Megatron-Core torch_dist checkpoints (metadata.json sharded_backend torch_dist) with the "
             "fully_reshardable or dp_reshardable distributed-optimizer layout")
TIED = ("output_layer.weight", "embedding.word_embeddings.weight")
GROUPS_REFUSAL = ("Megatron's param groups (common.pt) do not say which parameter is in which group; the masters "
                  "and moments read exactly, and convert carries them once --groups states the groups (DeepSpeed "
                  "files: zckpt convert PATH --to deepspeed --world-size N --groups megatron-default ...)")
_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


# ------------------------------------------------------------------------------------------------ finding it

def locate(path: str, tag: str | None, opts) -> tuple[str, str, bool]:
    """(save folder, iteration folder, whether the save folder's latest file was read)."""
    path = str(path).rstrip("/") or "/"
    if not storage.exists(path, opts):
        raise CheckpointNotFound("no such file or folder", path=path)
    latest = storage.join(path, LATEST)
    if _isfile(latest, opts):
        named_by = "the tag given" if tag is not None else LATEST
        if tag is None:
            text = storage.read_bytes(latest, opts).decode("utf-8", "replace").strip()
            if text == "release":
                tag = "release"
            elif text.isdigit():
                tag = f"iter_{int(text):07d}"
            else:
                raise CorruptFile(f"{LATEST} holds {text[:40]!r}, not an iteration", path=latest)
        elif tag.isdigit():
            tag = f"iter_{int(tag):07d}"
        if not (ITER_RE.match(tag) or tag == "release"):
            raise InvalidArgument(f"tag {tag!r} is not a Megatron iteration folder (iter_NNNNNNN)", path=path,
                                  hint="pass --tag iter_0000100 (or the iteration number)")
        folder = storage.join(path, tag)
        if not storage.exists(folder, opts):
            raise IncompleteCheckpoint(f"{folder}: missing: the iteration folder {named_by} names", path=folder)
        return path, folder, True
    if not ITER_RE.match(storage.basename(path)):  # a save folder without its latest file
        iters = _iterations(path, opts)
        if tag is None:
            raise IncompleteCheckpoint(f"a Megatron save folder without {LATEST} (iterations: {', '.join(iters)}); "
                                       "the last save may not have finished", path=path,
                                       hint=f"pick one with `tag`, e.g. `tag`={iters[-1]}, or pass its folder")
        tag = f"iter_{int(tag):07d}" if tag.isdigit() else tag
        if tag not in iters:
            raise InvalidArgument(f"no iteration folder {tag!r} with Megatron's {META_JSON} here", path=path,
                                  hint=f"choose one of {', '.join(iters)}")
        return path, storage.join(path, tag), False
    if tag is not None:
        raise InvalidArgument("`tag` picks an iteration of a Megatron save folder; this is one iteration folder",
                              path=path, hint="drop `tag`, or pass the save folder")
    return storage.parent(path), path, False


def _backend(folder: str, opts) -> None:
    """Refuse, in one line, every Megatron layout but torch_dist."""
    meta = storage.join(folder, META_JSON)
    if not _isfile(meta, opts):
        names = storage.listdir(folder, opts)
        legacy = sorted(n for n in names if n.startswith("mp_rank_"))
        if legacy:
            raise UnsupportedLayout(f"{storage.join(folder, legacy[0], 'model_optim_rng.pt')}: Megatron's legacy "
                                    f"'torch' checkpoint format; zckpt reads {SUPPORTED}", path=folder,
                                    hint="re-save with --ckpt-format torch_dist (--ckpt-convert-format)")
        raise IncompleteCheckpoint(f"{meta}: missing: Megatron writes it with every distributed checkpoint",
                                   path=meta, hint="use the folder of a finished save")
    try:
        doc = json.loads(storage.read_bytes(meta, opts))
    except (ValueError, UnicodeDecodeError):
        raise CorruptFile(f"{META_JSON} is not JSON", path=meta) from None
    backend = doc.get("sharded_backend") if isinstance(doc, dict) else None
    if backend != "torch_dist":
        raise UnsupportedLayout(f"{meta}: sharded_backend {str(backend)[:40]!r}; zckpt reads {SUPPORTED}",
                                path=meta)


# ------------------------------------------------------------------------------------------------ facts

def _args(common: dict) -> dict:
    args = common.get("args")
    if isinstance(args, Inert):
        return {k: v for k, v in vars(args).items() if not k.startswith("_")}
    return dict(args) if isinstance(args, dict) else {}


def _int(v):
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v):
    """A number the args hold (int or float, not a bool), else None."""
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def facts(common: dict, md: dcpmeta.DcpMetadata, ranks: list[int]) -> dict:
    """What the files say about the run: from the args Megatron-LM saves, ``content_metadata`` and the names of
    the rng-state shards; a value the files do not hold is None (never guessed)."""
    a = _args(common)
    content = common.get("content_metadata") if isinstance(common.get("content_metadata"), dict) else {}
    optim = common.get("optimizer") if isinstance(common.get("optimizer"), dict) else {}
    tp, pp = _int(a.get("tensor_model_parallel_size")), _int(a.get("pipeline_model_parallel_size"))
    rng = [m for k in md.values if (m := _RNG_RE.match(k))]
    if rng:
        tp = tp or int(rng[0].group(4))
        pp = pp or int(rng[0].group(3))
    # the sizes the args state, never counted from the .distcp files (a save by one writer is not one rank)
    world, dp = _int(a.get("world_size")), _int(a.get("data_parallel_size"))
    if dp is None and tp and pp and world and world % (tp * pp) == 0:
        dp = world // (tp * pp)
    if world is None and tp and pp and dp:
        world = tp * pp * dp
    untie = a.get("untie_embeddings_and_output_weights")
    layout = content.get("distrib_optim_sharding_type") or optim.get("param_state_sharding_type") or \
        (optim.get(0) or {}).get("param_state_sharding_type")  # (a chain: per optimizer)
    return {
        "tp": tp, "pp": pp, "dp": dp, "world_size": world,
        "num_layers": _int(a.get("num_layers")), "hidden_size": _int(a.get("hidden_size")),
        "num_attention_heads": _int(a.get("num_attention_heads")),
        # grouped-query attention as the args say it: off means one group per head, unsaid means unknown
        "num_query_groups": (_int(a.get("num_query_groups")) if a.get("group_query_attention") is True else
                             _int(a.get("num_attention_heads")) if a.get("group_query_attention") is False else None),
        "kv_channels": _int(a.get("kv_channels")), "ffn_hidden_size": _int(a.get("ffn_hidden_size")),
        "vocab_size": _int(a.get("padded_vocab_size")),
        "swiglu": a.get("swiglu") if isinstance(a.get("swiglu"), bool) else None,
        "tied": (not untie) if isinstance(untie, bool) else None,
        "normalization": a.get("normalization"), "position_embedding_type": a.get("position_embedding_type"),
        "add_bias_linear": a.get("add_bias_linear") if isinstance(a.get("add_bias_linear"), bool) else None,
        "params_dtype": a.get("params_dtype"), "max_position_embeddings": _int(a.get("max_position_embeddings")),
        # Megatron-LM >= 0.14 saves --norm-epsilon as TransformerConfig's layernorm_epsilon; older ones norm_epsilon
        "norm_epsilon": _num(a.get("layernorm_epsilon")) if _num(a.get("layernorm_epsilon")) is not None
        else _num(a.get("norm_epsilon")), "rotary_base": _num(a.get("rotary_base")),
        "rotary_percent": _num(a.get("rotary_percent")),
        "iteration": _int(common.get("iteration")) if _int(common.get("iteration")) is not None
        else _int(a.get("iteration")),
        "run": run_facts(a),
        "optimizer_layout": layout, "checkpoint_version": common.get("checkpoint_version"),
        "content_metadata": dict(content), "has_args": bool(a), "moe": moe.facts(a),
    }


#: what Megatron-LM's args say about the run (``info``'s "run"), each as saved; absent ones are left out
RUN_FACTS = ("consumed_train_samples", "train_iters", "train_samples", "global_batch_size", "micro_batch_size",
             "seq_length", "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "weight_decay", "clip_grad",
             "attention_backend", "transformer_impl", "tokenizer_type", "vocab_size", "make_vocab_size_divisible_by",
             "ckpt_format", "exit_signal", "model_type", "seed")


def _plain_value(v):
    """An args value as info shows it: an enum stand-in by its member's name, a dtype by its name."""
    if isinstance(v, safeload.EnumValue) or hasattr(type(v), "_members"):  # an enum stand-in
        return getattr(v, "name", None) or repr(v)
    if isinstance(v, (list, tuple)):
        return [_plain_value(x) for x in v]
    return v if isinstance(v, (str, int, float, bool)) or v is None else repr(v)


def run_facts(args: dict) -> dict:
    return {k: _plain_value(args[k]) for k in RUN_FACTS if k in args}


def check_extra_state(key: str, value, path: str | None = None) -> None:
    """``_extra_state`` of the local spec is ``[None]`` (or None): dropped. Anything else is TransformerEngine's
    (FP8 scaling factors and history), which no other format holds: refused, never dropped silently."""
    if value is None or (isinstance(value, list) and all(v is None for v in value)):
        return
    raise UnsupportedLayout(f"'{key}' holds TransformerEngine extra state (FP8 metadata), which zckpt cannot carry "
                            "into another format", path=path,
                            hint="save from a model without FP8 (--fp8-format unset), or with the local spec")


def _extra_states(items: distcp.Items, md: dcpmeta.DcpMetadata, mpath: str) -> int:
    n, memo = 0, {}
    for key, v in md.values.items():
        if "._extra_state" not in key:
            continue
        try:
            value = items.load(v.file, v.offset, v.length, memo)  # (identical objects parsed once)
        except UnsafePickle:
            value = "TE"
        check_extra_state(key, value, mpath)
        n += 1
    return n


# ------------------------------------------------------------------------------------------------ records

_SIZES, _LENGTH = operator.attrgetter("sizes"), operator.attrgetter("length")


class _Tensors:
    """Pieces of ranges of a DCP tensor (each chunk's zip read once)."""

    def __init__(self, items: distcp.Items, mpath: str):
        self.items, self.mpath, self.cache, self.learned = items, mpath, {}, set()

    def pieces(self, te: dcpmeta.TensorEntry, start: int = 0, length: int | None = None) -> list:
        return dcp_pieces(self.items, te, self.mpath, start, length, self.cache.setdefault(te.key, {}))

    def learn(self, te: dcpmeta.TensorEntry) -> None:
        """Learn the layout of each kind of chunk ``te`` has (one item read per dtype, chunk size and item length:
        a damaged one is refused at open; the others are checked against it when their bytes are read)."""
        if te.key in self.learned:
            return
        self.learned.add(te.key)
        if te.runs is None and te.grid is None:
            cut(te, self.mpath)
        chunks = te.chunks  # (a chunk of each (size, item length), found in C loops: 10**5 chunks per tensor)
        for c in dict(zip(zip(map(_SIZES, chunks), map(_LENGTH, chunks)), chunks)).values():
            self.items.layout(te, c)


def _pieces_of(tensors: _Tensors, entries: list, start: int, per: int) -> tuple[list, ...]:
    """A :class:`DeferredRecord`'s build: the pieces of ``[start, start + per)`` of each of ``entries`` (its value;
    or its master and both moments)."""
    lists = [tensors.pieces(te, start, per) for te in entries]
    return tuple(lists + [[], []][:3 - len(lists)])


_CHAINED_RE = re.compile(r"^chained_\d+\.optimizer\.")  # a mixture-of-experts model's two optimizers' keys


def _model_keys(md: dcpmeta.DcpMetadata) -> list[str]:
    return [k for k in md.tensors if not k.startswith(("optimizer.", "rng_state")) and not _CHAINED_RE.match(k)]


def _entries(md: dcpmeta.DcpMetadata, f: dict, mpath: str) -> list[tuple]:
    """(record name, model key, layer or None, shape, flat start, numel), in model order: embedding, the layers
    (an MoE layer's experts one record per expert and parameter: :mod:`zckpt.megatron.moe`), the rest."""
    out = []
    num_layers = f["num_layers"]
    order = {k: i for i, k in enumerate(md.tensors)}
    for key in _model_keys(md):
        te = md.tensors[key]
        if moe.is_expert_key(key):
            out += moe.entries(key, tuple(te.shape), num_layers, (f.get("moe") or {}).get("num_experts"), mpath)
        elif key.startswith(LAYERS) and not key[len(LAYERS):].split(".", 1)[0].isdigit():
            if not te.shape or (num_layers is not None and te.shape[0] != num_layers):
                raise UnsupportedLayout(f"'{key}' has size {list(te.shape)}: not stacked over the "
                                        f"{num_layers} layers the args name", path=mpath)
            rest, per = key[len(LAYERS):], te.numel // te.shape[0]
            out += [(f"{LAYERS}{i}.{rest}", key, i, tuple(te.shape[1:]), i * per, per) for i in range(te.shape[0])]
        else:
            out.append((key, key, None, tuple(te.shape), 0, te.numel))

    def rank(e):
        name = e[0]
        if name.startswith(LAYERS):
            return (1, int(name[len(LAYERS):].split(".", 1)[0]), order[e[1]])
        return (0 if name.startswith("embedding.") else 2, 0, order[e[1]])
    return sorted(out, key=rank)


def _records(tensors: _Tensors, md: dcpmeta.DcpMetadata, f: dict, mpath: str) -> list[TensorRecord]:
    """The model's records, their pieces built when first read (:class:`DeferredRecord`: ``info`` of 10**6 chunks
    places none); every chunk layout they use is learned here, at open (:meth:`_Tensors.learn`)."""
    fully = f["optimizer_layout"] == "fully_reshardable"
    records = []
    for name, key, layer, shape, start, per in _entries(md, f, mpath):
        te = md.tensors[key]
        tensors.learn(te)
        # (a router's expert_bias, --moe-router-enable-expert-bias, is a persistent buffer: no optimizer state)
        kind = "buffer" if moe.is_buffer(name) else "trainable"
        state = {k: md.tensors.get(f"{OPTIM_STATE}{k}.{key}") for k in STATE_KEYS}
        if fully and any(state.values()):
            for k, s in state.items():
                if s is None or tuple(s.shape) != tuple(te.shape):
                    raise CorruptFile(f"'{key}': optimizer.state.{k} is " + (
                        "missing" if s is None else f"of size {list(s.shape)}, the weight {list(te.shape)}"),
                        path=mpath)
                tensors.learn(s)
            entries = [state["param"], state["exp_avg"], state["exp_avg_sq"]]
            dtype, state_dtype = state["param"].dtype, state["exp_avg"].dtype
        else:
            entries, dtype, state_dtype = [te], te.dtype, None
        rec = DeferredRecord(name, shape, kind, dtype, lp_dtype=te.dtype if kind == "trainable" else None,
                             build=partial(_pieces_of, tensors, entries, start, per), state_dtype=state_dtype,
                             path=mpath)
        records.append(rec)
    names = {r.name for r in records}
    if f["tied"] and TIED[0] not in names and TIED[1] in names:
        src = next(r for r in records if r.name == TIED[1])
        records.append(TensorRecord(TIED[0], src.shape, "tied", src.dtype, tied_to=TIED[1]))
    return records


_DP_OPTIM_RE = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.optimizer/shard_0_1$")


def _dp_optimizer(items: distcp.Items, md: dcpmeta.DcpMetadata, mpath: str) -> dict | None:
    """``dp_reshardable``: the optimizer's non-parameter state (param groups with Adam's step), saved as one
    sharded object per model-parallel rank, not in common.pt; None when the ranks' objects disagree or are
    missing (then no step is known). A mixture-of-experts model has two optimizers (``chained_0``: the dense
    parameters, ``chained_1``: the experts'): their param groups in that order."""
    found: dict[int, list] = {}
    for key, v in md.values.items():
        if m := _DP_OPTIM_RE.match(key):
            try:
                value = items.load(v.file, v.offset, v.length)
            except UnsafePickle as e:
                raise UnsafePickle(f"Megatron optimizer object '{key}' in {v.file}: {e.message}", path=e.path,
                                   hint="zckpt never runs code from checkpoints; Megatron's distributed-optimizer "
                                        "objects hold param groups of plain values, nothing else") from None
            if isinstance(value, list) and len(value) == 1:  # a sharded object's value, as Megatron wraps it
                value = value[0]
            if not isinstance(value, dict):
                raise CorruptFile(f"'{key}' does not hold the optimizer's state dict", path=mpath)
            found.setdefault(int(m.group(1) or 0), []).append(value)
    if not found or sorted(found) != list(range(len(found))) or \
            any(v != vs[0] for vs in found.values() for v in vs[1:]):
        return None
    if len(found) == 1:
        return found[0][0]
    groups = [found[c][0].get("param_groups") for c in sorted(found)]
    return {"param_groups": [g for gs in groups for g in gs]} if all(isinstance(g, list) for g in groups) else None


def _step(common: dict) -> tuple[list[dict], object]:
    """The param groups' hyperparameters in common.pt (fully_reshardable) and their one Adam step (None when
    they disagree or are not saved)."""
    optim = common.get("optimizer") if isinstance(common.get("optimizer"), dict) else {}
    # a chain (an MoE model's dense 0, experts 1): in order
    if optim and all(isinstance(k, int) for k in optim) and sorted(optim) == list(range(len(optim))):
        parts = [((optim[i] or {}).get("optimizer") or {}).get("param_groups") if isinstance(optim[i], dict) else None
                 for i in range(len(optim))]
        groups = [g for p in parts for g in p] if all(isinstance(p, list) for p in parts) else None
    else:
        groups = (optim.get("optimizer") or {}).get("param_groups")
    groups = [dict(g) for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []
    steps = {g.get("step") for g in groups}
    step = steps.pop() if len(steps) == 1 else None
    return groups, (int(step) if isinstance(step, float) and step.is_integer() else step)


# ------------------------------------------------------------------------------------------------ read

def read(path: str, tag: str | None = None, storage_options: dict | None = None) -> Checkpoint:
    """The opener's read: the iteration ``latest_checkpointed_iteration.txt`` names (``tag``: another
    ``iter_NNNNNNN``, or its number), or the iteration folder given; metadata only."""
    opts = storage_options
    save_dir, folder, has_latest = locate(path, tag, opts)
    _backend(folder, opts)
    common_path, mpath = storage.join(folder, COMMON), storage.join(folder, METADATA)
    if not _isfile(mpath, opts):
        raise IncompleteCheckpoint(f"{mpath}: missing: DCP's .metadata (written last by the save: it did not "
                                   "finish)", path=mpath, hint="use the folder of a finished save")
    sizes = storage.file_sizes(folder, opts)  # one listing (on S3 one LIST, not two HEADs per file)
    links.check([mpath] + ([common_path] if COMMON in sizes else []), folder)
    data = storage.read_bytes(mpath, opts)
    try:
        md = dcpmeta.read_metadata(data, mpath, {n: s for n, s in sizes.items() if n != METADATA})
    except CorruptFile:  # an expert's chunk missing or twice, or its data file gone: named by layer and expert
        moe.diagnose(data, mpath, {n: s for n, s in sizes.items() if n != METADATA})
        raise
    links.check([storage.join(folder, n) for n in md.files], folder)
    if COMMON in sizes:  # megatron-core <= 0.18: rank 0's torch.save beside the DCP files
        common = load_common(common_path, opts)
    elif COMMON_ITEM in md.values:  # 0.19+: the same dict as a sharded object in the DCP (docs/megatron.md)
        common = _common_item(folder, opts, md)
    else:
        raise IncompleteCheckpoint(f"{common_path}: missing: common.pt (the non-sharded state, written by rank 0; "
                                   f"megatron-core 0.19+ keeps it as '{COMMON_ITEM}' in .metadata, absent too)",
                                   path=common_path, hint="use the folder of a finished save")
    if not isinstance(common, dict):
        raise CorruptFile(f"{COMMON if COMMON in sizes else COMMON_ITEM} does not hold a dict", path=common_path)
    with metadata_errors(mpath), safeload.gc_paused():  # 10**5-10**7 pieces built, no garbage: no collector pass
        return _build(path, save_dir, folder, has_latest, opts, md, common, sizes)


COMMON_REFUSAL = ("zckpt never runs code from checkpoints; Megatron-LM's common state (common.pt; in megatron-core "
                  "0.19 the DCP object common_state) holds its args (plain values, torch dtypes and the "
                  "megatron-core enums zckpt knows), iteration and optimizer layout, nothing else")


COMMON_ITEM = "common_state/shard_0_1"  # megatron-core 0.19+ (dist_checkpointing/serialization.py, save)


def _common_item(folder: str, opts, md: dcpmeta.DcpMetadata) -> dict:
    """The common state a megatron-core 0.19+ save keeps in the DCP: one ShardedObject ``common_state`` (global
    shape (1,)) whose item is a torch.save of ``[state_dict]``, read through the allow-list (its zip CRCs checked)."""
    v = md.values[COMMON_ITEM]
    items = distcp.Items(folder, opts)
    try:
        value = items.load(v.file, v.offset, v.length)
    except UnsafePickle as e:
        raise UnsafePickle(f"Megatron common state ('{COMMON_ITEM}' in {v.file}): {e.message}",
                           path=storage.join(folder, v.file), hint=COMMON_REFUSAL) from None
    finally:
        items.close()
    if not (isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict)):
        raise CorruptFile(f"'{COMMON_ITEM}' does not hold [dict], as megatron-core saves its common state",
                          path=storage.join(folder, v.file))
    return value[0]


def load_common(common_path: str, opts=None):
    """common.pt through the allow-list; a global outside it is refused as not what Megatron-LM saves."""
    try:
        return safeload.load(common_path, storage_options=opts)
    except UnsafePickle as e:
        raise UnsafePickle(f"Megatron common.pt: {e.message}", path=common_path, hint=COMMON_REFUSAL) from None


def _build(path, save_dir, folder, has_latest, opts, md, common, sizes) -> Checkpoint:
    mpath = storage.join(folder, METADATA)
    ranks = sorted({int(m.group(1)) for n in md.files if (m := _DATA_RE.match(n))})
    f = facts(common, md, ranks)
    layout = f["optimizer_layout"]
    if layout not in READ_LAYOUTS:
        raise UnsupportedLayout(f"{storage.join(folder, COMMON)}: distributed-optimizer layout {str(layout)[:40]!r}; "
                                f"zckpt reads {SUPPORTED}", path=folder)
    if not _model_keys(md):
        raise CorruptFile("no model tensors in .metadata", path=mpath)
    experts_saved = f["moe"] or any(moe.is_expert_key(k) for k in md.tensors)
    if experts_saved:
        moe.check_supported(list(md.tensors), f["moe"], mpath)
    items = distcp.Items(folder, opts)
    placed, bucket_error, layers = None, None, None
    try:
        # the objects the open reads whole (each module's extra state, the dp_reshardable optimizer objects) in
        # a few reads per data file, not one per object (DCP writes a file's objects together, before its tensors)
        items.prefetch([(v.file, v.offset, v.length) for k, v in md.values.items()
                        if "._extra_state" in k or _DP_OPTIM_RE.match(k)])
        n_extra = _extra_states(items, md, mpath)
        tensors = _Tensors(items, mpath)
        records = _records(tensors, md, f, mpath)
        if experts_saved:  # every expert once, with its value and state, and the routers (or refused here)
            layers = moe.coverage(records, f["moe"], mpath)
        if layout == "dp_reshardable":
            optim = common.get("optimizer") if isinstance(common.get("optimizer"), dict) else {}
            common = {**common, "optimizer": {**optim, "optimizer": _dp_optimizer(items, md, mpath)}}
            try:  # metadata only: where each parameter's state sits in the buckets, or why not
                placed = buckets.place(records, md, f, _args(common), tensors, mpath)
            except (UnsupportedLayout, CorruptFile) as e:
                bucket_error = e
            if placed and layers:
                moe.check_placed(layers, records, placed, mpath)
    finally:
        items.close()
    groups, step = _step(common)
    notes = ["names are Megatron's (decoder.layers.<i>.<...>, TE-style fused norm names as saved); "
             "stacked layers split per layer"]
    if bucket_error is not None:
        refusal = str(bucket_error)
        notes.append("optimizer state not read: " + refusal)
    else:
        refusal = GROUPS_REFUSAL
        if placed:
            notes.append("optimizer state in dp_reshardable buckets, placed by megatron-core's layout rule (checked "
                         "against the saved weights when carried)")
        notes.append("param groups unknown: " + GROUPS_REFUSAL)
    if f["tied"] is None and TIED[0] not in {r.name for r in records}:
        notes.append("no output_layer.weight and no args saying whether it is tied: none assumed")
    elif f["tied"] and any(r.kind == "tied" for r in records):
        notes.append(f"tied: {TIED[0]} -> {TIED[1]} (args: untie_embeddings_and_output_weights false)")
    data_files = [RankFile(storage.join(folder, n), n, "data", None, 0, sizes.get(n, -1)) for n in md.files]
    data_files += [RankFile(storage.join(folder, METADATA), METADATA, "metadata", None, 0, sizes.get(METADATA, -1))]
    if COMMON in sizes:  # 0.19+ saves keep the common state in the DCP (COMMON_ITEM)
        data_files.append(RankFile(storage.join(folder, COMMON), COMMON, "common", None, 0, sizes[COMMON]))
    loc = Location(str(path).rstrip("/") or "/", save_dir, storage.basename(folder), folder, None,
                   data_files=data_files, has_latest=has_latest, storage_options=opts)
    masters = sorted({r.dtype for r in records if r.kind == "trainable"}) or ["float32"]
    precision = "bf16" if _args(common).get("bf16") else "fp16" if _args(common).get("fp16") else \
        _PRECISION.get(masters[0], masters[0])
    merge_notes = ["tensor names are Megatron's (decoder.layers.<i>.self_attention.linear_qkv.weight...), not a "
                   "Hugging Face model's: the folder holds the weights, not a transformers model"]
    if layers:
        notes.append(f"MoE: {len(layers)} layer(s) x {layers[0]['experts']} experts (SequentialMLP, expert-parallel "
                     f"size {f['moe'].get('ep', '?')}), one record per expert and parameter "
                     "(decoder.layers.<i>.mlp.experts.experts.<e>.<param>, e global)")
    extra = {"metadata": md, "megatron": f, "merge_notes": merge_notes, "param_groups": groups, "step": step,
             **({"moe_coverage": layers} if layers else {}),
             # dp_reshardable: every expert's master and moments placed in the expert buckets (moe.check_placed)
             # (fully_reshardable: each expert's value is its master, checked with both moments by coverage)
             **({"moe_states": ["master", "exp_avg", "exp_avg_sq"]} if layers and (placed or (
                 layout == "fully_reshardable" and any(r.exp_avg for r in records))) else {}),
             # what each item of an expert's bytes holds, by layer and expert (verify --deep names damage so)
             **({"item_names": moe.item_names(md, placed)} if layers else {}),
             "extra_states": n_extra, "args": _args(common), "buckets": placed, "bucket_error": bucket_error,
             "common": {k: common[k] for k in ("opt_param_scheduler", "num_floating_point_operations_so_far")
                        if k in common},
             "other": [k for k in list(md.tensors) + list(md.values)
                       if k.startswith(("optimizer.", "rng_state", "rerun_state_machine_state", "common_state"))]}
    return Checkpoint(loc, 0, "megatron", precision, f["world_size"] or len(ranks), records, [], {}, [], [],
                      notes=notes, format=FORMAT, extra=extra, state_refusal=refusal,
                      reshard_refusal="zckpt reshard re-partitions DeepSpeed checkpoints; DeepSpeed files of this "
                                      "one: zckpt convert PATH --to deepspeed --world-size N --groups "
                                      "megatron-default ...; `zckpt merge` gives the consolidated weights")
