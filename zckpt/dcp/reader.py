"""A PyTorch DCP checkpoint (``dcp.save`` of FSDP2's ``get_state_dict``) as a :class:`~zckpt.state.model.Checkpoint`.

What it reads (:mod:`zckpt.encoding.dcpmeta` draws the files)::

    <dir>/.metadata            the safe-unpickled, checked metadata: every key, its dtype, size and chunks
    <dir>/__{rank}_{n}.distcp  each chunk a torch.save zip at an offset, placed by its layout (where its raw
                               bytes start: read from one item per dtype, chunk size and item length,
                               :class:`zckpt.encoding.distcp.Items`; each item checked against it when read);
                               a step and a param-group value read whole, one read each; no tensor byte read

Keys (the nested state dict's paths, from ``planner_data``), as ``get_state_dict`` and torchtitan write them::

    model.<fqn>                                  a module tensor (torchtitan: <fqn> at the top level)
    optim.state.<fqn>.{exp_avg,exp_avg_sq,step}  Adam state of parameter <fqn> (``optimizer.`` also read;
                                                 ``state.<fqn>.<k>`` when flatten_optimizer_state_dict=True)
    optim.param_groups.<i>.<hyperparameter>      group i's lr, betas, eps, weight_decay..., and ``params`` (FQNs)

A module tensor with Adam state is ``trainable``: its value is the sharded parameter FSDP2 saved (the fp32 master
when FSDP2 trains in fp32 with a mixed-precision policy), its moments the state's. A module tensor without state
is a frozen weight, a buffer or a tied alias: DCP does not say which; it is read as ``frozen`` unless ``buffers``
or ``tied`` say otherwise (names in ``Checkpoint.extra["stateless"]``). A chunk cut on dim 0 is one piece of the
flat tensor; chunks cut on inner dims become one piece per row (:func:`zckpt.encoding.dcpmeta.runs_in`: a grid
of such chunks is cut per range asked for, :class:`~zckpt.encoding.dcpmeta.Grid`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re

from zckpt.errors import (
    CheckpointNotFound, CorruptFile, IncompleteCheckpoint, InvalidArgument, UnsafePickle, UnsupportedLayout,
    ZckptError,
)
from zckpt.dcp.claims import (  # noqa: F401 - claims, is_dcp: reader.claims and reader.is_dcp, as before
    METADATA, TRAINER_PARTS, claims, dcp_parts, is_dcp)
from zckpt.encoding import dcpmeta, distcp, safeload
from zckpt.engine.segments import Piece
from zckpt.io import links, storage
from zckpt.state import experts, moe_names
from zckpt.state.model import (
    Checkpoint, GroupInfo, Location, RankFile, TensorRecord, dcp_pieces, metadata_errors,
)

TRAINER_MARKERS = ("trainer_state.json", "training_args.bin")
OPTIM_ROOTS = ("optim", "optimizer")
NOT_MODEL_ROOTS = OPTIM_ROOTS + ("lr_scheduler", "lr_schedulers", "train_state", "dataloader", "extra")
STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")
_DATA_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
DCP_HINTS = {
    CorruptFile: "the DCP folder is damaged or was not written by dcp.save; re-copy it or use another step's folder",
    UnsafePickle: "zckpt never runs code from checkpoints; this .metadata names more than DCP's own classes",
}
_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


FORMAT = "dcp"


def read(path: str, tag: str | None = None, storage_options: dict | None = None) -> Checkpoint:
    """The opener's read: :func:`open_dcp` (a DCP folder holds one checkpoint, so ``tag`` is refused)."""
    if tag is not None:
        raise InvalidArgument("`tag` picks a DeepSpeed tag; a DCP folder holds one checkpoint", path=path,
                              hint="drop `tag`, or pass the DCP folder of the step you want")
    return open_dcp(path, storage_options, fused_qkv="keep")


_Items = distcp.Items  # DCP items through the allow-list (zckpt.encoding.distcp, shared with Megatron's torch_dist)


def tensor_pieces(items: distcp.Items, te: dcpmeta.TensorEntry, path: str) -> list:
    """The pieces of ``te``'s row-major flat tensor, from its chunks (their layouts place them)."""
    runs = distcp.flat_runs(items, te, path)
    if runs is None:  # a chunk saved with strides of its own: element runs
        return dcp_pieces(items, te, path)
    return [Piece(f, off, n, te.dtype) for f, off, n in runs]


def _split(md: dcpmeta.DcpMetadata):
    """Sort the keys by role: model tensors, Adam state per parameter, param-group values, everything else."""
    has_model_root = any(md.path_of(k)[0] == "model" and len(md.path_of(k)) > 1 for k in md.tensors)
    model, state, groups, flat_groups, other = {}, {}, {}, {}, []
    keys = list(md.tensors) + list(md.values)
    order = {k: i for i, k in enumerate(md.paths)}  # the saved state dict's own order, where recorded
    for key in sorted(keys, key=lambda k: order.get(k, len(order))):
        p = md.path_of(key)
        is_tensor = key in md.tensors
        if p[0] in OPTIM_ROOTS and len(p) == 4 and p[1] == "state" and p[3] in STATE_KEYS:
            state.setdefault(p[2], {})[p[3]] = key  # nested (get_state_dict's default)
        elif p[0] in OPTIM_ROOTS and len(p) == 2 and p[1].startswith("state.") and p[1].count(".") >= 2 \
                and p[1].rsplit(".", 1)[1] in STATE_KEYS:
            fqn, k = p[1][len("state."):].rsplit(".", 1)  # flatten_optimizer_state_dict=True
            state.setdefault(fqn, {})[k] = key
        elif p[0] in OPTIM_ROOTS and len(p) == 4 and p[1] == "param_groups" and p[2].isdigit() and not is_tensor:
            groups.setdefault(int(p[2]), {})[p[3]] = key
        elif p[0] in OPTIM_ROOTS and len(p) == 2 and p[1].startswith("param_groups.") and not is_tensor:
            fqn, k = p[1][len("param_groups."):].rsplit(".", 1)
            flat_groups.setdefault(fqn, {})[k] = key
        elif is_tensor and has_model_root and p[0] == "model" and len(p) > 1:
            model[".".join(p[1:])] = key
        elif is_tensor and not has_model_root and p[0] not in NOT_MODEL_ROOTS:
            model[".".join(p)] = key
        else:
            other.append(key)
    return model, state, groups, flat_groups, other


def fused_qkv_twin(fqn: str, model: dict, state: dict) -> bool:
    """``{p}.wqkv.weight``'s optimizer state beside module tensors ``{p}.wq/wk/wv.weight`` that have their own: the
    second copy zckpt's ``--layout torchtitan`` writes for torchtitan's fused-qkv attention (its model state dict
    splits ``wqkv``, its optimizer's does not), read from the split keys. Optimizer state under ``wqkv`` alone (a
    save of torchtitan's own) is not this: it is refused as state of no module tensor."""
    if not fqn.endswith(".wqkv.weight"):
        return False
    return all(n in model and state.get(n) for n in fused_qkv_split(fqn))


def fused_qkv_split(fqn: str) -> list[str]:
    """The module tensors torchtitan's fused-qkv attention saves ``{p}.wqkv.weight`` as: ``{p}.wq/wk/wv.weight``."""
    return [fqn[:-len("wqkv.weight")] + w + ".weight" for w in ("wq", "wk", "wv")]


def matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns or ())


def open_dcp(path: str, storage_options: dict | None = None, buffers=None, tied: dict | None = None,
             fused_qkv: bool = False) -> Checkpoint:
    """Describe the DCP checkpoint in the folder ``path`` from its metadata (no tensor bytes read, but for the
    tie ``config.json`` states: see :func:`files_ties`).

    ``buffers``: names (fnmatch patterns) of module tensors without optimizer state that are buffers; ``tied``:
    {alias: source} for tied weights saved under both names (``{}``: none); ``None``: the ties the files state
    (:func:`files_ties`). Others without state are read as frozen. ``fused_qkv``: the optimizer state of a
    torchtitan fused-qkv attention (under ``wqkv`` alone) kept for the caller, whose stated config splits it
    (``extra["fused_qkv"]``: {fqn: {"exp_avg", "exp_avg_sq": pieces, "shape", "dtype"}}), not refused; ``"keep"``
    (the opener's: info, verify, merge, diff) kept the same way but not split, the checkpoint's ``state_refusal``
    saying why the optimizer state cannot be carried; ``False``: refused."""
    path = str(path).rstrip("/") or "/"
    opts = storage_options
    if not storage.exists(path, opts):
        raise CheckpointNotFound("no such file or folder", path=path)
    parts = dcp_parts(path, opts)
    if not parts:
        mpath = storage.join(path, METADATA)
        raise IncompleteCheckpoint(f"{mpath}: missing: DCP's .metadata (written last by dcp.save: the save did "
                                   "not finish, or this is not a DCP folder)", path=mpath,
                                   hint="use the folder of a finished save")
    try:
        with safeload.gc_paused():  # 10**5-10**6 pieces built, no garbage: one collector pass at the end, not many
            return _open_parts(path, opts, parts, buffers, tied, fused_qkv)
    except (CorruptFile, UnsafePickle) as exc:
        if exc.hint == type(exc).default_hint:  # the DeepSpeed wording (tags, rank files) does not fit a DCP folder
            exc.hint = DCP_HINTS[UnsafePickle if isinstance(exc, UnsafePickle) else CorruptFile]  # subclasses too
        raise


def _open_parts(path, opts, parts, buffers, tied, fused_qkv=False) -> Checkpoint:
    """:func:`open_dcp`'s reads: each part's ``.metadata``, then the checkpoint built from them."""
    metas, sizes, mds = [], {}, []
    for part in parts:
        folder = storage.join(path, part) if part else path
        mpath = storage.join(folder, METADATA)
        own = {n: s for n, s in storage.file_sizes(folder, opts).items() if n != METADATA}  # one listing
        links.check([mpath], path)  # .metadata and every .distcp it names: inside the folder, links resolved
        data = storage.read_bytes(mpath, opts)
        mds.append(_relative(dcpmeta.read_metadata(data, mpath, own), part))
        links.check([storage.join(path, f) for f in mds[-1].files], path)
        sizes.update({f"{part}/{n}" if part else n: size for n, size in own.items()})
        metas.append((f"{part}/{METADATA}" if part else METADATA, len(data)))
    md = _joined(mds, storage.join(path, metas[0][0]))
    with metadata_errors(storage.join(path, metas[0][0])):
        return _build(path, opts, md, sizes, metas, buffers, tied, fused_qkv)


def _relative(md: dcpmeta.DcpMetadata, part: str) -> dcpmeta.DcpMetadata:
    """``md`` with its data files named relative to the checkpoint folder (``optimizer_0/__0_0.distcp``)."""
    if not part:
        return md
    for te in md.tensors.values():
        te.chunks = [dataclasses.replace(c, file=f"{part}/{c.file}") for c in te.chunks]
        te.runs, te.grid = None, None  # (cut from the chunks as they were named before)
    md.values = {k: dataclasses.replace(v, file=f"{part}/{v.file}") for k, v in md.values.items()}
    md.files = [f"{part}/{f}" for f in md.files]
    return md


def _joined(mds: list[dcpmeta.DcpMetadata], mpath: str) -> dcpmeta.DcpMetadata:
    if len(mds) == 1:
        return mds[0]
    out = dcpmeta.DcpMetadata({}, {}, {}, mds[0].version, [])
    for md in mds:
        clash = (set(md.tensors) | set(md.values)) & (set(out.tensors) | set(out.values))
        if clash:
            raise CorruptFile(f"key '{sorted(clash)[0]}' is saved in two DCP folders of one checkpoint", path=mpath)
        out.tensors.update(md.tensors)
        out.values.update(md.values)
        out.paths.update(md.paths)
        out.files += md.files
    return out


def _values(items: _Items, md: dcpmeta.DcpMetadata, keys, mpath: str) -> dict:
    out = {}
    for key in keys:
        v = md.values[key]
        try:
            out[key] = items.load(v.file, v.offset, v.length)
        except ZckptError as exc:
            raise type(exc)(f"DCP value '{key}': {exc.message}", path=exc.path or mpath, hint=exc.hint) from None
    return out


def _build(path, opts, md, sizes, metas, buffers, tied, fused_qkv=False) -> Checkpoint:
    mpath = storage.join(path, metas[0][0])
    model, state, groups_raw, flat_groups, other = _split(md)
    if not model:
        raise UnsupportedLayout("DCP checkpoint without module tensors (no model.* keys)", path=mpath,
                                hint="zckpt reads DCP checkpoints of dcp.save({'model': ..., 'optim': ...})")
    orphans = sorted(set(state) - set(model))
    twins = [o for o in orphans if fused_qkv_twin(o, model, state)]
    for o in twins:  # zckpt's torchtitan layout: the fused wqkv's state beside wq/wk/wv's own (the same values)
        state.pop(o)
        flat_groups.pop(o, None)
    orphans = [o for o in orphans if o not in twins]
    alone = [o for o in orphans if o.endswith(".wqkv.weight") and fused_qkv_twin(o, model, {
        n: True for n in model})]
    kept = {o: state.pop(o) for o in alone} if fused_qkv else {}  # split by the caller (its stated config)
    orphans = [o for o in orphans if o not in kept]
    fused_refusal = None
    if alone:  # torchtitan's own fused-qkv save: its model split, its optimizer state not
        fused_refusal = (f"the optimizer state of '{alone[0]}' is torchtitan's fused-qkv attention's (the model's "
                         "wq/wk/wv fused per key-value group); where its rows split needs the head size, which the "
                         "files do not hold")
        hint = ("state the transformers class's config.json with --hf-config (merge, convert --to deepspeed), or "
                "build the torchtitan model with fuse_qkv=False")
        if not fused_qkv:
            raise UnsupportedLayout(fused_refusal, path=mpath, hint=hint)
        fused_refusal = fused_refusal if fused_qkv == "keep" else None
    if orphans and all(o.isdigit() for o in orphans):  # optimizer.state_dict(): torch's own keys, not names
        raise UnsupportedLayout(f"the optimizer state is keyed by parameter index ({', '.join(orphans[:3])}"
                                f"{' ...' if len(orphans) > 3 else ''}), not by name: it was saved from "
                                "optimizer.state_dict(), and which parameter each index is the files do not say",
                                path=mpath, hint="save with torch.distributed.checkpoint.state_dict.get_state_dict("
                                "model, optimizer), as FSDP2 and torchtitan do")
    if orphans:
        raise CorruptFile(f"optimizer state for '{orphans[0]}'" + (f" and {len(orphans) - 1} more" if len(orphans) > 1
                          else "") + ", which is not a module tensor", path=mpath)
    items = _Items(path, opts)
    try:
        steps = [md.tensors[st["step"]] for st in state.values() if st.get("step") in md.tensors]
        items.prefetch([(c.file, c.offset, c.length) for ste in steps if ste.numel == 1 for c in ste.chunks[:1]] +
                       [(v.file, v.offset, v.length) for v in md.values.values()])  # few reads, not one per item
        group_values = _values(items, md, [k for g in groups_raw.values() for k in g.values()], mpath)
        tie_source = "given" if tied is not None else None
        if tied is None:
            tied, tie_source = files_ties(path, opts, md, model, state, items, mpath)
        records, step_tensors, step_values = [], {}, {}
        grouped = _group_infos(groups_raw, group_values, mpath)
        group_of = {n: g.index for g in grouped for n in g.names}
        unknown = sorted(set(group_of) - set(model))
        if unknown:
            raise CorruptFile(f"param group {group_of[unknown[0]]} lists '{unknown[0]}', which is not a module "
                              "tensor", path=mpath)
        stateless = []
        for fqn, key in model.items():
            te = md.tensors[key]
            value = tensor_pieces(items, te, mpath)
            st = state.get(fqn, {})
            rec = TensorRecord(fqn, te.shape, "trainable", te.dtype, value, group=group_of.get(fqn))
            if st:
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in st and st[k] in md.tensors:
                        if md.tensors[st[k]].shape != te.shape:
                            raise CorruptFile(f"'{fqn}': {k} has size {list(md.tensors[st[k]].shape)}, the "
                                              f"parameter {list(te.shape)}", path=mpath)
                        setattr(rec, k, tensor_pieces(items, md.tensors[st[k]], mpath))
                if bool(rec.exp_avg) != bool(rec.exp_avg_sq) and te.numel:
                    raise UnsupportedLayout(f"'{fqn}' has only one of exp_avg / exp_avg_sq: not Adam state",
                                            path=mpath)
                if "step" in st and st["step"] in md.tensors:
                    ste = md.tensors[st["step"]]
                    if ste.numel != 1:
                        raise CorruptFile(f"'{fqn}': step has size {list(ste.shape)}", path=mpath)
                    step_tensors[fqn], step_values[fqn] = items.scalar(ste, ste.chunks[0])  # read whole, checked
            elif fqn in tied:
                rec = TensorRecord(fqn, te.shape, "tied", te.dtype, tied_to=tied[fqn])
            elif fqn not in group_of:
                rec.kind = "buffer" if matches(fqn, buffers) else "frozen"
                stateless.append(fqn)
            records.append(rec)
        for g in grouped:
            g.step = _group_step(g, step_values, mpath)
        fused = {}
        for fqn, st in kept.items():  # torchtitan's fused wqkv: its state as saved, for the caller to split
            te = md.tensors.get(st.get("exp_avg"))
            sq = md.tensors.get(st.get("exp_avg_sq"))
            if te is None or sq is None or sq.shape != te.shape or "step" not in st:
                raise CorruptFile(f"'{fqn}': not all of exp_avg, exp_avg_sq and step", path=mpath)
            ste = md.tensors[st["step"]]
            step_tensors[fqn], step_values[fqn] = items.scalar(ste, ste.chunks[0])
            fused[fqn] = {"exp_avg": tensor_pieces(items, te, mpath), "exp_avg_sq": tensor_pieces(items, sq, mpath),
                          "shape": tuple(te.shape), "dtype": te.dtype}
        extra = {"metadata": md, "step_tensors": step_tensors, "stateless": stateless, "other": other,
                 "tied": dict(tied), "tie_source": tie_source, "fused_qkv": fused, "step_values": step_values,
                 "flat_param_groups": bool(flat_groups), "model_keys": model,
                 "flat_groups": {fqn: {k: v for k, v in zip(keys, _values(items, md, list(keys.values()),
                                                                             mpath).values())}
                                 for fqn, keys in flat_groups.items()},
                 "values": _values(items, md, [k for k in other if k in md.values], mpath)}
    finally:
        items.close()
    _check_tied(records, tied, mpath)
    masters = sorted({r.dtype for r in records if r.kind == "trainable"}) or ["float32"]
    ranks = sorted({int(m.group(1)) for n in md.files if (m := _DATA_RE.match(n.rsplit("/", 1)[-1]))})
    data_files = [RankFile(storage.join(path, n), n, "data", None, 0, sizes.get(n, -1)) for n in md.files]
    data_files += [RankFile(storage.join(path, n), n, "metadata", None, 0, size) for n, size in metas]
    trainer = path if any(storage.isfile(storage.join(path, m), opts) for m in TRAINER_MARKERS) else None
    loc = Location(path, path, storage.basename(path), path, trainer, data_files=data_files, storage_options=opts)
    notes = []
    fused_split = {n for fqn in extra["fused_qkv"] for n in fused_qkv_split(fqn)}
    if fused_split:  # (their optimizer state is the fused wqkv's)
        stateless = [n for n in stateless if n not in fused_split]
    if fused_split and fused_refusal:  # (a caller that splits it says what it did)
        notes.append(f"torchtitan's fused-qkv attention in {len(extra['fused_qkv'])} layer(s): the optimizer state of "
                     "wq/wk/wv is saved fused under wqkv (read and checked as saved; convert --to deepspeed "
                     "--hf-config CONFIG.json splits and carries it)")
    if stateless:
        notes.append(f"{len(stateless)} module tensor(s) have no optimizer state ({', '.join(stateless[:3])}"
                     f"{'...' if len(stateless) > 3 else ''}): read as frozen weights unless named as buffers")
    if tie_source:
        extra["tie_candidates"] = []
        if tied:
            notes.append(f"{len(tied)} tied alias(es) from {tie_source}: " +
                         ", ".join(f"{a} -> {b}" for a, b in list(tied.items())[:3]))
    if flat_groups:
        notes.append("the optimizer state was saved flattened (flatten_optimizer_state_dict=True): the param groups "
                     "are not recorded")
    ckpt = Checkpoint(loc, 0, "dcp", _PRECISION.get(masters[0], masters[0]), (ranks[-1] + 1) if ranks else len(md.files),
                      records, grouped, {}, [], [], notes=notes, format="dcp", extra=extra,
                      reshard_refusal="a DCP checkpoint becomes DeepSpeed files through "
                                      "`zckpt convert SRC --to deepspeed --world-size N --stage S`",
                      state_refusal=fused_refusal)
    moe = moe_names.layers(records)  # MoE layers under the model's names: every expert once, its state, router
    if moe:
        experts.check(moe, records, mpath)
        extra["moe_coverage"] = moe
        notes.append(f"MoE: {len(moe)} layer(s) named as the model class does; the experts of a fused [E, ...] "
                     "tensor are its first dimension (checked against the router's rows)")
    if not tie_source and stateless:
        pairs = extra["tie_candidates"] = tie_candidates(ckpt)
        if pairs:
            notes.append("likely tied (no optimizer state, the same bytes as a trainable tensor; the files do not "
                         "say): " + ", ".join(f"{a} = {b}" for a, b in pairs[:3]) +
                         f"; convert --to deepspeed needs --tied {pairs[0][0]}={pairs[0][1]} or --tied ''")
    return ckpt


TIES_KEY = ("zckpt", "tied")  # zckpt's own record of tied aliases: a list of [alias, source] (dcp.load skips it)
CONFIG = "config.json"


def files_ties(path: str, opts, md: dcpmeta.DcpMetadata, model: dict, state: dict, items: "_Items",
               mpath: str) -> tuple[dict, str | None]:
    """The ties the files state, and where from: zckpt's own record (``zckpt.tied``, written beside ``model.*``
    by ``zckpt convert --to dcp``), else ``tie_word_embeddings: true`` in a Hugging Face ``config.json`` in the
    checkpoint folder: the one module tensor without optimizer state whose bytes equal a trainable one of its
    shape is the tied alias (refused when it is not exactly one). ``({}, None)`` when the files say nothing."""
    for key, v in md.values.items():
        if md.path_of(key) == TIES_KEY:
            value = _values(items, md, [key], mpath)[key]
            if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 and
                                                      all(isinstance(x, str) for x in p) for p in value):
                raise CorruptFile(f"DCP value '{key}' is not a list of [alias, source] names", path=mpath)
            return {a: b for a, b in value}, "zckpt.tied"
    cpath = storage.join(path, CONFIG)
    try:
        config = json.loads(storage.read_bytes(cpath, opts)) if storage.isfile(cpath, opts) else None
    except (ValueError, UnicodeDecodeError):
        config = None
    if not isinstance(config, dict) or config.get("tie_word_embeddings") is not True:
        return {}, None
    pairs = equal_pairs(md, model, state, items, opts, mpath)
    aliases = sorted({a for a, _ in pairs})
    if len(aliases) > 1 or len(pairs) > 1:
        raise UnsupportedLayout(f"{CONFIG} says tie_word_embeddings, and several tensors without optimizer state "
                                f"equal a trainable one ({', '.join(f'{a}={b}' for a, b in pairs[:3])})", path=cpath,
                                hint="name the tie with --tied ALIAS=SOURCE")
    return dict(pairs), f"{CONFIG} tie_word_embeddings" if pairs else None


def equal_pairs(md: dcpmeta.DcpMetadata, model: dict, state: dict, items: "_Items", opts, mpath: str) -> list:
    """(alias, source) for every module tensor without optimizer state whose bytes are identical to a trainable
    tensor of the same shape and dtype: likely ties (or a frozen copy), never assumed to be either."""
    stateless = [f for f in model if not state.get(f)]
    trainable = [f for f in model if state.get(f)]
    out, first = [], _Firsts(opts)
    for a in stateless:
        ta = md.tensors[model[a]]
        for b in trainable:
            tb = md.tensors[model[b]]
            if tuple(ta.shape) == tuple(tb.shape) and ta.dtype == tb.dtype and ta.numel:
                pa, pb = tensor_pieces(items, ta, mpath), tensor_pieces(items, tb, mpath)
                if first(a, pa) == first(b, pb) and same_bytes(pa, pb, opts):
                    out.append((a, b))
    return out


class _Firsts:
    """The first 64 KiB of each tensor compared for a tie, read once per tensor (not once per pair: one trainable
    tensor against many frozen ones of its shape reads each once; most unequal pairs differ there)."""

    def __init__(self, opts):
        self.opts, self.got = opts, {}

    def __call__(self, name: str, pieces: list) -> bytes:
        """The tensor's first min(64 KiB, size) bytes, whatever its pieces (tensors compared have one size)."""
        if name not in self.got:
            want, parts = 64 << 10, []
            for p in pieces:
                if want <= 0:
                    break
                n = min(want, p.nbytes)
                parts.append(storage.read_range(p.path, p.offset, n, self.opts))
                want -= n
            self.got[name] = b"".join(parts)
        return self.got[name]


def tie_candidates(ckpt: Checkpoint) -> list[tuple[str, str]]:
    """(alias, source) pairs of ``ckpt`` (read from DCP) that look like ties: a module tensor without optimizer
    state (read as frozen) whose bytes are identical to a trainable tensor's of the same shape and dtype."""
    stateless = set(ckpt.extra.get("stateless") or [])
    trainable = [r for r in ckpt.records if r.kind == "trainable" and r.exp_avg]
    out, first = [], _Firsts(ckpt.storage_options)
    for a in (r for r in ckpt.records if r.name in stateless and r.numel):
        for b in trainable:
            if tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype and \
                    first(a.name, a.value) == first(b.name, b.value) and \
                    same_bytes(a.value, b.value, ckpt.storage_options):
                out.append((a.name, b.name))
    return out


def _stream(pieces, opts, first: int = 64 << 10, block: int = 8 << 20):
    """The pieces' bytes: a small first read (most unequal pairs differ there), then 8 MiB at a time."""
    size = first
    for p in pieces:
        off = 0
        while off < p.nbytes:
            n = min(size, p.nbytes - off)
            yield storage.read_range(p.path, p.offset + off, n, opts)
            off, size = off + n, block


def same_bytes(a: list, b: list, opts) -> bool:
    """Whether two piece lists hold the same bytes (streamed: 64 KiB first, then 8 MiB at a time)."""
    if sum(p.nbytes for p in a) != sum(p.nbytes for p in b):
        return False
    sa, sb, ba, bb = _stream(a, opts), _stream(b, opts), b"", b""
    while True:
        if not ba:
            ba = next(sa, b"")
        if not bb:
            bb = next(sb, b"")
        if not ba or not bb:
            return not ba and not bb
        n = min(len(ba), len(bb))
        if ba[:n] != bb[:n]:
            return False
        ba, bb = ba[n:], bb[n:]


def _group_infos(groups_raw: dict, values: dict, mpath: str) -> list[GroupInfo]:
    out = []
    for i in sorted(groups_raw):
        hp = {k: values[key] for k, key in groups_raw[i].items()}
        params = hp.get("params")
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise CorruptFile(f"param group {i}: 'params' is not a list of parameter names", path=mpath)
        out.append(GroupInfo(i, hp, None, list(params)))
    if [g.index for g in out] != list(range(len(out))):
        raise CorruptFile(f"param groups {[g.index for g in out]} are not numbered 0..{len(out) - 1}", path=mpath)
    return out


def _group_step(g: GroupInfo, step_values: dict, mpath: str):
    """One step per group (what DeepSpeed keeps): torch's AdamW keeps one per parameter; they must agree."""
    steps = {n: step_values[n] for n in g.names if n in step_values}
    if not steps:
        return None
    if len(set(steps.values())) > 1:
        a, b = sorted(steps.items(), key=lambda kv: kv[1])[0], sorted(steps.items(), key=lambda kv: kv[1])[-1]
        raise UnsupportedLayout(f"param group {g.index}: parameters at different Adam steps ('{a[0]}' {a[1]}, "
                                f"'{b[0]}' {b[1]})", path=mpath, hint="one step per group is what DeepSpeed and "
                                "zckpt's model keep")
    return next(iter(steps.values()))


def _check_tied(records: list[TensorRecord], tied: dict, mpath: str) -> None:
    by = {r.name: r for r in records}
    for alias, src in tied.items():
        if alias not in by or src not in by or by[alias].kind != "tied" or by[src].kind == "tied" \
                or by[src].shape != by[alias].shape:
            raise UnsupportedLayout(f"tied '{alias}' -> '{src}': both must be module tensors of one shape, the "
                                    "alias without optimizer state", path=mpath)


def check_stateless_named(ckpt: Checkpoint, buffers) -> None:
    """Refuse to write a layout that needs to tell buffers from frozen weights when the user did not say."""
    left = ckpt.extra.get("stateless") or []
    if left and buffers is None:
        raise UnsupportedLayout(f"'{left[0]}'" + (f" and {len(left) - 1} more" if len(left) > 1 else "") +
                                " have no optimizer state, and DCP does not record whether a tensor is a buffer or a "
                                "frozen weight", path=ckpt.location.tag_dir,
                                hint="name the buffers with --buffers 'a,b*', or --buffers '' when all are frozen "
                                     "weights or tied aliases")
