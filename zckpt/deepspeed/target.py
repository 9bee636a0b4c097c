"""What the DeepSpeed writer plans against: the target layout (world size, stage, optimizer flavour, config) of a
training state, the source's groups in DeepSpeed's order, the pieces every rank file shares (loss scaler, frozen
weights, the model-states file), the module state dicts, and the plan's plain data (:class:`PlannedFile`,
:class:`ReshardPlan`) with the side files copied beside it (a Trainer checkpoint's config, scheduler, RNG states).

:mod:`zckpt.deepspeed.writer` is the entry; :mod:`zckpt.deepspeed.write_zero` lays out ZeRO-1/2/3 rank files,
:mod:`zckpt.deepspeed.write_parallel` pipeline and mixture-of-experts checkpoints; the partition maths is
:mod:`zckpt.deepspeed.partition`.
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
from dataclasses import dataclass, field

from zckpt.engine import torchzip
from zckpt.deepspeed import partition as W
from zckpt.deepspeed.partition import TorchObject
from zckpt.state.model import LP_DTYPES, Checkpoint, TensorRecord
from zckpt.errors import InvalidArgument, UnsupportedLayout
from zckpt.encoding.safeload import LazyTensor
from zckpt.engine.segments import Cast
from zckpt.engine.torchzip import TensorOut
from zckpt.units import format_size


# ---------------------------------------------------------------------------------------------- plan data

@dataclass
class PlannedFile:
    """One output file, planned once into its final bytes.

    ``kind`` "torch": ``archive`` is the torch zip laid out by :func:`zckpt.engine.torchzip.plan_archive` (the
    pickle of ``obj``, every entry and offset; only tensor bytes and their CRCs are left to write); "copy": ``src``
    is copied as it is; "object" (:func:`plan_ranks`): ``obj`` is loaded in memory, nothing is written.
    ``nbytes``: the size of the file written; ``payload_bytes``: the bytes copied from the source (its tensors)."""

    relpath: str
    kind: str
    nbytes: int
    payload_bytes: int = 0
    archive: torchzip.Archive | None = None
    obj: object = None  # the object tree (TensorOut leaves) the archive was pickled from
    src: str | None = None

    def __repr__(self) -> str:
        return f"<PlannedFile {self.relpath!r} ({self.kind}): {format_size(self.nbytes)}>"


@dataclass
class ReshardPlan:
    source: str
    tag: str
    fmt: str
    source_stage: int
    source_flavour: str
    source_world_size: int
    stage: int
    flavour: str
    world_size: int
    precision: str
    files: list[PlannedFile]
    notes: list[str] = field(default_factory=list)
    partitions: list[dict] = field(default_factory=list)  # per group / sub-group partition sizes

    def __repr__(self) -> str:
        return (f"<ReshardPlan {self.precision} ZeRO-{self.source_stage} x{self.source_world_size} -> "
                f"ZeRO-{self.stage} x{self.world_size} ({self.fmt}): {len(self.files)} files, "
                f"{format_size(self.total_bytes)}>")

    @property
    def total_bytes(self) -> int:
        """The size of the output: what --dry-run reports and execute writes (and reports to ``progress``)."""
        return sum(f.nbytes for f in self.files)

    @property
    def payload_bytes(self) -> int:
        return sum(f.payload_bytes for f in self.files)

    def summary(self) -> dict:
        return {
            "source": self.source, "tag": self.tag, "format": self.fmt,
            "from": {"stage": self.source_stage, "optimizer": self.source_flavour,
                     "world_size": self.source_world_size},
            "to": {"stage": self.stage, "optimizer": self.flavour, "world_size": self.world_size},
            "precision": self.precision, "total_bytes": self.total_bytes,
            "files": [{"name": f.relpath, "bytes": f.nbytes, "kind": f.kind, "payload_bytes": f.payload_bytes}
                      for f in self.files],
            "partitions": self.partitions, "notes": self.notes, "payload_bytes": self.payload_bytes,
        }


# ---------------------------------------------------------------------------------------------- planning

def flavour_of(stage: int, bf16_optimizer: bool) -> str:
    if stage == 3:
        return "zero3"
    return "bf16_optimizer" if bf16_optimizer else "zero"


def _target_config(cfg: dict, stage: int, flavour: str) -> dict:
    """The source's DeepSpeed config with the ZeRO stage (and BF16-optimizer switch) of the target."""
    cfg = copy.deepcopy(cfg) if isinstance(cfg, dict) else {}
    zero = cfg.get("zero_optimization")
    zero = dict(zero) if isinstance(zero, dict) else {}
    zero["stage"] = stage
    cfg["zero_optimization"] = zero
    dtypes = cfg.get("data_types") if isinstance(cfg.get("data_types"), dict) else None
    if flavour == "bf16_optimizer":
        cfg["data_types"] = {**(dtypes or {}), "grad_accum_dtype": "fp32"}
    elif dtypes is not None and dtypes.get("grad_accum_dtype") == "fp32" and stage == 1:
        dtypes = {k: v for k, v in dtypes.items() if k != "grad_accum_dtype"}
        if dtypes:
            cfg["data_types"] = dtypes
        else:
            cfg.pop("data_types")
    return cfg


@dataclass
class Group:
    """A user optimizer param group: hyperparameters (source key order), step, trainable records."""

    index: int
    hyper: OrderedDict  # without 'params'; None marks where 'params' sits
    step: object  # LazyTensor, number, or None (no optimizer state yet)
    records: list[TensorRecord]
    # the source's state dict of the group's (first) flat partition, in its key order: the per-element keys are
    # re-partitioned, every other value (a step, a counter) carried as saved; None: no state, or a DCP source
    template: OrderedDict | None = None


def _source_groups(ckpt: Checkpoint) -> list[Group]:
    if ckpt.format != "deepspeed":  # zckpt.ops.to_deepspeed: the groups as another format saved them (DCP's,
        # or Megatron's placed by its format's training_state), one step tensor per group (deepspeed_source)
        byname, steps = ckpt.by_name(), ckpt.extra.get("group_steps") or {}
        return [Group(g.index, OrderedDict((k, None if k == "params" else v) for k, v in g.hyperparams.items()),
                       steps.get(g.index), [byname[n] for n in g.names]) for g in ckpt.groups]
    osd0 = ckpt.optim_states[0]["optimizer_state_dict"]
    path = ckpt.location.optim_files[0].path
    if ckpt.flavour == "zero3":
        inner = osd0.get("optimizer_state_dict") or {}
        pgs, state = inner.get("param_groups") or [], inner.get("state") or {}
    else:
        bos = osd0.get("base_optimizer_state")
        if isinstance(bos, list):  # elastic_checkpoint: per-group states, no param_groups (see is_elastic)
            return [Group(info.index, OrderedDict(), bos[info.index].get("step") if info.index < len(bos)
                           and isinstance(bos[info.index], dict) else None,
                           [ckpt.by_name()[n] for n in info.names]) for info in ckpt.groups]
        if not isinstance(bos, dict):
            raise UnsupportedLayout("optimizer file has no base_optimizer_state", path=path)
        pgs, state = bos.get("param_groups") or [], bos.get("state") or {}
    byname = ckpt.by_name()
    groups = []
    for info in ckpt.groups:
        pg = pgs[info.index] if info.index < len(pgs) else {}
        hyper = OrderedDict((k, (None if k == "params" else v)) for k, v in pg.items())
        ids = list(pg.get("params") or [])
        st = state.get(ids[0]) if ids else None
        step = st.get("step") if isinstance(st, dict) else None
        groups.append(Group(info.index, hyper, step, [byname[n] for n in info.names],
                             OrderedDict(st) if isinstance(st, dict) and st else None))
    return groups


def state_pieces(rec: TensorRecord, key: str) -> list:
    """The pieces of ``rec``'s per-element optimizer state ``key`` (Adam's moments or any other)."""
    if key in rec.other_state:
        return list(rec.other_state[key])
    return list(rec.exp_avg if key == "exp_avg" else rec.exp_avg_sq if key == "exp_avg_sq" else [])


def _state_keys(ckpt: Checkpoint, groups: list[Group]) -> tuple[list[str], bool]:
    """(the per-element optimizer-state keys every trainable parameter has, whether every group holds its state):
    Adam's ``exp_avg`` / ``exp_avg_sq`` with a step, or (any other optimizer: SGD's ``momentum_buffer``, Lion's
    ``exp_avg``...) the keys of ``other_state``, found in every group's saved state dict."""
    recs = [r for g in groups for r in g.records]
    if all(g.step is not None for g in groups) and all(r.exp_avg and r.exp_avg_sq for r in recs):
        adam = ["exp_avg", "exp_avg_sq"]
        return adam + [k for k in ckpt.other_state_keys if k not in adam], True
    keys = ckpt.other_state_keys
    if keys and recs and all(set(r.other_state) == set(keys) for r in recs) and \
            all(g.template is not None and all(k in g.template for k in keys) for g in groups):
        return keys, True
    if keys:  # state for some parameters only: never written with a part dropped
        raise UnsupportedLayout(f"optimizer state {', '.join(repr(k) for k in keys)} is saved for some param "
                                "groups or parameters only", path=ckpt.location.tag_dir)
    if recs and groups and all(g.template for g in groups):  # scalars only (counters, a [1]-shaped step equal on
        return [], True  # every rank, as DeepSpeed's HybridStateOptimizer test keeps): carried as saved
    return [], False


def is_elastic(ckpt: Checkpoint) -> bool:
    """ZeRO-1/2 saved with ``elastic_checkpoint: true``: ``base_optimizer_state`` is a list of per-group states
    (padding stripped) and holds no param_groups, so no hyperparameters. It is resharded into the same elastic
    form (a rigid file would need the hyperparameters torch's ``load_state_dict`` restores); DeepSpeed loads it
    into an elastic engine at any world size and into a rigid one at the written size."""
    if ckpt.flavour != "zero" or not ckpt.optim_states:
        return False
    return isinstance(ckpt.optim_states[0]["optimizer_state_dict"].get("base_optimizer_state"), list)


def elastic_base(state: OrderedDict, pads: list[int]) -> list:
    """The elastic ``base_optimizer_state`` of one rank: each group's state with this rank's padding stripped
    (``_get_state_without_padding``: tensors of one or more dims lose their last ``pad`` elements)."""
    out = []
    for gi, pad in enumerate(pads):
        lean = OrderedDict()
        for key, value in (state.get(gi) or {}).items():
            if isinstance(value, TensorOut) and len(value.shape) > 0:
                n = value.numel - pad
                value = TensorOut(value.dtype, (n,), W.slice_segments(value.segments, 0, n))
            lean[key] = value
        out.append(lean)
    return out


def group_params(hyper: OrderedDict, ids: list[int], conv: W.Converter) -> dict:
    out = {k: (list(ids) if k == "params" else conv(v)) for k, v in hyper.items()}
    if "params" not in out:
        out["params"] = list(ids)
    return out


def _step_out(step) -> TensorOut | None:
    if step is None:
        return None
    if isinstance(step, TensorOut):  # made by deepspeed_source (a source with one step per group)
        return step
    if isinstance(step, LazyTensor):
        from zckpt.state.model import pieces_of
        return TensorOut(step.dtype, tuple(step.shape), pieces_of(step))
    return step  # an int/float step (old torch): kept as is


def output_tag(ckpt: Checkpoint) -> str:
    """The tag the output is written under: the source's, less the ``_universal`` of a universal source."""
    tag = ckpt.tag
    if ckpt.location.universal and tag.endswith("_universal") and len(tag) > len("_universal"):
        tag = tag[: -len("_universal")]
    return tag


@dataclass
class Target:
    """The layout being planned (world size, stage, optimizer, config) and the source facts every file needs."""

    ckpt: Checkpoint
    world_size: int
    stage: int
    flavour: str
    cfg: dict  # the target's DeepSpeed config
    ranks: list[int]  # the ranks whose files are planned (plan_ranks narrows them)
    tag: str
    version: str
    groups: list[Group]
    elastic: bool  # written back elastic (see is_elastic)
    has_state: bool  # the optimizer state of every group: Adam moments and a step, or any per-element state
    conv: W.Converter
    state_keys: list = field(default_factory=list)  # the per-element state keys, re-partitioned like the masters
    mp_rank: int = 0  # the pipeline stage whose files are planned (``mp_rank_{SS}`` in the names)

    @property
    def ms0(self) -> dict:
        return self.ckpt.model_state

    @property
    def osd0(self) -> dict:
        return self.ckpt.optim_states[0]["optimizer_state_dict"]

    def lp_dtype(self, rec: TensorRecord) -> str:
        return rec.lp_dtype or LP_DTYPES[self.ckpt.precision]

    def relpath(self, name: str) -> str:
        return os.path.join(self.tag, name)

    def optim_path(self, rank: int) -> str:
        prefix = "bf16_" if self.ckpt.precision == "bf16" else ""
        return self.relpath(f"{prefix}zero_pp_rank_{rank}_mp_rank_{self.mp_rank:02d}_optim_states.pt")

    def model_path(self, rank: int) -> str:
        return self.relpath(f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if self.stage == 3
                            else "mp_rank_00_model_states.pt")


def target_of(ckpt: Checkpoint, world_size: int, stage: int, flavour: str, ranks=None) -> Target:
    groups = _source_groups(ckpt)
    keys, has_state = _state_keys(ckpt, groups)
    version = ckpt.model_state.get("ds_version") or ckpt.optim_states[0].get("ds_version") or "0.19.8"
    return Target(ckpt, world_size, stage, flavour, _target_config(ckpt.ds_config, stage, flavour),
                   list(range(world_size)) if ranks is None else [int(r) for r in ranks], output_tag(ckpt),
                   version, groups, is_elastic(ckpt), has_state, W.Converter(), keys)


def key_dtype(t: Target, records: list[TensorRecord], key: str, what: str) -> str:
    """The one dtype ``key``'s pieces are stored in over ``records`` (one flat buffer holds one dtype)."""
    dts = {p.dtype for r in records for p in state_pieces(r, key)}
    if len(dts) > 1:
        raise UnsupportedLayout(f"{what} of the target layout would mix dtypes of the optimizer state '{key}' "
                                f"({', '.join(sorted(dts))})", path=t.ckpt.location.tag_dir)
    return dts.pop() if dts else "float32"


def state_dict_out(t: Target, g: Group, part) -> OrderedDict:
    """One flat partition's optimizer state: the per-element keys from ``part(key)`` (a TensorOut), every other
    value as the source saved it, in the source's key order (Adam's: step, exp_avg, exp_avg_sq, as torch has it)."""
    adam = ("exp_avg", "exp_avg_sq")
    if g.template is None or set(g.template) <= {"step", *adam}:
        out = OrderedDict([("step", _step_out(g.step))] if g.step is not None or t.state_keys[:2] == list(adam)
                          else [])
        for key in t.state_keys:
            out[key] = part(key)
        return out
    out = OrderedDict()
    for key, value in g.template.items():
        key = str(key) if isinstance(key, str) else key
        if key in t.state_keys:
            out[key] = part(key)
        elif key == "step":
            out[key] = _step_out(value)
        else:
            out[key] = t.conv(value) if isinstance(value, LazyTensor) else copy.deepcopy(value)
    return out


# ---- pieces every rank file shares

def flat_dtypes(t: Target, records: list[TensorRecord], what: str) -> tuple[str, str | None]:
    """(master dtype, moment dtype) of the params that share one flat target buffer, as the source stores
    them (fp32, or bf16 with bf16_master_weights_and_grads / bf16_optimizer_states). One buffer holds one
    dtype: params whose sources disagree cannot share it, and are refused rather than converted."""
    mdt = {r.dtype for r in records}
    sdt = {r.state_dtype for r in records} if t.has_state else set()
    if len(mdt) > 1 or len(sdt) > 1:
        raise UnsupportedLayout(f"{what} of the target layout would mix master or optimizer-state dtypes "
                                f"({', '.join(sorted(mdt | {d for d in sdt if d}))})", path=t.ckpt.location.tag_dir,
                                hint="keep the source's param groups (same stage), or reshard to ZeRO-3")
    return (mdt.pop() if mdt else "float32"), (sdt.pop() if sdt else None)


def loss_scaler_state(t: Target) -> OrderedDict:
    scaler = t.osd0.get("loss_scaler")
    return OrderedDict([
        ("loss_scaler", t.conv(scaler) if scaler is not None else W.default_loss_scaler()),
        ("dynamic_loss_scale", bool(t.osd0.get("dynamic_loss_scale", False))),
        ("overflow", bool(t.osd0.get("overflow", False))),
    ])


def clip_grad(t: Target) -> float:
    if "clip_grad" in t.osd0:
        return t.osd0["clip_grad"]
    return float(t.ckpt.ds_config.get("gradient_clipping", 0.0) or 0.0)


def frozen_records(t: Target) -> list[TensorRecord]:
    """What DeepSpeed lists as frozen (``requires_grad=False``): not the parameters in no optimizer group, which
    it keeps in ``module`` only."""
    return [r for r in t.ckpt.records if r.kind == "frozen" and not r.no_group]


def optim_file(t: Target, rank: int, osd: dict) -> TorchObject:
    return TorchObject(t.optim_path(rank), {"optimizer_state_dict": osd, "ds_config": copy.deepcopy(t.cfg),
                                            "ds_version": t.version})


_MODEL_KEYS = ["module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
               "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
               "global_steps", "global_samples", "dp_world_size", "mp_world_size",
               "checkpoint_parallel_dimensions", "ds_config", "ds_version"]
MODEL_KEYS = tuple(_MODEL_KEYS)  # DeepSpeed's own keys of a model-states file; the others are the client state


def model_file(t: Target, rank: int, module, param_shapes, frozen_shapes, frozen_frags) -> TorchObject:
    """The model-states file of ``rank``, keys in the source's order (DeepSpeed's), client-state keys included."""
    ms0 = t.ms0
    shared = ms0.get("shared_params")
    values = {
        "module": module,
        "buffer_names": list(ms0.get("buffer_names") or []),
        "optimizer": None,
        "param_shapes": param_shapes,
        "frozen_param_shapes": frozen_shapes,
        "shared_params": dict(shared or {}) if rank == 0 else {},
        "frozen_param_fragments": frozen_frags,
        "dp_world_size": t.world_size,
        "ds_config": copy.deepcopy(t.cfg),
    }
    keys = list(ms0.keys()) + [k for k in _MODEL_KEYS if k not in ms0 and k in values]
    return TorchObject(t.model_path(rank), {k: values[k] if k in values else t.conv(ms0[k]) for k in keys})


# ---- module state dicts

def module_zero12(t: Target) -> OrderedDict:
    """The full ``module`` state dict of a ZeRO-1/2 model-states file (tied weights stay one tensor)."""
    module = t.ms0.get("module") or {}
    byname = t.ckpt.by_name()
    out = OrderedDict()
    made: dict[str, TensorOut] = {}
    for name, src in module.items():
        rec = byname.get(name)
        if rec is None:
            out[name] = t.conv(src)
            continue
        base = byname.get(rec.tied_to) if rec.kind == "tied" else rec
        key = base.name if base is not None else name
        if key not in made:
            made[key] = t.conv(src) if base is None else _module_tensor_zero12(t, base, module.get(base.name))
        out[name] = made[key]
    return out


def _module_tensor_zero12(t: Target, base: TensorRecord, msrc) -> TensorOut:
    """One full weight: the source module's own tensor when it holds it whole (ZeRO-1/2 source), else the
    record's pieces (a trainable one cast from its fp32 master to the low-precision dtype)."""
    if t.ckpt.stage != 3 and isinstance(msrc, LazyTensor) and (base.kind != "trainable" or msrc.numel == base.numel):
        return t.conv(msrc)
    if base.kind == "trainable":
        lp = t.lp_dtype(base)
        return TensorOut(lp, base.shape, list(base.value) if lp == base.dtype else [Cast(list(base.value), base.dtype)])
    return TensorOut(base.dtype, base.shape, list(base.value))  # frozen, buffer


def module_zero3(t: Target) -> OrderedDict:
    """The ``module`` of a ZeRO-3 model-states file: buffers whole, parameters as empty placeholders."""
    module = t.ms0.get("module") or {}
    byname = t.ckpt.by_name()
    out = OrderedDict()
    placeholders: dict[str, TensorOut] = {}
    for name, src in module.items():
        rec = byname.get(name)
        if rec is None or (rec.kind == "buffer" and t.ckpt.stage == 3):
            out[name] = t.conv(src)
        elif rec.kind == "buffer" or rec.no_group:  # (a parameter in no group: never partitioned, kept whole)
            out[name] = TensorOut(rec.dtype, rec.shape, list(rec.value))
        else:
            base = rec.tied_to if rec.kind == "tied" else name
            if base not in placeholders:
                placeholders[base] = TensorOut(t.lp_dtype(byname.get(base, rec)), (0,), [])
            out[name] = placeholders[base]
    return out


def planned(obj: TorchObject) -> PlannedFile:
    """A torch file laid out once: pickled, every entry placed; execute writes exactly this."""
    archive = torchzip.plan_archive(obj.obj, torchzip.archive_name_of(obj.relpath))
    return PlannedFile(obj.relpath, "torch", archive.file_size, archive.payload_bytes, archive=archive, obj=obj.obj)


def check_world_size(world_size) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise InvalidArgument(f"must be a positive integer, got {world_size!r}", param="world_size")


# ---------------------------------------------------------------------------------------------- side files

def _rng_name(rank: int, world_size: int) -> str:
    return "rng_state.pth" if world_size == 1 else f"rng_state_{rank}.pth"


def copied(relpath: str, src: str, nbytes: int) -> PlannedFile:
    return PlannedFile(relpath, "copy", nbytes, nbytes, src=src)


def side_planned(side, world_size: int) -> list[PlannedFile]:
    """``side``: everything of the checkpoint that is not its tag (what the caller lists, e.g.
    :func:`zckpt.backup.files.side_files`: a Trainer checkpoint's config, trainer_state.json, scheduler, tokenizer,
    any subfolder..., a save folder's scripts and configs; items with ``rel``, ``path`` and ``size``), copied as it
    is; the RNG states renamed for the new ranks."""
    out: list[PlannedFile] = []
    rng_src = {}
    for f in side:
        if f.rel == "rng_state.pth":
            rng_src[0] = f
            continue
        if f.rel.startswith("rng_state_") and f.rel.endswith(".pth") and f.rel[10:-4].isdigit():
            rng_src[int(f.rel[10:-4])] = f
            continue
        out.append(copied(f.rel, f.path, f.size))
    for rank in range(world_size):  # ranks beyond the source's get no RNG file: the Trainer warns and goes on
        if rank in rng_src:
            out.append(copied(_rng_name(rank, world_size), rng_src[rank].path, rng_src[rank].size))
    return out
