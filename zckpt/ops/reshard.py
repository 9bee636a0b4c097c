"""Re-partitioning a DeepSpeed checkpoint for another data-parallel world size and/or ZeRO stage.

Read -> plan -> execute, like :mod:`zckpt.ops.merge`:

1. :func:`zckpt.deepspeed.layout.open_checkpoint` describes the source from metadata alone: every parameter's
   fp32 master and Adam moments as lists of byte ranges (pieces) in the rank files.
2. :func:`plan_reshard` lays the same training state out as DeepSpeed itself would have saved it at world size
   M and stage S (partition math in :mod:`zckpt.deepspeed.writer`): per output file, the object tree with
   :class:`~zckpt.engine.torchzip.TensorOut` leaves made of source pieces and zero fill. Plain data; ``--dry-run``
   prints its summary.
3. :func:`execute` streams every file with :func:`zckpt.engine.torchzip.save` into a temporary sibling of OUT, writes
   ``latest`` and the ``.zckpt.json`` marker last, and renames the folder into place (:mod:`zckpt.io.publish`).
   The source is never modified; no tensor is held whole.

Output (``fmt="deepspeed"``)::

    OUT/latest                                      the source tag
    OUT/.zckpt.json                                 zckpt's output marker (kind "reshard"; see zckpt.io.publish)
    OUT/zero_to_fp32.py, zero_to_torch.py           copied when the source save folder has them
    OUT/<tag>/mp_rank_00_model_states.pt            stage 1/2 (stage 3: zero_pp_rank_{r}_mp_rank_00_model_states.pt)
    OUT/<tag>/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt   r = 0..M-1
    OUT/<Trainer files>                             for a checkpoint-N: config, trainer_state.json, scheduler.pt,
                                                    rng_state_{r}.pth for r < min(N, M) (see docs/reshard.md)

``fmt="universal"`` writes DeepSpeed's universal layout instead (:mod:`zckpt.ops.universal`).
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

from zckpt.engine import executor
from zckpt.io import publish, storage
from zckpt.deepspeed import writer as W
from zckpt.deepspeed.writer import OutFile
from zckpt.deepspeed.layout import LP_DTYPES, Checkpoint, TensorRecord, open_checkpoint
from zckpt.errors import InvalidArgument, UnsupportedLayout
from zckpt.formats.safeload import DTYPE_SIZES, LazyTensor
from zckpt.engine.segments import Cast
from zckpt.engine.torchzip import TensorOut

log = logging.getLogger(__name__)

FORMATS = ("deepspeed", "universal")
SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


# ---------------------------------------------------------------------------------------------- plan data

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
    files: list[OutFile]
    notes: list[str] = field(default_factory=list)
    partitions: list[dict] = field(default_factory=list)  # per group / sub-group partition sizes

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def summary(self) -> dict:
        return {
            "source": self.source, "tag": self.tag, "format": self.fmt,
            "from": {"stage": self.source_stage, "optimizer": self.source_flavour,
                     "world_size": self.source_world_size},
            "to": {"stage": self.stage, "optimizer": self.flavour, "world_size": self.world_size},
            "precision": self.precision, "total_bytes": self.total_bytes,
            "files": [{"name": f.relpath, "bytes": f.nbytes,
                       "kind": "torch" if f.obj is not None else ("copy" if f.src else "text")} for f in self.files],
            "partitions": self.partitions, "notes": self.notes,
        }


@dataclass
class ReshardResult:
    output: str
    plan: ReshardPlan
    seconds: float = 0.0
    dry_run: bool = False

    def to_json(self) -> dict:
        return {"output": self.output, "dry_run": self.dry_run, "seconds": round(self.seconds, 3),
                **self.plan.summary()}


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


def _source_groups(ckpt: Checkpoint) -> list[_Group]:
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
        groups.append(_Group(info.index, hyper, step, [byname[n] for n in info.names]))
    return groups


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
        from zckpt.deepspeed.layout import pieces_of
        return TensorOut(step.dtype, tuple(step.shape), pieces_of(step))
    return step  # an int/float step (old torch): kept as is


def output_tag(ckpt: Checkpoint) -> str:
    """The tag the output is written under: the source's, less the ``_universal`` of a universal source."""
    tag = ckpt.tag
    if ckpt.location.universal and tag.endswith("_universal") and len(tag) > len("_universal"):
        tag = tag[: -len("_universal")]
    return tag


class _Planner:
    def __init__(self, ckpt: Checkpoint, world_size: int, stage: int, flavour: str):
        self.ckpt, self.ws, self.stage, self.flavour = ckpt, world_size, stage, flavour
        self.tag = output_tag(ckpt)
        self.conv = W.Converter()
        self.ms0 = ckpt.model_state
        self.osd0 = ckpt.optim_states[0]["optimizer_state_dict"]
        self.cfg = _target_config(ckpt.ds_config, stage, flavour)
        self.version = self.ms0.get("ds_version") or ckpt.optim_states[0].get("ds_version") or "0.19.8"
        self.groups = _source_groups(ckpt)
        self.elastic = is_elastic(ckpt)  # written back elastic (see is_elastic)
        self.byname = ckpt.by_name()
        self.has_state = all(g.step is not None for g in self.groups) and all(
            r.exp_avg and r.exp_avg_sq for g in self.groups for r in g.records)
        self.lp = LP_DTYPES[ckpt.precision]
        self.partitions: list[dict] = []
        self.notes: list[str] = []
        self.ranks = range(world_size)  # the ranks whose files are planned (plan_ranks narrows it)
        self.count_bytes = True  # OutFile.nbytes (plan_ranks skips it)

    # ---- shared pieces
    def lp_dtype(self, rec: TensorRecord) -> str:
        return rec.lp_dtype or self.lp

    def flat_dtypes(self, records: list[TensorRecord], what: str) -> tuple[str, str | None]:
        """(master dtype, moment dtype) of the params that share one flat target buffer, as the source stores
        them (fp32, or bf16 with bf16_master_weights_and_grads / bf16_optimizer_states). One buffer holds one
        dtype: params whose sources disagree cannot share it, and are refused rather than converted."""
        mdt = {r.dtype for r in records}
        sdt = {r.state_dtype for r in records} if self.has_state else set()
        if len(mdt) > 1 or len(sdt) > 1:
            raise UnsupportedLayout(f"{what} of the target layout would mix master or optimizer-state dtypes "
                                    f"({', '.join(sorted(mdt | {d for d in sdt if d}))})", path=self.ckpt.location.tag_dir,
                                    hint="keep the source's param groups (same stage), or reshard to ZeRO-3")
        return (mdt.pop() if mdt else "float32"), (sdt.pop() if sdt else None)

    def loss_scaler_state(self) -> OrderedDict:
        osd = self.osd0
        scaler = osd.get("loss_scaler")
        return OrderedDict([
            ("loss_scaler", self.conv(scaler) if scaler is not None else W.default_loss_scaler()),
            ("dynamic_loss_scale", bool(osd.get("dynamic_loss_scale", False))),
            ("overflow", bool(osd.get("overflow", False))),
        ])

    def clip_grad(self) -> float:
        if "clip_grad" in self.osd0:
            return self.osd0["clip_grad"]
        return float(self.ckpt.ds_config.get("gradient_clipping", 0.0) or 0.0)

    def prefix(self) -> str:
        return "bf16_" if self.ckpt.precision == "bf16" else ""

    def optim_name(self, rank: int) -> str:
        return f"{self.prefix()}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"

    def model_name(self, rank: int) -> str:
        return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if self.stage == 3 else "mp_rank_00_model_states.pt"

    def frozen_records(self) -> list[TensorRecord]:
        return [r for r in self.ckpt.records if r.kind == "frozen"]

    def optim_file(self, rank: int, osd: dict) -> dict:
        return {"optimizer_state_dict": osd, "ds_config": copy.deepcopy(self.cfg), "ds_version": self.version}

    def model_file(self, rank: int, module, param_shapes, frozen_shapes, frozen_frags) -> dict:
        """The model-states dict, keys in the source's order (DeepSpeed's), client-state keys included."""
        ms0 = self.ms0
        shared = ms0.get("shared_params")
        values = {
            "module": module,
            "buffer_names": list(ms0.get("buffer_names") or []),
            "optimizer": None,
            "param_shapes": param_shapes,
            "frozen_param_shapes": frozen_shapes,
            "shared_params": dict(shared or {}) if rank == 0 else {},
            "frozen_param_fragments": frozen_frags,
            "dp_world_size": self.ws,
            "ds_config": copy.deepcopy(self.cfg),
        }
        order = ["module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                 "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps",
                 "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                 "checkpoint_parallel_dimensions", "ds_config", "ds_version"]
        keys = list(ms0.keys()) + [k for k in order if k not in ms0 and k in values]
        out = {}
        for k in keys:
            out[k] = values[k] if k in values else self.conv(ms0[k])
        return out

    # ---- module state dict
    def module_stage12(self) -> OrderedDict:
        module = self.ms0.get("module") or {}
        out = OrderedDict()
        made: dict[str, TensorOut] = {}
        for name, src in module.items():
            rec = self.byname.get(name)
            if rec is None:
                out[name] = self.conv(src)
                continue
            base = self.byname.get(rec.tied_to) if rec.kind == "tied" else rec
            key = base.name if base is not None else name
            if key in made:
                out[name] = made[key]
                continue
            if base is None:
                t = self.conv(src)
            elif base.kind == "trainable":
                lp = self.lp_dtype(base)
                msrc = module.get(base.name)
                if self.ckpt.stage != 3 and isinstance(msrc, LazyTensor) and msrc.numel == base.numel:
                    t = self.conv(msrc)
                else:
                    segs = list(base.value) if lp == base.dtype else [Cast(list(base.value), base.dtype)]
                    t = TensorOut(lp, base.shape, segs)
            else:  # frozen, buffer
                if self.ckpt.stage != 3 and isinstance(module.get(base.name), LazyTensor):
                    t = self.conv(module[base.name])
                else:
                    t = TensorOut(base.dtype, base.shape, list(base.value))
            made[key] = t
            out[name] = t
        return out

    def module_stage3(self) -> OrderedDict:
        module = self.ms0.get("module") or {}
        out = OrderedDict()
        placeholders: dict[str, TensorOut] = {}
        for name, src in module.items():
            rec = self.byname.get(name)
            if rec is None:
                out[name] = self.conv(src)
            elif rec.kind == "buffer":
                if self.ckpt.stage == 3:
                    out[name] = self.conv(src)
                else:
                    out[name] = TensorOut(rec.dtype, rec.shape, list(rec.value))
            else:
                base = rec.tied_to if rec.kind == "tied" else name
                if base not in placeholders:
                    brec = self.byname.get(base, rec)
                    placeholders[base] = TensorOut(self.lp_dtype(brec), (0,), [])
                out[name] = placeholders[base]
        return out

    # ---- ZeRO-1/2 and the BF16 optimizer
    def plan_stage12(self) -> list[OutFile]:
        ws, files = self.ws, []
        align = bool((self.cfg.get("zero_optimization") or {}).get("parameter_alignment", False)) \
            and self.flavour == "zero"
        layouts, flats = [], []
        dtypes = []  # per group: (master dtype, moment dtype), as the source stores them
        for g in self.groups:
            itemsize = DTYPE_SIZES[self.lp_dtype(g.records[0])] if g.records else 2
            lay = W.flat_group_layout([r.numel for r in g.records], ws, itemsize, align)
            layouts.append(lay)
            mdt, sdt = self.flat_dtypes(g.records, f"param group {g.index}")
            dtypes.append((mdt, sdt))
            flats.append({k: lay.flat([list(getattr(r, attr)) for r in g.records], mdt if k == "fp32" else sdt)
                          for k, attr in (("fp32", "value"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))
                          if k == "fp32" or self.has_state})
            self.partitions.append({"group": g.index, "numel": sum(r.numel for r in g.records),
                                    "partition": lay.partition,
                                    "paddings": [lay.group_padding(r) for r in range(ws)]})
        for rank in self.ranks:
            fp32_parts, state, pgroups, gpads, maps = [], OrderedDict(), [], [], []
            for gi, (g, lay, flat, (mdt, sdt)) in enumerate(zip(self.groups, layouts, flats, dtypes)):
                P, pad = lay.partition, lay.group_padding(rank)
                keep = P if self.flavour == "bf16_optimizer" else P - pad
                fp32_parts.append(TensorOut(mdt, (keep,), W.slice_segments(flat["fp32"], rank * P, keep)))
                if self.has_state:
                    state[gi] = OrderedDict([
                        ("step", _step_out(g.step)),
                        ("exp_avg", TensorOut(sdt, (P,), W.slice_segments(flat["exp_avg"], rank * P, P))),
                        ("exp_avg_sq", TensorOut(sdt, (P,), W.slice_segments(flat["exp_avg_sq"], rank * P, P))),
                    ])
                pgroups.append(_group_params(g.hyper, [gi], self.conv))
                gpads.append(pad)
                maps.append(OrderedDict((g.records[i].name, W.fragment_address(n, s))
                                        for i, n, s in lay.slice_map(rank)))
            base = {"state": state, "param_groups": pgroups}
            osd = OrderedDict()
            if self.flavour == "zero":
                osd.update(self.loss_scaler_state())
            osd["clip_grad"] = self.clip_grad()
            osd["base_optimizer_state"] = _elastic_base(state, gpads) if self.elastic else base
            if self.elastic and "base_optimizer_state_step" in self.osd0:
                osd["base_optimizer_state_step"] = self.conv(self.osd0["base_optimizer_state_step"])
            osd["single_partition_of_fp32_groups"] = fp32_parts
            if self.flavour == "zero":
                osd["zero_stage"] = W.zero_stage_enum(self.stage)
            osd["group_paddings"] = gpads
            if self.flavour == "zero":
                osd["param_alignment_paddings"] = [list(lay.param_paddings) for lay in layouts]
            osd["partition_count"] = [ws] * len(self.groups)
            osd["ds_version"] = self.version
            osd["param_slice_mappings"] = maps
            files.append(self.torch_file(self.optim_name(rank), self.optim_file(rank, osd)))

        module = self.module_stage12()
        param_shapes = [OrderedDict((r.name, W.torch_size(r.shape)) for r in g.records) for g in self.groups]
        frozen_shapes = frozen_frags = None
        if self.stage == 2:
            frozen = self.frozen_records()
            if frozen or self.ms0.get("frozen_param_shapes") is not None:
                frozen_shapes = OrderedDict((r.name, W.torch_size(r.shape)) for r in frozen)
                frozen_frags = OrderedDict((r.name, module[r.name] if r.name in module else
                                            TensorOut(r.dtype, r.shape, list(r.value))) for r in frozen)
        ms = self.model_file(0, module, param_shapes, frozen_shapes, frozen_frags)
        files.insert(0, self.torch_file(self.model_name(0), ms))
        return files

    # ---- ZeRO-3
    def plan_stage3(self) -> list[OutFile]:
        ws, files = self.ws, []
        sgs = self.cfg.get("zero_optimization", {}).get("sub_group_size", W.DEFAULT_SUB_GROUP_SIZE)
        sgs = int(float(sgs)) if sgs is not None else None
        subs: list[tuple[_Group, list[TensorRecord]]] = []
        ids_of_group: dict[int, list[int]] = {}
        for g in self.groups:
            for idx in W.zero3_sub_groups([r.numel for r in g.records], ws, sgs):
                ids_of_group.setdefault(g.index, []).append(len(subs))
                subs.append((g, [g.records[i] for i in idx]))
        for s, (g, recs) in enumerate(subs):
            self.partitions.append({"sub_group": s, "group": g.index, "params": len(recs),
                                    "partition": sum(W.zero3_part(r.numel, ws) for r in recs)})
        frozen = self.frozen_records()
        module = self.module_stage3()
        param_shapes = [OrderedDict((r.name, W.torch_size(r.shape)) for r in recs) for _, recs in subs]
        sub_dtypes = [self.flat_dtypes(recs, f"ZeRO-3 sub-group {s}") for s, (_, recs) in enumerate(subs)]
        for rank in self.ranks:
            flat, state = [], OrderedDict()
            for s, (g, recs) in enumerate(subs):
                numel = sum(W.zero3_part(r.numel, ws) for r in recs)

                def part(attr, recs=recs, s=s):
                    dtype = sub_dtypes[s][0 if attr == "value" else 1]
                    segs = []
                    for r in recs:
                        segs += W.zero3_rank_slice(list(getattr(r, attr)), r.numel, ws, rank, dtype)
                    return TensorOut(dtype, (numel,), segs)

                flat.append(part("value"))
                if self.has_state:
                    state[s] = OrderedDict([("step", _step_out(g.step)), ("exp_avg", part("exp_avg")),
                                            ("exp_avg_sq", part("exp_avg_sq"))])
            pgroups = [_group_params(g.hyper, ids_of_group.get(g.index, []), self.conv) for g in self.groups]
            osd = OrderedDict([("zero_stage", W.zero_stage_enum(3))])
            osd.update(self.loss_scaler_state())
            osd["partition_count"] = ws
            osd["optimizer_state_dict"] = {"state": state, "param_groups": pgroups}
            osd["fp32_flat_groups"] = flat
            files.append(self.torch_file(self.optim_name(rank), self.optim_file(rank, osd)))

            frozen_shapes = frozen_frags = None
            if frozen or self.ms0.get("frozen_param_shapes") is not None:
                frozen_shapes = OrderedDict((r.name, W.torch_size(r.shape)) for r in frozen)
                frozen_frags = OrderedDict(
                    (r.name, TensorOut(r.dtype, (W.zero3_part(r.numel, ws),),
                                       W.zero3_rank_slice(list(r.value), r.numel, ws, rank, r.dtype)))
                    for r in frozen)
            ms = self.model_file(rank, module, param_shapes, frozen_shapes, frozen_frags)
            files.insert(rank, self.torch_file(self.model_name(rank), ms))
        return files

    def torch_file(self, name: str, obj, folder: str | None = None) -> OutFile:
        from zckpt.engine.torchzip import dumps
        if not self.count_bytes:  # plan_ranks: the files are not written, sizing them would pickle them twice
            return OutFile(os.path.join(folder or self.tag, name), obj=obj)
        _, tensors = dumps(obj)
        return OutFile(os.path.join(folder or self.tag, name), obj=obj, nbytes=sum(t.nbytes for t in tensors))


def _check_target(ckpt: Checkpoint, world_size, stage, bf16_optimizer) -> tuple[int, int, str]:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise InvalidArgument(f"--world-size must be a positive integer, got {world_size!r}")
    if ckpt.reshard_refusal:  # pipeline / MoE layouts (zckpt.deepspeed.pipeline, .moe): merge yes, reshard no
        raise UnsupportedLayout(ckpt.reshard_refusal, path=ckpt.location.tag_dir,
                                hint="zckpt merge / info / verify read this layout")
    stage = ckpt.stage if stage is None else stage
    if is_elastic(ckpt) and (stage == 3 or bf16_optimizer):
        raise UnsupportedLayout("an elastic checkpoint (elastic_checkpoint=true) saves no optimizer "
                                "hyperparameters, which a ZeRO-3 or BF16-optimizer file needs",
                                path=ckpt.location.tag_dir, hint="reshard it at ZeRO-1 or ZeRO-2")
    if stage not in (1, 2, 3):
        raise InvalidArgument(f"--stage must be 1, 2 or 3, got {stage!r}")
    if ckpt.offload:
        log.info("source used optimizer offload; the partitions are the same, offload is a config choice")
    if bf16_optimizer is None:
        bf16_optimizer = ckpt.flavour == "bf16_optimizer" and stage == 1
    if bf16_optimizer and (stage != 1 or ckpt.precision != "bf16"):
        raise InvalidArgument("the BF16 optimizer needs --stage 1 and a bf16 checkpoint",
                              hint="drop --bf16-optimizer, or use --stage 1 on a bf16 checkpoint")
    zcfg = ckpt.ds_config.get("zero_optimization") or {}
    if isinstance(zcfg, dict) and zcfg.get("round_robin_gradients"):
        raise UnsupportedLayout("round_robin_gradients reorders the flat groups per world size; not supported",
                                path=ckpt.location.tag_dir)
    return world_size, stage, _flavour_of(stage, bf16_optimizer)


def plan_reshard(ckpt: Checkpoint, world_size: int, stage: int | None = None, bf16_optimizer: bool | None = None,
                 fmt: str = "deepspeed") -> ReshardPlan:
    """Plan the files of ``ckpt`` re-partitioned for ``world_size`` ranks at ``stage`` (default: unchanged)."""
    if fmt not in FORMATS:
        raise InvalidArgument(f"unknown --format {fmt!r}", hint="use deepspeed or universal")
    world_size, stage, flavour = _check_target(ckpt, world_size, stage, bf16_optimizer)
    if fmt == "universal" and is_elastic(ckpt):
        raise UnsupportedLayout("an elastic checkpoint saves no optimizer hyperparameters, which the universal "
                                "layout's optimizer_state.pt needs", path=ckpt.location.tag_dir,
                                hint="reshard it in the DeepSpeed layout: an elastic engine loads it at any size")
    planner = _Planner(ckpt, world_size, stage, flavour)
    files = planner.plan_stage3() if stage == 3 else planner.plan_stage12()
    if fmt == "universal":
        from zckpt.ops import universal
        files, _ = universal.plan_universal(ckpt, planner, files)
    files += _side_files(ckpt, world_size)
    plan = ReshardPlan(ckpt.location.input_path, output_tag(ckpt), fmt, ckpt.stage, ckpt.flavour, ckpt.world_size, stage,
                       flavour, world_size, ckpt.precision, files, planner.notes, planner.partitions)
    if not planner.has_state:
        plan.notes.append("the source has no Adam state yet (saved before the first step); none is written")
    return plan


def plan_ranks(ckpt: Checkpoint, world_size: int, ranks, stage: int | None = None,
               bf16_optimizer: bool | None = None, zero: dict | None = None) -> ReshardPlan:
    """Like :func:`plan_reshard` (DeepSpeed layout), but only the model- and optimizer-states files of ``ranks``
    (no side files): what one rank of a job resuming at ``world_size`` loads (:mod:`zckpt.ops.resume`).
    ``zero``: ``zero_optimization`` values of the target engine that shape the layout (``sub_group_size``,
    ``parameter_alignment``), applied where they differ from the source config's."""
    world_size, stage, flavour = _check_target(ckpt, world_size, stage, bf16_optimizer)
    planner = _Planner(ckpt, world_size, stage, flavour)
    planner.ranks = [int(r) for r in ranks]
    planner.count_bytes = False
    zcfg = planner.cfg.setdefault("zero_optimization", {})
    defaults = {"sub_group_size": W.DEFAULT_SUB_GROUP_SIZE, "parameter_alignment": False}
    for key, value in (zero or {}).items():
        if value is not None and zcfg.get(key, defaults.get(key)) != value:
            zcfg[key] = value
    files = planner.plan_stage3() if stage == 3 else planner.plan_stage12()
    return ReshardPlan(ckpt.location.input_path, output_tag(ckpt), "deepspeed", ckpt.stage, ckpt.flavour, ckpt.world_size,
                       stage, flavour, world_size, ckpt.precision, files, planner.notes, planner.partitions)


# ---------------------------------------------------------------------------------------------- side files

def _rng_name(rank: int, world_size: int) -> str:
    return "rng_state.pth" if world_size == 1 else f"rng_state_{rank}.pth"


def _side_files(ckpt: Checkpoint, world_size: int) -> list[OutFile]:
    """Recovery scripts, and a Trainer checkpoint's own files (config, trainer_state.json, RNG states...)."""
    loc = ckpt.location
    out: list[OutFile] = []
    seen = set()
    save_names = set(storage.listdir(loc.save_dir)) if loc.save_dir else set()
    for name in SCRIPTS:
        if name in save_names:
            p = storage.join(loc.save_dir, name)
            out.append(OutFile(name, src=p, nbytes=storage.size(p)))
            seen.add(name)
    if not loc.trainer_dir:
        return out
    names = storage.listdir(loc.trainer_dir)
    rng_src = {}
    for name in names:
        path = storage.join(loc.trainer_dir, name)
        if name in seen or name in ("latest", publish.MARKER) or name == loc.tag or not storage.isfile(path):
            continue
        if name == "rng_state.pth":
            rng_src[0] = path
            continue
        if name.startswith("rng_state_") and name.endswith(".pth") and name[10:-4].isdigit():
            rng_src[int(name[10:-4])] = path
            continue
        out.append(OutFile(name, src=path, nbytes=storage.size(path)))
    for rank in range(world_size):  # ranks beyond the source's get no RNG file: the Trainer warns and goes on
        if rank in rng_src:
            out.append(OutFile(_rng_name(rank, world_size), src=rng_src[rank], nbytes=storage.size(rng_src[rank])))
    return out


# ---------------------------------------------------------------------------------------------- execute

def _check_out(out: str, overwrite: bool, source: publish.Source | None) -> None:
    if storage.is_url(out):
        raise InvalidArgument("reshard writes to a local folder", path=out,
                              hint="reshard locally, then `zckpt push` the result")
    publish.check_output(out, "reshard", source, overwrite)


def _copy_file(src: str, dst: str) -> int:
    if storage.is_url(src):
        data = storage.read_bytes(src)
        with open(dst, "wb") as f:
            f.write(data)
        return len(data)
    shutil.copyfile(src, dst)
    return os.path.getsize(dst)


def execute(plan: ReshardPlan, out: str, workers: int | None = None, overwrite: bool = False,
            progress: Callable[[int, int], None] | None = None, latest_name: str = "latest",
            durable: bool = False, source: publish.Source | None = None) -> None:
    """Write ``plan`` into the folder ``out`` atomically (:mod:`zckpt.io.publish`: temp sibling, ``latest`` and the
    ``.zckpt.json`` marker last, rename); ``overwrite`` replaces only a previous zckpt reshard output.

    As with merge, the folder appears whole or not at all whenever the process dies; ``durable=True`` also
    fsyncs every file (flushing each while the next is written) before ``latest`` and the rename."""
    from zckpt.engine import torchzip
    _check_out(out, overwrite, source)
    workers = workers or min(8, os.cpu_count() or 2)
    total, done = plan.total_bytes, [0]

    def step(n):
        done[0] += n
        if progress:
            progress(done[0], total)

    worker, maps = executor.Worker(), torchzip.SourceMaps()
    try:
        with publish.Publisher(out, "reshard", source.root if source else plan.source, durable) as pub:
            written = []
            with ThreadPoolExecutor(workers) as pool, ThreadPoolExecutor(1) as syncer:
                for f in plan.files:
                    executor.test_delay()
                    dst = pub.path(f.relpath)
                    if f.obj is not None:
                        torchzip.save(f.obj, dst, pool=pool, progress=step, worker=worker, maps=maps)
                    elif f.src is not None:
                        step(_copy_file(f.src, dst))
                    else:
                        with open(dst, "wb") as fh:
                            fh.write(f.data)
                        step(len(f.data))
                    pub.done(f.relpath)
                    if durable:  # flushes while the next file is written
                        written.append(syncer.submit(torchzip.fsync_all, [dst]))
                for fut in written:  # everything on disk before `latest` and the rename
                    fut.result()
            # DeepSpeed writes the bare tag, no newline
            pub.write_bytes(latest_name, (plan.tag if plan.fmt == "deepspeed" else f"{plan.tag}_universal").encode())
            pub.commit()
    finally:
        worker.close()
        maps.close()


def default_output(source: publish.Source, world_size: int, stage: int | None, fmt: str) -> str:
    """Next to the checkpoint, never inside it, never named like a checkpoint:
    ``outputs/checkpoint-4`` -> ``outputs/resharded-checkpoint-4-ws<M>[-z<S>][-universal]``."""
    suffix = f"-ws{world_size}" + (f"-z{stage}" if stage else "") + ("-universal" if fmt == "universal" else "")
    return publish.default_output(source, "resharded") + suffix


def reshard(path: str, out: str | None = None, world_size: int | None = None, stage: int | None = None,
            fmt: str = "deepspeed", tag: str | None = None, dry_run: bool = False, overwrite: bool = False,
            workers: int | None = None, progress: Callable[[int, int], None] | None = None,
            bf16_optimizer: bool | None = None, durable: bool = False) -> ReshardResult:
    """Re-partition the checkpoint at ``path`` for ``world_size`` ranks (and ``stage``) into the folder ``out``.

    ``fmt="deepspeed"``: DeepSpeed's native layout, loadable with a plain ``engine.load_checkpoint(out)`` at the
    new size. ``fmt="universal"``: DeepSpeed's universal layout (``"checkpoint": {"load_universal": true}``).
    ``bf16_optimizer``: target the BF16 optimizer (stage 1, bf16, ``grad_accum_dtype: fp32``); default keeps the
    source's choice when the stage stays 1. ``progress(done_bytes, total_bytes)`` is called as data is written;
    ``durable=True`` fsyncs everything before publishing (survives a power failure, waits for the disk).
    Default ``out``: next to the checkpoint, ``outputs/checkpoint-4`` -> ``outputs/resharded-checkpoint-4-ws<M>``
    (``-z<S>``, ``-universal`` appended when given). ``overwrite`` replaces only a previous zckpt reshard output.
    """
    t0 = time.perf_counter()
    if world_size is None:
        raise InvalidArgument("a target world size is required", hint="pass --world-size M")
    ckpt = open_checkpoint(path, tag)
    source = publish.source_of(ckpt.location, picked_tag=tag is not None)
    out = str(out) if out is not None else default_output(source, world_size, stage, fmt)
    _check_out(out, overwrite, source)  # before planning or writing anything
    plan = plan_reshard(ckpt, world_size, stage, bf16_optimizer, fmt)
    result = ReshardResult(out, plan, dry_run=dry_run)
    if dry_run:
        return result
    execute(plan, out, workers, overwrite, progress,
            latest_name="latest" if fmt == "deepspeed" else "latest_universal", durable=durable, source=source)
    result.seconds = time.perf_counter() - t0
    return result
