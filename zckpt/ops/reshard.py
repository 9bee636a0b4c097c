"""Re-partitioning a DeepSpeed checkpoint for another data-parallel world size and/or ZeRO stage.

Read -> plan -> execute, like :mod:`zckpt.ops.merge`:

1. :func:`zckpt.state.open.open_checkpoint` describes the source from metadata alone: every parameter's
   fp32 master and Adam moments as lists of byte ranges (pieces) in the rank files.
2. :func:`plan_reshard` lays the same training state out as DeepSpeed itself would have saved it at world size
   M and stage S (partition math in :mod:`zckpt.deepspeed.writer`): per output file, the object tree with
   :class:`~zckpt.engine.torchzip.TensorOut` leaves made of source pieces and zero fill (one function per kind of
   file: ``_zero12_model``, ``_zero12_optim``, ``_zero3_model``, ``_zero3_optim``, and
   :func:`zckpt.ops.universal.plan_universal`), then pickled once into its final byte layout
   (:func:`zckpt.engine.torchzip.plan_archive`): a :class:`ReshardPlan` of :class:`PlannedFile` s, plain data whose
   sizes are the output's; ``--dry-run`` prints its summary.
3. :func:`execute` writes exactly those archives (:func:`zckpt.engine.torchzip.write_planned`, nothing pickled
   again) and copies the side files into a temporary sibling of OUT, writes ``latest`` and the ``.zckpt.json``
   marker last, and renames the folder into place (:mod:`zckpt.io.publish`). The source is never modified; no
   tensor is held whole.

Output (``fmt="deepspeed"``)::

    OUT/latest                                      the source tag
    OUT/.zckpt.json                                 zckpt's output marker (kind "reshard"; see zckpt.io.publish)
    OUT/zero_to_fp32.py, zero_to_torch.py           copied when the source save folder has them
    OUT/<tag>/mp_rank_00_model_states.pt            stage 1/2 (stage 3: zero_pp_rank_{r}_mp_rank_00_model_states.pt)
    OUT/<tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt   r = 0..M-1
    OUT/<Trainer files>                             for a checkpoint-N: config, trainer_state.json, scheduler.pt,
                                                    rng_state_{r}.pth for r < min(N, M) (see docs/reshard.md)

``fmt="universal"`` writes DeepSpeed's universal layout instead (:mod:`zckpt.ops.universal`).

A pipeline-parallel source (``PipelineEngine``, ZeRO-1) keeps its stages: ``world_size`` is the new data-parallel
size, and each stage's ``..._mp_rank_{SS}_optim_states.pt`` are planned by the same ZeRO-1 writer
(:func:`_plan_pipeline`). A mixture-of-experts source (:mod:`zckpt.deepspeed.moe`, ZeRO-1/2) keeps its
expert-parallel size: dense groups are re-partitioned over ``world_size`` ranks, each expert group over each
expert-parallel rank's ``world_size / ep`` expert-data-parallel ranks, by the same ZeRO-1/2 writer
(:func:`_plan_moe`); the expert files are copied.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from zckpt.engine import executor, torchzip
from zckpt.engine.checked import InputCheck
from zckpt.io import publish, storage
from zckpt.state import checksums
from zckpt.backup.files import side_files
from zckpt.deepspeed import writer as W
from zckpt.deepspeed.writer import TorchObject
from zckpt.state.model import LP_DTYPES, Checkpoint, TensorRecord
from zckpt.state.open import open_checkpoint
from zckpt.errors import InvalidArgument, UnsupportedLayout
from zckpt.encoding.safeload import DTYPE_SIZES, LazyTensor
from zckpt.engine.segments import Cast
from zckpt.engine.torchzip import TensorOut
from zckpt.units import format_size

log = logging.getLogger(__name__)

FORMATS = ("deepspeed", "universal")


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


@dataclass
class ReshardResult:
    output: str
    plan: ReshardPlan
    seconds: float = 0.0
    dry_run: bool = False
    stats: dict = field(default_factory=dict)  # ranks, bytes per second, remote reads (engine.distributed.Stats)

    def to_json(self) -> dict:
        return {"output": self.output, "dry_run": self.dry_run, "seconds": round(self.seconds, 3),
                **self.plan.summary(), **({"stats": self.stats} if self.stats else {})}

    def __repr__(self) -> str:
        what = "would write" if self.dry_run else f"wrote in {self.seconds:.2f}s"
        return f"<ReshardResult {self.output!r}: {self.plan!r}, {what}>"


# ---------------------------------------------------------------------------------------------- planning

def _flavour_of(stage: int, bf16_optimizer: bool) -> str:
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
class _Group:
    """A user optimizer param group: hyperparameters (source key order), step, trainable records."""

    index: int
    hyper: OrderedDict  # without 'params'; None marks where 'params' sits
    step: object  # LazyTensor, number, or None (no optimizer state yet)
    records: list[TensorRecord]
    # the source's state dict of the group's (first) flat partition, in its key order: the per-element keys are
    # re-partitioned, every other value (a step, a counter) carried as saved; None: no state, or a DCP source
    template: OrderedDict | None = None


def _source_groups(ckpt: Checkpoint) -> list[_Group]:
    if ckpt.format == "dcp":  # zckpt.ops.to_deepspeed: the groups as DCP saved them, one step tensor per group
        byname, steps = ckpt.by_name(), ckpt.extra.get("group_steps") or {}
        return [_Group(g.index, OrderedDict((k, None if k == "params" else v) for k, v in g.hyperparams.items()),
                       steps.get(g.index), [byname[n] for n in g.names]) for g in ckpt.groups]
    osd0 = ckpt.optim_states[0]["optimizer_state_dict"]
    path = ckpt.location.optim_files[0].path
    if ckpt.flavour == "zero3":
        inner = osd0.get("optimizer_state_dict") or {}
        pgs, state = inner.get("param_groups") or [], inner.get("state") or {}
    else:
        bos = osd0.get("base_optimizer_state")
        if isinstance(bos, list):  # elastic_checkpoint: per-group states, no param_groups (see is_elastic)
            return [_Group(info.index, OrderedDict(), bos[info.index].get("step") if info.index < len(bos)
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
        groups.append(_Group(info.index, hyper, step, [byname[n] for n in info.names],
                             OrderedDict(st) if isinstance(st, dict) and st else None))
    return groups


def _state_pieces(rec: TensorRecord, key: str) -> list:
    """The pieces of ``rec``'s per-element optimizer state ``key`` (Adam's moments or any other)."""
    if key in rec.other_state:
        return list(rec.other_state[key])
    return list(rec.exp_avg if key == "exp_avg" else rec.exp_avg_sq if key == "exp_avg_sq" else [])


def _state_keys(ckpt: Checkpoint, groups: list[_Group]) -> tuple[list[str], bool]:
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
    return [], False


def is_elastic(ckpt: Checkpoint) -> bool:
    """ZeRO-1/2 saved with ``elastic_checkpoint: true``: ``base_optimizer_state`` is a list of per-group states
    (padding stripped) and holds no param_groups, so no hyperparameters. It is resharded into the same elastic
    form (a rigid file would need the hyperparameters torch's ``load_state_dict`` restores); DeepSpeed loads it
    into an elastic engine at any world size and into a rigid one at the written size."""
    if ckpt.flavour != "zero" or not ckpt.optim_states:
        return False
    return isinstance(ckpt.optim_states[0]["optimizer_state_dict"].get("base_optimizer_state"), list)


def _elastic_base(state: OrderedDict, pads: list[int]) -> list:
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


def _group_params(hyper: OrderedDict, ids: list[int], conv: W.Converter) -> dict:
    out = {k: (list(ids) if k == "params" else conv(v)) for k, v in hyper.items()}
    if "params" not in out:
        out["params"] = list(ids)
    return out


def _step_out(step) -> TensorOut | None:
    if step is None:
        return None
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
class _Target:
    """The layout being planned (world size, stage, optimizer, config) and the source facts every file needs."""

    ckpt: Checkpoint
    world_size: int
    stage: int
    flavour: str
    cfg: dict  # the target's DeepSpeed config
    ranks: list[int]  # the ranks whose files are planned (plan_ranks narrows them)
    tag: str
    version: str
    groups: list[_Group]
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


def _target(ckpt: Checkpoint, world_size: int, stage: int, flavour: str, ranks=None) -> _Target:
    groups = _source_groups(ckpt)
    keys, has_state = _state_keys(ckpt, groups)
    version = ckpt.model_state.get("ds_version") or ckpt.optim_states[0].get("ds_version") or "0.19.8"
    return _Target(ckpt, world_size, stage, flavour, _target_config(ckpt.ds_config, stage, flavour),
                   list(range(world_size)) if ranks is None else [int(r) for r in ranks], output_tag(ckpt),
                   version, groups, is_elastic(ckpt), has_state, W.Converter(), keys)


def _key_dtype(t: _Target, records: list[TensorRecord], key: str, what: str) -> str:
    """The one dtype ``key``'s pieces are stored in over ``records`` (one flat buffer holds one dtype)."""
    dts = {p.dtype for r in records for p in _state_pieces(r, key)}
    if len(dts) > 1:
        raise UnsupportedLayout(f"{what} of the target layout would mix dtypes of the optimizer state '{key}' "
                                f"({', '.join(sorted(dts))})", path=t.ckpt.location.tag_dir)
    return dts.pop() if dts else "float32"


def _state_dict_out(t: _Target, g: _Group, part) -> OrderedDict:
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

def _flat_dtypes(t: _Target, records: list[TensorRecord], what: str) -> tuple[str, str | None]:
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


def _loss_scaler_state(t: _Target) -> OrderedDict:
    scaler = t.osd0.get("loss_scaler")
    return OrderedDict([
        ("loss_scaler", t.conv(scaler) if scaler is not None else W.default_loss_scaler()),
        ("dynamic_loss_scale", bool(t.osd0.get("dynamic_loss_scale", False))),
        ("overflow", bool(t.osd0.get("overflow", False))),
    ])


def _clip_grad(t: _Target) -> float:
    if "clip_grad" in t.osd0:
        return t.osd0["clip_grad"]
    return float(t.ckpt.ds_config.get("gradient_clipping", 0.0) or 0.0)


def _frozen_records(t: _Target) -> list[TensorRecord]:
    """What DeepSpeed lists as frozen (``requires_grad=False``): not the parameters in no optimizer group, which
    it keeps in ``module`` only."""
    return [r for r in t.ckpt.records if r.kind == "frozen" and not r.no_group]


def _optim_file(t: _Target, rank: int, osd: dict) -> TorchObject:
    return TorchObject(t.optim_path(rank), {"optimizer_state_dict": osd, "ds_config": copy.deepcopy(t.cfg),
                                            "ds_version": t.version})


_MODEL_KEYS = ["module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
               "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
               "global_steps", "global_samples", "dp_world_size", "mp_world_size",
               "checkpoint_parallel_dimensions", "ds_config", "ds_version"]


def _model_file(t: _Target, rank: int, module, param_shapes, frozen_shapes, frozen_frags) -> TorchObject:
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

def _module_zero12(t: _Target) -> OrderedDict:
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


def _module_tensor_zero12(t: _Target, base: TensorRecord, msrc) -> TensorOut:
    """One full weight: the source module's own tensor when it holds it whole (ZeRO-1/2 source), else the
    record's pieces (a trainable one cast from its fp32 master to the low-precision dtype)."""
    if t.ckpt.stage != 3 and isinstance(msrc, LazyTensor) and (base.kind != "trainable" or msrc.numel == base.numel):
        return t.conv(msrc)
    if base.kind == "trainable":
        lp = t.lp_dtype(base)
        return TensorOut(lp, base.shape, list(base.value) if lp == base.dtype else [Cast(list(base.value), base.dtype)])
    return TensorOut(base.dtype, base.shape, list(base.value))  # frozen, buffer


def _module_zero3(t: _Target) -> OrderedDict:
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


# ---- ZeRO-1/2 and the BF16 optimizer

@dataclass
class _FlatGroup:
    """One param group laid out flat at the target size: ``flat`` maps fp32 / exp_avg / exp_avg_sq to the
    segments of the whole padded group, in the dtypes the source stores them in."""

    group: _Group
    layout: W.FlatGroupLayout
    flat: dict[str, list]
    master_dtype: str
    state_dtype: str | None
    names: list[str] | None = None  # the names param_slice_mappings gives the records (default: theirs)
    key_dtypes: dict = field(default_factory=dict)  # per-element state key -> its dtype


def _flat_group(t: _Target, g: _Group, ws: int, names: list[str] | None = None) -> _FlatGroup:
    """Group ``g`` laid out flat over ``ws`` partitions (the data-parallel size; an expert group's: its
    expert-data-parallel size)."""
    align = bool((t.cfg.get("zero_optimization") or {}).get("parameter_alignment", False)) and t.flavour == "zero"
    itemsize = DTYPE_SIZES[t.lp_dtype(g.records[0])] if g.records else 2
    lay = W.flat_group_layout([r.numel for r in g.records], ws, itemsize, align)
    mdt, sdt = _flat_dtypes(t, g.records, f"param group {g.index}")
    flat = {"fp32": lay.flat([list(r.value) for r in g.records], mdt)}
    dtypes = {}
    for key in t.state_keys if t.has_state else ():
        dtypes[key] = _key_dtype(t, g.records, key, f"param group {g.index}")
        flat[key] = lay.flat([_state_pieces(r, key) for r in g.records], dtypes[key])
    return _FlatGroup(g, lay, flat, mdt, sdt, names, dtypes)


def _flat_groups(t: _Target) -> list[_FlatGroup]:
    return [_flat_group(t, g, t.world_size) for g in t.groups]


def _flat_partitions(t: _Target, fgs: list[_FlatGroup]) -> list[dict]:
    return [{"group": fg.group.index, "numel": sum(r.numel for r in fg.group.records),
             "partition": fg.layout.partition, "paddings": [fg.layout.group_padding(r) for r in range(t.world_size)]}
            for fg in fgs]


def _zero12_optim(t: _Target, fgs: list[_FlatGroup], rank: int, windows: list[int] | None = None) -> TorchObject:
    """Rank ``rank``'s optimizer-states file: its window of every flat group, moments, paddings, slice maps.
    ``windows``: the partition each group takes (default ``rank``; an MoE expert group: the rank's index in its
    expert-data-parallel group, whose size is the group's ``layout.ws``, its ``partition_count``)."""
    fp32_parts, state, pgroups, gpads, maps = [], OrderedDict(), [], [], []
    for gi, fg in enumerate(fgs):
        lay, flat = fg.layout, fg.flat
        w = rank if windows is None else windows[gi]
        P, pad = lay.partition, lay.group_padding(w)
        keep = P if t.flavour == "bf16_optimizer" else P - pad
        fp32_parts.append(TensorOut(fg.master_dtype, (keep,), W.slice_segments(flat["fp32"], w * P, keep)))
        if t.has_state:
            state[gi] = _state_dict_out(t, fg.group, lambda key, fg=fg, w=w, P=P: TensorOut(
                fg.key_dtypes[key], (P,), W.slice_segments(fg.flat[key], w * P, P)))
        pgroups.append(_group_params(fg.group.hyper, [gi], t.conv))
        gpads.append(pad)
        names = fg.names or [r.name for r in fg.group.records]
        maps.append(OrderedDict((names[i], W.fragment_address(n, s)) for i, n, s in lay.slice_map(w)))
    osd = OrderedDict()
    if t.flavour == "zero":
        osd.update(_loss_scaler_state(t))
    clip = _clip_grad(t)
    if clip is not None:  # None: not known (a DCP source converted without a config): the engine keeps its own
        osd["clip_grad"] = clip
    osd["base_optimizer_state"] = _elastic_base(state, gpads) if t.elastic else {"state": state,
                                                                                  "param_groups": pgroups}
    if t.elastic and "base_optimizer_state_step" in t.osd0:
        osd["base_optimizer_state_step"] = t.conv(t.osd0["base_optimizer_state_step"])
    osd["single_partition_of_fp32_groups"] = fp32_parts
    if t.flavour == "zero":
        osd["zero_stage"] = W.zero_stage_enum(t.stage)
    osd["group_paddings"] = gpads
    if t.flavour == "zero":
        osd["param_alignment_paddings"] = [list(fg.layout.param_paddings) for fg in fgs]
    osd["partition_count"] = [fg.layout.ws for fg in fgs]
    osd["ds_version"] = t.version
    osd["param_slice_mappings"] = maps
    return _optim_file(t, rank, osd)


def _zero12_model(t: _Target) -> TorchObject:
    """The one model-states file of ZeRO-1/2: full weights; ZeRO-2 also lists the frozen params."""
    module = _module_zero12(t)
    param_shapes = [OrderedDict((r.name, W.torch_size(r.shape)) for r in g.records) for g in t.groups]
    frozen_shapes = frozen_frags = None
    if t.stage == 2:
        frozen = _frozen_records(t)
        if frozen or t.ms0.get("frozen_param_shapes") is not None:
            frozen_shapes = OrderedDict((r.name, W.torch_size(r.shape)) for r in frozen)
            frozen_frags = OrderedDict((r.name, module[r.name] if r.name in module else
                                        TensorOut(r.dtype, r.shape, list(r.value))) for r in frozen)
    return _model_file(t, 0, module, param_shapes, frozen_shapes, frozen_frags)


def _plan_zero12(t: _Target) -> tuple[list[TorchObject], list[dict]]:
    fgs = _flat_groups(t)
    optim = [_zero12_optim(t, fgs, rank) for rank in t.ranks]
    return [_zero12_model(t)] + optim, _flat_partitions(t, fgs)


# ---- ZeRO-3

@dataclass
class _SubGroup:
    """One ZeRO-3 sub-group: consecutive params of a user group flattened into one partition per rank."""

    group: _Group
    records: list[TensorRecord]
    master_dtype: str
    state_dtype: str | None

    def partition(self, ws: int) -> int:
        return sum(W.zero3_part(r.numel, ws) for r in self.records)

    def rank_slice(self, attr: str, ws: int, rank: int, dtype: str | None = None) -> TensorOut:
        """This sub-group's partition of rank ``rank``: each param's ceil(n/ws) slice, for ``attr`` (value, or a
        per-element optimizer-state key stored as ``dtype``)."""
        dtype = self.master_dtype if attr == "value" else dtype or self.state_dtype
        segs = []
        for r in self.records:
            segs += W.zero3_rank_slice(list(r.value) if attr == "value" else _state_pieces(r, attr), r.numel, ws,
                                       rank, dtype)
        return TensorOut(dtype, (self.partition(ws),), segs)


def _sub_groups(t: _Target) -> list[_SubGroup]:
    sgs = t.cfg.get("zero_optimization", {}).get("sub_group_size", W.DEFAULT_SUB_GROUP_SIZE)
    sgs = int(float(sgs)) if sgs is not None else None
    cut = [(g, [g.records[i] for i in idx]) for g in t.groups
           for idx in W.zero3_sub_groups([r.numel for r in g.records], t.world_size, sgs)]
    return [_SubGroup(g, recs, *_flat_dtypes(t, recs, f"ZeRO-3 sub-group {s}")) for s, (g, recs) in enumerate(cut)]


def _sub_partitions(t: _Target, subs: list[_SubGroup]) -> list[dict]:
    return [{"sub_group": s, "group": sg.group.index, "params": len(sg.records),
             "partition": sg.partition(t.world_size)} for s, sg in enumerate(subs)]


def _zero3_optim(t: _Target, subs: list[_SubGroup], rank: int) -> TorchObject:
    """Rank ``rank``'s optimizer-states file: its slice of every sub-group, moments, the user param groups."""
    ws, flat, state = t.world_size, [], OrderedDict()
    for s, sg in enumerate(subs):
        flat.append(sg.rank_slice("value", ws, rank))
        if t.has_state:
            dts = {k: _key_dtype(t, sg.records, k, f"ZeRO-3 sub-group {s}") for k in t.state_keys}
            state[s] = _state_dict_out(t, sg.group, lambda key, sg=sg, dts=dts: sg.rank_slice(key, ws, rank,
                                                                                                dts[key]))
    pgroups = [_group_params(g.hyper, [s for s, sg in enumerate(subs) if sg.group.index == g.index], t.conv)
               for g in t.groups]
    osd = OrderedDict([("zero_stage", W.zero_stage_enum(3))])
    osd.update(_loss_scaler_state(t))
    osd["partition_count"] = ws
    osd["optimizer_state_dict"] = {"state": state, "param_groups": pgroups}
    osd["fp32_flat_groups"] = flat
    return _optim_file(t, rank, osd)


def _zero3_model(t: _Target, subs: list[_SubGroup], module: OrderedDict, rank: int) -> TorchObject:
    """Rank ``rank``'s model-states file: placeholder module, shapes per sub-group, its frozen-param slices."""
    ws, frozen = t.world_size, _frozen_records(t)
    param_shapes = [OrderedDict((r.name, W.torch_size(r.shape)) for r in sg.records) for sg in subs]
    frozen_shapes = frozen_frags = None
    if frozen or t.ms0.get("frozen_param_shapes") is not None:
        frozen_shapes = OrderedDict((r.name, W.torch_size(r.shape)) for r in frozen)
        frozen_frags = OrderedDict(
            (r.name, TensorOut(r.dtype, (W.zero3_part(r.numel, ws),),
                               W.zero3_rank_slice(list(r.value), r.numel, ws, rank, r.dtype)))
            for r in frozen)
    return _model_file(t, rank, module, param_shapes, frozen_shapes, frozen_frags)


def _plan_zero3(t: _Target) -> tuple[list[TorchObject], list[dict]]:
    subs = _sub_groups(t)
    module = _module_zero3(t)  # one placeholder module, shared by every rank's file
    models = [_zero3_model(t, subs, module, rank) for rank in t.ranks]
    optims = [_zero3_optim(t, subs, rank) for rank in t.ranks]
    return models + optims, _sub_partitions(t, subs)


def _plan_native(t: _Target) -> tuple[list[TorchObject], list[dict]]:
    """The target's model- and optimizer-states files as object trees (in the order they are written), and
    the partition sizes per group / sub-group."""
    return _plan_zero3(t) if t.stage == 3 else _plan_zero12(t)


def _planned(obj: TorchObject) -> PlannedFile:
    """A torch file laid out once: pickled, every entry placed; execute writes exactly this."""
    archive = torchzip.plan_archive(obj.obj, torchzip.archive_name_of(obj.relpath))
    return PlannedFile(obj.relpath, "torch", archive.file_size, archive.payload_bytes, archive=archive, obj=obj.obj)


def _check_world_size(world_size) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise InvalidArgument(f"must be a positive integer, got {world_size!r}", param="world_size")


def _check_state(ckpt: Checkpoint) -> None:
    """Optimizer state the reader could not place (``state_refusal``: SGD's momentum_buffer, ZeRO-0 moments it
    cannot tell apart) is never dropped from a re-partitioned checkpoint with exit 0."""
    if ckpt.state_refusal:
        raise UnsupportedLayout(f"the optimizer state cannot be carried: {ckpt.state_refusal}",
                                path=ckpt.location.tag_dir, hint="zckpt merge / info / verify read this checkpoint")
    ckpt.check_ties()


def _check_target(ckpt: Checkpoint, world_size, stage, bf16_optimizer) -> tuple[int, int, str]:
    _check_world_size(world_size)
    if ckpt.reshard_refusal:  # pipeline / MoE layouts (zckpt.deepspeed.pipeline, .moe): merge yes, reshard no
        raise UnsupportedLayout(ckpt.reshard_refusal, path=ckpt.location.tag_dir,
                                hint="zckpt merge / info / verify read this layout")
    stage = ckpt.stage if stage is None else stage
    if is_elastic(ckpt) and (stage == 3 or bf16_optimizer):
        raise UnsupportedLayout("an elastic checkpoint (elastic_checkpoint=true) saves no optimizer "
                                "hyperparameters, which a ZeRO-3 or BF16-optimizer file needs",
                                path=ckpt.location.tag_dir, hint="reshard it at ZeRO-1 or ZeRO-2")
    if stage not in (1, 2, 3):
        raise InvalidArgument(f"must be 1, 2 or 3, got {stage!r}", param="stage")
    if stage == 3 and ckpt.no_group and ckpt.stage != 3:
        names = [r.name for r in ckpt.no_group]
        raise UnsupportedLayout(f"{len(names)} parameters in no optimizer group ({', '.join(names[:3])}"
                                f"{', ...' if len(names) > 3 else ''}): a ZeRO-3 engine partitions them and its "
                                "files would hold them nowhere", path=ckpt.location.tag_dir,
                                hint="keep stage 1 or 2 (they stay in 'module'), or put them in a param group")
    if ckpt.offload:
        log.info("source used optimizer offload; the partitions are the same, offload is a config choice")
    if bf16_optimizer is None:
        bf16_optimizer = ckpt.flavour == "bf16_optimizer" and stage == 1
    if bf16_optimizer and (stage != 1 or ckpt.precision != "bf16"):
        raise InvalidArgument("the BF16 optimizer needs `stage`=1 and a bf16 checkpoint", param="bf16_optimizer",
                              hint="drop `bf16_optimizer`, or use `stage`=1 on a bf16 checkpoint")
    zcfg = ckpt.ds_config.get("zero_optimization") or {}
    if isinstance(zcfg, dict) and zcfg.get("round_robin_gradients"):
        raise UnsupportedLayout("round_robin_gradients reorders the flat groups per world size; not supported",
                                path=ckpt.location.tag_dir)
    return world_size, stage, _flavour_of(stage, bf16_optimizer)


def plan_reshard(ckpt: Checkpoint, world_size: int, stage: int | None = None, bf16_optimizer: bool | None = None,
                 fmt: str = "deepspeed") -> ReshardPlan:
    """Plan the files of ``ckpt`` re-partitioned for ``world_size`` ranks at ``stage`` (default: unchanged):
    every torch file laid out once into its final bytes (:class:`PlannedFile`), then the side files."""
    if fmt not in FORMATS:
        raise InvalidArgument(f"unknown format {fmt!r}", param="fmt", hint="use deepspeed or universal")
    for sub in [ckpt] + list(ckpt.extra.get("pipeline_stages") or []):
        _check_state(sub)
    if ckpt.parallel == "pipeline" and ckpt.extra.get("pipeline_stages"):
        return _plan_pipeline(ckpt, world_size, stage, bf16_optimizer, fmt)
    if ckpt.parallel == "moe":
        return _moe_reshard(ckpt, world_size, stage, bf16_optimizer, fmt)
    world_size, stage, flavour = _check_target(ckpt, world_size, stage, bf16_optimizer)
    if fmt == "universal" and is_elastic(ckpt):
        raise UnsupportedLayout("an elastic checkpoint saves no optimizer hyperparameters, which the universal "
                                "layout's optimizer_state.pt needs", path=ckpt.location.tag_dir,
                                hint="reshard it in the DeepSpeed layout: an elastic engine loads it at any size")
    t = _target(ckpt, world_size, stage, flavour)
    objects, partitions = _plan_native(t)
    if fmt == "universal":
        from zckpt.ops import universal
        if t.has_state and t.state_keys[:2] != ["exp_avg", "exp_avg_sq"] or len(t.state_keys) > 2:
            raise UnsupportedLayout(f"optimizer state {', '.join(repr(k) for k in t.state_keys)}: zckpt writes "
                                    "the universal layout for Adam's moments only", path=ckpt.location.tag_dir,
                                    hint="reshard in the DeepSpeed layout (drop --format universal)")
        objects = universal.plan_universal(ckpt, t.tag, stage, t.groups, t.has_state, objects)
    files = [_planned(o) for o in objects] + _side_files(ckpt, world_size)
    plan = ReshardPlan(ckpt.location.input_path, t.tag, fmt, ckpt.stage, ckpt.flavour, ckpt.world_size, stage,
                       flavour, world_size, ckpt.precision, files, partitions=partitions)
    if not t.has_state:
        plan.notes.append("the source has no optimizer state yet (saved before the first step); none is written")
    return plan


# ---- pipeline parallel: each stage re-partitioned over the new data-parallel size

def _plan_pipeline(ckpt: Checkpoint, world_size: int, stage: int | None, bf16_optimizer: bool | None,
                   fmt: str) -> ReshardPlan:
    """A ``PipelineEngine`` checkpoint (:mod:`zckpt.deepspeed.pipeline`) at data-parallel size ``world_size``, the
    stage count kept. Each stage is an ordinary ZeRO-1 / BF16-optimizer checkpoint of its own parameters over the
    data-parallel ranks: its ``[bf16_]zero_pp_rank_{d}_mp_rank_{SS}_optim_states.pt`` are planned by the same
    writer as a plain checkpoint's (``_zero12_optim``); ``mp_rank_{SS}_model_states.pt`` is the source's with the
    new ``dp_world_size`` (what ``engine.load_checkpoint`` checks against the live data-parallel size and uses to
    name the optimizer files it reads); the ``layer_XX-model_states.pt`` files do not depend on it and are copied."""
    _check_world_size(world_size)
    tag_dir = ckpt.location.tag_dir
    if fmt != "deepspeed":
        raise UnsupportedLayout("a pipeline-parallel checkpoint is resharded in the DeepSpeed layout only",
                                path=tag_dir, hint="drop --format universal")
    if stage is not None and stage != ckpt.stage:
        raise UnsupportedLayout(f"changing the ZeRO stage of a pipeline-parallel checkpoint is not supported "
                                f"(PipelineEngine runs ZeRO-0/1): keep stage {ckpt.stage}; only the data-parallel "
                                "size can change", path=tag_dir, hint="drop --stage")
    if ckpt.stage == 0:  # engine.load_checkpoint feeds the model file's `optimizer` to the BF16 optimizer there
        raise UnsupportedLayout("resharding a ZeRO-0 pipeline-parallel checkpoint is not supported (its BF16-"
                                "optimizer state is also in mp_rank_XX_model_states.pt, which DeepSpeed loads "
                                "per rank): resume it at the same data-parallel size; ZeRO-1 pipelines reshard",
                                path=tag_dir)
    src_bf16 = ckpt.flavour == "bf16_optimizer"
    if bf16_optimizer is not None and bool(bf16_optimizer) != src_bf16:
        raise UnsupportedLayout("changing the optimizer (BF16 optimizer / ZeRO) of a pipeline-parallel checkpoint "
                                "is not supported: only the data-parallel size can change", path=tag_dir,
                                hint="drop --bf16-optimizer")
    zcfg = ckpt.ds_config.get("zero_optimization") or {}
    if isinstance(zcfg, dict) and zcfg.get("round_robin_gradients"):
        raise UnsupportedLayout("round_robin_gradients reorders the flat groups per world size; not supported",
                                path=tag_dir)
    objects: list[TorchObject] = []
    partitions: list[dict] = []
    tag = output_tag(ckpt)
    stage_ms = ckpt.extra["stage_model_states"]
    for s, sub in enumerate(ckpt.extra["pipeline_stages"]):
        t = _target(sub, world_size, ckpt.stage, sub.flavour)
        t.mp_rank = s
        fgs = _flat_groups(t)
        ms = {k: (world_size if k == "dp_world_size" else t.conv(v)) for k, v in stage_ms[s].items()}
        objects.append(TorchObject(t.relpath(f"mp_rank_{s:02d}_model_states.pt"), ms))
        objects += [_zero12_optim(t, fgs, rank) for rank in t.ranks]
        partitions += [{"pipeline_stage": s, **p} for p in _flat_partitions(t, fgs)]
    layers = [_copied(os.path.join(tag, f.path.rsplit("/", 1)[-1]), f.path, f.size)
              for f in sorted(ckpt.location.layer_files, key=lambda f: f.index)]
    files = [_planned(o) for o in objects] + layers + _side_files(ckpt, world_size)
    pp = len(stage_ms)
    plan = ReshardPlan(ckpt.location.input_path, tag, fmt, ckpt.stage, ckpt.flavour, ckpt.world_size, ckpt.stage,
                       ckpt.flavour, world_size, ckpt.precision, files, partitions=partitions)
    plan.notes.append(f"pipeline parallel: {pp} stages kept, data-parallel size {ckpt.world_size} -> {world_size} "
                      f"(launch {pp * world_size} ranks)")
    return plan


# ---- mixture of experts: dense groups over the new data-parallel size, each expert group over its new
# expert-data-parallel ranks

def _check_moe(ckpt: Checkpoint, world_size, stage: int | None, bf16_optimizer: bool | None, fmt: str):
    """The :class:`zckpt.deepspeed.moe.MoELayout` of an MoE checkpoint that can be laid out at ``world_size``;
    what cannot is refused in one line."""
    _check_world_size(world_size)
    tag_dir = ckpt.location.tag_dir
    layout = ckpt.extra.get("moe")
    if layout is None:  # MoE without ZeRO (expp_rank files): DeepSpeed loads it at any data-parallel size
        raise UnsupportedLayout(ckpt.reshard_refusal or "this mixture-of-experts checkpoint is not resharded",
                                path=tag_dir, hint="load it with engine.load_checkpoint at the new size"
                                if ckpt.stage == 0 else "zckpt merge / info / verify / convert read this layout")
    if fmt != "deepspeed":
        raise UnsupportedLayout("a mixture-of-experts checkpoint is resharded in the DeepSpeed layout only",
                                path=tag_dir, hint="drop --format universal")
    if stage is not None and stage != ckpt.stage:
        raise UnsupportedLayout(f"changing the ZeRO stage of a mixture-of-experts checkpoint is not supported: keep "
                                f"stage {ckpt.stage}; only the data-parallel size can change", path=tag_dir,
                                hint="drop --stage")
    if bf16_optimizer is not None and bool(bf16_optimizer) != (ckpt.flavour == "bf16_optimizer"):
        raise UnsupportedLayout("changing the optimizer (BF16 optimizer / ZeRO) of a mixture-of-experts checkpoint "
                                "is not supported: only the data-parallel size can change", path=tag_dir,
                                hint="drop --bf16-optimizer")
    if is_elastic(ckpt):
        raise UnsupportedLayout("an elastic mixture-of-experts checkpoint (elastic_checkpoint=true) is not "
                                "resharded", path=tag_dir)
    zcfg = ckpt.ds_config.get("zero_optimization") or {}
    if isinstance(zcfg, dict) and zcfg.get("round_robin_gradients"):
        raise UnsupportedLayout("round_robin_gradients reorders the flat groups per world size; not supported",
                                path=tag_dir)
    bad = sorted({ep for ep in layout.ep.values() if world_size % ep})
    if bad:
        raise UnsupportedLayout(f"mixture-of-experts checkpoint: data-parallel size {world_size} is not a multiple "
                                f"of the expert-parallel size {bad[0]}, which is kept (changing the expert-parallel size is not supported)",
                                path=tag_dir, hint=f"pass a multiple of {bad[0]}")
    return layout


def _moe_model(t: _Target, layout) -> TorchObject:
    """``mp_rank_00_model_states.pt``: the source's (dense module, rank 0's param_shapes, num_experts...) with the
    new ``dp_world_size`` and, for AutoEP, each layer's new ``expert_data_parallel_world_size``."""
    def layers(v):
        if not isinstance(v, list):
            return v
        return [dict(x, expert_data_parallel_world_size=t.world_size // int(x.get("ep_size") or 1))
                if isinstance(x, dict) and "expert_data_parallel_world_size" in x else x for x in v]

    ms = {}
    for k, v in t.ms0.items():
        if k == "dp_world_size":
            v = t.world_size
        elif k == "ds_autoep_layers":
            v = layers(v)
        elif k == "universal_checkpoint_info" and isinstance(v, dict) and "ds_autoep_layers" in v:
            v = dict(v, ds_autoep_layers=layers(v["ds_autoep_layers"]))
        ms[k] = t.conv(v)
    return TorchObject(t.model_path(0), ms)


def _plan_moe(t: _Target, layout, expert_files: str) -> tuple[list[TorchObject], list[dict]]:
    """The model- and optimizer-states files of ``t.ranks`` (and the expert files: ``"object"`` for each rank's own
    experts, as objects to load; ``"none"``: none, they are copied). A dense group is partitioned over all
    ``world_size`` ranks, an expert group of ep_size N separately for each expert-parallel rank e over its
    ``world_size / N`` expert-data-parallel ranks (:meth:`MoELayout.ep_rank`); both by the ZeRO-1/2 writer."""
    tag_dir, ws = t.ckpt.location.tag_dir, t.world_size
    flat: dict[tuple[int, int | None], _FlatGroup] = {}
    partitions = []
    for g in t.groups:
        ep = layout.ep.get(g.index)
        if ep is None:
            flat[(g.index, None)] = fg = _flat_group(t, g, ws)
            partitions.append({"group": g.index, "numel": sum(r.numel for r in g.records),
                               "partition": fg.layout.partition,
                               "paddings": [fg.layout.group_padding(r) for r in range(ws)]})
            continue
        for e, pairs in sorted(layout.shards[g.index].items()):
            sub = _Group(g.index, g.hyper, g.step, [r for _, r in pairs])
            flat[(g.index, e)] = fg = _flat_group(t, sub, ws // ep, [n for n, _ in pairs])
            partitions.append({"group": g.index, "expert_parallel_rank": e, "expert_parallel_size": ep,
                               "numel": sum(r.numel for r in sub.records), "partition": fg.layout.partition,
                               "paddings": [fg.layout.group_padding(r) for r in range(ws // ep)]})
    objects = [_moe_model(t, layout)]
    own: set[tuple[int, int]] = set()
    for rank in t.ranks:
        fgs, windows = [], []
        for g in t.groups:
            ep = layout.ep.get(g.index)
            e, w = (None, rank) if ep is None else layout.ep_rank(t.ms0, ws, ep, rank, tag_dir)
            fgs.append(flat[(g.index, e)])
            windows.append(w)
            if ep is not None:
                own.add((ep, e))
        if not layout.ep:
            own.add((1, 0))
        objects.append(_zero12_optim(t, fgs, rank, windows))
    if expert_files == "object":
        objects += [TorchObject(t.relpath(name), OrderedDict((k, t.conv(v)) for k, v in tensors))
                    for name, (tensors, ep, owner) in sorted(layout.expert_files.items())
                    if (ep, owner) in own or not layout.ep]
    return objects, partitions


def _moe_reshard(ckpt: Checkpoint, world_size: int, stage: int | None, bf16_optimizer: bool | None,
                 fmt: str) -> ReshardPlan:
    """An MoE checkpoint (:mod:`zckpt.deepspeed.moe`) at data-parallel size ``world_size``, the expert-parallel
    size, stage and optimizer kept; the expert files ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt`` do not
    depend on the data-parallel size and are copied."""
    layout = _check_moe(ckpt, world_size, stage, bf16_optimizer, fmt)
    t = _target(ckpt, world_size, ckpt.stage, ckpt.flavour)
    objects, partitions = _plan_moe(t, layout, "none")
    experts = [_copied(os.path.join(t.tag, f.path.replace("\\", "/").rsplit("/", 1)[-1]), f.path, f.size)
               for f in sorted(ckpt.location.expert_files, key=lambda f: (f.index, f.expert))]
    files = [_planned(o) for o in objects] + experts + _side_files(ckpt, world_size)
    plan = ReshardPlan(ckpt.location.input_path, t.tag, fmt, ckpt.stage, ckpt.flavour, ckpt.world_size, ckpt.stage,
                       ckpt.flavour, world_size, ckpt.precision, files, partitions=partitions)
    eps = sorted(set(layout.ep.values()))
    plan.notes.append(f"mixture of experts: expert-parallel size {', '.join(map(str, eps))} kept, data-parallel size "
                      f"{ckpt.world_size} -> {world_size}; each expert group over "
                      + ", ".join(str(world_size // ep) for ep in eps) + " expert-data-parallel ranks")
    if not t.has_state:
        plan.notes.append("the source has no optimizer state yet (saved before the first step); none is written")
    return plan


def plan_ranks(ckpt: Checkpoint, world_size: int, ranks, stage: int | None = None,
               bf16_optimizer: bool | None = None, zero: dict | None = None) -> ReshardPlan:
    """Like :func:`plan_reshard` (DeepSpeed layout), but only the model- and optimizer-states files of ``ranks``
    (no side files): what one rank of a job resuming at ``world_size`` loads (:mod:`zckpt.ops.resume`). The files
    are object trees to load (kind "object"), not laid out for writing.
    ``zero``: ``zero_optimization`` values of the target engine that shape the layout (``sub_group_size``,
    ``parameter_alignment``), applied where they differ from the source config's."""
    layout = None
    _check_state(ckpt)
    if ckpt.parallel == "moe":
        layout = _check_moe(ckpt, world_size, stage, bf16_optimizer, "deepspeed")
        stage, flavour = ckpt.stage, ckpt.flavour
    else:
        world_size, stage, flavour = _check_target(ckpt, world_size, stage, bf16_optimizer)
    t = _target(ckpt, world_size, stage, flavour, ranks)
    zcfg = t.cfg.setdefault("zero_optimization", {})
    defaults = {"sub_group_size": W.DEFAULT_SUB_GROUP_SIZE, "parameter_alignment": False}
    for key, value in (zero or {}).items():
        if value is not None and zcfg.get(key, defaults.get(key)) != value:
            zcfg[key] = value
    objects, partitions = _plan_native(t) if layout is None else _plan_moe(t, layout, "object")
    files = [PlannedFile(o.relpath, "object", 0, obj=o.obj) for o in objects]
    return ReshardPlan(ckpt.location.input_path, t.tag, "deepspeed", ckpt.stage, ckpt.flavour, ckpt.world_size,
                       stage, flavour, world_size, ckpt.precision, files, partitions=partitions)


# ---------------------------------------------------------------------------------------------- side files

def _rng_name(rank: int, world_size: int) -> str:
    return "rng_state.pth" if world_size == 1 else f"rng_state_{rank}.pth"


def _copied(relpath: str, src: str, nbytes: int) -> PlannedFile:
    return PlannedFile(relpath, "copy", nbytes, nbytes, src=src)


def _side_files(ckpt: Checkpoint, world_size: int) -> list[PlannedFile]:
    """Everything of the checkpoint that is not its tag (:func:`zckpt.backup.files.side_files`: a Trainer checkpoint's
    config, trainer_state.json, scheduler, tokenizer, any subfolder..., a save folder's scripts and configs), copied
    as it is; the RNG states renamed for the new ranks."""
    out: list[PlannedFile] = []
    rng_src = {}
    for f in side_files(ckpt.location, ckpt.storage_options):
        if f.rel == "rng_state.pth":
            rng_src[0] = f
            continue
        if f.rel.startswith("rng_state_") and f.rel.endswith(".pth") and f.rel[10:-4].isdigit():
            rng_src[int(f.rel[10:-4])] = f
            continue
        out.append(_copied(f.rel, f.path, f.size))
    for rank in range(world_size):  # ranks beyond the source's get no RNG file: the Trainer warns and goes on
        if rank in rng_src:
            out.append(_copied(_rng_name(rank, world_size), rng_src[rank].path, rng_src[rank].size))
    return out


# ---------------------------------------------------------------------------------------------- execute

def _check_out(out: str, overwrite: bool, source: publish.Source | None, kind: str = "reshard") -> None:
    if storage.is_url(out):
        raise InvalidArgument(f"{kind} writes to a local folder", path=out,
                              hint=f"{kind} locally, then `zckpt push` the result")
    publish.check_output(out, kind, source, overwrite)


def _copy_file(src: str, dst: str, storage_options: dict | None = None, check: InputCheck | None = None) -> int:
    if storage.is_url(src):
        data = storage.read_bytes(src, storage_options)
        with open(dst, "wb") as f:
            f.write(data)
    else:
        shutil.copyfile(src, dst)
    if check is not None:
        check.check_copy(src, dst)
    return os.path.getsize(dst)


def execute(plan: ReshardPlan, out: str, workers: int | None = None, overwrite: bool = False,
            progress: Callable[[int, int], None] | None = None, latest_name: str = "latest",
            durable: bool = False, source: publish.Source | None = None,
            storage_options: dict | None = None, kind: str = "reshard", check: InputCheck | None = None) -> dict:
    """Write ``plan`` into the folder ``out`` atomically (:mod:`zckpt.io.publish`: temp sibling, ``latest`` and the
    ``.zckpt.json`` marker last, rename); ``overwrite`` replaces only a previous zckpt output of ``kind`` (the
    command that made it, in the marker: "reshard", or "convert" for ``zckpt convert --to deepspeed``).

    As with merge, the folder appears whole or not at all whenever the process dies; ``durable=True`` also
    fsyncs every file (flushing each while the next is written) before ``latest`` and the rename.
    ``storage_options``: fsspec options for reading a source behind a URL (the checkpoint's). Returns what was read
    from remote sources (bytes, ranged GETs, seconds waited for them). ``check``: the input check every byte read
    is reported to; the CRC-32 of every input zip entry read is checked before anything is published (copied
    files are checked as they are copied)."""
    if any(f.kind not in ("torch", "copy") for f in plan.files):
        raise InvalidArgument("this plan's files are objects to load (plan_ranks), not files to write",
                              hint="plan with plan_reshard")
    _check_out(out, overwrite, source, kind)
    workers = workers or min(8, os.cpu_count() or 2)
    total, done = plan.total_bytes, [0]

    def step(n):
        done[0] += n
        if progress:
            progress(done[0], total)

    worker, maps = executor.Worker(storage_options=storage_options, check=check), torchzip.SourceMaps()
    try:
        with publish.Publisher(out, kind, source.root if source else plan.source, durable) as pub:
            written = []
            with ThreadPoolExecutor(workers) as pool, ThreadPoolExecutor(1) as syncer:
                for f in plan.files:
                    executor.test_delay()
                    dst = pub.path(f.relpath)
                    if f.kind == "torch":  # the archive planned: nothing is pickled again
                        torchzip.write_planned(f.archive, dst, pool=pool, progress=step, worker=worker, maps=maps)
                        step(f.nbytes - f.payload_bytes)  # pickle, headers, central directory
                    else:
                        step(_copy_file(f.src, dst, storage_options, check))
                    pub.done(f.relpath)
                    if durable:  # flushes while the next file is written
                        written.append(syncer.submit(torchzip.fsync_all, [dst]))
                for fut in written:  # everything on disk before `latest` and the rename
                    fut.result()
            # DeepSpeed writes the bare tag, no newline
            pub.write_bytes(latest_name, (plan.tag if plan.fmt == "deepspeed" else f"{plan.tag}_universal").encode())
            if check is not None:  # a damaged input is refused here: nothing has been published
                check.finish()
            pub.commit()
    finally:
        worker.close()
        maps.close()
    return worker.stats.to_json()


def default_output(source: publish.Source, world_size: int, stage: int | None, fmt: str) -> str:
    """Next to the checkpoint, never inside it, never named like a checkpoint:
    ``outputs/checkpoint-4`` -> ``outputs/resharded-checkpoint-4-ws<M>[-z<S>][-universal]``."""
    suffix = f"-ws{world_size}" + (f"-z{stage}" if stage else "") + ("-universal" if fmt == "universal" else "")
    return publish.default_output(source, "resharded") + suffix


def reshard(path: str, out: str | None = None, world_size: int | None = None, stage: int | None = None,
            fmt: str = "deepspeed", tag: str | None = None, dry_run: bool = False, overwrite: bool = False,
            workers: int | None = None, progress: Callable[[int, int], None] | None = None,
            bf16_optimizer: bool | None = None, durable: bool = False,
            storage_options: dict | None = None, group=None) -> ReshardResult:
    """Re-partition the checkpoint at ``path`` for ``world_size`` ranks (and ``stage``) into the folder ``out``.

    ``fmt="deepspeed"``: DeepSpeed's native layout, loadable with a plain ``engine.load_checkpoint(out)`` at the
    new size. ``fmt="universal"``: DeepSpeed's universal layout (``"checkpoint": {"load_universal": true}``).
    ``bf16_optimizer``: target the BF16 optimizer (stage 1, bf16, ``grad_accum_dtype: fp32``); default keeps the
    source's choice when the stage stays 1. ``progress(done_bytes, total_bytes)`` is called as data is written;
    ``durable=True`` fsyncs everything before publishing (survives a power failure, waits for the disk).
    Default ``out``: next to the checkpoint, ``outputs/checkpoint-4`` -> ``outputs/resharded-checkpoint-4-ws<M>``
    (``-z<S>``, ``-universal`` appended when given). ``overwrite`` replaces only a previous zckpt reshard output.
    ``storage_options``: fsspec options for a URL ``path`` (the output is always local), for this call only.
    ``group``: the ranks of a launcher's job (:func:`zckpt.engine.launch.launched`); every rank calls ``reshard``
    and writes a share of the bytes, rank 0 publishes (:mod:`zckpt.engine.distributed`).
    """
    t0 = time.perf_counter()
    if world_size is None:
        raise InvalidArgument("a target world size is required", param="world_size", hint="pass `world_size`")
    ckpt = open_checkpoint(path, tag, storage_options)
    t_open = time.perf_counter()
    source = publish.source_of(ckpt.location, picked_tag=tag is not None)
    out = str(out) if out is not None else default_output(source, world_size, stage, fmt)
    _check_out(out, overwrite, source)  # before planning or writing anything
    plan = plan_reshard(ckpt, world_size, stage, bf16_optimizer, fmt)
    log.info("plan: %d file(s), %s, world size %d -> %s (planned in %.2fs)", len(plan.files),
             format_size(plan.total_bytes), world_size, out, time.perf_counter() - t0)
    for f in plan.files:
        log.debug("  %s (%s)", f.relpath, format_size(f.nbytes))
    result = ReshardResult(out, plan, dry_run=dry_run)
    if dry_run:
        return result
    latest = "latest" if fmt == "deepspeed" else "latest_universal"
    t_plan = time.perf_counter()  # reading the metadata and planning: the rest is moving bytes
    check = checksums.input_check(ckpt)
    try:
        if group is not None:
            from zckpt.engine import distributed
            stats = distributed.run_reshard(group, plan, out, workers=workers, overwrite=overwrite,
                                            progress=progress, latest_name=latest, durable=durable, source=source,
                                            storage_options=ckpt.storage_options, check=check).to_json()
        else:
            stats = {"ranks": 1, **execute(plan, out, workers, overwrite, progress, latest_name=latest,
                                           durable=durable, source=source, storage_options=ckpt.storage_options,
                                           check=check)}
    finally:
        check.close()
    stats["crc_checked_entries"] = check.checked
    result.seconds = time.perf_counter() - t0
    result.stats = {**stats, "plan_seconds": round(t_plan - t0, 3), "open_seconds": round(t_open - t0, 3),
                    "bytes_per_second": round(plan.total_bytes / max(result.seconds, 1e-9))}
    log.info("wrote and published %s in %.2fs (%.2fs in all; %.1f MB/s, %d process%s)", out,
             time.perf_counter() - t_plan, result.seconds, plan.total_bytes / max(result.seconds, 1e-9) / 1e6,
             stats["ranks"], "es" if stats["ranks"] > 1 else "")
    return result
