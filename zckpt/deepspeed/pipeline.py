"""Pipeline-parallel checkpoints (DeepSpeed ``PipelineModule`` + ``PipelineEngine``, ZeRO-0/1 optimizer files).

``PipelineEngine`` saves each layer's ``state_dict`` on its own and one model-states file per pipeline stage with
``module=None`` (``runtime/pipe/module.py`` ``save_state_dict`` / ``ckpt_layer_path``)::

    global_step3/
      layer_00-model_states.pt     layer 0's state_dict, LOCAL keys ("weight"); written by dp rank 0 of its stage
      layer_01-model_states.pt     ("ln.weight", "up.weight", ..., buffers too); a layer without a state_dict
      layer_03-model_states.pt     (a plain function) has no file; TiedLayerSpec layers built with forward_fn
      ...                          neither; tied modules otherwise have a file per layer that uses them
      mp_rank_00_model_states.pt   stage 0: module=None, param_shapes (GLOBAL names, e.g. "1.up.weight",
      mp_rank_01_model_states.pt   "tied_modules.embed.weight"), buffer_names, steps, client state ...
      [bf16_]zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt    ZeRO-1 (or BF16 optimizer) partition of dp rank d
                                                                 of stage s: an ordinary ZeRO-1/2 optimizer file

Each stage is an ordinary ZeRO-1/2 checkpoint of its own parameters over the data-parallel ranks; this reader
builds each stage with :func:`zckpt.deepspeed.zero12.build` and puts the layers together. Names are the keys of
the whole ``PipelineModule.state_dict()``: ``"{layer_idx}.{key}"`` for ordinary layers and
``"tied_modules.{tie_key}.{key}"`` for ``TiedLayerSpec`` modules (one entry, however many stages hold a copy: the
first stage's masters and moments are used; DeepSpeed keeps the copies equal by all-reducing their gradients).
A layer file's tensor is a trainable parameter when its name is in a stage's ``param_shapes``, a buffer when it is
in a stage's ``buffer_names``, and frozen otherwise (ZeRO-1 keeps frozen weights only in the layer files).
Only those names say which file is a tied module: a layer file with neither (all frozen, no buffer) may be an
ordinary frozen layer or a frozen tied module, its names are unknown, and it is refused. ``reshard`` changes only the data-parallel size (:func:`zckpt.ops.reshard.plan_reshard` re-partitions
each stage of ``extra["pipeline_stages"]``); the stage count is fixed by the layer partition.
"""

from __future__ import annotations

import dataclasses
import re

from zckpt.io import storage
from zckpt.deepspeed.discover import Location, RankFile
from zckpt.deepspeed.model import Checkpoint, GroupInfo, TensorRecord, load_all, pieces_of, precision_of
from zckpt.errors import CorruptFile, IncompleteCheckpoint, UnsupportedLayout
from zckpt.encoding.safeload import LazyTensor

TIED_RE = re.compile(r"^tied_modules\.([^.]+)\.(.+)$")

REFUSAL = ("zckpt.deepspeed.load_checkpoint does not load a pipeline-parallel checkpoint: run `zckpt reshard "
           "--world-size <data-parallel size>` (the pipeline stages are kept) and load the output with DeepSpeed's "
           "engine.load_checkpoint")


def build(loc: Location, model_states: list[dict], optim_states: list[dict]) -> Checkpoint:
    stages = _stage_files(loc, model_states)
    if any(f.mp_rank for f in loc.layer_files):
        raise UnsupportedLayout("pipeline checkpoint with a tensor-parallel axis (layer_XX-model_YY files)",
                                path=loc.tag_dir)
    if not optim_states:
        raise UnsupportedLayout("pipeline-parallel checkpoint without ZeRO optimizer files (ZeRO-0 fp32/fp16): "
                                "its optimizer state is not partitioned; zckpt reads pipeline checkpoints of "
                                "ZeRO-1 and the BF16 optimizer", path=loc.tag_dir)
    stray = sorted({f.mp_rank for f in loc.optim_files} - set(range(len(stages))))
    if stray:
        raise IncompleteCheckpoint(f"optimizer files of pipeline stage(s) {stray} but only {len(stages)} stage "
                                   "model-states files", path=loc.tag_dir)
    layers = _load_layers(loc)
    per_stage = [_build_stage(loc, s, mf, ms, optim_states, layers) for s, (mf, ms) in enumerate(stages)]
    trainable: dict[str, TensorRecord] = {}
    groups: list[GroupInfo] = []
    for sub in per_stage:
        base = len(groups)
        for g in sub.groups:
            groups.append(GroupInfo(base + g.index, g.hyperparams, g.step, [n for n in g.names if n not in trainable]))
        for rec in sub.of_kind("trainable"):
            if rec.name not in trainable:  # a tied module: the first stage's copy
                trainable[rec.name] = dataclasses.replace(rec, group=base + (rec.group or 0))
    buffers = {n for _, ms in stages for n in (ms.get("buffer_names") or [])}
    records = _layer_records(layers, trainable, buffers, loc.storage_options)
    missing = [n for n in trainable if n not in {r.name for r in records}]
    if missing:
        raise IncompleteCheckpoint(f"no layer file holds trainable parameter(s) {', '.join(missing[:5])}",
                                   path=loc.tag_dir, hint="a layer_XX-model_states.pt file is missing")
    first = per_stage[0]
    ms0 = stages[0][1]
    dp = {sub.world_size for sub in per_stage}
    if len(dp) != 1:
        raise CorruptFile(f"pipeline stages partitioned over different data-parallel sizes {sorted(dp)}",
                          path=loc.tag_dir)
    notes = [f"pipeline parallel: {len(stages)} stages x {first.world_size} data-parallel ranks, "
             f"{len(loc.layer_files)} layer files"]
    zcfg = (first.ds_config.get("zero_optimization") or {}) if isinstance(first.ds_config, dict) else {}
    stage = 0 if ms0.get("param_shapes") is None and int(zcfg.get("stage") or 0) == 0 else first.stage
    return Checkpoint(loc, stage, first.flavour, precision_of(ms0, None), first.world_size, records, groups,
                      ms0, optim_states, model_states, offload=first.offload, notes=notes, parallel="pipeline",
                      reshard_refusal=REFUSAL,
                      extra={"pipeline_stages": per_stage, "stage_model_states": [ms for _, ms in stages]})


def _stage_files(loc: Location, model_states: list[dict]) -> list[tuple[RankFile, dict]]:
    """(model file, metadata) per stage, in stage order; every stage 0..pp-1 present exactly once."""
    pairs = sorted(zip(loc.model_files, model_states), key=lambda p: p[0].mp_rank)
    ranks = [f.mp_rank for f, _ in pairs]
    pp = int(pairs[0][1].get("mp_world_size") or len(pairs))
    dims = pairs[0][1].get("checkpoint_parallel_dimensions") or {}
    if isinstance(dims, dict) and int(dims.get("tp_degree") or 1) > 1:
        raise UnsupportedLayout(f"pipeline checkpoint with tensor parallelism (tp_degree={dims['tp_degree']})",
                                path=loc.tag_dir)
    if ranks != list(range(pp)) or any(f.dp_rank is not None for f in loc.model_files):
        raise IncompleteCheckpoint(f"a pipeline of {pp} stages needs mp_rank_00..{pp - 1:02d}_model_states.pt, "
                                   f"found mp ranks {ranks}", path=loc.tag_dir)
    for f, ms in pairs:
        if ms.get("module") is not None:
            raise UnsupportedLayout("pipeline-parallel layer files (layer_XX-model_states.pt) next to a model-states "
                                    "file with a module: not a PipelineEngine save", path=f.path,
                                    hint="remove the stray layer_* files, or pass a complete pipeline checkpoint")
    return pairs


def _build_stage(loc: Location, s: int, mfile: RankFile, ms: dict, optim_states: list[dict],
                 layers: list[tuple[RankFile, dict]]) -> Checkpoint:
    """Stage ``s`` as an ordinary ZeRO-1/2 checkpoint of its own parameters (zero12 reads it)."""
    from zckpt.deepspeed import zero12

    pairs = [(f, st) for f, st in zip(loc.optim_files, optim_states) if f.mp_rank == s]
    if not pairs:
        raise IncompleteCheckpoint(f"no optimizer files for pipeline stage {s} (*_mp_rank_{s:02d}_optim_states.pt)",
                                   path=loc.tag_dir)
    pairs.sort(key=lambda p: p[0].dp_rank)
    sub = Location(loc.input_path, loc.save_dir, loc.tag, loc.tag_dir, loc.trainer_dir,
                   model_files=[mfile], optim_files=[f for f, _ in pairs], has_latest=loc.has_latest,
                   storage_options=loc.storage_options)
    for st in (st for _, st in pairs):
        osd = st.get("optimizer_state_dict")
        if not isinstance(osd, dict):
            raise CorruptFile("not a DeepSpeed optimizer-states file (no 'optimizer_state_dict')", path=mfile.path)
        if osd.get("zero_stage") is not None and int(osd["zero_stage"]) not in (1, 2):
            raise UnsupportedLayout(f"pipeline stage {s} has zero_stage {int(osd['zero_stage'])}", path=loc.tag_dir)
    ms_stage = {**ms, "module": None, "frozen_param_shapes": None, "frozen_param_fragments": None,
                "shared_params": {}, "buffer_names": []}
    if ms.get("param_shapes") is None:  # ZeRO-0 + bf16: BF16_Optimizer files, no param_shapes in the model file
        ms_stage["param_shapes"] = _shapes_from_mappings([st["optimizer_state_dict"] for _, st in pairs], layers,
                                                         set(ms.get("buffer_names") or []), mfile.path)
    return zero12.build(sub, [ms_stage], [st for _, st in pairs])


def _load_layers(loc: Location) -> list[tuple[RankFile, dict]]:
    """(file, state_dict metadata) of every layer file, in layer order."""
    files = sorted(loc.layer_files, key=lambda f: f.index)
    out = list(zip(files, load_all(files, loc.storage_options)))  # metadata only; in parallel for URLs
    for f, sd in out:
        if not all(isinstance(t, LazyTensor) for t in sd.values()):
            raise CorruptFile("a pipeline layer file should hold a state_dict of tensors", path=f.path)
    return out


def _shapes_from_mappings(osds: list[dict], layers, buffers: set[str], path: str) -> list[dict]:
    """``param_shapes`` rebuilt for a stage whose model file has none (ZeRO-0 + bf16, BF16_Optimizer): the
    parameter order from every rank's ``param_slice_mappings`` (rank r's partition starts at r * P), the shapes
    from the layer files. zero12 then checks every slice against the mappings again."""
    fp32 = osds[0].get("single_partition_of_fp32_groups")
    if not isinstance(fp32, list):
        raise CorruptFile("no single_partition_of_fp32_groups list", path=path)
    out = []
    for g in range(len(fp32)):
        frags = []
        for r, osd in enumerate(osds):
            maps = osd.get("param_slice_mappings")
            part = (osd.get("single_partition_of_fp32_groups") or [None] * (g + 1))[g]
            if not isinstance(maps, list) or g >= len(maps) or not isinstance(part, LazyTensor):
                raise UnsupportedLayout("pipeline stage without param_shapes and without param_slice_mappings: "
                                        "parameter names unknown", path=path)
            frags += [(r * part.numel + int(frag.get("start", 0)), name, int(frag.get("numel", 0)))
                      for name, frag in maps[g].items()]
        numels: dict[str, int] = {}
        for _, name, n in sorted(frags, key=lambda t: t[0]):
            numels[name] = numels.get(name, 0) + n
        names = set(numels) | buffers
        shapes = {}
        for name, n in numels.items():
            shape = _layer_shape(name, layers, names)
            if shape is None:
                raise IncompleteCheckpoint(f"no layer file holds trainable parameter '{name}'", path=path,
                                           hint="a layer_XX-model_states.pt file is missing")
            if _prod(shape) != n:
                raise CorruptFile(f"'{name}': the optimizer holds {n} elements, the layer file {list(shape)}",
                                  path=path)
            shapes[name] = shape
        out.append(shapes)
    return out


def _layer_shape(name: str, layers, names: set[str]) -> tuple | None:
    """The shape of ``name`` in the layer files; a tied module's, when every candidate file agrees."""
    m = TIED_RE.match(name)
    if not m:
        idx, _, key = name.partition(".")
        return next((tuple(sd[key].shape) for f, sd in layers if str(f.index) == idx and key in sd), None)
    found = {tuple(sd[m.group(2)].shape) for f, sd in layers
             if m.group(2) in sd and not any(f"{f.index}.{k}" in names for k in sd)}
    return found.pop() if len(found) == 1 else None


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _layer_records(layers, trainable: dict[str, TensorRecord], buffers: set[str],
                   storage_options: dict | None = None) -> list[TensorRecord]:
    """Every tensor of every layer file, named as in ``PipelineModule.state_dict()``; tied modules first."""
    tied_names: dict[str, set[str]] = {}
    for name in list(trainable) + sorted(buffers):
        if m := TIED_RE.match(name):
            tied_names.setdefault(m.group(1), set()).add(m.group(2))
    tied_out: list[TensorRecord] = []
    layer_out: list[TensorRecord] = []
    seen: dict[str, LazyTensor] = {}
    for f, sd in layers:
        prefix = _prefix_of(f, sd, trainable, buffers, tied_names)
        out = tied_out if prefix.startswith("tied_modules.") else layer_out
        for key, t in sd.items():
            name = prefix + key
            if name in seen:  # the same tied module saved by another layer: one copy (checked to be the same)
                _same_copy(name, seen[name], t, f, storage_options)
                continue
            seen[name] = t
            out.append(_record(name, t, trainable, buffers, f.path))
    return tied_out + layer_out


def _same_copy(name: str, first: LazyTensor, t: LazyTensor, f: RankFile, storage_options: dict | None) -> None:
    """A second layer file taken for tied module ``name``'s must hold the same values (its first elements are
    compared): a frozen layer of the same keys and shapes would otherwise be dropped silently."""
    n = min(first.numel, 256)
    same = (tuple(first.shape), first.dtype) == (tuple(t.shape), t.dtype) and first.is_contiguous() \
        and t.is_contiguous() and storage.read_range(first.storage.path, first.byte_offset, n * first.itemsize,
                                                      storage_options) == \
        storage.read_range(t.storage.path, t.byte_offset, n * t.itemsize, storage_options)
    if not same:
        raise UnsupportedLayout(f"layer {f.index} has the keys of tied module '{name}' but other values: a frozen "
                                "layer or another tied module, which DeepSpeed's files do not tell apart", path=f.path)


def _prefix_of(f: RankFile, sd: dict, trainable, buffers, tied_names: dict[str, set[str]]) -> str:
    """``"{idx}."`` for an ordinary layer, ``"tied_modules.{key}."`` for the tied module this file holds.

    Only trainable and buffer names say which (``param_shapes``, ``param_slice_mappings`` and ``buffer_names``
    list nothing else): a file with neither is an ordinary frozen layer or a frozen ``TiedLayerSpec`` module,
    and its names in ``PipelineModule.state_dict()`` are unknown: refused."""
    plain = f"{f.index}."
    if any(plain + k in trainable or plain + k in buffers for k in sd):
        return plain
    keys = set(sd)
    match = [k for k, names in tied_names.items() if names and names <= keys]
    if len(match) > 1:  # same parameter names: decide by shapes
        match = [k for k in match if all(tuple(trainable[f"tied_modules.{k}.{n}"].shape) == tuple(sd[n].shape)
                                         for n in tied_names[k] if f"tied_modules.{k}.{n}" in trainable)]
    if len(match) > 1:
        raise UnsupportedLayout(f"layer {f.index} could be tied module {' or '.join(match)}; zckpt cannot tell "
                                "which one this file holds", path=f.path)
    if match:
        return f"tied_modules.{match[0]}."
    if sd:
        raise UnsupportedLayout(
            f"pipeline layer {f.index} holds only frozen tensors ({', '.join(list(sd)[:3])}): DeepSpeed's files do "
            f"not say whether they are '{plain}*' or a frozen TiedLayerSpec module's 'tied_modules.<key>.*', so "
            "their names are unknown", path=f.path,
            hint="resume it with DeepSpeed's own load_checkpoint and the same PipelineModule")
    return plain


def _record(name: str, t: LazyTensor, trainable: dict[str, TensorRecord], buffers: set[str],
            path: str) -> TensorRecord:
    rec = trainable.get(name)
    if rec is not None:
        if tuple(rec.shape) != tuple(t.shape):
            raise CorruptFile(f"'{name}' has shape {list(t.shape)} in its layer file, {list(rec.shape)} in "
                              "param_shapes", path=path)
        return dataclasses.replace(rec, lp_dtype=t.dtype)
    kind = "buffer" if name in buffers else "frozen"
    return TensorRecord(name, tuple(t.shape), kind, t.dtype, pieces_of(t),
                        lp_dtype=t.dtype if kind == "frozen" else None)
