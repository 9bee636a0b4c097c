"""What a checkpoint holds, from metadata alone (``zckpt info``)."""

from __future__ import annotations

import re

from zckpt.state import experts
from zckpt.state.model import Checkpoint, metadata_errors
from zckpt.state.open import open_checkpoint
from zckpt.encoding.safeload import Inert
from zckpt.backup.files import NotBackedUp, files_in_folder
from zckpt.units import counted

FLAVOURS = {
    "zero": "DeepSpeedZeroOptimizer",
    "bf16_optimizer": "BF16_Optimizer (ZeRO-1, fp32 gradient accumulation)",
    "zero3": "DeepSpeedZeroOptimizer_Stage3",
    "zero0": "no ZeRO optimizer (ZeRO-0: weights and optimizer in mp_rank_00_model_states.pt)",
}


def _plain(value, depth=0):
    """JSON-friendly copy of metadata (stand-ins become dicts, tensors become descriptions)."""
    from zckpt.encoding.safeload import LazyTensor
    if depth > 20:
        return "..."
    if isinstance(value, LazyTensor):
        return {"tensor": value.dtype, "shape": list(value.shape)}
    if isinstance(value, Inert):
        return {k: _plain(v, depth + 1) for k, v in vars(value).items() if not k.startswith("_")}
    if isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _counts(ckpt: Checkpoint) -> tuple[dict, dict]:
    counts, numels = {}, {}
    for kind in ("trainable", "frozen", "tied", "buffer"):
        recs = ckpt.of_kind(kind)
        counts[kind] = len(recs)
        numels[kind] = sum(r.numel for r in recs)
    return counts, numels


def describe_dcp(ckpt: Checkpoint) -> dict:
    """A DCP checkpoint (``ckpt.format == "dcp"``): what its metadata says, in the keys DeepSpeed's share."""
    counts, numels = _counts(ckpt)
    md = ckpt.extra["metadata"]
    return {
        "format": "dcp", "path": ckpt.location.input_path, "dcp_version": md.version,
        "world_size": ckpt.world_size, "master_dtype": _one_or_list(ckpt.master_dtypes),
        "parameter_dtype": _one_or_list(_param_dtypes(ckpt)),
        "optimizer_state_dtype": _one_or_list(ckpt.state_dtypes), "counts": counts, "numel": numels,
        "parameters": numels["trainable"] + numels["frozen"],
        "param_groups": [{"index": g.index, "params": len(g.names), "step": g.step, "lr": g.hyperparams.get("lr")}
                         for g in ckpt.groups],
        "without_optimizer_state": list(ckpt.extra.get("stateless") or []),
        "other_keys": list(ckpt.extra.get("other") or []), "notes": list(ckpt.notes),
        **({"moe": moe} if (moe := experts.summary(ckpt)) else {}),  # MoE layers x experts (by the shapes)
        "files": [{"name": f.name, "bytes": f.size} for f in ckpt.files],
        "total_bytes": sum(f.size for f in ckpt.files),
    }


def render_dcp(d: dict) -> str:
    c, n = d["counts"], d["numel"]
    lines = [
        f"checkpoint   {d['path']}",
        f"format       PyTorch DCP (torch.distributed.checkpoint, version {d['dcp_version']}), saved by "
        f"{d['world_size']} rank{'s' if d['world_size'] != 1 else ''}",
        f"dtypes       parameters {_dtypes(d['parameter_dtype'])}, "
        f"optimizer states {_dtypes(d['optimizer_state_dtype'])}",
        f"parameters   {human_count(d['parameters'])} ({d['parameters']:,}): "
        f"{c['trainable']} with optimizer state ({n['trainable']:,}), {c['frozen']} without ({n['frozen']:,}), "
        f"{c['tied']} tied, {c['buffer']} buffers ({n['buffer']:,} elements)",
        "optimizer    " + (", ".join(f"group {g['index']}: {counted(g['params'], 'param')}, lr {g['lr']}, "
                                     f"step {g['step']}"
                                     for g in d["param_groups"]) or "no param groups"),
        f"other keys   {', '.join(d['other_keys']) or 'none'}",
    ] + ([f"experts      {experts.render(d['moe'])}"] if d.get("moe") else []) + [
        f"files        {len(d['files'])}, {human_bytes(d['total_bytes'])}",
    ]
    lines += [f"note         {note}" for note in d["notes"]]
    lines += [f"  {f['name']:<52} {human_bytes(f['bytes']):>10}" for f in d["files"]]
    return "\n".join(lines)


def describe_megatron(ckpt: Checkpoint) -> dict:
    """A Megatron-Core torch_dist checkpoint (``ckpt.format == "megatron"``): what common.pt and .metadata say;
    a value the files do not hold is None."""
    counts, numels = _counts(ckpt)
    f = ckpt.extra["megatron"]
    return {
        "format": "megatron", "backend": "torch_dist", "path": ckpt.location.input_path,
        "save_dir": ckpt.location.save_dir, "tag": ckpt.location.tag, "iteration": f["iteration"],
        "tp_world_size": f["tp"], "pp_world_size": f["pp"], "dp_world_size": f["dp"], "world_size": f["world_size"],
        "model": {k: f[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                                     "kv_channels", "ffn_hidden_size", "vocab_size", "swiglu", "tied",
                                     "normalization", "position_embedding_type", "add_bias_linear", "params_dtype",
                                     "norm_epsilon", "rotary_base", "rotary_percent", "max_position_embeddings")},
        "run": dict(f.get("run") or {}), "checkpoint_version": f.get("checkpoint_version"),
        "optimizer_layout": f["optimizer_layout"], "precision": ckpt.precision,
        "parameter_dtype": _one_or_list(_param_dtypes(ckpt)), **_megatron_state(ckpt), "counts": counts,
        "numel": numels,
        "parameters": numels["trainable"] + numels["frozen"],
        "param_groups": [{"index": i, "step": g.get("step"), "lr": g.get("lr"), "weight_decay": g.get("weight_decay")}
                         for i, g in enumerate(ckpt.extra.get("param_groups") or [])],
        "state_refusal": ckpt.state_refusal, "content_metadata": _plain(f["content_metadata"]),
        # MoE layers x experts, checked, with the args' router top-k, expert tensor-parallel size, token dispatcher
        **({"moe": {**moe, **{k: _plain(v) for k, v in (f.get("moe") or {}).items()
                              if k in ("topk", "etp", "token_dispatcher", "ffn_hidden_size")}}}
           if (moe := experts.summary(ckpt)) else {}),
        "notes": list(ckpt.notes), "files": [{"name": x.name, "bytes": x.size} for x in ckpt.files],
        "total_bytes": sum(x.size for x in ckpt.files),
    }


def _param_dtypes(ckpt: Checkpoint) -> list[str]:
    """The dtypes the parameters' values are stored in (trainable and frozen; a model-only DCP has no masters)."""
    return sorted({r.dtype for r in ckpt.records if r.kind in ("trainable", "frozen")})


def _megatron_state(ckpt: Checkpoint) -> dict:
    """``master_dtype``, ``optimizer_state_dtype`` and ``optimizer_state_keys`` of a Megatron checkpoint: a
    ``fully_reshardable`` save's records hold them; a ``dp_reshardable`` one's are in the buckets, placed by the
    reader (``extra["buckets"]``: what convert carries); none where they could not be placed (a note says why)."""
    placed = ckpt.extra.get("buckets") or {}
    if placed:
        masters = sorted({p.dtype for m, _, _ in placed.values() for p in m})
        states = sorted({p.dtype for _, a, b in placed.values() for p in a + b})
        keys = ["exp_avg", "exp_avg_sq"] if states else []
    elif ckpt.extra["megatron"].get("optimizer_layout") == "dp_reshardable":  # not placed: the records hold weights
        masters, states, keys = [], [], []
    else:
        masters, states = ckpt.master_dtypes, ckpt.state_dtypes
        keys = ["exp_avg", "exp_avg_sq"] if states else []
    return {"master_dtype": _one_or_list(masters), "optimizer_state_dtype": _one_or_list(states),
            "optimizer_state_keys": keys}


_RUN_SHOWN = ("consumed_train_samples", "global_batch_size", "seq_length", "attention_backend", "transformer_impl")


def render_megatron(d: dict) -> str:
    c, n, m = d["counts"], d["numel"], d["model"]
    lines = [
        f"checkpoint   {d['path']}",
        f"format       Megatron-Core torch_dist, {d['tag']} (iteration {d['iteration']})",
        f"world size   {d['tp_world_size']} tensor-parallel x {d['pp_world_size']} pipeline x {d['dp_world_size']} "
        f"data-parallel ({counted(d['world_size'], 'rank')})" if d["dp_world_size"] is not None else
        f"world size   {d['tp_world_size']} tensor-parallel x {d['pp_world_size']} pipeline; data-parallel size not "
        f"saved (the args hold none; {d.get('optimizer_layout') or 'this'} layout)",
        f"model        {m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads, "
        f"{m['num_query_groups']} query groups, ffn {m['ffn_hidden_size']}, vocab {m['vocab_size']}, "
        f"swiglu {m['swiglu']}, tied {m['tied']}",
        *(["run          " + ", ".join(f"{k} {v}" for k, v in d["run"].items() if k in _RUN_SHOWN)]
          if any(k in d["run"] for k in _RUN_SHOWN) else []),
        f"dtypes       {d['precision']}; parameters {_dtypes(d['parameter_dtype'])}"
        + (f", masters {_dtypes(d['master_dtype'])}" if d["master_dtype"] != d["parameter_dtype"] else "")
        + f", optimizer states {_dtypes(d['optimizer_state_dtype'])}"
        + (f" ({', '.join(d['optimizer_state_keys'])} in {d['optimizer_layout']} buckets)"
           if d["optimizer_state_keys"] and d["optimizer_layout"] == "dp_reshardable" else ""),
        f"parameters   {human_count(d['parameters'])} ({d['parameters']:,}): {counted(c['trainable'], 'tensor')}, "
        f"{c['tied']} tied",
        f"optimizer    {d['optimizer_layout']}" + "".join(
            f"; group {g['index']}: lr {g['lr']}, weight decay {g['weight_decay']}, step {g['step']}"
            for g in d["param_groups"]),
        *([f"experts      {experts.render(d['moe'])}" + (f" (top-{d['moe']['topk']})" if d["moe"].get("topk")
                                                           else "")] if d.get("moe") else []),
        f"files        {len(d['files'])}, {human_bytes(d['total_bytes'])}",
    ]
    lines += [f"note         {note}" for note in d["notes"]]
    lines += [f"  {f['name']:<52} {human_bytes(f['bytes']):>10}" for f in d["files"]]
    return "\n".join(lines)


#: config.json facts info shows, where the config holds them
CONFIG_FACTS = ("model_type", "architectures", "num_hidden_layers", "hidden_size", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "torch_dtype", "dtype")


def describe_hf(ckpt: Checkpoint) -> dict:
    """A Hugging Face folder (``ckpt.format == "hf"``: merge's output, ``save_pretrained``'s): its weight files,
    tensors by dtype, size and what config.json says; weights only, so no optimizer or steps."""
    h = ckpt.extra["hf"]
    by_dtype: dict[str, dict] = {}
    for r in ckpt.records:
        d = by_dtype.setdefault(r.dtype, {"dtype": r.dtype, "tensors": 0, "numel": 0})
        d["tensors"] += 1
        d["numel"] += r.numel
    dtypes = [by_dtype[k] for k in sorted(by_dtype)]
    cfg = h["config"]
    return {
        "format": "hf", "path": ckpt.location.input_path, "weights_format": h["weights_format"],
        "index": h["index"], "tensors": len(ckpt.records), "parameters": sum(r.numel for r in ckpt.records),
        "master_dtype": None, "parameter_dtype": _one_or_list(sorted(by_dtype)),
        "counts": {"tensors": len(ckpt.records)}, "numel": {"tensors": sum(r.numel for r in ckpt.records)},
        "dtypes": dtypes, "config": None if cfg is None else {k: cfg[k] for k in CONFIG_FACTS if k in cfg},
        "checksums": h["checksums"], "notes": list(ckpt.notes),
        "files": [{"name": f.name, "bytes": f.size} for f in ckpt.files],
        "total_bytes": sum(f.size for f in ckpt.files),
    }


def render_hf(d: dict) -> str:
    kind = "safetensors" if d["weights_format"] == "safetensors" else "pytorch_model.bin (torch zip)"
    cfg = d["config"]
    facts = ", ".join(f"{k} {'/'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in cfg.items()) \
        if cfg else ("config.json holds none of " + ", ".join(CONFIG_FACTS[:4]) if cfg is not None else "none")
    lines = [
        f"checkpoint   {d['path']}",
        f"format       Hugging Face model folder, {kind}"
        + (f", sharded ({len(d['files'])} files, {d['index']})" if d["index"] else ""),
        f"tensors      {d['tensors']}, {human_count(d['parameters'])} parameters ({d['parameters']:,})",
        "dtypes       " + (", ".join(f"{v['dtype']} {counted(v['tensors'], 'tensor')} ({v['numel']:,})"
                                     for v in d["dtypes"])
                           or "none"),
        f"config       {facts}",
        "checksums    " + ("CRC-32 of every zip entry (checked when read)" if d["checksums"] else
                           "none (safetensors holds no checksum: header offsets and file sizes are checked)"),
        f"files        {len(d['files'])}, {human_bytes(d['total_bytes'])}",
    ]
    lines += [f"note         {note}" for note in d["notes"]]
    lines += [f"  {f['name']:<52} {human_bytes(f['bytes']):>10}" for f in d["files"]]
    lines += _all_files_line(d)
    return "\n".join(lines)


def describe(ckpt: Checkpoint) -> dict:
    if ckpt.format == "hf":
        return describe_hf(ckpt)
    if ckpt.format == "dcp":
        return describe_dcp(ckpt)
    if ckpt.format == "megatron":
        return describe_megatron(ckpt)
    counts, numels = {}, {}
    for kind in ("trainable", "frozen", "tied", "buffer"):
        recs = ckpt.of_kind(kind)
        counts[kind] = len(recs)
        numels[kind] = sum(r.numel for r in recs)
    unplaced = getattr(ckpt.state_refusal, "params", None)
    parameters = numels["trainable"] + numels["frozen"]
    if unplaced:  # trainable parameters held as frozen (their state cannot be placed): said as what they are
        kind = "trainable" if counts["frozen"] <= unplaced else "not_told_apart"
        counts[kind], numels[kind] = counts.get(kind, 0) + counts["frozen"], numels.get(kind, 0) + numels["frozen"]
        counts["frozen"], numels["frozen"] = 0, 0
    ms = ckpt.model_state
    loc = ckpt.location
    sched = ms.get("lr_scheduler")
    return {
        "path": loc.input_path,
        "save_dir": loc.save_dir,
        "tag": loc.tag,
        "trainer_checkpoint": loc.trainer_dir is not None,
        "zero_stage": ckpt.stage,
        "optimizer": ckpt.flavour,
        "optimizer_class": FLAVOURS[ckpt.flavour],
        "universal": loc.universal,
        "precision": ckpt.precision,
        "master_dtype": _one_or_list(ckpt.master_dtypes),
        "optimizer_state_dtype": _one_or_list(ckpt.state_dtypes),
        "dp_world_size": ckpt.world_size,
        **parallel_sizes(ckpt),
        "mp_world_size": int(ms.get("mp_world_size") or 1),
        "offload_optimizer": ckpt.offload,
        "counts": counts,
        "numel": numels,
        "parameters": parameters,
        "no_optimizer_group": [r.name for r in ckpt.no_group],
        "no_optimizer_group_numel": sum(r.numel for r in ckpt.no_group),
        "ambiguous_ties": [list(pair) for pair in ckpt.ambiguous_ties],
        "optimizer_state_keys": _state_keys(ckpt),
        "param_groups": [{"index": g.index, "params": len(g.names), "step": g.step,
                          "lr": g.hyperparams.get("lr")} for g in ckpt.groups],
        "global_steps": ms.get("global_steps"),
        "global_samples": ms.get("global_samples"),
        "skipped_steps": ms.get("skipped_steps"),
        "loss_scaler": _plain(ckpt.loss_scaler),
        "lr_scheduler": _plain(sched) if sched is not None else None,
        "client_state_keys": sorted(ckpt.client_state),
        "ds_version": ckpt.ds_version,
        "files": [{"name": f.name, "bytes": f.size} for f in ckpt.files],
        "total_bytes": sum(f.size for f in ckpt.files),
        # trainable parameters whose optimizer state the files do not place (ZeRO-0 moments of one shape, no names
        # saved): counted as trainable, or, where frozen ones are among them and the files do not say which, as
        # "not_told_apart" (the text says the same)
        "state_not_placed": unplaced,
        "notes": [str(n) for n in ckpt.notes],
        **({"moe": moe} if (moe := experts.summary(ckpt)) else {}),  # MoE layers x experts, checked
    }


def _state_keys(ckpt: Checkpoint) -> list[str]:
    """The per-element optimizer-state keys the trainable parameters have (``exp_avg``, ``exp_avg_sq``, then any
    other: ``momentum_buffer``...)."""
    adam = ["exp_avg", "exp_avg_sq"] if any(r.exp_avg for r in ckpt.of_kind("trainable")) else []
    return adam + [k for k in ckpt.other_state_keys if k not in adam]


def parallel_sizes(ckpt: Checkpoint) -> dict:
    """``pp_world_size`` (pipeline stages), ``tp_world_size`` (tensor-parallel degree) and ``ep_world_size``
    (expert-parallel size: one int, or the sorted sizes when expert groups differ; 1 without experts), next to
    ``dp_world_size``. ``mp_world_size`` stays DeepSpeed's own field (stages or TP degree, whichever it counted)."""
    ms = ckpt.model_state
    mp = int(ms.get("mp_world_size") or 1)
    pp = mp if ckpt.parallel == "pipeline" else 1
    tp = mp if ckpt.parallel == "tensor" else 1
    ep = sorted({int(m.group(1)) for g in ckpt.groups
                 if (m := re.match(r"^ep_size_(\d+)$", str(g.hyperparams.get("name", ""))))}) or [1]
    return {"pp_world_size": pp, "tp_world_size": tp, "ep_world_size": ep[0] if len(ep) == 1 else ep}


def _one_or_list(dtypes: list[str]):
    """``"float32"`` when every tensor agrees, the sorted list when they differ, None when there are none."""
    return dtypes[0] if len(dtypes) == 1 else (dtypes or None)


def info(path: str, tag: str | None = None, storage_options: dict | None = None) -> dict:
    """What the checkpoint at ``path`` holds (stage, precision, world size, parameters, steps, files), from
    metadata alone. ``storage_options``: fsspec options for a URL ``path`` (the CLI's ``--storage-option``)."""
    ckpt = open_checkpoint(path, tag, storage_options)
    with metadata_errors(ckpt.location.tag_dir):
        d = describe(ckpt)
    d.update(all_files(ckpt))
    return d


def all_files(ckpt: Checkpoint) -> dict:
    """``checkpoint_files`` (every file of the checkpoint in the folder given, as push sends and ``verify --deep``
    reads them: :func:`zckpt.backup.files.files_in_folder`) and ``checkpoint_bytes``; ``files`` lists the rank files."""
    try:
        files = files_in_folder(ckpt.location, ckpt.format, ckpt.storage_options)
    except NotBackedUp as exc:
        return {"checkpoint_files": None, "checkpoint_bytes": None, "checkpoint_files_error": exc.message}
    return {"checkpoint_files": [{"name": f.rel, "bytes": f.size} for f in files],
            "checkpoint_bytes": sum(f.size for f in files)}


def human_bytes(n: int | None) -> str:
    """``26.3 KiB``: the one size style of every command (:func:`zckpt.units.format_size`)."""
    from zckpt.units import format_size

    return format_size(n)


def human_count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _sizes(value) -> str:
    return "/".join(map(str, value)) if isinstance(value, list) else str(value)


def _dtypes(value) -> str:
    if value is None:
        return "none"
    return "+".join(value) if isinstance(value, list) else value


def _scaler(scaler) -> str:
    """``LossScaler, static, scale 1`` (not a Python dict): the class, dynamic or not, the current scale."""
    if not scaler:
        return "none"
    if not isinstance(scaler, dict):
        return str(scaler)
    parts = [str(scaler.get("class") or "loss scaler")]
    if "dynamic" in scaler:
        parts.append("dynamic" if scaler["dynamic"] else "static")
    if isinstance(scaler.get("cur_scale"), (int, float)):
        parts.append(f"scale {scaler['cur_scale']:g}")
    return ", ".join(parts)


def render(d: dict) -> str:
    if d.get("format") == "hf":
        return render_hf(d)
    if d.get("format") == "dcp":
        return render_dcp(d)
    if d.get("format") == "megatron":
        return render_megatron(d)
    c, n = d["counts"], d["numel"]
    lines = [
        f"checkpoint   {d['path']}" + ("  (Trainer checkpoint)" if d["trainer_checkpoint"] else ""),
        f"tag          {d['tag']}",
        f"optimizer    ZeRO-{d['zero_stage']}, {d['optimizer_class']}"
        + (", optimizer offload" if d["offload_optimizer"] else "")
        + (", universal layout (zero/<param>/*.pt)" if d.get("universal") else ""),
        f"precision    {d['precision']}; master weights {_dtypes(d['master_dtype'])}, "
        f"optimizer states {_dtypes(d['optimizer_state_dtype'])}",
        f"world size   {d['dp_world_size']} data-parallel x {d['pp_world_size']} pipeline x {d['tp_world_size']} "
        f"tensor-parallel; expert-parallel {_sizes(d['ep_world_size'])}",
    ] + ([f"experts      {experts.render(d['moe'])}"] if d.get("moe") else []) + [
        f"parameters   {human_count(d['parameters'])} ({d['parameters']:,}): {_kinds(d)}, "
        f"{c['tied']} tied, {c['buffer']} buffers ({n['buffer']:,} elements)"
        + (f"; {len(d['no_optimizer_group'])} parameters in no optimizer group "
           f"({d['no_optimizer_group_numel']:,}, module values)" if d.get("no_optimizer_group") else ""),
        "opt. state   " + (", ".join(d.get("optimizer_state_keys") or []) or "none") + " (per element)",
        f"steps        global_steps={d['global_steps']} global_samples={d['global_samples']} "
        f"skipped={d['skipped_steps']}; optimizer step "
        + ", ".join(f"group {g['index']}: {g['step']}" for g in d["param_groups"]),
        f"loss scaler  {_scaler(d['loss_scaler'])}",
        f"scheduler    {'saved' if d['lr_scheduler'] else 'none'}",
        f"client state {', '.join(d['client_state_keys']) or 'none'}",
        f"deepspeed    {d['ds_version']}",
        f"files        {len(d['files'])}, {human_bytes(d['total_bytes'])}",
    ]
    lines += [f"note         {note}" for note in d.get("notes") or []]
    lines += [f"  {f['name']:<52} {human_bytes(f['bytes']):>10}" for f in d["files"]]
    lines += _all_files_line(d)
    return "\n".join(lines)


def _kinds(d: dict) -> str:
    """``13 trainable (463), 1 frozen (49)``; where the optimizer state of some trainable parameters cannot be
    placed, those are said as such, not as frozen (:func:`describe`'s ``state_not_placed``)."""
    c, n = d["counts"], d["numel"]
    unplaced = d.get("state_not_placed")
    if not unplaced:
        return f"{c['trainable']} trainable ({n['trainable']:,}), {c['frozen']} frozen ({n['frozen']:,})"
    if not c.get("not_told_apart"):
        return (f"{c['trainable']} trainable ({n['trainable']:,}; the optimizer state of {unplaced} cannot be "
                f"placed), {c['frozen']} frozen ({n['frozen']:,})")
    rest = c["not_told_apart"] - unplaced
    known = "".join(f"{c[k]} {k} ({n[k]:,}), " for k in ("trainable", "frozen") if c[k])
    return (f"{known}{c['not_told_apart']} not told apart ({n['not_told_apart']:,}): {unplaced} trainable whose "
            f"optimizer state cannot be placed, {rest} frozen")



def _all_files_line(d: dict) -> list[str]:
    if d.get("checkpoint_files_error"):
        return [f"all files    {d['checkpoint_files_error']}"]
    if d.get("checkpoint_files") is None:
        return []
    return [f"all files    {len(d['checkpoint_files'])}, {human_bytes(d['checkpoint_bytes'])} (every file of the "
            "checkpoint here: what push sends, verify --deep reads)"]

