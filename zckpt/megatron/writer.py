"""Megatron-Core ``torch_dist`` written from the training-state model: a Megatron-LM save folder that
megatron-core's ``dist_checkpointing.load`` resumes at any TP / PP / DP (fixtures/megatron/README.md draws the
files)::

    OUT/latest_checkpointed_iteration.txt   the iteration, written last
    OUT/iter_NNNNNNN/.metadata              PyTorch DCP metadata (:mod:`zckpt.engine.dcplayout`, shared with DCP)
    OUT/iter_NNNNNNN/__I_0.distcp           one torch.save zip per tensor chunk or object
    OUT/iter_NNNNNNN/common.pt              args, iteration, the optimizer's param groups (Adam's step in them),
                                            the scheduler, counters, content metadata
    OUT/iter_NNNNNNN/metadata.json          {"sharded_backend": "torch_dist", ...}

Layout ``fully_reshardable`` (the default): every tensor in model space under its global key, as Megatron's
``DistributedOptimizer.sharded_state_dict(..., 'fully_reshardable')`` saves it: the model weights as the source saved
them (stacked layers: one key with a leading layer axis, TE-style norm names), and per parameter
``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`` (fp32 master and both moments); nothing depends on the
ranks that load it, so megatron-core reshards it on load to any TP / PP / DP. The target TP / PP are checked
against the model (vocabulary, heads, query groups, FFN divisible by TP; layers by PP: no uneven stages) and
stated in the args, so that Megatron-LM knows whether its RNG states apply (none are carried: ``no_save_rng``).
Layout ``dp_reshardable`` (Megatron-LM's default): the same model keys, the optimizer state as the distributed
optimizer's flat DDP buckets for one TP / PP and a data-parallel size (:mod:`zckpt.megatron.writer_buckets`).

A mixture-of-experts model (SequentialMLP experts) is written ``fully_reshardable`` for the expert-parallel size
``ep`` (:mod:`zckpt.megatron.writer_moe`: the experts in model space, ``common.pt``'s optimizer for that size).

Sources: a Megatron checkpoint read by :mod:`zckpt.megatron.reader`, either layout (``dp_reshardable`` state placed
by :mod:`zckpt.megatron.buckets`, checked against the saved weights). Refused in one line, nothing written: an
optimizer other than Adam, a checkpoint without optimizer state, a model the target TP / PP cannot split evenly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from zckpt.encoding import distcp
from zckpt.engine import dcplayout, torchzip
from zckpt.encoding.enums import NamedEnum, NamedStrEnum
from zckpt.engine.torchzip import GlobalRef, NewObj, Reduce, TensorOut
from zckpt.errors import InvalidArgument, OptionError, UnsupportedLayout
from zckpt.io import storage
from zckpt.megatron import moe, writer_moe
from zckpt.megatron.reader import COMMON, LATEST, LAYERS, META_JSON, OPTIM_STATE
from zckpt.state.model import Checkpoint, dcp_pieces

LAYOUTS = ("fully_reshardable", "dp_reshardable")
META_DOC = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}
_DROP_ARGS = ("world_size", "data_parallel_size")  # the source's; dp_reshardable states the output's (Ddp.args)
_GROUP_DROP = ("params",)  # a fully_reshardable save's param groups carry no params (Megatron fills them on load)


@dataclass
class MegatronPlan:
    """What ``convert --to megatron`` writes (plain data; :func:`zckpt.engine.run.run_convert` writes it):
    ``parts``: the iteration folder's DCP layout (``common.pt`` placed as one more file of it); ``written``: small
    files written after the parts' ``.metadata`` (``metadata.json``, then ``latest_checkpointed_iteration.txt``)."""

    source: str
    tag: str
    source_format: str
    parts: list
    written: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    layout: str = "fully_reshardable"
    tp: int = 1
    pp: int = 1
    copies: list = field(default_factory=list)
    carried: list = field(default_factory=list)
    not_carried: dict = field(default_factory=dict)
    to: str = "megatron"
    optimizer: str = ""  # (DCP's adam_mode: Megatron's param groups say decoupled_weight_decay themselves)
    stated: dict | None = None  # what --megatron-args made (a run Megatron did not train): --json's megatron_args
    dp: int | None = None  # dp_reshardable: the data-parallel size the buckets are cut for
    ddp: dict | None = None  # dp_reshardable: the DDP facts they were laid out for (writer_buckets.Ddp.summary)
    ep: int | None = None  # a mixture-of-experts model: the expert-parallel size common.pt's optimizer is for

    @property
    def total_bytes(self) -> int:
        return sum(p.total_bytes for _, p in self.parts) + sum(len(d) for _, d in self.written)

    def summary(self) -> dict:
        files = []
        for folder, part in self.parts:
            files += [{"name": f"{folder}/{f.name}", "bytes": f.size} for f in part.files]
            files.append({"name": f"{folder}/{part.commit_name}", "bytes": len(part.metadata)})
        files += [{"name": rel, "bytes": len(data)} for rel, data in self.written]
        return {"source": self.source, "tag": self.tag, "from": self.source_format, "to": "megatron",
                "layout": self.layout, "optimizer": self.optimizer, "tp": self.tp, "pp": self.pp,
                "keys": sum(len(p.items) for _, p in self.parts), "total_bytes": self.total_bytes,
                "payload_bytes": sum(p.payload_bytes for _, p in self.parts), "files": files, "notes": self.notes,
                "carried": self.carried, "not_carried": self.not_carried, "megatron_args": self.stated,
                "dp": self.dp, "ddp": self.ddp, "ep": self.ep}


def positive(name: str, value) -> int:
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgument(f"--{name} must be a positive integer, got {value!r}")
    return value


def padded_vocab(args: dict, tp: int) -> tuple[int | None, int | None]:
    """(the multiple Megatron-LM pads the vocabulary to at ``tp``, the padded size it comes to) from the saved args:
    ``make_vocab_size_divisible_by`` x TP (``_vocab_size_with_padding``); the size only where the args hold the
    tokenizer's own (``NullTokenizer``: ``vocab_size`` + 1), else None."""
    div = args.get("make_vocab_size_divisible_by")
    if not isinstance(div, int) or isinstance(div, bool) or div < 1:
        return None, None
    multiple = div * tp
    orig = args.get("vocab_size")
    if args.get("tokenizer_type") != "NullTokenizer" or not isinstance(orig, int) or isinstance(orig, bool):
        return multiple, None
    return multiple, -(-(orig + 1) // multiple) * multiple


def check_target(f: dict, tp: int, pp: int, path: str, args: dict | None = None) -> None:
    """The model splits evenly at ``tp`` / ``pp`` (what megatron-core asserts when it builds the model), and the
    vocabulary Megatron-LM pads again at ``tp`` comes to the saved size; or a one-line refusal naming the size that
    does not."""
    multiple, padded = padded_vocab(args or {}, tp)
    saved = f.get("vocab_size")
    if saved is not None and multiple is not None and (saved % multiple or (padded is not None and padded != saved)):
        raise UnsupportedLayout(f"the vocabulary does not pad to --tp {tp}: Megatron-LM pads it to a multiple of "
                                f"{multiple} (make_vocab_size_divisible_by x TP) = "
                                f"{padded if padded is not None else 'another size'}, the checkpoint holds {saved} "
                                "rows", path=path, hint="choose a TP at which the padded size is unchanged")
    need = {"padded_vocab_size (the vocabulary)": f.get("vocab_size"), "num_attention_heads": f.get("num_attention_heads"),
            "num_query_groups": f.get("num_query_groups"), "ffn_hidden_size": f.get("ffn_hidden_size"),
            "num_layers": f.get("num_layers")}
    missing = [k.split(" ")[0] for k, v in need.items() if v is None]
    if missing:
        raise UnsupportedLayout(f"the source does not say its {', '.join(missing)}, which a Megatron checkpoint's "
                                "args must hold", path=path)
    for what, n in list(need.items())[:4]:
        if n % tp:
            raise UnsupportedLayout(f"{what} {n} does not divide into --tp {tp}", path=path,
                                    hint="choose a TP that divides it (a checkpoint's padded vocabulary is fixed)")
    if f["num_layers"] % pp:
        raise UnsupportedLayout(f"{f['num_layers']} layers do not split evenly into --pp {pp} stages (uneven "
                                "pipeline stages are not written)", path=path, hint="choose a PP that divides them")


def _records_by_key(ckpt: Checkpoint, md, path: str) -> dict[str, list]:
    """Model key -> the records it holds, in order (a stacked key: one per layer; an MoE layer's experts: one per
    layer and expert)."""
    by_name = {r.name: r for r in ckpt.records}
    out = {}
    for key, te in md.tensors.items():
        if _not_model(key):
            continue
        if moe.is_expert_key(key):
            out[key] = writer_moe.records_by_key(key, tuple(te.shape), by_name, path)
        elif key.startswith(LAYERS) and not key[len(LAYERS):].split(".", 1)[0].isdigit():
            out[key] = [by_name.get(f"{LAYERS}{i}.{key[len(LAYERS):]}") for i in range(te.shape[0])]
        else:
            out[key] = [by_name.get(key)]
    return out


def _adam_state(ckpt: Checkpoint, path: str) -> None:
    args = ckpt.extra.get("args") or {}
    if args.get("fp16") is True:
        raise UnsupportedLayout("an fp16 run: its loss scaler's state is not carried", path=path,
                                hint="convert a bf16 or fp32 run's checkpoint")
    opt = args.get("optimizer")
    if opt is not None and opt != "adam":
        raise UnsupportedLayout(f"the run's optimizer is {opt!r}: only Adam's state (exp_avg, exp_avg_sq) is "
                                "written", path=path)
    stateful = [r for r in ckpt.records if r.kind == "trainable" and r.exp_avg]
    if not stateful or not ckpt.extra.get("param_groups"):
        raise UnsupportedLayout("the checkpoint holds no optimizer state (masters, moments and param groups) to "
                                "carry", path=path, hint="zckpt merge writes the weights")
    if ckpt.extra.get("step") is None:
        raise UnsupportedLayout("the param groups do not agree on Adam's step", path=path)


def plan_megatron(ckpt: Checkpoint, checkpoint_id: str | None = None, tp: int | None = None, pp: int | None = None,
                  layout: str | None = None, chunk_bytes: int = dcplayout.CHUNK_BYTES,
                  file_bytes: int = dcplayout.FILE_BYTES, dp: int | None = None, ddp_config=None,
                  ep: int | None = None) -> MegatronPlan:
    """The save folder of ``ckpt`` (a Megatron checkpoint, either optimizer layout) for ``tp`` / ``pp`` (default:
    the source's), as plain data; ``checkpoint_id``: the output folder (DCP's ``storage_meta``); a tensor over
    ``chunk_bytes`` is stored as blocks of rows, a ``.distcp`` file closed past ``file_bytes``. ``layout``
    ``dp_reshardable``: the buckets for ``dp`` data-parallel ranks (default: the source's, at its own TP / PP) and
    the DDP settings ``ddp_config`` (:mod:`zckpt.megatron.writer_buckets`). ``ep``: a mixture-of-experts model's
    expert-parallel size (default: the source's; :mod:`zckpt.megatron.writer_moe`)."""
    path = ckpt.location.tag_dir
    layout = layout or "fully_reshardable"
    if layout not in LAYOUTS:
        raise InvalidArgument(f"unknown Megatron layout {layout!r}", hint=f"choose one of {', '.join(LAYOUTS)}")
    check_dp_options(layout, dp, ddp_config)
    if ckpt.format != "megatron":
        raise UnsupportedLayout(f"--to megatron reads a Megatron, DCP or DeepSpeed checkpoint; this is {ckpt.format}",
                                path=path)
    f = ckpt.extra["megatron"]
    tp = positive("tp", tp) if tp is not None else (f.get("tp") or 1)
    pp = positive("pp", pp) if pp is not None else (f.get("pp") or 1)
    args = ckpt.extra.get("args") or {}
    check_target(f, tp, pp, path, args)
    ep = writer_moe.target_ep(ckpt, ep, layout, path, pp)  # None: a dense model (--ep refused)
    if f.get("iteration") is None:
        raise UnsupportedLayout("common.pt does not say the iteration, which names the folder Megatron-LM loads",
                                path=path)
    if f["optimizer_layout"] == "dp_reshardable":
        from zckpt.megatron import buckets
        ckpt = buckets.attach(ckpt)  # raises why the buckets could not be placed; checked against the weights
    _adam_state(ckpt, path)
    md = ckpt.extra["metadata"]
    state: dict = {}
    items = distcp.Items(path, ckpt.storage_options)
    try:
        for key, te in md.tensors.items():  # the weights exactly as saved (stacked layers, TE-style norm names)
            if _not_model(key):
                continue
            pieces = dcp_pieces(items, te, storage.join(path, ".metadata"))
            state[key] = TensorOut(te.dtype, tuple(te.shape), pieces)
        extra = {k: items.load(v.file, v.offset, v.length) for k, v in md.values.items() if "._extra_state" in k}
    finally:
        items.close()
    for key, recs in _records_by_key(ckpt, md, path).items():
        if any(r is None for r in recs):
            raise UnsupportedLayout(f"'{key}': the reader holds no record for each of its layers", path=path)
        with_state = [bool(r.exp_avg) for r in recs]
        if not any(with_state):
            continue  # a weight without optimizer state (frozen in the run)
        if not all(with_state):
            raise UnsupportedLayout(f"'{key}': some layers have optimizer state and some do not", path=path)
        te = md.tensors[key]
        for name, pieces in (("param", lambda r: r.value), ("exp_avg", lambda r: r.exp_avg),
                             ("exp_avg_sq", lambda r: r.exp_avg_sq)):
            segs = [p for r in recs for p in pieces(r)]
            state[f"{OPTIM_STATE}{name}.{key}"] = TensorOut("float32", tuple(te.shape), segs)
    for key, value in extra.items():  # the local spec's [None] (the reader refuses TransformerEngine's)
        state[key] = value
    bucket_notes, ddp = [], None
    if layout == "dp_reshardable":
        if dp is None and (tp, pp) == (f.get("tp"), f.get("pp")):
            dp = args.get("data_parallel_size")  # the source's own shape
        bucket_notes, ddp = dp_buckets(state, md, ckpt, f, args, tp, pp, dp, ddp_config, path)
    folder = ckpt.location.tag
    iter_id = (checkpoint_id.rstrip("/") + "/" + folder) if checkpoint_id else None
    part = dcplayout.plan_dcp(state, iter_id, chunk_bytes, file_bytes)
    common, dropped = _common(ckpt, f, tp, pp, layout, ddp, ep)
    archive = torchzip.plan_archive(common, "common")
    part.files.append(dcplayout.DcpFile(COMMON, [(archive, 0)], archive.file_size))
    iteration = f.get("iteration")
    latest = str(iteration) if folder != "release" else "release"
    written = [(f"{folder}/{META_JSON}", json.dumps(META_DOC).encode()), (LATEST, latest.encode())]
    n_state = sum(1 for k in state if k.startswith(OPTIM_STATE)) // 3
    notes = [f"{layout}: {len([k for k in state if not k.startswith(OPTIM_STATE) and '/' not in k])} model keys as "
             f"saved, the fp32 master and both Adam moments of {n_state} in model space; loads at any TP/PP/DP",
             f"args state --tp {tp} --pp {pp}; RNG states not carried (no_save_rng: Megatron-LM reseeds)"]
    if layout == "dp_reshardable":
        notes[0] = f"{layout}: the model keys as saved, the fp32 masters and both Adam moments in the distributed " \
                   f"optimizer's buckets for tp {tp}, pp {pp}, dp {dp} (loads at this TP/PP, any DP megatron-core " \
                   "can shard the buckets over)"
    notes += bucket_notes + (writer_moe.notes(ckpt, ep) if ep is not None else [])
    if f["optimizer_layout"] == "dp_reshardable":
        notes.append("optimizer state read from the source's dp_reshardable buckets (placed by megatron-core's "
                     "layout rule, every master checked against its saved weight)")
    carried = ["model", "optimizer (masters, exp_avg, exp_avg_sq, step, param groups)", "opt_param_scheduler",
               "iteration", "consumed_train_samples", "num_floating_point_operations_so_far", "args"]
    left = _left_out(md, state)
    notes += [f"left out {what}: {why}" for what, why in left.items() if what != "rng_state"]
    if dropped:
        left[f"args.{{{','.join(dropped)}}}"] = "values zckpt cannot pickle again (Megatron-LM's loader compares none)"
        notes.append(f"left out args {', '.join(dropped)}: values zckpt cannot pickle again")
    return MegatronPlan(ckpt.location.input_path, folder, ckpt.format, [(folder, part)], written, notes, layout,
                        tp, pp, carried=carried, not_carried=left, dp=dp if ddp else None,
                        ddp=ddp.summary() if ddp else None, ep=ep)


def check_dp_options(layout: str, dp, ddp_config) -> None:
    """``dp`` / ``ddp_config`` shape ``dp_reshardable`` buckets: given for another layout, exit 2 naming them."""
    given = [n for n, v in (("--dp", dp), ("--ddp-config", ddp_config)) if v not in (None, "", {})]
    if given and layout != "dp_reshardable":
        raise OptionError(f"{' / '.join(given)} shape{'s' if len(given) == 1 else ''} the dp_reshardable layout's "
                          f"buckets; --layout {layout} has none", hint=f"drop {' / '.join(given)}")
    if dp is not None:
        positive("dp", dp)


def dp_buckets(state: dict, md, ckpt: Checkpoint, f: dict, args: dict, tp: int, pp: int, dp, ddp_config,
               path: str) -> tuple[list[str], object]:
    """``state``'s optimizer tensors laid out as ``dp_reshardable`` buckets (:mod:`zckpt.megatron.writer_buckets`),
    in place; its notes and the DDP facts (``writer_buckets.Ddp``)."""
    from zckpt.megatron import writer_buckets as wb
    swiglu = f.get("swiglu")
    if swiglu is None and tp > 1 and any(".linear_fc1." in k for k in state):
        raise UnsupportedLayout("the args do not say whether linear_fc1 is SwiGLU (gate and up shards per TP rank)",
                                path=path)
    weights = {md.tensors[k[len(OPTIM_STATE) + len("param."):]].dtype for k in state
               if k.startswith(OPTIM_STATE + "param.")}
    if len(weights) != 1:
        raise UnsupportedLayout(f"parameters of several dtypes {sorted(weights)}: more than one grad buffer",
                                path=path)
    ddp = wb.ddp_facts(args, wb.parse_ddp_config(ddp_config), dp, weights.pop(), path, list(md.tensors))
    step = float(ckpt.extra["step"])
    groups = [{**{k: v for k, v in g.items() if k not in _GROUP_DROP}, "step": step}
              for g in ckpt.extra["param_groups"]]
    return wb.to_dp_reshardable(state, bool(swiglu), bool(f.get("tied")), args, tp, pp, ddp, groups, path), ddp


_LEFT = {"rng_state": "per-rank RNG states of the source's ranks (Megatron-LM reseeds: args.no_save_rng)",
         "rerun_state_machine_state": "per-rank state of Megatron-LM's rerun machine (it starts afresh; Megatron-LM "
                                      "skips it when TP/PP change)"}
_REWRITTEN = ("optimizer.", "common_state/")  # the optimizer state in model space and common.pt replace these
_CHAINED = re.compile(r"^chained_\d+\.optimizer\.")  # an MoE model's two optimizers' dp_reshardable state


def _not_model(key: str) -> bool:
    """An optimizer or RNG key of the source's ``.metadata`` (not a model tensor written as saved)."""
    return key.startswith(("optimizer.", "rng_state")) or bool(_CHAINED.match(key))


def _left_out(md, state: dict) -> dict:
    """{what: why} for every item of the source that the output does not hold (never a silent subset)."""
    left = {}
    for key in list(md.tensors) + list(md.values):
        if key in state or key.startswith(_REWRITTEN) or _CHAINED.match(key):
            continue
        root = key.split("/", 1)[0]
        left[root] = _LEFT.get(root, "not a part of the training state zckpt writes")
    return left


_PLAIN = (bool, int, float, str, bytes, type(None))
_NOT_PLAIN = object()


def _pickled(value):
    """``value`` (read through the allow-list) as ``common.pt`` pickles it again: plain data as it is, an enum
    member's stand-in as the member (``Class(value)``, the class named, never imported), a torch dtype as
    ``torch.<name>``; :data:`_NOT_PLAIN` for anything else."""
    if type(value) in _PLAIN:
        return value
    if isinstance(value, (NamedEnum, NamedStrEnum)) and "." in value._qualname:
        module, name = value._qualname.rsplit(".", 1)
        return Reduce(GlobalRef(module, name), ((int if isinstance(value, NamedEnum) else str)(value),))
    if type(value).__name__ == "TorchDtype" and isinstance(value, str):
        return GlobalRef("torch", str(value))
    if type(value) in (list, tuple):
        out = [_pickled(v) for v in value]
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in out) else type(value)(out)
    if type(value) is dict:
        out = {_pickled(k): _pickled(v) for k, v in value.items()}
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in list(out) + list(out.values())) else out
    return _NOT_PLAIN


def _common(ckpt: Checkpoint, f: dict, tp: int, pp: int, layout: str, ddp=None,
            ep: int | None = None) -> tuple[dict, list[str]]:
    """``common.pt``: what Megatron-LM's ``generate_state_dict`` keeps out of the sharded tensors; and the names of
    the args left out (not plain values). ``ddp`` (dp_reshardable): the world and data-parallel sizes and the DDP
    settings the buckets were cut for, stated in the args as a Megatron-LM save at that shape states them; a
    fully_reshardable output states none (it resumes at any)."""
    source_args = {k: _pickled(v) for k, v in (ckpt.extra.get("args") or {}).items() if k not in _DROP_ARGS}
    dropped = sorted(k for k, v in source_args.items() if v is _NOT_PLAIN)
    args = {k: v for k, v in source_args.items() if k not in dropped}
    args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, ckpt_format="torch_dist",
                dist_ckpt_optim_fully_reshardable=layout == "fully_reshardable", no_save_rng=True)
    if ddp is not None:
        args.update(ddp.args(tp, pp, source_args))
    if ep is not None:
        args.update(writer_moe.args_update(ckpt, ep))
    content = dict(f.get("content_metadata") or {})
    content["distrib_optim_sharding_type"] = layout
    if layout == "fully_reshardable":
        content.setdefault("distrib_optim_fully_reshardable_mem_efficient", False)
    content.setdefault("singleton_local_shards", False)
    content.setdefault("chained_optim_avoid_prefix", True)
    step = float(ckpt.extra["step"])
    groups = [{**{k: v for k, v in g.items() if k not in _GROUP_DROP}, "step": step}
              for g in ckpt.extra["param_groups"]]
    side = ckpt.extra.get("common") or {}
    out = {"args": NewObj(GlobalRef("argparse", "Namespace"), args), "checkpoint_version": 3.0,
           "iteration": f.get("iteration"),
           "optimizer": {"optimizer": {"param_groups": groups}, "param_state_sharding_type": layout}}
    if layout == "dp_reshardable":  # its param groups are the DCP's per-rank optimizer objects
        out["optimizer"] = {"param_state_sharding_type": layout}
    elif ep is not None:  # an MoE model: one optimizer at ep 1, the chain of dense and experts above
        out["optimizer"] = writer_moe.optimizer_state(groups, (f.get("moe") or {}).get("ep") or 1, ep, layout,
                                                      ckpt.location.tag_dir)
    if "opt_param_scheduler" in side:
        out["opt_param_scheduler"] = side["opt_param_scheduler"]
    if "num_floating_point_operations_so_far" in side:
        out["num_floating_point_operations_so_far"] = side["num_floating_point_operations_so_far"]
    out["content_metadata"] = content
    for what, key in (("param groups", "optimizer"), ("scheduler", "opt_param_scheduler")):
        if key in out and _pickled(out[key]) is _NOT_PLAIN:
            raise UnsupportedLayout(f"the source's {what} hold values that are not plain data",
                                    path=ckpt.location.tag_dir)
    return out, dropped

